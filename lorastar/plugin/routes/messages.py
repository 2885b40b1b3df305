"""``/messages``: Anthropic's Messages API over the chat route's pipeline (vLLM and SGLang serve it
too), so Anthropic's SDKs and the tools built on them can use the base model and its adapters.

A request becomes a chat request (``system`` a system message first; ``tool_use`` blocks an
assistant turn's tool calls, ``tool_result`` blocks tool messages, ``thinking`` blocks the turn's
``reasoning_content``) and goes through ``plan_chat``; the answer is read by the server's
reasoning and tool-call parsers into ``thinking``, ``text`` and ``tool_use`` blocks. Streams send
Anthropic's events (``message_start`` ... ``message_stop``); errors, streamed or not, are
Anthropic's ``{"type": "error", "error": {"type", "message"}}``.

Served: text, tools (``input_schema``) with every ``tool_choice`` (and its
``disable_parallel_tool_use``), a last assistant turn as a prefill (continued), ``stop_sequences``,
``output_config.format`` (json_schema), ``thinking`` on or off (the template's ``enable_thinking``;
``budget_tokens`` caps the thinking where the reasoning parser's tags are one token each),
``/messages/count_tokens``. Refused with a 400 naming the
field: images, documents, server tools (web search, code execution, ...).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from litestar import Request, Response, post
from litestar.openapi import ResponseSpec
from litestar.response import Stream
from litestar.status_codes import HTTP_200_OK

from lorastar.engine.outputs import CompletionOutput, RequestOutput
from lorastar.errors import EngineOverloadedError
from lorastar.plugin.errors import APIError, handler_map, make_exception_handler, to_api_error
from lorastar.plugin.messages_schemas import (
    AnthropicErrorInfo,
    AnthropicErrorResponse,
    ContentBlock,
    CountTokensRequest,
    CountTokensResponse,
    MessagesRequest,
    MessagesResponse,
    MessagesStreamEvent,
    MessagesUsage,
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
)
from lorastar.plugin.routes.chat import chat_request_of, plan_chat, render_messages
from lorastar.plugin.routes.common import choice_deltas, collect, prime_or_404
from lorastar.plugin.schemas import ChatCompletionRequest, ChatMessageParam
from lorastar.plugin.service import LoraStarService, merge_streams, run_until_disconnect
from lorastar.plugin.sse import STREAM_CHUNK, TypedEventsOperation, sse_event_response
from lorastar.plugin.tool_parsers import ParsedToolCall

# Anthropic's error types by status (its SDKs pick their exception class from the status).
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",  # Anthropic's status for overload (its SDKs' OverloadedError)
}
# The chat fields an error may name, as this route's client sent them.
_RENAMED = (
    ("'max_tokens' or 'max_completion_tokens'", "'max_tokens'"),
    ("response_format", "output_config"),
    ("stop", "stop_sequences"),
)


def anthropic_error(error: APIError) -> AnthropicErrorResponse:
    kind = _ERROR_TYPES.get(
        error.status_code, "invalid_request_error" if error.status_code < 500 else "api_error"
    )
    return AnthropicErrorResponse(error=AnthropicErrorInfo(type=kind, message=error.message))


def anthropic_response(error: APIError) -> Response[Any]:
    """An error in Anthropic's shape, with the status and headers the OpenAI routes would send."""
    return Response(anthropic_error(error), status_code=error.status_code, headers=error.headers)


def error_event(error: APIError, last: dict[str, Any] | None) -> dict[str, Any]:
    return {"type": "error", "error": {"type": anthropic_error(error).error.type, "message": error.message}}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


# --------------------------------------------------------------------------- request -> chat


def _text(block: dict[str, Any], where: str) -> str:
    if not isinstance(block.get("text"), str):
        raise APIError(f"{where} needs 'text' (a string).", param="messages")
    return block["text"]


def system_text(system: str | list[dict[str, Any]] | None) -> str | None:
    if system is None or isinstance(system, str):
        return system
    texts = []
    for j, block in enumerate(system):
        if (
            not isinstance(block, dict)
            or block.get("type") != "text"
            or not isinstance(block.get("text"), str)
        ):
            raise APIError(f"system[{j}]: only text blocks are supported.", param="system")
        texts.append(block["text"])
    return "\n".join(texts)


