"""`make demo`: the embedded SmolLM2 through the Python API, then the same prompts through the
demo LoRA adapters in ONE batch, then (if the plugin example is present) the OpenAI-compatible
server with the official `openai` client."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from lorastar import LLM, SamplingParams

HERE = Path(__file__).parent
QUESTIONS = ["What is the capital of France?", "Name a fruit that is yellow.", "What do bees make?"]


def main() -> None:
    t = time.perf_counter()
    llm = LLM()  # embedded SmolLM2-135M-Instruct (converted once into the cache)
    print(f"loaded {llm.engine.model_name} on {llm.engine.device} in {time.perf_counter() - t:.1f}s")
    greedy = SamplingParams(temperature=0, max_tokens=32)

    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8))[0]
    print(f"\nThe capital of France is{out.outputs[0].text!r}")

    adapters = sorted(p for p in (HERE / "adapters").iterdir() if (p / "adapter_config.json").is_file())
    for a in adapters:
        llm.load_adapter(a.name, str(a))
    names: list[str | None] = [None] + [a.name for a in adapters]
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS for _ in names]
    which = [n for _ in QUESTIONS for n in names]
    t = time.perf_counter()
    outs = llm.chat(convs, greedy, adapter=which)  # base and every adapter decode in one batch
    dt = time.perf_counter() - t
    ntok = sum(len(o.outputs[0].token_ids) for o in outs)
    print(
        f"\n{len(outs)} chats ({len(names)} models) in one batch: {ntok} tokens in {dt:.1f}s ({ntok / dt:.0f} tok/s)"
    )
    for i, q in enumerate(QUESTIONS):
        print(f"\nQ: {q}")
        for j, n in enumerate(names):
            text = outs[i * len(names) + j].outputs[0].text.strip().replace("\n", " ")
            print(f"  [{n or 'base'}] {text}")
    print("\nKV cache after the batch:", llm.kv_cache_usage())

    client_demo = HERE / "client_demo.py"
    if client_demo.is_file():
        print(
            "\n--- OpenAI-compatible server (examples/app.py) with the official openai client ---", flush=True
        )
        del llm
        sys.exit(subprocess.call([sys.executable, str(client_demo)]))


if __name__ == "__main__":
    main()
