"""The HTTP path against the offline engine on the same workload (issue #12's serving table).

``lorastar serve`` (a subprocess) with N streaming clients on ``/v1/completions`` against
``LLM.generate`` in this process, same prompts (token ids), same greedy lengths (``ignore_eos``).
Per concurrency: output tokens/s of each, their ratio, and for the server vLLM's serving metrics:
TTFT and inter-token latency (ITL, the gap between stream frames) percentiles.

``--routes`` runs the same load through other APIs of the same server, one after the other:
``chat`` (``/v1/chat/completions``), ``responses`` (OpenAI's ``/v1/responses``) and ``messages``
(Anthropic's ``/v1/messages``) send the prompt as text in a user message (the chat template adds
its few tokens) and count the tokens each stream's usage reports; results go to
``serving_routes.md`` then.

The default model is the 1-layer, hidden-32 random Llama of ``host_overhead.py`` (SmolLM2's
tokenizer): the model costs almost nothing, so the ratio measures what the HTTP layer and the step
loop cost each other. ``--model smollm2`` uses the embedded SmolLM2-135M.

    .venv/bin/python benchmarks/serving.py                      # 1, 16, 64 clients
    .venv/bin/python benchmarks/serving.py --model smollm2 --clients 16 --prompt-len 128 --new-tokens 64
    .venv/bin/python benchmarks/serving.py --modes process --routes completions,chat,responses,messages
    .venv/bin/python benchmarks/serving.py --clients 64 --modes process --rounds 9   # drift-cancelling ratio
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from host_overhead import tiny_model  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", default="1,16,64", help="concurrent streaming clients (= requests)")
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument(
        "--len-spread",
        type=int,
        default=0,
        help="each request's max_tokens drawn (seeded, the same for offline and HTTP) from "
        "new_tokens +- this: requests then end at different steps, as real ones do, instead of every "
        "client's ending and sending its next in the same step",
    )
    p.add_argument("--model", default="tiny", help="tiny (1 layer, hidden 32) or smollm2")
    p.add_argument("--threads", type=int, default=1, help="torch threads, server and offline alike")
    p.add_argument("--other", type=Path, default=None, help="a second checkout whose servers run too")
    p.add_argument(
        "--modes",
        default="thread,process",
        help="this checkout's engine: thread (in the server process) and/or process (--engine-process)",
    )
    p.add_argument(
        "--client", default="aiohttp", choices=["aiohttp", "httpx"], help="the load generator's HTTP library"
    )
    p.add_argument(
        "--routes", default="completions", help=f"the APIs each server is driven through: {', '.join(ROUTES)}"
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="timed offline and HTTP passes, alternated on one engine and one server per route; the "
        "table gives each figure's median over the rounds and the range of the per-round ratios",
    )
    p.add_argument("--out", type=Path, default=common.RESULTS)
    return p.parse_args()


@dataclass(frozen=True)
class Route:
    """How one API is driven: its path, a streamed request for a prompt (token ids and text), and
    what a frame says: (it carries new text, the output tokens its usage reports or None)."""

    path: str
    body: Callable[[list[int], str, int], dict[str, Any]]
    frame: Callable[[dict[str, Any]], tuple[bool, int | None]]


def _usage(msg: dict[str, Any], key: str) -> int | None:
    return (msg.get("usage") or {}).get(key)


ROUTES = {
    "completions": Route(
        "/v1/completions",
        lambda ids, _, n: {
            "prompt": ids,
            "max_tokens": n,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        },  # fmt: skip
        lambda m: (bool(m.get("choices") and m["choices"][0].get("text")), _usage(m, "completion_tokens")),
    ),
    "chat": Route(
        "/v1/chat/completions",
        lambda _, text, n: {
            "messages": [{"role": "user", "content": text}],
            "max_tokens": n,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        },  # fmt: skip
        lambda m: (
            bool(m.get("choices") and m["choices"][0]["delta"].get("content")),
            _usage(m, "completion_tokens"),
        ),
    ),
    "responses": Route(
        "/v1/responses",
        lambda _, text, n: {"input": text, "max_output_tokens": n},
        lambda m: (
            m["type"] == "response.output_text.delta" and bool(m["delta"]),
            _usage(m["response"], "output_tokens")
            if m["type"] in ("response.completed", "response.incomplete")
            else None,
        ),
    ),
    "messages": Route(
        "/v1/messages",
        lambda _, text, n: {"messages": [{"role": "user", "content": text}], "max_tokens": n},
        lambda m: (
            m["type"] == "content_block_delta" and m["delta"].get("type") == "text_delta",
            _usage(m, "output_tokens") if m["type"] == "message_delta" else None,
        ),
    ),
}


class Offline:
    """``LLM.generate`` on the prompts, warmed up on the first few; ``run`` times one pass.

    It stays open beside the server, so ``--rounds`` can alternate the two: this shared CPU drifts
    by 10-30% between runs, and a single offline pass followed by a single HTTP pass measured the
    drift as much as the server (64 clients on the 2-core Xeon: ratios 0.62 to 1.41 over seven runs,
    offline alone 7.7k to 12.0k tok/s)."""

    def __init__(self, model: str, prompts: list[list[int]], lengths: list[int], max_num_seqs: int) -> None:
        from lorastar import LLM, SamplingParams

        self.prompts = prompts
        self.llm = LLM(model=model, dtype="float32", max_num_seqs=max_num_seqs, enable_prefix_caching=False)
        self.sps = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
        self.llm.generate(prompts[:2], self.sps[:2])

    def run(self) -> float:
        """Output tokens/s of one pass over all the prompts."""
        t0 = time.perf_counter()
        outs = self.llm.generate(self.prompts, self.sps)
        wall = time.perf_counter() - t0
        return sum(len(o.outputs[0].token_ids) for o in outs) / wall

    def close(self) -> None:
        self.llm.engine.close()


def start_server(
    model: str, port: int, max_num_seqs: int, env: dict[str, str], checkout: Path, extra: list[str]
) -> subprocess.Popen[bytes]:
    """``lorastar serve`` with ``checkout``'s code (run from its root, so its package is imported)."""

    cmd = [sys.executable, "-c", "from lorastar.plugin.cli import main; main()", "serve", model, "--port", str(port),
           "--served-model-name", "m", "--dtype", "float32", "--max-num-seqs", str(max_num_seqs),
           "--max-waiting", "4096", "--uvicorn-log-level", "warning", *extra]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, cwd=checkout, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    common.wait_healthy(proc, port, lambda: proc.stderr.read().decode(), timeout=300)  # type: ignore[union-attr]
    return proc


