"""The plugin's runtime: owns the ``AsyncLLM``, resolves ``model`` names, tracks metrics.

One ``LoraStarService`` per plugin instance; the route handlers are closures over it, so several
apps (or several plugins in one app) never share state by accident.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import anyio

from lorastar.engine.outputs import RequestOutput
from lorastar.engine.sampling import MAX_THINKING_MESSAGE, RequestOutputKind
from lorastar.errors import AdapterError, EngineDeadError, EngineUnavailableError
from lorastar.hub import is_hub_id, model_folder_name, snapshot_hub_id
from lorastar.plugin.config import LoraStarConfig
from lorastar.plugin.engine_client import EngineClient
from lorastar.plugin.errors import APIError, forbidden, not_found
from lorastar.plugin.metrics import PluginMetrics, RequestTimer

logger = logging.getLogger("lorastar.plugin")
request_logger = logging.getLogger("lorastar.requests")  # LoraStarConfig.log_requests


def confine(root: Path | None, path: str, *, param: str = "lora_path") -> Path:
    """``path`` resolved (relative paths are taken under ``root``): 403 unless it stays inside
    ``root``, 400 unless it is a folder.

    ``resolve()`` follows symlinks and folds ``..``, so both escapes end outside the root.
    """
    if root is None:
        raise forbidden("Runtime adapter loading needs adapter_root to be configured.", param)
    if not path or "\x00" in path:
        raise APIError(f"{param} must be a non-empty path.", param=param)
    try:
        p = Path(path).expanduser()
        if not p.is_absolute():
            p = root / p
        resolved = p.resolve()
        inside = resolved.is_relative_to(root)
        is_dir = inside and resolved.is_dir()
    except (OSError, RuntimeError, ValueError) as exc:  # name too long, symlink loop: the client's input
        raise APIError(f"{param} cannot be resolved ({type(exc).__name__}).", param=param) from exc
    if not inside:
        raise forbidden(f"{param} must be inside the adapter root.", param)
    if not is_dir:
        raise APIError(f"{param} does not name an adapter folder: {path}", param=param)
    return resolved


def relative_to_root(root: Path | None, path: str | Path) -> str:
    """``path`` as API users may see it: relative to ``root`` when under it, the hub id of a
    Hugging Face cache snapshot, else its folder name (absolute server paths are never shown)."""
    p = Path(path)
    if root is not None and p.is_absolute() and p.is_relative_to(root):
        return p.relative_to(root).as_posix()
    return snapshot_hub_id(p) or p.name


def build_engine(config: Any) -> EngineClient:
    """Build the ``AsyncLLM`` (blocking: loads the weights)."""
    from lorastar import AsyncLLM  # deferred: importing the engine pulls in torch

    return AsyncLLM(config)


def build_core_client(config: Any, address: str | None) -> EngineClient:
    """A client of an engine core process (blocking until the core is ready): one spawned now
    (``address=None``), or the ``lorastar engine`` listening at ``address``."""
    from lorastar.engine.core_client import AsyncCoreClient

    return AsyncCoreClient(config, address=address)


class LoraStarService:
    """Engine lifecycle + model-name resolution for one plugin instance."""

    def __init__(self, config: LoraStarConfig) -> None:
        self.config = config
        self.engine: EngineClient | None = config.async_engine
        self._owns_engine = config.async_engine is None
        self._started = False
        self._closed = False  # after stop(): no lazy restart, requests get 503
        self._start_lock: asyncio.Lock | None = None
        # adapter_lock(name); weak: a lock lives while a caller holds it (one per name ever
        # loaded or tried would grow without bound)
        self._adapter_locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self.created = int(time.time())
        # generation requests being answered (LoraStarConfig.enable_server_load_tracking)
        self.server_load = 0
        self.adapter_created: dict[str, int] = {}
        # config.thinking_budget_message's token ids, encoded at start (None: no message)
        self.thinking_message_ids: list[int] | None = None
        self.admin_token = config.resolved_admin_token()
        self.adapter_root = config.resolved_adapter_root()
        self.metrics = PluginMetrics(self._stats, lambda: self.served_model_name, self._max_loras)
        # The base's Hugging Face id (a model given as one, or its cache snapshot), when no
        # served_model_name replaces the default name: it selects the base too (resolve_model).
        model = None if config.served_model_name else config.model or config.engine.model
        self._hub_id: str | None = None
        if model:
            self._hub_id = str(model) if is_hub_id(str(model)) else snapshot_hub_id(model)

    # ------------------------------------------------------------------ lifecycle

    @property
    def started(self) -> bool:
        return self._started

    @property
    def default_sampling(self) -> dict[str, Any]:
        """The engine's sampling defaults from ``generation_config.json`` (vLLM's
        ``--generation-config auto``): for the fields a request leaves unset. An engine client
        without them (an older or a test one) has none."""
        return getattr(self.engine, "default_sampling", None) or {}

    @property
    def closed(self) -> bool:
        """Shutdown has begun (or ended): requests get 503."""
        return self._closed

    @property
    def served_model_name(self) -> str:
        """The base's name in responses to requests without ``model``, in metrics and as adapters'
        ``parent``: the first of ``served_model_names``."""
        return self.served_model_names[0]

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """Every name that selects the base (``config.served_model_name``'s, or the model's)."""
        names = self.config.served_model_name
        if isinstance(names, (list, tuple)):
            return tuple(names)
        return (names or self._default_model_name(),)

    def _default_model_name(self) -> str:
        if self.engine is not None:
            return self.engine.model_name
        model = self.config.model or self.config.engine.model
        return model_folder_name(model) if model else "SmolLM2-135M-Instruct"

    async def start(self) -> None:
        """Build the engine (in a thread: loading is blocking), start its loop, load ``config.adapters``."""
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if self._started:
                return
            self._closed = False
            if self.engine is None:
                cfg = self.config
                if cfg.engine_process or cfg.engine_address is not None:
                    self.engine = await asyncio.to_thread(
                        build_core_client, cfg.engine_config(), cfg.engine_address
                    )
                else:
                    self.engine = await asyncio.to_thread(build_engine, cfg.engine_config())
            await self.engine.start()
            try:
                loaded = {a.name for a in self.engine.list_adapters()}
                for name, path in self.config.adapters.items():
                    if name in self.served_model_names:
                        raise ValueError(f"adapters: {name!r} is the base model's served name")
                    if name not in loaded:
                        await self.engine.load_adapter(name, str(Path(path).expanduser()))
                    self.adapter_created.setdefault(name, int(time.time()))
                if (message := self.config.thinking_budget_message) is not None:
                    ids = list(self.engine.tokenizer.encode(message, add_special_tokens=False))
                    if not 0 < len(ids) <= MAX_THINKING_MESSAGE:
                        raise ValueError(
                            f"thinking_budget_message is {len(ids)} tokens for this tokenizer: "
                            f"1 to {MAX_THINKING_MESSAGE} are allowed"
                        )
                    self.thinking_message_ids = ids
            except BaseException:
                if self._owns_engine:  # a failed startup must not leave the engine loop running
                    await self.engine.shutdown(drain_timeout=0)
                raise
            if self.admin_token is None and self.config.allow_runtime_adapter_loading:
                logger.warning(
                    "lorastar: no admin_token (or LORASTAR_ADMIN_TOKEN): admin routes refuse every request"
                )
            self._started = True

    def refuse_new_requests(self) -> None:
        """Shutdown has begun: new requests get 503 while in-flight ones drain."""
        self._closed = True

    async def stop(self) -> None:
        """Let in-flight requests finish (up to ``shutdown_drain_timeout``), then stop an engine we own."""
        self._closed = True
        if not self._started:
            return
        self._started = False
        if self._owns_engine and self.engine is not None:
            await self.engine.shutdown(drain_timeout=self.config.shutdown_drain_timeout)

    async def ready(self) -> EngineClient:
        """The running engine. Starts it on first use when no lifespan ran (e.g. under a Starlette Mount)."""
        if self._closed:  # Retry-After: a client or balancer retries (elsewhere) instead of failing
            raise APIError(
                "The server is shutting down.",
                503,
                headers={"Retry-After": str(self.config.retry_after_seconds)},
            )
        if not self._started:
            logger.warning(
                "lorastar: engine started lazily; run the app's lifespan (see lorastar.plugin.lifespan)"
            )
            await self.start()
        assert self.engine is not None  # start() built or was given one
        if self.engine.errored:
            raise EngineDeadError("The engine has stopped; the server cannot serve requests.")
        if self.engine.restarting:
            raise EngineUnavailableError(
                "The engine is restarting after a failure; retry shortly.", self.engine.retry_after
            )
        return self.engine

    def healthy(self) -> bool:
        return (
            self._started
            and not self._closed  # draining: out of rotation at once
            and self.engine is not None
            and not self.engine.errored
            and not self.engine.restarting
        )

    def _stats(self) -> Any:
        if not self._started or self.engine is None:
            return None
        try:
            return self.engine.stats()
        except Exception:  # a scrape must never fail because the engine is shutting down
            logger.debug("lorastar: stats() failed", exc_info=True)
            return None

    def _max_loras(self) -> int:
        return int(self.config.engine.max_loras)

    def scrub_paths(self, message: str) -> str:
        """``message`` with the server's adapter root cut from file paths (clients see paths
        relative to the root, as they send them)."""
        root = self.adapter_root
        if root is None:
            return message
        return message.replace(f"{root}/", "").replace(str(root), ".")

    # ------------------------------------------------------------------ model names

    def adapter_names(self) -> list[str]:
        return [a.name for a in self.engine.list_adapters()] if self.engine is not None else []

    def has_adapter(self, name: str) -> bool:
        """Whether the engine holds adapter ``name``: asked directly where the engine can say
        (listing builds every adapter's info, per request, however many are loaded)."""
        has = getattr(self.engine, "has_adapter", None)
        return has(name) if has is not None else name in self.adapter_names()

    async def resolve_model(self, model: str | None) -> str | None:
        """The adapter a request's ``model`` selects (``None``: the base). 404 when unknown."""
        if not model or model in self.served_model_names:
            return None
        if self.has_adapter(model):
            return model
        if model == self._hub_id:  # vLLM serves `org/name` as `org/name`: its clients send that
            return None
        if self.config.enable_adapter_resolver and self.adapter_root is not None:
            if await self._resolve_from_root(model):
                return model
        raise not_found(f"The model `{model}` does not exist.", "model")

    async def resolve_adapter(self, model: str | None, adapter_id: str | None) -> str | None:
        """The adapter a request selects: by ``model`` (vLLM), or by LoRAX's ``adapter_id`` (404 when
        unknown, 400 when it contradicts an adapter named by ``model``, both naming ``adapter_id``)."""
        adapter = await self.resolve_model(model)
        if adapter_id is None:
            return adapter
        if adapter is not None and adapter != adapter_id:
            raise APIError(
                f"adapter_id '{adapter_id}' does not match the adapter '{adapter}' named by model.",
                param="adapter_id",
            )
        try:
            return await self.resolve_model(adapter_id)
        except APIError as exc:
            raise not_found(f"The adapter `{adapter_id}` does not exist.", "adapter_id") from exc

    def adapter_lock(self, name: str) -> asyncio.Lock:
        """The lock held across "is ``name`` loaded?" and its load, by the resolver and the admin
        route alike: two loads of one new name never both go ahead."""
        return self._adapter_locks.setdefault(name, asyncio.Lock())

    async def _resolve_from_root(self, name: str) -> bool:
        # Only a plain folder name directly under the root: no separators, no dot-names.
        if not name or name.startswith(".") or "/" in name or "\\" in name or "\x00" in name:
            return False
        root = self.adapter_root
        assert root is not None
        try:
            candidate = (root / name).resolve()
            if not candidate.is_relative_to(root) or not (candidate / "adapter_config.json").is_file():
                return False
        except (OSError, RuntimeError):  # name too long for the filesystem, symlink loop
            return False
        async with self.adapter_lock(name):  # concurrent first requests load once
            if self.has_adapter(name):
                return True
            try:
                await self.engine.load_adapter(name, str(candidate))
            except AdapterError as exc:
                raise APIError(
                    f"The adapter folder `{name}` could not be loaded: {self.scrub_paths(str(exc))}",
                    param="model",
                ) from exc
            self.adapter_created[name] = int(time.time())
            logger.info("lorastar: resolver loaded adapter %r from %s", name, candidate)
        return True

    # ------------------------------------------------------------------ generation

    async def generate(
        self,
        prompt: str | list[int],
        params: Any,
        adapter: str | None,
        request_id: str,
        priority: int | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """``engine.generate`` plus metrics and a guaranteed abort when the consumer goes away.
        ``priority``: the request's (vLLM's field; None: 0)."""
        engine = self.engine
        label = adapter or self.served_model_name
        self.metrics.request_started(label)
        kind = getattr(params, "output_kind", None)
        # DELTA outputs hold only new tokens, except beam search's: its hypotheses come whole.
        delta = kind == RequestOutputKind.DELTA and not getattr(params, "use_beam_search", False)
        t0 = time.monotonic()
        timer = RequestTimer(self.metrics, t0, delta=delta, final_only=kind == RequestOutputKind.FINAL_ONLY)
        finished = False
        log_requests = self.config.log_requests
        if log_requests:
            self._log_received(request_id, label, prompt, params)
        failure: BaseException | None = None
        try:
            async with aclosing(
                engine.generate(
                    prompt, params, adapter=adapter, request_id=request_id, priority=priority or 0
                )
            ) as gen:
                async for out in gen:
                    now = time.monotonic()
                    ntok = timer.observe(out, now)
                    if out.finished:
                        finished = True
                        reason = next((o.finish_reason for o in out.outputs if o.finish_reason), "unknown")
                        self.metrics.request_finished(
                            label, now - t0, len(out.prompt_token_ids), ntok, reason, out.metrics
                        )
                        if log_requests:
                            request_logger.info(
                                "Finished request %s: %s, %d prompt tokens, %d output tokens, %.3f s",
                                request_id, reason, len(out.prompt_token_ids), ntok, now - t0,
                            )  # fmt: skip
                    yield out
        except Exception as exc:
            failure = exc
            raise
        finally:
            if log_requests and not finished:
                why = "the client went away" if failure is None else f"{type(failure).__name__}: {failure}"
                request_logger.info("Aborted request %s: %s", request_id, why)
            if not finished and engine is not None:
                # The engine aborts on generator close too; this makes it certain (and is a no-op
                # for a finished id). Shielded: under anyio's cancellation every await would raise.
                with anyio.CancelScope(shield=True):
                    try:
                        await engine.abort(request_id)
                    except Exception:
                        logger.debug("lorastar: abort(%s) failed", request_id, exc_info=True)

    def _log_received(self, request_id: str, model: str, prompt: str | list[int], params: Any) -> None:
        """vLLM's ``Received request`` line; prompt text and ids cut at ``max_log_len``."""
        cut = self.config.max_log_len
        ids: list[int] | None = None
        if isinstance(prompt, str):
            text: str | None = prompt
        else:
            ids = list(prompt[:cut] if cut is not None else prompt)
            try:
                text = self.engine.tokenizer.decode(ids)
            except Exception:  # no tokenizer here: the ids say it
                text = None
        if text is not None and cut is not None:
            text = text[:cut]
        request_logger.info(
            "Received request %s: model %r, prompt %r, prompt_token_ids %s, params %s",
            request_id, model, text, ids, params,
        )  # fmt: skip


async def merge_streams(
    streams: list[AsyncIterator[RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several output streams as ``(stream index, output)``; one stream is iterated inline.

    Closing (or cancelling) the merged iterator cancels every producer, which aborts its request.
    """
    if len(streams) == 1:
        async with aclosing(streams[0]) as gen:  # type: ignore[type-var]
            async for out in gen:
                yield 0, out
        return

    queue: asyncio.Queue[tuple[int, RequestOutput | None, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async with aclosing(gen) as g:  # type: ignore[type-var]
                async for out in g:
                    queue.put_nowait((i, out, None))
            queue.put_nowait((i, None, None))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # handed to the consumer, which raises it
            queue.put_nowait((i, None, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, out, exc = await queue.get()
            if exc is not None:
                raise exc
            if out is None:
                remaining -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)


async def wait_for_disconnect(receive: Any) -> None:
    """Return when the client has gone (``http.disconnect``); the request body was already read."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(coro: Any, receive: Any) -> Any:
    """Await ``coro`` unless the client disconnects first; then cancel it (aborting its requests)."""
    work = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work.done():
            work.cancel()
        watcher.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(work, watcher, return_exceptions=True)
    if work.cancelled():
        raise APIError("Client disconnected.", 499, type="ClientDisconnected")
    return work.result()
