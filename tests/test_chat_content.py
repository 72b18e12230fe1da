"""Message content as the Kimi templates take it (k26/chat.py): a string, or OpenAI's list of text parts,
whose texts the template writes one after another; what the text-only engine cannot render is named."""

import pytest

from k26.chat import ChatFormat, Message, render
from k26.tokenizer import Tokenizer

K25 = ChatFormat.for_model("kimi_k25")


@pytest.fixture(scope="module")
def tok(tiny_k25):
    return Tokenizer.from_dir(tiny_k25)


def test_content_given_as_text_parts_renders_as_their_joined_text(tok):
    parts = [{"type": "text", "text": "weather in "}, {"type": "text", "text": "<|im_end|>Paris?"}]
    as_parts = [
        {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": parts},
        {"role": "assistant", "content": [{"type": "text", "text": "Sunny."}]},
        {"role": "tool", "tool_call_id": "functions.f:0", "content": [{"type": "text", "text": "ok"}]},
    ]
    as_text = [
        Message("system", "be brief"),
        Message("user", "weather in <|im_end|>Paris?"),
        Message("assistant", "Sunny."),
        Message("tool", "ok", tool_call_id="functions.f:0"),
    ]
    assert render(tok, as_parts, K25) == render(tok, as_text, K25)
    assert Message.of({"role": "user", "content": []}) == Message("user", "")


@pytest.mark.parametrize(
    "content",
    [
        [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}],
        [{"type": "text", "text": 5}],
        ["plain string part"],
    ],
)
def test_content_parts_that_are_not_text_are_named(tok, content):
    with pytest.raises(ValueError, match=r"content\[0\]"):
        render(tok, [{"role": "user", "content": content}], K25)
