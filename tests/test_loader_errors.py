"""(e) Every way a checkpoint can be wrong gives one clear error naming the offending item."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from k26 import LLM, CheckpointError, ConfigError
from k26.loader import load_model
from k26.model import TPInfo


def edit_shard(d, key, fn):
    """Apply fn(tensors) to the shard holding `key` and rewrite the index to match."""
    index_file = d / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    fname = index["weight_map"][key]
    tensors = load_file(str(d / fname))
    fn(tensors)
    save_file(tensors, str(d / fname), metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != fname} | {
        k: fname for k in tensors
    }
    index_file.write_text(json.dumps(index))


def edit_config(d, fn):
    cfg = json.loads((d / "config.json").read_text())
    fn(cfg)
    (d / "config.json").write_text(json.dumps(cfg))


def load_err(d) -> str:
    with pytest.raises(CheckpointError) as e:
        load_model(d, progress=False)
    return str(e.value)


Q = "language_model.model.layers.1.self_attn.q_a_proj.weight"
PACKED = "language_model.model.layers.2.mlp.experts.5.down_proj.weight_packed"


def test_missing_tensor_is_named(ckpt):
    edit_shard(ckpt, Q, lambda t: t.pop(Q))
    assert "missing tensor model.layers.1.self_attn.q_a_proj.weight" in load_err(ckpt)


def test_missing_expert_is_named(ckpt):
    edit_shard(ckpt, PACKED, lambda t: t.pop(PACKED))
    assert "missing tensor model.layers.2.mlp.experts.5.down_proj.weight_packed" in load_err(ckpt)


def test_unexpected_tensor_is_named(ckpt):
    extra = "language_model.model.layers.1.self_attn.q_proj.weight"
    edit_shard(ckpt, Q, lambda t: t.__setitem__(extra, torch.zeros(2, 2, dtype=torch.bfloat16)))
    assert f"unexpected tensor {extra}" in load_err(ckpt)


def test_wrong_shape_is_named(ckpt):
    edit_shard(ckpt, Q, lambda t: t.__setitem__(Q, t[Q][:-1]))
    msg = load_err(ckpt)
    assert "model.layers.1.self_attn.q_a_proj.weight has shape [63, 128], expected [64, 128]" in msg


def test_wrong_dtype_is_named(ckpt):
    edit_shard(ckpt, PACKED, lambda t: t.__setitem__(PACKED, t[PACKED].to(torch.int64)))
    assert "experts.5.down_proj.weight_packed has dtype I64" in load_err(ckpt)


def test_int4_scales_not_in_bf16_are_named(ckpt):
    """The model keeps int4 scales in bf16: F32 scales were rounded on load, dequantising other weights than
    compressed-tensors does (4.8 % off transformers' logits on a tiny checkpoint)."""
    scale = PACKED.replace("weight_packed", "weight_scale")
    edit_shard(ckpt, scale, lambda t: t.__setitem__(scale, t[scale].float()))
    assert "down_proj.weight_scale has dtype F32, expected one of ['BF16'] (int4 scales" in load_err(ckpt)


def test_float_where_int_expected(ckpt):
    edit_shard(ckpt, Q, lambda t: t.__setitem__(Q, t[Q].to(torch.int32)))
    assert "q_a_proj.weight has dtype I32" in load_err(ckpt)


def test_weight_shape_disagreeing_is_named(ckpt):
    key = PACKED.replace("packed", "shape")
    edit_shard(ckpt, key, lambda t: t.__setitem__(key, torch.tensor([1, 2], dtype=torch.int32)))
    assert "experts.5.down_proj.weight_shape says [1, 2]" in load_err(ckpt)


def test_all_problems_reported_together(ckpt):
    def both(t):
        t.pop(Q)
        t["language_model.model.bogus"] = torch.zeros(1)

    edit_shard(ckpt, Q, both)
    with pytest.raises(CheckpointError) as e:
        load_model(ckpt, progress=False)
    assert len(e.value.problems) == 2


def test_corrupt_shard(ckpt):
    shard = ckpt / "model-00002-of-00003.safetensors"
    shard.write_bytes(b"\xff" * 64 + shard.read_bytes()[64:])
    assert "shard model-00002-of-00003.safetensors is corrupt" in load_err(ckpt)


def test_truncated_shard(ckpt):
    shard = ckpt / "model-00001-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:1000])
    assert "model-00001-of-00003.safetensors is corrupt" in load_err(ckpt)


def rewrite_header(shard, fn, tail: bytes = b""):
    """The shard with fn(header dict) applied to its JSON header, its data bytes kept (+ `tail`)."""
    raw = shard.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    fn(header)
    text = json.dumps(header).encode()
    shard.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n :] + tail)


