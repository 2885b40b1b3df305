"""The real server (uvicorn + the real engine on a tiny random Llama) driven by the official openai client."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from plugin_support import ServerThread, engine_config, engine_idle, wait_until

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def client(real_server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path, adapter_root: Path) -> Iterator[Any]:
    """The offline ``LLM`` on the same weights and adapters: the server must agree with it."""
    from lorastar import LLM

    cfg = engine_config(tiny_model_dir)
    llm = LLM(config=cfg)
    llm.load_adapter("alpha", str(adapter_root / "alpha"))
    llm.load_adapter("beta", str(adapter_root / "beta"))
    yield llm


def greedy(max_tokens: int = 12, **kw: Any) -> Any:
    from lorastar import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def test_models_list(client: openai.OpenAI, adapter_root: Path) -> None:
    models = client.models.list().data
    assert [m.id for m in models][:3] == ["tiny", "alpha", "beta"]
    base, alpha = models[0], models[1]
    assert base.object == "model" and getattr(base, "parent", None) is None
    assert getattr(base, "max_model_len", None) == 256
    # root: the adapter's path relative to the adapter root, never a server path (issue #10)
    assert getattr(alpha, "parent", None) == "tiny" and getattr(alpha, "root", None) == "alpha"
    assert str(adapter_root) not in str(getattr(base, "root", ""))


@pytest.mark.parametrize("model", ["tiny", "alpha", "beta"])
def test_greedy_completion_and_chat_equal_llm_generate(
    client: openai.OpenAI, reference: Any, model: str
) -> None:
    adapter = None if model == "tiny" else model
    want = reference.generate(PROMPT, greedy(), adapter=adapter)[0]
    got = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    assert got.choices[0].text == want.outputs[0].text
    assert got.choices[0].finish_reason == want.outputs[0].finish_reason
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.outputs[0].token_ids)
    assert got.model == model

    # Token-id prompts take the same path.
    ids = list(want.prompt_token_ids)
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == want.outputs[0].text

    want_chat = reference.chat(MESSAGES, greedy(10), adapter=adapter)[0]
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=10, temperature=0)
    assert chat.choices[0].message.content == want_chat.outputs[0].text
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens == len(want_chat.prompt_token_ids)
    # max_completion_tokens is the newer name of the same limit.
    chat2 = client.chat.completions.create(
        model=model, messages=MESSAGES, max_completion_tokens=10, temperature=0
    )
    assert chat2.choices[0].message.content == want_chat.outputs[0].text


def test_chat_prefill_and_template_fields(
    client: openai.OpenAI, real_server: ServerThread, reference: Any
) -> None:
    """vLLM's chat fields reach the template: ``continue_final_message`` continues the last message
    (prompt as transformers renders it); a request's own ``chat_template``, both prompt flags at
    once, and template parameters in ``chat_template_kwargs`` are 400s naming the field."""
    conv = [*MESSAGES, {"role": "assistant", "content": "Red, green"}]
    tok = reference.tokenizer
    want_ids = tok(
        tok.apply_chat_template(
            conv, tokenize=False, add_generation_prompt=False, continue_final_message=True
        ),
        add_special_tokens=False,
    )["input_ids"]
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    want = reference.chat(conv, greedy(8), **flags)[0]
    got = client.chat.completions.create(
        model="tiny", messages=conv, max_tokens=8, temperature=0, extra_body=flags
    )
    assert got.usage.prompt_tokens == len(want_ids) == len(want.prompt_token_ids)
    assert got.choices[0].message.content == want.outputs[0].text
    tokens = httpx.post(real_server.url + "/tokenize", json={"model": "tiny", "messages": conv, **flags})
    assert tokens.json()["tokens"] == want_ids
    for extra, param in [
        ({"continue_final_message": True}, "continue_final_message"),
        ({"chat_template": "{{ messages }}"}, "chat_template"),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ]:
        for route in ("/v1/chat/completions", "/tokenize"):
            r = httpx.post(
                real_server.url + route, json={"model": "tiny", "messages": conv, "max_tokens": 2, **extra}
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (route, r.text)


def test_truncate_prompt_tokens_keeps_the_last_tokens(
    client: openai.OpenAI, real_server: ServerThread, reference: Any
) -> None:
    """vLLM's ``truncate_prompt_tokens``: the model reads only the prompt's last k tokens (the same
    as sending those ids), echo shows them, and k over max_model_len is 400."""
    ids = reference.tokenizer(PROMPT)["input_ids"]
    assert len(ids) > 3
    want = client.completions.create(model="alpha", prompt=ids[-3:], max_tokens=6, temperature=0)
    got = client.completions.create(
        model="alpha", prompt=PROMPT, max_tokens=6, temperature=0, echo=True,
        extra_body={"truncate_prompt_tokens": 3},
    )  # fmt: skip
    assert got.usage.prompt_tokens == 3
    assert got.choices[0].text == reference.tokenizer.decode(ids[-3:]) + want.choices[0].text
    whole = client.completions.create(
        model="alpha", prompt=PROMPT, max_tokens=2, temperature=0, extra_body={"truncate_prompt_tokens": -1}
    )
    assert whole.usage.prompt_tokens == len(ids)  # -1: the last max_model_len, here all of it
    chat = client.chat.completions.create(
        model="alpha",
        messages=MESSAGES,
        max_tokens=2,
        temperature=0,
        extra_body={"truncate_prompt_tokens": 5},
    )
    assert chat.usage.prompt_tokens == 5
    for route, body in [
        ("/v1/completions", {"prompt": PROMPT}),
        ("/v1/chat/completions", {"messages": MESSAGES}),
    ]:
        for k in (0, -2, 257):
            r = httpx.post(
                real_server.url + route, json={"model": "alpha", "truncate_prompt_tokens": k, **body}
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text


def test_bad_words_on_both_routes_equal_llm_generate(
    client: openai.OpenAI, real_server: ServerThread, reference: Any
) -> None:
    """vLLM's ``bad_words``: the server's greedy text equals the offline engine's with the same
    words, which differs from the text without them; a blank word is a 400 naming the field."""
    free = reference.generate(PROMPT, greedy(), adapter="alpha")[0].outputs[0]
    words = [reference.tokenizer.decode(free.token_ids[:1]).strip()]  # the first token's text
    want = reference.generate(PROMPT, greedy(bad_words=words), adapter="alpha")[0].outputs[0]
    assert want.text != free.text
    got = client.completions.create(
        model="alpha", prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"bad_words": words}
    )
    assert got.choices[0].text == want.text
    chat_free = client.chat.completions.create(model="alpha", messages=MESSAGES, max_tokens=12, temperature=0)
    text = chat_free.choices[0].message.content or ""
    chat_words = [text.split()[0]] if text.split() else ["x"]
    chat = client.chat.completions.create(
        model="alpha", messages=MESSAGES, max_tokens=12, temperature=0, extra_body={"bad_words": chat_words}
    )
    assert chat.choices[0].message.content != text
    for route, body in [
        ("/v1/completions", {"prompt": PROMPT}),
        ("/v1/chat/completions", {"messages": MESSAGES}),
    ]:
        r = httpx.post(real_server.url + route, json={"model": "alpha", "bad_words": ["ok", " "], **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words", r.text


def test_guided_choice_on_both_routes_equals_llm_generate(
    client: openai.OpenAI, real_server: ServerThread, reference: Any
) -> None:
    """vLLM's ``guided_choice`` (and ``structured_outputs: {"choice": ...}``): the answer is one of
    the choices, the offline engine's; structural tags and both fields at once are 400s."""
    choices = ["red", "green", "blue sky", "blue"]
    want = reference.generate(PROMPT, greedy(guided_choice=choices), adapter="alpha")[0].outputs[0]
    assert want.text in choices and want.finish_reason == "stop"
    got = client.completions.create(
        model="alpha", prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"guided_choice": choices}
    )
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == "stop"
    for body in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        chat = client.chat.completions.create(
            model="alpha", messages=MESSAGES, max_tokens=12, temperature=1.0, seed=1, n=4, extra_body=body
        )
        assert all(c.message.content in choices for c in chat.choices), chat
    for route, body in [
        ("/v1/completions", {"prompt": PROMPT}),
        ("/v1/chat/completions", {"messages": MESSAGES}),
    ]:
        for extra, param in [
            ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
            ({"guided_choice": ["a"], "structured_outputs": {"choice": ["b"]}}, "guided_choice"),
            ({"guided_choice": []}, "guided_choice"),
        ]:
            r = httpx.post(real_server.url + route, json={"model": "alpha", **body, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


SCHEMA = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["colour", "ok"],
    "additionalProperties": False,
}


def test_structured_outputs_on_both_routes_equal_llm_generate(
    client: openai.OpenAI, real_server: ServerThread, reference: Any
) -> None:
    """A regex, a JSON schema (guided_json, structured_outputs.json, response_format json_schema) and
    any JSON object (response_format json_object): the server's greedy text is the offline engine's
    under the same constraint, and satisfies it; bad ones are 400s naming the field the client sent."""
    regex = "[a-e]{3,8}"
    want = reference.generate(PROMPT, greedy(20, guided_regex=regex), adapter="alpha")[0].outputs[0]
    assert re.fullmatch(regex, want.text) and want.finish_reason == "stop"
    got = client.completions.create(
        model="alpha", prompt=PROMPT, max_tokens=20, temperature=0, extra_body={"guided_regex": regex}
    )
    assert got.choices[0].text == want.text
    # compact JSON: the random model would write whitespace runs to max_tokens where xgrammar allows them
    compact = {"structured_outputs": {"disable_any_whitespace": True}}
    chat_want = reference.chat(
        MESSAGES, greedy(40, guided_json=SCHEMA, disable_any_whitespace=True), adapter="alpha"
    )[0].outputs[0]
    assert chat_want.finish_reason == "stop" and json.loads(chat_want.text)["colour"] in ("red", "blue"), (
        repr(chat_want.text)
    )
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}
    for kw in (
        {"response_format": fmt, "extra_body": compact},
        {"extra_body": {"structured_outputs": {"json": json.dumps(SCHEMA), "disable_any_whitespace": True}}},
    ):
        chat = client.chat.completions.create(
            model="alpha", messages=MESSAGES, max_tokens=40, temperature=0, **kw
        )
        assert chat.choices[0].message.content == chat_want.text, kw
    obj_want = reference.chat(MESSAGES, greedy(40, guided_json_object=True), adapter="alpha")[0].outputs[0]
    obj = client.chat.completions.create(
        model="alpha",
        messages=MESSAGES,
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert obj.choices[0].message.content == obj_want.text
    # vLLM's structural_tag: free text until the trigger (here the model's own first token, so it
    # fires), then the tagged section under its schema
    first = reference.chat(MESSAGES, greedy(1), adapter="alpha")[0].outputs[0].text
    tag = {"type": "structural_tag", "triggers": [first],
           "structures": [{"begin": first, "schema": SCHEMA, "end": "."}]}  # fmt: skip
    tag_want = reference.chat(MESSAGES, greedy(40, guided_structural_tag=tag), adapter="alpha")[0].outputs[0]
    # the tag fired and its schema took over (a tag's JSON takes any whitespace, which this random
    # model then writes to max_tokens)
    assert tag_want.text.startswith(first + '{"colour"'), tag_want.text
    for kw in (
        {"response_format": tag},
        {"extra_body": {"structured_outputs": {"structural_tag": json.dumps(tag)}}},
    ):
        chat = client.chat.completions.create(
            model="alpha", messages=MESSAGES, max_tokens=40, temperature=0, **kw
        )
        assert chat.choices[0].message.content == tag_want.text, kw
    for route, body in [
        ("/v1/completions", {"prompt": PROMPT}),
        ("/v1/chat/completions", {"messages": MESSAGES}),
    ]:
        for extra, param in [
            ({"guided_regex": "(["}, "guided_regex"),
            (
                {"structured_outputs": {"structural_tag": {"structures": [{"begin": 1}], "triggers": []}}},
                "structured_outputs",
            ),  # fmt: skip
            ({"guided_grammar": "root ::= "}, "guided_grammar"),
            ({"structured_outputs": {"json": {"type": "nope"}}}, "structured_outputs"),
            ({"structured_outputs": {"regex": "a", "json": {}}}, "structured_outputs"),
            ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format"),
        ]:
            r = httpx.post(real_server.url + route, json={"model": "alpha", **body, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)


def test_tool_choice_required_and_named_on_the_real_engine(client: openai.OpenAI, reference: Any) -> None:
    """Forced tool calls need no parser: decoded under the tools' schema, the tiny random model's
    answer is a call of one of the tools with arguments that satisfy its parameters."""
    compact = {"structured_outputs": {"disable_any_whitespace": True}}  # see the test above
    params = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
              "additionalProperties": False}  # fmt: skip
    tools = [{"type": "function", "function": {"name": n, "parameters": params}} for n in ("temp", "rain")]
    named = client.chat.completions.create(
        model="alpha", messages=MESSAGES, max_tokens=40, temperature=0, tools=tools,
        tool_choice={"type": "function", "function": {"name": "rain"}}, extra_body=compact,
    )  # fmt: skip
    [call] = named.choices[0].message.tool_calls
    want = reference.chat(
        MESSAGES, greedy(40, guided_json=params, disable_any_whitespace=True), adapter="alpha"
    )[0].outputs[0]
    assert call.function.name == "rain" and call.function.arguments == want.text
    assert json.loads(call.function.arguments)["unit"] in ("c", "f")
    required = client.chat.completions.create(
        model="alpha", messages=MESSAGES, max_tokens=80, temperature=0, tools=tools, tool_choice="required",
        extra_body=compact,
    )  # fmt: skip
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls and all(
        c.function.name in ("temp", "rain") for c in choice.message.tool_calls
    )
    assert all(json.loads(c.function.arguments)["unit"] in ("c", "f") for c in choice.message.tool_calls)


def test_cache_salt_keeps_prefix_cache_hits_within_a_salt(real_server: ServerThread) -> None:
    """vLLM's cache_salt: ``cached_tokens`` shows hits only between requests of the same salt; an
    empty salt is a 400 naming it."""
    ids = list(range(2000, 2040))  # two full blocks of 16 no other test sends

    def cached(salt: str | None, route: str = "/v1/completions") -> int:
        body: dict[str, Any] = {"model": "tiny", "prompt": ids, "max_tokens": 1, "cache_salt": salt}
        r = httpx.post(real_server.url + route, json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert [cached(s) for s in ("s1", "s1", "s2", None, None, "s2")] == [0, 32, 0, 0, 32, 32]
    r = httpx.post(
        real_server.url + "/v1/completions", json={"model": "tiny", "prompt": ids, "cache_salt": ""}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text


def test_adapters_change_the_output(client: openai.OpenAI) -> None:
    texts = {
        m: client.completions.create(model=m, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
        for m in ("tiny", "alpha", "beta")
    }
    assert len(set(texts.values())) == 3, texts


def test_streaming_with_usage_matches_non_streaming(client: openai.OpenAI) -> None:
    full = client.completions.create(model="alpha", prompt=PROMPT, max_tokens=12, temperature=0)
    chunks = list(
        client.completions.create(
            model="alpha",
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason

    chat_full = client.chat.completions.create(model="beta", messages=MESSAGES, max_tokens=10, temperature=0)
    stream = list(
        client.chat.completions.create(
            model="beta",
            messages=MESSAGES,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert stream[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == chat_full.choices[0].message.content
    assert stream[-1].usage.total_tokens == chat_full.usage.total_tokens


def test_n_greater_than_one_and_prompt_lists(client: openai.OpenAI) -> None:
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, n=3, temperature=1.0, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens <= 18 and r.usage.prompt_tokens > 0
    r = client.completions.create(model="alpha", prompt=[PROMPT, "Hello"], max_tokens=4, n=2, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text  # greedy: the n samples agree
    chat = client.chat.completions.create(
        model="beta", messages=MESSAGES, max_tokens=5, n=2, temperature=1.0, seed=3
    )
    assert [c.index for c in chat.choices] == [0, 1]
    streamed = list(
        client.chat.completions.create(
            model="beta", messages=MESSAGES, max_tokens=5, n=2, temperature=1.0, seed=3, stream=True
        )
    )
    for i in (0, 1):
        text = "".join(
            c.choices[0].delta.content or "" for c in streamed if c.choices and c.choices[0].index == i
        )
        assert text == chat.choices[i].message.content  # same seed, same samples, streamed or not


def test_n_greater_than_one_streams_one_finish_per_choice(client: openai.OpenAI) -> None:
    """Samples that stop at different steps: each choice's finish_reason goes out once (it was
    repeated in every later chunk), and the streamed texts equal the non-streamed ones."""
    kw: dict[str, Any] = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "n": 3, "temperature": 1.0}
    kw |= {"seed": 7, "stop": ["e"]}
    full = client.completions.create(**kw)
    assert len({len(c.text) for c in full.choices}) > 1, full.choices  # they finish at different steps
    finishes: dict[int, list[str]] = {0: [], 1: [], 2: []}
    texts = {0: "", 1: "", 2: ""}
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason is not None:
                finishes[c.index].append(c.finish_reason)
    assert finishes == {c.index: [c.finish_reason] for c in full.choices}
    assert texts == {c.index: c.text for c in full.choices}


def test_stop_strings(client: openai.OpenAI, reference: Any) -> None:
    text = reference.generate(PROMPT, greedy(20))[0].outputs[0].text
    # A 3-character stop string from the middle of the greedy answer (not blank).
    stop = next(text[i : i + 3] for i in range(4, len(text) - 3) if text[i : i + 3].strip())
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, stop=[stop])
    choice = r.choices[0]
    assert choice.text == text[: text.index(stop)]
    assert choice.finish_reason == "stop" and getattr(choice, "stop_reason", None) == stop
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, stop=stop, stream=True
        )
    )
    assert streamed == choice.text


def test_seed_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int, model: str = "tiny") -> str:
        return (
            client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=seed)
            .choices[0]
            .text
        )

    assert sample(123) == sample(123)
    assert sample(5, "alpha") == sample(5, "alpha")
    assert len({sample(s) for s in (1, 2, 3, 4)}) > 1


def test_logprobs(client: openai.OpenAI, reference: Any) -> None:
    want = reference.generate(PROMPT, greedy(5, logprobs=3))[0].outputs[0]
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(want.token_ids)
    for step, chosen, top, ref in zip(range(5), lp.token_logprobs, lp.top_logprobs, want.logprobs):
        assert chosen == pytest.approx(ref[want.token_ids[step]].logprob, abs=1e-4)
        assert 1 <= len(top) <= 4 and chosen == pytest.approx(max(top.values()), abs=1e-6)  # greedy: the best
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0

    chat = client.chat.completions.create(
        model="alpha", messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for tok in content:
        assert len(tok.top_logprobs) == 2 and tok.logprob <= 0
        assert tok.top_logprobs[0].logprob >= tok.top_logprobs[1].logprob
    plain = client.chat.completions.create(model="alpha", messages=MESSAGES, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_echo_and_cached_tokens(client: openai.OpenAI) -> None:
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert r.choices[0].text.startswith(PROMPT)
    long_prompt = "one two three four five six seven eight nine ten " * 6  # several KV blocks
    client.completions.create(model="beta", prompt=long_prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model="beta", prompt=long_prompt, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


def test_real_engine_error_paths(real_server: ServerThread, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="ghost", prompt=PROMPT)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="word " * 400)  # over max_model_len
    assert e.value.body["param"] == "prompt"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1000)
    assert e.value.body["param"] == "max_tokens"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "word " * 400}])
    assert e.value.body["param"] == "messages"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=[10**9])
    assert e.value.body["param"] == "prompt"  # type: ignore[index]
    assert httpx.get(real_server.url + "/app-own").json() == {"mine": "yes"}
    assert wait_until(lambda: engine_idle(real_server.plugin.engine))


def test_client_disconnect_mid_stream_frees_blocks(real_server: ServerThread) -> None:
    engine = real_server.plugin.engine  # type: ignore[attr-defined]
    with (
        httpx.Client(timeout=30) as c,
        c.stream(
            "POST",
            real_server.url + "/v1/completions",
            json={
                "model": "alpha",
                "prompt": PROMPT,
                "max_tokens": 200,
                "temperature": 1.0,
                "stream": True,
                "ignore_eos": True,
            },
        ) as s,
    ):
        lines = s.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["index"] == 0
        assert engine.stats().num_running + engine.stats().num_waiting >= 1
    assert wait_until(lambda: engine_idle(real_server.plugin.engine), timeout=10)


def test_overloaded_engine_answers_503(tiny_model_dir: Path) -> None:
    from litestar import Litestar

    from lorastar.plugin import LoraStarConfig, LoraStarPlugin

    plugin = LoraStarPlugin(
        LoraStarConfig(
            engine=engine_config(tiny_model_dir, max_num_seqs=1), max_waiting=1, retry_after_seconds=2
        )
    )
    import concurrent.futures

    with ServerThread(Litestar(plugins=[plugin])) as srv:
        srv.plugin = plugin  # type: ignore[attr-defined]

        def one(_: int) -> httpx.Response:
            return httpx.post(
                srv.url + "/v1/completions",
                json={"prompt": PROMPT, "max_tokens": 30, "ignore_eos": True},
                timeout=60,
            )

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            responses = list(pool.map(one, range(8)))
        codes = sorted(r.status_code for r in responses)
        assert set(codes) <= {200, 503} and 200 in codes and 503 in codes, codes
        busy = next(r for r in responses if r.status_code == 503)
        assert busy.headers["retry-after"] == "2" and busy.json()["error"]["code"] == 503
        assert wait_until(lambda: engine_idle(srv.plugin.engine))
        # a batch the queue can never hold is bad input, not "retry later"
        batch = httpx.post(
            srv.url + "/v1/completions", json={"prompt": [PROMPT, PROMPT], "max_tokens": 2}, timeout=60
        )
        assert batch.status_code == 400 and batch.json()["error"]["param"] == "prompt", batch.text
        assert "max_waiting" in batch.json()["error"]["message"]


def test_metrics_and_health_on_real_engine(real_server: ServerThread, client: openai.OpenAI) -> None:
    import re

    client.completions.create(model="alpha", prompt=PROMPT, max_tokens=4, temperature=0)
    assert httpx.get(real_server.url + "/health").status_code == 200
    text = httpx.get(real_server.url + "/metrics").text

    def value(pattern: str) -> float:
        m = re.search(rf"^{pattern} ([0-9.e+-]+)$", text, re.M)
        assert m, pattern
        return float(m.group(1))

    assert value(r'vllm:prompt_tokens_total\{model_name="tiny"\}') > 0
    assert value(r'vllm:generation_tokens_total\{model_name="tiny"\}') > 0
    assert value(r'vllm:time_to_first_token_seconds_count\{model_name="tiny"\}') > 0
    assert value(r'vllm:e2e_request_latency_seconds_count\{model_name="tiny"\}') > 0
    assert value(r'vllm:inter_token_latency_seconds_count\{model_name="tiny"\}') > 0
    assert value(r'lorastar:adapter_requests_total\{adapter="alpha",model_name="tiny"\}') >= 1
    assert 0 <= value(r'vllm:kv_cache_usage_perc\{model_name="tiny"\}') <= 1
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
    ):
        value(rf'{name}\{{model_name="tiny"\}}')
    assert re.search(r'^vllm:lora_requests_info\{max_lora="4",', text, re.M)


