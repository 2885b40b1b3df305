"""Speculative decoding (ngram drafts, verified in the step that runs them).

References are HF transformers: greedy outputs equal its greedy continuation token for token; a
sampled one's law equals the distribution its logits give. Most tests draft with an oracle (HF's
own continuation, some drafts spoiled on purpose) so every step drafts and both verdicts happen at
every draft position; the real ngram proposer is checked against a brute-force rule, and on the
embedded SmolLM2 with text that repeats.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from lorastar import LLM, SamplingParams
from lorastar.config import EngineConfig, SpeculativeConfig
from lorastar.engine import engine as engine_mod
from lorastar.engine.spec_decode import accepted, propose_ngram
from tests.conftest import make_peft_adapter
from tests.models.test_llama_vs_hf import hf_greedy, mixed_prompts

NEW = 24
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


# ---- the proposer ---------------------------------------------------------------------------------
def _brute(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    size = len(tokens)
    for n in range(min(hi, size - 1), lo - 1, -1):
        suffix = tokens[size - n :]
        for i in range(size - n):
            if tokens[i : i + n] == suffix:
                return tokens[i + n : i + n + k]
    return []


def test_propose_ngram_follows_vllms_rule() -> None:
    # vLLM's docstring example: [4, 2, 3] after the match of [2, 3]
    assert propose_ngram(np.array([1, 2, 3, 4, 2, 3]), 2, 3, 4) == [4, 2, 3]
    # the longest n-gram wins, at its earliest occurrence
    assert propose_ngram(np.array([1, 2, 3, 1, 2, 3, 9, 1, 2, 3]), 1, 3, 2) == [1, 2]
    assert propose_ngram(np.array([5, 6, 7]), 1, 3, 2) == []
    assert propose_ngram(np.array([7, 7]), 1, 1, 3) == [7]
    assert propose_ngram(np.array([1, 2, 1, 2]), 3, 3, 2) == []  # no 3-gram repeats
    assert propose_ngram(np.array([1, 2, 1, 2]), 1, 3, 0) == []
    rng = random.Random(0)
    for _ in range(400):
        toks = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        lo = rng.randrange(1, 4)
        hi = rng.randrange(lo, 6)
        k = rng.randrange(1, 6)
        assert propose_ngram(np.array(toks, dtype=np.int64), lo, hi, k) == _brute(toks, lo, hi, k), (
            toks,
            lo,
            hi,
        )


def test_accepted_counts_the_confirmed_prefix() -> None:
    assert accepted([5, 6, 7], [5, 6, 7, 8]) == 3
    assert accepted([5, 6, 7], [5, 9, 7, 8]) == 1
    assert accepted([5], [4, 5]) == 0


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ({"method": "ngram", "num_speculative_tokens": 3}, SpeculativeConfig("ngram", 3, 5, 5)),
        ({"num_speculative_tokens": 2, "prompt_lookup_max": 4}, SpeculativeConfig("ngram", 2, 4, 4)),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 2}, SpeculativeConfig("ngram", 2, 2, 2)),
        ({"model": "[ngram]", "num_speculative_tokens": 2}, SpeculativeConfig("ngram", 2, 5, 5)),
    ],
)
def test_speculative_config_reads_vllms_json(given: dict[str, Any], expected: SpeculativeConfig) -> None:
    assert EngineConfig(speculative_config=given).speculative_config == expected


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens must be a positive integer"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"num_speculative_tokens": 2, "model": "some/draft-model"}, "unsupported key"),
        ({"num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, "unsupported key"),
        ("ngram", "must be a dict"),
    ],
)
def test_speculative_config_names_a_bad_value(given: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=given)


# ---- the engine, with an oracle drafter --------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_model_dir):  # noqa: ANN001, ANN201
    path = tiny_model_dir("llama-gqa")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = mixed_prompts(11, [3, 17, 40, 70])
    refs = {tuple(p): hf_greedy(hf, p, NEW + 8) for p in prompts}
    return path, hf, prompts, refs


def _oracle(refs: dict[tuple[int, ...], list[int]], spoil: int | None = 3):  # noqa: ANN202
    """A drafter proposing HF's greedy continuation, with the draft at every ``spoil``-th absolute
    position made wrong (rejections at varying draft positions)."""

    def propose(tokens: np.ndarray, lo: int, hi: int, k: int) -> list[int]:
        toks = tokens.tolist()
        for prompt, ref in refs.items():
            if tuple(toks[: len(prompt)]) == prompt:
                done = len(toks) - len(prompt)
                out = ref[done : done + k]
                if spoil:
                    out = [t + 1 if (len(toks) + i) % spoil == 0 else t for i, t in enumerate(out)]
                return out
        return []

    return propose


def _llm(path: str, **kw: Any) -> LLM:
    """An engine that checks its invariants after every step (drafts gone, no block past the
    tokens, refcounts, the runner's rows)."""
    kw.setdefault("speculative_config", SPEC)
    llm = LLM(path, max_model_len=256, **kw)
    engine = llm.engine
    step = engine.step

    def checked() -> Any:
        out = step()
        engine.check_invariants()
        return out

    engine.step = checked  # type: ignore[method-assign]
    return llm


def _drained(llm: LLM) -> None:
    llm.engine.check_invariants()
    assert llm.kv_cache_usage()["num_used_blocks"] == 0 and not llm.engine.requests


@pytest.mark.parametrize("spoil", [None, 2, 3])
@pytest.mark.parametrize(
    "engine_kw",
    [
        {"num_kv_blocks": 128, "max_num_batched_tokens": 64},
        # drafts cut by the token budget; preemptions (few blocks) drop them
        {"num_kv_blocks": 26, "max_num_batched_tokens": 9, "block_size": 4},
    ],
    ids=["roomy", "tight"],
)
def test_greedy_with_drafts_equals_hf(tiny, monkeypatch: pytest.MonkeyPatch, spoil, engine_kw) -> None:  # noqa: ANN001
    path, _, prompts, refs = tiny
    monkeypatch.setattr(engine_mod, "propose_ngram", _oracle(refs, spoil))
    llm = _llm(path, **engine_kw)
    if engine_kw["num_kv_blocks"] == 26:
        prompts = prompts * 2  # more sequences than blocks: preemptions
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True),
    )
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == refs[tuple(p)][:NEW]
        assert o.outputs[0].finish_reason == "length"
    st = llm.engine.spec_stats
    assert st.num_drafts > 0 and st.num_accepted_tokens > 0
    if spoil is None and engine_kw["num_kv_blocks"] == 128:  # a perfect drafter: every draft is kept
        assert st.num_accepted_tokens == st.num_draft_tokens
    if spoil is not None:
        assert st.num_accepted_tokens < st.num_draft_tokens
    _drained(llm)
    if engine_kw["num_kv_blocks"] == 26:
        assert llm.engine.scheduler.stats.num_preemptions > 0


