"""A drafter directory's files checked against its config before the drafter is built."""

import json
import re
import shutil

import pytest

from k26 import LLM, CheckpointError


def test_an_absurd_drafter_layer_count_is_refused_before_the_drafter_is_built(
    tiny_k25, drafter_dir, tmp_path, monkeypatch
):
    """The target's layer count was checked against its checkpoint before building; the drafter's was not
    (20000 layers: 16 s of meta building, then every missing tensor counted)."""
    import k26.model.drafter

    def no_build(*a, **kw):
        raise AssertionError("the drafter was built before its layer count was checked")

    monkeypatch.setattr(k26.model.drafter, "DFlashDrafter", no_build)
    d = tmp_path / "drafter"
    shutil.copytree(drafter_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | {"num_hidden_layers": 200000}))
    said = (
        "the config says 200000 layers (num_hidden_layers), the checkpoint has tensors for 2 (layers 0 to 1)"
    )
    with pytest.raises(CheckpointError, match=re.escape(said)):
        LLM(tiny_k25, drafter=d, device="cpu", progress=False)


def test_a_drafter_config_with_fewer_layers_than_its_files_is_named(tiny_k25, drafter_dir, tmp_path):
    d = tmp_path / "drafter"
    shutil.copytree(drafter_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | {"num_hidden_layers": 1}))
    with pytest.raises(
        CheckpointError,
        match=re.escape("says 1 layers (num_hidden_layers), the checkpoint has tensors for 2"),
    ):
        LLM(tiny_k25, drafter=d, device="cpu", progress=False)


def test_an_odd_drafter_head_dim_is_named_not_a_torch_broadcast_error(tiny_k25, tmp_path):
    """(Found in a bug hunt: head_dim 31 passed the config and failed inside the rotary tables' build with
    'Attempting to broadcast a dimension of length 15'.)"""
    from k26 import ConfigError
    from k26.tiny import write_tiny_drafter

    d = write_tiny_drafter(tmp_path / "drafter", tiny_k25, head_dim=31)
    with pytest.raises(ConfigError, match="drafter head_dim=31: RoPE rotates pairs of dimensions"):
        LLM(tiny_k25, drafter=d, device="cpu", progress=False)
