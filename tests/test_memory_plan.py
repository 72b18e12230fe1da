"""`LLM`'s start-up memory plan (k26/memory_plan.py): the planned weights and caches are what the loader and
`LLM` allocate; on CUDA a plan that does not fit the GPU's free memory is refused in one line naming
max_batch / max_model_len and the values that fit, before any weight is read (every TP rank at once, the
tightest GPU's line raised by rank 0 itself); a plan that fits goes on to load. No GPU needed: the device
type and its free memory are stand-ins."""

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import k26.engine
import k26.memory_plan as mp
import k26.one_shot
from k26 import LLM
from k26.config import K26_TEXT_CONFIG, ModelConfig
from k26.drafter_config import DrafterConfig
from k26.graphs.buckets import Bucket
from k26.kv_cache import DrafterCache, LatentCache
from k26.loader import load_drafter, load_model
from k26.model import TPInfo
from k26.shard_reader import Piece, _part_bytes, batches
from k26.spec.prefill import MAX_CHUNK
from k26.stager import CHUNK
from k26.tiny import quantization_config
from k26.tp_driver import RankGroup

GiB = 1 << 30


class _Loaded(Exception):
    """Raised by the stand-in load_model: start-up got past the memory check to reading weights."""


def _tensor_bytes(m: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*m.parameters(), *m.buffers()))


@pytest.mark.parametrize("tp", [1, 2])
def test_planned_weights_are_what_every_rank_loads(tiny_tp, tp):
    """The plan's bytes per rank equal the tensors a real load of each rank's shard allocates (the int4
    experts as packed int32 words and bf16 scales, the drafter's heads split)."""
    target, drafter = tiny_tp
    cfg, dcfg = ModelConfig.from_dir(target), DrafterConfig.from_dir(drafter)
    w = mp.weight_bytes(cfg, dcfg, torch.bfloat16, tp, kernels=False)
    for rank in range(tp):
        model = load_model(target, cfg, device="cpu", tp=TPInfo(rank, tp), progress=False)
        assert w.target == _tensor_bytes(model)
        assert w.drafter == _tensor_bytes(load_drafter(drafter, cfg, cfg=dcfg, tp=TPInfo(rank, tp)))
    whole = mp.weight_bytes(cfg, dcfg, torch.bfloat16, 1, kernels=False)
    assert (w.total < whole.total) == (tp > 1)


def test_planned_caches_are_what_llm_allocates(tiny_tp):
    """`cache_bytes` per rank: the latent cache whole on every rank (MLA), the drafter's K/V split by heads
    with its trash row, as `LLM._load` allocates them."""
    target, drafter = tiny_tp
    cfg, dcfg = ModelConfig.from_dir(target), DrafterConfig.from_dir(drafter)
    rows, length = 3, 40
    for tp in (1, 2, 4):
        latent = LatentCache.allocate(cfg, rows, length, torch.bfloat16, "cpu").kv_LRTC
        d = DrafterCache.allocate(dcfg, rows, length, torch.bfloat16, "cpu", tp_size=tp)
        real = sum(t.numel() * t.element_size() for t in (latent, d.k, d.v))
        assert mp.cache_bytes(cfg, dcfg, rows, length, torch.bfloat16, tp) == real
        assert mp.cache_bytes(cfg, None, rows, length, torch.bfloat16, tp) == latent.numel() * 2
    # and what an LLM holds: its own caches against the plan for its rows and context
    from k26 import LLM

    llm = LLM(target, drafter=drafter, device="cpu", progress=False, max_batch=rows, max_model_len=length)
    held = sum(t.numel() * t.element_size() for t in (llm.cache.kv_LRTC, llm.dcache.k, llm.dcache.v))
    assert mp.cache_bytes(cfg, dcfg, rows, length, llm.dtype, 1) == held


