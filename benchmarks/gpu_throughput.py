"""GPU throughput: lorastar vs HF `generate` (static batch) on one random TinyLlama-shaped model.

The embedded SmolLM2 can't be converted on the GPU box (no gguf there), so this builds a random
1.1B Llama (TinyLlama's shape) in bf16 plus SmolLM2's tokenizer (--tokenizer folder) and runs
B requests of 128 prompt tokens + 64 new tokens (greedy, ignore_eos; the median of --timed-runs
runs after two warm-ups), measured side by side:
  lorastar base | the same with eager steps (no CUDA graphs) | lorastar with 16 distinct rank-16
  adapters (graphs, eager) | HF static batch (no padding needed) | PEFT's mixed-adapter batch
  (``generate(adapter_names=...)``) over the same adapters. Every run is warmed up on its batch.
lorastar runs with its CUDA default, async scheduling; --sync adds one-step-at-a-time columns.
The single-request figure is set against the weight-read roof: one decode step must read every
weight but the embedding table once, so tokens/s cannot exceed (device copy bandwidth, measured
here as bytes read + written by a large device-to-device copy) / (those weights' bytes). The
LoRA tax (tokens/s with adapters over without) is set against its own roof, the same bytes
argument with the adapters' weights added (``lora_tax_roof``).
Usage: python benchmarks/gpu_throughput.py --tokenizer DIR [--out DIR] [--batches 1,16,64] [--no-peft] [--sync]
       [--unstacked] [--compact] [--regex] [--targets q_proj,k_proj,v_proj,o_proj] [--timed-runs 3]
       [--interleave ROUNDS]
Writes gpu_throughput.md, .json and .png under --out.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch


def build_model(root: Path, tokenizer: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                      num_key_value_heads=4, vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    path = root / "tinyllama-random"
    model.save_pretrained(path)
    for f in tokenizer.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, path / f.name)
    del model
    torch.cuda.empty_cache()
    return path


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 2 GiB device-to-device copy (median of 10)."""
    src = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (2 << 30) / sorted(times[2:])[len(times[2:]) // 2]


def step_weight_bytes(path: Path) -> int:
    """Bytes of every weight a decode step reads: all but the embedding table (rows only)."""
    return _tensor_bytes(path, lambda name: "embed_tokens" not in name)


def _tensor_bytes(path: Path, keep: Callable[[str], bool]) -> int:
    """bf16 bytes of the tensors of ``path``'s safetensors whose names ``keep`` accepts."""
    from safetensors import safe_open

    total = 0
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                if keep(k):
                    total += math.prod(st.get_slice(k).get_shape()) * 2
    return total


def step_kv_bytes(path: Path, requests: int, ctx: int) -> int:
    """bf16 bytes of K and V a decode step reads for ``requests`` sequences of ``ctx`` tokens."""
    cfg = json.loads((path / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * 2 * requests * ctx


def lora_tax_roof(base_bytes: int, adapter: Path, active: int, slots: int, stacked: bool) -> float:
    """The LoRA tax a memory-bound decode step cannot beat: bytes the base step reads (weights and
    KV, ``base_bytes``) over those plus the adapters' (bf16, as served). Each active adapter's B is
    read; A of every one of ``slots`` slots when it sits stacked under the base weights (the GEMM
    reads all its rows, layers/lora.py), else the active adapters' A only."""
    a = _tensor_bytes(adapter, lambda name: "lora_A" in name)
    b = _tensor_bytes(adapter, lambda name: "lora_B" in name)
    lora = (slots if stacked else active) * a + active * b
    return base_bytes / (base_bytes + lora)


ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapters(
    base: Path, root: Path, n: int, rank: int, targets: tuple[str, ...] = ALL_TARGETS
) -> list[Path]:
    from safetensors.torch import save_file

    cfg = json.loads((base / "config.json").read_text())
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    shapes = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}  # fmt: skip
    shapes = {k: v for k, v in shapes.items() if k in targets}
    out = []
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        tensors = {}
        for layer in range(layers):
            for mod, (fin, fout) in shapes.items():
                blk = "self_attn" if mod.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
                key = f"base_model.model.model.layers.{layer}.{blk}.{mod}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fin, generator=g) * 0.01
                tensors[f"{key}.lora_B.weight"] = torch.randn(fout, rank, generator=g) * 0.01
        d = root / f"adapter{i}"
        d.mkdir()
        save_file(tensors, str(d / "adapter_model.safetensors"))
        (d / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(shapes),
            "bias": "none", "task_type": "CAUSAL_LM"}))  # fmt: skip
        out.append(d)
    return out


