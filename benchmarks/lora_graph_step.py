"""LoRA's share of a decode step inside a CUDA graph, per kernel configuration (needs a GPU).

Captures every LoRA linear of a TinyLlama-shaped model (22 layers x qkv, o, gate_up, down: 88
linears, 16 adapter slots at rank 16) in one CUDA graph, as the engine's decode graphs hold them,
and times its replay: the LoRA time a decode step pays, launch gaps included, which a per-kernel
``do_bench`` (benchmarks/kernels.py) leaves out. Variants: the fp32 intermediate zeroed by a
separate memset (the engine before session 31) or by the shrink only when it splits ``H``; ``split``
(``None``: picked from the grid; 1: no split, no atomics); the shrink's K step and the expand's
column tile. Each variant's output is checked against the first one's.

A second table puts the base GEMMs in the graph too and compares three forms of a step's 88
linears: the base GEMMs alone; base GEMM + shrink + expand (the engine's kernels and tiles); and
the shrink stacked into the base GEMM (every slot's A rows under the weight, ``x @ [W; A].T`` in
one cuBLAS call) with one expand launch reading each row's own slot's columns (``slot_cols``),
that expand on its plain grid and on its compact one (``EXPAND_COMPACT_GRID``). The LoRA's cost
per step is each form's time minus the base GEMMs'.

    python benchmarks/lora_graph_step.py [--out benchmarks/results] [--engine-tiles-only]

Writes ``lora_graph_step.md`` and ``lora_graph_step.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lorastar.forward_context import lora_ranges, slot_runs  # noqa: E402
from lorastar.kernels.lora import lora_expand, lora_shrink  # noqa: E402

SLOTS, RANK = 16, 16
SHAPES = [(2048, [2048, 256, 256]), (2048, [2048]), (2048, [5632, 5632]), (5632, [2048])]  # (H, slice widths)
# (memset, split, shrink block_k, expand block_n); the first is the engine before session 31.
VARIANTS = [(True, None, 64, 64), (False, 1, 64, 64), (False, 1, 128, 64), (False, 1, 256, 64),
            (False, None, 128, 64), (False, None, 256, 64), (False, 1, 128, 128), (False, None, 128, 128)]  # fmt: skip


def make_layers(dev: str) -> list[tuple]:
    torch.manual_seed(0)
    layers = []
    for _ in range(22):
        for h, widths in SHAPES:
            p = len(widths)
            bounds = torch.tensor([0, *itertools.accumulate(widths)], dtype=torch.int32, device=dev)
            a = torch.randn(SLOTS, p * RANK, h, device=dev, dtype=torch.bfloat16) * 0.02
            b = torch.randn(SLOTS, sum(widths), RANK, device=dev, dtype=torch.bfloat16) * 0.02
            ranks = torch.full((SLOTS, p), RANK, dtype=torch.int32, device=dev)
            layers.append((h, widths, bounds, a, b, ranks))
    return layers


def step(layers: list[tuple], xs: dict, ys: dict, runs: torch.Tensor, n: int, variant: tuple) -> None:
    zero, split, bk, bn = variant
    for h, widths, bounds, a, b, ranks in layers:
        x, y = xs[h][:n], ys[sum(widths)][:n]
        buf = (torch.zeros if zero else torch.empty)(n, a.shape[1], dtype=torch.float32, device=x.device)
        lora_shrink(x, a, buf, runs, ranks, max_rows=n, split_k=split, block_k=bk)
        lora_expand(buf, b, y, runs, ranks, bounds, max_rows=n, max_width=max(widths), block_n=bn)


ENGINE = (False, None, 128, 128)  # the engine's configuration (kernels/lora.py's defaults)
# base GEMMs alone; + shrink + expand; shrink stacked in the GEMM + expand, on the plain grid and
# on the compact one (kernels/lora.py EXPAND_COMPACT_GRID)
FORMS = ("base", "separate", "stacked", "stacked-compact")


def make_weights(layers: list[tuple]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per linear: the base weight ``W [N, H]`` and ``[W; A] [N + S * P * R, H]`` (every slot's A
    rows stacked under it)."""
    out = []
    for h, widths, _, a, _, _ in layers:
        w = torch.randn(sum(widths), h, device=a.device, dtype=a.dtype) * 0.02
        out.append((w, torch.cat([w, a.reshape(-1, h)])))
    return out


def step_with_base(
    layers: list[tuple], weights: list, xs: dict, outs: dict, runs: torch.Tensor, n: int, form: str
) -> None:
    for (h, widths, bounds, a, b, ranks), (w, stacked) in zip(layers, weights, strict=True):
        x, width = xs[h][:n], sum(widths)
        if form.startswith("stacked"):
            z = outs[(h, width, "stacked")][:n]  # [n, N + S * P * R]
            torch.mm(x, stacked.t(), out=z)
            lora_expand(z[:, width:], b, z[:, :width], runs, ranks, bounds, max_rows=n,
                        max_width=max(widths), slot_cols=a.shape[1], widths=widths,
                        compact=form == "stacked-compact")  # fmt: skip
            continue
        y = outs[(h, width, "plain")][:n]
        torch.mm(x, w.t(), out=y)
        if form == "separate":
            buf = torch.empty(n, a.shape[1], dtype=torch.float32, device=x.device)
            lora_shrink(x, a, buf, runs, ranks, max_rows=n)
            lora_expand(buf, b, y, runs, ranks, bounds, max_rows=n, max_width=max(widths))


