"""llama.cpp's BPE pre-tokenizers (`tokenizer.ggml.pre`) as Hugging Face `tokenizers` pre-tokenizers.

Each name llama.cpp accepts maps to the split expressions of the model's own tokenizer.json (llama.cpp keeps
them in llama-vocab.cpp, sometimes rewritten for std::regex; here they run in `tokenizers`' Oniguruma engine,
which takes the originals). The expressions apply in order, each isolating its matches, as llama.cpp's
`unicode_regex_split` does; the GPT-2 byte-to-unicode step follows unless the vocabulary is raw UTF-8.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Regex, normalizers, pre_tokenizers

# GPT-2's split (also what `pre_tokenizers.ByteLevel(use_regex=True)` runs).
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_JAIS2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)"
    r"|\s{1,2}(?!\S)|\s{1}"
)


def _cased_words(suffix: str) -> str:
    """Letter runs split at case changes (cl100k/o200k style): upper* lower+ or upper+ lower*, then `suffix`."""
    upper, lower = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
    lead = r"[^\r\n\p{L}\p{N}]?"
    return f"{lead}{upper}*{lower}+{suffix}|{lead}{upper}+{lower}*{suffix}"


_TEKKEN = _cased_words("") + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_GPT4O_SPLIT = _cased_words(_CONTRACTIONS + "?") + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_YOUTU = _cased_words(_CONTRACTIONS + "?") + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_PUNCT_WORDS = (
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPARK = (
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+"
)
_CJK_KANA = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_CJK_HANGUL = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
# DeepSeek-LLM's letters: the Latin, Greek, Cyrillic, Armenian ... ranges of its tokenizer.json.
_DEEPSEEK_LETTERS = (
    "A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376\u0377"
    "\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
    "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d"
    "\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb"
    "\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
    "\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4"
    "\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
    "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)
_NOT_SENTENCE_PUNCT = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"
_LINES = r"[^\n]+|[\n]+"
# Digit runs grouped in threes from the right (1234567 -> 1 234 567).
_DIGIT_GROUPS = r"\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))"


@dataclass(frozen=True)
class BpePreTokenizer:
    """How one llama.cpp pre-tokenizer prepares text for BPE merges, and its defaults."""

    splits: tuple[str, ...]
    ignore_merges: bool = False  # a piece that is itself a vocabulary entry is one token, merges or not
    add_bos: bool = False  # llama.cpp's default where the file has no tokenizer.ggml.add_bos_token
    byte_level: bool = True  # GPT-2 byte alphabet; False: raw UTF-8 pieces with <0xXX> byte fallback
    escape_spaces: bool = False  # spaces become "▁" before splitting (SentencePiece-style BPE)
    nfc: bool = False  # NFC first, as the model's tokenizer.json does (kept for the vocabularies that had it)
    default_bos: bool = True  # False: llama.cpp drops its default BOS (ChatGLM)

    def pre_tokenizer(self) -> pre_tokenizers.PreTokenizer | None:
        """The `tokenizers` pre-tokenizer: the splits, then the byte-level alphabet where it applies."""
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if self.byte_level and self.splits == (GPT2,):
            return byte_level
        if self.byte_level and self.splits == (r"\p{N}", GPT2):
            return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        steps: list[pre_tokenizers.PreTokenizer] = [
            pre_tokenizers.Split(Regex(split), behavior="isolated") for split in self.splits
        ]
        if self.byte_level:
            steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
        return steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)

    def normalizer(self) -> normalizers.Normalizer | None:
        """The normalizer that runs before splitting, if any."""
        if self.escape_spaces:
            return normalizers.Replace(" ", "\u2581")
        return normalizers.NFC() if self.nfc else None


_DEFAULT = BpePreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"))
_GPT2 = BpePreTokenizer((GPT2,))
_DIGITS = BpePreTokenizer((r"\p{N}", GPT2))
_LLAMA3 = BpePreTokenizer((LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2 = BpePreTokenizer((QWEN2,))
_DEEPSEEK3 = BpePreTokenizer((r"\p{N}{1,3}", _CJK_KANA, _PUNCT_WORDS))
_SPM_STYLE = BpePreTokenizer((_LINES,), byte_level=False, escape_spaces=True)
_SENTENCES = BpePreTokenizer((_NOT_SENTENCE_PUNCT,))
_CHATGLM = BpePreTokenizer((LLAMA3,), default_bos=False)
_GPT4O = BpePreTokenizer((_GPT4O_SPLIT,))
_TINY_AYA = BpePreTokenizer((r"\d{1,3}(?=(?:\d{3})*\b)", _GPT4O_SPLIT))
_BAILING = BpePreTokenizer(
    (r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",)
)

_GPT2_NAMES = """gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert exaone4
    jina-v1-en jina-v2-code roberta-bpe mpt olmo jais trillion granite-docling"""

BPE_PRE_TOKENIZERS: dict[str, BpePreTokenizer] = {
    "default": _DEFAULT,
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"],
        _LLAMA3,
    ),
    "dbrx": BpePreTokenizer((LLAMA3,)),
    # Smaug (a Llama 3 fine-tune) keeps Llama 3's whole-word lookup, as its tokenizer.json does (llama.cpp drops it).
    "smaug-bpe": BpePreTokenizer((LLAMA3,), ignore_merges=True),
    "jais-2": BpePreTokenizer((_JAIS2,)),
    "deepseek-llm": BpePreTokenizer(
        (
            r"[\r\n]",
            "\\s?[" + _DEEPSEEK_LETTERS + "]+",
            "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
            r"\s+$",
            _CJK_HANGUL,
            r"\p{N}+",
        )
    ),
    "deepseek-coder": BpePreTokenizer((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}")),
    **dict.fromkeys(["deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"], _DEEPSEEK3),
    "spark2_5": BpePreTokenizer((r"\p{N}{1,3}", _CJK_KANA, _SPARK, r"\p{N}")),
    "youtu": BpePreTokenizer(
        (
            "[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b\uff0c"
            "\u3001-\u303f\ufe30-\ufe4f]+|[\u3105-\u312f]+|" + _CJK_KANA,
            _YOUTU,
        ),
        ignore_merges=True,
    ),
    "falcon": BpePreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]")),
    **dict.fromkeys(
        ["starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"], _DIGITS
    ),
    **dict.fromkeys(_GPT2_NAMES.split(), _GPT2),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "megrez"], BpePreTokenizer((QWEN2,), nfc=True)),
    **dict.fromkeys(["kormo", "f2llmv2", "stablelm2", "hunyuan", "solar-open", "grok-2"], _QWEN2),
    "qwen35": BpePreTokenizer((_QWEN35,)),
    **dict.fromkeys(["gemma4", "granite-embed-multi-311m", "sarvam-moe"], _SPM_STYLE),
    "whitespace": BpePreTokenizer((r"\S+",), byte_level=False),
    **dict.fromkeys(["poro-chat", "bloom", "gpt3-finnish"], _SENTENCES),
    "viking": BpePreTokenizer((_NOT_SENTENCE_PUNCT, r"\p{N}")),
    "chatglm-bpe": _CHATGLM,
    **dict.fromkeys(["glm4", "glm5"], BpePreTokenizer((LLAMA3,), ignore_merges=True, default_bos=False)),
    "tekken": BpePreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True),
    "chameleon": BpePreTokenizer(
        (
            r"<sentinel:[0-9]+>",
            r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
            r"([\t\n]|    |  )",
            r"\p{N}",
            r"[\p{P}!-/:-@\[-`{-~]",
            GPT2,
        ),
        add_bos=True,
    ),
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], _GPT4O),
    "granite-embed-multi-97m": BpePreTokenizer((_GPT4O_SPLIT,), ignore_merges=True),
    **dict.fromkeys(["tiny_aya", "cohere2moe"], _TINY_AYA),
    "superbpe": BpePreTokenizer((r"\p{N}+", r"\d{1,3}(?=(?:\d{3})*(?!\d))")),
    **dict.fromkeys(["bailingmoe", "bailingmoe2", "llada-moe"], _BAILING),
    "seed-coder": BpePreTokenizer(
        (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",)
    ),
    "ufakzeka": BpePreTokenizer(
        (r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",)
    ),
    "afmoe": BpePreTokenizer(
        (
            _DIGIT_GROUPS,
            "[\u4e00-\u9fff\u3400-\u4dbf\u8c48-\ufaff\u3040-\u309f\u30a0-\u30ff\uff65-\uff9f\u2f00-\u2fdf"
            "\u0e40-\u0e7f\u0e80-\u0eff\u1780-\u17ff\u1000-\u109f\uaa60-\uaa7f\ua9e0-\ua9ff\uac00-\ud7af"
            "\u1100-\u11ff]+",
            _PUNCT_WORDS,
        )
    ),
    "laguna": BpePreTokenizer((_LINES, QWEN2)),
    "exaone-moe": BpePreTokenizer(
        (
            _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?"
            r"|\s*[\r\n]|\s+(?!\S)|\s+",
        )
    ),
    "minicpm5": BpePreTokenizer(
        (
            r"\p{N}{1,3}",
            _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ),
        ignore_merges=True,
    ),
}

# Names llama.cpp loads with a hand-written splitter (and no merges) that statelm does not reproduce.
UNSUPPORTED_BPE_PRE_TOKENIZERS = frozenset({"kimi-k2"})
