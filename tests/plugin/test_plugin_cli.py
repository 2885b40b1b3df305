"""`litestar lora ...` (the plugin's CLI group) and the `lorastar` console script, with click's runner
against live servers."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from click.testing import CliRunner
from plugin_fake_engine import FakeAsyncLLM
from plugin_support import ServerThread, free_port, wait_until

from lorastar.plugin import LoraStarConfig, create_app
from lorastar.plugin.cli import main

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cli_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli-adapters")
    for name in ("one", "two"):
        (root / name).mkdir()
        (root / name / "adapter_config.json").write_text("{}")
    return root


@pytest.fixture(scope="module")
def cli_server(cli_root: Path) -> Iterator[ServerThread]:
    app = create_app(
        LoraStarConfig(
            async_engine=FakeAsyncLLM(),
            adapter_root=cli_root,
            admin_token="tok",
            adapters={"one": str(cli_root / "one")},
        )
    )
    with ServerThread(app) as srv:
        yield srv


def litestar_cli(*args: str, env: dict[str, str] | None = None) -> Any:
    from litestar.cli.main import litestar_group

    return CliRunner().invoke(
        litestar_group, ["--app-dir", str(REPO), "--app", "examples.app:app", *args], env=env
    )


def test_litestar_lora_group_list_load_unload(cli_server: ServerThread, cli_root: Path) -> None:
    url = cli_server.url + "/v1"
    r = litestar_cli("lora", "--url", url, "list")
    assert r.exit_code == 0, r.output
    assert "base model: fake-model" in r.output and "one" in r.output
    assert str(cli_root) not in r.output  # paths relative to the adapter root: no server paths
    r = litestar_cli("lora", "--url", url, "--token", "tok", "load", "two", str(cli_root / "two"))
    assert r.exit_code == 0 and "Success: LoRA adapter 'two' added successfully." in r.output, r.output
    # The token can come from the environment.
    r = litestar_cli("lora", "--url", url, "unload", "two", env={"LORASTAR_ADMIN_TOKEN": "tok"})
    assert r.exit_code == 0 and "removed successfully" in r.output, r.output
    r = litestar_cli("lora", "--url", url, "--token", "wrong", "unload", "one")
    assert r.exit_code == 1 and "401" in r.output


def test_lorastar_script_lora_commands_and_failures(
    cli_server: ServerThread, cli_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LORASTAR_ADMIN_TOKEN", raising=False)
    url = cli_server.url + "/v1"
    runner = CliRunner()
    r = runner.invoke(
        main, ["lora", "--url", url, "--token", "tok", "load", "two", "two"]
    )  # relative to the root
    assert r.exit_code == 0 and "added successfully" in r.output, r.output
    r = runner.invoke(main, ["lora", "--url", url, "list"])
    assert r.exit_code == 0 and "two" in r.output.split("PATH", 1)[1]
    failures = {
        ("load", "x", "/etc"): "403",  # outside the adapter root
        ("load", "two", "two"): "already been loaded",
        ("unload", "ghost"): "cannot be found",
    }
    for args, text in failures.items():
        r = runner.invoke(main, ["lora", "--url", url, "--token", "tok", *args])
        assert r.exit_code == 1 and text in r.output, (args, r.output)
    r = runner.invoke(main, ["lora", "--url", url, "--token", "tok", "load", "--replace", "two", "one"])
    assert r.exit_code == 0 and "added successfully" in r.output, r.output  # replaced in place
    r = runner.invoke(main, ["lora", "--url", url, "unload", "two"])  # no token at all
    assert r.exit_code == 1 and "401" in r.output
    r = runner.invoke(main, ["lora", "--url", f"http://127.0.0.1:{free_port()}/v1", "list"])
    assert r.exit_code == 1 and "cannot reach" in r.output
    assert runner.invoke(main, ["lora", "--url", url, "--token", "tok", "unload", "two"]).exit_code == 0


def test_lorastar_serve_live(tiny_model_dir: Path, adapter_root: Path) -> None:
    """`lorastar serve MODEL --adapter name=path` in a real process, then the CLI and openai against it."""
    port = free_port()
    env = dict(os.environ, LORASTAR_ADMIN_TOKEN="serve-token")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lorastar.plugin.cli",
            "serve",
            str(tiny_model_dir),
            "--adapter",
            f"alpha={adapter_root / 'alpha'}",
            "--port",
            str(port),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--max-model-len",
            "256",
            "--num-kv-blocks",
            "256",
            "--adapter-root",
            str(adapter_root),
            "--log-level",
            "warning",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return proc.poll() is not None

    try:
        assert wait_until(healthy, timeout=120, interval=0.2) and proc.poll() is None, (
            proc.stdout.read().decode()
        )
        runner = CliRunner()
        r = runner.invoke(main, ["lora", "--url", url + "/v1", "list"])
        assert r.exit_code == 0 and "alpha" in r.output and tiny_model_dir.name in r.output, r.output
        r = runner.invoke(
            main,
            ["lora", "--url", url + "/v1", "load", "beta", "beta"],
            env={"LORASTAR_ADMIN_TOKEN": "serve-token"},
        )
        assert r.exit_code == 0, r.output
        client = openai.OpenAI(base_url=url + "/v1", api_key="x")
        out = client.completions.create(model="beta", prompt="Hello", max_tokens=3, temperature=0)
        assert out.usage.completion_tokens >= 1
    finally:
        proc.terminate()
        proc.wait(timeout=30)
