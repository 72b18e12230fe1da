"""`torch.ops.k26.add_rmsnorm` (k26/ops/csrc/add_rmsnorm.cu) against its reference on fresh random rows,
outputs poisoned first: the new residual bitwise, the normed rows within bf16 rounding, rows independent of
the row count, PDL on or off and graph replays bit-identical, and the shapes it does not serve on the
reference."""

import pytest
import torch
from oracles import bf16_ulps, poison_allocator

import k26.ops  # noqa: F401  (registers the ops)
from k26.ops import pdl
from k26.ops.allreduce_cuda import add_rmsnorm_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
EPS = 1e-6


def rows(n: int, D: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x, residual = (torch.randn(n, D, device="cuda", generator=g).bfloat16() for _ in range(2))
    weight = (torch.rand(D, device="cuda", generator=g) + 0.5).bfloat16()
    return x, residual * 4, weight


def check(out, h, x, residual, weight) -> None:
    """h bitwise; the normed rows within 2 ulps (rsqrtf and the row sum's order differ from torch's: one
    ulp in bf16(h * rstd), one more after the product with the weight)."""
    ref_out, ref_h = add_rmsnorm_reference(x, residual, weight, EPS)
    assert torch.equal(h, ref_h)
    assert torch.isfinite(out).all()
    worst = bf16_ulps(out, ref_out).max().item()
    assert worst <= 2, worst


@pytest.mark.parametrize("n", [1, 3, 16, 130])
@pytest.mark.parametrize("D", [7168, 1024, 16384, 8, 2056])
def test_add_rmsnorm_matches_reference(n, D):
    x, residual, weight = rows(n, D, seed=n * D)
    poison_allocator()
    out, h = torch.ops.k26.add_rmsnorm(x, residual, weight, EPS)
    check(out, h, x, residual, weight)


def test_rows_do_not_depend_on_the_row_count():
    """One block per row, a fixed reduction order: a row has the same bits alone or among 200 (what lets a
    verify step reproduce decode's residual stream)."""
    x, residual, weight = rows(200, 7168, seed=5)
    full = torch.ops.k26.add_rmsnorm(x, residual, weight, EPS)
    for n in (1, 2, 17, 64, 199):
        poison_allocator()
        part = torch.ops.k26.add_rmsnorm(x[:n], residual[:n], weight, EPS)
        assert all(torch.equal(p, f[:n]) for p, f in zip(part, full, strict=True)), n


def test_graph_replays_between_pdl_kernels_match_eager_and_pdl_off():
    """Between two small-M linears (PDL kernels that prefetch their weights before their wait) in a CUDA
    graph, replayed with new inputs: each replay equals the eager chain, with PDL on or off."""
    D, N = 7168, 2112
    g = torch.Generator(device="cuda").manual_seed(11)
    w1 = (torch.randn(D, 1024, device="cuda", generator=g) * 1024**-0.5).bfloat16()
    w2 = (torch.randn(N, D, device="cuda", generator=g) * D**-0.5).bfloat16()
    a = torch.empty(4, 1024, device="cuda", dtype=torch.bfloat16)
    residual = torch.empty(4, D, device="cuda", dtype=torch.bfloat16)
    weight = (torch.rand(D, device="cuda", generator=g) + 0.5).bfloat16()

    def chain():
        normed, h = torch.ops.k26.add_rmsnorm(torch.ops.k26.linear(a, w1), residual, weight, EPS)
        return torch.ops.k26.linear(normed, w2), h

    def fill(step: int) -> None:
        gs = torch.Generator(device="cuda").manual_seed(100 + step)
        a.copy_(torch.randn(a.shape, device="cuda", generator=gs))
        residual.copy_(torch.randn(residual.shape, device="cuda", generator=gs))

    fill(0)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        chain()  # warm-up off the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = chain()
    for step in range(1, 6):
        fill(step)
        for o in outs:
            o.fill_(float("nan"))  # a replay that writes nothing fails
        graph.replay()
        eager = chain()
        with pdl.disabled():
            plain = chain()
        for got, want, off in zip(outs, eager, plain, strict=True):
            assert torch.equal(got, want) and torch.equal(want, off), step


@pytest.mark.parametrize("view", ["strided rows", "16-byte misaligned"])
def test_strided_and_misaligned_views_match_reference(view):
    """Inputs the kernel cannot read in place (rows apart by more than D, a base address off the 16-byte
    grid) are copied into place first, never misread."""
    x, residual, weight = rows(5, 7168, seed=9)
    if view == "strided rows":
        x = torch.cat([x, x], dim=1)[:, :7168]
    else:
        flat = torch.empty(x.numel() + 1, dtype=x.dtype, device="cuda")
        flat[1:].copy_(x.flatten())
        x = flat[1:].view(5, 7168)
        assert x.data_ptr() % 16
    poison_allocator()
    out, h = torch.ops.k26.add_rmsnorm(x, residual, weight, EPS)
    check(out, h, x, residual, weight)


@pytest.mark.parametrize("case", ["float32", "D % 8", "D above 16384"])
def test_unserved_calls_run_the_reference(case):
    D = {"float32": 7168, "D % 8": 100, "D above 16384": 16392}[case]
    x, residual, weight = rows(3, D, seed=2)
    if case == "float32":
        x, residual, weight = x.float(), residual.float(), weight.float()
    out, h = torch.ops.k26.add_rmsnorm(x, residual, weight, EPS)
    ref_out, ref_h = add_rmsnorm_reference(x, residual, weight, EPS)
    assert torch.equal(out, ref_out) and torch.equal(h, ref_h)
