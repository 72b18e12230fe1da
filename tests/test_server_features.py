"""The server's features over the official `openai` client, on the session's served embedded pair
(conftest.py `served`): chat in the Kimi format (thinking, tools rendered), logprobs and echo, `n` choices
and prompt lists."""

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from served import CHAT, MODEL, PENALTIES, PROMPTS, greedy, metric

from k26 import SamplingParams
from k26.chat import ChatFormat, Message, ToolCall, render


@pytest.mark.parametrize("thinking", [True, False])
def test_chat_whole_and_streamed(served, thinking):
    """The embedded target is K2.6-format: thinking (the default) answers in reasoning_content."""
    c, llm, ref = served["client"], served["llm"], served["chats"][thinking]
    ids = render(llm.tokenizer, CHAT, ChatFormat.for_model(llm.config.model_type).with_thinking(thinking))
    assert llm.chat_ids(CHAT, thinking=thinking) == ids  # the Python API's way to the same prompt
    kw = {"model": MODEL, "messages": CHAT, "temperature": 0, "max_tokens": 8}
    kw["extra_body"] = {} if thinking else {"chat_template_kwargs": {"thinking": False}}
    whole = c.chat.completions.create(**kw)
    msg = whole.choices[0].message
    assert whole.usage.prompt_tokens == len(ids) and msg.role == "assistant"
    reasoning = (msg.model_extra or {}).get("reasoning_content")
    assert (reasoning is not None) == thinking
    assert (reasoning or "") + msg.content == ref.text and whole.usage.completion_tokens == len(ref.token_ids)
    chunks = list(c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert "".join(d.content or "" for d in deltas) == msg.content
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == (reasoning or "")
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens  # the usage chunk comes last


def test_completion_logprobs_whole_and_streamed(served):
    c, ref = served["client"], served["lp_ref"]
    whole = c.completions.create(model=MODEL, prompt=PROMPTS[0], logprobs=3, **greedy())
    lp = whole.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([x.logprob for x in ref.logprobs], abs=1e-5)
    assert len(lp.tokens) == whole.usage.completion_tokens and "".join(lp.tokens) == whole.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(len(t) == 3 for t in lp.top_logprobs)
    assert [max(t.values()) for t in lp.top_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-6)  # greedy
    zero = c.completions.create(model=MODEL, prompt=PROMPTS[0], logprobs=0, **greedy()).choices[0].logprobs
    assert zero.top_logprobs == [{t: v} for t, v in zip(zero.tokens, zero.token_logprobs)]  # the sampled one
    chunks = list(c.completions.create(model=MODEL, prompt=PROMPTS[0], logprobs=3, stream=True, **greedy()))
    got = [x for ch in chunks if ch.choices[0].logprobs for x in ch.choices[0].logprobs.token_logprobs]
    assert got == pytest.approx(lp.token_logprobs, abs=1e-5)  # (another batch row: float rounding may differ)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_with_logprobs_scores_the_prompt(served, max_tokens):
    """What evaluation harnesses send for a log-likelihood (echo, logprobs, max_tokens 0 or 1)."""
    c, ref = served["client"], served["scored"]
    kw = {"model": MODEL, "prompt": PROMPTS[2], "echo": True, "logprobs": 1, "temperature": 0}
    kw["max_tokens"] = max_tokens
    r = c.completions.create(**kw)
    lp, n = r.choices[0].logprobs, len(ref.prompt_token_ids)
    assert r.choices[0].text.startswith(PROMPTS[2]) and len(lp.tokens) == n + max_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    want = [x.logprob for x in ref.prompt_logprobs[1:]]
    assert lp.token_logprobs[1:n] == pytest.approx(want, abs=1e-5)
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset == sorted(lp.text_offset)
    chunks = list(c.completions.create(**kw, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == r.choices[0].text
    got = [x for ch in chunks if ch.choices[0].logprobs for x in ch.choices[0].logprobs.tokens]
    assert got == lp.tokens
    plain = c.completions.create(
        model=MODEL, prompt=PROMPTS[2], echo=True, max_tokens=max_tokens, temperature=0
    )
    assert plain.choices[0].text == r.choices[0].text and plain.choices[0].logprobs is None


def test_logprobs_stop_with_the_text_a_stop_string_cuts(served):
    """Tokens of the cut stop string get no logprobs, whole or streamed."""
    c, ref = served["client"], served["refs"][PROMPTS[0]]
    stop = ref.text[len(ref.text) // 2 :][:3]
    kw = dict(model=MODEL, prompt=PROMPTS[0], logprobs=1, stop=[stop], **greedy())
    whole = c.completions.create(**kw)
    text, lp = whole.choices[0].text, whole.choices[0].logprobs
    assert stop not in text and lp.text_offset and all(off < len(text) for off in lp.text_offset)
    assert len(lp.tokens) < whole.usage.completion_tokens
    chunks = list(c.completions.create(**kw, stream=True))
    got = [x for ch in chunks if ch.choices[0].logprobs for x in ch.choices[0].logprobs.tokens]
    assert got == lp.tokens


def test_chat_logprobs_whole_and_streamed(served):
    c = served["client"]
    kw = {"model": MODEL, "messages": CHAT, "temperature": 0, "max_tokens": 8}
    kw |= {"logprobs": True, "top_logprobs": 2}
    whole = c.chat.completions.create(**kw)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens  # every generated token (reasoning included)
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == e.logprob for e in content)  # greedy
    assert all(
        bytes(e.bytes).decode("utf-8", "replace") == e.token or e.token.startswith("bytes:") for e in content
    )
    chunks = list(c.chat.completions.create(**kw, stream=True))
    got = [
        e.token
        for ch in chunks
        if ch.choices and ch.choices[0].logprobs
        for e in ch.choices[0].logprobs.content
    ]
    assert got == [e.token for e in content]


def test_chat_renders_tools_tool_calls_and_tool_results(served):
    c, llm = served["client"], served["llm"]
    tools = [{"type": "function", "function": {"name": "f"}}]  # (the context holds 96 tokens)
    call = {
        "id": "functions.f:0",
        "type": "function",
        "function": {"name": "f", "arguments": "{}"},
    }
    msgs = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "w?"},
        {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "t"},
        {"role": "tool", "tool_call_id": call["id"], "content": "s"},
    ]
    fmt = ChatFormat.for_model(llm.config.model_type)
    got = c.chat.completions.create(model=MODEL, messages=msgs, tools=tools, max_tokens=1, temperature=0)
    want = [
        Message("system", "s"),
        Message("user", "w?"),
        Message("assistant", "", reasoning="t", tool_calls=(ToolCall(call["id"], "f", "{}"),)),
        Message("tool", "s", tool_call_id=call["id"]),
    ]
    assert got.usage.prompt_tokens == len(render(llm.tokenizer, want, fmt, tools))
    none = c.chat.completions.create(
        model=MODEL, messages=msgs, tools=tools, tool_choice="none", max_tokens=1
    )
    assert none.usage.prompt_tokens == len(render(llm.tokenizer, want, fmt))  # "none": no tools declared


SEEDED = {"temperature": 1.0, "top_p": 0.9, "max_tokens": 10, "extra_body": {"top_k": 50}}


def test_n_greedy_choices_each_equal_generate(served):
    c, ref = served["client"], served["refs"][PROMPTS[0]]
    r = c.completions.create(model=MODEL, prompt=PROMPTS[0], n=3, **greedy())
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert all(ch.text == ref.text and ch.finish_reason == ref.finish_reason for ch in r.choices)
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)  # the prompt counted once
    assert r.usage.completion_tokens == 3 * len(ref.token_ids)


