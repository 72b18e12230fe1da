"""torch.ops.k26.mla_glue_qb on CPU: its reference is mla_glue followed by linear (bitwise, the cache
included); schema and fake agree (opcheck); a bad q_b weight is named; the model with MLA.glue_qb computes
what it computes without (the op's two halves in one launch change no bit)."""

import pytest
import torch
from test_glue_ops import Q, _op_calls, inputs, random_tiny, switch_is_bitwise

import k26.ops  # noqa: F401  (registers the ops)


def q_b_weight(seed: int, n: int = 48, q: int = Q) -> torch.Tensor:
    return torch.randn(n, q, generator=torch.Generator().manual_seed(seed)).bfloat16() * 0.1


def test_reference_is_glue_then_linear_bitwise():
    a, w = inputs(seed=11), q_b_weight(1)
    want_cache = a["cache"].clone()
    want = torch.ops.k26.linear(torch.ops.k26.mla_glue(**(a | {"cache": want_cache})), w)
    got = torch.ops.k26.mla_glue_qb(*a.values(), w)
    assert got.shape == (2, 3, 48)
    assert torch.equal(got, want) and torch.equal(a["cache"], want_cache)


def test_mla_glue_qb_opcheck():
    a = inputs(seed=5)
    args = (*a.values(), q_b_weight(2))
    tests = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.k26.mla_glue_qb.default, args, test_utils=tests)


@pytest.mark.parametrize(
    "w, msg",
    [
        (q_b_weight(3, q=Q + 8), "q_b_weight must be"),
        (q_b_weight(3).float(), "q_b_weight dtype"),
        (q_b_weight(3)[0], "q_b_weight must be"),
    ],
)
def test_bad_q_b_weight_is_named(w, msg):
    with pytest.raises(ValueError, match=f"k26.mla_glue_qb: {msg}"):
        torch.ops.k26.mla_glue_qb(*inputs().values(), w)


def test_glue_input_checks_come_first():
    a = inputs() | {"rows": torch.zeros(3, dtype=torch.long)}
    with pytest.raises(ValueError, match="k26.mla_glue: rows"):
        torch.ops.k26.mla_glue_qb(*a.values(), q_b_weight(4))


def test_model_with_glue_qb_is_bitwise_the_model_without():
    cfg, model = random_tiny(torch.bfloat16, 3)
    model.fuse_dense_()  # q_b in the small-M op: where glue_qb applies
    ids, batch, cache = switch_is_bitwise(cfg, model, "glue_qb", True)
    assert _op_calls(model, ids, batch, cache, "k26::mla_glue_qb") == cfg.num_hidden_layers
    assert _op_calls(model, ids, batch, cache, "k26::mla_glue") == 0
