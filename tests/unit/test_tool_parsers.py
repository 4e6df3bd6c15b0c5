"""Tool-call parsers on recorded model outputs: every chunking gives the same calls, malformed calls stay content."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

import pytest

from statelm.api.parsers.reasoning import ReasoningParser
from statelm.api.parsers.tools import (
    TOOL_PARSERS,
    ContentDelta,
    ForcedToolParser,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    Qwen3CoderToolParser,
    ToolCallArgumentsDelta,
    ToolCallStart,
    ToolParser,
    detect_tool_parser,
    get_tool_parser,
)
from tests.unit.stream_chunks import chunkings

TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": properties}}}
    for name, properties in {
        "write_file": {"path": {"type": "string"}, "content": {"type": "string"}},
        "run_tests": {
            "paths": {"type": "array", "items": {"type": "string"}},
            "verbose": {"type": "boolean"},
            "timeout": {"type": ["integer", "null"]},
            "label": {"type": "string"},
        },
    }.items()
]


@dataclass
class Streamed:
    """What a client assembles from the stream: the content and each call's name and arguments."""

    content: str
    calls: list[tuple[str, str]]
    ids: list[str]


def stream(parser_class: type[ToolParser], chunks: list[str]) -> Streamed:
    parser = parser_class(TOOLS)
    events = [event for chunk in chunks for event in parser.feed(chunk)]
    events += parser.finish()
    content = ""
    calls: list[list[str]] = []
    for event in events:
        if isinstance(event, ContentDelta):
            assert event.text
            content += event.text
        elif isinstance(event, ToolCallStart):
            assert event.index == len(calls)
            calls.append([event.id, event.name, ""])
        else:
            assert isinstance(event, ToolCallArgumentsDelta) and event.arguments
            calls[event.index][2] += event.arguments
    assert [(c.id, c.name, c.arguments) for c in parser.tool_calls] == [tuple(call) for call in calls]
    return Streamed(content, [(name, arguments) for _, name, arguments in calls], [call[0] for call in calls])


def check_every_chunking(parser_class: type[ToolParser], text: str, **chunk_options: Any) -> Streamed:
    """The stream assembles to the same result however the text is cut; returns that result."""
    whole = stream(parser_class, [text])
    for chunks in chunkings(text, **chunk_options):
        result = stream(parser_class, chunks)
        assert (result.content, result.calls) == (whole.content, whole.calls), chunks
    assert parser_class(TOOLS).parse(text).content == whole.content
    return whole


def parsed_calls(result: Streamed) -> list[tuple[str, Any]]:
    return [(name, json.loads(arguments)) for name, arguments in result.calls]


# --- Hermes / Qwen ----------------------------------------------------------------------------------

QWEN25_PARALLEL = """<tool_call>
{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}
</tool_call>
<tool_call>
{"name": "get_temperature_date", "arguments": {"location": "San Francisco, CA, USA", "date": "2024-10-01"}}
</tool_call>"""

HERMES_TRICKY = (
    "I'll look that up.\n\n<tool_call>\n"
    '{"name": "search", "arguments": {"query": "weather in \\"Paris\\" {today}", '
    '"filters": {"lang": ["en", "fr"], "max": 5, "safe": true, "note": "a </tool_call> in a string ✓"}}}\n'
    "</tool_call>"
)


def test_hermes_parallel_calls() -> None:
    result = check_every_chunking(HermesToolParser, QWEN25_PARALLEL)
    assert result.content == ""
    assert parsed_calls(result) == [
        ("get_current_temperature", {"location": "San Francisco, CA, USA"}),
        ("get_temperature_date", {"location": "San Francisco, CA, USA", "date": "2024-10-01"}),
    ]
    assert all(call_id.startswith("call_") and len(call_id) == 29 for call_id in result.ids)
    assert len(set(result.ids)) == 2


def test_hermes_arguments_are_passed_through_exactly() -> None:
    result = check_every_chunking(HermesToolParser, HERMES_TRICKY)
    assert result.content == "I'll look that up.\n\n"
    ((name, arguments),) = result.calls
    assert name == "search"
    assert arguments == HERMES_TRICKY[HERMES_TRICKY.index('{"query"') : HERMES_TRICKY.rindex("}}") + 1]
    assert json.loads(arguments)["filters"]["note"] == "a </tool_call> in a string ✓"


