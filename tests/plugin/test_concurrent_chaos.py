"""Many clients at once, every kind of request, and clients that hang up at random moments.

Each round sends 24 concurrent requests drawn at random (chat, completions, OpenAI's responses and
Anthropic's messages, streamed or not,
the base model and three adapters over two device slots, n > 1, beam search, stop strings,
logprobs, penalties, seeds, echo, token-id prompts) to a live server on a small KV cache, and
gives two thirds of them a hang-up time of 0-500 ms (it falls before the reply starts, mid-stream,
or after the reply ended). Two plain requests beside them (``tiny``, ``beta``) must be served.
Meanwhile an operator hot-loads and unloads ``gamma`` (which requests also name: a 404 while it is
out) and replaces ``beta`` in place with other weights and back. What must hold: no 5xx and no
error frame in any stream, every round drains to an idle engine (no running or waiting request,
no KV block, no adapter reference), and the server still serves.
Engine as a thread of the server and in its own process, with and without async scheduling.
CI runs two rounds per mode with fixed draws (the cancel timing still varies); ``make fuzz``
runs ``2 x LORASTAR_FUZZ`` freshly random rounds.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
from collections import defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from plugin_support import ServerThread, engine_config, engine_idle, wait_until

from tests.fuzzing import FUZZ

ROUNDS = 2 * max(FUZZ, 1)
ADMIN = "chaos-admin"
CLIENTS = 24
WORDS = ["the", "cat", "a", "dog", "hello", "world", "lorem", "ipsum"]


def draw_request(rng: random.Random) -> tuple[str, dict[str, Any]]:
    """A random request: ``(route, JSON body)``, valid or refused with a 400 by design (for
    example stop strings with beam search)."""
    kind = rng.random()
    if kind >= 0.8:  # the newer APIs, over the same chat pipeline
        return draw_agent_request(rng, responses=kind < 0.9)
    chat = kind < 0.4
    body: dict[str, Any] = {
        "model": rng.choice(["tiny", "alpha", "beta", "gamma"]),  # gamma comes and goes
        "max_tokens": rng.randint(1, 40),
        "stream": rng.random() < 0.7,
        "temperature": rng.choice([0.0, 0.8]),
    }
    if rng.random() < 0.3:
        body["n"] = rng.randint(2, 3)
    if not chat and rng.random() < 0.2:
        body.update(use_beam_search=True, temperature=0.0, n=rng.randint(1, 2))
    if rng.random() < 0.3:
        body["stop"] = ["e", "a"]
    if rng.random() < 0.3:
        body.update(
            {"logprobs": True, "top_logprobs": rng.randint(0, 3)} if chat else {"logprobs": rng.randint(0, 3)}
        )
    if rng.random() < 0.2:
        body["ignore_eos"] = True
    if body["stream"] and rng.random() < 0.2:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.2:
        body["seed"] = rng.randint(0, 5)
    if rng.random() < 0.2:
        body["presence_penalty"] = 0.5
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60)))
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
        return "/v1/chat/completions", body
    body["prompt"] = (
        text if rng.random() < 0.8 else [rng.randint(3, 49151) for _ in range(rng.randint(1, 30))]
    )
    if rng.random() < 0.1:
        body["echo"] = True
    return "/v1/completions", body


def draw_agent_request(rng: random.Random, *, responses: bool) -> tuple[str, dict[str, Any]]:
    """A random ``/v1/responses`` or ``/v1/messages`` request (one answer each: no n, no beam)."""
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60)))
    body: dict[str, Any] = {
        "model": rng.choice(["tiny", "alpha", "beta", "gamma"]),
        "stream": rng.random() < 0.7,
        "temperature": rng.choice([0.0, 0.8]),
    }
    if responses:
        body.update(input=text, max_output_tokens=rng.randint(1, 40))
        if rng.random() < 0.3:
            body.update(top_logprobs=rng.randint(0, 3), include=["message.output_text.logprobs"])
        return "/v1/responses", body
    body.update(messages=[{"role": "user", "content": text}], max_tokens=rng.randint(1, 40))
    if rng.random() < 0.3:
        body["stop_sequences"] = ["e", "a"]
    return "/v1/messages", body


# Error types of the Responses (flat ``code``) and Messages (``error.type``) shapes, as statuses.
_STATUS_OF = {
    "ServiceUnavailableError": 503,
    "overloaded_error": 503,
    "InternalServerError": 500,
    "api_error": 500,
}


def openai_error(body: dict[str, Any], status: int | None = None) -> dict[str, Any] | None:
    """An error body or stream frame of any of the APIs in the OpenAI shape the checks read
    (``{"error": {"code", "message"}}``), or None when it is no error."""
    error = body.get("error")
    if isinstance(error, dict) and "code" in error:  # OpenAI's own
        return body
    if body.get("type") != "error":
        return None
    info = error if isinstance(error, dict) else body  # Anthropic's nests it; a Responses event is flat
    kind = info.get("type") if isinstance(error, dict) else body.get("code")
    return {"error": {"code": status or _STATUS_OF.get(str(kind), 500), "message": info.get("message", "")}}


async def send(client: httpx.AsyncClient, url: str, rng: random.Random, seen: dict[str, list[Any]]) -> None:
    """One random request; ``seen`` gets its status code (or "cancelled"), and the error body of a
    5xx ("5xx") or of an error frame in a stream ("error frames")."""
    route, body = draw_request(rng)
    hang_up = rng.choice([None, None, 0.0, 0.05, 0.2, 0.5])  # seconds until the client goes away
    try:
        async with asyncio.timeout(hang_up):
            if body["stream"]:
                async with client.stream("POST", url + route, json=body) as r:
                    text = (await r.aread()).decode() if r.status_code != 200 else ""
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            if (frame := openai_error(json.loads(line[6:]))) is not None:
                                seen["error frames"].append(frame)
            else:
                r = await client.post(url + route, json=body)
                text = r.text
    except TimeoutError:
        seen["cancelled"].append(route)
        return
    if r.status_code >= 500:
        seen["5xx"].append(openai_error(json.loads(text), r.status_code) if text.startswith("{") else text)
    if r.status_code == 404:
        seen["404 models"].append(body["model"])
    seen[str(r.status_code)].append(route)


async def anchor(
    client: httpx.AsyncClient, url: str, model: str, delay: float, seen: dict[str, list[Any]]
) -> None:
    """A plain request that never hangs up, sent ``delay`` seconds into the round: whatever the
    random clients drew, the server must serve it (``beta`` even while it is replaced in place)."""
    await asyncio.sleep(delay)
    body = {"model": model, "prompt": "the cat", "max_tokens": 4}
    r = await client.post(url + "/v1/completions", json=body)
    seen[f"anchor {r.status_code}"].append(model if r.status_code == 200 else r.text)


async def with_anchors(
    client: httpx.AsyncClient,
    url: str,
    operator: Callable[[httpx.AsyncClient], Awaitable[None]],
    delays: tuple[float, float],
    seen: dict[str, list[Any]],
) -> None:
    """The operator's calls beside an anchor request for ``tiny`` and one for ``beta``."""
    await asyncio.gather(
        operator(client),
        anchor(client, url, "tiny", delays[0], seen),
        anchor(client, url, "beta", delays[1], seen),
    )


