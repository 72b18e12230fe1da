"""Phase stamps of the MLA tree attention inside a graph-replayed K2.6 step, beside the same op alone: why
the attention adds more to the decode step's path than its standalone time (bench_k26's kernel table).
Needs the whole ops library built with -DK26_ATTN_TRACE (K26_OPS_LIB, e.g. `K26_OPS_DEFINES=-DK26_ATTN_TRACE
SNAP_ARCH=sm_90a bash profiling/snapshot.sh HEAD .snapT`). The table keeps the step's last attention launch
(row tile 0, every split); µs from the first block resident:

    K26_OPS_LIB=... python profiling/debug/attn_step_trace.py [--n 1] [--ctx 4096] [--layers 3] [--compile]
"""

import argparse
import ctypes
import os
import sys
from pathlib import Path

import torch
from phases import print_table, read_tables

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from k26_scale import K26_TEXT, randomize, token_ids
from timing import capture

from k26.config import ModelConfig
from k26.model import AttnBatch, KimiK2, TPInfo
from k26.model.moe import Router

NAMES = {
    8: "resident",
    9: "wait returned",
    0: "Q issued",
    1: "Q in registers",
    2: "key loop done",
    3: "barrier passed",
    7: "share merged",
}

ap = argparse.ArgumentParser()
ap.add_argument("--n", type=int, default=1)
ap.add_argument("--ctx", type=int, default=4096)
ap.add_argument("--layers", type=int, default=3)
ap.add_argument("--compile", action="store_true")
ap.add_argument("--reps", type=int, default=5)
a = ap.parse_args()
lib = ctypes.CDLL(os.environ["K26_OPS_LIB"])  # the library the ops load: one trace table
dev = torch.device("cuda")
cfg = ModelConfig.from_dict(K26_TEXT | {"num_hidden_layers": a.layers})
tp = TPInfo(0, 8, all_reduce=lambda x: x, all_gather=lambda x: x)
with torch.device("meta"):
    model = KimiK2(cfg, torch.bfloat16, tp).requires_grad_(False)
model.to_empty(device=dev)
randomize(model, False)
model.rope.reset_buffers()
model.eval()
for m in model.modules():
    if isinstance(m, Router):
        m.fuse_()
model.fuse_dense_()
cache = torch.randn(a.layers, 1, a.ctx + 512, cfg.latent_dim, dtype=torch.bfloat16, device=dev)
rows, start = torch.zeros(1, dtype=torch.long, device=dev), torch.full((1,), a.ctx, device=dev)
ids = token_ids(a.n, cfg.vocab_size, dev)
anc = torch.ones(a.n, a.n, dtype=torch.bool, device=dev).tril()[None]
batch = AttnBatch.tree(start, anc, rows, static=True)


def step():
    h, _ = model(ids, batch, cache)
    model.logits(h)


# The op alone: the last layer's own arguments, recorded in one eager step (before compiling: the op is
# looked up at call time), then captured on its own (PDL on, nothing before it).
captured: dict = {}
orig = torch.ops.k26.mla_tree_attention


def spy(*args, **kwargs):
    captured["args"], captured["kwargs"] = args, kwargs
    return orig(*args, **kwargs)


torch.ops.k26.mla_tree_attention = spy
try:
    step()
finally:
    torch.ops.k26.mla_tree_attention = orig
if a.compile:
    for layer in model.layers:
        layer.compile(dynamic=False)


def alone():
    orig(*captured["args"], **captured["kwargs"])


flush = torch.ones(64 << 20, device=dev)  # 256 MB read before each replay: cold L2
for label, g in (("in the step", capture(step)), ("alone", capture(alone))):
    tables = []
    for _ in range(a.reps):
        flush.sum()
        assert lib.k26_mla_tree_attn_trace_reset() == 0
        torch.cuda.synchronize()
        g.replay()
        torch.cuda.synchronize()
        tables.append(read_tables(lib.k26_mla_tree_attn_trace)[0])
    t = tables[len(tables) // 2]
    t0 = float(t[:, 8][t[:, 8] > 0].min())
    print(f"\n{label}: N = {a.n}, L = {a.ctx}, {a.layers} layers, splits traced {int((t[:, 0] > 0).sum())}")
    print_table(t, NAMES, t0)
