"""Host time per engine step, by part, on a model that costs almost nothing (issue #12's table).

A 1-layer random Llama with hidden size 32 and SmolLM2's tokenizer (real detokenization), N
sequences decoding at once; each step is timed whole and by part: schedule, prepare (input
tensors), forward (model + logits), sample, output (the core's token appends and deltas; before
the output processor existed, also detokenization and stop strings), frontend (the output
processor: detokenize, stop strings, RequestOutputs; in a frontend process when the core has its
own) and update (scheduler bookkeeping). Per-part times come from wrapping the engine's own methods,
so they cost the same in any checkout that has those methods. 'ipc' is the msgpack encoding of the
step's core outputs, which an engine process pays to send them (measured apart: the step in this
process does not encode). 'core ms' is what an engine process's loop pays per step besides the
model: host less the frontend (which runs in the server process then), plus ipc; for checkouts
before the engine process (one loop for everything) it is the host time.

``--other PATH`` runs the same measurement on a second checkout (``git worktree add /tmp/base
<rev>``) in alternation with this one, each size in a fresh process, and prints both side by
side with the ratio: run-to-run drift on this shared CPU is 10-30%, a ratio within one run is not.
``--rounds R`` repeats each pair R times (alternating) and reports each part's median over the
rounds, with the range of the per-round core ratios: one pair's ratio at 256 sequences moved
between 4.2x and 6.0x across three back-to-back runs of the same two checkouts.

    .venv/bin/python benchmarks/host_overhead.py --seqs 1,16,64,256 --other /tmp/base --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

PARTS = ("schedule", "prepare", "forward", "sample", "output", "frontend", "update", "ipc")


def tiny_model(out: Path) -> Path:
    """1 layer, hidden 32, SmolLM2's tokenizer: the model is nearly free, the host is what's left."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lorastar.models.default import default_model_dir

    if (out / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    src = Path(default_model_dir())
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / f).is_file():
            shutil.copy(src / f, out / f)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(cfg).save_pretrained(str(out), safe_serialization=True)
    return out


class _Timer:
    """Accumulates wall time per part by wrapping callables."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)

    def wrap(self, fn: Any, part: str) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[part] += time.perf_counter() - t0

        return timed


def measure(
    model_dir: Path, num_seqs: int, steps: int, temperature: float = 0.0, prompt_len: int = 32
) -> dict[str, float]:
    """Mean milliseconds per step (whole and per part) with ``num_seqs`` sequences decoding, each
    from a ``prompt_len``-token prompt."""
    import torch

    from lorastar import SamplingParams
    from lorastar.config import EngineConfig
    from lorastar.engine.engine import LLMEngine

    torch.set_num_threads(1)
    eng = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            device="cpu",
            dtype="float32",
            max_num_seqs=num_seqs,
            num_kv_blocks=num_seqs * (-(-(prompt_len + steps + 80) // 16) + 1) + 16,
            max_model_len=prompt_len + steps + 128,
            enable_prefix_caching=False,
        )
    )
    prompts = common.text_prompts(eng.tokenizer, num_seqs, prompt_len)
    params = SamplingParams(temperature=temperature, max_tokens=steps + 64, ignore_eos=True)
    for p in prompts:
        eng.add_request(p, params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.all_sequences()):
        eng.step()  # prefill done: every measured step is a decode step of num_seqs rows
    for _ in range(3):
        eng.step()

    timer = _Timer()
    sched, runner = eng.scheduler, eng.runner
    sched.schedule = timer.wrap(sched.schedule, "schedule")  # type: ignore[method-assign]
    sched.update = timer.wrap(sched.update, "update")  # type: ignore[method-assign]
    runner.prepare = timer.wrap(runner.prepare, "prepare")  # type: ignore[method-assign]
    runner.model.forward = timer.wrap(runner.model.forward, "forward")  # type: ignore[method-assign]
    runner.model.compute_logits = timer.wrap(runner.model.compute_logits, "forward")  # type: ignore[method-assign]
    eng.sampler = timer.wrap(eng.sampler, "sample")  # type: ignore[method-assign]
    eng._process = timer.wrap(eng._process, "output")  # type: ignore[method-assign]
    if hasattr(eng, "output_processor"):  # checkouts before it detokenized inside _process
        proc = eng.output_processor
        proc.process = timer.wrap(proc.process, "frontend")  # type: ignore[method-assign]
    try:  # what an engine process sends each step (checkouts before it had none)
        from lorastar.engine.messages import Outputs, encoder
    except ImportError:
        pass
    else:
        step_core, enc = eng.step_core, encoder()

        def core_and_encode() -> Any:
            outs = step_core()
            t = time.perf_counter()
            enc.encode(Outputs(outs))
            timer.total["ipc"] += time.perf_counter() - t
            return outs

        eng.step_core = core_and_encode  # type: ignore[method-assign]
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    wall = time.perf_counter() - t0 - timer.total["ipc"]  # the step in this process does not encode
    res = {p: 1000 * timer.total[p] / steps for p in PARTS}
    res["output"] -= res["sample"]  # sampling runs inside output processing
    res["step"] = 1000 * wall / steps
    res["other"] = res["step"] - sum(res[p] for p in PARTS if p != "ipc")
    res["host"] = res["step"] - res["forward"]  # everything but the model's own compute
    res["core"] = res["host"] - res["frontend"] + res["ipc"]  # an engine process's loop
    return res


def _core(r: dict[str, float]) -> float:
    """An engine process's host time per step (older result files have no 'core': the host)."""
    return r.get("core", r["step"] - r["forward"])