def test_stops_inside_the_drafts(tiny, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """max_tokens, a stop token and min_tokens cut or hold the kept drafts exactly where a plain
    step would."""
    path, _, prompts, refs = tiny
    monkeypatch.setattr(engine_mod, "propose_ngram", _oracle(refs, None))
    llm = _llm(path, num_kv_blocks=128)
    p = prompts[1]
    ref = refs[tuple(p)]
    for n in (1, 2, 3, 5, 6, 7):
        (o,) = llm.generate(
            [{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        )
        assert o.outputs[0].token_ids == ref[:n]
    stop = ref[6]
    first = ref.index(stop)
    (o,) = llm.generate(
        [{"prompt_token_ids": p}],
        SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, stop_token_ids=[stop]),
    )
    assert o.outputs[0].token_ids == ref[: first + 1] and o.outputs[0].finish_reason == "stop"
    # min_tokens past the stop's first place: the stop is masked there, drafts or not
    (o,) = llm.generate(
        [{"prompt_token_ids": p}],
        SamplingParams(
            temperature=0, max_tokens=first + 1, ignore_eos=True, stop_token_ids=[stop], min_tokens=first + 1
        ),
    )
    assert o.outputs[0].token_ids[:first] == ref[:first] and o.outputs[0].token_ids[first] != stop
    _drained(llm)


def test_logprobs_of_kept_drafts_are_hfs(tiny, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    path, hf, prompts, refs = tiny
    monkeypatch.setattr(engine_mod, "propose_ngram", _oracle(refs, 3))
    llm = _llm(path, num_kv_blocks=128)
    p = prompts[2]
    (o,) = llm.generate(
        [{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    )
    toks = o.outputs[0].token_ids
    assert toks == refs[tuple(p)][:12] and llm.engine.spec_stats.num_accepted_tokens > 0
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([p + toks])).logits[0].float(), -1)  # [L, V]
    for i, (tok, lp) in enumerate(zip(toks, o.outputs[0].logprobs)):
        row = ref[len(p) - 1 + i]
        assert math.isclose(lp[tok].logprob, row[tok].item(), abs_tol=1e-4)
        top = row.topk(2).indices.tolist()
        assert set(top) <= set(lp)
    _drained(llm)


def test_prefix_cache_holds_only_verified_tokens(tiny, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """A request whose prompt is an earlier one's prompt and output hits the blocks that output
    filled (drafts included, rejected ones overwritten) and still equals HF."""
    path, hf, prompts, refs = tiny
    monkeypatch.setattr(engine_mod, "propose_ngram", _oracle(refs, 2))
    llm = _llm(path, num_kv_blocks=128, block_size=4)
    p = prompts[1]
    (o,) = llm.generate(
        [{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    )
    longer = p + o.outputs[0].token_ids[:20]
    (o2,) = llm.generate(
        [{"prompt_token_ids": longer}], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    )
    assert o2.num_cached_tokens >= len(p) + 16
    assert o2.outputs[0].token_ids == hf_greedy(hf, longer, 6)
    _drained(llm)


def test_a_sequence_finishing_inside_its_drafts_caches_them(tiny, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """A stop token met among kept drafts: the blocks those drafts filled enter the prefix cache
    as plain steps leave them, so the next turn (prompt + answer) hits as many tokens."""
    path, _, prompts, refs = tiny
    p = prompts[2]
    ref = refs[tuple(p)]
    # drafts of 4, all kept: a step adds outputs 1-5, the next 6-10; the stop is a draft there
    s = next(i for i in (8, 9, 7) if ref[i] not in ref[:i])
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, stop_token_ids=[ref[s]])
    cached = []
    for spec in (None, SPEC):
        monkeypatch.setattr(engine_mod, "propose_ngram", _oracle(refs, None))
        llm = _llm(path, num_kv_blocks=128, block_size=4, speculative_config=spec)
        (o,) = llm.generate([{"prompt_token_ids": p}], params)
        assert o.outputs[0].token_ids == ref[: s + 1] and o.outputs[0].finish_reason == "stop"
        (o2,) = llm.generate(
            [{"prompt_token_ids": p + ref[: s + 1]}], SamplingParams(temperature=0, max_tokens=2)
        )
        cached.append(o2.num_cached_tokens)
        _drained(llm)
    assert llm.engine.spec_stats.num_accepted_tokens > 0
    assert cached[1] == cached[0] >= len(p) + s - 3, cached


def test_lora_with_drafts_equals_peft(tiny, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    from peft import PeftModel

    path, hf, prompts, _ = tiny
    adapter = make_peft_adapter(path, tmp_path / "a", seed=5, r=8, targets=("q_proj", "v_proj", "o_proj"))
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), adapter
    ).eval()
    refs = {tuple(p): hf_greedy(peft, p, 16) for p in prompts[:3]}
    monkeypatch.setattr(engine_mod, "propose_ngram", _oracle(refs, 3))
    llm = _llm(path, num_kv_blocks=128)
    llm.load_adapter("a", adapter)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts[:3]]
    outs = llm.generate(batch, params, adapter="a")
    for p, o in zip(prompts[:3], outs):
        assert o.outputs[0].token_ids == refs[tuple(p)]
    assert llm.engine.spec_stats.num_accepted_tokens > 0
    _drained(llm)


def test_beam_search_drafts_nothing(tiny, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """Beams fork and reorder on the host each step: no drafts. (Grammars, choices and thinking
    budgets draft: test_spec_decode_structured.py.)"""
    path, _, prompts, refs = tiny
    monkeypatch.setattr(engine_mod, "propose_ngram", _oracle(refs, None))
    llm = _llm(path, num_kv_blocks=128)
    llm.generate(
        [{"prompt_token_ids": prompts[1]}],
        SamplingParams(temperature=0, max_tokens=8, use_beam_search=True, n=2),
    )
    assert llm.engine.spec_stats.num_drafts == 0
    _drained(llm)


def test_repetition_penalty_with_drafts_equals_hf(tiny, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """Each drafted row is penalized for the output up to its own position (drafts before it
    included): greedy with HF's repetition penalty, token for token."""
    path, hf, prompts, _ = tiny
    refs = {}
    for p in prompts[:3]:
        ids = torch.tensor([p])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                          repetition_penalty=1.5, eos_token_id=None, pad_token_id=0)  # fmt: skip
        refs[tuple(p)] = out[0, len(p) :].tolist()
    monkeypatch.setattr(engine_mod, "propose_ngram", _oracle(refs, 3))
    llm = _llm(path, num_kv_blocks=128)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:3]], params)
    for p, o in zip(prompts[:3], outs):
        assert o.outputs[0].token_ids == refs[tuple(p)]
    st = llm.engine.spec_stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    _drained(llm)


@pytest.mark.parametrize(
    "kw",
    [
        {"frequency_penalty": 1.0, "logit_bias": "ref"},  # a favoured token repeats until penalized
        {"presence_penalty": 1.0, "logit_bias": "ref"},
        {"min_tokens": 14, "stop_token_ids": "ref"},  # the stop masked until the 14th token
        {"bad_words": "ref"},  # two-token words of the plain output: banned at their second token
    ],
    ids=["frequency", "presence", "min_tokens", "bad_words"],
)
def test_output_reading_sampling_with_drafts_equals_plain_steps(
    tiny, monkeypatch: pytest.MonkeyPatch, kw
) -> None:  # noqa: ANN001
    """Penalties, ``min_tokens`` and bad words read the output: with drafts (each row reading the
    output up to its position) the greedy tokens are those of the engine without drafting, whose
    semantics the sampling tests hold to vLLM's."""
    path, _, prompts, refs = tiny
    plain = LLM(path, max_model_len=256, num_kv_blocks=128)
    tok = plain.get_tokenizer()
    batch = [{"prompt_token_ids": p} for p in prompts[:3]]
    kw = dict(kw)
    first = [
        o.outputs[0].token_ids for o in plain.generate(batch, SamplingParams(temperature=0, max_tokens=20))
    ]
    if kw.get("logit_bias") == "ref":
        kw["logit_bias"] = {first[0][2]: 4.0, first[1][2]: 3.0}
        biased = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logit_bias=kw["logit_bias"])
        first = [o.outputs[0].token_ids for o in plain.generate(batch, biased)]
    if kw.get("stop_token_ids") == "ref":
        kw["stop_token_ids"] = [first[0][12], first[1][11]]
    if kw.get("bad_words") == "ref":
        kw["bad_words"] = [tok.decode(first[0][3:5]), tok.decode(first[1][6:8])]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, **kw)
    want = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts[:3], plain.generate(batch, params))}
    assert [want[tuple(p)] for p in prompts[:3]] != first  # the parameter changed something
    monkeypatch.setattr(engine_mod, "propose_ngram", _oracle(want, 3))
    llm = _llm(path, num_kv_blocks=128)
    outs = llm.generate(batch, params)
    assert [o.outputs[0].token_ids for o in outs] == [want[tuple(p)] for p in prompts[:3]]
    st = llm.engine.spec_stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    _drained(llm)