def time_graph(fn: Callable[[], None]) -> float:
    """Microseconds per replay of ``fn`` captured in one CUDA graph."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(20):
        graph.replay()
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1) / 20 * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument(
        "--engine-tiles-only", action="store_true", help="first table: the engine's configuration only"
    )
    args = ap.parse_args()
    dev = "cuda"
    layers = make_layers(dev)
    weights = make_weights(layers)
    variants = [ENGINE] if args.engine_tiles_only else VARIANTS
    rows, base_rows = [], []
    for n, slots in [(1, 1), (16, 16), (64, 16)]:
        token_slots = (torch.arange(n) % slots).sort().values
        runs = slot_runs(lora_ranges([(int(s), 1) for s in token_slots]), SLOTS, dev)
        xs = {h: torch.randn(n, h, device=dev, dtype=torch.bfloat16) for h in (2048, 5632)}
        ys = {w: torch.zeros(n, w, device=dev, dtype=torch.bfloat16) for w in (2048 + 512, 2048, 11264)}
        ref = None
        for variant in variants:
            for y in ys.values():
                y.zero_()
            step(layers, xs, ys, runs, n, variant)
            out = torch.cat([y.float().flatten() for y in ys.values()])
            ref = out if ref is None else ref
            err = ((out - ref).abs().max() / ref.abs().max()).item()
            us = time_graph(partial(step, layers, xs, ys, runs, n, variant))
            rows.append({"rows": n, "adapters": slots, "memset": variant[0], "split": variant[1],
                         "block_k": variant[2], "block_n": variant[3], "us": us, "rel_err": err})  # fmt: skip
            print(rows[-1], flush=True)
        outs = {}
        for h, widths, *_ in layers:
            width = sum(widths)
            outs[(h, width, "plain")] = torch.zeros(n, width, device=dev, dtype=torch.bfloat16)
            outs[(h, width, "stacked")] = torch.zeros(n, width + SLOTS * len(widths) * RANK, device=dev, dtype=torch.bfloat16)  # fmt: skip
        got = {}
        for form in FORMS:
            step_with_base(layers, weights, xs, outs, runs, n, form)
            got[form] = torch.cat([o[:, :w].float().flatten() for (_, w, kind), o in outs.items() if kind == ("stacked" if form.startswith("stacked") else "plain")])  # fmt: skip
            us = time_graph(partial(step_with_base, layers, weights, xs, outs, runs, n, form))
            base_rows.append({"rows": n, "adapters": slots, "form": form, "us": us})
        for r in base_rows[-len(FORMS) :]:
            r["lora_us"] = r["us"] - base_rows[-len(FORMS)]["us"]
            if r["form"].startswith("stacked"):  # of the LoRA delta, against the separate shrink's
                delta = (got["separate"] - got["base"]).abs().max()
                r["rel_err"] = ((got[r["form"]] - got["separate"]).abs().max() / delta).item()
        print(base_rows[-len(FORMS) :], flush=True)
    lines = [f"{torch.cuda.get_device_name()}: LoRA of 88 linears (TinyLlama shape, {SLOTS} slots, rank {RANK}) "
             "in one CUDA graph, per replay", "",
             "| rows | adapters | memset | split | shrink block_k | expand block_n | us per step | rel. error |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['rows']} | {r['adapters']} | {r['memset']} | {r['split']} | {r['block_k']} | {r['block_n']} | "
              f"{r['us']:.0f} | {r['rel_err']:.1e} |" for r in rows]  # fmt: skip
    lines += ["", f"With the base GEMMs in the graph ({SLOTS} slots of rank {RANK}; LoRA us = form - base GEMMs)", "",
              "| rows | adapters | form | us per step | LoRA us per step | LoRA rel. diff vs separate |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['rows']} | {r['adapters']} | {r['form']} | {r['us']:.0f} | {r['lora_us']:.0f} | "
              f"{r['rel_err']:.1e} |" if "rel_err" in r else
              f"| {r['rows']} | {r['adapters']} | {r['form']} | {r['us']:.0f} | {r['lora_us']:.0f} | |" for r in base_rows]  # fmt: skip
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lora_graph_step.md").write_text("\n".join(lines) + "\n")
    plot(rows, variants, args.out / "lora_graph_step.png")


def plot(rows: list[dict], variants: list[tuple], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["rows"] for r in rows})
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(variants)
    for i, v in enumerate(variants):
        us = [next(r["us"] for r in rows if r["rows"] == n and (r["memset"], r["split"], r["block_k"], r["block_n"]) == v)
              for n in sizes]  # fmt: skip
        label = f"{'memset, ' if v[0] else ''}split={v[1]}, k={v[2]}, n={v[3]}"
        ax.bar([j + i * width for j in range(len(sizes))], us, width, label=label)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sizes))], [f"{n} rows" for n in sizes])
    ax.set_ylabel("us per decode step (88 LoRA linears)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
