"""The planned reader (k26.shard_reader) fills exactly what the per-tensor path fills, reads only this rank's
bytes where the layout allows, reads every byte once across ranks when coordinated, and refuses a shard that
changes while it is read."""

import json
import multiprocessing as mp
import os
import re
from pathlib import Path

import pytest
import torch

from k26.checkpoint_index import read_index
from k26.config import ModelConfig
from k26.loader import fill, load_model, plan_load
from k26.model import KimiK2, TPInfo
from k26.safetensors_file import tensor_spans
from k26.shard_reader import read_into
from k26.stager import ShardChangedError, Stager


def planned(d, tp):
    cfg = ModelConfig.from_dir(d)
    with torch.device("meta"):
        model = KimiK2(cfg, dtype=torch.float32, tp=tp).requires_grad_(False)
    infos = read_index(d)
    items = plan_load(model, infos, tp, d)
    model.to_empty(device="cpu")
    for p in model.parameters():  # poison: a parameter the reader skips cannot pass by accident
        p.fill_(7) if not p.is_floating_point() else p.fill_(float("nan"))
    return model, items, infos


def tensor_bytes(items, infos, world):
    """Bytes of this rank's share if rows split (dim 0), else the whole tensor (what alone mode reads)."""
    spans = tensor_spans(sorted({i.file for i in infos.values()}, key=str))
    whole = sum(b - a for a, b in (spans[infos[it.hf].file, infos[it.hf].key] for it in items))
    rows = sum(b - a for it in items if it.dim == 0 for a, b in [spans[infos[it.hf].file, infos[it.hf].key]])
    return whole, whole - rows + rows // world


@pytest.mark.parametrize("world,rank,chunk", [(1, 0, 1 << 28), (2, 1, 4096), (4, 2, 1000)])
def test_reader_fills_what_the_per_tensor_path_fills(tiny_tp, world, rank, chunk):
    d, tp = tiny_tp[0], TPInfo(rank, world)
    want, items, infos = planned(d, tp)
    fill(want, items, infos, tp)
    got = planned(d, tp)[0]
    read_into(got, items, infos, rank=rank, size=world, chunk=chunk)
    for (n, a), (_, b) in zip(want.named_parameters(), got.named_parameters(), strict=True):
        assert torch.equal(a, b), n


def test_alone_reads_only_row_slices_of_row_split_tensors(tiny_tp):
    d, tp = tiny_tp[0], TPInfo(3, 4)
    model, items, infos = planned(d, tp)
    whole, share = tensor_bytes(items, infos, 4)
    stats = read_into(model, items, infos, rank=3, size=4)
    assert stats.bytes_read == share < whole


def test_load_model_exposes_its_stats(tiny_k25):
    model = load_model(tiny_k25, progress=False)
    items_bytes = sum(os.path.getsize(f) for f in tiny_k25.glob("*.safetensors"))
    assert 0 < model.load_stats.bytes_read < items_bytes  # headers and vision tensors are not read
    assert model.load_stats.seconds > 0


