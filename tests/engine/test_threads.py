"""Torch work off the step thread runs on threads that exit (engine/threads.py): the helpers, the
property they exist for (no OpenMP pool left behind) and the callers that must use them."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from lorastar.engine.threads import run_in_fresh_thread, submit_to_fresh_thread, to_fresh_thread


def _where() -> threading.Thread:
    return threading.current_thread()


def test_run_in_fresh_thread_returns_raises_and_the_thread_is_gone() -> None:
    t = run_in_fresh_thread(_where, thread_name="x-worker")
    assert t is not threading.current_thread() and t.name == "x-worker"
    assert not t.is_alive()
    assert run_in_fresh_thread(lambda a, b: a + b, 2, 3) == 5
    with pytest.raises(KeyError, match="boom"):
        run_in_fresh_thread(lambda: {}["boom"])


def test_to_fresh_thread_and_submit() -> None:
    async def go() -> tuple[threading.Thread, int]:
        t = await to_fresh_thread(_where)
        with pytest.raises(ValueError, match="bad"):
            await to_fresh_thread(lambda: (_ for _ in ()).throw(ValueError("bad")))
        return t, await to_fresh_thread(pow, 2, 10)

    t, v = asyncio.run(go())
    t.join(5)
    assert v == 1024 and not t.is_alive() and t is not threading.current_thread()
    fut = submit_to_fresh_thread(divmod, 7, 2)
    assert fut.result(5) == (3, 1)
    with pytest.raises(ZeroDivisionError):
        submit_to_fresh_thread(divmod, 1, 0).result(5)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through /proc")
def test_a_stop_iteration_reaches_the_awaiting_task_as_a_runtime_error() -> None:
    """An asyncio Future refuses a StopIteration (TypeError, logged on the loop), so the task
    awaiting ``to_fresh_thread`` hung forever; it now gets a RuntimeError caused by it."""

    def empty() -> int:
        return next(iter([]))

    async def main() -> None:
        with pytest.raises(RuntimeError, match="StopIteration") as err:
            await asyncio.wait_for(to_fresh_thread(empty), 10)
        assert isinstance(err.value.__cause__, StopIteration)

    asyncio.run(main())


def test_a_fresh_thread_leaves_no_openmp_worker_behind() -> None:
    """The reason for the helpers: a thread that ran a parallel torch op keeps an OpenMP worker
    pool while it lives (an executor thread lives on); one that exits takes its pool with it."""
    code = textwrap.dedent(
        """
        import os, concurrent.futures, time, torch
        from lorastar.engine.threads import run_in_fresh_thread
        torch.set_num_threads(2)
        x = torch.randn(512, 1024)
        tasks = lambda: len(os.listdir("/proc/self/task"))
        def settled():  # exiting OpenMP workers take a moment to go
            for _ in range(50):
                n = tasks()
                time.sleep(0.05)
                if tasks() == n:
                    return n
            return tasks()
        base = settled()
        run_in_fresh_thread(lambda: (x * x).sum())
        after_fresh = settled()
        pool = concurrent.futures.ThreadPoolExecutor(1)
        pool.submit(lambda: (x * x).sum()).result()
        print(base, after_fresh, settled())
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    base, after_fresh, after_pool = map(int, out.stdout.split())
    assert after_fresh == base
    assert after_pool >= base + 2  # the executor's thread and its OpenMP worker stay


def test_async_llm_builds_and_loads_adapters_on_threads_that_exit(
    tiny_model_dir, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:  # noqa: ANN001
    from lorastar.engine import async_engine
    from lorastar.engine.async_engine import AsyncLLM
    from tests.conftest import make_peft_adapter

    seen: dict[str, threading.Thread] = {}
    real_engine = async_engine.LLMEngine

    class Recording(real_engine):  # type: ignore[misc, valid-type]
        def __init__(self, *a, **kw) -> None:  # noqa: ANN002, ANN003
            seen["build"] = threading.current_thread()
            super().__init__(*a, **kw)

        def load_adapter(self, *a, **kw):  # noqa: ANN002, ANN003, ANN202
            seen["load"] = threading.current_thread()
            return super().load_adapter(*a, **kw)

    monkeypatch.setattr(async_engine, "LLMEngine", Recording)
    path = tiny_model_dir()
    adapter = make_peft_adapter(path, tmp_path / "a", seed=1)
    engine = AsyncLLM(model=path, num_kv_blocks=32)

    async def go() -> None:
        await engine.start()
        await engine.load_adapter("a", adapter)
        await engine.shutdown()

    asyncio.run(go())
    for what in ("build", "load"):
        t = seen[what]
        t.join(5)
        assert t is not threading.current_thread() and not t.is_alive(), what
        assert t.name.startswith("lorastar-"), what
