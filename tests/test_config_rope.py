"""Config parsing for every Kimi flavour, YaRN frequencies and softmax scale against the reference values."""

import math
import re

import pytest
import torch

from k26.config import K26_TEXT_CONFIG, ConfigError, ModelConfig
from k26.model.rope import Rope, yarn_inv_freq
from k26.tiny import quantization_config


def k26_config(**text_changes):
    text = K26_TEXT_CONFIG | text_changes | {"quantization_config": quantization_config()}
    return {"model_type": "kimi_k25", "text_config": text, "eos_token_id": 163585}


def test_k26_nesting():
    cfg = ModelConfig.from_dict(k26_config())
    assert cfg.quant.int4 and cfg.num_hidden_layers == 61 and cfg.latent_dim == 576
    assert math.isclose(cfg.softmax_scale, 0.1446796, rel_tol=1e-6)


def test_rope_parameters_key_is_accepted():
    text = dict(K26_TEXT_CONFIG)
    rp = dict(text.pop("rope_scaling"), rope_type="yarn", rope_theta=text.pop("rope_theta"))
    rp.pop("type")
    cfg = ModelConfig.from_dict(k26_config() | {"text_config": text | {"rope_parameters": rp}})
    assert cfg.rope.factor == 64 and cfg.rope.theta == 50000.0


def test_k2_instruct_scale():
    raw = K26_TEXT_CONFIG | {
        "max_position_embeddings": 131072,
        "rope_scaling": K26_TEXT_CONFIG["rope_scaling"] | {"factor": 32.0},
    }
    assert math.isclose(ModelConfig.from_dict(raw).softmax_scale, 0.1308608, rel_tol=1e-6)


@pytest.mark.parametrize(
    "i,k25,k2",
    [
        (9, 4.377666e-2, 4.768861e-2),
        (14, 4.465849e-3, 8.794287e-3),
        (19, 1.583750e-4, 1.621760e-3),
        (20, 1.807023e-5, 3.614047e-5),
        (31, 4.382206e-7, 8.764413e-7),
    ],
)
def test_yarn_inv_freq_reference_values(i, k25, k2):
    r25 = ModelConfig.from_dict(K26_TEXT_CONFIG).rope
    raw = K26_TEXT_CONFIG | {
        "max_position_embeddings": 131072,
        "rope_scaling": K26_TEXT_CONFIG["rope_scaling"] | {"factor": 32.0, "beta_fast": 1.0},
    }
    r2 = ModelConfig.from_dict(raw).rope
    assert math.isclose(yarn_inv_freq(r25, 64)[i].item(), k25, rel_tol=1e-5)
    assert math.isclose(yarn_inv_freq(r2, 64)[i].item(), k2, rel_tol=1e-5)


def test_rope_rotates_interleaved_pairs():
    rope = Rope(ModelConfig.from_dict(K26_TEXT_CONFIG).rope, 64)
    x = torch.randn(64)
    y = rope(x, torch.tensor(7))
    ang = 7 * rope.inv_freq[3]
    x0, x1 = x[6], x[7]
    assert torch.allclose(
        y[6:8], torch.stack([x0 * ang.cos() - x1 * ang.sin(), x0 * ang.sin() + x1 * ang.cos()])
    )


def test_latent_norm_eps_switch():
    cfg = ModelConfig.from_dict(K26_TEXT_CONFIG)
    assert cfg.latent_norm_eps == 1e-5
    assert ModelConfig.from_dict(K26_TEXT_CONFIG, latent_norm_eps_mode="hf_default").latent_norm_eps == 1e-6
    with pytest.raises(ConfigError, match="latent_norm_eps_mode='x'"):
        ModelConfig.from_dict(K26_TEXT_CONFIG, latent_norm_eps_mode="x")


