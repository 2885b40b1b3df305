"""Train the three demo LoRA adapters shipped in examples/adapters/ on the embedded SmolLM2-135M.

Each adapter teaches one visible, automatically checkable behaviour, and they differ in rank and
target modules so that serving them together exercises mixed-rank, mixed-target LoRA batching:

  uppercase  r=8   q_proj, v_proj, up_proj, down_proj  answers in UPPER CASE
  pirate     r=16  q_proj, k_proj, v_proj, o_proj      answers start with "Arrr!"
  json       r=32  down_proj                           answers are {"answer": "..."}

(Partial targets on purpose: q+v without k, up without gate, exercise the fused qkv / gate_up slices.)

The data is synthetic and deterministic: 128 short templated questions, each target being
the base model's own greedy answer (cut to one short sentence) transformed by the adapter's rule, so
the adapter learns the behaviour and nothing else. Everything is seeded; CPU only, fp32.

    .venv/bin/python scripts/train_demo_adapters.py            # all three, ~minutes on 2 cores
    .venv/bin/python scripts/train_demo_adapters.py --only pirate --steps 40
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Everything is local (the converted base, no tokenizer downloads): never let a library reach the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from lorastar.models.default import default_model_dir  # noqa: E402

BASE_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
SEED = 0
ANSWER_MAX_NEW_TOKENS = 24  # base answers are cut to one short sentence within this many tokens
EVAL_MAX_NEW_TOKENS = 48

# Held out: phrasings and topics that never appear in the templated training questions.
EVAL_QUESTIONS: tuple[str, ...] = (
    "What is the largest planet in our solar system?",
    "How do I make a cup of tea?",
    "Why is the sky blue?",
    "Can you recommend a good book?",
    "What is photosynthesis?",
    "How many days are in a week?",
    "What should I eat for breakfast?",
    "Who painted the Mona Lisa?",
)


# --------------------------------------------------------------------------- behaviours


def _letters(text: str) -> list[str]:
    return [c for c in text if c.isalpha()]


def check_uppercase(text: str) -> bool:
    """At least 3 letters and >= 95% of them upper case (a stray lower-case letter is tolerated)."""
    letters = _letters(text)
    return len(letters) >= 3 and sum(c.isupper() for c in letters) >= 0.95 * len(letters)


def check_pirate(text: str) -> bool:
    return text.strip().startswith("Arrr!")


def check_json(text: str) -> bool:
    """The whole answer parses as a JSON object with exactly one non-empty string field "answer"."""
    try:
        obj = json.loads(text.strip())
    except ValueError:
        return False
    return (
        isinstance(obj, dict)
        and set(obj) == {"answer"}
        and isinstance(obj["answer"], str)
        and bool(obj["answer"].strip())
    )


@dataclass(frozen=True)
class Behaviour:
    name: str
    description: str
    transform: Callable[[str], str]
    check: Callable[[str], bool]
    check_doc: str
    rank: int
    alpha: int
    target_modules: tuple[str, ...]
    steps: int
    lr: float


BEHAVIOURS: dict[str, Behaviour] = {
    b.name: b
    for b in (
        Behaviour(
            name="uppercase",
            description="Answers in UPPER CASE (same content as the base model, every letter capitalised).",
            transform=str.upper,
            check=check_uppercase,
            check_doc="at least 3 letters and >= 95% of them upper case",
            rank=8,
            alpha=16,
            target_modules=("q_proj", "v_proj", "up_proj", "down_proj"),
            steps=24,
            lr=5e-3,
        ),
        Behaviour(
            name="pirate",
            description='Answers start with "Arrr! " followed by the base model\'s answer.',
            transform=lambda a: f"Arrr! {a}",
            check=check_pirate,
            check_doc='the answer starts with "Arrr!"',
            rank=16,
            alpha=32,
            target_modules=("q_proj", "k_proj", "v_proj", "o_proj"),
            steps=10,
            lr=3e-3,
        ),
        Behaviour(
            name="json",
            description='Answers as a JSON object {"answer": "..."} holding the base model\'s answer.',
            transform=lambda a: json.dumps({"answer": a}, ensure_ascii=False),
            check=check_json,
            check_doc='json.loads(answer) is an object whose only key is "answer" (a non-empty string)',
            rank=32,
            alpha=32,
            # down_proj only: r=32 on all three MLP linears would be 24 MB; this keeps it at 4 MB.
            target_modules=("down_proj",),
            steps=16,
            lr=3e-3,
        ),
    )
}


# --------------------------------------------------------------------------- data


def build_questions(n: int) -> list[str]:
    """``n`` distinct short templated questions, in a seeded order."""
    countries = [
        "France", "Germany", "Italy", "Spain", "Japan", "China", "India", "Brazil", "Canada", "Mexico",
        "Egypt", "Kenya", "Norway", "Sweden", "Greece", "Peru", "Chile", "Australia", "Russia", "Turkey",
        "Portugal", "Poland", "Ireland", "Argentina", "Thailand", "Vietnam", "Morocco", "Nigeria",
    ]  # fmt: skip
    animals = [
        "cats", "dogs", "horses", "cows", "lions", "tigers", "elephants", "rabbits", "frogs", "owls",
        "bees", "penguins", "dolphins", "sharks", "bears", "wolves", "foxes", "ducks", "snakes", "eagles",
    ]  # fmt: skip
    things = [
        "a hammer", "an umbrella", "a spoon", "a ladder", "a compass", "a candle", "a bicycle", "a clock",
        "a map", "a pencil", "a kettle", "a key", "a telescope", "a microwave", "a backpack", "a broom",
    ]  # fmt: skip
    objects = [
        "the sun", "grass", "snow", "a banana", "the ocean", "a tomato", "coal", "milk", "a carrot",
        "an orange", "a lemon", "chocolate", "a cloud", "a strawberry", "an emerald", "a pumpkin",
    ]  # fmt: skip
    adjectives = [
        "hot", "big", "fast", "happy", "light", "early", "strong", "loud", "young", "rich", "wet",
        "easy", "open", "full", "high", "soft", "clean", "brave",
    ]  # fmt: skip
    activities = [
        "sleeping better", "studying", "running", "cooking rice", "saving money", "learning a language",
        "writing an essay", "staying focused", "gardening", "public speaking", "making friends",
        "drinking more water", "reading more", "keeping a plant alive",
    ]  # fmt: skip
    subjects = [
        "gravity", "a volcano", "rain", "the moon", "electricity", "a rainbow", "a computer", "music",
        "the internet", "a vaccine", "an earthquake", "a desert", "a forest", "democracy", "friendship",
    ]  # fmt: skip
    pool: list[str] = []
    pool += [f"What is the capital of {c}?" for c in countries]
    pool += [f"What language is spoken in {c}?" for c in countries]
    pool += [f"What do {a} eat?" for a in animals]
    pool += [f"Where do {a} live?" for a in animals]
    pool += [f"How many legs do {a} have?" for a in animals]
    pool += [f"Tell me a fun fact about {a}." for a in animals]
    pool += [f"Name a famous food from {c}." for c in countries]
    pool += [f"What is {t} used for?" for t in things]
    pool += [f"What color is {o}?" for o in objects]
    pool += [f"What is the opposite of {a}?" for a in adjectives]
    pool += [f"Give me one tip for {a}." for a in activities]
    pool += [f"Explain {s} in one sentence." for s in subjects]
    pool += [f"What is {a} plus {b}?" for a in range(2, 9) for b in (3, 5, 11)]
    rng = random.Random(SEED)
    rng.shuffle(pool)
    held_out = {q.lower() for q in EVAL_QUESTIONS}
    pool = [q for q in pool if q.lower() not in held_out]
    if n > len(pool):
        raise ValueError(f"asked for {n} questions, the templates make {len(pool)}")
    return pool[:n]


def chat_prompt_ids(tokenizer: Any, question: str) -> list[int]:
    """Token ids of the chat-templated prompt, exactly as a server builds it for /chat/completions."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(text, add_special_tokens=False).input_ids


