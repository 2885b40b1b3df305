#!/usr/bin/env python3
"""Make the quantized test fixtures with the real tools, and record transformers' logits for each.

    python3 scripts/make_quant_fixtures.py                 # everything (creates the venvs if missing)
    python3 scripts/make_quant_fixtures.py --only awq_g32,gptq_sym
    python3 scripts/make_quant_fixtures.py --only smollm2_gptq,smollm2_fp8,smollm2_w8a8   # benchmark inputs (cache)

The quantization tools conflict with lorastar's own environment (and with each other), so each runs
in its own throwaway venv under /tmp, with torch pinned to the local CPU wheel by a constraints file:
  awq   autoawq==0.2.9                     writes AutoAWQ GEMM checkpoints
  gptq  gptqmodel==7.6.0 + optimum          writes GPTQ checkpoints; lets transformers load AWQ and
                                            GPTQ on CPU (so every int4 reference logit comes from here)
  llmc  llmcompressor==0.14.0.1             writes compressed-tensors FP8 and int4/int8 weight-only
                                            (pack-quantized, RTN) checkpoints (pins transformers <= 5.17)
None of them is a runtime or test dependency of lorastar: the outputs are committed under
tests/fixtures/quant/<name>/ (config.json, model.safetensors, tokenizer, reference/reference.safetensors).

The base model is a tiny Llama (hidden 128, intermediate 256, 2 layers, vocab 384), seeded and
briefly trained on stdlib docstrings so its logits are not flat (a random model's greedy tokens
would all be near ties). reference/reference.safetensors holds ``input_ids`` [B, T] (prompt + transformers'
greedy continuation), ``prompt_len`` [B], ``seq_len`` [B], ``logits`` [B, T, V] fp32 from transformers
(CPU, fp32), and ``probe.<module>.x/.y``: one quantized linear's input and transformers' output.

Measured here (2 CPU cores, shared): base model ~2-9 min, AutoAWQ ~45 s/layer, gptqmodel ~1 min per
tiny checkpoint (its first run compiles a C++ packing extension), llm-compressor ~30 s. For SmolLM2,
gptqmodel estimated ~2 h on CPU (so benchmarks/quant.py falls back to RTN checkpoints in the same
layouts); FP8_DYNAMIC needs no calibration and takes ~1 min.
Kernel choices for the reference (transformers + gptqmodel on CPU): the default CPU GPTQ kernel
(torch_aten) runs activations in bf16, so ``backend="gptq_torch"`` is forced (dequantize in fp16 like
every GPTQ kernel, matmul in fp32). gptqmodel's only exact CPU AWQ kernel (torch_awq) computes fp32
inputs in fp16: its logits are kept as ``logits_native``, and ``logits`` is the same model with that
module's own fp16 dequantization matmul'd in fp32.

This script runs itself inside the venvs with ``--stage``; the top level only orchestrates.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "quant"
WORK = Path(os.environ.get("LORASTAR_QFIX_WORK", "/tmp/lorastar_qfix"))
VENVS = Path(os.environ.get("LORASTAR_QFIX_VENVS", "/tmp"))
TORCH_PIN = "torch==2.13.0"

VENV_PACKAGES = {
    "awq": ["autoawq==0.2.9", "accelerate", "safetensors"],
    "gptq": ["gptqmodel==7.6.0", "optimum", "accelerate", "safetensors"],
    "llmc": ["llmcompressor==0.14.0.1", "safetensors"],
}

# name -> (venv that quantizes, settings). Logits: AWQ/GPTQ in the gptq venv, compressed-tensors in llmc.
FIXTURES: dict[str, tuple[str, dict]] = {
    "awq_g32": ("awq", {"group_size": 32}),
    "awq_g128": ("awq", {"group_size": 128}),
    "gptq_sym": ("gptq", {"bits": 4, "group_size": 32, "sym": True, "desc_act": False}),
    "gptq_asym": ("gptq", {"bits": 4, "group_size": 64, "sym": False, "desc_act": False}),
    "gptq_act": ("gptq", {"bits": 4, "group_size": 32, "sym": True, "desc_act": True}),
    "gptq_8bit": ("gptq", {"bits": 8, "group_size": -1, "sym": True, "desc_act": False}),
    "fp8_tensor": ("llmc", {"scheme": "FP8"}),
    "fp8_channel": ("llmc", {"scheme": "FP8_DYNAMIC"}),
    "fp8_kv": ("llmc", {"scheme": "FP8_DYNAMIC", "kv_cache": True}),  # + static per-layer K/V scales
    # compressed-tensors pack-quantized int weights (RTN). The presets use group 128, one group on
    # this model's hidden 128: smaller groups, and channel scales for 8 bits, cover more layouts.
    "w4a16_g32": ("llmc", {"weights": {"num_bits": 4, "group_size": 32, "symmetric": True}}),
    "w4a16_asym": ("llmc", {"weights": {"num_bits": 4, "group_size": 64, "symmetric": False}}),
    "w8a16": ("llmc", {"weights": {"num_bits": 8, "strategy": "channel", "symmetric": True}}),
    # int8 weights per channel and int8 activations per token, dynamic (RedHatAI's "quantized.w8a8"
    # layout; llm-compressor's W8A8 preset, RTN without SmoothQuant: int-quantized format).
    "w8a8": ("llmc", {"scheme": "W8A8"}),
}
KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
# SmolLM2 checkpoints for benchmarks/quant.py: generated on demand into the cache, never committed
# (hidden 576 is not a multiple of 128: group size 64).
SMOLLM2: dict[str, tuple[str, dict]] = {
    "smollm2_awq": ("awq", {"group_size": 64}),
    "smollm2_gptq": ("gptq", {"bits": 4, "group_size": 64, "sym": True, "desc_act": False}),
    "smollm2_fp8": ("llmc", {"scheme": "FP8_DYNAMIC"}),
    "smollm2_w8a8": ("llmc", {"scheme": "W8A8"}),
}
CACHE = Path(os.environ.get("LORASTAR_CACHE", Path.home() / ".cache" / "lorastar"))
LOGITS_VENV = {"awq": "gptq", "gptq": "gptq", "llmc": "llmc"}


def paths(name: str) -> tuple[Path, Path]:
    """(base model folder, output folder) of a fixture or SmolLM2 target."""
    if name in SMOLLM2:
        return CACHE / "smollm2-135m-instruct", CACHE / "quant" / name
    return WORK / "base", WORK / name


PROMPTS = [
    "Return a new list containing all items from the iterable in ascending order.",
    "The string module contains a number of useful constants and classes.",
    "def join(a, *p):",
]
NEW_TOKENS = 8
PROBES = (
    "model.layers.0.self_attn.q_proj",
    "model.layers.1.self_attn.v_proj",
    "model.layers.0.mlp.down_proj",
)
KEEP_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


def venv_python(name: str) -> Path:
    return VENVS / f"qv_{name}" / "bin" / "python"


def ensure_venv(name: str) -> Path:
    py = venv_python(name)
    if py.exists():
        return py
    venv = py.parents[1]
    cons = WORK / "constraints.txt"
    WORK.mkdir(parents=True, exist_ok=True)
    cons.write_text(TORCH_PIN + "\n")  # else pip may pull a multi-GB CUDA torch
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(py), "-m", "pip", "install", "-q", "-c", str(cons)]
    subprocess.run([*pip, TORCH_PIN], check=True)
    subprocess.run([*pip, *VENV_PACKAGES[name]], check=True)
    return py


def run_stage(venv: str, stage: str, *args: str) -> None:
    env = dict(os.environ, GPTQMODEL_CPU_WORKERS="2", CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false")
    cmd = [str(ensure_venv(venv)), str(Path(__file__).resolve()), "--stage", stage, *args]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env)


# ---------------------------------------------------------------------------------------------
# Stages (run inside a venv)
# ---------------------------------------------------------------------------------------------


def corpus() -> list[str]:
    """Deterministic English-ish text: docstrings of a few stdlib modules (no downloads)."""
    import importlib
    import inspect

    texts = []
    for mod in ("textwrap", "difflib", "string", "functools", "collections", "json", "argparse", "shutil"):
        m = importlib.import_module(mod)
        for _, obj in sorted(vars(m).items()):
            doc = inspect.getdoc(obj) if callable(obj) else None
            if doc and len(doc) > 80:
                texts.append(" ".join(doc.split()))
    return texts


def stage_base() -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    base = WORK / "base"
    texts = corpus()
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=["<|bos|>", "<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|eos|>"
    )
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=384,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    model = LlamaForCausalLM(cfg).float()
    ids = torch.tensor([i for t in texts for i in [0, *hf_tok(t)["input_ids"]]], dtype=torch.long)
    seq, batch = 64, 16
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    model.train()
    for step in range(300):
        starts = torch.randint(0, ids.numel() - seq - 1, (batch,), generator=gen)
        x = torch.stack([ids[s : s + seq] for s in starts])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == 299:
            print(f"train step {step} loss {loss.item():.3f}", flush=True)
    model.eval()
    # fp16 on disk like real checkpoints (AutoAWQ and GPTQ keep fp16 scales).
    model.to(torch.float16).save_pretrained(base, safe_serialization=True)
    hf_tok.save_pretrained(base)
    (WORK / "calib.json").write_text(json.dumps(texts))


def stage_awq(name: str, settings: dict) -> None:
    from awq import AutoAWQForCausalLM
    from transformers import AutoTokenizer

    base, out = paths(name)
    model = AutoAWQForCausalLM.from_pretrained(str(base))
    tok = AutoTokenizer.from_pretrained(str(base))
    texts = corpus()
    qc = {"zero_point": True, "q_group_size": settings["group_size"], "w_bit": 4, "version": "GEMM"}
    model.quantize(
        tok,
        quant_config=qc,
        calib_data=texts,
        max_calib_samples=64,
        max_calib_seq_len=128,
        n_parallel_calib_samples=8,
    )
    model.save_quantized(str(out))
    tok.save_pretrained(str(out))


def stage_gptq(name: str, settings: dict) -> None:
    from gptqmodel import GPTQModel, QuantizeConfig
    from transformers import AutoTokenizer

    base, out = paths(name)
    tok = AutoTokenizer.from_pretrained(str(base))
    texts = corpus()[:128]
    extra = {"act_group_aware": False} if settings["group_size"] == -1 else {}  # GAR needs groups
    qc = QuantizeConfig(
        bits=settings["bits"],
        group_size=settings["group_size"],
        sym=settings["sym"],
        desc_act=settings["desc_act"],
        **extra,
    )
    model = GPTQModel.load(str(base), qc)
    model.quantize(texts, batch_size=4, tokenizer=tok)
    model.save(str(out))
    tok.save_pretrained(str(out))


def stage_fp8(name: str, settings: dict) -> None:
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base, out = paths(name)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float16)
    tok = AutoTokenizer.from_pretrained(str(base))
    texts = corpus()[:64]
    enc = [tok(t, truncation=True, max_length=128) for t in texts]
    ds = Dataset.from_dict(
        {"input_ids": [e["input_ids"] for e in enc], "attention_mask": [e["attention_mask"] for e in enc]}
    )
    kv = {"kv_cache_scheme": KV_SCHEME} if settings.get("kv_cache") else {}
    if "weights" in settings:  # int weight-only: an explicit scheme (the presets fix group 128)
        weights = {"type": "int", "dynamic": False, "strategy": "group", **settings["weights"]}
        groups = {"group_0": {"targets": ["Linear"], "weights": weights}}
        recipe = QuantizationModifier(config_groups=groups, ignore=["lm_head"], **kv)
    else:
        recipe = QuantizationModifier(targets="Linear", scheme=settings["scheme"], ignore=["lm_head"], **kv)
    oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length=128, num_calibration_samples=len(texts))
    model.save_pretrained(str(out), save_compressed=True)
    tok.save_pretrained(str(out))


BACKENDS = {"gptq": "gptq_torch", "awq": "torch_awq"}
_SEQS: list = []


def tok_ids(src: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src))
    return [[0, *tok(p)["input_ids"]] for p in PROMPTS]


def _sequence_logits(model, prompts: list[list[int]]):  # noqa: ANN001, ANN202
    """Greedy-continue each prompt (first call only: later calls reuse the same sequences, so
    every logits tensor in one fixture covers identical tokens); fp32 logits of whole sequences."""
    import torch

    with torch.no_grad():
        if not _SEQS:
            for p in prompts:
                ids = torch.tensor([p])
                out = model.generate(
                    ids, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS
                )
                _SEQS.append((out[0, : ids.shape[1] + NEW_TOKENS], ids.shape[1]))
        t = max(s.numel() for s, _ in _SEQS)
        input_ids = torch.full((len(_SEQS), t), 1, dtype=torch.long)
        logits = torch.zeros(len(_SEQS), t, model.config.vocab_size)
        for i, (s, _) in enumerate(_SEQS):
            input_ids[i, : s.numel()] = s
            logits[i, : s.numel()] = model(s[None]).logits[0].float()
    return (input_ids, [p for _, p in _SEQS], [s.numel() for s, _ in _SEQS]), logits


def _patch_awq_fp32(model) -> None:  # noqa: ANN001
    from gptqmodel.nn_modules.qlinear.torch_awq import AwqTorchLinear
    from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm

    def forward(self, x):  # noqa: ANN001, ANN202
        # The module's own dequantization (fp16 product, like every AWQ kernel), fp32 matmul.
        w = dequantize_gemm(
            qweight=self.qweight,
            qzeros=self.qzeros,
            scales=self.scales,
            bits=self.bits,
            group_size=self.group_size,
        ).float()
        out = x.float() @ w
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype)

    n = 0
    for m in model.modules():
        if isinstance(m, AwqTorchLinear):
            m.forward = forward.__get__(m)
            n += 1
    assert n, "no AwqTorchLinear modules to patch"


def stage_logits(name: str) -> None:
    """transformers' own view of the quantized checkpoint: greedy continuation + fp32 logits."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    src = WORK / name
    config = AutoConfig.from_pretrained(str(src))
    qc = getattr(config, "quantization_config", None) or {}
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method in BACKENDS:
        # gptqmodel's default CPU kernels compute in bf16 (torch_aten); pick the plain torch ones.
        qc["backend"] = BACKENDS[method]
    model = AutoModelForCausalLM.from_pretrained(
        str(src), config=config, dtype=torch.float32, device_map="cpu"
    )
    model.eval()
    kernels = sorted({type(m).__name__ for m in model.modules() if "Linear" in type(m).__name__})
    print(f"{name}: transformers linear modules: {kernels}", flush=True)
    extra = {}
    if method == "awq":
        # gptqmodel's AwqTorchLinear (the only exact CPU AWQ kernel) computes fp32 inputs in fp16.
        # Record those logits as transformers gives them ("logits_native"), then the same model with
        # that module's own dequantization matmul'd in fp32 ("logits"): the fp32 oracle.
        extra["logits_native"] = _sequence_logits(model, tok_ids(src))[1]
        _patch_awq_fp32(model)
    (input_ids, plens, seq_lens), logits = _sequence_logits(model, tok_ids(src))
    # Per-layer probes: transformers' own output of single quantized linears on a fixed input (an
    # oracle for one QuantMethod without the rest of the model).
    probes = {}
    gen = torch.Generator().manual_seed(0)
    mods = dict(model.named_modules())
    with torch.no_grad():
        for pname in PROBES:
            mod = mods[pname]
            in_features = mod.in_features if hasattr(mod, "in_features") else mod.infeatures
            x = torch.randn(4, in_features, generator=gen) * 0.5
            probes[f"probe.{pname}.x"] = x
            probes[f"probe.{pname}.y"] = mod(x[None])[0].float().contiguous()
    dst = OUT / name
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {
        "input_ids": input_ids,
        "prompt_len": torch.tensor(plens),
        "seq_len": torch.tensor(seq_lens),
        "logits": logits.contiguous(),
        **extra,
        **probes,
    }
    # In a subfolder: model loaders read every *.safetensors at the top of a model folder.
    (dst / "reference").mkdir(exist_ok=True)
    save_file(tensors, str(dst / "reference" / "reference.safetensors"))
    for f in KEEP_FILES:
        if (src / f).exists():
            shutil.copy(src / f, dst / f)
    print(f"{name}: wrote {dst} ({sum(f.stat().st_size for f in dst.iterdir()) / 1e6:.2f} MB)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated fixture names (default: all)")
    ap.add_argument("--stage", default="", help=argparse.SUPPRESS)
    ap.add_argument("--name", default="", help=argparse.SUPPRESS)
    ap.add_argument("--skip-base", action="store_true", help="reuse the base model in the work dir")
    args = ap.parse_args()
    if args.stage == "base":
        return stage_base()
    if args.stage == "logits":
        return stage_logits(args.name)
    if args.stage:
        venv, settings = {**FIXTURES, **SMOLLM2}[args.name]
        return {"awq": stage_awq, "gptq": stage_gptq, "llmc": stage_fp8}[venv](args.name, settings)

    names = [n for n in args.only.split(",") if n] or list(FIXTURES)
    targets = {**FIXTURES, **SMOLLM2}
    for n in names:
        if n not in targets:
            raise SystemExit(f"unknown target {n!r} (known: {', '.join(targets)})")
    if any(n in SMOLLM2 for n in names) and not (CACHE / "smollm2-135m-instruct" / "config.json").exists():
        raise SystemExit(
            "SmolLM2 is not in the cache yet: run `python -c 'import lorastar; lorastar.LLM()'` once"
        )
    needs_base = any(n in FIXTURES for n in names)
    if needs_base and (not args.skip_base or not (WORK / "base" / "config.json").exists()):
        # Any venv has what the base needs: spare building the gptq one for llm-compressor fixtures.
        run_stage("llmc" if all(targets[n][0] == "llmc" for n in names) else "gptq", "base")
    failed = []
    for n in names:
        venv = targets[n][0]
        try:
            shutil.rmtree(paths(n)[1], ignore_errors=True)
            run_stage(venv, "quant", "--name", n)
            if n in FIXTURES:  # SmolLM2 targets are benchmark inputs: no reference logits
                run_stage(LOGITS_VENV[venv], "logits", "--name", n)
        except subprocess.CalledProcessError as e:
            print(f"FAILED {n}: {e}", flush=True)
            failed.append(n)
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
