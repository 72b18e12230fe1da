"""Command line: `python -m k26 generate|info ...`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


from .embedded import default_drafter_dir, default_model_dir  # noqa: E402


def cmd_generate(a: argparse.Namespace) -> int:
    import torch

    from . import LLM, SamplingParams

    from . import SpecConfig

    if not a.model and not a.drafter:  # the embedded pair: the default model comes with its drafter
        a.drafter = default_drafter_dir()
        if a.spec is None and a.drafter:
            a.spec = "ddtree"
    a.spec = a.spec or "ar"
    if a.spec != "ar" and not a.drafter:
        raise ValueError(f"--spec {a.spec} needs --drafter DIR")
    world = int(os.environ.get("WORLD_SIZE", 1))  # torchrun --nproc-per-node N: one rank per process
    tp = a.tp or world
    if world > 1 and tp != world:
        raise ValueError(f"--tp {tp} differs from torchrun's WORLD_SIZE {world}")
    llm = LLM(a.model or default_model_dir(), drafter=a.drafter, device=a.device,
              dtype=getattr(torch, DTYPES[a.dtype]), max_model_len=a.max_model_len, tp=tp,
              progress=int(os.environ.get("RANK", 0)) == 0)
    spec = SpecConfig(method=a.spec, budget=a.budget if a.budget is not None else "auto")
    prompt = llm.tokenizer.chat([{"role": "user", "content": a.prompt}]) if a.chat else a.prompt
    sp = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, max_tokens=a.max_tokens, seed=a.seed)
    out = llm.generate(prompt, sp, spec)[0]
    llm.close()
    if int(os.environ.get("RANK", 0)) != 0:
        return 0
    print(out.text)
    extra = ""
    if a.spec != "ar":
        st = out.stats
        extra = (f", {len(st.accepted_per_step)} verify steps, tau={st.tau:.2f}, "
                 f"draft {st.draft_s * 1e3:.1f} ms, verify {st.verify_s * 1e3:.1f} ms")
    print(f"[k26] {len(out.token_ids)} tokens, finish_reason={out.finish_reason}{extra}", file=sys.stderr)
    return 0


def cmd_info(a: argparse.Namespace) -> int:
    from .config import ModelConfig
    from .kv_cache import LatentCache

    cfg = ModelConfig.from_dir(a.model or default_model_dir())
    for k, v in vars(cfg).items():
        print(f"{k:28s} {v}")
    print(f"{'softmax_scale':28s} {cfg.softmax_scale:.7f}")
    print(f"{'kv bytes/token (bf16)':28s} {LatentCache.bytes_per_token(cfg)}")
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    from .bench import run_bench

    text = run_bench(a)
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    return 0


def cmd_profile(a: argparse.Namespace) -> int:
    from .bench import run_profile

    print(run_profile(a))
    print(f"[k26] torch.profiler trace written to {a.out}", file=sys.stderr)
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    from .server.cli import serve

    return serve(a)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="k26", description="Kimi K2.6 inference")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text from a prompt")
    g.add_argument("--model", help="checkpoint directory (default: the embedded tiny model)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the Kimi chat format")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--device", choices=["cpu", "cuda"], default=None)
    g.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--drafter", help="DFlash drafter directory (enables --spec dflash|ddtree)")
    g.add_argument("--spec", choices=["ar", "dflash", "ddtree"], default=None,
                   help="decoding method (default: ddtree with the embedded pair, else ar)")
    g.add_argument("--budget", type=int, default=None, help="DDTree nodes besides the root")
    g.add_argument("--tp", type=int, default=None, help="tensor-parallel ranks (default: torchrun's WORLD_SIZE, else 1)")
    g.set_defaults(fn=cmd_generate)
    i = sub.add_parser("info", help="print the parsed model config")
    i.add_argument("--model")
    i.set_defaults(fn=cmd_info)
    bn = sub.add_parser("bench", help="tokens/s of AR eager / AR graphs / DFlash / DDTree / HF generate()")
    bn.add_argument("--model")
    bn.add_argument("--drafter")
    bn.add_argument("--device", choices=["cpu", "cuda"], default=None)
    bn.add_argument("--batch", type=int, default=1)
    bn.add_argument("--max-tokens", type=int, default=128)
    bn.add_argument("--budget", type=int, default=12)
    bn.add_argument("--compile", action="store_true")
    bn.add_argument("--no-hf", action="store_true")
    bn.add_argument("--out")
    bn.set_defaults(fn=cmd_bench)
    pr = sub.add_parser("profile", help="write a torch.profiler trace of a short generation")
    pr.add_argument("--model")
    pr.add_argument("--drafter")
    pr.add_argument("--device", choices=["cpu", "cuda"], default=None)
    pr.add_argument("--spec", choices=["ar", "dflash", "ddtree"], default="ar")
    pr.add_argument("--budget", type=int, default=12)
    pr.add_argument("--max-tokens", type=int, default=32)
    pr.add_argument("--out", default="k26-trace.json")
    pr.set_defaults(fn=cmd_profile)
    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching")
    sv.add_argument("--model", help="checkpoint directory (default: the embedded pair)")
    sv.add_argument("--drafter", help="DFlash drafter directory")
    sv.add_argument("--spec", choices=["ar", "dflash", "ddtree"], default=None,
                    help="decoding method (default: ddtree with a drafter, else ar)")
    sv.add_argument("--budget", default=None, help="DDTree nodes besides the root: N or auto (default)")
    sv.add_argument("--tp", type=int, default=None, help="tensor-parallel ranks (1 for now)")
    sv.add_argument("--device", choices=["cpu", "cuda"], default=None)
    sv.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--max-batch", type=int, default=8, help="rows decoded together")
    sv.add_argument("--max-waiting", type=int, default=64, help="queued requests beyond which 429 answers")
    sv.add_argument("--max-model-len", type=int, default=None)
    sv.add_argument("--served-model-name", default=None, help="the model id clients send (default: dir name)")
    sv.set_defaults(fn=cmd_serve)
    a = ap.parse_args(argv)
    try:
        return a.fn(a)
    except (ValueError, TypeError) as e:
        print(f"k26: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
