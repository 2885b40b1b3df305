"""``/chat/completions`` (vLLM's OpenAI chat: chat template, n, logprobs, echo of a partial assistant turn)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from typing import Any

from litestar import Request, Response
from litestar.response import Stream
from litestar.status_codes import HTTP_200_OK
from msgspec import UNSET

from lorastar.engine.outputs import CompletionOutput
from lorastar.engine.sampling import SamplingParams
from lorastar.engine.structured import strip_unenforced
from lorastar.plugin.config import LoraStarConfig
from lorastar.plugin.engine_client import EngineClient
from lorastar.plugin.errors import APIError
from lorastar.plugin.reasoning import THINK_END, THINK_START, ReasoningSplitter
from lorastar.plugin.request_id import request_ids
from lorastar.plugin.routes.common import (
    MIN_LOGPROB,
    ChoiceDelta,
    capped_max_tokens,
    check_length,
    choice_deltas,
    choice_usage,
    clamp_logprob,
    collect,
    decoded,
    generation_route,
    in_thread,
    logprobs_tokenizer,
    make_usage,
    prime_or_404,
    prompt_logprobs_of,
    ranked,
    request_sampling_params,
    stream_usage,
    truncate_prompt,
    usage_of,
    usage_wanted,
)
from lorastar.plugin.schemas import (
    ChatChoiceLogprobs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamResponse,
    ChatContentPart,
    ChatLogprobToken,
    ChatMessage,
    ChatMessageParam,
    ChatStreamChoice,
    ChatTopLogprob,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from lorastar.plugin.service import LoraStarService, merge_streams, run_until_disconnect
from lorastar.plugin.sse import sse_response
from lorastar.plugin.tool_parsers import (
    REQUIRED,
    REQUIRED_MISTRAL,
    ParsedToolCall,
    ToolCallStream,
    call_id,
    parse_tool_calls,
)

# vLLM's text part types (a refusal's text is its ``refusal``)
_TEXT_PARTS = ("text", "input_text", "output_text", "refusal")


def _message_text(content: str | list[ChatContentPart] | None, index: int) -> str | list[dict[str, str]]:
    """A string as sent, or the text parts (the engine joins them with "\n" for a template that
    prints content, or hands them as parts to one that loops over them, as vLLM does)."""
    if content is None or isinstance(content, str):
        return content or ""
    parts: list[dict[str, str]] = []
    for part in content:
        if part.type not in _TEXT_PARTS:
            raise APIError(f"messages[{index}].content: only text parts are supported.", param="messages")
        text = part.refusal if part.type == "refusal" else part.text
        if text is not None:  # vLLM skips a text part without its text
            parts.append({"type": "text", "text": text})
    return parts


def _template_tool_calls(calls: list[dict[str, Any]], index: int) -> list[dict[str, Any]]:
    """An assistant turn's ``tool_calls`` as chat templates take them: each function's ``arguments``
    parsed from its JSON text (vLLM does the same; Qwen's and Hermes' templates write the object)."""
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(
                f"messages[{index}].tool_calls[{j}] needs a function with a name.", param="messages"
            )
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args or "{}")
            except ValueError as exc:
                raise APIError(
                    f"messages[{index}].tool_calls[{j}].function.arguments is not JSON: {exc}",
                    param="messages",
                ) from exc
        out.append({**call, "function": {**fn, "arguments": args}})
    return out


def _normalize_messages(messages: list[ChatMessageParam]) -> list[dict[str, Any]]:
    """The messages as the chat template takes them: ``{"role", "content"[, "name", "tool_calls",
    "tool_call_id", "reasoning_content"]}``, text only."""
    if not messages:
        raise APIError("messages must not be empty.", param="messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        msg: dict[str, Any] = {"role": m.role, "content": _message_text(m.content, i)}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = _template_tool_calls(m.tool_calls, i)
        if (thinking := m.reasoning_content if m.reasoning_content is not None else m.reasoning) is not None:
            msg["reasoning_content"] = thinking
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """How a request's ``tools`` and ``tool_choice`` shape its answer (vLLM's rules)."""

    parser: str | None = None  # reads calls out of the answer ("auto": the server's; "required")
    schema: dict[str, Any] | None = None  # the answer is decoded under it ("required", a named function)
    function: str | None = None  # a named function: the whole answer is its arguments


def check_tools(tools: list[Any] | None, tool_choice: Any, config: LoraStarConfig) -> ToolChoice:
    """What ``tool_choice`` asks of the answer; a 400 naming the field, with vLLM's messages, for
    what cannot be served. ``"required"`` and a named function decode under a JSON schema built
    from the tools' parameters (as vLLM does), so they need no tool-call parser."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise APIError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
        return ToolChoice()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise APIError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}.", param="tools")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(f"tools[{i}].function needs a name.", param="tools")
    # vLLM's default: "auto" with tools, "none" with an empty list (clients send ``tools: []``)
    choice = ("auto" if tools else "none") if tool_choice is None else tool_choice
    if choice == "none":
        return ToolChoice()
    if choice == "auto":
        if not (config.enable_auto_tool_choice and config.tool_call_parser):
            raise APIError(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                param="tool_choice",
            )
        return ToolChoice(parser=config.tool_call_parser)
    functions = [t["function"] for t in tools]
    if choice == "required":
        if not functions:  # no call can satisfy an empty schema: the answer would run to the limit
            raise APIError("tools must not be empty when tool_choice requires a tool call.", param="tools")
        # the calls' ids in the server's form (Mistral's templates take only their own)
        parser = REQUIRED_MISTRAL if config.tool_call_parser == "mistral" else REQUIRED
        return ToolChoice(parser=parser, schema=strip_unenforced(required_tools_schema(functions)))
    fn_choice = choice.get("function") if isinstance(choice, dict) else None
    name = fn_choice.get("name") if isinstance(fn_choice, dict) else None  # not a dict: the 400 below
    if not (
        isinstance(choice, dict) and choice.get("type", "function") == "function" and isinstance(name, str)
    ):
        raise APIError(
            "tool_choice must be 'none', 'auto', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}.",
            param="tool_choice",
        )
    if not functions:
        raise APIError(f"tools must not be empty when tool_choice names a tool ({name!r}).", param="tools")
    fn = next((f for f in functions if f["name"] == name), None)
    if fn is None:
        raise APIError(f"tool_choice names {name!r}, which is not in tools.", param="tool_choice")
    return ToolChoice(schema=strip_unenforced(_parameters(fn)), function=name)


