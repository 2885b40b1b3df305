"""Prefix caching reviewed against vLLM v1: sliding-window hits, and sampled rows of a step that
mixes beam search with n > 1 fan-out (outputs must equal a cache-less / standalone run)."""

from __future__ import annotations

import random

from lorastar import LLM, SamplingParams
from lorastar.engine.block_manager import NULL_BLOCK, BlockManager
from lorastar.engine.request import Request, Sequence

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _seq(tokens: list[int]) -> Sequence:
    return Request(f"r{random.random()}", None, list(tokens), SamplingParams()).sequences[0]


def _run(llm: LLM, prompts: list[list[int]], max_steps: int = 200) -> list[list[int]]:
    """Each prompt run to the end after the previous one (bounded: a stalled engine fails)."""
    eng, outs = llm.engine, []
    for p in prompts:
        req = eng.add_request(p, GREEDY)
        done = None
        for _ in range(max_steps):
            for o in eng.step():
                if o.finished and o.request_id == req.request_id:
                    done = o
            eng.check_invariants()
            if not eng.has_unfinished():
                break
        assert done is not None, "the request never finished (admission stalled)"
        outs.append(done.outputs[0].token_ids)
    return outs


def test_window_hits_before_the_window_are_not_taken() -> None:
    """Hits whose positions the first query's window can't see stay free (NULL entries), as
    ``release_outside_window`` would leave them: admission needs only the window's blocks."""
    bs, w = 4, 6
    bm = BlockManager(8, bs, sliding_window=w)
    a = _seq(list(range(28)))  # 7 blocks
    assert bm.allocate(a, 28) == []
    a.num_computed_tokens = 28
    bm.commit(a)
    bm.free(a)
    b = _seq(list(range(28)) + [90] * 8)  # 7 hits + 2 new blocks: 9 > 8 if every hit were taken
    hit = bm.lookup(b)
    assert len(hit) == 7
    assert bm.can_allocate(b, 8, hit)
    assert bm.allocate(b, 8, hit) == []
    dead = (7 * bs - w + 1) // bs  # blocks ending before position 28 - 6 + 1
    assert b.block_table[:dead] == [NULL_BLOCK] * dead and b.block_table[dead:7] == hit[dead:]
    b.num_computed_tokens = 36
    bm.check_invariants([b])
    assert bm.num_used_blocks == 7 - dead + 2


def test_window_model_prefix_hit_longer_than_the_cache_runs(tiny_model_dir) -> None:
    """A windowed model's cached prefix may span more blocks than the cache holds beside the new
    chunk: taking every hit made admission impossible and the request never ran."""
    path = tiny_model_dir("mistral-window")  # window 24 on every layer
    rng = random.Random(5)
    a = [rng.randrange(3, 49152) for _ in range(100)]
    prompts = [a, a + [rng.randrange(3, 49152) for _ in range(20)]]
    kw = dict(num_kv_blocks=14, block_size=8, max_num_batched_tokens=32)
    want = _run(LLM(path, enable_prefix_caching=False, **kw), prompts)  # type: ignore[arg-type]
    llm = LLM(path, **kw)  # type: ignore[arg-type]
    assert _run(llm, prompts) == want
    assert llm.engine.scheduler.stats.prefix_hits > 0
    assert llm.kv_cache_usage()["num_used_blocks"] == 0


def test_beams_and_n_fan_out_in_one_step_sample_their_own_rows(tiny_model_dir) -> None:
    """A step with 2 running beams and a new n=3 request has as many sampled rows as logits rows
    (3 fan-out rows, 2 beam rows left out): the rows must still be selected, or the greedy request
    of the same step samples from a beam's logits."""
    path = tiny_model_dir("llama-gqa")
    rng = random.Random(3)
    g_prompt, n_prompt = (
        [rng.randrange(3, 49152) for _ in range(20)],
        [rng.randrange(3, 49152) for _ in range(9)],
    )
    n_params = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=4, ignore_eos=True)
    alone = LLM(path, num_kv_blocks=128)
    want_g = alone.generate([g_prompt], GREEDY)[0].outputs[0].token_ids
    want_n = [o.token_ids for o in alone.generate([n_prompt], n_params)[0].outputs]

    llm = LLM(path, num_kv_blocks=128)
    eng = llm.engine
    beam = eng.add_request(list(range(200, 230)), SamplingParams(use_beam_search=True, n=2, max_tokens=6))
    eng.step()
    assert len(beam.sequences) == 2  # two running beams
    g, n = eng.add_request(g_prompt, GREEDY), eng.add_request(n_prompt, n_params)
    finals = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                finals[o.request_id] = o
    assert finals[g.request_id].outputs[0].token_ids == want_g
    assert [o.token_ids for o in finals[n.request_id].outputs] == want_n
    eng.check_invariants()
    assert llm.kv_cache_usage()["num_used_blocks"] == 0
