"""An adapter whose folder is deleted or corrupted while it sits on the disk tier (max_cpu_loras
exceeded): only its own requests fail, with an error that names it; other adapters and the base
model go on serving, and nothing leaks.

The reload happens when the request is added (``AdapterRegistry.acquire`` pins the identity's host
weights for the request's lifetime, so the scheduler's ``try_reserve`` never re-reads the disk)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from lorastar import LLM, AsyncLLM, SamplingParams
from lorastar.engine.engine import LLMEngine
from lorastar.errors import AdapterError
from tests.conftest import make_peft_adapter

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = [4, 5, 6, 7]
KW = {"num_kv_blocks": 64, "max_model_len": 128, "max_loras": 1, "max_cpu_loras": 1, "max_lora_rank": 8}
A_FAILED = r"reloading adapter \['a'\] failed"


def _adapters(base: str, tmp_path: Path) -> tuple[str, str, str]:
    """a's folder, a spare copy of it (the good path to load it again from), b's folder."""
    pa = make_peft_adapter(base, tmp_path / "a", 1)
    good = shutil.copytree(pa, tmp_path / "a_good")
    return pa, str(good), make_peft_adapter(base, tmp_path / "b", 2)


def _assert_clean(eng: LLMEngine) -> None:
    eng.check_invariants()
    assert eng.kv_cache_usage().num_used_blocks == 0 and not eng.requests
    assert all(n == 0 for n in eng.registry.stats()["in_flight"].values())


def _break(path: str, how: str) -> None:
    if how == "deleted":
        shutil.rmtree(path)
    else:
        (Path(path) / "adapter_model.safetensors").write_bytes(b"\x00garbage")


@pytest.mark.parametrize("how", ["deleted", "corrupted"])
def test_offline_a_broken_disk_tier_adapter_fails_only_its_requests(
    tiny_model_dir, tmp_path: Path, how: str
) -> None:  # noqa: ANN001
    base = tiny_model_dir("llama-gqa")
    pa, good, pb = _adapters(base, tmp_path)
    llm = LLM(base, **KW)
    llm.load_adapter("a", pa)
    want_a = llm.generate(PROMPT, GREEDY, adapter="a")[0].outputs[0].token_ids
    llm.load_adapter("b", pb)
    want_b = llm.generate(PROMPT, GREEDY, adapter="b")[0].outputs[0].token_ids
    want_base = llm.generate(PROMPT, GREEDY)[0].outputs[0].token_ids
    assert len({tuple(want_a), tuple(want_b), tuple(want_base)}) == 3
    assert {i.name: i.tier for i in llm.list_adapters()}["a"] == "disk"
    _break(pa, how)

    eng = llm.engine
    rb, r0 = eng.add_request(PROMPT, GREEDY, adapter="b"), eng.add_request(PROMPT, GREEDY)
    with pytest.raises(AdapterError, match=A_FAILED):
        eng.add_request(PROMPT, GREEDY, adapter="a")
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert done[rb.request_id].outputs[0].token_ids == want_b
    assert done[r0.request_id].outputs[0].token_ids == want_base
    _assert_clean(eng)
    # A batch naming the broken adapter is refused whole (as vLLM's), the others aborted.
    with pytest.raises(AdapterError, match=A_FAILED):
        llm.generate([PROMPT, PROMPT, PROMPT], GREEDY, adapter=["b", None, "a"])
    _assert_clean(eng)
    # Unloaded and loaded again from a good folder: it serves as before.
    llm.unload_adapter("a")
    llm.load_adapter("a", good)
    outs = llm.generate([PROMPT, PROMPT], GREEDY, adapter=["a", "b"])
    assert [o.outputs[0].token_ids for o in outs] == [want_a, want_b]
    _assert_clean(eng)


async def test_async_a_deleted_disk_tier_adapter_fails_only_its_requests(
    tiny_model_dir, tmp_path: Path
) -> None:  # noqa: ANN001
    base = tiny_model_dir("llama-gqa")
    pa, good, pb = _adapters(base, tmp_path)
    engine = AsyncLLM(model=base, **KW)
    await engine.start()
    try:

        async def run(adapter: str | None) -> list[int]:
            outs = [o async for o in engine.generate(PROMPT, GREEDY, adapter=adapter)]
            assert outs[-1].finished
            return outs[-1].outputs[0].token_ids

        await engine.load_adapter("a", pa)
        want_a = await run("a")
        await engine.load_adapter("b", pb)
        want_b, want_base = await run("b"), await run(None)
        shutil.rmtree(pa)
        got = await asyncio.gather(run("b"), run(None), run("a"), return_exceptions=True)
        assert got[:2] == [want_b, want_base]
        assert isinstance(got[2], AdapterError) and "reloading adapter ['a'] failed" in str(got[2])
        await engine.unload_adapter("a")
        await engine.load_adapter("a", good)
        assert await asyncio.gather(run("a"), run("b")) == [want_a, want_b]
        _assert_clean(engine.engine)
    finally:
        await engine.shutdown()
