"""Pure HTTP behaviour of the plugin (framing, errors, auth, lifecycle) on a fake engine: fast, no torch.

The engine-backed checks (real outputs, blocks freed, load test) are in the other test files.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from litestar import Litestar, Request, Response, get
from litestar.exceptions import HTTPException
from plugin_fake_engine import FakeAsyncLLM
from plugin_support import ServerThread, wait_until

from lorastar.errors import EngineOverloadedError
from lorastar.plugin import LoraStarConfig, LoraStarPlugin, create_app

ERROR_KEYS = {"message", "type", "param", "code"}


def assert_error(resp: httpx.Response, status: int, param: str | None = "any") -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    assert body["error"]["code"] == status
    assert "Traceback" not in resp.text
    if param != "any":
        assert body["error"]["param"] == param, body
    return body["error"]


@pytest.fixture(scope="module")
def fake_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fake-adapters")
    for name in ("a1", "a2", "lazy"):
        (root / name).mkdir()
        (root / name / "adapter_config.json").write_text("{}")
    outside = tmp_path_factory.mktemp("outside")
    (outside / "adapter_config.json").write_text("{}")
    os.symlink(outside, root / "sneaky")  # inside the root by name, outside once resolved
    return root


@pytest.fixture(scope="module")
def fake(fake_root: Path) -> Iterator[tuple[ServerThread, FakeAsyncLLM]]:
    engine = FakeAsyncLLM()

    @get("/mine")
    async def mine(lorastar_engine: Any) -> dict[str, str]:
        return {"engine": type(lorastar_engine).__name__}

    def app_http_handler(_: Request[Any, Any, Any], exc: HTTPException) -> Response[Any]:
        return Response({"app": "own handler", "status": exc.status_code}, status_code=exc.status_code)

    app = Litestar(
        route_handlers=[mine],
        exception_handlers={HTTPException: app_http_handler, 400: app_http_handler},
        plugins=[
            LoraStarPlugin(
                LoraStarConfig(
                    async_engine=engine,
                    adapter_root=fake_root,
                    admin_token="tok",
                    adapters={"a1": str(fake_root / "a1")},
                    enable_adapter_resolver=True,
                )
            )
        ],
    )
    with ServerThread(app) as srv:
        yield srv, engine


@pytest.fixture(autouse=True)
def _reset_fake(request: pytest.FixtureRequest) -> None:
    if "fake" in request.fixturenames:
        engine = request.getfixturevalue("fake")[1]
        engine.fail_after = None
        engine.fail_on_submit = None
        engine.errored = False
        engine.max_waiting = None


@pytest.fixture()
def http(fake: tuple[ServerThread, FakeAsyncLLM]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fake[0].url, timeout=30) as c:
        yield c


def test_user_routes_dependency_and_handlers_untouched(http: httpx.Client) -> None:
    assert http.get("/mine").json() == {"engine": "FakeAsyncLLM"}
    # The app's own exception handler still answers outside the plugin's routes...
    assert http.get("/nowhere").json() == {"app": "own handler", "status": 404}
    # ...while the plugin's routes answer in the OpenAI shape, even for a 400 the app maps itself.
    assert_error(http.post("/v1/completions", json={"prompt": 5}), 400)
    schema = http.get("/schema/openapi.json").json()
    assert "/mine" in schema["paths"] and "/v1/completions" in schema["paths"]


def test_post_routes_answer_200_and_sse_framing_is_exact(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "cba"
    with http.stream(
        "POST",
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as s:
        assert s.status_code == 200
        assert s.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(s.iter_raw()).decode()
    frames = raw.split("\n\n")
    assert frames[-1] == "" and frames[-2] == "data: [DONE]"
    assert all(re.fullmatch(r"data: \{.*\}", f) for f in frames[:-2]), frames
    chunks = [json.loads(f[6:]) for f in frames[:-2]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert "usage" not in chunks[1]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ({"max_tokens": 3}, "prompt"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "logprobs": 99}, "logprobs"),
        ({"prompt": "x", "stop": [""]}, "stop"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [[1], [-3]]}, "prompt"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "logit_bias": {"a": 2}}, "logit_bias"),  # keys are token ids
        ({"prompt": "x" * 300}, "prompt"),  # longer than max_model_len (fake: 256)
        ({"prompt": list(range(1, 300))}, "prompt"),
    ],
)
def test_completion_validation_errors_name_the_field(
    http: httpx.Client, body: dict[str, Any], param: str
) -> None:
    assert_error(http.post("/v1/completions", json=body), 400, param)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 1000}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        (
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 50},
            "top_logprobs",
        ),
        ({"messages": [{"role": "user", "content": "x" * 300}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ],
)
def test_chat_validation_errors_name_the_field(http: httpx.Client, body: dict[str, Any], param: str) -> None:
    assert_error(http.post("/v1/chat/completions", json=body), 400, param)


def test_malformed_json_and_unknown_model(http: httpx.Client) -> None:
    assert_error(
        http.post("/v1/completions", content=b"{nope", headers={"content-type": "application/json"}), 400
    )
    err = assert_error(http.post("/v1/completions", json={"prompt": "x", "model": "ghost"}), 404, "model")
    assert err["type"] == "NotFoundError"
    err = assert_error(
        http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}], "model": "ghost", "stream": True},
        ),
        404,
        "model",
    )


def test_overloaded_is_503_with_retry_after(
    fake: tuple[ServerThread, FakeAsyncLLM], http: httpx.Client
) -> None:
    fake[1].fail_on_submit = EngineOverloadedError("waiting queue is full (max_waiting=1)")
    for stream in (False, True):
        r = http.post("/v1/completions", json={"prompt": "x", "stream": stream})
        assert_error(r, 503)
        assert r.headers["retry-after"] == "1"


def test_a_batch_larger_than_the_queue_is_400_not_503(
    fake: tuple[ServerThread, FakeAsyncLLM], http: httpx.Client
) -> None:
    """Each prompt of a batch is a request: a batch over ``max_waiting`` would get 503 on every
    retry, however idle the server, so it is refused as bad input, before any prompt is queued."""
    fake[1].max_waiting = 3
    for stream in (False, True):
        for prompt in (["a", "b", "c", "d"], [[1], [2], [3], [4]]):
            r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "stream": stream})
            err = assert_error(r, 400, "prompt")
            assert "4 prompts" in err["message"] and "max_waiting" in err["message"], err
        r = http.post("/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 2, "stream": stream})
        assert r.status_code == 200, r.text
    assert not fake[1].running


def test_stream_options_without_stream_is_400_as_in_vllm(http: httpx.Client) -> None:
    """Usage asked for in a response that has no chunk to carry it: vLLM refuses the request
    rather than return a body without what was asked for; so does lorastar."""
    bodies = {
        "/v1/completions": {"prompt": "x", "max_tokens": 2},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
    }
    opts = {"include_usage": True}
    for route, body in bodies.items():
        for stream in ({}, {"stream": False}):
            err = assert_error(
                http.post(route, json={**body, **stream, "stream_options": opts}), 400, "stream_options"
            )
            assert "stream=True" in err["message"], err
        assert http.post(route, json={**body, "stream_options": None}).status_code == 200
        with http.stream("POST", route, json={**body, "stream": True, "stream_options": opts}) as s:
            assert s.status_code == 200
            assert '"usage"' in "".join(s.iter_text())


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("logits_processors", ["m.P"]),
        ("kv_transfer_params", {"a": 1}),
        ("vllm_xargs", {"a": 1}),
    ],
)
def test_vllm_fields_lorastar_lacks_are_400_not_ignored(http: httpx.Client, field: str, value: Any) -> None:
    """Each of these changes what vLLM returns; ignoring one would hand back something else than
    was asked for (unconstrained text for a logits processor's request)."""
    bodies = {
        "/v1/completions": {"prompt": "x", "max_tokens": 2},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
    }
    for route, body in bodies.items():
        err = assert_error(http.post(route, json={**body, field: value}), 400, field)
        assert "not supported" in err["message"], err
    # vLLM's defaults (unset, empty, false, 0) are no request for the feature
    unset = {"priority": 0, "bad_words": [], "return_tokens_as_token_ids": False, "guided_json": None}
    for route, body in bodies.items():
        assert http.post(route, json={**body, **unset}).status_code == 200
    err = assert_error(
        http.post("/v1/completions", json={**bodies["/v1/completions"], "prompt_embeds": "AAAA"}),
        400,
        "prompt_embeds",
    )
    for fmt, words in [
        ({"type": "yaml"}, "type must be"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "needs {'json_schema'"),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
            "invalid JSON schema",
        ),
    ]:
        for route, body in bodies.items():
            err = assert_error(
                http.post(route, json={**body, "response_format": fmt}), 400, "response_format"
            )
            assert err["message"].startswith("response_format: ") and words in err["message"], err


