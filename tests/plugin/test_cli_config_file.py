"""``--config FILE`` (vLLM's YAML of long option names) on ``serve``, ``run-batch`` and ``engine``:
command line > file > defaults, MODEL over the file's ``model``, and every bad file or key a
one-line usage error (exit 2) before anything loads."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from lorastar.plugin import cli
from lorastar.plugin.cli import main


@pytest.fixture
def folders(tmp_path: Path) -> dict[str, Path]:
    out = {}
    for name in ("m", "m2"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
        out[name] = tmp_path / name
    for name in ("a", "b"):
        (tmp_path / "root" / name).mkdir(parents=True)
        (tmp_path / "root" / name / "adapter_config.json").write_text("{}")
    out["root"] = tmp_path / "root"
    return out


def serve(monkeypatch: pytest.MonkeyPatch, args: list[str]) -> tuple[Any, Any]:
    """``lorastar serve ARGS`` up to uvicorn: (the click result, the plugin config or None)."""
    seen: dict[str, Any] = {}

    def fake_run(app: Any, sock: socket.socket, log_level: str) -> None:
        seen.update(
            config=app.plugins.get("LoraStarPlugin").config, port=sock.getsockname()[1], level=log_level
        )
        sock.close()

    monkeypatch.setattr(cli, "run_server", fake_run)
    result = CliRunner().invoke(main, ["serve", *args])
    return result, seen


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


def test_the_file_sets_options_by_their_long_names(
    monkeypatch: pytest.MonkeyPatch, folders: dict[str, Path], tmp_path: Path
) -> None:
    root = folders["root"]
    config = write(
        tmp_path,
        f"""
model: {folders["m"]}
port: 0
uvicorn-log-level: warning
max-num-seqs: 7
max_lora_rank: 32            # underscores as vLLM's parser takes them
enable-prefix-caching: false # the --no- side of a flag pair
no-async-scheduling: true
enforce-eager: true
served-model-name: [base, alias]
lora-modules:
  - a={root / "a"}
  - {{name: b, path: {root / "b"}}}
speculative-config: {{method: ngram, num_speculative_tokens: 3}}
allowed-origins: ["https://chat.example"]
api-key: secret
reasoning-parser: deepseek_r1
""",
    )
    r, seen = serve(monkeypatch, ["--config", config])
    assert r.exit_code == 0, r.output
    cfg = seen["config"]
    assert seen["level"] == "warning"
    assert cfg.model == str(folders["m"]) and cfg.served_model_name == ["base", "alias"]
    assert cfg.adapters == {"a": str(root / "a"), "b": str(root / "b")}
    assert cfg.api_keys == ["secret"] and cfg.reasoning_parser == "deepseek_r1"
    eng = cfg.engine_config()
    assert (eng.max_num_seqs, eng.max_lora_rank, eng.enable_prefix_caching) == (7, 32, False)
    assert eng.async_scheduling is False and eng.enforce_eager
    spec = eng.speculative_config
    assert (spec.method, spec.num_speculative_tokens) == ("ngram", 3)


def test_the_command_line_wins_over_the_file(
    monkeypatch: pytest.MonkeyPatch, folders: dict[str, Path], tmp_path: Path
) -> None:
    config = write(tmp_path, f"model: {folders['m']}\nport: 0\nmax-num-seqs: 7\nenforce-eager: true\n")
    r, seen = serve(monkeypatch, [str(folders["m2"]), "--config", config, "--max-num-seqs", "9"])
    assert r.exit_code == 0, r.output
    cfg = seen["config"]
    assert cfg.model == str(folders["m2"])  # MODEL over the file's model, as vLLM
    eng = cfg.engine_config()
    assert eng.max_num_seqs == 9 and eng.enforce_eager  # the flag over the file; the rest kept
    # Without the file, the defaults.
    r, seen = serve(monkeypatch, [str(folders["m"]), "--port", "0"])
    assert r.exit_code == 0 and seen["config"].engine_config().max_num_seqs == 64


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max-num-seq: 3\n", "'max-num-seq' is not an option of `lorastar serve`"),
        ("config: other.yaml\n", "'config' is not an option"),
        ("enforce-eager: yes please\n", "enforce-eager takes true or false, got 'yes please'"),
        ("- port: 1\n", "a mapping of option names to values is expected"),
        ("port: [unclosed\n", "not YAML"),
        ("port: -5\n", "--port"),
        ("kv-cache-dtype: int3\n", "--kv-cache-dtype"),
    ],
)
def test_bad_files_are_one_line_usage_errors(
    monkeypatch: pytest.MonkeyPatch, folders: dict[str, Path], tmp_path: Path, text: str, message: str
) -> None:
    r, seen = serve(monkeypatch, [str(folders["m"]), "--config", write(tmp_path, text)])
    assert r.exit_code == 2, r.output
    assert message in r.output and "Traceback" not in r.output
    assert not seen  # nothing started


def test_a_missing_file_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    r, _ = serve(monkeypatch, ["--config", str(tmp_path / "none.yaml")])
    assert r.exit_code == 2 and "--config" in r.output and "No such file or directory" in r.output


def test_run_batch_and_engine_take_the_file_too(folders: dict[str, Path], tmp_path: Path) -> None:
    """Each command checks the file against its own options (serve's --port is not run-batch's)."""
    batch = tmp_path / "in.jsonl"
    batch.write_text(
        json.dumps({"custom_id": "x", "method": "GET", "url": "/v1/completions", "body": {}}) + "\n"
    )
    r = CliRunner().invoke(
        main,
        ["run-batch", "-i", str(batch), "-o", str(tmp_path / "o"), "--config", write(tmp_path, "port: 1\n")],
    )
    assert r.exit_code == 2 and "'port' is not an option of `lorastar run-batch`" in r.output
    # engine: the file's model is the one checked (a folder without config.json is refused).
    (tmp_path / "empty").mkdir()
    r = CliRunner().invoke(
        main,
        [
            "engine",
            "--address",
            "tcp://127.0.0.1:1",
            "--config",
            write(tmp_path, f"model: {tmp_path / 'empty'}\n"),
        ],
    )
    assert r.exit_code == 2 and f"model folder '{tmp_path / 'empty'}' has no config.json" in r.output
