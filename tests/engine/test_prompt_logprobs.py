"""Prompt logprobs (``SamplingParams(prompt_logprobs=k)``) against HF transformers and PEFT.

Every prompt position after the first gets the prompt token's logprob and rank plus the top k,
equal to ``log_softmax`` of the reference model's logits at the previous position: with chunked
prefill, mixed LoRA batches, a warm prefix cache, preemption, and on quantized bases.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from lorastar import LLM, SamplingParams
from lorastar.engine import prompt_logprobs as plp
from tests.conftest import make_peft_adapter

TOL = 1e-4  # fp32 logprobs, absolute


def _hf_logprobs(model_dir: str, ids: list[int], adapter: str | None = None) -> torch.Tensor:
    """``[len(ids), vocab]`` log_softmax of HF's (or PEFT's) logits over the whole prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def _check(prompt_lps: list, ids: list[int], ref: torch.Tensor, k: int, tol: float = TOL) -> None:
    assert prompt_lps is not None and len(prompt_lps) == len(ids)
    assert prompt_lps[0] is None
    for pos in range(1, len(ids)):
        want = ref[pos - 1]  # [vocab]
        entry = prompt_lps[pos]
        tok = ids[pos]
        got = entry[tok]
        assert abs(got.logprob - want[tok].item()) <= tol, (pos, got.logprob, want[tok].item())
        # Rank as vLLM counts it (ties within the tolerance may order either way).
        lo = int((want > want[tok] + tol).sum()) + 1
        hi = int((want >= want[tok] - tol).sum())
        assert lo <= got.rank <= hi, (pos, got.rank, lo, hi)
        top = sorted((lp for t, lp in entry.items() if lp.rank <= k), key=lambda lp: lp.rank)
        assert len(top) >= k  # the prompt token may be one of them
        ref_top = want.topk(k).values
        for lp, v in zip(top, ref_top.tolist()):
            assert abs(lp.logprob - v) <= tol
        for t, lp in entry.items():
            assert abs(lp.logprob - want[t].item()) <= tol
            assert lp.decoded_token is not None


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> str:  # noqa: ANN001
    return tiny_model_dir("llama-gqa")


@pytest.fixture(scope="module")
def adapters(model_dir: str, tmp_path_factory) -> dict[str, str]:  # noqa: ANN001
    root = tmp_path_factory.mktemp("plp-adapters")
    return {
        "a": make_peft_adapter(model_dir, root / "a", seed=1),
        "b": make_peft_adapter(model_dir, root / "b", seed=2, r=4, targets=("q_proj", "k_proj", "gate_proj")),
    }


def _finish(llm: LLM) -> None:
    llm.engine.check_invariants()
    assert llm.kv_cache_usage()["num_used_blocks"] == 0 or llm.engine.config.enable_prefix_caching
    assert not llm.engine.requests


PROMPTS = [list(range(100, 170)), [5, 6, 7], list(range(900, 937)), [42, 43]]


@pytest.mark.parametrize("chunk", [None, 16])
def test_prompt_logprobs_equal_transformers(model_dir: str, chunk: int | None) -> None:
    """Several prompts in one batch, optionally prefilled 16 tokens a step (chunks straddle
    requests and never align with prompt ends)."""
    llm = LLM(model_dir, num_kv_blocks=128, max_model_len=256, max_num_batched_tokens=chunk)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=4))
    for ids, out in zip(PROMPTS, outs):
        _check(out.prompt_logprobs, ids, _hf_logprobs(model_dir, ids), k=4)
        assert len(out.outputs[0].token_ids) == 3
    _finish(llm)


def test_prompt_logprobs_zero_gives_only_the_prompt_token(model_dir: str) -> None:
    llm = LLM(model_dir, num_kv_blocks=64, max_model_len=256)
    ids = PROMPTS[0]
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    ref = _hf_logprobs(model_dir, ids)
    assert all(list(d) == [t] for d, t in zip(out.prompt_logprobs[1:], ids[1:]))
    _check(out.prompt_logprobs, ids, ref, k=0)
    # Requests without prompt_logprobs report none.
    plain = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1))[0]
    assert plain.prompt_logprobs is None