def last_tensor(header) -> dict:
    """The entry whose bytes end the data section."""
    return max((v for k, v in header.items() if k != "__metadata__"), key=lambda v: v["data_offsets"][1])


def two_same_tensors(header) -> tuple[str, str]:
    """Two tensors of one dtype and shape (one may take the other's offsets and still match its size)."""
    seen = {}
    for key, v in header.items():
        if key != "__metadata__":
            sig = (v["dtype"], tuple(v["shape"]))
            if sig in seen:
                return seen[sig], key
            seen[sig] = key
    raise AssertionError("no two tensors alike")


@pytest.mark.parametrize(
    "change,tail,needle",
    [
        # another tensor's offsets: safe_open refuses it; it loaded that tensor's bytes, silently
        (
            lambda h: h[two_same_tensors(h)[1]].update(
                data_offsets=h[two_same_tensors(h)[0]]["data_offsets"]
            ),
            b"",
            "overlaps the tensor before it",
        ),
        (
            lambda h: h[two_same_tensors(h)[0]].update(
                shape=[x + 0.7 for x in h[two_same_tensors(h)[0]]["shape"]]
            ),
            b"",
            "do not hold",
        ),
        (
            lambda h: h[two_same_tensors(h)[0]].update(
                data_offsets=[float(x) for x in h[two_same_tensors(h)[0]]["data_offsets"]]
            ),
            b"",
            "do not hold",
        ),
        (lambda h: None, b"\0" * 16, "trailing bytes"),
        # the last tensor moved 16 bytes on (the file grown to hold it): a gap no tensor covers
        (
            lambda h: last_tensor(h).update(data_offsets=[x + 16 for x in last_tensor(h)["data_offsets"]]),
            b"\0" * 16,
            "leaves a hole of 16 bytes before it",
        ),
    ],
    ids=["overlap", "float-shape", "float-offsets", "trailing", "hole"],
)
def test_a_header_that_does_not_tile_its_data_is_named(ckpt, change, tail, needle):
    shard = ckpt / "model-00002-of-00003.safetensors"
    rewrite_header(shard, change, tail)
    err = load_err(ckpt)
    assert "model-00002-of-00003.safetensors is corrupt" in err and needle in err


def test_an_unreadable_shard_is_not_called_corrupt(ckpt, monkeypatch):
    import k26.checkpoint_index

    real = k26.checkpoint_index.read_header

    def denied(f):
        if f.name == "model-00002-of-00003.safetensors":
            raise PermissionError(13, "Permission denied")
        return real(f)

    monkeypatch.setattr(k26.checkpoint_index, "read_header", denied)
    err = load_err(ckpt)
    assert "shard model-00002-of-00003.safetensors cannot be read: Permission denied" in err
    assert "corrupt" not in err


def test_missing_shard_file(ckpt):
    (ckpt / "model-00003-of-00003.safetensors").unlink()
    assert "shard model-00003-of-00003.safetensors named by the index is missing" in load_err(ckpt)


