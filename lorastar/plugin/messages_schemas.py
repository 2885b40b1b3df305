"""Wire types of ``/messages`` (Anthropic's Messages API, the text, thinking and tool-use subset
vLLM serves). Requests ignore unknown fields; ``messages`` and ``system`` content blocks are dicts
checked in the route (``routes/messages.py``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from lorastar.engine.sampling import MAX_CACHE_SALT

# --------------------------------------------------------------------------- request


class MessagesRequest(msgspec.Struct, kw_only=True):
    """``POST /messages``."""

    messages: list[dict[str, Any]]
    max_tokens: Annotated[int, msgspec.Meta(ge=1)]
    model: str | None = None
    system: str | list[dict[str, Any]] | None = None  # a system message first
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None  # {"name", "description", "input_schema"}
    tool_choice: dict[str, Any] | None = None  # {"type": "auto" | "any" | "tool" | "none", "name"}
    # {"type": "enabled" | "adaptive" | "between_tools" | "disabled", "budget_tokens"}: the template's
    # enable_thinking (Qwen3, SmolLM3 and other hybrid templates); an enabled budget_tokens caps the
    # thinking where the server's reasoning parser has one-token tags (the chat route's
    # thinking_token_budget), and is dropped otherwise
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # {"format": {"type": "json_schema", "schema": {...}}}
    metadata: dict[str, Any] | None = None
    # vLLM's extras (as on the chat route)
    seed: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    cache_salt: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_CACHE_SALT)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    adapter_id: str | None = None  # LoRAX's way to pick an adapter (instead of `model`)


class CountTokensRequest(msgspec.Struct, kw_only=True):
    """``POST /messages/count_tokens``: the prompt ``/messages`` would build, counted."""

    messages: list[dict[str, Any]]
    model: str | None = None
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    adapter_id: str | None = None


# --------------------------------------------------------------------------- response


class TextBlock(msgspec.Struct, kw_only=True, tag_field="type", tag="text"):
    text: str


class ThinkingBlock(msgspec.Struct, kw_only=True, tag_field="type", tag="thinking"):
    thinking: str
    signature: str = ""  # a local model's thinking carries no signature


class ToolUseBlock(msgspec.Struct, kw_only=True, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = TextBlock | ThinkingBlock | ToolUseBlock


class MessagesUsage(msgspec.Struct, kw_only=True):
    input_tokens: int  # prompt tokens not read from the prefix cache (Anthropic's meaning)
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class MessagesResponse(msgspec.Struct, kw_only=True):
    id: str
    model: str
    content: list[ContentBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    usage: MessagesUsage
    stop_sequence: str | None = None
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"


class MessagesStreamEvent(msgspec.Struct, kw_only=True):
    """One server-sent event of a streamed message (``event: {type}`` / ``data: {json}``): the
    field every event has; the rest depend on ``type`` (Anthropic's streaming reference)."""

    type: str


class CountTokensResponse(msgspec.Struct, kw_only=True):
    input_tokens: int


class AnthropicErrorInfo(msgspec.Struct, kw_only=True):
    type: str
    message: str


class AnthropicErrorResponse(msgspec.Struct, kw_only=True):
    error: AnthropicErrorInfo
    type: Literal["error"] = "error"
