"""Graceful shutdown on SIGINT/SIGTERM, whatever ASGI server runs the app.

uvicorn (and so ``litestar run`` and ``lorastar serve``) stops accepting on the first signal, then
waits for open responses without a time limit before it runs the lifespan shutdown: a long stream
would keep the server up to its end. :func:`drain_on_signal` chains onto the server's handlers: on
the first signal new requests get 503, in-flight ones get ``shutdown_drain_timeout`` seconds, then
every remaining one ends with an error (a stream: a final error frame and ``data: [DONE]``), so the
server's own shutdown proceeds. A second signal ends them at once; a third is the server's force quit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

from lorastar.plugin.errors import APIError

logger = logging.getLogger("lorastar.plugin")

SIGNALS = (signal.SIGINT, signal.SIGTERM)


async def drain(service: Any, timeout: float) -> int:
    """Refuse new requests, wait up to ``timeout`` s for in-flight ones, end the rest; how many ended."""
    service.refuse_new_requests()
    engine = service.engine
    if engine is None:
        return 0
    deadline = time.monotonic() + timeout
    while engine.has_unfinished() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    n = engine.fail_streams(
        APIError(
            "The server is shutting down; the request was ended before it finished.",
            503,
            headers={"Retry-After": str(service.config.retry_after_seconds)},
        )
    )
    if n:
        logger.warning("lorastar: shutdown: ended %d unfinished request(s) after %.1f s", n, timeout)
    return n


@contextlib.contextmanager
def drain_on_signal(service: Any, timeout: float) -> Iterator[None]:
    """While active, the first SIGINT/SIGTERM also starts :func:`drain` on the running loop."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    loop = asyncio.get_running_loop()
    started: list[asyncio.Task[int]] = []

    signals: list[int] = []

    def on_signal(sig: int, frame: FrameType | None, prev: Any) -> None:
        # 1st: the server's own handling (stop accepting) + drain; 2nd: end the requests now (the
        # server then finishes its shutdown cleanly); 3rd: the server's handling again (force quit).
        signals.append(sig)
        if len(signals) == 2:
            loop.call_soon_threadsafe(lambda: started.append(loop.create_task(drain(service, 0.0))))
            return
        if callable(prev):
            prev(sig, frame)
        elif prev == signal.SIG_DFL and sig == signal.SIGINT:
            raise KeyboardInterrupt
        if len(signals) == 1:
            loop.call_soon_threadsafe(lambda: started.append(loop.create_task(drain(service, timeout))))

    previous: dict[int, Any] = {}
    for sig in SIGNALS:
        prev = signal.getsignal(sig)
        try:
            signal.signal(sig, lambda s, f, prev=prev: on_signal(s, f, prev))
        except (ValueError, OSError):  # not settable here: leave the server's handling alone
            continue
        previous[sig] = prev
    try:
        yield
    finally:
        for sig, prev in previous.items():
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(sig, prev)
