"""vLLM's ``--gpu-memory-utilization`` (scripts copied from vLLM passed it and got "no such option"):
the KV cache gets 80% of what that fraction of the GPU's total memory leaves over what the device
holds once the weights are in (the default's activation share), at most the driver's free bytes. The
CUDA memory calls are faked: the sizing arithmetic runs without a GPU."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lorastar.config import EngineConfig
from lorastar.engine.engine import LLMEngine

GiB = 1 << 30


def _blocks(monkeypatch: pytest.MonkeyPatch, device: str, **cfg: Any) -> int:
    """KV blocks of 1 MiB each on a faked 80 GiB GPU where 10 GiB is in use (2 GiB of it torch's
    cached-but-unused bytes) and 70 GiB is free."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * GiB, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 6 * GiB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 4 * GiB)
    engine = SimpleNamespace(config=EngineConfig(**cfg), device=torch.device(device))
    return LLMEngine._auto_num_blocks(engine, SimpleNamespace(bytes_per_block=1 << 20))  # type: ignore[arg-type]


def test_the_fraction_sizes_the_kv_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    # default: 80% of free + cached (72 GiB), at most the free 70 GiB
    assert _blocks(monkeypatch, "cuda") == int(72 * GiB * 0.8) >> 20
    # 0.9 of 80 GiB = 72 GiB, less the 8 GiB held (10 used, 2 of them reusable): 80% of 64 GiB
    assert _blocks(monkeypatch, "cuda", gpu_memory_utilization=0.9) == int(64 * GiB * 0.8) >> 20
    assert _blocks(monkeypatch, "cuda", gpu_memory_utilization=0.5) == int(32 * GiB * 0.8) >> 20
    # all of it: the default's size (80 GiB less the 8 held)
    assert _blocks(monkeypatch, "cuda", gpu_memory_utilization=1.0) == int(72 * GiB * 0.8) >> 20
    # kv_cache_memory, when given, wins
    assert _blocks(monkeypatch, "cuda", gpu_memory_utilization=0.9, kv_cache_memory=GiB) == 1024


def test_a_fraction_that_leaves_nothing_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(
        ValueError, match=r"gpu_memory_utilization=0\.1: 8\.0 GiB .* 8\.0 GiB the device holds"
    ):
        _blocks(monkeypatch, "cuda", gpu_memory_utilization=0.1)


def test_cpu_ignores_it_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="lorastar"):
        assert _blocks(monkeypatch, "cpu", gpu_memory_utilization=0.9) == 1024  # the CPU default, 1 GiB
    assert "gpu_memory_utilization is ignored on CPU" in caplog.text


@pytest.mark.parametrize("bad", [0, 0.0, 1.5, -0.2, True, "0.9"])
def test_out_of_range_values_are_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        EngineConfig(gpu_memory_utilization=bad)


def test_serve_takes_the_flag() -> None:
    from click.testing import CliRunner

    from lorastar.plugin import cli

    res = CliRunner().invoke(cli.main, ["serve", "--gpu-memory-utilization", "1.5", "--port", "1"])
    assert res.exit_code == 2 and "--gpu-memory-utilization" in res.output and "Traceback" not in res.output
    cfg = cli.engine_config(
        tokenizer=None, chat_template=None, max_cpu_loras=None, max_loras=1, gpu_memory_utilization=0.85
    )
    assert cfg.gpu_memory_utilization == 0.85
