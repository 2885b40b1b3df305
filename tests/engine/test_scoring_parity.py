"""Scoring: prompt logprobs and sampled-token logprobs against HF transformers' log-softmax
in the cases ``test_prompt_logprobs.py`` leaves out: prefix-cache hits on prompts of exactly whole
blocks, concurrent requests of different ``k`` sharing a prefix, async scheduling, and the sampled
tokens' logprobs under temperature / top-k / top-p / penalties (vLLM's default ``raw_logprobs``:
the model's log-softmax before any of them)."""

from __future__ import annotations

import pytest
import torch

from lorastar import LLM, SamplingParams

TOL = 1e-4  # fp32 logprobs, absolute (test_prompt_logprobs.py's)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> str:  # noqa: ANN001
    return tiny_model_dir("llama-gqa")


@pytest.fixture(scope="module")
def hf(model_dir: str):  # noqa: ANN201
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def _ref(hf, ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    """``[len(ids), vocab]``: row ``i`` is HF's log-softmax predicting position ``i + 1``."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def _check_entry(entry: dict, tok: int, want: torch.Tensor, k: int) -> None:
    """One position: the token's logprob and rank (ties within TOL may order either way), the top
    k, every entry's value, and no more than the top k plus the token."""
    got = entry[tok]
    assert abs(got.logprob - want[tok].item()) <= TOL, (got.logprob, want[tok].item())
    lo, hi = int((want > want[tok] + TOL).sum()) + 1, int((want >= want[tok] - TOL).sum())
    assert lo <= got.rank <= hi, (got.rank, lo, hi)
    top = sorted((lp.logprob for lp in entry.values() if lp.rank <= k), reverse=True)
    assert len(top) >= k
    for a, b in zip(top, want.topk(k).values.tolist()) if k else ():
        assert abs(a - b) <= TOL
    for t, lp in entry.items():
        assert abs(lp.logprob - want[t].item()) <= TOL
    assert len(entry) <= k + 1


def _check_prompt(hf, out, ids: list[int], k: int) -> None:  # noqa: ANN001
    ref = _ref(hf, ids)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids)
    assert out.prompt_logprobs[0] is None
    for pos in range(1, len(ids)):
        _check_entry(out.prompt_logprobs[pos], ids[pos], ref[pos - 1], k)


