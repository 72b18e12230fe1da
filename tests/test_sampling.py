"""The sampler (k26/sampling.py) on the CPU: empirical token frequencies against the exact filtered softmax
(temperature, then top-k, then top-p), and temperatures beyond float32's range."""

import pytest
import torch

from k26 import SamplingParams
from k26.sampling import RowSampling, sample_rows


def filtered_softmax(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """The specification: softmax of logits / temperature over the top_k largest (ties with the k-th kept),
    then the smallest most-probable set whose mass reaches top_p, renormalised."""
    x = logits / sp.temperature
    if sp.top_k:
        x = x.masked_fill(x < x.sort(descending=True).values[min(sp.top_k, x.numel()) - 1], float("-inf"))
    p = torch.softmax(x, -1)
    srt, order = p.sort(descending=True)
    keep = (srt.cumsum(0) - srt) < sp.top_p
    q = torch.zeros_like(p)
    q[order[keep]] = srt[keep]
    return q / q.sum()


@pytest.mark.parametrize(
    "temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 0.8, 0), (1.3, 1.0, 3), (1.0, 0.5, 5), (2.0, 0.95, 6)]
)
def test_sampled_frequencies_follow_the_filtered_softmax(temperature, top_p, top_k):
    g = torch.Generator().manual_seed(1)
    V, n = 8, 40000
    logits = torch.randn(V, generator=g) * 2
    sp = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    noise = torch.empty(n, 1, V).exponential_(1.0, generator=g)
    tok = sample_rows(logits.expand(n, 1, V).clone(), RowSampling.of([sp] * n, "cpu", noise))[:, 0]
    got, want = torch.bincount(tok, minlength=V).float(), filtered_softmax(logits, sp) * n
    kept = want > 0
    assert (got[~kept] == 0).all()
    chi2 = ((got[kept] - want[kept]) ** 2 / want[kept]).sum().item()
    assert chi2 < 24.3, chi2  # df <= 7, p = 0.001


@pytest.mark.parametrize("temperature", [1e30, 1e39, 1.7e308])
def test_a_temperature_beyond_float32_still_filters_and_keeps_banned_tokens_out(temperature):
    """A finite temperature the row's float32 tensor holds as inf divided every logit to 0 (top-k then kept
    the whole vocabulary) and a -inf one (a stop id min_tokens holds back) to NaN, which the race picked:
    such a temperature must sample as a merely huge one does, uniformly over the top-k, never a -inf token."""
    g = torch.Generator().manual_seed(2)
    V, n = 10, 4000
    logits = torch.randn(V, generator=g)
    logits[[0, 4]] = float("-inf")  # held back (min_tokens) or banned
    sp = SamplingParams(temperature=temperature, top_k=3)
    noise = torch.empty(n, 1, V).exponential_(1.0, generator=g)
    tok = sample_rows(logits.expand(n, 1, V).clone(), RowSampling.of([sp] * n, "cpu", noise))[:, 0]
    assert set(tok.tolist()) == set(logits.topk(3).indices.tolist())


def test_stop_token_ids_as_a_tensor_are_taken_as_prompts_are_or_named():
    """(Found in a bug hunt: a 0-d tensor raised torch's 'iteration over a 0-d tensor'; a 1-d one was refused
    as 'must be non-negative integers', its elements being 0-d tensors.)"""
    assert SamplingParams(stop_token_ids=torch.tensor([7, 8])).stop_token_ids == (7, 8)
    for bad in (torch.tensor(7), torch.tensor([1.0]), torch.tensor([[1]]), torch.tensor([True])):
        with pytest.raises(ValueError, match=r"SamplingParams.stop_token_ids=tensor\(.*a 1-d integer tensor"):
            SamplingParams(stop_token_ids=bad)


@pytest.mark.parametrize("stop", [torch.tensor(3), torch.tensor([3]), 3])
def test_stop_strings_that_are_not_strings_are_named(stop):
    """(Found in a bug hunt: a 0-d tensor raised torch's 'iteration over a 0-d tensor', not a ValueError.)"""
    with pytest.raises(ValueError, match=r"SamplingParams.stop=.*must be a string or a list of strings"):
        SamplingParams(stop=stop)


def test_a_sampling_error_survives_pickling_with_its_field():
    # (a TP rank's exception is pickled back to rank 0; the default reduce passed only the message)
    import pickle

    from k26.sampling import SamplingError

    with pytest.raises(SamplingError) as e:
        SamplingParams(top_p=2.0)
    back = pickle.loads(pickle.dumps(e.value))
    assert (type(back), back.field, back.value, str(back)) == (SamplingError, "top_p", 2.0, str(e.value))


def test_stop_strings_are_held_as_plain_str():
    # (a str subclass of the user's __main__ travelled to the TP ranks, which could not unpickle it: the rank
    # died and the LLM was out of step for good)
    class S(str):
        pass

    sp = SamplingParams(stop=[S("ab"), "cd"])
    assert sp.stop == ("ab", "cd") and all(type(s) is str for s in sp.stop)