TIMED_RUNS = 3  # --timed-runs


def run_lorastar(
    path: Path,
    prompts: list[list[int]],
    adapters: list[Path] | None,
    eager: bool = False,
    asyn: bool | None = None,
    regex_rows: int = 0,
) -> float:
    """Generated tokens/s of ``prompts`` (128 + 64 tokens, greedy); ``regex_rows``: that many of
    the requests under ``guided_regex`` (their sampling reads the output on the host)."""
    from lorastar import LLM, SamplingParams

    # async_scheduling only when asked: an older checkout run side by side may not know the flag
    kw = {} if asyn is None else {"async_scheduling": asyn}
    llm = LLM(str(path), device="cuda", dtype="bfloat16", max_num_seqs=256, max_loras=16, max_lora_rank=16,
              kv_cache_memory=8 << 30, enforce_eager=eager, **kw)  # fmt: skip
    names = None
    if adapters:
        for i, a in enumerate(adapters):
            llm.load_adapter(f"a{i}", str(a))
        names = [f"a{i % len(adapters)}" for i in range(len(prompts))]
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    if regex_rows:  # unbounded, so a random model writes its 64 tokens as the plain rows do
        guided = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, guided_regex="[a-z ]+")
        sp = [guided] * regex_rows + [sp] * (len(prompts) - regex_rows)  # type: ignore[assignment]
    # Two warm-ups on the same batch: the first compiles the kernels, captures this batch size's
    # CUDA graphs and fills the prefix cache; the second takes the timed run's path, every prompt
    # block cached, whose kernels may be specializations the first did not compile (Triton JIT in
    # the timed window would read as a slow configuration).
    # Then TIMED_RUNS timed runs, their median taken: one run of 64 requests lasts ~0.2 s on an
    # H200, and single runs of one configuration drifted by up to a third within a lease.
    times = []
    for _ in range(2 + TIMED_RUNS):
        torch.cuda.synchronize()
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, adapter=names)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    dt = statistics.median(times[2:])
    print(f"  {len(prompts)} requests, {len(adapters or ())} adapters: warm-ups {times[0]:.3f} s, {times[1]:.3f} s; "
          f"timed {', '.join(f'{x:.3f}' for x in times[2:])} s (median {dt:.3f})", flush=True)  # fmt: skip
    del llm
    torch.cuda.empty_cache()
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt


def run_interleaved(
    path: Path, prompts: list[list[int]], adapters: list[Path], rounds: int
) -> dict[str, float]:
    """The LoRA tax measured inside one engine: with the adapters loaded, the batch runs without
    adapters and then with them (request ``i`` on adapter ``i % len(adapters)``), alternately,
    ``rounds`` times after two warm-ups of each. Separate engines, one per configuration, differ by
    more than the adapters cost at 64 requests (H200, 2026-11-29: three base engines' medians of five
    runs were 0.162-0.191 s at 64 requests), so the ratio of two engines' figures
    could not resolve the tax. A step without adapters replays the graph captured without them and
    reads none of their buffers (the stacked linears' weights are views of the same memory).
    Returns the medians' tokens/s and the median of the rounds' ratios."""
    from lorastar import LLM, SamplingParams

    llm = LLM(str(path), device="cuda", dtype="bfloat16", max_num_seqs=256, max_loras=16, max_lora_rank=16,
              kv_cache_memory=8 << 30)  # fmt: skip
    for i, a in enumerate(adapters):
        llm.load_adapter(f"a{i}", str(a))
    names = [f"a{i % len(adapters)}" for i in range(len(prompts))]
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)

    def once(llm: LLM, adapter: list[str] | None) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate(prompts, sp, adapter=adapter)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    for _ in range(2):
        once(llm, None), once(llm, names)
    base, lora = [], []
    for _ in range(rounds):
        base.append(once(llm, None))
        lora.append(once(llm, names))
    print(f"  {len(prompts)} requests, interleaved in one engine: base {', '.join(f'{x:.3f}' for x in base)} s; "
          f"{len(adapters)} adapters {', '.join(f'{x:.3f}' for x in lora)} s", flush=True)  # fmt: skip
    del llm
    torch.cuda.empty_cache()
    tokens = len(prompts) * 64
    return {"base": tokens / statistics.median(base), "lora": tokens / statistics.median(lora),
            "tax": statistics.median(b / x for b, x in zip(base, lora))}  # fmt: skip