def test_k26_tp8_shapes_are_legal():
    ModelConfig.from_dict(k26_config()).check_tp(8)
    with pytest.raises(ConfigError, match="tensor-parallel size 3"):
        ModelConfig.from_dict(k26_config()).check_tp(3)


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"rope_scaling": "yarn"}, "rope_scaling='yarn': expected an object"),
        ({"rope_theta": 1.0}, "rope_theta=1.0"),
        ({"rope_theta": "50000"}, "rope_theta='50000'"),
        ({"rms_norm_eps": float("inf")}, "rms_norm_eps=inf"),
        ({"routed_scaling_factor": float("inf")}, "routed_scaling_factor=inf"),
        ({"norm_topk_prob": "false"}, "norm_topk_prob='false'"),
        ({"bos_token_id": "1"}, "bos_token_id='1'"),
        # (found in a bug hunt: any eos_token_id loaded and was shown as the model's)
        ({"eos_token_id": "abc"}, "eos_token_id=['abc']: expected a token id"),
        ({"eos_token_id": [[2]]}, "eos_token_id=[[2]]: expected a token id"),
        ({"eos_token_id": -5}, "eos_token_id=[-5]: expected a token id"),
        ({"eos_token_id": True}, "eos_token_id=[True]: expected a token id"),
        ({"quantization_config": "int4"}, "quantization_config='int4'"),
        ({"n_group": 64, "topk_group": 1}, "topk_group=1"),  # 6 experts a group, top-8
        (
            {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0}},
            "original_max_position_embeddings=0",
        ),
        (
            {"rope_scaling": {"type": "yarn", "factor": -4.0, "original_max_position_embeddings": 256}},
            "factor=-4.0",
        ),
        (
            {
                "rope_scaling": {
                    "type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 256,
                    "beta_fast": "abc",
                }
            },
            "beta_fast='abc'",
        ),
    ],
)
def test_bad_config_fields_are_named(change, needle):
    """Each field of a bad config.json named in one ConfigError (they were tracebacks, math errors, or taken
    as valid: an infinite eps, "false" read as true, groups holding fewer experts than top-k)."""
    text = k26_config()["text_config"]
    with pytest.raises(ConfigError, match=re.escape(needle)):
        ModelConfig.from_dict(k26_config() | {"text_config": text | change})


