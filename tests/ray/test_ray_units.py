"""lorastar.ray without a Ray cluster: ingress routing options, streaming, the in-process ASGI call, eviction."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

pytest.importorskip("ray.serve")

from starlette.requests import Request  # noqa: E402
from starlette.responses import StreamingResponse  # noqa: E402

from lorastar.plugin.asgi_call import ResponseStart, call_asgi, http_scope  # noqa: E402
from lorastar.ray.ingress import LoraStarIngress, model_of  # noqa: E402


@pytest.mark.parametrize(
    ("method", "body", "want"),
    [
        ("POST", b'{"model": "a1", "prompt": "x"}', "a1"),
        ("GET", b'{"model": "a1"}', None),
        ("POST", b"not json", None),
        ("POST", b"\xff\xfe", None),
        ("POST", b'["model"]', None),
        ("POST", b'{"model": 3}', None),
        ("POST", b'{"model": ""}', None),
        ("POST", b"", None),
    ],
)
def test_model_of(method: str, body: bytes, want: str | None) -> None:
    assert model_of(method, body) == want


class FakeReplicas:
    """Records the handle options and call; streams ``items``, holding after the first chunk until ``go``."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items
        self.options_seen: dict[str, Any] = {}
        self.args: tuple[Any, ...] = ()
        self.go = asyncio.Event()
        self.handle_http = self

    def options(self, **kw: Any) -> FakeReplicas:
        self.options_seen = kw
        return self

    def remote(self, *args: Any) -> AsyncIterator[Any]:
        self.args = args

        async def gen() -> AsyncIterator[Any]:
            for i, item in enumerate(self.items):
                if i == 2:
                    await self.go.wait()
                yield item

        return gen()


def _request(body: bytes, path: str = "/v1/completions") -> Request:
    scope = http_scope("POST", path, b"a=1", [(b"content-type", b"application/json")])

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    return Request(scope, receive)


JSON_START = ResponseStart(200, [(b"content-type", b"application/json"), (b"content-length", b"2")])
SSE_START = ResponseStart(200, [(b"content-type", b"text/event-stream")])


@pytest.mark.parametrize(
    ("routing", "model", "multiplexed"),
    [("multiplexed", "a1", "a1"), ("multiplexed", "base", None), ("adapter_blind", "a1", None)],
)
def test_routing_options(routing: str, model: str, multiplexed: str | None) -> None:
    async def main() -> None:
        fake = FakeReplicas([JSON_START, b"{", b"}"])
        fake.go.set()
        ingress = LoraStarIngress(fake, ["base"], routing)
        body = b'{"model": "%s"}' % model.encode()
        response = await ingress(_request(body))
        assert response.status_code == 200 and response.body == b"{}"
        assert (b"content-length", b"2") in response.raw_headers
        assert fake.options_seen.get("multiplexed_model_id") == multiplexed
        assert fake.options_seen["stream"] is True
        assert fake.args[0] == (None if model == "base" else model)  # the replica pins adapters only
        assert fake.args[1:5] == ("POST", "/v1/completions", b"a=1", [(b"content-type", b"application/json")])

    asyncio.run(main())


def test_unknown_routing_is_refused() -> None:
    with pytest.raises(ValueError, match="routing"):
        LoraStarIngress(FakeReplicas([]), ["base"], "round_robin")


def test_sse_is_forwarded_chunk_by_chunk() -> None:
    async def main() -> None:
        fake = FakeReplicas([SSE_START, b"data: 1\n\n", b"data: [DONE]\n\n"])
        response = await asyncio.wait_for(LoraStarIngress(fake, ["base"])(_request(b'{"model": "a1"}')), 5)
        assert isinstance(response, StreamingResponse)
        chunks = response.body_iterator
        # The first event arrives while the replica still holds the rest back.
        assert await asyncio.wait_for(chunks.__anext__(), 5) == b"data: 1\n\n"
        fake.go.set()
        assert [c async for c in chunks] == [b"data: [DONE]\n\n"]

    asyncio.run(main())


def test_call_asgi_yields_start_then_body_and_disconnects_on_close() -> None:
    seen: list[str] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert (await receive())["body"] == b"hello"
        await send({"type": "http.response.start", "status": 201, "headers": [(b"x", b"1")]})
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        seen.append((await receive())["type"])  # blocks until the consumer goes away
        await asyncio.sleep(10)

    async def main() -> None:
        gen = call_asgi(app, http_scope("POST", "/p", b"", []), b"hello")
        start = await gen.__anext__()
        assert isinstance(start, ResponseStart) and start.status == 201 and start.header(b"X") == b"1"
        assert await gen.__anext__() == b"a"
        await asyncio.wait_for(gen.aclose(), 5)  # disconnect: the app is told, then cancelled

    asyncio.run(main())
    assert seen == ["http.disconnect"]


def test_call_asgi_reraises_app_errors() -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        raise RuntimeError("boom")

    async def main() -> None:
        with pytest.raises(RuntimeError, match="boom"):
            async for _ in call_asgi(app, http_scope("GET", "/", b"", []), b""):
                pass

    asyncio.run(main())


def test_replica_failure_is_an_openai_503() -> None:
    class Dead(FakeReplicas):
        def remote(self, *args: Any) -> AsyncIterator[Any]:
            async def gen() -> AsyncIterator[Any]:
                raise RuntimeError("actor died")
                yield  # pragma: no cover

            return gen()

    async def main() -> None:
        response = await LoraStarIngress(Dead([]), ["base"])(_request(b'{"model": "a1"}'))
        assert response.status_code == 503
        assert json.loads(response.body)["error"]["code"] == 503

    asyncio.run(main())


