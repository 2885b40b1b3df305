"""GPU throughput: lorastar vs HF `generate` (static batch) on one random TinyLlama-shaped model.

The embedded SmolLM2 can't be converted on the GPU box (no gguf there), so this builds a random
1.1B Llama (TinyLlama's shape) in bf16 plus SmolLM2's tokenizer (--tokenizer folder) and runs
B requests of 128 prompt tokens + 64 new tokens (greedy, ignore_eos), measured side by side:
  lorastar base | the same with eager steps (no CUDA graphs) | lorastar with 16 distinct rank-16
  adapters (graphs, eager) | HF static batch (no padding needed) | PEFT's mixed-adapter batch
  (``generate(adapter_names=...)``) over the same adapters. Every run is warmed up on its batch.
Usage: python benchmarks/gpu_throughput.py --tokenizer DIR [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
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


def make_adapters(base: Path, root: Path, n: int, rank: int) -> list[Path]:
    from safetensors.torch import save_file

    cfg = json.loads((base / "config.json").read_text())
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    shapes = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}  # fmt: skip
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


def run_lorastar(
    path: Path, prompts: list[list[int]], adapters: list[Path] | None, eager: bool = False
) -> float:
    from lorastar import LLM, SamplingParams

    llm = LLM(str(path), device="cuda", dtype="bfloat16", max_num_seqs=256, max_loras=16, max_lora_rank=16,
              kv_cache_memory=8 << 30, enforce_eager=eager)  # fmt: skip
    names = None
    if adapters:
        for i, a in enumerate(adapters):
            llm.load_adapter(f"a{i}", str(a))
        names = [f"a{i % len(adapters)}" for i in range(len(prompts))]
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    # Warm-up on the same batch: compiles the kernels and captures this batch size's CUDA graphs.
    llm.generate(prompts, sp, adapter=names)
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, adapter=names)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    del llm
    torch.cuda.empty_cache()
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt


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
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp())
    path = build_model(root, args.tokenizer)
    adapters = make_adapters(path, root, 16, 16)
    g = torch.Generator().manual_seed(0)
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        prompts = torch.randint(3, 49152, (b, 128), generator=g).tolist()
        base = run_lorastar(path, prompts, None)
        eager = run_lorastar(path, prompts, None, eager=True)
        lora = run_lorastar(path, prompts, adapters[: min(16, b)])
        lora_eager = run_lorastar(path, prompts, adapters[: min(16, b)], eager=True)
        hf = run_hf(path, prompts)
        peft = run_peft_mixed(path, prompts, adapters[: min(16, b)])
        rows.append({"batch": b, "lorastar": base, "lorastar_eager": eager, "lorastar_16_lora": lora,
                     "lorastar_16_lora_eager": lora_eager, "hf_static": hf, "peft_mixed": peft})  # fmt: skip
        print(f"B={b}: lorastar {base:.0f} (eager {eager:.0f}) tok/s | +{min(16, b)} adapters {lora:.0f} "
              f"(eager {lora_eager:.0f}) tok/s | HF static {hf:.0f} | PEFT mixed {peft:.0f} tok/s", flush=True)  # fmt: skip
    lines = [f"GPU: {torch.cuda.get_device_name()}, random 1.1B Llama (TinyLlama shape), bf16, 128+64 tokens", "",
             "| requests | lorastar tok/s | eager steps | lorastar, 16 adapters (r=16) | eager steps | "
             "HF generate static batch | PEFT mixed batch, same adapters | lorastar / HF | "
             "CUDA graphs / eager | LoRA tax | lorastar / PEFT mixed (adapters) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['batch']} | {r['lorastar']:.0f} | {r['lorastar_eager']:.0f} | {r['lorastar_16_lora']:.0f} | "
                     f"{r['lorastar_16_lora_eager']:.0f} | {r['hf_static']:.0f} | {r['peft_mixed']:.0f} | "
                     f"{r['lorastar'] / r['hf_static']:.2f}x | {r['lorastar'] / r['lorastar_eager']:.2f}x | "
                     f"{r['lorastar_16_lora'] / r['lorastar']:.2f} | {r['lorastar_16_lora'] / r['peft_mixed']:.2f}x |")  # fmt: skip
    table = "\n".join(lines)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_throughput.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
