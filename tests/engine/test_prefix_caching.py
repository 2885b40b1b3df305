"""Automatic prefix caching: same outputs as without it, keyed by adapter *content*."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorastar import LLM, SamplingParams
from tests.conftest import make_peft_adapter

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SYSTEM = list(range(1000, 1100))  # 100 shared tokens: 6 full blocks


def _adapter(base_dir: str, out: Path, seed: int) -> str:
    return make_peft_adapter(base_dir, out, seed, r=4, targets=("k_proj", "v_proj"), scale=0.5)


def test_outputs_equal_with_and_without_prefix_caching(tiny_model_dir, tmp_path: Path) -> None:
    base_dir = tiny_model_dir("llama-gqa")
    ad = _adapter(base_dir, tmp_path / "ad", 1)
    prompts = [SYSTEM + [i, i + 1, i + 2] for i in range(5, 11)]
    adapters = [None, "ad", None, "ad", "ad", None]
    results = []
    for caching in (False, True):
        llm = LLM(base_dir, num_kv_blocks=256, enable_prefix_caching=caching)
        llm.load_adapter("ad", ad)
        # Twice: the second round hits blocks cached by the first (and by its own batch).
        first = llm.generate(prompts, GREEDY, adapter=adapters)
        second = llm.generate(prompts, GREEDY, adapter=adapters)
        assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]
        hits = [o.num_cached_tokens for o in second]
        results.append(([o.outputs[0].token_ids for o in first], hits))
        llm.engine.check_invariants()
        assert llm.kv_cache_usage()["num_used_blocks"] == 0
    (plain, plain_hits), (cached, cached_hits) = results
    assert plain == cached
    assert plain_hits == [0] * 6
    assert all(h == 96 for h in cached_hits)  # 6 full blocks of the shared prefix
    # Same prompt, base vs adapter: different KV, so outputs differ and caches must not mix.
    assert cached[0] != cached[1] or cached[2] != cached[3]


def test_reloaded_adapter_never_hits_old_blocks(tiny_model_dir, tmp_path: Path) -> None:
    """Same name, new weights: the cache is keyed by content, not by name."""
    base_dir = tiny_model_dir("llama-gqa")
    p1, p2 = _adapter(base_dir, tmp_path / "v1", 1), _adapter(base_dir, tmp_path / "v2", 2)
    prompt = [SYSTEM + [7, 8, 9]]
    fresh = LLM(base_dir, num_kv_blocks=256)
    fresh.load_adapter("x", p2)
    want_v2 = fresh.generate(prompt, GREEDY, adapter="x")[0].outputs[0].token_ids

    llm = LLM(base_dir, num_kv_blocks=256)
    llm.load_adapter("x", p1)
    v1 = llm.generate(prompt, GREEDY, adapter="x")[0]
    llm.unload_adapter("x")
    llm.load_adapter("x", p2)
    v2 = llm.generate(prompt, GREEDY, adapter="x")[0]
    assert v2.num_cached_tokens == 0  # v1's blocks are still cached, but must not match
    assert v2.outputs[0].token_ids == want_v2
    assert v1.outputs[0].token_ids != want_v2
    # Reloading v1's weights under another name hits v1's blocks (same content hash).
    llm.load_adapter("y", p1)
    again = llm.generate(prompt, GREEDY, adapter="y")[0]
    assert again.num_cached_tokens == 96 and again.outputs[0].token_ids == v1.outputs[0].token_ids


def test_cache_salt_shares_blocks_only_within_a_salt(tiny_model_dir) -> None:
    """vLLM's cache_salt: a salted request never hits blocks of an unsalted one or of another
    salt, hits its own salt's, and gets the same tokens either way."""
    llm = LLM(tiny_model_dir("llama-gqa"), num_kv_blocks=256)
    prompt = [SYSTEM + [7, 8, 9]]

    def run(salt: str | None) -> tuple[list[int], int]:
        sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, cache_salt=salt)
        out = llm.generate(prompt, sp)[0]
        return out.outputs[0].token_ids, out.num_cached_tokens

    want, _ = run(None)
    runs = [run(s) for s in ("tenant-a", "tenant-a", "tenant-b", None, "tenant-b")]
    assert [hits for _, hits in runs] == [0, 96, 0, 96, 96]
    assert all(tokens == want for tokens, _ in runs)
    sp = SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=6, ignore_eos=True, cache_salt="tenant-c")
    assert llm.generate(prompt, sp)[0].num_cached_tokens == 0
    llm.engine.check_invariants()
    assert llm.kv_cache_usage()["num_used_blocks"] == 0
    for bad in ("", 7, "x" * 1025):
        with pytest.raises(ValueError, match="cache_salt"):
            SamplingParams(cache_salt=bad)  # type: ignore[arg-type]


def test_parallel_samples_share_prompt_blocks(tiny_model_dir) -> None:
    llm = LLM(tiny_model_dir("llama-gqa"), num_kv_blocks=256, enable_prefix_caching=False)
    eng = llm.engine
    prompt = list(range(300, 340))  # 2 full blocks + 8 tokens in a partial block
    req = eng.add_request(prompt, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True))
    eng.step()  # prefill + first tokens: fork into 4 samples sharing every block
    assert len(req.sequences) == 4
    assert all(s.block_table == req.sequences[0].block_table for s in req.sequences)
    used_shared = llm.kv_cache_usage()["num_used_blocks"]
    assert used_shared == 3
    eng.step()  # each sample writes into the shared partial block: copy-on-write for 3 of them
    tables = [s.block_table for s in req.sequences]
    assert len({t[2] for t in tables}) == 4 and len({tuple(t[:2]) for t in tables}) == 1
    assert llm.kv_cache_usage()["num_used_blocks"] == 2 + 4
    while eng.has_unfinished():
        eng.step()
    eng.check_invariants()
    assert llm.kv_cache_usage()["num_used_blocks"] == 0


def test_requests_arriving_together_compute_a_shared_prefix_once(tiny_model_dir) -> None:
    """lm-eval's choices of one question: one passage, several endings, submitted together. The later
    ones wait while the first computes the passage, then read it from the cache (prompt logprobs too)."""
    path = tiny_model_dir("llama-gqa")
    passage = list(range(100, 164))  # 4 blocks of 16
    prompts = [passage + [7 + i, 9 + i] for i in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    ref = LLM(path, num_kv_blocks=64, enable_prefix_caching=False).generate(prompts, sp)
    llm = LLM(path, num_kv_blocks=64)
    outs = llm.generate(prompts, sp)
    stats = llm.engine.scheduler.stats
    assert stats.prefix_waits > 0
    assert [o.num_cached_tokens for o in outs] == [0, 64, 64, 64]
    for a, b in zip(ref, outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            tok = next(iter(la))
            assert abs(la[tok].logprob - lb[tok].logprob) < 1e-4
    assert llm.kv_cache_usage()["num_used_blocks"] == 0