def _parameters(fn: dict[str, Any]) -> dict[str, Any]:
    params = fn.get("parameters")
    if params is None:
        return {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise APIError(f"tools: {fn['name']}'s parameters must be a JSON schema object.", param="tools")
    return params


def required_tools_schema(functions: list[dict[str, Any]]) -> dict[str, Any]:
    """vLLM's schema for ``tool_choice: "required"``: a non-empty JSON list of
    ``{"name": one of the tools, "parameters": that tool's parameters}``. Each tool's ``$defs`` move
    to the top (its ``#/$defs/...`` references resolve from the root); two tools defining one name
    differently are a 400."""
    defs: dict[str, Any] = {}
    variants = []
    for fn in functions:
        params = dict(_parameters(fn))
        for key, value in (params.pop("$defs", None) or {}).items():
            if defs.setdefault(key, value) != value:
                raise APIError(f"tools: two tools define $defs {key!r} differently.", param="tools")
        variants.append({
            "properties": {"name": {"type": "string", "enum": [fn["name"]]}, "parameters": params},
            "required": ["name", "parameters"],
        })  # fmt: skip
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": variants}}
    if defs:
        schema["$defs"] = defs
    return schema


_EBNF_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def choice_grammar(choices: list[str]) -> str:
    """``guided_choice`` as an EBNF grammar (xgrammar's, as vLLM compiles a choice): the output is
    exactly one of ``choices``. Control characters and surrogates are written as escapes."""

    def char(ch: str) -> str:
        code = ord(ch)
        if ch in _EBNF_ESCAPES:
            return _EBNF_ESCAPES[ch]
        return f"\\u{code:04x}" if code < 0x20 or code == 0x7F or 0xD800 <= code < 0xE000 else ch

    return "root ::= " + " | ".join('"' + "".join(map(char, c)) + '"' for c in choices)


def tag_token_id(tokenizer: Any, tag: str) -> int | None:
    """``tag``'s token id where it is one token of this tokenizer, else None."""
    ids = tokenizer.encode(tag, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def reasoning_token_ids(tokenizer: Any, style: str) -> tuple[int | None, int] | None:
    """The reasoning block's (start, end) token ids for a structured output that follows it:
    ``qwen3`` gives both (the model opens the block itself), ``deepseek_r1`` only the end (the
    prompt is left inside it). None where a tag is not one token of this tokenizer: the
    constraint then applies from the first token."""
    end = tag_token_id(tokenizer, THINK_END)
    start = tag_token_id(tokenizer, THINK_START) if style == "qwen3" else None
    if end is None or (style == "qwen3" and start is None):
        return None
    return start, end


def prompt_reasoning_style(tokenizer: Any, style: str | None, prompt_ids: list[int]) -> str | None:
    """How the answer is read, given where the prompt leaves the thinking block (vLLM reads the
    prompt too, its parser's ``is_reasoning_end``): a prompt ending in ``</think>`` (a hybrid
    template with ``enable_thinking=False``) closed it, so the answer is all content (None); one
    ending in ``<think>`` (Qwen3-Thinking-2507's, Qwen3.5's) left it open, so the answer is
    reasoning from its first token (``deepseek_r1``). Only whitespace may follow the tag; tags of
    several tokens leave ``style`` as it is."""
    if style is None:
        return None
    start, end = tag_token_id(tokenizer, THINK_START), tag_token_id(tokenizer, THINK_END)
    if start is None or end is None:
        return style
    tags = {start: THINK_START, end: THINK_END}
    for i in range(len(prompt_ids) - 1, max(len(prompt_ids) - 9, -1), -1):
        if (tag := tags.get(prompt_ids[i])) is not None:
            if tokenizer.decode(prompt_ids[i + 1 :]).strip():
                return style
            return "deepseek_r1" if tag == THINK_START else None
    return style


class AnswerParts:
    """One choice's streamed text through the reasoning splitter and the tool-call parser (each
    where configured): (reasoning, content, calls) per delta. ``forced``: the content is a named
    function's arguments, from their first character that is not whitespace (a template writes
    some after a thinking block), as ``ChatPlan.read`` takes them."""

    def __init__(
        self,
        reasoning_style: str | None,
        tool_parser: str | None,
        tools: list[Any] | None,
        forced: bool = False,
    ) -> None:
        self.reasoning = ReasoningSplitter(reasoning_style) if reasoning_style else None
        self.tools = ToolCallStream(tool_parser, tools) if tool_parser else None
        self.forced = forced
        self.opened = False  # forced: the arguments have begun

    def feed(self, text: str, final: bool) -> tuple[str, str, list[ParsedToolCall]]:
        reasoning, content = self.reasoning.feed(text, final) if self.reasoning else ("", text)
        if self.forced:
            if not self.opened:
                content = content.lstrip()
                self.opened = bool(content)
            return reasoning, content, []
        calls: list[ParsedToolCall] = []
        if self.tools is not None:
            content, calls = self.tools.feed(content, final)
        return reasoning, content, calls


async def render_messages(
    engine: EngineClient,
    messages: list[ChatMessageParam],
    add_generation_prompt: bool,
    add_special_tokens: bool = False,
    *,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, str]] | None = None,
) -> tuple[list[dict[str, Any]], list[int]]:
    """The messages as the template takes them and their token ids, rendered on a worker thread.
    A template that rejects them ("roles must alternate") raises the engine's InvalidParamError
    naming ``messages`` (``InputProcessor.apply_chat_template``): the client's 400. (A request's
    own ``chat_template`` never gets here: the schemas refuse it, as vLLM does unless its operator
    trusts clients' templates.)"""
    normalized = _normalize_messages(messages)
    # documents only when sent: an engine client written before them takes no such argument
    extra: dict[str, Any] = {"documents": documents} if documents is not None else {}
    ids = await in_thread(
        partial(
            engine.apply_chat_template, normalized, add_generation_prompt, add_special_tokens,
            continue_final_message=continue_final_message, chat_template_kwargs=chat_template_kwargs,
            tools=tools, **extra,
        )
    )  # fmt: skip
    return normalized, list(ids)


