"""Beam search's end conditions (stop_token_ids, min_tokens, ignore_eos), its adapter accounting,
and n > 1 with seeds, against HF transformers' ``generate(num_beams=...)`` and vLLM's rules."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from lorastar import LLM, SamplingParams
from lorastar.engine.sampling import RequestOutputKind
from tests.conftest import make_peft_adapter

PROMPT = [11, 22, 33, 44, 55]


@pytest.fixture(scope="module")
def path(tiny_model_dir: Any) -> str:
    return str(tiny_model_dir("llama-gqa"))


@pytest.fixture(scope="module")
def llm(path: str) -> Iterator[LLM]:
    llm = LLM(path, num_kv_blocks=256, max_loras=2)
    yield llm
    llm.engine.check_invariants()


@pytest.fixture(scope="module")
def hf(path: str) -> Any:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _beams(llm: LLM, **kw: Any) -> list[Any]:
    sp = SamplingParams(use_beam_search=True, temperature=0, **{"n": 3, "max_tokens": 8, **kw})
    return llm.generate([PROMPT], sp)[0].outputs


def _hf_beams(model: Any, width: int, max_new: int, ends: list[int], min_new: int) -> list[list[int]]:
    """HF's hypotheses, each cut after its end token (HF pads the shorter ones)."""
    ids = torch.tensor([PROMPT])
    rows = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, num_return_sequences=width,
                          do_sample=False, max_new_tokens=max_new, min_new_tokens=min_new, early_stopping=False,
                          pad_token_id=0, eos_token_id=ends)  # fmt: skip
    out = []
    for row in rows:
        gen = row[len(PROMPT) :].tolist()
        cut = next((i for i, t in enumerate(gen) if t in ends), len(gen) - 1)
        out.append(gen[: cut + 1])
    return out


@pytest.mark.parametrize("min_tokens", [0, 3])
def test_beam_stop_token_ids_and_min_tokens_match_hf(llm: LLM, hf: Any, min_tokens: int) -> None:
    """stop_token_ids end a hypothesis as EOS does (HF: ``eos_token_id`` a list) and min_tokens keeps
    them out until then (HF's ``min_new_tokens``); both were silently ignored by beam search."""
    free = _beams(llm)
    stop = [free[0].token_ids[2], free[2].token_ids[5]]  # tokens the unconstrained search picks
    got = _beams(llm, stop_token_ids=stop, min_tokens=min_tokens)
    eos = list(llm.engine.eos_token_ids)
    assert [o.token_ids for o in got] == _hf_beams(hf, 3, 8, eos + stop, min_tokens)
    for o in got:
        assert len(o.token_ids) > min_tokens
        if o.token_ids[-1] in stop:
            assert (o.finish_reason, o.stop_reason) == ("stop", o.token_ids[-1])
        else:
            assert (o.finish_reason, o.stop_reason) == ("length", None)
    if min_tokens == 0:  # the best hypothesis ends on the first stop token
        assert got[0].token_ids == free[0].token_ids[:3] and got[0].finish_reason == "stop"


def test_beam_stop_token_text_only_with_include_stop_str_in_output(llm: LLM) -> None:
    """A hypothesis's ending token is in its ids, and in its text only with
    include_stop_str_in_output, as for a sampled output (vLLM's beam search leaves it out too)."""
    tok = llm.tokenizer
    stop = _beams(llm, n=2)[0].token_ids[2]
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop]))[0]
    assert greedy.outputs[0].token_ids[-1] == stop  # the sampled output's rule, for comparison
    for keep in (False, True):
        (best, _) = _beams(llm, n=2, stop_token_ids=[stop], include_stop_str_in_output=keep)
        assert best.token_ids[-1] == stop and best.finish_reason == "stop"
        ids = best.token_ids if keep else best.token_ids[:-1]
        assert best.text == tok.decode(ids, skip_special_tokens=True)
        if not keep:
            assert best.text == greedy.outputs[0].text


