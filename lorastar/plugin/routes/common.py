"""What the OpenAI routes share: request -> ``SamplingParams``, usage, vLLM's length checks,
priming a stream (submission errors become an HTTP status), collecting finals, and
``choice_deltas``, the one streaming helper that turns DELTA outputs into per-choice frames."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import aclosing
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio
from litestar import post
from litestar.openapi import ResponseSpec
from litestar.status_codes import HTTP_200_OK

from lorastar.engine.outputs import CompletionOutput, Logprob, RequestOutput
from lorastar.engine.sampling import RequestOutputKind, SamplingParams, bounded_logprobs
from lorastar.engine.structured import parse_grammar
from lorastar.errors import AdapterNotFoundError, InvalidParamError
from lorastar.plugin.engine_client import EngineClient
from lorastar.plugin.errors import APIError, error_responses
from lorastar.plugin.schemas import PromptLogprob, PromptLogprobs, PromptTokensDetails, UsageInfo
from lorastar.plugin.sse import STREAM_CHUNK, StreamingOperation, TypedEventsOperation

SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop_token_ids",
    "allowed_token_ids",
    "bad_words",
    "cache_salt",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "use_beam_search",
    "length_penalty",
)
# the fields a model's generation_config.json may default (engine/generation_config.py)
GENERATION_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
MIN_LOGPROB = -9999.0  # vLLM clamps -inf so the JSON stays valid
OK_DOC = (
    "The whole answer as JSON; with `stream: true`, server-sent events: `data: {chunk}` frames "
    "(an error after the stream started is one `data: {error}` frame), then `data: [DONE]`"
)


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def truncate_prompt(ids: list[int], k: int | None, max_model_len: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the last ``k`` tokens (``-1``: the last ``max_model_len``)."""
    if k is None:
        return ids
    if k == -1:
        k = max_model_len
    if k < 1:  # the schema allows -1 and up
        raise APIError(
            f"truncate_prompt_tokens must be -1 or an integer >= 1, got {k}.", param="truncate_prompt_tokens"
        )
    if k > max_model_len:
        raise APIError(
            f"truncate_prompt_tokens ({k}) is greater than max_model_len ({max_model_len}).",
            param="truncate_prompt_tokens",
        )
    return ids[-k:]


