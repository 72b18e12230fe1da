"""The fused all-reduce + residual add + RMSNorm on the CPU: its reference is today's composition, the
model and the drafter route every per-layer reduction through `TPInfo.reduce_add_norm` (bitwise the
composition), gloo ranks fall back to the composition and agree on why, and the errors name the rank.
The kernel itself runs in tests/test_allreduce_gpu.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k26.config import ModelConfig
from k26.drafter_config import DrafterConfig
from k26.embedded import DEFAULT_DIR
from k26.model import AttnBatch, KimiK2
from k26.model.drafter import DFlashDrafter
from k26.model.layers import TPInfo
from k26.ops.allreduce_cuda import add_rmsnorm_reference
from k26.ops.allreduce_group import FusedAllReduce, check_inputs
from k26.tiny import DEFAULT_SIZES, text_config


def _two_identical_ranks(fused: bool, calls: list) -> TPInfo:
    """TP 2 where both ranks hold this rank's partials: all-reduce = 2x. `fused`: the fused collective is a
    Python stand-in that counts its calls and computes the reference."""

    def fused_ar(x, residual, weight, eps):
        calls.append(x.shape)
        return add_rmsnorm_reference(x + x, residual, weight, eps)

    return TPInfo(0, 2, lambda x: x + x, None, fused_ar if fused else None)


def test_model_reduces_every_layer_through_the_fused_collective_bitwise():
    torch.manual_seed(0)
    cfg = ModelConfig.from_dict(text_config(DEFAULT_SIZES, 384, "none"))
    out, calls = [], []
    for fused in (False, True):
        torch.manual_seed(0)
        model = KimiK2(cfg, torch.bfloat16, _two_identical_ranks(fused, calls)).eval()
        for p in model.parameters():
            p.data.normal_(0, 0.3)
        ids = torch.randint(0, cfg.vocab_size // 2, (2, 4))
        cache = torch.randn(cfg.num_hidden_layers, 2, 12, cfg.latent_dim).bfloat16()
        with torch.no_grad():
            out.append(model(ids, AttnBatch.causal(torch.tensor([2, 5]), 4), cache, aux_layers=(0,)))
    assert len(calls) == 2 * cfg.num_hidden_layers  # after attention and after the MLP / MoE, every layer
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])


def test_drafter_reduces_every_layer_through_the_fused_collective_bitwise():
    cfg = DrafterConfig.from_dir(DEFAULT_DIR / "drafter")
    out, calls = [], []
    for fused in (False, True):
        torch.manual_seed(0)
        d = DFlashDrafter(cfg, torch.float32, _two_identical_ranks(fused, calls)).eval()
        for p in d.parameters():
            p.data.normal_(0, 0.05)
        B, S, T, L = 2, cfg.block_size, 16, cfg.num_hidden_layers
        hkv = cfg.num_key_value_heads // 2
        ck, cv = (torch.randn(L, B + 1, T, hkv, cfg.head_dim) for _ in range(2))
        x = torch.randn(B, S, cfg.hidden_size)
        pos = torch.arange(S)[None].expand(B, S) + 6
        with torch.no_grad():
            out.append(d(x, pos, ck, cv, torch.arange(B), torch.tensor([6, 3])))
    assert len(calls) == 2 * cfg.num_hidden_layers
    assert torch.equal(out[0], out[1])


def test_fused_collective_errors_name_the_rank():
    ar = FusedAllReduce.__new__(FusedAllReduce)  # the error word as a kernel leaves it, no group needed
    ar.rank, ar.timeout_ns = 0, int(5e9)
    ar.err = torch.tensor([1 << 8 | 3, 0], dtype=torch.int32)  # kind 1 (timeout), peer 2
    with pytest.raises(RuntimeError, match="rank 0 waited 5 s for rank 2, which never arrived"):
        ar.check()
    ar.err = torch.tensor([2 << 8 | 2, 14336], dtype=torch.int32)  # kind 2 (size), peer 1
    with pytest.raises(RuntimeError, match="rank 1 was called with 14336 elements, a different size"):
        ar.check()
    ar.err = torch.zeros(2, dtype=torch.int32)
    ar.check()
    x = torch.randn(2, 16).bfloat16()
    with pytest.raises(ValueError, match="residual"):
        check_inputs(x, x[:1], torch.ones(16).bfloat16())
    with pytest.raises(ValueError, match=r"weight must be \[16\]"):
        check_inputs(x, x, torch.ones(8).bfloat16())
    with pytest.raises(ValueError, match="weight is torch.float32"):
        check_inputs(x, x, torch.ones(16))


def _gloo_rank(rank: int, world: int, port: int) -> None:
    """One gloo rank: FusedAllReduce falls back (no CUDA here) with the same reason on every rank, the op's
    reference equals all-reduce + add + RMSNorm, and tp_info on gloo keeps the composition."""
    import torch.distributed as dist

    from k26.dist import tp_info
    from k26.model.layers import RMSNorm

    store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    ar = FusedAllReduce(device="cpu")
    assert not ar.p2p and ar.why == "rank 0 has no CUDA device", ar.why
    g = torch.Generator().manual_seed(rank)
    x, res = torch.randn(3, 64, generator=g), torch.randn(3, 64, generator=torch.Generator().manual_seed(9))
    norm = RMSNorm(64, 1e-6, torch.float32)
    norm.weight.data.normal_(1, 0.1, generator=torch.Generator().manual_seed(5))
    normed, h = ar(x, res, norm.weight, norm.eps)
    s = x.clone()
    dist.all_reduce(s)
    assert torch.equal(h, res + s) and torch.equal(normed, norm(res + s))
    normed2, h2 = torch.ops.k26.allreduce_add_rmsnorm(
        x, res, norm.weight, norm.eps, ar.group_name, ar.peers, ar.ctl, ar.err, rank, 0, 0, 0
    )
    assert torch.equal(normed2, normed) and torch.equal(h2, h)
    tp = tp_info(rank, world)
    assert tp.allreduce_add_rmsnorm is None
    assert all(torch.equal(a, b) for a, b in zip(tp.reduce_add_norm(x, res, norm), (normed, h), strict=True))
    dist.barrier()  # both ranks are done before either takes the group (and rank 0 its store) down
    dist.destroy_process_group()


def test_gloo_ranks_fall_back_to_the_composition_and_agree():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = str(Path(__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(r), "2", str(port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    for r, p in enumerate(procs):
        out = p.communicate(timeout=120)[0]
        assert p.returncode == 0, f"rank {r}:\n{out[-3000:]}"


class _Recorder:
    """A fused collective stand-in whose recorded failure appears after `fail_after` checks."""

    def __init__(self, fail_after: int):
        self.checks, self.closed, self.fail_after = 0, 0, fail_after

    def __call__(self, x, residual, weight, eps):
        return add_rmsnorm_reference(x, residual, weight, eps)

    def check(self):
        self.checks += 1
        if self.checks > self.fail_after:
            raise RuntimeError("k26 fused all-reduce: rank 0 waited 2 s for rank 1, which never arrived")

    def close(self):
        self.closed += 1


def test_decoder_raises_a_failure_the_fused_collective_recorded_and_close_releases_it():
    """Inside CUDA graphs no front door runs: the decoder asks the collective after every step, so a peer
    that died mid-step surfaces as its error (naming the rank), and LLM.close releases the collective."""
    import dataclasses

    from k26 import LLM, SamplingParams, SpecConfig

    llm = LLM(device="cpu", dtype=torch.float32, progress=False)
    rec = _Recorder(fail_after=2)
    llm.model.tp = dataclasses.replace(llm.model.tp, allreduce_add_rmsnorm=rec)
    sp = SamplingParams(max_tokens=16, stop_token_ids=[])
    with pytest.raises(RuntimeError, match="rank 1, which never arrived"):
        llm.generate([[5, 6, 7]], sp, SpecConfig("ar"))
    assert rec.checks == 3  # two good steps, then the third step's check raised
    llm.close()
    assert rec.closed == 1


def test_calibrated_crossover_size_runs_nccl(monkeypatch):
    """calibrate() measures where NCCL wins; a message of exactly that size must then run the composition
    over NCCL (the front door sends messages *above* nccl_bytes there), the size below it the kernel."""
    import k26.ops.allreduce_cuda as arc
    import k26.ops.allreduce_group as arg

    D, rows = 64, [1, 2, 4, 8]
    sizes = [2 * n * D for n in rows]
    times = [[5.0, 9.0, 20.0], [6.0, 9.0, 20.0], [7.0, 9.0, 6.5], [9.0, 9.5, 7.0]]  # NCCL from 4 rows on
    two_shot, nccl = arg.crossovers(sizes, times, 1 << 30)
    assert two_shot == 1 << 62  # the two-shot never wins here
    ran = []

    def composition(x, r, w, eps, group):
        ran.append(group)
        return r.clone(), r.clone()

    for module in (arc, arg):  # the op's reference (arc) and the front door's NCCL path (arg) both call it
        monkeypatch.setattr(module, "composition", composition)
    monkeypatch.setattr(arc, "_group", lambda name: "kernel op")  # the op's CPU reference: the kernel's path
    ar = FusedAllReduce.__new__(FusedAllReduce)
    ar.p2p, ar.max_dim, ar.cap, ar.group, ar.group_name, ar.rank = True, 1024, 1 << 20, "nccl", "g", 0
    ar.two_shot_bytes, ar.nccl_bytes, ar.timeout_ns = two_shot, nccl, 1
    ar.peers, ar.ctl, ar.err = (
        torch.empty(0, dtype=torch.int64),
        torch.zeros(0),
        torch.zeros(2, dtype=torch.int32),
    )
    w = torch.ones(D).bfloat16()
    for n in rows:
        x = torch.randn(n, D).bfloat16()
        ar(x, x, w, 1e-6)
    assert ran == ["kernel op", "kernel op", "nccl", "nccl"]


def test_a_bad_allreduce_choice_is_refused_before_loading():
    from k26 import LLM

    with pytest.raises(ValueError, match="allreduce='ring': expected one of 'fused', 'calibrate', 'nccl'"):
        LLM(model_path="/nonexistent", allreduce="ring")


if __name__ == "__main__":
    torch.set_num_threads(1)
    _gloo_rank(*map(int, sys.argv[1:4]))
    # Past this point only interpreter teardown is left, where gloo's and the TCP store's C++ threads can
    # abort the process ("terminate called without an active exception", seen in about 1 of 10 runs)
    # after every check passed: leave without it.
    sys.stdout.flush()
    os._exit(0)


@pytest.mark.parametrize(
    "x_dtype, res_dtype, w_dtype, res_rows",
    [
        (torch.float32, torch.bfloat16, torch.bfloat16, 3),
        (torch.bfloat16, torch.bfloat16, torch.float32, 3),
        (torch.float32, torch.float32, torch.float32, 1),  # a residual broadcast over x's rows
    ],
)
def test_the_fused_collectives_fake_has_the_references_shapes_and_dtypes(
    x_dtype, res_dtype, w_dtype, res_rows
):
    """The fake answered residual's shape and dtype whatever x's (fp32 x, bf16 residual: the reference gives
    fp32, fp32; a one-row residual: x's rows) — torch.compile traced the wrong tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, res = torch.randn(3, 8, dtype=x_dtype), torch.randn(res_rows, 8, dtype=res_dtype)
    w, e = torch.randn(8, dtype=w_dtype), torch.empty(0, dtype=torch.int64)
    want = add_rmsnorm_reference(x, res, w, 1e-6)  # (the all-reduce keeps x as it is)
    with FakeTensorMode() as mode:
        fx, fres, fw, fe = (mode.from_tensor(t) for t in (x, res, w, e))
        got = torch.ops.k26.allreduce_add_rmsnorm(fx, fres, fw, 1e-6, "no group", fe, fe, fe, 0, 0, 0, 0)
    assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in want]
