"""Reasoning parser: think blocks split from the answer across every chunking, and template detection."""

from __future__ import annotations

import pytest

from statelm.api.parsers.reasoning import (
    THINK_TAGS,
    ReasoningParser,
    ReasoningTags,
    detect_reasoning_tags,
    prompt_opens_reasoning,
)
from statelm.tokenizer import render_chat_template
from tests.unit.stream_chunks import chunkings

# Recorded outputs (Qwen3-8B, DeepSeek-R1-Distill, Magistral), with the tags each uses.
QWEN3 = (
    "<think>\nOkay, the user asks for 17 * 23. 17 * 20 = 340 and 17 * 3 = 51, so 391.\n</think>\n\n17 × 23 = **391**."
)
R1_TEMPLATE_OPENED = "Let me compute: 2 + 2 is 4. No tricks here.\n</think>\n\nThe answer is 4."
MAGISTRAL = "[THINK]The user greets me; reply briefly.[/THINK]Hello! How can I help you today?"


def run(parser: ReasoningParser, chunks: list[str]) -> tuple[str, str]:
    reasoning, content = [], []
    for chunk in chunks:
        delta = parser.feed(chunk)
        reasoning.append(delta.reasoning)
        content.append(delta.content)
    delta = parser.finish()
    return "".join(reasoning) + delta.reasoning, "".join(content) + delta.content


CASES = [
    (
        QWEN3,
        THINK_TAGS,
        False,
        "Okay, the user asks for 17 * 23. 17 * 20 = 340 and 17 * 3 = 51, so 391.",
        "17 × 23 = **391**.",
    ),
    (R1_TEMPLATE_OPENED, THINK_TAGS, True, "Let me compute: 2 + 2 is 4. No tricks here.", "The answer is 4."),
    (
        MAGISTRAL,
        ReasoningTags("[THINK]", "[/THINK]"),
        False,
        "The user greets me; reply briefly.",
        "Hello! How can I help you today?",
    ),
    ("Just an answer, no thinking.", THINK_TAGS, False, "", "Just an answer, no thinking."),
    ("  <thinking> is not our tag", THINK_TAGS, False, "", "  <thinking> is not our tag"),
    (
        "Answer first <think>then a tag</think> stays content",
        THINK_TAGS,
        False,
        "",
        "Answer first <think>then a tag</think> stays content",
    ),
    ("<think>\n\n</think>\n\nNo reasoning this time.", THINK_TAGS, False, "", "No reasoning this time."),
    ("<think>cut off by max_tokens </thi", THINK_TAGS, False, "cut off by max_tokens </thi", ""),
    ("still thinking when the budget ran out", THINK_TAGS, True, "still thinking when the budget ran out", ""),
    ("<thi", THINK_TAGS, False, "", "<thi"),
    ("  \n", THINK_TAGS, False, "", "  \n"),
    ("<think>a < b and </ thin</think>c", THINK_TAGS, False, "a < b and </ thin", "c"),
]


@pytest.mark.parametrize(("text", "tags", "opened", "reasoning", "content"), CASES)
def test_split_is_the_same_for_every_chunking(
    text: str, tags: ReasoningTags, opened: bool, reasoning: str, content: str
) -> None:
    for chunks in chunkings(text):
        assert run(ReasoningParser(tags, in_reasoning=opened), chunks) == (reasoning, content), chunks


def test_state_tracks_the_block() -> None:
    parser = ReasoningParser()
    assert not parser.in_reasoning
    assert parser.feed("<think>hm") == ("hm", "")
    assert parser.in_reasoning and not parser.reasoning_ended
    assert parser.feed("m</th") == ("m", "")
    assert parser.in_reasoning
    assert parser.feed("ink>\n\nHi") == ("", "Hi")
    assert not parser.in_reasoning and parser.reasoning_ended


def test_whitespace_inside_reasoning_streams_once_more_text_follows() -> None:
    parser = ReasoningParser(in_reasoning=True)
    assert parser.feed("step one.\n") == ("step one.", "")
    assert parser.feed("\nstep two.") == ("\n\nstep two.", "")


QWEN3_TEMPLATE = """{%- for message in messages %}<|im_start|>{{ message.role }}
{%- if message.role == 'assistant' and '</think>' in message.content %}
{{ message.content.split('</think>')[-1].lstrip('\\n') }}
{%- else %}
{{ message.content }}
{%- endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{%- if enable_thinking is defined and enable_thinking is false %}
<think>

</think>

{%- endif %}
{%- endif %}"""

R1_TEMPLATE = """{% for message in messages %}{% if message['role'] == 'user' %}<｜User｜>{{ message['content'] }}\
{% else %}<｜Assistant｜>{{ message['content'].split('</think>')[-1] }}<｜end▁of▁sentence｜>{% endif %}{% endfor %}\
{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}"""

CHATML_TEMPLATE = """{% for message in messages %}<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def generation_prompt_opens_reasoning(template: str, **template_kwargs: object) -> bool:
    """Whether the template's generation prompt for one user message ends inside a think block."""
    prompt = render_chat_template(template, [{"role": "user", "content": "Hi"}], **template_kwargs)
    return prompt_opens_reasoning(prompt, THINK_TAGS)


def test_detects_tags_and_whether_the_generation_prompt_opens_a_block() -> None:
    assert detect_reasoning_tags(QWEN3_TEMPLATE) == THINK_TAGS
    assert not generation_prompt_opens_reasoning(QWEN3_TEMPLATE)
    assert not generation_prompt_opens_reasoning(QWEN3_TEMPLATE, enable_thinking=False)
    assert detect_reasoning_tags(R1_TEMPLATE) == THINK_TAGS
    assert generation_prompt_opens_reasoning(R1_TEMPLATE)
    assert detect_reasoning_tags(CHATML_TEMPLATE) is None
    assert detect_reasoning_tags(None) is None
    assert detect_reasoning_tags("{{ '[THINK]' }}…{{ '[/THINK]' }}") == ReasoningTags("[THINK]", "[/THINK]")
    assert detect_reasoning_tags("'<seed:think>' '</seed:think>'") == ReasoningTags("<seed:think>", "</seed:think>")


def test_prompt_check_looks_only_at_the_prompt_end() -> None:
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n", THINK_TAGS)
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n", THINK_TAGS)
    assert not prompt_opens_reasoning(
        "<|im_start|>user\nwhat does <think> do?<|im_end|>\n<|im_start|>assistant\n", THINK_TAGS
    )
