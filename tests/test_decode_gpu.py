"""Eager decoding's device-side helpers on a GPU: the phase timer's CUDA events stay bounded and add up."""

import pytest
import torch

from k26.spec.step import PhaseTimer

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