def _exact_law(hf: Any, prompt: list[int], k: int, depth: int) -> dict[tuple[int, ...], float]:
    """The law of the first ``depth`` tokens sampled at temperature 1 from the top ``k``."""
    law: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(depth):
        nxt: dict[tuple[int, ...], float] = {}
        for seq, pr in law.items():
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + list(seq)])).logits[0, -1].double()
            vals, idx = logits.topk(k)
            for v, t in zip(torch.softmax(vals, -1).tolist(), idx.tolist()):
                nxt[(*seq, t)] = pr * v
        law = nxt
    return law


def test_sampled_outputs_keep_the_models_law(tiny, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """Random sampling with drafts (each a draw's likeliest continuation, so kept often and
    rejected often): the law of the first three tokens is HF's. 1,200 seeded requests; total
    variation distance over the 8 outcomes (about 0.03 expected from sampling noise alone)."""
    path, hf, prompts, _ = tiny
    prompt = prompts[1]
    law = _exact_law(hf, prompt, 2, 3)
    greedy_next = {}
    for seq in [(), *[s[:1] for s in law], *[s[:2] for s in law]]:
        with torch.no_grad():
            greedy_next[seq] = int(hf(torch.tensor([prompt + list(seq)])).logits[0, -1].argmax())

    def propose(tokens: np.ndarray, lo: int, hi: int, k: int) -> list[int]:
        out = list(tokens.tolist()[len(prompt) :])
        drafts: list[int] = []
        while len(drafts) < k and tuple(out) in greedy_next:
            drafts.append(greedy_next[tuple(out)])
            out.append(drafts[-1])
        return drafts

    monkeypatch.setattr(engine_mod, "propose_ngram", propose)
    llm = _llm(path, num_kv_blocks=256, max_num_seqs=128)
    n = 1200
    outs = llm.generate(
        [{"prompt_token_ids": prompt}] * n,
        [SamplingParams(temperature=1.0, top_k=2, max_tokens=3, seed=i, ignore_eos=True) for i in range(n)],
    )
    seen = Counter(tuple(o.outputs[0].token_ids) for o in outs)
    tv = 0.5 * sum(abs(seen.get(s, 0) / n - p) for s, p in law.items()) + 0.5 * sum(
        c / n for s, c in seen.items() if s not in law
    )
    st = llm.engine.spec_stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    assert tv < 0.06, (tv, seen, law)
    _drained(llm)


def test_seeded_samples_repeat_and_n_forks_draft(tiny, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    path, _, prompts, refs = tiny
    monkeypatch.setattr(engine_mod, "propose_ngram", _oracle(refs, 3))
    llm = _llm(path, num_kv_blocks=128)
    params = SamplingParams(temperature=0.8, max_tokens=12, n=3, seed=7, ignore_eos=True)
    a = llm.generate([{"prompt_token_ids": prompts[2]}], params)[0]
    b = llm.generate([{"prompt_token_ids": prompts[2]}], params)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert all(len(c.token_ids) == 12 for c in a.outputs)
    assert llm.engine.spec_stats.num_drafts > 0
    _drained(llm)


# ---- the real proposer on real text ---------------------------------------------------------------
def test_smollm2_ngram_drafts_on_repeating_text(model_dir: str) -> None:
    """SmolLM2 asked to edit code copies most of it: the ngram proposer's drafts are kept, and the
    greedy output is transformers' own."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    code = "def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n    return 2 * (width + height)\n"
    msgs = [{"role": "user", "content": f"Add a docstring to each function:\n```python\n{code}```"}]
    prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    ref = hf_greedy(hf, prompt, 24)
    llm = LLM(
        speculative_config={"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    )
    (o,) = llm.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    )
    assert o.outputs[0].token_ids == ref
    st = llm.engine.stats().spec_decode
    assert st is not None and st.num_accepted_tokens >= 8, st
    assert sum(st.accepted_per_pos) == st.num_accepted_tokens
    from lorastar.engine.summary import engine_summary

    assert (
        "Speculative decoding: ngram, up to 4 drafted tokens per step (n-grams of 2-4 tokens); "
        "async scheduling off"
    ) in engine_summary(llm.engine)
    _drained(llm)


@pytest.mark.parametrize("family", ["mistral-window", "gemma3", "phi3"])
def test_families_with_windows_and_fused_layers(
    tiny_model_dir, monkeypatch: pytest.MonkeyPatch, family: str
) -> None:  # noqa: ANN001
    """Sliding windows (blocks released behind a uniform window as kept drafts advance it; Gemma 3's
    mixed layers) and fused checkpoints: greedy with drafts equals transformers."""
    from tests.conftest import hf_model

    path = tiny_model_dir(family)
    hf = hf_model(path).eval()
    prompts = mixed_prompts(5, [9, 40])
    refs = {tuple(p): hf_greedy(hf, p, 20) for p in prompts}
    monkeypatch.setattr(engine_mod, "propose_ngram", _oracle(refs, 3))
    llm = _llm(path, num_kv_blocks=64, block_size=4)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
    )
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == refs[tuple(p)]
    assert llm.engine.spec_stats.num_accepted_tokens > 0
    _drained(llm)


def _decoding(num_blocks: int, prompts: list[list[int]]) -> tuple[Any, Any, list[Any]]:
    """A torch-free scheduler (blocks of 4) whose sequences have prefilled ``prompts`` and sampled
    one token each (token 9): every one is about to decode."""
    from lorastar.engine.block_manager import BlockManager
    from lorastar.engine.request import Request, Sequence
    from lorastar.engine.scheduler import Scheduler

    bm = BlockManager(num_blocks, 4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_loras=1)
    seqs = []
    for i, prompt in enumerate(prompts):
        req = Request(f"r{i}", None, list(prompt), SamplingParams(max_tokens=8))
        seq = Sequence(req, 0, list(prompt), len(prompt))
        req.sequences.append(seq)
        sched.add(seq)
        seqs.append(seq)
    sched.update(sched.schedule())
    for seq in seqs:
        seq.token_ids.append(9)
    return bm, sched, seqs


def test_scheduler_runs_without_drafts_before_preempting_for_them() -> None:
    """Two decoding sequences fill every block: the one whose drafts need another block drops
    them and decodes; nobody is preempted for a draft. A budget that cuts into drafts keeps the
    ones that fit."""
    from lorastar.engine.request import SeqStatus

    bm, sched, seqs = _decoding(2, [[1, 2, 3], [1, 2, 3]])  # 4 tokens, 3 computed, a block each
    a, b = seqs
    a.token_ids += [5, 6]  # two drafts: a second block, and none is free
    a.num_draft_tokens = 2
    out = sched.schedule()
    assert [(s.seq.seq_id, s.num_new_tokens, s.num_drafts) for s in out.scheduled] == [
        (a.seq_id, 1, 0),
        (b.seq_id, 1, 0),
    ]
    assert not out.preempted and a.token_ids == [1, 2, 3, 9] and a.num_draft_tokens == 0
    assert all(s.status is SeqStatus.RUNNING for s in seqs)

    sched.max_num_batched_tokens = 3
    sched.update(out)
    for seq in seqs:
        seq.token_ids.append(9)
    bm2 = sched.bm
    assert bm2.num_free_blocks == 0
    sched.finish(b, "stop")  # a block comes free: a's drafts fit, the budget takes two of three
    a.token_ids += [5, 6, 7]
    a.num_draft_tokens = 3
    out = sched.schedule()
    (s,) = out.scheduled
    assert (s.num_new_tokens, s.num_drafts, s.samples) == (3, 2, True)
    assert a.token_ids[-3:] == [9, 5, 6]
    sched.update(out)
    assert a.num_computed_tokens == 5  # the drafts count once verified (the engine's part)


def test_token_array_tracks_the_growing_sequence() -> None:
    from lorastar.engine.request import Request, Sequence
    from lorastar.engine.spec_decode import token_array

    req = Request("r", None, [1, 2, 3], SamplingParams(max_tokens=500))
    seq = Sequence(req, 0, [1, 2, 3], 3)
    rng = random.Random(1)
    for _ in range(60):
        seq.token_ids += [rng.randrange(100) for _ in range(rng.randrange(0, 9))]
        got = token_array(seq)
        assert got.tolist() == seq.token_ids and got.dtype == np.int64


def test_disable_by_batch_size(tiny, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """vLLM's ``disable_by_batch_size``: no drafts while at least that many sequences run."""
    path, _, prompts, refs = tiny
    monkeypatch.setattr(engine_mod, "propose_ngram", _oracle(refs, None))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts[:3]]
    llm = _llm(path, num_kv_blocks=128, speculative_config={**SPEC, "disable_by_batch_size": 3})
    outs = llm.generate(batch, params)
    assert [o.outputs[0].token_ids for o in outs] == [refs[tuple(p)][:8] for p in prompts[:3]]
    assert llm.engine.spec_stats.num_drafts == 0  # three ran together throughout
    llm.generate(batch[:1], params)
    assert llm.engine.spec_stats.num_drafts > 0  # one alone drafts
    _drained(llm)
    assert (
        EngineConfig(
            speculative_config={**SPEC, "disable_by_batch_size": 4}
        ).speculative_config.disable_by_batch_size
        == 4
    )  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="disable_by_batch_size must be a positive integer"):
        EngineConfig(speculative_config={**SPEC, "disable_by_batch_size": 0})