def test_hermes_streams_arguments_before_the_call_is_complete() -> None:
    parser = HermesToolParser()
    assert parser.feed('<tool_call>\n{"name": "f", "arg') == []
    start, first = parser.feed('uments": {"city": "Pa')
    assert isinstance(start, ToolCallStart) and start.name == "f"
    assert first == ToolCallArgumentsDelta(0, '{"city": "Pa')
    assert parser.feed('ris"}}\n</tool_') == [ToolCallArgumentsDelta(0, 'ris"}')]
    assert parser.tool_calls == []
    assert parser.feed("call>") == []
    assert [call.arguments for call in parser.tool_calls] == ['{"city": "Paris"}']


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\nI cannot call tools.\n</tool_call>",
        '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call> and more',
        '<tool_call>{"name": 42, "arguments": {}}</tool_call>',
        "Use the <tool_call> tag to call a tool.",
        '<tool_call>{"name": "f" "arguments": {}}</tool_call>',
        "<tool_call>",
        "<tool_",
    ],
)
def test_hermes_malformed_blocks_stay_content(text: str) -> None:
    result = check_every_chunking(HermesToolParser, text)
    assert (result.content, result.calls) == (text, [])


def test_hermes_unfinished_output_keeps_the_call_it_announced() -> None:
    text = '<tool_call>\n{"name": "f", "arguments": {"a": [1, 2'
    assert check_every_chunking(HermesToolParser, text).calls == [("f", '{"a": [1, 2')]
    text = '<tool_call>\n{"name": "f", "arguments": {}}'
    assert check_every_chunking(HermesToolParser, text).calls == [("f", "{}")]
    text = '<tool_call>\n{"name": "f"}\n</tool_call>\nDone.'
    result = check_every_chunking(HermesToolParser, text)
    assert (result.content, result.calls) == ("\nDone.", [("f", "{}")])


def test_qwen3_thinking_then_tool_call() -> None:
    text = (
        "<think>\nThe user wants the weather in Tokyo; I should call get_weather.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京"}}\n</tool_call>'
    )
    for chunks in chunkings(text, random_cuts=5):
        reasoning_parser, tool_parser = ReasoningParser(), HermesToolParser()
        reasoning, events = "", []
        for chunk in chunks:
            delta = reasoning_parser.feed(chunk)
            reasoning += delta.reasoning
            events += tool_parser.feed(delta.content)
        delta = reasoning_parser.finish()
        events += tool_parser.feed(delta.content) + tool_parser.finish()
        assert reasoning == "The user wants the weather in Tokyo; I should call get_weather."
        assert not [event for event in events if isinstance(event, ContentDelta)]
        assert [(c.name, json.loads(c.arguments)) for c in tool_parser.tool_calls] == [
            ("get_weather", {"city": "東京"})
        ]


# --- Qwen3-Coder ------------------------------------------------------------------------------------

QWEN3_CODER = """I'll write the file, then run the tests.
<tool_call>
<function=write_file>
<parameter=path>
src/app.py
</parameter>
<parameter=content>
def main() -> None:
    print("hello <world>")


if __name__ == "__main__":
    main()
</parameter>
</function>
</tool_call>
<tool_call>
<function=run_tests>
<parameter=paths>
["tests/test_app.py"]
</parameter>
<parameter=verbose>
true
</parameter>
<parameter=timeout>
30
</parameter>
<parameter=label>
42
</parameter>
</function>
</tool_call>"""


def test_qwen3_coder_types_parameters_by_the_tool_schema() -> None:
    result = check_every_chunking(Qwen3CoderToolParser, QWEN3_CODER, random_cuts=5)
    assert result.content == "I'll write the file, then run the tests.\n"
    code = 'def main() -> None:\n    print("hello <world>")\n\n\nif __name__ == "__main__":\n    main()'
    assert parsed_calls(result) == [
        ("write_file", {"path": "src/app.py", "content": code}),
        ("run_tests", {"paths": ["tests/test_app.py"], "verbose": True, "timeout": 30, "label": "42"}),
    ]


