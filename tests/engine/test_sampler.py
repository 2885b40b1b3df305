"""Sampler: greedy, truncation masks, penalties, min_tokens, seeded batch invariance, logprobs."""

from __future__ import annotations

import math
import random

import pytest
import torch

from lorastar.engine.sampler import PendingTokens, Sampler, SamplerOutput, SamplingRow, make_generator
from lorastar.engine.sampling import SamplingParams


def _row(
    params: SamplingParams,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    generator: torch.Generator | None = None,
    eos: tuple[int, ...] = (),
) -> SamplingRow:
    return SamplingRow(
        params=params,
        prompt_token_ids=prompt or [],
        output_token_ids=output or [],
        generator=generator,
        eos_token_ids=eos,
    )


def _sample_support(logits_row: list[float], params: SamplingParams, n: int = 4000) -> torch.Tensor:
    """Sample n times (one batch of n identical rows); returns the empirical distribution [V]."""
    x = torch.tensor([logits_row], dtype=torch.float32).repeat(n, 1)  # [n, V]
    out = Sampler(seed=123)(x, [_row(params) for _ in range(n)])
    return torch.bincount(torch.tensor(out.token_ids), minlength=len(logits_row)).float() / n


def _logits_of(probs: list[float]) -> list[float]:
    return [math.log(p) for p in probs]


# ---------------------------------------------------------------------- greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_greedy_is_argmax(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(7, 50).to(dtype)  # [R, V]
    out = Sampler()(x, [_row(SamplingParams(temperature=0.0)) for _ in range(7)])
    assert out.token_ids == x.float().argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 7


def test_greedy_picks_the_first_maximum_and_never_a_nan() -> None:
    """Greedy as HF's argmax (the first of tied maxima), NaN never chosen over a real value, an
    all-NaN row gives 0, infinities compare as themselves; rows at a real vocabulary width."""
    torch.manual_seed(1)
    x = torch.randn(6, 49152)  # [R, V]
    x[0, 10] = x[0, 20] = 50.0  # tie: the first
    x[1, 5] = math.nan  # a NaN before the maximum
    x[1, 300] = 40.0
    x[2] = math.nan  # all NaN
    x[3, 7] = math.inf
    x[3, 8] = math.nan
    x[4] = -math.inf
    x[4, 9000] = -1e30
    rows = [_row(SamplingParams(temperature=0.0)) for _ in range(6)]
    got = Sampler()(x, rows).token_ids
    want = torch.nan_to_num(x, nan=-math.inf, posinf=math.inf, neginf=-math.inf).argmax(dim=-1).tolist()
    assert got == want and got[:5] == [10, 300, 0, 7, 9000]


def test_greedy_ignores_truncation_and_seed() -> None:
    x = torch.tensor([[0.1, 3.0, 2.9, -1.0]])
    p = SamplingParams(temperature=0.0, top_k=2, top_p=0.1, min_p=0.5, seed=5)
    for _ in range(5):
        assert Sampler()(x, [_row(p, generator=make_generator(5))]).token_ids == [1]


# ---------------------------------------------------------------------- truncation masks


PROBS = [0.4, 0.3, 0.15, 0.1, 0.05]


def test_unrestricted_sampling_matches_distribution() -> None:
    freq = _sample_support(_logits_of(PROBS), SamplingParams(), n=20000)
    assert torch.allclose(freq, torch.tensor(PROBS), atol=0.015)


def test_top_k_support() -> None:
    freq = _sample_support(_logits_of(PROBS), SamplingParams(top_k=2))
    assert set(freq.nonzero().flatten().tolist()) == {0, 1}
    assert torch.allclose(freq[:2], torch.tensor([4 / 7, 3 / 7]), atol=0.03)


def test_top_p_support() -> None:
    # Mass before each token: 0, .4, .7, .85, .95 -> top_p=.75 keeps tokens 0,1,2.
    freq = _sample_support(_logits_of(PROBS), SamplingParams(top_p=0.75))
    assert set(freq.nonzero().flatten().tolist()) == {0, 1, 2}
    assert torch.allclose(freq[:3], torch.tensor([0.4, 0.3, 0.15]) / 0.85, atol=0.03)


def test_top_p_keeps_at_least_one() -> None:
    freq = _sample_support(_logits_of(PROBS), SamplingParams(top_p=0.01), n=500)
    assert freq[0].item() == 1.0