class FakeEngine:
    def __init__(self) -> None:
        self.unloaded: list[str] = []

    async def unload_adapter(self, name: str) -> None:
        self.unloaded.append(name)


def _replica() -> Any:
    from lorastar.ray.replica import ReplicaBase

    replica = object.__new__(ReplicaBase)  # no engine, no Ray: only the eviction bookkeeping
    replica.plugin = type("P", (), {"engine": FakeEngine()})()
    replica.resident = {}
    replica.adapter_unloads = 0
    return replica


def test_eviction_waits_for_in_flight_requests() -> None:
    from lorastar.ray.replica import ResidentAdapter

    async def main() -> None:
        replica = _replica()
        resident = replica.resident["a1"] = ResidentAdapter(replica, "a1")
        assert resident.acquire()
        evicting = asyncio.create_task(resident.__del__())  # what Ray awaits on LRU eviction
        await asyncio.sleep(0.05)
        assert not evicting.done() and replica.plugin.engine.unloaded == []
        assert not resident.acquire()  # new requests load it again instead of pinning this one
        resident.release()
        await asyncio.wait_for(evicting, 5)
        assert replica.plugin.engine.unloaded == ["a1"] and replica.resident == {}

    asyncio.run(main())


def test_eviction_keeps_a_reloaded_adapter() -> None:
    from lorastar.ray.replica import ResidentAdapter

    async def main() -> None:
        replica = _replica()
        old = ResidentAdapter(replica, "a1")
        new = replica.resident["a1"] = ResidentAdapter(replica, "a1")  # loaded again meanwhile
        await old.__del__()
        assert replica.plugin.engine.unloaded == [] and replica.resident == {"a1": new}

    asyncio.run(main())


def test_gc_never_awaits_eviction() -> None:
    from lorastar.ray.replica import ResidentAdapter

    assert "__del__" not in vars(ResidentAdapter)  # an instance attribute: Ray's hook, not Python's


class DiesAfter(FakeReplicas):
    """Sends ``items`` then dies, as a replica whose actor was lost mid-response."""

    def remote(self, *args: Any) -> AsyncIterator[Any]:
        async def gen() -> AsyncIterator[Any]:
            for item in self.items:
                yield item
            raise RuntimeError("actor died")

        return gen()


def test_a_replica_lost_after_its_response_start_is_an_openai_503_not_a_bare_500() -> None:
    async def main() -> None:
        response = await LoraStarIngress(DiesAfter([JSON_START, b"{"]), ["base"])(
            _request(b'{"model": "a1"}')
        )
        assert response.status_code == 503
        assert json.loads(response.body)["error"]["code"] == 503
        assert (b"content-length", b"2") not in response.raw_headers  # the lost start's headers are void

    asyncio.run(main())


@pytest.mark.parametrize(
    ("path", "sent", "want"),
    [
        ("/v1/completions", b'data: {"id": "c"}\n\n', "openai"),
        ("/v1/chat/completions", b'data: {"id": "c"}\n\n', "openai"),
        ("/v1/messages", b"event: ping\ndata: {}\n\n", "messages"),
        (
            "/v1/responses",
            b'event: response.output_text.delta\ndata: {"sequence_number": 7}\n\n',
            "responses",
        ),
    ],
)
def test_a_replica_lost_mid_stream_ends_the_stream_with_the_apis_error(
    path: str, sent: bytes, want: str
) -> None:
    async def main() -> list[bytes]:
        fake = DiesAfter([SSE_START, sent])
        response = await LoraStarIngress(fake, ["base"])(_request(b'{"model": "a1", "stream": true}', path))
        assert isinstance(response, StreamingResponse)
        return [c async for c in response.body_iterator]

    chunks = asyncio.run(main())
    assert chunks[0] == sent and len(chunks) == 2
    end = chunks[1].decode()
    if want == "openai":  # vLLM's in-band error frame, then [DONE]
        first, done = end.split("\n\n")[:2]
        assert json.loads(first.removeprefix("data: "))["error"]["code"] == 503 and done == "data: [DONE]"
    else:
        name, data = end.strip().split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == "event: error" and event["type"] == "error"
        if want == "responses":
            assert event["sequence_number"] == 8
        else:
            assert "replica" in event["error"]["message"]


@pytest.mark.parametrize(
    ("device", "cluster_gpus", "want"),
    [("auto", 8.0, {"num_gpus": 1}), ("auto", None, {"num_cpus": 1}), ("cuda", None, {"num_gpus": 1}),
     ("cpu", 8.0, {"num_cpus": 1})],
)  # fmt: skip
def test_auto_replicas_take_a_gpu_where_the_cluster_has_one(
    device: str, cluster_gpus: float | None, want: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # device="auto" (the default) gave every replica one CPU: Ray hides the GPUs from an actor that
    # asked for none, so on a GPU cluster each replica ran its engine on the CPU without a word.
    import ray

    from lorastar.config import EngineConfig
    from lorastar.plugin import LoraStarConfig
    from lorastar.ray.app import default_actor_options

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(
        ray, "cluster_resources", lambda: {"CPU": 16.0, **({"GPU": cluster_gpus} if cluster_gpus else {})}
    )
    assert default_actor_options(LoraStarConfig(engine=EngineConfig(device=device))) == want
