"""Kimi's tiktoken tokenizer: `tiktoken.model` ranks + the special tokens named in tokenizer_config.json
(the chat format built on it: `chat.py`).

Security: `encode` keeps special-token strings inside text as plain text, so a string such as
"<|im_end|>" typed by a user becomes plain BPE pieces, never the control token.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import json
import re
from pathlib import Path

import tiktoken

# Verbatim from tokenization_kimi.py (one alternative per line); the `&&` class intersections need
# tiktoken's Rust regex engine.
KIMI_PAT_STR = (
    r"[\p{Han}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)

NUM_RESERVED_SPECIAL = 256
# The reference registers 256 + 2 ids past the base vocabulary; the model's embedding covers only 256.
NUM_SPECIAL_IDS = NUM_RESERVED_SPECIAL + 2
_MAX_CHUNK_CHARS = 400_000  # the reference encodes in chunks of this many characters ...
_MAX_RUN_CHARS = 25_000  # ... and splits longer runs of (non-)whitespace, for parity on odd inputs


class TokenizerError(ValueError):
    """A tokenizer file is missing or inconsistent."""


class Tokenizer:
    def __init__(self, ranks: dict[bytes, int], names: dict[int, str], name: str = "kimi"):
        self.num_base = len(ranks)
        specials = {}
        for i in range(self.num_base, self.num_base + NUM_SPECIAL_IDS):
            specials[names.get(i, f"<|reserved_token_{i}|>")] = i
        if len(specials) != NUM_SPECIAL_IDS:
            raise TokenizerError("two special ids have the same name")  # (from_dir names the file)
        self.special_ids = specials
        self.enc = tiktoken.Encoding(
            name, pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens=specials
        )
        self.n_words = self.enc.n_vocab
        # A text of more bytes than n x this is more than n tokens: `min_tokens`
        self.max_token_bytes = max(map(len, ranks), default=1)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        model_file, cfg_file = path / "tiktoken.model", path / "tokenizer_config.json"
        for f in (model_file, cfg_file):
            if not f.is_file():
                raise TokenizerError(
                    f"{f} is missing: the Kimi tokenizer needs tiktoken.model and tokenizer_config.json"
                )
        try:
            ranks = read_ranks(model_file)
        except (ValueError, binascii.Error) as e:
            raise TokenizerError(f"{model_file} is not a tiktoken BPE file: {e}") from e
        except OSError as e:
            raise TokenizerError(f"{model_file} cannot be read: {e.strerror or e}") from e
        if sorted(ranks.values()) != list(range(len(ranks))):  # (tiktoken panics on repeats)
            raise TokenizerError(f"{model_file}: the ranks are not 0 .. {len(ranks) - 1}, each once")
        if missing := [b for b in range(256) if bytes([b]) not in ranks]:  # (tiktoken panics on such text)
            raise TokenizerError(
                f"{model_file}: no token for {len(missing)} single byte(s) (first 0x{missing[0]:02x}); a "
                "byte-level BPE needs one for each of the 256, or some text cannot be encoded"
            )
        try:
            cfg = json.loads(cfg_file.read_text())
        except (ValueError, RecursionError) as e:  # (invalid JSON or UTF-8)
            raise TokenizerError(f"{cfg_file} is not valid JSON: {e}") from e
        except OSError as e:
            raise TokenizerError(f"{cfg_file} cannot be read: {e.strerror or e}") from e
        added = cfg.get("added_tokens_decoder", {}) if isinstance(cfg, dict) else None
        if not isinstance(added, dict):
            raise TokenizerError(f"{cfg_file}: expected an object with an added_tokens_decoder object")
        names = {}
        lo, hi = len(ranks), len(ranks) + NUM_SPECIAL_IDS
        for key, tok in added.items():
            if (
                not (key.isascii() and key.isdigit())
                or not isinstance(tok, dict)
                or not isinstance(tok.get("content"), str)
            ):
                raise TokenizerError(
                    f"{cfg_file}: added_tokens_decoder[{key!r}]: expected a token id and {{'content': str}}"
                )
            i = int(key)
            if not lo <= i < hi:
                raise TokenizerError(
                    f"{cfg_file}: added token {tok.get('content')!r} has id {i}, outside the special range "
                    f"[{lo}, {hi}) that follows the {lo} tokens of {model_file.name} (a truncated "
                    f"{model_file.name}, or the two files of different tokenizers?)"
                )
            names[i] = tok["content"]
        if not {"<|im_end|>", "[EOS]"} & set(names.values()):  # (no stop id: every answer runs to max_tokens)
            raise TokenizerError(
                f"{cfg_file}: added_tokens_decoder names neither <|im_end|> nor [EOS]: no end token would "
                "stop generation (not this model's tokenizer_config.json?)"
            )
        try:
            return cls(ranks, names)
        except TokenizerError as e:
            raise TokenizerError(f"{cfg_file}: {e}") from None

    # -- text ---------------------------------------------------------------------------------
    def min_tokens(self, chars: int) -> int:
        """The fewest tokens a text of `chars` characters can encode to (no token holds more than
        max_token_bytes bytes, and a character is one byte or more): what a bound checks before encoding."""
        return -(-chars // self.max_token_bytes)

    def encode(self, text: str) -> list[int]:
        """Ordinary text to ids; special-token strings inside `text` stay plain text. A lone UTF-16 surrogate
        (no UTF-8 form: tiktoken encoded it as U+FFFD, silently) is a ValueError naming its position."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"text holds an unpaired UTF-16 surrogate at character {e.start}") from None
        ids: list[int] = []
        for start in range(0, len(text), _MAX_CHUNK_CHARS):
            for piece in _split_long_runs(text[start : start + _MAX_CHUNK_CHARS]):
                ids.extend(self.enc.encode_ordinary(piece))
        return ids

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        if (
            skip_special
        ):  # (only the special tokens: an id past the vocabulary still reaches tiktoken, refused)
            ids = [i for i in ids if not self.num_base <= i < self.n_words]
        try:
            return self.enc.decode(ids, errors="replace")
        except (KeyError, OverflowError) as e:  # (tiktoken's words for an id it lacks, or a negative one)
            raise self._unknown(ids, e) from None

    def decode_bytes(self, ids: list[int]) -> bytes:
        try:
            return self.enc.decode_bytes(ids)
        except (KeyError, OverflowError) as e:
            raise self._unknown(ids, e) from None

    def _unknown(self, ids: list[int], e: Exception) -> ValueError:
        """The error for ids tiktoken could not decode, naming the first one outside the vocabulary (looked
        for only after a failure: decoding pays nothing for it)."""
        n = self.enc.n_vocab
        bad = next((i for i in ids if not 0 <= i < n), None)
        what = f"token id {bad}" if bad is not None else f"a token id ({e})"
        return ValueError(f"{what} is not in this tokenizer's vocabulary [0, {n})")

    def token_id(self, name: str) -> int:
        try:
            return self.special_ids[name]
        except KeyError:
            raise TokenizerError(f"special token {name!r} is not defined by this tokenizer") from None

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """<|im_end|> ends a chat turn, [EOS] ends a document."""
        return tuple(self.special_ids[n] for n in ("<|im_end|>", "[EOS]") if n in self.special_ids)


