"""A checkpoint's `quantization_config`: the one compressed-tensors scheme k26 runs (int4 pack-quantized,
group 32, symmetric, weight-only) and its scope, read from `targets` / `ignore` as compressed-tensors reads
them: exactly the routed experts, everything else (attention, dense MLP, shared experts, lm_head) bf16, as
every K2 release ships. A wider or narrower scope is refused here, naming the entry, rather than surfacing
at load time as hundreds of missing tensors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from .config_fields import ConfigError


@dataclass(frozen=True)
class QuantConfig:
    """How routed-expert weights are stored: int4 pack-quantized (group 32, symmetric) or bf16."""

    kind: Literal["none", "int4"] = "none"
    group_size: int = 32

    @property
    def int4(self) -> bool:
        return self.kind == "int4"


# K2-Thinking's, K2.5's and K2.6's `ignore` (with `targets: ["Linear"]`): all but the routed experts.
K2_IGNORE = [
    "lm_head",
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
]
_MLP = ("gate_proj", "up_proj", "down_proj")
_ATTN = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
# An nn.Linear's class names as compressed-tensors matches a plain entry against them (its torch MRO).
_LINEAR_CLASSES = frozenset({"Linear", "Module"})


def parse_quant(q: dict[str, Any] | None, prefix: str) -> QuantConfig:
    if q is None:
        return QuantConfig("none")
    p = f"{prefix}quantization_config"
    if not isinstance(q, dict):
        raise ConfigError(f"{p}={q!r}: expected an object")
    method = q.get("quant_method")
    if method == "fp8":
        raise ConfigError(
            f"{p}.quant_method='fp8' (block-FP8 K2-Instruct) is not supported: its ~1 TB of weights does not "
            "fit the 8x96 GB target; use an INT4 release (K2-Thinking, K2.5, K2.6)"
        )
    if method != "compressed-tensors":
        raise ConfigError(f"{p}.quant_method={method!r} is not supported; expected 'compressed-tensors'")
    if q.get("format") != "pack-quantized":
        raise ConfigError(f"{p}.format={q.get('format')!r} is not supported; expected 'pack-quantized'")
    status = q.get("quantization_status", "compressed")
    if status != "compressed":
        raise ConfigError(f"{p}.quantization_status={status!r}: expected 'compressed' weights on disk")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ConfigError(f"{p}.config_groups is missing or empty")
    want = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
    for gname, group in groups.items():
        if not isinstance(group, dict) or not isinstance(group.get("weights") or {}, dict):
            raise ConfigError(f"{p}.config_groups.{gname}: expected an object with a 'weights' object")
        w = group.get("weights") or {}
        for k, v in want.items():
            if w.get(k) != v:
                raise ConfigError(f"{p}.config_groups.{gname}.weights.{k}={w.get(k)!r}: k26 supports {v!r}")
        if w.get("dynamic"):
            raise ConfigError(f"{p}.config_groups.{gname}.weights.dynamic=true is not supported")
        if w.get("actorder") not in (None, False):
            raise ConfigError(
                f"{p}.config_groups.{gname}.weights.actorder={w['actorder']!r} is not supported"
            )
        if group.get("input_activations") is not None:
            raise ConfigError(
                f"{p}.config_groups.{gname}.input_activations: only weight-only (W4A16) is supported"
            )
    return QuantConfig("int4", group_size=32)


def _entries(value: Any, where: str) -> list[tuple[str, str]]:
    """(where, entry) of a targets / ignore list (None: no entries, as compressed-tensors takes it); each
    "re:" entry must compile."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(e, str) for e in value):
        raise ConfigError(
            f"{where}={value!r}: expected a list of module names, class names or 're:' patterns"
        )
    for e in value:
        if e.startswith("re:"):
            try:
                re.compile(e[3:])
            except re.error as err:
                raise ConfigError(f"{where} entry {e!r} is not a valid regular expression ({err})") from err
    return [(where, e) for e in value]


def _matches(entry: str, name: str) -> bool:
    """compressed-tensors' `is_match` for an nn.Linear: a "re:" entry is `re.match`ed against the module's
    name; any other entry must equal the name or one of the module's class names."""
    if entry.startswith("re:"):
        return re.match(entry[3:], name) is not None
    return entry == name or entry in _LINEAR_CLASSES


def _first(entries: list[tuple[str, str]], names: tuple[str, ...]) -> tuple[str, str] | None:
    return next(((w, e) for w, e in entries for n in names if _matches(e, n)), None)


def _modules(layers: int, first_dense: int, shared: bool) -> tuple[list, list]:
    """(kind, names) of modules that must stay bf16, and the routed experts' names, at the layers where a
    per-layer list would go wrong first: each end of the dense and of the MoE layers. Each module has its
    text-model name and the `language_model.`-nested one (either may be what a list was written against)."""

    def forms(name: str) -> tuple[str, str]:
        return name, f"language_model.{name}"

    kept, routed = [("the output head", forms("lm_head"))], []
    for i in sorted(i for i in {0, first_dense - 1, first_dense, layers - 1} if 0 <= i < layers):
        layer = f"model.layers.{i}"
        kept += [("attention", forms(f"{layer}.self_attn.{m}")) for m in _ATTN]
        if i < first_dense:
            kept += [("the dense MLP", forms(f"{layer}.mlp.{m}")) for m in _MLP]
            continue
        if shared:
            kept += [("the shared experts", forms(f"{layer}.mlp.shared_experts.{m}")) for m in _MLP]
        routed += [forms(f"{layer}.mlp.experts.0.{m}") for m in _MLP]
    return kept, routed


def check_quant_scope(q: dict[str, Any], prefix: str, layers: int, first_dense: int, shared: bool) -> None:
    """The block's targets / ignore must quantize exactly the routed experts (see the module docstring)."""
    p = f"{prefix}quantization_config"
    ignore = _entries(q.get("ignore"), f"{p}.ignore")
    targets = [
        t
        for g, group in q["config_groups"].items()
        for t in _entries(group.get("targets"), f"{p}.config_groups.{g}.targets")
    ]
    release = f"K2 releases: targets ['Linear'], ignore {K2_IGNORE}"
    kept, routed = _modules(layers, first_dense, shared)
    for kind, names in kept:
        hit = _first(targets, names)
        if hit is not None and _first(ignore, names) is None:
            why = (
                f"{p}.ignore is missing, so compressed-tensors ignores nothing"
                if q.get("ignore") is None
                else f"no {p}.ignore entry covers it"
            )
            raise ConfigError(
                f"{hit[0]} entry {hit[1]!r} quantizes {kind} ({names[0]}) and {why}: not supported, k26 runs "
                f"only the routed experts in int4 and everything else in bf16 ({release})"
            )
    for names in routed:
        if (hit := _first(ignore, names)) is not None:
            raise ConfigError(
                f"{hit[0]} entry {hit[1]!r} leaves the routed experts ({names[0]}) unquantized, but the "
                f"block promises int4 experts ({release})"
            )
        if _first(targets, names) is None:
            got = [e for _, e in targets]
            raise ConfigError(
                f"no {p}.config_groups.*.targets entry (of {got}) matches the routed experts ({names[0]}), "
                f"so they would not be int4, but the block promises int4 experts ({release})"
            )
