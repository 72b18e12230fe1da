"""The benchmarks' table arithmetic on the CPU: each kernel's share of a replay's path under PDL
(profiling/kernel_table.py `paths`) and the 8x RTX PRO 6000 model reading a table's path column
(profiling/model_rtx8.py `category_table(path=True)`)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "profiling"))
import kernel_table
import model_rtx8


@pytest.mark.parametrize(
    "spans, want",
    [
        ([(0.0, 5.0), (4.0, 3.0), (6.0, 2.0)], [5.0, 2.0, 1.0]),  # PDL: each starts inside its predecessor
        ([(0.0, 10.0), (2.0, 3.0), (4.0, 7.0)], [10.0, 0.0, 1.0]),  # one ends inside the one before it
        ([(0.0, 2.0), (5.0, 1.0)], [2.0, 4.0]),  # an idle gap counts to the kernel after it
    ],
)
def test_paths_add_up_to_the_replay_span(spans, want):
    got = kernel_table.paths(spans)
    assert got == want
    assert sum(got) == max(t + d for t, d in spans) - spans[0][0]


TABLE = """
### fused, L = 4096, N = 1

- step (graph replay, median): 4.22 ms; kernels in the step: 692

| category | launches per layer | µs per layer | MB per layer | % copy BW | path µs per layer |
|---|---|---|---|---|---|
| MoE experts (int4 kernel) | 2 | 34.9 | 35.8 | 25% | 16.2 |
| MLA tree attention | 1 | 14.2 | 4.7 | 8% | 13.2 |
| all dense projections of the layer | 4 | 36.5 | 51.8 | 34% | 20.9 |
"""


def test_model_reads_spans_or_path_shares():
    spans = model_rtx8.category_table(TABLE, "fused", 4096, 1)
    shares = model_rtx8.category_table(TABLE, "fused", 4096, 1, path=True)
    assert [r[2] for r in spans] == [34.9, 14.2, 36.5]
    assert [r[2] for r in shares] == [16.2, 13.2, 20.9]
    assert shares[2][0] == model_rtx8.DENSE and shares[2][3] == 51.8
    old = "\n".join(
        line.rsplit("|", 2)[0] + "|" if line.startswith("|") else line for line in TABLE.splitlines()
    )
    with pytest.raises(ValueError, match="no path column"):
        model_rtx8.category_table(old, "fused", 4096, 1, path=True)


def test_dense_path_variants_switch_the_projections_they_name():
    from k26.config import ModelConfig
    from k26.model import KimiK2
    from k26.model.mla import MLA
    from k26.tiny import DEFAULT_SIZES, text_config

    cfg = ModelConfig.from_dict(text_config(DEFAULT_SIZES | {"num_hidden_layers": 2}, 384, "none"))
    model = KimiK2(cfg, torch.bfloat16).eval()
    attns = [m for m in model.modules() if isinstance(m, MLA)]
    # the fused variants each way round: the switches do not leak from one to the next (both run every MLA
    # projection, o_proj included, in the small-M kernel at decode / verify rows: short_k_max_m)
    for name, every in [("fused-all", True), ("fused", False), ("fused-all", True), ("fused", False)]:
        kernel_table.apply_variant(model, name)
        assert all(m.o_proj.use_kernel is every and m.q_b_proj.use_kernel is every for m in attns), name
        assert all(m.short_k_max_m >= 16 and m.kernel_max_m >= 16 for m in attns), name
        assert model.lm_head.use_kernel is every, name
        assert all(m.qkv_a is not None and m.glue for m in attns) and all(
            n.use_kernel for n in model.residual_norms()
        )
    with pytest.raises(ValueError, match="unknown dense-path variant 'fused-x'"):
        kernel_table.apply_variant(model, "fused-x")
    with pytest.raises(
        ValueError, match="'glue' after a fused one"
    ):  # its rows would measure the stacked q_a
        kernel_table.apply_variant(model, "glue")


def test_a_step_reads_its_tokens_embedding_rows_not_the_embedding_table():
    """bench_k26's GB read counted the whole embedding shard (294 MB at K2.6's TP8 shapes, 2-5 % of a step's
    bytes) where a step gathers N rows of it."""
    from k26.config import ModelConfig
    from k26.model import KimiK2
    from k26.tiny import DEFAULT_SIZES, text_config

    cfg = ModelConfig.from_dict(text_config(DEFAULT_SIZES | {"num_hidden_layers": 2}, 384, "none"))
    model = KimiK2(cfg, torch.bfloat16).eval()
    everything = sum(p.numel() * p.element_size() for p in model.parameters())
    table = model.embed_tokens.weight.numel() * 2
    assert kernel_table.param_bytes(model, routed=False) + kernel_table.param_bytes(model, True) == (
        everything - table
    )
    nonrouted = kernel_table.param_bytes(model, False)
    assert kernel_table.step_gb(nonrouted, 0, 0, 16, cfg) * 1e9 == nonrouted + 16 * cfg.hidden_size * 2


def test_the_dense_row_counts_q_bs_glue_kernel_where_one_token_runs_it_there():
    """At one token q_b runs inside mla_glue_linear: its bytes were in the dense row, its time was not."""
    names = ["k26_attn::tree_attn_kernel<1, true>", "linear_tile_kernel<1>", "mla_glue_linear_kernel<1>"]
    kernels = []
    for layer in range(4):  # attention kernels delimit the layers' segments
        for j, name in enumerate(names):
            kernels.append({"name": name, "grid": (1,), "dur": 2.0 + j, "path": 1.0 + j})
    out = kernel_table.table(kernels, 1e-3, 4, {"dense": 6e6}, 3e12, "t")
    row = next(r for r in out if r.startswith("| all dense projections of the layer"))
    assert "| 2 | 7.0 |" in row  # the linear (3.0 µs) and the glue + q_b kernel (4.0 µs)
