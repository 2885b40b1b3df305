"""Automatic prefix caching: 32 requests sharing a 512-token system prompt.

Each request is the same ``--system-len``-token system prompt followed by its own
``--user-len``-token user text (token ids concatenated), ``--new-tokens`` greedy tokens, EOS
ignored. Two engines in the same run, prefix caching on and off, three arrival patterns (each
with its own system prompt, so every pattern starts with a cold cache):

- sequential: requests arrive one after another, each after the previous one finished;
- warm burst: request 0 runs until its first token, then the other 31 arrive together;
- cold burst: all 32 arrive together.

Reported per pattern and mode: cached prompt tokens (``RequestOutput.num_cached_tokens``), prompt
tokens actually prefilled, time to first token (arrival to first token) of request 0 and of the
later requests, and the wall time; greedy outputs must be equal with caching on and off.

    .venv/bin/python benchmarks/prefix.py            # full run
    .venv/bin/python benchmarks/prefix.py --quick    # smoke run

Writes ``prefix.md`` / ``.json`` / ``.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    RESULTS,
    LoadMonitor,
    env_line,
    markdown_table,
    new_figure,
    save_figure,
    setup_torch,
    text_prompts,
    write_results,
)

PATTERNS = ("sequential", "warm_burst", "cold_burst")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--system-len", type=int, default=512)
    p.add_argument("--user-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--patterns", type=str, default=",".join(PATTERNS), help="subset of " + ",".join(PATTERNS))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    p.add_argument("--out", type=Path, default=RESULTS)
    a = p.parse_args()
    if a.quick:
        a.requests, a.system_len, a.user_len, a.new_tokens = 6, 64, 8, 2
    a.pats = [x for x in a.patterns.split(",") if x]
    for x in a.pats:
        if x not in PATTERNS:
            p.error(f"--patterns: unknown pattern {x!r}")
    return a


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def run_pattern(llm: Any, prompts: list[list[int]], pattern: str, new_tokens: int) -> dict[str, Any]:
    from lorastar import SamplingParams

    eng = llm.engine
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    done: dict[str, Any] = {}
    order: list[str] = []

    def drain(until: Any) -> None:
        while not until():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o
            if not eng.has_unfinished() and not until():
                raise RuntimeError("engine idle before the condition held")

    t0 = time.perf_counter()
    if pattern == "sequential":
        for p in prompts:
            rid = eng.add_request(p, sp).request_id
            order.append(rid)
            drain(lambda rid=rid: rid in done)
    elif pattern == "warm_burst":
        first = eng.add_request(prompts[0], sp)
        order.append(first.request_id)
        drain(lambda: first.first_token_time is not None)
        order += [eng.add_request(p, sp).request_id for p in prompts[1:]]
        drain(lambda: len(done) == len(prompts))
    else:
        order += [eng.add_request(p, sp).request_id for p in prompts]
        drain(lambda: len(done) == len(prompts))
    wall = time.perf_counter() - t0
    eng.check_invariants()
    outs = [done[r] for r in order]
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    cached = [o.num_cached_tokens for o in outs]
    later = ttft[1:]
    return {
        "wall_s": wall,
        "ttft_s": ttft,
        "cached_tokens": cached,
        "prompt_tokens": [len(o.prompt_token_ids) for o in outs],
        "prefilled_tokens": sum(len(o.prompt_token_ids) - c for o, c in zip(outs, cached)),
        "ttft_first_s": ttft[0],
        "ttft_later_median_s": statistics.median(later) if later else float("nan"),
        "ttft_later_p90_s": percentile(later, 0.9) if later else float("nan"),
        "ttft_later_mean_s": statistics.mean(later) if later else float("nan"),
        "outputs": [o.outputs[0].token_ids for o in outs],
    }


def main() -> None:
    a = parse_args()
    setup_torch(a.threads)
    mon = LoadMonitor()
    mon.sample()
    env_start = env_line()
    print(env_start, flush=True)
    from lorastar import LLM

    engines = {
        "on": LLM(device="cpu", enable_prefix_caching=True, max_num_seqs=64),
        "off": LLM(device="cpu", enable_prefix_caching=False, max_num_seqs=64),
    }
    tok = engines["on"].tokenizer
    for llm in engines.values():  # warm up (first-call allocations)
        llm.generate(text_prompts(tok, 2, 16, seed=99), None)

    results: dict[str, dict[str, Any]] = {}
    for k, pattern in enumerate(PATTERNS):
        if pattern not in a.pats:
            continue
        system = text_prompts(tok, 1, a.system_len, seed=500 + k)[0]
        users = text_prompts(tok, a.requests, a.user_len, seed=600 + k)
        prompts = [system + u for u in users]
        results[pattern] = {}
        for mode in ("on", "off"):
            r = run_pattern(engines[mode], prompts, pattern, a.new_tokens)
            results[pattern][mode] = r
            mon.sample()
            print(
                f"{pattern:11s} caching {mode:3s}: cached {sum(r['cached_tokens']):6d} tokens, prefilled "
                f"{r['prefilled_tokens']:6d}, TTFT first {r['ttft_first_s']:.3f}s later median "
                f"{r['ttft_later_median_s']:.3f}s, wall {r['wall_s']:.1f}s",
                flush=True,
            )
        results[pattern]["outputs_equal"] = (
            results[pattern]["on"]["outputs"] == results[pattern]["off"]["outputs"]
        )

    rows = []
    for pattern in a.pats:
        for mode in ("on", "off"):
            r = results[pattern][mode]
            later_cached = r["cached_tokens"][1:]
            rows.append(
                [
                    pattern.replace("_", " "),
                    mode,
                    sum(r["cached_tokens"]),
                    f"{statistics.mean(later_cached):.0f}" if later_cached else "n/a",
                    r["prefilled_tokens"],
                    r["ttft_first_s"],
                    r["ttft_later_median_s"],
                    r["ttft_later_p90_s"],
                    r["wall_s"],
                ]
            )
    table = markdown_table(
        [
            "arrival",
            "prefix caching",
            "cached tokens (all)",
            "cached per later request",
            "prompt tokens prefilled",
            "TTFT req 0 s",
            "TTFT later median s",
            "TTFT later p90 s",
            "wall s",
        ],
        rows,
    )
    summary = []
    for pattern in a.pats:
        on, off = results[pattern]["on"], results[pattern]["off"]
        summary.append(
            f"{pattern.replace('_', ' ')}: later requests' median TTFT {off['ttft_later_median_s']:.3f} s off -> "
            f"{on['ttft_later_median_s']:.3f} s on ({off['ttft_later_median_s'] / on['ttft_later_median_s']:.1f}x); prefilled tokens {off['prefilled_tokens']} -> {on['prefilled_tokens']}; "
            f"greedy outputs equal on/off: {results[pattern]['outputs_equal']}"
        )
    print()
    print(table)
    print()
    for s in summary:
        print(s)
    env = env_line(f"load during run (1-min): {mon.summary()}")
    notes = [
        f"{a.requests} requests = one {a.system_len}-token system prompt + a distinct {a.user_len}-token user text "
        f"(token ids concatenated); {a.new_tokens} greedy new tokens each, EOS ignored; SmolLM2-135M fp32 CPU, "
        f"{a.threads} threads, block size 16, token budget 2048 per step.",
        "TTFT = first token time - arrival time (engine metrics). Cached tokens = RequestOutput.num_cached_tokens "
        "(full 16-token blocks found in the prefix cache at admission).",
        "The system prompt is prefilled once when caching is on: in the cold burst the first step admits the "
        "requests that fit the token budget before any block is committed, so those few prefill it too.",
        *summary,
    ]
    write_results(
        "prefix",
        a.out,
        [table],
        {
            "env": env,
            "env_start": env_start,
            "args": vars(a),
            "results": {
                p: {
                    m: {k: v for k, v in r.items() if k != "outputs"} if isinstance(r, dict) else r
                    for m, r in d.items()
                }
                for p, d in results.items()
            },
        },
        notes=notes,
    )
    plot(a, results, a.out / "prefix.png", env)
    print(f"wrote {a.out / 'prefix.md'} and prefix.png")


def plot(a: argparse.Namespace, results: dict[str, Any], path: Path, env: str) -> None:
    fig, axes = new_figure(len(a.pats), width=4.8)
    for ax, pattern in zip(axes, a.pats):
        for mode, style in (("off", "s--"), ("on", "o-")):
            r = results[pattern][mode]
            ax.plot(range(len(r["ttft_s"])), [1000 * t for t in r["ttft_s"]], style, ms=3,
                    label=f"prefix caching {mode}")  # fmt: skip
        ax.set_xlabel("request (arrival order)")
        ax.set_ylabel("TTFT ms")
        ax.set_title(f"{pattern.replace('_', ' ')}: {a.requests} x ({a.system_len} shared + {a.user_len})")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    save_figure(fig, path, env)


if __name__ == "__main__":
    main()