def _tool_result(block: dict[str, Any], where: str) -> ChatMessageParam:
    if not isinstance(block.get("tool_use_id"), str):
        raise APIError(f"{where} needs 'tool_use_id' (a string).", param="messages")
    content = block.get("content")
    if content is None:  # absent or null: an empty result (vLLM's)
        content = ""
    elif isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise APIError(f"{where}.content[{k}]: only text blocks are supported.", param="messages")
            parts.append(_text(part, f"{where}.content[{k}]"))
        content = "\n".join(parts)
    elif not isinstance(content, str):
        raise APIError(f"{where}.content must be a string or text blocks.", param="messages")
    return ChatMessageParam(role="tool", content=content, tool_call_id=block["tool_use_id"])


def chat_messages(req: MessagesRequest | CountTokensRequest) -> list[ChatMessageParam]:
    """The conversation as chat messages: a user turn's ``tool_result`` blocks become tool messages
    (before its text, as Anthropic orders them); an assistant turn's ``thinking``, ``text`` and
    ``tool_use`` blocks one assistant message with ``reasoning_content`` and ``tool_calls``."""
    out: list[ChatMessageParam] = []
    if system := system_text(req.system):  # an empty one is no system prompt (vLLM's)
        out.append(ChatMessageParam(role="system", content=system))
    if not req.messages:
        raise APIError("messages must not be empty.", param="messages")
    for i, msg in enumerate(req.messages):
        where = f"messages[{i}]"
        role = msg.get("role") if isinstance(msg, dict) else None
        if role not in ("user", "assistant"):
            raise APIError(f"{where}.role must be 'user' or 'assistant', got {role!r}.", param="messages")
        content = msg.get("content")
        if isinstance(content, str):
            out.append(ChatMessageParam(role=role, content=content))
            continue
        if not isinstance(content, list):
            raise APIError(f"{where}.content must be a string or a list of blocks.", param="messages")
        texts: list[str] = []
        thinking: list[str] = []
        calls: list[dict[str, Any]] = []
        results = False  # the turn answered tool calls
        for j, block in enumerate(content):
            at = f"{where}.content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                texts.append(_text(block, at))
            elif kind == "tool_result" and role == "user":
                out.append(_tool_result(block, at))
                results = True
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise APIError(f"{at} needs 'id' and 'name' (strings).", param="messages")
                if not isinstance(block.get("input", {}), dict):
                    raise APIError(f"{at}.input must be an object.", param="messages")
                arguments = json.dumps(block.get("input", {}), ensure_ascii=False)
                calls.append({"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": arguments}})  # fmt: skip
            elif kind == "thinking" and role == "assistant":
                if not isinstance(block.get("thinking"), str):
                    raise APIError(f"{at} needs 'thinking' (a string).", param="messages")
                thinking.append(block["thinking"])
            elif kind == "redacted_thinking" and role == "assistant":
                continue  # encrypted by another model: nothing this one can read
            else:
                raise APIError(
                    f"{at}: {kind!r} blocks are not supported in {role} messages "
                    f"(text{', tool_result' if role == 'user' else ', thinking, tool_use'}).",
                    param="messages",
                )
        if role == "user":
            if texts or not results:
                out.append(ChatMessageParam(role="user", content="\n".join(texts)))
        else:
            out.append(ChatMessageParam(
                role="assistant", content="\n".join(texts) if texts else None, tool_calls=calls or None,
                reasoning_content="\n".join(thinking) if thinking else None,
            ))  # fmt: skip
    return out


def prefilled(messages: list[ChatMessageParam]) -> bool:
    """Anthropic's prefill: a last assistant turn of text (no tool calls) is continued, not
    answered (the chat route's continue_final_message); the answer is the continuation."""
    last = messages[-1]
    return last.role == "assistant" and bool(last.content) and not last.tool_calls


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Client tools in the chat API's shape; server tools (web search, ...) are a 400."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type", "custom")
        if kind != "custom":
            raise APIError(
                f"tools[{i}]: tools of type {kind!r} are not supported: lorastar serves client tools "
                "({'name', 'description', 'input_schema'}).",
                param="tools",
            )
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise APIError(f"tools[{i}] needs a name.", param="tools")
        fn = {"name": tool["name"], "parameters": tool.get("input_schema")}
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: dict[str, Any] | None) -> Any:
    if choice is None:
        return None
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(
        "tool_choice must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': ...}.",
        param="tool_choice",
    )


