"""(g) The loader's TP shards of world size 2 and 4 reassemble the world-size-1 tensors, each split along the
dimension Megatron-style tensor parallelism prescribes (stated here, independently of the loader's table)."""

import re

import pytest
import torch

from k26.config import ModelConfig
from k26.loader import load_drafter, load_model
from k26.model import TPInfo

# k26 parameter -> split dim of the k26 tensor: column-parallel projections split their output rows,
# row-parallel ones their input columns; the experts' stacked tensors carry the expert index first.
# Anything else replicates.
TARGET_SPLITS = [
    (r"embed_tokens\.weight|lm_head\.weight", 0),  # vocab parallel
    (r".*self_attn\.(q_b_proj|kv_b_proj)\.weight", 0),  # heads
    (r".*self_attn\.o_proj\.weight", 1),
    (r".*mlp\.(shared_experts\.)?(gate_proj|up_proj)\.weight", 0),
    (r".*mlp\.(shared_experts\.)?down_proj\.weight", 1),
    (r".*mlp\.experts\.(gate|up)_(packed|scale|proj)", 1),
    (r".*mlp\.experts\.down_(packed|scale|proj)", 2),
]
DRAFTER_SPLITS = [
    (r".*self_attn\.(q|k|v)_proj\.weight|.*mlp\.(gate|up)_proj\.weight", 0),
    (r".*self_attn\.o_proj\.weight|.*mlp\.down_proj\.weight|fc\.weight", 1),
]


def split_dim(table, name):
    return next((d for rx, d in table if re.fullmatch(rx, name)), None)


def check_reassembles(full, parts, table):
    world, split = len(parts), 0
    for name, ref in full.items():
        dim = split_dim(table, name)
        if dim is None:
            assert all(torch.equal(p[name], ref) for p in parts), name
        else:
            assert parts[0][name].shape[dim] * world == ref.shape[dim], name
            assert torch.equal(torch.cat([p[name] for p in parts], dim=dim), ref), name
            split += 1
    assert split >= 4  # the table above names tensors that exist


@pytest.mark.parametrize("world", [2, 4])
def test_shards_reassemble(tiny_tp, world):
    d = tiny_tp[0]
    full = dict(load_model(d, progress=False).named_parameters())
    parts = [
        dict(load_model(d, tp=TPInfo(r, world), progress=False).named_parameters()) for r in range(world)
    ]
    check_reassembles(full, parts, TARGET_SPLITS)


def test_drafter_shards_reassemble(tiny_tp):
    d, dr = tiny_tp
    cfg = ModelConfig.from_dir(d)
    full = dict(load_drafter(dr, cfg, dtype=torch.float32).named_parameters())
    parts = [
        dict(load_drafter(dr, cfg, dtype=torch.float32, tp=TPInfo(r, 4)).named_parameters()) for r in range(4)
    ]
    check_reassembles(full, parts, DRAFTER_SPLITS)
