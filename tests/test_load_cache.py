"""The load cache: a second start reads only the rank's own bytes and gives the same weights; another
checkpoint, another k26, a changed shard, a truncated entry or a full disk never yield stale weights."""

import errno
import json
import os
import re
import shutil

import pytest
import torch

from k26 import load_cache
from k26.loader import load_model
from k26.model import TPInfo
from k26.safetensors_file import read_header


def params(m):
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def ckpt(tiny_tp, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(tiny_tp[0], d)
    return d


def test_second_start_reads_only_its_own_bytes(ckpt, tmp_path):
    tp = TPInfo(1, 2)
    fresh = load_model(ckpt, tp=tp, progress=False, cache_dir=tmp_path / "c")
    assert not fresh.load_stats.from_cache
    again = load_model(ckpt, tp=tp, progress=False, cache_dir=tmp_path / "c")
    assert again.load_stats.from_cache
    own = sum(p.numel() * p.element_size() for p in again.parameters())
    assert again.load_stats.bytes_read == own < fresh.load_stats.bytes_read
    assert same(params(fresh), params(again))


def test_a_changed_shard_invalidates_the_entry(ckpt, tmp_path, capsys):
    load_model(ckpt, progress=False, cache_dir=tmp_path / "c")
    shard = min(ckpt.glob("*.safetensors"))
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    m = load_model(ckpt, progress=False, cache_dir=tmp_path / "c")
    assert not m.load_stats.from_cache
    assert "made from a different shards; loading the checkpoint" in capsys.readouterr().err


def test_same_named_shards_in_subdirectories_are_stamped_apart(ckpt, tmp_path, capsys):
    """part0/model.safetensors and part1/model.safetensors: the entry keyed stamps by file name, so the
    second overwrote the first's and a changed part0 still loaded from the cache (stale weights)."""
    index_file = ckpt / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    moved = {}
    for i, name in enumerate(sorted(set(index["weight_map"].values()))):
        (ckpt / f"part{i}").mkdir()
        os.rename(ckpt / name, ckpt / f"part{i}" / "model.safetensors")
        moved[name] = f"part{i}/model.safetensors"
    index["weight_map"] = {k: moved[v] for k, v in index["weight_map"].items()}
    index_file.write_text(json.dumps(index))
    load_model(ckpt, progress=False, cache_dir=tmp_path / "c")
    shard = ckpt / "part0" / "model.safetensors"
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    m = load_model(ckpt, progress=False, cache_dir=tmp_path / "c")
    assert not m.load_stats.from_cache
    assert "made from a different shards; loading the checkpoint" in capsys.readouterr().err


def test_an_in_place_edit_that_puts_size_and_mtime_back_invalidates_the_entry(ckpt, tmp_path, capsys):
    """Same size, mtime set back (a tool that keeps times, `touch -d`): the kernel's ctime still moved, so the
    entry is rebuilt and the edited bytes are what loads (the stamp was size + mtime: stale weights)."""
    load_model(ckpt, progress=False, cache_dir=tmp_path / "c")
    shard, key = next(
        (f, k)
        for f in sorted(ckpt.glob("*.safetensors"))
        for k in read_header(f)
        if k.endswith("norm.weight")
    )
    a, b = read_header(shard)[key][2]
    st = shard.stat()
    with open(shard, "r+b") as w:
        w.seek(a)
        w.write(torch.full(((b - a) // 2,), 3.0, dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes())
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert shard.stat().st_size == st.st_size and shard.stat().st_mtime_ns == st.st_mtime_ns
    m = load_model(ckpt, progress=False, cache_dir=tmp_path / "c")
    assert not m.load_stats.from_cache
    assert "made from a different shards; loading the checkpoint" in capsys.readouterr().err
    assert same(params(m), params(load_model(ckpt, progress=False)))


def test_an_entry_stamped_by_size_and_mtime_alone_is_rebuilt(ckpt, tmp_path, capsys):
    """An entry written before the stamp held ctime and inode (format 1, [size, mtime] per shard): said in one
    line, loaded fresh and rewritten, then used."""
    load_model(ckpt, progress=False, cache_dir=tmp_path / "c")
    (meta,) = (tmp_path / "c").glob("*/meta.json")
    m = json.loads(meta.read_text())
    old = {f: stamp[:2] for f, stamp in m["shards"].items()}
    meta.write_text(json.dumps(m | {"format": 1, "shards": old}))
    again = load_model(ckpt, progress=False, cache_dir=tmp_path / "c")
    assert not again.load_stats.from_cache
    assert "made from a different format, shards; loading the checkpoint" in capsys.readouterr().err
    assert load_model(ckpt, progress=False, cache_dir=tmp_path / "c").load_stats.from_cache


def test_another_k26_version_invalidates_the_entry(ckpt, tmp_path, capsys, monkeypatch):
    load_model(ckpt, progress=False, cache_dir=tmp_path / "c")
    monkeypatch.setattr(load_cache, "code_digest", lambda: "another k26")
    m = load_model(ckpt, progress=False, cache_dir=tmp_path / "c")
    assert not m.load_stats.from_cache
    assert "made from a different code" in capsys.readouterr().err


def test_an_entry_of_another_checkpoint_is_not_used(ckpt, tiny_k25, tmp_path, capsys):
    """Two checkpoints with the same directory name get entries of their own (the path's hash is in the
    entry's name), and the other's entry moved under this one's name is still refused by its fingerprint."""
    other = tmp_path / "x" / "ckpt"
    shutil.copytree(tiny_k25, other)
    load_model(other, progress=False, cache_dir=tmp_path / "o")
    m = load_model(ckpt, progress=False, cache_dir=tmp_path / "c")
    ((theirs,), (mine,)) = (list((tmp_path / "o").iterdir()), list((tmp_path / "c").iterdir()))
    assert theirs.name != mine.name  # same directory name, different entries
    shutil.rmtree(mine)
    theirs.rename(mine)
    m = load_model(ckpt, progress=False, cache_dir=tmp_path / "c")
    assert not m.load_stats.from_cache
    assert "made from a different checkpoint" in capsys.readouterr().err
    assert same(params(m), params(load_model(ckpt, progress=False)))


def test_a_truncated_entry_is_not_used(ckpt, tmp_path, capsys):
    load_model(ckpt, progress=False, cache_dir=tmp_path / "c")
    (w,) = (tmp_path / "c").glob("*/weights.safetensors")
    w.write_bytes(w.read_bytes()[:-100])
    m = load_model(ckpt, progress=False, cache_dir=tmp_path / "c")
    assert not m.load_stats.from_cache
    assert "wrong size" in capsys.readouterr().err
    assert same(params(m), params(load_model(ckpt, progress=False)))


def rewrite_header(w, edit):
    """The entry's weights file with its JSON header edited in place, padded to the same length (so the
    size check passes and only the header is wrong)."""
    b = w.read_bytes()
    n = int.from_bytes(b[:8], "little")
    header = edit(json.loads(b[8 : 8 + n]))
    j = json.dumps(header).encode()
    assert len(j) <= n
    w.write_bytes(b[:8] + j + b" " * (n - len(j)) + b[8 + n :])


@pytest.mark.parametrize(
    "edit",
    [
        lambda h: [0],  # not an object
        lambda h: {
            k: {kk: vv for kk, vv in v.items() if kk != "shape"} if k != "__metadata__" else v
            for k, v in h.items()
        },  # an entry without its shape
        lambda h: {
            k: v | {"dtype": "F16"} if k != "__metadata__" and v["dtype"] == "F32" else v
            for k, v in h.items()
        },  # another dtype (same shapes)
    ],
    ids=["list", "no-shape", "dtype"],
)
def test_an_entry_with_a_bad_header_is_a_fresh_load(ckpt, tmp_path, capsys, edit):
    """As the module promises: said in one line and loaded fresh (these were tracebacks, or an error that
    did not name the cache)."""
    load_model(ckpt, progress=False, cache_dir=tmp_path / "c", dtype=torch.float32)
    (w,) = (tmp_path / "c").glob("*/weights.safetensors")
    rewrite_header(w, edit)
    m = load_model(ckpt, progress=False, cache_dir=tmp_path / "c", dtype=torch.float32)
    assert not m.load_stats.from_cache
    assert "load cache" in capsys.readouterr().err
    assert same(params(m), params(load_model(ckpt, progress=False, dtype=torch.float32)))


def test_a_full_disk_leaves_no_entry_and_only_warns(ckpt, tmp_path, monkeypatch):
    def full(f, named):
        f.write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(load_cache, "write_safetensors", full)
    with pytest.warns(UserWarning, match="not written .*No space left on device"):
        m = load_model(ckpt, progress=False, cache_dir=tmp_path / "c")
    assert same(params(m), params(load_model(ckpt, progress=False)))
    (entry,) = (tmp_path / "c").iterdir()
    assert list(entry.iterdir()) == []  # neither weights nor meta: the next start loads fresh
    monkeypatch.undo()
    assert not load_model(ckpt, progress=False, cache_dir=tmp_path / "c").load_stats.from_cache


def test_a_cache_dir_that_cannot_be_made_only_warns(ckpt, tmp_path):
    """A file where the cache directory should be: the load succeeds and warns (the temp file's clean-up
    raised NotADirectoryError out of the load before)."""
    (tmp_path / "c").write_text("not a directory")
    with pytest.warns(UserWarning, match="not written"):
        m = load_model(ckpt, progress=False, cache_dir=tmp_path / "c")
    assert not m.load_stats.from_cache and (tmp_path / "c").read_text() == "not a directory"


def test_entry_meta_names_what_it_was_made_from(ckpt, tmp_path):
    load_model(ckpt, tp=TPInfo(0, 2), dtype=torch.float32, progress=False, cache_dir=tmp_path / "c")
    (meta,) = (tmp_path / "c").glob("*/meta.json")
    m = json.loads(meta.read_text())
    assert re.fullmatch(r"ckpt-[0-9a-f]{12}-tp0of2-float32", meta.parent.name)
    assert m["tp"] == [0, 2] and m["dtype"] == "torch.float32" and len(m["shards"]) == 2


def _cached_rank(d, rank, world, port, cache, out):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        runs = []
        for _ in range(2):
            m = load_model(d, tp=TPInfo(rank, world), progress=False, group=dist.group.WORLD, cache_dir=cache)
            runs.append((m.load_stats.from_cache, params(m)))
        torch.save(
            {"first": runs[0][0], "second": runs[1][0], "same": same(runs[0][1], runs[1][1])},
            out / f"r{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


def test_coordinated_ranks_use_the_cache_together(ckpt, tmp_path):
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = 29400 + os.getpid() % 300
    args = [(ckpt, r, 2, port, tmp_path / "c", tmp_path) for r in range(2)]
    procs = [ctx.Process(target=_cached_rank, args=a) for a in args]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
    assert [p.exitcode for p in procs] == [0, 0]
    for r in range(2):
        got = torch.load(tmp_path / f"r{r}.pt")
        assert got == {"first": False, "second": True, "same": True}, r


def test_a_missing_or_unreadable_compile_cache_is_a_fresh_compile(tmp_path, capsys):
    from k26.load_cache import load_compile_cache

    assert load_compile_cache(tmp_path / "none.bin") is False
    (tmp_path / "bad.bin").write_bytes(b"not torch's artifacts")
    assert load_compile_cache(tmp_path / "bad.bin") is False
    assert "not used" in capsys.readouterr().err


def test_the_compile_cache_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    from k26.load_cache import save_compile_cache

    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"artifacts", None))
    f = tmp_path / "c" / "compile.bin"
    save_compile_cache(f)
    assert f.read_bytes() == b"artifacts" and [p.name for p in f.parent.iterdir()] == ["compile.bin"]
    real_write = type(f).write_bytes

    def torn(self, data):  # a disk that fills halfway through the write
        real_write(self, data[: len(data) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(type(f), "write_bytes", torn)
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"newer artifacts", None))
    with pytest.warns(UserWarning, match="not written"):
        save_compile_cache(f)
    assert f.read_bytes() == b"artifacts" and [p.name for p in f.parent.iterdir()] == ["compile.bin"]
    monkeypatch.setattr(type(f), "write_bytes", real_write)
    blocked = tmp_path / "file"
    blocked.write_text("x")  # a file where the directory should be: the write fails
    with pytest.warns(UserWarning, match="not written"):
        save_compile_cache(blocked / "compile.bin")
    assert blocked.read_text() == "x"
