"""Review of request ids (X-Request-Id) and ``--config FILE``: each test here failed on the code it
was written against."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from plugin_support import engine_config

from lorastar.plugin import cli
from lorastar.plugin.cli import main


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    return tmp_path / "m"


def serve(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    text: str,
    args: list[str],
    env: dict[str, str] | None = None,
) -> tuple[Any, Any]:
    """``lorastar serve --config FILE ARGS`` up to uvicorn: (the click result, the plugin config or None)."""
    seen: dict[str, Any] = {}

    def fake_run(app: Any, sock: socket.socket, log_level: str) -> None:
        seen["config"] = app.plugins.get("LoraStarPlugin").config
        sock.close()

    monkeypatch.setattr(cli, "run_server", fake_run)
    path = tmp_path / "config.yaml"
    path.write_text(text)
    result = CliRunner().invoke(main, ["serve", "--config", str(path), *args], env=env)
    return result, seen.get("config")


@pytest.mark.parametrize("env_name", ["LORASTAR_API_KEY", "VLLM_API_KEY"])
def test_the_files_api_key_wins_over_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, model_dir: Path, env_name: str
) -> None:
    """vLLM's --config is the command line's equivalent: its api-key wins over VLLM_API_KEY. Here the
    environment's key silently replaced the file's (clients using the file's key got 401)."""
    r, cfg = serve(
        monkeypatch,
        tmp_path,
        f"model: {model_dir}\nport: 0\napi-key: from-file\n",
        [],
        env={env_name: "from-env"},
    )
    assert r.exit_code == 0, r.output
    assert cfg.api_keys == ["from-file"]


@pytest.mark.parametrize(
    ("text", "option"),
    [
        pytest.param("max-num-seqs: 7.5\n", "--max-num-seqs", id="float-for-int"),  # was silently 7
        pytest.param("max-model-len: true\n", "--max-model-len", id="bool-for-int"),  # was silently 1
        pytest.param(
            "gpu-memory-utilization: true\n", "--gpu-memory-utilization", id="bool-for-float"
        ),  # was silently 1.0
    ],
)
def test_a_number_option_refuses_floats_and_booleans(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, model_dir: Path, text: str, option: str
) -> None:
    """As the same value on the command line (and as vLLM's file, read as argv): exit 2, naming it."""
    r, cfg = serve(monkeypatch, tmp_path, f"model: {model_dir}\nport: 0\n{text}", [])
    assert r.exit_code == 2, (r.output, cfg and cfg.engine_config())
    assert option in r.output and cfg is None


def test_served_model_names_after_a_file_that_names_the_model(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, model_dir: Path
) -> None:
    """`--served-model-name a b` with the model in the file: the file's model is vLLM's `--model`, so
    both words are names (vLLM's nargs='+'); `b` was taken as MODEL ("model folder 'b' does not exist")."""
    r, cfg = serve(monkeypatch, tmp_path, f"model: {model_dir}\nport: 0\n", ["--served-model-name", "a", "b"])
    assert r.exit_code == 0, r.output
    assert cfg.model == str(model_dir) and cfg.served_model_name == ["a", "b"]


def test_request_id_header_on_404_and_405_under_the_api_prefix(tiny_model_dir: Path) -> None:
    """With enable_request_id_headers, the errors lorastar itself answers under /v1 (its OpenAI-shaped
    404 / 405, e.g. GET /v1/chat/completions) carry X-Request-Id too, as vLLM's do."""
    from litestar import Litestar
    from litestar.testing import TestClient

    from lorastar.plugin import LoraStarConfig, LoraStarPlugin

    plugin = LoraStarPlugin(
        LoraStarConfig(
            engine=engine_config(tiny_model_dir), served_model_name="tiny", enable_request_id_headers=True
        )
    )
    with TestClient(Litestar(plugins=[plugin])) as c:
        for method, path, status in [
            ("get", "/v1/chat/completions", 405),
            ("post", "/v1/models", 405),
            ("get", "/v1/no-such-route", 404),
        ]:
            r = c.request(method.upper(), path, headers={"X-Request-Id": "gw-7"})
            assert r.status_code == status and r.json()["error"]["code"] == status
            assert r.headers.get("x-request-id") == "gw-7", (method, path)