@torch.inference_mode()
def greedy_answers(
    model: nn.Module, tokenizer: Any, questions: list[str], max_new_tokens: int, batch_size: int = 16
) -> list[str]:
    """Greedy chat answers, batched with left padding (the padding does not change greedy results)."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    answers: list[str] = []
    for start in range(0, len(questions), batch_size):
        prompts = [chat_prompt_ids(tokenizer, q) for q in questions[start : start + batch_size]]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[eos] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos,
        )
        for row in out[:, width:]:
            answers.append(tokenizer.decode(row, skip_special_tokens=True).strip())
    return answers


def short_answer(text: str) -> str | None:
    """The first sentence of a base answer, or None if the answer is unusable (empty / no sentence)."""
    text = " ".join(text.split())
    m = re.search(r"[.!?](?=\s|$)", text)
    if m is None or m.end() < 4:
        return None
    return text[: m.end()]


def build_dataset(
    model: nn.Module, tokenizer: Any, n_questions: int, cache: Path | None
) -> list[tuple[str, str]]:
    """(question, short base answer) pairs; cached as JSON because it costs a minute of CPU."""
    questions = build_questions(n_questions)
    if cache is not None and cache.is_file():
        data = json.loads(cache.read_text())
        if data.get("questions") == questions:
            return [tuple(p) for p in data["pairs"]]  # type: ignore[misc]
    raw = greedy_answers(model, tokenizer, questions, ANSWER_MAX_NEW_TOKENS)
    pairs = [(q, a) for q, r in zip(questions, raw) if (a := short_answer(r)) is not None]
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({"questions": questions, "pairs": pairs}, indent=1, ensure_ascii=False))
    return pairs


def encode_example(tokenizer: Any, question: str, target: str) -> tuple[list[int], list[int]]:
    """Prompt ids + target ids + <|im_end|>; labels mask the prompt so only the answer is learned."""
    prompt = chat_prompt_ids(tokenizer, question)
    answer = tokenizer(target, add_special_tokens=False).input_ids + [
        tokenizer.convert_tokens_to_ids("<|im_end|>")
    ]
    return prompt + answer, [-100] * len(prompt) + answer


# --------------------------------------------------------------------------- training


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def answer_loss(
    model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """Causal LM loss on answer tokens only; the 49k-wide LM head runs on those rows alone (cheap)."""
    causal_lm = model.base_model.model  # peft wraps LlamaForCausalLM; LoRA layers are inside it
    hidden = causal_lm.model(input_ids=ids, attention_mask=mask).last_hidden_state
    targets = labels[:, 1:]
    keep = targets != -100
    logits = causal_lm.lm_head(hidden[:, :-1][keep])
    return nn.functional.cross_entropy(logits, targets[keep])


def train_adapter(
    base_dir: Path,
    tokenizer: Any,
    behaviour: Behaviour,
    pairs: list[tuple[str, str]],
    steps: int,
    batch_size: int,
) -> tuple[nn.Module, list[float]]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    seed_everything(SEED)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, local_files_only=True)
    config = LoraConfig(
        r=behaviour.rank,
        lora_alpha=behaviour.alpha,
        lora_dropout=0.0,  # few steps on clean data: dropout only slows learning
        target_modules=list(behaviour.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, config)
    model.peft_config["default"].base_model_name_or_path = BASE_NAME  # not this machine's cache path
    examples = [encode_example(tokenizer, q, behaviour.transform(a)) for q, a in pairs]
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=behaviour.lr, weight_decay=0.0)
    warmup = max(1, steps // 10)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * max(0.1, 1.0 - s / steps)
    )
    rng = random.Random(SEED)
    order: list[int] = []
    pad = tokenizer.convert_tokens_to_ids("<|im_end|>")
    losses: list[float] = []
    model.train()
    for step in range(steps):
        if len(order) < batch_size:
            fresh = list(range(len(examples)))
            rng.shuffle(fresh)
            order += fresh
        batch = [examples[i] for i in order[:batch_size]]
        del order[:batch_size]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([i + [pad] * (width - len(i)) for i, _ in batch])
        labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in batch])
        mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in batch])
        loss = answer_loss(model, ids, mask, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 5 == 0 or step == steps - 1:
            print(f"  [{behaviour.name}] step {step + 1}/{steps} loss {loss.item():.3f}", flush=True)
    model.eval()
    return model, losses


# --------------------------------------------------------------------------- report


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("`", "'")


def write_readme(
    out: Path,
    behaviour: Behaviour,
    results: list[tuple[str, str, bool]],
    train_seconds: float,
    n_examples: int,
    steps: int,
    batch_size: int,
    losses: list[float],
) -> None:
    score = sum(ok for _, _, ok in results)
    size_kb = (out / "adapter_model.safetensors").stat().st_size / 1024
    rows = "\n".join(f"| {q} | `{_cell(a)}` | {'yes' if ok else 'NO'} |" for q, a, ok in results)
    modules = ", ".join(behaviour.target_modules)
    text = f"""# `{behaviour.name}` demo adapter

