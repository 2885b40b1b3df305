"""Wire types of ``/responses`` (OpenAI's Responses API, the text and function-call subset vLLM
serves). Requests ignore unknown fields, as the other routes do; ``input`` items are dicts checked
in the route (``routes/responses.py``), since OpenAI's item forms are an untagged union."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

from lorastar.engine.sampling import MAX_CACHE_SALT
from lorastar.plugin.schemas import ChatLogprobToken, Priority

# --------------------------------------------------------------------------- request


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """``POST /responses``. One answer per request (the API has no ``n``)."""

    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None  # a system message first (not carried to the next turn)
    max_output_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0)] | None = None  # at most the engine's max_logprobs
    include: list[str] | None = None  # "message.output_text.logprobs" returns the logprobs
    tools: list[dict[str, Any]] | None = None  # {"type": "function", "name", "parameters", ...}
    tool_choice: str | dict[str, Any] | None = None  # auto, none, required, {"type": "function", "name"}
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    reasoning: dict[str, Any] | None = None  # accepted and echoed; thinking follows the template
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # OpenAI's that change what comes back and are not served: refused in the route when set
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    # vLLM's extras (as on the chat route)
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    cache_salt: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_CACHE_SALT)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    adapter_id: str | None = None  # LoRAX's way to pick an adapter (instead of `model`)
    priority: Priority | None = None  # vLLM's (lower first under --scheduling-policy priority)


# --------------------------------------------------------------------------- response


class ResponseOutputText(msgspec.Struct, kw_only=True, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[ChatLogprobToken] | UnsetType = UNSET


class ResponseReasoningText(msgspec.Struct, kw_only=True, tag_field="type", tag="reasoning_text"):
    text: str


class ResponseOutputMessage(msgspec.Struct, kw_only=True, tag_field="type", tag="message"):
    id: str
    content: list[ResponseOutputText]
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ResponseReasoningItem(msgspec.Struct, kw_only=True, tag_field="type", tag="reasoning"):
    id: str
    content: list[ResponseReasoningText]
    summary: list[Any] = msgspec.field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ResponseFunctionToolCall(msgspec.Struct, kw_only=True, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


ResponseOutputItem = ResponseOutputMessage | ResponseReasoningItem | ResponseFunctionToolCall


class ResponseInputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0
    cache_write_tokens: int = 0  # required by OpenAI's schema; the prefix cache has no paid writes


class ResponseOutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    input_tokens_details: ResponseInputTokensDetails
    output_tokens: int
    output_tokens_details: ResponseOutputTokensDetails
    total_tokens: int


class ResponsesResponse(msgspec.Struct, kw_only=True):
    id: str
    created_at: int
    model: str
    output: list[ResponseOutputItem]
    status: Literal["completed", "incomplete", "in_progress"]
    usage: ResponseUsage | None
    object: Literal["response"] = "response"
    incomplete_details: dict[str, str] | None = None  # {"reason": "max_output_tokens"}
    error: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    parallel_tool_calls: bool = True
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = msgspec.field(default_factory=list)
    text: dict[str, Any] = msgspec.field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict[str, Any] | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    store: bool = False
    truncation: str = "disabled"
    user: str | None = None
    background: bool = False
    service_tier: str = "auto"


class ResponseStreamEvent(msgspec.Struct, kw_only=True):
    """One server-sent event of a streamed response (``event: {type}`` / ``data: {json}``): the
    fields every event has; the rest depend on ``type`` (OpenAI's event reference)."""

    type: str
    sequence_number: int


class ResponseDeleted(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True
