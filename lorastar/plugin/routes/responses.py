"""``/responses``: OpenAI's Responses API over the chat route's pipeline (vLLM serves it too).

A request becomes a chat request (``instructions`` a system message first, then the stored
conversation of ``previous_response_id``, then ``input``'s messages, function calls and their
outputs), goes through ``plan_chat`` (template, tools, structured output, sampling), and its answer
is read the same way (reasoning parser, tool-call parser). What differs is the answer's shape:
``output`` items (``reasoning``, ``message``, ``function_call``) and, streamed, OpenAI's typed
events (``response.created`` ... ``response.completed``), each with its ``sequence_number``.

Served: text input and output, function tools with every ``tool_choice``, ``text.format``
(json_object, json_schema), logprobs, reasoning items, ``previous_response_id`` (with
``LoraStarConfig.responses_store_size`` > 0). Refused with a 400 naming the field: built-in tools
(web search, file search, ...), images and files, ``background``, ``conversation``, stored
``prompt`` templates, ``truncation: "auto"``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any, Literal

from litestar import Request, Response, delete, get
from litestar.response import Stream
from litestar.status_codes import HTTP_200_OK
from msgspec import UNSET

from lorastar.engine.outputs import CompletionOutput, RequestOutput
from lorastar.plugin.errors import APIError, error_responses
from lorastar.plugin.reasoning import THINK_END
from lorastar.plugin.responses_schemas import (
    ResponseDeleted,
    ResponseFunctionToolCall,
    ResponseInputTokensDetails,
    ResponseOutputItem,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseOutputTokensDetails,
    ResponseReasoningItem,
    ResponseReasoningText,
    ResponsesRequest,
    ResponsesResponse,
    ResponseStreamEvent,
    ResponseUsage,
)
from lorastar.plugin.routes.chat import (
    ChatPlan,
    chat_logprobs,
    chat_request_of,
    plan_chat,
    reasoning_token_ids,
)
from lorastar.plugin.routes.common import (
    choice_deltas,
    collect,
    generation_route,
    prime_or_404,
)
from lorastar.plugin.schemas import ChatCompletionRequest, ChatLogprobToken, ChatMessageParam
from lorastar.plugin.service import LoraStarService, merge_streams, run_until_disconnect
from lorastar.plugin.sse import sse_event_response
from lorastar.plugin.tool_parsers import ParsedToolCall

LOGPROBS_INCLUDE = "message.output_text.logprobs"
MAX_METADATA = 16  # OpenAI's bounds on metadata: pairs, key and value lengths
MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 512
# The chat fields an error may name, as this route's client sent them.
_RENAMED = (
    ("'max_tokens' or 'max_completion_tokens'", "'max_output_tokens'"),
    ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"),
    ("response_format", "text.format"),
    ("messages", "input"),
)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesStore:
    """Finished responses and the conversation each ends (its input messages and its answer as
    one assistant turn), least recently used dropped past ``size``."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[str, tuple[ResponsesResponse, list[ChatMessageParam]]] = OrderedDict()

    def put(self, response: ResponsesResponse, conversation: list[ChatMessageParam]) -> None:
        if self.size <= 0:
            return
        self._items[response.id] = (response, conversation)
        self._items.move_to_end(response.id)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> tuple[ResponsesResponse, list[ChatMessageParam]] | None:
        entry = self._items.get(response_id)
        if entry is not None:
            self._items.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None

    def not_found(self, response_id: str, param: str | None = None) -> APIError:
        why = "" if self.size > 0 else (
            ": this server keeps no responses (LoraStarConfig.responses_store_size, "
            "lorastar serve --responses-store-size)"
        )  # fmt: skip
        return APIError(f"Response with id '{response_id}' not found{why}.", 404, param=param)


# --------------------------------------------------------------------------- request -> chat