def test_completions_add_special_tokens_reaches_the_tokenizer(
    fake: tuple[ServerThread, FakeAsyncLLM], http: httpx.Client
) -> None:
    calls = fake[1].tokenized_with_special_tokens
    calls.clear()
    for flag in (None, False, True):
        extra = {} if flag is None else {"add_special_tokens": flag}
        assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, **extra}).status_code == 200
    assert calls == [True, False, True]  # vLLM's default: on


def test_dead_engine_health_503_and_requests_503(
    fake: tuple[ServerThread, FakeAsyncLLM], http: httpx.Client
) -> None:
    assert http.get("/health").status_code == 200
    fake[1].errored = True
    assert_error(http.get("/health"), 503)
    assert_error(http.post("/v1/completions", json={"prompt": "x"}), 503)
    fake[1].errored = False
    assert http.get("/health").status_code == 200


def test_unexpected_engine_error_is_500_without_traceback(
    fake: tuple[ServerThread, FakeAsyncLLM], http: httpx.Client
) -> None:
    fake[1].fail_on_submit = RuntimeError("secret internal detail")
    err = assert_error(http.post("/v1/completions", json={"prompt": "x"}), 500)
    assert "secret" not in err["message"]


def test_error_after_stream_start_goes_in_band(
    fake: tuple[ServerThread, FakeAsyncLLM], http: httpx.Client
) -> None:
    fake[1].fail_after = 2
    r = http.post("/v1/completions", json={"prompt": "abcdef", "max_tokens": 6, "stream": True})
    assert r.status_code == 200
    frames = r.text.split("\n\n")
    assert frames[-2] == "data: [DONE]"
    last = json.loads(frames[-3][6:])
    assert set(last) == {"error"} and last["error"]["code"] == 500 and "secret" not in r.text


