"""Where a request's sampling parameters are built: on the event loop for a plain request (the
worker-thread hop cost a loaded server ~20 ms of every request's time to first token), on a worker
thread where the body constrains the output (a JSON schema or grammar can take long to check).
Tokenizing and chat templates stay on worker threads (``request_sampling_params`` says why)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import msgspec
import pytest

from lorastar.plugin.errors import APIError
from lorastar.plugin.routes import common
from lorastar.plugin.schemas import ChatCompletionRequest, CompletionRequest

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

PLAIN: list[dict[str, Any]] = [
    {},
    {"temperature": 0.7, "top_p": 0.9, "stop": ["\n"], "logit_bias": {"5": 1.0}},
    {"response_format": {"type": "text"}},
    {"structured_outputs": None},
]
CONSTRAINED: list[dict[str, Any]] = [
    {"guided_json": SCHEMA},
    {"guided_regex": "[0-9]+"},
    {"guided_choice": ["yes", "no"]},
    {"guided_grammar": 'root ::= "a"'},
    {"structured_outputs": {"json": SCHEMA}},
    {"structured_outputs": {"json_object": True}},
    {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
]


def _request(kind: type, fields: dict[str, Any]) -> Any:
    base = {"model": "m", "prompt": "hi"} if kind is CompletionRequest else {"model": "m", "messages": []}
    return msgspec.convert({**base, **fields}, kind)


def _thread_of_build(req: Any, monkeypatch: pytest.MonkeyPatch, **kw: Any) -> tuple[bool, Any]:
    """(whether ``sampling_params`` ran on the event loop's thread, the parameters)."""
    seen: list[threading.Thread] = []
    real = common.sampling_params

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(threading.current_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(common, "sampling_params", spy)

    async def main() -> tuple[threading.Thread, Any]:
        return threading.current_thread(), await common.request_sampling_params(
            req, max_tokens=8, logprobs=None, **kw
        )

    loop_thread, params = asyncio.run(main())
    assert len(seen) == 1
    return seen[0] is loop_thread, params


@pytest.mark.parametrize("kind", [CompletionRequest, ChatCompletionRequest])
@pytest.mark.parametrize("fields", PLAIN, ids=lambda f: ",".join(f) or "bare")
def test_a_plain_request_builds_its_parameters_on_the_loop(
    kind: type, fields: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    on_loop, params = _thread_of_build(_request(kind, fields), monkeypatch)
    assert on_loop
    assert params.max_tokens == 8 and params.grammar_spec is None


@pytest.mark.parametrize("kind", [CompletionRequest, ChatCompletionRequest])
@pytest.mark.parametrize("fields", CONSTRAINED, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items())[:40])
def test_a_constrained_request_builds_its_parameters_on_a_worker_thread(
    kind: type, fields: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    on_loop, params = _thread_of_build(_request(kind, fields), monkeypatch)
    assert not on_loop
    assert params.grammar_spec is not None or params.guided_choice is not None


def test_a_forced_tool_call_schema_goes_to_a_worker_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chat's tools schema arrives as ``guided_json`` beside an unconstrained body."""
    on_loop, params = _thread_of_build(_request(ChatCompletionRequest, {}), monkeypatch, guided_json=SCHEMA)
    assert not on_loop
    assert params.grammar_spec is not None


@pytest.mark.parametrize("on_loop_body", [False, True])
def test_errors_are_the_same_on_either_path(on_loop_body: bool) -> None:
    """A bad field is the client's 400 naming it, whichever thread built the parameters."""
    fields: dict[str, Any] = {"logit_bias": {"x": 1.0}}
    if not on_loop_body:
        fields["guided_regex"] = "[0-9]+"
    req = _request(CompletionRequest, fields)
    with pytest.raises(APIError) as err:
        asyncio.run(common.request_sampling_params(req, max_tokens=8, logprobs=None))
    assert err.value.param == "logit_bias"


def test_an_unparsable_schema_is_a_400_from_the_worker_thread() -> None:
    req = _request(CompletionRequest, {"guided_regex": "("})
    with pytest.raises(APIError) as err:
        asyncio.run(common.request_sampling_params(req, max_tokens=8, logprobs=None))
    assert err.value.param == "guided_regex"
