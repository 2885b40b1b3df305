"""Evaluate the base model and every demo adapter with lm-evaluation-harness: through one lorastar
server (concurrent ``local-completions`` runs) against lm-eval's ``hf`` backend run adapter by
adapter at its best batch size. Same tasks, same machine, same run.

Tasks: the three small local tasks of ``tests/plugin/lm_eval_support.py`` (multiple choice,
perplexity, generate_until) plus ``--extra`` synthetic documents so the sweep is big enough to time.

- lorastar: ``lorastar serve`` (a subprocess, the embedded SmolLM2 with the demo adapters), then one
  ``lm_eval --model local-completions`` subprocess per model, all at once (``num_concurrent`` each).
  Its wall time includes the server's start.
- hf: ``lm_eval --model hf`` per model, one after another (``peft=`` for adapters), each at the
  batch size that was fastest on the base model among ``--hf-batch-sizes`` (that search is not
  counted). Its wall time includes each run's model load, as a user running them pays it.

Scores must be equal (accuracy and exact match; perplexities within 1e-4 relative).

    .venv/bin/python benchmarks/eval_sweep.py            # full run
    .venv/bin/python benchmarks/eval_sweep.py --quick    # smoke run

Writes ``eval_sweep.md`` / ``.json`` / ``.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "plugin"))

from common import REPO, RESULTS, env_line, markdown_table, new_figure, save_figure, write_results  # noqa: E402
from lm_eval_support import TASKS, write_tasks  # noqa: E402

ADAPTERS = ("uppercase", "pirate", "json")
METRICS = (
    "lorastar_mc/acc,none",
    "lorastar_mc/acc_norm,none",
    "lorastar_gen/exact_match,none",
    "lorastar_rolling/word_perplexity,none",
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--extra", type=int, default=96, help="synthetic documents added to the tasks")
    p.add_argument("--num-concurrent", type=int, default=8, help="requests in flight per lm-eval run")
    p.add_argument("--hf-batch-sizes", type=str, default="8,16,32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    p.add_argument("--out", type=Path, default=RESULTS)
    a = p.parse_args()
    if a.quick:
        a.extra, a.hf_batch_sizes = 0, "8"
    return a


def lm_eval_cmd(model: str, model_args: dict[str, Any], tasks: Path, out: Path, **kw: Any) -> list[str]:
    args = ",".join(f"{k}={v}" for k, v in model_args.items())
    cmd = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", args, "--tasks", ",".join(TASKS),
           "--include_path", str(tasks), "--output_path", str(out)]  # fmt: skip
    for k, v in kw.items():
        cmd += [f"--{k}", str(v)]
    return cmd


def read_scores(out: Path) -> dict[str, float]:
    files = sorted(out.rglob("results_*.json"))
    if not files:
        raise RuntimeError(f"lm-eval wrote no results under {out}")
    res = json.loads(files[-1].read_text())["results"]
    return {m: float(res[m.split("/")[0]][m.split("/")[1]]) for m in METRICS}


def run_all(cmds: dict[str, list[str]], env: dict[str, str], parallel: bool) -> float:
    """Run the commands (all at once or one by one); wall seconds."""
    t0 = time.perf_counter()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    for name, cmd in cmds.items():
        procs[name] = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if not parallel:
            _wait(name, procs[name])
    if parallel:
        for name, p in procs.items():
            _wait(name, p)
    return time.perf_counter() - t0


def _wait(name: str, p: subprocess.Popen[bytes]) -> None:
    _, err = p.communicate()
    if p.returncode != 0:
        raise RuntimeError(f"lm-eval for {name} failed:\n{err.decode()[-3000:]}")


def start_server(model_dir: str, port: int, env: dict[str, str]) -> subprocess.Popen[bytes]:
    import httpx

    cmd = [str(Path(sys.executable).with_name("lorastar")), "serve", model_dir, "--port", str(port),
           "--served-model-name", "smollm2", "--dtype", "float32", "--max-model-len", "1024",
           "--max-loras", str(len(ADAPTERS)), "--kv-cache-memory", str(4 << 30)]  # fmt: skip
    for name in ADAPTERS:
        cmd += ["--adapter", f"{name}={REPO / 'examples' / 'adapters' / name}"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError("lorastar serve exited during start-up")
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("lorastar serve did not become healthy in 300 s")


def main() -> None:
    a = parse_args()
    from lorastar.models.default import default_model_dir

    model_dir = str(default_model_dir())
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": str(a.threads)}  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="eval_sweep_"))
    tasks = write_tasks(work / "tasks", extra=a.extra)
    models = ["base", *ADAPTERS]

    # hf: pick the batch size on the base model (not counted), then every model one by one.
    best_bs, best_t = 0, float("inf")
    for bs in [int(x) for x in a.hf_batch_sizes.split(",")]:
        t = run_all({"base": lm_eval_cmd("hf", {"pretrained": model_dir, "dtype": "float32"}, tasks,
                                         work / f"probe{bs}", batch_size=bs, device="cpu")}, env, False)  # fmt: skip
        print(f"hf batch size {bs}: {t:.1f} s", flush=True)
        if t < best_t:
            best_bs, best_t = bs, t
    hf_cmds = {}
    for m in models:
        args: dict[str, Any] = {"pretrained": model_dir, "dtype": "float32"}
        if m != "base":
            args["peft"] = REPO / "examples" / "adapters" / m
        hf_cmds[m] = lm_eval_cmd("hf", args, tasks, work / f"hf_{m}", batch_size=best_bs, device="cpu")
    hf_wall = run_all(hf_cmds, env, parallel=False)
    print(f"hf sweep: {hf_wall:.1f} s", flush=True)

    t0 = time.perf_counter()
    server = start_server(model_dir, a.port, env)
    startup = time.perf_counter() - t0
    try:
        ls_cmds = {
            m: lm_eval_cmd(
                "local-completions",
                {
                    "base_url": f"http://127.0.0.1:{a.port}/v1/completions",
                    "model": "smollm2" if m == "base" else m,
                    "tokenizer_backend": "huggingface",
                    "tokenizer": model_dir,
                    "num_concurrent": a.num_concurrent,
                    "max_retries": 1,
                },  # fmt: skip
                tasks,
                work / f"ls_{m}",
            )
            for m in models
        }
        ls_runs = run_all(ls_cmds, env, parallel=True)
    finally:
        server.terminate()
        server.wait(30)
    ls_wall = startup + ls_runs
    print(f"lorastar sweep: {ls_wall:.1f} s (start-up {startup:.1f} s)", flush=True)

    rows, equal = [], True
    for m in models:
        ours, theirs = read_scores(work / f"ls_{m}"), read_scores(work / f"hf_{m}")
        same = all(
            abs(ours[k] - theirs[k]) <= 1e-4 * max(1.0, abs(theirs[k]))
            if "perplexity" in k
            else ours[k] == theirs[k]
            for k in METRICS
        )
        equal &= same
        rows.append([m, *(ours[k] for k in METRICS), *(theirs[k] for k in METRICS), "yes" if same else "NO"])
    n_docs = {"mc": 8 + a.extra, "rolling": 4 + a.extra // 4, "gen": 6 + a.extra // 2}
    timing = markdown_table(
        ["system", "wall s", "vs hf"],
        [
            [f"hf backend, adapter by adapter (batch size {best_bs})", hf_wall, 1.0],
            [
                f"lorastar, {len(models)} concurrent lm-eval runs (incl. {startup:.1f} s start-up)",
                ls_wall,
                hf_wall / ls_wall,
            ],
        ],  # fmt: skip
    )
    short = ["acc", "acc_norm", "exact_match", "word_ppl"]
    score_table = markdown_table(
        ["model", *(f"lorastar {s}" for s in short), *(f"hf {s}" for s in short), "equal"], rows
    )
    print(timing + "\n\n" + score_table)
    env_desc = env_line(f"{a.threads} threads")
    write_results(
        "eval_sweep",
        a.out,
        [f"Tasks: {n_docs} documents; models: base + {', '.join(ADAPTERS)}.", timing, score_table],
        {
            "env": env_desc,
            "hf_wall": hf_wall,
            "lorastar_wall": ls_wall,
            "startup": startup,
            "hf_batch_size": best_bs,
            "speedup": hf_wall / ls_wall,
            "scores_equal": equal,
            "rows": rows,
        },  # fmt: skip
    )
    fig, (ax,) = new_figure(width=6.0, height=3.2)
    ax.barh(
        ["hf backend\n(one by one)", "lorastar\n(concurrent)"], [hf_wall, ls_wall], color=["#999", "#c33"]
    )
    ax.set_xlabel("wall seconds (lower is better)")
    save_figure(fig, a.out / "eval_sweep.png", f"lm-eval sweep, base + {len(ADAPTERS)} adapters: {env_desc}")
    if not equal:
        raise SystemExit("scores differ between lorastar and the hf backend")


if __name__ == "__main__":
    main()
