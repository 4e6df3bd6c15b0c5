"""Logprobs of generated tokens: the token strings they show, and chat's `logprobs.content` (which responses share)."""

from __future__ import annotations

import functools

from statelm.api.generation import ReleasedToken
from statelm.api.protocol import ChoiceLogprobs, TokenLogprobInfo, TopLogprob
from statelm.tokenizer import Tokenizer

VOCAB_CACHE_SIZE = 1 << 17


class TokenStrings:
    """A token id's text (decoded alone, special tokens included) and UTF-8 bytes, as logprobs show them."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.text = functools.lru_cache(maxsize=VOCAB_CACHE_SIZE)(self._text)
        self.bytes = functools.lru_cache(maxsize=VOCAB_CACHE_SIZE)(self._bytes)

    def _text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def _bytes(self, token_id: int) -> list[int]:
        return list(self._tokenizer.token_bytes(token_id))

    def top(self, token_id: int, logprob: float) -> TopLogprob:
        """One token with its logprob, in chat's format."""
        return TopLogprob(token=self.text(token_id), logprob=logprob, bytes=self.bytes(token_id))


def chat_logprobs(tokens: list[ReleasedToken], strings: TokenStrings) -> ChoiceLogprobs:
    """Chat's `logprobs` object for some tokens of a choice."""
    content = []
    for released in tokens:
        record = released.logprob
        chosen = strings.top(record.token_id, record.logprob)
        alternatives = [strings.top(token_id, logprob) for token_id, logprob in record.top]
        content.append(TokenLogprobInfo(**chosen.model_dump(), top_logprobs=alternatives))
    return ChoiceLogprobs(content=content)