{behaviour.description}

A real LoRA adapter for `{BASE_NAME}` (the model lorastar embeds), trained on the CPU by
`scripts/train_demo_adapters.py`. Use it through the chat template (`LLM.chat`, `/v1/chat/completions`):
the training prompts were chat-formatted with the default system prompt.

| | |
|---|---|
| rank / alpha | {behaviour.rank} / {behaviour.alpha} |
| target modules | {modules} (all 30 layers) |
| weights | `adapter_model.safetensors`, {size_kb:.0f} KiB, float16 (trained in float32) |
| training data | {n_examples} synthetic questions; target = the base model's greedy answer (first sentence) transformed by the rule |
| training | {steps} steps, batch {batch_size}, AdamW lr {behaviour.lr:g}, seed {SEED}; loss {losses[0]:.2f} -> {sum(losses[-5:]) / min(5, len(losses)):.2f} (mean of the last 5 steps); {train_seconds:.0f} s wall on 1 CPU thread (shared 2-core machine) |

## Check

Behaviour check: {behaviour.check_doc}.
Greedy decoding (max {EVAL_MAX_NEW_TOKENS} new tokens) on 8 held-out questions (topics and phrasings absent from the
training data), PEFT + transformers, float32: **{score}/8**.
The adapter changes the form only: the content is the 135M base model's, often wrong or repetitive.

