"""vLLM's ``bad_words`` on the embedded SmolLM2 against HF transformers: greedy decoding with the
words' token ids banned equals ``generate(bad_words_ids=...)`` with the same ids; the tokenization
(each word bare and, where that differs, after a space) and the prefix rule as vLLM's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lorastar import LLM, SamplingParams
from lorastar.engine.sampler import BadWords, Sampler, SamplingRow
from lorastar.engine.sampling import bad_words_token_ids
from lorastar.errors import InvalidParamError, LimitExceededError

PROMPT = "Once upon a time, there was a little"
WORDS = ["sun", "to play", "in the sun", "Emma"]  # one token each way; two; three; "Em" "ma" bare only


@pytest.fixture(scope="module")
def tok(model_dir: str):  # noqa: ANN201
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def _encode(tok) -> object:  # noqa: ANN001
    return lambda text: tok.encode(text, add_special_tokens=False)


def test_words_tokenize_bare_and_after_a_space_as_vllm(tok) -> None:  # noqa: ANN001
    enc = _encode(tok)
    one = bad_words_token_ids(enc, ["Paris"])
    assert one == [enc("Paris"), enc(" Paris")] and all(len(w) == 1 for w in one)
    assert bad_words_token_ids(enc, [" Paris"]) == one  # leading space stripped first
    # " indeed" is one token but "indeed" two: vLLM keeps the spaced form only at the same length
    assert len(enc("indeed")) == 2 and len(enc(" indeed")) == 1
    assert bad_words_token_ids(enc, ["indeed"]) == [enc("indeed")]
    assert bad_words_token_ids(enc, ["hello world"]) == [enc("hello world"), enc(" hello world")]


def test_a_word_is_banned_only_after_its_first_tokens() -> None:
    bw = BadWords.from_token_ids([[5], [7, 8], [1, 2, 3], [9, 2, 4]])
    assert bw is not None and bw.single.tolist() == [5]
    assert bw.banned([]) == []
    assert bw.banned([4, 7]) == [8]
    assert bw.banned([7, 7]) == [8]
    assert bw.banned([1, 2]) == [3] and bw.banned([0, 1, 2]) == [3]
    assert bw.banned([2]) == [] and bw.banned([0, 2]) == []  # "1 2 3" needs the 1 before the 2
    assert sorted(bw.banned([9, 2])) == [4] and bw.banned([9, 1, 2]) == [3]
    assert BadWords.from_token_ids([]) is None
    # the sampler: row 0 bans 5 always and 8 after 7; row 1 has no bad words
    logits = torch.zeros(2, 10)
    logits[:, 5] = 3.0
    logits[:, 8] = 2.0
    p_bw, p_free = SamplingParams(temperature=0, bad_words=["x"]), SamplingParams(temperature=0)
    rows = [SamplingRow(p_bw, [1], [7], bad_words=bw), SamplingRow(p_free, [1], [7])]
    assert Sampler()(logits, rows).token_ids == [0, 5]  # row 0: the first of the zeros left
    rows[0] = SamplingRow(p_bw, [1], [6], bad_words=bw)
    assert Sampler()(logits, rows).token_ids == [8, 5]


def test_greedy_bad_words_equal_transformers_bad_words_ids(model_dir: str, tok) -> None:  # noqa: ANN001
    from transformers import AutoModelForCausalLM

    banned = bad_words_token_ids(_encode(tok), WORDS)
    assert sorted({len(w) for w in banned}) == [1, 2, 3]
    ids = tok(PROMPT)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    with torch.inference_mode():
        ref = model.generate(
            torch.tensor([ids]), max_new_tokens=24, do_sample=False, bad_words_ids=banned,
            pad_token_id=tok.eos_token_id,
        )[0, len(ids) :].tolist()  # fmt: skip
        free = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids) :].tolist()
    word = tok.encode(" to play", add_special_tokens=False)
    assert any(free[i : i + len(word)] == word for i in range(len(free)))  # greedy meets a word's prefix
    assert ref != free

    llm = LLM(model_dir, num_kv_blocks=64, max_model_len=256)
    base = dict(max_tokens=24, ignore_eos=True)
    params = [
        SamplingParams(temperature=0, bad_words=WORDS, **base),
        SamplingParams(temperature=1.0, seed=3, n=4, bad_words=WORDS, **base),
        SamplingParams(temperature=0, **base),
    ]
    out_greedy, out_sampled, out_free = llm.generate([PROMPT] * 3, params)
    assert out_greedy.outputs[0].token_ids == ref
    assert out_free.outputs[0].token_ids == free  # the batch's other rows keep every word
    for o in out_sampled.outputs:
        t = o.token_ids
        assert not any(t[i : i + len(w)] == w for w in banned for i in range(len(t))), o.text
    llm.engine.check_invariants()
    assert not llm.engine.requests


def test_bad_words_refusals_and_sync_holds(model_dir: str) -> None:
    llm = LLM(model_dir, num_kv_blocks=64, max_model_len=256, max_bad_words=2)
    eng = llm.engine
    for words in (["ok", " "], [""], "word", [3]):
        with pytest.raises(InvalidParamError, match="bad_words") as e:
            SamplingParams(bad_words=words)  # type: ignore[arg-type]
        assert e.value.param == "bad_words"
    with pytest.raises(InvalidParamError, match="use_beam_search"):
        SamplingParams(bad_words=["a"], use_beam_search=True, n=2, temperature=0)
    with pytest.raises(LimitExceededError, match="max_bad_words") as e2:
        eng.add_request("hi", SamplingParams(bad_words=["a", "b", "c"]))
    assert e2.value.param == "bad_words"
    assert SamplingParams(bad_words=[]).bad_words is None  # vLLM's default: no words
    # A word of several tokens reads the output on the host: under async scheduling its request
    # has the step in flight completed before sampling; one-token words are a mask alone.
    multi = eng.add_request("hi", SamplingParams(bad_words=["to play"], max_tokens=2))
    single = eng.add_request("hi", SamplingParams(bad_words=["sun"], max_tokens=2))
    assert multi.reads_host and not single.reads_host and not multi.holds_sync
    assert single.bad_words is not None and not single.bad_words.multi
    assert np.array_equal(np.sort(single.bad_words.single), np.sort(np.asarray(bad_words_token_ids(
        lambda s: eng.tokenizer.encode(s, add_special_tokens=False), ["sun"]
    )).ravel()))  # fmt: skip
    while eng.requests:
        eng.step()
    eng.check_invariants()
