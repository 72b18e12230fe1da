"""The cp.async-staged gate/up GEMM of the fused INT4 MoE kernel (csrc/moe_gate_up_staged.cuh, the path for
more than 64 (token, expert) pairs at nt = 1): bit-identical to the register-held GEMM it replaces there
(moe_cuda.register_gate_up()), close to the fp32 reference, and correct under graph replay when the
number of live groups changes (its blocks loop over the groups of a one-wave grid)."""

import pytest
import torch
from oracles import poison_allocator
from test_moe_gpu import _kernel_names, block_inputs

from k26.ops import moe_cuda
from k26.ops.moe_cuda import _reference

pytestmark = pytest.mark.gpu

TP8 = (384, 8, 7168, 256)  # E, topk, hidden D, intermediate I per rank


def staged_and_register(x, w, ids, tw, sh):
    """The op's output as it runs (staged where it serves) and under register_gate_up(), each into a
    poisoned allocator."""
    poison_allocator()
    staged = torch.ops.k26.moe_w4a16_repacked(x, *w, ids, tw, *sh)
    with moe_cuda.register_gate_up():
        poison_allocator()
        register = torch.ops.k26.moe_w4a16_repacked(x, *w, ids, tw, *sh)
    return staged, register


def assert_bitwise_and_close(x, w, ids, tw, sh):
    staged, register = staged_and_register(x, w, ids, tw, sh)
    assert torch.isfinite(staged.float()).all() and torch.equal(staged, register)
    ref = _reference(x, *w, ids, tw, *sh).float()
    assert ((staged.float() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("M", [9, 16, 33, 64])
@pytest.mark.parametrize("kind", ["uniform", "hot10", "same"])
@pytest.mark.parametrize("with_shared", [False, True])
def test_staged_gate_up_equals_register_gate_up_bitwise_k26_tp8(M, kind, with_shared):
    """K2.6 TP8 shapes, uniform routing (M = 64: ~300 groups, ~12 per block row), skewed and one expert set
    for all tokens (full groups of 8), with and without the shared expert (its 4x-wider bf16 rows)."""
    E, K, D, inter = TP8
    _, w, sh, x, ids, tw = block_inputs(800 + M, M, E, K, D, inter, kind, with_shared=with_shared)
    assert moe_cuda.pick_nt(M * K, E) == 1 and M * K > 64  # the staged path's case
    assert_bitwise_and_close(x, w, ids, tw, sh)


@pytest.mark.parametrize(
    "E,K,D,inter,M",
    [
        (48, 4, 7168, 2048, 40),  # TP1 width: 128 blocks a group, a few group rows
        (64, 8, 512, 256, 16),  # a small model's hidden: one k chunk per warp
        (64, 8, 256, 128, 24),  # K = 256: four chunks for eight warps (warps without chunks)
    ],
)
def test_staged_gate_up_other_widths_equal_register_gate_up_bitwise(E, K, D, inter, M):
    _, w, sh, x, ids, tw = block_inputs(900 + M, M, E, K, D, inter, "uniform")
    assert moe_cuda.pick_nt(M * K, E) == 1 and M * K > 64
    assert_bitwise_and_close(x, w, ids, tw, sh)


def test_many_pairs_launch_the_staged_gate_up():
    """At M = 16 (K2.6 TP8) the op launches gate_up_staged, not the register gate/up GEMM; under
    register_gate_up() the other way round (what the bitwise tests compare); M = 8 keeps the register GEMM."""
    _, w, sh, x, ids, tw = block_inputs(950, 16, *TP8)
    staged = _kernel_names(lambda: torch.ops.k26.moe_w4a16_repacked(x, *w, ids, tw, *sh))
    with moe_cuda.register_gate_up():
        register = _kernel_names(lambda: torch.ops.k26.moe_w4a16_repacked(x, *w, ids, tw, *sh))
    assert any("gate_up_staged" in k for k in staged), staged
    assert not any("gemm_kernel" in k for k in staged), staged
    assert not any("gate_up_staged" in k for k in register), register
    assert any("gemm_kernel" in k for k in register), register
    _, w, sh, x, ids, tw = block_inputs(951, 8, *TP8)
    few = _kernel_names(lambda: torch.ops.k26.moe_w4a16_repacked(x, *w, ids, tw, *sh))
    assert not any("gate_up_staged" in k for k in few), few


def test_staged_gate_up_graph_replays_with_other_group_counts_match_reference():
    """One graph captured at M = 48 (TP8 shapes), replayed with routings of very different live-group counts
    (all tokens on 8 experts: 6 + 8 groups; uniform: ~300; 10 hot experts), each replay against the
    reference: the blocks' loop bound is read on the device, never baked in at capture."""
    E, K, D, inter = TP8
    gen, w, sh, x, ids, tw = block_inputs(960, 48, E, K, D, inter, "uniform")
    torch.ops.k26.moe_w4a16_repacked(x, *w, ids, tw, *sh)  # built and planned before capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = torch.ops.k26.moe_w4a16_repacked(x, *w, ids, tw, *sh)
    from test_moe_gpu import routing

    for kind in ["same", "uniform", "hot10", "same"]:
        x.copy_(torch.randn(48, D, generator=gen, device="cuda"))
        ids.copy_(routing(kind, 48, E, K, gen))
        out.fill_(float("nan"))
        g.replay()
        ref = _reference(x, *w, ids, tw, *sh).float()
        assert torch.isfinite(out.float()).all(), kind
        assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2, kind
