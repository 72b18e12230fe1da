"""K2.6 on 8x RTX PRO 6000 (TP 8, PCIe), batch 1 — a per-kernel model [modelled, not measured].

Issue 18, deliverable 5. Inputs are measurements, read from the results files, not typed in here:
- the per-category kernel tables of one compiled, graph-replayed 61-layer step at one TP8 rank's shapes on
  an H200 (`profiling/bench_k26.py --variants fused --table-nodes 1,16 --no-pdl`: without PDL, so that the
  kernels' spans do not overlap; a results file with the sections "### <variant>, L = <ctx>, N = <n>"): per
  category of one MoE layer its launches, µs and bytes;
- the per-message all-reduce latencies of the 8-GPU PCIe model (`2026-12-01-allreduce_pcie8-model.md`,
  itself built from published P2P figures), taken at the message of each step;
- the whole speculative step of one `profiling/bench_k26.py` run (`--step-results`: its rows "verify" at N =
  16, "whole ddtree budget 15 step", "draft forward" and the drafter's bytes), for what a DDTree step adds
  to its verify: the drafter, top-k, tree build, acceptance, KV commit, context append and their launch
  gaps.

Per kernel category of a layer, on one RTX PRO 6000:  max(bytes / 1.79 TB/s, the H200 time)  — a category
the H200 ran latency-bound keeps its H200 time (same instruction chain; the RTX part clocks higher but has
GDDR7's longer latency: taken as a wash), one that streamed bytes slows to the GDDR7 rate. Per layer two
all-reduces at the modelled PCIe latency (residual add + RMSNorm fused in: no extra kernels). A step: the
measured H200 step (all 61 layers, embedding, head) plus 61 x what the modelled layer adds (layer 0 is
dense and smaller: a slight overestimate), plus for DDTree the rest of the step (measured H200 whole step
minus verify, or the drafter's and the head shard's bytes at 1.79 TB/s plus that rest's non-draft part, the
larger) and the drafter's all-reduces. tokens/s = τ / step.

    python profiling/model_rtx8.py [--results FILE] [--step-results FILE] [--variant fused] [--ctx 4096]
        [--out FILE.md]
"""

from __future__ import annotations

import argparse
import datetime
import re
import subprocess
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
GDDR7 = 1.79e12  # bytes/s, RTX PRO 6000 (the figure)
DENSE = "dense projections at the GDDR7 rate"
LAYERS = 61
# The DFlash drafter at a TP8 rank's shapes (bench_k26.drafter_config): 6 layers, block 8 tokens, and the
# target's head shard its draft reads (163840 / 8 x 7168 bf16)
DRAFTER_LAYERS, DRAFTER_BLOCK, HEAD_SHARD_GB = 6, 8, 163840 // 8 * 7168 * 2 / 1e9
# τ (tokens per target forward): the published DFlash/DDTree drafter for K2-class models, and the embedded
# tiny pair at budget 15 (2026-11-30-bench_acceptance-h200.md: DDTree 16 -> 2.33).
TAUS = {"published drafter (τ ≈ 5.3)": 5.3, "embedded tiny pair (τ 2.33, budget 15)": 2.33}


def category_table(
    text: str, variant: str, ctx: int, n: int, path: bool = False
) -> list[tuple[str, int, float, float | None]]:
    """(category, launches, µs, MB or None) of the last section '### variant, L = ctx, N = n' (a results
    file may hold several runs, the newest last). `path`: µs from the "path µs per layer" column (a PDL
    table's share of the step per category, kernel_table.py) instead of the kernels' spans."""
    head = f"\n### {variant}, L = {ctx}, N = {n}\n"  # the whole line: N = 1 must not find N = 16
    i = text.rindex(head)
    j = text.index("\n| category | launches", i) + 1
    rows = []
    for line in text[j:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0].startswith("all dense projections"):  # the dense rows' sum, with their bytes:
            cells[0] = DENSE  # a bandwidth check for the rows that give none
        if path and len(cells) < 6:
            raise ValueError(f"no path column in '### {variant}, L = {ctx}, N = {n}' (an older table)")
        us = float(cells[5] if path else cells[2])
        rows.append((cells[0], int(cells[1]), us, float(cells[3]) if cells[3] else None))
    return rows


