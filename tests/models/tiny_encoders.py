"""Tiny random encoders for the tests: BERT embedding models and a cross-encoder as Hugging Face folders (with a
WordPiece tokenizer), a nomic-bert embedding model as nomic's published checkpoints lay it out, and the embedding
models and the cross-encoder as GGUF files written with gguf's writer, as llama.cpp's converter lays them out."""

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
    "pooler.dense": "cls",  # a cross-encoder's head: llama.cpp's converter leaves the pooler out
    "classifier": "cls.output",
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
    backend.add_special_tokens(SPECIALS)  # as BERT's own tokenizer.json lists them (llama.cpp's converter reads them)
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


NOMIC_CONFIG = {  # nomic-embed-text v1.5's config.json (nomic's remote-code NomicBertConfig), at the tiny shape
    "architectures": ["NomicBertModel"],
    "model_type": "nomic_bert",
    "activation_function": "swiglu",
    "n_embd": SHAPE["hidden_size"],
    "n_layer": SHAPE["num_hidden_layers"],
    "n_head": SHAPE["num_attention_heads"],
    "n_inner": SHAPE["intermediate_size"],
    "n_positions": 8192,
    "max_trained_positions": 2048,
    "rotary_emb_base": 1000,
    "rotary_emb_fraction": 1.0,
    "rotary_emb_interleaved": False,
    "rotary_emb_scale_base": None,
    "rotary_scaling_factor": None,
    "prenorm": False,
    "parallel_block": False,
    "causal": False,
    "qkv_proj_bias": False,
    "mlp_fc1_bias": False,
    "mlp_fc2_bias": False,
    "use_rms_norm": False,
    "type_vocab_size": 2,
    "layer_norm_epsilon": 1e-12,
    "pad_vocab_size_multiple": 64,
}
NOMIC_GGUF_NAMES = {  # nomic's tensor names, as llama.cpp's converter writes them
    "embeddings.word_embeddings": "token_embd",
    "embeddings.token_type_embeddings": "token_types",
    "emb_ln": "token_embd_norm",
    "attn.Wqkv": "attn_qkv",
    "attn.out_proj": "attn_output",
    "norm1": "attn_output_norm",
    "mlp.fc11": "ffn_up",
    "mlp.fc12": "ffn_gate",
    "mlp.fc2": "ffn_down",
    "norm2": "layer_output_norm",
}


def make_tiny_nomic_dir(path: Path, seed: int = 3) -> Path:
    """A seeded random nomic-bert embedder as nomic publishes nomic-embed-text: its config.json and tensor names,
    the word embeddings padded to a multiple of 64 rows, a WordPiece tokenizer and mean pooling."""
    from safetensors.torch import save_file

    tokens = vocabulary()
    config = {**NOMIC_CONFIG, "vocab_size": -(-len(tokens) // 64) * 64}
    hidden, inner = config["n_embd"], config["n_inner"]
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int, scale: float) -> torch.Tensor:
        return scale * torch.randn(shape, generator=generator)

    tensors = {
        "embeddings.word_embeddings.weight": normal(config["vocab_size"], hidden, scale=1.0),
        "embeddings.token_type_embeddings.weight": normal(2, hidden, scale=0.5),
        "emb_ln.weight": 1 + normal(hidden, scale=0.1),
        "emb_ln.bias": normal(hidden, scale=0.1),
    }
    for i in range(config["n_layer"]):
        for name, rows, columns in (("attn.Wqkv", 3 * hidden, hidden), ("attn.out_proj", hidden, hidden),
                                    ("mlp.fc11", inner, hidden), ("mlp.fc12", inner, hidden),
                                    ("mlp.fc2", hidden, inner)):  # fmt: skip
            tensors[f"encoder.layers.{i}.{name}.weight"] = normal(rows, columns, scale=columns**-0.5)
        for norm in ("norm1", "norm2"):
            tensors[f"encoder.layers.{i}.{norm}.weight"] = 1 + normal(hidden, scale=0.1)
            tensors[f"encoder.layers.{i}.{norm}.bias"] = normal(hidden, scale=0.1)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config))
    write_wordpiece_tokenizer(path, tokens)
    write_sentence_transformers_pooling(path, "mean")
    return path