def sampling_params(
    req: Any,
    *,
    max_tokens: int,
    logprobs: int | None,
    aliases: dict[str, str] | None = None,
    prompt_logprobs: int | None = None,
    guided_json: dict[str, Any] | None = None,
    defaults: Mapping[str, Any] | None = None,
    max_logprobs: int | None = None,
    vocab_size: int = 0,
) -> SamplingParams:
    """The engine's parameters from a request body. ``aliases`` renames engine fields to the
    wire field the client sent (chat's ``top_logprobs`` is the engine's ``logprobs``).
    ``defaults``: the model's sampling defaults (``generation_config.json``) for fields the body
    leaves unset (vLLM's ``default_sampling_params``).
    ``prompt_logprobs``: what the route needs (completions' echo), merged with the body's.
    ``guided_json``: the tools' schema of a forced tool call (a 400 beside another constraint).
    ``max_logprobs``: the engine's cap on top logprobs (checked here to name the wire field); a
    ``logprobs`` or ``prompt_logprobs`` of -1 comes back as ``vocab_size``, the whole vocabulary."""
    if req.prompt_logprobs and req.stream:  # vLLM's rule: 0 is let through (and asks for nothing)
        raise APIError("prompt_logprobs is not available with stream=true.", param="prompt_logprobs")
    if req.stream_options is not None and not req.stream_options.is_empty() and not req.stream:
        # vLLM's rule (usage would be silently absent); an empty object passes, as there
        raise APIError("Stream options can only be defined when `stream=True`.", param="stream_options")
    # an invalid value goes to the engine as sent: it names the field (a stream's is 0: none computed)
    pl = None if req.stream else req.prompt_logprobs
    if prompt_logprobs is not None and (
        pl is None or (0 <= pl and (prompt_logprobs == -1 or pl < prompt_logprobs))
    ):
        pl = prompt_logprobs  # the larger (-1: the whole vocabulary)
    kw: dict[str, Any] = {
        "n": req.n,
        "max_tokens": max_tokens,
        "stop": req.stop,
        "seed": req.seed,
        "logprobs": logprobs,
        "prompt_logprobs": pl,
        # Streams get what is new each step; a plain response only the complete final output.
        "output_kind": RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY,
    }
    for name in SAMPLING_FIELDS:
        kw[name] = getattr(req, name)
        if kw[name] is None and defaults and name in GENERATION_FIELDS:
            kw[name] = defaults.get(name)
    guided, wire = structured_fields(req)
    if guided_json is not None:  # the tools' schema (tool_choice "required" or a named function)
        flags = {k: v for k, v in guided.items() if k == "disable_any_whitespace"}
        if len(guided) > len(flags):
            raise APIError(
                f"tool_choice and {wire.get(next(iter(guided)), next(iter(guided)))} both set: "
                "a forced tool call already constrains the answer.",
                param="tool_choice",
            )
        guided, wire = {"guided_json": guided_json, **flags}, {"guided_json": "tools"}
    kw.update(guided)
    aliases = {**(aliases or {}), **wire}
    if req.logit_bias:
        try:  # OpenAI sends token ids as strings
            kw["logit_bias"] = {int(k): v for k, v in req.logit_bias.items()}
        except ValueError as exc:
            raise APIError(
                "logit_bias keys must be token ids (integers as strings).", param="logit_bias"
            ) from exc
    try:
        params = SamplingParams.from_dict(kw)
        if max_logprobs is not None:
            params = bounded_logprobs(params, max_logprobs, vocab_size)
        parse_grammar(params)  # a schema, regex or grammar xgrammar cannot parse: 400 here
        return params
    except InvalidParamError as exc:
        message, param = str(exc), exc.param
        name = aliases.get(param or "")
        if param and name:  # name the field the client sent, in the message too
            message, param = message.replace(param, name, 1), name
        raise APIError(message, param=param) from exc


async def request_sampling_params(req: Any, **kw: Any) -> SamplingParams:
    """``sampling_params(req, **kw)``: on a worker thread where the request constrains its output
    (checking a JSON schema, regex or grammar can take long), on the event loop where it does not
    (a few dict lookups, ~0.1 ms). The thread hop is what costs there: with 64 streaming clients
    (serving.py's tiny model, 2-core VM) a plain request waited 19.6 ms (p50) between entering the
    handler and having its parameters, 0.13 ms without the hop, its time to first token that
    much shorter and its batch slot that much sooner filled.

    The parameters alone inline lowered TTFT p50 in all ten alternated comparisons against the
    code before (5-14 ms; p99 moved both ways). Tokenizing and chat templates stay on worker
    threads: rendering short chats inline too (~0.18 ms each) gave the chat route a TTFT p99 of
    207-253 ms in three alternated runs where the code before had 126-211 ms (64 clients whose
    requests arrive in bursts)."""
    if kw.get("guided_json") is not None or constrained(req):
        return await in_thread(partial(sampling_params, req, **kw))  # type: ignore[no-any-return]
    return sampling_params(req, **kw)


def constrained(req: Any) -> bool:
    """Whether the body asks for structured output in any of its forms (``structured_fields``' reading
    of them; a whitespace option alone constrains nothing)."""
    guided, _ = structured_fields(req)
    return any(name != "disable_any_whitespace" for name in guided)


# structured_outputs' keys -> the engine's fields
_STRUCTURED_KEYS = {
    "choice": "guided_choice",
    "json": "guided_json",
    "regex": "guided_regex",
    "grammar": "guided_grammar",
    "json_object": "guided_json_object",
    "structural_tag": "guided_structural_tag",
}


