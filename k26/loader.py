"""Checkpoint directory -> a loaded (and, for TP, sliced) `KimiK2`.

Reads sharded safetensors (with `model.safetensors.index.json`) or a single file, indexed by
`checkpoint_index` (every shard's header; `CheckpointError`). The model is built on
the meta device, every tensor is checked against it (names, shapes, dtypes, int4 `weight_shape`) before
any storage is allocated, and only then filled: the target through `shard_reader` (planned sequential
reads in 256 MB batches, TP slices on the device, each shard read once across ranks given the group;
never the whole checkpoint in RAM), optionally from `load_cache`. All problems are reported together.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from .checkpoint_index import CheckpointError, Tally, TensorInfo, check_layers, read_index
from .config import ModelConfig
from .drafter_config import DrafterConfig
from .model import KimiK2, TPInfo
from .model.moe import Int4Experts, use_cuda_kernels
from .safetensors_file import file_stamp, read_small
from .shard_reader import read_into
from .stager import ShardChangedError
from .startup import phase_line

_FLOAT = {"BF16", "F16", "F32"}
_INT = {"I32", "I64", "I16", "I8", "U8"}

# The one HF <-> k26 name table. k26 name regex -> (HF name template with \1.. groups and {e} for the
# expert index, the dim split across TP ranks or None, whether the k26 tensor stacks experts on dim 0).
# Shard dims are in HF (per-expert) coordinates: 0 = output rows (column parallel), 1 = input columns.
NAME_TABLE: list[tuple[str, str, int | None, bool]] = [
    (r"embed_tokens\.weight", "model.embed_tokens.weight", 0, False),
    (r"norm\.weight", "model.norm.weight", None, False),
    (r"lm_head\.weight", "lm_head.weight", 0, False),
    (
        r"layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\.weight",
        r"model.layers.\1.\2.weight",
        None,
        False,
    ),
    (
        r"layers\.(\d+)\.self_attn\.(q_a_proj|q_a_layernorm|kv_a_proj_with_mqa|kv_a_layernorm)\.weight",
        r"model.layers.\1.self_attn.\2.weight",
        None,
        False,
    ),
    (
        r"layers\.(\d+)\.self_attn\.(q_b_proj|kv_b_proj)\.weight",
        r"model.layers.\1.self_attn.\2.weight",
        0,
        False,
    ),
    (r"layers\.(\d+)\.self_attn\.o_proj\.weight", r"model.layers.\1.self_attn.o_proj.weight", 1, False),
    (
        r"layers\.(\d+)\.mlp\.(shared_experts\.)?(gate_proj|up_proj)\.weight",
        r"model.layers.\1.mlp.\2\3.weight",
        0,
        False,
    ),
    (
        r"layers\.(\d+)\.mlp\.(shared_experts\.)?down_proj\.weight",
        r"model.layers.\1.mlp.\2down_proj.weight",
        1,
        False,
    ),
    (
        r"layers\.(\d+)\.mlp\.gate\.(weight|e_score_correction_bias)",
        r"model.layers.\1.mlp.gate.\2",
        None,
        False,
    ),
    (
        r"layers\.(\d+)\.mlp\.experts\.(gate|up)_packed",
        r"model.layers.\1.mlp.experts.{e}.\2_proj.weight_packed",
        0,
        True,
    ),
    (
        r"layers\.(\d+)\.mlp\.experts\.(gate|up)_scale",
        r"model.layers.\1.mlp.experts.{e}.\2_proj.weight_scale",
        0,
        True,
    ),
    (
        r"layers\.(\d+)\.mlp\.experts\.down_packed",
        r"model.layers.\1.mlp.experts.{e}.down_proj.weight_packed",
        1,
        True,
    ),
    (
        r"layers\.(\d+)\.mlp\.experts\.down_scale",
        r"model.layers.\1.mlp.experts.{e}.down_proj.weight_scale",
        1,
        True,
    ),
    (
        r"layers\.(\d+)\.mlp\.experts\.(gate|up)_proj",
        r"model.layers.\1.mlp.experts.{e}.\2_proj.weight",
        0,
        True,
    ),
    (r"layers\.(\d+)\.mlp\.experts\.down_proj", r"model.layers.\1.mlp.experts.{e}.down_proj.weight", 1, True),
]
_COMPILED = [(re.compile(k + "$"), hf, dim, stacked) for k, hf, dim, stacked in NAME_TABLE]


@dataclass(frozen=True)
class _Item:
    """One checkpoint tensor that feeds (part of) one model parameter."""

    param: str
    hf: str
    expert: int | None
    dim: int | None


def target_rule(pname: str) -> tuple[str, int | None, bool]:
    """A `KimiK2` parameter -> (HF name, `{e}` for the expert, its TP dim in HF coordinates, stacked)."""
    for rx, hf, dim, stacked in _COMPILED:
        if m := rx.match(pname):
            return m.expand(hf), dim, stacked
    raise AssertionError(f"model parameter {pname} has no entry in the loader's NAME_TABLE")


# Drafter tensors split across TP ranks (dim 0: column parallel, dim 1: row parallel); the rest is replicated.
DRAFTER_SHARDS = [
    (re.compile(r"layers\.\d+\.(self_attn\.(q|k|v)_proj|mlp\.(gate|up)_proj)\.weight$"), 0),
    (re.compile(r"layers\.\d+\.(self_attn\.o_proj|mlp\.down_proj)\.weight$"), 1),
    (re.compile(r"^fc\.weight$"), 1),  # row-parallel (DFlashDrafter)
]


def drafter_rule(pname: str) -> tuple[str, int | None, bool]:
    """A drafter's tensors are named as its modules (the `model.` prefix is stripped when read)."""
    return pname, next((d for rx, d in DRAFTER_SHARDS if rx.search(pname)), None), False