def run_hf(path: Path, prompts: list[list[int]]) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor(prompts, device="cuda")
    kw = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0)
    model.generate(ids, attention_mask=torch.ones_like(ids), **kw)  # warm-up on the same batch
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    del model
    torch.cuda.empty_cache()
    return (out.shape[1] - ids.shape[1]) * ids.shape[0] / dt


def run_peft_mixed(path: Path, prompts: list[list[int]], adapters: list[Path]) -> float:
    """PEFT's mixed-adapter batch: one ``generate(adapter_names=...)`` over all requests."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    model = PeftModel.from_pretrained(base, str(adapters[0]), adapter_name="a0")
    for i, a in enumerate(adapters[1:], start=1):
        model.load_adapter(str(a), adapter_name=f"a{i}")
    model.eval()
    names = [f"a{i % len(adapters)}" for i in range(len(prompts))]
    ids = torch.tensor(prompts, device="cuda")
    kw = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), adapter_names=names, **kw
        )  # warm-up
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), adapter_names=names, **kw)
        torch.cuda.synchronize()
    dt = time.perf_counter() - t
    del model, base
    torch.cuda.empty_cache()
    return (out.shape[1] - ids.shape[1]) * ids.shape[0] / dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--no-peft", action="store_true", help="skip PEFT's mixed batch (the slowest column)")
    ap.add_argument(
        "--sync", action="store_true", help="also run with async_scheduling=False (two more columns)"
    )
    ap.add_argument(
        "--targets", default=",".join(ALL_TARGETS), help="the adapters' target modules (default: all seven)"
    )
    ap.add_argument(
        "--unstacked", action="store_true",
        help="also run the adapters with the shrink outside the base GEMM (layers/lora.py STACKED_MAX_BYTES = 0)",
    )  # fmt: skip
    ap.add_argument(
        "--regex", action="store_true",
        help="also run the base model with one request of each batch under guided_regex (its rows read the output "
             "on the host; before 195867c they held the whole batch to one step at a time)",
    )  # fmt: skip
    ap.add_argument(
        "--compact", action="store_true",
        help="also run the adapters with the expand on each grid, plain then compact (kernels/lora.py "
             "EXPAND_COMPACT_GRID), after the run on the default one",
    )  # fmt: skip
    ap.add_argument(
        "--interleave", type=int, default=0, metavar="ROUNDS",
        help="also measure the LoRA tax inside one engine: the batch without and with the adapters, "
             "alternately, ROUNDS times (run_interleaved)",
    )  # fmt: skip
    ap.add_argument(
        "--timed-runs", type=int, default=3, help="timed runs per lorastar configuration (median)"
    )
    args = ap.parse_args()
    global TIMED_RUNS
    TIMED_RUNS = args.timed_runs
    root = Path(tempfile.mkdtemp())
    bw = copy_bandwidth()
    path = build_model(root, args.tokenizer)
    weight_bytes = step_weight_bytes(path)
    roof = bw / weight_bytes
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s, {weight_bytes / 1e9:.2f} GB of weights per step: "
          f"single-request roof {roof:.0f} tok/s", flush=True)  # fmt: skip
    targets = tuple(args.targets.split(","))
    if not set(targets) <= set(ALL_TARGETS):
        ap.error(f"--targets: each of {', '.join(ALL_TARGETS)}")
    adapters = make_adapters(path, root, 16, 16, targets)
    g = torch.Generator().manual_seed(0)
    # The first engine of a process ran at a quarter of later ones' speed on one request (H200:
    # 115 vs 430 tok/s, whichever configuration came first), its own warm-up generate
    # notwithstanding: one throwaway run keeps that out of the table. The first engine with adapters
    # may pay the same (H100, adapters on q/k/v/o, batches 64,1: 16 adapters at 64 requests kept
    # 0.34 of the base tokens/s when first, the separate-shrink run after them 0.85, and one request
    # afterwards 0.97; order not yet swapped on a lease): a throwaway run with adapters as well.
    warm = torch.randint(3, 49152, (1, 128), generator=torch.Generator().manual_seed(1)).tolist()
    run_lorastar(path, warm, None)
    run_lorastar(path, warm, adapters[:1])
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        prompts = torch.randint(3, 49152, (b, 128), generator=g).tolist()
        base = run_lorastar(path, prompts, None)
        eager = run_lorastar(path, prompts, None, eager=True)
        lora = run_lorastar(path, prompts, adapters[: min(16, b)])
        lora_eager = run_lorastar(path, prompts, adapters[: min(16, b)], eager=True)
        hf = run_hf(path, prompts)
        peft = float("nan") if args.no_peft else run_peft_mixed(path, prompts, adapters[: min(16, b)])
        # Mean context over the decode: the prompt plus half the new tokens.
        base_bytes = weight_bytes + step_kv_bytes(path, b, 128 + 64 // 2)
        roof_kw = dict(adapter=adapters[0], active=min(16, b), slots=16)
        rows.append({"batch": b, "lorastar": base, "lorastar_eager": eager, "lorastar_16_lora": lora,
                     "lorastar_16_lora_eager": lora_eager, "hf_static": hf, "peft_mixed": peft,
                     "lora_roof": lora_tax_roof(base_bytes, stacked=True, **roof_kw),
                     "lora_roof_unstacked": lora_tax_roof(base_bytes, stacked=False, **roof_kw)})  # fmt: skip
        if args.unstacked:
            import lorastar.layers.lora as lora_layers

            saved, lora_layers.STACKED_MAX_BYTES = lora_layers.STACKED_MAX_BYTES, 0
            rows[-1]["lorastar_16_lora_unstacked"] = run_lorastar(path, prompts, adapters[: min(16, b)])
            lora_layers.STACKED_MAX_BYTES = saved
            print(f"B={b}: +{min(16, b)} adapters, shrink outside the base GEMM: "
                  f"{rows[-1]['lorastar_16_lora_unstacked']:.0f} tok/s (LoRA tax "
                  f"{rows[-1]['lorastar_16_lora_unstacked'] / base:.2f}; stacked {lora / base:.2f})", flush=True)  # fmt: skip
        if args.regex:
            regex = run_lorastar(path, prompts, None, regex_rows=1)
            rows[-1]["lorastar_one_regex"] = regex
            print(
                f"B={b}: one request under guided_regex: {regex:.0f} tok/s ({regex / base:.2f} of all plain)",
                flush=True,
            )
        if args.compact:
            import lorastar.kernels.lora as lora_kernels

            saved, grids = lora_kernels.EXPAND_COMPACT_GRID, {}
            for name, on in (("plain", False), ("compact", True)):
                lora_kernels.EXPAND_COMPACT_GRID = on
                grids[name] = run_lorastar(path, prompts, adapters[: min(16, b)])
            lora_kernels.EXPAND_COMPACT_GRID = saved
            rows[-1].update(lorastar_16_lora_plain=grids["plain"], lorastar_16_lora_compact=grids["compact"])
            print(f"B={b}: +{min(16, b)} adapters, expand on the plain grid {grids['plain']:.0f}, compact grid "
                  f"{grids['compact']:.0f} tok/s (LoRA tax {grids['compact'] / base:.2f}; default grid "
                  f"{lora:.0f})", flush=True)  # fmt: skip
        if args.interleave:
            il = run_interleaved(path, prompts, adapters[: min(16, b)], args.interleave)
            rows[-1].update(
                interleaved_base=il["base"], interleaved_lora=il["lora"], interleaved_tax=il["tax"]
            )
            print(f"B={b}: interleaved in one engine: base {il['base']:.0f}, +{min(16, b)} adapters {il['lora']:.0f} "
                  f"tok/s (LoRA tax {il['tax']:.2f}, median of {args.interleave} rounds)", flush=True)  # fmt: skip
        if args.sync:
            sync = run_lorastar(path, prompts, None, asyn=False)
            lora_sync = run_lorastar(path, prompts, adapters[: min(16, b)], asyn=False)
            rows[-1].update(lorastar_sync=sync, lorastar_16_lora_sync=lora_sync)
            print(f"B={b} one step at a time: {sync:.0f} tok/s (async {base / sync:.2f}x), +{min(16, b)} adapters "
                  f"{lora_sync:.0f} tok/s (async {lora / lora_sync:.2f}x; LoRA tax {lora_sync / sync:.2f})", flush=True)  # fmt: skip
        print(f"B={b}: lorastar {base:.0f} (eager {eager:.0f}) tok/s | +{min(16, b)} adapters {lora:.0f} "
              f"(eager {lora_eager:.0f}) tok/s | HF static {hf:.0f} | PEFT mixed {peft:.0f} tok/s", flush=True)  # fmt: skip
    single = next((r["lorastar"] for r in rows if r["batch"] == 1), float("nan"))
    lines = [f"GPU: {torch.cuda.get_device_name()}, random 1.1B Llama (TinyLlama shape), bf16, 128+64 tokens; "
             f"torch {torch.__version__}; adapters (rank 16) on {', '.join(targets)}", "",
             f"Weight-read roof for one request: {bw / 1e9:.0f} GB/s copy bandwidth / {weight_bytes / 1e9:.2f} GB "
             f"read per step = {roof:.0f} tok/s; lorastar's single request reaches {single:.0f} tok/s "
             f"({single / roof:.2f} of the roof).", "",
             "| requests | lorastar tok/s | eager steps | lorastar, 16 adapters (r=16) | eager steps | "
             "HF generate static batch | PEFT mixed batch, same adapters | lorastar / HF | "
             "CUDA graphs / eager | LoRA tax | LoRA tax roof | tax / roof | lorastar / PEFT mixed (adapters) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        tax = r["lorastar_16_lora"] / r["lorastar"]
        lines.append(f"| {r['batch']} | {r['lorastar']:.0f} | {r['lorastar_eager']:.0f} | {r['lorastar_16_lora']:.0f} | "
                     f"{r['lorastar_16_lora_eager']:.0f} | {r['hf_static']:.0f} | {r['peft_mixed']:.0f} | "
                     f"{r['lorastar'] / r['hf_static']:.2f}x | {r['lorastar'] / r['lorastar_eager']:.2f}x | "
                     f"{tax:.2f} | {r['lora_roof']:.3f} | {tax / r['lora_roof']:.2f} | "
                     f"{r['lorastar_16_lora'] / r['peft_mixed']:.2f}x |")  # fmt: skip
    lines += ["", "LoRA tax roof: what a step bound by reading memory keeps with the adapters, base bytes "
              "(weights but the embedding table, and KV at the mean context) over those plus the adapters' "
              "(every active adapter's B, and A of all 16 slots: stacked under the base weights, the GEMM "
              "reads them all)."]  # fmt: skip
    if args.sync:
        lines += ["", "One step at a time (`async_scheduling=False`; the columns above use the CUDA default, "
                  "async scheduling), same run:", "",
                  "| requests | sync tok/s | async / sync | sync, 16 adapters | async / sync | LoRA tax (sync) |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for r in rows:
            lines.append(f"| {r['batch']} | {r['lorastar_sync']:.0f} | {r['lorastar'] / r['lorastar_sync']:.2f}x | "
                         f"{r['lorastar_16_lora_sync']:.0f} | {r['lorastar_16_lora'] / r['lorastar_16_lora_sync']:.2f}x "
                         f"| {r['lorastar_16_lora_sync'] / r['lorastar_sync']:.2f} |")  # fmt: skip
    if args.unstacked:
        lines += ["", "The shrink outside the base GEMM (`STACKED_MAX_BYTES = 0`: one shrink and one expand "
                  "launch per linear, as before the stacked layout), same run:", "",
                  "| requests | 16 adapters, stacked tok/s | LoRA tax | roof | shrink separate tok/s | LoRA tax | "
                  "roof (active A only) | stacked / separate |",
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in rows:
            u = r["lorastar_16_lora_unstacked"]
            lines.append(f"| {r['batch']} | {r['lorastar_16_lora']:.0f} | {r['lorastar_16_lora'] / r['lorastar']:.2f} | "
                         f"{r['lora_roof']:.3f} | {u:.0f} | {u / r['lorastar']:.2f} | {r['lora_roof_unstacked']:.3f} | "
                         f"{r['lorastar_16_lora'] / u:.2f}x |")  # fmt: skip
    if args.interleave:
        lines += ["", f"The LoRA tax inside one engine (`--interleave {args.interleave}`: with the adapters loaded, "
                  "the batch without and with them alternately; medians), same run:", "",
                  "| requests | base tok/s | 16 adapters tok/s | LoRA tax (median of the rounds' ratios) | roof | "
                  "tax / roof |", "|---|---|---|---|---|---|"]  # fmt: skip
        lines += [f"| {r['batch']} | {r['interleaved_base']:.0f} | {r['interleaved_lora']:.0f} | "
                  f"{r['interleaved_tax']:.2f} | {r['lora_roof']:.3f} | {r['interleaved_tax'] / r['lora_roof']:.2f} |"
                  for r in rows]  # fmt: skip
    if args.regex:
        lines += ["", "One request of each batch under `guided_regex` (its grammar mask is filled on the host; "
                  "the step before completes between the forward and sampling), same run:", "",
                  "| requests | all plain tok/s | one under a regex tok/s | ratio |", "|---|---|---|---|"]  # fmt: skip
        lines += [f"| {r['batch']} | {r['lorastar']:.0f} | {r['lorastar_one_regex']:.0f} | "
                  f"{r['lorastar_one_regex'] / r['lorastar']:.2f} |" for r in rows]  # fmt: skip
    if args.compact:
        lines += ["", "The expand on each grid (`EXPAND_COMPACT_GRID`; compact: only the row tiles that can hold "
                  f"rows and the column tiles that hold columns), after the run on the default "
                  f"({'compact' if lora_kernels.EXPAND_COMPACT_GRID else 'plain'}), same run:", "",
                  "| requests | base tok/s | 16 adapters, default grid | plain grid | compact grid | "
                  "LoRA tax (plain) | LoRA tax (compact) | compact / plain |",
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in rows:
            p, c = r["lorastar_16_lora_plain"], r["lorastar_16_lora_compact"]
            lines.append(f"| {r['batch']} | {r['lorastar']:.0f} | {r['lorastar_16_lora']:.0f} | {p:.0f} | {c:.0f} | "
                         f"{p / r['lorastar']:.2f} | {c / r['lorastar']:.2f} | {c / p:.2f}x |")  # fmt: skip
    table = "\n".join(lines)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_throughput.md").write_text(table + "\n")
    meta = {"device": torch.cuda.get_device_name(), "copy_bandwidth": bw, "step_weight_bytes": weight_bytes}
    (args.out / "gpu_throughput.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    _plot(rows, roof, args.out / "gpu_throughput.png")


def _plot(rows: list[dict], roof: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = [("lorastar", "lorastar"), ("lorastar_eager", "eager steps"), ("lorastar_16_lora", "16 adapters"),
            ("lorastar_16_lora_eager", "16 adapters, eager"), ("hf_static", "HF static batch"),
            ("peft_mixed", "PEFT mixed batch")]  # fmt: skip
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = range(len(rows))
    width = 0.8 / len(cols)
    for i, (key, label) in enumerate(cols):
        ax.bar([j + i * width for j in x], [r[key] for r in rows], width, label=label)
    ax.axhline(roof, color="k", ls="--", lw=1, label="1-request weight-read roof")
    ax.set_xticks([j + 0.4 - width / 2 for j in x], [f"{r['batch']} requests" for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("generated tokens/s")
    ax.set_title(f"{torch.cuda.get_device_name()}: random 1.1B Llama, bf16, 128+64 tokens")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