@pytest.mark.parametrize("chunk", [None, 8])
def test_prefix_hits_on_whole_block_prompts_equal_hf(model_dir: str, hf, chunk: int | None) -> None:  # noqa: ANN001
    """Prompts of 16, 32 and 33 tokens (block 16) sent twice, then extended: the second run hits
    every full block but the last (its last token must run), the extension hits all of them; every
    position equals HF whatever was served from the kept blocks."""
    for n in (16, 32, 33):
        llm = LLM(model_dir, num_kv_blocks=64, max_model_len=256, enable_prefix_caching=True,
                  block_size=16, max_num_batched_tokens=chunk)  # fmt: skip
        ids = list(range(400, 400 + n))
        sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
        first = llm.generate([ids], sp)[0]
        second = llm.generate([ids], sp)[0]
        ext = llm.generate([ids + [7, 8, 9]], sp)[0]
        assert first.num_cached_tokens == 0
        assert second.num_cached_tokens == 16 * ((n - 1) // 16)
        assert ext.num_cached_tokens == 16 * (n // 16)
        for out, p in ((first, ids), (second, ids), (ext, ids + [7, 8, 9])):
            _check_prompt(hf, out, p, 2)
        llm.engine.check_invariants()


@pytest.mark.parametrize("chunk", [None, 8])
def test_concurrent_requests_of_different_k_share_a_prefix(model_dir: str, hf, chunk: int | None) -> None:  # noqa: ANN001
    """One step admits a plain request and prompt-logprob requests of k = 1, 5, 0, 5, 1 on one
    48-token context: kept blocks serve only a k they hold, and every request equals HF."""
    llm = LLM(model_dir, num_kv_blocks=64, max_model_len=256, enable_prefix_caching=True,
              block_size=16, max_num_batched_tokens=chunk)  # fmt: skip
    eng = llm.engine
    ctx = list(range(300, 350))
    specs = [(None, [1]), (1, [2, 3]), (5, [4]), (0, [5, 6, 7]), (5, [8]), (1, [9])]
    reqs = [
        (eng.add_request(ctx + c, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=k)), k, ctx + c)
        for k, c in specs
    ]
    finals = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                finals[o.request_id] = o
    for req, k, ids in reqs:
        out = finals[req.request_id]
        if k is None:
            assert out.prompt_logprobs is None
        else:
            _check_prompt(hf, out, ids, k)
    assert any(finals[r.request_id].num_cached_tokens for r, _, _ in reqs[3:])  # some hit
    eng.check_invariants()


def test_prompt_logprobs_under_async_scheduling(model_dir: str, hf) -> None:  # noqa: ANN001
    """A scoring request arriving while a plain request's async step is in flight, and another
    that hits its kept blocks: both equal HF."""
    llm = LLM(model_dir, num_kv_blocks=64, max_model_len=256, enable_prefix_caching=True, block_size=16,
              max_num_batched_tokens=8, async_scheduling=True)  # fmt: skip
    eng = llm.engine
    ctx = list(range(300, 350))
    finals = {}

    def steps(n: int | None) -> None:
        i = 0
        while eng.has_unfinished() and (n is None or i < n):
            for o in eng.step():
                if o.finished:
                    finals[o.request_id] = o
            i += 1

    eng.add_request(ctx + [1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    steps(3)
    a = eng.add_request(
        ctx + [2, 3], SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2, logprobs=2)
    )
    steps(2)
    b = eng.add_request(ctx + [4], SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2))
    steps(None)
    _check_prompt(hf, finals[a.request_id], ctx + [2, 3], 2)
    _check_prompt(hf, finals[b.request_id], ctx + [4], 2)
    assert finals[b.request_id].num_cached_tokens == 48
    eng.check_invariants()


SAMPLING = [
    dict(temperature=0),
    dict(temperature=0.3, seed=1),
    dict(temperature=2.0, seed=1, top_k=5),
    dict(temperature=0.7, top_p=0.5, seed=2),
    dict(temperature=0.8, min_p=0.2, seed=4),
    dict(temperature=1.0, repetition_penalty=1.5, seed=3),
    dict(temperature=0, presence_penalty=1.0, frequency_penalty=0.5),
    dict(temperature=0, logit_bias={5: 100.0}),
]


def test_sampled_logprobs_are_the_raw_model_logprobs(model_dir: str, hf) -> None:  # noqa: ANN001
    """vLLM's default ``logprobs_mode`` (``raw_logprobs``): every sampled token's logprob, rank and
    top k are HF's log-softmax at its position, before temperature, truncation, penalties and
    logit_bias; ``cumulative_logprob`` is their sum. Also on a prefix-cache hit."""
    llm = LLM(model_dir, num_kv_blocks=64, max_model_len=256, enable_prefix_caching=True, block_size=16)
    ids = list(range(300, 340))
    for kw in SAMPLING:
        out = llm.generate([ids], SamplingParams(max_tokens=5, logprobs=3, ignore_eos=True, **kw))[0]
        o = out.outputs[0]
        ref = _ref(hf, ids + o.token_ids)
        assert len(o.logprobs) == len(o.token_ids) == 5
        for i, (tok, step) in enumerate(zip(o.token_ids, o.logprobs)):
            _check_entry(step, tok, ref[len(ids) - 1 + i], 3)
        total = sum(step[t].logprob for t, step in zip(o.token_ids, o.logprobs))
        assert abs(o.cumulative_logprob - total) <= 1e-3
    assert out.num_cached_tokens == 32


def test_a_token_tied_for_the_top_is_reported_at_rank_1(model_dir: str) -> None:
    llm = LLM(model_dir, num_kv_blocks=64, max_model_len=256)
    model = llm.engine.model
    real = model.compute_logits

    def tied(hidden: torch.Tensor) -> torch.Tensor:
        x = real(hidden).zero_()
        x[:, 3] = x[:, 7] = 5.0  # tokens 3 and 7 tie for the top
        return x

    model.compute_logits = tied
    out = llm.generate(
        [[1, 3, 7]], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1, logprobs=1)
    )[0]
    # numpy's argmax (the top 1) is the first maximum: token 3, the prompt's token at position 1
    # and the greedy token; vLLM reports both at rank 1.
    assert {t: lp.rank for t, lp in out.prompt_logprobs[1].items()} == {3: 1}
    assert out.outputs[0].token_ids == [3]
    assert {t: lp.rank for t, lp in out.outputs[0].logprobs[0].items()} == {3: 1}