async def httpx_events(client: Any, url: str, body: dict[str, Any]) -> AsyncIterator[tuple[float, str]]:
    """A stream's ``data:`` payloads (``[DONE]`` left out) with their arrival times, over httpx."""
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield time.perf_counter(), line[6:]


async def aiohttp_events(session: Any, url: str, body: dict[str, Any]) -> AsyncIterator[tuple[float, bytes]]:
    """The same over aiohttp, read as vLLM's ``bench serve`` reads it: its C parser and chunk
    iteration cost the load generator several times less CPU than httpx's line iterator (on a
    2-core machine the client competes with the server for the cores)."""
    async with session.post(url, json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
        buf = b""
        async for chunk in r.content.iter_any():
            now = time.perf_counter()
            buf += chunk
            *events, buf = buf.split(b"\n\n")
            for ev in events:  # `data: {...}`, or `event: type` then `data: {...}`
                data = next((ln[6:] for ln in ev.split(b"\n") if ln.startswith(b"data: ")), b"")
                if data and data != b"[DONE]":
                    yield now, data


async def one_client(
    events: Callable[[str, dict[str, Any]], AsyncIterator[tuple[float, str | bytes]]],
    url: str,
    prompts: list[tuple[list[int], str, int]],
    route: Route,
) -> list[dict[str, Any]]:
    """Stream each prompt in turn through ``events``; per request: TTFT, frame gaps, tokens."""
    results = []
    for ids, text, new_tokens in prompts:
        body = {"model": "m", "temperature": 0, "stream": True, **route.body(ids, text, new_tokens)}
        t0 = time.perf_counter()
        stamps: list[float] = []
        tokens = 0
        async for now, data in events(url, body):
            has_text, usage = route.frame(json.loads(data))
            if has_text:
                stamps.append(now)
            if usage:
                tokens = usage
        if not stamps:
            raise RuntimeError("a stream produced no text")
        results.append({"ttft": stamps[0] - t0, "gaps": [b - a for a, b in zip(stamps, stamps[1:])],
                        "tokens": tokens or new_tokens})  # fmt: skip
    return results


async def serve_load(
    port: int,
    per_client: list[list[tuple[list[int], str, int]]],
    client_lib: str = "aiohttp",
    route: Route = ROUTES["completions"],
    warm: bool = True,
) -> dict[str, float]:
    """The load through ``route``, timed after one untimed pass of it when ``warm``: a fresh
    server's first pass ran 2.5-4x slower here (16 clients, tiny model: 0.28-0.41 of offline, then
    0.96-1.11), mostly oneDNN building a GEMM primitive the first time each row count comes by
    (0.65-1.9 ms per linear shape, against ~1 ms steps on this model)."""
    url = f"http://127.0.0.1:{port}{route.path}"
    async with contextlib.AsyncExitStack() as stack:
        if client_lib == "aiohttp":
            import aiohttp

            conn = aiohttp.TCPConnector(limit=len(per_client) + 4)
            session = aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600))
            events = functools.partial(aiohttp_events, await stack.enter_async_context(session))
        else:
            import httpx

            client = httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=len(per_client) + 4))
            events = functools.partial(httpx_events, await stack.enter_async_context(client))
        if warm:  # the whole load once, untimed (as vLLM's bench serve runs are warmed up here)
            await asyncio.gather(*(one_client(events, url, ps, route) for ps in per_client))
        t0 = time.perf_counter()
        runs = await asyncio.gather(*(one_client(events, url, ps, route) for ps in per_client))
        wall = time.perf_counter() - t0
    reqs = [r for run in runs for r in run]
    ttft = sorted(r["ttft"] for r in reqs)
    gaps = sorted(g for r in reqs for g in r["gaps"]) or [0.0]

    def pct(xs: list[float], q: float) -> float:
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    return {
        "tok_s": sum(r["tokens"] for r in reqs) / wall,
        "ttft_p50_ms": 1e3 * statistics.median(ttft),
        "ttft_p99_ms": 1e3 * pct(ttft, 0.99),
        "itl_p50_ms": 1e3 * statistics.median(gaps),
        "itl_p99_ms": 1e3 * pct(gaps, 0.99),
    }