def chat_logprobs(tokenizer: Any, out: CompletionOutput, start: int, num_top: int) -> ChatChoiceLogprobs:
    content: list[ChatLogprobToken] = []
    steps = out.logprobs or []
    for i, tid in enumerate(out.token_ids[start:], start=start):
        step = steps[i] if i < len(steps) else {}
        chosen = step.get(tid)
        tok = decoded(tokenizer, tid, chosen)
        top = [
            ChatTopLogprob(
                token=(s := decoded(tokenizer, t, p)),
                logprob=clamp_logprob(p.logprob),
                bytes=list(s.encode("utf-8", errors="replace")),
            )
            for t, p in ranked(step)[:num_top]
        ]
        content.append(
            ChatLogprobToken(
                token=tok,
                logprob=clamp_logprob(chosen.logprob) if chosen is not None else MIN_LOGPROB,
                bytes=list(tok.encode("utf-8", errors="replace")),
                top_logprobs=top,
            )
        )
    return ChatChoiceLogprobs(content=content)


# The request fields /responses and /messages hand to the chat pipeline as they are (chat_request_of).
PASSED_THROUGH = (
    "model", "adapter_id", "stream", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "seed", "cache_salt",
)  # fmt: skip


def chat_request_of(req: Any, **fields: Any) -> ChatCompletionRequest:
    """A chat request from another API's request ``req``: its ``PASSED_THROUGH`` fields as they
    are, ``fields`` (the ones that API names or shapes its own way) on top."""
    return ChatCompletionRequest(**{name: getattr(req, name) for name in PASSED_THROUGH}, **fields)


