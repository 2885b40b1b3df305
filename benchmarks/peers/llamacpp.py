"""Run llama.cpp (``llama-cpp-python``'s low-level API) on given prompt token ids, ``c`` sequences at
once in one ``llama_batch`` per step; print JSON tok/s per concurrency.

Runs inside its own venv (``make bench-peers`` builds it and converts SmolLM2 to an F32 GGUF), as a
subprocess of throughput.py:

    /path/to/llama-venv/bin/python benchmarks/peers/llamacpp.py --gguf smollm2-f32.gguf \
        --prompts prompts.json --concurrency 1,5,10,20 --new-tokens 64

Each concurrency ``c`` clears the KV cache, decodes the first ``c`` prompts (all of their tokens in
batches of up to ``n_batch``, one sequence id each), then ``--new-tokens`` steps of one token per
sequence, greedy (argmax of the logits), EOS ignored: what lorastar's and vLLM's waves do. One
warm-up wave first; stdout's last line is the JSON result.

(Named llamacpp.py, not llama_cpp.py: run as a script its folder comes first on sys.path, and the
file would import itself instead of the llama_cpp package.)
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gguf", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--concurrency", default="1,5,10,20")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n-batch", type=int, default=2048)
    a = p.parse_args()
    import llama_cpp as lc
    import numpy as np

    prompts: list[list[int]] = json.load(open(a.prompts))
    conc = [int(c) for c in a.concurrency.split(",")]
    max_c = max(conc)
    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(a.gguf.encode(), lc.llama_model_default_params())
    if not model:
        raise SystemExit(f"cannot load {a.gguf}")
    cp = lc.llama_context_default_params()
    longest = max(len(x) for x in prompts[:max_c]) + a.new_tokens
    cp.n_seq_max = max_c
    cp.n_ctx = max_c * (longest + 16)  # every sequence's context fits (the cache is shared)
    cp.n_batch = a.n_batch
    cp.n_ubatch = min(512, a.n_batch)
    cp.n_threads = cp.n_threads_batch = a.threads
    ctx = lc.llama_init_from_model(model, cp)
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    batch = lc.llama_batch_init(a.n_batch, 0, max_c)

    def decode(items: list[tuple[int, int, int, bool]]) -> None:
        """``(token, pos, seq, wants_logits)`` in chunks of n_batch."""
        for lo in range(0, len(items), a.n_batch):
            chunk = items[lo : lo + a.n_batch]
            batch.n_tokens = len(chunk)
            for i, (tok, pos, seq, want) in enumerate(chunk):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = want
            if lc.llama_decode(ctx, batch) != 0:
                raise SystemExit("llama_decode failed")
            for i, (_, _, seq, want) in enumerate(chunk):
                if want:
                    logits = np.ctypeslib.as_array(
                        ctypes.cast(lc.llama_get_logits_ith(ctx, i), ctypes.POINTER(ctypes.c_float)),
                        (n_vocab,),
                    )
                    last[seq] = int(logits.argmax())

    last: dict[int, int] = {}
    first: list[int] = []  # the tokens of sequence 0 (a check against the other systems' greedy output)

    def wave(ps: list[list[int]], new: int) -> int:
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        last.clear()
        decode([(t, i, s, i == len(x) - 1) for s, x in enumerate(ps) for i, t in enumerate(x)])
        made = len(ps)  # the first new token of each sequence comes from its prompt's logits
        lens = [len(x) for x in ps]
        first.clear()
        first.append(last[0])
        for step in range(new - 1):
            decode([(last[s], lens[s] + step, s, True) for s in range(len(ps))])
            made += len(ps)
            first.append(last[0])
        return made

    wave(prompts[: min(2, max_c)], 4)
    out = {"version": lc.__version__, "rates": {}}
    for c in conc:
        t0 = time.perf_counter()
        toks = wave(prompts[:c], a.new_tokens)
        dt = time.perf_counter() - t0
        out["rates"][str(c)] = toks / dt
        out.setdefault("tokens0", list(first))
        print(f"llama.cpp c={c}: {toks / dt:.1f} tok/s", flush=True)
    lc.llama_batch_free(batch)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
