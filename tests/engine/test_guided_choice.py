"""vLLM's ``guided_choice`` on the embedded SmolLM2 against HF transformers: greedy decoding along
the choices' token paths (then EOS) equals ``generate`` with ``prefix_allowed_tokens_fn`` giving the
same paths; every output is one of the choices."""

from __future__ import annotations

import pytest
import torch

from lorastar import LLM, SamplingParams
from lorastar.engine.sampler import ChoicePaths
from lorastar.errors import InvalidParamError, LimitExceededError

MESSAGES = [{"role": "user", "content": "Is the sky blue on a clear day? Answer with one word."}]
CHOICES = ["Yes", "No", "Yes, always", "Maybe"]  # "Yes" a prefix of another choice


def test_choice_paths() -> None:
    paths = ChoicePaths.from_token_ids([[5, 6], [5, 6, 7], [8]], eos=[2])
    assert paths.allowed([]).tolist() == [5, 8]
    assert paths.allowed([5]).tolist() == [6]
    assert paths.allowed([5, 6]).tolist() == [2, 7]  # a whole choice: EOS, or go on to the longer
    assert paths.allowed([8]).tolist() == [2] and paths.allowed([5, 6, 7]).tolist() == [2]
    assert paths.allowed([9]).tolist() == [2]  # off every path: EOS only


def test_greedy_guided_choice_equals_transformers_prefix_allowed_tokens(model_dir: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    eos = tok.eos_token_id
    paths = ChoicePaths.from_token_ids([tok.encode(c, add_special_tokens=False) for c in CHOICES], [eos])

    def allowed(_: int, input_ids: torch.Tensor) -> list[int]:
        return paths.allowed(input_ids[len(ids) :].tolist()).tolist()

    with torch.inference_mode():
        ref = model.generate(
            torch.tensor([ids]), max_new_tokens=12, do_sample=False, prefix_allowed_tokens_fn=allowed,
            eos_token_id=eos, pad_token_id=eos,
        )[0, len(ids) :].tolist()  # fmt: skip
        free = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids) :].tolist()
    want = tok.decode(ref, skip_special_tokens=True)
    assert want in CHOICES and tok.decode(free, skip_special_tokens=True) not in CHOICES

    llm = LLM(model_dir, num_kv_blocks=64, max_model_len=256)
    greedy = SamplingParams(temperature=0, max_tokens=12, guided_choice=CHOICES)
    sampled = SamplingParams(temperature=1.5, seed=4, n=12, max_tokens=12, guided_choice=CHOICES)
    plain = SamplingParams(temperature=0, max_tokens=12)
    out_greedy, out_sampled, out_plain = llm.generate([ids] * 3, [greedy, sampled, plain])
    g = out_greedy.outputs[0]
    assert g.token_ids == ref[: len(g.token_ids)] and g.text == want and g.finish_reason == "stop"
    assert out_plain.outputs[0].token_ids == free  # the batch's other rows are free
    assert all(o.text in CHOICES and o.finish_reason == "stop" for o in out_sampled.outputs)
    assert len({o.text for o in out_sampled.outputs}) > 1  # the draws cover more than one choice
    llm.engine.check_invariants()
    assert not llm.engine.requests


def test_guided_choice_refusals(model_dir: str) -> None:
    llm = LLM(model_dir, num_kv_blocks=64, max_model_len=256, max_guided_choices=2)
    for value in ([], [""], ["a", 3], "a"):
        with pytest.raises(InvalidParamError, match="guided_choice") as e:
            SamplingParams(guided_choice=value)  # type: ignore[arg-type]
        assert e.value.param == "guided_choice"
    with pytest.raises(InvalidParamError, match="use_beam_search"):
        SamplingParams(guided_choice=["a"], use_beam_search=True, n=2, temperature=0)
    with pytest.raises(LimitExceededError, match="max_guided_choices"):
        llm.generate("hi", SamplingParams(guided_choice=["a", "b", "c"]))
    req = llm.engine.add_request("hi", SamplingParams(guided_choice=["a", "b"], max_tokens=3))
    assert req.reads_host and not req.holds_sync  # the paths read the output on the host
    while llm.engine.requests:
        llm.engine.step()
    llm.engine.check_invariants()
