"""The training and checkpoint scripts (scripts/): bad arguments refused in one line before anything is
written; a drafter training run that stops early leaves OUT as it was."""

import hashlib
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "k26" / "default" / "target"
DRAFTER = ROOT / "k26" / "default" / "drafter"


def command(name: str, *args) -> list[str]:
    return [sys.executable, str(ROOT / "scripts" / name), *map(str, args)]


def script(name: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run(command(name, *args), check=False, capture_output=True, text=True, timeout=300)


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha1(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_train_drafter_refuses_a_sequence_without_room_for_a_block_before_writing(tmp_path):
    r = script("train_drafter.py", tmp_path / "out", "--target", TARGET, "--seq", 8, "--block", 8)
    assert r.returncode == 2 and "--seq 8" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_train_drafter_refuses_a_file_as_out_before_training(tmp_path):
    (tmp_path / "out").write_text("not a folder")
    r = script("train_drafter.py", tmp_path / "out", "--target", TARGET)
    assert r.returncode == 2 and "is a file" in r.stderr and "Traceback" not in r.stderr


def test_an_interrupted_drafter_training_leaves_the_drafter_in_out_untouched(tmp_path):
    out = tmp_path / "drafter"
    shutil.copytree(DRAFTER, out)
    before = digest(out)
    args = ("--target", TARGET, "--minutes", 5, "--seq", 32, "--batch", 1, "--anchors", 1)
    cmd = command("train_drafter.py", out, *args)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        for line in proc.stdout:  # training has begun (the drafter it starts from exists by now)
            if line.startswith("step 0"):
                break
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode != 0 and digest(out) == before


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--shards", 0], "shards 0"),
        (["--hidden-size", 100], "hidden_size=100"),
        (["--first-k-dense-replace", 5], "first_k_dense_replace=5"),
        (["--base-vocab", 10], "base_vocab 10"),
    ],
)
def test_make_tiny_checkpoint_refuses_bad_sizes_before_writing(tmp_path, flags, named):
    r = script("make_tiny_checkpoint.py", tmp_path / "out", *flags)
    assert r.returncode == 2 and named in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_train_tiny_refuses_sizes_the_int4_export_cannot_take_before_training(tmp_path):
    r = script("train_tiny.py", tmp_path / "out", "--hidden", 200, "--minutes", 5, "--tokenizer", TARGET)
    assert r.returncode == 2 and "hidden_size=200" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["make_tiny_checkpoint.py", "make_tiny_drafter.py", "train_tiny.py"])
def test_the_writing_scripts_refuse_a_file_as_out_in_one_line(tmp_path, name):
    (tmp_path / "out").write_text("not a folder")
    extra = ["--target", TARGET] if name == "make_tiny_drafter.py" else []
    r = script(name, tmp_path / "out", *extra)
    assert r.returncode == 2 and "is a file" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "target, named", [("missing", "does not exist"), ("empty", "config.json is missing")]
)
def test_make_tiny_drafter_names_a_target_without_a_checkpoint(tmp_path, target, named):
    (tmp_path / "empty").mkdir()
    r = script("make_tiny_drafter.py", tmp_path / "out", "--target", tmp_path / target)
    assert r.returncode == 2 and "--target" in r.stderr and named in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "flags, named",
    [(["--block-size", 0], "block_size=0"), (["--block-size", -3], "block_size=-3"), (["--layers", 0], "=0")],
)
def test_make_tiny_drafter_refuses_what_the_loader_would_refuse_before_writing(tmp_path, flags, named):
    r = script("make_tiny_drafter.py", tmp_path / "out", "--target", TARGET, *flags)
    assert r.returncode == 2 and named in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_make_tiny_drafter_writes_a_drafter_the_loader_takes(tmp_path):
    from k26.drafter_config import DrafterConfig

    r = script("make_tiny_drafter.py", tmp_path / "out", "--target", TARGET, "--block-size", 4)
    assert r.returncode == 0, r.stderr
    assert DrafterConfig.from_dir(tmp_path / "out").block_size == 4
