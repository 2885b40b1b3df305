"""``TokenizerLoader`` (engine/input_processor.py): one load, on first use, whatever the threads."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from lorastar.engine import input_processor
from lorastar.engine.input_processor import InputProcessor, TokenizerLoader


def test_loads_once_on_first_use_across_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Path, str | None]] = []

    def slow_load(folder: Path, chat_template: str | None = None) -> Any:
        calls.append((folder, chat_template))
        time.sleep(0.05)  # a second caller arrives mid-load
        return object()

    monkeypatch.setattr(input_processor, "load_tokenizer", slow_load)
    loader = TokenizerLoader(Path("/m"), "{{ x }}")
    inputs = InputProcessor(loader, model_name="m", max_model_len=8, max_prompt_bytes=64, vocab_size=10)
    assert not loader.loaded and calls == []
    inputs.validate_prompt([1, 2, 3])  # token ids: no tokenizer needed
    assert calls == []
    got: list[Any] = []
    threads = [threading.Thread(target=lambda: got.append(loader.get())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [(Path("/m"), "{{ x }}")] and loader.loaded
    assert all(g is got[0] for g in got) and inputs.tokenizer is got[0]


def test_a_failed_background_load_is_logged_and_the_next_get_raises(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    attempts: list[int] = []

    def broken(folder: Path, chat_template: str | None = None) -> Any:
        attempts.append(1)
        raise OSError(f"no tokenizer in {folder}")

    monkeypatch.setattr(input_processor, "load_tokenizer", broken)
    loader = TokenizerLoader(Path("/nothing"))
    loader.load_in_background().join(timeout=10)
    assert "loading the tokenizer failed" in caplog.text and not loader.loaded
    with pytest.raises(OSError, match="no tokenizer in /nothing"):
        loader.get()
    assert len(attempts) == 2
