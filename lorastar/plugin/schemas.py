"""Wire types of the OpenAI routes (msgspec Structs, field names and shapes as in vLLM's server).

Requests ignore unknown fields (as vLLM does); vLLM's own fields that lorastar does not implement
are declared and refused when set (a 400 naming the field), since each changes the result.
``prompt`` is ``str | list`` because msgspec unions may hold only one array type; its list forms
are checked in the route.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

from lorastar.engine.sampling import MAX_CACHE_SALT

# --------------------------------------------------------------------------- requests

# Why each refused vLLM field is refused: the 400 that names it says f"{field}{why}".
UNSUPPORTED_FIELDS: dict[str, str] = {
    "logits_processors": " is not supported.",
    "kv_transfer_params": " is not supported (no disaggregated serving).",
    "vllm_xargs": " is not supported.",
    "prompt_embeds": " is not supported: send text or token ids.",
    "chat_template": " in a request is not supported: the server's template is set at start "
    "(lorastar serve --chat-template).",
}

MAX_REQUEST_ID = 256  # characters of a client's request id (body or X-Request-Id header)
# A request's priority: the engine's int64 range (engine/request.py: check_priority_value)
Priority = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]


# guided_choice's strings: at least one, none empty
Choices = Annotated[list[Annotated[str, msgspec.Meta(min_length=1)]], msgspec.Meta(min_length=1)]


class StructuredOutputsParam(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's ``structured_outputs``: one of ``choice``, ``json`` (a JSON schema), ``regex``,
    ``grammar`` (EBNF or Lark), ``json_object`` and ``structural_tag`` (xgrammar's, as JSON text
    or an object); its other keys (whitespace options) are refused as unknown."""

    choice: Choices | None = None
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool | None = None  # JSON without free whitespace between tokens


class StreamOptions(msgspec.Struct, kw_only=True):
    """UNSET (falsy) where the client left a field out: ``{}`` with ``stream: false`` is no error,
    as in vLLM, whose rule reads the raw object's truthiness."""

    include_usage: bool | None | msgspec.UnsetType = msgspec.UNSET
    continuous_usage_stats: bool | None | msgspec.UnsetType = msgspec.UNSET

    def is_empty(self) -> bool:
        return self.include_usage is msgspec.UNSET and self.continuous_usage_stats is msgspec.UNSET


class _SamplingFields(msgspec.Struct, kw_only=True):
    """Sampling fields shared by both routes (OpenAI's plus vLLM's extras)."""

    model: str | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    echo: bool | None = False
    # vLLM's extension: top-k logprobs of every prompt position after the first (non-streaming).
    prompt_logprobs: int | None = None
    adapter_id: str | None = None  # LoRAX's way to pick an adapter (instead of `model`)
    # vLLM's: only these ids can be sampled
    allowed_token_ids: (
        Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(min_length=1)] | None
    ) = None
    # vLLM's: the output is one of these strings (structured_outputs' choice, the older name)
    guided_choice: Choices | None = None
    # vLLM's older names of structured_outputs' json (a JSON schema), regex and grammar
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsParam | None = None
    # OpenAI's: {"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema"}}
    response_format: dict[str, Any] | None = None
    # vLLM's: words never generated (with and without a leading space)
    bad_words: list[str] | None = None
    # vLLM's: prompt blocks shared only with requests of the same salt
    cache_salt: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_CACHE_SALT)] | None = None
    # vLLM's: the answer's id is "chatcmpl-{request_id}" / "cmpl-{request_id}" (an X-Request-Id
    # header wins); it may repeat, the engine's own id stays unique
    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_REQUEST_ID)] | None = None
    # vLLM's: keep only the prompt's last k tokens (-1: the last max_model_len; 0 is refused).
    truncate_prompt_tokens: Annotated[int, msgspec.Meta(ge=-1)] | None = None
    # vLLM's: logprobs name each token "token_id:{id}" (RL trainers read the sampled ids back;
    # text cannot tell apart tokens that decode alike, such as two halves of one character)
    return_tokens_as_token_ids: bool | None = None
    # vLLM's: the prompt's and each choice's token ids in the response (streamed: the prompt's in
    # the first chunk, each chunk's new ids)
    return_token_ids: bool | None = None
    # vLLM's: lower is served first under --scheduling-policy priority (0 otherwise; else a 400)
    priority: Priority | None = None
    # vLLM fields lorastar does not implement (UNSUPPORTED_FIELDS). Each changes what comes back,
    # so they are typed to take only their unset values (null; vLLM's defaults 0 and []): anything
    # else fails validation, a 400 naming the field (plugin/errors.py), never silently ignored.
    logits_processors: None = None
    kv_transfer_params: None = None
    vllm_xargs: None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: str | list[Any]
    max_tokens: int | None = None  # None: 16 (vLLM's default), less when the context has less room
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS etc. on text prompts
    prompt_embeds: None = None  # refused (UNSUPPORTED_FIELDS)


ChatRole = Literal["system", "user", "assistant", "tool", "developer"]


class ChatContentPart(msgspec.Struct, kw_only=True):
    """One part of a message's content; only text is served: ``{"type": "text", "text": ...}``
    (also ``input_text`` / ``output_text``, vLLM's) and an assistant's ``{"type": "refusal",
    "refusal": ...}`` (OpenAI's), each as its text."""

    type: str
    text: str | None = None
    refusal: str | None = None


