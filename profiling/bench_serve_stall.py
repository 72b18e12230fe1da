"""Does one huge request stall the other clients? While a streamed completion runs, a request with a prompt of
--mb megabytes of text arrives (refused as too long for the context: the question is what the refusal costs
everyone else); meanwhile /health is polled. Reports the stream's largest gap between chunks before and
during the huge request, /health's worst latency, and the huge request's status and time.

    python profiling/bench_serve_stall.py --device cpu --dtype float32 [--mb 30] [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import string
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import start_server
from engine_bench import add_model_args
from timing import report


def post(url: str, body: bytes) -> urllib.request.Request:
    return urllib.request.Request(url, body, {"Content-Type": "application/json"})


def stream_times(url: str, model: str, max_tokens: int, out: list[float]) -> None:
    """One long greedy stream; each chunk's arrival time appended to `out`."""
    body = {"model": model, "prompt": "def main(", "max_tokens": max_tokens, "temperature": 0, "stream": True}
    body["ignore_eos"] = True
    with urllib.request.urlopen(post(url + "/v1/completions", json.dumps(body).encode()), timeout=600) as r:
        for line in r:
            if line.startswith(b"data: {"):
                out.append(time.perf_counter())


def main() -> None:
    ap = argparse.ArgumentParser()
    add_model_args(ap)
    ap.add_argument("--spec", default="ddtree", choices=["ar", "dflash", "ddtree"])
    ap.add_argument("--budget", default="auto")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument(
        "--max-tokens", type=int, default=3000, help="the stream's length (it must outlast the rest)"
    )
    ap.add_argument("--mb", type=float, default=30.0, help="megabytes of prompt in the huge request")
    ap.add_argument("--ids", action="store_true", help="the huge prompt as token ids (JSON ints), not text")
    ap.add_argument("--out")
    a = ap.parse_args()
    url, model, _ = start_server(a)
    # The body first: making 30 MB of it in Python holds this process's GIL (the server's too) for seconds
    rng = random.Random(0)
    if a.ids:  # ~6 bytes an id ("1234, ")
        prompt: str | list[int] = [rng.randrange(1000, 4000) for _ in range(int(a.mb * 1e6 / 6))]
    else:
        prompt = "".join(rng.choices(string.ascii_letters + " ", k=int(a.mb * 1e6)))
    big = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1}).encode()
    chunks: list[float] = []
    streamer = threading.Thread(target=stream_times, args=(url, model, a.max_tokens, chunks), daemon=True)
    streamer.start()
    while len(chunks) < 20:
        time.sleep(0.05)
    result: dict = {}

    def huge() -> None:
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(post(url + "/v1/completions", big), timeout=600) as r:
                result["status"] = r.status
        except urllib.error.HTTPError as e:
            result["status"] = e.code
        result["s"], result["span"] = time.perf_counter() - t0, (t0, time.perf_counter())

    h = threading.Thread(target=huge)
    h.start()
    health = []
    while h.is_alive():
        t0 = time.perf_counter()
        urllib.request.urlopen(url + "/health", timeout=600).read()
        health.append(time.perf_counter() - t0)
        time.sleep(0.05)
    h.join()
    t_start, t_end = result["span"]
    while chunks[-1] <= t_end and streamer.is_alive():  # the stream's first chunk after it (a stall's end)
        time.sleep(0.01)
    gaps = [(b - a_, b) for a_, b in itertools.pairwise(chunks)]
    before = max(g for g, t in gaps if t < t_start)
    # the gaps that end while it runs, or the first after it (a stall spans its end)
    during = max([g for g, t in gaps if t_start <= t <= t_end] + [g for g, t in gaps if t > t_end][:1])
    assert chunks[-1] > t_end, "the stream ended before the huge request did: raise --max-tokens"
    dev = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if dev == "cuda" else f"CPU ({os.cpu_count()} cores)"
    lines = [
        f"# bench_serve_stall — {time.strftime('%Y-%m-%d')}",
        "",
        f"- device: {name}; model: {a.model or 'embedded pair'}; spec {a.spec}; dtype {a.dtype}",
        (
            f"- commit: {os.environ.get('K26_COMMIT', '?')}; command: `python profiling/bench_serve_stall.py "
            f"{' '.join(sys.argv[1:])}`"
        ),
        (
            f"- a {a.mb:g} MB prompt ({'token ids' if a.ids else 'text'}; max_model_len {a.max_model_len}) "
            "sent while one greedy stream runs"
        ),
        "",
        "| huge request | its time s | stream's worst chunk gap before / during, s | /health worst s |",
        "|---|---|---|---|",
        f"| {result['status']} | {result['s']:.2f} | {before:.3f} / {during:.3f} | {max(health):.3f} |",
    ]
    report("\n".join(lines) + "\n", a.out)
    os._exit(0)  # (the stream's thread and the server's are daemons; the engine thread is not)


if __name__ == "__main__":
    main()