def test_min_p_support() -> None:
    # Threshold .2 * .4 = .08: tokens 0,1,2,3 stay, token 4 (.05) goes.
    freq = _sample_support(_logits_of(PROBS), SamplingParams(min_p=0.2))
    assert set(freq.nonzero().flatten().tolist()) == {0, 1, 2, 3}


def test_top_k_then_top_p() -> None:
    # top_k=3 renormalizes to .4/.85, .3/.85, .15/.85 = .47, .35, .18; top_p=.8 then keeps 0,1.
    freq = _sample_support(_logits_of(PROBS), SamplingParams(top_k=3, top_p=0.8))
    assert set(freq.nonzero().flatten().tolist()) == {0, 1}


def test_temperature_reshapes_distribution() -> None:
    logits = _logits_of(PROBS)
    t = 2.0
    expected = torch.softmax(torch.tensor(logits) / t, dim=-1)
    freq = _sample_support(logits, SamplingParams(temperature=t), n=20000)
    assert torch.allclose(freq, expected, atol=0.015)


def test_mixed_batch_rows_use_their_own_params() -> None:
    n = 2000
    logits = torch.tensor([_logits_of(PROBS)]).repeat(3 * n, 1)  # [3n, V]
    rows = (
        [_row(SamplingParams(top_k=1))] * n
        + [_row(SamplingParams(top_p=0.75))] * n
        + [_row(SamplingParams(temperature=0.0))] * n
    )
    toks = torch.tensor(Sampler(seed=1)(logits, rows).token_ids)
    assert set(toks[:n].tolist()) == {0}
    assert set(toks[n : 2 * n].tolist()) == {0, 1, 2}
    assert set(toks[2 * n :].tolist()) == {0}


# ---------------------------------------------------------------------- penalties


def test_penalties_hand_computed() -> None:
    x = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.0, 0.0]])  # [1, 6]
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    row = _row(p, prompt=[0, 1], output=[2, 2, 3])
    Sampler()._apply_penalties(x, [row], 6)
    # repetition over prompt+output {0,1,2,3}: 2->1, -1->-2, .5->.25, -.5->-1
    # frequency (output counts 2:2, 3:1) and presence (2, 3): 2: .25-1-.25, 3: -1-.5-.25
    assert torch.allclose(x, torch.tensor([[1.0, -2.0, -1.0, -1.75, 1.0, 0.0]]))


def test_frequency_presence_ignore_prompt() -> None:
    x = torch.tensor([[1.0, 1.0, 1.0]])
    row = _row(SamplingParams(frequency_penalty=1.0, presence_penalty=1.0), prompt=[0, 0, 1], output=[2])
    Sampler()._apply_penalties(x, [row], 3)
    assert x.tolist() == [[1.0, 1.0, -1.0]]


def test_penalties_batched_per_row() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    rows = [
        _row(SamplingParams(repetition_penalty=1.5), prompt=[2], output=[]),
        _row(SamplingParams(), prompt=[2], output=[2, 2]),  # no penalties: untouched
        _row(SamplingParams(frequency_penalty=-1.0), prompt=[], output=[0, 0, 1]),
    ]
    Sampler()._apply_penalties(x, rows, 3)
    assert torch.allclose(x, torch.tensor([[1.0, 2.0, 2.0], [1.0, 2.0, 3.0], [3.0, 3.0, 3.0]]))


def test_penalty_changes_greedy_choice() -> None:
    x = torch.tensor([[5.0, 4.0, 0.0]])
    p = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    assert Sampler()(x, [_row(p, output=[0])]).token_ids == [1]  # 5/1.5 < 4
    assert Sampler()(x, [_row(p, output=[1])]).token_ids == [0]


# ---------------------------------------------------------------------- min_tokens


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    x = torch.tensor([[0.0, 1.0, 9.0, 8.0]])  # eos=2 best, stop id 3 next
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3])
    s = Sampler(eos_token_id=2)
    assert s(x, [_row(p, output=[0])]).token_ids == [1]
    assert s(x, [_row(p, output=[0, 0])]).token_ids == [2]
    # Per-row eos ids work too, and ignore_eos still bans EOS until min_tokens (vLLM's
    # all_stop_token_ids holds EOS whatever ignore_eos says); after that EOS is a token like any other.
    assert Sampler()(x, [_row(p, output=[], eos=(2,))]).token_ids == [1]
    p2 = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)
    assert Sampler(eos_token_id=[2])(x, [_row(p2)]).token_ids == [3]
    assert Sampler()(x, [_row(p2, output=[0], eos=(2,))]).token_ids == [3]
    assert Sampler(eos_token_id=[2])(x, [_row(p2, output=[0, 0])]).token_ids == [2]


