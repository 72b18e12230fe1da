"""The served-engine tests' shared pieces: the embedded pair behind a real server (the `served` fixture in
conftest.py builds it once per session), the constants its references use, small HTTP helpers."""

import json
import urllib.error
import urllib.request

from k26 import SpecConfig

MODEL = "k26-test"
SPEC = SpecConfig("ddtree", 8)
PROMPTS = [
    "def main(",
    "import os\n",
    "class Foo(object):\n",
    "    return ",
    "for i in range(",
    "if __name__ ==",
    "# Copyright",
    "self.",
]
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def main("}]


# penalties and a logit bias, as the API takes them and as SamplingParams holds them
PENALTIES = {"frequency_penalty": 1.5, "presence_penalty": 0.5, "logit_bias": {"7": 3.0}}
PENALTIES_SP = {"frequency_penalty": 1.5, "presence_penalty": 0.5, "logit_bias": {7: 3.0}}


def greedy(**kw):
    return dict(temperature=0, max_tokens=12, **kw)


def raw(url: str, path: str, data: bytes | None = None, method: str | None = None) -> tuple[int, dict | str]:
    req = urllib.request.Request(
        url + path, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            body = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as e:
        body, status = e.read().decode(), e.code
    try:
        return status, json.loads(body)
    except json.JSONDecodeError:
        return status, body


def metric(url: str, name: str) -> float:
    text = raw(url, "/metrics")[1]
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith(name + " ")))
