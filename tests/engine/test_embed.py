"""Embeddings (``LLM.embed``, ``SamplingParams(embed=True)``) against HF transformers and PEFT: the
last prompt token's final hidden state (``last_hidden_state[-1]``, the pooling of decoder embedding
models such as Qwen3-Embedding), L2-normalized or raw; with chunked prefill, a warm prefix cache,
adapters in one batch, async scheduling, and generation requests in the same steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lorastar import LLM, SamplingParams
from lorastar.errors import InvalidParamError
from tests.conftest import make_peft_adapter

TOL = 1e-4  # fp32, absolute, per value

PROMPTS = [list(range(100, 170)), [5, 6, 7], [42], "The quick brown fox"]


def _hf_last(model_dir: str, ids: list[int], adapter: str | None = None) -> torch.Tensor:
    """HF's (or PEFT's) ``last_hidden_state`` at the last prompt token: ``[hidden]``."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).eval().base_model.model
    with torch.no_grad():
        return model.model(torch.tensor([ids])).last_hidden_state[0, -1].float()


def _ids(llm: LLM, p: Any) -> list[int]:
    return llm.get_tokenizer()(p)["input_ids"] if isinstance(p, str) else list(p)


def _close(got: list[float], want: torch.Tensor) -> None:
    g = torch.tensor(got)
    assert g.shape == want.shape, (g.shape, want.shape)
    assert (g - want).abs().max().item() <= TOL, (g - want).abs().max().item()


def _finish(llm: LLM) -> None:
    llm.engine.check_invariants()
    assert not llm.engine.requests


@pytest.mark.parametrize(("arch", "chunk"), [("llama-gqa", None), ("llama-gqa", 16), ("qwen3", 16)])
def test_embeddings_equal_transformers(tiny_model_dir: Any, arch: str, chunk: int | None) -> None:
    model_dir = tiny_model_dir(arch)
    llm = LLM(model_dir, num_kv_blocks=128, max_model_len=256, max_num_batched_tokens=chunk)
    outs = llm.embed(PROMPTS)
    raw = llm.embed(PROMPTS, normalize=False)  # a warm prefix cache: the long prompt's blocks hit
    for p, out, r in zip(PROMPTS, outs, raw):
        ids = _ids(llm, p)
        assert out.prompt_token_ids == ids and out.finished
        want = _hf_last(model_dir, ids)
        _close(r.outputs.embedding, want)
        _close(out.outputs.embedding, torch.nn.functional.normalize(want, dim=0))
    assert outs[0].num_cached_tokens == 0 and raw[0].num_cached_tokens > 0  # the second read the cache
    _finish(llm)


