"""Request and response bodies of the OpenAI-compatible API: what the generation routes share, and chat's."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    ValidationInfo,
    field_validator,
    model_validator,
)

from statelm.api.json_schemas import JSONSchema, JSONSchemaOrText, check_parameters_schema
from statelm.engine.client import LOGIT_BIAS_LIMIT
from statelm.sampler_settings import SamplerSettings, TypedModel

MAX_STOP_STRINGS = 16
MAX_CHOICES = 128
MAX_TOP_LOGPROBS = 20
MAX_REPETITION_PERIOD = 512
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch generators accept
MAX_TAG_LENGTH = 512  # user, safety_identifier, prompt_cache_key: OpenAI's limit is 64; proxies send longer ids
MAX_METADATA_PAIRS = 16  # OpenAI's limits on `metadata`
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512

TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]
TokenId = Annotated[int, Field(ge=0)]
TokenIdKey = Annotated[int, Field(ge=0), Strict(False)]  # JSON object keys are strings
FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
JSONObject = dict[str, Any]
# Template variables statelm sets itself (or the template environment's own globals)
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception", "strftime_now"}
)


def _check_template_kwargs(kwargs: JSONObject) -> JSONObject:
    refused = sorted(name for name in kwargs if name in RESERVED_TEMPLATE_KWARGS or not name.isidentifier())
    if refused:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(map(repr, refused))}")
    return kwargs


TemplateKwargs = Annotated[JSONObject, AfterValidator(_check_template_kwargs)]
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]  # OpenAI's, as the SDK sends
Metadata = Annotated[
    dict[Annotated[str, Field(max_length=MAX_METADATA_KEY)], Annotated[str, Field(max_length=MAX_METADATA_VALUE)]],
    Field(max_length=MAX_METADATA_PAIRS),
]


class StreamOptions(TypedModel):
    """Options of a streamed response."""

    include_usage: bool = False


class JSONSchemaSpec(TypedModel):
    """`response_format.json_schema`: a named schema the output must follow (`strict` is always the behaviour)."""

    model_config = ConfigDict(populate_by_name=True)

    name: FunctionName
    description: str | None = None
    json_schema: JSONSchema | None = Field(default=None, alias="schema")  # absent: any JSON object
    strict: bool | None = None


class TextResponseFormat(TypedModel):
    """`response_format` {"type": "text"}: no constraint."""

    type: Literal["text"]


class JSONObjectResponseFormat(TypedModel):
    """`response_format` {"type": "json_object"}: one JSON object; llama.cpp's `schema` makes it follow a schema."""

    type: Literal["json_object"]
    json_schema: JSONSchema | None = Field(default=None, alias="schema")  # llama.cpp


class JSONSchemaResponseFormat(TypedModel):
    """`response_format` {"type": "json_schema"}: JSON valid under OpenAI's `json_schema` or llama.cpp's `schema`."""

    type: Literal["json_schema"]
    json_schema: JSONSchemaSpec | None = None
    schema_: JSONSchema | None = Field(default=None, alias="schema")  # llama.cpp: the schema itself

    @model_validator(mode="after")
    def _one_schema(self) -> JSONSchemaResponseFormat:
        if (self.json_schema is None) == (self.schema_ is None):
            raise ValueError("json_schema response_format takes either json_schema (OpenAI) or schema (llama.cpp)")
        return self


ResponseFormat = Annotated[
    TextResponseFormat | JSONObjectResponseFormat | JSONSchemaResponseFormat, Field(discriminator="type")
]


