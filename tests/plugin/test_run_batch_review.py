"""Review of ``lorastar run-batch``: bugs a user hits with odd but valid input or a failed start."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from lorastar.plugin.cli import main


def line(custom_id: str, url: str = "/v1/completions", **body: Any) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


pytestmark = pytest.mark.usefixtures("restore_lorastar_logger")


def _flags(model: Path) -> list[str]:
    return [str(model), "--served-model-name", "tiny", "--device", "cpu", "--no-engine-process",
            "--disable-log-stats"]  # fmt: skip


def test_output_same_as_input_and_a_failed_start_keeps_the_input(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """``-o`` naming the input file: a start-up failure (here --max-model-len beyond the model's 512
    positions) must not leave the user's batch file truncated to 0 bytes. Today the output is opened
    with "w" before the model loads, so the input is gone (and a SIGTERM mid-run loses the unanswered
    requests the same way)."""
    batch = tmp_path / "batch.jsonl"
    text = line("a", model="tiny", prompt="hi", max_tokens=2) + "\n"
    batch.write_text(text, encoding="utf-8")
    r = CliRunner().invoke(
        main,
        [
            "run-batch",
            "-i",
            str(batch),
            "-o",
            str(batch),
            *_flags(tiny_model_dir),
            "--max-model-len",
            "100000",
        ],
    )
    assert r.exit_code == 2, r.output
    assert batch.read_text(encoding="utf-8") == text, "the input file was clobbered"


def test_custom_id_with_a_lone_surrogate_does_not_crash_the_run(tiny_model_dir: Path, tmp_path: Path) -> None:
    """``"custom_id": "a\\ud83d"`` is valid JSON the file check accepts; writing the record with
    ensure_ascii=False to the UTF-8 output raises UnicodeEncodeError, the run dies with a traceback
    (exit 1) and the other lines are not written. Either the file check names the line (exit 2,
    before loading) or the record is written."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    bad = line("a\ud83d", model="tiny", prompt="hi", max_tokens=2)  # json.dumps writes the escape
    assert "\\ud83d" in bad
    inp.write_text(bad + "\n" + line("b", model="tiny", prompt="hi", max_tokens=2) + "\n", encoding="utf-8")
    r = CliRunner().invoke(main, ["run-batch", "-i", str(inp), "-o", str(out), *_flags(tiny_model_dir)])
    assert r.exit_code in (0, 2), (r.exit_code, repr(r.exception), r.output[-2000:])
    if r.exit_code == 2:
        assert "line 1" in r.output
    else:
        records = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
        assert [rec["response"]["status_code"] for rec in records] == [200, 200]