def _llm_plan(cfg, dcfg=None, tp: int = 1, buckets=None) -> mp.MemoryPlan:
    """LLM's own plan on CUDA in bf16: graphs and the kernels' layouts, the default chunk."""
    return mp.plan_memory(
        cfg, dcfg, torch.bfloat16, tp, graphs=True, kernels=True, chunk=MAX_CHUNK, buckets=buckets
    )


def _k26(tp: int, buckets=None) -> mp.MemoryPlan:
    cfg = ModelConfig.from_dict(K26_TEXT_CONFIG | {"quantization_config": quantization_config()})
    return _llm_plan(cfg, tp=tp, buckets=buckets)


def test_k26_at_tp8_with_a_262k_context_for_8_rows_is_refused_on_an_h200():
    """K2.6 at TP 8: ~76 GB of weights a rank, and 147 GB of latent cache on every rank for 8 rows of
    262,144 positions: refused on a 139 GiB GPU, naming a batch and a context that do fit."""
    plan = _k26(8)
    assert 70 * GiB < plan.weights.total < 72 * GiB  # 594 GB of checkpoint / 8, the int4 experts packed
    assert plan.caches(8, 262144) == 61 * 576 * 2 * 262144 * 8  # replicated: not divided by tp
    free = 139 * GiB
    why = plan.refusal(8, 262144, free, "cuda:0 (tensor-parallel rank 0)")
    m = re.fullmatch(
        r"max_model_len=262144, max_batch=8: the KV caches need 137\.2 GiB a rank on top of the weights' "
        r"7\d\.\d GiB and [\d.]+ GiB of activations and graph pools; cuda:0 \(tensor-parallel rank 0\) has "
        r"139\.0 GiB free; at most max_batch=(\d+) fits at this length "
        r"\(or max_model_len=(\d+) at this batch\)",
        why,
    )
    assert m, why
    batch, context = int(m[1]), int(m[2])
    assert plan.need(batch, 262144) <= free < plan.need(batch + 1, 262144) and 1 <= batch < 8
    assert plan.need(8, context) <= free < plan.need(8, context + 1)
    assert plan.refusal(batch, 262144, free, "cuda:0") is None
    assert plan.refusal(8, context, free, "cuda:0") is None


def test_a_refusal_adds_up_when_the_loads_transient_buffers_break_it():
    # The weights fit, the caches and activations of one row too, but not the load's read buffers and
    # repack beside the weights: the line must name them, or its numbers add up to less than the free memory.
    plan = _k26(4)
    free = plan.weights.total + plan.weights.transient - 1
    assert plan.weights.total + plan.caches(1, 4096) + plan.activations(1) <= free
    why = plan.refusal(1, 4096, free, "cuda:0")
    assert why.startswith("tp=4: the weights need") and "the load " in why and "more for a while" in why


def test_a_suggested_batch_below_the_users_buckets_says_so():
    wide, narrow = _k26(8, [Bucket(8, 16)]), _k26(8, [Bucket(1, 16)])
    assert "max_batch=3 with buckets within it fits" in wide.refusal(8, 262144, 139 * GiB, "cuda:0")
    assert "with buckets within it" not in narrow.refusal(8, 262144, 139 * GiB, "cuda:0")


def test_weights_that_leave_no_room_name_tp():
    plan = _k26(1)  # ~560 GiB of weights on one GPU
    why = plan.refusal(1, 4096, 139 * GiB, "cuda:0")
    assert why.startswith("tp=1: the weights need 5") and "raise tp" in why and "\n" not in why


def _fake_cuda(monkeypatch, free: int | None) -> list:
    """LLM(device="cuda:0") on this CPU machine: the device check passes, the GPU has `free` bytes, and
    reading weights raises _Loaded (recording the call)."""
    loads: list = []

    def load(*a, **kw):
        loads.append(a)
        raise _Loaded

    monkeypatch.setattr(k26.engine, "check_device", lambda device: None)
    monkeypatch.setattr(k26.engine, "load_model", load)
    monkeypatch.setattr(mp, "usable_memory", lambda device: free)
    return loads


