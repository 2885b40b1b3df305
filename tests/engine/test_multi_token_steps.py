"""Several new tokens per sequence in one step (what a speculative decoder's verifier hands back).

The engine's ``_sample`` is wrapped by an oracle that accepts, after each sampled token, the next
``k - 1`` tokens of HF transformers' greedy continuation (a drafter that is always right). The
engine must then compute the KV of all of them in the next step and go on exactly as HF does;
stops inside a step's tokens cut the rest; streams carry several tokens per delta; nothing leaks.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from lorastar import LLM, SamplingParams
from lorastar.engine.sampling import RequestOutputKind
from tests.models.test_llama_vs_hf import hf_greedy, mixed_prompts

NEW = 20


@pytest.fixture(scope="module")
def setup(tiny_model_dir):  # noqa: ANN001, ANN201
    path = tiny_model_dir("llama-gqa")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = mixed_prompts(7, [3, 17, 40])
    refs = {tuple(p): hf_greedy(hf, p, NEW + 8) for p in prompts}
    llm = LLM(path, num_kv_blocks=128, max_model_len=256, max_num_batched_tokens=64)
    return llm, prompts, refs


@pytest.fixture
def oracle(setup, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN001, ANN201
    """``oracle(k)``: from now on each sampled row gets up to ``k`` tokens; returns the step log."""
    llm, _, refs = setup
    engine = llm.engine
    sample = type(engine)._sample
    log: list[list[int]] = []  # tokens per row, per step

    def install(k: int) -> list[list[int]]:
        def multi(self, logits, rows, meta=None):  # noqa: ANN001, ANN202
            got = sample(self, logits, rows, meta)
            out = []
            for row, (toks, lps) in zip(rows, got):
                ref = refs[tuple(row.prompt_token_ids)]
                pos = len(row.output_token_ids)
                assert toks == [ref[pos]], "the engine's own token differs from HF's greedy one"
                extra = ref[pos + 1 : pos + k]
                out.append((toks + extra, None if lps is None else lps + [{t: (-0.5, 1)} for t in extra]))
            log.append([len(t) for t, _ in out])
            return out

        monkeypatch.setattr(engine, "_sample", multi.__get__(engine))
        return log

    yield install
    engine.check_invariants()
    assert llm.kv_cache_usage()["num_used_blocks"] == 0 and not engine.requests


@pytest.mark.parametrize("k", [1, 2, 4])
def test_accepted_tokens_continue_exactly_as_hf(setup, oracle, k: int) -> None:  # noqa: ANN001
    llm, prompts, refs = setup
    log = oracle(k)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == refs[tuple(p)][:NEW]
        assert o.outputs[0].finish_reason == "length"
    # Each request needs ceil(NEW / k) sampled steps, not NEW.
    assert max(len(log), 1) <= len(prompts) * -(-NEW // k)
    assert sum(map(sum, log)) >= len(prompts) * NEW and max(map(max, log)) == k


@pytest.mark.parametrize("max_tokens", [1, 5, 7])
def test_max_tokens_cuts_inside_a_step(setup, oracle, max_tokens: int) -> None:  # noqa: ANN001
    llm, prompts, refs = setup
    oracle(4)
    outs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    )
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        assert c.token_ids == refs[tuple(p)][:max_tokens] and c.finish_reason == "length"
        assert len(c.logprobs) == max_tokens


def test_stop_token_inside_a_step_drops_the_rest(setup, oracle) -> None:  # noqa: ANN001
    llm, prompts, refs = setup
    oracle(4)  # the engine samples output positions 0, 4, 8, ...; the oracle adds the rest
    for p in prompts:
        ref = refs[tuple(p)]
        # A stop token whose first use falls on an added position (min_tokens below would mask
        # it at a sampled one, and the oracle checks every sampled token against HF).
        first = next(i for i in (ref.index(t) for t in ref[1:8]) if i % 4)
        stop = ref[first]
        out = llm.generate([p], SamplingParams(temperature=0, max_tokens=NEW, stop_token_ids=[stop]))[0]
        c = out.outputs[0]
        assert c.token_ids == ref[: first + 1] and c.finish_reason == "stop" and c.stop_reason == stop
        # min_tokens holds a stop back until enough tokens are out, inside a step too.
        min_tokens = first + 2
        later = [i for i, t in enumerate(ref[:NEW]) if t == stop and i + 1 >= min_tokens]
        params = SamplingParams(temperature=0, max_tokens=NEW, stop_token_ids=[stop], min_tokens=min_tokens)
        c = llm.generate([p], params)[0].outputs[0]
        assert c.token_ids == (ref[: later[0] + 1] if later else ref[:NEW])


def test_stop_string_inside_a_step_matches_one_token_steps(setup, oracle) -> None:  # noqa: ANN001
    llm, prompts, refs = setup
    tok = llm.engine.tokenizer
    params = []
    for p in prompts:
        text = tok.decode(refs[tuple(p)][:NEW])
        params.append(
            SamplingParams(temperature=0, max_tokens=NEW, stop=[text[len(text) // 2 : len(text) // 2 + 3]])
        )
    one = [o.outputs[0] for o in llm.generate(prompts, params)]
    oracle(4)
    many = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert [(c.text, c.finish_reason, c.stop_reason) for c in many] == [
        (c.text, c.finish_reason, c.stop_reason) for c in one
    ]
    assert all(c.finish_reason == "stop" for c in many)


def test_stream_deltas_carry_several_tokens(setup, oracle) -> None:  # noqa: ANN001
    llm, prompts, refs = setup
    oracle(3)
    engine = llm.engine
    params = SamplingParams(
        temperature=0, max_tokens=NEW, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    ids = [engine.add_request(p, params).request_id for p in prompts]
    deltas: dict[str, list] = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            deltas[out.request_id].append(out.outputs[0])
    for p, rid in zip(prompts, ids):
        ds = deltas[rid]
        assert [t for d in ds for t in d.token_ids] == refs[tuple(p)][:NEW]
        assert "".join(d.text for d in ds) == engine.tokenizer.decode(refs[tuple(p)][:NEW])
        assert max(len(d.token_ids) for d in ds) == 3 and len(ds) < NEW