async def operate(
    client: httpx.AsyncClient, url: str, rng: random.Random, seen: dict[str, list[Any]]
) -> None:
    """Hot-load and unload ``gamma`` and replace ``beta`` in place, in a random order at random
    moments, then restore ``beta``."""
    calls = [
        ("/v1/load_lora_adapter", {"lora_name": "gamma", "lora_path": "gamma"}),
        ("/v1/unload_lora_adapter", {"lora_name": "gamma"}),
        ("/v1/load_lora_adapter", {"lora_name": "beta", "lora_path": "alpha", "load_inplace": True}),
    ]
    restore = ("/v1/load_lora_adapter", {"lora_name": "beta", "lora_path": "beta", "load_inplace": True})
    for route, body in [*rng.sample(calls, len(calls)), restore]:
        await asyncio.sleep(rng.uniform(0.0, 0.3))
        r = await client.post(url + route, json=body, headers={"Authorization": f"Bearer {ADMIN}"})
        if r.status_code not in (200, 400, 404):  # loading one loaded, unloading one absent: 4xx
            seen["admin bad"].append(f"{r.status_code} {r.text} for {route} {body}")
        seen[f"admin {r.status_code}"].append(route)


def serve(tiny_model_dir: Path, adapter_root: Path, *, engine_process: bool, async_scheduling: bool) -> Any:
    """The plugin both tests serve: 40 blocks of 4 tokens for up to 8 sequences (preemption),
    alpha and beta loaded over 2 device slots, gamma loadable from ``adapter_root``."""
    from lorastar.plugin import LoraStarConfig, LoraStarPlugin

    return LoraStarPlugin(
        LoraStarConfig(
            engine=engine_config(
                tiny_model_dir,
                num_kv_blocks=40,
                block_size=4,
                max_num_seqs=8,
                max_loras=2,
                max_num_batched_tokens=48,
                async_scheduling=async_scheduling,
            ),
            served_model_name="tiny",
            adapters={name: str(adapter_root / name) for name in ("alpha", "beta")},
            adapter_root=adapter_root,
            admin_token=ADMIN,
            engine_process=engine_process,
        )
    )


