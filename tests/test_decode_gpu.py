"""Decoding on a GPU: sampled graph steps equal the eager steps (each sampling mode's captured sampler is
the one eager decoding picks), and the eager phase timer's CUDA events stay bounded and add up."""

import pytest
import torch
from oracles import random_prompts

from k26 import LLM, SamplingParams, SpecConfig
from k26.spec.timer import PhaseTimer

pytestmark = pytest.mark.gpu


def test_phase_timer_folds_cuda_events_and_keeps_their_sum():
    timer, x = PhaseTimer(torch.device("cuda")), torch.randn(1024, 1024, device="cuda")
    pairs = []
    for _ in range(4 * PhaseTimer.HELD):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with timer("verify"):
            a.record()
            x = x @ x.T / 1024
            b.record()
        pairs.append((a, b))
        x.sum().item()  # an eager step's one host read
        assert timer.held() <= PhaseTimer.HELD
    inner = sum(a.elapsed_time(b) for a, b in pairs) / 1e3
    total = timer.total("verify")
    assert timer.held() == 0 and inner <= total < inner + 0.05, (inner, total)


@pytest.mark.parametrize(
    "sp",
    [
        SamplingParams(temperature=0.8, max_tokens=24, stop_token_ids=[], seed=3),  # "sample": no sort
        SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=24, stop_token_ids=[], seed=3),
    ],
    ids=["sample", "filter"],
)
@pytest.mark.parametrize("spec", [SpecConfig("ar"), SpecConfig("ddtree", 5)], ids=str)
def test_sampled_graph_steps_equal_eager_steps(tiny_k25, drafter_dir, sp, spec):
    kw = {"drafter": drafter_dir, "device": "cuda", "progress": False, "max_batch": 2, "max_model_len": 256}
    graphed, eager = LLM(tiny_k25, graphs=True, **kw), LLM(tiny_k25, graphs=False, **kw)
    eager.decoder.ctx.static = True  # the sync-free code path the graphs captured
    ps = random_prompts(2, 3, 30, seed=5)
    a, b = graphed.generate(ps, sp, spec), eager.generate(ps, sp, spec)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    modes = {mode for (_, mode) in graphed.decoder.runners}
    assert modes == {"filter" if sp.top_p < 1 else "sample"}  # one fixed batch captures its mode only
