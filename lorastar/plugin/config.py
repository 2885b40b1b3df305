"""LoraStarConfig: everything the Litestar plugin needs (one dataclass, a docstring under each field)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorastar.config import EngineConfig
from lorastar.plugin.reasoning import REASONING_PARSERS
from lorastar.plugin.tool_parsers import TOOL_CALL_PARSERS

ADMIN_TOKEN_ENV = "LORASTAR_ADMIN_TOKEN"
# A server's default bound on queued requests (offline LLM.generate queues without bound).
DEFAULT_MAX_WAITING = 256


@dataclass
class LoraStarConfig:
    """How the plugin serves one base model and its LoRA adapters over the OpenAI API.

    Invalid values raise ``ValueError`` naming the field.
    """

    model: str | None = None
    """HF folder of the base model. ``None`` keeps ``engine.model`` (itself ``None``: the embedded
    SmolLM2-135M-Instruct)."""

    served_model_name: str | list[str] | None = None
    """Name clients put in the ``model`` field for the base, or several (vLLM's list): each selects
    the base, the first is the one ``/metrics`` and a request without ``model`` use, and adapters'
    ``parent``. ``None``: the engine's ``model_name`` (the model folder's name)."""

    adapters: dict[str, str] = field(default_factory=dict)
    """Adapters loaded at startup, ``{name: PEFT folder}``. Trusted (written by the operator), so not
    confined to ``adapter_root``. A bad one makes startup fail."""

    adapter_root: str | Path | None = None
    """The only folder runtime loading (``/v1/load_lora_adapter`` and the resolver) may read from.
    ``None``: runtime loading is refused (403)."""

    allow_runtime_adapter_loading: bool = True
    """Mount ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``. ``False``: the routes do not exist."""

    admin_token: str | None = None
    """Bearer token of the admin routes. ``None``: read ``LORASTAR_ADMIN_TOKEN`` from the environment;
    when that is unset too, every admin request is refused (401), never silently open."""

    api_keys: Sequence[str] | None = None
    """Keys accepted on the inference routes (``/models``, ``/completions``, ``/chat/completions``,
    ``/responses``, ``/messages``, ...), sent as ``Authorization: Bearer KEY`` (OpenAI's clients) or
    ``x-api-key: KEY`` (Anthropic's). ``None`` or empty: those routes are open."""

    path: str = "/v1"
    """Prefix of the OpenAI routes."""

    health_path: str | None = "/health"
    """Liveness route (200, or 503 once the engine died). ``None``: not mounted. An app that serves
    this path itself keeps its own route (the plugin's is left out with a warning), as for
    ``metrics_path``, ``/tokenize``, ``/detokenize`` and the live page."""

    metrics_path: str | None = "/metrics"
    """Prometheus route (vLLM's metric names). ``None``: not mounted."""

    metrics_require_api_key: bool = False
    """Guard the metrics route with ``api_keys`` too (scrapers then send ``Authorization: Bearer``).
    ``False``: open, as vLLM's is, for Prometheus and gateways scraping inside the cluster."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    """Engine settings (device, dtype, KV cache, max_loras, ...)."""

    engine_process: bool = False
    """Run the engine core in a process of its own (``AsyncCoreClient``): this process keeps HTTP,
    tokenizing and the streams, so they no longer take turns with the step loop on one GIL
    (see README's serving table). ``False``: the step loop is a thread of this process."""

    engine_address: str | None = None
    """Connect to an engine core started by ``lorastar engine --address ADDR`` (``tcp://127.0.0.1:PORT``
    or ``ipc:///path``) instead of loading the model here: how several app workers share one copy
    of the model. Without it, each worker process loads its own engine. The core's own settings
    (model, KV cache, ...) apply; ``engine`` and ``model`` here are ignored."""

    reasoning_parser: str | None = None
    """Split a thinking model's ``<think>...</think>`` out of chat answers into ``reasoning_content``
    (vLLM's ``--reasoning-parser``): ``"qwen3"`` (Qwen3, SmolLM3: the model opens the block itself)
    or ``"deepseek_r1"`` (DeepSeek-R1 distills, QwQ, Qwen3-Thinking: the prompt opens it).
    ``None``: answers are returned as generated."""

    thinking_budget_message: str | None = None
    """Text written into the thinking block before ``</think>`` when a request's
    ``thinking_token_budget`` (or ``/messages``' ``budget_tokens``) is spent, e.g. Qwen3's
    ``"\n\nConsidering the limited time by the user, I have to give the solution based on the
    thinking directly now.\n"`` (llama.cpp's ``--reasoning-budget-message``): a model told why its
    thinking stops answers better than one cut off mid-thought. ``None``: ``</think>`` alone."""

    enable_auto_tool_choice: bool = False
    """Parse the function calls a model writes into chat answers' ``tool_calls`` when a request sends
    ``tools`` (``tool_choice: "auto"``, its default), with ``tool_call_parser`` (vLLM's
    ``--enable-auto-tool-choice``). ``False``: such a request is 400, as in vLLM."""

    tool_call_parser: str | None = None
    """How calls are written: ``"hermes"`` (``<tool_call>{"name", "arguments"}</tool_call>``: Hermes,
    Qwen2.5, Qwen3, SmolLM3 and fine-tunes of their templates) or ``"llama3_json"`` (an answer of
    ``{"name", "parameters"}`` objects: Llama 3.1-3.3) or ``"mistral"`` (``[TOOL_CALLS]``: Mistral 7B
    v0.3, Nemo, Small 3.x, Ministral 3) or ``"qwen3_coder"`` (``<tool_call><function=name>
    <parameter=p>...``: Qwen3-Coder, its values typed by the request's tool schemas). Required by
    ``enable_auto_tool_choice``. ``"pythonic"``: ``[f(a=1), g()]`` (Llama 3.2 / 4)."""

    max_waiting: int | None = None
    """Most requests queued and not yet started; past it requests get 503 + ``Retry-After``
    (each prompt of a completions batch is a request: a batch larger than this is 400).
    ``None``: ``engine.max_waiting`` when set, else ``DEFAULT_MAX_WAITING`` (256)."""

    retry_after_seconds: int = 1
    """Value of the ``Retry-After`` header on 503 answers."""

    enable_request_id_headers: bool = False
    """Answer every request to lorastar's routes with an ``X-Request-Id`` header: the request's own
    (a gateway's trace id) or a new one (vLLM's ``--enable-request-id-headers``). Whether or not it is
    on, chat and completions answers take their ``id`` from a request's ``X-Request-Id`` (or its
    body's ``request_id``), as vLLM's do."""

    return_tokens_as_token_ids: bool = False
    """Logprobs name each token ``token_id:{id}`` for requests that leave
    ``return_tokens_as_token_ids`` out (vLLM's ``--return-tokens-as-token-ids``: RL trainers read the
    sampled ids back; text cannot tell apart tokens that decode alike). A request's own value wins."""

    enable_force_include_usage: bool = False
    """Chat and completions streams end with a usage chunk even when the request does not ask
    (``stream_options.include_usage``), as vLLM's ``--enable-force-include-usage``: a gateway that
    bills by tokens gets them from every client."""

    response_role: str = "assistant"
    """The role of chat answers (vLLM's ``--response-role``). A request with
    ``add_generation_prompt: false`` is answered in its last message's role, as vLLM does."""

    enable_adapter_resolver: bool = False
    """A request whose ``model`` names no loaded adapter but a folder directly under ``adapter_root``
    loads that folder under that name first (vLLM's LoRA resolver)."""

    responses_store_size: int = 0
    """Most ``/responses`` answers kept in this process's memory (``store``, the default in OpenAI's
    API), least recently used dropped first, for ``previous_response_id`` and
    ``GET /responses/{id}``. ``0``: none are kept (vLLM's default: a stored conversation is memory
    the server holds), and ``previous_response_id`` is a 404 that says so. Each app worker (and
    each Ray Serve replica) keeps its own: a continued conversation must reach the same one."""

    shutdown_drain_timeout: float = 5.0
    """Seconds in-flight requests get to finish at shutdown before they are aborted."""

    log_stats_interval: float | None = None
    """Seconds between the stats lines logged on the ``lorastar`` logger (vLLM's ``Avg prompt
    throughput: ...`` line: tokens/s, running and waiting requests, KV cache usage, prefix cache hit
    rate, adapters; INFO while tokens flow, DEBUG while idle). ``None``: none, for an app that owns
    its logs; ``lorastar serve`` logs one every 10 s unless ``--disable-log-stats``."""

    log_requests: bool = False
    """Log each request on the ``lorastar.requests`` logger (vLLM's ``--enable-log-requests``):
    ``Received request ID: model, prompt, prompt_token_ids, params`` when it is submitted, then
    ``Finished request ID`` (finish reason, tokens, seconds) or ``Aborted request ID`` (the client
    went away, or the error). Off by default: prompts are user data."""

    max_log_len: int | None = None
    """Most prompt characters and prompt token ids a ``Received request`` line shows (vLLM's
    ``--max-log-len``); ``None``: all."""

    sagemaker_routes: bool = False
    """Mount Amazon SageMaker's container routes, as ``vllm serve`` does: ``GET``/``POST /ping`` (the
    liveness answer of ``health_path``) and ``POST /invocations`` (a chat completions body, with
    ``messages``, a completions body, with ``prompt``, or an embeddings body, with ``input``,
    answered by that route, streaming included; the API key, when set, is checked there). ``lorastar serve`` mounts them."""

    enable_server_load_tracking: bool = False
    """Count the generation requests being answered (chat, completions, embeddings, Responses,
    Messages; a stream until its end) and serve the count at ``GET /load`` as ``{"server_load": N}`` (vLLM's
    ``--enable-server-load-tracking``), a cheap signal for a load balancer's least-loaded routing."""

    engine_dependency_key: str = "lorastar_engine"
    """Name of the app-level dependency that hands the ``AsyncLLM`` to the user's own handlers
    (not added when the app already has a dependency of that name)."""

    include_in_schema: bool = True
    """List the plugin's routes in the app's OpenAPI schema."""

    async_engine: Any = None
    """An already built ``AsyncLLM`` to serve instead of building one (tests, sharing one engine).
    The plugin starts it but never shuts it down: its owner does."""

    def __post_init__(self) -> None:
        if self.engine is None:
            self.engine = EngineConfig()
        if not isinstance(self.engine, EngineConfig):
            raise ValueError(f"engine must be an EngineConfig, got {type(self.engine).__name__}")
        if not isinstance(self.adapters, dict) or not all(
            isinstance(k, str) and k and isinstance(v, (str, os.PathLike)) for k, v in self.adapters.items()
        ):
            raise ValueError("adapters must be a dict of non-empty names to folder paths")
        if not isinstance(self.path, str) or not self.path.startswith("/"):
            raise ValueError(f"path must start with '/', got {self.path!r}")
        self.path = "/" + self.path.strip("/") if self.path.strip("/") else "/"
        if not isinstance(self.response_role, str) or not self.response_role.strip():
            raise ValueError(f"response_role must be a non-empty string, got {self.response_role!r}")
        if self.max_waiting is not None and (
            not isinstance(self.max_waiting, int)
            or isinstance(self.max_waiting, bool)
            or self.max_waiting < 1
        ):
            raise ValueError(f"max_waiting must be a positive integer or None, got {self.max_waiting!r}")
        if isinstance(self.api_keys, str):  # a lone string would be iterated per character
            self.api_keys = [self.api_keys]
        # A None or non-string key (an unset environment variable) failed every request with a 500.
        if self.api_keys is not None:
            if isinstance(self.api_keys, bytes) or not isinstance(self.api_keys, Collection):
                raise ValueError(
                    f"api_keys must be a list of strings or None, got {type(self.api_keys).__name__}"
                )
            for key in self.api_keys:
                if not isinstance(key, str) or not key:  # the key itself is never echoed
                    got = "an empty string" if key == "" else type(key).__name__
                    raise ValueError(f"api_keys must hold non-empty strings, got {got}")
        if self.admin_token is not None and not isinstance(self.admin_token, str):
            raise ValueError(f"admin_token must be a string or None, got {type(self.admin_token).__name__}")
        names = self.served_model_name
        if names is not None and not isinstance(names, str):
            if (
                not isinstance(names, (list, tuple))
                or not names
                or not all(isinstance(n, str) and n for n in names)
                or len(set(names)) < len(names)
            ):
                raise ValueError(
                    "served_model_name must be a string, a list of distinct non-empty strings or None, "
                    f"got {names!r}"
                )
        if self.engine_address is not None and not str(self.engine_address).startswith(("tcp://", "ipc://")):
            raise ValueError(f"engine_address must start with tcp:// or ipc://, got {self.engine_address!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)} or None, "
                f"got {self.reasoning_parser!r}"
            )
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)} or None, "
                f"got {self.tool_call_parser!r}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser (e.g. 'hermes')")
        if (
            not isinstance(self.responses_store_size, int)
            or isinstance(self.responses_store_size, bool)
            or self.responses_store_size < 0
        ):
            raise ValueError(
                f"responses_store_size must be an integer >= 0, got {self.responses_store_size!r}"
            )
        if self.thinking_budget_message is not None and (
            not isinstance(self.thinking_budget_message, str) or not self.thinking_budget_message
        ):
            raise ValueError(
                f"thinking_budget_message must be a non-empty string or None, got {self.thinking_budget_message!r}"
            )
        for name in ("retry_after_seconds", "shutdown_drain_timeout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if self.max_log_len is not None and (
            not isinstance(self.max_log_len, int)
            or isinstance(self.max_log_len, bool)
            or self.max_log_len < 0
        ):
            raise ValueError(f"max_log_len must be an integer >= 0 or None, got {self.max_log_len!r}")
        interval = self.log_stats_interval
        if interval is not None and (
            not isinstance(interval, (int, float)) or isinstance(interval, bool) or not interval > 0
        ):
            raise ValueError(f"log_stats_interval must be a number > 0 or None, got {interval!r}")

    def engine_config(self) -> EngineConfig:
        """The engine settings with this config's overrides (``model``, ``max_waiting``) applied."""
        overrides: dict[str, Any] = {}
        if self.model is not None:
            overrides["model"] = str(self.model)
        if self.max_waiting is not None:
            overrides["max_waiting"] = self.max_waiting
        elif self.engine.max_waiting is None:  # a server queue is always bounded
            overrides["max_waiting"] = DEFAULT_MAX_WAITING
        return dataclasses.replace(self.engine, **overrides) if overrides else self.engine

    def resolved_admin_token(self) -> str | None:
        return self.admin_token if self.admin_token is not None else os.environ.get(ADMIN_TOKEN_ENV) or None

    def resolved_adapter_root(self) -> Path | None:
        return Path(self.adapter_root).expanduser().resolve() if self.adapter_root is not None else None