class ChatMessageParam(msgspec.Struct, kw_only=True):
    """One chat message: text content; an assistant turn's ``tool_calls`` and a tool result's
    ``tool_call_id`` go to the chat template as OpenAI writes them (arguments parsed from JSON)."""

    role: ChatRole
    content: str | list[ChatContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    # an earlier answer's thinking, sent back (interleaved thinking): to the template as
    # reasoning_content (the name Qwen3's and DeepSeek's templates read); ``reasoning``: newer vLLM's
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessageParam]
    n: int | None = 1  # vLLM's chat takes null (1); its completions do not
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # vLLM's: leave the last message open (an assistant prefill); exclusive with add_generation_prompt.
    continue_final_message: bool = False
    add_special_tokens: bool = False  # vLLM's: the tokenizer's BOS etc. on top of the template's
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables (enable_thinking)
    documents: list[dict[str, str]] | None = None  # vLLM's: RAG documents, the template's ``documents``
    include_reasoning: bool = True  # vLLM's: False drops reasoning_content (with a reasoning parser)
    # vLLM's: at most this many tokens of thinking, then the block's end tag (with a reasoning parser)
    thinking_token_budget: Annotated[int, msgspec.Meta(ge=0)] | None = None
    chat_template: None = None  # refused (UNSUPPORTED_FIELDS): the server's template is its operator's
    tools: list[Any] | None = None  # OpenAI function definitions, rendered by the chat template
    tool_choice: Any = None  # "auto" (the default with tools; needs a tool_call_parser) or "none"
    parallel_tool_calls: bool | None = None  # OpenAI's: false keeps an answer's first call only (vLLM's)


class LoadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    lora_name: str = ""
    lora_int_id: int | None = None


# --------------------------------------------------------------------------- responses


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class UsageInfo(msgspec.Struct):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class PromptLogprob(msgspec.Struct):
    """One entry of vLLM's ``prompt_logprobs``: ``{token_id: {logprob, rank, decoded_token}}``."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# None for the first prompt position, then the prompt token and the top k at each position.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionLogProbs(msgspec.Struct):
    text_offset: list[int] = msgspec.field(default_factory=list)
    token_logprobs: list[float | None] = msgspec.field(default_factory=list)
    tokens: list[str] = msgspec.field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = msgspec.field(default_factory=list)


class CompletionResponseChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | UnsetType = UNSET  # return_token_ids
    token_ids: list[int] | UnsetType = UNSET


class CompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | UnsetType = UNSET  # return_token_ids: in the choice's first chunk
    token_ids: list[int] | UnsetType = UNSET  # return_token_ids: this chunk's new ids


class CompletionStreamResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None | UnsetType = UNSET


class ChatTopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[ChatTopLogprob] = msgspec.field(default_factory=list)


class ChatChoiceLogprobs(msgspec.Struct):
    content: list[ChatLogprobToken] | None = None


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(msgspec.Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class DeltaFunctionCall(msgspec.Struct):
    name: str | UnsetType = UNSET
    arguments: str | UnsetType = UNSET


class DeltaToolCall(msgspec.Struct):
    index: int
    id: str | UnsetType = UNSET
    type: str | UnsetType = UNSET
    function: DeltaFunctionCall | UnsetType = UNSET


class ChatMessage(msgspec.Struct):
    role: str
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # the same text: newer vLLM's name (clients read one or the other)
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)


class ChatCompletionResponseChoice(msgspec.Struct):
    index: int
    message: ChatMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | UnsetType = UNSET  # return_token_ids


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | UnsetType = UNSET  # return_token_ids


class DeltaMessage(msgspec.Struct):
    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET  # with a reasoning parser: the thinking block's text
    reasoning: str | UnsetType = UNSET  # the same text under newer vLLM's name
    tool_calls: list[DeltaToolCall] | UnsetType = UNSET  # with a tool-call parser: complete calls


class ChatStreamChoice(msgspec.Struct):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | UnsetType = UNSET  # return_token_ids: this chunk's new ids


class ChatCompletionStreamResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None | UnsetType = UNSET
    prompt_token_ids: list[int] | UnsetType = UNSET  # return_token_ids: in the first chunk


class ModelPermission(msgspec.Struct, kw_only=True):
    id: str
    object: str = "model_permission"
    created: int
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "lorastar"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = msgspec.field(default_factory=list)


class ModelList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[ModelCard]


# ---- /v1/embeddings (OpenAI's, with vLLM's extras) --------------------------------------------------


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    input: str | list[Any]
    model: str | None = None
    adapter_id: str | None = None  # LoRAX's way to pick an adapter (instead of `model`)
    encoding_format: Literal["float", "base64"] = "float"
    # Matryoshka: the first `dimensions` values, normalized again (meaningful for models trained so)
    dimensions: Annotated[int, msgspec.Meta(ge=1)] | None = None
    user: str | None = None
    # vLLM's extras
    truncate_prompt_tokens: Annotated[int, msgspec.Meta(ge=-1)] | None = None
    add_special_tokens: bool = True
    normalize: bool | None = None  # None: True (L2), as vLLM's embedding pooler
    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_REQUEST_ID)] | None = None
    priority: Priority | None = None


class EmbeddingData(msgspec.Struct):
    index: int
    embedding: list[float] | str  # base64: the float32 values, little-endian
    object: str = "embedding"


class EmbeddingResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo
    object: str = "list"
