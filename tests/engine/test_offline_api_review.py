"""The offline API as a vLLM user porting code calls it: vLLM's prompt dicts (TextPrompt /
TokensPrompt), ``generate()`` from several threads, ``AsyncLLM.generate`` with a params dict."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from lorastar import LLM, AsyncLLM, RequestOutput, SamplingParams
from lorastar.errors import InvalidParamError

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:  # noqa: ANN001
    return LLM(tiny_model_dir("llama-gqa"), num_kv_blocks=64, max_model_len=128)


@pytest.fixture(autouse=True)
def _no_leaks(llm: LLM):  # noqa: ANN202
    yield
    assert not llm.engine.requests
    assert llm.kv_cache_usage()["num_used_blocks"] == 0


def _ids(outs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_prompt_dicts_are_prompts_as_in_vllm(llm: LLM) -> None:
    """``generate({"prompt": text})`` iterated the dict and generated for its key, the text
    "prompt", silently; vLLM's TextPrompt / TokensPrompt are one prompt each, alone or in a list."""
    text_ref = llm.generate("Hello there", GREEDY)[0]
    ids_ref = llm.generate([5, 6, 7], GREEDY)[0]
    one = llm.generate({"prompt": "Hello there"}, GREEDY)
    assert len(one) == 1 and one[0].prompt == "Hello there"
    assert one[0].prompt_token_ids == text_ref.prompt_token_ids and _ids(one) == _ids([text_ref])
    tok = llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY)
    assert len(tok) == 1 and tok[0].prompt is None and tok[0].prompt_token_ids == [5, 6, 7]
    assert _ids(tok) == _ids([ids_ref])
    mixed = llm.generate([{"prompt": "Hello there"}, {"prompt_token_ids": [5, 6, 7]}, "Hello there"], GREEDY)
    assert _ids(mixed) == _ids([text_ref, ids_ref, text_ref])


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ({"prompt": "hi", "multi_modal_data": {}}, "multi_modal_data"),
        ({"text": "hi"}, "'prompt' .text. or 'prompt_token_ids'"),
        ({"prompt_token_ids": [1, 10**9]}, "outside the vocabulary"),
        ({"prompt_token_ids": []}, "must not be empty"),
        ({"prompt_token_ids": "hi"}, "prompt_token_ids must be a list"),
        ({"prompt": [1, 2]}, "prompt must be a string"),
    ],
)
def test_bad_prompt_dicts_are_refused_naming_the_problem(
    llm: LLM, prompt: dict[str, Any], match: str
) -> None:
    with pytest.raises(InvalidParamError, match=match) as e:
        llm.generate([prompt], GREEDY)
    assert e.value.param == "prompt"


