"""Speculative decoding behind the plugin: ``--speculative-config`` as vLLM's, the engine core in
its own process drafting and verifying, vLLM's ``spec_decode`` counters on /metrics and in the
stats line. The answer is transformers' greedy one (the engine tests check the rest)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import httpx
import pytest
import torch
from click.testing import CliRunner
from plugin_fake_engine import FakeStats
from plugin_support import ServerThread, engine_config
from prometheus_client.parser import text_string_to_metric_families

from lorastar.engine.metrics import SpecDecodeStats
from lorastar.models.default import default_model_dir
from lorastar.plugin import cli
from lorastar.plugin.cli import main
from lorastar.plugin.stats_log import StatsLine

CODE = "def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n    return 2 * (width + height)\n"
MESSAGES = [{"role": "user", "content": f"Add a docstring to each function:\n```python\n{CODE}```"}]
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    from litestar import Litestar

    from lorastar.plugin import LoraStarConfig, LoraStarPlugin

    plugin = LoraStarPlugin(
        LoraStarConfig(
            engine=engine_config(default_model_dir(progress=False), speculative_config=SPEC),
            served_model_name="smol",
        )
    )
    with ServerThread(Litestar(plugins=[plugin])) as srv:
        yield srv


def test_chat_answer_is_transformers_greedy_and_drafts_are_counted(server: ServerThread) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_dir(progress=False)
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids) :].tolist()
    body = {"model": "smol", "messages": MESSAGES, "max_tokens": 32, "temperature": 0}
    r = httpx.post(server.url + "/v1/chat/completions", json={**body, "return_token_ids": True}, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    got = choice["token_ids"]
    assert got == ref[: len(got)] and (len(got) == 32 or got[-1] == tok.eos_token_id)

    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}
    value = {
        name: sum(s.value for s in fams[name].samples if s.name == name + "_total")
        for name in (
            "vllm:spec_decode_num_drafts",
            "vllm:spec_decode_num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens",
            "vllm:spec_decode_num_accepted_tokens_per_pos",
        )
    }
    assert value["vllm:spec_decode_num_drafts"] > 0
    assert 0 < value["vllm:spec_decode_num_accepted_tokens"] <= value["vllm:spec_decode_num_draft_tokens"]
    assert (
        value["vllm:spec_decode_num_accepted_tokens_per_pos"] == value["vllm:spec_decode_num_accepted_tokens"]
    )
    positions = {s.labels["position"] for s in fams["vllm:spec_decode_num_accepted_tokens_per_pos"].samples}
    assert positions == {"0", "1", "2", "3"}


def _drafted(server: ServerThread) -> tuple[float, float]:
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}
    return tuple(  # type: ignore[return-value]
        sum(s.value for s in fams[name].samples if s.name == name + "_total")
        for name in ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")
    )


def test_json_schema_answer_is_transformers_under_xgrammar_with_drafts(server: ServerThread) -> None:
    """response_format's schema through the core process, drafting (the values are copied from the
    prompt): the tokens are transformers' greedy under xgrammar's own logits processor."""
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM, AutoTokenizer

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "city": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "city", "age"],
    }
    record = "Record 17: Margaret Thompson-Whitfield, a retired marine biologist, lives in Saint Petersburg, Florida, aged 67."
    messages = [
        {"role": "user", "content": f"Extract name, city and age as JSON from this record:\n{record}"}
    ]
    path = default_model_dir(progress=False)
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=hf.config.vocab_size)
    grammar = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema))
    with torch.inference_mode():
        ref = hf.generate(
            torch.tensor([ids]), max_new_tokens=64, do_sample=False, eos_token_id=tok.eos_token_id,
            pad_token_id=tok.eos_token_id, logits_processor=[xgr.contrib.hf.LogitsProcessor(grammar)],
        )[0, len(ids) :].tolist()  # fmt: skip
    before = _drafted(server)
    body = {
        "model": "smol", "messages": messages, "max_tokens": 64, "temperature": 0, "return_token_ids": True,
        "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
    }  # fmt: skip
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    got = choice["token_ids"]
    assert got == ref[: len(got)] and choice["finish_reason"] == "stop"
    assert set(json.loads(choice["message"]["content"])) == {"name", "city", "age"}
    after = _drafted(server)
    assert after[0] > before[0] and after[1] > before[1]  # this request drafted, and kept some


def test_stats_line_reports_the_intervals_acceptance() -> None:
    line = StatsLine()
    assert line.update(FakeStats(spec_decode=SpecDecodeStats(3, 2, 6, 3, [2, 1, 0])), 0.0) is None
    now = FakeStats(generation_tokens_total=20, spec_decode=SpecDecodeStats(3, 6, 18, 11, [6, 4, 1]))
    level, msg = line.update(now, 10.0)  # type: ignore[misc]
    assert level == logging.INFO
    assert msg.endswith(
        "SpecDecoding: Mean acceptance length: 3.00, Accepted: 8 tokens, Drafted: 12 tokens, "
        "Per-position acceptance rate: 1.000, 0.750, 0.250, Avg Draft acceptance rate: 66.7%"
    )
    idle = FakeStats(generation_tokens_total=20, spec_decode=SpecDecodeStats(3, 6, 18, 11, [6, 4, 1]))
    assert "SpecDecoding" not in line.update(idle, 20.0)[1]  # type: ignore[index]


@pytest.mark.parametrize(
    ("value", "text"),
    [
        ("ngram", "--speculative-config takes a JSON object"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "method must be one of ('ngram',)"),
        ('{"method": "ngram"}', "num_speculative_tokens is required"),
    ],
)
def test_serve_flag_names_a_bad_value(value: str, text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "run_server", lambda *a: pytest.fail("must not start"))
    r = CliRunner().invoke(main, ["serve", "--port", "0", "--speculative-config", value])
    assert r.exit_code == 2 and text in r.output and "Traceback" not in r.output, r.output


def test_serve_flag_reaches_the_engine_config() -> None:
    config = cli.engine_config(
        tokenizer=None, chat_template=None, max_cpu_loras=None, max_loras=8,
        speculative_config='{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}',
    )  # fmt: skip
    spec = config.speculative_config
    assert (spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min) == (3, 4, 4)


def test_ops_page_shows_the_share_of_drafts_kept(server: ServerThread) -> None:
    """/lorastar/stats carries the counters; the live page shows the share kept (headless Chromium)."""
    import shutil

    body = {"model": "smol", "messages": MESSAGES, "max_tokens": 24, "temperature": 0}
    assert httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
    s = httpx.get(server.url + "/lorastar/stats", timeout=10).json()["spec_decode"]
    assert (
        0 < s["num_accepted_tokens"] <= s["num_draft_tokens"]
        and sum(s["accepted_per_pos"]) == s["num_accepted_tokens"]
    )
    kept = f"{100 * s['num_accepted_tokens'] / s['num_draft_tokens']:.1f}%"
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("no chromium on this machine")
    sync_playwright = pytest.importorskip("playwright.sync_api").sync_playwright
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=path, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(server.url + "/lorastar/")
            page.wait_for_function("!document.getElementById('speccard').hidden", timeout=20000)
            assert page.text_content("#spec") == kept
            assert "tokens per drafted step" in (page.text_content("#specsub") or "")
        finally:
            browser.close()
