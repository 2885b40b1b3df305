"""Beam search with logprobs, and vLLM's offline ``LLM.beam_search``: each token of a hypothesis
carries the model's log-probabilities at that position, checked against HF transformers' forward
pass over the hypothesis (not against the engine's own beam scores)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from lorastar import LLM, BeamSearchOutput, BeamSearchParams, SamplingParams

PROMPTS = [[11, 22, 33, 44, 55], list(range(100, 140))]


@pytest.fixture(scope="module")
def models(tiny_model_dir) -> tuple[LLM, torch.nn.Module]:  # noqa: ANN001
    path = tiny_model_dir("llama-gqa")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return LLM(path, num_kv_blocks=256), hf


def _hf_logprobs(hf: torch.nn.Module, prompt: list[int], out: list[int]) -> torch.Tensor:
    """log_softmax of HF's logits at each generated position: ``[len(out), vocab]``."""
    ids = torch.tensor([prompt + out])
    with torch.no_grad():
        logits = hf(ids).logits[0, len(prompt) - 1 : len(prompt) + len(out) - 1]
    return torch.log_softmax(logits.float(), dim=-1)


def _check_against_hf(hf: torch.nn.Module, prompt: list[int], toks: list[int], lps: list, k: int,
                      cum: float) -> None:  # fmt: skip
    ref = _hf_logprobs(hf, prompt, toks)
    assert len(lps) == len(toks)
    total = 0.0
    for pos, (tok, entry) in enumerate(zip(toks, lps)):
        assert tok in entry
        want = ref[pos, tok].item()
        assert entry[tok].logprob == pytest.approx(want, abs=1e-4)
        assert entry[tok].rank == int((ref[pos] >= want - 1e-6).sum())  # ties count, as the sampler's
        top_vals, top_ids = ref[pos].topk(k)
        others = {t: lp for t, lp in entry.items() if t != tok}
        assert set(others) <= set(top_ids.tolist())
        for t, v in zip(top_ids.tolist(), top_vals.tolist()):
            assert entry[t].logprob == pytest.approx(v, abs=1e-4)
        total += entry[tok].logprob
    assert total == pytest.approx(cum, abs=1e-3)


@pytest.mark.parametrize("k", [0, 3])
def test_beam_search_logprobs_are_the_models(models: tuple[LLM, torch.nn.Module], k: int) -> None:
    """Before, a beam request's outputs had ``logprobs=None`` (the HTTP routes refused the field)."""
    llm, hf = models
    sp = SamplingParams(n=3, use_beam_search=True, max_tokens=8, temperature=0, logprobs=k)
    plain = llm.generate(PROMPTS, SamplingParams(n=3, use_beam_search=True, max_tokens=8, temperature=0))
    for prompt, out, ref in zip(PROMPTS, llm.generate(PROMPTS, sp), plain):
        # asking for logprobs changes no hypothesis
        assert [o.token_ids for o in out.outputs] == [o.token_ids for o in ref.outputs]
        for o in out.outputs:
            assert o.logprobs is not None
            _check_against_hf(hf, prompt, o.token_ids, o.logprobs, k, o.cumulative_logprob)
            assert all(len(e) <= k + 1 for e in o.logprobs)
    llm.engine.check_invariants()
    assert llm.kv_cache_usage()["num_used_blocks"] == 0


def test_beam_logprobs_survive_preemption(tiny_model_dir) -> None:  # noqa: ANN001
    """A KV pool too small for the beams beside another request preempts beams, which recompute
    (the prefix cache gives the shared prompt back); their logprobs still match a roomy run's."""
    path = tiny_model_dir("llama-gqa")
    beam = SamplingParams(
        n=2, use_beam_search=True, temperature=0, max_tokens=11, ignore_eos=True, logprobs=2
    )
    other = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[(7 * i + 3) % 500 + 5 for i in range(25)], [(11 * i + 9) % 500 + 5 for i in range(20)]]
    roomy = LLM(path, num_kv_blocks=256).generate(prompts, [beam, other])[0]
    tight = LLM(path, num_kv_blocks=14, block_size=4, max_num_batched_tokens=16, max_num_seqs=3)
    got = tight.generate(prompts, [beam, other])[0]
    assert tight.engine.scheduler.stats.num_preemptions > 0
    assert [o.token_ids for o in roomy.outputs] == [o.token_ids for o in got.outputs]
    for a, b in zip(roomy.outputs, got.outputs):
        assert a.logprobs is not None and b.logprobs is not None
        assert [{t: round(v.logprob, 4) for t, v in e.items()} for e in a.logprobs] == [
            {t: round(v.logprob, 4) for t, v in e.items()} for e in b.logprobs
        ]
    assert tight.kv_cache_usage()["num_used_blocks"] == 0


def test_offline_beam_search_api(models: tuple[LLM, torch.nn.Module]) -> None:
    """vLLM's ``LLM.beam_search(prompts, BeamSearchParams)``: ``BeamSearchOutput.sequences``, best
    first, each with the prompt's and the generated ``tokens``, per-token ``logprobs`` (the top
    ``2 * beam_width``), ``cum_logprob`` and ``text``. It did not exist."""
    llm, hf = models
    params = BeamSearchParams(beam_width=2, max_tokens=6)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    same = llm.generate(PROMPTS, SamplingParams(n=2, use_beam_search=True, max_tokens=6, temperature=0))
    assert len(outs) == len(PROMPTS)
    for prompt, out, ref in zip(PROMPTS, outs, same):
        assert isinstance(out, BeamSearchOutput) and len(out.sequences) == 2
        for seq, o in zip(out.sequences, ref.outputs):
            assert seq.tokens == prompt + o.token_ids
            assert seq.cum_logprob == pytest.approx(o.cumulative_logprob)
            assert seq.text == llm.get_tokenizer().decode(seq.tokens)
            assert seq.finish_reason in ("stop", "length")
            _check_against_hf(hf, prompt, o.token_ids, seq.logprobs, 4, seq.cum_logprob)
    text = llm.beam_search([{"prompt": "The capital of France is"}], params)[0]
    assert len(text.sequences) == 2 and all(math.isfinite(s.cum_logprob) for s in text.sequences)
    with pytest.raises(ValueError, match="beam_width"):
        llm.beam_search([{"prompt": "hi"}], BeamSearchParams(beam_width=0, max_tokens=4))
