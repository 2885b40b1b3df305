"""Command line: the ``lora`` group (added to ``litestar`` by the plugin) and the ``lorastar`` script.

``litestar lora list|load NAME PATH|unload NAME`` and ``lorastar lora ...`` talk to a running server
over HTTP (``--url``, ``--token`` / ``LORASTAR_ADMIN_TOKEN``; see ``lora_cli.py``). ``lorastar serve`` runs a standalone
server for people who have no app yet.
"""

from __future__ import annotations

import sys

import click

from lorastar.plugin.config import ADMIN_TOKEN_ENV
from lorastar.plugin.lora_cli import make_lora_group


def _parse_adapters(values: tuple[str, ...]) -> dict[str, str]:
    adapters: dict[str, str] = {}
    for v in values:
        name, sep, path = v.partition("=")
        if not sep or not name or not path:
            raise click.BadParameter(f"expected NAME=PATH, got {v!r}", param_hint="--adapter")
        adapters[name] = path
    return adapters


@click.group("lorastar", help="lorastar: serve one LLM with many LoRA adapters over the OpenAI API.")
def main() -> None:
    pass


main.add_command(make_lora_group())


@main.command("serve", help="Serve MODEL (an HF folder; default: the embedded SmolLM2) with the OpenAI API.")
@click.argument("model", required=False)
@click.option("--adapter", "adapters", multiple=True, metavar="NAME=PATH", help="Adapter to load at startup.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--served-model-name", default=None, help="Name of the base in the 'model' field.")
@click.option("--adapter-root", default=None, help="Folder runtime loading may read adapters from.")
@click.option(
    "--admin-token", envvar=ADMIN_TOKEN_ENV, default=None, help=f"Admin token (env {ADMIN_TOKEN_ENV})."
)
@click.option("--api-key", "api_keys", multiple=True, help="Accepted API key (repeatable).")
@click.option("--no-runtime-loading", is_flag=True, help="Do not mount the adapter admin routes.")
@click.option(
    "--enable-adapter-resolver", is_flag=True, help="Load unknown adapter names from --adapter-root."
)
@click.option("--device", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "cuda"]))
@click.option("--dtype", default="auto", show_default=True)
@click.option("--max-model-len", default=None, type=int)
@click.option("--max-num-seqs", default=64, show_default=True, type=int)
@click.option("--num-kv-blocks", default=None, type=int)
@click.option("--max-loras", default=8, show_default=True, type=int)
@click.option("--max-lora-rank", default=64, show_default=True, type=int)
@click.option(
    "--quantization",
    default=None,
    type=click.Choice(["awq", "gptq", "fp8"]),
    help="Force or check the method.",
)
@click.option(
    "--kv-cache-dtype", default="auto", show_default=True, type=click.Choice(["auto", "fp8", "fp8_e5m2"])
)
@click.option(
    "--embedding-quantization", default=None, type=click.Choice(["int8"]), help="int8 embedding / lm_head."
)
@click.option("--enforce-eager", is_flag=True, help="No CUDA graphs.")
@click.option("--max-waiting", default=None, type=int, help="Waiting-queue bound (503 beyond it).")
@click.option("--log-level", default="info", show_default=True)
def serve(
    model: str | None,
    adapters: tuple[str, ...],
    host: str,
    port: int,
    served_model_name: str | None,
    adapter_root: str | None,
    admin_token: str | None,
    api_keys: tuple[str, ...],
    no_runtime_loading: bool,
    enable_adapter_resolver: bool,
    device: str,
    dtype: str,
    max_model_len: int | None,
    max_num_seqs: int,
    num_kv_blocks: int | None,
    max_loras: int,
    max_lora_rank: int,
    quantization: str | None,
    kv_cache_dtype: str,
    embedding_quantization: str | None,
    enforce_eager: bool,
    max_waiting: int | None,
    log_level: str,
) -> None:
    import uvicorn

    from lorastar.config import EngineConfig
    from lorastar.plugin.config import LoraStarConfig
    from lorastar.plugin.plugin import create_app  # lazy: the app stack is only needed to serve

    try:
        engine = EngineConfig(
            device=device,
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            num_kv_blocks=num_kv_blocks,
            max_loras=max_loras,
            max_cpu_loras=max(64, max_loras),
            max_lora_rank=max_lora_rank,
            quantization=quantization,
            kv_cache_dtype=kv_cache_dtype,
            embedding_quantization=embedding_quantization,
            enforce_eager=enforce_eager,
        )
        config = LoraStarConfig(
            model=model,
            served_model_name=served_model_name,
            adapters=_parse_adapters(adapters),
            adapter_root=adapter_root,
            allow_runtime_adapter_loading=not no_runtime_loading,
            admin_token=admin_token,
            api_keys=list(api_keys) or None,
            engine=engine,
            max_waiting=max_waiting,
            enable_adapter_resolver=enable_adapter_resolver,
        )
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    app = create_app(config)
    click.echo(f"lorastar: serving on http://{host}:{port}{config.path}", err=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level)


if __name__ == "__main__":  # python -m lorastar.plugin.cli
    sys.exit(main())
