"""Small local lm-evaluation-harness tasks (one per request kind) and helpers to run them.

The tasks are written to a folder at run time (their YAML names their data files by absolute
path); ``run`` evaluates them through lm-eval against either lorastar's server
(``local-completions``) or lm-eval's own ``hf`` backend (the oracle), with samples logged.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

MC = [  # multiple choice (loglikelihood)
    ("What is the capital of France?", ["Paris", "London", "Berlin", "Madrid"], 0),
    ("What color is the sky on a clear day?", ["Green", "Blue", "Red", "Yellow"], 1),
    ("How many legs does a spider have?", ["Six", "Four", "Eight", "Ten"], 2),
    ("Which animal says meow?", ["Dog", "Cow", "Cat", "Duck"], 2),
    ("What is 2 plus 2?", ["Three", "Four", "Five", "Six"], 1),
    ("Which planet do we live on?", ["Mars", "Venus", "Jupiter", "Earth"], 3),
    ("What do bees make?", ["Honey", "Milk", "Silk", "Wool"], 0),
    ("What is frozen water called?", ["Steam", "Ice", "Sand", "Glass"], 1),
]
ROLLING = [  # loglikelihood_rolling (perplexity)
    "The quick brown fox jumps over the lazy dog. It was a sunny day in the park.",
    "Machine learning models are trained on data and evaluated on held-out examples.",
    "Paris is the capital and most populous city of France, on the river Seine.",
    "To make tea, boil water, pour it over the leaves and wait three minutes.",
]
GEN = [  # generate_until (exact match): continuations a small model can finish
    ("The capital of France is", "Paris"),
    ("3 + 4 =", "7"),
    ("The opposite of hot is", "cold"),
    ("Monday, Tuesday,", "Wednesday"),
    ("One, two, three, four,", "five"),
    ("The color of grass is", "green"),
]
TASKS = ["lorastar_mc", "lorastar_rolling", "lorastar_gen"]


def synthetic(extra: int, seed: int = 0) -> tuple[list[Any], list[str], list[Any]]:
    """``extra`` more multiple-choice docs, ``extra // 4`` texts and ``extra // 2`` continuations,
    for a sweep big enough to time (``benchmarks/eval_sweep.py``). Each multiple-choice doc reads
    a passage of 40-60 words before its question (arithmetic), as reading-comprehension and
    HellaSwag-style tasks do: its four continuations share a context of about 70 tokens."""
    import random

    rng = random.Random(seed)
    words = ROLLING[0].split() + ROLLING[1].split() + ROLLING[2].split()
    mc, texts, gen = [], [], []
    for _ in range(extra):
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        wrong = rng.sample([x for x in range(2, 41) if x != a + b], 3)
        choices = [str(x) for x in [a + b, *wrong]]
        rng.shuffle(choices)
        passage = " ".join(rng.choice(words) for _ in range(rng.randint(40, 60)))
        mc.append((f"{passage}. What is {a} plus {b}?", choices, choices.index(str(a + b))))
    for _ in range(extra // 4):
        texts.append(" ".join(rng.choice(words) for _ in range(rng.randint(20, 40))) + ".")
    for _ in range(extra // 2):
        n = rng.randint(1, 5)
        gen.append((", ".join(str(n + i) for i in range(4)) + ",", str(n + 4)))
    return mc, texts, gen


def write_tasks(folder: Path, extra: int = 0) -> Path:
    """The three tasks' data and YAML under ``folder`` (plus ``extra`` synthetic docs, see
    ``synthetic``); returns it (lm-eval's include_path)."""
    folder.mkdir(parents=True, exist_ok=True)
    more_mc, more_texts, more_gen = synthetic(extra) if extra else ([], [], [])

    def data(name: str, rows: list[dict[str, Any]]) -> str:
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(path)

    mc = data("mc", [{"question": q, "choices": c, "answer": a} for q, c, a in MC + more_mc])
    rolling = data("rolling", [{"text": t} for t in ROLLING + more_texts])
    gen = data("gen", [{"question": q, "answer": a} for q, a in GEN + more_gen])
    common = "dataset_path: json\ntest_split: test\n"
    (folder / "lorastar_mc.yaml").write_text(
        f"task: lorastar_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {mc}\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    (folder / "lorastar_rolling.yaml").write_text(
        f"task: lorastar_rolling\n{common}dataset_kwargs:\n  data_files:\n    test: {rolling}\n"
        "output_type: loglikelihood_rolling\n"
        'doc_to_text: ""\n'
        'doc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n"
    )
    (folder / "lorastar_gen.yaml").write_text(
        f"task: lorastar_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {gen}\n"
        "output_type: generate_until\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_target: " {{answer}}"\n'
        'generation_kwargs:\n  until: ["\\n", ".", ","]\n  max_gen_toks: 16\n  do_sample: false\n  temperature: 0\n'
        "metric_list:\n  - metric: exact_match\n    ignore_case: true\n    ignore_punctuation: true\n"
        "    regexes_to_ignore: ['^\\s+', '\\s+$']\n"
    )
    return folder


@functools.cache
def task_manager(include_path: Path) -> Any:
    """lm-eval's index of the tasks under ``include_path`` alone, built once per folder: indexing
    lm-eval's own few thousand task files as well took 8.5-11 s per ``TaskManager`` here, 2/3 of
    each test's time when every run built one."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(include_path), include_defaults=False)


def run(model: str, model_args: dict[str, Any], include_path: Path, **kw: Any) -> dict[str, Any]:
    """lm-eval's ``simple_evaluate`` on the three tasks, samples logged."""
    from lm_eval import simple_evaluate

    return simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=TASKS,
        task_manager=task_manager(include_path),
        log_samples=True,
        **kw,
    )


def scores(result: dict[str, Any]) -> dict[str, float]:
    """Every numeric metric of every task, e.g. ``lorastar_mc/acc,none``."""
    out: dict[str, float] = {}
    for task, metrics in result["results"].items():
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and not k.endswith("_stderr,none") and "stderr" not in k:
                out[f"{task}/{k}"] = float(v)
    return out


def per_request(result: dict[str, Any], task: str) -> list[Any]:
    """Raw responses in (doc, request) order: (loglikelihood, is_greedy), a rolling
    loglikelihood, or generated text."""
    samples = sorted(result["samples"][task], key=lambda s: s["doc_id"])
    return [r[0] for s in samples for r in s["resps"]]
