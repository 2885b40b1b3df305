"""``lorastar serve``: vLLM's flag names, usage problems as one line with exit code 2, found before
anything loads (real processes for the port and path checks)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from lorastar.plugin import cli
from lorastar.plugin.cli import main

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def folders(tmp_path: Path) -> dict[str, Path]:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    root = tmp_path / "root"
    for name in ("a", "b"):
        (root / name).mkdir(parents=True)
        (root / name / "adapter_config.json").write_text("{}")
    (tmp_path / "tpl.jinja").write_text("{{ messages[0]['content'] }}")
    return {"model": model, "root": root, "tpl": tmp_path / "tpl.jinja"}


def test_vllm_flags_reach_the_config(monkeypatch: pytest.MonkeyPatch, folders: dict[str, Path]) -> None:
    seen: dict[str, Any] = {}

    def fake_run(app: Any, sock: socket.socket, log_level: str) -> None:
        seen.update(app=app, port=sock.getsockname()[1], log_level=log_level)
        sock.close()

    monkeypatch.setattr(cli, "run_server", fake_run)
    root = folders["root"]
    r = CliRunner().invoke(
        main,
        ["serve", "--model", str(folders["model"]),
         "--lora-modules", f"a={root / 'a'}",
         "--lora-modules", json.dumps({"name": "b", "path": str(root / "b"), "base_model_name": "m"}),
         "--port", "0", "--admin-token", "t", "--adapter-root", str(root), "--max-waiting", "5",
         "--device", "cpu", "--kv-cache-dtype", "fp8", "--embedding-quantization", "int8",
         "--max-lora-rank", "32", "--enforce-eager", "--max-num-seqs", "7", "--max-num-batched-tokens", "512",
         "--block-size", "32", "--seed", "3", "--max-cpu-loras", "9", "--no-enable-prefix-caching", "--max-logprobs", "-1",
         "--num-gpu-blocks-override", "100", "--tokenizer", str(folders["model"]),
         "--chat-template", str(folders["tpl"]), "--served-model-name", "base", "--enable-lora",
         "--shutdown-drain-timeout", "2.5", "--uvicorn-log-level", "warning", "--cpu-gemm", "torch",
         "--async-scheduling", "--reasoning-parser", "deepseek_r1", "--enable-auto-tool-choice",
         "--tool-call-parser", "hermes", "--thinking-budget-message", "Time is up."],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert seen["port"] > 0 and seen["log_level"] == "warning"
    cfg = seen["app"].plugins.get("LoraStarPlugin").config
    assert cfg.model == str(folders["model"]) and cfg.served_model_name == "base"
    assert cfg.adapters == {"a": str(root / "a"), "b": str(root / "b")}
    assert cfg.admin_token == "t" and cfg.shutdown_drain_timeout == 2.5
    assert cfg.reasoning_parser == "deepseek_r1"
    assert cfg.enable_auto_tool_choice and cfg.tool_call_parser == "hermes"
    assert cfg.thinking_budget_message == "Time is up."
    eng = cfg.engine_config()
    assert eng.max_waiting == 5
    assert (eng.kv_cache_dtype, eng.embedding_quantization, eng.max_lora_rank) == ("fp8", "int8", 32)
    assert eng.enforce_eager and eng.quantization is None and eng.cpu_gemm == "torch"
    assert eng.async_scheduling and eng.max_logprobs == -1
    assert (eng.max_num_seqs, eng.max_num_batched_tokens, eng.block_size, eng.seed) == (7, 512, 32, 3)
    assert (eng.max_cpu_loras, eng.enable_prefix_caching, eng.num_kv_blocks) == (9, False, 100)
    assert eng.tokenizer == str(folders["model"]) and eng.chat_template == "{{ messages[0]['content'] }}"


@pytest.mark.parametrize(
    ("flag", "want"), [([], None), (["--async-scheduling"], True), (["--no-async-scheduling"], False)]
)
def test_async_scheduling_flag(
    monkeypatch: pytest.MonkeyPatch, folders: dict[str, Path], flag: list[str], want: bool | None
) -> None:
    """No flag leaves the engine's default (on for CUDA); either spelling overrides it."""
    seen: dict[str, Any] = {}

    def fake_run(app: Any, sock: socket.socket, log_level: str) -> None:
        seen.update(app=app)
        sock.close()

    monkeypatch.setattr(cli, "run_server", fake_run)
    r = CliRunner().invoke(main, ["serve", str(folders["model"]), "--port", "0", *flag])
    assert r.exit_code == 0, r.output
    assert seen["app"].plugins.get("LoraStarPlugin").config.engine_config().async_scheduling is want


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--adapter", "no-equals-sign"], "expected NAME=PATH"),
        (["--lora-modules", '{"name": "x"}'], "JSON with name and path"),
        (["/no/such/model"], "model folder '/no/such/model' does not exist"),
        (["--lora-modules", "x=/no/such/adapter"], "adapter 'x'"),
        (["--tokenizer", "/no/such/tok"], "--tokenizer folder"),
        (["--chat-template", "not-a-file"], "--chat-template"),
        (["--max-num-seqs", "0"], "max_num_seqs"),
    ],
)
def test_usage_problems_one_line_exit_2(
    args: list[str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli, "run_server", lambda *a: pytest.fail("must not start"))
    r = CliRunner().invoke(main, ["serve", *args])
    assert r.exit_code == 2 and message in r.output and r.output.count("\n") == 1, r.output


def _serve_proc(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lorastar.plugin.cli", "serve", *args],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_taken_port_fails_before_loading() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t0 = time.monotonic()
        p = _serve_proc("--port", str(port), "--device", "cpu")  # the embedded model would take seconds
        elapsed = time.monotonic() - t0
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().count("\n") == 0 and f"cannot listen on 127.0.0.1:{port}" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and elapsed < 30


def test_bad_adapter_path_in_a_real_process(tmp_path: Path) -> None:
    p = _serve_proc("--lora-modules", f"x={tmp_path}", "--port", "0")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert (
        p.stderr.strip() == f"Error: adapter 'x': '{tmp_path}' is not a PEFT folder (no adapter_config.json)"
    )


def test_engine_takes_the_chat_template_and_tokenizer(tiny_model_dir: Path) -> None:
    from lorastar.config import EngineConfig
    from lorastar.engine.engine import LLMEngine

    tpl = "<<{{ messages[0]['content'] }}>>"
    eng = LLMEngine(
        EngineConfig(
            model=str(tiny_model_dir), device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=8,
            chat_template=tpl, tokenizer=str(tiny_model_dir),
        )
    )  # fmt: skip
    ids = eng.apply_chat_template([{"role": "user", "content": "hi"}])
    assert eng.tokenizer.decode(ids) == "<<hi>>"


@pytest.mark.parametrize("command", ["serve", "engine"])
def test_kv_cache_dtype_choices_are_the_engines(command: str) -> None:
    """vLLM's ``fp8_e4m3`` spelling, which ``EngineConfig`` takes, was missing from the flag."""
    from lorastar.config import _KV_DTYPES

    opt = next(p for p in main.commands[command].params if p.name == "kv_cache_dtype")
    assert tuple(opt.type.choices) == _KV_DTYPES  # type: ignore[attr-defined]
