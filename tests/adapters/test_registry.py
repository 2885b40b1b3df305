"""AdapterRegistry: names -> content identities, refcounts, device slots (LRU with a pinned set),
the CPU tier (LRU drop + verified reload), and invariants after every scenario."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lorastar.adapters.peft import LoRAWeights, ModelSpec, load_peft_adapter
from lorastar.adapters.registry import AdapterEntry, AdapterRegistry
from lorastar.errors import AdapterError, AdapterNotFoundError


def fake(tag: str, rank: int = 4) -> LoRAWeights:
    a, b = torch.ones(rank, 8), torch.zeros(8, rank)
    return LoRAWeights(
        path=f"/adapters/{tag}",
        rank=rank,
        alpha=8.0,
        use_rslora=False,
        target_modules=frozenset({"q_proj"}),
        content_hash=f"hash-{tag}",
        weights={(0, "q_proj"): (a, b)},
    )


class FakeDisk:
    """loader(path) -> the weights currently 'on disk' at path; counts reads."""

    def __init__(self) -> None:
        self.files: dict[str, LoRAWeights] = {}
        self.reads: list[str] = []

    def put(self, tag: str) -> tuple[str, LoRAWeights]:
        w = fake(tag)
        self.files[w.path] = w
        return w.path, w

    def __call__(self, path: str) -> LoRAWeights:
        self.reads.append(path)
        if path not in self.files:
            raise FileNotFoundError(path)
        return self.files[path]


def make(max_loras: int = 2, max_cpu_loras: int = 8, **kw: object) -> tuple[AdapterRegistry, FakeDisk]:
    disk = FakeDisk()
    return AdapterRegistry(max_loras, max_cpu_loras, disk, **kw), disk  # type: ignore[arg-type]


def assert_empty(reg: AdapterRegistry) -> None:
    reg.check_invariants()
    s = reg.stats()
    assert s["identities"] == 0 and s["slots_used"] == 0 and s["adapters_registered"] == 0


def test_same_weights_two_names_one_identity() -> None:
    reg, disk = make()
    p, w = disk.put("x")
    e1 = reg.register("a", p, w)
    e2 = reg.register("b", "/elsewhere/x", fake("x"))
    assert e1 is e2 and e1.names == {"a", "b"}
    assert reg.register("a", p, w) is e1  # identical re-register: no-op
    assert reg.stats()["identities"] == 1 and len(reg) == 2
    assert [i.content_hash for i in reg.list()] == ["hash-x", "hash-x"]
    reg.check_invariants()
    reg.unregister("a")
    assert e1.path == "/elsewhere/x"  # reloads now go through a path a live name still uses
    assert reg.stats()["identities"] == 1
    reg.unregister("b")
    assert_empty(reg)


def test_rename_to_new_weights_keeps_old_identity_for_inflight() -> None:
    reg, disk = make()
    p1, w1 = disk.put("v1")
    p2, w2 = disk.put("v2")
    reg.register("a", p1, w1)
    old = reg.acquire("a")
    new = reg.register("a", p2, w2)
    assert new is not old and [i.content_hash for i in reg.list()] == [new.content_hash]
    assert reg.stats()["identities"] == 2 and old.weights is w1 and not old.names
    reg.check_invariants()
    assert reg.acquire("a") is new  # new requests get the new identity
    # Switching back to v1 while a v1 request is still running reuses that identity.
    assert reg.register("a", p1, w1) is old
    reg.register("a", p2, w2)
    reg.release(old)
    assert reg.stats()["identities"] == 1  # old freed once its request finished
    reg.release(new)
    reg.unregister("a")
    assert_empty(reg)


def test_unregister_while_in_flight() -> None:
    reg, disk = make()
    reg.register("a", *disk.put("a"))
    reg.register("b", *disk.put("b"))
    e = reg.acquire("a")
    slot, _ = reg.try_reserve(e, set()) or (None, None)
    assert slot is not None
    reg.unregister("a")
    with pytest.raises(AdapterNotFoundError) as ei:
        reg.acquire("a")
    assert "'a'" in str(ei.value) and "['b']" in str(ei.value)
    assert isinstance(ei.value, KeyError)
    assert e.slot == slot and reg.stats()["slots_used"] == 1  # running request keeps its slot
    reg.check_invariants()
    reg.release(e)
    assert e.slot is None and reg.stats()["slots_used"] == 0 and reg.stats()["identities"] == 1
    with pytest.raises(AdapterNotFoundError):
        reg.unregister("a")
    reg.unregister("b")
    assert_empty(reg)


@pytest.mark.parametrize("bad", ["", "a b", "a/b", "tab\tx", None, 3])
def test_bad_names_leave_registry_unchanged(bad: object) -> None:
    reg, disk = make()
    reg.register("ok", *disk.put("ok"))
    before = (reg.list(), reg.stats())
    with pytest.raises(AdapterError, match="adapter name"):
        reg.register(bad, *disk.put("new"))  # type: ignore[arg-type]
    assert (reg.list(), reg.stats()) == before
    reg.check_invariants()


def test_release_misuse() -> None:
    reg, disk = make()
    e = reg.register("a", *disk.put("a"))
    with pytest.raises(ValueError, match="release without acquire"):
        reg.release(e)
    stale = AdapterEntry("hash-zz", "/p", 4, frozenset(), None)
    with pytest.raises(ValueError, match="does not hold"):
        reg.release(stale)
    reg.check_invariants()


def test_slots_lru_with_pinned_set() -> None:
    uploads: list[tuple[int, str]] = []
    reg, disk = make(max_loras=2, on_slot_assigned=lambda s, w: uploads.append((s, w.content_hash)))
    for n in "abc":
        reg.register(n, *disk.put(n))
    a, b, c = reg.acquire("a"), reg.acquire("b"), reg.acquire("c")
    assert reg.try_reserve(a, {a.content_hash}) == (0, None)
    assert reg.try_reserve(b, {a.content_hash, b.content_hash}) == (1, None)
    assert uploads == [(0, "hash-a"), (1, "hash-b")]
    # Both slots belong to adapters already in this step's batch: c must wait.
    assert reg.try_reserve(c, {a.content_hash, b.content_hash, c.content_hash}) is None
    assert c.slot is None
    # Next step: a was used more recently than b, so b is the LRU victim.
    assert reg.try_reserve(a, {a.content_hash}) == (0, None)
    assert reg.try_reserve(c, {c.content_hash}) == (1, b)
    assert b.slot is None and c.slot == 1 and uploads[-1] == (1, "hash-c")
    # Already on a slot: no upload, no eviction.
    n_up = len(uploads)
    assert reg.try_reserve(a, set()) == (0, None) and len(uploads) == n_up
    # Pinned set overrides recency: c is older than a now, but it is pinned.
    assert reg.try_reserve(b, {c.content_hash}) == (0, a)
    tiers = {i.name: (i.tier, i.slot, i.in_flight) for i in reg.list()}
    assert tiers == {"a": ("cpu", None, 1), "b": ("device", 0, 1), "c": ("device", 1, 1)}
    reg.check_invariants()
    for e in (a, b, c):
        reg.release(e)
    for n in "abc":
        reg.unregister(n)
    assert_empty(reg)


def test_zero_slots() -> None:
    reg, disk = make(max_loras=0)
    reg.register("a", *disk.put("a"))
    e = reg.acquire("a")
    assert reg.try_reserve(e, set()) is None
    reg.release(e)
    reg.unregister("a")
    assert_empty(reg)


def test_failed_upload_leaves_slot_free() -> None:
    def boom(slot: int, w: LoRAWeights) -> None:
        raise RuntimeError("upload failed")

    reg, disk = make(max_loras=1, on_slot_assigned=boom)
    e = reg.register("a", *disk.put("a"))
    with pytest.raises(RuntimeError):
        reg.try_reserve(e, set())
    assert e.slot is None and reg.stats()["slots_used"] == 0
    reg.check_invariants()


def test_cpu_tier_eviction_and_reload() -> None:
    reg, disk = make(max_loras=1, max_cpu_loras=2)
    ea = reg.register("a", *disk.put("a"))
    eb = reg.register("b", *disk.put("b"))
    ec = reg.register("c", *disk.put("c"))
    # a is the least recently used idle identity: dropped to disk.
    assert {i.name: i.tier for i in reg.list()} == {"a": "disk", "b": "cpu", "c": "cpu"}
    assert ea.weights is None and reg.stats()["cpu_loaded"] == 2
    reg.check_invariants()
    got = reg.acquire("a")  # reload on next use, hash verified
    assert got is ea and ea.weights is disk.files["/adapters/a"] and disk.reads == ["/adapters/a"]
    assert eb.weights is None  # b became the LRU idle one
    # Slot-resident and in-flight identities are never dropped (soft limit).
    assert reg.try_reserve(reg.acquire("c"), set()) == (0, None)
    assert reg.stats()["cpu_loaded"] == 2 and ea.weights is not None and ec.weights is not None
    reg.check_invariants()
    # try_reserve reloads a disk-tier identity itself; c's slot is evicted (not pinned).
    assert reg.try_reserve(eb, set()) == (0, ec)
    assert eb.weights is not None and disk.reads[-1] == "/adapters/b"
    reg.check_invariants()
    reg.release(ea)
    reg.release(ec)
    reg.check_invariants()
    for n in "abc":
        reg.unregister(n)
    assert_empty(reg)


def test_reload_refuses_changed_or_missing_file() -> None:
    reg, disk = make(max_cpu_loras=1)
    p, _ = disk.put("a")
    e = reg.register("a", p, disk.files[p])
    reg.register("z", *disk.put("z"))
    assert e.weights is None  # max_cpu_loras=1: a went to the disk tier
    disk.files[p] = fake("other")
    disk.files[p].path = p
    with pytest.raises(AdapterError, match="changed on disk"):
        reg.acquire("a")
    assert e.in_flight == 0
    with pytest.raises(AdapterError, match="changed on disk"):
        reg.try_reserve(e, set())
    assert e.slot is None
    del disk.files[p]
    with pytest.raises(AdapterError, match="reloading adapter"):
        reg.acquire("a")
    reg.check_invariants()
    # Re-registering the same content brings it back to the CPU tier without reading the disk.
    n = len(disk.reads)
    assert reg.register("b", p, fake("a")) is e and e.weights is not None and len(disk.reads) == n


def test_reloads_read_a_folder_that_still_holds_the_content() -> None:
    """A name reloaded in place with the same content from another folder moves there (listings
    and disk-tier reloads used the old one, which may be gone); an identity two names share
    reloads from either name's folder."""
    reg, disk = make(max_cpu_loras=1)
    w = fake("x")
    disk.files["/old"] = disk.files["/new"] = w
    e = reg.register("x", "/old", w)
    assert reg.register("x", "/new", w) is e
    assert [(i.name, i.path) for i in reg.list()] == [("x", "/new")]
    del disk.files["/old"]
    reg.register("z", *disk.put("z"))  # max_cpu_loras=1: x drops to the disk tier
    assert e.weights is None
    assert reg.acquire("x") is e and disk.reads == ["/new"]
    reg.release(e)
    y = fake("y")
    disk.files["/p1"] = disk.files["/p2"] = y
    ey = reg.register("y1", "/p1", y)
    assert reg.register("y2", "/p2", y) is ey
    reg.register("q", *disk.put("q"))
    assert ey.weights is None
    del disk.files["/p1"]
    assert reg.acquire("y2") is ey and disk.reads[-2:] == ["/p1", "/p2"] and ey.path == "/p2"
    reg.release(ey)
    del disk.files["/p2"]  # no folder holds it any more: the first folder's error
    reg.register("r", *disk.put("r"))
    assert ey.weights is None
    with pytest.raises(AdapterError, match="/p2: reloading adapter"):
        reg.acquire("y1")
    reg.check_invariants()


