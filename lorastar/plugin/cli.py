"""Command line: the ``lora`` group (added to ``litestar`` by the plugin) and the ``lorastar`` script.

``litestar lora list|load NAME PATH|unload NAME`` and ``lorastar lora ...`` talk to a running server
over HTTP (``--url``, ``--token`` / ``LORASTAR_ADMIN_TOKEN``; see ``lora_cli.py``). ``lorastar serve`` runs a standalone
server for people who have no app yet, ``lorastar engine`` a core that app workers share, and
``lorastar run-batch`` answers an OpenAI batch file through the same routes (``batch_file.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import click

from lorastar.plugin.client_cli import chat, complete
from lorastar.plugin.config import ADMIN_TOKEN_ENV, DEFAULT_MAX_WAITING
from lorastar.plugin.lora_cli import make_lora_group
from lorastar.plugin.reasoning import REASONING_PARSERS
from lorastar.plugin.tool_parsers import TOOL_CALL_PARSERS

# uvicorn's --log-level names (uvicorn.config.LOG_LEVELS; not imported here: the CLI starts lazily).
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# The embedded model's served name (lorastar.engine.engine.DEFAULT_MODEL_NAME, which imports torch).
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class UsageProblem(click.ClickException):
    """A one-line ``Error: ...`` with exit code 2 (click's usage-error code) and no usage dump."""

    exit_code = 2


def parse_lora_modules(values: tuple[str, ...], option: str = "--lora-modules") -> dict[str, str]:
    """``name=path`` or vLLM's JSON form ``{"name": ..., "path": ..., "base_model_name"?: ...}``."""
    adapters: dict[str, str] = {}
    for raw in values:
        for v in raw.split() if not raw.lstrip().startswith("{") else [raw.strip()]:
            if v.startswith("{"):
                try:
                    obj = json.loads(v)
                    name, path = str(obj["name"]), str(obj["path"])
                except (ValueError, KeyError, TypeError) as exc:
                    raise UsageProblem(
                        f"{option}: expected NAME=PATH or JSON with name and path, got {v!r}"
                    ) from exc
            else:
                name, sep, path = v.partition("=")
                if not sep or not name or not path:
                    raise UsageProblem(f"{option}: expected NAME=PATH, got {v!r}")
            if name in adapters:
                raise UsageProblem(f"{option}: adapter {name!r} given twice")
            adapters[name] = path
    return adapters


def _check_model(model: str | None, revision: str | None = None, cache_dir: str | None = None) -> str | None:
    """A local folder, or a Hugging Face id fetched (or found in the HF cache) now, at ``revision``:
    the local folder."""
    if model is None:
        return None
    from lorastar.hub import adapter_hint, resolve_folder

    try:
        p = resolve_folder(model, revision=revision, cache_dir=cache_dir)
    except ValueError as exc:
        raise UsageProblem(str(exc)) from exc
    if not (p / "config.json").is_file():
        why = adapter_hint(p) or " (not a Hugging Face model folder)"
        raise UsageProblem(f"model folder {model!r} has no config.json{why}")
    return model if Path(model).expanduser().is_dir() else str(p)


def _adapter_rank(name: str, config_file: Path) -> int | None:
    """The largest rank of the adapter (``r``, default 8 as PEFT's, and ``rank_pattern``); ``None``
    when the values are not integers (the loader names those)."""
    try:
        cfg = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UsageProblem(f"adapter {name!r}: cannot read {config_file}: {exc}") from exc
    if not isinstance(cfg, dict):
        raise UsageProblem(f"adapter {name!r}: {config_file} is not a JSON object")
    pattern = cfg.get("rank_pattern") or {}
    ranks = [cfg.get("r", 8), *(pattern.values() if isinstance(pattern, dict) else ())]
    ints = [r for r in ranks if isinstance(r, int) and not isinstance(r, bool)]
    return max(ints) if ints else None


def _check_adapters(
    adapters: dict[str, str],
    root: str | None,
    *,
    max_lora_rank: int | None = None,
    base_names: tuple[str, ...] = (),
    cache_dir: str | None = None,
) -> dict[str, str]:
    """Each adapter a PEFT folder (a Hugging Face id is fetched now), not named as the base model
    (any of ``base_names``) and of rank at most ``max_lora_rank`` (when given); the local paths."""
    from lorastar.hub import is_hub_id, resolve_folder

    out: dict[str, str] = {}
    for name, path in adapters.items():
        if name in base_names:
            raise UsageProblem(
                f"adapter {name!r} has the base model's served name; rename the adapter or "
                "change --served-model-name"
            )
        p = Path(path).expanduser()
        if (
            not p.is_absolute()
            and not p.exists()
            and root is not None
            and (Path(root).expanduser() / p).exists()
        ):
            p = Path(root).expanduser() / p
        elif is_hub_id(path):
            try:
                p = resolve_folder(path, kind="adapter", cache_dir=cache_dir)
            except ValueError as exc:
                raise UsageProblem(f"adapter {name!r}: {exc}") from exc
        if not (p / "adapter_config.json").is_file():
            raise UsageProblem(f"adapter {name!r}: {path!r} is not a PEFT folder (no adapter_config.json)")
        rank = _adapter_rank(name, p / "adapter_config.json")
        if max_lora_rank is not None and rank is not None and rank > max_lora_rank:
            raise UsageProblem(
                f"adapter {name!r}: rank {rank} exceeds --max-lora-rank {max_lora_rank}; "
                f"start with --max-lora-rank {rank} or more"
            )
        # As written when found there; else the folder found (under --adapter-root, or a hub id's).
        out[name] = path if p == Path(path).expanduser() else str(p)
    if root is not None and not Path(root).expanduser().is_dir():
        raise UsageProblem(f"--adapter-root {root!r} is not a folder")
    return out


def _bind(host: str, port: int) -> socket.socket:
    """Bind the listening socket now, before the model loads: a taken port fails in milliseconds."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UsageProblem(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    sock.set_inheritable(True)
    return sock


def _chat_template(value: str | None) -> str | None:
    # vLLM: a file path or the template itself.
    if value is None:
        return None
    p = Path(value).expanduser()
    try:
        is_file = p.is_file()
    except (OSError, ValueError):  # e.g. a long inline template: "File name too long"
        is_file = False
    if is_file:
        try:
            return p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageProblem(f"--chat-template: cannot read {value!r}: {exc}") from exc
    if "{" not in value:
        raise UsageProblem(f"--chat-template: {value!r} is neither a file nor a template")
    return value


def _end_core_wait() -> None:
    """End an app start-up's wait for a shared engine core (``--engine-address``): it waits on a
    thread, which no signal reaches (else Ctrl-C waited for the connect timeout)."""
    client = sys.modules.get("lorastar.engine.core_client")
    if client is not None:
        client.cancel_startup()


def _starting(engine_address: str | None) -> str:
    """What a command does while its app starts, for its first line."""
    return (
        "loading the model"
        if engine_address is None
        else f"connecting to the engine core at {engine_address}"
    )


def run_server(app: Any, sock: socket.socket, log_level: str, **uvicorn_kw: Any) -> None:
    """uvicorn on the already bound socket (tests replace this); ``uvicorn_kw``: more
    ``uvicorn.Config`` fields (``access_log``, ``ssl_*``), passed only when a flag sets them."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            _end_core_wait()
            super().handle_exit(sig, frame)

    # A startup that fails on a ValueError (the options against the model: --max-model-len past its
    # positions, a --quantization the checkpoint lacks, an unsupported architecture, a bad adapter)
    # is one `Error:` line, exit 2, as the checks before it; it was a 60-line traceback, exit 3.
    failed: list[BaseException] = []

    async def asgi(scope: Any, receive: Any, send: Any) -> None:
        async def send_startup(message: Any) -> None:
            if message["type"] == "lifespan.startup.failed":
                error = _config_error(sys.exc_info()[1])  # sent from the app's except block
                if error is not None:
                    logging.getLogger("lorastar").debug("%s", message.get("message"))
                    failed.append(error)
                    message = {**message, "message": ""}  # uvicorn logs a non-empty one
            await send(message)

        await app(scope, receive, send_startup if scope["type"] == "lifespan" else send)

    server = Server(uvicorn.Config(asgi, log_level=log_level, **uvicorn_kw))
    # uvicorn re-raises the signal that stopped it once it is done; with these no-op handlers in
    # place (it restores them first) a Ctrl-C ends the process with exit code 0, no traceback.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        server.run(sockets=[sock])
    except SystemExit:
        if failed:
            raise UsageProblem(f"cannot start: {failed[0]}") from None
        raise
    finally:
        sock.close()


def _config_error(
    exc: BaseException | None, types: tuple[type[BaseException], ...] = (ValueError,)
) -> BaseException | None:
    """The one exception of ``types`` (a ValueError) ``exc`` is or holds (exception groups
    unwrapped), else None."""
    while exc is not None and len(getattr(exc, "exceptions", ())) == 1:
        exc = exc.exceptions[0]  # type: ignore[attr-defined]
    return exc if isinstance(exc, types) else None


CONFIG_MODEL_KEY = "lorastar.config_model"  # ctx.meta: the model a --config file names


def _read_config(value: str) -> dict[Any, Any]:
    """The mapping a ``--config`` file holds (empty for an empty file); a usage error naming it."""
    import yaml

    where = f"--config {value!r}"
    try:
        data = yaml.safe_load(Path(value).expanduser().read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageProblem(f"{where}: {exc.strerror or exc}") from exc
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise UsageProblem(f"{where}: not YAML ({exc})") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageProblem(f"{where}: a mapping of option names to values is expected, e.g. 'port: 8000'")
    return data


def _load_config_file(ctx: click.Context, _param: click.Parameter, value: str | None) -> None:
    """``--config FILE``: vLLM's YAML of long option names (``port: 8000``, ``max-num-seqs: 32``,
    ``lora-modules: [a=/x]``, ``enable-prefix-caching: false``) as the command's defaults, so the
    command line wins over the file and the file over the defaults; ``model`` yields to MODEL."""
    if value is None:
        return
    where = f"--config {value!r}"
    data = _read_config(value)
    flags: dict[str, tuple[click.Option, bool]] = {}  # long name -> (option, is its --no- form)
    for p in ctx.command.params:
        if isinstance(p, click.Option) and p.name != "config":
            for opt in p.opts:
                flags.setdefault(opt.removeprefix("--"), (p, False))
            for opt in p.secondary_opts:
                flags.setdefault(opt.removeprefix("--"), (p, True))
    defaults: dict[str, Any] = {}
    for key, v in data.items():
        name = str(key).removeprefix("--").replace("_", "-")
        if name == "model" and "model" in flags:
            if v is not None:
                ctx.meta[CONFIG_MODEL_KEY] = str(v)
            continue
        if name not in flags:
            raise UsageProblem(f"{where}: {key!r} is not an option of `lorastar {ctx.info_name}`")
        option, negative = flags[name]
        if v is None:
            continue
        if option.is_flag:
            if not isinstance(v, bool):
                raise UsageProblem(f"{where}: {key} takes true or false, got {v!r}")
            if option.secondary_opts:
                v = v != negative
            elif not v:
                continue  # a plain flag set to false: its default
        elif option.multiple:
            v = [
                json.dumps(x) if isinstance(x, dict | list) else str(x)
                for x in (v if isinstance(v, list) else [v])
            ]
        elif isinstance(v, dict | list):
            v = json.dumps(v)  # --speculative-config, --allowed-origins: their JSON
        else:
            v = str(v)  # as typed on the command line: `max-num-seqs: 7.5` is refused, not cut to 7
        defaults[option.name] = v  # type: ignore[index]
    ctx.default_map = {**(ctx.default_map or {}), **defaults}


class _FileOverEnvOption(click.Option):
    """An option with an environment variable that a ``--config`` file's value beats: vLLM reads
    the file as command-line arguments, which win over ``VLLM_API_KEY`` (click ranks env vars above
    its defaults, where the file's values live)."""

    def resolve_envvar_value(self, ctx: click.Context) -> str | None:
        if self.name in (ctx.default_map or {}):
            return None
        return super().resolve_envvar_value(ctx)


def _given_model(model: str | None, model_opt: str | None) -> str | None:
    """MODEL or --model (the same one, when both), else a --config file's ``model``."""
    if model is not None and model_opt is not None and model != model_opt:
        raise UsageProblem(f"two models given: {model!r} and --model {model_opt!r}")
    ctx = click.get_current_context(silent=True)
    return model or model_opt or (ctx.meta.get(CONFIG_MODEL_KEY) if ctx is not None else None)


_CONFIG_OPTION = click.option(
    "--config",
    is_eager=True,
    expose_value=False,
    callback=_load_config_file,
    metavar="FILE",
    help="YAML file of long option names and values (vLLM's --config); the command line wins over it.",
)


_ENGINE_OPTIONS = [
    click.option("--tokenizer", default=None, help="Tokenizer folder (default: the model's)."),
    click.option(
        "--revision", default=None, help="Branch, tag or commit of a model given as a Hugging Face id."
    ),
    click.option(
        "--download-dir",
        default=None,
        help="Folder Hugging Face ids (model, tokenizer, adapters) download to and are found in "
        "(default: the Hugging Face cache).",
    ),
    click.option(
        "--tokenizer-revision",
        default=None,
        help="Branch, tag or commit of a --tokenizer given as a Hugging Face id.",
    ),
    click.option("--chat-template", default=None, help="Chat template: a file or the Jinja text itself."),
    click.option("--device", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "cuda"])),
    click.option("--dtype", default="auto", show_default=True),
    click.option("--max-model-len", default=None, type=int),
    click.option("--max-num-seqs", default=64, show_default=True, type=int),
    click.option("--max-num-batched-tokens", default=None, type=int, help="Token budget of one step."),
    click.option("--block-size", default=16, show_default=True, type=int),
    click.option(
        "--num-kv-blocks",
        "--num-gpu-blocks-override",
        "num_kv_blocks",
        default=None,
        type=int,
        help="KV blocks.",
    ),
    click.option(
        "--kv-cache-memory", default=None, type=int, help="Bytes for the KV cache (default: sized)."
    ),
    click.option(
        "--gpu-memory-utilization",
        default=None,
        type=click.FloatRange(0, 1, min_open=True),
        help="Fraction of the GPU's memory to use in all; sizes the KV cache (vLLM's flag; CPU: ignored).",
    ),
    click.option("--max-loras", default=8, show_default=True, type=int),
    click.option("--max-lora-rank", default=64, show_default=True, type=int),
    click.option(
        "--max-cpu-loras",
        default=None,
        type=int,
        help="Adapters kept in CPU memory (default: max(64, max-loras)).",
    ),
    click.option("--enable-prefix-caching/--no-enable-prefix-caching", default=True, show_default=True),
    click.option("--seed", default=0, show_default=True, type=int),
    click.option(
        "--max-logprobs",
        default=20,
        show_default=True,
        type=int,
        help="Most top logprobs a request may ask for (logprobs, top_logprobs, prompt_logprobs); -1: no cap.",
    ),
    click.option(
        "--generation-config",
        default="auto",
        show_default=True,
        help="Sampling defaults for requests that leave them unset: auto (the model's "
        "generation_config.json), vllm (none) or a folder holding one.",
    ),
    click.option(
        "--override-generation-config",
        default=None,
        metavar="JSON",
        help='Sampling defaults over --generation-config\'s, e.g. \'{"temperature": 0.6, "max_new_tokens": 512}\'.',
    ),
    click.option(
        "--quantization",
        "-q",
        default=None,
        type=click.Choice(["awq", "gptq", "fp8", "int8", "compressed-tensors"]),
        help="Force or check the method (fp8 / int8 quantize a 16-bit checkpoint at load; int8: CPU W8A8).",
    ),
    click.option(
        "--kv-cache-dtype",
        default="auto",
        show_default=True,
        type=click.Choice(["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]),
    ),
    click.option(
        "--embedding-quantization",
        default=None,
        type=click.Choice(["int8"]),
        help="int8 embedding / lm_head.",
    ),
    click.option(
        "--cpu-gemm",
        default="auto",
        show_default=True,
        type=click.Choice(["auto", "torch", "onednn"]),
        help=(
            "GEMM for fp32 CPU linears, and bf16 ones on CPUs with bf16 arithmetic "
            "(auto: oneDNN unless torch's is clearly faster, timed at load)."
        ),
    ),
    click.option(
        "--cpu-kernels",
        default="auto",
        show_default=True,
        type=click.Choice(["auto", "torch", "native"]),
        help="CPU decode attention and LoRA (native: C++ ops, built once; auto: native if they build).",
    ),
    click.option(
        "--scheduling-policy",
        default="fcfs",
        show_default=True,
        type=click.Choice(["fcfs", "priority"]),
        help="priority: requests' `priority` field (lower first, then arrival) orders the queue, "
        "each step's budget and preemption; fcfs: first come, first served (priority must be 0).",
    ),
    click.option("--enforce-eager", is_flag=True, help="No CUDA graphs."),
    click.option(
        "--async-scheduling/--no-async-scheduling",
        default=None,
        help="Launch step N+1 before reading step N's tokens back (the host overlaps the forward) "
        "[default: on for CUDA, off elsewhere].",
    ),
    click.option(
        "--speculative-config",
        default=None,
        help='Speculative decoding, as vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4}\' (prompt-lookup drafts; greedy outputs unchanged).',
    ),
    click.option(
        "--tune-malloc/--no-tune-malloc",
        default=True,
        show_default=True,
        help="CPU: keep freed memory for reuse (glibc mallopt) instead of page-faulting big buffers each step.",
    ),
    # vLLM flags that scripts copied from vLLM pass: accepted where they ask for what lorastar always does
    click.option("--trust-remote-code", is_flag=True, hidden=True, help="Accepted (no model code is run)."),
    click.option("--enable-chunked-prefill", is_flag=True, hidden=True, help="Accepted (always on)."),
    click.option(
        "--disable-log-requests", is_flag=True, hidden=True, help="Accepted (requests are not logged)."
    ),
    click.option(
        "--disable-log-stats",
        is_flag=True,
        help="serve, engine: no stats line (tokens/s, queue, KV cache) every 10 s.",
    ),
    click.option("--tensor-parallel-size", "-tp", type=int, default=1, hidden=True, help="1 only."),
    click.option("--pipeline-parallel-size", "-pp", type=int, default=1, hidden=True, help="1 only."),
]
_VLLM_ACCEPTED = ("trust_remote_code", "enable_chunked_prefill", "disable_log_requests", "disable_log_stats")


def _json_list(option: str, text: str) -> list[str]:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UsageProblem(f"{option} takes a JSON list of strings, e.g. '[\"*\"]'; got {text!r}")
    return value


def cors_config(origins: str | None, methods: str, headers: str, credentials: bool) -> Any:
    """Litestar's ``CORSConfig`` of vLLM's CORS flags (JSON lists); None without ``--allowed-origins``:
    vLLM allows every origin by default, lorastar none (a local server's API stays out of reach of
    the pages its operator browses) until asked."""
    if origins is None:
        return None
    from litestar.config.cors import CORSConfig

    return CORSConfig(
        allow_origins=_json_list("--allowed-origins", origins),
        allow_methods=_json_list("--allowed-methods", methods),  # type: ignore[arg-type]
        allow_headers=_json_list("--allowed-headers", headers),
        allow_credentials=credentials,
    )


def engine_options(f: Any) -> Any:
    """The engine's flags (vLLM's names), shared by ``serve`` and ``engine``."""
    for option in reversed(_ENGINE_OPTIONS):
        f = option(f)
    return f


def engine_config(
    *, tokenizer: str | None, chat_template: str | None, max_cpu_loras: int | None, max_loras: int, **kw: Any
) -> Any:
    """The ``EngineConfig`` of the engine flags (``ValueError`` on a bad value)."""
    from lorastar.config import EngineConfig

    for name in _VLLM_ACCEPTED:
        kw.pop(name, None)
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        if (n := kw.pop(name, 1)) != 1:
            raise UsageProblem(
                f"--{name.replace('_', '-')} {n}: lorastar runs an engine on one device; scale out with "
                "replicas (several `lorastar serve`, or Ray Serve: lorastar.ray.build_app)"
            )

    spec = kw.pop("speculative_config", None)
    if spec is not None:
        try:
            spec = json.loads(spec)
        except ValueError:
            spec = None
        if not isinstance(spec, dict):
            raise UsageProblem(
                '--speculative-config takes a JSON object, e.g. \'{"method": "ngram", '
                '"num_speculative_tokens": 4}\''
            )
        kw["speculative_config"] = spec
    override = kw.pop("override_generation_config", None)
    if override is not None:
        from lorastar.engine.generation_config import check_override

        try:
            override = json.loads(override)
            check_override(override)  # now: a bad key was every request's 400, or a failed start
        except ValueError as exc:
            raise UsageProblem(f"--override-generation-config: {exc}") from None
        kw["override_generation_config"] = override
    if tokenizer is not None and not Path(tokenizer).expanduser().is_dir():
        from lorastar.hub import is_hub_id, resolve_folder

        if not is_hub_id(tokenizer):
            raise UsageProblem(f"--tokenizer folder {tokenizer!r} does not exist")
        try:  # a Hugging Face id (vLLM's --tokenizer takes one): fetched now, as the model is
            tokenizer = str(
                resolve_folder(
                    tokenizer,
                    kind="tokenizer",
                    revision=kw.get("tokenizer_revision"),
                    cache_dir=kw.get("download_dir"),
                )
            )
        except ValueError as exc:
            raise UsageProblem(f"--tokenizer: {exc}") from exc
    return EngineConfig(
        tokenizer=tokenizer,
        chat_template=_chat_template(chat_template),
        max_loras=max_loras,
        max_cpu_loras=max_cpu_loras,  # None: EngineConfig's max(64, max_loras)
        **kw,
    )


@click.group("lorastar", help="lorastar: serve one LLM with many LoRA adapters over the OpenAI API.")
def main() -> None:
    pass


main.add_command(make_lora_group())
main.add_command(chat)
main.add_command(complete)


_ADAPTER_FLAGS = ("--lora-modules", "--adapter")
API_KEY_ENVS = ("LORASTAR_API_KEY", "VLLM_API_KEY")


def _spread_adapter_values(args: list[str]) -> list[str]:
    """vLLM's ``--lora-modules a=X b=Y`` (argparse ``nargs='+'``) as ``--lora-modules a=X
    --lora-modules b=Y``: each ``NAME=PATH`` or JSON word right after the flag's value is one more
    value (a model folder or Hub id has neither, so MODEL after them is still MODEL)."""
    out: list[str] = []
    flag: str | None = None  # the adapter flag whose values are being read
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            return out + args[i:]
        if a in _ADAPTER_FLAGS and i + 1 < len(args):
            out += [a, args[i + 1]]
            flag, i = a, i + 2
            continue
        name = a.partition("=")[0]
        if name in _ADAPTER_FLAGS:  # --lora-modules=a=X
            out.append(a)
            flag, i = name, i + 1
            continue
        if flag is not None and not a.startswith("-") and ("=" in a or a.lstrip().startswith("{")):
            out += [flag, a]
        else:
            out.append(a)
            flag = None
        i += 1
    return out


def _config_names_model(args: list[str]) -> bool:
    """Whether a ``--config`` file among ``args`` names the model (then, as vLLM's ``--model``, it
    makes the words after ``--served-model-name``'s value names); a bad file is reported later."""
    for i, a in enumerate(args):
        if a.startswith("--config="):
            path: str | None = a.partition("=")[2]
        else:
            path = args[i + 1] if a == "--config" and i + 1 < len(args) else None
        if path is not None:
            try:
                if _read_config(path).get("model") is not None:
                    return True
            except UsageProblem:
                continue
    return False


def _spread_served_names(args: list[str], value_options: set[str], model_in_file: bool = False) -> list[str]:
    """vLLM's ``MODEL --served-model-name a b`` as ``--served-model-name a --served-model-name b``.
    The words after the first name are names only where the model is already given (MODEL before
    the flag, ``--model`` or a ``--config`` file's ``model``): ``--served-model-name a ./model``
    keeps ``./model`` as MODEL.
    ``value_options``: the options that take a value (their value is not MODEL)."""
    flag = "--served-model-name"
    if flag not in args:
        return args
    model_given = model_in_file or "--model" in args or any(a.startswith("--model=") for a in args)
    out: list[str] = []
    reading = False  # reading more names after the flag's value
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            return out + args[i:]
        if a == flag and i + 1 < len(args):
            out += [a, args[i + 1]]
            reading, i = model_given, i + 2
            continue
        if reading and not a.startswith("-"):
            out += [flag, a]
        else:
            reading = False
            out.append(a)
            if a.startswith("-") and "=" not in a and a in value_options and i + 1 < len(args):
                out.append(args[i + 1])
                i += 1
            elif not a.startswith("-"):
                model_given = True  # MODEL, before the flag
        i += 1
    return out


class _ServeCommand(click.Command):
    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        value_options = {
            name
            for p in self.params
            if isinstance(p, click.Option) and not p.is_flag and not p.count
            for name in p.opts
        }
        model_in_file = "--served-model-name" in args and _config_names_model(args)
        spread = _spread_served_names(_spread_adapter_values(args), value_options, model_in_file)
        return super().parse_args(ctx, spread)


def _options(options: list[Any]) -> Any:
    def apply(f: Any) -> Any:
        for option in reversed(options):
            f = option(f)
        return f

    return apply


# The model and its adapters, shared by ``serve`` and ``run-batch``.
_model_options = _options(
    [
        click.argument("model", required=False),
        click.option("--model", "model_opt", default=None, help="Same as the MODEL argument (vLLM's flag)."),
        click.option(
            "--lora-modules",
            "lora_modules",
            multiple=True,
            metavar="NAME=PATH|JSON",
            help='Adapter to load at startup (repeatable): NAME=PATH or \'{"name": ..., "path": ...}\'.',
        ),
        click.option(
            "--adapter", "adapters", multiple=True, metavar="NAME=PATH", help="Same as --lora-modules."
        ),
        click.option(
            "--enable-lora", is_flag=True, hidden=True, help="Accepted for vLLM compatibility (always on)."
        ),
        click.option(
            "--served-model-name",
            "served_model_names",
            multiple=True,
            metavar="NAME",
            help="Name of the base in the 'model' field; several (repeated, or vLLM's `MODEL --served-model-name "
            "a b`): each selects the base, the first is reported.",
        ),
        click.option("--adapter-root", default=None, help="Folder runtime loading may read adapters from."),
    ]
)

# How the routes answer and where the engine runs, shared by ``serve`` and ``run-batch``.
_answer_options = _options(
    [
        click.option(
            "--engine-process/--no-engine-process",
            default=True,
            show_default=True,
            help="Run the engine core in a process of its own, the HTTP layer keeping this one (measured, "
            "README: 0.89 against 0.50 of offline tokens/s at 64 streams where the host is the bottleneck, "
            "and a lower TTFT p99 on SmolLM2); --no-engine-process runs it as a thread here.",
        ),
        click.option(
            "--engine-address",
            default=None,
            metavar="ADDR",
            help="Use the engine core `lorastar engine --address ADDR` runs instead of loading the model here.",
        ),
        click.option(
            "--enable-auto-tool-choice",
            is_flag=True,
            help="Parse the model's function calls into tool_calls when a request sends tools (vLLM's flag).",
        ),
        click.option(
            "--tool-call-parser",
            default=None,
            type=click.Choice(TOOL_CALL_PARSERS),
            help="How the model writes function calls (hermes: <tool_call>{...}</tool_call>; llama3_json: "
            "Llama 3.x's JSON; mistral: [TOOL_CALLS]; qwen3_coder: <function=...><parameter=...> XML; "
            "pythonic: [f(a=1)]).",
        ),
        click.option(
            "--reasoning-parser",
            default=None,
            type=click.Choice(REASONING_PARSERS),
            help="Split <think>...</think> into the chat answers' reasoning_content (vLLM's flag).",
        ),
        click.option(
            "--thinking-budget-message",
            default=None,
            help="Text written before </think> when a request's thinking_token_budget is spent "
            "(llama.cpp's --reasoning-budget-message; default: </think> alone).",
        ),
        click.option(
            "--return-tokens-as-token-ids",
            is_flag=True,
            help="Logprobs name tokens 'token_id:{id}' unless a request says otherwise (vLLM's flag).",
        ),
        click.option(
            "--enable-force-include-usage",
            is_flag=True,
            help="Every chat and completions stream ends with a usage chunk, asked for or not (vLLM's flag).",
        ),
        click.option(
            "--response-role",
            default="assistant",
            show_default=True,
            help="The role of chat answers (vLLM's flag).",
        ),
        click.option(
            "--enable-prompt-tokens-details",
            is_flag=True,
            hidden=True,
            help="Accepted for vLLM compatibility (usage always has prompt_tokens_details.cached_tokens).",
        ),
        click.option(
            "--enable-log-requests",
            "log_requests",
            is_flag=True,
            help="Log each request (prompt, params) and how it ended, on lorastar.requests (vLLM's flag).",
        ),
        click.option(
            "--max-log-len",
            default=None,
            type=click.IntRange(0),
            help="Most prompt characters and token ids a logged request shows (default: all).",
        ),
        click.option(
            "--log-level",
            "--uvicorn-log-level",
            "log_level",
            default="info",
            show_default=True,
            type=click.Choice(LOG_LEVELS, case_sensitive=False),
        ),
    ]
)


# _answer_options that are LoraStarConfig fields of the same name
_ANSWER_FIELDS = (
    "engine_process",
    "reasoning_parser",
    "enable_auto_tool_choice",
    "tool_call_parser",
    "thinking_budget_message",
    "log_requests",
    "max_log_len",
    "return_tokens_as_token_ids",
    "enable_force_include_usage",
    "response_role",
)


def _engine_flags_given() -> list[str]:
    """The engine's flags (and MODEL) the current command was given on its command line or by an
    environment variable (not by default, nor by a --config file an engine and its app workers may
    share): with --engine-address none of them has an effect."""
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return []
    from click.core import ParameterSource

    ignored = _engine_flag_names() | {"model", "model_opt"}
    given = []
    for p in ctx.command.params:
        if p.name in ignored and ctx.get_parameter_source(p.name) in (
            ParameterSource.COMMANDLINE,
            ParameterSource.ENVIRONMENT,
        ):
            given.append(p.opts[0] if p.opts[0].startswith("-") else "MODEL")
    return given


@functools.cache
def _engine_flag_names() -> frozenset[str]:
    """Parameter names of ``_ENGINE_OPTIONS`` that configure the engine (not the accepted no-ops,
    nor --disable-log-stats, which also stops the app's stats line)."""
    params = engine_options(lambda: None).__click_params__
    skip = {*_VLLM_ACCEPTED, "tensor_parallel_size", "pipeline_parallel_size"}
    return frozenset(p.name for p in params if p.name not in skip)


def _plugin_config(options: dict[str, Any], **plugin_kw: Any) -> Any:
    """The ``LoraStarConfig`` of a command's ``_model_options``, ``_answer_options`` and engine
    flags (``options``: all of its flags but its own, which ``plugin_kw`` gives as config fields),
    everything checkable checked (paths, ranks, names) before anything loads."""
    from lorastar.hub import model_folder_name
    from lorastar.plugin.config import LoraStarConfig

    engine_kw = dict(options)
    model, model_opt = engine_kw.pop("model"), engine_kw.pop("model_opt")
    lora_modules, adapters = engine_kw.pop("lora_modules"), engine_kw.pop("adapters")
    served_model_names, adapter_root = engine_kw.pop("served_model_names"), engine_kw.pop("adapter_root")
    engine_address = engine_kw.pop("engine_address")
    answer = {name: engine_kw.pop(name) for name in _ANSWER_FIELDS}
    if engine_address is not None and (given := _engine_flags_given()):
        click.echo(
            f"lorastar: {', '.join(given)} ignored: the engine core at --engine-address {engine_address} "
            "keeps the model and settings `lorastar engine` was started with (give them there)",
            err=True,
        )
    # vLLM's flags, accepted (lorastar does so always); the command's logging
    for name in ("enable_lora", "enable_prompt_tokens_details", "log_level"):
        engine_kw.pop(name)

    model = _check_model(
        _given_model(model, model_opt), engine_kw.get("revision"), engine_kw.get("download_dir")
    )
    all_adapters = parse_lora_modules(lora_modules)
    for name, path in parse_lora_modules(adapters, "--adapter").items():
        if name in all_adapters:
            raise UsageProblem(f"adapter {name!r} given twice")
        all_adapters[name] = path
    # A shared core (--engine-address) has its own rank limit and model name: only a given
    # --served-model-name is known here then.
    served_model_name = (
        served_model_names[0] if len(served_model_names) == 1 else list(served_model_names) or None
    )
    base_names = served_model_names or (
        () if engine_address is not None else (model_folder_name(model) if model else DEFAULT_MODEL_NAME,)
    )
    all_adapters = _check_adapters(
        all_adapters,
        adapter_root,
        max_lora_rank=None if engine_address is not None else engine_kw["max_lora_rank"],
        base_names=base_names,
        cache_dir=engine_kw.get("download_dir"),
    )
    try:
        return LoraStarConfig(
            model=model,
            served_model_name=served_model_name,
            adapters=all_adapters,
            adapter_root=adapter_root,
            engine=engine_config(**engine_kw),
            log_stats_interval=None if engine_kw.get("disable_log_stats") else 10.0,
            engine_address=engine_address,
            **answer,
            **plugin_kw,
        )
    except ValueError as exc:
        raise UsageProblem(str(exc)) from exc


@main.command(
    "serve",
    cls=_ServeCommand,
    help="Serve MODEL (an HF folder; default: the embedded SmolLM2) with the OpenAI API.",
)
@_CONFIG_OPTION
@_model_options
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option(
    "--admin-token",
    cls=_FileOverEnvOption,
    envvar=ADMIN_TOKEN_ENV,
    default=None,
    help=f"Admin token (env {ADMIN_TOKEN_ENV}).",
)
@click.option(
    "--api-key",
    "api_keys",
    cls=_FileOverEnvOption,
    multiple=True,
    envvar=API_KEY_ENVS,  # vLLM's serve reads VLLM_API_KEY: a migrated deployment stays guarded
    help=f"Accepted API key (repeatable; env {' or '.join(API_KEY_ENVS)}, keys separated by spaces).",
)
@click.option(
    "--allowed-origins",
    default=None,
    metavar="JSON",
    help="CORS: origins browsers may call from, vLLM's JSON list ('[\"*\"]'); default: none (vLLM: all).",
)
@click.option("--allowed-methods", default='["*"]', show_default=True, metavar="JSON", help="CORS methods.")
@click.option("--allowed-headers", default='["*"]', show_default=True, metavar="JSON", help="CORS headers.")
@click.option("--allow-credentials", is_flag=True, help="CORS: allow credentials.")
@click.option("--no-runtime-loading", is_flag=True, help="Do not mount the adapter admin routes.")
@click.option(
    "--enable-adapter-resolver", is_flag=True, help="Load unknown adapter names from --adapter-root."
)
@engine_options
@click.option("--max-waiting", default=None, type=int, help="Waiting-queue bound (503 beyond it).")
@_answer_options
@click.option(
    "--responses-store-size",
    default=0,
    show_default=True,
    type=click.IntRange(0),
    help="/v1/responses answers kept in memory for previous_response_id (0: none, vLLM's default).",
)
@click.option(
    "--disable-uvicorn-access-log", is_flag=True, help="No access log line per request (vLLM's flag)."
)
@click.option("--ssl-keyfile", default=None, help="Serve HTTPS: the private key file (with --ssl-certfile).")
@click.option("--ssl-certfile", default=None, help="Serve HTTPS: the certificate file (with --ssl-keyfile).")
@click.option("--ssl-ca-certs", default=None, help="CA certificates file to verify clients with.")
@click.option(
    "--ssl-cert-reqs",
    default=None,
    type=click.IntRange(0, 2),
    help="Client certificates: 0 none, 1 optional, 2 required (Python's ssl.CERT_*; vLLM's flag).",
)
@click.option(
    "--enable-request-id-headers",
    is_flag=True,
    help="Answer with an X-Request-Id header: the request's own or a new one (vLLM's flag).",
)
@click.option(
    "--enable-server-load-tracking",
    is_flag=True,
    help='GET /load answers {"server_load": N}: the generation requests being answered (vLLM\'s flag).',
)
@click.option(
    "--shutdown-drain-timeout",
    default=5.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="Seconds in-flight requests get on shutdown.",
)
def serve(
    host: str,
    port: int,
    admin_token: str | None,
    api_keys: tuple[str, ...],
    allowed_origins: str | None,
    allowed_methods: str,
    allowed_headers: str,
    allow_credentials: bool,
    no_runtime_loading: bool,
    enable_adapter_resolver: bool,
    max_waiting: int | None,
    responses_store_size: int,
    shutdown_drain_timeout: float,
    enable_request_id_headers: bool,
    enable_server_load_tracking: bool,
    disable_uvicorn_access_log: bool,
    ssl_keyfile: str | None,
    ssl_certfile: str | None,
    ssl_ca_certs: str | None,
    ssl_cert_reqs: int | None,
    **options: Any,
) -> None:
    from lorastar.plugin.plugin import LoraStarPlugin, create_app  # lazy: only needed to serve

    # Everything checkable is checked before anything loads: paths, flags, then the port.
    cors = cors_config(allowed_origins, allowed_methods, allowed_headers, allow_credentials)
    uvicorn_kw = _uvicorn_options(
        disable_uvicorn_access_log, ssl_keyfile, ssl_certfile, ssl_ca_certs, ssl_cert_reqs
    )
    config = _plugin_config(
        options,
        allow_runtime_adapter_loading=not no_runtime_loading,
        admin_token=admin_token,
        api_keys=list(api_keys) or None,
        max_waiting=max_waiting,
        enable_adapter_resolver=enable_adapter_resolver,
        responses_store_size=responses_store_size,
        shutdown_drain_timeout=shutdown_drain_timeout,
        enable_request_id_headers=enable_request_id_headers,
        enable_server_load_tracking=enable_server_load_tracking,
        sagemaker_routes=True,  # as `vllm serve` (/ping, /invocations)
    )
    engine_address, log_level = options["engine_address"], options["log_level"]
    sock = _bind(host, port)
    app = create_app(config, cors_config=cors)
    shown = f"[{host}]" if ":" in host else host
    scheme = "https" if "ssl_certfile" in uvicorn_kw else "http"
    url = f"{scheme}://{shown}:{sock.getsockname()[1]}{config.path}"
    app.plugins.get(LoraStarPlugin).public_url = url
    _log_to_stderr(log_level)
    click.echo(f"lorastar: listening on {url}; {_starting(engine_address)}", err=True)
    run_server(app, sock, log_level, **uvicorn_kw)


def _no_key_password(keyfile: str) -> Any:
    """OpenSSL's password callback for the key: an encrypted key is a usage error, not a prompt on
    the terminal (twice here, then again in uvicorn) or, without one, 'Invalid argument'."""

    def refuse() -> str:
        raise UsageProblem(
            f"--ssl-keyfile {keyfile!r} is encrypted with a passphrase; give an unencrypted key "
            "(openssl pkey -in KEY -out PLAIN_KEY)"
        )

    return refuse


def _uvicorn_options(
    no_access_log: bool,
    keyfile: str | None,
    certfile: str | None,
    ca_certs: str | None,
    cert_reqs: int | None,
) -> dict[str, Any]:
    """The ``uvicorn.Config`` fields the flags set (none when none is given); the TLS files are
    checked to load together now, before the model (a bad one was uvicorn's traceback after it)."""
    kw: dict[str, Any] = {"access_log": False} if no_access_log else {}
    if (keyfile is None) != (certfile is None):
        raise UsageProblem("--ssl-keyfile and --ssl-certfile go together: give both to serve HTTPS")
    if certfile is None:
        if ca_certs is not None or cert_reqs is not None:
            raise UsageProblem("--ssl-ca-certs and --ssl-cert-reqs need --ssl-keyfile and --ssl-certfile")
        return kw
    if cert_reqs in (1, 2) and ca_certs is None:  # else no client certificate could ever verify
        raise UsageProblem(
            f"--ssl-cert-reqs {cert_reqs} needs --ssl-ca-certs (the CA that signs the clients' certificates)"
        )
    import ssl

    for flag, path in (
        ("--ssl-keyfile", keyfile),
        ("--ssl-certfile", certfile),
        ("--ssl-ca-certs", ca_certs),
    ):
        if path is not None and not Path(path).is_file():
            raise UsageProblem(f"{flag} {path!r} is not a file")
    try:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(certfile, keyfile, password=_no_key_password(keyfile))
        if ca_certs is not None:
            context.load_verify_locations(ca_certs)
    except (OSError, ssl.SSLError) as exc:
        raise UsageProblem(
            f"--ssl-keyfile / --ssl-certfile / --ssl-ca-certs: cannot load them: {exc}"
        ) from exc
    kw.update(ssl_keyfile=keyfile, ssl_certfile=certfile)
    if ca_certs is not None:
        kw["ssl_ca_certs"] = ca_certs
    if cert_reqs is not None:
        kw["ssl_cert_reqs"] = cert_reqs
    return kw


@main.command(
    "run-batch",
    cls=_ServeCommand,
    help="Answer an OpenAI batch file with MODEL and its adapters, as vLLM's run-batch: each input line "
    '{"custom_id", "method": "POST", "url", "body"} (url: /v1/chat/completions, /v1/completions, '
    "/v1/embeddings, /v1/responses or /v1/messages; the adapter by the body's model) gets one output line, in input "
    "order, answered as `lorastar serve` answers it.",
)
@_CONFIG_OPTION
@click.option("-i", "--input-file", required=True, help="The batch file (JSONL); - reads stdin.")
@click.option("-o", "--output-file", required=True, help="Where the answers go (JSONL); - writes stdout.")
@_model_options
@engine_options
@_answer_options
def run_batch(input_file: str, output_file: str, **options: Any) -> None:
    from lorastar.plugin.batch_file import BatchFileError, BatchSummary, parse_batch
    from lorastar.plugin.plugin import create_app

    # The whole file is checked, then the flags and the output, before the model loads.
    try:
        if input_file == "-":
            lines = parse_batch(sys.stdin)
        else:
            with open(input_file, encoding="utf-8") as f:
                lines = parse_batch(f)
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageProblem(f"--input-file {input_file!r}: {getattr(exc, 'strerror', None) or exc}") from exc
    except BatchFileError as exc:
        raise UsageProblem(
            f"--input-file {input_file!r}: {len(exc.problems)} bad line(s), nothing was run:\n{exc}"
        ) from None
    config = _plugin_config(
        options,
        allow_runtime_adapter_loading=False,
        # The runner bounds what is in flight (2 x --max-num-seqs, as vLLM's); a completions line
        # may hold many prompts, so the waiting queue gets no bound of its own to answer 503 with.
        max_waiting=2**31 - 1,
    )
    _check_output_file(output_file, input_file)
    _log_to_stderr(options["log_level"])
    click.echo(
        f"lorastar run-batch: {len(lines)} requests from {input_file}; {_starting(options['engine_address'])}",
        err=True,
    )
    summary = BatchSummary()
    where = "stdout" if output_file == "-" else output_file
    opened: list[Any] = []  # the output, opened once the engine has started (a failed start keeps
    # an earlier run's file)

    def open_output() -> Any:
        out = sys.stdout if output_file == "-" else open(output_file, "w", encoding="utf-8")  # noqa: SIM115
        opened.append(out)
        return out

    try:
        asyncio.run(
            _answer_batch(
                create_app(config),
                lines,
                open_output,
                summary,
                prefix=config.path,
                concurrency=2 * options["max_num_seqs"],
            )
        )
    except (KeyboardInterrupt, asyncio.CancelledError):  # Ctrl-C or SIGTERM: the run was stopped
        if not opened:
            raise click.ClickException(
                f"stopped before the engine started; nothing was run and {where} was not touched"
            ) from None
        raise click.ClickException(
            f"stopped; {where} holds the answers to the first {summary.written} of {len(lines)} requests"
        ) from None
    finally:
        for out in opened:
            if out is not sys.stdout:
                with contextlib.suppress(BrokenPipeError):
                    out.close()
    if summary.output_closed:  # `-o - | head`: no traceback, and nothing more to flush at exit
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise click.ClickException(
            f"stopped; the reader of {where} went away after {summary.written} of {len(lines)} answers"
        )
    click.echo(
        f"lorastar run-batch: {summary.succeeded} answered, {summary.failed} refused (their lines' error "
        f"says why); wrote {where}",
        err=True,
    )


def _check_output_file(output_file: str, input_file: str) -> None:
    """``-o`` is writable and not the input, checked without touching it (it is opened, and an
    existing one emptied, only once the engine has started)."""
    if output_file == "-":
        return
    path = Path(output_file).expanduser()
    if path.is_dir():
        raise UsageProblem(f"--output-file {output_file!r} is a folder")
    if input_file != "-" and path.exists() and path.samefile(input_file):
        raise UsageProblem(f"--output-file {output_file!r} is the input file; write the answers elsewhere")
    folder = path.parent
    if not folder.is_dir():
        raise UsageProblem(f"--output-file {output_file!r}: folder {str(folder)!r} does not exist")
    if not os.access(path if path.exists() else folder, os.W_OK):
        raise UsageProblem(f"--output-file {output_file!r}: not writable")


async def _answer_batch(
    app: Any, lines: Any, open_output: Any, summary: Any, *, prefix: str, concurrency: int
) -> None:
    """Start ``app`` (a start-up ``ValueError``, or no core at ``--engine-address``, is a usage
    error, as ``serve``'s), open the output (``open_output()``), answer ``lines``, stop it; progress
    on the ``lorastar`` log every 10 s. Ctrl-C and SIGTERM cancel the run: the app's lifespan then
    stops the engine, and the lines written so far stay whole."""
    from lorastar.plugin.batch_file import run_batch as answer_lines

    log = logging.getLogger("lorastar")
    last = [time.monotonic()]

    def progress(done: int, summary: Any) -> None:
        if (now := time.monotonic()) - last[0] >= 10.0:
            last[0] = now
            log.info("run-batch: %d of %d answered (%d refused)", done, len(lines), summary.failed)

    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    assert task is not None

    def stop(*_: Any) -> None:
        # A cancel, not a KeyboardInterrupt raised in the handler: that one, raised inside the
        # loop's frames, left contextlib's exit stacks looping forever on a cyclic __context__ chain.
        _end_core_wait()
        loop.call_soon_threadsafe(task.cancel)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        async with contextlib.AsyncExitStack() as stack:
            try:
                await stack.enter_async_context(app.lifespan())
            except Exception as exc:
                error = _config_error(exc, (ValueError, ConnectionError))  # no core at --engine-address
                if error is not None:
                    raise UsageProblem(f"cannot start: {error}") from None
                raise
            await answer_lines(
                app,
                lines,
                open_output(),
                prefix=prefix,
                concurrency=concurrency,
                on_answer=progress,
                summary=summary,
            )
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@main.command(
    "engine",
    help="Run only the engine core, at --address; app workers share it with "
    "LoraStarConfig(engine_address=ADDR) or `lorastar serve --engine-address ADDR` (one model in memory).",
)
@_CONFIG_OPTION
@click.argument("model", required=False)
@click.option("--model", "model_opt", default=None, help="Same as the MODEL argument.")
@click.option(
    "--address", required=True, metavar="ADDR", help="tcp://127.0.0.1:PORT or ipc:///path (same host)."
)
@click.option(
    "--max-waiting", default=DEFAULT_MAX_WAITING, show_default=True, type=int, help="Waiting-queue bound."
)
@engine_options
def engine(
    model: str | None, model_opt: str | None, address: str, max_waiting: int, **engine_kw: Any
) -> None:
    from lorastar.engine.core_proc import run_engine_core
    from lorastar.plugin.stats_log import start_stats_thread

    model = _given_model(model, model_opt)
    lock = _lock_ipc_address(address)  # held while this core runs
    try:
        _check_engine_address(address)
        try:
            config = engine_config(
                model=_check_model(model, engine_kw.get("revision"), engine_kw.get("download_dir")),
                max_waiting=max_waiting,
                **engine_kw,
            )
        except ValueError as exc:
            raise UsageProblem(str(exc)) from exc
        _probe_bind(address)  # last: nothing else can fail before the core binds it again
        _log_to_stderr("info")
        click.echo(f"lorastar: engine core at {address}; loading the model", err=True)
        previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
        stop_stats: list[Any] = []  # the stats thread's stop, once the core is ready

        def ready(core: Any) -> None:
            _log_engine_ready(core, address)
            if not engine_kw.get("disable_log_stats"):  # serve's stats line, of the core's engine
                stop_stats.append(
                    start_stats_thread(
                        10.0, lambda: None if getattr(core, "restarting", False) else core.engine.stats()
                    )
                )

        try:
            run_engine_core(config, address, on_ready=ready)
        except KeyboardInterrupt:
            pass
        except ValueError as exc:  # the options against the model (--max-model-len, -q, ...)
            raise UsageProblem(f"cannot start: {exc}") from None
        finally:
            signal.signal(signal.SIGTERM, previous)
            for stop in stop_stats:
                stop()
    finally:
        if lock is not None:
            lock.release()


_LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def _lock_ipc_address(address: str) -> Any:
    """For an ``ipc://PATH`` address in an existing folder, the held lock ``PATH.lock`` (filelock), or
    a usage error where another process holds it; None for other addresses. zmq's ipc bind replaces
    a socket file someone else listens on, and two ``lorastar engine`` started at one instant both
    found no listener there: both bound, and the first core's clients lost it. A tcp port needs no
    lock (the second bind fails)."""
    if not address.startswith("ipc://"):
        return None
    path = Path(address[len("ipc://") :])
    if not str(path) or not path.parent.is_dir():
        return None  # _check_engine_address says what is wrong
    from filelock import FileLock, Timeout

    lock = FileLock(f"{path}.lock", timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise UsageProblem(
            f"--address {address!r}: another `lorastar engine` holds {str(path)!r} (lock {str(path)}.lock); "
            "stop it or pick another path"
        ) from None
    except OSError as exc:
        raise UsageProblem(f"--address {address!r}: cannot create the lock {str(path)}.lock: {exc}") from exc
    return lock


def _check_engine_address(address: str) -> None:
    """``tcp://LOCALHOST:PORT`` or ``ipc:///path`` in an existing folder; an ipc socket file that a
    live process answers on is refused (zmq would take it over), a stale one removed."""
    if address.startswith("tcp://"):
        host, sep, port = address[len("tcp://") :].rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UsageProblem(
                f"--address {address!r}: give a port from 1 to 65535, e.g. tcp://127.0.0.1:5555"
            )
        if host.strip("[]") not in _LOCAL_HOSTS:
            raise UsageProblem(
                f"--address {address!r}: the engine socket has no authentication (it loads adapters from "
                "any path it is sent); bind it to 127.0.0.1 or an ipc:// path"
            )
        return
    if not address.startswith("ipc://"):
        raise UsageProblem(f"--address must start with tcp:// or ipc://, got {address!r}")
    path = Path(address[len("ipc://") :])
    if not str(path) or not path.parent.is_dir():
        raise UsageProblem(f"--address {address!r}: folder {str(path.parent)!r} does not exist")
    if not (path.exists() or path.is_symlink()):
        return
    if not path.is_socket():
        raise UsageProblem(f"--address {address!r}: {str(path)!r} exists and is not a socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(2.0)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            pass  # nobody listens: a stale file of a core that is gone
        except OSError as exc:
            raise UsageProblem(f"--address {address!r}: cannot check {str(path)!r}: {exc}") from exc
        else:
            raise UsageProblem(
                f"--address {address!r}: something already listens there (another `lorastar engine`?); "
                "stop it or pick another path"
            )
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        raise UsageProblem(f"--address {address!r}: cannot remove the stale {str(path)!r}: {exc}") from exc


def _probe_bind(address: str) -> None:
    """Bind ``address`` once with zmq and let go: a taken port or an unusable path is a one-line error
    before the model loads (the core binds it again as it starts)."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    try:
        sock.bind(address)
    except zmq.ZMQError as exc:
        why = str(exc.strerror).split(" (addr=")[0]
        raise UsageProblem(f"--address {address!r}: cannot bind: {why}") from exc
    finally:
        sock.close(linger=0)
        ctx.term()


def _log_engine_ready(core: Any, address: str) -> None:
    from lorastar.plugin.startup_log import log_startup

    log_startup(core, getattr(core.engine, "model_name", "?"))  # the engine's lines, as serve's
    logging.getLogger("lorastar").info("lorastar: engine core ready at %s", address)


def _log_to_stderr(level: str) -> None:
    """lorastar's own log lines (start-up summary, shutdown) on stderr, as uvicorn's are."""
    log = logging.getLogger("lorastar")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(
            logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s", "%H:%M:%S")
        )
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(
        logging.getLevelName(level.upper())
        if level.upper() in logging.getLevelNamesMapping()
        else logging.INFO
    )


if __name__ == "__main__":  # python -m lorastar.plugin.cli
    sys.exit(main())