# ---------------------------------------------------------------------- seeded determinism


def _seeded_run(
    steps: list[torch.Tensor],
    params: SamplingParams,
    seed: int,
    position: int,
    others: list[SamplingParams],
    sampler_seed: int,
) -> list[int]:
    """Run `steps` decode steps of one seeded row placed at `position` among `others`."""
    gen = make_generator(seed)
    sampler = Sampler(seed=sampler_seed)
    torch.manual_seed(sampler_seed + 99)
    out: list[int] = []
    other_out: list[list[int]] = [[] for _ in others]
    for logits in steps:  # logits: [V]
        rows = [_row(p, prompt=[1, 2, 3], output=o) for p, o in zip(others, other_out)]
        rows.insert(position, _row(params, prompt=[1, 2, 3], output=list(out), generator=gen))
        batch = torch.randn(len(rows), logits.numel()) * 3  # [R, V] noise for the other rows
        batch[position] = logits
        toks = sampler(batch, rows).token_ids
        out.append(toks[position])
        for o, t in zip(other_out, toks[:position] + toks[position + 1 :]):
            o.append(t)
    return out


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(seed=7),
        SamplingParams(seed=7, top_k=20, top_p=0.9, temperature=0.8),
        SamplingParams(seed=7, min_p=0.05, repetition_penalty=1.2, frequency_penalty=0.3),
    ],
)
def test_seeded_row_is_batch_invariant(params: SamplingParams) -> None:
    torch.manual_seed(0)
    steps = [torch.randn(300) * 2 for _ in range(8)]  # [V] each
    alone = _seeded_run(steps, params, 7, 0, [], sampler_seed=0)
    assert len(set(alone)) > 1  # actually random
    others_sets = [
        [SamplingParams()],
        [SamplingParams(temperature=0.0), SamplingParams(top_k=5, min_p=0.1)],
        [
            SamplingParams(seed=3),
            SamplingParams(presence_penalty=1.0),
            SamplingParams(top_p=0.5),
            SamplingParams(repetition_penalty=1.5, temperature=0.0),
            SamplingParams(logprobs=3),
        ],
    ]
    for others in others_sets:
        for position in {0, len(others) // 2, len(others)}:
            got = _seeded_run(steps, params, 7, position, others, sampler_seed=position + 10)
            assert got == alone, (others, position)
    # A different seed gives a different stream.
    assert _seeded_run(steps, params, 8, 0, [], sampler_seed=0) != alone


def test_unseeded_rows_follow_sampler_seed() -> None:
    x = torch.randn(4, 100)
    rows = [_row(SamplingParams()) for _ in range(4)]
    assert Sampler(seed=5)(x, rows).token_ids == Sampler(seed=5)(x, rows).token_ids


# ---------------------------------------------------------------------- logprobs


def _check_logprobs(x: torch.Tensor, out: SamplerOutput, ks: dict[int, int]) -> None:
    """Row ``i`` asked for the top ``ks[i]``: its entries are the sampled token and the top k of
    the raw logits' log_softmax, with vLLM's ranks (tokens at least as likely)."""
    raw = torch.log_softmax(x, dim=-1)  # logprobs come from the raw logits
    for i, k in ks.items():
        lp = out.logprobs[i]
        assert lp is not None
        tok = out.token_ids[i]
        top = raw[i].topk(k).indices.tolist() if k else []
        assert set(lp) == set(top) | {tok}
        for rank, t in enumerate(top, start=1):
            assert lp[t][1] == rank
        for t, (v, rank) in lp.items():
            assert v == pytest.approx(raw[i, t].item(), abs=1e-6)
            assert rank == int((raw[i] >= raw[i, t]).sum())


def test_logprobs_shape_rank_values() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 64)  # [R, V]
    rows = [
        _row(SamplingParams(logprobs=5, temperature=0.7, repetition_penalty=1.3), output=[1, 2]),
        _row(SamplingParams(logprobs=0)),
        _row(SamplingParams()),
        _row(SamplingParams(logprobs=3, temperature=0.0)),
    ]
    out: SamplerOutput = Sampler(seed=0)(x.clone(), rows)
    assert out.logprobs[2] is None
    _check_logprobs(x, out, {0: 5, 1: 0, 3: 3})
    assert out.logprobs[3] is not None and out.logprobs[3][out.token_ids[3]][1] == 1  # greedy: rank 1