def plan_load(
    model: torch.nn.Module, infos: dict[str, TensorInfo], tp: TPInfo, path: Path, rule=target_rule
) -> list[_Item]:
    """Match every parameter to checkpoint tensors and check names, shapes and dtypes; raise on any problem.
    The one validation path of target and drafter: `rule` maps a parameter to its checkpoint name(s)."""
    items: list[_Item] = []
    problems: list[str] = []
    missing, used = Tally("missing tensor"), set()
    for pname, p in model.named_parameters():
        hf_base, dim, stacked = rule(pname)
        local = tuple(p.shape[1:] if stacked else p.shape)
        full = list(local)
        if dim is not None and tp.size > 1:
            full[dim] *= tp.size
        for e in range(p.shape[0]) if stacked else [None]:
            hf = hf_base.format(e=e) if stacked else hf_base
            info = infos.get(hf)
            if info is None:
                missing.add(hf, f" (for {pname})" if hf != pname else "")
                continue
            used.add(hf)
            if info.shape != tuple(full):
                problems.append(f"tensor {hf} has shape {list(info.shape)}, expected {full}")
            # int4 scales stay bf16 in the model (the kernels' layout): a checkpoint's F32 / F16 scales would
            # be rounded, dequantising other weights than compressed-tensors does
            scale = hf.endswith(".weight_scale")
            want = {"I32"} if p.dtype == torch.int32 else {"BF16"} if scale else _FLOAT
            if info.dtype not in want:
                why = " (int4 scales are kept in bf16)" if scale else ""
                problems.append(f"tensor {hf} has dtype {info.dtype}, expected one of {sorted(want)}{why}")
            items.append(_Item(pname, hf, e, dim if tp.size > 1 else None))
            if hf.endswith(".weight_packed"):
                problems += _check_weight_shape(infos, hf, full, used, missing)
    unexpected = Tally("unexpected tensor")
    for n in sorted(set(infos) - used):
        unexpected.add(infos[n].key)
    problems = missing.lines() + problems + unexpected.lines()
    if problems:
        raise CheckpointError(path, problems)
    return items


