"""statelm's GGUF tokenizers against llama.cpp's own (libllama) on random texts: every test vocabulary and every
pre-tokenizer.

Usage: .venv/bin/python -m bench.tokenizer_parity [--llama-server PATH] [--texts 400] [--seed 1] [--show 2]
Needs `make test-data` (llama.cpp's ggml-vocab-* files) and the llama.cpp build bench.peers uses (its libllama.so
and headers): a small C program linked to it tokenizes and detokenizes, compiled here with `cc`. Each vocabulary
runs the same texts; then Llama 3's vocabulary runs again under every `tokenizer.ggml.pre` statelm knows. Texts are
tokenized with special tokens recognised (statelm always recognises them) and without BOS/EOS.
"""

from __future__ import annotations

import argparse
import random
import struct
import subprocess
import tempfile
from pathlib import Path

import gguf

from bench.common import machine_report
from bench.peers import build_with_libllama, find_llama_server
from statelm.gguf_vocab.pre_tokenizers import BPE_PRE_TOKENIZERS
from statelm.tokenizer import Tokenizer
from tests.llama_vocab import VECTOR_SEPARATOR, read_gguf_fields, require_vocab_dir

HELPER = r"""
#include "llama.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
static void quiet(enum ggml_log_level level, const char * text, void * data) { (void) level; (void) text; (void) data; }
int main(int argc, char ** argv) {
    if (argc != 3) { fprintf(stderr, "usage: tokenize VOCAB TEXTS\n"); return 2; }
    llama_log_set(quiet, NULL);
    struct llama_model_params params = llama_model_default_params();
    params.vocab_only = true;
    struct llama_model * model = llama_model_load_from_file(argv[1], params);
    if (!model) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    const struct llama_vocab * vocab = llama_model_get_vocab(model);
    FILE * file = fopen(argv[2], "rb");
    fseek(file, 0, SEEK_END); long size = ftell(file); fseek(file, 0, SEEK_SET);
    char * text = malloc(size + 1); size_t got = fread(text, 1, size, file); text[got] = 0; fclose(file);
    const char * sep = "\n__ggml_vocab_test__\n";
    int32_t * ids = malloc(sizeof(int32_t) * 1000000); char * out = malloc(10000000);
    for (char * at = text; at < text + got;) {
        char * next = strstr(at, sep);
        int32_t length = (int32_t) (next ? next - at : text + got - at);
        int32_t n = llama_tokenize(vocab, at, length, ids, 1000000, false, true);
        for (int32_t i = 0; i < n; i++) printf(i ? " %d" : "%d", ids[i]);
        int32_t m = llama_detokenize(vocab, ids, n, out, 10000000, false, false);
        printf("\t");
        for (int32_t i = 0; i < m; i++) printf("%02x", (unsigned char) out[i]);
        printf("\n");
        if (!next) break;
        at = next + strlen(sep);
    }
    return 0;
}
"""
COLUMNS = (
    "| texts | tokenized differently | llama.cpp's round trip gives the text back, statelm's not |\n"
    "| --- | ---: | ---: | ---: |"
)
FRAGMENTS = [
    "hello", "World", "HELLO", "don't", "I'M", "we'Ve", "'ll", " ", "  ", "   ", "\n", "\n\n", "\r\n", "\t", " \n ",
    "123", "4567890", "3.14", "½", "²", "٣", "、", "。", "中文", "日本語", "ひらがな", "カタカナ", "한국어", "ภาษาไทย",
    "កាន់តែ", "नमस्ते", "e\u0301", "ñ", "Ä", "ß", "İ", "Ελληνικά", "кириллица", "🦙", "😶\u200d🌫️", "👍🏽", "🇯🇵",
    "...", "!!!", "?", ",", "$", "+", "<", "=", ">", "^", "`", "|", "~", "``", '""', "(", ")", "[", "]", "{", "}",
    "--", "==", "//", "#", "@", "_", "\\", "/", "'", "’", "“", "—", "…", "\u00a0", "\u2009", "\u3000", "\u200b",
    "\u2581", "<s>", "</s>", "<|endoftext|>", "<unk>", "[CLS]", "<mask>", "http://x.y/z?a=1&b=2", "x=1;y=2",
    "def f(x):\n    return x", "a" * 40, "\x07", "\ufffd", "\U0010fffd",
]  # fmt: skip


