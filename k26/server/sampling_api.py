"""A request's sampling fields (max_tokens / max_completion_tokens, temperature, top_p, top_k, seed, stop,
the penalties, min_tokens, logit_bias, vLLM's ignore_eos / stop_token_ids, logprobs / top_logprobs) read
into one prompt's `SamplingParams`, each bad value an `APIError` naming its field."""

from __future__ import annotations

from typing import Any

from ..sampling import MAX_LOGPROBS, SamplingParams
from .errors import APIError
from .json_values import id_list, is_int, number, short

MAX_STOP = 4
MAX_STOP_CHARS = 512  # characters a stop string may hold
MAX_STOP_IDS = 64  # stop_token_ids a request may name


def sampling_params(
    body: dict, chat: bool, room: int, vocab: int, eos: tuple[int, ...], where: str = "the prompt"
) -> SamplingParams:
    """One prompt's sampling; `room`: the positions its context leaves after it (chat's default max_tokens,
    and the cap on max_tokens and min_tokens), `eos`: the tokenizer's end ids, `where`: the prompt as an
    error names it (one of a /v1/completions list: prompt[k])."""
    for key in ("max_tokens", "max_completion_tokens") if chat else ("max_tokens",):  # each one given
        if body.get(key) is not None and (not is_int(body[key]) or body[key] < 0):
            raise APIError(400, f"{key}={short(body[key])}: expected an integer >= 0", key)
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    mt = body.get(key)
    if mt is None:
        mt = room if chat else min(room, 16)  # OpenAI's: the rest of the context (chat), 16 (completions)
    elif mt > room:  # (as OpenAI and vLLM: a 400, not a completion silently cut to the context)
        msg = f"{key}={mt}: the model's context leaves {room} tokens after {where}; ask for fewer"
        raise APIError(400, msg, key, code="context_length_exceeded")
    t = number(body, "temperature", 1.0)  # OpenAI's default
    if not 0 <= t <= 2:
        raise APIError(400, f"temperature={short(t)}: must lie in [0, 2]", "temperature")
    top_p = number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise APIError(400, f"top_p={short(top_p)}: must lie in (0, 1]", "top_p")
    top_k = body.get("top_k", 0)
    if top_k is None or top_k == -1:
        top_k = 0  # vLLM's "off"
    if not is_int(top_k) or not 0 <= top_k < 2**31:
        raise APIError(400, f"top_k={short(top_k)}: expected an integer in [0, 2**31) (0, -1: off)", "top_k")
    seed = body.get("seed")
    if seed is not None and (not is_int(seed) or not -(2**63) <= seed < 2**63):
        raise APIError(400, f"seed={short(seed)}: expected an integer in [-2**63, 2**63)", "seed")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise APIError(
            400,
            f"stop={short(body.get('stop'))}: expected a non-empty string or up to {MAX_STOP} of them",
            "stop",
        )
    if any(len(s) > MAX_STOP_CHARS for s in stop):  # (a stream re-checks each one's prefixes at every event)
        raise APIError(400, f"stop: a stop string longer than {MAX_STOP_CHARS} characters", "stop")
    penalties = {}
    for name in ("presence_penalty", "frequency_penalty"):
        penalties[name] = number(body, name, 0.0)
        if not -2 <= penalties[name] <= 2:
            raise APIError(400, f"{name}={short(penalties[name])}: must lie in [-2, 2]", name)
    least = body.get("min_tokens")
    least = 0 if least is None else least
    if not is_int(least) or not 0 <= least <= mt:
        raise APIError(
            400, f"min_tokens={short(least)}: expected an integer in [0, max_tokens={mt}]", "min_tokens"
        )
    return SamplingParams(
        temperature=float(t),
        top_p=float(top_p),
        top_k=top_k,
        max_tokens=mt,
        min_tokens=least,
        seed=seed,
        stop=tuple(stop),
        logprobs=_logprobs(body, chat),
        logit_bias=_logit_bias(body.get("logit_bias"), vocab),
        stop_token_ids=_stop_token_ids(body, vocab, eos),
        **penalties,
    )


def _stop_token_ids(body: dict, vocab: int, eos: tuple[int, ...]) -> tuple[int, ...] | None:
    """SamplingParams.stop_token_ids from vLLM's `ignore_eos` and `stop_token_ids`: the tokenizer's end
    ids (`eos`) unless ignored, then the extra ids; None (the tokenizer's default) when neither is given."""
    ignore = body.get("ignore_eos")
    if ignore is not None and not isinstance(ignore, bool):
        raise APIError(400, f"ignore_eos={short(ignore)}: expected true or false", "ignore_eos")
    extra = body.get("stop_token_ids")
    extra = [] if extra is None else extra
    if not id_list(extra, vocab) or len(extra) > MAX_STOP_IDS:
        raise APIError(
            400,
            f"stop_token_ids={short(body.get('stop_token_ids'))}: expected up to {MAX_STOP_IDS} token ids "
            f"in [0, {vocab})",
            "stop_token_ids",
        )
    if not ignore and not extra:
        return None
    return tuple(dict.fromkeys((() if ignore else eos) + tuple(extra)))  # each id once, in order


def _logit_bias(lb: Any, vocab: int) -> tuple[tuple[int, float], ...]:
    """`logit_bias`: {token id (a string, as JSON keys are): bias in [-100, 100]}."""
    if lb is None:
        return ()
    if not isinstance(lb, dict):
        raise APIError(400, f"logit_bias={short(lb)}: expected an object {{token id: bias}}", "logit_bias")
    out = []
    for key, v in lb.items():
        k = key.strip() if isinstance(key, str) else ""
        k = k.lstrip("0") or k[:1]  # ("0005" and "00005" alike: both 5, or both refused)
        # (the length first: int() of a 4,300+ digit string raises)
        if len(k) > len(str(vocab)) or not (k.isdigit() and k.isascii()) or int(k) >= vocab:
            raise APIError(400, f"logit_bias: {short(key)} is not a token id in [0, {vocab})", "logit_bias")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise APIError(
                400, f"logit_bias[{short(key)}]={short(v)}: expected a number in [-100, 100]", "logit_bias"
            )
        out.append((int(k), float(v)))
    if len({i for i, _ in out}) != len(out):
        raise APIError(400, "logit_bias: a token id appears twice", "logit_bias")
    return tuple(out)


def _logprobs(body: dict, chat: bool) -> int | None:
    """SamplingParams.logprobs: /v1/completions' `logprobs` (how many top tokens), /v1/chat/completions'
    `logprobs` (bool) with `top_logprobs`."""
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if not chat:
        if lp is not None and (not is_int(lp) or not 0 <= lp <= MAX_LOGPROBS):
            msg = f"logprobs={short(lp)}: expected an integer in [0, {MAX_LOGPROBS}]"
            raise APIError(400, msg, "logprobs")
        return lp
    if lp is not None and not isinstance(lp, bool):
        raise APIError(400, f"logprobs={short(lp)}: expected true or false", "logprobs")
    if top is not None and (not is_int(top) or not 0 <= top <= MAX_LOGPROBS):
        raise APIError(
            400, f"top_logprobs={short(top)}: expected an integer in [0, {MAX_LOGPROBS}]", "top_logprobs"
        )
    if top is not None and not lp:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if lp else None