def fill(
    model: torch.nn.Module,
    items: list[_Item],
    infos: dict[str, TensorInfo],
    tp: TPInfo,
    bar: tqdm | None = None,
) -> None:
    """Copy each planned tensor (this rank's slice of it) into the model, one file open at a time: the one
    TP-slicing path of target and drafter. A file whose stamp is not the one its header was read with, before
    or after its tensors are copied, raises (its bytes may not be the planned ones)."""
    params = dict(model.named_parameters())
    by_file: dict[Path, list[_Item]] = {}
    for it in items:
        by_file.setdefault(infos[it.hf].file, []).append(it)
    for f, file_items in sorted(by_file.items()):
        planned = infos[file_items[0].hf].stamp
        _check_unchanged(f, planned, "since its header was read")
        with safe_open(str(f), framework="pt") as h:
            for it in file_items:
                info = infos[it.hf]
                sl = h.get_slice(info.key)
                if it.dim is None:
                    t = sl[:]
                else:
                    n = info.shape[it.dim] // tp.size
                    idx = [slice(None)] * len(info.shape)
                    idx[it.dim] = slice(tp.rank * n, (tp.rank + 1) * n)
                    t = sl[tuple(idx)]
                dst = params[it.param] if it.expert is None else params[it.param][it.expert]
                dst.copy_(t.to(dst.dtype))
                if bar is not None:
                    bar.update()
        _check_unchanged(f, planned, "while loading")


def _check_unchanged(f: Path, planned, when: str) -> None:
    if planned is not None and file_stamp(f) != planned:
        raise ShardChangedError(f"shard {f.name} changed on disk {when}: load again")


def _check_weight_shape(
    infos: dict[str, TensorInfo], packed: str, full_packed: list[int], used: set[str], missing: Tally
) -> list[str]:
    name = packed.removesuffix("_packed") + "_shape"
    info = infos.get(name)
    if info is None:
        missing.add(name)
        return []
    used.add(name)
    if info.dtype not in _INT or info.shape != (2,):
        return [f"tensor {name} must be 2 integers, got {info.dtype} {list(info.shape)}"]
    got = read_small(info.file, info.span, info.dtype).tolist()  # exact bytes: no mmap read-around
    want = [full_packed[0], full_packed[1] * 8]
    return [] if got == want else [f"tensor {name} says {got}, expected {want} from weight_packed"]


def load_model(
    path: str | Path,
    cfg: ModelConfig | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    tp: TPInfo = TPInfo(),
    progress: bool = True,
    cuda_kernels: bool = True,
    group=None,
    cache_dir: str | Path | None = None,
) -> KimiK2:
    """`group`: the TP process group; with it the ranks read each shard once between them and exchange
    slices (k26.shard_reader). `cache_dir`: the optional load cache (k26.load_cache). `model.load_stats`
    holds the bytes read and the time of each phase."""
    path = Path(path)
    cfg = cfg or ModelConfig.from_dir(path)
    infos = read_index(path)
    moe = cfg.num_hidden_layers > cfg.first_k_dense_replace  # (an all-dense model holds no expert)
    check_layers(infos, path, cfg.num_hidden_layers, cfg.n_routed_experts if moe else 0)  # before building
    with torch.device("meta"):
        model = KimiK2(cfg, dtype=dtype, tp=tp).requires_grad_(False)
    items = plan_load(model, infos, tp, path)

    model.to_empty(device=device)
    stats = _read(model, items, infos, path, tp, group, device, dtype, cache_dir, progress)
    model.rope.reset_buffers()
    if cuda_kernels and torch.device(device).type == "cuda" and dtype == torch.bfloat16:
        t0 = time.perf_counter()
        use_cuda_kernels(model)  # the kernels are bf16-activation kernels; other dtypes keep the reference
        model.fuse_dense_()  # stacked q_a / kv_a; MLA projections in the small-M kernel where it wins
        torch.cuda.synchronize(device)
        stats.phases["repack"] = dt = time.perf_counter() - t0
        n = sum(isinstance(m, Int4Experts) and m.repacked for m in model.modules())
        phase_line(f"repack   {n} MoE layers in {dt:.2f} s ({dt / max(n, 1):.3f} s per layer)", progress)
    model.load_stats = stats
    return model.eval()


