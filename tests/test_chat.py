"""The Kimi chat format's output side (k26/chat_parser.py): output ids parsed into reasoning, content and
tool calls, the same whole or streamed in any split (random marker soup included), stop-string cuts,
max_tokens cuts and parallel_tool_calls limits applied, and every character kept. The input side
(rendering prompts) is in test_chat_render.py; `two_calls` here is also test_server_chat.py's script."""

import random

import pytest
import torch

from k26.chat import ToolCall
from k26.chat_parser import MARKERS, ChatParser
from k26.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tiny_k25):
    return Tokenizer.from_dir(tiny_k25)


def output(tok, *parts) -> list[int]:
    """Output ids from text pieces (ordinary text) and special names."""
    ids = []
    for p in parts:
        ids += [tok.token_id(p)] if p in tok.special_ids else tok.encode(p)
    return ids


def two_calls(tok) -> list[int]:
    return output(
        tok,
        "let me think: é😀",
        "</think>",
        "Sure.",
        "<|tool_calls_section_begin|>",
        "<|tool_call_begin|>",
        "functions.get_weather:0",
        "<|tool_call_argument_begin|>",
        '{"city": "Zürich"}',
        "<|tool_call_end|>",
        "<|tool_call_begin|>",
        " functions.get_time:1 ",
        "<|tool_call_argument_begin|>",
        "{}",
        "<|tool_call_end|>",
        "<|tool_calls_section_end|>",
    )


def test_parser_splits_reasoning_content_and_tool_calls(tok):
    p = ChatParser(tok, thinking=True)
    p.push(two_calls(tok))
    p.finish()
    assert p.reasoning() == "let me think: é😀" and p.content() == "Sure."
    assert p.tool_calls() == [
        ToolCall("functions.get_weather:0", "get_weather", '{"city": "Zürich"}'),
        ToolCall("functions.get_time:1", "get_time", "{}"),
    ]
    assert p.tool_calls(limit=1) == p.tool_calls()[:1]
    assert p.finish_reason("stop") == "tool_calls" and p.finish_reason("length") == "length"
    assert p.plain == tok.decode(two_calls(tok), skip_special=True)  # the text stop strings are cut in


def streamed(p: ChatParser, ids: list[int], rng: random.Random, limit=None):
    """Feed `ids` in random chunks, taking after each with a random hold-back; return what went out."""
    got = {"reasoning": "", "content": "", "calls": {}}

    def add(piece):
        got["reasoning"] += piece.reasoning
        got["content"] += piece.content
        for index, cid, name, args in piece.calls:
            c = got["calls"].setdefault(index, [None, None, ""])
            if cid is not None:
                assert c[0] is None, "a call's header goes out once"
                c[0], c[1] = cid, name
            else:
                assert c[0] is not None, "arguments only after the header"
            c[2] += args

    i = 0
    while i < len(ids):
        n = rng.randint(1, 4)
        p.push(ids[i : i + n])
        i += n
        add(p.take(max(len(p.plain) - rng.randint(0, 3), 0), limit=limit))
    p.finish()
    add(p.take(len(p.plain), final=True, limit=limit))
    return got


@pytest.mark.parametrize("seed", range(8))
def test_parser_stream_equals_whole_in_any_split(tok, seed):
    ids = two_calls(tok)
    whole = ChatParser(tok, thinking=True)
    whole.push(ids)
    whole.finish()
    for limit in (None, 1):
        got = streamed(ChatParser(tok, thinking=True), ids, random.Random(seed), limit)
        assert got["reasoning"] == whole.reasoning() and got["content"] == whole.content()
        calls = [ToolCall(c[0], c[1], c[2]) for _, c in sorted(got["calls"].items())]
        assert calls == whole.tool_calls(limit)


def test_parser_reads_a_think_block_the_model_opens_itself(tok):
    p = ChatParser(tok, thinking=False)  # K2-Thinking: the prompt opens nothing
    p.push(output(tok, "<think>", "hmm", "</think>", "answer"))
    p.finish()
    assert (p.reasoning(), p.content()) == ("hmm", "answer")
    q = ChatParser(tok, thinking=False)
    q.push(output(tok, "answer <think>", "<think>"))  # not at the start: no reasoning channel
    assert q.reasoning() is None and q.content() == "answer <think>"


