"""Torch work off the step thread runs in a thread that exits afterwards (``run_in_fresh_thread``).

Why: with torch's libgomp, every live thread that has run a parallel torch op keeps its own
OpenMP worker pool. Once more pool threads exist than CPUs, libgomp stops spinning between
parallel regions (its throttled spin count) and every region of the step thread wakes its workers
through the kernel. Measured on the 2-core CPU (torch 2.13, 2 threads): an elementwise ``[128,
1536]`` multiply 12 us on the step thread alone, 50 us while an idle thread that once ran one op is
alive, 12 us again once it exits; SmolLM2's 128-token prefill 83 ms alone, 121-135 ms with the
model loaded on a thread that stayed alive (``asyncio.to_thread``'s executor keeps its workers).
So engines are built, and adapters read and checked, on a thread of their own that ends with the
work, and the step thread is the only one left holding a pool.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def run_in_fresh_thread(fn: Callable[..., T], *args: Any, thread_name: str = "lorastar-worker") -> T:
    """``fn(*args)`` on a new thread, joined before returning; its exception is re-raised here."""
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            error.append(e)

    t = threading.Thread(target=target, name=thread_name, daemon=True)
    t.start()
    t.join()
    if error:
        raise error[0]
    return result[0]


async def to_fresh_thread(fn: Callable[..., T], *args: Any, thread_name: str = "lorastar-worker") -> T:
    """Await ``fn(*args)`` run on a new thread that exits afterwards (not the loop's executor)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def done(ok: bool, value: Any) -> None:
        if fut.cancelled():
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def target() -> None:
        try:
            value, ok = fn(*args), True
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
            value, ok = e, False
            if isinstance(e, StopIteration):  # a Future refuses it (TypeError): the task would hang
                value = RuntimeError(f"{getattr(fn, '__qualname__', fn)} raised StopIteration")
                value.__cause__ = e
        try:
            loop.call_soon_threadsafe(done, ok, value)
        except RuntimeError:  # the loop is closed: nobody is waiting
            pass

    threading.Thread(target=target, name=thread_name, daemon=True).start()
    return await fut


def submit_to_fresh_thread(
    fn: Callable[..., T], *args: Any, thread_name: str = "lorastar-worker"
) -> concurrent.futures.Future[T]:
    """Start ``fn(*args)`` on a new thread that exits afterwards; its result as a future."""
    fut: concurrent.futures.Future[T] = concurrent.futures.Future()
    fut.set_running_or_notify_cancel()

    def target() -> None:
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to whoever reads the future
            fut.set_exception(e)

    threading.Thread(target=target, name=thread_name, daemon=True).start()
    return fut