def _rank(d, rank, world, port, out):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        tp = TPInfo(rank, world)
        model, items, infos = planned(d, tp)
        stats = read_into(model, items, infos, rank=rank, size=world, group=dist.group.WORLD, chunk=3000)
        torch.save(dict(model.named_parameters()), out / f"rank{rank}.pt")
        (out / f"rank{rank}.json").write_text(json.dumps({"bytes": stats.bytes_read}))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_coordinated_ranks_read_each_byte_once_and_get_their_slices(tiny_tp, tmp_path, world):
    d = tiny_tp[0]
    ctx = mp.get_context("spawn")  # a forked gloo rank can hang on torch's thread pool
    port = 29600 + world + os.getpid() % 200
    procs = [ctx.Process(target=_rank, args=(d, r, world, port, tmp_path)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    total = 0
    for r in range(world):
        tp = TPInfo(r, world)
        want, items, infos = planned(d, tp)
        fill(want, items, infos, tp)
        got = torch.load(tmp_path / f"rank{r}.pt")
        for n, a in want.named_parameters():
            assert torch.equal(a, got[n]), (r, n)
        total += json.loads((tmp_path / f"rank{r}.json").read_text())["bytes"]
    assert total == tensor_bytes(items, infos, world)[0]  # every tensor byte read by exactly one rank


def test_a_shard_that_changes_while_read_is_refused(tiny_k25):
    f = min(tiny_k25.glob("*.safetensors"))
    st = Stager(torch.device("cpu"))
    st.read([(f, 8, 64)])
    os.utime(f, ns=(st.fds[f][1][1] + 10**9, st.fds[f][1][1] + 10**9))
    with pytest.raises(ShardChangedError, match=f"{f.name} changed on disk while loading"):
        st.close()


def test_a_shard_cut_short_while_read_is_refused(tmp_path):
    f = tmp_path / "short.safetensors"
    f.write_bytes(b"x" * 100)
    st = Stager(torch.device("cpu"))
    with pytest.raises(ShardChangedError, match="short.safetensors ended at byte 100 while loading"):
        st.read([(f, 50, 150)])
    st.close()


@pytest.mark.gpu
def test_pinned_staging_on_gpu_fills_what_the_per_tensor_path_fills(tiny_tp):
    """Small staging buffers force the ring to wrap many times, pieces to span buffers and batches."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    d, tp = tiny_tp[0], TPInfo(1, 4)
    want, items, infos = planned(d, tp)
    fill(want, items, infos, tp)
    got = planned(d, tp)[0].to("cuda")
    for p in got.parameters():
        p.fill_(7) if not p.is_floating_point() else p.fill_(float("nan"))
    read_into(got, items, infos, rank=1, size=4, device="cuda", chunk=1000)
    for (n, a), (_, b) in zip(want.named_parameters(), got.named_parameters(), strict=True):
        assert torch.equal(a, b.cpu()), n


def test_a_shard_replaced_after_its_header_was_read_is_refused(tiny_tp, tmp_path):
    """The byte ranges come from the header read at planning time: a shard swapped since then must not be
    read with them."""
    import shutil

    d = tmp_path / "ckpt"
    shutil.copytree(tiny_tp[0], d)
    model, items, infos = planned(d, TPInfo())
    f = max(d.glob("*.safetensors"))
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(ShardChangedError, match=f"shard {f.name} changed since its header was read"):
        read_into(model, items, infos)


def edit_in_place_keeping_times(f):
    """Two bytes at the file's end changed in place, size and mtime put back (only ctime moves)."""
    st = f.stat()
    with open(f, "r+b") as w:
        w.seek(st.st_size - 2)
        w.write(b"\x00\x40")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_shard_edited_in_place_with_its_times_put_back_is_refused(tiny_tp, tmp_path):
    """Same size and mtime after the edit: the stamp's ctime (set by the kernel, not by utime) still moved."""
    import shutil

    d = tmp_path / "ckpt"
    shutil.copytree(tiny_tp[0], d)
    model, items, infos = planned(d, TPInfo())
    f = max(d.glob("*.safetensors"))
    edit_in_place_keeping_times(f)
    with pytest.raises(ShardChangedError, match=f"shard {f.name} changed since its header was read"):
        read_into(model, items, infos)


def test_a_drafter_shard_changed_after_its_header_was_read_is_refused(tiny_tp, tmp_path):
    """The drafter's path (`fill`, memory-mapped) checks its shards' stamps as the target's reader does: an
    in-place edit with size and mtime put back, between planning and reading, is refused (was read)."""
    import shutil

    from k26.drafter_config import DrafterConfig
    from k26.loader import _drafter_infos, drafter_rule
    from k26.model.drafter import DFlashDrafter

    d = tmp_path / "drafter"
    shutil.copytree(tiny_tp[1], d)
    with torch.device("meta"):
        model = DFlashDrafter(DrafterConfig.from_dir(d), torch.float32, TPInfo()).requires_grad_(False)
    infos = _drafter_infos(d)
    items = plan_load(model, infos, TPInfo(), d, rule=drafter_rule)
    model.to_empty(device="cpu")
    (f,) = d.glob("*.safetensors")
    edit_in_place_keeping_times(f)
    with pytest.raises(ShardChangedError, match=f"shard {f.name} changed on disk since its header was read"):
        fill(model, items, infos, TPInfo())


def test_batches_keep_a_zero_byte_piece_and_the_chunk_bound():
    """An empty tensor first in file order opened no batch (IndexError); every batch stays within the chunk
    unless a single piece is bigger."""
    from k26.shard_reader import Piece, batches

    f = Path("/x/model-1.safetensors")
    sizes = [0, 5, 7, 0, 12, 3]
    pieces, pos = [], 0
    for i, n in enumerate(sizes):
        pieces.append(Piece(f"p{i}", None, f, pos, pos + n, torch.uint8, (n,)))
        pos += n
    got = batches(pieces, chunk=10)
    assert [p.param for b in got for p in b] == [f"p{i}" for i in range(len(sizes))]
    assert all(sum(p.nbytes for p in b) <= 10 or len(b) == 1 for b in got)


def _safetensors(f: Path, header: dict, data: bytes) -> Path:
    raw = json.dumps(header).encode()
    f.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return f


@pytest.mark.parametrize(
    ("entry", "data", "why"),
    [
        ({"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 8]}, bytes(16), "do not hold F32 [2, 2]"),
        # an element count past int64 (safetensors refuses it; torch.Size's count wrapped to 0 bytes)
        ({"dtype": "F32", "shape": [2**32, 2**32], "data_offsets": [0, 0]}, b"", "do not hold F32 [42949"),
        ({"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}, bytes(8), "past the end of the file"),
        ({"dtype": "Q4", "shape": [2], "data_offsets": [0, 1]}, bytes(1), "malformed header entry"),
        ({"shape": [2], "data_offsets": [0, 8]}, bytes(8), "malformed header entry"),
    ],
)
def test_a_bad_header_is_refused_by_name(tmp_path, entry, data, why):
    """Headers are read without safetensors' loader, so the format's checks are the reader's own."""
    from k26.safetensors_file import read_header

    f = _safetensors(tmp_path / "x.safetensors", {"w": entry}, data)
    with pytest.raises(ValueError, match=re.escape(why)):
        read_header(f)


def test_a_good_header_gives_absolute_spans(tmp_path):
    from k26.safetensors_file import read_header

    header = {"__metadata__": {"format": "pt"}, "a": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 6]}}
    header["b"] = {"dtype": "I64", "shape": [1, 1], "data_offsets": [6, 14]}
    f = _safetensors(tmp_path / "x.safetensors", header, bytes(range(14)))
    base = 8 + len(json.dumps(header).encode())
    assert read_header(f) == {
        "a": ("BF16", (3,), (base, base + 6)),
        "b": ("I64", (1, 1), (base + 6, base + 14)),
    }


def _with_header(f: Path, edit) -> None:
    """`f` with its header's JSON text replaced by edit(header dict) (bytes), its data kept."""
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    text = edit(json.loads(raw[8 : 8 + n]))
    f.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n :])


def twice(header: dict, key: str, value: str) -> bytes:
    """The header's JSON with the field `"key": "value"` written two times over."""
    pair = f'"{key}": "{value}"'
    return json.dumps(header).replace(pair, f"{pair}, {pair}").encode()


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (lambda h: json.dumps(h | {"__metadata__": {"format": 1}}).encode(), "__metadata__ must map"),
        (lambda h: json.dumps(h | {"__metadata__": ["pt"]}).encode(), "__metadata__ must map"),
        (lambda h: json.dumps(h).encode("utf-16"), "not UTF-8 JSON"),
        (lambda h: json.dumps(h | {"__metadata__": {"format": float("nan")}}).encode(), "NaN is not JSON"),
        # (found in a bug hunt: json.loads kept the last of the two, safetensors' parser refuses the entry)
        (lambda h: twice(h, "dtype", "F32"), "tensor w: its header entry has the field 'dtype' twice"),
        # beside a key safetensors ignores (found in review: the first check looked at the keys held)
        (lambda h: twice(h, "dtype", "F32").replace(b'"F32", "dtype"', b'"F32", "x": 1, "dtype"'), "twice"),
    ],
    ids=["metadata-int", "metadata-list", "utf16", "nan", "entry-field-twice", "entry-field-twice-extra-key"],
)
def test_a_header_safetensors_refuses_is_refused_by_the_reader_too(tmp_path, edit, why):
    """Headers safetensors' own loader refuses (non-string metadata, UTF-16, NaN) were read as valid."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import save_file

    from k26.safetensors_file import read_header

    f = tmp_path / "x.safetensors"
    save_file({"w": torch.zeros(2, 3)}, str(f), metadata={"format": "pt"})
    _with_header(f, edit)
    with pytest.raises(SafetensorError), safe_open(str(f), "pt"):
        pass
    with pytest.raises(ValueError, match=re.escape(why)):
        read_header(f)


def test_a_metadata_key_twice_is_read_as_safetensors_reads_it(tmp_path):
    """Only a tensor entry's repeated field is refused: safetensors keeps the last of a repeated metadata key
    (a map there), and so does the reader."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from k26.safetensors_file import read_header

    f = tmp_path / "x.safetensors"
    for key in ("format", "dtype"):  # ("dtype": a metadata key, not a tensor entry's field)
        save_file({"w": torch.zeros(2, 3)}, str(f), metadata={key: "pt"})
        _with_header(f, lambda h, key=key: twice(h, key, "pt"))
        with safe_open(str(f), "pt") as h:
            assert h.metadata() == {key: "pt"}
        assert set(read_header(f)) == {"w"}


