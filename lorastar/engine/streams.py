"""A request's outputs from the step loop's thread to its asyncio caller: ``deliver`` hands a
step's outputs to their streams, ``stream_outputs`` reads one stream, ``Embeds`` awaits an
embedding. Shared by ``AsyncLLM`` (engine in a thread) and ``AsyncCoreClient`` (engine core in a
process). Torch-free, as ``AsyncCoreClient``'s
imports are: a server whose core runs in a process of its own imports torch (through transformers'
tokenizer) on the thread that warms it up while the core starts, not before it spawns the core.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from lorastar.engine.outputs import CompletionOutput, EmbeddingRequestOutput, RequestOutput, embedding_result
from lorastar.engine.sampling import embedding_params

Stream = tuple[asyncio.AbstractEventLoop, "asyncio.Queue[RequestOutput | BaseException]"]


def release_id(open_ids: dict[str, str], lock: threading.Lock, rid: str, wire: str) -> None:
    """The caller's request id ``rid`` is free again, unless it already names a newer request
    (``open_ids``: caller's id -> the wire id of its open stream; ``wire``: the one ending)."""
    with lock:
        if open_ids.get(rid) == wire:
            del open_ids[rid]


async def stream_outputs(
    q: asyncio.Queue[RequestOutput | BaseException],
    delta: bool,
    abandon: Callable[[], None],
    name: str | None = None,
) -> AsyncIterator[RequestOutput]:
    """A request's outputs from its queue until the finished one. Several waiting are handed out
    as one (DELTA: joined; otherwise the newest); an exception in the queue is raised. Left before
    the end (closed, cancelled), it calls ``abandon`` (drop the stream, abort the request).
    ``name``: the caller's request id, given to each output (the engine knows it by a wire id)."""
    finished = False
    try:
        while not finished:
            item = await q.get()
            run: list[RequestOutput] = []  # DELTA: outputs to join onto item, once (not pairwise)
            while not q.empty():  # several outputs waiting: hand out one that covers them
                nxt = q.get_nowait()
                if isinstance(item, RequestOutput) and isinstance(nxt, RequestOutput):
                    if delta:
                        run.append(nxt)
                    else:
                        item = nxt  # cumulative: the newest
                else:
                    item = nxt if isinstance(nxt, BaseException) else item
                    break
            if run and isinstance(item, RequestOutput):
                item = _merge_run(item, run)
            if isinstance(item, BaseException):
                finished = True
                raise item
            finished = item.finished
            if name is not None:
                item.request_id = name
            yield item
    finally:
        if not finished:
            abandon()


def deliver(streams: dict[str, Stream], lock: threading.Lock, outs: list[RequestOutput]) -> None:
    """Hand a step's outputs to their streams (a finished one's stream is dropped) with ONE wake-up
    per event loop, not one per output: with 64 streams a per-output ``call_soon_threadsafe``
    costs 64 self-pipe writes and event-loop wake-ups per step, contending for the GIL with the
    step loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Any, RequestOutput]]] = {}
    with lock:
        for out in outs:
            stream = streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del streams[out.request_id]
            by_loop.setdefault(stream[0], []).append((stream[1], out))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the caller's loop is closed: nobody is listening
            pass


def _put_all(items: list[tuple[Any, RequestOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)


def _merge_run(first: RequestOutput, rest: list[RequestOutput]) -> RequestOutput:
    """``merge_deltas`` folded over ``first`` then ``rest``, each choice's pieces joined once: a
    stream whose reader fell k steps behind (a slow client) copied its joined text, ids and
    logprobs k times, pairwise (quadratic in the backlog, on the event loop)."""
    if len(rest) == 1:
        return merge_deltas(first, rest[0])
    pieces: dict[int, list[CompletionOutput]] = {}
    prompt_logprobs = first.prompt_logprobs
    for out in (first, *rest):
        prompt_logprobs = prompt_logprobs or out.prompt_logprobs
        for o in out.outputs:
            pieces.setdefault(o.index, []).append(o)
    outs = []
    for run in pieces.values():
        o = run[-1]
        if len(run) > 1:
            ids: list[int] = []
            lps = None if run[0].logprobs is None else list(run[0].logprobs)
            for p in run:
                ids.extend(p.token_ids)
                if p is not run[0]:  # merge_deltas' rule: None if the later piece has none
                    lps = None if p.logprobs is None else (lps if lps is not None else [])
                    if lps is not None:
                        lps.extend(p.logprobs)  # type: ignore[arg-type]
            text = "".join(p.text for p in run)
            o = CompletionOutput(
                o.index, text, ids, o.cumulative_logprob, lps, o.finish_reason, o.stop_reason
            )
        outs.append(o)
    if len(outs) > 1:
        outs.sort(key=lambda o: o.index)
    b = rest[-1]
    return RequestOutput(
        b.request_id, b.prompt, b.prompt_token_ids, outs, b.finished, b.adapter, b.num_cached_tokens,
        prompt_logprobs, b.metrics, b.embedding,
    )  # fmt: skip


def merge_deltas(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """One DELTA output covering ``a`` then ``b`` (same request): texts, ids and logprobs joined;
    finish state, cumulative logprob and metrics from ``b``; prompt logprobs from the first.

    Built with the constructors, every field named (a test checks none is missed): a server that
    falls a step behind merges 64 streams' outputs a step, and ``dataclasses.replace`` made this
    10% of its event loop (py-spy, ``benchmarks/serving.py`` at 64 clients)."""
    mine = {o.index: o for o in a.outputs}
    outs = []
    for o in b.outputs:
        p = mine.pop(o.index, None)
        if p is not None:
            o = CompletionOutput(
                o.index,
                p.text + o.text,
                p.token_ids + o.token_ids,
                o.cumulative_logprob,
                None if o.logprobs is None else (p.logprobs or []) + o.logprobs,
                o.finish_reason,
                o.stop_reason,
            )
        outs.append(o)
    outs.extend(mine.values())
    if len(outs) > 1:
        outs.sort(key=lambda o: o.index)
    return RequestOutput(
        b.request_id,
        b.prompt,
        b.prompt_token_ids,
        outs,
        b.finished,
        b.adapter,
        b.num_cached_tokens,
        a.prompt_logprobs or b.prompt_logprobs,
        b.metrics,
        b.embedding,
    )


class Embeds:
    """``embed`` for ``AsyncLLM`` and ``AsyncCoreClient``: an embedding request through their own
    ``generate``, its stream read to the end."""

    generate: Callable[..., AsyncIterator[RequestOutput]]

    async def embed(
        self,
        prompt: str | list[int],
        *,
        adapter: str | None = None,
        normalize: bool = True,
        request_id: str | None = None,
        priority: int = 0,
    ) -> EmbeddingRequestOutput:
        """One prompt's embedding (``LLM.embed``'s: the last token's final hidden state, L2-normalized
        unless ``normalize=False``), awaited; closing the awaiting task aborts it."""
        final: RequestOutput | None = None
        async for out in self.generate(
            prompt, embedding_params(), adapter=adapter, request_id=request_id, priority=priority
        ):
            final = out
        if final is None or final.embedding is None:
            raise RuntimeError("the embedding request ended without an embedding (aborted)")
        return embedding_result(final, normalize)