def random_texts(count: int, seed: int) -> list[str]:
    """Texts of 1 to 12 fragments (scripts, digits, punctuation, whitespace runs, special-token names)."""
    rng = random.Random(seed)
    return [
        "".join(rng.choice(FRAGMENTS) + rng.choice(["", "", " ", "\n"]) for _ in range(rng.randint(1, 12)))
        for _ in range(count)
    ]


def llama_cpp(program: Path, vocab: Path, texts_file: Path) -> list[tuple[list[int], str]]:
    """llama.cpp's ids and detokenized text of every text."""
    done = subprocess.run([str(program), str(vocab), str(texts_file)], capture_output=True, text=True, check=True)
    rows = []
    for line in done.stdout.splitlines():
        ids, text = line.split("\t")
        rows.append(([int(i) for i in ids.split()], bytes.fromhex(text).decode("utf-8", "replace")))
    return rows


def with_pre_tokenizer(data: bytes, field: gguf.ReaderField, name: str) -> bytes:
    """The GGUF bytes with its `tokenizer.ggml.pre` string replaced (a vocabulary-only file: no tensor offsets)."""
    end = field.offset + sum(int(part.nbytes) for part in field.parts)
    key, value = b"tokenizer.ggml.pre", name.encode()
    entry = struct.pack("<Q", len(key)) + key + struct.pack("<IQ", gguf.GGUFValueType.STRING, len(value)) + value
    return data[: field.offset] + entry + data[end:]


def compare(name: str, vocab: Path, program: Path, texts: list[str], texts_file: Path, show: int) -> tuple[int, int]:
    """Print and return (texts tokenized differently, texts llama.cpp's round trip gives back and statelm's not)."""
    tok = Tokenizer.from_gguf_fields(read_gguf_fields(vocab))
    encode_diffs = decode_misses = 0
    for text, (ids, decoded) in zip(texts, llama_cpp(program, vocab, texts_file), strict=True):
        ours = tok.encode(text)
        if ours != ids:
            encode_diffs += 1
            if encode_diffs <= show:
                print(f"    {text!r}\n      llama.cpp {[tok.backend.id_to_token(i) for i in ids]}")
                print(f"      statelm   {[tok.backend.id_to_token(i) for i in ours]}")
        decode_misses += decoded == text and tok.decode(ours) != text
    print(f"| {name} | {len(texts)} | {encode_diffs} | {decode_misses} |", flush=True)
    return encode_diffs, decode_misses


def main() -> None:
    """Compare every vocabulary, then every pre-tokenizer on Llama 3's vocabulary."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-server", type=Path, default=None, help="llama-server of the build to link")
    parser.add_argument("--texts", type=int, default=400, help="random texts per vocabulary")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--show", type=int, default=2, help="differing texts printed per vocabulary")
    args = parser.parse_args()
    print(machine_report())
    directory = require_vocab_dir()
    vectors = (directory / "ggml-vocab-qwen35.gguf.inp").read_text(encoding="utf-8").split(VECTOR_SEPARATOR)
    texts = [t for t in random_texts(args.texts, args.seed) + vectors if t and VECTOR_SEPARATOR not in t]
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        program = build_with_libllama(find_llama_server(args.llama_server), HELPER, work / "tokenize")
        texts_file = work / "texts.txt"
        texts_file.write_text(VECTOR_SEPARATOR.join(texts), encoding="utf-8")
        print(f"\n| vocabulary {COLUMNS}")
        for vocab in sorted(directory.glob("ggml-vocab-*.gguf")):
            compare(vocab.stem.removeprefix("ggml-vocab-"), vocab, program, texts, texts_file, args.show)
        base = directory / "ggml-vocab-llama-bpe.gguf"
        field = gguf.GGUFReader(base).fields["tokenizer.ggml.pre"]
        data = base.read_bytes()
        print("\nLlama 3's vocabulary under each tokenizer.ggml.pre (byte-level ones)\n")
        print(f"| tokenizer.ggml.pre {COLUMNS}")
        for name, pre in sorted(BPE_PRE_TOKENIZERS.items()):
            if pre.byte_level:
                patched = work / f"{name}.gguf"
                patched.write_bytes(with_pre_tokenizer(data, field, name))
                compare(name, patched, program, texts, texts_file, args.show)


if __name__ == "__main__":
    main()