def test_qwen3_coder_streams_one_parameter_at_a_time() -> None:
    parser = Qwen3CoderToolParser(TOOLS)
    events = parser.feed("<tool_call>\n<function=run_tests>\n<parameter=verbose>\nfal")
    assert [type(event) for event in events] == [ToolCallStart]
    assert parser.feed("se\n</parameter>\n") == [ToolCallArgumentsDelta(0, '{"verbose": false')]
    assert parser.feed("<parameter=timeout>\nnull\n</parameter>\n</function>") == [
        ToolCallArgumentsDelta(0, ', "timeout": null}')
    ]


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("<function=get_time>\n<parameter=tz>\nCET\n</parameter>\n</function>", "", [("get_time", {"tz": "CET"})]),
        (  # the model forgot </parameter>
            "<tool_call>\n<function=f>\n<parameter=a>\n1\n<parameter=b>\nx y\n</function>\n</tool_call>",
            "",
            [("f", {"a": "1", "b": "x y"})],
        ),
        ("<tool_call>\n<function=f>\n</function>\n</tool_call>", "", [("f", {})]),
        ("<tool_call>\n<function=f>\n<parameter=a>\ncut off", "", [("f", {"a": "cut off"})]),
        ("<tool_call>\nno function here\n</tool_call>", "<tool_call>\nno function here\n</tool_call>", []),
        ("<function=bad name\n>", "<function=bad name\n>", []),
        ("a <function= b", "a <function= b", []),
    ],
)
def test_qwen3_coder_edge_cases(text: str, content: str, calls: list[tuple[str, Any]]) -> None:
    result = check_every_chunking(Qwen3CoderToolParser, text)
    assert (result.content, parsed_calls(result)) == (content, calls)


# --- Llama 3 ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "calls"),
    [
        (
            '{"name": "get_weather", "parameters": {"location": "Paris", "unit": "celsius"}}',
            [("get_weather", {"location": "Paris", "unit": "celsius"})],
        ),
        (
            '<|python_tag|>{"name": "get_weather", "parameters": {"location": "Paris"}}',
            [("get_weather", {"location": "Paris"})],
        ),
        (
            '\n\n{"type": "function", "name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {}}',
            [("a", {"x": 1}), ("b", {})],
        ),
        ('{"parameters": {"q": "x"}, "name": "search"}', [("search", {"q": "x"})]),
    ],
)
def test_llama3_json_calls(text: str, calls: list[tuple[str, Any]]) -> None:
    result = check_every_chunking(Llama3JsonToolParser, text)
    assert (result.content, parsed_calls(result)) == ("", calls)


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "Bob", "age": 42}',
        'The weather in Paris is {"sunny"}.',
        'Here: {"name": "f", "parameters": {}}',
        "<|python_tag|>brave_search.call(query='paris')",
        "   ",
    ],
)
def test_llama3_plain_answers_stay_content(text: str) -> None:
    result = check_every_chunking(Llama3JsonToolParser, text)
    assert (result.content, result.calls) == (text, [])


# --- Mistral ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (
            '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", '
            '"format": "celsius"}}, {"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]',
            "",
            [
                ("get_current_weather", {"location": "Paris, France", "format": "celsius"}),
                ("get_time", {"tz": "Europe/Paris"}),
            ],
        ),
        (
            '[TOOL_CALLS]get_current_weather[ARGS]{"location": "Paris, France"}'
            '[TOOL_CALLS]get_time[ARGS]{"tz": "Europe/Paris"}',
            "",
            [("get_current_weather", {"location": "Paris, France"}), ("get_time", {"tz": "Europe/Paris"})],
        ),
        (
            'Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Lyon"}',
            "Let me check.",
            [("get_weather", {"city": "Lyon"})],
        ),
        ('[TOOL_CALLS]{"name": "f", "arguments": {"a": 1}}', "", [("f", {"a": 1})]),
        ("[TOOL_CALLS] sorry, no tools", "[TOOL_CALLS] sorry, no tools", []),
        ("[TOOL_CALLS][]", "[TOOL_CALLS][]", []),
        ('[TOOL_CALLS]f[ARGS]{"a": "cut', "", [("f", '{"a": "cut')]),
    ],
)
def test_mistral_both_forms(text: str, content: str, calls: list[tuple[str, Any]]) -> None:
    result = check_every_chunking(MistralToolParser, text)
    assert result.content == content
    expected = [(name, args if isinstance(args, str) else json.dumps(args)) for name, args in calls]
    assert [
        (name, args if not args.endswith("}") else json.dumps(json.loads(args))) for name, args in result.calls
    ] == [(name, args if not args.endswith("}") else json.dumps(json.loads(args))) for name, args in expected]
    assert all(len(call_id) == 9 and call_id.isalnum() for call_id in result.ids)