@dataclass
class ChatPlan:
    """A chat request made ready to generate: its prompt, its parameters and how its answer is read
    (shared by ``/chat/completions``, ``/responses`` and ``/messages``)."""

    engine: EngineClient
    adapter: str | None
    messages: list[dict[str, Any]]  # as the template took them
    prompt_ids: list[int]
    params: SamplingParams
    tool_parser: str | None  # reads calls out of the answer (the server's, or REQUIRED)
    forced: str | None  # a named function: the answer (after any thinking block) is its arguments
    forced_ids: list[str]  # that call's id, one per choice
    reasoning_style: str | None  # the server's reasoning parser
    tools: list[Any] | None  # the request's tools (typed arguments for parsers that read them)

    def read(self, text: str, index: int = 0) -> tuple[str | None, str | None, list[ParsedToolCall]]:
        """A whole answer's (reasoning, content, calls): the reasoning parser reads it, then a
        forced function takes the rest as its arguments (from their first character that is not
        whitespace) or the tool-call parser reads the rest."""
        reasoning, content = (
            ReasoningSplitter(self.reasoning_style).split(text) if self.reasoning_style else (None, text)
        )
        if self.forced:
            arguments = (content or "").lstrip()
            return reasoning, None, [ParsedToolCall(self.forced, arguments, self.forced_ids[index])]
        if self.tool_parser and content:
            content, calls = parse_tool_calls(content, self.tool_parser, self.tools)
            return reasoning, content, calls
        return reasoning, content, []

    def parts(self) -> AnswerParts:
        """The same reading for a streamed answer, delta by delta (a forced function's aside)."""
        return AnswerParts(self.reasoning_style, self.tool_parser, self.tools, forced=self.forced is not None)


