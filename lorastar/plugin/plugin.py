"""LoraStarPlugin: mounts lorastar's OpenAI routes, engine lifespan, metrics and CLI into a Litestar app."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any

from litestar import Controller, Litestar, Router
from litestar.di import Provide
from litestar.exceptions import (
    HTTPException,
    MethodNotAllowedException,
    NotFoundException,
)
from litestar.handlers import HTTPRouteHandler
from litestar.plugins import CLIPlugin, InitPlugin
from litestar.utils.path import join_paths, normalize_path

from lorastar.errors import LoraStarError, StartupCancelled
from lorastar.plugin.config import LoraStarConfig
from lorastar.plugin.errors import APIError, handler_map, make_exception_handler, scoped_handler, unauthorized
from lorastar.plugin.lora_cli import make_lora_group
from lorastar.plugin.request_id import request_id_hook
from lorastar.plugin.routes.admin import (
    bearer_token,
    build_admin_handlers,
    build_reset_prefix_cache_handler,
    token_matches,
)
from lorastar.plugin.routes.openai import build_openai_handlers
from lorastar.plugin.routes.ops import build_ops_handlers
from lorastar.plugin.routes.sagemaker import build_invocations_handler
from lorastar.plugin.routes.system import (
    build_health_handler,
    build_load_handler,
    build_metrics_handler,
    load_tracking,
)
from lorastar.plugin.routes.tokenize import build_tokenize_handlers
from lorastar.plugin.service import LoraStarService
from lorastar.plugin.shutdown import drain_on_signal
from lorastar.plugin.startup_log import log_startup
from lorastar.plugin.stats_log import log_stats_every

logger = logging.getLogger("lorastar.plugin")

if TYPE_CHECKING:
    from click import Group
    from litestar.config.app import AppConfig
    from litestar.connection import ASGIConnection
    from litestar.handlers.base import BaseRouteHandler


def _app_routes(handlers: list[Any]) -> set[tuple[str, str]]:
    """``(path, method)`` the app's own handlers, routers and controllers serve (before the plugin's;
    OPTIONS, which Litestar answers on every path, left out)."""
    out: set[tuple[str, str]] = set()
    for h in handlers:
        if isinstance(h, Router):
            out |= {(normalize_path(r.path), m) for r in h.routes for m in getattr(r, "methods", ())}
        elif isinstance(h, type) and issubclass(h, Controller):
            for name in dir(h):
                v = getattr(h, name, None)
                if isinstance(v, HTTPRouteHandler):
                    out |= {(join_paths([h.path, p]), m) for p in v.paths for m in v.http_methods}
        elif isinstance(h, HTTPRouteHandler):
            out |= {(normalize_path(p), m) for p in h.paths for m in h.http_methods}
    return {(p, m) for p, m in out if m != "OPTIONS"}


class LoraStarPlugin(InitPlugin, CLIPlugin):
    """Serve one base model + LoRA adapters over the OpenAI API inside an existing Litestar app.

    ``app.plugins.get(LoraStarPlugin).engine`` is the running ``AsyncLLM`` (also injected into the
    app's handlers as the ``lorastar_engine`` dependency).
    """

    __slots__ = ("config", "public_url", "service")

    def __init__(self, config: LoraStarConfig | None = None, **kwargs: Any) -> None:
        if config is not None and kwargs:
            raise ValueError("pass either a LoraStarConfig or keyword options, not both")
        self.config = config if config is not None else LoraStarConfig(**kwargs)
        self.service = LoraStarService(self.config)
        self.public_url: str | None = None  # logged at start-up when set (``lorastar serve`` sets it)

    @property
    def engine(self) -> Any:
        """The ``AsyncLLM`` (``None`` until the app's lifespan started it)."""
        return self.service.engine

    # ------------------------------------------------------------------ app

    def on_app_init(self, app_config: AppConfig) -> AppConfig:
        cfg, service = self.config, self.service
        handler = make_exception_handler(cfg.retry_after_seconds)
        own_handlers = handler_map(handler)
        api_guards = [_api_key_guard(list(cfg.api_keys))] if cfg.api_keys else []
        route_handlers: list[Any] = build_openai_handlers(service, guards=api_guards)
        if cfg.allow_runtime_adapter_loading:
            route_handlers += build_admin_handlers(service)
        app_config.route_handlers.append(
            Router(
                path=cfg.path,
                route_handlers=route_handlers,
                exception_handlers=own_handlers,
                include_in_schema=cfg.include_in_schema,
                tags=["lorastar"],
                middleware=[load_tracking(service, cfg.path)] if cfg.enable_server_load_tracking else [],
            )
        )
        system: list[Any] = []
        if cfg.health_path:
            system.append(build_health_handler(service, cfg.health_path, cfg.include_in_schema))
        if cfg.metrics_path:
            metrics_guards = api_guards if cfg.metrics_require_api_key else []
            if cfg.metrics_require_api_key and not cfg.api_keys:  # nothing to guard it with
                logger.warning(
                    "lorastar: metrics_require_api_key without api_keys: %s stays open", cfg.metrics_path
                )
            system.append(
                build_metrics_handler(service, cfg.metrics_path, cfg.include_in_schema, metrics_guards)
            )
        if cfg.sagemaker_routes:
            system.append(build_health_handler(service, "/ping", cfg.include_in_schema, ("GET", "POST")))
            system.append(build_invocations_handler(cfg.path))
        if cfg.enable_server_load_tracking:
            system.append(build_load_handler(service, cfg.include_in_schema))
        system.append(build_reset_prefix_cache_handler(service))  # admin token
        system += build_tokenize_handlers(service, guards=api_guards)  # vLLM serves these at the root
        system += build_ops_handlers(service, guards=api_guards)  # the live page: /lorastar/
        # The app's own route on a path of ours (its /health, say) wins: ours would stop it starting.
        taken = _app_routes(app_config.route_handlers)
        for h in list(system):
            if clash := sorted(taken & _app_routes([h])):
                system.remove(h)
                logger.warning(
                    "lorastar: the app serves %s itself; lorastar's route there is not mounted", clash[0][0]
                )
        if system:
            app_config.route_handlers.append(
                Router(
                    path="/",
                    route_handlers=system,
                    exception_handlers=own_handlers,
                    include_in_schema=cfg.include_in_schema,  # /tokenize, /version, ... too
                    tags=["lorastar"],
                )
            )

        if cfg.enable_request_id_headers:
            app_config.before_send.append(request_id_hook([cfg.path, *(p for p, _ in _app_routes(system))]))

        def provide_engine() -> Any:
            return service.engine

        # Only where the app has none of its own: never override the user's choices.
        app_config.dependencies.setdefault(
            cfg.engine_dependency_key, Provide(provide_engine, sync_to_thread=False)
        )
        app_config.exception_handlers.setdefault(LoraStarError, handler)
        app_config.exception_handlers.setdefault(APIError, handler)
        prefixes = tuple(p for p in (cfg.path, cfg.health_path, cfg.metrics_path) if p)
        for status in (404, 405):
            fallback = app_config.exception_handlers.get(status) or _class_handler(
                app_config.exception_handlers, status
            )
            app_config.exception_handlers[status] = scoped_handler(prefixes, handler, fallback)
        app_config.lifespan.append(self._lifespan)
        return app_config

    @asynccontextmanager
    async def _lifespan(self, _app: Litestar) -> AsyncIterator[None]:
        try:
            await self.service.start()
        except StartupCancelled as exc:  # Ctrl-C while waiting for a shared core: stop quietly
            logger.warning("lorastar: %s; not serving", exc)
            try:
                yield  # (the server is already stopping; a request would start the engine lazily)
            finally:
                await self.service.stop()
            return
        log_startup(self.service.engine, self.service.served_model_name, self.public_url)
        interval = self.config.log_stats_interval
        stats_log = None
        if interval is not None and self.service.engine is not None:
            stats_log = asyncio.create_task(log_stats_every(interval, self.service.engine))
        try:
            with drain_on_signal(self.service, self.config.shutdown_drain_timeout):
                yield
        finally:
            if stats_log is not None:
                stats_log.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await stats_log
            await self.service.stop()

    # ------------------------------------------------------------------ CLI

    def on_cli_init(self, cli: Group) -> None:
        cli.add_command(make_lora_group(plugin_path=self.config.path))


def _class_handler(handlers: dict[Any, Any], status: int) -> Any:
    """The app's own handler for the exception Litestar raises with ``status``, if it has one."""
    exc_type = NotFoundException if status == 404 else MethodNotAllowedException
    for cls in exc_type.__mro__:
        if cls in handlers:
            return handlers[cls]
    return None


def _api_key_guard(keys: list[str]) -> Any:
    # A plain closure, not a bound method: Litestar deep-copies routers, and a bound method would
    # drag the whole plugin (engine, metric locks) into the copy.
    def guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
        # OpenAI's clients send `Authorization: Bearer KEY`; Anthropic's `x-api-key: KEY`.
        token = bearer_token(connection) or connection.headers.get("x-api-key") or None
        if not token_matches(token, keys):
            raise unauthorized("Invalid or missing API key.")

    return guard


def create_app(config: LoraStarConfig | None = None, **litestar_kwargs: Any) -> Litestar:
    """The plugin's routes as a standalone Litestar (ASGI) app, e.g. for ``starlette_app.mount("/llm", ...)``.

    Starlette's ``Mount`` does not forward lifespan events to a mounted app: run this app's lifespan
    from the parent's, ``Starlette(..., lifespan=lambda _: lorastar.plugin.lifespan(llm_app))``.
    Without that the engine starts lazily on the first request (and is never shut down cleanly).
    """
    cfg = config if config is not None else LoraStarConfig()
    handler = make_exception_handler(cfg.retry_after_seconds)
    plugins = [LoraStarPlugin(cfg), *litestar_kwargs.pop("plugins", [])]
    exception_handlers = {HTTPException: handler, **litestar_kwargs.pop("exception_handlers", {})}
    return Litestar(plugins=plugins, exception_handlers=exception_handlers, **litestar_kwargs)


@asynccontextmanager
async def lifespan(*apps: Litestar) -> AsyncIterator[None]:
    """Run the lifespan of one or more apps from :func:`create_app` (for frameworks that mount them)."""
    async with AsyncExitStack() as stack:
        for app in apps:
            await stack.enter_async_context(app.lifespan())
        yield