def endpoint(c, chat: bool, prompt: str):
    """One endpoint's (create, seeded-sampling kwargs, a whole choice's text, a streamed choice's piece)."""
    if chat:
        ask = dict(messages=[{"role": "user", "content": prompt}], **SEEDED)
        return (
            c.chat.completions.create,
            ask,
            lambda ch: ch.message.content,
            lambda ch: ch.delta.content or "",
        )
    return c.completions.create, dict(prompt=prompt, **SEEDED), lambda ch: ch.text, lambda ch: ch.text


def test_n_seeded_choice_i_is_the_request_with_seed_plus_i(served):
    c = served["client"]
    for chat in (False, True):
        make, ask, text, _ = endpoint(c, chat, PROMPTS[1])
        many = make(model=MODEL, n=3, seed=11, **ask).choices
        alone = [text(make(model=MODEL, seed=11 + i, **ask).choices[0]) for i in range(3)]
        assert [text(ch) for ch in many] == alone


def test_n_streamed_choices_equal_whole(served):
    c = served["client"]
    for chat in (False, True):
        make, ask, text, piece = endpoint(c, chat, PROMPTS[2])
        whole = make(model=MODEL, n=3, seed=5, **ask)
        chunks = list(
            make(model=MODEL, n=3, seed=5, stream=True, stream_options={"include_usage": True}, **ask)
        )
        got, finishes = ["", "", ""], [[], [], []]
        for ch in chunks[:-1]:
            (part,) = ch.choices  # one choice a chunk
            got[part.index] += piece(part)
            finishes[part.index].append(part.finish_reason)
        assert got == [text(ch) for ch in whole.choices]
        for i, f in enumerate(finishes):  # each choice's finish reason once, on its last chunk
            assert f[-1] == whole.choices[i].finish_reason and all(x is None for x in f[:-1])
        assert (
            chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
        )