def test_mixed_lora_batch_equals_peft(model_dir: str, adapters: dict[str, str]) -> None:
    """Base and two adapters in one batch (and steps), each against PEFT."""
    llm = LLM(model_dir, num_kv_blocks=128, max_model_len=256, max_loras=2, max_lora_rank=16,
              max_num_batched_tokens=32)  # fmt: skip
    for name, path in adapters.items():
        llm.load_adapter(name, path)
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    reqs = [
        (eng.add_request(PROMPTS[0], params, adapter="a"), PROMPTS[0], adapters["a"]),
        (eng.add_request(PROMPTS[2], params), PROMPTS[2], None),
        (eng.add_request(PROMPTS[0], params, adapter="b"), PROMPTS[0], adapters["b"]),
    ]
    finals = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                finals[o.request_id] = o
    for req, ids, path in reqs:
        _check(finals[req.request_id].prompt_logprobs, ids, _hf_logprobs(model_dir, ids, path), k=3)
    _finish(llm)


def test_warm_prefix_cache_gives_cold_values(model_dir: str) -> None:
    """A request asking for prompt logprobs computes its whole prompt even when the prefix cache
    holds it (the cached positions' logits were never kept), and equals a cold run; its blocks
    still serve later requests."""
    ids = list(range(300, 365))
    cold = LLM(model_dir, num_kv_blocks=64, max_model_len=256)
    want = cold.generate([ids], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2))[0]

    llm = LLM(model_dir, num_kv_blocks=64, max_model_len=256, enable_prefix_caching=True, block_size=16)
    llm.generate([ids], SamplingParams(temperature=0, max_tokens=2))  # warm the cache
    got = llm.generate([ids], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2))[0]
    assert got.num_cached_tokens == 0
    assert len(got.prompt_logprobs) == len(want.prompt_logprobs)
    for a, b in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
        for t in a:
            assert abs(a[t].logprob - b[t].logprob) <= TOL and a[t].rank == b[t].rank
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    again = llm.generate([ids], SamplingParams(temperature=0, max_tokens=2))[0]
    assert again.num_cached_tokens == 64
    llm.engine.check_invariants()


def test_multiple_choice_contexts_hit_the_prefix_cache_with_kept_logprobs(
    model_dir: str, adapters: dict[str, str]
) -> None:
    """One context, several continuations (lm-eval's multiple choice): the first request keeps its
    full prompt blocks' logprobs; the others hit the prefix cache for the shared context and still
    equal HF at the cached positions, the first computed one and the rest. A smaller k reuses
    (trimmed), a larger k or another adapter misses, and the cache serves PEFT rows the same way."""
    ctx = list(range(300, 340))  # 40 tokens: blocks 0 and 1 are full and shared
    conts = [[500, 501, 502], [600, 601], [700, 701, 702, 703]]
    llm = LLM(model_dir, num_kv_blocks=64, max_model_len=256, enable_prefix_caching=True, block_size=16)
    llm.load_adapter("a", adapters["a"])

    def run(ids: list[int], k: int, adapter: str | None = None):  # noqa: ANN202
        sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k)
        return llm.generate([ids], sp, adapter=adapter)[0]

    outs = [run(ctx + c, 2) for c in conts]
    assert [o.num_cached_tokens for o in outs] == [0, 32, 32]
    for c, o in zip(conts, outs):
        _check(o.prompt_logprobs, ctx + c, _hf_logprobs(model_dir, ctx + c), k=2)
    small, big = run(ctx + [9], 1), run(ctx + [8], 3)
    assert (small.num_cached_tokens, big.num_cached_tokens) == (32, 0)
    _check(small.prompt_logprobs, ctx + [9], _hf_logprobs(model_dir, ctx + [9]), k=1)
    assert all(len(e) <= 2 for e in small.prompt_logprobs[1:])  # the kept top-2, trimmed to k = 1
    _check(big.prompt_logprobs, ctx + [8], _hf_logprobs(model_dir, ctx + [8]), k=3)
    first, second = run(ctx + [7], 1, "a"), run(ctx + [6, 5], 1, "a")
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 32)
    _check(second.prompt_logprobs, ctx + [6, 5], _hf_logprobs(model_dir, ctx + [6, 5], adapters["a"]), k=1)
    assert llm.engine.prompt_logprobs_cache.max_blocks >= len(llm.engine.prompt_logprobs_cache) > 0
    _finish(llm)