def test_check_invariants_catches_corruption() -> None:
    reg, disk = make()
    e = reg.register("a", *disk.put("a"))
    reg.check_invariants()
    e.slot = 1
    with pytest.raises(ValueError, match="claims slot"):
        reg.check_invariants()
    e.slot = None
    e.in_flight = -1
    with pytest.raises(ValueError, match="in_flight"):
        reg.check_invariants()


def test_concurrent_loads_and_step_loop() -> None:
    reg, disk = make(max_loras=3, max_cpu_loras=4)
    for i in range(8):
        disk.put(f"t{i}")
    reg.register("base0", *disk.put("base0"))
    stop = threading.Event()
    errors: list[BaseException] = []

    def admin(k: int) -> None:
        try:
            for j in range(200):
                name = f"n{k}_{j % 3}"
                reg.register(name, f"/adapters/t{(j + k) % 8}", disk.files[f"/adapters/t{(j + k) % 8}"])
                if j % 2:
                    reg.unregister(name)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=admin, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    held: list[AdapterEntry] = []
    for step in range(300):
        for name in [i.name for i in reg.list()][:4]:
            try:
                held.append(reg.acquire(name))
            except AdapterNotFoundError:
                pass  # unregistered between list() and acquire(): the request is refused
        pinned: set[str] = set()
        for e in held[-3:]:
            if reg.try_reserve(e, pinned) is not None:
                pinned.add(e.content_hash)
        while len(held) > 6:
            reg.release(held.pop(0))
        if step % 50 == 0:
            reg.check_invariants()
    stop.set()
    for t in threads:
        t.join()
    assert not errors
    for e in held:
        reg.release(e)
    reg.check_invariants()
    for name in [i.name for i in reg.list()]:
        reg.unregister(name)
    assert_empty(reg)


