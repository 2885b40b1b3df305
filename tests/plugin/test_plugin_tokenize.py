"""``/tokenize``, ``/detokenize``, ``/version`` on the live shared server (real engine, tiny model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from transformers import AutoTokenizer

import lorastar


def _post(srv: Any, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(srv.url + route, json=body, timeout=60)


def test_tokenize_detokenize_roundtrip(real_server: Any, tiny_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    r = _post(real_server, "/tokenize", {"model": "tiny", "prompt": "Hello world", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    expected = tok("Hello world")["input_ids"]
    assert body["tokens"] == expected and body["count"] == len(expected)
    assert body["max_model_len"] > 0 and body["token_strs"] == tok.convert_ids_to_tokens(expected)
    r = _post(real_server, "/detokenize", {"model": "tiny", "tokens": body["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": tok.decode(expected)}
    # chat form: the chat template with the generation prompt, no extra special tokens
    msgs = [{"role": "user", "content": "hi"}]
    r = _post(real_server, "/tokenize", {"model": "alpha", "messages": msgs})
    want = tok(
        tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )
    assert r.status_code == 200 and r.json()["tokens"] == want["input_ids"] and r.json()["token_strs"] is None
    # add_special_tokens with messages (vLLM's field): the rendered text tokenized with them
    r = _post(real_server, "/tokenize", {"model": "tiny", "messages": msgs, "add_special_tokens": True})
    want = tok(
        tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True), add_special_tokens=True
    )
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == want["input_ids"]


def test_chat_template_add_special_tokens_adds_what_the_tokenizer_adds(tiny_model_dir: Path) -> None:
    """With a tokenizer that adds a BOS to any text, the rendered messages get it only when asked
    (transformers 5's tokenizers have no ``build_inputs_with_special_tokens``: /tokenize used it and
    answered 500)."""
    from lorastar.engine.input_processor import InputProcessor

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tok.add_bos_token = True
    inputs = InputProcessor(tok, model_name="tiny", max_model_len=64, max_prompt_bytes=4096, vocab_size=49152)
    msgs = [{"role": "user", "content": "hi"}]
    plain = inputs.apply_chat_template(msgs)
    with_bos = inputs.apply_chat_template(msgs, add_special_tokens=True)
    assert with_bos == [tok.bos_token_id, *plain]


def test_adapter_id_selects_or_is_refused(real_server: Any) -> None:
    ok = _post(real_server, "/tokenize", {"prompt": "x", "adapter_id": "alpha"})
    assert ok.status_code == 200
    both = _post(real_server, "/tokenize", {"model": "alpha", "prompt": "x", "adapter_id": "alpha"})
    assert both.status_code == 200 and both.json() == ok.json()
    unknown = _post(real_server, "/tokenize", {"prompt": "x", "adapter_id": "nope"})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "adapter_id"
    clash = _post(real_server, "/detokenize", {"model": "beta", "tokens": [1], "adapter_id": "alpha"})
    assert clash.status_code == 400 and clash.json()["error"]["param"] == "adapter_id"
    assert "adapter_id 'alpha'" in clash.json()["error"]["message"]
    no_model = _post(real_server, "/tokenize", {"model": "ghost", "prompt": "x"})
    assert no_model.status_code == 404 and no_model.json()["error"]["param"] == "model"


def test_bad_input_and_version(real_server: Any) -> None:
    r = _post(real_server, "/tokenize", {"model": "tiny"})
    assert r.status_code == 400 and "exactly one of" in r.json()["error"]["message"]
    r = _post(real_server, "/detokenize", {"tokens": [10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = httpx.get(real_server.url + "/version", timeout=10)
    assert r.status_code == 200 and r.json() == {"version": lorastar.__version__}
