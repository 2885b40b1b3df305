"""Where a decode step's time goes, with and without adapters: kernel time per step by kernel.

gpu_throughput.py measures the LoRA tax (tokens/s with 16 adapters over without); this says
where it goes. Same model and workload on a GPU: a random 1.1B Llama (TinyLlama's shape) in bf16
with SmolLM2's tokenizer (--tokenizer), B requests of 128 prompt tokens decoding greedily, and
16 distinct rank-16 adapters on --targets. For the base model and the adapters (with --compact
twice: the LoRA expand on its plain grid, then its compact one; kernels/lora.py EXPAND_COMPACT_GRID),
the prompts are prefilled untimed, then torch.profiler records --steps decode steps of the
engine (CUDA graphs and async scheduling, its CUDA defaults). Printed per configuration: wall ms
per step, device-busy ms per step (the union of its kernels' intervals), the idle rest split into
gaps under GAP_US between kernels (the device's own launch latency, a graph replay's kernels
back to back) and longer ones (the device waiting for the host), the host's time inside the CUDA
runtime and driver calls, kernels per step; then kernel time per step by kernel name with each
adapter configuration's difference to the base, largest first.

With --model DIR --device cpu it profiles a local model on the CPU instead (torch ops by name,
no adapters unless --adapters), which is also how this script is tested without a GPU.

    python benchmarks/gpu_step_profile.py --tokenizer DIR [--out DIR] [--batch 64] [--steps 32]
        [--targets q_proj,k_proj,v_proj,o_proj] [--compact]

Writes gpu_step_profile.md and .json under --out.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

# A gap this short between two kernels is the device's own launch latency (kernels queued back to
# back: a graph replay's run ~1-2 us apart); a longer one is the device waiting for the host.
GAP_US = 10.0
NAME_WIDTH = 70  # kernel names are long (cuBLAS tile configurations): grouped by their first characters


def profile_decode(
    path: Path,
    prompts: list[list[int]],
    adapters: list[Path] | None,
    steps: int,
    device: str,
    compact: bool | None = None,
) -> dict[str, Any]:
    """Profile ``steps`` decode steps of ``prompts`` (each with its own adapter, round robin, when
    ``adapters``) after their prefill. Returns wall and busy ms per step and time per step by name."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    import lorastar.kernels.lora as lora_kernels
    from lorastar import LLM, SamplingParams

    saved = lora_kernels.EXPAND_COMPACT_GRID
    lora_kernels.EXPAND_COMPACT_GRID = saved if compact is None else compact
    try:
        kw: dict[str, Any] = (
            {"kv_cache_memory": 8 << 30} if device == "cuda" else {"num_kv_blocks": 64 + 16 * len(prompts)}
        )
        dtype = "bfloat16" if device == "cuda" else "float32"
        llm = LLM(str(path), device=device, dtype=dtype, max_num_seqs=max(256, len(prompts)), max_loras=16,
                  max_lora_rank=16, enable_prefix_caching=False, **kw)  # fmt: skip
        names: list[str | None] = [None] * len(prompts)
        if adapters:
            for i, a in enumerate(adapters):
                llm.load_adapter(f"a{i}", str(a))
            names = [f"a{i % len(adapters)}" for i in range(len(prompts))]
        eng = llm.engine
        # Warm-up: a short run of the same batch compiles the kernels and captures its graphs.
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), adapter=names)
        sp = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
        for p, a in zip(prompts, names):
            eng.add_request(p, sp, adapter=a)
        while any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.all_sequences()):
            eng.step()  # prefill, untimed
        for _ in range(2):
            eng.step()
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        sync()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profile(activities=activities) as prof:
            t = time.perf_counter()
            for _ in range(steps):
                eng.step()
            sync()
            wall = time.perf_counter() - t
        for rid in list(eng.requests):
            eng.abort_request(rid)
        del llm, eng
    finally:
        lora_kernels.EXPAND_COMPACT_GRID = saved
    if device == "cuda":
        torch.cuda.empty_cache()
    want = DeviceType.CUDA if device == "cuda" else DeviceType.CPU
    by_name: dict[str, float] = defaultdict(float)
    spans: list[tuple[float, float]] = []
    count = 0
    api_us = 0.0  # host time inside the CUDA runtime and driver (launches, graph replays, copies)
    for evt in prof.events():
        if device == "cuda" and evt.device_type == DeviceType.CPU and evt.name.startswith(("cuda", "cu")):
            api_us += evt.time_range.elapsed_us()
        if evt.device_type != want or (device != "cuda" and evt.cpu_parent is not None):
            continue  # CPU: top-level ops only (no double counting)
        us = evt.time_range.elapsed_us()
        by_name[evt.name[:NAME_WIDTH]] += us
        spans.append((evt.time_range.start, evt.time_range.end))
        count += 1
    short, long = _gaps(spans, GAP_US)
    return {
        "wall_ms": 1e3 * wall / steps,
        "busy_ms": _union(spans) / 1e3 / steps,
        "short_gap_ms": short / 1e3 / steps,
        "long_gap_ms": long / 1e3 / steps,
        "api_ms": api_us / 1e3 / steps,
        "ops_per_step": count / steps,
        "us_per_step": {k: v / steps for k, v in by_name.items()},
    }