def _write_adapter(d: Path, scale: float) -> None:
    d.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], "bias": "none"}
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    t = {}
    for i in range(2):
        k = f"base_model.model.model.layers.{i}.self_attn.q_proj"
        t[f"{k}.lora_A.weight"] = torch.randn(2, 16, generator=g) * scale
        t[f"{k}.lora_B.weight"] = torch.randn(16, 2, generator=g)
    save_file(t, d / "adapter_model.safetensors")


def test_real_folders_reload_and_change_detection(tmp_path: Path) -> None:
    spec = ModelSpec(num_layers=2, module_shapes={"q_proj": (16, 16)})

    def loader(path: str) -> LoRAWeights:
        return load_peft_adapter(path, spec, max_rank=8)

    _write_adapter(tmp_path / "a", 1.0)
    _write_adapter(tmp_path / "b", 2.0)
    _write_adapter(tmp_path / "a_copy", 1.0)
    reg = AdapterRegistry(max_loras=1, max_cpu_loras=1, loader=loader)
    ea = reg.register("a", tmp_path / "a", loader(str(tmp_path / "a")))
    assert reg.register("same", tmp_path / "a_copy", loader(str(tmp_path / "a_copy"))) is ea
    reg.register("b", tmp_path / "b", loader(str(tmp_path / "b")))
    assert ea.weights is None  # dropped to disk
    assert reg.acquire("a") is ea and ea.weights is not None  # reread and hash-verified
    reg.release(ea)
    reg.register("b2", tmp_path / "b", loader(str(tmp_path / "b")))  # pushes a out again
    assert ea.weights is None
    _write_adapter(tmp_path / "a", 3.0)  # the file changed behind our back
    # "same"'s folder still holds a's content: the identity reloads from there.
    assert reg.acquire("a") is ea and ea.path == str(tmp_path / "a_copy")
    reg.release(ea)
    reg.register("b3", tmp_path / "b", loader(str(tmp_path / "b")))  # pushes a out again
    assert ea.weights is None
    _write_adapter(tmp_path / "a_copy", 4.0)  # now no folder holds it
    with pytest.raises(AdapterError, match="changed on disk"):
        reg.acquire("a")
    reg.check_invariants()