def test_config_json_that_is_not_an_object_is_named(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must hold a JSON object, not a list"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        ModelConfig.from_dir(tmp_path)


def test_yarn_fields_without_the_type_are_refused_not_taken_for_plain_rope():
    rs = dict(K26_TEXT_CONFIG["rope_scaling"])
    rs.pop("type", None), rs.pop("rope_type", None)
    with pytest.raises(ConfigError, match="rope_scaling has YaRN's fields but no 'type'"):
        ModelConfig.from_dict(K26_TEXT_CONFIG | {"rope_scaling": rs})


@pytest.mark.parametrize("value", [False, None])
def test_rope_interleave_false_is_refused(value):
    """transformers' DeepseekV3 rotates (x[i], x[i + P/2]) when rope_interleave is false, or null (it tests
    the field's truth); k26's RoPE (and its kernels) rotate interleaved pairs only, so such a config must be
    refused (false was taken silently until a fix, null until 2026-12-06: on a tiny checkpoint the logits
    differed from transformers' by 46-49 %)."""
    with pytest.raises(ConfigError, match=re.escape(f"rope_interleave={value!r} is not supported")):
        ModelConfig.from_dict(K26_TEXT_CONFIG | {"rope_interleave": value})
    assert ModelConfig.from_dict(K26_TEXT_CONFIG | {"rope_interleave": True}).rope.factor == 64
    no_key = {k: v for k, v in K26_TEXT_CONFIG.items() if k != "rope_interleave"}
    assert ModelConfig.from_dict(no_key).rope.factor == 64  # absent: transformers' default, True


@pytest.mark.parametrize("value", [False, None, 0])
def test_a_yarn_without_truncation_is_refused(value):
    """rope_scaling.truncate false makes transformers' YaRN skip the correction range's floor / ceil, which
    k26 always applies (the field was ignored: 0.5 % off transformers' logits on a tiny checkpoint)."""
    rs = dict(K26_TEXT_CONFIG["rope_scaling"], truncate=value)
    with pytest.raises(ConfigError, match=re.escape(f"rope_scaling.truncate={value!r} is not supported")):
        ModelConfig.from_dict(K26_TEXT_CONFIG | {"rope_scaling": rs})
    rs["truncate"] = True
    assert ModelConfig.from_dict(K26_TEXT_CONFIG | {"rope_scaling": rs}).rope.factor == 64


@pytest.mark.parametrize(
    "rope_changes,multiplier",
    [
        ({"mscale_all_dim": None}, 0.1 * math.log(64) + 1),  # DeepSeek's default mscale_all_dim 0
        ({"mscale_all_dim": 0.0}, 0.1 * math.log(64) + 1),
        ({"mscale_all_dim": 0.5}, (0.1 * math.log(64) + 1) / (0.05 * math.log(64) + 1)),
        ({"mscale": 0.0}, 1 / (0.1 * math.log(64) + 1)),  # mscale(f, 0) is 1
    ],
)
def test_yarn_cos_sin_multiplier_other_than_one_is_refused(rope_changes, multiplier):
    """The reference YaRN multiplies RoPE's cos and sin by mscale(f, mscale) / mscale(f, mscale_all_dim)
    (modeling_deepseek.py; transformers' attention_factor). k26 applies no multiplier (its kernels rope
    q_pe and k_pe unscaled), so a config where it is not 1 must be refused; it was taken silently (tiny
    checkpoint, no mscale_all_dim: logits 24 % off transformers')."""
    rs = {k: v for k, v in (K26_TEXT_CONFIG["rope_scaling"] | rope_changes).items() if v is not None}
    with pytest.raises(ConfigError, match=re.escape(f"{multiplier:.6g}")):
        ModelConfig.from_dict(K26_TEXT_CONFIG | {"rope_scaling": rs})


@pytest.mark.parametrize(
    "rope_changes",
    [
        {"mscale": 0.707, "mscale_all_dim": 0.707},  # DeepSeek-V2's: the ratio is 1
        {"factor": 1.0, "mscale_all_dim": 0.0},  # no extension: mscale(1, m) is 1 for every m
    ],
)
def test_yarn_cos_sin_multiplier_of_one_is_accepted(rope_changes):
    rs = K26_TEXT_CONFIG["rope_scaling"] | rope_changes
    max_pos = int(rs["factor"] * rs["original_max_position_embeddings"])
    cfg = ModelConfig.from_dict(K26_TEXT_CONFIG | {"rope_scaling": rs, "max_position_embeddings": max_pos})
    assert cfg.rope.attention_factor == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize(
    "rope_changes,named",
    [
        ({"mscale": None}, "mscale=None"),  # DeepSeek: mscale 1, ratio 1; transformers: mscale(64, 1) = 1.42
        ({"mscale": 0.0, "mscale_all_dim": 0.0}, "mscale=0.0"),  # DeepSeek 1; transformers 1.42
        ({"attention_factor": 2.0}, "attention_factor=2.0"),  # transformers takes it as given
    ],
)
def test_yarn_fields_transformers_reads_otherwise_are_refused(rope_changes, named):
    """Where DeepSeek's reference multiplier is 1 but transformers' (_compute_yarn_parameters) is not, the
    checkpoint means two things: refused, naming the field (these loaded silently)."""
    rs = {k: v for k, v in (K26_TEXT_CONFIG["rope_scaling"] | rope_changes).items() if v is not None}
    with pytest.raises(ConfigError, match=re.escape(named)):
        ModelConfig.from_dict(K26_TEXT_CONFIG | {"rope_scaling": rs})
    rs_one = K26_TEXT_CONFIG["rope_scaling"] | {"attention_factor": 1.0}  # an explicit 1 is what k26 does
    assert ModelConfig.from_dict(K26_TEXT_CONFIG | {"rope_scaling": rs_one}).rope.factor == 64


@pytest.mark.parametrize(
    "field", ["n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob", "first_k_dense_replace"]
)
def test_a_routing_field_left_out_is_named_not_defaulted(field):
    # Readers disagree on these fields' defaults (transformers: n_group 8, topk_group 4, scale 2.5, 3 dense
    # layers; DeepSeek's reference: no renormalisation, scale 1.0, no dense layer): guessing routes silently
    # differently from one of them.
    text = {k: v for k, v in K26_TEXT_CONFIG.items() if k != field}
    with pytest.raises(ConfigError, match=f"{field} is missing from config.json"):
        ModelConfig.from_dict(
            k26_config() | {"text_config": text | {"quantization_config": quantization_config()}}
        )


def test_drafter_rope_fields_are_not_held_to_the_targets_reading():
    # The drafter's YaRN factor is its own setting (rope_attention_factor, 0.1 ln f + 1 by default): its
    # rope_scaling without mscale loaded before the target's check (2b14277) and must still
    import json

    from k26.drafter_config import DrafterConfig
    from k26.embedded import default_drafter_dir

    raw = json.loads((default_drafter_dir() / "config.json").read_text())
    rs = raw.get("rope_scaling") or {}
    if rs.get("factor", 1) <= 1:
        pytest.skip("the embedded drafter has no YaRN extension")
    raw["rope_scaling"] = {k: v for k, v in rs.items() if k != "mscale"} | {"mscale_all_dim": 1.0}
    assert DrafterConfig.from_dict(raw).rope.factor == rs["factor"]


@pytest.mark.parametrize("eos", [163585, [163585, 163586], None, []])
def test_eos_token_ids_as_real_configs_write_them_load(tmp_path, eos):
    """An id or a list of ids (K2: 163585; K2.5 / K2.6 lists), null or none at all: what the check takes."""
    from k26.config import ModelConfig
    from k26.tiny import DEFAULT_SIZES, text_config

    raw = text_config(DEFAULT_SIZES | {"base_vocab": 163584}, 163584, "none") | {"eos_token_id": eos}
    want = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    assert ModelConfig.from_dict(raw).eos_token_ids == want