def test_mistral_keeps_the_models_call_id() -> None:
    result = check_every_chunking(MistralToolParser, "[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{}")
    assert (result.ids, result.calls) == (["a1B2c3D4e"], [("get_time", "{}")])


# --- forced calls (tool_choice required / named) ----------------------------------------------------


def test_forced_call_list() -> None:
    text = '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'
    result = check_every_chunking(ForcedToolParser, text)
    assert (result.content, parsed_calls(result)) == ("", [("get_weather", {"city": "Paris"}), ("get_time", {})])
    assert check_every_chunking(ForcedToolParser, "not a list").content == "not a list"


# --- robustness and selection -----------------------------------------------------------------------

_FUZZ_PIECES = [
    "<tool_call>", "</tool_call>", "<function=f>", "<function=", "</function>", "<parameter=a>", "</parameter>",
    "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|python_tag|>", "{", "}", "[", "]", '"', "\\", ",", ";", ":",
    '{"name": "f", "arguments": ', '{"name": "g"', '"arguments"', '"parameters": ', '"x"', "1", "true", "nul",
    "f", "name", "\n", "  ", "text ", "ü",
]  # fmt: skip


@pytest.mark.parametrize("parser_class", [*TOOL_PARSERS.values(), ForcedToolParser])
def test_random_garbage_never_breaks_the_stream(parser_class: type[ToolParser]) -> None:
    rng = random.Random(parser_class.name)
    for _ in range(40):
        text = "".join(rng.choice(_FUZZ_PIECES) for _ in range(rng.randint(1, 14)))
        whole = stream(parser_class, [text])
        for chunks in [list(text), *chunkings(text, random_cuts=4)][: len(text) + 6 : 7]:
            result = stream(parser_class, chunks)
            assert (result.content, result.calls) == (whole.content, whole.calls), chunks


def test_long_arguments_stream_intact_in_small_chunks() -> None:
    body = json.dumps({"path": "big.txt", "content": "x = {'a': [1, 2]}\n" * 1000})
    text = f'<tool_call>\n{{"name": "write_file", "arguments": {body}}}\n</tool_call>'
    result = stream(HermesToolParser, [text[i : i + 4] for i in range(0, len(text), 4)])
    assert result.calls == [("write_file", body)]


def test_registry_and_template_detection() -> None:
    assert get_tool_parser("hermes") is HermesToolParser
    assert get_tool_parser("qwen") is HermesToolParser
    assert get_tool_parser("qwen3_coder") is Qwen3CoderToolParser
    assert get_tool_parser("llama3_json") is get_tool_parser("llama3") is Llama3JsonToolParser
    assert get_tool_parser("mistral") is MistralToolParser
    with pytest.raises(ValueError, match="unknown tool parser 'nope'"):
        get_tool_parser("nope")
    qwen25 = '{%- if tools %}…<tools>{{ tool | tojson }}</tools>…<tool_call>\\n{"name": …}\\n</tool_call>{% endif %}'
    qwen3_coder = "<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n"
    llama31 = '<|start_header_id|>ipython<|end_header_id|>{"name": function name, "parameters": dictionary}'
    mistral = "{%- if message.tool_calls %}[TOOL_CALLS]{{ tool_calls | tojson }}{% endif %}"
    assert detect_tool_parser(qwen25) == "hermes"
    assert detect_tool_parser(qwen3_coder) == "qwen3_coder"
    assert detect_tool_parser(llama31) == "llama3_json"
    assert detect_tool_parser("{{ '<|python_tag|>' + tool_call.arguments.code }}") == "llama3_json"
    assert detect_tool_parser(mistral) == "mistral"
    assert detect_tool_parser("<|im_start|>{{ message.content }}<|im_end|>") is None
    assert detect_tool_parser(None) is None