def run_child(
    checkout: Path, model_dir: Path, num_seqs: int, steps: int, temperature: float, prompt_len: int
) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_WAIT_POLICY": "PASSIVE"}
    # The checkout goes first on sys.path after importing this script (whose ``common`` puts this
    # repository first), and the child checks where lorastar came from: before this check the
    # "other" column silently measured this checkout too. benchmarks/ leaves sys.path again: its
    # kernels.py would pass for the ``kernels`` package transformers probes for.
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import host_overhead as h; "
        "sys.path[:] = [p for p in sys.path if p != sys.argv[1]]; sys.path.insert(0, sys.argv[6]); import lorastar; "
        "assert h.Path(lorastar.__file__).resolve().is_relative_to(h.Path(sys.argv[6]).resolve()), lorastar.__file__; "
        "print(json.dumps(h.measure(h.Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]), "
        "int(sys.argv[7]))))"
    )
    here = Path(__file__).resolve().parent
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            str(here),
            str(model_dir),
            str(num_seqs),
            str(steps),
            str(temperature),
            str(checkout),
            str(prompt_len),
        ],  # fmt: skip
        env=env,
        cwd=str(checkout),
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", default="1,16,64,256", help="running sequences per step")
    ap.add_argument("--steps", type=int, default=40, help="measured decode steps per size")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: the random path")
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per sequence (context length)")
    ap.add_argument("--other", type=Path, default=None, help="a second checkout to compare with")
    ap.add_argument("--rounds", type=int, default=1, help="pairs per size (medians are reported)")
    ap.add_argument("--out", type=Path, default=common.RESULTS)
    args = ap.parse_args()
    sizes = [int(s) for s in args.seqs.split(",")]
    model_dir = tiny_model(
        Path(os.environ.get("LORASTAR_CACHE", Path.home() / ".cache" / "lorastar")) / "tiny-host"
    )
    here = common.REPO
    systems = {"this": here} | ({"other": args.other.resolve()} if args.other else {})
    results: dict[str, dict[int, dict[str, float]]] = {name: {} for name in systems}
    rounds: dict[str, dict[int, list[dict[str, float]]]] = {name: {n: [] for n in sizes} for name in systems}
    for n in sizes:
        for _ in range(args.rounds):
            for name, checkout in systems.items():  # alternate: drift hits both alike
                r = run_child(checkout, model_dir, n, args.steps, args.temperature, args.prompt_len)
                rounds[name][n].append(r)
                print(f"{name:5s} {n:4d} seqs: {r['step']:.2f} ms/step, core {_core(r):.2f} ms", flush=True)
        for name in systems:  # each part's median over the rounds
            results[name][n] = {
                k: statistics.median(r[k] for r in rounds[name][n]) for k in rounds[name][n][0]
            }

    rows = []
    for n in sizes:
        for name in systems:
            r = results[name][n]
            host = r["step"] - r["forward"]
            row = [
                name,
                n,
                r["step"],
                1000 * r["step"] / n,
                host,
                _core(r),
                *(r[p] for p in PARTS),
                r["other"],
            ]
            rows.append(row)
    headers = [
        "checkout",
        "seqs",
        "ms/step",
        "µs/seq-step",
        "host ms",
        "core ms",
        *(f"{p} ms" for p in PARTS),
        "other ms",
    ]
    sections = [common.markdown_table(headers, rows)]
    if args.other:
        o, t = results["other"], results["this"]
        ratio_rows = []
        for n in sizes:
            per_round = [_core(a) / _core(b) for a, b in zip(rounds["other"][n], rounds["this"][n])]
            ratio_rows.append([
                n,
                o[n]["step"] / t[n]["step"],
                (o[n]["step"] - o[n]["forward"]) / (t[n]["step"] - t[n]["forward"]),
                _core(o[n]) / _core(t[n]),
                f"{min(per_round):.2f} - {max(per_round):.2f}",
            ])  # fmt: skip
        sections.append(
            common.markdown_table(
                [
                    "seqs",
                    "other / this: whole step",
                    "other / this: host (step - forward)",
                    "other / this: core (engine process)",
                    "core ratio per round (min - max)",
                ],
                ratio_rows,
            )
        )
    text = common.write_results(
        "host_overhead",
        args.out,
        sections,
        {"env": common.env_line("1 thread per engine"), "results": results, "rounds": rounds},
        notes=[
            "Model: 1 layer, hidden 32, SmolLM2 vocabulary (49152): 'forward' is mostly the lm_head.",
            f"Sampling at temperature {args.temperature} (0: greedy), ignore_eos, prefix caching off; "
            f"{args.prompt_len}-token prompts.",
            "'host ms': the step less 'forward' (everything but the model's own compute).",
            "'core ms': host less frontend plus ipc: an engine process's own loop per step (for a "
            "checkout without an engine process, its host).",
            f"{args.rounds} round(s) per size, alternating checkouts; each part is its median over the rounds.",
        ],
    )
    print(text)

    fig, (ax,) = common.new_figure()
    for name in systems:
        ax.plot(sizes, [1000 * results[name][n]["step"] / n for n in sizes], marker="o", label=name)
    common.log_x_axis(ax, sizes)
    ax.set_xlabel("running sequences")
    ax.set_ylabel("host µs per sequence-step")
    ax.legend()
    common.save_figure(fig, args.out / "host_overhead.png", "Host time per sequence-step (tiny model)")


if __name__ == "__main__":
    main()
