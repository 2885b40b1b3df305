"""``lorastar run-batch``: vLLM's OpenAI batch-file runner. Greedy answers equal transformers (base)
and PEFT (adapter) token for token; records come back in input order with the route's errors; a
bad file fails before anything loads, naming each bad line."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from lorastar.plugin.batch_file import MAX_PROBLEMS_SHOWN, BatchFileError, BatchLine, parse_batch, run_batch
from lorastar.plugin.cli import main

PROMPTS = ["The capital of France is", "1, 2, 3, 4,"]


def line(custom_id: str, url: str = "/v1/completions", **body: Any) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


# ----------------------------------------------------------------------------- the file


def test_every_bad_line_is_named_with_its_number() -> None:
    lines = [
        line("ok", model="m", prompt="x"),
        "{not json",
        "[1, 2]",
        json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}),
        json.dumps({"custom_id": "g", "method": "GET", "url": "/v1/completions", "body": {}}),
        line("e", "/v1/audio/transcriptions", file="x"),
        json.dumps({"custom_id": "s", "method": "POST", "url": "/v1/completions", "body": "x"}),
        line("st", stream=True, prompt="x"),
        "",
        line("ok", prompt="again"),
    ]
    with pytest.raises(BatchFileError) as info:
        parse_batch(lines)
    problems = info.value.problems
    assert [p.split(":")[0] for p in problems] == [f"line {n}" for n in (2, 3, 4, 5, 6, 7, 8, 10)]
    for number, words in [
        (2, "not JSON"),
        (3, "a JSON object is expected, got list"),
        (4, "custom_id must be a non-empty string"),
        (5, "method must be \"POST\", got 'GET'"),
        (6, "'/v1/audio/transcriptions' is not served by run-batch"),
        (7, "body must be a JSON object"),
        (8, "body.stream is true"),
        (10, "custom_id 'ok' repeats line 1"),
    ]:
        assert any(p.startswith(f"line {number}: ") and words in p for p in problems), (number, problems)


def test_good_lines_parse_and_many_problems_are_cut() -> None:
    parsed = parse_batch(["", line("a", model="m", prompt="x"), "  ", line("b", "/v1/chat/completions")])
    assert [(b.number, b.custom_id, b.url) for b in parsed] == [
        (2, "a", "/v1/completions"),
        (4, "b", "/v1/chat/completions"),
    ]
    assert json.loads(parsed[0].body) == {"model": "m", "prompt": "x"}
    with pytest.raises(BatchFileError) as info:
        parse_batch(["nope"] * (MAX_PROBLEMS_SHOWN + 5))
    text = str(info.value)
    assert len(info.value.problems) == MAX_PROBLEMS_SHOWN + 5
    assert text.count("not JSON") == MAX_PROBLEMS_SHOWN and text.endswith("... and 5 more")


def test_a_byte_order_mark_is_skipped_and_nan_is_refused() -> None:
    """Files from Windows tools may start with a BOM; Python's JSON reader takes NaN, which no
    route does (the 400 would point at a byte of the re-encoded body, not the line)."""
    parsed = parse_batch(["\ufeff" + line("a", prompt="x"), line("b", prompt="y")])
    assert [b.custom_id for b in parsed] == ["a", "b"]
    with pytest.raises(BatchFileError) as info:
        parse_batch([line("a", prompt="x").replace('"x"', "NaN"), line("b", temperature=float("inf"))])
    assert info.value.problems == [
        "line 1: not JSON (NaN is not JSON)",
        "line 2: not JSON (Infinity is not JSON)",
    ]


# ----------------------------------------------------------------------------- the runner (a fake app)


def test_records_come_in_input_order_within_the_concurrency_bound() -> None:
    """Later lines answer first; each record waits for the ones before it, and no more than
    ``concurrency`` requests are in flight. A failing app is a 500 record, not a failed run."""
    in_flight = {"now": 0, "most": 0}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = json.loads((await receive())["body"])
        in_flight["now"] += 1
        in_flight["most"] = max(in_flight["most"], in_flight["now"])
        await asyncio.sleep(0.002 * (20 - body["i"]))
        in_flight["now"] -= 1
        if body["i"] == 7:
            raise RuntimeError("boom")
        status = 400 if body["i"] == 3 else 200
        payload = (
            {"error": {"message": "bad", "code": 400}}
            if status == 400
            else {"echo": body["i"], "path": scope["path"]}
        )
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": json.dumps(payload).encode()})

    lines = [
        BatchLine(i + 1, f"r{i}", "/v1/chat/completions", json.dumps({"i": i}).encode()) for i in range(20)
    ]
    out = io.StringIO()
    seen: list[int] = []
    summary = asyncio.run(
        run_batch(app, lines, out, prefix="/llm/v1", concurrency=4, on_answer=lambda n, s: seen.append(n))
    )
    records = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [r["custom_id"] for r in records] == [f"r{i}" for i in range(20)]
    assert in_flight["most"] == 4
    assert (summary.succeeded, summary.failed) == (18, 2) and seen == list(range(1, 21))
    ok = records[0]
    assert ok["error"] is None and ok["response"]["status_code"] == 200
    assert ok["response"]["body"] == {"echo": 0, "path": "/llm/v1/chat/completions"}
    assert ok["id"].startswith("lorastar-") and ok["response"]["request_id"].startswith("lorastar-batch-")
    assert len({r["id"] for r in records}) == 20
    refused = records[3]
    assert refused["response"] == {**refused["response"], "status_code": 400, "body": None}
    assert refused["error"] == {"error": {"message": "bad", "code": 400}}
    crashed = records[7]
    assert crashed["response"]["status_code"] == 500 and "boom" in crashed["error"]["error"]["message"]


# ----------------------------------------------------------------------------- the command


def test_a_bad_file_fails_before_anything_loads(tmp_path: Path) -> None:
    bad = tmp_path / "in.jsonl"
    bad.write_text(
        line("a", prompt="x") + "\n" + line("a", prompt="y") + "\n" + line("b", "/v1/rerank") + "\n"
    )
    out = tmp_path / "out.jsonl"
    # No such model: the file is checked first, so the model is never looked at.
    r = CliRunner().invoke(main, ["run-batch", "-i", str(bad), "-o", str(out), str(tmp_path / "no-model")])
    assert r.exit_code == 2, r.output
    assert "2 bad line(s), nothing was run" in r.output
    assert "line 2: custom_id 'a' repeats line 1" in r.output and "line 3: url '/v1/rerank'" in r.output
    assert not out.exists()
    r = CliRunner().invoke(main, ["run-batch", "-i", str(tmp_path / "missing.jsonl"), "-o", str(out)])
    assert r.exit_code == 2 and "No such file or directory" in r.output
    good = tmp_path / "good.jsonl"
    good.write_text(line("a", prompt="x") + "\n")
    r = CliRunner().invoke(main, ["run-batch", "-i", str(good), "-o", str(tmp_path / "no-dir" / "o.jsonl")])
    assert r.exit_code == 2 and "--output-file" in r.output


def test_a_failed_start_leaves_an_earlier_output_alone(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The output is opened once the engine has started: a start that fails (--max-model-len past
    the model's positions) is a usage error and the last run's answers stay."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(line("a", model="tiny", prompt="x") + "\n")
    out.write_text("the last run's answers\n")
    proc = subprocess.run(
        [sys.executable, "-m", "lorastar.plugin.cli", "run-batch", "-i", str(inp), "-o", str(out), str(tiny_model_dir),
         "--served-model-name", "tiny", "--device", "cpu", "--no-engine-process", "--max-model-len", "100000"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 2 and "Error: cannot start: max_model_len" in proc.stderr, proc.stderr[-2000:]
    assert out.read_text() == "the last run's answers\n"


def test_a_closed_stdout_stops_the_run_without_a_traceback(tiny_model_dir: Path) -> None:
    """``run-batch -o - | head -1``: once the reader is gone the run stops, saying so."""
    batch = "".join(line(f"r{i}", model="tiny", prompt=PROMPTS[0], max_tokens=50) + "\n" for i in range(200))
    proc = subprocess.Popen(
        [sys.executable, "-m", "lorastar.plugin.cli", "run-batch", "-i", "-", "-o", "-", str(tiny_model_dir),
         "--served-model-name", "tiny", "--max-num-seqs", "1", "--device", "cpu", "--no-engine-process",
         "--disable-log-stats"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    try:
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        proc.stdin.write(batch)
        proc.stdin.close()
        first = json.loads(proc.stdout.readline())
        proc.stdout.close()
        err = proc.stderr.read()
        proc.wait(timeout=120)
    finally:
        proc.kill()
    assert first["custom_id"] == "r0"
    assert proc.returncode == 1 and "the reader of stdout went away after" in err, err[-2000:]
    assert "Traceback" not in err


def _references(model_dir: Path, adapter: Path, max_new: int) -> dict[tuple[str | None, str], list[int]]:
    """Greedy new token ids from transformers (base) and PEFT (adapter), per (adapter, prompt)."""
    import torch
    from peft import PeftModel
    from transformers import AutoTokenizer

    from tests.conftest import hf_model

    tok = AutoTokenizer.from_pretrained(model_dir)
    out: dict[tuple[str | None, str], list[int]] = {}
    base = hf_model(model_dir, torch.float32)
    for name in (None, "alpha"):
        model = (
            base if name is None else PeftModel.from_pretrained(hf_model(model_dir, torch.float32), adapter)
        )
        for prompt in PROMPTS:
            ids = torch.tensor([tok(prompt)["input_ids"]])
            with torch.no_grad():
                gen = model.generate(ids, max_new_tokens=max_new, do_sample=False, min_new_tokens=max_new)
            out[(name, prompt)] = gen[0, ids.shape[1] :].tolist()
    return out


def test_run_batch_answers_as_transformers_and_peft(
    tiny_model_dir: Path, adapter_root: Path, tmp_path: Path
) -> None:
    """The real command, reading stdin: base and adapter lines (one holding two prompts), a chat
    line, a line the route refuses and an unknown model, at 2 x --max-num-seqs 2 in flight."""
    greedy = {"max_tokens": 8, "temperature": 0, "return_token_ids": True, "ignore_eos": True}
    batch = [
        line("base-0", model="tiny", prompt=PROMPTS[0], **greedy),
        line("alpha-both", model="alpha", prompt=PROMPTS, **greedy),
        line(
            "chat",
            "/v1/chat/completions",
            model="alpha",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
        ),
        line("refused", model="tiny", prompt="x", temperature=-1),
        line("unknown", model="nobody", prompt="x"),
        line("base-1", model="tiny", prompt=PROMPTS[1], **greedy),
    ]
    out = tmp_path / "out.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "lorastar.plugin.cli", "run-batch", "-i", "-", "-o", str(out), str(tiny_model_dir),
         "--served-model-name", "tiny", "--lora-modules", f"alpha={adapter_root / 'alpha'}",
         "--max-num-seqs", "2", "--device", "cpu", "--no-engine-process", "--disable-log-stats"],
        input="\n".join(batch) + "\n", capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "4 answered, 2 refused" in proc.stderr
    records = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert list(records) == ["base-0", "alpha-both", "chat", "refused", "unknown", "base-1"]

    want = _references(tiny_model_dir, adapter_root / "alpha", 8)
    assert records["base-0"]["response"]["body"]["choices"][0]["token_ids"] == want[(None, PROMPTS[0])]
    assert records["base-1"]["response"]["body"]["choices"][0]["token_ids"] == want[(None, PROMPTS[1])]
    both = records["alpha-both"]["response"]["body"]
    assert [c["token_ids"] for c in sorted(both["choices"], key=lambda c: c["index"])] == [
        want[("alpha", p)] for p in PROMPTS
    ]
    assert want[("alpha", PROMPTS[0])] != want[(None, PROMPTS[0])]  # the adapter changes the answer
    chat = records["chat"]["response"]["body"]
    assert (
        chat["object"] == "chat.completion"
        and chat["model"] == "alpha"
        and chat["usage"]["completion_tokens"] >= 1
    )
    refused = records["refused"]
    assert refused["response"]["status_code"] == 400 and refused["error"]["error"]["param"] == "temperature"
    assert (
        records["unknown"]["response"]["status_code"] == 404
        and "nobody" in records["unknown"]["error"]["error"]["message"]
    )


def test_sigterm_stops_the_run_and_keeps_the_answered_lines(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A run stopped part way exits promptly; what it wrote is whole records of the first lines."""
    batch = [
        line(f"r{i}", model="tiny", prompt=PROMPTS[0], max_tokens=200, ignore_eos=True) for i in range(60)
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(batch) + "\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "lorastar.plugin.cli", "run-batch", "-i", str(inp), "-o", str(out), str(tiny_model_dir),
         "--served-model-name", "tiny", "--max-num-seqs", "1", "--device", "cpu", "--disable-log-stats"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists() and out.read_text().count("\n") >= 1:
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1, err[-2000:]
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert 1 <= len(records) < 60, err[-2000:]
    assert f"stopped; {out} holds the answers to the first {len(records)} of 60 requests" in err
    assert [r["custom_id"] for r in records] == [f"r{i}" for i in range(len(records))]
    assert all(r["response"]["status_code"] == 200 for r in records)
