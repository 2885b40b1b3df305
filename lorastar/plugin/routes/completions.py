"""``/completions`` (vLLM's OpenAI completions: four prompt forms, n, echo, legacy logprobs)."""

from __future__ import annotations

import copy
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import replace
from typing import Any

from litestar import Request, Response
from litestar.response import Stream
from litestar.status_codes import HTTP_200_OK
from msgspec import UNSET

from lorastar.engine.outputs import CompletionOutput, Logprob, RequestOutput
from lorastar.engine.sampling import SamplingParams
from lorastar.plugin.errors import APIError
from lorastar.plugin.request_id import request_ids
from lorastar.plugin.routes.common import (
    ChoiceDelta,
    capped_max_tokens,
    check_batch_size,
    check_length,
    choice_deltas,
    choice_usage,
    clamp_logprob,
    collect,
    decoded,
    generation_route,
    in_thread,
    logprobs_tokenizer,
    parse_prompts,
    prime_or_404,
    prompt_logprobs_of,
    ranked,
    request_sampling_params,
    stream_usage,
    tokenize,
    truncate_prompt,
    usage_of,
    usage_wanted,
    vocab_size,
)
from lorastar.plugin.schemas import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamChoice,
    CompletionStreamResponse,
)
from lorastar.plugin.service import LoraStarService, merge_streams, run_until_disconnect
from lorastar.plugin.sse import sse_response


def _top(tokenizer: Any, step: dict[int, Logprob], tid: int, num_top: int) -> dict[str, float]:
    """The legacy ``top_logprobs`` entry of one position: the top ``num_top`` and the chosen token."""
    top: dict[str, float] = {}
    for t, p in ranked(step)[: max(num_top, 0)]:
        top[decoded(tokenizer, t, p)] = clamp_logprob(p.logprob)
    chosen = step.get(tid)
    if chosen is not None:
        top.setdefault(decoded(tokenizer, tid, chosen), clamp_logprob(chosen.logprob))
    return top


def _completion_logprobs(
    tokenizer: Any,
    out: CompletionOutput,
    start: int,
    text_offset0: int,
    num_top: int,
    prompt: RequestOutput | None = None,
) -> CompletionLogProbs:
    """vLLM's legacy completions ``logprobs`` for tokens ``start:``, after the prompt's tokens
    when echoing (``prompt``): their logprobs are the engine's prompt logprobs (``None`` for the
    first token, which nothing predicts) and their ``text_offset`` counts from 0."""
    lp = CompletionLogProbs()
    if prompt is not None:
        offset = 0
        entries = prompt.prompt_logprobs or [None] * len(prompt.prompt_token_ids)
        for tid, entry in zip(prompt.prompt_token_ids, entries):
            chosen = entry.get(tid) if entry is not None else None
            tok = decoded(tokenizer, tid, chosen)
            lp.tokens.append(tok)
            lp.token_logprobs.append(clamp_logprob(chosen.logprob) if chosen is not None else None)
            lp.top_logprobs.append(_top(tokenizer, entry, tid, num_top) if entry is not None else None)
            lp.text_offset.append(offset)
            offset += len(tok)
    offset = text_offset0
    steps = out.logprobs or []
    for i, tid in enumerate(out.token_ids[start:], start=start):
        step = steps[i] if i < len(steps) else {}
        chosen = step.get(tid)
        tok = decoded(tokenizer, tid, chosen)
        lp.tokens.append(tok)
        lp.token_logprobs.append(clamp_logprob(chosen.logprob) if chosen is not None else None)
        lp.top_logprobs.append(_top(tokenizer, step, tid, num_top))
        lp.text_offset.append(offset)
        offset += len(tok)
    return lp


