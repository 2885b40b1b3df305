"""Two lorastar replicas on Ray Serve: adapter-affinity (multiplexed) routing against adapter-blind.

SmolLM2-135M-Instruct (fp32, CPU, one torch thread and one Ray CPU per replica), 32 generated PEFT
adapters (rank 8, target sets cycling as in ``lora.py``), ``max_loras=8`` per replica (Ray's
multiplex cache = the engine's device slots), Zipf popularity (s = ``--zipf``). In one run, for
each routing:

- ``multiplexed``: the ingress forwards with ``multiplexed_model_id=model`` (``lorastar.ray``'s
  default): Ray's router prefers a replica already holding the adapter;
- ``adapter_blind``: no multiplexed id, Serve's default power-of-two-choices router (by queue
  length, blind to adapters), the same replicas and LRU caches otherwise.

``--concurrency`` clients send ``--warmup`` requests (not counted), then ``--requests`` measured
ones; each: a ``--prompt-len``-token prompt, ``--new-tokens`` greedy tokens (EOS ignored). Adapter
loads are the replicas' own counters (``x-lorastar-adapter-loads`` response header).

    .venv/bin/python benchmarks/replicas.py           # full run
    .venv/bin/python benchmarks/replicas.py --quick   # smoke run (about 3 minutes on 2 cores)

Writes ``replicas.md`` / ``.json`` / ``.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    REPO,
    RESULTS,
    LoadMonitor,
    env_line,
    free_port,
    markdown_table,
    new_figure,
    save_figure,
    text_prompts,
    write_results,
)
from lora import adapter_specs, make_adapters  # noqa: E402

ROUTINGS = ("multiplexed", "adapter_blind")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--adapters", type=int, default=32)
    p.add_argument("--max-loras", type=int, default=8, help="adapters held per replica")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--zipf", type=float, default=1.0, help="popularity exponent s (rank k gets 1/k^s)")
    p.add_argument("--requests", type=int, default=400, help="measured requests per routing")
    p.add_argument("--warmup", type=int, default=64, help="requests before measuring (not counted)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--adapter-dir", type=Path, default=Path("/tmp/lorastar_bench_adapters"))
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    p.add_argument("--out", type=Path, default=RESULTS)
    a = p.parse_args()
    if a.quick:
        a.requests, a.warmup, a.new_tokens = 120, 32, 8
    return a


def zipf_names(names: list[str], n: int, s: float, seed: int) -> list[str]:
    """``n`` draws, adapter ``names[k]`` with weight ``1 / (k + 1)^s``."""
    rng = random.Random(seed)
    return rng.choices(names, weights=[1.0 / (k + 1) ** s for k in range(len(names))], k=n)


async def drive(
    url: str, jobs: list[tuple[str, list[int]]], new_tokens: int, concurrency: int
) -> dict[str, Any]:
    """Send ``jobs`` with ``concurrency`` in flight; per replica the highest load counter seen
    (every load happens before the response of the request that caused it starts)."""
    import httpx

    loads: dict[str, int] = {}
    served: dict[str, int] = {}
    tokens = 0
    queue = list(reversed(jobs))

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal tokens
        while queue:
            model, prompt = queue.pop()
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": new_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            r = await client.post(url + "/v1/completions", json=body)
            r.raise_for_status()
            replica = r.headers["x-lorastar-replica"]
            loads[replica] = max(loads.get(replica, 0), int(r.headers["x-lorastar-adapter-loads"]))
            served[replica] = served.get(replica, 0) + 1
            tokens += r.json()["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return {"seconds": time.perf_counter() - t0, "tokens": tokens, "loads": loads, "served": served}


def run_routing(routing: str, a: argparse.Namespace, root: Path, jobs: list, warm: list) -> dict[str, Any]:
    from ray import serve

    from lorastar.config import EngineConfig
    from lorastar.plugin import LoraStarConfig
    from lorastar.ray import build_app

    engine = EngineConfig(device="cpu", dtype="float32", max_loras=a.max_loras, max_cpu_loras=a.max_loras,
                          max_lora_rank=a.rank, max_model_len=512, num_kv_blocks=512, enable_prefix_caching=False)  # fmt: skip
    cfg = LoraStarConfig(adapter_root=root, engine=engine)
    t0 = time.perf_counter()
    serve.run(build_app(cfg, num_replicas=2, routing=routing), name=routing, route_prefix="/")
    print(f"{routing}: replicas up in {time.perf_counter() - t0:.0f} s", flush=True)
    url = f"http://127.0.0.1:{a.port}"
    w = asyncio.run(drive(url, warm, a.new_tokens, a.concurrency))
    m = asyncio.run(drive(url, jobs, a.new_tokens, a.concurrency))
    serve.delete(routing)
    loads = sum(m["loads"][r] - w["loads"].get(r, 0) for r in m["loads"])
    row = {
        "routing": routing,
        "requests": len(jobs),
        "loads": loads,
        "loads_per_1000": 1000.0 * loads / len(jobs),
        "warmup_loads": sum(w["loads"].values()),
        "tokens": m["tokens"],
        "seconds": m["seconds"],
        "tokens_per_s": m["tokens"] / m["seconds"],
        "served_per_replica": sorted(m["served"].values(), reverse=True),
    }
    print(
        f"{routing}: {row['loads_per_1000']:.1f} loads/1000 requests, {row['tokens_per_s']:.1f} tok/s",
        flush=True,
    )
    return row


def main() -> None:
    a = parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    mon = LoadMonitor()
    mon.sample()
    specs = [dict(s, r=a.rank) for s in adapter_specs(a.adapters, [a.rank])]
    paths = make_adapters(a.adapter_dir, specs)
    root = next(iter(paths.values())).parent
    names = [s["name"] for s in specs]

    from transformers import AutoTokenizer

    from lorastar.models.default import default_model_dir

    tok = AutoTokenizer.from_pretrained(str(default_model_dir()))
    prompts = text_prompts(tok, a.warmup + a.requests, a.prompt_len, seed=5)
    models = zipf_names(names, a.warmup + a.requests, a.zipf, seed=7)
    warm = list(zip(models[: a.warmup], prompts[: a.warmup], strict=True))
    jobs = list(zip(models[a.warmup :], prompts[a.warmup :], strict=True))

    import ray
    from ray import serve

    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env}, log_to_driver=False)
    a.port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": a.port})
    rows = []
    try:
        for routing in ROUTINGS:
            mon.sample()
            rows.append(run_routing(routing, a, root, jobs, warm))
            mon.sample()
    finally:
        serve.shutdown()
        ray.shutdown()

    top = max(models.count(n) for n in names) / len(models)
    table = markdown_table(
        ["routing", "measured requests", "adapter loads", "loads / 1000 requests", "tokens/s", "requests per replica"],
        [
            [r["routing"], r["requests"], r["loads"], r["loads_per_1000"], r["tokens_per_s"],
             " / ".join(map(str, r["served_per_replica"]))]
            for r in rows
        ],
    )  # fmt: skip
    print(table)
    env = env_line(f"load during run (1-min): {mon.summary()}")
    notes = [
        f"2 replicas (1 Ray CPU, OMP_NUM_THREADS=1 each) + a thin ingress on one local Ray (num_cpus=2); "
        f"SmolLM2-135M fp32; {a.adapters} PEFT adapters of rank {a.rank} under one adapter root; "
        f"max_loras={a.max_loras} per replica (multiplex cache = engine device slots; max_cpu_loras "
        f"the same, so an evicted adapter is read from disk again).",
        f"Zipf s={a.zipf}: the most popular adapter gets {top:.0%} of requests; {a.warmup} warm-up "
        f"requests then {a.requests} measured, the same sequence for both routings; "
        f"{a.concurrency} in flight; {a.prompt_len}-token prompts, {a.new_tokens} greedy tokens, EOS ignored.",
        "Loads: the replicas' own counters (adapters read into the engine by Ray's multiplex loader).",
    ]
    write_results(
        "replicas", a.out, [table], {"env": env, "args": {k: str(v) for k, v in vars(a).items()}, "rows": rows},
        notes=notes,
    )  # fmt: skip
    plot(rows, a.out / "replicas.png", env)
    print(f"wrote {a.out / 'replicas.md'}")


def plot(rows: list[dict[str, Any]], path: Path, env: str) -> None:
    fig, (ax1, ax2) = new_figure(ncols=2, width=4.5)
    labels = [r["routing"] for r in rows]
    ax1.bar(labels, [r["loads_per_1000"] for r in rows], color=["tab:green", "tab:gray"])
    ax1.set_ylabel("adapter loads per 1000 requests")
    ax2.bar(labels, [r["tokens_per_s"] for r in rows], color=["tab:green", "tab:gray"])
    ax2.set_ylabel("generated tokens/s (2 replicas)")
    save_figure(fig, path, "Ray Serve, 2 replicas, 32 adapters, max_loras=8: " + env)


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    main()
