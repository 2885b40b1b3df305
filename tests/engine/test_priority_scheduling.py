"""Priority scheduling end to end (``EngineConfig.scheduling_policy="priority"``, vLLM's
``--scheduling-policy priority`` and ``LLM.generate(priority=...)``): requests start in priority
order, outputs stay HF's greedy ones token for token (also when block pressure preempts), and an
FCFS engine refuses a non-zero priority before queueing anything, in-process and through a core
process."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from lorastar import LLM, SamplingParams
from lorastar.config import EngineConfig
from lorastar.engine.core_client import AsyncCoreClient
from lorastar.errors import InvalidParamError
from tests.models.test_llama_vs_hf import hf_greedy, mixed_prompts

NEW = 10
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def base(tiny_model_dir: Any) -> tuple[str, list[list[int]], list[list[int]]]:
    path = tiny_model_dir("llama-gqa")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = mixed_prompts(21, [5, 17, 9, 30, 3, 12])
    return path, prompts, [hf_greedy(hf, p, NEW) for p in prompts]


def _clean(llm: LLM) -> None:
    eng = llm.engine
    eng.check_invariants()
    assert not eng.requests and not eng.has_unfinished()
    assert llm.kv_cache_usage()["num_used_blocks"] == 0


def test_requests_start_in_priority_order_with_hf_outputs(base: Any) -> None:
    path, prompts, refs = base
    llm = LLM(path, scheduling_policy="priority", max_num_seqs=1, num_kv_blocks=64, max_model_len=128)
    prio = [3, 0, 2, -1, 0, 1]
    outs = llm.generate(prompts, GREEDY, priority=prio)
    assert [o.outputs[0].token_ids for o in outs] == refs
    started = sorted(range(len(prompts)), key=lambda i: outs[i].metrics.first_scheduled_time)
    assert started == [3, 1, 4, 5, 2, 0]  # by priority, ties (1 and 4) by arrival
    _clean(llm)


def test_block_pressure_preempts_and_loses_nothing(base: Any) -> None:
    """Six requests of up to 40 tokens in 6 blocks of 16: most steps preempt someone; every output is
    still HF's."""
    path, prompts, refs = base
    llm = LLM(path, scheduling_policy="priority", num_kv_blocks=6, max_model_len=128)
    outs = llm.generate(prompts, GREEDY, priority=[5, 0, 5, 0, 5, 0])
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert llm.engine.scheduler.stats.num_preemptions > 0
    _clean(llm)


def test_fcfs_refuses_a_priority_and_queues_nothing(base: Any) -> None:
    path, prompts, refs = base
    llm = LLM(path, num_kv_blocks=32, max_model_len=128)
    with pytest.raises(InvalidParamError, match="--scheduling-policy priority") as err:
        llm.generate(prompts[:2], GREEDY, priority=[0, 1])
    assert err.value.param == "priority"
    _clean(llm)
    for bad in (True, 1.5, "1", 2**63):
        with pytest.raises(InvalidParamError, match="priority must be an integer"):
            llm.generate(prompts[:1], GREEDY, priority=[bad])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="priority has 1 entries for 2 prompts"):
        llm.generate(prompts[:2], GREEDY, priority=[0])
    with pytest.raises(ValueError, match="priority must be a list"):
        llm.generate(prompts[:1], GREEDY, priority=0)  # type: ignore[arg-type]
    outs = llm.generate(prompts[:2], GREEDY, priority=[0, 0])  # 0 is every FCFS request's
    assert [o.outputs[0].token_ids for o in outs] == refs[:2]
    _clean(llm)
    with pytest.raises(ValueError, match="scheduling_policy must be 'fcfs' or 'priority'"):
        EngineConfig(model=path, scheduling_policy="sjf")


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_core_process_takes_the_priority_from_its_clients(
    base: Any, policy: str, tmp_path: Path, core_in_thread: Any
) -> None:
    path, prompts, refs = base
    address = f"ipc://{tmp_path}/core"

    async def main() -> list[int] | InvalidParamError:
        client = await asyncio.to_thread(AsyncCoreClient, address=address, start_timeout=60)
        try:
            outs = [o async for o in client.generate(prompts[0], GREEDY, priority=-4)]
            return outs[-1].outputs[0].token_ids
        except InvalidParamError as exc:
            return exc
        finally:
            await client.shutdown(drain_timeout=0)

    config = EngineConfig(
        model=path, device="cpu", num_kv_blocks=32, max_model_len=128, scheduling_policy=policy
    )
    with core_in_thread(config, address) as core:
        got = asyncio.run(main())
        assert not core.engine.requests
    if policy == "priority":
        assert got == refs[0]
    else:
        assert isinstance(got, InvalidParamError) and got.param == "priority", got
        assert "first come, first served" in str(got)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_urgent_arrival_preempts_for_a_seat_and_everything_stays_hf(
    base: Any, async_scheduling: bool
) -> None:
    """Both seats held by priority-1 requests; a priority-0 request arriving mid-way preempts one of
    them (the latest), starts at once and ends before it. Every output is still HF's (the preempted request
    recomputes), with async scheduling too (its victim has a token in flight), and nothing leaks."""
    from lorastar.engine.engine import LLMEngine

    path, prompts, refs = base
    eng = LLMEngine(
        EngineConfig(
            model=path, device="cpu", num_kv_blocks=64, max_model_len=128, max_num_seqs=2,
            scheduling_policy="priority", async_scheduling=async_scheduling,
        )
    )  # fmt: skip
    done: dict[str, Any] = {}

    def step() -> None:
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out

    eng.add_request(prompts[3], GREEDY, request_id="low-a", priority=1)
    eng.add_request(prompts[1], GREEDY, request_id="low-b", priority=1)
    for _ in range(3):
        step()
    eng.add_request(prompts[0], GREEDY, request_id="urgent", priority=0)
    while eng.has_unfinished():
        step()
    assert [done[r].outputs[0].token_ids for r in ("urgent", "low-a", "low-b")] == [refs[0], refs[3], refs[1]]
    assert eng.scheduler.stats.num_preemptions >= 1
    m = {r: done[r].metrics for r in done}
    # it ran beside low-a (the earlier of the two) and instead of low-b, the latest
    assert m["urgent"].first_token_time < m["low-a"].finished_time
    assert m["urgent"].finished_time < m["low-b"].finished_time
    eng.check_invariants()
    assert not eng.requests and eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
