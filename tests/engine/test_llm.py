"""LLM API behaviour on a tiny model: validation, sampling features, aborts, adapter lifecycle."""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path

import pytest

from lorastar import LLM, SamplingParams
from lorastar.errors import AdapterError, AdapterNotFoundError, InvalidParamError
from tests.conftest import make_peft_adapter

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:  # noqa: ANN001
    return LLM(
        tiny_model_dir("llama-gqa"), num_kv_blocks=128, max_model_len=256, max_loras=2, max_lora_rank=16
    )


@pytest.fixture(autouse=True)
def _no_leaks(llm: LLM):  # noqa: ANN202
    yield
    llm.engine.check_invariants()
    assert llm.kv_cache_usage()["num_used_blocks"] == 0
    assert not llm.engine.requests


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ("", None, "prompt"),
        ([[]], None, "prompt"),
        ([1] * 300, None, "max_model_len"),
        ("hi", {"max_tokens": 0}, "max_tokens"),
        ("hi", {"temperature": -1.0}, "temperature"),
        ("hi", {"top_p": 0.0}, "top_p"),
        ("hi", {"top_p": 1.5}, "top_p"),
        ([1, 2, 10**9], None, "prompt_token_ids"),
        ([1, -1], None, "prompt_token_ids"),
        ("hi", {"bogus_field": 1}, "bogus_field"),
    ],
)
def test_bad_input_names_the_field_and_engine_goes_on(llm: LLM, prompt, params, field: str) -> None:  # noqa: ANN001
    eng = llm.engine
    running = eng.add_request([5, 6, 7], GREEDY)  # another request is being served meanwhile
    eng.step()
    with pytest.raises(ValueError, match=field):
        sp = SamplingParams.from_dict(params) if params else None
        llm.generate(prompt, sp)
    while eng.has_unfinished():
        eng.step()
    assert running.is_finished and running.sequences[0].num_output_tokens == 8


def test_unknown_adapter_is_refused(llm: LLM) -> None:
    with pytest.raises(AdapterNotFoundError, match="nope"):
        llm.generate("hi", GREEDY, adapter="nope")


def test_n_samples_seed_logprobs_stop(llm: LLM) -> None:
    sp = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True, logprobs=2)
    a = llm.generate([5, 6, 7, 8], sp)[0]
    assert len(a.outputs) == 3 and {o.index for o in a.outputs} == {0, 1, 2}
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1  # distinct samples
    for o in a.outputs:
        assert len(o.token_ids) == 10 and len(o.logprobs) == 10
        for tok, lp in zip(o.token_ids, o.logprobs):
            assert tok in lp and len(lp) <= 3
            assert all(v.logprob <= 0 for v in lp.values())
    # Same seed, same outputs, whatever else is in the batch.
    others = [[9, 10, 11], [12] * 20]
    b = llm.generate([[5, 6, 7, 8], *others], [sp, GREEDY, SamplingParams(temperature=0.8, max_tokens=5)])[0]
    assert [o.token_ids for o in b.outputs] == [o.token_ids for o in a.outputs]

    # Sample k draws from its own generator (seed + k, wrapping at the largest seed allowed).
    for seed in (2**64 - 1, -(2**63)):
        edge = llm.generate([5, 6, 7, 8], SamplingParams(**{**vars(sp), "seed": seed}))[0]
        assert [len(o.token_ids) for o in edge.outputs] == [10, 10, 10]

    # Stop strings: the text ends before the stop string, which may span tokens.
    full = llm.generate([5, 6, 7, 8], GREEDY)[0].outputs[0]
    stop = full.text[3:7]
    if stop and stop.strip():
        cut = llm.generate([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=8, stop=[stop]))[0].outputs[
            0
        ]
        assert cut.finish_reason == "stop" and cut.stop_reason == stop
        assert cut.text == full.text[: full.text.index(stop)]
    tid = full.token_ids[2]
    s2 = llm.generate([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[tid]))[0]
    assert s2.outputs[0].token_ids == full.token_ids[:3] and s2.outputs[0].stop_reason == tid


def test_abort_frees_blocks_at_once(llm: LLM) -> None:
    eng = llm.engine
    req = eng.add_request([3] * 40, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    eng.step()
    assert llm.kv_cache_usage()["num_used_blocks"] > 0
    out = eng.abort_request(req.request_id)
    assert out is not None and out.finished and out.outputs[0].finish_reason == "abort"
    assert llm.kv_cache_usage()["num_used_blocks"] == 0


def test_chat_uses_template(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "hello"}], GREEDY)[0]
    text = llm.tokenizer.decode(out.prompt_token_ids)
    assert "hello" in text and "assistant" in text