def run_round(
    url: str,
    rng: random.Random,
    seen: dict[str, list[Any]],
    beside: Callable[[httpx.AsyncClient], Awaitable[None]],
) -> None:
    """``CLIENTS`` random requests at once, with ``beside(client)`` running alongside them."""

    async def main() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            rngs = [random.Random(rng.random()) for _ in range(CLIENTS)]
            await asyncio.gather(beside(client), *(send(client, url, r, seen) for r in rngs))

    asyncio.run(main())


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "process"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_concurrent_mixed_requests_and_hang_ups_leave_nothing(
    tiny_model_dir: Path, adapter_root: Path, engine_process: bool, async_scheduling: bool
) -> None:
    from litestar import Litestar

    plugin = serve(
        tiny_model_dir, adapter_root, engine_process=engine_process, async_scheduling=async_scheduling
    )
    seed = random.Random().random() if FUZZ else 0
    with ServerThread(Litestar(plugins=[plugin])) as srv:
        engine = plugin.engine
        for rnd in range(ROUNDS):
            rng = random.Random(f"{seed}-{rnd}-{engine_process}-{async_scheduling}")
            seen: dict[str, list[Any]] = defaultdict(list)
            operator = functools.partial(operate, url=srv.url, rng=random.Random(rng.random()), seen=seen)
            delays = random.Random(f"anchors-{seed}-{rnd}")
            beside = functools.partial(
                with_anchors, url=srv.url, operator=operator, seen=seen,
                delays=(delays.uniform(0.0, 0.5), delays.uniform(0.0, 0.5)),
            )  # fmt: skip
            run_round(srv.url, rng, seen, beside)
            bad = seen["5xx"] + seen["error frames"] + seen["admin bad"]
            assert not bad, (seed, rnd, bad[:3])
            # Served throughout: the two plain requests beside the random ones (a random round can
            # draw few clients that stay, all of them for gamma or refused by design), and no 404
            # but for gamma, which comes and goes (beta's in-place replacement never hides it).
            assert sorted(seen["anchor 200"]) == ["beta", "tiny"], (seed, rnd, dict(seen))
            assert set(seen["404 models"]) <= {"gamma"}, (seed, rnd, seen["404 models"])
            assert wait_until(lambda: engine_idle(engine), timeout=60), (seed, rnd, engine.stats())
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        names = {a.name: a for a in engine.list_adapters()}
        assert names["beta"].path.endswith("beta"), names  # each round ends by restoring beta


def test_a_core_killed_under_load_fails_its_requests_with_503_and_comes_back(
    tiny_model_dir: Path, adapter_root: Path
) -> None:
    """The engine process is SIGKILLed while a round of random requests and one long stream are in
    flight: each request in flight or arriving during the restart ends with a 503 that says to
    retry (a status, or an error frame in a stream; the long stream surely so), never another 5xx;
    a new core starts with the adapters loaded again, drains to idle and serves."""
    import os
    import signal

    from litestar import Litestar

    plugin = serve(tiny_model_dir, adapter_root, engine_process=True, async_scheduling=False)
    seed = random.Random().random() if FUZZ else 0
    with ServerThread(Litestar(plugins=[plugin])) as srv:
        engine = plugin.engine
        for rnd in range(ROUNDS):
            rng = random.Random(f"kill-{seed}-{rnd}")
            seen: dict[str, list[Any]] = defaultdict(list)
            pid = engine.core_pid

            async def kill(
                client: httpx.AsyncClient,
                delay: float = rng.uniform(0.0, 0.2),
                pid: int | None = pid,
                seen: dict[str, list[Any]] = seen,
            ) -> None:
                """A long stream that is surely in flight: the kill comes after its first frame."""
                # 150 of the 160 tokens this cache holds (max_model_len follows the cache)
                body = {"prompt": "Hi", "max_tokens": 150, "ignore_eos": True, "stream": True}
                async with client.stream("POST", srv.url + "/v1/completions", json=body) as r:
                    lines = r.aiter_lines()
                    async for line in lines:
                        if line.startswith("data: "):
                            break
                    await asyncio.sleep(delay)
                    assert pid is not None
                    os.kill(pid, signal.SIGKILL)
                    async for line in lines:
                        if line.startswith("data: ") and line != "data: [DONE]":
                            if "error" in (frame := json.loads(line[6:])):
                                seen["error frames"].append(frame)
                                seen["long stream failed"].append(frame)

            run_round(srv.url, rng, seen, kill)
            assert seen["long stream failed"], (seed, rnd, {k: len(v) for k, v in seen.items()})
            failed = seen["5xx"] + seen["error frames"]
            for err in failed:
                assert isinstance(err, dict) and err["error"]["code"] == 503, (seed, rnd, err)
                assert "retry" in err["error"]["message"], (seed, rnd, err)
            assert wait_until(lambda: not engine.restarting, timeout=120), (seed, rnd)
            assert engine.core_pid != pid
            assert sorted(a.name for a in engine.list_adapters()) == ["alpha", "beta"]
            assert wait_until(lambda: engine_idle(engine), timeout=60), (seed, rnd, engine.stats())
            r = httpx.post(
                srv.url + "/v1/completions",
                json={"model": "alpha", "prompt": "Hi", "max_tokens": 2},
                timeout=30,
            )
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