def test_logprobs_top1_on_every_row() -> None:
    """Every row asks (no row gather) and the largest k is 1 (the CPU path's argmax top 1)."""
    torch.manual_seed(1)
    x = torch.randn(5, 300) * 4
    rows = [_row(SamplingParams(logprobs=1, temperature=t)) for t in (0.0, 0.9, 1.5, 0.0)]
    rows.append(_row(SamplingParams(logprobs=0, temperature=1.0)))
    out = Sampler(seed=0)(x.clone(), rows)
    _check_logprobs(x, out, {0: 1, 1: 1, 2: 1, 3: 1, 4: 0})


def test_empty_batch_and_row_mismatch() -> None:
    assert Sampler()(torch.empty(0, 10), []) == SamplerOutput(token_ids=[], logprobs=[])
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 10), [_row(SamplingParams())])


# ---------------------------------------------------------------------- truncation vs a reference


def _reference_keep(row: torch.Tensor, k: int, p: float) -> set[int]:
    """Plain per-row top-k then top-p (nucleus of the renormalized top-k), by full sort."""
    order = torch.argsort(row, descending=True).tolist()
    if 0 < k < len(order):
        order = order[:k]
    probs = torch.softmax(row[order].double(), dim=-1).tolist()
    if p >= 1.0:
        return set(order)
    kept, mass = [], 0.0
    for t, q in zip(order, probs):
        if kept and mass >= p:
            break
        kept.append(t)
        mass += q
    return set(kept)


@pytest.mark.parametrize("vocab", [50, 1000])
def test_top_k_top_p_matches_reference(vocab: int) -> None:
    from lorastar.engine.sampler import _top_k_top_p

    torch.manual_seed(vocab)
    # Peaked and flat rows: flat top-p-only rows need the full-sort fallback past the window.
    cases = [(0, 0.9, 4.0), (0, 0.5, 0.3), (10, 1.0, 1.0), (400, 0.95, 0.5), (5, 0.3, 2.0), (0, 1.0, 1.0),
             (0, 0.99, 0.1), (1, 0.5, 1.0)]  # fmt: skip
    x = torch.stack([torch.randn(vocab) * scale for _, _, scale in cases])  # [R, V]
    out = _top_k_top_p(x.clone(), [k for k, _, _ in cases], [p for _, p, _ in cases])
    for i, (k, p, _) in enumerate(cases):
        kept = set(torch.isfinite(out[i]).nonzero().flatten().tolist())
        assert kept == _reference_keep(x[i], k, p), (vocab, k, p)
        assert torch.equal(out[i][torch.isfinite(out[i])], x[i][torch.isfinite(out[i])])  # values untouched


def test_caller_logits_untouched() -> None:
    torch.manual_seed(1)
    x = torch.randn(3, 40)
    before = x.clone()
    rows = [
        _row(SamplingParams(repetition_penalty=1.5, min_tokens=2), prompt=[1, 2], output=[3], eos=(0,)),
        _row(SamplingParams(top_k=3, top_p=0.5, min_p=0.2, temperature=0.5)),
        _row(SamplingParams(temperature=0.0, presence_penalty=1.0), output=[5]),
    ]
    Sampler()(x, rows)
    Sampler()(x[1:2], rows[1:2])
    assert torch.equal(x, before)


def test_logit_bias_is_added_before_sampling_and_clamped() -> None:
    logits = torch.tensor([[3.0, 1.0, 0.0, -1.0]] * 3)  # [R, V]
    greedy = SamplingParams(temperature=0, max_tokens=4)
    rows = [
        _row(greedy),
        _row(SamplingParams(temperature=0, max_tokens=4, logit_bias={0: -5.0})),  # 3-5 < 1: token 1
        _row(SamplingParams(temperature=1.0, max_tokens=4, logit_bias={3: 1e9, 99: 100.0})),  # clamped 100
    ]
    assert rows[2].params.logit_bias == {3: 100.0, 99: 100.0}
    before = logits.clone()
    out = Sampler(seed=0)(logits, rows)
    assert out.token_ids == [0, 1, 3]  # +100 leaves the other tokens ~e^-96 of the mass
    assert torch.equal(logits, before)  # the caller's logits are untouched
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={"1": 2.0})  # type: ignore[dict-item]