class StructuredOutputs(TypedModel):
    """vLLM's `structured_outputs`: exactly one of a JSON schema, a regex, a grammar (GBNF/Lark) or choices."""

    json_schema: JSONSchemaOrText | None = Field(default=None, alias="json")
    regex: Annotated[str, Field(min_length=1)] | None = None
    grammar: Annotated[str, Field(min_length=1)] | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None

    model_config = ConfigDict(populate_by_name=True)

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [name for name in ("json_schema", "regex", "grammar", "choice") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex, grammar, choice")
        return self


class RepetitionDetection(TypedModel):
    """statelm's loop stop: end the output once a block of min..max_period tokens repeats min_repeats times.

    A loop must also span `min_tokens` tokens, so short harmless repeats ("ha ha ha") are not cut.
    """

    enabled: bool = True
    min_period: Annotated[int, Field(ge=1, le=MAX_REPETITION_PERIOD)] = 1
    max_period: Annotated[int, Field(ge=1, le=MAX_REPETITION_PERIOD)] = 64
    min_repeats: Annotated[int, Field(ge=2, le=1000)] = 3
    min_tokens: Annotated[int, Field(ge=0, le=100_000)] = 32

    @model_validator(mode="after")
    def _periods_in_order(self) -> RepetitionDetection:
        if self.min_period > self.max_period:
            raise ValueError(f"min_period ({self.min_period}) is more than max_period ({self.max_period})")
        return self


class SamplingOptions(SamplerSettings):
    """The sampling and stopping fields of every generation route, OpenAI's and the extensions, and the access-log
    tags; each one is honoured (an explicit null counts as unset)."""

    logit_bias: dict[TokenIdKey, Annotated[float, Field(ge=-LOGIT_BIAS_LIMIT, le=LOGIT_BIAS_LIMIT)]] | None = None
    seed: Annotated[int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    ignore_eos: bool = False
    structured_outputs: StructuredOutputs | None = None  # vLLM
    repetition_detection: RepetitionDetection | None = None
    user: Annotated[str, Field(max_length=MAX_TAG_LENGTH)] | None = None  # OpenAI: logged, see statelm.api.access_log
    safety_identifier: Annotated[str, Field(max_length=MAX_TAG_LENGTH)] | None = None  # OpenAI: logged
    prompt_cache_key: Annotated[str, Field(max_length=MAX_TAG_LENGTH)] | None = None  # OpenAI: logged; one cache
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None  # OpenAI: scheduling priority

    @field_validator("stop")
    @classmethod
    def _stop_strings_are_not_empty(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if stop == "" or (isinstance(stop, list) and "" in stop):
            raise ValueError("stop strings must not be empty")
        return stop

    def stop_strings(self) -> list[str]:
        """`stop` as a list."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class GenerationRequest(SamplingOptions):
    """The fields chat and text completions share."""

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    guided_json: JSONSchemaOrText | None = None  # vLLM's earlier names of structured_outputs' fields
    guided_regex: Annotated[str, Field(min_length=1)] | None = None
    guided_grammar: Annotated[str, Field(min_length=1)] | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: Annotated[str, Field(min_length=1)] | None = None  # llama.cpp: a GBNF grammar
    json_schema: JSONSchema | None = None  # llama.cpp: a JSON schema

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, options: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if options is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return options

    def requested_max_tokens(self) -> int | None:
        """The completion length limit the request sets, if any."""
        return self.max_tokens

    def top_logprobs_count(self) -> int | None:
        """How many top alternatives to report with each token's logprob; None when logprobs are off."""
        return None

    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage


class TextContentPart(TypedModel):
    """A text part of a message's content list."""

    type: Literal["text"]
    text: str


class FunctionCall(TypedModel):
    """The function a tool call names, with its arguments as a JSON text."""

    name: str
    arguments: str


class ToolCallMessage(TypedModel):
    """A tool call of an assistant message."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(TypedModel):
    """One message of a conversation: a system, user, assistant (with tool calls, reasoning) or tool message."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # assistant
    reasoning_content: str | None = None  # assistant: its reasoning, for templates that show it
    tool_call_id: str | None = None  # tool: the call this message answers

    @model_validator(mode="after")
    def _fields_fit_the_role(self) -> ChatMessage:
        if self.role != "assistant" and (self.tool_calls is not None or self.reasoning_content is not None):
            raise ValueError(f"tool_calls and reasoning_content belong to assistant messages, not {self.role}")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message needs tool_call_id, and only a tool message has one")
        return self

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def for_transcript(self) -> dict[str, Any]:
        """The message as a session's transcript keeps it: as sent, without unset fields."""
        return self.model_dump(exclude_none=True)


class FunctionDefinition(TypedModel):
    """A function the model may call: its name, what it does, and a JSON schema of its parameters."""

    name: FunctionName
    description: str | None = None
    parameters: JSONObject | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _parameters_schema(cls, schema: JSONObject | None, info: ValidationInfo) -> JSONObject | None:
        return check_parameters_schema(schema, info.data.get("name"))


class ToolDefinition(TypedModel):
    """One entry of `tools`."""

    type: Literal["function"]
    function: FunctionDefinition

    @property
    def name(self) -> str:
        """The function's name."""
        return self.function.name


class FunctionChoice(TypedModel):
    """The function a named `tool_choice` forces."""

    name: FunctionName


class NamedToolChoice(TypedModel):
    """`tool_choice` naming the one function the model must call."""

    type: Literal["function"]
    function: FunctionChoice

    @property
    def name(self) -> str:
        """The function's name."""
        return self.function.name


class ToolRules(TypedModel):
    """The checks of `tools` and `tool_choice` that chat and responses share; each declares the fields in its own
    shape (`tools` before `tool_choice`), whose entries and named choice have a `name`."""

    @field_validator("tools", check_fields=False)
    @classmethod
    def _tool_names_differ(cls, tools: list[Any] | None) -> list[Any] | None:
        names = [tool.name for tool in tools or ()]
        if len(set(names)) < len(names):
            raise ValueError("tools holds two functions of the same name")
        return tools

    @field_validator("tool_choice", check_fields=False)
    @classmethod
    def _tool_choice_fits_the_tools(cls, choice: Any, info: ValidationInfo) -> Any:
        names = [tool.name for tool in info.data.get("tools") or ()]
        if choice in ("auto", "required") and not names:
            raise ValueError(f"tool_choice {choice!r} needs tools")
        if choice is not None and not isinstance(choice, str) and choice.name not in names:
            raise ValueError(f"tool_choice names the function {choice.name!r}, which is not in tools")
        return choice


class ReasoningControls(TypedModel):
    """statelm's controls of the chat template and of reasoning, which chat and responses share."""

    chat_template_kwargs: TemplateKwargs | None = None
    max_reasoning_tokens: Annotated[int, Field(ge=0)] | None = None  # statelm/vLLM; `thinking_budget` too
    thinking_budget: Annotated[int, Field(ge=0)] | None = None

    @field_validator("thinking_budget")
    @classmethod
    def _one_reasoning_budget(cls, value: int | None, info: ValidationInfo) -> int | None:
        other = info.data.get("max_reasoning_tokens")
        if value is not None and other is not None and value != other:
            raise ValueError(f"max_reasoning_tokens ({other}) and thinking_budget ({value}) differ; send one of them")
        return value

    def reasoning_budget(self) -> int | None:
        """The reasoning token budget under either of its names."""
        return self.max_reasoning_tokens if self.max_reasoning_tokens is not None else self.thinking_budget


class ChatCompletionRequest(GenerationRequest, ReasoningControls, ToolRules):
    """Body of POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    session_id: str | None = None  # statelm: `messages` are this turn's messages, appended to the session
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    reasoning_effort: ReasoningEffort | None = None
    store: bool = False  # OpenAI: keep the completion retrievable at GET /v1/chat/completions/{id}
    metadata: Metadata | None = None  # OpenAI: kept with a stored completion, and logged

    @field_validator("max_completion_tokens")
    @classmethod
    def _one_length_limit(cls, value: int | None, info: ValidationInfo) -> int | None:
        other = info.data.get("max_tokens")
        if value is not None and other is not None and value != other:
            raise ValueError(f"max_tokens ({other}) and max_completion_tokens ({value}) differ; send one of them")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs set to true")
        return value

    def requested_max_tokens(self) -> int | None:
        """The completion length limit, under either of its names."""
        return self.max_completion_tokens or self.max_tokens

    def top_logprobs_count(self) -> int | None:
        """`top_logprobs` (0 if unset) when `logprobs` is true, else None."""
        return (self.top_logprobs or 0) if self.logprobs else None


class PromptTokensDetails(BaseModel):
    """Breakdown of the prompt tokens."""

    cached_tokens: int = 0


class Usage(BaseModel):
    """Token accounting of one response."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def _omit_none(value: object) -> bool:
    return value is None


class Timings(BaseModel):
    """Where a response's time went, in llama.cpp's `timings` fields (`prompt_n` excludes the cached tokens)."""

    cache_n: int
    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float
    draft_n: int | None = Field(default=None, exclude_if=_omit_none)  # verified draft tokens
    draft_n_accepted: int | None = Field(default=None, exclude_if=_omit_none)  # of which generated


class TopLogprob(BaseModel):
    """A token and its logprob, with the token's UTF-8 bytes."""

    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobInfo(TopLogprob):
    """A generated token's logprob and the most likely tokens at its position."""

    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    """Logprobs of a choice's tokens, in chat's format."""

    content: list[TokenLogprobInfo]
    refusal: None = None


class AssistantMessage(BaseModel):
    """The generated message: the answer, the reasoning before it and the tool calls it makes."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = Field(default=None, exclude_if=_omit_none)
    tool_calls: list[ToolCallMessage] | None = Field(default=None, exclude_if=_omit_none)


class ChatChoice(BaseModel):
    """One generated choice; `repetition_detected` (statelm) is present when a loop ended it."""

    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None
    repetition_detected: bool | None = Field(default=None, exclude_if=_omit_none)


class ChatCompletionResponse(BaseModel):
    """Body of a non-streamed chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    timings: Timings
    system_fingerprint: str
    service_tier: str
    session_id: str | None = Field(default=None, exclude_if=_omit_none)


class StoredChatCompletion(ChatCompletionResponse):
    """A completion made with `store: true`, as GET /v1/chat/completions/{id} returns it, with its metadata."""

    metadata: dict[str, str] = Field(default_factory=dict)


class DeletedCompletion(BaseModel):
    """Body of DELETE /v1/chat/completions/{id}."""

    id: str
    object: Literal["chat.completion.deleted"] = "chat.completion.deleted"
    deleted: bool = True


class DeltaFunctionCall(BaseModel):
    """The function of a streamed tool call: the name in its first delta, then pieces of the arguments."""

    name: str | None = Field(default=None, exclude_if=_omit_none)
    arguments: str = ""


class DeltaToolCall(BaseModel):
    """A piece of a streamed tool call; its first piece carries the id, type and name."""

    index: int
    id: str | None = Field(default=None, exclude_if=_omit_none)
    type: Literal["function"] | None = Field(default=None, exclude_if=_omit_none)
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    """The new part of the message in one stream chunk."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = Field(default=None, exclude_if=_omit_none)
    tool_calls: list[DeltaToolCall] | None = Field(default=None, exclude_if=_omit_none)


class ChunkChoice(BaseModel):
    """One choice's delta in a stream chunk."""

    index: int
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None
    repetition_detected: bool | None = Field(default=None, exclude_if=_omit_none)


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion; the last one before [DONE] carries `timings`."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    timings: Timings | None = Field(default=None, exclude_if=_omit_none)
    system_fingerprint: str
    service_tier: str
    session_id: str | None = Field(default=None, exclude_if=_omit_none)


class ModelCard(BaseModel):
    """One entry of GET /v1/models."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "statelm"
    max_model_len: int
    sampling_defaults: SamplerSettings | None = None  # what a request that leaves a sampling field out gets
    kind: Literal["generation", "embedding", "reranker"] = "generation"  # embedding models and rerankers don't generate


class ModelList(BaseModel):
    """Body of GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
