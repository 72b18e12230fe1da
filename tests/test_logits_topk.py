"""`torch.ops.k26.logits_topk` on CPU: its reference is a stable descending sort (equal values in column
order, NaN above everything, -0.0 equal to +0.0) plus torch.logsumexp, the vocabulary head's top-k
log-probabilities keep their meaning under the op, schema and fake agree (opcheck), and bad inputs are
named."""

import pytest
import torch

from k26.ops import reference


def test_the_reference_orders_ties_by_column_and_nan_first():
    x = torch.tensor([[0.0, -0.0, 1.0, float("nan"), 1.0, float("-inf"), 2.0]])
    v, i, lse = reference.logits_topk(x, 7)
    assert i.tolist() == [[3, 6, 2, 4, 0, 1, 5]]
    assert torch.equal(v[:, 1:], x[:, i[0, 1:]]) and v[0, 0].isnan()
    assert lse.isnan().all()  # a NaN logit makes the row's log-sum-exp NaN, as torch.logsumexp does


@pytest.mark.parametrize("shape, k", [((7, 300), 5), ((2, 3, 1000), 64), ((1, 9), 9)])
def test_the_op_gives_torch_topk_and_logsumexp_on_distinct_values(shape, k):
    g = torch.Generator().manual_seed(k)
    x = torch.randn(*shape, generator=g) * 3
    v, i, lse = torch.ops.k26.logits_topk(x, k)
    want = x.topk(k, dim=-1)  # distinct random values: no tie for the order to differ on
    assert torch.equal(v, want.values) and torch.equal(i, want.indices)
    assert torch.equal(lse, x.logsumexp(-1))


def test_topk_logprobs_are_the_log_softmax_top_k():
    from k26.model.layers import TPInfo, VocabHead

    g = torch.Generator().manual_seed(3)
    head = VocabHead(200, 16, torch.float32, TPInfo())
    with torch.no_grad():
        head.weight.copy_(torch.randn(200, 16, generator=g))
    x = torch.randn(2, 5, 16, generator=g)
    lp, tok = head.topk_logprobs(x, 9)
    want = torch.log_softmax(x @ head.weight.T, dim=-1).topk(9, dim=-1)
    assert torch.equal(tok, want.indices)
    torch.testing.assert_close(lp, want.values, rtol=0, atol=1e-5)


def test_logits_topk_opcheck():
    x = torch.randn(3, 4, 50)
    op = torch.ops.k26.logits_topk.default
    torch.library.opcheck(op, (x, 6), test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize(
    "x, k, match",
    [
        (torch.zeros(4, 10, dtype=torch.int64), 2, "x must be floating"),
        (torch.tensor(1.0), 1, "x must be floating"),
        (torch.zeros(4, 10), 0, r"k=0 must lie in \[1, 10\]"),
        (torch.zeros(4, 10), 11, r"k=11 must lie in \[1, 10\]"),
    ],
)
def test_bad_inputs_are_named(x, k, match):
    with pytest.raises(ValueError, match=match):
        torch.ops.k26.logits_topk(x, k)
    mode = torch._subclasses.FakeTensorMode()  # the fake refuses them too (torch.compile's tracing)
    fake = mode.from_tensor(x)
    with mode, pytest.raises(ValueError, match=match):
        torch.ops.k26.logits_topk(fake, k)