def test_an_unencodable_response_is_the_servers_error_not_the_clients() -> None:
    """A UnicodeEncodeError is a ValueError, which the routes answer as 400; encoding a response
    failing is the server's fault: 500, the detail withheld (in a stream's in-band frame too)."""
    from lorastar.plugin.errors import to_api_error

    enc = UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed")
    assert to_api_error(enc).status_code == 500 and "surrogate" not in to_api_error(enc).message
    assert to_api_error(ValueError("n must be >= 1")).status_code == 400
    dec = UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")  # from client bytes: 400
    assert to_api_error(dec).status_code == 400


def test_client_disconnect_mid_stream_aborts(fake: tuple[ServerThread, FakeAsyncLLM]) -> None:
    engine = fake[1]
    before = len(engine.aborted)
    with (
        httpx.Client(base_url=fake[0].url, timeout=30) as c,
        c.stream("POST", "/v1/completions", json={"prompt": "abc", "max_tokens": 200, "stream": True}) as s,
    ):
        it = s.iter_lines()
        assert next(it).startswith("data: ")
    assert wait_until(lambda: len(engine.aborted) > before and not engine.running, 10)


def test_client_disconnect_non_stream_aborts(fake: tuple[ServerThread, FakeAsyncLLM]) -> None:
    import socket

    engine = fake[1]
    before = len(engine.aborted)
    body = json.dumps({"prompt": "abc", "max_tokens": 250}).encode()
    sock = socket.create_connection(("127.0.0.1", fake[0].port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    assert wait_until(lambda: bool(engine.running), 10)  # the request is generating...
    sock.close()  # ...when the client hangs up
    assert wait_until(lambda: len(engine.aborted) > before and not engine.running, 10)


def test_openai_client_against_fake(fake: tuple[ServerThread, FakeAsyncLLM]) -> None:
    client = openai.OpenAI(base_url=fake[0].url + "/v1", api_key="unused")
    ids = [m.id for m in client.models.list().data]
    assert ids[0] == "fake-model" and "a1" in ids
    assert client.models.retrieve("a1").parent == "fake-model"  # type: ignore[attr-defined]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("ghost")
    r = client.completions.create(model="a1", prompt=["ab", "cd"], max_tokens=2, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == "BA" and r.usage.completion_tokens == 8
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="ghost", prompt="x")
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model="fake-model", prompt="x", temperature=-2)
    assert ei.value.body["param"] == "temperature"  # type: ignore[index]


def test_resolver_loads_unknown_name_from_root_once(
    fake: tuple[ServerThread, FakeAsyncLLM], http: httpx.Client
) -> None:
    r = http.post("/v1/completions", json={"prompt": "xy", "model": "lazy", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "YX"
    assert "lazy" in fake[1].adapters
    # Not a folder name directly under the root: never resolved.
    for name in ("../outside", "sneaky", ".hidden", "a1/../a2"):
        assert_error(http.post("/v1/completions", json={"prompt": "x", "model": name}), 404, "model")


def test_admin_auth_and_path_confinement(
    fake: tuple[ServerThread, FakeAsyncLLM], fake_root: Path, http: httpx.Client
) -> None:
    body = {"lora_name": "a2", "lora_path": str(fake_root / "a2")}
    assert_error(http.post("/v1/load_lora_adapter", json=body), 401)
    assert_error(
        http.post("/v1/load_lora_adapter", json=body, headers={"Authorization": "Bearer wrong"}), 401
    )
    assert_error(http.post("/v1/load_lora_adapter", json=body, headers={"Authorization": "Basic tok"}), 401)
    auth = {"Authorization": "Bearer tok"}
    for path in ("../outside", str(fake_root / ".." / "x"), "/etc", "sneaky", str(fake_root / "sneaky")):
        assert_error(
            http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": path}, headers=auth),
            403,
            "lora_path",
        )
    assert "bad" not in fake[1].adapters
    r = http.post("/v1/load_lora_adapter", json=body, headers=auth)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a2' added successfully."
    assert_error(http.post("/v1/load_lora_adapter", json=body, headers=auth), 400, "lora_name")
    assert_error(
        http.post("/v1/load_lora_adapter", json={"lora_name": "a3", "lora_path": "missing"}, headers=auth),
        400,
        "lora_path",
    )
    assert_error(http.post("/v1/load_lora_adapter", json={"lora_name": "a3"}, headers=auth), 400, "lora_path")
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "a2"}, headers=auth)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a2' removed successfully."
    assert_error(
        http.post("/v1/unload_lora_adapter", json={"lora_name": "a2"}, headers=auth), 404, "lora_name"
    )


def test_concurrent_loads_of_one_new_name_load_it_once(
    fake: tuple[ServerThread, FakeAsyncLLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    srv, engine = fake
    real_load = engine.load_adapter
    paths: list[str] = []
    second: list[asyncio.Event] = []

    async def slow_load(name: str, path: str) -> None:
        # The first load waits (up to 1 s) for a second to start: without a lock held across the
        # route's "already loaded?" check and the load, both would load and both answer 200.
        paths.append(path)
        if len(paths) == 1:
            second.append(asyncio.Event())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(second[0].wait(), 1.0)
        else:
            second[0].set()
        await real_load(name, path)

    monkeypatch.setattr(engine, "load_adapter", slow_load)

    def load(path: str) -> httpx.Response:
        body = {"lora_name": "race", "lora_path": path}
        auth = {"Authorization": "Bearer tok"}
        return httpx.post(srv.url + "/v1/load_lora_adapter", json=body, headers=auth, timeout=30)

    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(load, "a1")
            assert wait_until(lambda: bool(paths))  # the first is inside its load
            late = pool.submit(load, "a2").result()
            assert first.result().status_code == 200, first.result().text
        error = assert_error(late, 400, "lora_name")
        assert "has already been loaded" in error["message"]
        assert len(paths) == 1 and engine.adapters["race"].path.endswith("a1")
    finally:
        engine.adapters.pop("race", None)


def test_api_keys_guard_inference_routes_only() -> None:
    engine = FakeAsyncLLM()
    app = create_app(LoraStarConfig(async_engine=engine, api_keys=["k1", "k2"], admin_token="adm"))
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url) as c:
        for method, path in (
            ("GET", "/v1/models"),
            ("POST", "/v1/completions"),
            ("POST", "/v1/chat/completions"),
            ("POST", "/v1/responses"),
            ("GET", "/v1/responses/resp_1"),
            ("DELETE", "/v1/responses/resp_1"),
        ):
            assert_error(c.request(method, path, json={}), 401)
            assert_error(c.request(method, path, json={}, headers={"Authorization": "Bearer nope"}), 401)
        assert c.get("/v1/models", headers={"Authorization": "Bearer k2"}).status_code == 200
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200
        # The admin routes take the admin token, not an API key.
        assert_error(
            c.post(
                "/v1/unload_lora_adapter", json={"lora_name": "x"}, headers={"Authorization": "Bearer k1"}
            ),
            401,
        )
        assert_error(
            c.post(
                "/v1/unload_lora_adapter", json={"lora_name": "x"}, headers={"Authorization": "Bearer adm"}
            ),
            404,
        )
        # create_app's own unknown routes speak OpenAI errors too.
        assert_error(c.get("/v1/nothing"), 404)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="k1")
        assert client.models.list().data[0].id == "fake-model"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="bad").models.list()


