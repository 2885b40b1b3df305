"""Speculative decoding at its edges (review): settings that cannot work together are refused by
the config, as vLLM's config refuses them, so ``lorastar serve`` exits with a usage error instead
of starting a server whose engine then fails to start."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from lorastar.config import EngineConfig
from lorastar.plugin import cli
from lorastar.plugin.cli import main

SPEC = {"method": "ngram", "num_speculative_tokens": 2}


def test_async_scheduling_with_drafts_is_refused_by_the_config() -> None:
    with pytest.raises(ValueError, match="speculative_config and async_scheduling"):
        EngineConfig(speculative_config=SPEC, async_scheduling=True)
    # the default (None: on for CUDA) is turned off by the engine; False is fine
    assert EngineConfig(speculative_config=SPEC).speculative_config is not None
    assert EngineConfig(speculative_config=SPEC, async_scheduling=False).async_scheduling is False


def test_serve_refuses_async_scheduling_with_drafts_before_starting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "run_server", lambda *a: pytest.fail("must not start"))
    r = CliRunner().invoke(
        main,
        [
            "serve",
            "--port",
            "0",
            "--async-scheduling",
            "--speculative-config",
            '{"num_speculative_tokens": 2}',
        ],
    )
    assert r.exit_code == 2, r.output
    assert "speculative_config and async_scheduling" in r.output and "Traceback" not in r.output
