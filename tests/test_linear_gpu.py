"""The small-M linear kernel against its pure-torch reference on fresh random inputs, outputs poisoned
first: K2.6 projection shapes, odd K and N, every M up to 64, split-K counters reused, residual, groups,
strided weights, graph replay."""

import pytest
import torch
from oracles import poison_allocator

import k26.ops  # noqa: F401  (registers the ops)
from k26.ops.linear_cuda import MAX_ROWS, launch, linear_grouped_reference, linear_reference
from k26.ops.swiglu_cuda import linear_swiglu_reference as swiglu_reference

pytestmark = pytest.mark.gpu


def rand(*shape, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)


def close(got, ref, tol=1e-2):
    got, ref = got.float(), ref.float()
    assert torch.isfinite(got).all()
    err = ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert err < tol, err


def check(M, N, K, seed, residual=False, splits=None):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x, w = rand(M, K, gen=gen), rand(N, K, gen=gen, scale=K**-0.5)
    r = rand(M, N, gen=gen) if residual else None
    ref = linear_reference(x, w, r)
    poison_allocator()
    if splits is None:
        got = torch.ops.k26.linear(x, w, r)
    else:
        got = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
        launch(x, w, r, got, groups=1, strides=(K, 0, K, 0, N, 0), splits=splits)
    close(got, ref)


K26_SHAPES = {  # [N, K] at one TP8 rank of K2.6 (hidden 7168) and the drafter
    "q_a+kv_a": (2112, 7168),
    "q_b": (1536, 1536),
    "o_proj": (7168, 1024),
    "gate+up": (4608, 7168),
    "down": (7168, 2304),
    "drafter_q": (1024, 7168),
    "drafter_kv": (256, 7168),
}


@pytest.mark.parametrize("M", [1, 16])
@pytest.mark.parametrize("name", sorted(K26_SHAPES))
def test_k26_projection_shapes(name, M):
    check(M, *K26_SHAPES[name], seed=M)


@pytest.mark.parametrize("M", [1, 8, 16])
def test_a_stack_equals_its_parts_bit_for_bit(M):
    """Tile mode's rows are independent: the drafter's stacked q / k / v (`stack_`, one call) equals the
    three projections run apart, bit for bit, and the K / V rows' view of the stack (`DrafterAttention.kv`)
    equals its two; fresh random inputs, outputs poisoned first."""
    gen = torch.Generator(device="cuda").manual_seed(500 + M)
    K = 7168
    parts = [rand(n, K, gen=gen, scale=K**-0.5) for n in (1024, 128, 128)]
    stack, x = torch.cat(parts), rand(M, K, gen=gen)
    poison_allocator()
    alone = [torch.ops.k26.linear(x, w) for w in parts]
    close(alone[0], linear_reference(x, parts[0]))
    assert torch.equal(torch.ops.k26.linear(x, stack), torch.cat(alone, dim=-1))
    assert torch.equal(torch.ops.k26.linear(x, stack[1024:]), torch.cat(alone[1:], dim=-1))


@pytest.mark.parametrize("M", [1, 2, 5, 8, 9, 15, 16, 17, 31, 33, 48, 63, 64])
def test_every_m_up_to_64(M):
    check(M, 200, 1000, seed=100 + M)


@pytest.mark.parametrize("N,K", [(1, 8), (17, 40), (63, 72), (65, 1032), (100, 7176), (300, 88), (129, 2056)])
@pytest.mark.parametrize("M", [1, 3, 16, 40])
def test_odd_n_and_k(N, K, M):
    check(M, N, K, seed=N + K + M)


@pytest.mark.parametrize("M,N,K", [(16, 64, 43008), (64, 200, 7168), (8, 72, 43008), (33, 100, 7168)])
def test_largest_staged_x(M, N, K):
    """The fewest splits stage the most x: at the shared-memory budget (the drafter fc at M = 16)."""
    check(M, N, K, seed=M + N)