def main() -> None:
    a = parse_args()
    common.setup_torch(a.threads)
    from transformers import AutoTokenizer

    from lorastar.models.default import default_model_dir

    if a.model == "tiny":
        model = str(tiny_model(Path(tempfile.gettempdir()) / "lorastar_host_overhead_model"))
    elif a.model == "smollm2":
        model = str(default_model_dir())
    else:
        model = a.model
    tok = AutoTokenizer.from_pretrained(model)
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "TOKENIZERS_PARALLELISM": "false"}
    rows, data = [], []
    flags = {"thread": ["--no-engine-process"], "process": ["--engine-process"]}
    checkouts = {f"this ({m})": (common.REPO, flags[m]) for m in a.modes.split(",")}
    if a.other:  # the same modes (a checkout from before --engine-process existed: thread only)
        for m in a.modes.split(","):
            checkouts[f"other ({m})"] = (a.other.resolve(), flags[m])
    if not 0 <= a.len_spread < a.new_tokens:
        raise SystemExit(f"--len-spread must be in [0, --new-tokens), got {a.len_spread}")
    routes = a.routes.split(",")
    if unknown := [r for r in routes if r not in ROUTES]:
        raise SystemExit(f"--routes: unknown {unknown}; choose from {', '.join(ROUTES)}")
    labels: list[str] = []
    for c in [int(x) for x in a.clients.split(",")]:
        n = c * a.requests_per_client
        prompts = common.text_prompts(tok, n, a.prompt_len, seed=c)
        rng = random.Random(c)
        lengths = [a.new_tokens + rng.randint(-a.len_spread, a.len_spread) for _ in prompts]
        both = [(ids, tok.decode(ids), k) for ids, k in zip(prompts, lengths, strict=True)]
        per_client = [both[i::c] for i in range(c)]
        off_engine = Offline(model, prompts, lengths, max(c, 1))
        offs = [off_engine.run()]  # one timed pass before any server; --rounds adds one per round
        for name, (checkout, extra) in checkouts.items():
            port = common.free_port()
            server = start_server(model, port, max(c, 1), env, checkout, extra)
            try:
                for route in routes:  # one server, each API in turn
                    label = name if routes == ["completions"] else f"{name} {route}"
                    labels += [label] if label not in labels else []
                    rounds: list[tuple[float, dict[str, float]]] = []
                    for r in range(a.rounds):
                        if r:  # the offline pass beside this HTTP pass
                            offs.append(off_engine.run())
                        srv = asyncio.run(serve_load(port, per_client, a.client, ROUTES[route], warm=r == 0))
                        rounds.append((offs[-1], srv))
                        print(
                            f"{label}, {c} clients, round {r + 1}/{a.rounds}: HTTP {srv['tok_s']:.0f} tok/s, "
                            f"offline {offs[-1]:.0f}, ratio {srv['tok_s'] / offs[-1]:.2f}",
                            flush=True,
                        )
                    ratios = sorted(s["tok_s"] / o for o, s in rounds)
                    med = {k: statistics.median(s[k] for _, s in rounds) for k in rounds[0][1]}
                    off = statistics.median(o for o, _ in rounds)
                    ratio = statistics.median(ratios)
                    spread = f"{ratios[0]:.2f}-{ratios[-1]:.2f}" if a.rounds > 1 else "-"
                    rows.append([label, c, off, med["tok_s"], ratio, spread, med["ttft_p50_ms"],
                                 med["ttft_p99_ms"], med["itl_p50_ms"], med["itl_p99_ms"]])  # fmt: skip
                    data.append(
                        {
                            "checkout": label,
                            "clients": c,
                            "offline_tok_s": off,
                            **med,
                            "ratio": ratio,
                            "round_ratios": ratios,
                        }  # fmt: skip
                    )
            finally:
                server.terminate()
                server.wait(30)
        off_engine.close()
    table = common.markdown_table(
        [
            "server",
            "clients",
            "offline tok/s",
            "HTTP tok/s",
            "HTTP / offline",
            "ratio range",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "ITL p50 ms",
            "ITL p99 ms",
        ],  # fmt: skip
        rows,
    )
    print(table)
    env_desc = common.env_line(f"{a.threads} torch thread(s) per process")
    desc = (
        f"Model: {a.model}; prompts of {a.prompt_len} tokens, {a.new_tokens}"
        f"{f' +- {a.len_spread}' if a.len_spread else ''} greedy tokens each (ignore_eos), "
        f"{a.requests_per_client} requests per client in turn; the server's max_num_seqs = clients. "
        f"{a.rounds} timed round(s) per server and route, each an offline pass then an HTTP pass (the "
        "first round's offline pass runs before the servers start); each figure is the median over the "
        "rounds, the ratio the median of the rounds' ratios."
    )
    stem = "serving" if routes == ["completions"] else "serving_routes"
    common.write_results(stem, a.out, [desc, table], {"env": env_desc, "rows": data})
    fig, (ax,) = common.new_figure(width=6.0, height=3.6)
    this = [r for r in data if r["checkout"] == labels[0]]
    xs = [r["clients"] for r in this]
    ax.plot(xs, [r["offline_tok_s"] for r in this], "o-", label="offline LLM.generate", color="#999")
    for label, color in zip(labels, ("#c33", "#3a3", "#36c", "#c80", "#939", "#0aa", "#666", "#a60")):
        ys = [r["tok_s"] for r in data if r["checkout"] == label]
        ax.plot(xs, ys, "o-", label=f"HTTP streaming ({label})", color=color)
    common.log_x_axis(ax, xs)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("output tokens/s")
    ax.legend()
    common.save_figure(fig, a.out / f"{stem}.png", f"HTTP vs offline ({a.model}): {env_desc}")


if __name__ == "__main__":
    main()
