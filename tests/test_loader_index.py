"""The shard index and the shards it names, read by k26.checkpoint_index.read_index: spellings of one
shard, names the file system refuses, and a directory without an index whose shard is no regular file; the
layers and routed experts a config promises checked against the tensors the index holds."""

import json
import os
import shutil

import pytest
import torch

from k26 import LLM, CheckpointError
from k26.loader import load_model


def rewrite_index(d, fn):
    index_file = d / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"] = {k: fn(i, v) for i, (k, v) in enumerate(index["weight_map"].items())}
    index_file.write_text(json.dumps(index))


def test_one_shard_under_two_spellings_is_read_once(ckpt, tiny_k25):
    """'x.safetensors' and './x.safetensors' (every other entry): each tensor 'appeared twice' (hundreds of
    problems naming the same file twice); transformers reads it as one file."""
    rewrite_index(ckpt, lambda i, v: f"./{v}" if i % 2 else v)
    got, want = load_model(ckpt, progress=False), load_model(tiny_k25, progress=False)
    a, b = dict(got.named_parameters()), dict(want.named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_shard_name_the_file_system_refuses_is_named_not_raised(ckpt):
    """A 300-character shard name: Path.is_file raised OSError (ENAMETOOLONG), a traceback from LLM()."""
    long = "x" * 300 + ".safetensors"
    rewrite_index(ckpt, lambda i, v: long if i == 0 else v)
    with pytest.raises(ValueError, match=f"shard {long} cannot be read: File name too long"):
        LLM(ckpt, device="cpu", dtype=torch.float32, progress=False)


def test_without_an_index_a_shard_that_is_no_file_is_not_said_to_be_named_by_one(ckpt):
    """A broken link left by an interrupted download: 'named by the index is missing', with no index."""
    (ckpt / "model.safetensors.index.json").unlink()
    os.symlink(ckpt / "nowhere", ckpt / "model-00004-of-00004.safetensors")
    with pytest.raises(
        ValueError, match=r"model-00004-of-00004.safetensors is no regular file \(a broken link"
    ):
        LLM(ckpt, device="cpu", dtype=torch.float32, progress=False)


def test_the_hf_state_reads_the_shards_the_index_names(ckpt, tiny_k25):
    """`k26 bench`'s HF baseline globbed *.safetensors: shards in a subdirectory gave it no tensor at all
    (a RuntimeError from load_state_dict after the k26 runs), and a stray shard beside them was merged in."""
    from k26.hf_state import deepseek_v3_state

    (ckpt / "sub").mkdir()
    for f in ckpt.glob("*.safetensors"):
        os.rename(f, ckpt / "sub" / f.name)
    rewrite_index(ckpt, lambda i, v: f"sub/{v}")
    shutil.copy(ckpt / "sub" / min(p.name for p in (ckpt / "sub").iterdir()), ckpt / "stray.safetensors")
    (_, got), (_, want) = deepseek_v3_state(ckpt, torch.float32), deepseek_v3_state(tiny_k25, torch.float32)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


def test_routed_experts_promised_where_the_checkpoint_holds_none_are_named_at_once(tiny_k25):
    """(Found in a bug hunt: with no expert tensors at all the count went unchecked, and the load plan looped
    over every promised expert first — 45 s for 10**6 — before listing them missing.)"""
    from k26.checkpoint_index import check_layers, read_index
    from k26.config import ModelConfig

    cfg = ModelConfig.from_dir(tiny_k25)
    infos = {k: v for k, v in read_index(tiny_k25).items() if ".mlp.experts." not in k}
    with pytest.raises(
        CheckpointError,
        match=r"the config says 1000000 routed experts \(n_routed_experts\), "
        r"the checkpoint has tensors for 0",
    ):
        check_layers(infos, tiny_k25, cfg.num_hidden_layers, 10**6)
    check_layers(infos, tiny_k25, cfg.num_hidden_layers, 0)  # no MoE layer promised: nothing to hold


def test_an_all_dense_config_promises_no_expert_and_loads(tmp_path):
    """n_routed_experts is set in every config; only a model with an MoE layer promises its experts (the
    check of a checkpoint holding none must not refuse a dense one)."""
    from k26.tiny import write_tiny_checkpoint

    d = write_tiny_checkpoint(tmp_path / "dense", quant="none", num_hidden_layers=2, first_k_dense_replace=2)
    assert not any(
        ".mlp.experts." in k
        for k in json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    )
    assert load_model(d, progress=False).cfg.n_routed_experts > 0
