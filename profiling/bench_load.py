"""Start-up at K2.6 width: write a full-width K2.6-layout checkpoint of a few layers, drop the page cache,
measure the disk (dd of one shard), then load + repack as TP ranks, alone (one rank at a time, its own bytes)
and coordinated (all ranks at once on gloo, each shard read by one rank), and extrapolate to 61 layers on
8 ranks (modelled, labelled so).

    python profiling/bench_load.py --out /tmp/k26_ckpt --layers 2 --tp 8 --alone-ranks 0 [--coordinated]
    python profiling/bench_load.py --repack-only      # the repack's speed alone (TP8 shapes, 384 experts)

Layers: layer 0 dense, the rest MoE (384 int4 experts, real dims); `language_model.` nesting; random weights
(int4 words are random bits: every pattern is a valid code). Writes bench_load.md and .json to --results.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k26.load_cache import write_safetensors
from k26.loader import load_model
from k26.model import TPInfo
from k26.ops.moe_cuda import repack_experts
from k26.shard_reader import io_read_bytes
from k26.tiny import text_config

K26 = dict(  # noqa: C408 (the config's own names)
    hidden_size=7168,
    num_hidden_layers=61,
    first_k_dense_replace=1,
    num_attention_heads=64,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    n_routed_experts=384,
    num_experts_per_tok=8,
    n_group=1,
    topk_group=1,
    n_shared_experts=1,
    max_position_embeddings=262144,
    original_max_position_embeddings=4096,
)
FIRST_SPECIAL = 163584  # vocab 163840
K26_BYTES = 594e9  # the released checkpoint


def tensor_specs(s: dict) -> list[tuple[str, str, tuple[int, ...]]]:
    """(HF name, kind, shape) of every text tensor, in layer order; kind: bf16, f32, words, scale, shape."""
    D, H, V = s["hidden_size"], s["num_attention_heads"], FIRST_SPECIAL + 256
    qk = s["qk_nope_head_dim"] + s["qk_rope_head_dim"]
    out = [("model.embed_tokens.weight", "bf16", (V, D))]
    for i in range(s["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", "bf16", (D,)),
            (p + "post_attention_layernorm.weight", "bf16", (D,)),
            (p + "self_attn.q_a_proj.weight", "bf16", (s["q_lora_rank"], D)),
            (p + "self_attn.q_a_layernorm.weight", "bf16", (s["q_lora_rank"],)),
            (p + "self_attn.q_b_proj.weight", "bf16", (H * qk, s["q_lora_rank"])),
            (
                p + "self_attn.kv_a_proj_with_mqa.weight",
                "bf16",
                (s["kv_lora_rank"] + s["qk_rope_head_dim"], D),
            ),
            (p + "self_attn.kv_a_layernorm.weight", "bf16", (s["kv_lora_rank"],)),
            (
                p + "self_attn.kv_b_proj.weight",
                "bf16",
                (H * (s["qk_nope_head_dim"] + s["v_head_dim"]), s["kv_lora_rank"]),
            ),
            (p + "self_attn.o_proj.weight", "bf16", (D, H * s["v_head_dim"])),
        ]
        if i < s["first_k_dense_replace"]:
            F = s["intermediate_size"]
            out += [
                (p + f"mlp.{n}.weight", "bf16", sh)
                for n, sh in (("gate_proj", (F, D)), ("up_proj", (F, D)), ("down_proj", (D, F)))
            ]
            continue
        F, E = s["moe_intermediate_size"], s["n_routed_experts"]
        out += [
            (p + "mlp.gate.weight", "bf16", (E, D)),
            (p + "mlp.gate.e_score_correction_bias", "f32", (E,)),
        ]
        out += [
            (p + f"mlp.shared_experts.{n}.weight", "bf16", sh)
            for n, sh in (("gate_proj", (F, D)), ("up_proj", (F, D)), ("down_proj", (D, F)))
        ]
        for e in range(E):
            for proj, (o, n) in (("gate_proj", (F, D)), ("up_proj", (F, D)), ("down_proj", (D, F))):
                q = f"{p}mlp.experts.{e}.{proj}."
                out += [
                    (q + "weight_packed", "words", (o, n // 8)),
                    (q + "weight_scale", "scale", (o, n // 32)),
                    (q + "weight_shape", "shape", (o, n)),
                ]
    return out + [("model.norm.weight", "bf16", (D,)), ("lm_head.weight", "bf16", (V, D))]


def sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def make(kind: str, shape: tuple[int, ...], dev: str) -> torch.Tensor:
    if kind == "words":
        return torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32, device=dev)
    if kind == "scale":
        return (torch.rand(shape, device=dev) * 0.01 + 1e-3).to(torch.bfloat16)
    if kind == "shape":
        return torch.tensor(shape, dtype=torch.int32)
    if kind == "f32":
        return 0.05 * torch.randn(shape, device=dev)
    return (0.02 * torch.randn(shape, device=dev)).to(torch.bfloat16)


def write_checkpoint(out: Path, layers: int, shard_gb: float, dev: str, experts: int) -> tuple[int, float]:
    s = K26 | {"num_hidden_layers": layers, "n_routed_experts": experts}
    text = text_config(s | {"base_vocab": 0}, FIRST_SPECIAL, "int4")
    cfg = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "bos_token_id": FIRST_SPECIAL,
        "eos_token_id": FIRST_SPECIAL + 1,
        "tie_word_embeddings": False,
        "text_config": text,
        "quantization_config": text["quantization_config"],
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    specs = tensor_specs(s)
    groups, cur, size = [], [], 0
    for spec in specs:
        nb = torch.Size(spec[2]).numel() * (2 if spec[1] in ("bf16", "scale") else 4)
        if cur and size + nb > shard_gb * 1e9:
            groups.append(cur)
            cur, size = [], 0
        cur.append(spec)
        size += nb
    groups.append(cur)
    t0, total, wmap = time.perf_counter(), 0, {}
    for i, g in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        named = [("language_model." + n, make(k, sh, dev).cpu()) for n, k, sh in g]
        total += write_safetensors(out / fname, named)
        wmap |= {n: fname for n, _ in named}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    return total, time.perf_counter() - t0


def drop_cache(files: list[Path]) -> str:
    """Drop the page cache: the whole host's where permitted, else each file's pages (posix_fadvise)."""
    subprocess.run(["sync"], check=False)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError:
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        return "fadvise"


def dd_gbps(f: Path) -> float:
    t0 = time.perf_counter()
    subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=64M"], check=True, capture_output=True)
    return f.stat().st_size / (time.perf_counter() - t0) / 1e9


def repack_time(tp: int, dev: str) -> tuple[float, bool]:
    """One MoE layer's repack at this TP's shard shapes (384 experts), best of 3; GPU == CPU on 4 experts."""
    D, F, E = K26["hidden_size"], K26["moe_intermediate_size"] // tp, K26["n_routed_experts"]
    ex = [
        make("words", (E, F, D // 8), dev),
        make("scale", (E, F, D // 32), dev),
        make("words", (E, F, D // 8), dev),
        make("scale", (E, F, D // 32), dev),
        make("words", (E, D, F // 8), dev),
        make("scale", (E, D, F // 32), dev),
    ]
    small = [t[:4].cpu() for t in ex]
    same = all(
        torch.equal(a.cpu(), b)
        for a, b in zip(repack_experts(*[t[:4] for t in ex]), repack_experts(*small), strict=True)
    )
    best = float("inf")
    for _ in range(3 if dev.startswith("cuda") else 1):
        sync(dev)
        t0 = time.perf_counter()
        repack_experts(*ex)
        sync(dev)
        best = min(best, time.perf_counter() - t0)
    return best, same


def load_rank(path: Path, rank: int, tp: int, dev: str, group=None) -> dict:
    """One rank's load, then its repack timed apart (`Int4Experts.repack_`, what `use_cuda_kernels` runs,
    without building the kernel library, which the load does not need)."""
    from k26.model.moe import Int4Experts

    io0, t0 = io_read_bytes(), time.perf_counter()
    model = load_model(path, device=dev, tp=TPInfo(rank, tp), progress=False, group=group, cuda_kernels=False)
    sync(dev)
    t1 = time.perf_counter()
    for m in model.modules():
        if isinstance(m, Int4Experts):
            m.repack_()
    sync(dev)
    t2, io1 = time.perf_counter(), io_read_bytes()
    st = model.load_stats
    del model
    if dev.startswith("cuda"):
        torch.cuda.empty_cache()
    disk = None if io0 is None or io1 is None else io1 - io0
    return {
        "rank": rank,
        "load_s": t1 - t0,
        "read_s": st.seconds,
        "bytes": st.bytes_read,
        "repack_s": t2 - t1,
        "wall": t2 - t0,
        "disk": disk,
    }


def _coordinated_rank(rank: int, tp: int, path: str, port: int, out: str, dev: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=tp)
    dist.barrier()
    r = load_rank(Path(path), rank, tp, dev, dist.group.WORLD)
    Path(out, f"coord{rank}.json").write_text(json.dumps(r))
    dist.destroy_process_group()


def coordinated(path: Path, tp: int, out: Path, dev: str) -> list[dict]:
    import torch.multiprocessing as mp

    for f in out.glob("coord*.json"):
        f.unlink()
    mp.spawn(_coordinated_rank, args=(tp, str(path), 29650, str(out), dev), nprocs=tp, join=True)
    return [json.loads((out / f"coord{r}.json").read_text()) for r in range(tp)]


def model_rows(a: argparse.Namespace, dd: float, alone: list[dict], rp: float) -> list[tuple[str, str]]:
    """K2.6 (594 GB, 60 MoE layers) on 8 ranks, each byte read once at --nvme GB/s: modelled, not measured."""
    eff = min(1.0, min(r["bytes"] / r["read_s"] / 1e9 / dd for r in alone)) if alone else 1.0
    read = K26_BYTES / (a.nvme * 1e9 * eff)
    rep = 60 * rp
    total = read + rep + a.capture_s
    return [
        (
            f"read 594 GB once across 8 ranks at {a.nvme:.0f} GB/s x measured efficiency {eff:.2f}",
            f"{read:.0f} s",
        ),
        (f"repack, 60 MoE layers per rank (ranks in parallel), measured {rp:.3f} s/layer", f"{rep:.1f} s"),
        ("graph capture (assumed, --capture-s; not measured here)", f"{a.capture_s:.0f} s"),
        ("modelled start-up to first token", f"{total:.0f} s ({total / 60:.1f} min)"),
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/k26_load_ckpt")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--shard-gb", type=float, default=2.0)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--alone-ranks", default="0")
    ap.add_argument("--coordinated", action="store_true")
    ap.add_argument("--nvme", type=float, default=7.0)
    ap.add_argument("--capture-s", type=float, default=60.0)
    ap.add_argument("--results", default=os.environ.get("OUT", "."))
    ap.add_argument("--reuse", action="store_true", help="keep a checkpoint already in --out")
    ap.add_argument("--skip-repack-time", action="store_true")
    ap.add_argument("--repack-only", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--experts", type=int, default=384, help="routed experts per layer (384: full width)")
    a = ap.parse_args()
    out, res = Path(a.out), Path(a.results)
    res.mkdir(parents=True, exist_ok=True)
    rows: list[tuple[str, str]] = []
    rp, same = repack_time(a.tp, a.device) if not a.skip_repack_time else (float("nan"), None)
    rows.append(
        (
            (
                f"repack of one MoE layer on {a.device}, TP{a.tp} shapes (384 experts; best of 3 on GPU); "
                f"equal to the CPU's on 4 experts: {same}"
            ),
            f"{rp * 1e3:.1f} ms",
        )
    )
    print(rows[-1], flush=True)
    if a.repack_only:  # seconds of device time: the repack's speed without the disk
        return
    if a.reuse and (out / "model.safetensors.index.json").is_file():  # a checkpoint this bench wrote before
        files = sorted(out.glob("*.safetensors"))
        size, wt = sum(f.stat().st_size for f in files), float("nan")
    else:
        size, wt = write_checkpoint(out, a.layers, a.shard_gb, a.device, a.experts)
        files = sorted(out.glob("*.safetensors"))
    rows.append(
        (
            f"checkpoint written: {a.layers} layers, {a.experts} experts, {len(files)} shards",
            f"{size / 1e9:.2f} GB in {wt:.1f} s",
        )
    )
    print(rows[-1], flush=True)
    how = drop_cache(files)
    dd = dd_gbps(max(files, key=lambda f: f.stat().st_size))
    rows.append((f"dd of the largest shard, cold ({how})", f"{dd:.2f} GB/s"))
    print(rows[-1], flush=True)
    alone = []
    for r in [int(x) for x in a.alone_ranks.split(",") if x]:
        drop_cache(files)
        x = load_rank(out, r, a.tp, a.device)
        alone.append(x)
        gbps = x["bytes"] / x["read_s"] / 1e9
        disk = "n/a" if x["disk"] is None else f"{x['disk'] / 1e9:.2f} GB"
        rows.append(
            (
                (
                    f"alone, rank {r} of {a.tp}, cold: read {x['bytes'] / 1e9:.2f} GB (disk {disk}) in "
                    f"{x['read_s']:.2f} s, {gbps:.2f} GB/s = {gbps / dd:.0%} of dd; "
                    f"repack {a.layers - 1} MoE layer(s) {x['repack_s']:.2f} s"
                ),
                f"{x['wall']:.1f} s",
            )
        )
        print(rows[-1], flush=True)
    if a.coordinated:
        drop_cache(files)
        t0 = time.perf_counter()
        cs = coordinated(out, a.tp, res, a.device)
        wall = time.perf_counter() - t0
        total = sum(c["bytes"] for c in cs)
        disk = sum(c["disk"] or 0 for c in cs)
        slow = max(c["wall"] for c in cs)
        rows.append(
            (
                (
                    f"coordinated, {a.tp} ranks on gloo, all on {a.device}, cold: bytes read all ranks "
                    f"{total / 1e9:.2f} GB = {total / size:.2f}x checkpoint (disk {disk / 1e9:.2f} GB = "
                    f"{disk / size:.2f}x); slowest rank load {slow:.1f} s"
                ),
                f"{wall:.1f} s incl. spawn",
            )
        )
        print(rows[-1], flush=True)
    rows += [("MODELLED: " + k, v) for k, v in model_rows(a, dd, alone, rp)]
    dev = torch.cuda.get_device_name() if a.device.startswith("cuda") else f"CPU ({os.cpu_count()} cores)"
    lines = [
        f"# bench_load — {time.strftime('%Y-%m-%d')}",
        "",
        f"- device: {dev}; torch {torch.__version__}",
        f"- command: `python profiling/bench_load.py {' '.join(sys.argv[1:])}`",
        "",
        "| what | value |",
        "|---|---|",
    ] + [f"| {k} | {v} |" for k, v in rows]
    text = "\n".join(lines) + "\n"
    (res / "bench_load.md").write_text(text)
    (res / "bench_load.json").write_text(json.dumps({"rows": rows, "alone": alone}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