def test_failed_step_rebuilds_engine_and_serves_again(
    tiny_model_dir: Path, adapter_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that raises fails the requests in it (in-band 503 frame), the engine is rebuilt with
    its adapters (503 + Retry-After on /health meanwhile), then serves the same greedy output."""
    from litestar import Litestar

    import lorastar.engine.async_engine as async_engine
    from lorastar.plugin import LoraStarConfig, LoraStarPlugin

    plugin = LoraStarPlugin(
        LoraStarConfig(
            engine=engine_config(tiny_model_dir),
            served_model_name="tiny",
            adapters={"alpha": str(adapter_root / "alpha")},
        )
    )
    body = {"model": "alpha", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    with ServerThread(Litestar(plugins=[plugin])) as srv:
        before = httpx.post(srv.url + "/v1/completions", json=body, timeout=30).json()["choices"][0]["text"]
        llm = plugin.engine
        llm.restart_backoff = (0.5, 1.0)
        inner = llm.engine  # the synchronous LLMEngine behind AsyncLLM
        real_step = inner.step
        steps = {"n": 0}

        def dying_step() -> Any:
            steps["n"] += 1
            if steps["n"] > 3:
                raise RuntimeError("simulated device failure")
            return real_step()

        inner.step = dying_step
        # The first rebuild fails too (as a device still in trouble would): the 503 window lasts
        # one backoff, long enough to observe.
        real_engine_cls = async_engine.LLMEngine
        builds = {"n": 0}

        def flaky_engine(config: Any) -> Any:
            builds["n"] += 1
            if builds["n"] == 1:
                raise RuntimeError("simulated rebuild failure")
            return real_engine_cls(config)

        monkeypatch.setattr(async_engine, "LLMEngine", flaky_engine)
        r = httpx.post(
            srv.url + "/v1/completions",
            timeout=30,
            json={"prompt": PROMPT, "max_tokens": 50, "ignore_eos": True, "stream": True},
        )
        assert r.status_code == 200
        frames = r.text.split("\n\n")
        assert frames[-2] == "data: [DONE]"
        err = json.loads(frames[-3][6:])["error"]
        assert err["code"] == 503 and "Traceback" not in r.text and "simulated" not in r.text
        down = httpx.get(srv.url + "/health")
        assert down.status_code == 503 and int(down.headers["retry-after"]) >= 1
        busy = httpx.post(srv.url + "/v1/completions", json=body)
        assert busy.status_code == 503 and "retry-after" in busy.headers
        assert wait_until(lambda: httpx.get(srv.url + "/health").status_code == 200, timeout=60)
        assert llm.num_restarts == 1 and builds["n"] == 2
        after = httpx.post(srv.url + "/v1/completions", json=body, timeout=30).json()["choices"][0]["text"]
        assert after == before  # the adapter was re-registered: same weights, same greedy text
        metrics = httpx.get(srv.url + "/metrics").text
        assert 'vllm:num_requests_running{model_name="tiny"} 0.0' in metrics
        llm.engine.check_invariants()
        assert llm.engine.kv_cache_usage().num_used_blocks == 0


def test_shutdown_lets_in_flight_streams_finish(tiny_model_dir: Path) -> None:
    import threading

    from litestar import Litestar

    from lorastar.plugin import LoraStarConfig, LoraStarPlugin

    plugin = LoraStarPlugin(LoraStarConfig(engine=engine_config(tiny_model_dir)))
    srv = ServerThread(Litestar(plugins=[plugin])).__enter__()
    try:
        frames: list[str] = []
        started = threading.Event()

        def stream() -> None:
            with httpx.stream(
                "POST",
                srv.url + "/v1/completions",
                timeout=60,
                json={"prompt": PROMPT, "max_tokens": 60, "ignore_eos": True, "stream": True},
            ) as s:
                for line in s.iter_lines():
                    if line:
                        frames.append(line)
                        started.set()

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(30)
        srv.server.should_exit = True  # the server stops while the stream is in flight
        t.join(60)
    finally:
        srv.__exit__(None, None, None)
    assert frames[-1] == "data: [DONE]"
    assert json.loads(frames[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert not plugin.service.started and not plugin.engine.is_running
