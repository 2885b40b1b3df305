"""``parallel_tool_calls: false`` on ``/v1/responses`` keeps the answer's first function call, as the
chat route does (vLLM's ``maybe_filter_parallel_tool_calls``); it was accepted and ignored: every
call came back (fake engine: ``ScriptedLLM`` answers what ``say`` wrote)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from plugin_fake_engine import ScriptedLLM, say
from plugin_support import ServerThread

from lorastar.plugin import LoraStarConfig, create_app

TOOLS = [
    {"type": "function", "name": "f", "parameters": {"type": "object"}},
    {"type": "function", "name": "g", "parameters": {"type": "object"}},
]


def _block(name: str, args: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


TWO_CALLS = "Checking." + _block("f", {"a": 1}) + "\n" + _block("g", {})


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    cfg = LoraStarConfig(
        async_engine=ScriptedLLM(max_model_len=4096, step_delay=0),
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
    )
    with ServerThread(create_app(cfg)) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        yield c


def _names(items: list[dict[str, Any]]) -> list[str]:
    return [i["name"] for i in items if i["type"] == "function_call"]


@pytest.mark.parametrize(("flag", "want"), [(None, ["f", "g"]), (True, ["f", "g"]), (False, ["f"])])
def test_parallel_tool_calls_false_keeps_the_first_call(
    http: httpx.Client, flag: Any, want: list[str]
) -> None:
    body: dict[str, Any] = {"model": "fake-model", "input": say(TWO_CALLS), "max_output_tokens": len(TWO_CALLS),
                            "tools": TOOLS, **({} if flag is None else {"parallel_tool_calls": flag})}  # fmt: skip
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    resp = r.json()
    assert _names(resp["output"]) == want
    assert resp["parallel_tool_calls"] is (flag is not False)
    s = http.post("/v1/responses", json={**body, "stream": True})
    assert s.status_code == 200
    events = [json.loads(x[6:]) for x in s.text.splitlines() if x.startswith("data: {")]
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert _names(added) == want
    done = next(e for e in events if e["type"] in ("response.completed", "response.incomplete"))["response"]
    assert _names(done["output"]) == want
    args = [i["arguments"] for i in done["output"] if i["type"] == "function_call"]
    assert json.loads(args[0]) == {"a": 1}