def _union(spans: list[tuple[float, float]]) -> float:
    """Total length of the union of ``spans`` (overlapping kernels count once)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def _gaps(spans: list[tuple[float, float]], threshold: float) -> tuple[float, float]:
    """Idle time between the union's intervals: the gaps shorter than ``threshold`` (kernels
    queued back to back, inside a graph replay or not: launch latency on the device) and the
    longer ones (the device waited for the host), each summed."""
    short = long = 0.0
    end = None
    for s, e in sorted(spans):
        if end is not None and s > end:
            if s - end < threshold:
                short += s - end
            else:
                long += s - end
        end = e if end is None else max(end, e)
    return short, long


def table(results: dict[str, dict[str, Any]], top: int = 25) -> list[str]:
    """Markdown: the summary per configuration, then time per step by name with each
    configuration's difference to the first (the base), largest differences first."""
    cfgs = list(results)
    lines = [
        f"| configuration | wall ms/step | device-busy ms/step | busy / wall | idle in gaps < {GAP_US:.0f} us, ms/step | "
        "idle in longer gaps, ms/step | host in CUDA API ms/step | ops per step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in cfgs:
        r = results[c]
        lines.append(f"| {c} | {r['wall_ms']:.3f} | {r['busy_ms']:.3f} | {r['busy_ms'] / r['wall_ms']:.2f} | "
                     f"{r.get('short_gap_ms', float('nan')):.3f} | {r.get('long_gap_ms', float('nan')):.3f} | "
                     f"{r.get('api_ms', float('nan')):.3f} | {r['ops_per_step']:.0f} |")  # fmt: skip
    base = results[cfgs[0]]["us_per_step"]
    names = set().union(*(results[c]["us_per_step"] for c in cfgs))
    rest = cfgs[1:]

    def change(n: str) -> float:
        return max((abs(results[c]["us_per_step"].get(n, 0.0) - base.get(n, 0.0)) for c in rest), default=0.0)

    order = sorted(names, key=lambda n: (change(n), base.get(n, 0.0)), reverse=True)[:top]
    head = " | ".join(f"{c} us/step" for c in cfgs) + "".join(f" | {c} - {cfgs[0]}" for c in rest)
    lines += ["", f"| name | {head} |", "|---" * (1 + len(cfgs) + len(rest)) + "|"]
    for n in order:
        vals = [results[c]["us_per_step"].get(n, 0.0) for c in cfgs]
        diffs = [v - vals[0] for v in vals[1:]]
        lines.append(
            f"| `{n}` | "
            + " | ".join(f"{v:.1f}" for v in vals)
            + "".join(f" | {d:+.1f}" for d in diffs)
            + " |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, help="SmolLM2's tokenizer files (the GPU model is built here)")
    ap.add_argument("--model", type=Path, help="a local model folder instead of the random 1.1B Llama")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32, help="profiled decode steps")
    ap.add_argument("--adapters", type=int, default=16, help="distinct adapters (0: base only)")
    ap.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    ap.add_argument("--compact", action="store_true", help="also the adapters on the expand's compact grid")
    args = ap.parse_args()
    import gpu_throughput as gt

    root = Path(tempfile.mkdtemp())
    if args.model is not None:
        path = args.model
    elif args.tokenizer is not None:
        path = gt.build_model(root, args.tokenizer)
    else:
        ap.error("--tokenizer (to build the GPU model) or --model")
    targets = tuple(args.targets.split(","))
    adapters = gt.make_adapters(path, root, args.adapters, 16, targets) if args.adapters else []
    cfg = json.loads((path / "config.json").read_text())
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, cfg["vocab_size"], (args.batch, 128), generator=g).tolist()
    results = {"base": profile_decode(path, prompts, None, args.steps, args.device)}
    if adapters:
        results[f"{len(adapters)} adapters" + (", plain grid" if args.compact else "")] = profile_decode(
            path, prompts, adapters, args.steps, args.device, compact=False if args.compact else None
        )
        if args.compact:
            results["compact grid"] = profile_decode(
                path, prompts, adapters, args.steps, args.device, compact=True
            )
    dev = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    lines = ["# gpu_step_profile", "", f"{dev}: {path.name}, {args.batch} requests decoding, {args.steps} profiled "
             f"steps; adapters (rank 16) on {', '.join(targets)}", "", *table(results)]  # fmt: skip
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_step_profile.md").write_text(text + "\n")
    (args.out / "gpu_step_profile.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
