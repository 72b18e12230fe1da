"""Serving benchmark: throughput, time to first token (TTFT) and time per output token (TPOT), p50 / p99, at
1, 4 and 8 concurrent streaming clients against `python -m k26 serve` (continuous batching).

By default it starts the server in-process on a free loopback port (the embedded pair, or --model /
--drafter); --url measures a server already running. Clients are stdlib HTTP (one thread each) reading
the SSE stream; prompts are held-out windows of the stdlib corpus (k26.train.corpus), greedy decoding up
to --max-tokens (a request that meets end-of-text counts the tokens it got). In-process, the clients share
the interpreter with the server: on CPU their threads take a little from the engine.

    python profiling/bench_serve.py --device cpu --dtype float32 --out profiling/results/DATE-serve-cpu.md
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_bench import add_model_args, make_llm
from timing import report

from k26 import SpecConfig
from k26.train import corpus


def one_request(url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion: seconds to the first token, to the end, and the tokens generated."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    first, n = None, 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and first is None:
                first = time.perf_counter()
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    first = first or end
    return {"ttft": first - t0, "tpot": (end - first) / max(n - 1, 1), "tokens": n, "end": end, "start": t0}


def level(url: str, model: str, prompts: list[list[int]], clients: int, max_tokens: int) -> dict:
    with ThreadPoolExecutor(clients) as ex:
        t0 = time.perf_counter()
        rs = list(ex.map(lambda p: one_request(url, model, p, max_tokens), prompts))
        wall = time.perf_counter() - t0

    def pct(xs, q):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]

    tt, tp = [r["ttft"] for r in rs], [r["tpot"] for r in rs]
    return {
        "clients": clients,
        "requests": len(rs),
        "tokens": sum(r["tokens"] for r in rs),
        "wall": wall,
        "tok_s": sum(r["tokens"] for r in rs) / wall,
        "ttft50": statistics.median(tt),
        "ttft99": pct(tt, 0.99),
        "tpot50": statistics.median(tp),
        "tpot99": pct(tp, 0.99),
    }


def start_server(a) -> tuple[str, str, object]:
    import uvicorn

    from k26.server import Engine, create_app

    llm = make_llm(a, a.max_batch, a.max_model_len)
    spec = (
        SpecConfig(a.spec, "auto" if a.budget == "auto" else int(a.budget))
        if a.spec == "ddtree"
        else SpecConfig(a.spec)
    )
    engine = Engine(llm, spec, max_batch=a.max_batch, max_waiting=256)
    engine.start()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(engine, "bench"), log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", "bench", llm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", help="a running server (default: start one in-process)")
    ap.add_argument("--model-name", default="bench", help="with --url: the served model id")
    add_model_args(ap)
    ap.add_argument("--spec", default="ddtree", choices=["ar", "dflash", "ddtree"])
    ap.add_argument("--budget", default="auto")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--clients", default="1,4,8")
    ap.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.url:
        url, model, tok = a.url, a.model_name, None
    else:
        url, model, llm = start_server(a)
        tok = llm.tokenizer
    if tok is None:
        from k26.embedded import default_model_dir
        from k26.tokenizer import Tokenizer

        tok = Tokenizer.from_dir(a.model or default_model_dir())
    ids = tok.encode(corpus.text("eval"))
    gen = torch.Generator().manual_seed(0)
    prompts = corpus.windows(ids, a.requests, a.prompt_len, gen, room=a.max_tokens)
    one_request(url, model, prompts[0], 4)  # warm-up
    rows = [level(url, model, prompts, int(c), a.max_tokens) for c in a.clients.split(",")]
    dev = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if dev == "cuda" else f"CPU ({os.cpu_count()} cores)"
    lines = [
        f"# bench_serve — {time.strftime('%Y-%m-%d')}",
        "",
        (
            f"- device: {name}; model: {a.model or 'embedded pair'}; spec {a.spec} budget {a.budget}; "
            f"dtype {a.dtype}; max_batch {a.max_batch}"
        ),
        (
            f"- commit: {os.environ.get('K26_COMMIT', '?')}; command: `python profiling/bench_serve.py "
            f"{' '.join(sys.argv[1:])}`"
        ),
        (
            f"- {a.requests} streamed greedy requests per level, prompt {a.prompt_len} tokens (held-out "
            f"stdlib windows), max_tokens {a.max_tokens}; TTFT includes queueing; "
            "TPOT = (last - first token) / (n - 1)"
        ),
        "",
        "| clients | requests | tokens | wall s | tokens/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['clients']} | {r['requests']} | {r['tokens']} | {r['wall']:.2f} | {r['tok_s']:.1f} | "
            f"{r['ttft50'] * 1e3:.0f} / {r['ttft99'] * 1e3:.0f} | {r['tpot50'] * 1e3:.1f} / "
            f"{r['tpot99'] * 1e3:.1f} |"
        )
    report("\n".join(lines) + "\n", a.out)


if __name__ == "__main__":
    main()
