"""``reset_prefix_cache`` (vLLM's ``LLM.reset_prefix_cache()``, its engine clients' and
``POST /reset_prefix_cache``): forget every cached prefix block (and the prompt logprobs kept with
them) so the next request computes its prompt again, e.g. between the runs of a benchmark; refused
(False, nothing dropped) while a request holds blocks, as vLLM refuses it."""

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
from lorastar.engine.engine import LLMEngine
from tests.models.test_llama_vs_hf import hf_greedy, mixed_prompts

NEW = 6
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
FAST = {"device": "cpu", "num_kv_blocks": 32, "max_model_len": 128, "block_size": 4}


@pytest.fixture(scope="module")
def base(tiny_model_dir: Any) -> tuple[str, list[int], list[int]]:
    path = tiny_model_dir("llama-gqa")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = mixed_prompts(31, [22])[0]
    return path, prompt, hf_greedy(hf, prompt, NEW)


def test_llm_reset_makes_the_next_prompt_compute_again(base: Any) -> None:
    path, prompt, ref = base
    llm = LLM(path, **FAST)
    first, again = llm.generate([prompt], GREEDY)[0], llm.generate([prompt], GREEDY)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 20  # 5 full blocks of 4
    scored = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    llm.generate([prompt], scored)
    assert len(llm.engine.prompt_logprobs_cache) > 0
    assert llm.reset_prefix_cache() is True
    assert len(llm.engine.prompt_logprobs_cache) == 0 and not llm.engine.block_manager._cached
    after = llm.generate([prompt], GREEDY)[0]
    assert after.num_cached_tokens == 0
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == after.outputs[0].token_ids == ref
    llm.engine.check_invariants()


def test_a_reset_while_a_request_holds_blocks_is_refused(base: Any) -> None:
    path, prompt, ref = base
    eng = LLMEngine(EngineConfig(model=path, **FAST))
    eng.add_request(prompt, GREEDY, request_id="first")
    while eng.has_unfinished():
        eng.step()
    eng.add_request(prompt, GREEDY, request_id="live")
    eng.step()  # its prompt is in the KV cache (and found cached)
    cached = dict(eng.block_manager._cached)
    assert cached and eng.reset_prefix_cache() is False
    assert eng.block_manager._cached == cached  # nothing dropped
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert outs[-1].outputs[0].token_ids == ref
    assert eng.reset_prefix_cache() is True and not eng.block_manager._cached
    eng.check_invariants()


def test_engine_clients_reset_in_the_core(base: Any, tmp_path: Path, core_in_thread: Any) -> None:
    path, prompt, ref = base
    address = f"ipc://{tmp_path}/core"

    async def main() -> tuple[int, bool, int]:
        client = await asyncio.to_thread(AsyncCoreClient, address=address, start_timeout=60)
        try:
            outs = []
            for _ in range(2):
                outs.append([o async for o in client.generate(prompt, GREEDY)][-1])
            reset = await client.reset_prefix_cache()
            after = [o async for o in client.generate(prompt, GREEDY)][-1]
            assert [o.outputs[0].token_ids for o in (*outs, after)] == [ref] * 3
            return outs[1].num_cached_tokens, reset, after.num_cached_tokens
        finally:
            await client.shutdown(drain_timeout=0)

    with core_in_thread(EngineConfig(model=path, **FAST), address):
        assert asyncio.run(main()) == (20, True, 0)
