"""Complete tiny Hugging Face model folders: a random checkpoint plus a trained ChatML tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from tests.models.tiny_checkpoints import make_tiny_checkpoint

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added but not special, as in Qwen3: they stay in decoded text, where the output parsers look for them.
THINKING_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France; Berlin is the capital of Germany.",
    "def add(a, b):\n    return a + b\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000",
]
_THINKING_CORPUS = [
    *_CORPUS,
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}',
    "Let me think about what the user asks. The answer is short.",
]

# A Qwen3-style template: tools in the system turn, reasoning shown only after the last user message,
# tool results grouped into one user turn, and a generation prompt that opens (or skips) the think block.
THINKING_TEMPLATE = """\
{%- set has_system = messages and messages[0].role == 'system' %}
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if has_system %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- 'You may call these tools, described one JSON object per line:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nWrite each call in its own block:\\n<tool_call>\\n' }}
{{- '{"name": <tool name>, "arguments": <arguments as a JSON object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif has_system %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}
{%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- if not loop.first %}{{- '<|im_start|>system\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}
{%- elif message.role == 'user' %}
{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
{%- if loop.index0 > ns.last_user and message.reasoning_content is string and message.reasoning_content %}
{{- '<think>\\n' + message.reasoning_content.strip() + '\\n</think>\\n\\n' }}
{%- endif %}
{%- if message.content is string %}{{- message.content }}{%- endif %}
{%- for call in message.tool_calls or [] %}
{%- set fn = call.function if call.function is defined else call %}
{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>\\n{"name": ' + (fn.name | tojson) + ', "arguments": ' }}
{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}
{%- else %}{{- '<think>\\n' }}{%- endif %}
{%- endif %}
"""


def _train_byte_level_bpe(corpus: list[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE trained on `corpus`, with the ChatML special tokens first."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(corpus * 20, trainer)
    return backend


def _save_tokenizer(backend: Tokenizer, path: Path, template: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    config = {"bos_token": None, "eos_token": "<|im_end|>", "chat_template": template}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def write_chatml_tokenizer(path: Path, vocab_size: int = 400) -> None:
    """A byte-level BPE trained on a small corpus, with ChatML specials and template."""
    _save_tokenizer(_train_byte_level_bpe(_CORPUS, vocab_size), path, CHATML_TEMPLATE)


def write_thinking_tokenizer(path: Path, vocab_size: int = 400) -> None:
    """Like write_chatml_tokenizer, plus non-special think/tool tags and the Qwen3-style THINKING_TEMPLATE."""
    backend = _train_byte_level_bpe(_THINKING_CORPUS, vocab_size)
    backend.add_tokens([AddedToken(tag, normalized=False, special=False) for tag in THINKING_TOKENS])
    _save_tokenizer(backend, path, THINKING_TEMPLATE)


def make_tiny_model_dir(arch: str, path: Path, seed: int = 0, **overrides: object) -> Path:
    """A loadable model folder: tiny random `arch` checkpoint and a tokenizer that fits its vocabulary."""
    make_tiny_checkpoint(arch, path, seed=seed, **overrides)
    write_chatml_tokenizer(path)
    return path


def make_tiny_thinking_model_dir(path: Path, seed: int = 0, **overrides: object) -> Path:
    """A loadable tiny random Qwen3 folder whose tokenizer and template reason in `<think>` and call tools."""
    make_tiny_checkpoint("qwen3", path, seed=seed, **overrides)  # vocab_size 512 covers the 400 + 6 tokens
    write_thinking_tokenizer(path)
    return path