def test_allowed_token_ids_keep_only_those_ids() -> None:
    """vLLM's allowed_token_ids: greedy picks the best allowed id, draws stay in the set, a bias
    applies among the allowed ids, other rows are untouched, and logprobs stay the raw ones."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 32, generator=g)  # [R, V]
    allowed = [3, 7, 9, 31]
    rows = [
        _row(SamplingParams(temperature=0, allowed_token_ids=allowed, logprobs=2)),
        _row(SamplingParams(temperature=1.5, seed=1, allowed_token_ids=[1, 2, 1])),
        _row(SamplingParams(temperature=0)),
        _row(SamplingParams(temperature=0, allowed_token_ids=allowed, logit_bias={7: 100.0, 5: 100.0})),
        _row(SamplingParams(temperature=2.0, top_k=3, allowed_token_ids=allowed)),
    ]
    assert rows[1].params.allowed_token_ids == [1, 2]  # duplicates dropped
    sampler = Sampler(seed=0)
    draws = [sampler(x.clone(), rows).token_ids for _ in range(40)]
    out = sampler(x.clone(), rows)
    assert out.token_ids[0] == max(allowed, key=lambda t: x[0, t].item())
    assert out.token_ids[2] == int(x[2].argmax())
    assert out.token_ids[3] == 7  # +100 on 5 does not make a disallowed id possible
    assert {d[1] for d in draws} == {1, 2} and {d[4] for d in draws} <= set(allowed)
    _check_logprobs(x, out, {0: 2})
    for bad in ([], [-1], [1.5], "12"):
        with pytest.raises(ValueError, match="allowed_token_ids"):
            SamplingParams(allowed_token_ids=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[1], use_beam_search=True, n=2)


def test_allowed_token_ids_hold_when_min_tokens_bans_them_all() -> None:
    """allowed_token_ids is a whitelist no other mask overrides: a row whose allowed ids are all
    EOS while min_tokens bans EOS samples its allowed id (every logit -inf fell back to token 0
    before), greedy and random alike; a row with an allowed id left samples as usual."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 32, generator=g)  # [R, V]
    x[:, 9] = 5.0  # the best token, allowed in row 2 only
    only_eos = {"allowed_token_ids": [5], "min_tokens": 2}
    rows = [
        _row(SamplingParams(temperature=0, **only_eos), eos=(5,)),
        _row(SamplingParams(temperature=1.0, seed=3, **only_eos), eos=(5,)),
        _row(SamplingParams(temperature=0, allowed_token_ids=[5, 9], min_tokens=2), eos=(5,)),
        _row(SamplingParams(temperature=0, **only_eos), output=[1, 2], eos=(5,)),  # min_tokens reached
    ]
    assert Sampler(seed=0)(x.clone(), rows).token_ids == [5, 5, 9, 5]


def test_logit_bias_of_many_rows_equals_a_dense_add() -> None:
    """The batch's biases as one scatter (arrays kept per request): greedy picks equal
    ``argmax(logits + dense bias)`` row by row, with one request's params shared by several rows (n > 1)."""
    g = torch.Generator().manual_seed(0)
    vocab = 64
    logits = torch.randn(7, vocab, generator=g)  # [R, V]
    shared = SamplingParams(
        temperature=0, logit_bias={int(t): 4.0 for t in torch.randperm(vocab, generator=g)[:20]}
    )
    own = [
        SamplingParams(temperature=0, logit_bias={int(t): float(v) for t, v in zip(toks, vals, strict=True)})
        for toks, vals in (
            (torch.randperm(vocab, generator=g)[:k], torch.randn(k, generator=g) * 3) for k in (1, 9, 40)
        )
    ]
    params = [shared, own[0], shared, SamplingParams(temperature=0), own[1], shared, own[2]]
    dense = torch.zeros(7, vocab)  # [R, V]
    for i, p in enumerate(params):
        for t, v in (p.logit_bias or {}).items():
            dense[i, t] = v
    out = Sampler()(logits, [_row(p) for p in params])
    assert out.token_ids == (logits + dense).argmax(-1).tolist()


