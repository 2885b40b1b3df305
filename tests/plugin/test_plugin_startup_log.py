"""Start-up summary lines (vLLM-like) from a real engine, and the per-tensor loading bar."""

from __future__ import annotations

import io
import logging
import sys
from pathlib import Path

import pytest
import torch

from lorastar.config import EngineConfig
from lorastar.engine.async_engine import AsyncLLM
from lorastar.plugin.startup_log import log_startup, startup_lines


class _TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_summary_lines_and_progress_bar(
    tiny_model_dir: Path,
    adapter_root: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    err = _TTY()
    monkeypatch.setattr(sys, "stderr", err)
    engine = AsyncLLM(
        EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32", max_model_len=128,
                     num_kv_blocks=24, block_size=16, max_loras=2)
    )  # fmt: skip
    monkeypatch.undo()
    assert "Loading " + tiny_model_dir.name in err.getvalue() and "tensor" in err.getvalue()
    from safetensors import safe_open

    with safe_open(str(tiny_model_dir / "model.safetensors"), framework="pt") as sf:
        n = len(sf.keys())
    assert f"{n}/{n}" in err.getvalue(), err.getvalue()
    engine.engine.load_adapter("alpha", str(adapter_root / "alpha"))
    lines = startup_lines(engine, "tiny", "http://127.0.0.1:1/v1")
    text = "\n".join(lines)
    assert "dtype=float32, device=cpu, quantization=none" in text, text
    assert "KV cache: 24 blocks of 16 tokens = 384 tokens" in text
    assert "Maximum concurrency for 128 tokens per request: 3.00x" in text
    assert "CUDA graphs: off (not on cpu)" in text
    assert f"CPU: {torch.get_num_threads()} threads, GEMM " in text and "OpenMP wait " in text
    assert ", kernels native," in text or ", kernels torch," in text
    assert "Adapters (1): alpha (rank 4, " in text
    assert "http://127.0.0.1:1/v1" in lines[-1]
    with caplog.at_level(logging.INFO, logger="lorastar"):
        log_startup(engine, "tiny")
    assert [r.getMessage() for r in caplog.records if r.name == "lorastar"] == startup_lines(engine, "tiny")


def test_summary_of_a_fake_engine_never_fails() -> None:
    from plugin_fake_engine import FakeAsyncLLM

    engine = FakeAsyncLLM()
    lines = startup_lines(engine, "fake-model")
    assert lines[0] == "Serving model 'fake-model'"
