"""Embeddings (``LLM.embed``: the last token's final hidden state, L2-normalized) against HF
transformers and PEFT, as sentence-transformers computes them for decoder embedding models.

``--inputs`` texts of random lengths in ``[--min-len, --max-len]`` tokens, embedded by the base
model and, in a second scenario, each by one of ``--adapters`` LoRA adapters (round-robin, ranks
``--ranks`` on the attention and MLP projections). lorastar embeds them all in one call (continuous
batching, no padding, adapters mixed in one batch); HF runs left-padded static batches of
``--batch`` (``model.model(...).last_hidden_state[:, -1]``) and PEFT the same batches with mixed
``adapter_names``. Each rep uses fresh texts (no prefix-cache hits) and alternates which system runs
first. Also reported: the largest difference between the two systems' normalized vectors.

    .venv/bin/python benchmarks/embeddings.py            # SmolLM2, 64 inputs, 8 adapters
    .venv/bin/python benchmarks/embeddings.py --reps 3
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--inputs", type=int, default=64)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--adapters", type=int, default=8, help="adapters of the second scenario (0: none)")
    p.add_argument("--ranks", default="8,16,32")
    p.add_argument("--batch", type=int, default=16, help="HF / PEFT static batch size")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--adapter-dir", type=Path, default=Path("/tmp/lorastar_bench_adapters"))
    p.add_argument("--out", type=Path, default=common.REPO / "benchmarks" / "results")
    return p.parse_args()


def hf_embed(model: Any, inputs: list[list[int]], names: list[str] | None, batch: int, pad: int) -> list[Any]:
    """Left-padded static batches: the last position is every row's last token."""
    import torch

    out = []
    with torch.no_grad():
        for i in range(0, len(inputs), batch):
            ids, mask = common.left_pad(inputs[i : i + batch], pad)
            if names is None:
                hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
            else:  # PEFT: one batch, each row its adapter (its mixed-batch inference)
                hidden = model(
                    input_ids=ids,
                    attention_mask=mask,
                    adapter_names=names[i : i + batch],
                    output_hidden_states=True,
                ).hidden_states[-1]
            out.extend(torch.nn.functional.normalize(hidden[:, -1].float(), dim=-1))
    return out