def _prompt_only(out: RequestOutput) -> RequestOutput:
    """``echo`` with ``max_tokens: 0``: the prompt alone. The engine ran one token (vLLM does the
    same) so the prompt's logprobs come from its prefill; that token is dropped here."""
    return replace(
        out,
        outputs=[
            CompletionOutput(
                o.index,
                "",
                [],
                None,
                [] if o.logprobs is not None else None,
                "length" if o.finished() else None,
                None,
            )  # fmt: skip
            for o in out.outputs
        ],
    )


async def _prompts_only(
    merged: AsyncIterator[tuple[int, RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    async with aclosing(merged) as m:  # type: ignore[type-var]
        async for i, out in m:
            yield i, _prompt_only(out)


def _with_max_tokens(params: SamplingParams, max_tokens: int) -> SamplingParams:
    """``params`` for one prompt: its own ``max_tokens`` (checked already: ``params`` holds the least)."""
    if params.max_tokens == max_tokens:
        return params
    own = copy.copy(params)
    own.max_tokens = max_tokens
    return own


def build_completion_handler(service: LoraStarService, guards: list[Any]) -> Any:
    @generation_route(
        "/completions", "OpenAI completions", CompletionResponse, CompletionStreamResponse, guards
    )
    async def create_completion(
        data: CompletionRequest, request: Request[Any, Any, Any]
    ) -> Response[Any] | Stream:
        engine = await service.ready()
        adapter = await service.resolve_adapter(data.model, data.adapter_id)
        if data.suffix:
            raise APIError("suffix is not supported.", param="suffix")
        if data.best_of is not None and data.best_of != data.n:
            raise APIError("best_of is not supported (it must equal n).", param="best_of")
        tokenizer = engine.tokenizer
        lp_names = logprobs_tokenizer(tokenizer, data, service.config.return_tokens_as_token_ids)
        want_ids = bool(data.return_token_ids)
        prompts = parse_prompts(data.prompt, vocab_size(tokenizer))
        check_batch_size(len(prompts), engine.max_waiting, "prompt", "prompts")  # a request each
        max_model_len = int(engine.max_model_len)
        max_tokens = data.max_tokens
        echo = bool(data.echo)
        prompt_only = echo and max_tokens == 0
        if max_tokens is not None and max_tokens < 1 and not prompt_only:
            raise APIError(
                f"max_tokens must be an integer >= 1 (0 only with echo), got {max_tokens}.",
                param="max_tokens",
            )
        if prompt_only:
            if data.n != 1 or data.use_beam_search:
                raise APIError("max_tokens 0 (echo the prompt alone) needs n = 1.", param="n")
            max_tokens = 1
        # Tokenized once, off the event loop (the engine refuses text over max_prompt_bytes first).
        token_ids = [
            p if isinstance(p, list) else await in_thread(tokenize, engine, p, data.add_special_tokens)
            for p in prompts
        ]
        if data.truncate_prompt_tokens is not None:
            cut = [truncate_prompt(ids, data.truncate_prompt_tokens, max_model_len) for ids in token_ids]
            # a cut prompt is echoed as the model read it
            prompts = [
                c if len(c) < len(ids) else p for p, ids, c in zip(prompts, token_ids, cut, strict=True)
            ]
            token_ids = cut
        # vLLM's default 16 per prompt, shortened when that prompt leaves less room (not the others)
        limits = [
            max_tokens if max_tokens is not None else max(1, min(16, max_model_len - len(ids)))
            for ids in token_ids
        ]
        for ids, limit in zip(token_ids, limits, strict=True):
            check_length(max_model_len, len(ids), limit, chat=False)
        defaults = service.default_sampling
        if not prompt_only:  # the model's max_new_tokens caps each (vLLM's get_max_tokens)
            limits = [capped_max_tokens(limit, defaults) for limit in limits]
        params = await request_sampling_params(
            data, max_tokens=min(limits), logprobs=data.logprobs,
            prompt_logprobs=data.logprobs if echo and data.logprobs is not None else None,
            defaults=defaults, max_logprobs=engine.max_logprobs, vocab_size=engine.vocab_size,
        )  # fmt: skip
        request_id, engine_id = request_ids("cmpl", request, data.request_id)
        created = int(time.time())
        model_name = data.model or service.served_model_name
        streams = [
            service.generate(ids, _with_max_tokens(params, limit), adapter, f"{engine_id}-{i}", data.priority)
            for i, (ids, limit) in enumerate(zip(token_ids, limits, strict=True))
        ]
        n = params.n
        num_top = params.logprobs or 0  # the body's, -1 read as the vocabulary

        decoded_prompts: dict[int, str] = {}  # an ids prompt's text: decoded once, not per streamed chunk

        def prompt_text(out: RequestOutput, i: int) -> str:
            p = prompts[i]
            if isinstance(p, str):
                return p
            if i not in decoded_prompts:
                decoded_prompts[i] = out.prompt or tokenizer.decode(out.prompt_token_ids)
            return decoded_prompts[i]

        if data.stream:
            include_usage, continuous = usage_wanted(data, service.config.enable_force_include_usage)
            # a client gone before the first output (queued, prefilling) aborts the requests
            merged = await run_until_disconnect(
                prime_or_404(merge_streams(streams), data.model), request.receive
            )
            if prompt_only:
                merged = _prompts_only(merged)

            async def events() -> AsyncIterator[Any]:
                finals: dict[int, ChoiceDelta] = {}  # each request's last frame
                async for d in choice_deltas(merged, emit_first=echo):
                    o, out = d.choice, d.out
                    text = prompt_text(out, d.stream) + d.text if (echo and d.first) else d.text
                    lp = None
                    if data.logprobs is not None:
                        echoed = out if (echo and d.first) else None
                        offset0 = d.text_start + (len(prompt_text(out, d.stream)) if echo else 0)
                        lp = _completion_logprobs(lp_names, o, 0, offset0, num_top, echoed)
                    choice = CompletionStreamChoice(
                        index=d.stream * n + o.index,
                        text=text,
                        logprobs=lp,
                        finish_reason=o.finish_reason,
                        stop_reason=o.stop_reason,
                        prompt_token_ids=list(out.prompt_token_ids) if want_ids and d.first else UNSET,
                        token_ids=list(o.token_ids) if want_ids else UNSET,
                    )
                    yield CompletionStreamResponse(
                        id=request_id,
                        created=created,
                        model=model_name,
                        choices=[choice],
                        usage=choice_usage(d) if continuous else UNSET,
                    )
                    if out.finished:
                        finals[d.stream] = d
                if include_usage:
                    yield CompletionStreamResponse(
                        id=request_id,
                        created=created,
                        model=model_name,
                        choices=[],
                        usage=stream_usage(finals.values()),
                    )

            return sse_response(events(), retry_after=service.config.retry_after_seconds)

        finals = await run_until_disconnect(collect(merge_streams(streams), data.model), request.receive)
        if prompt_only:
            finals = {i: _prompt_only(out) for i, out in finals.items()}
        choices: list[CompletionResponseChoice] = []
        for i in range(len(prompts)):
            out = finals[i]
            for o in out.outputs:
                text = o.text
                lp = None
                if data.logprobs is not None:
                    lp = _completion_logprobs(
                        lp_names,
                        o,
                        0,
                        len(prompt_text(out, i)) if echo else 0,
                        num_top,
                        out if echo else None,
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
                        prompt_logprobs=prompt_logprobs_of(out, data.prompt_logprobs),
                        prompt_token_ids=list(out.prompt_token_ids) if want_ids else UNSET,
                        token_ids=list(o.token_ids) if want_ids else UNSET,
                    )
                )
        return Response(
            CompletionResponse(
                id=request_id, created=created, model=model_name, choices=choices, usage=usage_of(finals)
            ),
            status_code=HTTP_200_OK,
        )

    return create_completion
