"""Priority scheduling: interactive requests arriving while a batch job fills the engine.

A batch job (``--batch`` requests, priority 1) is queued at once, more than ``--max-num-seqs`` can
run; short interactive requests (priority 0) arrive every ``--interval`` seconds while it runs. The
same engine is run with ``scheduling_policy="fcfs"`` (where every request's priority is 0: the
interactive ones queue behind the whole batch), ``"priority"`` as vLLM v1 has it (they wait for the
next free seat, ahead of the queued batch) and lorastar's ``"priority"`` (they preempt a batch
request for a seat and start at once). Reps alternate the order of the three; the table gives the
interactive requests' time to first token and end-to-end latency (median and worst over every rep),
the batch job's makespan and the output tokens/s of the whole run. Prefix caching is on (the
serving default): a preempted batch request recomputes its prompt mostly from its cached blocks.

    .venv/bin/python benchmarks/priority.py            # SmolLM2, 32 batch + 8 interactive
    .venv/bin/python benchmarks/priority.py --reps 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=32, help="batch-job requests (priority 1), queued at once")
    p.add_argument("--batch-prompt", type=int, default=128)
    p.add_argument("--batch-new", type=int, default=64)
    p.add_argument("--interactive", type=int, default=8, help="interactive requests (priority 0)")
    p.add_argument("--interactive-prompt", type=int, default=32)
    p.add_argument("--interactive-new", type=int, default=16)
    p.add_argument("--interval", type=float, default=1.0, help="seconds between interactive arrivals")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=common.REPO / "benchmarks" / "results")
    return p.parse_args()


def main() -> None:
    a = parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    common.setup_torch(a.threads)
    from transformers import AutoTokenizer

    from lorastar import SamplingParams
    from lorastar.config import EngineConfig
    from lorastar.engine.engine import LLMEngine
    from lorastar.engine.sampling import RequestOutputKind
    from lorastar.models.default import default_model_dir

    model = str(default_model_dir())
    tok = AutoTokenizer.from_pretrained(model)

    def params(new: int) -> Any:
        return SamplingParams(
            max_tokens=new, temperature=0, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
        )

    systems = ("fcfs", "priority, wait for a seat (vLLM v1)", "priority")
    engines = {
        name: LLMEngine(
            EngineConfig(
                model=model,
                device="cpu",
                dtype="float32",
                max_num_seqs=a.max_num_seqs,
                scheduling_policy="fcfs" if name == "fcfs" else "priority",
            )
        )  # fmt: skip
        for name in systems
    }
    engines[systems[1]].scheduler.preempt_for_seats = False

    def run(policy: str, rep: int) -> dict[str, Any]:
        # each rep's own prompts: no run finds another's in its prefix cache
        batch_prompts = common.text_prompts(tok, a.batch, a.batch_prompt, seed=10 + rep)
        inter_prompts = common.text_prompts(tok, a.interactive, a.interactive_prompt, seed=100 + rep)
        eng = engines[policy]
        prio = policy != "fcfs"
        t0 = time.perf_counter()
        mono0 = time.monotonic()
        for i, p in enumerate(batch_prompts):
            eng.add_request(p, params(a.batch_new), request_id=f"b{i}", priority=1 if prio else 0)
        sent = 0
        done: dict[str, Any] = {}
        while eng.has_unfinished() or sent < a.interactive:
            now = time.perf_counter() - t0
            while sent < a.interactive and now >= (sent + 1) * a.interval:
                eng.add_request(inter_prompts[sent], params(a.interactive_new), request_id=f"i{sent}")
                sent += 1
            if not eng.has_unfinished():
                time.sleep(0.001)
                continue
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out
        seconds = time.perf_counter() - t0
        inter = [done[f"i{k}"].metrics for k in range(a.interactive)]
        batch_end = max(done[f"b{k}"].metrics.finished_time for k in range(a.batch)) - mono0
        tokens = a.batch * a.batch_new + a.interactive * a.interactive_new
        assert sum(len(o.outputs[0].token_ids) for o in done.values()) == tokens
        eng.check_invariants()
        return {
            "ttft": [m.first_token_time - m.arrival_time for m in inter],
            "e2e": [m.finished_time - m.arrival_time for m in inter],
            "batch_makespan": batch_end,
            "tok_s": tokens / seconds,
        }

    results: dict[str, list[dict[str, Any]]] = {name: [] for name in systems}
    for eng in engines.values():  # warm-up: a short pass each, not timed
        eng.add_request(common.text_prompts(tok, 1, a.interactive_prompt, seed=1)[0], params(4))
        while eng.has_unfinished():
            eng.step()
    for rep in range(a.reps):
        for policy in systems if rep % 2 == 0 else reversed(systems):
            r = run(policy, rep)
            results[policy].append(r)
            print(
                f"rep {rep + 1}, {policy}: interactive TTFT p50 {statistics.median(r['ttft']):.2f} s, "
                f"batch {r['batch_makespan']:.1f} s, {r['tok_s']:.1f} tok/s",
                flush=True,
            )

    rows = []
    for policy, reps in results.items():
        ttft = [x for r in reps for x in r["ttft"]]
        e2e = [x for r in reps for x in r["e2e"]]
        rows.append([
            policy, statistics.median(ttft), max(ttft), statistics.median(e2e), max(e2e),
            statistics.median(r["batch_makespan"] for r in reps), max(r["tok_s"] for r in reps),
        ])  # fmt: skip
    ratios = [[f"{r[0]} / fcfs", *(r[k] / rows[0][k] for k in range(1, 7))] for r in rows[1:]]
    table = common.markdown_table(
        ["policy", "interactive TTFT p50 s", "TTFT max s", "latency p50 s", "latency max s",
         "batch makespan s", "tok/s (best)"],
        [*rows, *ratios],
    )  # fmt: skip
    print(table)
    workload = (
        f"SmolLM2-135M fp32, {a.threads} threads, max_num_seqs {a.max_num_seqs}: a batch job of {a.batch} x "
        f"({a.batch_prompt} prompt + {a.batch_new} new) tokens queued at once (priority 1), "
        f"{a.interactive} interactive x ({a.interactive_prompt} + {a.interactive_new}) arriving every "
        f"{a.interval:g} s (priority 0); under fcfs every priority is 0; {a.reps} reps alternating"
    )
    common.write_results("priority", a.out, [workload, table], {"env": common.env_line(), "results": results})
    fig, axes = common.new_figure(ncols=2, width=10)
    for ax, key, label in ((axes[0], "ttft", "time to first token (s)"), (axes[1], "e2e", "latency (s)")):
        data = [[x for r in results[pol] for x in r[key]] for pol in systems]
        ax.boxplot(data, tick_labels=["fcfs", "priority,\nwait (vLLM v1)", "priority"])
        ax.set_yscale("log")
        ax.set_ylabel(f"interactive requests: {label}")
    common.save_figure(fig, a.out / "priority.png", f"priority scheduling: {workload}")


if __name__ == "__main__":
    main()
