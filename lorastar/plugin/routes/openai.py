"""``/models``, ``/completions`` and ``/chat/completions`` (vLLM's OpenAI server shapes)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import anyio
from litestar import Request, Response, get, post
from litestar.openapi import ResponseSpec
from litestar.response import Stream
from litestar.status_codes import HTTP_200_OK
from msgspec import UNSET

from lorastar.engine.outputs import CompletionOutput, Logprob, RequestOutput
from lorastar.engine.sampling import SamplingParams
from lorastar.errors import AdapterNotFoundError, InvalidParamError
from lorastar.plugin.errors import APIError, error_responses
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
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    ModelPermission,
    PromptTokensDetails,
    UsageInfo,
)
from lorastar.plugin.service import LoraStarService, merge_streams, relative_to_root, run_until_disconnect
from lorastar.plugin.sse import STREAM_CHUNK, StreamingOperation, sse_response

_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "use_beam_search",
    "length_penalty",
)
_MIN_LOGPROB = -9999.0  # vLLM clamps -inf so the JSON stays valid
_OK_DOC = (
    "The whole answer as JSON; with `stream: true`, server-sent events: `data: {chunk}` frames "
    "(an error after the stream started is one `data: {error}` frame), then `data: [DONE]`"
)


# ----------------------------------------------------------------------------- helpers


def _random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _sampling_params(
    req: Any, *, max_tokens: int, logprobs: int | None, aliases: dict[str, str] | None = None
) -> SamplingParams:
    """The engine's parameters from a request body. ``aliases`` renames engine fields to the
    wire field the client sent (chat's ``top_logprobs`` is the engine's ``logprobs``)."""
    kw: dict[str, Any] = {
        "n": req.n,
        "max_tokens": max_tokens,
        "stop": req.stop,
        "seed": req.seed,
        "logprobs": logprobs,
    }
    for name in _SAMPLING_FIELDS:
        kw[name] = getattr(req, name)
    if req.logit_bias:
        try:  # OpenAI sends token ids as strings
            kw["logit_bias"] = {int(k): v for k, v in req.logit_bias.items()}
        except ValueError as exc:
            raise APIError(
                "logit_bias keys must be token ids (integers as strings).", param="logit_bias"
            ) from exc
    try:
        return SamplingParams.from_dict(kw)
    except InvalidParamError as exc:
        message, param = str(exc), exc.param
        wire = (aliases or {}).get(param or "")
        if param and wire:  # name the field the client sent, in the message too
            message, param = message.replace(param, wire, 1), wire
        raise APIError(message, param=param) from exc


def _lp(value: float) -> float:
    return max(float(value), _MIN_LOGPROB)


def _decoded(tokenizer: Any, token_id: int, lp: Logprob | None) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([token_id])


def _ranked(step: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    return sorted(step.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0, -kv[1].logprob))


def _usage(prompt_tokens: int, completion_tokens: int, cached: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def _parse_prompts(prompt: Any, vocab_size: int | None) -> list[str | list[int]]:
    """OpenAI's four prompt forms: str, list[str], list[int], list[list[int]]."""

    def is_tok(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    def check_ids(ids: list[Any]) -> list[int]:
        if not ids:
            raise APIError("prompt must not be empty.", param="prompt")
        for t in ids:
            if not is_tok(t) or t < 0 or (vocab_size is not None and t >= vocab_size):
                raise APIError(f"prompt contains an invalid token id: {t!r}.", param="prompt")
        return list(ids)

    if isinstance(prompt, str):
        prompts: list[str | list[int]] = [prompt]
    elif isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            prompts = list(prompt)
        elif all(is_tok(p) for p in prompt):
            prompts = [check_ids(prompt)]
        elif all(isinstance(p, list) for p in prompt):
            prompts = [check_ids(p) for p in prompt]
        else:
            raise APIError(
                "prompt must be a string, a list of strings, a list of token ids or a list of "
                "lists of token ids.",
                param="prompt",
            )
    else:
        raise APIError("prompt must not be empty.", param="prompt")
    for p in prompts:
        if isinstance(p, str) and not p:
            raise APIError("prompt must not be empty.", param="prompt")
    return prompts


def _message_text(content: str | list[ChatContentPart] | None, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts: list[str] = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise APIError(f"messages[{index}].content: only text parts are supported.", param="messages")
        parts.append(part.text)
    return "\n".join(parts)


def _normalize_messages(messages: list[ChatMessageParam]) -> list[dict[str, Any]]:
    """The messages as the chat template takes them: ``{"role", "content"[, "name"]}``, text only."""
    if not messages:
        raise APIError("messages must not be empty.", param="messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        msg: dict[str, Any] = {"role": m.role, "content": _message_text(m.content, i)}
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


def _check_length(max_model_len: int, prompt_len: int, max_tokens: int | None, *, chat: bool) -> int:
    """vLLM's context-length checks; returns the max_tokens to use (None: all that fits)."""
    param = "messages" if chat else "prompt"
    if prompt_len >= max_model_len:
        raise APIError(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{prompt_len} input tokens. Please reduce the length of the input {param}.",
            param=param,
        )
    room = max_model_len - prompt_len
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise APIError(
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum context "
            f"length is {max_model_len} tokens and your request has {prompt_len} input tokens "
            f"({max_tokens} > {max_model_len} - {prompt_len}).",
            param="max_tokens",
        )
    return max_tokens


async def _prime(stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """Pull the first item now, so errors raised on submission (bad prompt, unknown adapter,
    overload) become a proper HTTP status instead of an in-band error inside a 200 stream."""
    try:
        first = await stream.__anext__()
    except StopAsyncIteration:
        first = None
    except BaseException:
        await stream.aclose()  # type: ignore[attr-defined]
        raise

    async def chained() -> AsyncIterator[Any]:
        async with aclosing(stream) as s:  # type: ignore[type-var]
            if first is not None:
                yield first
            async for item in s:
                yield item

    return chained()


def _map_adapter_error(exc: AdapterNotFoundError, model: str | None) -> APIError:
    return APIError(f"The model `{model}` does not exist.", 404, param="model")


# ----------------------------------------------------------------------------- builders


def _completion_logprobs(
    tokenizer: Any,
    out: CompletionOutput,
    start: int,
    text_offset0: int,
    num_top: int,
    prompt_ids: list[int] | None = None,
) -> CompletionLogProbs:
    """vLLM's legacy completions ``logprobs`` for tokens ``start:`` (plus prompt tokens when echoing)."""
    lp = CompletionLogProbs()
    offset = text_offset0
    if prompt_ids:
        for tid in prompt_ids:
            tok = tokenizer.decode([tid])
            lp.tokens.append(tok)
            lp.token_logprobs.append(None)
            lp.top_logprobs.append(None)
            lp.text_offset.append(offset)
            offset += len(tok)
    steps = out.logprobs or []
    for i, tid in enumerate(out.token_ids[start:], start=start):
        step = steps[i] if i < len(steps) else {}
        chosen = step.get(tid)
        tok = _decoded(tokenizer, tid, chosen)
        lp.tokens.append(tok)
        lp.token_logprobs.append(_lp(chosen.logprob) if chosen is not None else None)
        top: dict[str, float] = {}
        for t, p in _ranked(step)[: max(num_top, 0)]:
            top[_decoded(tokenizer, t, p)] = _lp(p.logprob)
        if chosen is not None:
            top.setdefault(tok, _lp(chosen.logprob))
        lp.top_logprobs.append(top)
        lp.text_offset.append(offset)
        offset += len(tok)
    return lp


def _chat_logprobs(tokenizer: Any, out: CompletionOutput, start: int, num_top: int) -> ChatChoiceLogprobs:
    content: list[ChatLogprobToken] = []
    steps = out.logprobs or []
    for i, tid in enumerate(out.token_ids[start:], start=start):
        step = steps[i] if i < len(steps) else {}
        chosen = step.get(tid)
        tok = _decoded(tokenizer, tid, chosen)
        top = [
            ChatTopLogprob(
                token=(s := _decoded(tokenizer, t, p)),
                logprob=_lp(p.logprob),
                bytes=list(s.encode("utf-8", errors="replace")),
            )
            for t, p in _ranked(step)[:num_top]
        ]
        content.append(
            ChatLogprobToken(
                token=tok,
                logprob=_lp(chosen.logprob) if chosen is not None else _MIN_LOGPROB,
                bytes=list(tok.encode("utf-8", errors="replace")),
                top_logprobs=top,
            )
        )
    return ChatChoiceLogprobs(content=content)


# ----------------------------------------------------------------------------- handlers


def build_openai_handlers(service: LoraStarService, guards: list[Any] | None = None) -> list[Any]:
    """Route handlers bound to ``service`` (closures: one set per plugin instance)."""
    guards = guards or []

    async def model_cards() -> list[ModelCard]:
        engine = await service.ready()
        base = service.served_model_name
        now = int(time.time())
        model_path = service.config.model or service.config.engine.model
        root = Path(model_path).name if model_path else base  # never a server path
        cards = [
            ModelCard(
                id=base,
                created=service.created,
                root=root,
                parent=None,
                max_model_len=int(engine.max_model_len),
                permission=[ModelPermission(id=_random_id("modelperm"), created=now)],
            )
        ]
        for a in engine.list_adapters():
            cards.append(
                ModelCard(
                    id=a.name,
                    created=service.adapter_created.get(a.name, service.created),
                    root=relative_to_root(service.adapter_root, a.path),
                    parent=base,
                    permission=[ModelPermission(id=_random_id("modelperm"), created=now)],
                )
            )
        return cards

    auth = (401,) if guards else ()

    @get(
        "/models",
        guards=guards,
        summary="List the base model and its adapters",
        responses=error_responses(*auth, 503),
    )
    async def list_models() -> ModelList:
        return ModelList(data=await model_cards())

    @get(
        "/models/{model_id:str}",
        guards=guards,
        summary="One model (OpenAI's retrieve)",
        responses=error_responses(*auth, 404, 503),
    )
    async def retrieve_model(model_id: str) -> ModelCard:
        for card in await model_cards():
            if card.id == model_id:
                return card
        raise APIError(f"The model `{model_id}` does not exist.", 404, param="model")

    # ------------------------------------------------------------------ completions

    @post(
        "/completions",
        status_code=HTTP_200_OK,
        guards=guards,
        summary="OpenAI completions",
        responses={
            200: ResponseSpec(CompletionResponse, description=_OK_DOC),
            STREAM_CHUNK: ResponseSpec(CompletionStreamResponse, description="stream chunk"),
            **error_responses(400, *auth, 404, 413, 503),
        },
        operation_class=StreamingOperation,
    )
    async def create_completion(
        data: CompletionRequest, request: Request[Any, Any, Any]
    ) -> Response[Any] | Stream:
        engine = await service.ready()
        adapter = await service.resolve_model(data.model)
        if data.suffix:
            raise APIError("suffix is not supported.", param="suffix")
        if data.best_of is not None and data.best_of != data.n:
            raise APIError("best_of is not supported (it must equal n).", param="best_of")
        tokenizer = engine.tokenizer
        prompts = _parse_prompts(data.prompt, _vocab_size(tokenizer))
        max_model_len = int(engine.max_model_len)
        max_tokens = data.max_tokens
        if max_tokens is not None and max_tokens < 1:
            raise APIError(f"max_tokens must be an integer >= 1, got {max_tokens}.", param="max_tokens")
        # Tokenized once, off the event loop (the engine refuses text over max_prompt_bytes first).
        token_ids = [p if isinstance(p, list) else await _in_thread(_tokenize, engine, p) for p in prompts]
        if max_tokens is None:  # the default 16, shortened when a prompt leaves less room
            max_tokens = max(1, min([16, *(max_model_len - len(ids) for ids in token_ids)]))
        for ids in token_ids:
            _check_length(max_model_len, len(ids), max_tokens, chat=False)
        params = _sampling_params(data, max_tokens=max_tokens, logprobs=data.logprobs)
        request_id = _random_id("cmpl")
        created = int(time.time())
        model_name = data.model or service.served_model_name
        streams = [
            service.generate(ids, params, adapter, f"{request_id}-{i}") for i, ids in enumerate(token_ids)
        ]
        n = params.n
        num_top = data.logprobs or 0
        echo = bool(data.echo)

        def prompt_text(out: RequestOutput, i: int) -> str:
            p = prompts[i]
            return p if isinstance(p, str) else (out.prompt or tokenizer.decode(out.prompt_token_ids))

        if data.stream:
            include_usage = bool(data.stream_options and data.stream_options.include_usage)
            continuous = include_usage and bool(
                data.stream_options and data.stream_options.continuous_usage_stats
            )
            merged = await _prime_or_404(merge_streams(streams), data.model)

            async def events() -> AsyncIterator[Any]:
                sent_text: dict[int, int] = {}
                sent_tok: dict[int, int] = {}
                finals: dict[int, RequestOutput] = {}
                async with aclosing(merged) as m:  # type: ignore[type-var]
                    async for i, out in m:
                        for o in out.outputs:
                            idx = i * n + o.index
                            first = idx not in sent_text
                            t0, k0 = sent_text.get(idx, 0), sent_tok.get(idx, 0)
                            delta = o.text[t0:] if len(o.text) >= t0 else ""
                            new_tokens = len(o.token_ids) - k0
                            if (
                                not delta
                                and new_tokens <= 0
                                and o.finish_reason is None
                                and not (first and echo)
                            ):
                                continue
                            text = delta
                            lp = None
                            if echo and first:
                                text = prompt_text(out, i) + delta
                            if data.logprobs is not None:
                                lp = _completion_logprobs(
                                    tokenizer,
                                    o,
                                    k0,
                                    t0,
                                    num_top,
                                    out.prompt_token_ids if (echo and first) else None,
                                )
                            sent_text[idx], sent_tok[idx] = len(o.text), len(o.token_ids)
                            yield CompletionStreamResponse(
                                id=request_id,
                                created=created,
                                model=model_name,
                                choices=[
                                    CompletionStreamChoice(
                                        index=idx,
                                        text=text,
                                        logprobs=lp,
                                        finish_reason=o.finish_reason,
                                        stop_reason=o.stop_reason,
                                    )
                                ],
                                usage=_usage_of({0: out}) if continuous else UNSET,
                            )
                        if out.finished:
                            finals[i] = out
                if include_usage:
                    yield CompletionStreamResponse(
                        id=request_id, created=created, model=model_name, choices=[], usage=_usage_of(finals)
                    )

            return sse_response(events(), retry_after=service.config.retry_after_seconds)

        finals = await run_until_disconnect(_collect(merge_streams(streams), data.model), request.receive)
        choices: list[CompletionResponseChoice] = []
        for i in range(len(prompts)):
            out = finals[i]
            for o in out.outputs:
                text = o.text
                lp = None
                if data.logprobs is not None:
                    lp = _completion_logprobs(
                        tokenizer,
                        o,
                        0,
                        len(prompt_text(out, i)) if echo else 0,
                        num_top,
                        out.prompt_token_ids if echo else None,
                    )
                if echo:
                    text = prompt_text(out, i) + text
                choices.append(
                    CompletionResponseChoice(
                        index=i * n + o.index,
                        text=text,
                        logprobs=lp,
                        finish_reason=o.finish_reason,
                        stop_reason=o.stop_reason,
                    )
                )
        return Response(
            CompletionResponse(
                id=request_id, created=created, model=model_name, choices=choices, usage=_usage_of(finals)
            ),
            status_code=HTTP_200_OK,
        )

    # ------------------------------------------------------------------ chat

    @post(
        "/chat/completions",
        status_code=HTTP_200_OK,
        guards=guards,
        summary="OpenAI chat completions",
        responses={
            200: ResponseSpec(ChatCompletionResponse, description=_OK_DOC),
            STREAM_CHUNK: ResponseSpec(ChatCompletionStreamResponse, description="stream chunk"),
            **error_responses(400, *auth, 404, 413, 503),
        },
        operation_class=StreamingOperation,
    )
    async def create_chat_completion(
        data: ChatCompletionRequest, request: Request[Any, Any, Any]
    ) -> Response[Any] | Stream:
        engine = await service.ready()
        adapter = await service.resolve_model(data.model)
        if data.tools:
            raise APIError("tools are not supported.", param="tools")
        if data.response_format and data.response_format.get("type", "text") != "text":
            raise APIError("response_format: only {'type': 'text'} is supported.", param="response_format")
        if data.top_logprobs is not None and not data.logprobs:
            raise APIError("top_logprobs requires logprobs to be true.", param="top_logprobs")
        messages = _normalize_messages(data.messages)
        try:
            prompt_ids = list(
                await _in_thread(engine.apply_chat_template, messages, data.add_generation_prompt)
            )
        except (APIError, InvalidParamError):
            raise
        except Exception as exc:  # jinja TemplateError ("roles must alternate", ...) is the client's input
            raise APIError(
                f"messages could not be rendered by the chat template: {exc}", param="messages"
            ) from exc
        requested = data.max_completion_tokens if data.max_completion_tokens is not None else data.max_tokens
        if requested is not None and requested < 1:
            field = "max_completion_tokens" if data.max_completion_tokens is not None else "max_tokens"
            raise APIError(f"{field} must be an integer >= 1, got {requested}.", param=field)
        max_tokens = _check_length(int(engine.max_model_len), len(prompt_ids), requested, chat=True)
        num_top = data.top_logprobs or 0
        aliases = {"logprobs": "top_logprobs"}
        if data.max_completion_tokens is not None:
            aliases["max_tokens"] = "max_completion_tokens"
        params = _sampling_params(
            data, max_tokens=max_tokens, logprobs=num_top if data.logprobs else None, aliases=aliases
        )
        request_id = _random_id("chatcmpl")
        created = int(time.time())
        model_name = data.model or service.served_model_name
        tokenizer = engine.tokenizer
        stream = service.generate(prompt_ids, params, adapter, request_id)
        n = params.n
        want_lp = bool(data.logprobs)
        echo_text = ""
        if data.echo and messages and messages[-1].get("role") == "assistant":
            echo_text = messages[-1]["content"] or ""

        if data.stream:
            include_usage = bool(data.stream_options and data.stream_options.include_usage)
            continuous = include_usage and bool(
                data.stream_options and data.stream_options.continuous_usage_stats
            )
            primed = await _prime_or_404(stream, data.model)

            async def events() -> AsyncIterator[Any]:
                def chunk(
                    choice: ChatStreamChoice, out: RequestOutput | None = None
                ) -> ChatCompletionStreamResponse:
                    # continuous_usage_stats (vLLM): every chunk carries the usage so far.
                    usage: Any = UNSET
                    if continuous:
                        usage = _usage_of({0: out}) if out is not None else _usage(len(prompt_ids), 0, 0)
                    return ChatCompletionStreamResponse(
                        id=request_id, created=created, model=model_name, choices=[choice], usage=usage
                    )

                # vLLM's first frame per choice: the role, empty content.
                for i in range(n):
                    yield chunk(ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
                    if echo_text:
                        yield chunk(ChatStreamChoice(index=i, delta=DeltaMessage(content=echo_text)))
                sent_text = [0] * n
                sent_tok = [0] * n
                final: RequestOutput | None = None
                async with aclosing(primed) as s:  # type: ignore[type-var]
                    async for out in s:
                        for o in out.outputs:
                            i = o.index
                            t0, k0 = sent_text[i], sent_tok[i]
                            delta = o.text[t0:] if len(o.text) >= t0 else ""
                            if not delta and len(o.token_ids) <= k0 and o.finish_reason is None:
                                continue
                            lp = _chat_logprobs(tokenizer, o, k0, num_top) if want_lp else None
                            sent_text[i], sent_tok[i] = len(o.text), len(o.token_ids)
                            yield chunk(
                                ChatStreamChoice(
                                    index=i,
                                    delta=DeltaMessage(content=delta),
                                    logprobs=lp,
                                    finish_reason=o.finish_reason,
                                    stop_reason=o.stop_reason,
                                ),
                                out,
                            )
                        if out.finished:
                            final = out
                if include_usage:
                    yield ChatCompletionStreamResponse(
                        id=request_id,
                        created=created,
                        model=model_name,
                        choices=[],
                        usage=_usage_of({0: final} if final else {}),
                    )

            return sse_response(events(), retry_after=service.config.retry_after_seconds)

        finals = await run_until_disconnect(_collect(merge_streams([stream]), data.model), request.receive)
        out = finals[0]
        choices = [
            ChatCompletionResponseChoice(
                index=o.index,
                message=ChatMessage(role="assistant", content=echo_text + o.text),
                logprobs=_chat_logprobs(tokenizer, o, 0, num_top) if want_lp else None,
                finish_reason=o.finish_reason,
                stop_reason=o.stop_reason,
            )
            for o in out.outputs
        ]
        return Response(
            ChatCompletionResponse(
                id=request_id, created=created, model=model_name, choices=choices, usage=_usage_of(finals)
            ),
            status_code=HTTP_200_OK,
        )

    return [list_models, retrieve_model, create_completion, create_chat_completion]


async def _in_thread(fn: Any, *args: Any) -> Any:
    """Run blocking work (tokenizing, chat templates) on a worker thread, not the event loop."""
    return await anyio.to_thread.run_sync(fn, *args)


def _tokenize(engine: Any, prompt: str) -> list[int]:
    """The prompt's token ids, as the engine counts them (for vLLM's length checks)."""
    tokenize = getattr(engine, "tokenize", None)
    if callable(tokenize):
        return list(tokenize(prompt))
    return list(engine.tokenizer(prompt, add_special_tokens=True)["input_ids"])


def _vocab_size(tokenizer: Any) -> int | None:
    try:
        return len(tokenizer)
    except Exception:
        return None


def _usage_of(finals: dict[int, RequestOutput]) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in finals.values())
    completion = sum(len(c.token_ids) for o in finals.values() for c in o.outputs)
    cached = sum(int(o.num_cached_tokens or 0) for o in finals.values())
    return _usage(prompt, completion, cached)


async def _collect(
    merged: AsyncIterator[tuple[int, RequestOutput]], model: str | None
) -> dict[int, RequestOutput]:
    finals: dict[int, RequestOutput] = {}
    try:
        async with aclosing(merged) as m:  # type: ignore[type-var]
            async for i, out in m:
                finals[i] = out  # cumulative: the last one is complete
    except AdapterNotFoundError as exc:  # unloaded between resolution and submission
        raise _map_adapter_error(exc, model) from exc
    return finals


async def _prime_or_404(stream: AsyncIterator[Any], model: str | None) -> AsyncIterator[Any]:
    try:
        return await _prime(stream)
    except AdapterNotFoundError as exc:
        raise _map_adapter_error(exc, model) from exc
