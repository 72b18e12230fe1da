"""A checkpoint's tokenizer files wrong in every way a user can meet: one TokenizerError naming the file."""

import json

import pytest

from k26 import LLM
from k26.tokenizer import TokenizerError


def test_broken_tokenizer_files_are_named(ckpt):
    """Ranks not 0..n-1 once each (tiktoken panicked on a repeat; a gap blamed the prompt later), and
    tokenizer_config.json entries of the wrong shape (tracebacks): one TokenizerError naming the file."""
    model, cfg = ckpt / "tiktoken.model", ckpt / "tokenizer_config.json"
    lines = model.read_bytes().splitlines()
    tok, _ = lines[-1].split()
    model.write_bytes(b"\n".join([*lines[:-1], tok + b" 5000"]) + b"\n")
    with pytest.raises(TokenizerError, match="tiktoken.model: the ranks are not 0"):
        LLM(ckpt, device="cpu", progress=False)
    model.write_bytes(b"\n".join(lines) + b"\n")
    good = json.loads(cfg.read_text())
    for bad in (
        [1],
        {"added_tokens_decoder": [1]},
        {"added_tokens_decoder": {"abc": {"content": "x"}}},
        {"added_tokens_decoder": {str(len(lines)): {"no": "content"}}},
    ):
        cfg.write_text(json.dumps(bad))
        with pytest.raises(TokenizerError, match="tokenizer_config.json"):
            LLM(ckpt, device="cpu", progress=False)
    cfg.write_text(json.dumps(good))


def test_a_tokenizer_missing_a_byte_or_truncated_is_named_with_its_file(ckpt):
    """A byte without its token (tiktoken panicked on text holding it), a truncated tiktoken.model (blamed
    on tokenizer_config.json's special ids): one TokenizerError naming tiktoken.model."""
    import base64

    model = ckpt / "tiktoken.model"
    lines = model.read_bytes().splitlines()
    a = next(i for i, line in enumerate(lines) if base64.b64decode(line.split()[0]) == b"a")
    # byte "a" replaced by a longer token: ranks still 0 .. n-1 once each
    swapped = [*lines[:a], base64.b64encode(b"zzzzqq") + b" " + lines[a].split()[1], *lines[a + 1 :]]
    model.write_bytes(b"\n".join(swapped) + b"\n")
    with pytest.raises(
        TokenizerError, match=r"tiktoken.model: no token for 1 single byte\(s\) \(first 0x61\)"
    ):
        LLM(ckpt, device="cpu", progress=False)
    half = len(lines) - 20  # (the last ranks: merges, not single bytes)
    model.write_bytes(b"\n".join(lines[:half]) + b"\n")
    with pytest.raises(TokenizerError, match=f"follows the {half} tokens of tiktoken.model .a truncated"):
        LLM(ckpt, device="cpu", progress=False)


def test_missing_tokenizer(ckpt):
    (ckpt / "tiktoken.model").unlink()
    with pytest.raises(TokenizerError, match="tiktoken.model is missing"):
        LLM(ckpt, device="cpu", progress=False)