def test_prompt_list_answers_each_prompt_in_prompt_major_order(served):
    c, refs = served["client"], served["refs"]
    r = c.completions.create(model=MODEL, prompt=PROMPTS[:3], n=2, **greedy())
    assert [ch.index for ch in r.choices] == list(range(6))
    assert [ch.text for ch in r.choices] == [refs[p].text for p in PROMPTS[:3] for _ in range(2)]
    assert r.usage.prompt_tokens == sum(len(refs[p].prompt_token_ids) for p in PROMPTS[:3])  # each once
    assert r.usage.completion_tokens == 2 * sum(len(refs[p].token_ids) for p in PROMPTS[:3])


def test_n_choices_are_queued_together_or_not_at_all(served):
    engine, c = served["engine"], served["client"]
    import asyncio

    from k26.server.engine import QueueFull
    from k26.server.engine import Request as EngineRequest

    loop = asyncio.new_event_loop()
    requests = engine.metrics.requests
    engine.max_waiting = 4
    try:
        reqs = [EngineRequest([1, 2], SamplingParams(max_tokens=1), loop, choice=i) for i in range(5)]
        with pytest.raises(QueueFull, match="needs 5"):
            engine.submit(reqs)
        assert engine.pending == 0 and engine.metrics.requests == requests  # none of the five went in
        with engine.lock:  # two rows already waiting (the engine only lowers it when it admits real rows)
            engine.pending = 2
        try:
            with pytest.raises(QueueFull, match="2 rows wait"):  # 3 would fit alone, not beside the 2
                engine.submit(reqs[:3])
            assert engine.pending == 2 and engine.metrics.requests == requests
        finally:
            with engine.lock:
                engine.pending = 0
        with pytest.raises(openai.BadRequestError, match="max-waiting 4"):  # never servable: 400, not 429
            c.completions.create(model=MODEL, prompt="x", max_tokens=1, n=5)
    finally:
        engine.max_waiting = 64
        loop.close()
    assert len(c.completions.create(model=MODEL, prompt="x", max_tokens=1, n=4).choices) == 4


