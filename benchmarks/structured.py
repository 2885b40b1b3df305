"""Structured outputs: what a grammar costs a batch, side by side with plain decoding.

SmolLM2-135M-Instruct (fp32, CPU). Each round runs the same chat prompts (each its own request)
three ways in one engine, in alternating order:

- ``plain``: no constraint, EOS ignored (``--new-tokens`` each);
- ``regex``: ``guided_regex`` of ``--new-tokens``-plus characters of lowercase text, EOS ignored, so
  every request decodes exactly as many tokens as plain (only the constraint differs);
- ``json``: a three-field JSON schema (``guided_json``), ending at the schema's end (fewer tokens:
  compared by tokens/s only).

Reported per concurrency: tokens/s (median of ``--rounds``), the ratio to plain of the medians, and
the host time of the mask per step (matcher advance, packed mask, its addition to the logits).

    .venv/bin/python benchmarks/structured.py            # 1, 16, 64 requests
    .venv/bin/python benchmarks/structured.py --quick    # smoke run

Writes ``structured.md`` / ``.json`` / ``.png`` under ``--out``.
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
    write_results,
)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
}
MODES = ("plain", "regex", "json")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=str, default="1,16,64")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    p.add_argument("--out", type=Path, default=RESULTS)
    a = p.parse_args()
    a.levels = [int(x) for x in a.concurrency.split(",") if x]
    if a.quick:
        a.levels, a.new_tokens, a.rounds = [1, 4], 8, 1
    return a


def params(mode: str, new_tokens: int) -> Any:
    from lorastar import SamplingParams

    kw: dict[str, Any] = {"temperature": 0.7, "seed": 1, "max_tokens": new_tokens}
    if mode == "plain":
        kw["ignore_eos"] = True
    elif mode == "regex":
        kw.update(ignore_eos=True, guided_regex=f"[a-z ,.]{{{new_tokens * 8}}}")
    else:
        kw["guided_json"] = SCHEMA
    return SamplingParams(**kw)


class MaskTimer:
    """Host time in the sampler's grammar masks (``structured.apply_grammars``), per call."""

    def __init__(self) -> None:
        import lorastar.engine.sampler as sampler

        self.sampler, self.orig = sampler, sampler.apply_grammars
        self.total, self.calls = 0.0, 0

        def timed(*args: Any) -> Any:
            t = time.perf_counter()
            out = self.orig(*args)
            self.total += time.perf_counter() - t
            self.calls += 1
            return out

        sampler.apply_grammars = timed

    def take(self) -> float:
        """Mean ms per masked step since the last call."""
        ms = 1e3 * self.total / self.calls if self.calls else 0.0
        self.total, self.calls = 0.0, 0
        return ms


def main() -> None:
    a = parse_args()
    setup_torch(a.threads)
    mon = LoadMonitor()
    mon.sample()
    env = env_line()
    print(env, flush=True)
    from lorastar import LLM

    llm = LLM(device="cpu", max_model_len=512, max_num_seqs=max(a.levels))
    timer = MaskTimer()
    results: dict[int, dict[str, Any]] = {}
    for n in a.levels:
        msgs = [
            [{"role": "user", "content": f"Describe person number {i} as JSON with a name, an age and tags."}]
            for i in range(n)
        ]
        for mode in MODES:  # warm-up: compiles the grammars, first-call allocations
            llm.chat(msgs[:2], params(mode, 4))
        timer.take()
        runs: dict[str, list[tuple[float, int, float]]] = {m: [] for m in MODES}
        for r in range(a.rounds):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                t = time.perf_counter()
                outs = llm.chat(msgs, params(mode, a.new_tokens))
                dt = time.perf_counter() - t
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                runs[mode].append((tokens / dt, tokens, timer.take()))
                mon.sample()
        res = {m: {"tok_s": [x[0] for x in v], "tokens": v[0][1], "mask_ms": statistics.median(x[2] for x in v)}
               for m, v in runs.items()}  # fmt: skip
        for m in MODES:
            res[m]["median"] = statistics.median(res[m]["tok_s"])
            res[m]["ratio"] = res[m]["median"] / res["plain"]["median"]
        results[n] = res
        print(
            f"{n:3d} requests: " + ", ".join(
                f"{m} {res[m]['median']:.1f} tok/s ({res[m]['ratio']:.2f}x, mask {res[m]['mask_ms']:.2f} ms/step)"
                for m in MODES
            ),
            flush=True,
        )  # fmt: skip

    rows = [
        [n, *(results[n][m]["median"] for m in MODES), results[n]["regex"]["ratio"], results[n]["json"]["ratio"],
         results[n]["regex"]["mask_ms"], results[n]["json"]["mask_ms"], results[n]["json"]["tokens"] / n]
        for n in a.levels
    ]  # fmt: skip
    table = markdown_table(
        ["requests", "plain tok/s", "regex tok/s", "json tok/s", "regex / plain", "json / plain",
         "regex mask ms/step", "json mask ms/step", "json tokens per request"],
        rows,
    )  # fmt: skip
    notes = [
        "plain and regex decode the same number of tokens per request (EOS ignored); json ends at the "
        "schema's end, so its prefill is a larger share of its time.",
        f"Ratios are of medians over {a.rounds} alternating rounds in one process.",
        f"1-minute load average during the run: {mon.summary()}.",
    ]
    md = write_results("structured", a.out, [table], {"env": env, "results": results}, notes=notes)
    print(md)
    fig, (ax,) = new_figure()
    for m in MODES:
        ax.plot(a.levels, [results[n][m]["median"] for n in a.levels], marker="o", label=m)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("tokens / s")
    ax.legend()
    save_figure(fig, a.out / "structured.png", "Structured outputs vs plain decoding, SmolLM2 fp32 CPU")


if __name__ == "__main__":
    main()