def test_admin_routes_absent_when_runtime_loading_off_and_refused_without_token(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("LORASTAR_ADMIN_TOKEN", raising=False)
    off = create_app(
        LoraStarConfig(async_engine=FakeAsyncLLM(), allow_runtime_adapter_loading=False, admin_token="t")
    )
    no_token = create_app(LoraStarConfig(async_engine=FakeAsyncLLM(), adapter_root=tmp_path))
    with ServerThread(off) as a, ServerThread(no_token) as b:
        for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            r = httpx.post(
                a.url + route,
                json={"lora_name": "x", "lora_path": "y"},
                headers={"Authorization": "Bearer t"},
            )
            assert r.status_code in (404, 405)
            assert_error(httpx.post(b.url + route, json={"lora_name": "x"}), 401)
        paths = httpx.get(a.url + "/schema/openapi.json").json()["paths"]
        assert "/v1/load_lora_adapter" not in paths and "/v1/completions" in paths


def test_metrics_names_labels_and_per_plugin_registry(
    fake: tuple[ServerThread, FakeAsyncLLM], http: httpx.Client
) -> None:
    http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3, "model": "a1"})
    text = http.get("/metrics").text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:lora_requests_info",
        "lorastar:adapter_requests_total",
        "lorastar:adapter_generation_tokens_total",
    ):
        assert re.search(rf"^{re.escape(name)}\{{.*model_name=\"fake-model\"", text, re.M) or (
            name == "vllm:lora_requests_info"
            and re.search(r"^vllm:lora_requests_info\{.*max_lora=", text, re.M)
        ), name
    assert re.search(
        r'^lorastar:adapter_requests_total\{adapter="a1",model_name="fake-model"\} [1-9]', text, re.M
    )
    # A second app in the same process has its own registry (no duplicate-name error, fresh counters).
    other = create_app(LoraStarConfig(async_engine=FakeAsyncLLM(), served_model_name="other"))
    with ServerThread(other) as srv:
        t2 = httpx.get(srv.url + "/metrics").text
    assert 'model_name="other"' in t2 and "lorastar:adapter_requests_total{" not in t2