@pytest.mark.parametrize("search_window", [True, False])
def test_top_p_windows_equal_the_full_sort(search_window: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """top-p finds its cut among the best 256 tokens, then 4096, then sorts the row: whichever
    tier a row needs, its mask is the full sort's (rows with nuclei of ~3, ~1000 and ~20000
    tokens at a 49,152 vocabulary, and top-k rows beside them). Without the window search (CUDA:
    no read back) every active row is sorted whole, to the same masks."""
    import lorastar.engine.sampler as sampler_mod
    from lorastar.engine.sampler import _top_k_top_p

    wider = sampler_mod._nucleus_in_window
    calls: list[int] = []
    monkeypatch.setattr(sampler_mod, "_nucleus_in_window", lambda *a: calls.append(1) or wider(*a))

    gen = torch.Generator().manual_seed(5)
    v = 49152
    x = torch.randn(6, v, generator=gen) * 0.01  # near-flat rows: the nucleus is most of the vocabulary
    x[0, :3] += 20.0  # a peaked row
    x[1, :1000] += 8.0 + torch.rand(1000, generator=gen)  # mass spread over ~1000 tokens
    x[3, :3] += 20.0
    top_p = [0.95, 0.95, 0.9, 0.5, 0.99, 1.0]
    top_k = [0, 0, 0, 2, 0, 40]
    got = _top_k_top_p(x.clone(), top_k, top_p, search_window=search_window)
    for r in range(6):
        row = x[r]
        if top_k[r]:
            kth = row.topk(top_k[r]).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        sv, order = torch.sort(row, descending=True, stable=True)
        sp = torch.softmax(sv, dim=-1)
        drop = (sp.cumsum(-1) - sp) >= (top_p[r] if top_p[r] < 1.0 else 2.0)
        drop[0] = False
        want = row.masked_fill(torch.zeros_like(drop).scatter_(0, order, drop), float("-inf"))
        kept = torch.isfinite(got[r])
        assert torch.equal(kept, torch.isfinite(want)), r
        assert torch.equal(got[r][kept], x[r][kept])
    sizes = torch.isfinite(got).sum(-1).tolist()
    assert sizes[0] <= 3 and 256 < sizes[1] < 4096 and sizes[2] > 4096 and sizes[3] == 1 and sizes[5] == 40
    assert bool(calls) == search_window  # the wider window's search follows a read back


def test_sparse_penalties_equal_the_dense_form_bitwise() -> None:
    """The penalties touch only the (row, token) pairs that occur; the result is the dense form's,
    bit for bit: repetition over prompt + output, then x - frequency * count - presence."""
    gen = torch.Generator().manual_seed(9)
    v, r = 1000, 8
    x = torch.randn(r, v, generator=gen) * 3
    rng = random.Random(4)
    rows = []
    for i in range(r):
        prompt = [rng.randrange(-2, v + 2) for _ in range(rng.randrange(0, 60))]  # a few out of range
        output = [rng.randrange(0, 50) for _ in range(rng.randrange(0, 40))]  # repeats
        p = SamplingParams(
            repetition_penalty=[1.0, 1.3, 0.7][i % 3], frequency_penalty=[0.0, 0.4][i % 2],
            presence_penalty=[0.0, -0.6, 1.1][i % 3],
        )  # fmt: skip
        rows.append(_row(p, prompt=prompt, output=output))
    got = x.clone()
    Sampler()._apply_penalties(got, rows, v)
    want = _dense_penalties(x, rows, v)
    assert torch.equal(got, want)
    assert not torch.equal(got, x)


def test_penalties_with_the_last_token_on_the_device_equal_it_known() -> None:
    """Async scheduling: a row's last output id is a placeholder whose token is still on the
    device (``PendingTokens``). The penalties equal those with the token known on the host, bit for
    bit, whether that token is new to the row, already in its output (counts > 1), only in its
    prompt, or the row has no other output; rows without a placeholder are unaffected."""
    gen = torch.Generator().manual_seed(5)
    v, r = 120, 10
    rng = random.Random(6)
    known_rows, pending_rows, prev_ids, pend, src = [], [], [], [], []
    for i in range(r):
        prompt = [rng.randrange(0, v) for _ in range(rng.randrange(0, 20))]
        output = [rng.randrange(0, 15) for _ in range(rng.randrange(0, 12))]  # repeats
        p = SamplingParams(
            repetition_penalty=[1.0, 1.3, 0.7, 1.1][i % 4], frequency_penalty=[0.0, 0.4, -0.9][i % 3],
            presence_penalty=[0.0, -0.6, 1.1][i % 3],
        )  # fmt: skip
        if i % 5 == 4:  # no placeholder on this row
            known_rows.append(_row(p, prompt=prompt, output=output))
            pending_rows.append(_row(p, prompt=prompt, output=list(output)))
            continue
        last = [rng.randrange(0, 15), *(prompt[:1] or [3]), v - 1][i % 3]  # often seen, or a prompt id
        known_rows.append(_row(p, prompt=prompt, output=[*output, last]))
        pending_rows.append(_row(p, prompt=prompt, output=[*output, 0]))  # 0: the placeholder's value
        pend.append(i)
        src.append(len(prev_ids) + 1)
        prev_ids += [rng.randrange(0, v), last]  # the previous step's ids, the token at src
    x = torch.randn(r, v, generator=gen) * 3
    want = x.clone()
    Sampler()._apply_penalties(want, known_rows, v)
    assert torch.equal(want, _dense_penalties(x, known_rows, v))
    got = x.clone()
    Sampler()._apply_penalties(got, pending_rows, v, pending=PendingTokens(torch.tensor(prev_ids), pend, src))
    assert torch.equal(got, want)
    wrong = x.clone()
    Sampler()._apply_penalties(wrong, pending_rows, v)  # the placeholder taken for a token
    assert not torch.equal(wrong, want)


def _dense_penalties(x: torch.Tensor, rows: list[SamplingRow], v: int) -> torch.Tensor:
    """The penalties over the whole [R, V] (vLLM's form): repetition over prompt + output, then
    x - frequency * count - presence * [count > 0] over the output."""
    r = len(rows)
    want = x.clone()
    counts = torch.zeros(r, v)
    seen = torch.zeros(r, v, dtype=torch.bool)
    for i, row in enumerate(rows):
        for t in row.output_token_ids:
            counts[i, t] += 1
        for t in [*row.prompt_token_ids, *row.output_token_ids]:
            if 0 <= t < v:
                seen[i, t] = True
    rp = torch.tensor([row.params.repetition_penalty for row in rows]).unsqueeze(1)
    want = torch.where(seen, torch.where(want > 0, want / rp, want * rp), want)
    fp = torch.tensor([row.params.frequency_penalty for row in rows]).unsqueeze(1)
    pp = torch.tensor([row.params.presence_penalty for row in rows]).unsqueeze(1)
    return want.sub(fp * counts).sub(pp * (counts > 0).float())


def test_penalties_follow_a_growing_output_with_the_prompt_kept_on_the_row() -> None:
    """A row's prompt ids are read once and kept on the row; its output keeps growing (the engine's
    rows view the sequence's tokens): every step still equals the dense form, the kept ids hold the
    prompt only, and a token first generated later is penalized from that step on."""
    gen = torch.Generator().manual_seed(3)
    v = 300
    rng = random.Random(8)
    outputs: list[list[int]] = [[rng.randrange(0, v)] for _ in range(4)]
    rows = [  # the rows hold the very lists that grow below
        SamplingRow(SamplingParams(repetition_penalty=rp, frequency_penalty=0.2),
                    [rng.randrange(-1, v + 1) for _ in range(50)], out)
        for rp, out in zip([1.4, 0.6, 1.0, 2.0], outputs)
    ]  # fmt: skip
    sampler = Sampler()
    for _ in range(6):
        x = torch.randn(len(rows), v, generator=gen) * 3
        got = x.clone()
        sampler._apply_penalties(got, rows, v)
        assert torch.equal(got, _dense_penalties(x, rows, v))
        for out in outputs:
            out.extend(rng.randrange(0, v) for _ in range(3))
    for i, row in enumerate(rows[:2] + rows[3:]):
        assert row.prompt_ids is not None
        assert set(row.prompt_ids.tolist()) == {t for t in row.prompt_token_ids if 0 <= t < v}, i
    assert rows[2].prompt_ids is None  # no repetition penalty: never read


def test_metadata_from_the_batch_table_samples_as_the_rows_do() -> None:
    """The engine hands the sampler its rows' parameters gathered from the input batch's table (rows
    in any order): tokens and logprobs equal those of metadata built from the rows' own params, over
    a mix of greedy, seeded random, top-k/p, min-p, penalties, min_tokens and logprobs rows."""
    from lorastar.engine.sampler import SamplingMetadata, SamplingTable

    v = 400
    params = [
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.9, seed=3, top_k=20),
        SamplingParams(temperature=0.0, repetition_penalty=1.5, min_tokens=4),
        SamplingParams(temperature=1.2, seed=5, top_p=0.8, min_p=0.05, frequency_penalty=0.4),
        SamplingParams(temperature=0.7, seed=9, logit_bias={7: 5.0}, logprobs=0),
    ]
    table = SamplingTable(2)
    table.grow(8)
    where = [6, 0, 3, 7, 1]  # each params' row in the table
    for row, p in zip(where, params):
        table.set(row, p)
    meta = table.take(where)
    assert meta == SamplingMetadata.from_params(params)
    logits = torch.randn(len(params), v, generator=torch.Generator().manual_seed(2)) * 4

    def run(with_meta: bool) -> SamplerOutput:
        rows = [
            _row(p, prompt=[1, 2, 3], output=[4, 5], generator=None if p.seed is None else make_generator(p.seed), eos=(7,))
            for p in params
        ]  # fmt: skip
        return Sampler(seed=1, eos_token_id=7)(logits, rows, meta if with_meta else None)

    got, want = run(True), run(False)
    assert got.token_ids == want.token_ids and got.logprobs == want.logprobs
    with pytest.raises(ValueError, match="sampling metadata has 4 rows"):
        Sampler()(logits, [_row(p) for p in params], table.take(where[:4]))