def _text_of(content: Any, where: str, kinds: tuple[str, ...]) -> str:
    """A content field's text: a string, or a list of text parts of ``kinds``."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"{where} must be a string or a list of content parts.", param="input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise APIError(
                f"{where}[{j}]: only text parts ({', '.join(kinds)}) are supported, got {kind!r}.",
                param="input",
            )
        texts.append(part["text"])
    return "\n".join(texts)


def _field(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(f"{where} needs {key!r} (a string).", param="input")
    return value


def input_messages(items: str | list[dict[str, Any]]) -> list[ChatMessageParam]:
    """``input`` as chat messages: a string is one user message; items are messages, function calls
    (consecutive ones, and the assistant message right before them, make one assistant turn), their
    outputs (tool messages) and reasoning (the next assistant turn's ``reasoning_content``)."""
    if isinstance(items, str):
        return [ChatMessageParam(role="user", content=items)]
    if not items:
        raise APIError("input must not be empty.", param="input")
    out: list[ChatMessageParam] = []
    thinking: str | None = None
    merge = False  # the last message is an assistant turn that function calls join
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(f"{where} must be an object.", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(
                    f"{where}.role must be 'user', 'system', 'developer' or 'assistant', got {role!r}.",
                    param="input",
                )
            kinds = ("output_text", "refusal") if role == "assistant" else ("input_text",)
            text = _text_of(item.get("content"), f"{where}.content", (*kinds, "text"))
            if role == "assistant":
                out.append(ChatMessageParam(role="assistant", content=text, reasoning_content=thinking))
                thinking, merge = None, True
            else:
                out.append(ChatMessageParam(role=role, content=text))
                merge = False
        elif kind == "function_call":
            call_id, name = _field(item, "call_id", where), _field(item, "name", where)
            arguments = _field(item, "arguments", where)
            try:  # checked here: the template's own check would name the chat message's index
                json.loads(arguments or "{}")
            except ValueError as exc:
                raise APIError(f"{where}.arguments is not JSON: {exc}", param="input") from exc
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            if merge:
                last = out[-1]
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                out.append(
                    ChatMessageParam(
                        role="assistant", content=None, tool_calls=[call], reasoning_content=thinking
                    )
                )
                thinking, merge = None, True
        elif kind == "function_call_output":
            output = item.get("output")
            text = _text_of(output, f"{where}.output", ("input_text", "output_text", "text"))
            out.append(
                ChatMessageParam(role="tool", content=text, tool_call_id=_field(item, "call_id", where))
            )
            merge = False
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            kinds = ("reasoning_text", "summary_text")
            thinking = (thinking or "") + _text_of(parts, f"{where}.content", kinds)
        else:
            raise APIError(
                f"{where}: items of type {kind!r} are not supported (message, function_call, "
                "function_call_output, reasoning).",
                param="input",
            )
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Function tools in the chat API's shape; built-in tools are a 400."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise APIError(
                f"tools[{i}]: tools of type {kind!r} are not supported: lorastar serves function tools.",
                param="tools",
            )
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(f"tools[{i}] needs a name.", param="tools")
        fn = {"name": name, "parameters": tool.get("parameters")}
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(
        "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}.",
        param="tool_choice",
    )


def chat_response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise APIError("text.format must be an object.", param="text")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise APIError("text.format: json_schema needs a 'schema' object.", param="text")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", ""), "schema": fmt["schema"]}}
    raise APIError(
        f"text.format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}.", param="text"
    )


def _refuse_unserved(req: ResponsesRequest) -> None:
    if req.background:
        raise APIError(
            "background is not supported: responses run while the request is open.", param="background"
        )
    if req.conversation is not None:
        raise APIError(
            "conversation is not supported: send previous_response_id or the whole input.",
            param="conversation",
        )
    if req.prompt is not None:
        raise APIError("prompt (a stored prompt template) is not supported: send input.", param="prompt")
    if req.truncation == "auto":
        raise APIError(
            "truncation 'auto' is not supported: the input must fit the model's context.", param="truncation"
        )
    meta = req.metadata or {}
    if len(meta) > MAX_METADATA or any(
        len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE for k, v in meta.items()
    ):
        raise APIError(
            f"metadata takes at most {MAX_METADATA} pairs, keys up to {MAX_METADATA_KEY} characters "
            f"and values up to {MAX_METADATA_VALUE}.",
            param="metadata",
        )


def _renamed(exc: APIError) -> APIError:
    """A chat-field error as this route's fields name it."""
    message, param = exc.message, exc.param
    for old, new in _RENAMED:
        message = message.replace(old, new)
        if param == old:
            param = new.split(".")[0]  # the top-level field, as the other 400s name it
    return APIError(message, exc.status_code, param=param, headers=exc.headers)


def error_event(error: APIError, last: dict[str, Any] | None) -> dict[str, Any]:
    """OpenAI's ``error`` event, numbered after the last event sent."""
    seq = last["sequence_number"] + 1 if last is not None else 0
    return {
        "type": "error",
        "code": error.type,
        "message": error.message,
        "param": error.param,
        "sequence_number": seq,
    }


def wants_logprobs(req: ResponsesRequest) -> bool:
    return req.top_logprobs is not None or LOGPROBS_INCLUDE in (req.include or [])


def chat_request(req: ResponsesRequest, conversation: list[ChatMessageParam]) -> ChatCompletionRequest:
    system = [ChatMessageParam(role="system", content=req.instructions)] if req.instructions else []
    want_lp = wants_logprobs(req)
    return chat_request_of(
        req,
        messages=system + conversation,
        max_tokens=req.max_output_tokens,
        stop=req.stop,
        chat_template_kwargs=req.chat_template_kwargs,
        logprobs=want_lp,
        top_logprobs=(req.top_logprobs or 0) if want_lp else None,
        tools=chat_tools(req.tools),
        tool_choice=chat_tool_choice(req.tool_choice),
        response_format=chat_response_format(req.text),
    )


# --------------------------------------------------------------------------- answer -> output


def reasoning_tokens(plan: ChatPlan, ids: list[int], text: str, reasoning: str | None) -> int:
    """Tokens of the answer (``ids``, ``text``) up to and including the one closing its reasoning
    (all of them when the block never closed); 0 without reasoning. Where the closing tag is not
    one token, the text up to it is tokenized again (exact but for merges across the tag)."""
    if not reasoning or plan.reasoning_style is None:
        return 0
    tokenizer = plan.engine.tokenizer
    tags = reasoning_token_ids(tokenizer, plan.reasoning_style)
    if tags is not None:
        return ids.index(tags[1]) + 1 if tags[1] in ids else len(ids)
    end = text.find(THINK_END)
    if end < 0:
        return len(ids)
    return min(len(ids), len(tokenizer.encode(text[: end + len(THINK_END)], add_special_tokens=False)))


def output_items(
    out: CompletionOutput,
    reasoning: str | None,
    content: str | None,
    calls: list[ParsedToolCall],
    logprobs: list[ChatLogprobToken] | None,
) -> list[ResponseOutputItem]:
    """The answer as output items, in the order it wrote them: its reasoning, its text (also when
    empty, unless it made calls), its calls. The last item has the answer's status (a cut answer
    was cut there); the ones before it were written whole."""
    items: list[ResponseOutputItem] = []
    if reasoning:
        items.append(ResponseReasoningItem(id=new_id("rs"), content=[ResponseReasoningText(text=reasoning)]))
    if content or not calls:
        text = ResponseOutputText(text=content or "", logprobs=UNSET if logprobs is None else logprobs)
        items.append(ResponseOutputMessage(id=new_id("msg"), content=[text]))
    items += [
        ResponseFunctionToolCall(id=new_id("fc"), call_id=c.id, name=c.name, arguments=c.arguments)
        for c in calls
    ]
    items[-1].status = _status(out)
    return items


def _json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _status(out: CompletionOutput) -> Literal["completed", "incomplete"]:
    return "incomplete" if out.finish_reason == "length" else "completed"


class _Events:
    """A streamed answer as OpenAI's events, numbered in order; keeps the output items it wrote
    (the final response's ``output``). One item is open at a time: reasoning, then the message's
    text, then each call."""

    def __init__(self, want_lp: bool) -> None:
        self.seq = 0
        self.items: list[ResponseOutputItem] = []
        self.want_lp = want_lp
        self._open: str | None = None  # "reasoning" | "message" | "call"
        self._id = ""
        self._text = ""
        self._lp: list[ChatLogprobToken] = []  # all of the message's logprobs
        self._lp_sent = 0
        self._call: ParsedToolCall | None = None

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def _start(self, kind: str, item: Any, part: Any = None) -> list[dict[str, Any]]:
        self._open, self._id, self._text = kind, item.id, ""
        evs = [self.event("response.output_item.added", output_index=len(self.items), item=item)]
        if part is not None:
            evs.append(self.event(
                "response.content_part.added", item_id=self._id, output_index=len(self.items), content_index=0,
                part=part,
            ))  # fmt: skip
        return evs

    def reasoning(self, text: str) -> list[dict[str, Any]]:
        evs = [] if self._open == "reasoning" else self.close("completed")
        if self._open is None:
            item = ResponseReasoningItem(id=new_id("rs"), content=[], status="in_progress")
            evs += self._start("reasoning", item, ResponseReasoningText(text=""))
        self._text += text
        evs.append(self.event(
            "response.reasoning_text.delta", item_id=self._id, output_index=len(self.items), content_index=0,
            delta=text,
        ))  # fmt: skip
        return evs

    @property
    def has_message(self) -> bool:
        return self._open == "message" or any(isinstance(i, ResponseOutputMessage) for i in self.items)

    def logprobs(self, lps: list[ChatLogprobToken]) -> None:
        self._lp += lps

    def _new_logprobs(self) -> list[ChatLogprobToken]:
        new = self._lp[self._lp_sent :]
        self._lp_sent = len(self._lp)
        return new if self.want_lp else []

    def content(self, text: str) -> list[dict[str, Any]]:
        evs = [] if self._open == "message" else self.close("completed")
        if self._open is None:
            item = ResponseOutputMessage(id=new_id("msg"), content=[], status="in_progress")
            part = ResponseOutputText(text="", logprobs=[] if self.want_lp else UNSET)
            evs += self._start("message", item, part)
        self._text += text
        evs.append(self.event(
            "response.output_text.delta", item_id=self._id, output_index=len(self.items), content_index=0,
            delta=text, logprobs=self._new_logprobs(),
        ))  # fmt: skip
        return evs

    def call(self, call: ParsedToolCall, arguments: str | None = None) -> list[dict[str, Any]]:
        """Open ``call``'s item and send ``arguments`` (a whole call: its own arguments)."""
        evs = self.close("completed")
        self._call = call
        item = ResponseFunctionToolCall(
            id=new_id("fc"), call_id=call.id, name=call.name, arguments="", status="in_progress"
        )
        evs += self._start("call", item)
        return evs + self.arguments(call.arguments if arguments is None else arguments)

    def arguments(self, delta: str) -> list[dict[str, Any]]:
        if not delta:
            return []
        self._text += delta
        return [self.event(
            "response.function_call_arguments.delta", item_id=self._id, output_index=len(self.items), delta=delta,
        )]  # fmt: skip

    def close(self, status: str) -> list[dict[str, Any]]:
        """Finish the open item (``status``: the answer's, for its text and calls)."""
        kind, index, evs = self._open, len(self.items), []
        if kind is None:
            return evs
        where = {"item_id": self._id, "output_index": index}
        item: ResponseOutputItem
        if kind == "reasoning":
            part = ResponseReasoningText(text=self._text)
            evs.append(self.event("response.reasoning_text.done", **where, content_index=0, text=self._text))
            evs.append(self.event("response.content_part.done", **where, content_index=0, part=part))
            item = ResponseReasoningItem(id=self._id, content=[part])
        elif kind == "message":
            lps = self._lp if self.want_lp else UNSET
            if self._lp_sent < len(self._lp) and self.want_lp:  # logprobs of tokens held back to the end
                evs.append(self.event(
                    "response.output_text.delta", **where, content_index=0, delta="", logprobs=self._new_logprobs()
                ))  # fmt: skip
            part = ResponseOutputText(text=self._text, logprobs=lps)
            evs.append(self.event(
                "response.output_text.done", **where, content_index=0, text=self._text,
                logprobs=self._lp if self.want_lp else [],
            ))  # fmt: skip
            evs.append(self.event("response.content_part.done", **where, content_index=0, part=part))
            item = ResponseOutputMessage(id=self._id, content=[part], status=status)  # type: ignore[arg-type]
        else:
            assert self._call is not None
            evs.append(self.event(
                "response.function_call_arguments.done", **where, name=self._call.name, arguments=self._text
            ))  # fmt: skip
            item = ResponseFunctionToolCall(
                id=self._id, call_id=self._call.id, name=self._call.name, arguments=self._text,
                status=status,  # type: ignore[arg-type]
            )  # fmt: skip
        evs.append(self.event("response.output_item.done", output_index=index, item=item))
        self.items.append(item)
        self._open = None
        return evs


# --------------------------------------------------------------------------- routes


def build_responses_handlers(service: LoraStarService, guards: list[Any]) -> list[Any]:
    """``POST /responses``, ``GET`` and ``DELETE /responses/{id}``, one store per plugin instance."""
    store = ResponsesStore(service.config.responses_store_size)

    def response_of(
        req: ResponsesRequest,
        params: Any,
        response_id: str,
        created: int,
        items: list[ResponseOutputItem],
        status: Any,
        usage: ResponseUsage | None,
        stored: bool,
    ) -> ResponsesResponse:
        return ResponsesResponse(
            id=response_id,
            created_at=created,
            model=req.model or service.served_model_name,
            output=items,
            status=status,
            usage=usage,
            incomplete_details={"reason": "max_output_tokens"} if status == "incomplete" else None,
            instructions=req.instructions,
            max_output_tokens=req.max_output_tokens,
            # the values used, as OpenAI and vLLM echo them (a default fills what the request left out)
            temperature=params.temperature,
            top_p=params.top_p,
            top_logprobs=req.top_logprobs,
            parallel_tool_calls=req.parallel_tool_calls is not False,
            tool_choice=req.tool_choice if req.tool_choice is not None else "auto",
            tools=req.tools or [],
            text=req.text if req.text and "format" in req.text else {"format": {"type": "text"}},
            reasoning=req.reasoning,
            previous_response_id=req.previous_response_id,
            metadata=req.metadata or {},
            store=stored,
            truncation=req.truncation or "disabled",
            user=req.user,
        )

    def usage_of(
        plan: ChatPlan, out: RequestOutput, ids: list[int], text: str, reasoning: str | None
    ) -> ResponseUsage:
        """Usage of the request ``out`` came from, its answer's token ``ids`` and ``text``."""
        prompt = len(out.prompt_token_ids)
        return ResponseUsage(
            input_tokens=prompt,
            input_tokens_details=ResponseInputTokensDetails(cached_tokens=int(out.num_cached_tokens or 0)),
            output_tokens=len(ids),
            output_tokens_details=ResponseOutputTokensDetails(
                reasoning_tokens=reasoning_tokens(plan, ids, text, reasoning)
            ),
            total_tokens=prompt + len(ids),
        )

    def answer_turn(
        reasoning: str | None, content: str | None, calls: list[ParsedToolCall]
    ) -> ChatMessageParam:
        """The answer as the assistant turn a later request's conversation holds. A call whose
        arguments are no JSON object (cut by max_output_tokens) stays text, its arguments as
        written (as /v1/messages keeps it): the chat template takes arguments parsed, so as a call it
        would make every continuation a 400 about input the client never sent."""
        tool_calls, texts = [], [content] if content else []
        for c in calls:
            if _json_object(c.arguments):
                fn = {"name": c.name, "arguments": c.arguments}
                tool_calls.append({"id": c.id, "type": "function", "function": fn})
            else:
                texts.append(c.arguments)
        return ChatMessageParam(
            role="assistant",
            content="\n".join(t for t in texts if t) or content,
            tool_calls=tool_calls or None,
            reasoning_content=reasoning or None,
        )

    @generation_route(
        "/responses", "OpenAI responses", ResponsesResponse, ResponseStreamEvent, guards, typed_events=True
    )
    async def create_response(
        data: ResponsesRequest, request: Request[Any, Any, Any]
    ) -> Response[Any] | Stream:
        _refuse_unserved(data)
        conversation: list[ChatMessageParam] = []
        if data.previous_response_id is not None:
            entry = store.get(data.previous_response_id)
            if entry is None:
                raise store.not_found(data.previous_response_id, "previous_response_id")
            conversation = list(entry[1])
        conversation += input_messages(data.input)
        try:
            plan = await plan_chat(service, chat_request(data, conversation))
        except APIError as exc:
            raise _renamed(exc) from exc
        stored = bool(data.store) and store.size > 0
        one_call = data.parallel_tool_calls is False  # as chat's (vLLM's): only the first call is returned
        want_lp, num_top = wants_logprobs(data), data.top_logprobs or 0
        tokenizer = plan.engine.tokenizer
        response_id, created = new_id("resp"), int(time.time())
        stream = service.generate(plan.prompt_ids, plan.params, plan.adapter, response_id, data.priority)

        if data.stream:
            # a client gone before the first output (queued, prefilling) aborts the request
            primed = await run_until_disconnect(
                prime_or_404(merge_streams([stream]), data.model), request.receive
            )

            async def events() -> AsyncIterator[Any]:
                ev = _Events(want_lp)
                started = response_of(
                    data, plan.params, response_id, created, [], "in_progress", None, stored
                )
                yield ev.event("response.created", response=started)
                yield ev.event("response.in_progress", response=started)
                parts = plan.parts()
                reasoning_text, content_text = "", ""
                calls: list[ParsedToolCall] = []
                ids: list[int] = []
                raw = ""  # the answer as generated
                last = None
                async for d in choice_deltas(primed):
                    o, final = d.choice, d.choice.finish_reason is not None
                    ids += o.token_ids
                    raw += d.text
                    if want_lp:
                        ev.logprobs(chat_logprobs(tokenizer, o, 0, num_top).content)
                    if plan.forced:  # after any thinking, the named function's arguments, as they come
                        r, arguments, _ = parts.feed(d.text, final=final)
                        reasoning_text += r
                        for e in ev.reasoning(r) if r else []:
                            yield e
                        if calls:
                            for e in ev.arguments(arguments):
                                yield e
                        elif arguments or final:
                            calls.append(ParsedToolCall(plan.forced, "", plan.forced_ids[0]))
                            for e in ev.call(calls[0], arguments):
                                yield e
                        content_text += arguments
                    else:
                        r, c, new_calls = parts.feed(d.text, final=final)
                        reasoning_text, content_text = reasoning_text + r, content_text + c
                        for e in (ev.reasoning(r) if r else []) + (ev.content(c) if c else []):
                            yield e
                        for call in new_calls[: 1 - len(calls)] if one_call else new_calls:
                            calls.append(call)
                            for e in ev.call(call):
                                yield e
                    if d.out.finished:
                        last = d
                assert last is not None
                status = _status(last.choice)
                if not calls and not ev.has_message:  # an answer without text or calls: an empty message
                    for e in ev.content(""):
                        yield e
                for e in ev.close(status):
                    yield e
                usage = usage_of(plan, last.out, ids, raw, reasoning_text)
                done = response_of(data, plan.params, response_id, created, ev.items, status, usage, stored)
                if stored:
                    content = None if plan.forced else content_text or None
                    if plan.forced:  # the call's arguments are the answer's
                        calls = [ParsedToolCall(plan.forced, content_text, plan.forced_ids[0])]
                    store.put(done, [*conversation, answer_turn(reasoning_text, content, calls)])
                yield ev.event(
                    "response.incomplete" if status == "incomplete" else "response.completed", response=done
                )

            return sse_event_response(events(), error_event, retry_after=service.config.retry_after_seconds)

        finals = await run_until_disconnect(collect(merge_streams([stream]), data.model), request.receive)
        out = finals[0]
        o = out.outputs[0]
        reasoning, content, calls = plan.read(o.text)
        calls = calls[:1] if one_call else calls
        lps = chat_logprobs(tokenizer, o, 0, num_top).content if want_lp else None
        items = output_items(o, reasoning, content, calls, lps)
        usage = usage_of(plan, out, list(o.token_ids), o.text, reasoning)
        response = response_of(data, plan.params, response_id, created, items, _status(o), usage, stored)
        if stored:
            store.put(response, [*conversation, answer_turn(reasoning, content, calls)])
        return Response(response, status_code=HTTP_200_OK)

    @get(
        "/responses/{response_id:str}",
        guards=guards,
        sync_to_thread=False,
        summary="A stored response",
        responses=error_responses(*((401,) if guards else ()), 404),
    )
    def retrieve_response(response_id: str) -> ResponsesResponse:
        entry = store.get(response_id)
        if entry is None:
            raise store.not_found(response_id)
        return entry[0]

    @delete(
        "/responses/{response_id:str}",
        guards=guards,
        sync_to_thread=False,
        status_code=HTTP_200_OK,
        summary="Delete a stored response",
        responses=error_responses(*((401,) if guards else ()), 404),
    )
    def delete_response(response_id: str) -> ResponseDeleted:
        if not store.delete(response_id):
            raise store.not_found(response_id)
        return ResponseDeleted(id=response_id)

    return [create_response, retrieve_response, delete_response]
