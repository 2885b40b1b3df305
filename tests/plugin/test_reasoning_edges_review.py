"""Reasoning edge cases on the chat route against vLLM's: a structured output of any kind follows the
thinking block, and a prompt that already opened or closed the block decides how the answer is read
(fake engine: ``ScriptedLLM`` answers what ``say`` wrote; ``TagTokenizer`` makes the thinking tags
one token each, as Qwen3's and DeepSeek-R1's tokenizers do)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
from plugin_fake_engine import ScriptedLLM, TagTokenizer, say
from plugin_support import ServerThread
from xgrammar.testing import _is_grammar_accept_string as accepts

from lorastar.engine.structured import parse_grammar
from lorastar.plugin import LoraStarConfig, create_app


class TemplateTagLLM(ScriptedLLM):
    """``ScriptedLLM`` whose template ends the prompt with ``suffix`` (ids: the thinking tags as a
    template writes them); the answer is still what ``say`` wrote."""

    suffix: list[int] = []

    def apply_chat_template(self, messages: list[dict], *args: Any, **kw: Any) -> list[int]:
        return [*super().apply_chat_template(messages, *args, **kw), *self.suffix]

    async def generate(self, prompt: Any, sampling_params: Any = None, **kw: Any) -> AsyncIterator[Any]:
        if self.suffix and isinstance(prompt, list):
            prompt = prompt[: len(prompt) - len(self.suffix)]
        async for out in super().generate(prompt, sampling_params, **kw):
            yield out


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, tuple[httpx.Client, TemplateTagLLM]]]:
    made: dict[str, tuple[httpx.Client, TemplateTagLLM]] = {}
    with ExitStack() as stack:
        for style in ("deepseek_r1", "qwen3"):
            fake = TemplateTagLLM(max_model_len=4096, step_delay=0)
            fake.tokenizer = TagTokenizer(fake.tokenizer)
            srv = stack.enter_context(
                ServerThread(create_app(LoraStarConfig(async_engine=fake, reasoning_parser=style)))
            )
            made[style] = (stack.enter_context(httpx.Client(base_url=srv.url, timeout=30)), fake)
        yield made


@pytest.fixture
def server(servers: dict[str, tuple[httpx.Client, TemplateTagLLM]]) -> tuple[httpx.Client, TemplateTagLLM]:
    return servers["deepseek_r1"]


def _answer(http: httpx.Client, answer: str, stream: bool = False, **extra: Any) -> tuple[Any, Any]:
    """The (reasoning_content, content) of ``answer``, whole or streamed."""
    body = {"model": "fake-model", "messages": [{"role": "user", "content": say(answer)}],
            "max_tokens": len(answer), "stream": stream, **extra}  # fmt: skip
    if not stream:
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        msg = r.json()["choices"][0]["message"]
        return msg["reasoning_content"], msg["content"]
    reasoning, content = None, None
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for ch in json.loads(line[6:])["choices"]:
                    if "reasoning_content" in ch["delta"]:
                        reasoning = (reasoning or "") + ch["delta"]["reasoning_content"]
                    if ch["delta"].get("content"):
                        content = (content or "") + ch["delta"]["content"]
    return reasoning, content


CHOICES = ["yes", "no", 'a "quoted"\\ choice', "two\nlines", "é😀"]


@pytest.mark.parametrize(
    "constraint", [{"guided_choice": CHOICES}, {"structured_outputs": {"choice": CHOICES}}]
)
def test_a_choice_follows_the_thinking_block(
    server: tuple[httpx.Client, TemplateTagLLM], constraint: dict[str, Any]
) -> None:
    """vLLM compiles a choice into a grammar, which (as every structured output) applies after the
    reasoning parser's end tag: the model thinks first, then answers one of the choices. Before,
    the choice bound the first token, so a DeepSeek-R1 model could not think and its answer came
    back as ``reasoning_content`` with ``content`` null."""
    http, fake = server
    answer = "hm</think>yes"
    body = {"model": "fake-model", "messages": [{"role": "user", "content": say(answer)}]}
    r = http.post("/v1/chat/completions", json={**body, "max_tokens": len(answer), **constraint})
    assert r.status_code == 200, r.text
    p = fake.last_params
    assert p.reasoning_end_token_id == 901  # the engine frees the block, then constrains
    grammar = parse_grammar(p)
    assert grammar is not None and p.guided_choice is None
    for c in CHOICES:
        assert accepts(grammar, c), c
    assert not accepts(grammar, "maybe") and not accepts(grammar, "yesno")


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_that_closed_the_block_gets_an_answer_of_content(
    servers: dict[str, tuple[httpx.Client, TemplateTagLLM]], stream: bool
) -> None:
    """A hybrid template with ``enable_thinking=False`` ends the prompt with ``<think>\\n\\n</think>\\n\\n``:
    vLLM reads the prompt (``is_reasoning_end``), so the answer is content and a constraint binds
    from its first token. Before, a ``deepseek_r1`` server returned the whole answer as
    ``reasoning_content`` (content null), held a JSON constraint back for a ``</think>`` that never
    came, and a budget forced ``</think>`` into the answer."""
    http, fake = servers["deepseek_r1"]
    fake.suffix = [900, ord("\n"), ord("\n"), 901, ord("\n"), ord("\n")]
    try:
        assert _answer(http, "just the answer", stream) == (None, "just the answer")
        _answer(http, "{}", stream, response_format={"type": "json_object"}, thinking_token_budget=3)
        p = fake.last_params
        assert (p.reasoning_end_token_id, p.thinking_token_budget) == (None, None)
    finally:
        fake.suffix = []
    assert _answer(http, "plan</think>answer", stream) == ("plan", "answer")  # the template's own block


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_that_opened_the_block_gets_reasoning_first_on_qwen3(
    servers: dict[str, tuple[httpx.Client, TemplateTagLLM]], stream: bool
) -> None:
    """Qwen3-Thinking-2507's and Qwen3.5's templates end the prompt with ``<think>\\n``: vLLM's qwen3
    parser reads the answer as reasoning up to ``</think>``. Before, the answer was all content,
    the ``</think>`` tag included, and a constraint bound the first token of the thinking."""
    http, fake = servers["qwen3"]
    fake.suffix = [900, ord("\n")]
    try:
        assert _answer(http, "plan</think>answer", stream) == ("plan", "answer")
        assert _answer(http, "cut off", stream) == ("cut off", None)
        _answer(http, "{}", stream, response_format={"type": "json_object"})
        p = fake.last_params
        assert (p.reasoning_start_token_id, p.reasoning_end_token_id) == (None, 901)
    finally:
        fake.suffix = []
    # the qwen3 template of old: the model opens the block itself, or answers without one
    assert _answer(http, "<think>plan</think>answer", stream) == ("plan", "answer")
    assert _answer(http, "answer only", stream) == (None, "answer only")