def test_lifespan_starts_and_stops_owned_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    created: list[FakeAsyncLLM] = []

    class Owned(FakeAsyncLLM):
        def __init__(self, config: Any = None) -> None:
            super().__init__()
            self.config = config
            created.append(self)

    import lorastar.plugin.service

    monkeypatch.setattr(lorastar.plugin.service, "build_engine", Owned)
    app = create_app(LoraStarConfig(model="/some/model", max_waiting=7))
    with ServerThread(app) as srv:
        assert httpx.get(srv.url + "/health").status_code == 200
        engine = created[0]
        assert engine.started and engine.config.model == "/some/model" and engine.config.max_waiting == 7
    assert not engine.started  # shut down with the app


def test_continuous_usage_stats(http: httpx.Client) -> None:
    for url, body in (
        ("/v1/completions", {"prompt": "abcd"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "abcd"}]}),
    ):
        body = dict(
            body,
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
        frames = [json.loads(f[6:]) for f in http.post(url, json=body).text.split("\n\n")[:-2]]
        assert all("usage" in f for f in frames)
        assert frames[-2]["usage"]["completion_tokens"] == 3 == frames[-1]["usage"]["completion_tokens"]


def test_bad_startup_adapter_fails_startup_and_stops_engine(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import lorastar.plugin.service

    created: list[FakeAsyncLLM] = []

    def build(config: Any) -> FakeAsyncLLM:
        created.append(FakeAsyncLLM())
        return created[-1]

    monkeypatch.setattr(lorastar.plugin.service, "build_engine", build)
    app = create_app(LoraStarConfig(adapters={"broken": str(tmp_path)}))  # no adapter_config.json there
    with pytest.raises(RuntimeError, match="did not start"), ServerThread(app, startup_timeout=20):
        pass
    assert created and not created[0].started


async def test_no_lazy_restart_after_shutdown() -> None:
    from lorastar.plugin.errors import APIError
    from lorastar.plugin.service import LoraStarService

    engine = FakeAsyncLLM()
    service = LoraStarService(LoraStarConfig(async_engine=engine))
    assert await service.ready() is engine  # lazy start (no lifespan ran)
    await service.stop()
    with pytest.raises(APIError) as ei:
        await service.ready()  # a request racing the shutdown: 503, not a second engine start
    assert ei.value.status_code == 503 and not service.healthy()
    await service.start()  # an explicit lifespan start works again
    assert service.healthy()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"path": "v1"}, "path"),
        ({"max_waiting": 0}, "max_waiting"),
        ({"adapters": {"": "x"}}, "adapters"),
        ({"adapters": ["x"]}, "adapters"),
        ({"engine": {"device": "cpu"}}, "engine"),
        ({"retry_after_seconds": -1}, "retry_after_seconds"),
        ({"thinking_budget_message": ""}, "thinking_budget_message"),
    ],
)
def test_config_validation_names_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        LoraStarConfig(**kwargs)


