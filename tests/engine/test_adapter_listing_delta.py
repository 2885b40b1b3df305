"""The adapter listing crosses the core boundary only when it changed.

An engine core attached every adapter's row to each ``State`` (every 0.1 s while stepping, and on
every step that finished a request): 3 ms to rebuild and encode at 1,000 adapters, and the frontend
decoded it again. The registry now keeps the listing under ``listing_version`` (a name, path, tier or
slot changed; ``in_flight`` is sent apart, per busy name), and a client gets the rows only when its
copy is stale. These tests hold the cached listing to one built from scratch after every kind of
change, count the rows the core builds and sends, and check what a client sees through a real core.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from lorastar.adapters.registry import AdapterEntry, AdapterRegistry
from lorastar.engine.sampling import RequestOutputKind, SamplingParams
from tests.adapters.test_registry import make
from tests.conftest import make_peft_adapter
from tests.engine.test_core_process import _wait


def _fresh(reg: AdapterRegistry) -> list[tuple[Any, ...]]:
    """The listing built from the registry's tables now (what ``list()`` built before caching)."""
    return [
        (
            n,
            reg._paths[n],
            e.rank,
            e.content_hash,
            tuple(sorted(e.target_modules)),
            e.tier,
            e.slot,
            e.in_flight,
        )
        for n, e in sorted(reg._names.items())
    ]


def _rows(infos: list[Any]) -> list[tuple[Any, ...]]:
    return [
        (a.name, a.path, a.rank, a.content_hash, a.target_modules, a.tier, a.slot, a.in_flight) for a in infos
    ]


@pytest.mark.parametrize("seed", range(4))
def test_cached_listing_equals_one_built_from_scratch_after_every_change(seed: int) -> None:
    rng = random.Random(seed)
    reg, disk = make(max_loras=2, max_cpu_loras=2)
    files = [disk.put(f"t{i}") for i in range(5)]
    held: list[AdapterEntry] = []
    names = [f"n{i}" for i in range(6)]
    prev_static, prev_version = [r[:-1] for r in _fresh(reg)], reg.listing_version
    for _ in range(300):
        op = rng.choice(["register", "register", "unregister", "acquire", "release", "reserve", "preload"])
        registered = sorted(reg._names)
        if op == "register":
            path, w = rng.choice(files)
            reg.register(rng.choice(names), path, w)
        elif op == "unregister" and registered:
            reg.unregister(rng.choice(registered))
        elif op == "acquire" and registered:
            held.append(reg.acquire(rng.choice(registered)))
        elif op == "release" and held:
            reg.release(held.pop(rng.randrange(len(held))))
        elif op == "reserve" and held:
            reg.try_reserve(rng.choice(held), pinned={rng.choice(held).content_hash})
        elif op == "preload" and registered:
            reg.preload(rng.choice(registered))
        reg.check_invariants()
        fresh = _fresh(reg)
        assert _rows(reg.list()) == fresh, op
        version, rows = reg.listing()
        assert _rows(rows) == [(*r[:-1], 0) for r in fresh], op
        assert reg.tiers() == {r[0]: r[5] for r in fresh}, op
        assert reg.in_flight_by_name() == {r[0]: r[-1] for r in fresh if r[-1]}, op
        static = [r[:-1] for r in fresh]
        if static != prev_static:  # a change a client must hear of moved the version
            assert version != prev_version, (op, prev_static, static)
        prev_static, prev_version = static, version
    for e in held:
        reg.release(e)
    reg.check_invariants()


@pytest.fixture(scope="module")
def core(tiny_model_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from lorastar.config import EngineConfig
    from lorastar.engine.core_proc import EngineCoreProc

    address = f"ipc://{tmp_path_factory.mktemp('core')}/in"
    proc = EngineCoreProc(
        EngineConfig.from_kwargs(model=tiny_model_dir("llama-gqa"), num_kv_blocks=64), address
    )
    yield proc
    proc.close()


def test_a_client_gets_the_rows_only_when_its_copy_is_stale(
    core: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lorastar.adapters.peft import LoRAWeights
    from tests.engine.test_host_scalability_review import _count_adapter_infos

    reg = core.engine.registry
    names = [f"row-{i:03d}" for i in range(200)]
    for name in names:
        reg.register(
            name, f"/a/{name}", LoRAWeights(f"/a/{name}", 8, 16.0, False, frozenset({"q_proj"}), name, {})
        )
    built, _ = _count_adapter_infos(monkeypatch)
    try:
        first = core.state("a")
        assert [a.name for a in first.adapters] == names
        assert core.state("a").adapters is None  # a's copy is current
        assert [a.name for a in core.state("b").adapters] == names  # b has none yet
        assert [a.name for a in core.state().adapters] == names  # no client: always whole
        entry = reg.acquire(
            names[-1]
        )  # (the newest is in host memory) a request starts: in flight, not a listing change
        later = [core.state("a") for _ in range(20)]
        assert all(s.adapters is None and s.adapters_in_flight == {names[-1]: 1} for s in later)
        assert built[0] == len(names)  # built once, for all of the states above
        reg.release(entry)
        assert core.state("a").adapters_in_flight == {}
        reg.unregister(names[0])
        again = core.state("a")
        assert again.adapters is not None and [a.name for a in again.adapters] == names[1:]
        assert core.state("a").adapters is None
        core._drop_client("a")  # a client that comes back (Hello) starts afresh
        assert core.state("a").adapters is not None
        core.restarting = True  # a rebuilding engine lists nothing; the rebuilt one goes to all
        assert core.state("b").adapters == []
        core.restarting = False
        assert [a.name for a in core.state("b").adapters] == names[1:]
    finally:
        core.restarting = False
        for name in names[1:]:
            reg.unregister(name)


async def test_through_a_core_process_the_listing_and_in_flight_stay_live(
    tiny_model_dir: Any, tmp_path: Any
) -> None:
    from lorastar.config import EngineConfig
    from lorastar.engine.core_client import AsyncCoreClient

    model = tiny_model_dir("llama-gqa")
    adapter = make_peft_adapter(model, tmp_path / "ad", seed=1, r=4)
    c = await asyncio.to_thread(
        AsyncCoreClient, EngineConfig(model=model, device="cpu", num_kv_blocks=64, max_loras=2)
    )
    try:
        await c.load_adapter("one", adapter)
        await c.load_adapter("two", adapter)  # same content: one identity, two names
        assert [a.name for a in c.list_adapters()] == ["one", "two"]
        assert c.has_adapter("one") and not c.has_adapter("three")
        sp = SamplingParams(max_tokens=400, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        gen = c.generate("hello", sp, adapter="one")
        await gen.__anext__()

        def busy() -> dict[str, int]:
            return {a.name: a.in_flight for a in c.list_adapters() if a.in_flight}

        assert await asyncio.to_thread(_wait, lambda: busy() == {"one": 1, "two": 1})
        assert {a.name: a.tier for a in c.list_adapters()} == {"one": "device", "two": "device"}
        await gen.aclose()  # aborts it in the core
        assert await asyncio.to_thread(_wait, lambda: busy() == {})
        await c.unload_adapter("two")
        assert [a.name for a in c.list_adapters()] == ["one"] and not c.has_adapter("two")
    finally:
        await c.shutdown(drain_timeout=0)
