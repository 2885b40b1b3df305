"""OpenAI batch files answered by the app's own routes, in-process: ``lorastar run-batch``.

vLLM's ``run_batch`` format (OpenAI's Batch API file format). Input, one request per line::

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

Output, one line per request, in input order, each written as soon as it and all lines before it
are answered (an interrupted run leaves a complete prefix)::

    {"id": "lorastar-...", "custom_id": "r1",
     "response": {"status_code": 200, "request_id": "lorastar-batch-...", "body": {...}},
     "error": null}

A request the route refuses keeps the route's status, ``body`` null and the route's error object
in ``error``, as vLLM writes its ``ErrorResponse``. Each body goes through the same route as over
HTTP (no socket): adapters by ``model``, validation, parsers and defaults are ``serve``'s.

The whole file is checked before anything runs, as OpenAI's Batch API validates a file: a line
that is not such an object, names an endpoint not served here, asks to stream or repeats a
``custom_id`` fails the run with its line number, before the model loads.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from lorastar.plugin.asgi_call import ResponseStart, call_asgi, http_scope

# The batch file's url -> the route under the plugin's path (``LoraStarConfig.path``, "/v1").
BATCH_URLS = {
    "/v1/chat/completions": "/chat/completions",
    "/v1/completions": "/completions",
    "/v1/embeddings": "/embeddings",
    "/v1/responses": "/responses",
    "/v1/messages": "/messages",
}
MAX_PROBLEMS_SHOWN = 10


class BatchFileError(ValueError):
    """The input file's problems, one ``line N: ...`` each (the first ``MAX_PROBLEMS_SHOWN``)."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        more = len(problems) - MAX_PROBLEMS_SHOWN
        super().__init__(
            "\n".join(problems[:MAX_PROBLEMS_SHOWN] + ([f"... and {more} more"] if more > 0 else []))
        )


@dataclass(frozen=True, slots=True)
class BatchLine:
    """One request of the file: its 1-based line number, id, url and JSON body."""

    number: int
    custom_id: str
    url: str
    body: bytes


@dataclass(slots=True)
class BatchSummary:
    """How a run went: requests answered with a 2xx, the others (each an ``error`` line), and the
    records written (a prefix of the input: the rest wait for an earlier line)."""

    succeeded: int = 0
    failed: int = 0
    written: int = 0
    output_closed: bool = False  # the output's reader went away (a broken pipe): the run stopped


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _write_record(out: TextIO, record: dict[str, Any]) -> None:
    """One output line: non-ASCII text as itself, unless something in the record cannot be UTF-8
    (a lone surrogate a route echoed back), which is then written escaped (a text file encodes the
    whole line before it writes any of it)."""
    try:
        out.write(json.dumps(record, ensure_ascii=False) + "\n")
    except UnicodeEncodeError:
        out.write(json.dumps(record) + "\n")


def _problem(obj: Any) -> str | None:
    """What is wrong with one parsed line (``None``: nothing)."""
    if not isinstance(obj, dict):
        return f"a JSON object is expected, got {type(obj).__name__}"
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return "custom_id must be a non-empty string"
    if not _is_unicode(cid):
        return "custom_id is not valid Unicode (a lone surrogate escape such as \\ud83d)"
    if obj.get("method") != "POST":
        return f'method must be "POST", got {obj.get("method")!r}'
    url = obj.get("url")
    if url not in BATCH_URLS:
        return f"url {url!r} is not served by run-batch; use one of {', '.join(BATCH_URLS)}"
    body = obj.get("body")
    if not isinstance(body, dict):
        return "body must be a JSON object (the request the url takes)"
    if body.get("stream") is True:
        return "body.stream is true; a batch line gets one answer (leave stream out)"
    return None


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # Python's reader takes NaN and Infinity; routes do not


def parse_batch(lines: Iterable[str]) -> list[BatchLine]:
    """The requests of a batch file's lines (blank lines skipped); ``BatchFileError`` naming every
    bad line."""
    out: list[BatchLine] = []
    problems: list[str] = []
    first_line: dict[str, int] = {}  # custom_id -> the line that used it first
    for number, raw in enumerate(lines, 1):
        if number == 1:
            raw = raw.removeprefix("\ufeff")  # a byte-order mark some editors write first
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw, parse_constant=_not_json)
        except ValueError as exc:
            problems.append(f"line {number}: not JSON ({exc})")
            continue
        if (why := _problem(obj)) is not None:
            problems.append(f"line {number}: {why}")
            continue
        cid = obj["custom_id"]
        if cid in first_line:
            problems.append(f"line {number}: custom_id {cid!r} repeats line {first_line[cid]}")
            continue
        first_line[cid] = number
        out.append(BatchLine(number, cid, obj["url"], json.dumps(obj["body"]).encode()))
    if problems:
        raise BatchFileError(problems)
    return out


async def answer(app: Any, line: BatchLine, prefix: str) -> dict[str, Any]:
    """The output record of one request, answered by ``app``'s route under ``prefix``."""
    scope = http_scope(
        "POST",
        prefix.rstrip("/") + BATCH_URLS[line.url],
        b"",
        [(b"content-type", b"application/json"), (b"content-length", str(len(line.body)).encode())],
    )
    status = 500
    chunks: list[bytes] = []
    payload: Any = None
    try:
        async for item in call_asgi(app, scope, line.body):
            if isinstance(item, ResponseStart):
                status = item.status
            else:
                chunks.append(item)
        payload = json.loads(b"".join(chunks)) if chunks else None
    except Exception as exc:  # the app failed after it answered, or answered something not JSON
        status, payload = (
            500,
            {"error": {"message": f"{type(exc).__name__}: {exc}", "type": "InternalServerError"}},
        )
    ok = 200 <= status < 300
    return {
        "id": f"lorastar-{uuid.uuid4().hex}",
        "custom_id": line.custom_id,
        "response": {
            "status_code": status,
            "request_id": f"lorastar-batch-{uuid.uuid4().hex}",
            "body": payload if ok else None,
        },
        "error": None if ok else payload,
    }


async def run_batch(
    app: Any,
    lines: Sequence[BatchLine],
    out: TextIO,
    *,
    prefix: str = "/v1",
    concurrency: int = 128,
    on_answer: Callable[[int, BatchSummary], None] | None = None,
    summary: BatchSummary | None = None,
) -> BatchSummary:
    """Answer ``lines`` through ``app`` (its lifespan already entered), at most ``concurrency`` at
    a time, writing each record to ``out`` in input order as soon as the ones before it are written.
    ``on_answer(answered, summary)`` is called after each answer (progress); ``summary`` (else a new
    one) is kept up to date as the run goes, so a caller whose run was cancelled still reads it."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    summary = summary if summary is not None else BatchSummary()
    ready: dict[int, dict[str, Any]] = {}  # answered, waiting for an earlier line
    todo = iter(enumerate(lines))

    async def worker() -> None:
        for index, line in todo:  # one shared iterator: each line is taken once
            record = await answer(app, line, prefix)
            if record["error"] is None:
                summary.succeeded += 1
            else:
                summary.failed += 1
            ready[index] = record
            while summary.written in ready:
                _write_record(out, ready.pop(summary.written))
                summary.written += 1
            out.flush()
            if on_answer is not None:
                on_answer(summary.succeeded + summary.failed, summary)

    workers = [asyncio.ensure_future(worker()) for _ in range(min(concurrency, len(lines)))]
    try:
        await asyncio.gather(*workers)
    except BrokenPipeError:  # `-o - | head`: nobody reads on; the lines in flight are aborted
        summary.output_closed = True
    finally:
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    return summary
