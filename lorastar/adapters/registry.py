"""Adapter registry: names -> content identities, refcounts, the CPU tier and the device slots.

Plain Python (tensors are only stored, never computed on), so it unit-tests in microseconds.

Model:
* A *name* is what users send (``model`` field / ``adapter=``). Names map to *identities*, keyed by
  the adapter's content hash: two names with identical weights share one identity (one slot, one
  copy in host memory, one prefix-cache namespace).
* An identity lives while a name refers to it **or** a request is in flight on it. So unloading or
  re-registering a name never pulls weights from under running requests.
* Tiers: ``device`` (holds one of ``max_loras`` slots; implies host weights), ``cpu`` (weights in
  host memory, at most ``max_cpu_loras`` beyond which the LRU idle identity drops its tensors) and
  ``disk`` (only path + hash kept; ``loader(path)`` re-reads and the hash is re-checked on next use).

Thread-safety: every public method takes one re-entrant lock. The engine's step loop calls the slot
API; loads/unloads may come from other threads. ``on_slot_assigned`` runs under the lock (so a slot
is never handed out twice); it may call back into the registry.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lorastar.adapters.info import AdapterInfo, check_name
from lorastar.adapters.peft import LoRAWeights
from lorastar.errors import AdapterError, AdapterNotFoundError

Loader = Callable[[str], LoRAWeights]
SlotCallback = Callable[[int, LoRAWeights], None]


@dataclass(eq=False)
class AdapterEntry:
    """One adapter identity (unique content). Read its fields; mutate only through the registry."""

    content_hash: str
    path: str
    rank: int
    target_modules: frozenset[str]
    weights: LoRAWeights | None  # None while on the disk tier
    names: set[str] = field(default_factory=set)
    in_flight: int = 0
    slot: int | None = None
    last_used: int = 0  # LRU clock tick, shared by the slot and CPU tiers

    @property
    def tier(self) -> str:
        if self.slot is not None:
            return "device"
        return "cpu" if self.weights is not None else "disk"


class AdapterRegistry:
    def __init__(
        self,
        max_loras: int,
        max_cpu_loras: int,
        loader: Loader,
        on_slot_assigned: SlotCallback | None = None,
    ) -> None:
        if max_loras < 0:
            raise ValueError(f"max_loras must be >= 0, got {max_loras}")
        if max_cpu_loras < 0:
            raise ValueError(f"max_cpu_loras must be >= 0, got {max_cpu_loras}")
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self._loader = loader
        self._on_slot_assigned = on_slot_assigned
        self._lock = threading.RLock()
        self._names: dict[str, AdapterEntry] = {}
        self._by_hash: dict[str, AdapterEntry] = {}
        self._paths: dict[str, str] = {}  # name -> the path it was registered from
        self._slots: list[AdapterEntry | None] = [None] * max_loras
        self._clock = 0
        # Bumped whenever ``listing()`` would change (a name, path, tier or slot; not ``in_flight``,
        # which moves with every request and is reported apart, by ``in_flight_by_name``). An engine
        # core sends its clients the listing only when this moved: rebuilding and encoding 1,000
        # adapters' rows took 2.5 ms, on each step that finished a request.
        self.listing_version = 0
        self._listing: tuple[int, list[AdapterInfo]] | None = None  # (version, rows) of listing()
        self._tiers: tuple[int, dict[str, str]] | None = None  # (version, name -> tier) of tiers()
        self._busy: set[AdapterEntry] = set()  # the identities with in_flight > 0

    # ---- names ----------------------------------------------------------------------------------

    def register(self, name: str, path: str | os.PathLike[str], weights: LoRAWeights) -> AdapterEntry:
        """Bind ``name`` to these weights. Idempotent for identical content; a different content
        gives the name a new identity while the old one lives on for its in-flight requests."""
        check_name(name)
        if not isinstance(weights, LoRAWeights):
            raise AdapterError(f"adapter {name!r}: weights must be LoRAWeights, got {type(weights).__name__}")
        path = str(path)
        with self._lock:
            old = self._names.get(name)
            if old is not None and old.content_hash == weights.content_hash:
                # Same content from (maybe) another folder: that one was just read, so reloads
                # and listings use it (the old folder may be gone).
                self._paths[name] = old.path = path
                self.listing_version += 1
                return old
            entry = self._by_hash.get(weights.content_hash)
            if entry is None:
                entry = AdapterEntry(
                    content_hash=weights.content_hash,
                    path=path,
                    rank=weights.rank,
                    target_modules=weights.target_modules,
                    weights=weights,
                )
                self._by_hash[entry.content_hash] = entry
            elif entry.weights is None:
                entry.weights = weights  # we hold the tensors anyway: back to the CPU tier for free
            if old is not None:
                self._detach_name(name, old)
            entry.names.add(name)
            self._names[name] = entry
            self._paths[name] = path
            self.listing_version += 1
            self._touch(entry)
            self._enforce_cpu_limit()
            return entry

    def unregister(self, name: str) -> None:
        """Remove the name now; the identity goes once no name and no request refers to it."""
        with self._lock:
            entry = self._names.get(name)
            if entry is None:
                raise self._not_found(name)
            self._detach_name(name, entry)

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._names

    def __len__(self) -> int:
        with self._lock:
            return len(self._names)

    # ---- requests -------------------------------------------------------------------------------

    def acquire(self, name: str) -> AdapterEntry:
        """A request starts on ``name``: pins its identity (and reloads it from disk if needed).

        Raises AdapterNotFoundError for an unknown name, AdapterError if the reload fails or the file
        changed since registration (the refcount is then untouched)."""
        with self._lock:
            entry = self._names.get(name)
            if entry is None:
                raise self._not_found(name)
            self._ensure_loaded(entry)
            entry.in_flight += 1
            self._busy.add(entry)
            self._touch(entry)
            self._enforce_cpu_limit()
            return entry

    def on_disk(self, name: str) -> bool:
        """Whether ``name`` is registered with its weights only on disk (``acquire`` reads them)."""
        with self._lock:
            entry = self._names.get(name)
            return entry is not None and entry.weights is None

    def preload(self, name: str) -> bool:
        """Read ``name``'s weights from disk into host memory if they are not there, without
        holding the registry's lock while reading (``acquire`` reads under it, and the step loop's
        slot calls wait on that lock: a reload of a disk-tier adapter stalled every running
        request for the read and hash). Whether ``acquire`` will now find them in host memory.
        A failed read is ignored: ``acquire`` tries again and raises the error."""
        with self._lock:
            entry = self._names.get(name)
            if entry is None:
                return False
            if entry.weights is not None:
                return True
            paths = [entry.path, *sorted({self._paths[n] for n in entry.names} - {entry.path})]
        for path in paths:
            try:
                w = self._loader(path)
            except Exception:  # acquire names the failure
                continue
            if w.content_hash != entry.content_hash:
                continue
            with self._lock:
                if self._by_hash.get(entry.content_hash) is not entry:  # unregistered meanwhile
                    return False
                if entry.weights is None:
                    entry.path, entry.weights = path, w
                    self.listing_version += 1
                    self._touch(entry)
                    # the newest: dropped again only when every other identity is pinned
                    self._enforce_cpu_limit()
                return entry.weights is not None
        return False

    def release(self, entry: AdapterEntry) -> None:
        """A request on ``entry`` ended (finished, aborted or failed)."""
        with self._lock:
            if self._by_hash.get(entry.content_hash) is not entry:
                raise ValueError(
                    f"release of an adapter identity the registry does not hold ({entry.content_hash[:12]})"
                )
            if entry.in_flight <= 0:
                raise ValueError(f"release without acquire on adapter {entry.content_hash[:12]}")
            entry.in_flight -= 1
            if entry.in_flight == 0:
                self._busy.discard(entry)
            if not self._maybe_free(entry):
                self._enforce_cpu_limit()

    # ---- device slots (called by the scheduler / runner each step) ----------------------------

    def try_reserve(self, entry: AdapterEntry, pinned: set[str]) -> tuple[int, AdapterEntry | None] | None:
        """Put ``entry`` on a device slot for this step.

        Returns ``(slot, evicted)``: the entry's current slot (``evicted`` None), else a free slot, else
        the least recently used slot whose adapter's hash is not in ``pinned`` (the hashes already in
        this step's batch); ``evicted`` is the entry that lost it. None when every slot is pinned (or
        ``max_loras`` is 0). Calls ``on_slot_assigned(slot, weights)`` for a new assignment.
        Raises AdapterError if the entry had to be reloaded from disk and that failed.
        """
        with self._lock:
            if self._by_hash.get(entry.content_hash) is not entry:
                raise ValueError(f"adapter identity {entry.content_hash[:12]} is not held by the registry")
            if entry.slot is not None:
                self._touch(entry)
                return entry.slot, None
            free = next((i for i, e in enumerate(self._slots) if e is None), None)
            victim: AdapterEntry | None = None
            if free is None:
                candidates = [e for e in self._slots if e is not None and e.content_hash not in pinned]
                if not candidates:
                    return None
                victim = min(candidates, key=lambda e: e.last_used)
            weights = self._ensure_loaded(entry)  # before evicting: a failed reload changes nothing
            if victim is not None:
                assert victim.slot is not None
                free = victim.slot
                self._slots[free] = None
                victim.slot = None
            assert free is not None
            try:
                if self._on_slot_assigned is not None:
                    # A failing upload leaves the slot free (its old content is gone either way).
                    self._on_slot_assigned(free, weights)
                self._slots[free] = entry
                entry.slot = free
                self._touch(entry)
            finally:
                self.listing_version += 1  # (a victim lost its slot even if the upload failed)
                self._enforce_cpu_limit()
            return free, victim

    # ---- introspection --------------------------------------------------------------------------

    def list(self) -> list[AdapterInfo]:
        """One row per registered name, sorted by name."""
        with self._lock:
            rows = self._cached_listing()[1]
            busy = self.in_flight_by_name()
            if not busy:
                return list(rows)
            return [dataclasses.replace(r, in_flight=busy[r.name]) if r.name in busy else r for r in rows]

    def listing(self) -> tuple[int, list[AdapterInfo]]:
        """``(listing_version, rows)``: ``list()`` with ``in_flight`` 0 in every row, rebuilt only
        when ``listing_version`` moved (the list is shared: do not mutate it)."""
        with self._lock:
            return self._cached_listing()

    def in_flight_by_name(self) -> dict[str, int]:
        """The registered names whose identity has requests in flight, and how many."""
        with self._lock:
            return {n: e.in_flight for e in self._busy for n in e.names}

    def tiers(self) -> dict[str, str]:
        """Each registered name's tier (``list()``'s, without building every adapter's info)."""
        with self._lock:
            if self._tiers is None or self._tiers[0] != self.listing_version:
                self._tiers = (self.listing_version, {n: e.tier for n, e in sorted(self._names.items())})
            return dict(self._tiers[1])

    def _cached_listing(self) -> tuple[int, list[AdapterInfo]]:
        if self._listing is None or self._listing[0] != self.listing_version:
            rows = [
                AdapterInfo(
                    name=n,
                    path=self._paths[n],
                    rank=e.rank,
                    content_hash=e.content_hash,
                    target_modules=tuple(sorted(e.target_modules)),
                    tier=e.tier,
                    slot=e.slot,
                    in_flight=0,
                )
                for n, e in sorted(self._names.items())
            ]
            self._listing = (self.listing_version, rows)
        return self._listing

    def stats(self) -> dict[str, Any]:
        """Counters for metrics (``vllm:lora_requests_info`` and friends)."""
        with self._lock:
            entries = self._by_hash.values()
            return {
                "adapters_registered": len(self._names),
                "identities": len(self._by_hash),
                "cpu_loaded": sum(1 for e in entries if e.weights is not None),
                "cpu_bytes": sum(e.weights.nbytes() for e in entries if e.weights is not None),
                "slots_used": sum(1 for e in self._slots if e is not None),
                "max_loras": self.max_loras,
                "max_cpu_loras": self.max_cpu_loras,
                "in_flight": {e.content_hash: e.in_flight for e in entries},
                "in_flight_by_name": {n: e.in_flight for n, e in sorted(self._names.items())},
            }

    def check_invariants(self) -> None:
        """Raise ValueError when slots, names, refcounts or tiers are inconsistent."""
        with self._lock:
            if len(self._slots) != self.max_loras:
                raise ValueError(f"{len(self._slots)} slots for max_loras={self.max_loras}")
            for i, e in enumerate(self._slots):
                if e is None:
                    continue
                if self._by_hash.get(e.content_hash) is not e:
                    raise ValueError(
                        f"slot {i} holds an identity the registry no longer has ({e.content_hash[:12]})"
                    )
                if e.slot != i:
                    raise ValueError(f"slot {i} holds {e.content_hash[:12]} whose slot is {e.slot}")
            if set(self._names) != set(self._paths):
                raise ValueError("name and path tables differ")
            if any(self._by_hash.get(e.content_hash) is not e for e in self._busy):
                raise ValueError("an identity the registry no longer holds is counted as busy")
            for n, e in self._names.items():
                if self._by_hash.get(e.content_hash) is not e or n not in e.names:
                    raise ValueError(f"name {n!r} points at an inconsistent identity {e.content_hash[:12]}")
            for h, e in self._by_hash.items():
                if e.content_hash != h:
                    raise ValueError(f"identity keyed {h[:12]} has hash {e.content_hash[:12]}")
                if any(self._names.get(n) is not e for n in e.names):
                    raise ValueError(f"identity {h[:12]} lists names {sorted(e.names)} that point elsewhere")
                if e.in_flight < 0:
                    raise ValueError(f"identity {h[:12]} has in_flight={e.in_flight}")
                if (e in self._busy) != (e.in_flight > 0):
                    raise ValueError(f"identity {h[:12]} with in_flight={e.in_flight} is misfiled as busy")
                if not e.names and e.in_flight == 0:
                    raise ValueError(f"identity {h[:12]} has no name and no request but was not freed")
                if e.slot is not None and (not 0 <= e.slot < self.max_loras or self._slots[e.slot] is not e):
                    raise ValueError(f"identity {h[:12]} claims slot {e.slot} it does not hold")
                if e.weights is None and (e.slot is not None or e.in_flight > 0):
                    raise ValueError(f"identity {h[:12]} is on a slot or in flight without host weights")
                if e.weights is not None and e.weights.content_hash != h:
                    raise ValueError(f"identity {h[:12]} holds weights of {e.weights.content_hash[:12]}")
            loaded = [e for e in self._by_hash.values() if e.weights is not None]
            if len(loaded) > self.max_cpu_loras and any(self._cpu_evictable(e) for e in loaded):
                raise ValueError(
                    f"{len(loaded)} identities in host memory > max_cpu_loras={self.max_cpu_loras}"
                )

    # ---- internals (lock held) ------------------------------------------------------------------

    def _touch(self, entry: AdapterEntry) -> None:
        self._clock += 1
        entry.last_used = self._clock

    def _not_found(self, name: str) -> AdapterNotFoundError:
        known = sorted(self._names)
        return AdapterNotFoundError(f"adapter {name!r} is not loaded; known adapters: {known}")

    def _detach_name(self, name: str, entry: AdapterEntry) -> None:
        self.listing_version += 1
        del self._names[name]
        gone_path = self._paths.pop(name)
        entry.names.discard(name)
        if entry.path == gone_path and entry.names:
            # Reload from a path some remaining name still vouches for.
            entry.path = self._paths[min(entry.names)]
        self._maybe_free(entry)

    def _maybe_free(self, entry: AdapterEntry) -> bool:
        if entry.names or entry.in_flight > 0:
            return False
        if entry.slot is not None and self._slots[entry.slot] is entry:
            self._slots[entry.slot] = None
        entry.slot = None
        entry.weights = None
        del self._by_hash[entry.content_hash]
        return True

    def _ensure_loaded(self, entry: AdapterEntry) -> LoRAWeights:
        if entry.weights is not None:
            return entry.weights
        # The entry's folder first, then those of its other names (same content): any one that
        # still holds it will do.
        paths = [entry.path, *sorted({self._paths[n] for n in entry.names} - {entry.path})]
        first: AdapterError | None = None
        for path in paths:
            try:
                w = self._loader(path)
            except AdapterError as e:  # the loader names the folder only: name the adapter too
                msg = str(e).removeprefix(f"{path}: ")
                first = first or AdapterError(
                    f"{path}: reloading adapter {sorted(entry.names)} failed: {msg}"
                )
                continue
            except Exception as e:  # the loader's own failure, with the adapter named
                first = first or AdapterError(f"{path}: reloading adapter {sorted(entry.names)} failed: {e}")
                continue
            if w.content_hash != entry.content_hash:
                first = first or AdapterError(
                    f"{path}: adapter {sorted(entry.names)} changed on disk since it was registered "
                    f"(hash {w.content_hash[:12]} != {entry.content_hash[:12]}); load it again under a name"
                )
                continue
            # No CPU-limit enforcement here: the caller pins the entry (in flight / slot) first.
            entry.path = path
            entry.weights = w
            self.listing_version += 1
            self._touch(entry)
            return w
        assert first is not None
        raise first

    def _cpu_evictable(self, entry: AdapterEntry) -> bool:
        return entry.weights is not None and entry.slot is None and entry.in_flight == 0

    def _enforce_cpu_limit(self) -> None:
        loaded = [e for e in self._by_hash.values() if e.weights is not None]
        excess = len(loaded) - self.max_cpu_loras
        if excess <= 0:
            return
        # Soft limit: identities on a slot or with requests in flight keep their tensors.
        for e in sorted((e for e in loaded if self._cpu_evictable(e)), key=lambda e: e.last_used)[:excess]:
            e.weights = None
            self.listing_version += 1