def test_chat_messages_the_template_cannot_render_are_refused_naming_messages(llm: LLM) -> None:
    """A message without content made the template raise jinja's UndefinedError out of
    ``LLM.chat``; it is the caller's InvalidParamError, as the HTTP route's 400 already was."""
    with pytest.raises(InvalidParamError, match="could not be rendered by the chat template") as e:
        llm.chat([{"role": "user"}], GREEDY)
    assert e.value.param == "messages"
    assert llm.kv_cache_usage()["num_used_blocks"] == 0


PREFILL = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "Arr, the"}]


def test_chat_continue_final_message_renders_as_transformers(llm: LLM) -> None:
    """vLLM's ``continue_final_message``: the last message stays open for the model to continue
    (an assistant prefill), token for token as transformers renders it; it excludes a generation
    prompt."""
    tok = llm.tokenizer
    ref = tok.apply_chat_template(
        PREFILL, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    out = llm.chat(PREFILL, GREEDY, add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt_token_ids == tok(ref, add_special_tokens=False)["input_ids"]
    assert tok.decode(out.prompt_token_ids).endswith("Arr, the")
    closed = llm.chat(PREFILL, GREEDY, add_generation_prompt=False)[0]
    assert len(closed.prompt_token_ids) > len(out.prompt_token_ids)  # the message ended there
    with pytest.raises(InvalidParamError, match="add_generation_prompt") as e:
        llm.chat(PREFILL, GREEDY, continue_final_message=True)  # add_generation_prompt is on by default
    assert e.value.param == "continue_final_message"


def test_chat_template_kwargs_are_template_variables_only(llm: LLM) -> None:
    """``chat_template_kwargs`` reach the template as variables (Qwen3's ``enable_thinking``); the
    tokenizer's own ``apply_chat_template`` parameters are refused, naming the field."""
    import copy

    from lorastar.engine.input_processor import InputProcessor

    tok = copy.deepcopy(llm.tokenizer)
    tok.chat_template = (
        "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    inputs = InputProcessor(
        tok, model_name="t", max_model_len=256, max_prompt_bytes=1 << 16, vocab_size=len(tok)
    )
    msgs = [{"role": "user", "content": "hi"}]
    off = inputs.apply_chat_template(msgs, False, chat_template_kwargs={"enable_thinking": False})
    assert tok.decode(off) == "<think></think>hi"
    assert tok.decode(inputs.apply_chat_template(msgs, False)) == "hi"
    for key in ("tokenize", "chat_template", "add_generation_prompt", "tools", "messages", "conversations"):
        with pytest.raises(InvalidParamError, match=key) as e:
            llm.chat(msgs, GREEDY, chat_template_kwargs={key: True})
        assert e.value.param == "chat_template_kwargs"


def test_adapter_load_unload_while_generating(llm: LLM, tiny_model_dir, tmp_path: Path) -> None:  # noqa: ANN001
    base_dir = tiny_model_dir("llama-gqa")
    p1 = make_peft_adapter(base_dir, tmp_path / "one", 1)
    p2 = make_peft_adapter(base_dir, tmp_path / "two", 2)
    eng = llm.engine
    llm.load_adapter("one", p1)
    ref_one = llm.generate(
        [4, 5, 6], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), adapter="one"
    )[0]
    # In flight on "one" while "two" is loaded and "one" unloaded.
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    req = eng.add_request([4, 5, 6], sp, adapter="one")
    base_req = eng.add_request([4, 5, 6], sp)
    for _ in range(3):
        eng.step()
    llm.load_adapter("two", p2)
    llm.unload_adapter("one")
    with pytest.raises(AdapterNotFoundError):
        eng.add_request([4, 5, 6], sp, adapter="one")  # new requests for it are refused
    two = eng.add_request([4, 5, 6], sp, adapter="two")
    finished = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                finished[o.request_id] = o
    assert finished[req.request_id].outputs[0].token_ids == ref_one.outputs[0].token_ids
    assert finished[two.request_id].outputs[0].token_ids != ref_one.outputs[0].token_ids
    assert finished[base_req.request_id].outputs[0].token_ids != ref_one.outputs[0].token_ids
    assert [a.name for a in llm.list_adapters()] == ["two"]
    # The unloaded identity's slot is released once its request finished.
    on_slots = sum(i.slot is not None for i in eng.registry.list())  # only "two" is named now
    assert eng.registry.stats()["slots_used"] == on_slots
    llm.unload_adapter("two")
    assert not llm.list_adapters()


def test_bad_adapters_leave_registry_intact(llm: LLM, tiny_model_dir, tmp_path: Path) -> None:  # noqa: ANN001
    base_dir = tiny_model_dir("llama-gqa")
    good = Path(make_peft_adapter(base_dir, tmp_path / "good", 3))
    llm.load_adapter("good", str(good))
    before = llm.list_adapters()

    def variant(name: str, edit) -> str:  # noqa: ANN001
        d = tmp_path / name
        d.mkdir()
        for f in good.iterdir():
            (d / f.name).write_bytes(f.read_bytes())
        edit(d)
        return str(d)

    def cfg_edit(**kw):  # noqa: ANN202
        def f(d: Path) -> None:
            c = json.loads((d / "adapter_config.json").read_text())
            c.update(kw)
            (d / "adapter_config.json").write_text(json.dumps(c))

        return f

    def pickle_only(d: Path) -> None:
        (d / "adapter_model.safetensors").unlink()
        (d / "adapter_model.bin").write_bytes(b"not really a pickle")

    def corrupt(d: Path) -> None:
        (d / "adapter_model.safetensors").write_bytes(b"\x00garbage")

    cases = {
        "unknown_target": cfg_edit(target_modules=["embed_tokens"]),
        "rank_too_big": cfg_edit(r=64),
        "not_lora": cfg_edit(peft_type="IA3"),
        "modules_to_save": cfg_edit(modules_to_save=["lm_head"]),
        "pickle": pickle_only,
        "corrupt": corrupt,
        "missing_config": lambda d: (d / "adapter_config.json").unlink(),
    }
    for name, edit in cases.items():
        with pytest.raises(AdapterError):
            llm.load_adapter(name, variant(name, edit))
        assert llm.list_adapters() == before, name
    with pytest.raises(AdapterError):
        llm.load_adapter("missing", str(tmp_path / "does-not-exist"))
    # Wrong shapes: an adapter trained for another base (4 kv heads there, 2 here: v_proj differs).
    other = make_peft_adapter(tiny_model_dir("llama-mha-llama3"), tmp_path / "other_base", 4)
    with pytest.raises(AdapterError, match="shape"):
        llm.load_adapter("other", other)
    assert llm.list_adapters() == before
    llm.unload_adapter("good")


def engine_parts(llm: LLM) -> dict[str, weakref.ref]:
    """Weak references to an engine and what holds its memory (weights, KV cache, adapter slots)."""
    import torch

    e = llm.engine
    parts = {"engine": e, "runner": e.runner, "model": e.model, "lora_state": e.lora_state}
    parts |= {"scheduler": e.scheduler, "registry": e.registry, "sampler": e.sampler}
    parts |= {
        f"kv_caches[{i}]": kv for i, kv in enumerate(e.runner.kv_caches) if isinstance(kv, torch.Tensor)
    }
    parts |= {f"param {n}": p for n, p in list(e.model.named_parameters())[:3]}
    return {k: weakref.ref(v) for k, v in parts.items()}


@pytest.mark.parametrize(
    ("name", "async_scheduling"),
    [("llama-gqa", False), ("llama-gqa", True), ("gemma3", False), ("phi3", True)],
)
def test_dropped_llm_frees_its_memory_at_once(
    tiny_model_dir, tmp_path: Path, name: str, async_scheduling: bool
) -> None:  # noqa: ANN001
    """The last reference gone, the engine's weights, KV cache and adapter slots go at once, not
    at Python's next cyclic GC, which GPU memory pressure never runs (making one engine after
    another ran out of memory on an H100 while the scheduler held the engine's bound methods)."""
    path = tiny_model_dir(name)
    adapter = make_peft_adapter(
        path,
        tmp_path / "a",
        0,
        targets=("qkv_proj", "o_proj") if name == "phi3" else ("q_proj", "v_proj", "down_proj"),
    )
    gc.collect()
    gc.disable()
    try:
        llm = LLM(path, num_kv_blocks=32, max_loras=1, max_lora_rank=8, async_scheduling=async_scheduling)
        llm.load_adapter("a", adapter)
        sp = [
            GREEDY,
            SamplingParams(n=2, max_tokens=4, seed=1),
            SamplingParams(n=2, use_beam_search=True, max_tokens=3),
        ]
        assert len(llm.generate(["hi", [5, 6, 7], "beam"], sp, adapter=["a", None, "a"])) == 3
        refs = engine_parts(llm)
        del llm
        assert [k for k, r in refs.items() if r() is not None] == []
    finally:
        gc.enable()
