"""Config parsing for every Kimi flavour, YaRN frequencies and softmax scale against the reference values."""

import math

import pytest
import torch

from k26.config import ConfigError, ModelConfig
from k26.model.rope import Rope, yarn_inv_freq
from k26.tiny import quantization_config

K26_TEXT = {
    "vocab_size": 163840,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 64,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.827,
    "norm_topk_prob": True,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 262144,
    "rope_theta": 50000.0,
    "num_nextn_predict_layers": 0,
    "model_type": "kimi_k2",
    "rope_scaling": {
        "type": "yarn",
        "factor": 64.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
}


def k26_config(**text_changes):
    text = K26_TEXT | text_changes | {"quantization_config": quantization_config()}
    return {"model_type": "kimi_k25", "text_config": text, "eos_token_id": 163585}


def test_k26_nesting():
    cfg = ModelConfig.from_dict(k26_config())
    assert cfg.quant.int4 and cfg.num_hidden_layers == 61 and cfg.latent_dim == 576
    assert math.isclose(cfg.softmax_scale, 0.1446796, rel_tol=1e-6)


def test_rope_parameters_key_is_accepted():
    text = dict(K26_TEXT)
    rp = dict(text.pop("rope_scaling"), rope_type="yarn", rope_theta=text.pop("rope_theta"))
    rp.pop("type")
    cfg = ModelConfig.from_dict(k26_config() | {"text_config": text | {"rope_parameters": rp}})
    assert cfg.rope.factor == 64 and cfg.rope.theta == 50000.0


def test_k2_instruct_scale():
    raw = K26_TEXT | {
        "max_position_embeddings": 131072,
        "rope_scaling": K26_TEXT["rope_scaling"] | {"factor": 32.0},
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
    r25 = ModelConfig.from_dict(K26_TEXT).rope
    raw = K26_TEXT | {
        "max_position_embeddings": 131072,
        "rope_scaling": K26_TEXT["rope_scaling"] | {"factor": 32.0, "beta_fast": 1.0},
    }
    r2 = ModelConfig.from_dict(raw).rope
    assert math.isclose(yarn_inv_freq(r25, 64)[i].item(), k25, rel_tol=1e-5)
    assert math.isclose(yarn_inv_freq(r2, 64)[i].item(), k2, rel_tol=1e-5)


def test_rope_rotates_interleaved_pairs():
    rope = Rope(ModelConfig.from_dict(K26_TEXT).rope, 64)
    x = torch.randn(64)
    y = rope(x, torch.tensor(7))
    ang = 7 * rope.inv_freq[3]
    x0, x1 = x[6], x[7]
    assert torch.allclose(
        y[6:8], torch.stack([x0 * ang.cos() - x1 * ang.sin(), x0 * ang.sin() + x1 * ang.cos()])
    )


def test_latent_norm_eps_switch():
    cfg = ModelConfig.from_dict(K26_TEXT)
    assert cfg.latent_norm_eps == 1e-5
    assert ModelConfig.from_dict(K26_TEXT, latent_norm_eps_mode="hf_default").latent_norm_eps == 1e-6
    with pytest.raises(ConfigError, match="latent_norm_eps_mode='x'"):
        ModelConfig.from_dict(K26_TEXT, latent_norm_eps_mode="x")


def test_k26_tp8_shapes_are_legal():
    ModelConfig.from_dict(k26_config()).check_tp(8)
    with pytest.raises(ConfigError, match="tensor-parallel size 3"):
        ModelConfig.from_dict(k26_config()).check_tp(3)
