"""Speculative decoding, a read of the change (review): a seeded sample's tokens do not depend on
the drafts its batch let it run."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from lorastar import LLM, SamplingParams
from lorastar.engine import engine as engine_mod

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 1}


def _llm(path: str, **kw: Any) -> LLM:
    return LLM(path, max_model_len=128, num_kv_blocks=64, block_size=4, **kw)


def test_seeded_sample_is_the_same_with_drafts_and_without(
    tiny_model_dir, monkeypatch: pytest.MonkeyPatch
) -> None:  # noqa: ANN001
    """A seeded request draws once per token in plain steps; a drafted step sampled every row and
    kept the draws of the rejected ones spent, so its tokens changed with drafting on, and with
    the batch it ran in (``disable_by_batch_size``: alone it drafts, beside two others it does
    not). Rewound to one draw per kept token, they are plain decoding's in every case."""
    path = tiny_model_dir("llama-gqa")
    prompt = [int(t) for t in np.random.default_rng(3).integers(5, 300, 12)]
    seeded = SamplingParams(temperature=1.0, max_tokens=16, seed=123, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    (plain,) = _llm(path).generate([{"prompt_token_ids": prompt}], seeded)

    # drafts that repeat the last token: mostly rejected at temperature 1
    monkeypatch.setattr(engine_mod, "propose_ngram", lambda tokens, lo, hi, k: [int(tokens[-1])] * k)
    llm = _llm(path, speculative_config={**SPEC, "disable_by_batch_size": 2})
    (alone,) = llm.generate([{"prompt_token_ids": prompt}], seeded)
    st = llm.engine.spec_stats
    assert st.num_drafts > 0 and st.num_accepted_tokens < st.num_draft_tokens
    batched = llm.generate(
        [{"prompt_token_ids": prompt}, {"prompt_token_ids": prompt[:7]}, {"prompt_token_ids": prompt[3:]}],
        [seeded, greedy, greedy],
    )[0]
    assert alone.outputs[0].token_ids == plain.outputs[0].token_ids
    assert batched.outputs[0].token_ids == plain.outputs[0].token_ids
    # greedy seeded rows draw nothing: nothing to rewind, outputs as before
    g = SamplingParams(temperature=0, max_tokens=10, seed=5, ignore_eos=True)
    assert llm.generate([{"prompt_token_ids": prompt}], g)[0].outputs[0].token_ids == (
        _llm(path).generate([{"prompt_token_ids": prompt}], g)[0].outputs[0].token_ids
    )


def test_unknown_key_message_names_every_key_accepted() -> None:
    from lorastar.config import SpeculativeConfig

    with pytest.raises(ValueError, match="unsupported key") as info:
        SpeculativeConfig.from_dict({"num_speculative_tokens": 2, "disable_padded_drafter_batch": True})
    for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
        assert key in str(info.value).split("(", 1)[1]
