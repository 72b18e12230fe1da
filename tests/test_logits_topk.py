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


def tie_and_special_rows() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(3, 5000, generator=g) * 3, -(torch.randint(0, 3, (4, 3000), generator=g).float() / 4)]
    x = torch.randn(2, 1000, generator=g)
    x[0, [5, 900]] = float("nan")
    x[1, ::2], x[1, 1::2] = -0.0, 0.0
    rows.append(x)
    x = torch.full((1, 300), float("-inf"))
    x[0, 7] = float("inf")
    return [*rows, x]


@pytest.mark.parametrize("k", [1, 7, 65, 200])
def test_the_keyed_topk_gives_the_references_order_and_bits(k):
    """The CUDA front door's path for shapes the kernels do not hold (k > 64): torch.topk over unique keys."""
    from k26.ops.topk_cuda import keyed_topk

    for x in tie_and_special_rows():
        got, want = keyed_topk(x, k), reference.logits_topk(x, k)
        assert torch.equal(got[1], want[1])
        assert torch.equal(got[0].view(torch.int32), want[0].view(torch.int32))  # -0.0 and NaN bits too
        torch.testing.assert_close(got[2], want[2], rtol=0, atol=0, equal_nan=True)


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
