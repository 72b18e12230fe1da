"""The quantization block's scope, read as compressed-tensors reads `targets` / `ignore`: exactly the routed
experts in int4 (as every K2 release ships), anything else refused at parse time naming the entry; a block at
the top level and one in text_config must agree."""

import re

import pytest

from k26.config import K26_TEXT_CONFIG, ConfigError, ModelConfig
from k26.config_quant import K2_IGNORE
from k26.tiny import quantization_config

P = "text_config.quantization_config"


def parse(targets=("Linear",), ignore=K2_IGNORE, top=None, **text_changes):
    q = quantization_config()
    q["config_groups"]["group_0"]["targets"] = list(targets)
    if ignore is None:
        q.pop("ignore")
    else:
        q["ignore"] = list(ignore) if isinstance(ignore, (list, tuple)) else ignore
    raw = {
        "model_type": "kimi_k25",
        "text_config": K26_TEXT_CONFIG | text_changes | {"quantization_config": q},
    }
    return ModelConfig.from_dict(raw | ({} if top is None else {"quantization_config": top}))


def without(entry):
    return [e for e in K2_IGNORE if e != entry]


@pytest.mark.parametrize(
    "ignore,needle",
    [
        (without("lm_head"), "quantizes the output head (lm_head) and no " + P + ".ignore entry covers it"),
        (without("re:.*self_attn.*"), "quantizes attention (model.layers.0.self_attn.q_a_proj)"),
        (
            without("re:.*shared_experts.*"),
            "quantizes the shared experts (model.layers.1.mlp.shared_experts.",
        ),
        (without(K2_IGNORE[3]), "quantizes the dense MLP (model.layers.0.mlp.gate_proj)"),
        (None, f"{P}.ignore is missing, so compressed-tensors ignores nothing: not supported"),
    ],
    ids=["lm_head", "attention", "shared", "dense", "no-ignore"],
)
def test_a_scope_wider_than_the_routed_experts_is_named(ignore, needle):
    with pytest.raises(
        ConfigError, match=re.escape(f"{P}.config_groups.group_0.targets entry 'Linear' ")
    ) as e:
        parse(ignore=ignore)
    assert needle in str(e.value)


def test_a_scope_leaving_the_routed_experts_bf16_is_named():
    with pytest.raises(ConfigError, match=re.escape(f"{P}.ignore entry 're:.*experts.*' leaves the routed")):
        parse(ignore=[*K2_IGNORE, "re:.*experts.*"])
    with pytest.raises(
        ConfigError, match=r"no .*targets entry \(of \['re:.*gate_proj'\]\) matches the routed"
    ):
        parse(targets=[r"re:.*experts\.\d+\.gate_proj"], ignore=None)


def test_targets_naming_only_the_experts_need_no_ignore_list():
    """Without `ignore` nothing is ignored, but these targets reach only the routed experts."""
    assert parse(targets=[r"re:.*mlp\.experts\..*"], ignore=None).quant.int4


def test_an_ignore_list_of_exact_module_names_is_read_as_compressed_tensors_does():
    """Per-module lists (as some tools write them, here against the nested names): every layer's names
    ignored is the release's scope; the last layer's left out quantizes its attention."""
    layers, names = K26_TEXT_CONFIG["num_hidden_layers"], ["language_model.lm_head"]
    for i in range(layers):
        names += [f"language_model.model.layers.{i}.self_attn.{m}" for m in ("q_a_proj", "q_b_proj")]
        names += [
            f"language_model.model.layers.{i}.self_attn.{m}" for m in ("kv_a_proj_with_mqa", "kv_b_proj")
        ]
        names += [f"language_model.model.layers.{i}.self_attn.o_proj"]
        mlp = "mlp" if i == 0 else "mlp.shared_experts"
        names += [f"language_model.model.layers.{i}.{mlp}.{m}" for m in ("gate_proj", "up_proj", "down_proj")]
    assert parse(ignore=names).quant.int4
    last = f"language_model.model.layers.{layers - 1}."
    with pytest.raises(
        ConfigError, match=re.escape(f"attention (model.layers.{layers - 1}.self_attn.q_a_proj)")
    ):
        parse(ignore=[n for n in names if not n.startswith(last)])


@pytest.mark.parametrize(
    "ignore,needle",
    [
        (["re:(lm_head"], "entry 're:(lm_head' is not a valid regular expression"),
        ("lm_head", "ignore='lm_head'"),
    ],
)
def test_a_malformed_ignore_list_is_named(ignore, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        parse(ignore=ignore)


@pytest.mark.parametrize(
    "top,needle",
    [
        (
            quantization_config() | {"ignore": without("lm_head")},
            "disagree: quantization_config.config_groups.group_0.targets entry 'Linear' quantizes the output",
        ),
        (None, "disagree: the top level says no quantized weights, " + P + " int4 routed experts"),
    ],
    ids=["scope", "null"],
)
def test_quantization_blocks_that_disagree_are_named_with_both_places(top, needle):
    raw = {
        "model_type": "kimi_k25",
        "text_config": K26_TEXT_CONFIG | {"quantization_config": quantization_config()},
    }
    with pytest.raises(ConfigError, match=re.escape(f"quantization_config (top level) and {P} {needle}")):
        ModelConfig.from_dict(raw | {"quantization_config": top})


def test_quantization_blocks_that_differ_only_outside_the_text_model_agree():
    """The same block in both places (the release layout), or the top one also ignoring the vision tower
    (as K2.6's reportedly does) and carrying other metadata: both describe the same text model."""
    assert parse(top=quantization_config()).quant.int4
    vision = quantization_config() | {"ignore": [*K2_IGNORE, "re:.*vision_tower.*", "re:.*mm_projector.*"]}
    assert parse(top=vision | {"global_compression_ratio": None}).quant.int4