def _plan(target, drafter) -> mp.MemoryPlan:
    return _llm_plan(ModelConfig.from_dir(target), DrafterConfig.from_dir(drafter))


def test_llm_refuses_a_plan_the_gpu_cannot_hold_before_any_weight_is_read(tiny_k25, drafter_dir, monkeypatch):
    """Free memory for 3 rows at this length: max_batch=8 is refused in one line naming both arguments and
    max_batch=3; no weight is read."""
    length = 1024
    free = _plan(tiny_k25, drafter_dir).need(3, length)
    loads = _fake_cuda(monkeypatch, free)
    with pytest.raises(ValueError) as e:
        LLM(tiny_k25, drafter=drafter_dir, device="cuda:0", max_batch=8, max_model_len=length, progress=False)
    msg = str(e.value)
    assert msg.startswith(f"max_model_len={length}, max_batch=8: the KV caches need ") and "\n" not in msg
    assert "cuda:0 has " in msg and "at most max_batch=3 fits at this length" in msg
    assert not loads


def test_llm_with_a_plan_that_fits_goes_on_to_load(tiny_k25, drafter_dir, monkeypatch):
    """Exactly the planned bytes free: the check passes and the load starts; one byte fewer: refused."""
    length, plan = 1024, _plan(tiny_k25, drafter_dir)
    kw = {
        "drafter": drafter_dir,
        "device": "cuda:0",
        "max_batch": 8,
        "max_model_len": length,
        "progress": False,
    }
    loads = _fake_cuda(monkeypatch, plan.need(8, length))
    with pytest.raises(_Loaded):
        LLM(tiny_k25, **kw)
    assert len(loads) == 1
    _fake_cuda(monkeypatch, plan.need(8, length) - 1)
    with pytest.raises(ValueError, match="max_batch=8: .* at most max_batch=7 fits"):
        LLM(tiny_k25, **kw)


def test_cpu_devices_are_not_planned(tiny_k25, monkeypatch):
    """Host memory is not the engine's to plan: on the CPU the check never asks for free memory."""
    _fake_cuda(monkeypatch, None)
    monkeypatch.setattr(mp, "usable_memory", lambda device: pytest.fail("free memory asked on the CPU"))
    with pytest.raises(_Loaded):
        LLM(tiny_k25, device="cpu", max_batch=8, progress=False)


def test_cpu_caches_the_host_cannot_hold_are_refused_before_any_weight_is_read(
    tiny_k25, drafter_dir, monkeypatch
):
    """On the CPU the KV caches alone are checked against the host's free memory: max_batch=10**6 failed
    with an allocator traceback after the load. Exactly the caches' bytes free: it loads; one fewer: refused
    in one line naming max_batch / max_model_len and the max_batch that fits."""
    loads = _fake_cuda(monkeypatch, None)
    kw = {"drafter": drafter_dir, "device": "cpu", "max_model_len": 1024, "progress": False}
    need = mp.cache_bytes(
        ModelConfig.from_dir(tiny_k25), DrafterConfig.from_dir(drafter_dir), 8, 1024, torch.bfloat16
    )
    monkeypatch.setattr(mp, "free_memory", lambda device: need)
    with pytest.raises(_Loaded):
        LLM(tiny_k25, max_batch=8, **kw)
    monkeypatch.setattr(mp, "free_memory", lambda device: need - 1)
    with pytest.raises(ValueError) as e:
        LLM(tiny_k25, max_batch=8, **kw)
    msg = str(e.value)
    assert msg.startswith("max_model_len=1024, max_batch=8: the KV caches need ") and "\n" not in msg
    assert "this machine has " in msg and "at most max_batch=7 fits at this length" in msg
    assert len(loads) == 1


def _check(target: str) -> None:
    """This rank's check of an 8-row, 512-position plan at TP 2 on a stand-in cuda:<rank>."""
    rank = dist.get_rank()
    plan = _llm_plan(ModelConfig.from_dir(target), tp=2)
    mp.check_memory(plan, 8, 512, torch.device("cuda", rank), rank, 2)