async def plan_chat(
    service: LoraStarService, data: ChatCompletionRequest, *, soft_thinking_budget: bool = False
) -> ChatPlan:
    """Resolve the adapter, check the tools, render the template and build the sampling
    parameters (each a 400 naming the chat field at fault). ``soft_thinking_budget``: a
    ``thinking_token_budget`` the server cannot enforce (no reasoning parser, or tags of several
    tokens) is dropped instead of refused (Anthropic's ``budget_tokens``, which its clients send
    with every thinking request)."""
    engine = await service.ready()
    adapter = await service.resolve_adapter(data.model, data.adapter_id)
    tools = check_tools(data.tools, data.tool_choice, service.config)
    tool_parser, forced = tools.parser, tools.function
    if data.top_logprobs and not data.logprobs:  # vLLM's rule: 0 (clients' default) asks for nothing
        raise APIError("top_logprobs requires logprobs to be true.", param="top_logprobs")
    messages, prompt_ids = await render_messages(
        engine, data.messages, data.add_generation_prompt, data.add_special_tokens,
        continue_final_message=data.continue_final_message,
        chat_template_kwargs=data.chat_template_kwargs, tools=data.tools, documents=data.documents,
    )  # fmt: skip
    prompt_ids = truncate_prompt(prompt_ids, data.truncate_prompt_tokens, int(engine.max_model_len))
    requested = data.max_completion_tokens if data.max_completion_tokens is not None else data.max_tokens
    if requested is not None and requested < 1:
        field = "max_completion_tokens" if data.max_completion_tokens is not None else "max_tokens"
        raise APIError(f"{field} must be an integer >= 1, got {requested}.", param=field)
    max_tokens = check_length(int(engine.max_model_len), len(prompt_ids), requested, chat=True)
    defaults = service.default_sampling
    max_tokens = capped_max_tokens(max_tokens, defaults)
    num_top = data.top_logprobs or 0
    aliases = {"logprobs": "top_logprobs"}
    if data.max_completion_tokens is not None:
        aliases["max_tokens"] = "max_completion_tokens"
    params = await request_sampling_params(
        data, max_tokens=max_tokens, logprobs=num_top if data.logprobs else None,
        aliases=aliases, guided_json=tools.schema, defaults=defaults, max_logprobs=engine.max_logprobs,
        vocab_size=engine.vocab_size,
    )  # fmt: skip
    if tool_parser and tool_parser not in (REQUIRED, REQUIRED_MISTRAL):  # markers may be control tokens
        params.skip_special_tokens = False
    configured = service.config.reasoning_parser
    reasoning_style = prompt_reasoning_style(engine.tokenizer, configured, prompt_ids)
    budget = data.thinking_token_budget
    # the constraint follows the thinking; the budget counts it
    constrained = params.grammar_spec is not None or params.guided_choice is not None
    if reasoning_style and (constrained or budget is not None):
        tags = reasoning_token_ids(engine.tokenizer, reasoning_style)
        if tags is not None:
            params.reasoning_start_token_id, params.reasoning_end_token_id = tags
            if params.guided_choice is not None:  # vLLM's: a choice is a grammar, which waits for the block
                params.guided_grammar, params.guided_choice = choice_grammar(params.guided_choice), None
    if budget is not None and params.reasoning_end_token_id is not None:
        params.thinking_token_budget = budget
        params.thinking_budget_message_ids = service.thinking_message_ids
    elif budget is not None and not soft_thinking_budget and not (configured and reasoning_style is None):
        # (the prompt closed the block: no thinking to cap)
        why = "the server has no reasoning parser (--reasoning-parser)" if not configured else (
            f"the {configured} parser's </think> is several tokens for this tokenizer"
        )  # fmt: skip
        raise APIError(
            f"thinking_token_budget needs the thinking block's end tag as one token: {why}.",
            param="thinking_token_budget",
        )
    # A named function's call id, one per choice (Mistral's templates take only their own ids).
    forced_ids = [call_id(service.config.tool_call_parser) for _ in range(params.n)] if forced else []
    return ChatPlan(
        engine,
        adapter,
        messages,
        prompt_ids,
        params,
        tool_parser,
        forced,
        forced_ids,
        reasoning_style,
        data.tools,
    )