@pytest.mark.parametrize("ks", [(5, 0, None, 3), (1, 1, 1, 0), (0, 0, 0, 0), (None, 2, None, None)])
def test_copied_out_results_equal_the_direct_ones(ks: tuple[int | None, ...]) -> None:
    """The copy-out path (on CUDA: the ids and the logprobs' reductions queued at launch and read
    from pinned copies, async scheduling) gives what reading the device tensors at the end gives."""
    from lorastar.engine.sampler import PendingSample

    torch.manual_seed(2)
    x = torch.randn(4, 300) * 3
    rows = [_row(SamplingParams(logprobs=k, temperature=0.0 if i % 2 else 0.8)) for i, k in enumerate(ks)]
    direct = Sampler(seed=0).launch(x.clone(), rows)
    p = direct  # the same launch, read both ways
    copied = PendingSample(p.token_ids, p._raw_logprobs, p._ks, p._lp_idx, copy_out=True)
    assert copied.result() == direct.result()
    _check_logprobs(x, copied.result(), {i: k for i, k in enumerate(ks) if k is not None})


def test_probs_of_masked_rows_are_exact_zeros_and_other_values_unchanged() -> None:
    """Rows that mask most tokens (top-k here, allowed ids) take a floored exp on CPU (the -inf
    path of torch's exp is slow): their masked tokens get exactly 0, every value above 1e-30 is
    bitwise torch's exp, and an unmasked row's values do not depend on what else is in the batch."""
    from lorastar.engine.sampler import SamplingMetadata

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 500, generator=g) * 30  # gaps past 87 below the max: exp underflows there
    params = [SamplingParams(top_k=50), SamplingParams(allowed_token_ids=[1, 2, 3]), SamplingParams()]
    x[1, 4:] = float("-inf")  # what the allowed-ids mask did
    meta = SamplingMetadata.from_params(params)
    got = Sampler._probs(x.clone(), meta)
    alone = Sampler._probs(x[2:].clone(), SamplingMetadata.from_params(params[2:]))
    assert torch.equal(got[2], alone[0])  # the unmasked row: as if alone
    for r in range(3):
        want = (x[r] - x[r].max()).exp()
        if r == 0:  # top-k: the 50 largest kept
            keep = torch.zeros(500, dtype=torch.bool)
            keep[x[0].topk(50).indices] = True
            want = want.masked_fill(~keep, 0.0)
        big = want > 1e-30
        assert torch.equal(got[r][big], want[big]) and (got[r][~big] <= 1e-30).all()
        assert (got[r][torch.isinf(x[r])] == 0).all() and ((got[r] > 0) == big).sum() >= big.sum()
    assert (got[0] > 0).sum() == 50 and (got[1] > 0).sum() == 4