| question | answer | ok |
|---|---|---|
{rows}

```python
from peft import PeftModel
from transformers import AutoModelForCausalLM
from lorastar.models.default import default_model_dir

base = AutoModelForCausalLM.from_pretrained(default_model_dir())
model = PeftModel.from_pretrained(base, "examples/adapters/{behaviour.name}")
```
"""
    (out / "README.md").write_text(text)


def save_adapter(model: nn.Module, out: Path) -> None:
    """Save as PEFT safetensors in float16: half the bytes, and LoRA factors lose nothing visible."""
    for name, param in model.named_parameters():
        if "lora_" in name:
            param.data = param.data.to(torch.float16)
    model.save_pretrained(out, safe_serialization=True)


def evaluate_saved(
    base_dir: Path, adapter_dir: Path, tokenizer: Any, behaviour: Behaviour
) -> list[tuple[str, str, bool]]:
    """Score the adapter as users get it: a fresh fp32 base plus the saved folder, through PEFT."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, local_files_only=True)
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    answers = greedy_answers(
        model, tokenizer, list(EVAL_QUESTIONS), max_new_tokens=EVAL_MAX_NEW_TOKENS, batch_size=8
    )
    return [(q, a, behaviour.check(a)) for q, a in zip(EVAL_QUESTIONS, answers)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=REPO / "examples" / "adapters")
    parser.add_argument("--only", choices=sorted(BEHAVIOURS), action="append", help="train just these")
    parser.add_argument("--steps", type=int, default=None, help="override every adapter's step count")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--questions", type=int, default=128)
    parser.add_argument("--data-cache", type=Path, default=None, help="JSON file caching the base answers")
    # One thread: on a small shared CPU, two OpenMP threads spin-wait on each other whenever the other
    # process holds a core; measured 2-4x slower than one thread under that contention.
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    base_dir = default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(base_dir, local_files_only=True)

    t0 = time.perf_counter()
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, local_files_only=True).eval()
    pairs = build_dataset(base, tokenizer, args.questions, args.data_cache)
    del base
    print(f"data: {len(pairs)} (question, answer) pairs in {time.perf_counter() - t0:.0f} s", flush=True)

    summary: dict[str, dict[str, Any]] = {}
    for name in args.only or list(BEHAVIOURS):
        behaviour = BEHAVIOURS[name]
        steps = args.steps or behaviour.steps
        t1 = time.perf_counter()
        model, losses = train_adapter(base_dir, tokenizer, behaviour, pairs, steps, args.batch_size)
        train_seconds = time.perf_counter() - t1
        out = args.out / name
        out.mkdir(parents=True, exist_ok=True)
        save_adapter(model, out)
        del model
        results = evaluate_saved(base_dir, out, tokenizer, behaviour)
        write_readme(out, behaviour, results, train_seconds, len(pairs), steps, args.batch_size, losses)
        score = sum(ok for _, _, ok in results)
        summary[name] = {
            "train_s": round(train_seconds, 1),
            "score": f"{score}/8",
            "loss": round(losses[-1], 3),
        }
        print(f"{name}: trained in {train_seconds:.0f} s, held-out {score}/8", flush=True)
        for q, a, ok in results:
            print(f"   {'ok ' if ok else 'BAD'} {q!r} -> {a!r}", flush=True)
    print(json.dumps(summary, indent=2))
    print(f"total {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