def test_parser_cut_at_a_stop_string_drops_what_follows(tok):
    ids = two_calls(tok)
    plain = tok.decode(ids, skip_special=True)
    p = ChatParser(tok, thinking=True)
    p.push(ids)
    p.finish(cut=plain.index("Sure") + 2)  # a stop string began inside the content
    assert p.content() == "Su" and p.tool_calls() == [] and p.finish_reason("stop") == "stop"
    q = ChatParser(tok, thinking=True)
    q.push(ids)
    q.finish(cut=plain.index("functions.get_time") + 3)  # inside the second call's id
    assert [c.id for c in q.tool_calls()] == ["functions.get_weather:0", "fun"]
    assert q.finish_reason("stop") == "tool_calls"  # the first call closed before the cut
    r = ChatParser(tok, thinking=True)
    r.push(ids)
    r.finish(cut=plain.index(" functions.get_time"))  # the second call has no id yet: not a call
    assert [c.name for c in r.tool_calls()] == ["get_weather"]


def test_parser_reports_a_call_cut_by_max_tokens(tok):
    ids = two_calls(tok)
    cut = ids.index(tok.token_id("<|tool_call_end|>")) - 1  # the arguments' last token never came
    p = ChatParser(tok, thinking=True)
    p.push(ids[:cut])
    p.finish()
    (call,) = p.tool_calls()
    assert call.name == "get_weather" and '{"city": "Zürich"}'.startswith(call.arguments)
    assert p.finish_reason("length") == "length" and p.finish_reason("stop") == "stop"


def test_parser_drops_a_call_without_an_id_everywhere(tok):
    ids = output(
        tok,
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        '{"a": 1}',
        "<|tool_call_end|>",
        "<|tool_call_begin|>",
        "functions.f:1",
        "<|tool_call_argument_begin|>",
        "{}",
        "<|tool_call_end|>",
    )
    for limit in (None, 1):
        p = ChatParser(tok, thinking=False)
        p.push(ids)
        p.finish()
        assert p.tool_calls(limit) == [ToolCall("functions.f:1", "f", "{}")]
        assert p.finish_reason("stop", limit) == "tool_calls"
        got = streamed(ChatParser(tok, thinking=False), ids, random.Random(limit or 0), limit)
        assert {k: (c[0], c[2]) for k, c in got["calls"].items()} == {0: ("functions.f:1", "{}")}
    q = ChatParser(tok, thinking=False)
    q.push(ids[:4])  # only the call without an id: no call, and it did not finish by calling
    q.finish()
    assert q.tool_calls() == [] and q.finish_reason("stop") == "stop"


def test_parser_keeps_every_character_in_odd_marker_orders(tok):
    ids = output(
        tok,
        "plan ",
        "<|tool_call_begin|>",  # a call inside reasoning: reasoning resumes after it
        "functions.a:0",
        "<|tool_call_argument_begin|>",
        "{}",
        "<|tool_call_end|>",
        " more",
        "</think>",
        "The answer",
        "<|tool_call_begin|>",
        "functions.b:1",
        "<|tool_call_begin|>",  # a call begun inside an unfinished one: the first stays unclosed
        "functions.c:2",
        "<|tool_call_argument_begin|>",
        "{}",
        "<|tool_call_end|>",
        "<|tool_calls_section_end|>",  # stray
        " end",
    )
    p = ChatParser(tok, thinking=True)
    p.push(ids)
    p.finish()
    assert (p.reasoning(), p.content()) == ("plan  more", "The answer end")
    assert [c.id for c in p.tool_calls()] == ["functions.a:0", "functions.b:1", "functions.c:2"]
    assert sorted(p.closed) == [0, 2]


def test_parser_without_tools_leaves_call_text_in_the_content(tok):
    p = ChatParser(tok, thinking=True, tools=False)
    p.push(two_calls(tok))
    p.finish()
    assert p.tool_calls() == [] and p.finish_reason("stop") == "stop"
    assert p.content() == 'Sure.functions.get_weather:0{"city": "Zürich"} functions.get_time:1 {}'