def _read(model, items, infos, path: Path, tp: TPInfo, group, device, dtype, cache_dir, progress: bool):
    """From the load cache if every rank's entry is valid (they must agree: a coordinated read is a
    collective), else from the checkpoint, then written to the cache."""
    cache = None
    if cache_dir is not None:
        from .load_cache import LoadCache

        files = sorted({i.file for i in infos.values()}, key=str)
        cache = LoadCache(cache_dir, path, files, tp.rank, tp.size, dtype)
        ok = cache.usable(model)
        if group is not None and tp.size > 1:
            import torch.distributed as dist

            flags: list = [None] * tp.size
            dist.all_gather_object(flags, ok, group=group)
            ok = all(flags)
        if ok:
            return cache.read(model, torch.device(device), progress)
    stats = read_into(
        model,
        items,
        infos,
        rank=tp.rank,
        size=tp.size,
        group=group,
        device=device,
        progress=progress,
    )
    if cache is not None:
        cache.write(model)
    return stats


def load_drafter(
    path: str | Path,
    target: ModelConfig,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    cfg: DrafterConfig | None = None,
    tp: TPInfo = TPInfo(),
    cuda_kernels: bool = True,
):
    """A DFlash drafter directory -> `DFlashDrafter` (this rank's shard). Tensor names are the module names,
    with an optional `model.` prefix; every missing, unexpected, mis-shaped or mis-typed tensor is named."""
    from .model.drafter import DFlashDrafter

    path = Path(path)
    cfg = cfg or DrafterConfig.from_dir(path)
    cfg.check_target(target)
    infos = _drafter_infos(path, cfg.num_hidden_layers)
    with torch.device("meta"):
        model = DFlashDrafter(cfg, dtype, tp).requires_grad_(False)
    items = plan_load(model, infos, tp, path, rule=drafter_rule)
    model.to_empty(device=device)
    fill(model, items, infos, tp)
    model.rope.reset_buffers()
    if cuda_kernels and torch.device(device).type == "cuda" and dtype == torch.bfloat16:
        use_cuda_kernels(model)  # the target's switch: today nothing of the drafter's changes
        model.fuse_()  # residual adds + norms as one op
        model.use_linear_kernel_()  # projections of <= 16 rows (a draft, an accepted path): small-M kernel
    return model.eval()


def check_drafter_files(path: str | Path, cfg: DrafterConfig, dtype: torch.dtype, tp_size: int) -> None:
    """The drafter's tensors planned on a meta model, before the target's weights are read (at K2.6 scale,
    minutes): a TP size its heads do not divide, every missing, unexpected, mis-shaped or mis-typed tensor
    and every unreadable shard are named now, not after the target's load."""
    from .model.drafter import DFlashDrafter

    infos = _drafter_infos(Path(path), cfg.num_hidden_layers)
    with torch.device("meta"):
        model = DFlashDrafter(cfg, dtype, TPInfo(0, tp_size))
    plan_load(model, infos, TPInfo(0, tp_size), Path(path), rule=drafter_rule)


def _drafter_infos(path: Path, layers: int | None = None) -> dict[str, TensorInfo]:
    """The drafter's tensors by module name (an optional `model.` prefix dropped); a name held both with and
    without the prefix is refused (one copy would silently win); the config's `layers` must be the ones held
    (an absurd num_hidden_layers was a long meta build, 16 s at 20000)."""
    infos: dict[str, TensorInfo] = {}
    for key, info in read_index(path).items():
        name = key.removeprefix("model.")
        if name in infos:
            raise CheckpointError(
                path, [f"tensor {name} appears twice (with and without the 'model.' prefix)"]
            )
        infos[name] = info
    if layers is not None:  # before the meta model is built
        check_layers(infos, path, layers, 0, where="layers")
    return infos
