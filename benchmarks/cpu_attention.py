"""The CPU paged decode op (``kernels/csrc/cpu_attention.cpp``): its tiled form against the per-key
form, side by side, over decode shapes of the models lorastar serves.

Each shape is ``rows`` decode rows (one new token each) over ``context`` cached keys in shuffled
16-token blocks of an fp32 cache, as the engine's C++ op reads them. Both forms run alternately,
``--reps`` rounds of ``--iters`` calls each; a form's time is its best round (this shared CPU's
drift is 10-30% between runs, the best of alternating rounds is what both could do). "GB/s" is the
K/V bytes each call must read divided by its time. The tiled form exists in builds for AVX-512
(``cpu_native.decode_tiled()``); elsewhere the script says so and times the per-key form alone.

    .venv/bin/python benchmarks/cpu_attention.py              # full run, 1 thread
    .venv/bin/python benchmarks/cpu_attention.py --quick      # smoke run

Writes ``cpu_attention.md`` / ``.json`` / ``.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

# (name, query heads, kv heads, head size): the attention shapes of models lorastar serves.
MODELS = {
    "smollm2-135m": (9, 3, 64),
    "qwen3-0.6b": (16, 8, 128),
    "llama-3-8b": (32, 8, 128),
}
FULL = [(m, rows, ctx) for m in MODELS for rows, ctx in ((1, 1000), (16, 200), (64, 300))]
QUICK = [("smollm2-135m", 4, 64)]


def case(rows: int, hq: int, hkv: int, d: int, ctx: int, bs: int = 16, seed: int = 0) -> dict[str, Any]:
    """Inputs of ``paged_decode`` for ``rows`` rows of ``ctx`` keys in shuffled blocks."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    nblk = -(-ctx // bs)
    nb = rows * nblk + 1
    k_cache = torch.randn(nb, bs, hkv, d, generator=gen)
    v_cache = torch.randn(nb, bs, hkv, d, generator=gen)
    gather = torch.randperm(nb - 1, generator=gen)[: rows * nblk].view(rows, nblk).contiguous()
    return {
        "q": torch.randn(rows, hq, d, generator=gen),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "rows": torch.arange(rows),
        "gather": gather,
        "lo": torch.zeros(rows, dtype=torch.int64),
        "lens": torch.full((rows,), ctx, dtype=torch.int64),
        "out": torch.empty(rows, hq, d),
        "kv_bytes": rows * ctx * hkv * d * 4 * 2,
    }


def time_forms(c: dict[str, Any], forms: list[bool], iters: int, reps: int) -> dict[bool, float]:
    """Best per-call seconds of each form (``tiled`` True/False), rounds alternating."""
    from lorastar.kernels.cpu_native import paged_decode

    args = [c[k] for k in ("q", "k_cache", "v_cache", "rows", "gather", "lo", "lens", "out")]
    scale = c["q"].shape[-1] ** -0.5
    best = {f: float("inf") for f in forms}
    for f in forms:  # warm-up
        paged_decode(*args, scale=scale, tiled=f)
    for _ in range(reps):
        for f in forms:
            t0 = time.perf_counter()
            for _ in range(iters):
                paged_decode(*args, scale=scale, tiled=f)
            best[f] = min(best[f], (time.perf_counter() - t0) / iters)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    a = ap.parse_args()
    common.setup_torch(a.threads)
    from lorastar.kernels import cpu_native

    if cpu_native.load() is None:
        sys.exit("the CPU ops did not build here (no g++/ninja): nothing to time")
    tiled = cpu_native.decode_tiled()
    forms = [True, False] if tiled else [False]
    shapes = QUICK if a.quick else FULL
    iters, reps = (2, 2) if a.quick else (a.iters, a.reps)
    results: list[dict[str, Any]] = []
    rows_md: list[list[Any]] = []
    for model, rows, ctx in shapes:
        hq, hkv, d = MODELS[model]
        c = case(rows, hq, hkv, d, ctx)
        best = time_forms(c, forms, iters, reps)
        gen_us = 1e6 * best[False]
        til_us = 1e6 * best[True] if tiled else float("nan")
        r = {"model": model, "heads": f"{hq}/{hkv}", "d": d, "rows": rows, "context": ctx}
        r |= {"per_key_us": gen_us, "tiled_us": til_us, "speedup": gen_us / til_us if tiled else None}
        r |= {"per_key_gbs": c["kv_bytes"] / best[False] / 1e9}
        r |= {"tiled_gbs": c["kv_bytes"] / best[True] / 1e9 if tiled else None}
        results.append(r)
        rows_md.append(
            [model, r["heads"], d, rows, ctx, gen_us, til_us, r["speedup"], r["per_key_gbs"], r["tiled_gbs"]]
        )
        print(rows_md[-1], flush=True)
    table = common.markdown_table(
        [
            "model",
            "q/kv heads",
            "head size",
            "rows",
            "context",
            "per-key form us",
            "tiled form us",
            "per-key / tiled",
            "per-key GB/s",
            "tiled GB/s",
        ],
        rows_md,
    )
    notes = [
        f"{a.threads} thread(s); fp32 cache in 16-token blocks, shuffled; best of {reps} alternating "
        f"rounds of {iters} calls.",
        "GB/s: the K/V bytes a call must read over its time (reads from L2/L3 for the small shapes, "
        "from memory for the large ones).",
    ]
    if not tiled:
        notes.append("This build has no tiled form (built without AVX-512): the per-key form alone.")
    md = common.write_results(
        "cpu_attention", a.out, [table], {"env": common.env_line(), "results": results}, notes=notes
    )
    print(md)
    if tiled:
        fig, (ax,) = common.new_figure(width=8.0)
        labels = [f"{r['model']}\n{r['rows']}x{r['context']}" for r in results]
        ax.bar(range(len(results)), [r["speedup"] for r in results])
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(range(len(results)))
        ax.set_xticklabels(labels, fontsize=6)
        ax.set_ylabel("per-key time / tiled time")
        common.save_figure(fig, a.out / "cpu_attention.png", "CPU paged decode: tiled vs per-key form")


if __name__ == "__main__":
    main()