def build_chat_handler(service: LoraStarService, guards: list[Any]) -> Any:
    @generation_route(
        "/chat/completions",
        "OpenAI chat completions",
        ChatCompletionResponse,
        ChatCompletionStreamResponse,
        guards,
    )
    async def create_chat_completion(
        data: ChatCompletionRequest, request: Request[Any, Any, Any]
    ) -> Response[Any] | Stream:
        plan = await plan_chat(service, data)
        engine, messages, prompt_ids, params = plan.engine, plan.messages, plan.prompt_ids, plan.params
        tool_parser, forced, forced_ids = plan.tool_parser, plan.forced, plan.forced_ids
        reasoning_style = plan.reasoning_style
        num_top = params.logprobs or 0  # top_logprobs (with logprobs), -1 read as the vocabulary
        request_id, engine_id = request_ids("chatcmpl", request, data.request_id)
        created = int(time.time())
        model_name = data.model or service.served_model_name
        tokenizer = engine.tokenizer
        lp_names = logprobs_tokenizer(tokenizer, data, service.config.return_tokens_as_token_ids)
        # vLLM's get_chat_request_role: a request that leaves the answer open continues its last message
        role_name = (
            service.config.response_role
            if data.add_generation_prompt or not messages
            else str(messages[-1].get("role") or service.config.response_role)
        )
        want_ids = bool(data.return_token_ids)
        stream = service.generate(prompt_ids, params, plan.adapter, engine_id, data.priority)
        n = params.n
        # vLLM's: with the reasoning hidden, so are logprobs (their tokens would spell it out)
        want_lp = bool(data.logprobs) and (data.include_reasoning or not reasoning_style)
        out_ids = want_ids and (data.include_reasoning or not reasoning_style)  # the answer's ids: likewise
        one_call = data.parallel_tool_calls is False  # vLLM's: only the first call is returned
        echo_text = ""
        if data.echo and messages and messages[-1].get("role") == "assistant":
            echo_text = messages[-1]["content"] or ""
            if isinstance(echo_text, list):  # vLLM's echo of a parts message: its texts joined
                echo_text = "\n".join(p["text"] for p in echo_text)

        if data.stream:
            include_usage, continuous = usage_wanted(data, service.config.enable_force_include_usage)
            # a client gone before the first output (queued, prefilling) aborts the request
            primed = await run_until_disconnect(
                prime_or_404(merge_streams([stream]), data.model), request.receive
            )

            async def events() -> AsyncIterator[Any]:
                def chunk(
                    choice: ChatStreamChoice, d: ChoiceDelta | None = None, prompt: Any = UNSET
                ) -> ChatCompletionStreamResponse:
                    # continuous_usage_stats (vLLM): every chunk carries its choice's usage so far
                    usage: Any = UNSET
                    if continuous:
                        usage = choice_usage(d) if d is not None else make_usage(len(prompt_ids), 0, 0)
                    return ChatCompletionStreamResponse(
                        id=request_id, created=created, model=model_name, choices=[choice], usage=usage,
                        prompt_token_ids=prompt,
                    )  # fmt: skip

                # vLLM's first frame per choice: the role, empty content (return_token_ids: the
                # prompt's ids in the very first).
                held: dict[int, list[int]] = {}  # return_token_ids: ids of chunks held back, per choice
                for i in range(n):
                    role = ChatStreamChoice(index=i, delta=DeltaMessage(role=role_name, content=""))
                    yield chunk(role, prompt=list(prompt_ids) if want_ids and i == 0 else UNSET)
                for i in range(n if echo_text else 0):  # vLLM's: the echoes after every choice's role
                    yield chunk(ChatStreamChoice(index=i, delta=DeltaMessage(content=echo_text)))
                final: ChoiceDelta | None = None
                parts = (
                    {i: plan.parts() for i in range(n)} if reasoning_style or tool_parser or forced else {}
                )
                started: set[int] = set()
                async for d in choice_deltas(primed):
                    o = d.choice
                    lp = chat_logprobs(lp_names, o, 0, num_top) if want_lp else None
                    delta = DeltaMessage(content=d.text)
                    finish = o.finish_reason
                    if forced:  # after any thinking, the named function's arguments: they stream as they come
                        reasoning, arguments, _ = parts[o.index].feed(d.text, final=finish is not None)
                        if not data.include_reasoning:
                            reasoning = ""
                        first = o.index not in started
                        call: Any = UNSET
                        if arguments or (first and (finish is not None or d.out.finished)):
                            started.add(o.index)
                            call = [DeltaToolCall(
                                index=0, id=forced_ids[o.index] if first else UNSET,
                                type="function" if first else UNSET,
                                function=DeltaFunctionCall(name=forced if first else UNSET, arguments=arguments),
                            )]  # fmt: skip
                        elif not (reasoning or lp or finish or d.out.finished):
                            held.setdefault(o.index, []).extend(o.token_ids)
                            continue  # held back (a tag or the whitespace before the arguments)
                        delta = DeltaMessage(
                            reasoning_content=reasoning or UNSET,
                            reasoning=reasoning or UNSET,
                            tool_calls=call,
                        )
                    elif parts:
                        reasoning, content, calls = parts[o.index].feed(d.text, final=finish is not None)
                        calls = calls[:1] if one_call else calls
                        if not data.include_reasoning:
                            reasoning = ""
                        if not (reasoning or content or calls or lp or finish or d.out.finished):
                            held.setdefault(o.index, []).extend(o.token_ids)
                            continue  # all of it held back (a tag may be starting): nothing to send yet
                        delta = DeltaMessage(
                            content=content or UNSET,
                            reasoning_content=reasoning or UNSET,
                            reasoning=reasoning or UNSET,
                            tool_calls=[
                                DeltaToolCall(
                                    index=k, id=c.id, type="function",
                                    function=DeltaFunctionCall(name=c.name, arguments=c.arguments),
                                )
                                for k, c in enumerate(calls)
                            ] or UNSET,
                        )  # fmt: skip
                        if calls:
                            finish = "tool_calls"
                    # Parsed calls (which come whole, with the end) go out before the chunk that ends
                    # the choice, as OpenAI sends them: the openai SDK's stream helper reads a
                    # chunk's finish_reason before its tool calls, and never closed the last call.
                    split = bool(parts) and not forced and finish == "tool_calls"
                    yield chunk(
                        ChatStreamChoice(
                            index=o.index,
                            delta=delta,
                            logprobs=lp,
                            finish_reason=None if split else finish,
                            stop_reason=None if split else o.stop_reason,
                            token_ids=[*held.pop(o.index, []), *o.token_ids] if out_ids else UNSET,
                        ),
                        d,
                    )
                    if split:
                        end = ChatStreamChoice(index=o.index, delta=DeltaMessage(), finish_reason=finish,
                                               stop_reason=o.stop_reason, token_ids=[] if out_ids else UNSET)  # fmt: skip
                        yield chunk(end, d)
                    if d.out.finished:
                        final = d
                if include_usage:
                    yield ChatCompletionStreamResponse(
                        id=request_id,
                        created=created,
                        model=model_name,
                        choices=[],
                        usage=stream_usage([final] if final else []),
                    )

            return sse_response(events(), retry_after=service.config.retry_after_seconds)

        finals = await run_until_disconnect(collect(merge_streams([stream]), data.model), request.receive)
        out = finals[0]

        def choice(o: CompletionOutput) -> ChatCompletionResponseChoice:
            reasoning, content, calls = plan.read(o.text, o.index)
            calls = calls[:1] if one_call else calls
            if echo_text:
                content = echo_text + (content or "")
            return ChatCompletionResponseChoice(
                index=o.index,
                message=ChatMessage(
                    role=role_name,
                    content=content,
                    reasoning_content=reasoning if data.include_reasoning else None,
                    reasoning=reasoning if data.include_reasoning else None,
                    tool_calls=[ToolCall(id=c.id, function=FunctionCall(c.name, c.arguments)) for c in calls],
                ),
                logprobs=chat_logprobs(lp_names, o, 0, num_top) if want_lp else None,
                finish_reason="tool_calls" if calls and not forced else o.finish_reason,  # vLLM's
                stop_reason=o.stop_reason,
                token_ids=list(o.token_ids) if out_ids else UNSET,
            )

        choices = [choice(o) for o in out.outputs]
        return Response(
            ChatCompletionResponse(
                id=request_id,
                created=created,
                model=model_name,
                choices=choices,
                usage=usage_of(finals),
                prompt_logprobs=prompt_logprobs_of(out, data.prompt_logprobs),
                prompt_token_ids=list(out.prompt_token_ids) if want_ids else UNSET,
            ),
            status_code=HTTP_200_OK,
        )

    return create_chat_completion