def structured_fields(req: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """The engine's ``guided_*`` fields from a body's ``guided_*``, ``structured_outputs`` or
    ``response_format`` (one of the three; ``structured_outputs.disable_any_whitespace`` goes with
    any), with the wire field each came from (for messages)."""
    given = {
        name: value
        for name in ("guided_choice", "guided_json", "guided_regex", "guided_grammar")
        if (value := getattr(req, name)) is not None
    }
    wire: dict[str, str] = {}
    if (so := req.structured_outputs) is not None:
        if given:
            first = next(iter(given))
            raise APIError(
                f"{first} and structured_outputs both set: send the constraint in one of them.", param=first
            )
        given = {
            field: value
            for key, field in _STRUCTURED_KEYS.items()
            if (value := getattr(so, key)) is not None and value is not False
        }
        wire = dict.fromkeys(given, "structured_outputs")
    if fmt := response_format_fields(req.response_format):
        if given:
            first = wire.get(next(iter(given)), next(iter(given)))
            raise APIError(
                f"response_format and {first} both set: send the constraint in one of them.",
                param="response_format",
            )
        given, wire = fmt, dict.fromkeys(fmt, "response_format")
    if so is not None and so.disable_any_whitespace:  # applies to the JSON of any of the three
        given["disable_any_whitespace"] = True
    return given, wire


def response_format_fields(fmt: dict[str, Any] | None) -> dict[str, Any]:
    """OpenAI's ``response_format`` as the engine's fields: ``text`` none, ``json_object`` any
    JSON object, ``json_schema`` its ``schema``, vLLM's ``structural_tag`` the format itself
    (``structures`` and ``triggers``, or xgrammar's ``format``)."""
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"guided_json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema") if fmt else None
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise APIError(
                "response_format: json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}.",
                param="response_format",
            )
        return {"guided_json": schema}
    if kind == "structural_tag":
        return {"guided_structural_tag": fmt}
    raise APIError(
        f"response_format: type must be 'text', 'json_object', 'json_schema' or 'structural_tag', got {kind!r}.",
        param="response_format",
    )


def prompt_logprobs_of(out: RequestOutput, requested: int | None) -> PromptLogprobs | None:
    """The response's ``prompt_logprobs`` when the body asked for them (the engine may have
    computed more for echo: keep the prompt token and the top ``requested``; -1: all)."""
    if requested is None or out.prompt_logprobs is None:
        return None
    result: PromptLogprobs = []
    for pos, entry in enumerate(out.prompt_logprobs):
        if entry is None:
            result.append(None)
            continue
        tok = out.prompt_token_ids[pos]
        result.append(
            {
                t: PromptLogprob(clamp_logprob(lp.logprob), lp.rank, lp.decoded_token)
                for t, lp in entry.items()
                if t == tok or requested == -1 or (lp.rank is not None and lp.rank <= requested)
            }
        )
    return result


def clamp_logprob(value: float) -> float:
    return max(float(value), MIN_LOGPROB)


class TokenIdNames:
    """The logprobs' "tokenizer" of a request with vLLM's ``return_tokens_as_token_ids``: each
    token is named ``token_id:{id}``."""

    def decode(self, ids: list[int]) -> str:
        return "".join(f"token_id:{i}" for i in ids)


def logprobs_tokenizer(tokenizer: Any, req: Any, default: bool = False) -> Any:
    """What names the tokens in ``req``'s logprobs: its ids (``return_tokens_as_token_ids``, else
    ``default``: the server's ``--return-tokens-as-token-ids``) or text."""
    own = getattr(req, "return_tokens_as_token_ids", None)
    return TokenIdNames() if (default if own is None else own) else tokenizer


