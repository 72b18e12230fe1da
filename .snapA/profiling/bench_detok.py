"""Host cost of following a request's text as it grows (stop strings in the decode loop, `LLM.stream`, the
server's SSE stream): decoding the whole output again at every token, as k26 did before 2026-12-01, against
`TextStream` (each token's bytes decoded once) with the stop-string search on the tail (`first_stop`).

    python profiling/bench_detok.py [--lengths 1024 4096 16384] [--out FILE.md]

Microseconds per generated token, averaged over a whole output of each length (held-out text of the corpus
the embedded pair was trained on, embedded tokenizer), one stop string that never occurs.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time

from k26.embedded import default_model_dir
from k26.tokenizer import TextStream, Tokenizer, first_stop
from k26.train import corpus

STOPS = ("<<never>>",)


def whole(tok: Tokenizer, ids: list[int]) -> float:
    t0 = time.perf_counter()
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n], skip_special=True)
        [text.find(s) for s in STOPS if s in text]
    return (time.perf_counter() - t0) / len(ids)


def stream(tok: Tokenizer, ids: list[int]) -> float:
    t0 = time.perf_counter()
    ts = TextStream(tok)
    for i in ids:
        first_stop(ts.text, STOPS, len(ts.push([i])))
    return (time.perf_counter() - t0) / len(ids)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--out")
    a = ap.parse_args()
    tok = Tokenizer.from_dir(default_model_dir())
    ids = tok.encode(corpus.text("eval") * 8)
    lines = [
        f"# bench_detok — {datetime.date.today()} (CPU, host time per generated token)",
        "",
        (
            f"- commit: {os.environ.get('K26_COMMIT', '?')}; command: `python profiling/bench_detok.py "
            f"--lengths {' '.join(map(str, a.lengths))}`"
        ),
        "",
        "| output tokens | decode all every token µs | TextStream + tail search µs | ratio |",
        "|---|---|---|---|",
    ]
    for n in a.lengths:
        w, s = whole(tok, ids[:n]), stream(tok, ids[:n])
        lines.append(f"| {n} | {w * 1e6:.1f} | {s * 1e6:.1f} | {w / s:.0f}x |")
        print(lines[-1], flush=True)
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