def test_generate_from_another_thread_meanwhile_loses_no_outputs(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each ``generate`` steps the engine and kept only its own final outputs: a second thread's
    ``generate`` running meanwhile took the first's outputs, which then raised "engine went idle
    with unfinished requests". Calls from several threads now run one after another."""
    eng = llm.engine
    ref_a, ref_b = _ids(llm.generate([[5, 6, 7]], GREEDY)), _ids(llm.generate([[8, 9]], GREEDY))
    results: dict[str, Any] = {}

    def other() -> None:
        try:
            results["b"] = _ids(llm.generate([[8, 9]], GREEDY))
        except Exception as exc:  # noqa: BLE001 - reported below
            results["b"] = exc

    thread = threading.Thread(target=other)
    real_step = eng.step

    def step() -> list[RequestOutput]:
        if thread.ident is None:  # the first thread's first step: the other generate() starts
            thread.start()
            thread.join(0.5)  # lets it run to its end unless it waits for this one
        return real_step()

    monkeypatch.setattr(eng, "step", step)
    results["a"] = _ids(llm.generate([[5, 6, 7]], GREEDY))
    thread.join(30)
    assert results == {"a": ref_a, "b": ref_b}


def test_async_generate_takes_a_params_dict_and_prompt_dict(llm: LLM) -> None:
    """``AsyncLLM.generate`` with a params dict (which its engine takes) read ``.output_kind`` off
    the dict: AttributeError after the request had been queued, which ran on unobserved."""
    ref = llm.generate("Hello there", GREEDY)[0]

    async def main() -> list[RequestOutput]:
        engine = AsyncLLM(llm.engine.config)
        try:
            params = {"temperature": 0, "max_tokens": 4, "ignore_eos": True, "output_kind": 1}
            deltas = [o async for o in engine.generate({"prompt": "Hello there"}, params)]
            return deltas
        finally:
            await engine.shutdown()

    deltas = asyncio.run(main())
    assert deltas[-1].finished and deltas[-1].prompt == "Hello there"
    assert [t for o in deltas for t in o.outputs[0].token_ids] == ref.outputs[0].token_ids  # DELTA kept


def test_vllm_style_batches_and_their_errors(llm: LLM) -> None:
    """What already matched vLLM: one SamplingParams per prompt, an empty batch, a list whose
    length differs from the prompts (named), a system-only conversation, a list of conversations."""
    outs = llm.generate(["a", "b"], [GREEDY, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)])
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 2]
    assert llm.generate([], GREEDY) == []
    with pytest.raises(ValueError, match="sampling_params has 1 entries for 2 prompts"):
        llm.generate(["a", "b"], [GREEDY])
    with pytest.raises(ValueError, match="adapter has 3 entries for 2 prompts"):
        llm.generate(["a", "b"], GREEDY, adapter=[None, None, None])
    system = llm.chat([{"role": "system", "content": "Be brief."}], GREEDY)
    assert len(system) == 1 and len(system[0].outputs[0].token_ids) == 4
    convs = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "yo"}]]
    assert len(llm.chat(convs, [GREEDY, GREEDY])) == 2


def test_get_tokenizer_and_lora_request_as_in_vllm(llm: LLM, tiny_model_dir, tmp_path) -> None:  # noqa: ANN001
    """vLLM code calls ``llm.get_tokenizer()`` and picks adapters with ``lora_request=LoRARequest(
    name, id, path)``: the path is loaded under the name on first use, then the name is reused; the
    output equals ``adapter=name``'s. A wrong object or a length mismatch is refused before loading."""
    from dataclasses import dataclass

    from tests.conftest import make_peft_adapter

    @dataclass
    class LoRARequest:  # vllm.lora.request.LoRARequest's fields
        lora_name: str
        lora_int_id: int
        lora_path: str = ""

    assert llm.get_tokenizer() is llm.tokenizer
    path = make_peft_adapter(tiny_model_dir("llama-gqa"), tmp_path / "sql", 7)
    req = LoRARequest("sql", 1, path)
    try:
        with pytest.raises(ValueError, match="lora_request must be a LoRARequest"):
            llm.generate(["a"], GREEDY, lora_request="sql")
        with pytest.raises(ValueError, match="lora_request has 1 entries for 2 prompts"):
            llm.generate(["a", "b"], GREEDY, lora_request=[req])
        with pytest.raises(ValueError, match="adapter or lora_request"):
            llm.generate(["a"], GREEDY, adapter="sql", lora_request=req)
        assert not llm.list_adapters()  # nothing loaded by a refused call
        base = llm.generate([[5, 6, 7]], GREEDY)
        outs = llm.generate([[5, 6, 7], [5, 6, 7]], GREEDY, lora_request=[req, None])
        assert [a.name for a in llm.list_adapters()] == ["sql"]
        assert _ids(outs[1:]) == _ids(base)
        again = llm.generate([[5, 6, 7]], GREEDY, adapter="sql")
        assert _ids(outs[:1]) == _ids(again) != _ids(base)  # the adapter changes this seed's output
        chat = llm.chat([{"role": "user", "content": "hi"}], GREEDY, lora_request=req)
        assert len(chat) == 1 and [a.name for a in llm.list_adapters()] == ["sql"]
    finally:
        if llm.list_adapters():
            llm.unload_adapter("sql")
