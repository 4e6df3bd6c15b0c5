"""Request and response bodies of /v1/embeddings (OpenAI's shape), /v1/rerank (Cohere's and Jina's, as vLLM and
llama.cpp serve it) and /v1/score (vLLM's)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from statelm.api.errors import APIError
from statelm.api.protocol import MAX_TAG_LENGTH, TokenId, TypedModel

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one embeddings request
MAX_DOCUMENTS = 4096  # documents one rerank or score request may rank

Text = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
EmbeddingInput = (
    Text
    | Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)]
    | TokenIds
    | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_INPUTS)]
)


class EmbeddingRequest(TypedModel):
    """OpenAI's embeddings request: a text, texts, token ids or lists of token ids."""

    model: str
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None  # Matryoshka truncation, where the model allows it
    user: Annotated[str, Field(max_length=MAX_TAG_LENGTH)] | None = None  # logged, see statelm.api.access_log

    def inputs(self) -> list[str] | list[list[int]]:
        """The inputs as a list: texts, or token-id lists."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if value and isinstance(value[0], int):
            return [value]  # type: ignore[list-item]  # one list of token ids
        return value  # type: ignore[return-value]


class Embedding(BaseModel):
    """One input's vector: floats, or base64 of little-endian float32."""

    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    """Tokens read: every input's, special tokens included."""

    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    """OpenAI's embeddings response."""

    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
    # the model's weights, tokenizer and pooling, hashed (as chat completions carry it): vectors with the same one
    # are comparable, so a client may keep them
    system_fingerprint: str


class DocumentObject(TypedModel):
    """A document as Cohere's v2 and Jina send it: an object with its text."""

    text: Text


Document = Text | DocumentObject


class RerankRequest(TypedModel):
    """Rank documents by relevance to a query (Cohere/Jina: vLLM's and llama.cpp's /v1/rerank)."""

    model: str
    query: Text
    documents: Annotated[list[Document], Field(min_length=1, max_length=MAX_DOCUMENTS)]
    top_n: Annotated[int, Field(ge=0)] | None = None  # None or 0: every document
    return_documents: bool = True

    def texts(self) -> list[str]:
        """The documents' texts."""
        return [doc if isinstance(doc, str) else doc.text for doc in self.documents]


class RerankDocument(BaseModel):
    """The text of a ranked document."""

    text: str


class RerankResult(BaseModel):
    """One document's place: its index in the request, its score and (if asked for) its text."""

    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(BaseModel):
    """Tokens read, every query-document pair's."""

    prompt_tokens: int
    total_tokens: int


class RerankResponse(BaseModel):
    """The documents, most relevant first."""

    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage


ScoreTexts = Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_DOCUMENTS)]


class ScoreRequest(TypedModel):
    """Score text pairs (vLLM's /v1/score): one text_1 against each text_2, or text_1[i] against text_2[i]."""

    model: str
    text_1: ScoreTexts
    text_2: ScoreTexts

    def pairs(self) -> list[tuple[str, str]]:
        """The (text_1, text_2) pairs to score; 400 when both are lists of different lengths."""
        firsts = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        seconds = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if len(firsts) == 1:
            return [(firsts[0], second) for second in seconds]
        if len(firsts) != len(seconds):
            raise APIError(
                f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}; send one text_1, or as many as text_2",
                param="text_2",
            )
        return list(zip(firsts, seconds, strict=True))


class Score(BaseModel):
    """One pair's score."""

    object: Literal["score"] = "score"
    index: int
    score: float


class ScoreResponse(BaseModel):
    """Every pair's score, in the request's order."""

    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[Score]
    usage: RerankUsage