def usage_wanted(req: Any, force: bool) -> tuple[bool, bool]:
    """A stream's ``(include_usage, continuous_usage_stats)``: what ``stream_options`` asks, usage
    always under ``force`` (vLLM's ``--enable-force-include-usage``; its ``should_include_usage``)."""
    opts = req.stream_options
    include = bool(opts and opts.include_usage) or force
    return include, include and bool(opts and opts.continuous_usage_stats)


def decoded(tokenizer: Any, token_id: int, lp: Logprob | None) -> str:
    if isinstance(tokenizer, TokenIdNames):
        return f"token_id:{token_id}"
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([token_id])


def ranked(step: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    return sorted(step.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0, -kv[1].logprob))


def make_usage(prompt_tokens: int, completion_tokens: int, cached: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def capped_max_tokens(max_tokens: int, defaults: Mapping[str, Any]) -> int:
    """``max_tokens`` within the model's ``max_new_tokens`` (vLLM takes the least of both)."""
    cap = defaults.get("max_tokens")
    return min(max_tokens, cap) if isinstance(cap, int) and cap >= 1 else max_tokens


def parse_prompts(prompt: Any, vocab_size: int | None, param: str = "prompt") -> list[str | list[int]]:
    """OpenAI's four prompt forms: str, list[str], list[int], list[list[int]] (``param``: the
    field's name in errors: ``prompt`` for completions, ``input`` for embeddings)."""

    def is_tok(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    def check_ids(ids: list[Any]) -> list[int]:
        if not ids:
            raise APIError(f"{param} must not be empty.", param=param)
        for t in ids:
            if not is_tok(t) or t < 0 or (vocab_size is not None and t >= vocab_size):
                raise APIError(f"{param} contains an invalid token id: {t!r}.", param=param)
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
                f"{param} must be a string, a list of strings, a list of token ids or a list of "
                "lists of token ids.",
                param=param,
            )
    else:
        raise APIError(f"{param} must not be empty.", param=param)
    for p in prompts:
        if isinstance(p, str) and not p:
            raise APIError(f"{param} must not be empty.", param=param)
    return prompts


def check_batch_size(count: int, limit: int | None, param: str, noun: str) -> None:
    """A 400 for a batch of more requests (prompts, inputs) than the queue takes at once: it would
    meet the queue bound (503) on every retry, however idle the server."""
    if limit is not None and count > limit:
        raise APIError(
            f"{param} holds {count} {noun}; this server queues at most {limit} requests "
            f"(max_waiting): send at most {limit} {noun} per request.",
            param=param,
        )


def check_length(max_model_len: int, prompt_len: int, max_tokens: int | None, *, chat: bool) -> int:
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


async def prime(stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
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


def map_adapter_error(exc: AdapterNotFoundError, model: str | None) -> APIError:
    return APIError(f"The model `{model}` does not exist.", 404, param="model")


async def in_thread(fn: Any, *args: Any) -> Any:
    """Run blocking work (tokenizing, chat templates) on a worker thread, not the event loop."""
    return await anyio.to_thread.run_sync(fn, *args)


def tokenize(engine: EngineClient, prompt: str, add_special_tokens: bool = True) -> list[int]:
    """The prompt's token ids, as the engine counts them (for vLLM's length checks)."""
    return list(engine.tokenize(prompt, add_special_tokens))


def vocab_size(tokenizer: Any) -> int | None:
    try:
        return len(tokenizer)
    except Exception:
        return None


def usage_of(finals: dict[int, RequestOutput]) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in finals.values())
    completion = sum(len(c.token_ids) for o in finals.values() for c in o.outputs)
    cached = sum(int(o.num_cached_tokens or 0) for o in finals.values())
    return make_usage(prompt, completion, cached)


async def collect(
    merged: AsyncIterator[tuple[int, RequestOutput]], model: str | None
) -> dict[int, RequestOutput]:
    finals: dict[int, RequestOutput] = {}
    try:
        async with aclosing(merged) as m:  # type: ignore[type-var]
            async for i, out in m:
                finals[i] = out  # cumulative: the last one is complete
    except AdapterNotFoundError as exc:  # unloaded between resolution and submission
        raise map_adapter_error(exc, model) from exc
    return finals


async def prime_or_404(stream: AsyncIterator[Any], model: str | None) -> AsyncIterator[Any]:
    try:
        return await prime(stream)
    except AdapterNotFoundError as exc:
        raise map_adapter_error(exc, model) from exc


@dataclass
class ChoiceDelta:
    """New output of one choice since the last frame sent for it."""

    stream: int  # which request of the call (completions: one per prompt)
    out: RequestOutput  # the DELTA output it came from
    choice: CompletionOutput  # the choice's new tokens (and their logprobs) only
    text: str  # new text
    text_start: int  # length of the text already sent
    first: bool  # the first frame of this choice
    completion_tokens: int  # tokens generated so far by the stream's request (all its choices)
    choice_tokens: int  # tokens generated so far by this choice


async def choice_deltas(
    merged: AsyncIterator[tuple[int, RequestOutput]], *, emit_first: bool = False
) -> AsyncIterator[ChoiceDelta]:
    """Per-choice frames from DELTA outputs: one per choice that has new text, new tokens or a
    finish reason (``emit_first``: also a choice's first output, e.g. to echo the prompt)."""
    sent: dict[tuple[int, int], int] = {}  # (stream, choice) -> characters sent
    tokens: dict[int, int] = {}  # stream -> completion tokens so far (all its choices)
    counts: dict[tuple[int, int], int] = {}  # (stream, choice) -> its tokens so far
    async with aclosing(merged) as m:  # type: ignore[type-var]
        async for i, out in m:
            tokens[i] = tokens.get(i, 0) + sum(len(o.token_ids) for o in out.outputs)
            for o in out.outputs:
                key = (i, o.index)
                first = key not in sent
                t0 = sent.get(key, 0)
                counts[key] = counts.get(key, 0) + len(o.token_ids)
                if not o.text and not o.token_ids and o.finish_reason is None and not (first and emit_first):
                    continue
                sent[key] = t0 + len(o.text)
                yield ChoiceDelta(i, out, o, o.text, t0, first, tokens[i], counts[key])


def choice_usage(d: ChoiceDelta) -> UsageInfo:
    """``continuous_usage_stats``' usage of one chunk, as vLLM counts it (``previous_num_tokens[i]``):
    its own prompt and its own choice's tokens so far (the last, usage-only chunk sums them all)."""
    return make_usage(len(d.out.prompt_token_ids), d.choice_tokens, int(d.out.num_cached_tokens or 0))


def stream_usage(last: Iterable[ChoiceDelta]) -> UsageInfo:
    """Usage of a streamed call from the last frame of each of its requests."""
    last = list(last)
    return make_usage(
        sum(len(d.out.prompt_token_ids) for d in last),
        sum(d.completion_tokens for d in last),
        sum(int(d.out.num_cached_tokens or 0) for d in last),
    )


def generation_route(
    path: str, summary: str, response: type, chunk: type, guards: list[Any], *, typed_events: bool = False
) -> Any:
    """The ``@post`` of a generating route: 200 with the JSON model or, streamed, ``chunk`` frames
    (documented per SSE event; ``typed_events``: ``event:`` + ``data:`` frames, no ``[DONE]``), and
    the error statuses it can answer."""
    return post(
        path,
        status_code=HTTP_200_OK,
        guards=guards,
        summary=summary,
        responses={
            200: ResponseSpec(response, description=OK_DOC),
            STREAM_CHUNK: ResponseSpec(chunk, description="stream chunk"),
            **error_responses(400, *((401,) if guards else ()), 404, 413, 503),
        },
        operation_class=TypedEventsOperation if typed_events else StreamingOperation,
    )