def _rank(target: str, free: tuple[int, int]) -> None:
    """Rank 1's side (its own process): its stand-in free memory, then the check."""
    mp.usable_memory = lambda device: free[dist.get_rank()]
    _check(target)


def test_tp_ranks_refuse_together_with_the_tightest_gpus_line(tiny_tp, monkeypatch):
    """Rank 1's GPU has room for 2 rows, rank 0's for all 8: rank 0 raises the refusal naming rank 1's GPU
    itself (the ranks share what they have free), in one line, not a rank's traceback."""
    target = str(tiny_tp[0])
    plan = _llm_plan(ModelConfig.from_dir(target), tp=2)
    free = (plan.need(8, 512), plan.need(2, 512))
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parent))  # the ranks import _rank from here
    monkeypatch.setattr(mp, "usable_memory", lambda device: free[0])
    group = RankGroup(2, _rank, (target, free), {}, "cpu")
    try:
        with pytest.raises(ValueError) as e:
            _check(target)
        msg = str(e.value)
        assert "cuda:1 (tensor-parallel rank 1) has" in msg and "at most max_batch=2 fits" in msg
        assert "\n" not in msg
    finally:
        group.close(kill=True)
        dist.destroy_process_group()
    monkeypatch.setattr(mp, "usable_memory", lambda device: free[0])
    assert plan.refusal(8, 512, free[0], "cuda:0") is None  # rank 0 alone would have gone on


def test_score_whose_logits_do_not_fit_is_refused_before_any_forward(tiny_k25, monkeypatch):
    # (score returned [T, vocab] float32 logits outside the start-up plan: 21 GiB at K2.6's vocabulary and 32K
    # tokens, an out-of-memory error mid-call)
    llm = LLM(tiny_k25, device="cpu", dtype=torch.float32, progress=False, max_model_len=64, max_batch=1)
    vocab = llm.config.vocab_size
    monkeypatch.setattr(mp, "free_memory", lambda device: 2 * 10 * vocab * 4)  # room for 10 tokens' logits
    monkeypatch.setattr(k26.one_shot, "prefill", lambda *a, **k: pytest.fail("a forward ran"))
    with pytest.raises(
        ValueError,
        match=rf"score\(\) of 11 tokens returns \[11, {vocab}\] float32 logits .* "
        r"score at most 10 tokens at once",
    ):
        llm.score(list(range(1, 12)))
    monkeypatch.undo()
    assert llm.score(list(range(1, 11))).shape == (10, vocab)


def test_the_load_plan_holds_the_read_buffers_of_a_tensor_larger_than_a_chunk():
    # The embedding and the head (vocab x hidden bf16: 2.2 GiB each at K2.6) each go alone and whole into a
    # batch (shard_reader.batches): the stager's batch and the one read ahead are both held, and a coordinated
    # round (TP) adds its send buffer (every rank's slices) and this rank's slice received. The plan's
    # transient bytes held 2.1 GiB at TP 8 (four CHUNKs and a layer's repack): a nearly full GPU passed
    # check_memory and ran out of memory in the read.
    cfg = ModelConfig.from_dict(K26_TEXT_CONFIG | {"quantization_config": quantization_config()})
    v, d = cfg.vocab_size, cfg.hidden_size
    names = ("embed_tokens.weight", "lm_head.weight")
    pieces = [
        Piece(n, None, Path("s"), i * v * d * 2, (i + 1) * v * d * 2, torch.bfloat16, (v, d), 0)
        for i, n in enumerate(names)
    ]
    todo = batches(pieces, CHUNK)
    assert [len(b) for b in todo] == [1, 1]
    for tp in (1, 8):
        held = sum(p.nbytes for b in todo for p in b)
        if tp > 1:
            held += pieces[0].nbytes + _part_bytes(pieces[0], 0, tp)
        assert mp.weight_bytes(cfg, None, torch.bfloat16, tp, True).transient >= held