def chat_response_format(config: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (config or {}).get("format")
    if fmt is None:
        return None
    if (
        not isinstance(fmt, dict)
        or fmt.get("type") != "json_schema"
        or not isinstance(fmt.get("schema"), dict)
    ):
        raise APIError(
            "output_config.format must be {'type': 'json_schema', 'schema': {...}}.", param="output_config"
        )
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


# Anthropic's thinking types that let the model think: ``enabled`` (with a budget), ``adaptive``
# (the model decides how much) and ``between_tools`` (interleaved with tool calls).
_THINKING_ON = ("enabled", "adaptive", "between_tools")


def template_kwargs(req: MessagesRequest | CountTokensRequest) -> dict[str, Any] | None:
    """The template's variables: ``thinking`` on (enabled, adaptive, between_tools) or disabled
    becomes ``enable_thinking`` (the switch of Qwen3's, SmolLM3's and other hybrid templates; others
    ignore it) unless the request sets that variable itself."""
    kwargs = dict(req.chat_template_kwargs or {})
    if req.thinking is not None:
        kind = req.thinking.get("type")
        if kind not in (*_THINKING_ON, "disabled"):
            raise APIError(
                f"thinking.type must be 'enabled', 'adaptive', 'between_tools' or 'disabled', got {kind!r}.",
                param="thinking",
            )
        kwargs.setdefault("enable_thinking", kind != "disabled")
    return kwargs or None


def chat_request(req: MessagesRequest) -> ChatCompletionRequest:
    messages = chat_messages(req)
    prefill = prefilled(messages)
    return chat_request_of(
        req,
        messages=messages,
        add_generation_prompt=not prefill,
        continue_final_message=prefill,
        max_tokens=req.max_tokens,
        stop=req.stop_sequences,
        chat_template_kwargs=template_kwargs(req),
        tools=chat_tools(req.tools),
        tool_choice=chat_tool_choice(req.tool_choice),
        response_format=chat_response_format(req.output_config),
        thinking_token_budget=thinking_budget(req),
    )


def thinking_budget(req: MessagesRequest) -> int | None:
    """``thinking.budget_tokens`` of enabled thinking: the chat route's ``thinking_token_budget``
    (enforced where the server's reasoning parser has one-token tags, dropped otherwise)."""
    thinking = req.thinking or {}
    budget = thinking.get("budget_tokens")
    if thinking.get("type") != "enabled" or budget is None:
        return None
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
        raise APIError(f"thinking.budget_tokens must be an integer >= 0, got {budget!r}.", param="thinking")
    return budget


def _renamed(exc: APIError) -> APIError:
    message, param = exc.message, exc.param
    for old, new in _RENAMED:
        if param == old:
            param = new
            message = message.replace(old, new)
        elif old.startswith("'"):
            message = message.replace(old, new)
    return APIError(message, exc.status_code, param=param, headers=exc.headers)


# --------------------------------------------------------------------------- answer -> content


def tool_input(arguments: str) -> dict[str, Any] | None:
    """A call's arguments as ``tool_use.input`` (a JSON object), or None where they are not one
    (an answer cut at max_tokens mid-call), or hold what no response can carry: a lone surrogate
    (the arguments keep it as a JSON escape; decoded, it cannot be encoded as UTF-8: a 500)."""
    try:
        value = json.loads(arguments)
        json.dumps(value, ensure_ascii=False).encode()
    except (ValueError, RecursionError):  # UnicodeEncodeError is a ValueError
        return None
    return value if isinstance(value, dict) else None


def content_blocks(
    reasoning: str | None, content: str | None, calls: list[ParsedToolCall]
) -> list[ContentBlock]:
    """The answer as blocks in the order it wrote them. A call whose arguments are no JSON object
    stays text (its arguments as written), so nothing the model wrote is lost."""
    blocks: list[ContentBlock] = []
    if reasoning:
        blocks.append(ThinkingBlock(thinking=reasoning))
    if content:
        blocks.append(TextBlock(text=content))
    for call in calls:
        if not call.arguments.strip():  # a forced call cut before its input began: nothing written
            continue
        args = tool_input(call.arguments)
        if args is None:
            blocks.append(TextBlock(text=call.arguments))
        else:
            blocks.append(ToolUseBlock(id=new_id("toolu"), name=call.name, input=args))
    return blocks


def stop_of(out: CompletionOutput, used_tools: bool) -> tuple[Any, str | None]:
    """Anthropic's (stop_reason, stop_sequence) of the engine's finish."""
    if out.finish_reason == "length":
        return "max_tokens", None
    if used_tools:
        return "tool_use", None
    if isinstance(out.stop_reason, str):
        return "stop_sequence", out.stop_reason
    return "end_turn", None


def usage_of(out: RequestOutput, output_tokens: int) -> MessagesUsage:
    cached = int(out.num_cached_tokens or 0)
    return MessagesUsage(
        input_tokens=len(out.prompt_token_ids) - cached,
        output_tokens=output_tokens,
        cache_read_input_tokens=cached,
    )


class _Blocks:
    """A streamed answer as Anthropic's content-block events, one block open at a time."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # "thinking" | "text" | "tool_use"

    def _start(self, kind: str, block: dict[str, Any]) -> list[dict[str, Any]]:
        evs = self.close()
        self.index += 1
        self.open = kind
        return [*evs, {"type": "content_block_start", "index": self.index, "content_block": block}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def thinking(self, text: str) -> list[dict[str, Any]]:
        evs = (
            []
            if self.open == "thinking"
            else self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
        )
        return [*evs, self._delta({"type": "thinking_delta", "thinking": text})]

    def text(self, text: str) -> list[dict[str, Any]]:
        evs = [] if self.open == "text" else self._start("text", {"type": "text", "text": ""})
        return [*evs, self._delta({"type": "text_delta", "text": text})]

    def tool_use(self, name: str, arguments: str) -> list[dict[str, Any]]:
        evs = self._start("tool_use", {"type": "tool_use", "id": new_id("toolu"), "name": name, "input": {}})
        return evs + self.tool_input(arguments)

    def tool_input(self, partial_json: str) -> list[dict[str, Any]]:
        return (
            [self._delta({"type": "input_json_delta", "partial_json": partial_json})] if partial_json else []
        )

    def close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.index}]


# --------------------------------------------------------------------------- routes


def build_messages_handlers(service: LoraStarService, guards: list[Any]) -> list[Any]:
    """``POST /messages`` and ``POST /messages/count_tokens``, answering errors in Anthropic's shape."""
    retry_after = service.config.retry_after_seconds
    handle = make_exception_handler(retry_after, anthropic_response)

    def handler(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
        # a full queue is Anthropic's 529 (the OpenAI routes' 503, Retry-After kept); a restart,
        # shutdown or dead engine stays 503 (unavailable, not overloaded)
        if isinstance(exc, EngineOverloadedError):
            error = to_api_error(exc, retry_after=retry_after)
            return anthropic_response(APIError(error.message, 529, headers=error.headers))
        return handle(request, exc)  # type: ignore[no-any-return]

    errors = {
        s: ResponseSpec(data_container=AnthropicErrorResponse, description=_ERROR_TYPES[s])
        for s in (400, *((401,) if guards else ()), 404, 413, 503)
    }
    handlers = handler_map(handler)  # route-level: they beat the router's OpenAI-shaped ones

    @post(
        "/messages",
        status_code=HTTP_200_OK,
        guards=guards,
        summary="Anthropic messages",
        responses={
            200: ResponseSpec(
                MessagesResponse, description="The whole message; with `stream: true`, Anthropic's events"
            ),
            STREAM_CHUNK: ResponseSpec(MessagesStreamEvent, description="stream event"),
            **errors,
            529: ResponseSpec(data_container=AnthropicErrorResponse, description=_ERROR_TYPES[529]),
        },
        operation_class=TypedEventsOperation,
        exception_handlers=handlers,
    )
    async def create_message(
        data: MessagesRequest, request: Request[Any, Any, Any]
    ) -> Response[Any] | Stream:
        try:
            plan = await plan_chat(service, chat_request(data), soft_thinking_budget=True)
        except APIError as exc:
            raise _renamed(exc) from exc
        message_id = new_id("msg")
        model = data.model or service.served_model_name
        # Anthropic's disable_parallel_tool_use: at most one tool_use (the chat route's
        # parallel_tool_calls false: the answer's first call only, as vLLM's)
        one_call = bool((data.tool_choice or {}).get("disable_parallel_tool_use"))
        stream = service.generate(plan.prompt_ids, plan.params, plan.adapter, message_id)

        if data.stream:
            # a client gone before the first output (queued, prefilling) aborts the request
            primed = await run_until_disconnect(
                prime_or_404(merge_streams([stream]), data.model), request.receive
            )

            async def events() -> AsyncIterator[Any]:
                blocks = _Blocks()
                parts = plan.parts()
                started = False
                used_tools = False
                n_calls = 0  # the parser's calls so far (disable_parallel_tool_use keeps the first)
                generated = 0
                last = None
                async for d in choice_deltas(primed):
                    o = d.choice
                    generated += len(o.token_ids)
                    if not started:  # the first output knows the prompt's cached tokens
                        started = True
                        head = MessagesResponse(
                            id=message_id, model=model, content=[], stop_reason=None, usage=usage_of(d.out, 0)
                        )
                        yield {"type": "message_start", "message": head}
                    if plan.forced:  # after any thinking, the named tool's input, streamed as it comes
                        reasoning, arguments, _ = parts.feed(d.text, final=o.finish_reason is not None)
                        for e in blocks.thinking(reasoning) if reasoning else []:
                            yield e
                        if arguments:  # none yet at the end (cut in the thinking): no call
                            for e in (
                                blocks.tool_input(arguments)
                                if used_tools
                                else blocks.tool_use(plan.forced, arguments)
                            ):
                                yield e
                            used_tools = True
                    else:
                        reasoning, content, calls = parts.feed(d.text, final=o.finish_reason is not None)
                        for e in (blocks.thinking(reasoning) if reasoning else []) + (
                            blocks.text(content) if content else []
                        ):
                            yield e
                        for call in calls:
                            n_calls += 1
                            if one_call and n_calls > 1:
                                continue
                            if tool_input(call.arguments) is None:
                                evs = blocks.text(call.arguments)
                            else:
                                evs, used_tools = blocks.tool_use(call.name, call.arguments), True
                            for e in evs:
                                yield e
                    if d.out.finished:
                        last = d
                assert last is not None
                for e in blocks.close():
                    yield e
                stop_reason, stop_sequence = stop_of(last.choice, used_tools)
                usage = usage_of(last.out, generated)
                yield {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                    "usage": {
                        "output_tokens": usage.output_tokens,
                        "input_tokens": usage.input_tokens,
                        "cache_read_input_tokens": usage.cache_read_input_tokens,
                    },
                }
                yield {"type": "message_stop"}

            return sse_event_response(events(), error_event, retry_after=service.config.retry_after_seconds)

        finals = await run_until_disconnect(collect(merge_streams([stream]), data.model), request.receive)
        out = finals[0]
        o = out.outputs[0]
        reasoning, content, calls = plan.read(o.text)
        blocks = content_blocks(reasoning, content, calls[:1] if one_call else calls)
        stop_reason, stop_sequence = stop_of(o, any(isinstance(b, ToolUseBlock) for b in blocks))
        message = MessagesResponse(
            id=message_id, model=model, content=blocks, stop_reason=stop_reason, stop_sequence=stop_sequence,
            usage=usage_of(out, len(o.token_ids)),
        )  # fmt: skip
        return Response(message, status_code=HTTP_200_OK)

    @post(
        "/messages/count_tokens",
        status_code=HTTP_200_OK,
        guards=guards,
        summary="Anthropic token count",
        responses=errors,
        exception_handlers=handlers,
    )
    async def count_tokens(data: CountTokensRequest) -> CountTokensResponse:
        engine = await service.ready()
        await service.resolve_adapter(data.model, data.adapter_id)  # an unknown model is a 404
        chat_tool_choice(data.tool_choice)  # checked as /messages checks it
        tools = chat_tools(data.tools)
        messages = chat_messages(data)
        prefill = prefilled(messages)
        _, ids = await render_messages(
            engine, messages, not prefill, continue_final_message=prefill,
            chat_template_kwargs=template_kwargs(data), tools=tools,
        )  # fmt: skip
        return CountTokensResponse(input_tokens=len(ids))

    return [create_message, count_tokens]