def test_a_drafter_header_safetensors_refuses_is_named_before_the_target_is_read(
    tiny_k25, drafter_dir, tmp_path, monkeypatch
):
    """The drafter's tensors are copied through safetensors' loader: its header with non-string metadata
    passed the drafter's checks and raised a raw SafetensorError after the target's whole load."""
    import shutil

    import k26.engine
    from k26 import LLM, CheckpointError

    def no_load(*a, **kw):
        raise AssertionError("the target was read before the drafter's files were checked")

    monkeypatch.setattr(k26.engine, "load_model", no_load)
    d = tmp_path / "drafter"
    shutil.copytree(drafter_dir, d)
    _with_header(d / "model.safetensors", lambda h: json.dumps(h | {"__metadata__": {"v": 1}}).encode())
    with pytest.raises(CheckpointError, match="shard model.safetensors is corrupt .*__metadata__ must map"):
        LLM(tiny_k25, drafter=d, device="cpu", progress=False)


@pytest.mark.parametrize("change", ["truncated", "overwritten"])
def test_a_shard_cut_short_or_overwritten_after_its_header_was_read_is_named(tiny_tp, tmp_path, change):
    """The reader read every header again before its stamp check: a shard truncated or overwritten since
    planning raised a bare ValueError ("its header ... does not fit the file") naming no file."""
    import shutil

    d = tmp_path / "ckpt"
    shutil.copytree(tiny_tp[0], d)
    model, items, infos = planned(d, TPInfo())
    f = max(d.glob("*.safetensors"))
    raw = f.read_bytes()
    f.write_bytes(raw[:5000] if change == "truncated" else b"\xff" * 64 + raw[64:])
    with pytest.raises(ShardChangedError, match=f"shard {f.name} changed since its header was read"):
        read_into(model, items, infos)


def test_the_loader_runs_where_os_has_no_posix_fadvise_or_preadv(tiny_k25, monkeypatch):
    """macOS's os module has neither (Linux-only calls): every header read raised AttributeError, reported as
    "shard ... is corrupt", so no checkpoint loaded there (the embedded pair's laptop CPU included)."""
    want = load_model(tiny_k25, dtype=torch.float32, progress=False)
    monkeypatch.delattr(os, "posix_fadvise")
    monkeypatch.delattr(os, "preadv")
    got = load_model(tiny_k25, dtype=torch.float32, progress=False)
    for (n, a), (_, b) in zip(want.named_parameters(), got.named_parameters(), strict=True):
        assert torch.equal(a, b), n