@pytest.mark.parametrize("splits", [1, 2, 3, 7, 28])
@pytest.mark.parametrize("M", [1, 16, 64])
def test_split_counts_agree(splits, M):
    """Split-K (asked for: tile mode is the default), against the reference."""
    check(M, 256, 7168, seed=splits + M, splits=splits)


@pytest.mark.parametrize("M", [1, 2, 9, 16, 31, 40, 64])
@pytest.mark.parametrize("N,K", [(2112, 7168), (17, 40), (100, 7176), (1536, 1536), (7168, 1024)])
def test_tile_mode_matches_reference(M, N, K):
    check(M, N, K, seed=M + N, residual=M % 2 == 1, splits=0)


@pytest.mark.parametrize("N,K,G", [(2112, 7168, 1), (100, 7176, 1), (128, 512, 8), (7168, 1024, 1)])
def test_tile_mode_is_batch_invariant(N, K, G):
    """A row of y has the same bits whatever the other rows: every M reproduces the M = 200 result (four
    launches of up to 64 rows) on its first M rows (what makes a verify step reproduce decode's logits).
    Grids of at most one block per SM take the deep variant up to 16 rows, (7168, 1024) the default one."""
    gen = torch.Generator(device="cuda").manual_seed(N + G)
    x, w = rand(200, G, K, gen=gen), rand(G, N, K, gen=gen, scale=K**-0.5)
    full = torch.ops.k26.linear_grouped(x, w) if G > 1 else torch.ops.k26.linear(x[:, 0], w[0])
    close(full, linear_grouped_reference(x, w) if G > 1 else linear_reference(x[:, 0], w[0]))
    for M in (1, 2, 7, 8, 9, 16, 17, 33, 63, 64, 65, 130):
        poison_allocator()
        part = torch.ops.k26.linear_grouped(x[:M], w) if G > 1 else torch.ops.k26.linear(x[:M, 0], w[0])
        assert torch.equal(part, full[:M]), M


def test_counters_are_reset_between_calls():
    gen = torch.Generator(device="cuda").manual_seed(1)
    w = rand(2112, 7168, gen=gen, scale=0.01)
    for _ in range(3):  # split-K (tile mode, the default, has no counters)
        x = rand(4, 7168, gen=gen)
        got = torch.full((4, 2112), float("nan"), dtype=torch.bfloat16, device="cuda")
        launch(x, w, None, got, groups=1, strides=(7168, 0, 7168, 0, 2112, 0), splits=16)
        close(got, linear_reference(x, w))


@pytest.mark.parametrize("M", [1, 16, 64])
def test_residual_epilogue(M):
    check(M, 7168, 1024, seed=7 + M, residual=True)


@pytest.mark.parametrize("M", [1, 16])
def test_grouped_w_uv_on_strided_kv_b(M):
    """W_UV is the second half of each head's kv_b rows: a strided view, no copy."""
    gen = torch.Generator(device="cuda").manual_seed(M)
    H, nope, v, r = 8, 128, 128, 512
    kv_b = rand(H * (nope + v), r, gen=gen, scale=r**-0.5)
    w_uv = kv_b.view(H, nope + v, r)[:, nope:]
    x = rand(M, H, r, gen=gen)
    ref = linear_grouped_reference(x, w_uv)
    poison_allocator()
    close(torch.ops.k26.linear_grouped(x, w_uv), ref)


def test_leading_dims_and_non_contiguous_x():
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = rand(2, 3, 2 * 512, gen=gen)[..., ::2]  # stride 2 in K: copied, not refused
    w = rand(96, 512, gen=gen)
    close(torch.ops.k26.linear(x, w), linear_reference(x, w))


def test_unsupported_runs_the_reference():
    gen = torch.Generator(device="cuda").manual_seed(4)
    x, w = rand(MAX_ROWS + 1, 64, gen=gen), rand(32, 64, gen=gen)
    assert torch.equal(torch.ops.k26.linear(x, w), linear_reference(x, w))
    xf, wf = x.float(), w.float()
    assert torch.equal(torch.ops.k26.linear(xf, wf), linear_reference(xf, wf))


