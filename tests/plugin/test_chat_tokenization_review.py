"""Chat prompts against vLLM's rendering of the same request: the fake engine (it answers with its
prompt reversed) with, where the prompt itself matters, a real tokenizer (SmolLM2's) and its chat
template rendering the messages."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from plugin_fake_engine import FakeAsyncLLM
from plugin_support import ServerThread
from transformers import AutoTokenizer

from lorastar.engine.chat_content import content_format, template_content
from lorastar.engine.input_processor import InputProcessor
from lorastar.models.default import default_model_dir
from lorastar.plugin import LoraStarConfig, create_app

# Granite 3's way with RAG documents, cut down: the documents before the conversation.
RAG_TEMPLATE = (
    "{%- if documents %}<|im_start|>documents\n{% for d in documents %}[{{ d['title'] }}] {{ d['text'] }}\n"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class TemplateLLM(FakeAsyncLLM):
    """The fake engine whose chat prompts are rendered by a real tokenizer's template
    (``InputProcessor``): the ids it generates from are the real prompt's."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(max_model_len=4096)
        self.inputs = InputProcessor(
            tokenizer, model_name="fake-model", max_model_len=4096, max_prompt_bytes=1 << 20, vocab_size=49152
        )
        self.prompts: list[list[int]] = []

    def apply_chat_template(self, messages: list[dict], *args: Any, **kw: Any) -> list[int]:
        fmt = content_format(self.inputs.tokenizer.chat_template)  # content as the template reads it
        given = [{**m, "content": template_content(m.get("content"), fmt, i)} for i, m in enumerate(messages)]
        self.rendered.append((given, kw.get("tools")))
        ids = self.inputs.apply_chat_template(messages, *args, **kw)
        self.prompts.append(ids)
        return ids


@pytest.fixture(scope="module")
def tok() -> Any:
    t = AutoTokenizer.from_pretrained(str(default_model_dir()))
    t.chat_template = RAG_TEMPLATE
    return t


@pytest.fixture(scope="module")
def engine(tok: Any) -> TemplateLLM:
    return TemplateLLM(tok)


@pytest.fixture(scope="module")
def http(engine: TemplateLLM) -> Iterator[httpx.Client]:
    with (
        ServerThread(create_app(LoraStarConfig(async_engine=engine))) as srv,
        httpx.Client(base_url=srv.url, timeout=30) as c,
    ):
        yield c


def test_documents_reach_the_chat_template(http: httpx.Client, engine: TemplateLLM, tok: Any) -> None:
    """vLLM's ``documents`` (RAG: Granite's, Command-R's templates) go to the template as its
    ``documents``: they were dropped without a word, the model never saw them."""
    msgs = [{"role": "user", "content": "What is the capital?"}]
    docs = [{"title": "France", "text": "Paris is the capital of France."}]
    r = http.post("/v1/chat/completions", json={"messages": msgs, "documents": docs, "max_tokens": 2})
    assert r.status_code == 200, r.text
    want = tok(
        tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, documents=docs),
        add_special_tokens=False,
    )["input_ids"]
    assert engine.prompts[-1] == want and "[France] Paris" in tok.decode(want)
    assert r.json()["usage"]["prompt_tokens"] == len(want)
    # a document that is not an object of strings is the client's 400, naming the field
    r = http.post("/v1/chat/completions", json={"messages": msgs, "documents": [{"text": 1}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents", r.text


def test_documents_on_the_input_processor(tok: Any) -> None:
    """The engine's ``apply_chat_template`` (shared by every engine client) takes them too."""
    inputs = InputProcessor(tok, model_name="m", max_model_len=4096, max_prompt_bytes=64, vocab_size=49152)
    msgs = [{"role": "user", "content": "hi"}]
    ids = inputs.apply_chat_template(msgs, documents=[{"title": "t", "text": "body"}])
    assert tok.decode(ids).startswith("<|im_start|>documents\n[t] body\n")
    assert inputs.apply_chat_template(msgs, documents=[]) == inputs.apply_chat_template(msgs)
    with pytest.raises(Exception, match="max_prompt_bytes"):  # documents count toward the limit
        inputs.apply_chat_template(msgs, documents=[{"title": "t", "text": "x" * 100}])


def test_refusal_and_input_text_parts_are_text(http: httpx.Client, engine: TemplateLLM) -> None:
    """vLLM takes an assistant's ``{"type": "refusal", "refusal": ...}`` part (OpenAI's, sent back
    with the history) and ``input_text`` / ``output_text`` parts as text, and skips a text part
    without its text; each was a 400 "only text parts are supported"."""
    msgs = [
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "text", "text": None}]},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]},
        {"role": "user", "content": [{"type": "text", "text": "b"}, {"type": "output_text", "text": "c"}]},
    ]
    r = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert [m["content"] for m in engine.rendered[-1][0]] == ["a", "I can't.", "b\nc"]
    # other parts stay refused
    bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    r = http.post("/v1/chat/completions", json={"messages": bad, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