def test_adapters_in_one_batch_equal_peft(tiny_model_dir: Any, tmp_path: Path) -> None:
    model_dir = tiny_model_dir("llama-gqa")
    paths = {
        "a": make_peft_adapter(model_dir, tmp_path / "a", seed=1),
        "b": make_peft_adapter(
            model_dir, tmp_path / "b", seed=2, r=4, targets=("q_proj", "k_proj", "gate_proj")
        ),
    }
    llm = LLM(
        model_dir,
        num_kv_blocks=128,
        max_model_len=256,
        max_loras=2,
        max_lora_rank=16,
        max_num_batched_tokens=32,
    )
    for name, path in paths.items():
        llm.load_adapter(name, path)
    ids = PROMPTS[0]
    outs = llm.embed([ids, ids, ids], adapter=["a", None, "b"], normalize=False)
    _close(outs[0].outputs.embedding, _hf_last(model_dir, ids, paths["a"]))
    _close(outs[1].outputs.embedding, _hf_last(model_dir, ids))
    _close(outs[2].outputs.embedding, _hf_last(model_dir, ids, paths["b"]))
    assert outs[0].adapter == "a" and outs[1].adapter is None
    # the adapters change the embedding (a test that could not tell them apart would pass anyway)
    assert (
        torch.tensor(outs[0].outputs.embedding) - torch.tensor(outs[1].outputs.embedding)
    ).abs().max() > 1e-3
    _finish(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_embeddings_beside_generation(tiny_model_dir: Any, async_scheduling: bool) -> None:
    """Embedding and generation requests share steps: each generation's greedy tokens are those
    it gets alone, each embedding HF's."""
    model_dir = tiny_model_dir("llama-gqa")
    kw = dict(
        num_kv_blocks=128, max_model_len=256, max_num_batched_tokens=24, async_scheduling=async_scheduling
    )
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in LLM(model_dir, **kw).generate(PROMPTS[:2], greedy)]
    llm = LLM(model_dir, **kw)
    eng = llm.engine
    gen = [eng.add_request(p, greedy).request_id for p in PROMPTS[:2]]
    emb = [
        eng.add_request(p, SamplingParams(max_tokens=1, temperature=0, embed=True)).request_id
        for p in PROMPTS[1:3]
    ]
    finals: dict[str, Any] = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                finals[out.request_id] = out
    assert [finals[r].outputs[0].token_ids for r in gen] == alone
    assert all(finals[r].embedding is None for r in gen)
    for rid, p in zip(emb, PROMPTS[1:3]):
        _close(finals[rid].embedding, _hf_last(model_dir, p))
        assert finals[rid].outputs[0].token_ids == [] and finals[rid].outputs[0].text == ""
    assert eng.generation_tokens_total == 2 * 6  # the embeddings' sampled tokens are no output
    _finish(llm)


def test_an_embedding_has_one_output() -> None:
    for kw in ({"n": 2}, {"n": 2, "use_beam_search": True}):
        with pytest.raises(InvalidParamError, match="embedding"):
            SamplingParams(max_tokens=1, embed=True, **kw)  # type: ignore[arg-type]


@pytest.mark.gpu
def test_embeddings_on_cuda_beside_graph_decodes(tiny_model_dir: Any) -> None:
    """On a GPU with decode graphs: a one-token embedding input (a step of one-token rows, which
    a graph would replay without hidden states) and longer ones beside decoding requests equal HF."""
    model_dir = tiny_model_dir("llama-gqa")
    llm = LLM(model_dir, device="cuda", dtype="float32", num_kv_blocks=128, max_model_len=256)
    eng = llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    gen = [eng.add_request(p, greedy).request_id for p in PROMPTS[:2]]
    for _ in range(3):  # the generations are decoding: their steps replay graphs
        eng.step()
    emb = SamplingParams(max_tokens=1, temperature=0, embed=True)
    ids = {eng.add_request(p, emb).request_id: p for p in ([42], PROMPTS[0])}
    finals: dict[str, Any] = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                finals[out.request_id] = out
    assert all(len(finals[r].outputs[0].token_ids) == 12 for r in gen)
    for rid, p in ids.items():
        _close(finals[rid].embedding, _hf_last(model_dir, p))
    _finish(llm)


async def test_async_engines_embed(tiny_model_dir: Any) -> None:
    """``AsyncLLM.embed`` and ``AsyncCoreClient.embed`` (the core in its own process) equal HF."""
    from lorastar import AsyncLLM
    from lorastar.config import EngineConfig
    from lorastar.engine.core_client import AsyncCoreClient

    model_dir = tiny_model_dir("llama-gqa")
    want = _hf_last(model_dir, PROMPTS[0])
    cfg = EngineConfig(model=model_dir, num_kv_blocks=64, max_model_len=256)
    engines = [AsyncLLM(config=cfg), AsyncCoreClient(cfg)]
    try:
        for eng in engines:
            out = await eng.embed(PROMPTS[0], normalize=False)
            _close(out.outputs.embedding, want)
            unit = await eng.embed(PROMPTS[0], request_id="mine")
            assert unit.request_id == "mine" and unit.num_cached_tokens > 0  # the prompt's blocks, cached
            _close(unit.outputs.embedding, torch.nn.functional.normalize(want, dim=0))
    finally:
        for eng in engines:
            await eng.shutdown(drain_timeout=0)