def test_parser_joins_a_character_split_by_a_marker_as_plain_decoding_does(tok):
    pieces = [tok.enc.encode_single_token(bytes([b])) for b in "你".encode()]  # (byte-level BPE)
    ids = [*tok.encode("ok "), *pieces[:-1], tok.token_id("</think>"), pieces[-1], *tok.encode("xy")]
    p = ChatParser(tok, thinking=True)
    p.push(ids)
    p.finish(cut=len(tok.decode(ids, skip_special=True)))
    assert p.plain == tok.decode(ids, skip_special=True) == "ok 你xy"
    assert (p.reasoning(), p.content()) == ("ok ", "你xy")


SCRAPS = [*MARKERS, "<|im_middle|>"]  # the parser's markers and a special it leaves out


@pytest.mark.parametrize("seed", range(40))
def test_parser_stream_equals_whole_on_random_marker_soup(tok, seed):
    """Random ordinary text (multi-byte characters cut into single bytes) and markers in any order."""
    rng = random.Random(seed)
    ids = []
    for _ in range(rng.randint(1, 30)):
        r = rng.random()
        if r < 0.35:
            ids.append(tok.token_id(rng.choice(SCRAPS)))
        elif r < 0.5:
            ids += [tok.enc.encode_single_token(bytes([b])) for b in rng.choice(["é", "😀", "你"]).encode()]
        else:
            ids += tok.encode(rng.choice(["functions.f:0", " ", "{}", "x", "ab c", "\n"]))
    for limit in (None, 1):
        whole = ChatParser(tok, thinking=seed % 2 == 0)
        whole.push(ids)
        whole.finish()
        assert sum(len(p.text) for p in whole.parts) == len(whole.plain)  # no character dropped
        assert whole.plain == tok.decode(ids, skip_special=True)
        got = streamed(ChatParser(tok, thinking=seed % 2 == 0), ids, random.Random(seed + 99), limit)
        assert got["reasoning"] == (whole.reasoning() or "") and got["content"] == whole.content()
        calls = [ToolCall(c[0], c[1], c[2]) for _, c in sorted(got["calls"].items())]
        assert calls == whole.tool_calls(limit)


def test_the_parser_names_what_it_cannot_read(tok):
    # (a str raised a comparison TypeError, an out-of-vocabulary id was dropped unsaid, thinking="no" was
    # taken for True, a push after finish() went on, a negative cut emptied the content)
    with pytest.raises(TypeError, match="thinking='no'"):
        ChatParser(tok, thinking="no")
    p = ChatParser(tok, thinking=False)
    for ids, error, needle in [
        ("hello", TypeError, "ids is a str"),
        (5, TypeError, "ids is a int"),
        ([1, 10**9], ValueError, r"ids\[1\] = 1000000000 is not a token id"),
        ([1.0], ValueError, r"ids\[0\] = 1.0"),
    ]:
        with pytest.raises(error, match=needle):
            p.push(ids)
    with pytest.raises(ValueError, match="cut=-1"):
        p.finish(-1)
    p.push(tok.encode("abc"))
    p.finish()
    assert p.content() == "abc"
    with pytest.raises(RuntimeError, match="finished"):
        p.push([41])


def test_chat_parser_arguments_are_checked_at_the_boundary(tok):
    # (found in an audit: an LLM for its tokenizer an AttributeError, limit=-1 dropped the last call silently,
    # limit="x" / take("x") a bare TypeError, a tensor of ids refused while generate() takes one)
    with pytest.raises(TypeError, match="tok is a str; expected a Tokenizer"):
        ChatParser("tok", thinking=False)
    p = ChatParser(tok, thinking=False)
    p.push(torch.tensor(tok.encode("hi")))
    assert p.plain == "hi"
    for limit, error in ((-1, ValueError), (0, ValueError), ("x", TypeError), (True, TypeError)):
        with pytest.raises(error, match="limit="):
            p.tool_calls(limit)
        with pytest.raises(error, match="limit="):
            p.take(2, limit=limit)
    with pytest.raises(TypeError, match="upto="):
        p.take("x")
    with pytest.raises(TypeError, match="reason=5"):
        p.finish_reason(5)
