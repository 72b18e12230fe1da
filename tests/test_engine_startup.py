"""Start-up progress and its record (issue 22, deliverables 4-5): one line per phase on rank 0, only on a
terminal and only when asked; every rank's bytes in `LLM.startup` (TP 2 over gloo: the ranks read each
checkpoint byte once between them)."""

import io
import json
import struct

import torch

from k26 import LLM
from k26.startup import phase_bar

KW = {"device": "cpu", "dtype": torch.float32, "max_batch": 1, "max_model_len": 64}


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def final_lines(text: str) -> list[str]:
    """What a terminal shows at the end: each line's last carriage-return segment."""
    return [ln.split("\r")[-1].strip() for ln in text.split("\n") if ln.split("\r")[-1].strip()]


def checkpoint_tensor_bytes(path) -> int:
    """Bytes of the tensors a load places: the language model's (vision is skipped), less the int4
    `weight_shape` pairs (checked, not loaded)."""
    total = 0
    for f in path.glob("*.safetensors"):
        with open(f, "rb") as h:
            header = json.loads(h.read(struct.unpack("<Q", h.read(8))[0]))
        placed = [v for k, v in header.items() if k.startswith("language_model.") and "weight_shape" not in k]
        total += sum(v["data_offsets"][1] - v["data_offsets"][0] for v in placed)
    return total


def test_one_read_line_on_a_terminal(tiny_k25, monkeypatch):
    term = Terminal()
    monkeypatch.setattr("sys.stderr", term)
    llm = LLM(tiny_k25, progress=True, **KW)
    lines = final_lines(term.getvalue())
    assert [ln.split()[0] for ln in lines] == ["read"], lines
    assert "100%" in lines[0] and "B/s" in lines[0]  # bytes and their rate, to the end
    assert llm.startup.bytes_read == checkpoint_tensor_bytes(tiny_k25)


def test_quiet_off_a_terminal_and_when_asked(tiny_k25, monkeypatch, capsys):
    LLM(tiny_k25, progress=True, **KW)  # pytest's captured stderr is no terminal
    assert capsys.readouterr().err == ""
    term = Terminal()
    monkeypatch.setattr("sys.stderr", term)
    LLM(tiny_k25, progress=False, **KW)
    assert term.getvalue() == ""


def test_a_phase_line_counts_to_its_total_with_a_rate_and_eta(monkeypatch):
    term = Terminal()
    monkeypatch.setattr("sys.stderr", term)
    with phase_bar("capture", 3, "graph", True) as bar:
        for _ in range(3):
            bar.update()
    (line,) = final_lines(term.getvalue())
    assert line.startswith("capture") and "3/3" in line and "graph/s" in line and "<00:00" in line


def test_tp2_one_set_of_lines_and_every_ranks_bytes(tiny_tp, monkeypatch):
    """Two ranks (the second a `python -m k26.tp_driver` process, told to be quiet) print one read line
    between them, and the report holds both ranks' bytes: together exactly the checkpoint's tensors."""
    term = Terminal()
    monkeypatch.setattr("sys.stderr", term)
    llm = LLM(tiny_tp[0], tp=2, progress=True, **KW)
    try:
        lines = final_lines(term.getvalue())
        assert [ln.split()[0] for ln in lines] == ["read"], lines
        assert len(llm.startup.ranks) == 2 and all(r["bytes_read"] > 0 for r in llm.startup.ranks)
        assert llm.startup.bytes_read == checkpoint_tensor_bytes(tiny_tp[0])
        assert llm.startup.lines()[0].startswith("read") and "by 2 rank(s)" in llm.startup.lines()[0]
    finally:
        llm.close()


def test_capture_without_graphs_records_nothing(tiny_k25):
    llm = LLM(tiny_k25, progress=False, capture=True, **KW)  # CPU: no CUDA graphs
    assert llm.capture() == [] and llm.startup.captures == []
    assert "capture" not in llm.startup.phases


def test_report_lines_name_every_phase():
    from k26.graphs.buckets import Bucket
    from k26.startup import CaptureRecord, StartupReport

    r = StartupReport(
        {"read": 2.0, "repack": 0.5, "capture": 3.0},
        [{"bytes_read": 10**9, "read_s": 2.0, "disk_bytes": 10**9}],
        [CaptureRecord(Bucket(4, 1), 1.5, 2 * 10**6, "ar greedy")],
    )
    text = "\n".join(r.lines())
    assert "1.00 GB" in text and "0.50 GB/s" in text and "repack    0.50 s" in text
    assert "capture   3.00 s" in text
    assert "graph ar greedy batch 4 nodes 1: 1.50 s, pool +2.0 MB" in text


def test_info_startup_prints_the_report(tiny_k25, capsys):
    from k26.__main__ import main

    assert main(["info", "--model", str(tiny_k25), "--startup", "--device", "cpu"]) == 0
    out = capsys.readouterr().out.splitlines()
    at = out.index("start-up:")
    assert out[at + 1].startswith("read") and "by 1 rank(s)" in out[at + 1]


def test_capture_of_no_sampling_mode_captures_nothing(tiny_k25):
    """capture(greedy=False, sampled=False) asks for no graphs: nothing is captured (it raised StopIteration
    from the graph stepper, which had no runner to take the batch's state from)."""
    llm = LLM(tiny_k25, progress=False, **KW)
    llm.graphs = llm.decoder.ctx.graphs = True  # as on CUDA; no mode asked, so nothing reaches a capture
    assert llm.capture(greedy=False, sampled=False) == [] and llm.startup.captures == []