def test_scheduler_takes_back_anothers_drafts_before_preempting() -> None:
    """A's drafts took the last free block; B's next token needs one: A's drafts go, their block
    goes to B, and nobody is preempted (a draft is never worth a recompute)."""
    bm, sched, seqs = _decoding(4, [[1, 2, 3], [1, 2, 3, 4, 5, 6, 7, 8]])
    a, b = seqs
    assert bm.num_free_blocks == 1
    a.token_ids += [5, 6, 7, 8]
    a.num_draft_tokens = 4
    out = sched.schedule()
    assert [(s.seq.seq_id, s.num_new_tokens, s.num_drafts) for s in out.scheduled] == [
        (a.seq_id, 1, 0),
        (b.seq_id, 1, 0),
    ]
    assert not out.preempted and a.token_ids == [1, 2, 3, 9] and len(a.block_table) == 1
    assert len(b.block_table) == 3 and bm.num_free_blocks == 0
    sched.update(out)
    bm.check_invariants(sched.all_sequences())


def test_scheduler_drops_the_drafts_of_a_sequence_it_does_not_run() -> None:
    """The budget runs out at A (its last token and two drafts): B is not scheduled this step and
    leaves it without its drafts (they would sit in its tokens until a later step)."""
    bm, sched, (a, b) = _decoding(8, [[1, 2, 3], [4, 5, 6]])
    for seq in (a, b):
        seq.token_ids += [7, 8]
        seq.num_draft_tokens = 2
    sched.max_num_batched_tokens = 3
    out = sched.schedule()
    assert [(s.seq.seq_id, s.num_new_tokens, s.num_drafts) for s in out.scheduled] == [(a.seq_id, 3, 2)]
    assert b.token_ids == [4, 5, 6, 9] and b.num_draft_tokens == 0
