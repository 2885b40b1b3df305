"""Speculative decoding (ngram prompt lookup) on the CPU: tokens/s with and without it.

SmolLM2-135M-Instruct, greedy, chat prompts of two kinds:

- edit: "add docstrings to / rename a variable in this code" (the answer copies most of the prompt:
  the drafts come from it);
- chat: open questions (little to copy: what drafting costs when it rarely pays);
- extract: "extract these fields as JSON" from a short record, under a JSON schema (``guided_json``:
  the grammar's matcher steps through the drafts; the values are copied from the prompt).

Each kind at ``--concurrency`` (requests in flight: 1 runs them one after another), with
speculative decoding off and on (``num_speculative_tokens=4``, n-grams of 2-4 tokens) in the same
run, alternating, best of ``--reps``. Reported: generated tokens/s, the on/off ratio, the mean
acceptance length (tokens a drafted step adds) and the draft acceptance rate; greedy outputs must be
equal with and without it (near ties aside: a draft is verified in a multi-token pass).

    .venv/bin/python benchmarks/spec_decode.py            # full run
    .venv/bin/python benchmarks/spec_decode.py --quick    # smoke run

Writes ``spec_decode.md`` / ``.json`` / ``.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
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

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
NAMES = ("width", "height", "price", "count", "total", "speed", "radius", "weight")


def _code(i: int) -> str:
    a, b = NAMES[i % len(NAMES)], NAMES[(i + 3) % len(NAMES)]
    return (
        f"def combine_{i}({a}, {b}):\n    result = {a} * {b} + {i}\n    return result\n\n\n"
        f"def scale_{i}(values, {a}):\n    out = []\n    for v in values:\n        out.append(v * {a})\n"
        f"    return out\n\n\ndef describe_{i}({b}):\n    if {b} > {i}:\n        return 'large'\n"
        "    return 'small'\n"
    )


def edit_prompts(n: int) -> list[list[dict[str, str]]]:
    asks = ("Add a docstring to each function", f"Rename the variable {NAMES[0]} to w")
    return [
        [{"role": "user", "content": f"{asks[i % 2]} in this code:\n```python\n{_code(i)}```"}]
        for i in range(n)
    ]


def chat_prompts(n: int) -> list[list[dict[str, str]]]:
    topics = ("the history of Rome", "how rainbows form", "why the sky is blue", "how bees make honey",
              "the water cycle", "how a bicycle works", "the life of a star", "how bread rises")  # fmt: skip
    return [
        [{"role": "user", "content": f"Explain {topics[i % len(topics)]} in a few sentences."}]
        for i in range(n)
    ]


PEOPLE = (
    ("Margaret Thompson-Whitfield", "retired marine biologist", "Saint Petersburg, Florida", 67),
    ("Oluwaseun Adebayo-Okafor", "civil engineer", "Port Harcourt, Nigeria", 41),
    ("Jean-Baptiste Delacroix", "pastry chef", "Clermont-Ferrand, France", 35),
    ("Siobhan McLaughlin-Byrne", "veterinary surgeon", "Letterkenny, County Donegal", 52),
)
EXTRACT_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "job": {"type": "string"}, "city": {"type": "string"},
                   "age": {"type": "integer"}},
    "required": ["name", "job", "city", "age"],
}  # fmt: skip


def extract_prompts(n: int) -> list[list[dict[str, str]]]:
    out = []
    for i in range(n):
        name, job, city, age = PEOPLE[i % len(PEOPLE)]
        record = (
            f"Record {100 + i}: {name}, a {job}, lives in {city} and is {age + i // len(PEOPLE)} years old."
        )
        out.append(
            [
                {
                    "role": "user",
                    "content": f"Extract name, job, city and age as JSON from this record:\n{record}",
                }
            ]
        )
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=str, default="1,8")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    p.add_argument("--out", type=Path, default=RESULTS)
    a = p.parse_args()
    if a.quick:
        a.requests, a.new_tokens, a.reps = 2, 16, 1
    a.conc = [int(x) for x in a.concurrency.split(",") if x]
    return a


def run(
    llm: Any, prompts: list[Any], conc: int, new_tokens: int, schema: Any = None
) -> tuple[float, int, list[list[int]], Any]:
    from lorastar import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, guided_json=schema)
    eng = llm.engine
    before = eng.stats().spec_decode
    t = time.perf_counter()
    outs: list[Any] = []
    for i in range(0, len(prompts), conc):
        outs += llm.chat(prompts[i : i + conc], params, use_tqdm=False)
    dt = time.perf_counter() - t
    after = eng.stats().spec_decode
    toks = [o.outputs[0].token_ids for o in outs]
    delta = None
    if after is not None:
        delta = (
            after.num_drafts - before.num_drafts,
            after.num_draft_tokens - before.num_draft_tokens,
            after.num_accepted_tokens - before.num_accepted_tokens,
        )
    return dt, sum(len(x) for x in toks), toks, delta


def main() -> None:
    a = parse_args()
    setup_torch(a.threads)
    from lorastar import LLM

    mon = LoadMonitor()
    kinds = {
        "edit": edit_prompts(a.requests),
        "chat": chat_prompts(a.requests),
        "extract": extract_prompts(a.requests),
    }
    engines = {
        "off": LLM(max_num_seqs=max(a.conc)),
        "on": LLM(max_num_seqs=max(a.conc), speculative_config=SPEC),
    }
    from lorastar import SamplingParams

    for llm in engines.values():  # warm-up: first-call costs out of the timings
        llm.chat(kinds["edit"][:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    rows: list[list[Any]] = []
    data: dict[str, Any] = {"runs": []}
    for kind, prompts in kinds.items():
        for conc in a.conc:
            best: dict[str, tuple[float, int, list[list[int]], Any]] = {}
            for _ in range(a.reps):
                for mode, llm in engines.items():  # alternating: drift hits both alike
                    r = run(llm, prompts, conc, a.new_tokens, EXTRACT_SCHEMA if kind == "extract" else None)
                    mon.sample()
                    if mode not in best or r[1] / r[0] > best[mode][1] / best[mode][0]:
                        best[mode] = r
            off, on = best["off"], best["on"]
            same = sum(x == y for x, y in zip(off[2], on[2]))
            drafts, drafted, kept = on[3]
            tps_off, tps_on = off[1] / off[0], on[1] / on[0]
            rows.append([
                kind, conc, f"{tps_off:.1f}", f"{tps_on:.1f}", f"{tps_on / tps_off:.2f}x",
                f"{1 + kept / drafts:.2f}" if drafts else "-", f"{100 * kept / drafted:.0f}%" if drafted else "-",
                f"{same}/{len(prompts)}",
            ])  # fmt: skip
            data["runs"].append({"kind": kind, "concurrency": conc, "tokens_per_s_off": tps_off,
                                 "tokens_per_s_on": tps_on, "drafts": drafts, "drafted": drafted,
                                 "accepted": kept, "same_outputs": same, "requests": len(prompts)})  # fmt: skip
            print(rows[-1], flush=True)
    headers = ["prompts", "concurrency", "tok/s off", "tok/s on", "on/off", "mean acceptance length",
               "draft acceptance", "same greedy output"]  # fmt: skip
    table = markdown_table(headers, rows)
    print(table)
    env = env_line(f"load during run (1-min): {mon.summary()}")
    data["env"] = env
    write_results(
        "spec_decode", a.out, [table], data,
        notes=[
            f"SmolLM2-135M-Instruct fp32, {a.threads} threads, {a.requests} chat requests per kind, "
            f"{a.new_tokens} new tokens at most (greedy, EOS ends), best of {a.reps} alternating runs; "
            "extract: under a JSON schema of four fields.",
            "speculative_config: " + str(SPEC),
            "mean acceptance length: tokens a drafted sequence-step adds (1 + kept drafts / drafted steps).",
        ],
    )  # fmt: skip
    fig, axes = new_figure(1, width=6.4)
    ax = axes[0]
    labels = [f"{r[0]}\nc={r[1]}" for r in rows]
    x = list(range(len(rows)))
    ax.bar([i - 0.2 for i in x], [float(r[2]) for r in rows], 0.4, label="off")
    ax.bar([i + 0.2 for i in x], [float(r[3]) for r in rows], 0.4, label="ngram, 4 drafts")
    ax.set_xticks(x)
    ax.set_xticklabels(labels)
    ax.set_ylabel("generated tokens/s")
    ax.legend()
    save_figure(fig, a.out / "spec_decode.png", env)


if __name__ == "__main__":
    main()
