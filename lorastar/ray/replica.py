"""The replica deployment: one engine + the plugin's OpenAI routes, adapters multiplexed by Ray.

Adapters named in a request are loaded on first use from ``adapter_root`` through
``@serve.multiplexed(max_num_models_per_replica=engine.max_loras)``: Ray keeps at most
``max_loras`` per replica (LRU), reports which ones each replica holds to its router, and routes a
request whose handle carries ``multiplexed_model_id`` to a replica already holding that adapter.

Invariants:
* The engine holds exactly the adapters in Ray's multiplex cache (plus ``config.adapters``, which
  every replica loads at start and never evicts), so every held adapter fits a device slot.
* An evicted adapter is unloaded from the engine only after its in-flight requests finished, and
  never when the name was loaded again meanwhile (a newer :class:`ResidentAdapter` owns it).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from ray import serve

from lorastar.plugin import LoraStarConfig, LoraStarPlugin, create_app
from lorastar.plugin.asgi_call import Headers, ResponseStart, call_asgi, http_scope
from lorastar.plugin.errors import APIError, to_api_error
from lorastar.plugin.service import confine

REPLICA_HEADER = "x-lorastar-replica"
LOADS_HEADER = "x-lorastar-adapter-loads"
ENGINE_ADAPTERS_HEADER = "x-lorastar-engine-adapters"


class ResidentAdapter:
    """One adapter in the multiplex cache. Ray awaits ``__del__`` (an instance attribute, so
    garbage collection never calls it) when it evicts the adapter."""

    def __init__(self, replica: ReplicaBase, name: str) -> None:
        self.replica = replica
        self.name = name
        self.in_flight = 0
        self.evicted = False
        self.drained = asyncio.Event()
        self.drained.set()
        self.__del__ = self._evict

    def acquire(self) -> bool:
        """Pin for one request; ``False`` once evicted (the caller asks the cache again)."""
        if self.evicted:
            return False
        self.in_flight += 1
        self.drained.clear()
        return True

    def release(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self.drained.set()

    async def _evict(self) -> None:
        self.evicted = True
        await self.drained.wait()
        await self.replica.unload_if_current(self)


class ReplicaBase:
    """What every replica does; :func:`replica_class` adds the multiplexed loader sized by ``max_loras``."""

    async def __init__(self, config: LoraStarConfig) -> None:
        # Adapters come only through the multiplex cache: the resolver and the admin routes would
        # load behind Ray's back (and on one replica only).
        self.config = dataclasses.replace(
            config, enable_adapter_resolver=False, allow_runtime_adapter_loading=False
        )
        self.adapter_root = self.config.resolved_adapter_root()
        self.app = create_app(self.config)
        self._lifespan = self.app.lifespan()
        await self._lifespan.__aenter__()
        self.plugin = self.app.plugins.get(LoraStarPlugin)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.adapter_loads = 0
        self.adapter_unloads = 0
        self.resident: dict[str, ResidentAdapter] = {}
        self.__del__ = self._shutdown  # Serve awaits it at replica shutdown; GC never calls it

    async def get_adapter(self, name: str) -> ResidentAdapter:  # replaced by the multiplexed loader
        raise NotImplementedError

    async def load_adapter(self, name: str) -> ResidentAdapter:
        """Ray's multiplex loader: read ``adapter_root/name`` into the engine."""
        path = confine(self.adapter_root, name, param="model")
        await self.plugin.engine.load_adapter(name, str(path))
        self.adapter_loads += 1
        resident = ResidentAdapter(self, name)
        self.resident[name] = resident
        return resident

    async def unload_if_current(self, resident: ResidentAdapter) -> None:
        if self.resident.get(resident.name) is resident:
            del self.resident[resident.name]
            await self.plugin.engine.unload_adapter(resident.name)
            self.adapter_unloads += 1

    def is_loadable(self, name: str) -> bool:
        """``name`` is a folder under the adapter root (else the routes answer 404 themselves)."""
        if name in self.config.adapters:
            return False
        try:
            confine(self.adapter_root, name, param="model")
        except APIError:
            return False
        return True

    async def handle_http(
        self, adapter: str | None, method: str, path: str, query_string: bytes, headers: Headers, body: bytes
    ) -> AsyncIterator[ResponseStart | bytes]:
        """Serve one HTTP request with the plugin's app; ``adapter`` is pinned while it runs.

        An adapter that fails to load (bad folder, rank above ``max_lora_rank``) is answered with
        the plugin's OpenAI error, as the plugin answers a failed runtime load."""
        resident = None
        try:
            if adapter and self.is_loadable(adapter):
                while not (resident := await self.get_adapter(adapter)).acquire():
                    await asyncio.sleep(0)  # evicted between load and pin: load it again
        except Exception as exc:
            error = to_api_error(exc)
            error_headers = [(b"content-type", b"application/json"), *self._headers()]
            error_headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
            yield ResponseStart(error.status_code, error_headers)
            yield msgspec.json.encode(error.body())
            return
        try:
            extra = self._headers()
            scope = http_scope(method, path, query_string, headers)
            async for item in call_asgi(self.app, scope, body):
                if isinstance(item, ResponseStart):
                    item = ResponseStart(item.status, item.headers + extra)
                yield item
        finally:
            if resident is not None:
                resident.release()

    def _headers(self) -> Headers:
        return [
            (REPLICA_HEADER.encode(), self.replica_id.encode()),
            (LOADS_HEADER.encode(), str(self.adapter_loads).encode()),
            (ENGINE_ADAPTERS_HEADER.encode(), ",".join(self.engine_adapters()).encode()),
        ]

    def stats(self) -> dict[str, Any]:
        """This replica's adapter counters (also sent on every response as headers)."""
        return {
            "replica": self.replica_id,
            "adapter_loads": self.adapter_loads,
            "adapter_unloads": self.adapter_unloads,
            "resident": sorted(self.resident),
            "engine_adapters": self.engine_adapters(),
        }

    def engine_adapters(self) -> list[str]:
        return sorted(a.name for a in self.plugin.engine.list_adapters())

    async def _shutdown(self) -> None:
        await self._lifespan.__aexit__(None, None, None)


def replica_class(max_loras: int) -> type[ReplicaBase]:
    """A replica class whose multiplex cache holds ``max_loras`` adapters (the engine's slots)."""

    class LoraStarReplica(ReplicaBase):
        @serve.multiplexed(max_num_models_per_replica=max_loras)
        async def get_adapter(self, name: str) -> ResidentAdapter:
            return await self.load_adapter(name)

    return LoraStarReplica
