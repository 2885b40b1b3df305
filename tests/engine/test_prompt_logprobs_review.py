"""Prompt logprobs in combinations the other scoring tests take one at a time: the prefix cache's
kept blocks together with preemption, chunked prefill and a mixed base / LoRA batch (against HF
and PEFT), a one-token prompt, and DELTA outputs of ``n > 1`` (the prompt's logprobs once)."""

from __future__ import annotations

import pytest
import torch

from lorastar import LLM, SamplingParams
from lorastar.engine.sampling import RequestOutputKind
from tests.conftest import make_peft_adapter

TOL = 1e-4  # fp32 logprobs, absolute (test_prompt_logprobs.py's)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> str:  # noqa: ANN001
    return tiny_model_dir("llama-gqa")


@pytest.fixture(scope="module")
def adapter(model_dir: str, tmp_path_factory) -> str:  # noqa: ANN001
    return make_peft_adapter(model_dir, tmp_path_factory.mktemp("plp-review") / "a", seed=5)


def _ref(model_dir: str, ids: list[int], adapter: str | None) -> torch.Tensor:
    """``[len(ids), vocab]``: HF's (or PEFT's) log-softmax, row ``i`` predicting position ``i + 1``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def _check(prompt_lps: list, ids: list[int], ref: torch.Tensor, k: int) -> None:
    assert prompt_lps is not None and len(prompt_lps) == len(ids) and prompt_lps[0] is None
    for pos in range(1, len(ids)):
        want, tok, entry = ref[pos - 1], ids[pos], prompt_lps[pos]
        assert abs(entry[tok].logprob - want[tok].item()) <= TOL, pos
        lo, hi = int((want > want[tok] + TOL).sum()) + 1, int((want >= want[tok] - TOL).sum())
        assert lo <= entry[tok].rank <= hi, (pos, entry[tok].rank, lo, hi)
        assert max(k, 1) <= len(entry) <= k + 1
        for t, lp in entry.items():
            assert abs(lp.logprob - want[t].item()) <= TOL


def test_kept_blocks_with_preemption_chunks_and_adapters(model_dir: str, adapter: str) -> None:
    """Four requests on one 24-token context (3 blocks of 8), base and LoRA, prefilled 5 tokens a
    step in a cache too small for all of them: some hit the kept blocks, some are preempted and
    recomputed, and every prompt position equals HF / PEFT."""
    llm = LLM(model_dir, num_kv_blocks=16, block_size=8, max_model_len=128, max_num_batched_tokens=5,
              enable_prefix_caching=True, max_loras=2, max_lora_rank=16)  # fmt: skip
    llm.load_adapter("a", adapter)
    eng = llm.engine
    ctx = list(range(2000, 2024))
    specs = [(None, 2, [11, 12, 13]), ("a", 0, [21, 22]), (None, 1, [31, 32, 33, 34]), ("a", 2, [41])]
    reqs = [
        (eng.add_request(ctx + tail, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                    prompt_logprobs=k), adapter=ad), ad, k, ctx + tail)
        for ad, k, tail in specs
    ]  # fmt: skip
    finals = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                finals[o.request_id] = o
    assert eng.scheduler.stats.num_preemptions > 0
    assert any(finals[r.request_id].num_cached_tokens for r, *_ in reqs)
    for req, ad, k, ids in reqs:
        _check(finals[req.request_id].prompt_logprobs, ids, _ref(model_dir, ids, adapter if ad else None), k)
    eng.check_invariants()
    assert not eng.requests


def test_one_token_prompt_reports_only_the_unpredicted_position(model_dir: str) -> None:
    """vLLM: the first position is None (nothing predicts it); a one-token prompt is just that."""
    llm = LLM(model_dir, num_kv_blocks=32, max_model_len=64, enable_prefix_caching=True, block_size=8)
    for _ in range(2):  # cold, then with the prefix cache warm
        out = llm.generate([[77]], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))[0]
        assert out.prompt_logprobs == [None]
        assert len(out.outputs[0].token_ids) == 2


def test_delta_outputs_of_n_samples_carry_the_prompt_once(model_dir: str) -> None:
    """DELTA (streams), ``n = 2``: the first output holds the prompt's logprobs, equal to a FINAL_ONLY
    run's, and no later output repeats them (vLLM's ``pop_prompt_logprobs``)."""
    llm = LLM(model_dir, num_kv_blocks=64, max_model_len=128, max_num_batched_tokens=8)
    eng = llm.engine
    ids = list(range(500, 530))
    base = dict(n=2, temperature=1.0, seed=3, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    final = llm.generate([ids], SamplingParams(**base))[0]
    eng.add_request(ids, SamplingParams(**base, output_kind=RequestOutputKind.DELTA))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert outs[0].prompt_logprobs is not None and all(o.prompt_logprobs is None for o in outs[1:])
    assert {o.index for o in outs[0].outputs} == {0, 1}
    for a, b in zip(outs[0].prompt_logprobs[1:], final.prompt_logprobs[1:]):
        assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) <= TOL for t in a)