def step_ms(text: str, variant: str, ctx: int, n: int) -> float:
    """The measured graph-replay time of the whole step in that section (all layers, embedding, head)."""
    i = text.rindex(f"\n### {variant}, L = {ctx}, N = {n}\n")
    return float(re.search(r"step \(graph replay, median\): ([\d.]+) ms", text[i:]).group(1))


def step_row_ms(text: str, label: str, ctx: int) -> float:
    """The ms column of the last step-table row `| label | ctx | ...` of a bench_k26 results file."""
    rows = [line for line in text.splitlines() if line.startswith(f"| {label} | {ctx} |")]
    if not rows:
        raise ValueError(f"no row '{label}' at L = {ctx} in the step results")
    return float(rows[-1].strip("|").split("|")[3])


def allreduce_us(model_text: str, n: int) -> float:
    """The PCIe model's pick for a 7168 x n message: the fastest of its columns at that row."""
    for line in model_text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) >= 6 and cells[0] == str(n):
            vals = [float(c) for c in cells[2:6] if re.fullmatch(r"[\d.]+", c)]
            return min(vals)
    raise ValueError(f"no row N = {n} in the all-reduce model")


def layer_us(rows) -> tuple[float, float, list[str]]:
    """(H200 µs, modelled RTX µs, per-category lines) of one layer."""
    h200 = rtx = 0.0
    lines = []
    for cat, launches, us, mb in rows:
        if cat == DENSE:  # only what the dense rows' bytes at the GDDR7 rate add beyond their H200 time
            extra = max(0.0, (mb or 0) * 1e6 / GDDR7 * 1e6 - us)
            rtx += extra
            lines.append(f"| {cat} ({launches} launches: {mb:.1f} MB in {us:.1f} µs) | | | | +{extra:.1f} |")
            continue
        t = max(us, (mb or 0) * 1e6 / GDDR7 * 1e6)
        h200, rtx = h200 + us, rtx + t
        lines.append(f"| {cat} | {launches} | {us:.1f} | {'' if mb is None else f'{mb:.1f}'} | {t:.1f} |")
    return h200, rtx, lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # spans without PDL: under PDL a span starts at launch and covers the kernel it waits for (or, with
    # --path, a PDL table's path column: each kernel's end minus the previous one's)
    ap.add_argument("--results", type=Path, default=RESULTS / "2026-12-01-bench_k26-nopdl-table-h200.md")
    ap.add_argument(
        "--path", action="store_true", help="H200 µs per category from the table's path column (PDL runs)"
    )
    ap.add_argument("--allreduce-model", type=Path, default=RESULTS / "2026-12-01-allreduce_pcie8-model.md")
    ap.add_argument(
        "--step-results", type=Path, default=RESULTS / "2026-12-02-bench_k26-drafter-stacked-h200.md"
    )
    ap.add_argument("--variant", default="fused")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--verify-n", type=int, default=16, help="DDTree verify tokens (budget 15 + the root)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    text, ar_text = a.results.read_text(), a.allreduce_model.read_text()
    step_text = a.step_results.read_text()

    today = datetime.date.today()
    git = ["git", "rev-parse", "--short", "HEAD"]
    commit = subprocess.run(git, check=False, capture_output=True, text=True, cwd=RESULTS).stdout.strip()
    out = [
        f"# K2.6 on 8x RTX PRO 6000 (TP 8, PCIe), batch 1 — per-kernel model [modelled] — {today}",
        "",
        f"- device: none (arithmetic on measured inputs, run on the CPU machine); commit: {commit or '?'}",
        (
            f"- per-kernel input: `{a.results.name}` (H200, one TP8 rank, 61 layers, variant `{a.variant}`, "
            f"{a.ctx} context, its last run); all-reduce input: `{a.allreduce_model.name}` (published PCIe "
            f"P2P figures); whole-step input: `{a.step_results.name}`"
        ),
        (
            f"- rule: per category max(bytes / {GDDR7 / 1e12:.2f} TB/s, H200 µs"
            f"{' on the step path (PDL)' if a.path else ''}); 2 all-reduces per layer; the measured step + "
            f"{LAYERS} x the layer's difference; `python profiling/model_rtx8.py"
            f"{' --path' if a.path else ''}`"
        ),
        "",
    ]
    steps = {}
    for n in (1, a.verify_n):
        rows = category_table(text, a.variant, a.ctx, n, a.path)
        h200, rtx, lines = layer_us(rows)
        ar = allreduce_us(ar_text, n)
        measured = step_ms(text, a.variant, a.ctx, n)  # H200, collectives excluded
        steps[n] = (measured + LAYERS * (rtx - h200 + 2 * ar) / 1e3, measured, ar)
        out += [
            f"## One MoE layer, N = {n}",
            "",
            "| category | launches | H200 µs | MB | RTX PRO 6000 µs (modelled) |",
            "|---|---|---|---|---|",
            *lines,
            f"| 2 all-reduces + add + RMSNorm (PCIe model, 7168 x {n}) | 2 | — | — | {2 * ar:.1f} |",
            f"| **layer** | | **{h200:.1f}** | | **{rtx + 2 * ar:.1f}** |",
            "",
            (
                f"Step: the measured H200 step {measured:.2f} ms + {LAYERS} x (the layer's modelled RTX time "
                f"- its H200 time) = **{steps[n][0]:.2f} ms** on one RTX PRO 6000 of 8."
            ),
            "",
        ]
    # What the DDTree step adds to its verify, measured on the H200 in one run; on the RTX part the draft
    # forward's share streams the drafter's and the head shard's bytes at the GDDR7 rate if that is longer
    # (fc's bytes, read by the context append, counted here too: an upper bound).
    whole = step_row_ms(step_text, f"whole ddtree budget {a.verify_n - 1} step", a.ctx)
    rest = whole - step_row_ms(step_text, "verify", a.ctx)
    draft = step_row_ms(step_text, "draft forward (drafter + lm_head shard)", a.ctx)
    drafter_gb = float(re.search(r"drafter ([\d.]+) GB", step_text).group(1))
    drafter_ar = allreduce_us(ar_text, DRAFTER_BLOCK)
    draft_rtx = max(draft, (drafter_gb + HEAD_SHARD_GB) * 1e9 / GDDR7 * 1e3)
    drafter_ms = rest - draft + draft_rtx + 2 * DRAFTER_LAYERS * drafter_ar / 1e3
    ar_ms = steps[1][0]
    dd_ms = steps[a.verify_n][0] + drafter_ms
    out += [
        "## Step and tokens/s",
        "",
        "| | ms per step (modelled) | tokens/s at τ |",
        "|---|---|---|",
        f"| autoregressive decode (N = 1) | {ar_ms:.2f} | {1e3 / ar_ms:.0f} (τ = 1) |",
    ]
    for name, tau in TAUS.items():
        out.append(
            f"| DDTree budget {a.verify_n - 1}: verify N = {a.verify_n} + the rest {drafter_ms:.2f} ms, "
            f"{name} | {dd_ms:.2f} | {tau * 1e3 / dd_ms:.0f} |"
        )
    out += [
        "",
        (
            f"The rest (H200, `{a.step_results.name}`): whole DDTree step {whole:.2f} ms - verify "
            f"{whole - rest:.2f} ms = {rest:.2f} ms, of which the draft forward {draft:.2f} ms (modelled "
            f"{draft_rtx:.2f} ms: the larger of it and {drafter_gb + HEAD_SHARD_GB:.2f} GB at the GDDR7 "
            "rate — every drafter weight, fc included, which the context append reads, and the head "
            f"shard: an upper bound), plus {2 * DRAFTER_LAYERS} drafter all-reduces of 7168 x "
            f"{DRAFTER_BLOCK}."
        ),
        "",
        (
            "Reading: at batch 1 the modelled RTX step is the H200's latency-bound kernel chain plus PCIe "
            "all-reduces; GDDR7's lower bandwidth costs little because almost no category streams at the "
            "bandwidth yet. The levers are the kernel count and floors (issues 16-18) and the all-reduce "
            "latency (issue 19), not bytes. Not measured on any RTX PRO 6000."
        ),
    ]
    text_out = "\n".join(out) + "\n"
    print(text_out)
    if a.out:
        a.out.write_text(text_out)


if __name__ == "__main__":
    main()
