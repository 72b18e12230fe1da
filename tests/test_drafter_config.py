"""A DFlash drafter's config: its RoPE attention factor (the legacy rule and transformers' YaRN rule) and
every field checked against the target's before anything is built."""

import json
import shutil

import pytest
import torch

from k26 import LLM
from k26.config import ConfigError


def test_drafter_rope_factor_switch(drafter_dir):
    from k26.drafter_config import DrafterConfig

    legacy = DrafterConfig.from_dir(drafter_dir)
    plain = DrafterConfig.from_dir(drafter_dir, rope_attention_factor="config")
    assert legacy.attention_factor == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)
    assert plain.attention_factor == 1.0


@pytest.mark.parametrize(
    "fields",
    [
        {},  # neither mscale: transformers' 0.1 ln f + 1
        {"mscale_all_dim": 1.0},  # one of the two: the same
        {"mscale": 1.0, "mscale_all_dim": 1.0},  # Kimi's: 1
        {"mscale": 0.707, "mscale_all_dim": 1.0},
        {"attention_factor": 1.3},  # explicit: as given
        {"attention_factor": 1.3, "factor": 1.0},  # at any factor
    ],
)
def test_drafter_config_rope_factor_reads_rope_scaling_as_transformers(fields):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from k26.drafter_config import DrafterConfig
    from k26.embedded import default_drafter_dir

    raw = json.loads((default_drafter_dir() / "config.json").read_text())
    f = fields.get("factor", 4.0)
    orig = int(raw["max_position_embeddings"] / f)
    raw["rope_scaling"] = {"type": "yarn", "factor": f, "original_max_position_embeddings": orig} | fields
    ours = DrafterConfig.from_dict(raw, rope_attention_factor="config").attention_factor
    hf_cfg = transformers.Qwen3Config(
        hidden_size=raw["hidden_size"],
        num_attention_heads=raw["num_attention_heads"],
        head_dim=raw["head_dim"],
        max_position_embeddings=raw["max_position_embeddings"],
        rope_theta=raw["rope_theta"],
        rope_scaling=raw["rope_scaling"] | {"rope_type": "yarn"},
    )
    assert ours == pytest.approx(ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")[1], rel=1e-12)


def test_a_malformed_drafter_attention_factor_is_named():
    from k26.drafter_config import DrafterConfig
    from k26.embedded import default_drafter_dir

    raw = json.loads((default_drafter_dir() / "config.json").read_text())
    raw["rope_scaling"] = dict(raw["rope_scaling"], attention_factor="abc")
    with pytest.raises(ConfigError, match="rope_scaling.attention_factor='abc'"):
        DrafterConfig.from_dict(raw)


@pytest.mark.parametrize(
    "edit,needle",
    [
        (lambda c: c.update(hidden_size=64), "hidden_size 64 != target hidden_size 128"),
        (lambda c: c.update(vocab_size=100), "vocab_size 100 != target"),
        (lambda c: c["dflash_config"].update(target_layer_ids=[1, 9]), "target_layer_ids [9] beyond"),
        (lambda c: c["dflash_config"].update(mask_token_id=5000), "mask_token_id 5000 outside"),
        (lambda c: c.update(block_size=1), "block_size=1"),
        (lambda c: c["dflash_config"].update(mask_token_id=True), "mask_token_id=True"),
        (lambda c: c["dflash_config"].update(target_layer_ids=[True]), "target_layer_ids=[True]"),
        (lambda c: c.pop("dflash_config"), "no 'dflash_config'"),
        (lambda c: c.update(num_target_layers=61), "num_target_layers 61 != target num_hidden_layers"),
        (lambda c: c.update(num_target_layers="6"), "num_target_layers='6'"),
    ],
)
def test_bad_drafter_is_refused(tiny_k25, drafter_dir, tmp_path, edit, needle):
    d = tmp_path / "d"
    shutil.copytree(drafter_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        LLM(tiny_k25, drafter=d, device="cpu", progress=False)
