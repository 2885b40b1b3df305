"""Adapter hot-loading on the real engine, and the load test against the demo app (examples/app.py)."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from plugin_support import ServerThread, engine_config, engine_idle, wait_until

ADMIN = {"Authorization": "Bearer admin-secret"}
PROMPT = "Once upon a time"


def test_path_escapes_and_tokens_on_real_engine(
    real_server: ServerThread, adapter_root: Path, tmp_path: Path
) -> None:
    url = real_server.url + "/v1"
    outside = tmp_path / "outside"
    outside.mkdir()
    (adapter_root / "escape-link").symlink_to(adapter_root.parent / "nowhere-but-out")
    (adapter_root / "gamma-link").symlink_to(outside)
    try:
        for path in (
            "../" + adapter_root.name + "/../x",
            str(outside),
            "gamma-link",
            "escape-link",
            str(adapter_root / ".." / adapter_root.name / "gamma" / ".." / ".." / "x"),
        ):
            r = httpx.post(
                url + "/load_lora_adapter", json={"lora_name": "x", "lora_path": path}, headers=ADMIN
            )
            assert r.status_code == 403 and r.json()["error"]["param"] == "lora_path", (path, r.text)
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "admin-secret"}):
            r = httpx.post(
                url + "/load_lora_adapter", json={"lora_name": "g", "lora_path": "gamma"}, headers=headers
            )
            assert r.status_code == 401
        # A folder that exists but is not an adapter: 400, registry unchanged.
        (adapter_root / "not-an-adapter").mkdir(exist_ok=True)
        r = httpx.post(
            url + "/load_lora_adapter",
            json={"lora_name": "bad", "lora_path": "not-an-adapter"},
            headers=ADMIN,
        )
        assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
        ids = [m["id"] for m in httpx.get(url + "/models").json()["data"]]
        assert "x" not in ids and "bad" not in ids and "g" not in ids
    finally:
        (adapter_root / "escape-link").unlink()
        (adapter_root / "gamma-link").unlink()


def test_concurrent_load_unload_during_streaming(real_server: ServerThread) -> None:
    url = real_server.url + "/v1"
    engine = real_server.plugin.engine  # type: ignore[attr-defined]
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
    results: list[tuple[str, str | None]] = []
    errors: list[BaseException] = []

    def stream(model: str) -> None:
        try:
            finish = None
            for chunk in client.completions.create(
                model=model,
                prompt=PROMPT,
                max_tokens=40,
                stream=True,
                temperature=1.0,
                extra_body={"ignore_eos": True},
            ):
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
            results.append((model, finish))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [
        threading.Thread(target=stream, args=(m,)) for m in ("tiny", "alpha", "beta", "alpha", "beta", "tiny")
    ]
    for t in threads:
        t.start()
    # While they stream: load gamma, use it, unload it, reload it; unload + reload beta (in use).
    for _ in range(2):
        r = httpx.post(
            url + "/load_lora_adapter", json={"lora_name": "gamma", "lora_path": "gamma"}, headers=ADMIN
        )
        assert r.status_code == 200, r.text
        assert (
            client.completions.create(model="gamma", prompt=PROMPT, max_tokens=3).usage.completion_tokens >= 1
        )
        r = httpx.post(url + "/unload_lora_adapter", json={"lora_name": "gamma"}, headers=ADMIN)
        assert r.status_code == 200, r.text
    # Replace alpha in place (in-flight alpha streams keep their weights), then restore it.
    for path in ("gamma", "alpha"):
        r = httpx.post(
            url + "/load_lora_adapter",
            json={"lora_name": "alpha", "lora_path": path, "load_inplace": True},
            headers=ADMIN,
        )
        assert r.status_code == 200, r.text
        root = next(m.root for m in client.models.list().data if m.id == "alpha")  # type: ignore[attr-defined]
        assert root.endswith(path)
    r = httpx.post(url + "/unload_lora_adapter", json={"lora_name": "beta"}, headers=ADMIN)
    assert r.status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="beta", prompt=PROMPT, max_tokens=2)
    r = httpx.post(url + "/load_lora_adapter", json={"lora_name": "beta", "lora_path": "beta"}, headers=ADMIN)
    assert r.status_code == 200
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    # Every stream ran to its end (requests already on beta finished although beta was unloaded meanwhile).
    assert sorted(f for _, f in results) == ["length"] * 6
    ids = [m.id for m in client.models.list().data]
    assert "gamma" not in ids and "beta" in ids
    assert wait_until(lambda: engine_idle(engine))


def test_load_200_requests_32_streaming_clients_against_demo_app(
    tiny_model_dir: Path, adapter_root: Path
) -> None:
    """>= 200 requests over 32 concurrent streaming clients, some hanging up early; at the end every
    request was answered or cleanly aborted and no KV block or adapter reference is held."""
    import examples.app

    app = examples.app.create_app(
        model=str(tiny_model_dir),
        adapter_dir=adapter_root,
        engine=engine_config(tiny_model_dir, max_num_seqs=32, num_kv_blocks=1024),
        admin_token="t",
    )
    total, concurrency = 200, 32
    with ServerThread(app) as srv:
        plugin = app.plugins.get("LoraStarPlugin")
        with httpx.Client() as c:
            models = [m["id"] for m in c.get(srv.url + "/v1/models").json()["data"]]
            assert {"alpha", "beta", "gamma"} <= set(models)
            assert c.get(srv.url + "/books").status_code == 200  # the demo app's own routes still work
            # ...and one of them uses the engine the plugin injects (`lorastar_engine`), with an adapter.
            blurb = c.post(srv.url + "/books/1/blurb", params={"style": "alpha"}, timeout=60).json()
            assert blurb["style"] == "alpha" and blurb["blurb"]

        outcome: dict[str, int] = {"finished": 0, "aborted": 0}
        failures: list[str] = []

        async def run() -> None:
            client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
            queue: asyncio.Queue[int] = asyncio.Queue()
            for i in range(total):
                queue.put_nowait(i)
            rng = random.Random(0)

            async def worker() -> None:
                while not queue.empty():
                    i = queue.get_nowait()
                    model = models[i % len(models)]
                    hang_up = i % 7 == 3  # some clients disconnect early
                    try:
                        if i % 2:
                            stream = await client.chat.completions.create(
                                model=model,
                                messages=[{"role": "user", "content": f"Story {i}"}],
                                max_tokens=rng.randint(4, 12),
                                stream=True,
                                temperature=1.0,
                                stream_options={"include_usage": True},
                            )
                        else:
                            stream = await client.completions.create(
                                model=model,
                                prompt=f"{PROMPT} {i}",
                                max_tokens=rng.randint(4, 12),
                                stream=True,
                                temperature=1.0,
                                stream_options={"include_usage": True},
                            )
                        chunks = 0
                        usage = None
                        async for chunk in stream:
                            chunks += 1
                            usage = chunk.usage or usage
                            if hang_up and chunks == 2:
                                await stream.close()
                                break
                        if hang_up:
                            outcome["aborted"] += 1
                        elif usage is not None and usage.completion_tokens >= 1:
                            outcome["finished"] += 1
                        else:
                            failures.append(f"request {i}: no usage chunk")
                    except Exception as exc:  # noqa: BLE001
                        failures.append(f"request {i} ({model}): {exc!r}")

            await asyncio.gather(*(worker() for _ in range(concurrency)))
            await client.close()

        t0 = time.monotonic()
        asyncio.run(run())
        elapsed = time.monotonic() - t0
        assert not failures, failures[:5]
        assert outcome["finished"] + outcome["aborted"] == total and outcome["aborted"] > 0
        assert wait_until(lambda: engine_idle(plugin.engine), timeout=20), plugin.engine.stats()
        metrics = httpx.get(srv.url + "/metrics").text
        assert 'vllm:num_requests_running{model_name="' in metrics
        print(f"load test: {total} requests, {concurrency} clients, {elapsed:.1f} s, {outcome}")
