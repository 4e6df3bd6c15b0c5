"""Tiny random BERT encoders for the tests: an embedding model and a cross-encoder as Hugging Face folders (with a
WordPiece tokenizer), and the embedding model as a GGUF file written with gguf's writer, as llama.cpp lays it out."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = [
    "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "paris", "is", "capital", "of", "france", "berlin",
    "germany", "a", "cat", "sat", "on", "mat", "what", "which", "city", "river", "flows", "through", "weather", "today",
    "sunny", "rain", ",", ".", "?", "!",
]  # fmt: skip
PIECES = ["##s", "##ing", "##ed", "##ly", "##er"]
SHAPE = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
    "type_vocab_size": 2,
}
GGUF_LAYER_NAMES = {  # Hugging Face's names of a layer's tensors, as llama.cpp's convert script writes them
    "attention.self.query": "attn_q",
    "attention.self.key": "attn_k",
    "attention.self.value": "attn_v",
    "attention.output.dense": "attn_output",
    "attention.output.LayerNorm": "attn_output_norm",
    "intermediate.dense": "ffn_up",
    "output.dense": "ffn_down",
    "output.LayerNorm": "layer_output_norm",
}
F32_TENSORS = ("position_embd.weight", "token_types.weight")  # llama.cpp adds them to float32 rows: kept float32
GGUF_NAMES = {
    "embeddings.word_embeddings": "token_embd",
    "embeddings.position_embeddings": "position_embd",
    "embeddings.token_type_embeddings": "token_types",
    "embeddings.LayerNorm": "token_embd_norm",
}


def vocabulary(size: int = 0) -> list[str]:
    """The WordPiece vocabulary: specials, words, single characters (first and continuation) and suffixes, then
    `[unusedN]` entries up to size (BERT's own filler)."""
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [str(d) for d in range(10)]
    tokens = list(dict.fromkeys([*SPECIALS, *WORDS, *letters, *(f"##{c}" for c in letters), *PIECES]))
    return tokens + [f"[unused{i}]" for i in range(size - len(tokens))]


def write_wordpiece_tokenizer(path: Path, tokens: list[str]) -> None:
    """A lowercasing BERT WordPiece tokenizer of tokens: tokenizer.json, its config and vocab.txt."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    backend = Tokenizer(models.WordPiece({token: i for i, token in enumerate(tokens)}, unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    sep, cls = ("[SEP]", tokens.index("[SEP]")), ("[CLS]", tokens.index("[CLS]"))
    backend.post_processor = processors.BertProcessing(sep, cls)
    backend.decoder = decoders.WordPiece()
    # as sentence-transformers folders ship it: padded to and truncated at a fixed length (statelm must undo both)
    length = 64
    backend.enable_padding(pad_id=tokens.index("[PAD]"), pad_token="[PAD]", length=length)
    backend.enable_truncation(max_length=length)
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    (path / "vocab.txt").write_text("\n".join(tokens) + "\n")
    specials = {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]"}
    config = {"tokenizer_class": "BertTokenizer", "do_lower_case": True, "mask_token": "[MASK]", **specials}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def make_tiny_bert_dir(
    path: Path, *, cross_encoder: bool = False, seed: int = 0, shape: dict[str, int] | None = None, **config: Any
) -> Path:
    """A seeded random BertModel (or a one-label BertForSequenceClassification) with its tokenizer; shape (and
    `vocab_size`) default to the tiny test model's."""
    import transformers

    shape = {**SHAPE, **(shape or {})}
    tokens = vocabulary(shape.pop("vocab_size", 0))
    bert_config = transformers.BertConfig(vocab_size=len(tokens), **shape, **config)
    torch.manual_seed(seed)
    if cross_encoder:
        bert_config.num_labels = 1
        model = transformers.BertForSequenceClassification(bert_config)
    else:
        model = transformers.BertModel(bert_config, add_pooling_layer=False)
    _randomize_norms(model, seed)
    model.save_pretrained(path, safe_serialization=True)
    write_wordpiece_tokenizer(path, tokens)
    return path


def write_sentence_transformers_pooling(path: Path, mode: str) -> None:
    """The sentence-transformers files that declare a folder's pooling (`cls`, `mean` or `lasttoken`)."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    keys = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens", "lasttoken": "pooling_mode_lasttoken"}
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32, keys[mode]: True}))


def _randomize_norms(model: torch.nn.Module, seed: int) -> None:
    """Non-trivial LayerNorm weights and biases, so that loading them wrongly shows."""
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn(param.shape, generator=generator))


def write_bert_gguf(model_dir: Path, path: Path, pooling_type: int = 1, float16: bool = False) -> Path:
    """The BertModel of model_dir as a float32 (or float16: its matrices) GGUF file with a `bert` WordPiece
    vocabulary, in llama.cpp's layout."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((model_dir / "config.json").read_text())
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_name(path.stem)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_layer_norm_eps(config["layer_norm_eps"])
    writer.add_causal_attention(False)
    writer.add_token_type_count(config["type_vocab_size"])
    writer.add_pooling_type(gguf.PoolingType(pooling_type))
    tokens = (model_dir / "vocab.txt").read_text().splitlines()
    writer.add_tokenizer_model("bert")
    writer.add_token_list([_llama_cpp_piece(token) for token in tokens])
    writer.add_token_types([3 if token in SPECIALS else 1 for token in tokens])
    for name, setter in (("[CLS]", writer.add_bos_token_id), ("[SEP]", writer.add_sep_token_id),
                         ("[UNK]", writer.add_unk_token_id), ("[PAD]", writer.add_pad_token_id),
                         ("[MASK]", writer.add_mask_token_id)):  # fmt: skip
        setter(tokens.index(name))
    for name, tensor in load_file(model_dir / "model.safetensors").items():
        if not name.endswith("position_ids"):
            array, target = tensor.float().numpy(), gguf_name(name)
            half = float16 and array.ndim == 2 and target not in F32_TENSORS
            writer.add_tensor(target, array.astype("float16") if half else array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name of a BertModel tensor."""
    base, kind = hf_name.removeprefix("bert.").rsplit(".", 1)
    if base in GGUF_NAMES:
        return f"{GGUF_NAMES[base]}.{kind}"
    _, _, layer, rest = base.split(".", 3)  # encoder.layer.N.rest
    return f"blk.{layer}.{GGUF_LAYER_NAMES[rest]}.{kind}"


def _llama_cpp_piece(token: str) -> str:
    """llama.cpp's form of a WordPiece entry: a word's first piece after `▁`, a continuation bare."""
    if token in SPECIALS:
        return token
    return token[2:] if token.startswith("##") else "\u2581" + token


def write_sparse_safetensors(path: Path, elements: int) -> Path:
    """A safetensors file whose one float32 tensor has `elements` elements, sparse on disk: the header says how
    large the weights are, the file's size agrees, and no byte of them is written."""
    header = json.dumps({"weight": {"dtype": "F32", "shape": [elements], "data_offsets": [0, 4 * elements]}}).encode()
    header += b" " * (-len(header) % 8)
    with path.open("wb") as handle:
        handle.write(struct.pack("<Q", len(header)) + header)
        handle.truncate(8 + len(header) + 4 * elements)
    return path