def main() -> None:
    a = parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    common.setup_torch(a.threads)
    import torch
    from lora import adapter_specs, load_peft, make_adapters

    from lorastar import LLM
    from lorastar.models.default import default_model_dir

    model_dir = str(default_model_dir())
    hf, tok = common.load_hf_model()
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ranks = [int(r) for r in a.ranks.split(",")]
    paths = make_adapters(a.adapter_dir, adapter_specs(a.adapters, ranks)) if a.adapters else {}
    peft = load_peft(paths) if paths else None
    llm = LLM(model_dir, dtype="float32", max_loras=max(1, a.adapters), max_lora_rank=max(ranks))
    for name, path in paths.items():
        llm.load_adapter(name, str(path))
    names = list(paths)

    def workload(rep: int, scenario: str) -> tuple[list[list[int]], list[str | None]]:
        rng = random.Random(1000 * rep + len(scenario))
        lengths = [rng.randint(a.min_len, a.max_len) for _ in range(a.inputs)]
        texts = common.text_prompts(tok, a.inputs, lengths, seed=7 + 100 * rep + len(scenario))
        adapters = (
            [names[i % len(names)] for i in range(a.inputs)] if scenario != "base" else [None] * a.inputs
        )
        return texts, adapters

    def run_lorastar(texts: list[list[int]], adapters: list[str | None]) -> tuple[float, list[Any]]:
        t0 = time.perf_counter()
        outs = llm.embed(texts, adapter=adapters)
        return time.perf_counter() - t0, [torch.tensor(o.outputs.embedding) for o in outs]

    def run_hf(texts: list[list[int]], adapters: list[str | None]) -> tuple[float, list[Any]]:
        t0 = time.perf_counter()
        if adapters[0] is None:
            vecs = hf_embed(hf, texts, None, a.batch, pad)
        else:
            vecs = hf_embed(peft, texts, [n or "__base__" for n in adapters], a.batch, pad)
        return time.perf_counter() - t0, vecs

    scenarios = ["base"] + ([f"{a.adapters} adapters"] if a.adapters else [])
    llm.embed([[1, 2, 3]])  # warm-up (not timed)
    hf_embed(hf, [[1, 2, 3]], None, 1, pad)
    results: dict[str, dict[str, list[float]]] = {
        s: {"lorastar": [], "hf": [], "diff": []} for s in scenarios
    }
    tokens: dict[str, list[int]] = {s: [] for s in scenarios}
    for rep in range(a.reps):
        for scenario in scenarios:
            texts, adapters = workload(rep, scenario)
            tokens[scenario].append(sum(map(len, texts)))
            order = [("lorastar", run_lorastar), ("hf", run_hf)]
            vecs: dict[str, list[Any]] = {}
            for name, fn in order if rep % 2 == 0 else reversed(order):
                seconds, vecs[name] = fn(texts, adapters)
                results[scenario][name].append(seconds)
            diff = max((x - y).abs().max().item() for x, y in zip(vecs["lorastar"], vecs["hf"]))
            results[scenario]["diff"].append(diff)
            r = results[scenario]
            print(
                f"rep {rep + 1}, {scenario}: lorastar {a.inputs / r['lorastar'][-1]:.1f} inputs/s, "
                f"HF/PEFT {a.inputs / r['hf'][-1]:.1f} inputs/s, max |diff| {diff:.1e}",
                flush=True,
            )
    llm.engine.check_invariants()

    rows = []
    for scenario in scenarios:
        r = results[scenario]
        ls, hs = statistics.median(r["lorastar"]), statistics.median(r["hf"])
        toks = statistics.median(tokens[scenario])
        rows.append([
            scenario, a.inputs / ls, toks / ls, a.inputs / hs, toks / hs, hs / ls, f"{max(r['diff']):.1e}",
        ])  # fmt: skip
    if len(rows) > 1:
        tax = rows[1][1] / rows[0][1]
        rows.append(
            ["LoRA tax (with / without adapters)", tax, None, rows[1][3] / rows[0][3], None, None, None]
        )
    table = common.markdown_table(
        ["scenario", "lorastar inputs/s", "lorastar tokens/s", "HF / PEFT inputs/s", "HF / PEFT tokens/s",
         "lorastar / HF", "max abs diff"],
        rows,
    )  # fmt: skip
    print(table)
    workload_line = (
        f"SmolLM2-135M fp32, {a.threads} threads: {a.inputs} inputs of {a.min_len}-{a.max_len} tokens, "
        f"base and {a.adapters} adapters (ranks {a.ranks}, round-robin); HF/PEFT left-padded batches of "
        f"{a.batch}; median of {a.reps} reps alternating the order; fresh inputs each rep"
    )
    common.write_results(
        "embeddings", a.out, [workload_line, table], {"env": common.env_line(), "results": results}
    )
    fig, axes = common.new_figure(ncols=1, width=7)
    ax = axes[0]
    x = range(len(scenarios))
    ax.bar(
        [i - 0.2 for i in x], [r[1] for r in rows[: len(scenarios)]], width=0.4, label="lorastar LLM.embed"
    )
    ax.bar([i + 0.2 for i in x], [r[3] for r in rows[: len(scenarios)]], width=0.4, label="HF / PEFT batches")
    ax.set_xticks(list(x))
    ax.set_xticklabels(scenarios)
    ax.set_ylabel("inputs embedded per second")
    ax.legend()
    common.save_figure(fig, a.out / "embeddings.png", f"embeddings: {workload_line}")


if __name__ == "__main__":
    main()
