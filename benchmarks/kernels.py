"""Kernel benchmarks on a CUDA GPU: decode/prefill paged attention and the punica-style LoRA
shrink/expand (one launch each per fused linear, eager and CUDA-graph grids).

Reports achieved bandwidth (the fewest bytes each op must move: every input read once, every
output written once) against the device's measured copy bandwidth (bytes read + written by a
large device-to-device copy). Times are medians of ``triton.testing.do_bench`` (it flushes L2
between repetitions, so small working sets are not served from cache).

    python benchmarks/kernels.py [--out benchmarks/results] [--quick]

Prints a table and writes ``kernels.md``, ``kernels.json`` and ``kernels.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton.testing  # noqa: E402

# The one copy-bandwidth measurement (gpu_throughput.py has no sys.path side effects to import).
from gpu_throughput import copy_bandwidth  # noqa: E402

from lorastar.forward_context import lora_ranges, slot_runs  # noqa: E402
from lorastar.kernels.lora import lora_expand, lora_shrink  # noqa: E402
from lorastar.kernels.paged_attention import paged_attention  # noqa: E402

DTYPE = torch.bfloat16


def bench_eager(fn: Callable[[], object]) -> float:
    """Median milliseconds of one eager call (launch overhead included when it exceeds the flush)."""
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


_FLUSH: torch.Tensor | None = None


def bench(fn: Callable[[], object], n: int = 20) -> float:
    """Median milliseconds of the GPU work alone: ``n`` calls replayed from one CUDA graph (as the
    engine runs decode steps), each after an L2 flush; the flushes' own time is subtracted."""
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    flush = _FLUSH
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compiles) outside the capture
        fn()
        flush.zero_()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graphs = []
    for with_fn in (True, False):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(n):
                flush.zero_()
                if with_fn:
                    fn()
        graphs.append(g)
    meds = []
    for g in graphs:
        times = []
        for _ in range(7):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / n)
        meds.append(sorted(times)[len(times) // 2])
    return max(meds[0] - meds[1], 1e-4)


def _paged_setup(
    batch: int, ctx: int, q_len: int, hq: int, hkv: int, d: int, bs: int, cache_dtype: torch.dtype
) -> dict:
    blocks_per_seq = (ctx + bs - 1) // bs
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(num_blocks, bs, hkv, d, device="cuda", dtype=DTYPE).to(cache_dtype)
    v_cache = torch.randn(num_blocks, bs, hkv, d, device="cuda", dtype=DTYPE).to(cache_dtype)
    # Shuffled blocks: a real cache after churn is not contiguous per sequence.
    perm = torch.randperm(num_blocks, device="cuda").to(torch.int32)
    block_tables = perm.view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    qsl = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * q_len
    q = torch.randn(batch * q_len, hq, d, device="cuda", dtype=DTYPE)
    return {
        "args": (q, k_cache, v_cache, block_tables, seq_lens, qsl),
        "kw": {"scale": d**-0.5, "max_query_len": q_len, "max_seq_len": ctx},
    }


def bench_decode_attention(copy_bw: float, quick: bool) -> list[dict]:
    rows = []
    hq, hkv, d, bs = 32, 8, 128, 16  # Llama-3-8B shapes
    batches = [1, 8, 32, 64] if not quick else [1, 64]
    ctxs = [512, 2048, 8192] if not quick else [2048]
    for cache_dtype in (DTYPE, torch.float8_e4m3fn):
        for batch in batches:
            for ctx in ctxs:
                if batch * ctx > 64 * 8192:
                    continue
                s = _paged_setup(batch, ctx, 1, hq, hkv, d, bs, cache_dtype)
                kw = s["kw"]
                if cache_dtype != DTYPE:
                    kw = {**kw, "k_scale": 1.0, "v_scale": 1.0}
                fn = lambda s=s, kw=kw: paged_attention(*s["args"], **kw)  # noqa: E731
                ms = bench(fn)
                eager_ms = bench_eager(fn)
                kv_bytes = 2 * batch * ctx * hkv * d * torch.empty((), dtype=cache_dtype).element_size()
                qo_bytes = 2 * batch * hq * d * 2
                gbs = (kv_bytes + qo_bytes) / ms / 1e6
                rows.append(
                    {
                        "op": "decode_attn",
                        "kv": str(cache_dtype).replace("torch.", ""),
                        "batch": batch,
                        "ctx": ctx,
                        "us": ms * 1e3,
                        "GB/s": gbs,
                        "%copy": 100 * gbs / copy_bw,
                        "eager_us": eager_ms * 1e3,
                    }
                )
                del s
    return rows


def bench_prefill_attention(quick: bool) -> list[dict]:
    rows = []
    hq, hkv, d, bs = 32, 8, 128, 16
    for batch, q_len in [(1, 2048), (4, 1024)] if not quick else [(4, 1024)]:
        s = _paged_setup(batch, q_len, q_len, hq, hkv, d, bs, DTYPE)
        ms = bench(lambda s=s: paged_attention(*s["args"], **s["kw"]))
        flops = batch * hq * d * 2 * 2 * (q_len * (q_len + 1) / 2)  # causal QK^T and PV
        rows.append(
            {
                "op": "prefill_attn",
                "batch": batch,
                "q_len": q_len,
                "us": ms * 1e3,
                "TFLOP/s": flops / ms / 1e9,
            }
        )
    return rows


WIDTHS = [4096, 1024, 1024]  # q/k/v of a 4096-wide GQA model: one fused linear, three slices


def _lora_case(tokens: int, rank: int, num_adapters: int, hidden: int) -> dict:
    """A fused q/k/v linear in the GPU slot layout (8 slots), ``tokens`` rows spread evenly over
    ``num_adapters`` slots, sorted by slot as the runner orders them."""
    slots, p = 8, len(WIDTHS)
    bounds = [sum(WIDTHS[:i]) for i in range(p + 1)]
    token_slots = sorted(t % num_adapters for t in range(tokens))
    ranges = lora_ranges([(s, 1) for s in token_slots])
    return {
        "x": torch.randn(tokens, hidden, device="cuda", dtype=DTYPE),
        "y": torch.randn(tokens, bounds[-1], device="cuda", dtype=DTYPE),
        "buf": torch.zeros(tokens, p * rank, device="cuda", dtype=torch.float32),
        "a": torch.randn(slots, p * rank, hidden, device="cuda", dtype=DTYPE) * 0.02,
        "b": torch.randn(slots, bounds[-1], rank, device="cuda", dtype=DTYPE) * 0.02,
        "ranks": torch.full((slots, p), rank, dtype=torch.int32, device="cuda"),
        "bounds": torch.tensor(bounds, dtype=torch.int32, device="cuda"),
        "runs": slot_runs(ranges, slots, "cuda"),
        "max_rows": max(e - s for _, s, e in ranges),
    }


def _shrink(c: dict, rows: int) -> None:
    c["buf"].zero_()  # split-K atomics: the memset counts in the shrink's time
    lora_shrink(c["x"], c["a"], c["buf"], c["runs"], c["ranks"], max_rows=rows)


def _expand(c: dict, rows: int, **kw: int) -> None:
    lora_expand(
        c["buf"], c["b"], c["y"], c["runs"], c["ranks"], c["bounds"],
        max_rows=rows, max_width=max(WIDTHS), **kw,
    )  # fmt: skip


def bench_lora(copy_bw: float, quick: bool) -> list[dict]:
    """One shrink and one expand launch per fused q/k/v linear; ``grid`` = fitted (eager: the
    longest run known on the host) or ``graph`` (a CUDA graph's grid over the whole batch)."""
    rows = []
    hidden, n = 4096, sum(WIDTHS)
    cases = [(t, r, min(t, 4)) for r in (16, 64) for t in ([1, 8, 16, 32, 64] if not quick else [1, 64])]
    cases += [(64, 64, 8), (64, 16, 8)]  # decode, every slot busy
    cases += [(t, r, 4) for r in (16, 64) for t in ([256, 2048] if not quick else [2048])]  # prefill
    for tokens, rank, num_adapters in cases:
        c = _lora_case(tokens, rank, num_adapters, hidden)
        grids = {"fitted": c["max_rows"], "graph": tokens} if tokens <= 256 else {"fitted": c["max_rows"]}
        for grid, max_rows in grids.items():
            ms_s = bench(lambda c=c, m=max_rows: _shrink(c, m))
            ms_e = bench(lambda c=c, m=max_rows: _expand(c, m))
            eager_s = bench_eager(lambda c=c, m=max_rows: _shrink(c, m))
            p = len(WIDTHS)
            shrink_bytes = num_adapters * p * rank * hidden * 2 + tokens * hidden * 2 + tokens * p * rank * 4
            expand_bytes = num_adapters * n * rank * 2 + tokens * p * rank * 4 + 2 * tokens * n * 2
            for op, ms, nbytes in (("shrink", ms_s, shrink_bytes), ("expand", ms_e, expand_bytes)):
                gbs = nbytes / ms / 1e6
                rows.append(
                    {
                        "op": f"{op}_{grid}",
                        "tokens": tokens,
                        "rank": rank,
                        "adapters": num_adapters,
                        "us": ms * 1e3,
                        "GB/s": gbs,
                        "%copy": 100 * gbs / copy_bw,
                        "eager_us": (eager_s if op == "shrink" else float("nan")) * 1e3,
                    }
                )
    return rows


def sweep_lora_expand(copy_bw: float) -> list[dict]:
    """Tile sweep of the expand at prefill size (2048 tokens, 4 rank-64 adapters), checked vs torch."""
    rows = []
    c = _lora_case(2048, 64, 4, 4096)
    c["buf"].normal_()
    y0 = c["y"].clone()
    ref = y0.float()
    bounds = c["bounds"].tolist()
    runs = c["runs"].tolist()
    for s in range(4):
        rs = slice(runs[0][s], runs[0][s] + runs[1][s])
        for i in range(len(WIDTHS)):
            cols = slice(bounds[i], bounds[i + 1])
            ref[rs, cols] += c["buf"][rs, i * 64 : (i + 1) * 64] @ c["b"][s, cols].float().t()
    n = sum(WIDTHS)
    nbytes = 4 * n * 64 * 2 + 2048 * 3 * 64 * 4 + 2 * 2048 * n * 2
    for bm in (16, 32, 64):
        for br in (16, 32, 64):

            def fn(c: dict = c, bm: int = bm, br: int = br) -> None:
                _expand(c, c["max_rows"], block_m=bm, block_r=br)

            c["y"].copy_(y0)
            fn()
            err = ((c["y"].float() - ref).norm() / ref.norm()).item()
            ms = bench(fn)
            rows.append(
                {"op": "lora_expand", "block_m": bm, "block_r": br, "us": ms * 1e3,
                 "%copy": 100 * nbytes / ms / 1e6 / copy_bw, "rel_err": err}
            )  # fmt: skip
    return rows


def _table(rows: list[dict]) -> str:
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        cells = [f"{r[k]:.1f}" if isinstance(r.get(k), float) else str(r.get(k, "")) for k in keys]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _plot(decode: list[dict], lora: list[dict], copy_bw: float, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG")
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    ax = axes[0]
    for kv in sorted({r["kv"] for r in decode}):
        for ctx in sorted({r["ctx"] for r in decode}):
            pts = [r for r in decode if r["kv"] == kv and r["ctx"] == ctx]
            if pts:
                ax.plot(
                    [p["batch"] for p in pts], [p["GB/s"] for p in pts], marker="o", label=f"{kv} ctx {ctx}"
                )
    ax.axhline(copy_bw, color="gray", ls="--", label="copy bandwidth")
    ax.set(
        xscale="log",
        xlabel="batch (sequences)",
        ylabel="GB/s",
        title="decode paged attention (32q/8kv x 128)",
    )
    ax.legend(fontsize=7)
    ax = axes[1]
    for op in sorted({r["op"] for r in lora}):
        for rank in sorted({r["rank"] for r in lora}):
            pts = [r for r in lora if r["op"] == op and r["rank"] == rank]
            if pts:
                ax.plot(
                    [p["tokens"] for p in pts], [p["GB/s"] for p in pts], marker="o", label=f"{op} r{rank}"
                )
    ax.axhline(copy_bw, color="gray", ls="--", label="copy bandwidth")
    ax.set(
        xscale="log",
        xlabel="tokens",
        ylabel="GB/s",
        title="LoRA shrink/expand, fused q/k/v (hidden 4096, bf16)",
    )
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    out = Path(args.out)
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    name = torch.cuda.get_device_name()
    copy_bw = copy_bandwidth() / 1e9  # GB/s
    decode = bench_decode_attention(copy_bw, args.quick)
    prefill = bench_prefill_attention(args.quick)
    lora = bench_lora(copy_bw, args.quick)
    sweep = sweep_lora_expand(copy_bw)
    header = (
        f"{name}, torch {torch.__version__}, triton {triton.__version__}; copy bandwidth {copy_bw:.0f} GB/s"
    )
    text = "\n\n".join([header, _table(decode), _table(prefill), _table(lora), _table(sweep)])
    print(text)
    (out / "kernels.md").write_text(text + "\n")
    (out / "kernels.json").write_text(
        json.dumps(
            {
                "device": name,
                "copy_GBps": copy_bw,
                "decode": decode,
                "prefill": prefill,
                "lora": lora,
                "sweep": sweep,
            },
            indent=1,
        )
    )
    _plot(decode, lora, copy_bw, out / "kernels.png")


if __name__ == "__main__":
    main()