def write_nomic_gguf(model_dir: Path, path: Path) -> Path:
    """The nomic-bert model of model_dir as a float32 `nomic-bert` GGUF file, as llama.cpp's converter writes it
    (its context the trained 2048 positions, its rope base from rotary_emb_base)."""
    from safetensors.torch import load_file

    config = json.loads((model_dir / "config.json").read_text())
    shape = {"max_position_embeddings": config["max_trained_positions"], "hidden_size": config["n_embd"],
             "intermediate_size": config["n_inner"], "num_hidden_layers": config["n_layer"],
             "num_attention_heads": config["n_head"], "layer_norm_eps": config["layer_norm_epsilon"]}  # fmt: skip
    tensors = {}
    for name, tensor in load_file(model_dir / "model.safetensors").items():
        base, kind = name.rsplit(".", 1)
        if base.startswith("encoder.layers."):
            _, _, layer, rest = base.split(".", 3)
            tensors[f"blk.{layer}.{NOMIC_GGUF_NAMES[rest]}.{kind}"] = tensor.numpy()
        else:
            tensors[f"{NOMIC_GGUF_NAMES[base]}.{kind}"] = tensor.numpy()
    extra = {"add_rope_freq_base": float(config["rotary_emb_base"])}
    return _write_encoder_gguf(path, "nomic-bert", shape, config["type_vocab_size"], 1, model_dir, tensors, extra)


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


def write_bert_gguf(
    model_dir: Path, path: Path, pooling_type: int | None = 1, float16: bool = False, pooler: bool = True
) -> Path:
    """The BertModel or BertForSequenceClassification of model_dir as a float32 (or float16: its matrices) GGUF file
    with a `bert` WordPiece vocabulary, in llama.cpp's layout: a cross-encoder's classifier as `cls.output` with its
    labels, its pooler as `cls` (or left out, as llama.cpp's converter does, without pooler); no pooling_type for
    None (the converter writes none for a folder without sentence-transformers files)."""
    from safetensors.torch import load_file

    config = json.loads((model_dir / "config.json").read_text())
    shape = {key: config[key] for key in ("max_position_embeddings", "hidden_size", "intermediate_size",
                                          "num_hidden_layers", "num_attention_heads", "layer_norm_eps")}  # fmt: skip
    tensors = {}
    for name, tensor in load_file(model_dir / "model.safetensors").items():
        if not name.endswith("position_ids") and (pooler or ".pooler." not in name):
            array, target = tensor.float().numpy(), gguf_name(name)
            half = float16 and array.ndim == 2 and target not in F32_TENSORS
            tensors[target] = array.astype("float16") if half else array
    head = "cls.output.weight" in tensors
    labels = {"add_classifier_output_labels": list(config["id2label"].values())} if head else {}
    type_count = config["type_vocab_size"]
    return _write_encoder_gguf(path, "bert", shape, type_count, pooling_type, model_dir, tensors, labels)


def _write_encoder_gguf(
    path: Path,
    architecture: str,
    shape: dict[str, Any],
    type_vocab_size: int,
    pooling_type: int | None,
    model_dir: Path,
    tensors: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> Path:
    """A GGUF encoder of architecture: its shape (BertConfig's keys), model_dir's WordPiece vocabulary padded to
    the word embeddings' rows with `[PADn]` entries (as llama.cpp's converter pads it), and tensors by GGUF name."""
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name(path.stem)
    writer.add_context_length(shape["max_position_embeddings"])
    writer.add_embedding_length(shape["hidden_size"])
    writer.add_feed_forward_length(shape["intermediate_size"])
    writer.add_block_count(shape["num_hidden_layers"])
    writer.add_head_count(shape["num_attention_heads"])
    writer.add_layer_norm_eps(shape["layer_norm_eps"])
    writer.add_causal_attention(False)
    writer.add_token_type_count(type_vocab_size)
    if pooling_type is not None:
        writer.add_pooling_type(gguf.PoolingType(pooling_type))
    for key, value in (extra or {}).items():
        getattr(writer, key)(value)
    tokens = (model_dir / "vocab.txt").read_text().splitlines()
    padding = [f"[PAD{i}]" for i in range(len(tokens), tensors["token_embd.weight"].shape[0])]
    writer.add_tokenizer_model("bert")
    writer.add_token_list([_llama_cpp_piece(token) for token in tokens] + ["\u2581" + pad for pad in padding])
    writer.add_token_types([3 if token in SPECIALS else 1 for token in tokens] + [5] * len(padding))  # 5: unused
    for name, setter in (("[CLS]", writer.add_bos_token_id), ("[SEP]", writer.add_sep_token_id),
                         ("[UNK]", writer.add_unk_token_id), ("[PAD]", writer.add_pad_token_id),
                         ("[MASK]", writer.add_mask_token_id)):  # fmt: skip
        setter(tokens.index(name))
    for name, array in tensors.items():
        writer.add_tensor(name, array)
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