_LONG_RUN = re.compile(rf"\s{{{_MAX_RUN_CHARS + 1},}}|\S{{{_MAX_RUN_CHARS + 1},}}")


def read_ranks(path: str | Path) -> dict[bytes, int]:
    """A tiktoken BPE file (`base64-token rank` per line). Read directly: tiktoken's loader caches files by
    path in a temp directory, so a tokenizer rewritten at the same path would come back stale."""
    ranks = {}
    for line in Path(path).read_bytes().splitlines():
        if line.strip():
            tok, rank = line.split()
            ranks[base64.b64decode(tok, validate=True)] = int(rank)
    return ranks


def _split_long_runs(text: str):
    """Cut `text` after every 25k characters of one unbroken (non-)whitespace run, as the reference does."""
    pos = 0
    for m in _LONG_RUN.finditer(text):
        for cut in range(m.start() + _MAX_RUN_CHARS, m.end(), _MAX_RUN_CHARS):
            yield text[pos:cut]
            pos = cut
    yield text[pos:]


# Offsets of the named specials from the first special id (163584 in the real vocabulary).
SPECIAL_OFFSETS = {
    "[BOS]": 0,
    "[EOS]": 1,
    "<|im_end|>": 2,
    "<|im_user|>": 3,
    "<|im_assistant|>": 4,
    "<|start_header_id|>": 6,
    "<|end_header_id|>": 7,
    "[EOT]": 9,
    "<|im_system|>": 10,
    "<|tool_calls_section_begin|>": 11,
    "<|tool_calls_section_end|>": 12,
    "<|tool_call_begin|>": 13,
    "<|tool_call_argument_begin|>": 14,
    "<|tool_call_end|>": 15,
    "<|im_middle|>": 17,
    "<|media_begin|>": 18,
    "<|media_content|>": 19,
    "<|media_end|>": 20,
    "<|media_pad|>": 21,
    "<think>": 22,
    "</think>": 23,
    "[UNK]": 254,
    "[PAD]": 255,
}


class TextStream:
    """The text of a growing token sequence, decoded as it grows: each `push` decodes only the new tokens'
    bytes (re-decoding the whole output at every step cost O(length) per step, O(length^2) per request, on
    the thread that steps every row), special tokens left out, whole UTF-8 characters only (a token may end
    mid-character: its bytes wait for the next token). After `finish` (the rest flushed, an incomplete
    character as U+FFFD) `text` equals `Tokenizer.decode(ids, skip_special=True)` of every id pushed."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""
        self.ids = 0  # tokens pushed so far

    def push(self, ids: list[int]) -> str:
        """Append tokens; returns the text they completed."""
        self.ids += len(ids)
        tok = self.tok
        new = self._utf8.decode(tok.decode_bytes([i for i in ids if not tok.num_base <= i < tok.n_words]))
        self.text += new
        return new

    def finish(self) -> str:
        """The whole text, with what waited for a character's next bytes flushed."""
        self.text += self._utf8.decode(b"", final=True)
        return self.text


def first_stop(text: str, stops: tuple[str, ...], new: int, lo: int = 0) -> int | None:
    """Where the first stop string begins in `text` among those that end in its last `new` characters and
    after position `lo` (min_tokens: after the text the min_tokens-th token completed; it may begin before, as
    vLLM's), given that none ended there before (so only that tail is searched), or None."""
    end = max(lo, len(text) - new)  # an occurrence counts if it ends past here: it begins past end - len(s)
    hits = [h for s in stops if (h := text.find(s, max(0, end - len(s) + 1))) >= 0]
    return min(hits) if hits else None


def save_tokenizer(out: str | Path, ranks: dict[bytes, int]) -> int:
    """tiktoken.model + tokenizer_config.json with the Kimi special names; returns the first special id."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in sorted(ranks.items(), key=lambda kv: kv[1])]
    (out / "tiktoken.model").write_text("\n".join(lines) + "\n")
    first = len(ranks)
    added = {str(first + off): {"content": name, "special": True} for name, off in SPECIAL_OFFSETS.items()}
    cfg = {
        "tokenizer_class": "TikTokenTokenizer",
        "added_tokens_decoder": added,
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
    return first