def test_config_overrides_and_plugin_kwargs(monkeypatch: pytest.MonkeyPatch) -> None:
    from lorastar.config import EngineConfig

    cfg = LoraStarConfig(model="/m", max_waiting=3, engine=EngineConfig(max_loras=2), path="/api/v1/")
    assert cfg.path == "/api/v1"
    eng = cfg.engine_config()
    assert (eng.model, eng.max_waiting, eng.max_loras) == ("/m", 3, 2)
    monkeypatch.setenv("LORASTAR_ADMIN_TOKEN", "from-env")
    assert LoraStarConfig().resolved_admin_token() == "from-env"
    assert LoraStarConfig(admin_token="explicit").resolved_admin_token() == "explicit"
    plugin = LoraStarPlugin(api_keys="single-key")
    assert plugin.config.api_keys == ["single-key"] and plugin.engine is None
    with pytest.raises(ValueError):
        LoraStarPlugin(LoraStarConfig(), path="/x")


def test_engines_implement_the_engine_client_protocol(tiny_model_dir: Path) -> None:
    """The routes are typed against EngineClient: AsyncLLM and the fake both provide all of it."""
    from plugin_support import engine_config

    from lorastar import AsyncLLM
    from lorastar.plugin.engine_client import EngineClient

    assert isinstance(FakeAsyncLLM(), EngineClient)
    assert isinstance(AsyncLLM(engine_config(tiny_model_dir)), EngineClient)
