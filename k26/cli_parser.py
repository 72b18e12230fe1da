"""`python -m k26`'s argument parser: every subcommand's arguments (the commands themselves, and the checks
run before anything loads: `__main__.py`; the server's: `server/cli.py`)."""

from __future__ import annotations

import argparse

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # --dtype's names -> torch dtypes
ALLREDUCE = ["fused", "calibrate", "nccl"]  # --allreduce (LLM(allreduce=...)); not given: fused


def _positive(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


DEFAULT_MAX_TOKENS = 64  # generate's --max-tokens when not given (then cut to the room the context leaves)
MAX_BUDGET = 255  # k26.spec.step.MAX_BUDGET (this module stays free of torch: `--help` is instant)
# generate and serve refuse a drafter that would go unused, in the same words
AR_WITH_DRAFTER = (
    "--drafter with --spec ar: autoregressive decoding uses no drafter; drop --drafter or pick "
    "--spec dflash|ddtree"
)


def _budget(s: str) -> int | str:
    """`--budget` of generate / serve: 'auto', or an integer (its range is checked with the other arguments,
    before loading, so the message names the value)."""
    if s == "auto":
        return s
    try:
        return int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {s!r}") from None


def _fixed_budget(s: str) -> int:
    """`--budget` of bench / profile: a DDTree budget in [1, MAX_BUDGET]."""
    v = _positive(s)
    if v > MAX_BUDGET:
        raise argparse.ArgumentTypeError(f"expected a DDTree budget in [1, {MAX_BUDGET}], got {v}")
    return v


def _info_parser(sub) -> None:
    i = sub.add_parser("info", help="print the parsed model config")
    i.add_argument("--model", help="checkpoint directory (default: the embedded tiny model)")
    i.add_argument(
        "--startup", action="store_true", help="also start it (graphs captured) and report the cost"
    )
    i.add_argument(
        "--drafter", help="with --startup: a drafter directory (default with no --model: embedded)"
    )
    i.add_argument("--device", choices=["cpu", "cuda"], default=None, help="with --startup: where it starts")
    i.add_argument("--cache-dir", default=None, help="with --startup: the load cache (LLM(cache_dir=...))")


def _serve_parser(sub) -> None:
    """`python -m k26 serve`'s arguments (checked by k26.server.cli.check_args before loading)."""
    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching")
    sv.add_argument("--model", help="checkpoint directory (default: the embedded pair)")
    sv.add_argument("--drafter", help="DFlash drafter directory (ddtree unless --spec says otherwise)")
    sv.add_argument(
        "--spec",
        choices=["ar", "dflash", "ddtree"],
        default=None,
        help="decoding method (default: ddtree when there is a drafter, else ar)",
    )
    sv.add_argument(
        "--budget", type=_budget, default=None, help="DDTree nodes besides the root: N or auto (default)"
    )
    sv.add_argument("--tp", type=_positive, default=None, help="tensor-parallel ranks")
    sv.add_argument(
        "--max-request-mb", type=float, default=64.0, help="largest request body in MiB (larger: 413)"
    )
    sv.add_argument("--device", choices=["cpu", "cuda"], default=None)
    sv.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--max-batch", type=_positive, default=8, help="rows decoded together")
    sv.add_argument(
        "--max-waiting",
        type=_positive,
        default=64,
        help="queued rows (one per prompt and choice); beyond: 429, a request of more rows: 400",
    )
    sv.add_argument("--max-model-len", type=_positive, default=None)
    sv.add_argument(
        "--served-model-name",
        default=None,
        help="model id clients send (default: the model directory's name; k26-embedded without --model)",
    )
    sv.add_argument("--compile", action="store_true", help="torch.compile the decoder layers (CUDA graphs)")
    sv.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY (or env K26_API_KEY)")
    sv.add_argument("--no-logprobs", action="store_true", help="no logprobs graphs; logprobs requests: 400")
    sv.add_argument("--cache-dir", default=None, help="load cache: sliced, repacked weights, compile cache")
    sv.add_argument("--no-prefix-cache", action="store_true", help="prefill every prompt whole (no reuse)")
    sv.add_argument(
        "--prefill-chunk", type=_positive, default=256, help="prefill positions a row and forward"
    )
    sv.add_argument("--prefill-budget", type=_positive, default=512, help="deferred prefill positions a step")
    sv.add_argument(
        "--allreduce",
        choices=ALLREDUCE,
        default=None,
        help="TP all-reduces: fused with add + RMSNorm (default), fused with measured crossovers, or NCCL",
    )


def build_parser(commands: dict | None = None) -> argparse.ArgumentParser:
    """The parser; `commands`, when given, receives each subcommand's own parser by name."""
    from . import __version__

    ap = argparse.ArgumentParser(
        prog="k26", description="Kimi K2.6 inference with DDTree speculative decoding"
    )
    ap.add_argument("--version", action="version", version=f"k26 {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="command")
    g = sub.add_parser("generate", help="continue a prompt, streaming the text as it is accepted")
    g.add_argument("--model", help="checkpoint directory (default: the embedded tiny model and its drafter)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the Kimi chat format")
    g.add_argument(
        "--no-thinking", action="store_true", help="with --chat on K2.5 / K2.6: answer without a think block"
    )
    g.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help=f"tokens to generate at most (default {DEFAULT_MAX_TOKENS}, or the room the context leaves)",
    )
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--ignore-eos", action="store_true", help="generate --max-tokens tokens: no end id stops")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--device", choices=["cpu", "cuda"], default=None)
    g.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    g.add_argument("--max-model-len", type=_positive, default=None)
    g.add_argument(
        "--drafter", help="DFlash drafter directory (decodes with --spec ddtree unless told otherwise)"
    )
    g.add_argument(
        "--spec",
        choices=["ar", "dflash", "ddtree"],
        default=None,
        help="decoding method (default: ddtree when there is a drafter, as with the embedded pair, else ar)",
    )
    g.add_argument(
        "--budget", type=_budget, default=None, help="DDTree nodes besides the root: N or auto (default)"
    )
    g.add_argument(
        "--tp",
        type=_positive,
        default=None,
        help="tensor-parallel ranks (default: torchrun's WORLD_SIZE, else 1)",
    )
    g.add_argument("--cache-dir", default=None, help="load cache: a later start reads only its own bytes")
    g.add_argument(
        "--allreduce", choices=ALLREDUCE, default=None, help="TP all-reduces (default fused; --tp > 1)"
    )
    _info_parser(sub)
    bn = sub.add_parser("bench", help="tokens/s of AR eager / AR graphs / DFlash / DDTree / HF generate()")
    bn.add_argument("--model", help="checkpoint directory (default: the embedded pair)")
    bn.add_argument("--drafter", help="DFlash drafter directory (default with no --model: the embedded one)")
    bn.add_argument("--device", choices=["cpu", "cuda"], default=None)
    bn.add_argument("--batch", type=_positive, default=1, help="prompts decoded together (default 1)")
    bn.add_argument("--max-tokens", type=_positive, default=128, help="tokens a prompt (default 128)")
    bn.add_argument("--budget", type=_fixed_budget, default=12, help="DDTree budget (default 12)")
    bn.add_argument("--compile", action="store_true", help="torch.compile the decoder layers")
    bn.add_argument("--no-hf", action="store_true", help="leave out the transformers generate() row")
    bn.add_argument("--out", help="also write the table to this Markdown file")
    pr = sub.add_parser("profile", help="write a torch.profiler trace of a short generation")
    pr.add_argument("--model", help="checkpoint directory (default: the embedded pair)")
    pr.add_argument("--drafter", help="DFlash drafter directory (for --spec dflash / ddtree)")
    pr.add_argument("--device", choices=["cpu", "cuda"], default=None)
    pr.add_argument(
        "--spec", choices=["ar", "dflash", "ddtree"], default="ar", help="decoding method (default ar)"
    )
    pr.add_argument("--budget", type=_fixed_budget, default=None, help="DDTree budget (default 12)")
    pr.add_argument("--max-tokens", type=_positive, default=32, help="tokens to generate (default 32)")
    pr.add_argument("--out", default="k26-trace.json", help="the trace file (default k26-trace.json)")
    _serve_parser(sub)
    if commands is not None:  # (parse_args: an unknown flag is said with its command's usage)
        commands.update(sub.choices)
    return ap


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """`python -m k26`'s arguments; an unrecognised one exits 2 with its subcommand's usage (the top-level
    parser printed `k26 [-h] [--version] command ...`, no help for `generate --bogus`)."""
    commands: dict[str, argparse.ArgumentParser] = {}
    a, extra = build_parser(commands).parse_known_args(argv)
    if extra:
        commands[a.cmd].error(f"unrecognized arguments: {' '.join(extra)}")
    return a
