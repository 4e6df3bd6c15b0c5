"""Complete tiny Hugging Face model folders: a random checkpoint plus a trained ChatML tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tests.models.tiny_checkpoints import make_tiny_checkpoint

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France; Berlin is the capital of Germany.",
    "def add(a, b):\n    return a + b\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000",
]


def write_chatml_tokenizer(path: Path, vocab_size: int = 400) -> None:
    """A byte-level BPE trained on a small corpus, with ChatML specials and template."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(_CORPUS * 20, trainer)
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    config = {"bos_token": None, "eos_token": "<|im_end|>", "chat_template": CHATML_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def make_tiny_model_dir(arch: str, path: Path, seed: int = 0, **overrides: object) -> Path:
    """A loadable model folder: tiny random `arch` checkpoint and a tokenizer that fits its vocabulary."""
    make_tiny_checkpoint(arch, path, seed=seed, **overrides)
    write_chatml_tokenizer(path)
    return path
