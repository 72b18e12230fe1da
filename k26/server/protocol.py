"""OpenAI request validation and response shapes for /v1/completions and /v1/chat/completions (the chat
messages, tools and thinking switch: chat_api.py; the sampling fields: sampling_api.py), and the bodies of
/tokenize and /detokenize.

Every bad input becomes an `APIError` (HTTP status, message naming the item, OpenAI error type and
param) before any work reaches the engine; unsupported parameters are refused by name, never ignored.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..chat import ChatFormat
from ..sampling import SamplingParams
from ..tokenizer import Tokenizer
from .chat_api import ChatTurn, parse_chat
from .errors import APIError
from .json_values import is_int, short
from .sampling_api import sampling_params

COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "seed",
    "stream",
    "stream_options",
    "n",
    "user",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "ignore_eos",  # vLLM's: the end-of-turn / end-of-text ids do not end a choice
    "stop_token_ids",  # vLLM's: more ids that end a choice (the id is not part of the answer)
    "min_tokens",  # vLLM's: no stop id or stop string ends a choice before this many tokens
}
COMPLETION = COMMON | {"prompt", "echo", "best_of", "suffix"}
CHAT = COMMON | {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "parallel_tool_calls",
    "response_format",
    "chat_template_kwargs",  # vLLM's / SGLang's way to switch K2.5 / K2.6 thinking: {"thinking": bool}
}
# accepted when they ask for nothing beyond plain generation; anything else is refused by name
NEUTRAL = {
    "suffix": (None, ""),
    "functions": (None, []),  # the deprecated form of tools
    "function_call": (None, "none"),
}
MAX_N = 16  # choices a request may ask for (`n`): each takes a row of the batch like a request of its own
MAX_PROMPTS = 64  # prompts in one /v1/completions request (a list); prompts x n rows in all


@dataclass
class Parsed:
    """A validated request: its prompts as ids (one, or a /v1/completions list) with their sampling (each
    prompt's max_tokens fits its own room), how many choices a prompt, and how to answer."""

    prompts: list[list[int]]
    params: list[SamplingParams]
    stream: bool
    include_usage: bool
    chat: bool
    n: int = 1
    turn: ChatTurn | None = None  # chat: how to read the output (thinking, tool calls)
    echo: bool = False  # completions: the prompt's text (and with logprobs its tokens') comes first

    def rows(self) -> list[tuple[list[int], SamplingParams]]:
        """Every choice's (prompt ids, sampling), in OpenAI's choice order: index = prompt * n + i. Choice i
        of a prompt samples with seed + i when a seed is given (so the choices differ, and choice 0 is what
        the same prompt with n = 1 answers); without one each row draws its own noise anyway."""
        out = []
        for ids, sp in zip(self.prompts, self.params):
            for i in range(self.n):
                seeded = sp.seed is not None and i > 0
                out.append((ids, dataclasses.replace(sp, seed=sp.seed + i) if seeded else sp))
        return out


def parse(
    body: Any,
    *,
    chat: bool,
    model: str,
    tok: Tokenizer,
    vocab: int,
    max_model_len: int,
    fmt: ChatFormat = ChatFormat(),  # noqa: B008  (frozen)
    logprobs: bool = True,
) -> Parsed:
    """A validated request (`logprobs`: the server serves them; else asking for them is a 400)."""
    _known(body, CHAT if chat else COMPLETION, model)
    _refuse_unserved(body)
    turn = None
    if chat:
        ids, turn = parse_chat(body, tok, fmt, max_model_len)
        prompts = [ids]
    else:
        prompts = _prompts(body, tok, vocab, max_model_len)
    for k, ids in enumerate(prompts):
        if len(ids) >= max_model_len:
            raise _too_long(
                "messages" if chat else "prompt" if len(prompts) == 1 else f"prompt[{k}]", ids, max_model_len
            )
    stream = False if body.get("stream") is None else body["stream"]  # (null: OpenAI's default, false)
    if not isinstance(stream, bool):
        raise APIError(400, f"stream={short(stream)}: expected true or false", "stream")
    opts = body.get("stream_options")
    bad = (
        not isinstance(opts, dict)
        or set(opts) - {"include_usage"}
        or not isinstance(opts.get("include_usage", False), bool)
    )
    if opts is not None and (not stream or bad):
        raise APIError(400, "stream_options: only {'include_usage': bool} with stream=true", "stream_options")
    n = body.get("n")
    n = 1 if n is None else n
    if not is_int(n) or not 1 <= n <= MAX_N:
        raise APIError(400, f"n={short(body.get('n'))}: expected an integer in [1, {MAX_N}]", "n")
    best_of = body.get("best_of")
    # more candidates than choices (ranked by logprobs): not served
    if best_of is not None and (not is_int(best_of) or best_of != n):
        raise APIError(
            400, f"best_of={short(best_of)} is not supported by this server (only best_of = n)", "best_of"
        )
    echo = False if body.get("echo") is None else body["echo"]
    if not isinstance(echo, bool):
        raise APIError(400, f"echo={short(echo)}: expected true or false", "echo")
    if not isinstance(body.get("user", ""), (str, type(None))):  # (OpenAI's end-user id: logged nowhere here)
        raise APIError(400, f"user={short(body['user'])}: expected a string", "user")
    params = [
        sampling_params(
            body,
            chat,
            max_model_len - len(ids),
            vocab,
            tok.stop_ids,
            "the prompt" if len(prompts) == 1 else f"prompt[{k}]",
        )
        for k, ids in enumerate(prompts)
    ]
    if params[0].logprobs is not None and not logprobs:
        raise APIError(400, "logprobs: this server was started with --no-logprobs", "logprobs")
    if echo and params[0].logprobs is not None:  # the prompt's tokens get theirs too
        params = [dataclasses.replace(sp, prompt_logprobs=sp.logprobs) for sp in params]
    if params[0].seed is not None and params[0].seed + n - 1 >= 2**63:  # choice i samples with seed + i
        raise APIError(400, f"seed={params[0].seed}: with n={n}, seed + n - 1 must stay below 2**63", "seed")
    return Parsed(
        prompts,
        params,
        stream,
        bool(opts and opts.get("include_usage")),
        chat,
        n,
        turn,
        echo,
    )


def _known(body: Any, keys: set[str], model: str) -> None:
    """A JSON object of known keys, naming the model this server serves."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - keys)
    if unknown:
        raise APIError(400, f"unrecognized request argument supplied: {unknown[0]}", unknown[0])
    if body.get("model") is None:
        raise APIError(400, "missing required parameter: 'model'", "model")
    if not isinstance(body["model"], str):
        raise APIError(400, f"model={short(body['model'])}: expected a string", "model")
    if body["model"] != model:
        raise APIError(
            404,
            f"the model {short(body['model'])} does not exist; this server serves {short(model)}",
            "model",
            code="model_not_found",
        )


def prompt_ids(body: Any, tok: Tokenizer, vocab: int, fmt: ChatFormat, *, model: str) -> list[int]:
    """/tokenize: a `prompt` (string or ids) or chat `messages` (with `tools`, `chat_template_kwargs`)."""
    _known(body, {"model", "prompt", "messages", "tools", "tool_choice", "chat_template_kwargs"}, model)
    if ("prompt" in body) == ("messages" in body):
        raise APIError(400, "tokenize: give one of 'prompt' or 'messages'", "prompt")
    if "messages" in body:
        return parse_chat(body, tok, fmt)[0]
    chat_only = sorted({"tools", "tool_choice", "chat_template_kwargs"} & set(body))
    if chat_only:
        raise APIError(400, f"tokenize: {chat_only[0]} goes with 'messages', not 'prompt'", chat_only[0])
    return _prompt(body["prompt"], tok, vocab, "prompt")


def token_ids(body: Any, vocab: int, *, model: str) -> list[int]:
    """/detokenize: `tokens`, ids of this vocabulary."""
    _known(body, {"model", "tokens"}, model)
    ids = body.get("tokens")
    if ids is None:  # (as every endpoint says a missing field)
        raise APIError(400, "missing required parameter: 'tokens'", "tokens")
    if not isinstance(ids, list):
        raise APIError(400, f"tokens={short(ids)}: expected a list of token ids in [0, {vocab})", "tokens")
    for i, t in enumerate(ids):  # the first element that is no id of this vocabulary, by its index
        if not (is_int(t) and 0 <= t < vocab):
            msg = f"tokens[{i}]={short(t)}: expected a token id in [0, {vocab})"
            raise APIError(400, msg, f"tokens[{i}]")
    return ids


def _refuse_unserved(body: dict) -> None:
    """Parameters that ask for what this server does not do, refused by name."""
    for name, ok in NEUTRAL.items():
        if name in body and body[name] not in ok:
            raise APIError(400, f"{name}={short(body[name])} is not supported by this server", name)
    rf = body.get("response_format")
    if rf is not None and rf != {"type": "text"}:
        raise APIError(400, 'response_format: only {"type": "text"} is supported', "response_format")


def _prompts(body: dict, tok: Tokenizer, vocab: int, max_len: int) -> list[list[int]]:
    """`prompt` as OpenAI takes it: a string, a list of token ids, or a list of either (several prompts)."""
    p = body.get("prompt")
    if p is None:
        raise APIError(400, "missing required parameter: 'prompt'", "prompt")
    several = isinstance(p, list) and bool(p) and all(isinstance(x, (str, list)) for x in p)
    if isinstance(p, list) and not several and any(isinstance(x, (str, list)) for x in p):
        # both kinds: the first element unlike prompt[0] is the odd one (prompt[0] itself where it is neither)
        first = isinstance(p[0], (str, list))
        odd = (i for i, x in enumerate(p) if isinstance(x, (str, list)) != first)
        i = next(odd) if first or is_int(p[0]) else 0
        want = "a prompt (a string or a list of token ids)" if first or i == 0 else "a token id"
        msg = f"prompt[{i}]={short(p[i])}: expected {want}; a list holds prompts or token ids, not both"
        raise APIError(400, msg, f"prompt[{i}]")
    items = p if several else [p]
    if len(items) > MAX_PROMPTS:
        raise APIError(400, f"prompt: {len(items)} prompts, at most {MAX_PROMPTS} a request", "prompt")
    # (one prompt is "prompt" even in a list of one; its elements keep their place: prompt[0][i])
    return [
        _prompt(
            x,
            tok,
            vocab,
            f"prompt[{k}]" if len(items) > 1 else "prompt",
            max_len,
            f"prompt[{k}]" if several else "prompt",
        )
        for k, x in enumerate(items)
    ]


def _prompt(
    p: Any, tok: Tokenizer, vocab: int, where: str, max_len: int | None = None, at: str | None = None
) -> list[int]:
    """One prompt's ids; a text that cannot fit `max_len` tokens whatever it encodes to is refused before
    it is encoded (tokenizing tens of megabytes takes seconds). `at`: the prompt's place in the request, for
    naming one of its elements (default `where`)."""
    if isinstance(p, str):
        if max_len is not None and tok.min_tokens(len(p)) > max_len - 1:
            raise APIError(
                400,
                f"{where}: {len(p):,} characters, more than the {max_len} tokens of the context "
                f"(max_model_len) can hold",
                where,
                code="context_length_exceeded",
            )
        ids = tok.encode(p)
    elif isinstance(p, list) and max_len is not None and len(p) >= max_len:  # before a pass over millions
        raise _too_long(where, p, max_len)
    elif isinstance(p, list) and all(is_int(t) for t in p):
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"{where}: token id {bad[0]} is outside the vocabulary [0, {vocab})", where)
        ids = list(p)
    elif isinstance(p, list):  # the first element that is no token id, by its index
        i, at = next(i for i, t in enumerate(p) if not is_int(t)), at or where
        raise APIError(400, f"{at}[{i}]={short(p[i])}: expected a token id (an integer)", f"{at}[{i}]")
    else:
        raise APIError(
            400, f"{where}: expected a string or a list of token ids, got {type(p).__name__}", where
        )
    if not ids:
        raise APIError(400, f"{where} is empty", where)
    return ids


def _too_long(where: str, ids: list, max_len: int) -> APIError:
    msg = f"{where}: {len(ids)} tokens, but the context holds {max_len} (max_model_len), leaving no room to "
    msg += "generate"
    return APIError(400, msg, where, code="context_length_exceeded")
