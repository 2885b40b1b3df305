"""``override_generation_config`` / ``--override-generation-config`` (vLLM's): sampling defaults
over ``generation_config``'s; a request that leaves one unset gets it (greedy here, held to
transformers); bad keys and values are refused before the model loads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from plugin_support import engine_config, serve_config

from lorastar.plugin.cli import main

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def file_defaults(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A generation_config.json of a model creator: sampled, top_p 0.9, at most 40 new tokens."""
    folder = tmp_path_factory.mktemp("genconf")
    (folder / "generation_config.json").write_text(
        json.dumps({"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 40})
    )
    return folder


def hf_greedy(model_dir: Path, new_tokens: int) -> list[int]:
    import torch
    from transformers import AutoTokenizer

    from tests.conftest import hf_model

    ids = torch.tensor([AutoTokenizer.from_pretrained(model_dir)(PROMPT)["input_ids"]])
    with torch.no_grad():
        out = hf_model(model_dir, torch.float32).generate(
            ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
        )
    return out[0, ids.shape[1] :].tolist()


def test_override_merges_over_the_file_and_decides_unset_fields(
    tiny_model_dir: Path, file_defaults: Path
) -> None:
    from lorastar import LLM

    override = {"temperature": 0, "max_new_tokens": 6}
    llm = LLM(
        config=engine_config(
            tiny_model_dir, generation_config=str(file_defaults), override_generation_config=override
        )
    )
    assert llm.engine.default_sampling == {"temperature": 0, "top_p": 0.9, "max_tokens": 6}
    out = llm.generate([PROMPT], use_tqdm=False)[0].outputs[0]  # no params: the defaults
    want = hf_greedy(tiny_model_dir, 6)
    assert list(out.token_ids) == want  # greedy (the override's temperature 0), 6 tokens (its cap)
    # Without a file ("vllm"), the override alone.
    alone = LLM(
        config=engine_config(
            tiny_model_dir, generation_config="vllm", override_generation_config={"top_k": 5}
        )
    )
    assert alone.engine.default_sampling == {"top_k": 5}


def test_http_requests_that_leave_temperature_unset_get_the_override(tiny_model_dir: Path) -> None:
    """Through the plugin with the engine core in its own process (the defaults cross in Ready)."""
    from litestar import Litestar
    from litestar.testing import TestClient

    from lorastar.plugin import LoraStarConfig, LoraStarPlugin

    config = LoraStarConfig(
        engine=engine_config(
            tiny_model_dir, override_generation_config={"temperature": 0, "max_new_tokens": 5}
        ),
        served_model_name="tiny",
        engine_process=True,
    )
    with TestClient(Litestar(plugins=[LoraStarPlugin(config)])) as c:
        body = {"model": "tiny", "prompt": PROMPT, "ignore_eos": True, "return_token_ids": True}
        answers = [c.post("/v1/completions", json={**body, "max_tokens": 50}).json() for _ in range(2)]
    want = hf_greedy(tiny_model_dir, 5)
    # greedy (the override's temperature 0) and capped at 5 (its max_new_tokens caps max_tokens)
    assert [a["choices"][0]["token_ids"] for a in answers] == [want, want], answers


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('{"temperatur": 0.5}', "'temperatur' is not one of repetition_penalty, temperature, top_k"),
        ('{"temperature": -1}', "temperature must be in [0"),
        ('{"top_p": 0}', "top_p must be in (0, 1]"),
        ('{"max_new_tokens": 0}', "max_new_tokens=0"),
        ('{"top_k": 2.5}', "top_k=2.5"),
        ("[1]", "must be a JSON object"),
        ("temperature=1", "Expecting value"),
    ],
)
def test_bad_overrides_fail_before_loading(tmp_path: Path, value: str, message: str) -> None:
    (tmp_path / "config.json").write_text("{}")  # never loaded: the flag is checked first
    r = CliRunner().invoke(
        main, ["serve", str(tmp_path), "--port", "0", "--override-generation-config", value]
    )
    assert r.exit_code == 2, r.output
    assert "--override-generation-config" in r.output and message in r.output, r.output


def test_the_flag_reaches_the_engine_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    value = '{"temperature": 0.3, "repetition_penalty": 1.1}'
    r, config = serve_config(
        monkeypatch, [str(tmp_path), "--port", "0", "--override-generation-config", value]
    )
    assert r.exit_code == 0, r.output
    assert config.engine_config().override_generation_config == {
        "temperature": 0.3,
        "repetition_penalty": 1.1,
    }


def test_responses_echo_the_values_used(tiny_model_dir: Path, real_server: Any) -> None:
    """OpenAI and vLLM echo the temperature and top_p a response was sampled with: the override's
    where the request left them out (they were echoed as null), the request's own otherwise."""
    import httpx
    from litestar import Litestar
    from litestar.testing import TestClient

    from lorastar.plugin import LoraStarConfig, LoraStarPlugin

    config = LoraStarConfig(
        engine=engine_config(tiny_model_dir, override_generation_config={"temperature": 0.25, "top_p": 0.5}),
        served_model_name="tiny",
    )
    body = {"model": "tiny", "input": "Hi", "max_output_tokens": 3}
    with TestClient(Litestar(plugins=[LoraStarPlugin(config)])) as c:
        r = c.post("/v1/responses", json=body).json()
        assert (r["temperature"], r["top_p"]) == (0.25, 0.5)
        r = c.post("/v1/responses", json={**body, "temperature": 0.7}).json()
        assert (r["temperature"], r["top_p"]) == (0.7, 0.5)
    # no defaults at all: OpenAI's neutral 1.0, as OpenAI's own responses show
    r = httpx.post(real_server.url + "/v1/responses", json=body).json()
    assert (r["temperature"], r["top_p"]) == (1.0, 1.0)
