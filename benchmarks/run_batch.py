"""``lorastar run-batch`` against the offline engine on the same workload.

The batch runner answers each line through the app's own route in-process (JSON in, validation,
the route, JSON out), at most 2 x ``max_num_seqs`` in flight; ``LLM.generate`` gets the same
token-id prompts and greedy lengths (``ignore_eos``) directly. Both ways of running the engine
under the runner are measured: as a thread of this process and as a core process of its own (the
CLI's default). Reps alternate between the systems; the table gives each one's best output
tokens/s and its ratio to the offline engine's best.

    .venv/bin/python benchmarks/run_batch.py                       # SmolLM2, 64 lines
    .venv/bin/python benchmarks/run_batch.py --lines 128 --new-tokens 32 --reps 3
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lines", type=int, default=64, help="requests in the batch file")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=common.REPO / "benchmarks" / "results")
    return p.parse_args()


def main() -> None:
    a = parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    common.setup_torch(a.threads)
    from transformers import AutoTokenizer

    from lorastar import LLM, SamplingParams
    from lorastar.config import EngineConfig
    from lorastar.models.default import default_model_dir
    from lorastar.plugin import LoraStarConfig, create_app, lifespan
    from lorastar.plugin.batch_file import parse_batch, run_batch

    model = str(default_model_dir())
    tok = AutoTokenizer.from_pretrained(model)
    prompts = common.text_prompts(tok, a.lines, a.prompt_len)
    body = {"max_tokens": a.new_tokens, "temperature": 0, "ignore_eos": True}
    lines = parse_batch(
        json.dumps(
            {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": {**body, "prompt": p}}
        )
        for i, p in enumerate(prompts)
    )
    # no prefix caching: every rep prefills its prompts again, in every system
    engine = {
        "model": model,
        "device": "cpu",
        "dtype": "float32",
        "max_num_seqs": a.max_num_seqs,
        "enable_prefix_caching": False,
    }
    total = a.lines * a.new_tokens

    def offline(llm: Any) -> float:
        params = SamplingParams(max_tokens=a.new_tokens, temperature=0, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        assert sum(len(o.outputs[0].token_ids) for o in outs) == total
        return total / (time.perf_counter() - t0)

    async def batch(app: Any) -> float:
        out = io.StringIO()
        t0 = time.perf_counter()
        summary = await run_batch(app, lines, out, concurrency=2 * a.max_num_seqs)
        seconds = time.perf_counter() - t0
        records = [json.loads(x) for x in out.getvalue().splitlines()]
        assert summary.failed == 0 and len(records) == a.lines, out.getvalue()[:2000]
        assert sum(r["response"]["body"]["usage"]["completion_tokens"] for r in records) == total
        return total / seconds

    async def run() -> dict[str, list[float]]:
        llm = LLM(config=EngineConfig(**engine))
        apps = {
            f"run-batch, engine {mode}": create_app(
                LoraStarConfig(
                    engine=EngineConfig(**engine), engine_process=mode == "process", max_waiting=2**31 - 1
                )
            )
            for mode in ("thread", "process")
        }
        results: dict[str, list[float]] = {"offline LLM.generate": [], **{name: [] for name in apps}}
        async with lifespan(*apps.values()):
            offline(llm)  # warm-up: one pass of each, not timed
            for app in apps.values():
                await batch(app)
            for rep in range(a.reps):
                order = list(results) if rep % 2 == 0 else list(reversed(results))
                for name in order:
                    tok_s = offline(llm) if name.startswith("offline") else await batch(apps[name])
                    results[name].append(tok_s)
                    print(f"rep {rep + 1}, {name}: {tok_s:.1f} tok/s", flush=True)
        return results

    results = asyncio.run(run())
    base = max(results["offline LLM.generate"])
    rows = [[name, max(v), max(v) / base, ", ".join(f"{x:.1f}" for x in v)] for name, v in results.items()]
    table = common.markdown_table(["system", "best tok/s", "/ offline", "each rep"], rows)
    print(table)
    workload = (
        f"SmolLM2-135M fp32, {a.lines} lines of {a.prompt_len} prompt tokens, {a.new_tokens} greedy "
        f"new tokens each (ignore_eos), max_num_seqs {a.max_num_seqs}, {a.threads} threads"
    )
    common.write_results(
        "run_batch", a.out, [workload, table], {"env": common.env_line(), "results": results}
    )
    fig, (ax,) = common.new_figure()
    ax.bar(range(len(rows)), [r[1] for r in rows], color=["#888", "#4a7", "#47a"][: len(rows)])
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r[0] for r in rows], fontsize=7)
    ax.set_ylabel("output tokens/s (best rep)")
    common.save_figure(fig, a.out / "run_batch.png", f"run-batch vs offline: {workload}")


if __name__ == "__main__":
    main()