@pytest.mark.parametrize(
    "op, M, N, scale, seed",
    [("linear", 16, 2112, 0.01, 5), ("linear_swiglu", 8, 2 * 2304, 7168**-0.5, 78)],
)
def test_graph_replay_matches_eager(op, M, N, scale, seed):
    fn = getattr(torch.ops.k26, op)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x, w = rand(M, 7168, gen=gen), rand(N, 7168, gen=gen, scale=scale)
    fn(x, w)  # load the library and the counters before capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn(x, w)
    for _ in range(2):
        x.copy_(rand(M, 7168, gen=gen))
        g.replay()
        assert torch.equal(out, fn(x, w))


def test_model_with_the_kernel_matches_cublas(tiny_k25):
    from k26 import LLM
    from k26.model.layers import use_linear_kernel

    llm = LLM(tiny_k25, device="cuda", progress=False)
    ids = torch.randint(0, 600, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    b = llm.score(ids)
    assert use_linear_kernel(llm.model) > 0 and llm.model.layers[0].self_attn.q_b_proj.use_kernel
    a = llm.score(ids)  # 40 tokens: every projection within the kernel's M <= 64
    assert ((a - b).norm() / b.norm()).item() < 2e-2


@pytest.mark.parametrize("M", [1, 2, 9, 16, 31, 64, 100])
@pytest.mark.parametrize("I,K", [(2304, 7168), (512, 7168), (20, 40), (100, 7176)])
def test_swiglu_matches_reference(M, I, K):
    """linear_swiglu (the [gate; up] stack in tile mode, SiLU·up in the epilogue; I = 512: the deep grid;
    100 rows: two launches) against the reference on fresh inputs, and against SiLU·up of the plain kernel's
    own gate / up rows, whose sums it shares bit for bit."""
    gen = torch.Generator(device="cuda").manual_seed(M * 7 + I)
    x, w = rand(M, K, gen=gen), rand(2 * I, K, gen=gen, scale=K**-0.5)
    poison_allocator()
    got = torch.ops.k26.linear_swiglu(x, w)
    close(got, swiglu_reference(x, w))
    own = torch.nn.functional.silu(torch.ops.k26.linear(x, w[:I])) * torch.ops.k26.linear(x, w[I:])
    # the same sums and rounding points: equal but where F.silu's exp may differ in a last fp32 bit (a skipped
    # rounding point would move a large share of the elements)
    assert (got != own).sum().item() <= max(1, got.numel() // 1000)


def test_swiglu_rows_are_batch_invariant():
    gen = torch.Generator(device="cuda").manual_seed(77)
    x, w = rand(64, 7168, gen=gen), rand(2 * 2304, 7168, gen=gen, scale=7168**-0.5)
    full = torch.ops.k26.linear_swiglu(x, w)
    for M in (1, 8, 16, 33):
        assert torch.equal(torch.ops.k26.linear_swiglu(x[:M], w), full[:M]), M


def test_a_swiglu_weight_the_door_copies_is_launched_without_pdl(monkeypatch):
    """As `k26.linear`'s door: a stacked weight the SwiGLU door had to copy (a strided view, a view 8 bytes
    off a 16-byte line) is launched without PDL, the caller's own packed weight with it; a strided x is
    copied. All equal the reference on fresh inputs."""
    from k26.ops import swiglu_cuda

    seen = []
    real = swiglu_cuda._lib()

    class Recorder:
        def k26_linear_swiglu(self, *args):
            seen.append(args[-2])  # the pdl flag
            return real.k26_linear_swiglu(*args)

    monkeypatch.setattr(swiglu_cuda.pdl, "ENABLED", True)
    monkeypatch.setattr(swiglu_cuda, "_lib", lambda: Recorder())
    gen = torch.Generator(device="cuda").manual_seed(79)
    I, K = 96, 512
    x = rand(3, 2 * K, gen=gen)[:, ::2]  # strided rows: the door packs them
    stacked = rand(2 * I, 2 * K, gen=gen, scale=K**-0.5)
    flat = stacked.flatten()[4 : 4 + 2 * I * K].view(2 * I, K)
    assert flat.data_ptr() % 16 == 8
    for w in (stacked[:, ::2], flat, stacked[:, ::2].contiguous()):
        ref = swiglu_reference(x, w)
        poison_allocator()
        close(torch.ops.k26.linear_swiglu(x, w), ref)
    assert seen == [0, 0, 1]


def test_the_loaded_drafter_runs_its_projections_in_the_kernel(tiny_k25, drafter_dir):
    """The loader puts the drafter's projections in the small-M kernel (up to layers.KERNEL_MAX_ROWS rows):
    a draft block forward of two sequences on fresh random inputs is one small-M call per stack and
    projection (4 a layer, gate / up with SiLU·up as `linear_swiglu`), and equals the same drafter's
    cuBLAS-path forward."""
    from test_compile_layers import LinearCalls

    from k26.config import ModelConfig
    from k26.loader import load_drafter
    from k26.model.layers import KERNEL_MAX_ROWS, use_linear_kernel

    drafter = load_drafter(drafter_dir, ModelConfig.from_dir(tiny_k25), device="cuda")
    assert drafter.fc.use_kernel and drafter.fc.kernel_max_rows == KERNEL_MAX_ROWS
    cfg, gen = drafter.cfg, torch.Generator(device="cuda").manual_seed(41)
    hd, kv = cfg.head_dim, cfg.num_key_value_heads
    ck, cv = (rand(cfg.num_hidden_layers, 3, 40, kv, hd, gen=gen) for _ in range(2))
    x = rand(2, cfg.block_size, cfg.hidden_size, gen=gen)
    pos = (torch.arange(cfg.block_size, device="cuda") + 30).expand(2, -1)
    rows, lens = torch.tensor([0, 2], device="cuda"), torch.tensor([30, 17], device="cuda")
    with torch.no_grad():
        poison_allocator()
        with LinearCalls() as calls:
            got = drafter(x, pos, ck, cv, rows, lens, static=True)
        assert len(calls.weights) == 4 * cfg.num_hidden_layers
        assert len(calls.swiglu) == cfg.num_hidden_layers
        use_linear_kernel(drafter, False)
        poison_allocator()
        want = drafter(x, pos, ck, cv, rows, lens, static=True)
    close(got, want, tol=2e-2)


@pytest.mark.parametrize("grouped", [False, True])
def test_a_weight_the_door_copies_is_launched_without_pdl(monkeypatch, grouped):
    """The kernel loads weights before its grid-dependency wait: a weight the front door had to copy (a
    strided view) is the copy kernel's output, still being written under PDL, so that launch goes without
    PDL; the caller's own weight keeps it. Both equal the reference on fresh inputs."""
    from k26.ops import linear_cuda

    seen = []
    monkeypatch.setattr(linear_cuda.pdl, "ENABLED", True)
    real = linear_cuda.launch
    monkeypatch.setattr(linear_cuda, "launch", lambda *a, **k: (seen.append(k["pdl_on"]), real(*a, **k)))
    gen = torch.Generator(device="cuda").manual_seed(31)
    G, N, K = (4, 96, 256) if grouped else (1, 384, 512)
    x = rand(3, G, K, gen=gen) if grouped else rand(3, K, gen=gen)
    stacked = rand(G, N, 2 * K, gen=gen, scale=K**-0.5)
    flat = stacked.flatten()[4 : 4 + G * N * K].view(G, N, K)  # contiguous at 8 bytes past a 16-byte line
    assert flat.is_contiguous() and flat.data_ptr() % 16 == 8
    # a strided view and a misaligned one (both copied), then the caller's own packed weight
    for w in (stacked[..., ::2], flat, stacked[..., ::2].contiguous()):
        w = w if grouped else w[0]
        ref = linear_grouped_reference(x, w) if grouped else linear_reference(x, w)
        poison_allocator()
        got = torch.ops.k26.linear_grouped(x, w) if grouped else torch.ops.k26.linear(x, w)
        close(got, ref)
    assert seen == [False, False, True]
