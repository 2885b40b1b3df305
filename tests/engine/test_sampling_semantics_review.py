"""Sampler semantics against a plain-torch transcription of vLLM v1's sampler (vllm/v1/sample:
allowed ids -> min_tokens -> logit_bias -> penalties -> temperature -> min-p -> top-k -> top-p)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import Tensor

from lorastar.engine.sampler import Sampler, SamplingMetadata, SamplingRow, make_generator
from lorastar.engine.sampling import SamplingParams

_NEG_INF = float("-inf")


def _vllm_processed(
    logits: Tensor, p: SamplingParams, prompt: list[int], output: list[int], eos: int
) -> Tensor:
    """vLLM's logits after allowed ids, min_tokens, logit_bias and penalties (``[V]``)."""
    x = logits.clone().float()
    vocab = x.shape[-1]
    if p.allowed_token_ids is not None:
        banned = torch.ones(vocab, dtype=torch.bool)
        banned[p.allowed_token_ids] = False
        x[banned] = _NEG_INF
    if len(output) < p.min_tokens:
        for t in {*(p.stop_token_ids or ()), eos}:
            x[t] = _NEG_INF
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    prompt_mask = torch.zeros(vocab, dtype=torch.bool)
    prompt_mask[prompt] = True
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab).float()
    out_mask = counts > 0
    pen = torch.where(prompt_mask | out_mask, p.repetition_penalty, 1.0)
    x = x * torch.where(x > 0, 1.0 / pen, pen)
    return x - p.frequency_penalty * counts - p.presence_penalty * out_mask.float()


def _vllm_probs(x: Tensor, p: SamplingParams) -> Tensor:
    """vLLM's sampling distribution from processed logits ``x [V]``: temperature, then min-p (an
    argmax-invariant logits processor), then top-k and top-p (ascending sort, as its sampler)."""
    vocab = x.shape[-1]
    x = x / p.temperature
    if p.min_p > 0:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < probs.amax() * p.min_p, _NEG_INF)
    srt, idx = x.sort(descending=False)
    if 0 < p.top_k < vocab:
        srt = srt.masked_fill(srt < srt[vocab - p.top_k], _NEG_INF)
    if p.top_p < 1.0:
        drop = srt.softmax(-1).cumsum(-1) <= 1 - p.top_p
        drop[-1] = False
        srt = srt.masked_fill(drop, _NEG_INF)
    return torch.empty_like(srt).scatter_(0, idx, srt).softmax(-1)


def _our_probs(x: Tensor, params: list[SamplingParams]) -> Tensor:
    """The sampler's normalized distribution for processed logits ``x [R, V]``."""
    probs = Sampler._probs(x.clone(), SamplingMetadata.from_params(params))
    return probs / probs.sum(-1, keepdim=True)


def test_min_p_truncates_before_top_p_as_vllm() -> None:
    """probs .5 .3 .1 .1, min_p .25 keeps .5 .3 (renormalized .625 .375); vLLM's top-p 0.6 then
    keeps the first token alone. Top-p on the whole distribution first (mass before token 1 is
    .5 < .6) kept both, so token 1 was sampled ~37% of the time where vLLM never samples it."""
    x = torch.tensor([[math.log(v) for v in (0.5, 0.3, 0.1, 0.1)]])
    p = SamplingParams(min_p=0.25, top_p=0.6)
    got = _our_probs(x, [p])[0]
    assert torch.allclose(got, _vllm_probs(x[0], p), atol=1e-6)
    assert got.tolist() == [1.0, 0.0, 0.0, 0.0]
    # End to end: every seeded draw is token 0.
    out = Sampler()(x.repeat(64, 1), [SamplingRow(p, [], [], make_generator(i)) for i in range(64)])
    assert set(out.token_ids) == {0}


@pytest.mark.parametrize("vocab", [50, 6000])
def test_truncation_matches_vllm_at_any_width(vocab: int) -> None:
    """Temperature, min-p, top-k and top-p together, one row each, against vLLM's formula: at a
    small vocabulary and past the top-p search windows (256, 4096 tokens)."""
    gen = torch.Generator().manual_seed(vocab)
    cases = [
        dict(min_p=0.05, top_p=0.8),
        dict(min_p=0.01, top_p=0.95, temperature=1.5),
        dict(min_p=0.2, top_k=20, top_p=0.7, temperature=0.7),
        dict(min_p=0.1),
        dict(top_p=0.9),
        dict(top_k=5, top_p=0.5),
        dict(min_p=1.0),
        dict(temperature=0.5),
    ]
    params = [SamplingParams(**c) for c in cases]  # type: ignore[arg-type]
    scales = [0.5, 1.0, 2.0, 4.0]
    x = torch.stack([torch.randn(vocab, generator=gen) * scales[i % 4] for i in range(len(cases))])
    got = _our_probs(x, params)
    for i, p in enumerate(params):
        want = _vllm_probs(x[i], p)
        assert torch.equal(got[i] > 0, want > 0), cases[i]
        assert torch.allclose(got[i], want, atol=1e-5), cases[i]