def test_index_names_tensor_absent_from_shard(ckpt):
    index_file = ckpt / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"]["language_model.model.layers.0.ghost"] = "model-00001-of-00003.safetensors"
    index_file.write_text(json.dumps(index))
    assert "language_model.model.layers.0.ghost is listed in the index" in load_err(ckpt)


def test_single_file_checkpoint_loads(tiny_bf16):
    # tiny_bf16 has one shard; without the index the loader reads *.safetensors directly.
    d = tiny_bf16.parent / "single"
    shutil.copytree(tiny_bf16, d)
    (d / "model.safetensors.index.json").unlink()
    assert load_model(d, progress=False).cfg.quant.kind == "none"


def test_vision_tensors_are_skipped(tiny_k25):
    names = json.loads((tiny_k25 / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(n.startswith("vision_tower.") for n in names)
    load_model(tiny_k25, progress=False)


@pytest.mark.parametrize(
    "edit,needle",
    [
        (lambda c: c.update(model_type="llama"), "model_type 'llama' is not supported"),
        (lambda c: c.pop("model_type"), "config.json lacks model_type"),  # (it said "model_type None")
        (lambda c: c["text_config"].pop("hidden_size"), "text_config.hidden_size is missing"),
        (lambda c: c["text_config"].update(num_hidden_layers=-1), "text_config.num_hidden_layers=-1"),
        (lambda c: c["text_config"].update(scoring_func="softmax"), "text_config.scoring_func='softmax'"),
        (lambda c: c["text_config"]["rope_scaling"].update(type="linear"), "rope_scaling.type='linear'"),
        (lambda c: c["text_config"]["rope_scaling"].update(factor=3.0), "rope_scaling.factor=3.0 disagrees"),
        (lambda c: c["text_config"].update(num_experts_per_tok=99), "num_experts_per_tok=99"),
        (lambda c: c["text_config"].update(n_group=3), "n_group=3"),
        (
            lambda c: c["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"].update(
                group_size=128
            ),
            "weights.group_size=128",
        ),
        (
            lambda c: c["text_config"].update(quantization_config={"quant_method": "fp8"}),
            "quant_method='fp8'",
        ),
        (
            lambda c: c["text_config"].update(quantization_config={"quant_method": "awq"}),
            "quant_method='awq'",
        ),
        (lambda c: c["text_config"].update(num_nextn_predict_layers=1), "num_nextn_predict_layers=1"),
    ],
)
def test_bad_config_is_named(ckpt, edit, needle):
    edit_config(ckpt, edit)
    with pytest.raises(ConfigError) as e:
        LLM(ckpt, device="cpu", progress=False)
    assert needle in str(e.value)


def test_config_not_json(ckpt):
    (ckpt / "config.json").write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        LLM(ckpt, device="cpu", progress=False)


def test_no_such_directory(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        LLM(tmp_path / "nope", device="cpu", progress=False)


@pytest.mark.parametrize("weight_map", [["a"], {"model.norm.weight": 3}, {"model.norm.weight": None}])
def test_index_whose_weight_map_is_not_names_to_shards_is_named(ckpt, weight_map):
    index_file = ckpt / "model.safetensors.index.json"
    index_file.write_text(json.dumps({"weight_map": weight_map}))
    assert "weight_map must map tensor names to shard names" in load_err(ckpt)


def test_index_with_an_empty_weight_map_is_named(ckpt):
    """Was reported as 'the config says 3 layers, the checkpoint has tensors for 0'."""
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    assert "model.safetensors.index.json: weight_map is empty" in load_err(ckpt)


def test_config_and_checkpoint_disagree(ckpt):
    # A config that promises more layers than the weights hold: said in one line, with what the weights hold.
    edit_config(ckpt, lambda c: c["text_config"].update(num_hidden_layers=4))
    said = "the config says 4 layers (num_hidden_layers), the checkpoint has tensors for 3 (layers 0 to 2)"
    assert said in load_err(ckpt)


def test_an_absurd_layer_count_is_refused_before_the_model_is_built(ckpt, monkeypatch):
    """200000 layers: minutes building the meta model and listing ~22 million missing tensors (measured in
    the commit); the index says at once that it holds 3."""
    import k26.loader

    def no_build(*a, **kw):
        raise AssertionError("the model was built before its layer count was checked against the checkpoint")

    monkeypatch.setattr(k26.loader, "KimiK2", no_build)
    edit_config(ckpt, lambda c: c["text_config"].update(num_hidden_layers=200000))
    said = "the config says 200000 layers (num_hidden_layers), the checkpoint has tensors for 3"
    assert said in load_err(ckpt)


def test_more_routed_experts_than_the_checkpoint_holds_are_named(ckpt):
    edit_config(ckpt, lambda c: c["text_config"].update(n_routed_experts=64))
    said = "the config says 64 routed experts (n_routed_experts), the checkpoint has tensors for 16"
    assert f"{said} (experts 0 to 15)" in load_err(ckpt)


def test_missing_and_unexpected_tensors_are_counted_by_kind_in_bounded_lines(ckpt):
    """A config without the quantization block over int4 weights: every expert's bf16 weight missing and its
    packed / scale / shape unexpected; the first few named and the rest counted by kind (was a line each)."""
    from k26.checkpoint_index import Tally

    edit_config(ckpt, lambda c: [d.pop("quantization_config") for d in (c, c["text_config"])])
    with pytest.raises(CheckpointError) as e:
        load_model(ckpt, progress=False)
    assert len(e.value.problems) == 2 * (Tally.SHOWN + 1)
    experts = 16 * 2  # two MoE layers of 16 experts
    said = str(e.value)
    assert (
        f"... {3 * experts} missing tensors in all, by kind: {experts} x model.layers.*.mlp.experts.*."
        in said
    )
    assert f"... {9 * experts} unexpected tensors in all, by kind: {experts} x language_model.model" in said


def test_tp_size_that_does_not_divide(tiny_k25):
    with pytest.raises(ConfigError, match="size 3 does not divide num_attention_heads=4, .*vocab_size=640"):
        load_model(tiny_k25, tp=TPInfo(0, 3), progress=False)


def test_tp_size_that_splits_int4_groups(tiny_k25):
    # moe_intermediate_size 64 / 2 = 32 keeps groups; / 4 = 16 would cut a group of 32.
    with pytest.raises(
        ConfigError, match="size 4 does not divide moe_intermediate_size=64 .*splits an int4 group"
    ):
        load_model(tiny_k25, tp=TPInfo(0, 4), progress=False)


def test_drafter_file_problems_are_named_before_the_target_is_read(
    tiny_k25, drafter_dir, tmp_path, monkeypatch
):
    """A drafter tensor missing, or one held both with and without the `model.` prefix (one copy silently
    won): CheckpointError before the target's weights are read (at K2.6 scale, minutes)."""
    import k26.engine

    def no_load(*a, **kw):
        raise AssertionError("the target was read before the drafter's files were checked")

    monkeypatch.setattr(k26.engine, "load_model", no_load)
    d = tmp_path / "drafter"
    shutil.copytree(drafter_dir, d)
    [shard] = d.glob("*.safetensors")
    tensors = load_file(str(shard))
    name = next(k for k in tensors if k.endswith("norm.weight") and not k.startswith("model."))
    save_file({k: v for k, v in tensors.items() if k != name}, str(shard))
    with pytest.raises(CheckpointError, match=f"missing tensor {name}"):
        LLM(tiny_k25, drafter=d, device="cpu", progress=False)
    save_file({**tensors, "model." + name: torch.zeros_like(tensors[name])}, str(shard))
    with pytest.raises(CheckpointError, match=f"tensor {name} appears twice"):
        LLM(tiny_k25, drafter=d, device="cpu", progress=False)