def test_a_follow_up_prompt_reports_the_tokens_its_row_held(served):
    """A prompt that extends an earlier request's prompt and answer starts where that row's cache holds it:
    usage says how many prompt tokens were not prefilled (whole and streamed), /metrics counts them."""
    c, url = served["client"], served["url"]
    first = c.completions.create(model=MODEL, prompt=PROMPTS[6], **greedy())
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    follow = PROMPTS[6] + first.choices[0].text + "\n"
    before = metric(url, "k26_prefix_cache_hit_tokens_total")
    r = c.completions.create(model=MODEL, prompt=follow, temperature=0, max_tokens=2)
    hit = r.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens <= hit < r.usage.prompt_tokens
    assert metric(url, "k26_prefix_cache_hit_tokens_total") == before + hit
    chunks = list(
        c.completions.create(
            model=MODEL,
            prompt=follow,
            temperature=0,
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - 1


def test_penalties_and_logit_bias_answer_as_generate(served):
    """presence_penalty, frequency_penalty and logit_bias are served: the answer is generate()'s with the same
    SamplingParams, whole and streamed, and differs from the unpenalised one."""
    c = served["client"]
    want = served["penalized"].text
    assert want != served["refs"][PROMPTS[0]].text
    whole = c.completions.create(model=MODEL, prompt=PROMPTS[0], **greedy(), **PENALTIES).choices[0].text
    chunks = c.completions.create(model=MODEL, prompt=PROMPTS[0], stream=True, **greedy(), **PENALTIES)
    assert whole == want == "".join(ch.choices[0].text for ch in chunks)


def test_stop_token_ids_end_the_answer_before_their_id(served):
    """vLLM's `stop_token_ids`: the greedy answer ends (finish_reason "stop") just before the first
    generated id that is one of them, whole and streamed."""
    c, llm, ref = served["client"], served["llm"], served["refs"][PROMPTS[0]]
    k = 3
    stop = ref.token_ids[k]
    cut = ref.token_ids[: ref.token_ids.index(stop)]  # (an earlier equal id ends it there)
    whole = c.completions.create(
        model=MODEL, prompt=PROMPTS[0], **greedy(), extra_body={"stop_token_ids": [stop]}
    )
    choice = whole.choices[0]
    assert choice.text == llm.tokenizer.decode(cut) and choice.finish_reason == "stop"
    assert whole.usage.completion_tokens == len(cut)
    chunks = c.completions.create(
        model=MODEL, prompt=PROMPTS[0], stream=True, **greedy(), extra_body={"stop_token_ids": [stop]}
    )
    assert "".join(ch.choices[0].text for ch in chunks) == choice.text


@pytest.mark.parametrize("chat", [False, True])
def test_ignore_eos_and_min_tokens_generate_through_the_end_ids(served, chat):
    """A logit bias makes an end id the greedy choice: the answer ends at once (finish_reason "stop"),
    with vLLM's `ignore_eos` it runs to max_tokens (finish_reason "length") instead, and with vLLM's
    `min_tokens` it ends on an end id after min_tokens tokens."""
    c, llm = served["client"], served["llm"]
    end = llm.tokenizer.stop_ids[0]
    kw = {"model": MODEL, **greedy(), "logit_bias": {str(end): 100}}
    create = c.chat.completions.create if chat else c.completions.create
    kw.update({"messages": CHAT} if chat else {"prompt": PROMPTS[1]})
    ended = create(**kw)
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens == 0
    through = create(**kw, extra_body={"ignore_eos": True})
    assert (
        through.choices[0].finish_reason == "length" and through.usage.completion_tokens == kw["max_tokens"]
    )
    held = create(**kw, extra_body={"min_tokens": 3})  # the end ids wait 3 tokens, then end it
    assert held.choices[0].finish_reason == "stop" and held.usage.completion_tokens == 3
    # vLLM's ignore_eos with min_tokens: the end ids are held back all the same, then no longer stop
    both = create(**kw, extra_body={"min_tokens": 3, "ignore_eos": True})
    assert both.choices[0].finish_reason == "length"
    if not chat:  # (the chat answer's text is what the parser makes of the end ids)
        first = [c.completions.create(**{**kw, "max_tokens": 3, "logit_bias": {}}).choices[0].text]
        assert both.choices[0].text.startswith(first[0])