def test_beam_ignore_eos_hypothesis_ending_on_eos_finishes_length(llm: LLM) -> None:
    """A hypothesis ended by EOS leaves the EOS's text out (it was decoded in). With ignore_eos an
    EOS is a token like any other: a hypothesis cut by max_tokens right after one finished
    "length" (it said "stop")."""
    eng = llm.engine
    eos_tok = _beams(llm, n=2)[0].token_ids[2]
    saved = eng.eos_token_ids
    eng.eos_token_ids = (*saved, eos_tok)  # a model whose EOS the search reaches
    try:
        ended = _beams(llm, n=2, max_tokens=5)
        assert ended[0].token_ids[-1] == eos_tok and ended[0].finish_reason == "stop"
        assert ended[0].stop_reason is None  # EOS, not a stop token id
        assert ended[0].text == llm.tokenizer.decode(ended[0].token_ids[:-1])  # its text left out
        free = _beams(llm, n=2, max_tokens=3, ignore_eos=True)
        assert free[0].token_ids[-1] == eos_tok
        assert [o.finish_reason for o in free] == ["length", "length"]
    finally:
        eng.eos_token_ids = saved


def test_beam_search_with_adapter_matches_peft_and_counts_its_tokens(
    llm: LLM, path: str, tmp_path: Path
) -> None:
    """Beam search on a LoRA adapter equals PEFT's ``generate(num_beams=...)``, and its tokens count
    in the adapter's generation-token metric (they did not)."""
    from peft import PeftModel

    folder = make_peft_adapter(path, tmp_path / "ad", seed=5)
    llm.load_adapter("beamy", folder)
    try:
        eng = llm.engine
        before = eng.stats()
        sp = SamplingParams(n=2, use_beam_search=True, temperature=0, max_tokens=5)
        got = [o.token_ids for o in llm.generate([PROMPT], sp, adapter="beamy")[0].outputs]
        after = eng.stats()
        made = after.generation_tokens_total - before.generation_tokens_total
        assert made > 0 and after.adapter_generation_tokens.get("beamy", 0) == made
        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        peft = PeftModel.from_pretrained(base, folder).eval()
        ids = torch.tensor([PROMPT])
        rows = peft.generate(input_ids=ids, attention_mask=torch.ones_like(ids), num_beams=2,
                             num_return_sequences=2, do_sample=False, max_new_tokens=5,
                             early_stopping=False, pad_token_id=0)  # fmt: skip
        assert got == [r[len(PROMPT) :].tolist() for r in rows]
    finally:
        llm.unload_adapter("beamy")


def test_seeded_n_samples_reproducible_distinct_and_batch_independent(llm: LLM) -> None:
    """vLLM: sample k of a seeded request draws as a single request seeded seed + k would, whatever
    else runs beside it; n > 1 at temperature 0 gives n equal samples."""
    sp = SamplingParams(n=3, seed=7, max_tokens=6, ignore_eos=True)
    alone = [o.token_ids for o in llm.generate([PROMPT], sp)[0].outputs]
    assert len({tuple(t) for t in alone}) == 3
    singles = [
        llm.generate([PROMPT], SamplingParams(seed=7 + k, max_tokens=6, ignore_eos=True))[0]
        .outputs[0]
        .token_ids
        for k in range(3)
    ]
    assert alone == singles
    other = SamplingParams(n=2, seed=1, max_tokens=9, temperature=0.7, ignore_eos=True)
    batched = llm.generate([[5, 6, 7], PROMPT, [9] * 30], [other, sp, other])[1]
    assert [o.token_ids for o in batched.outputs] == alone
    greedy = llm.generate([PROMPT], SamplingParams(n=3, temperature=0, max_tokens=6))[0]
    assert len({tuple(o.token_ids) for o in greedy.outputs}) == 1


@pytest.mark.parametrize("beam", [False, True])
def test_abort_n_or_beams_with_prefix_caching_frees_every_block(path: str, beam: bool) -> None:
    """Aborted at every step of its life, an n > 1 or beam request (beside another on the same
    prompt) reports n aborted samples and leaves no block held."""
    llm = LLM(path, num_kv_blocks=64, enable_prefix_caching=True, max_num_batched_tokens=32)
    eng = llm.engine
    prompt = list(range(300, 350))
    kind = RequestOutputKind.CUMULATIVE
    sp = SamplingParams(n=3, max_tokens=20, ignore_eos=True, use_beam_search=beam, seed=None if beam else 1,
                        output_kind=kind)  # fmt: skip
    for steps in range(5):
        req = eng.add_request(prompt, sp)
        other = eng.add_request(prompt, SamplingParams(n=2, max_tokens=20, ignore_eos=True))
        for _ in range(steps):
            eng.step()
        out = eng.abort_request(req.request_id)
        eng.abort_request(other.request_id)
        assert out is not None and out.finished
        assert [o.finish_reason for o in out.outputs] == ["abort"] * 3
        eng.check_invariants()
        assert llm.kv_cache_usage()["num_used_blocks"] == 0
