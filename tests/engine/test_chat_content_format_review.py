"""Message content as the chat template reads it (review), against vLLM's content-format detection
and transformers' rendering: a template that loops over ``message['content']`` (Gemma 3, Mistral 3,
SmolVLM) gets OpenAI's list of text parts, a template that prints it gets the parts joined with
"\\n". lorastar joined the parts for every template: Gemma 3 rendered multi-part messages with
newlines vLLM does not add, and a template with no string branch rendered every message empty."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient

from lorastar.config import EngineConfig
from lorastar.engine.chat_content import content_format
from lorastar.engine.input_processor import InputProcessor, TokenizerLoader, load_tokenizer
from lorastar.errors import InvalidParamError
from lorastar.plugin import LoraStarConfig, create_app

GEMMA3 = (  # Gemma 3's own handling of content (its template, trimmed to the text parts)
    "{{ bos_token }}{%- for message in messages -%}<start_of_turn>{{ message['role'] }}\n"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}<end_of_turn>\n{% endfor -%}{%- if add_generation_prompt -%}<start_of_turn>model\n{% endif -%}"
)
LISTS_ONLY = (  # SmolVLM's: no string branch
    "{% for message in messages %}{{ message['role'] }}:{% for line in message['content'] %}"
    "{% if line['type'] == 'text' %} {{ line['text'] }}{% endif %}{% endfor %}\n{% endfor %}"
)
ALIASED = (  # through a {% set %} of a slice and attribute access
    "{% set loop_messages = messages[0:] %}{% for m in loop_messages %}{{ m.role }}:"
    "{% for part in m.content %}[{{ part.text }}]{% endfor %}\n{% endfor %}"
)
STRING = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {
        "role": "user",
        "content": [{"type": "text", "text": " Hello "}, {"type": "input_text", "text": "world"}],
    },
    {"role": "assistant", "content": None},
    {"role": "user", "content": [{"type": "text", "text": None}, {"type": "text", "text": "again"}]},
]
AS_PARTS = [  # what vLLM hands a template of the "openai" content format
    {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
    {"role": "user", "content": [{"type": "text", "text": " Hello "}, {"type": "text", "text": "world"}]},
    {"role": "assistant", "content": []},
    {"role": "user", "content": [{"type": "text", "text": "again"}]},
]
AS_STRINGS = [  # and one of the "string" format
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": " Hello \nworld"},
    {"role": "assistant", "content": ""},
    {"role": "user", "content": "again"},
]


def _inputs(folder: str, template: str) -> InputProcessor:
    return InputProcessor(
        TokenizerLoader(Path(folder), template), model_name="m", max_model_len=512,
        max_prompt_bytes=1 << 16, vocab_size=1 << 20,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("template", "fmt"), [(GEMMA3, "openai"), (LISTS_ONLY, "openai"), (ALIASED, "openai"), (STRING, "string")]
)
def test_messages_render_as_transformers_renders_what_vllm_hands_the_template(
    tiny_model_dir: Any, template: str, fmt: str
) -> None:
    assert content_format(template) == fmt
    folder = tiny_model_dir("llama-gqa")
    reference = load_tokenizer(Path(folder), template)
    conversation = AS_PARTS if fmt == "openai" else AS_STRINGS
    want = reference.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    got = _inputs(folder, template).apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert got == reference(want, add_special_tokens=False)["input_ids"]
    if template == LISTS_ONLY:  # was rendered from strings: every message empty
        assert "Hello  world" in want and "again" in want


def test_a_non_text_part_is_refused_naming_messages(tiny_model_dir: Any) -> None:
    inputs = _inputs(tiny_model_dir("llama-gqa"), GEMMA3)
    bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(InvalidParamError, match=r"messages\[0\].content\[0\]: only text parts") as e:
        inputs.apply_chat_template(bad)
    assert e.value.param == "messages"


def test_the_chat_route_hands_a_list_template_the_parts(tiny_model_dir: Any) -> None:
    """Through HTTP (``/tokenize`` renders as ``/v1/chat/completions`` does): the route joined
    the parts before the engine saw them."""
    folder = tiny_model_dir("llama-gqa")
    engine = EngineConfig(
        model=folder, chat_template=GEMMA3, num_kv_blocks=16, cpu_gemm="torch", cpu_kernels="torch"
    )
    reference = load_tokenizer(Path(folder), GEMMA3)
    text = reference.apply_chat_template(AS_PARTS[:2], tokenize=False, add_generation_prompt=True)
    want = reference(text, add_special_tokens=False)["input_ids"]
    with TestClient(create_app(LoraStarConfig(engine=engine))) as c:
        r = c.post("/tokenize", json={"messages": MESSAGES[:2], "add_generation_prompt": True})
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == want