def test_pipeline_matches_vllm_on_hand_made_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Random small cases of every logits stage (allowed ids, min_tokens with EOS and stop ids,
    logit_bias, repetition / frequency / presence penalties, temperature, min-p, top-k, top-p):
    the logits the sampler truncates and its distribution equal vLLM's; greedy rows take the
    argmax of the processed logits."""
    seen: dict[str, Tensor] = {}
    orig = Sampler._probs

    def spy(x: Tensor, meta: SamplingMetadata) -> Tensor:
        seen["logits"] = x.clone()
        return orig(x, meta)

    monkeypatch.setattr(Sampler, "_probs", staticmethod(spy))
    rng = np.random.default_rng(0)
    eos = 0
    for case in range(150):
        vocab = int(rng.integers(5, 40))
        logits = torch.tensor(rng.normal(size=vocab) * rng.choice([0.5, 2.0, 5.0]), dtype=torch.float32)
        kw: dict[str, object] = {"temperature": float(rng.choice([0.0, 0.5, 1.0, 1.7]))}
        if rng.random() < 0.5:
            kw["top_k"] = int(rng.integers(1, vocab + 3))
        if rng.random() < 0.5:
            kw["top_p"] = float(rng.choice([0.3, 0.5, 0.8, 0.95]))
        if rng.random() < 0.5:
            kw["min_p"] = float(rng.choice([0.05, 0.1, 0.3]))
        if rng.random() < 0.3:
            kw["repetition_penalty"] = float(rng.choice([0.8, 1.3]))
        if rng.random() < 0.3:
            kw["frequency_penalty"] = float(rng.choice([-0.5, 0.7]))
        if rng.random() < 0.3:
            kw["presence_penalty"] = float(rng.choice([-0.5, 0.7]))
        if rng.random() < 0.2:
            kw["logit_bias"] = {int(rng.integers(0, vocab)): float(rng.normal() * 3)}
        if rng.random() < 0.2:
            kw.update(min_tokens=3, stop_token_ids=[1])
        if rng.random() < 0.1:
            kw["allowed_token_ids"] = sorted({int(t) for t in rng.integers(0, vocab, size=4)})
        p = SamplingParams(**kw)  # type: ignore[arg-type]
        prompt = rng.integers(0, vocab, size=int(rng.integers(1, 6))).tolist()
        output = rng.integers(0, vocab, size=int(rng.integers(0, 6))).tolist()
        want_x = _vllm_processed(logits, p, prompt, output, eos)
        row = SamplingRow(p, prompt, output, make_generator(case))
        seen.clear()
        tok = Sampler(eos_token_id=eos)(logits[None], [row]).token_ids[0]
        if p.is_greedy:
            assert tok == int(want_x.argmax()), kw
            continue
        assert torch.allclose(seen["logits"][0], want_x, atol=1e-5), kw
        got = _our_probs(seen["logits"], [p])[0]
        assert torch.allclose(got, _vllm_probs(want_x, p), atol=1e-5), kw
        assert got[tok] > 0, kw


def test_min_p_rows_do_not_change_other_rows() -> None:
    """A seeded row samples the same tokens alone and beside rows that use min-p / top-p."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 300, generator=gen) * 3
    mine = SamplingParams(temperature=0.9, seed=11, top_k=40)
    others = [SamplingParams(min_p=0.1, top_p=0.9), SamplingParams(min_p=0.3)]

    def run(batch: bool) -> list[int]:
        g = make_generator(11)
        toks = []
        for _ in range(20):
            rows = [SamplingRow(mine, [], [], g)]
            if batch:
                rows += [SamplingRow(o, [], []) for o in others]
            toks.append(Sampler(seed=5)(x if batch else x[:1], rows).token_ids[0])
        return toks

    assert run(True) == run(False)