def test_preempted_prefill_keeps_its_logprobs(model_dir: str) -> None:
    """A cache too small for all requests at once: sequences are preempted and recomputed; the
    prompt logprobs still equal HF's and nothing leaks."""
    llm = LLM(model_dir, num_kv_blocks=12, block_size=16, max_model_len=160, max_num_batched_tokens=16)
    prompts = [list(range(1000 + 50 * i, 1050 + 50 * i)) for i in range(4)]
    outs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=1)
    )
    assert llm.engine.scheduler.stats.num_preemptions > 0
    for ids, out in zip(prompts, outs):
        _check(out.prompt_logprobs, ids, _hf_logprobs(model_dir, ids), k=1)
    _finish(llm)


def test_n_and_beam_search_report_the_prompt_once(model_dir: str) -> None:
    llm = LLM(model_dir, num_kv_blocks=128, max_model_len=256)
    ids = PROMPTS[2]
    ref = _hf_logprobs(model_dir, ids)
    for params in (
        SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=4, prompt_logprobs=2),
        SamplingParams(n=2, use_beam_search=True, temperature=0, max_tokens=4, prompt_logprobs=2),
    ):
        out = llm.generate([ids], params)[0]
        assert len(out.outputs) == params.n
        _check(out.prompt_logprobs, ids, ref, k=2)
    _finish(llm)


def test_long_prompt_stays_within_the_memory_bound(tiny_model_dir, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """A 4k-token prompt with k=5: logits are projected a block of rows at a time, never
    ``[prompt_len, vocab]`` at once (the spy sees every projection the runner makes)."""
    d = tiny_model_dir("llama-long")
    llm = LLM(d, num_kv_blocks=300, block_size=16, max_model_len=4200, max_num_batched_tokens=1024)
    model = llm.engine.model
    vocab = model.vocab_size
    rows_seen: list[int] = []
    real = model.compute_logits

    def spy(hidden: torch.Tensor) -> torch.Tensor:
        rows_seen.append(hidden.shape[0])
        return real(hidden)

    monkeypatch.setattr(model, "compute_logits", spy)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, vocab, (4096,), generator=g).tolist()
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5))[0]
    bound = plp.rows_per_block(vocab)
    assert max(rows_seen) <= bound and max(rows_seen) * vocab * 4 <= plp.DEFAULT_MAX_BYTES
    assert sum(rows_seen) == 4095 + 1  # every scored position once, plus the sampled row
    assert len(out.prompt_logprobs) == 4096 and all(len(d) >= 5 for d in out.prompt_logprobs[1:])
    # Spot-check against HF on the first positions (the whole 4k forward in HF is slow here).
    ref = _hf_logprobs(d, ids[:200])
    _check(out.prompt_logprobs[:200], ids[:200], ref, k=5)


def test_bad_prompt_logprobs_is_refused() -> None:
    from lorastar.errors import InvalidParamError

    for bad in (-2, 1.5, True):  # over the engine's max_logprobs: tests/engine/test_max_logprobs.py
        with pytest.raises(InvalidParamError) as exc:
            SamplingParams(prompt_logprobs=bad)
        assert exc.value.param == "prompt_logprobs"


QUANT = Path(__file__).resolve().parents[1] / "quant"


@pytest.mark.parametrize("name", ["awq_g32", "gptq_act", "fp8_channel"])
def test_prompt_logprobs_on_quantized_bases(name: str) -> None:
    """On the committed int4 / FP8 fixtures, against the logits transformers recorded with the
    quantization library's own loader (tolerance: the fixture's logit tolerance, as logprobs)."""
    sys.path.insert(0, str(QUANT))
    from quant_fixtures import fixture_dir, have_fixture, reference

    if not have_fixture(name):
        pytest.skip(f"fixture {name} not present")
    ref = reference(name)
    n = int(ref["seq_len"][0])
    ids = ref["input_ids"][0, :n].tolist()
    want = torch.log_softmax(ref["logits"][0, :n].float(), dim=-1)
    tol = (1e-3 if not name.startswith("fp8") else 2e-2) * 2 * float(ref["logits"][0, :n].abs().max())
    llm = LLM(str(fixture_dir(name)), num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=8)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0]
    for pos in range(1, n):
        got = out.prompt_logprobs[pos][ids[pos]].logprob
        assert abs(got - want[pos - 1, ids[pos]].item()) <= tol, (pos, got)
