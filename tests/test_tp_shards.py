"""(g) The loader's TP shards of world size 2 and 4 reassemble the world-size-1 tensors."""

import re

import pytest
import torch

from k26.loader import NAME_TABLE, load_model
from k26.model import TPInfo
from k26.tiny import write_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_tp(tmp_path_factory):
    # moe_intermediate_size 128 keeps whole int4 groups of 32 at TP 4.
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tp"), seed=4, moe_intermediate_size=128, shards=2)


def shard_dim(name):
    for rx, _, dim, stacked in NAME_TABLE:
        if re.fullmatch(rx, name):
            return None if dim is None else dim + int(stacked)
    raise KeyError(name)


@pytest.mark.parametrize("world", [2, 4])
def test_shards_reassemble(tiny_tp, world):
    full = dict(load_model(tiny_tp, progress=False).named_parameters())
    parts = [dict(load_model(tiny_tp, tp=TPInfo(r, world), progress=False).named_parameters()) for r in range(world)]
    for name, ref in full.items():
        dim = shard_dim(name)
        if dim is None:
            assert all(torch.equal(p[name], ref) for p in parts), name
        else:
            assert parts[0][name].shape[dim] * world == ref.shape[dim], name
            assert torch.equal(torch.cat([p[name] for p in parts], dim=dim), ref), name
