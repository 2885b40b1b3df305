"""lm-evaluation-harness end to end: ``local-completions`` against lorastar's server equals lm-eval's
own ``hf`` backend (``peft=`` for adapters), on the embedded SmolLM2 and two demo adapters.

Three local tasks, one per request kind: multiple choice (loglikelihood), perplexity
(loglikelihood_rolling) and generate_until. Identical accuracy and exact match; every request's
loglikelihood within 1e-3; the same generated text.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lm_eval_support import TASKS, per_request, run, scores, write_tasks
from plugin_support import ServerThread

pytest.importorskip("lm_eval")

REPO = Path(__file__).resolve().parents[2]
ADAPTERS = {name: REPO / "examples" / "adapters" / name for name in ("uppercase", "pirate")}
LL_TOL = 1e-3


@pytest.fixture(scope="module")
def smollm2() -> str:
    from lorastar.models.default import default_model_dir

    return str(default_model_dir())


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tasks(tmp_path_factory.mktemp("lm_eval_tasks"))


@pytest.fixture(scope="module")
def server(smollm2: str) -> Iterator[ServerThread]:
    from litestar import Litestar

    from lorastar.config import EngineConfig
    from lorastar.plugin import LoraStarConfig, LoraStarPlugin

    plugin = LoraStarPlugin(
        LoraStarConfig(
            engine=EngineConfig(model=smollm2, dtype="float32", max_model_len=512, max_loras=2),
            served_model_name="smollm2",
            adapters={name: str(path) for name, path in ADAPTERS.items()},
        )
    )
    with ServerThread(Litestar(plugins=[plugin])) as srv:
        yield srv


@pytest.mark.parametrize("model", ["smollm2", *ADAPTERS])
def test_lm_eval_through_lorastar_equals_hf_backend(
    server: ServerThread, smollm2: str, tasks: Path, model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ours = run(
        "local-completions",
        {
            "base_url": server.url + "/v1/completions",
            "model": model,
            "tokenizer_backend": "huggingface",
            "tokenizer": smollm2,
            "num_concurrent": 4,
            "max_retries": 1,
        },
        tasks,
    )
    hf_args: dict[str, Any] = {"pretrained": smollm2, "dtype": "float32"}
    if model in ADAPTERS:
        hf_args["peft"] = str(ADAPTERS[model])
    oracle = run("hf", hf_args, tasks, batch_size=8, device="cpu")

    got, want = scores(ours), scores(oracle)
    print(f"{model}: lorastar {got}\n{model}: hf       {want}\n{per_request(ours, 'lorastar_gen')}")
    for key in ("lorastar_mc/acc,none", "lorastar_mc/acc_norm,none", "lorastar_gen/exact_match,none"):
        assert got[key] == want[key], key
    for key in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        k = f"lorastar_rolling/{key}"
        assert got[k] == pytest.approx(want[k], rel=1e-4), k

    for task in ("lorastar_mc", "lorastar_rolling"):
        a, b = per_request(ours, task), per_request(oracle, task)
        assert len(a) == len(b) > 0
        for x, y in zip(a, b):
            ll_x = x[0] if isinstance(x, (list, tuple)) else x
            ll_y = y[0] if isinstance(y, (list, tuple)) else y
            assert abs(float(ll_x) - float(ll_y)) <= LL_TOL, (task, x, y)
            if isinstance(x, (list, tuple)):
                assert bool(x[1]) == bool(y[1]), (task, x, y)  # is_greedy
    assert per_request(ours, "lorastar_gen") == per_request(oracle, "lorastar_gen")
    assert set(ours["results"]) == set(TASKS)
