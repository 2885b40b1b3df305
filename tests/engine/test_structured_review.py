"""Structured outputs against vLLM's xgrammar backend: JSON-schema keywords xgrammar compiles without
enforcing are refused (vLLM's ``has_xgrammar_unsupported_json_features``), as a 400 naming the field
the client sent and offline as ``InvalidParamError``; those it enforces are kept. Matcher-level with
SmolLM2's tokenizer, the HTTP routes on the fake engine, one tiny engine for stop / length / n."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import xgrammar as xgr

from lorastar import LLM, SamplingParams
from lorastar.engine.structured import GrammarCompiler, parse_grammar
from lorastar.errors import InvalidParamError

sys.path.insert(0, str(Path(__file__).parents[1] / "plugin"))  # plugin_fake_engine

# (schema, an output that breaks it which xgrammar 0.2.8 accepts, what the refusal names)
IGNORED: list[tuple[dict[str, Any], str, str]] = [
    ({"type": "number", "multipleOf": 0.5}, "0.3", "'multipleOf' at #"),
    ({"type": "integer", "multipleOf": 2.5}, "7", "'multipleOf' at #"),
    ({"type": ["number", "null"], "multipleOf": 2}, "3", "'multipleOf' at #"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]", "'uniqueItems' at #"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}}, "[1, 2]", "'contains' at #"),
    ({"type": "array", "items": {"type": "integer"}, "maxContains": 1}, "[3, 3]", "'maxContains' at #"),
    (
        {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3},
        '"abcdef"',
        "'maxLength' with 'pattern' at #",
    ),
    ({"type": "string", "format": "date", "maxLength": 3}, '"2020-01-01"', "'maxLength' with 'format' at #"),
    (
        {"type": "object", "propertyNames": {"pattern": "^[a-z]+$", "maxLength": 2}},
        '{"abcd": 1}',
        "'propertyNames' with 'maxLength' and 'pattern' at #",
    ),
    (
        {"type": "object", "propertyNames": {"pattern": "^[a-z]$"}, "unevaluatedProperties": False},
        '{"a": 1}',
        "'unevaluatedProperties' with 'propertyNames' at #",
    ),
    (  # nested: the refusal says where
        {
            "type": "object",
            "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
            "required": ["tags"],
        },
        '{"tags": ["a", "a"]}',
        "'uniqueItems' at #/properties/tags",
    ),
    (
        {
            "$defs": {"half": {"type": "number", "multipleOf": 0.5}},
            "type": "object",
            "properties": {"x": {"$ref": "#/$defs/half"}},
            "required": ["x"],
        },
        '{"x": 0.3}',
        "'multipleOf' at #/$defs/half",
    ),
    (
        {"anyOf": [{"type": "null"}, {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}]},
        "[1, 1]",
        "at #/anyOf/1",
    ),
]
# (schema, an output that breaks it, one that keeps it): xgrammar enforces these; not refused
ENFORCED: list[tuple[dict[str, Any], str | None, str]] = [
    ({"type": "integer", "multipleOf": 5}, "7", "10"),
    ({"type": ["integer", "null"], "multipleOf": 5}, "7", "null"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": False}, None, "[1, 1]"),
    ({"type": "string", "maxLength": 3}, '"abcdef"', '"abc"'),
    ({"type": "string", "format": "email"}, '"abc"', '"a@b.co"'),
    # a format xgrammar does not know is an annotation (JSON Schema's default), not refused
    ({"type": "string", "format": "password"}, None, '"x"'),
    ({"type": "integer", "format": "int64"}, '"x"', "7"),
    ({"type": "string", "pattern": "^a+$"}, '"b"', '"aa"'),
    (  # keywords as property names, and as data (a default), are no keywords
        {
            "type": "object",
            "properties": {
                "contains": {"type": "string", "format": "date"},
                "uniqueItems": {"type": "integer"},
            },
            "required": ["contains", "uniqueItems"],
            "default": {"type": "number", "multipleOf": 0.5},
        },
        '{"contains": "x", "uniqueItems": 1}',
        '{"contains": "2020-01-01", "uniqueItems": 1}',
    ),
    ({"enum": ["é", "日本"]}, '"e"', '"日本"'),
    ({"const": "ü€"}, '"u"', '"ü€"'),
    (  # recursion through $ref
        {
            "type": "object",
            "properties": {"v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
            "required": ["v", "next"],
        },
        '{"v": 1, "next": {"v": "2", "next": null}}',
        '{"v": 1, "next": {"v": 2, "next": null}}',
    ),
]


@pytest.fixture(scope="module")
def compiler(model_dir: str) -> GrammarCompiler:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return GrammarCompiler(lambda: tok, 49152, [tok.eos_token_id])


def _accepts(compiler: GrammarCompiler, grammar: Any, text: str) -> bool:
    """Whether the whole of ``text`` and then EOS pass a fresh matcher of ``grammar``."""
    m = xgr.GrammarMatcher(compiler.compiler().compile_grammar(grammar))
    return m.accept_string(text) and m.accept_token(compiler.eos_token_ids[0]) and m.is_terminated()


def test_keywords_xgrammar_ignores_are_refused_naming_where(compiler: GrammarCompiler) -> None:
    for schema, breaks, names in IGNORED:
        # why: xgrammar compiles it and its matcher takes an output the schema refuses
        assert _accepts(compiler, xgr.Grammar.from_json_schema(json.dumps(schema)), breaks), schema
        sp = SamplingParams(guided_json=schema, max_tokens=4)
        for refuse in (parse_grammar, compiler.compile):  # a frontend's check, the engine's compile
            with pytest.raises(InvalidParamError) as e:
                refuse(sp)
            assert e.value.param == "guided_json", schema
            assert str(e.value).startswith("guided_json: the JSON schema uses "), str(e.value)
            assert names in str(e.value) and "does not enforce" in str(e.value), str(e.value)


def test_keywords_xgrammar_enforces_are_kept(compiler: GrammarCompiler) -> None:
    for schema, breaks, keeps in ENFORCED:
        for ws in (False, True):
            sp = SamplingParams(guided_json=schema, disable_any_whitespace=ws)
            grammar = parse_grammar(sp)
            compiler.compile(sp)
            assert _accepts(compiler, grammar, keeps), (schema, keeps)
            if breaks is not None:
                assert not _accepts(compiler, grammar, breaks), (schema, breaks)


def test_disable_any_whitespace_is_the_compact_form(compiler: GrammarCompiler) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for params in ({"guided_json": schema}, {"guided_json_object": True}):
        loose = parse_grammar(SamplingParams(**params))
        tight = parse_grammar(SamplingParams(**params, disable_any_whitespace=True))
        assert _accepts(compiler, loose, '{ "a" :\n 1 }') and not _accepts(compiler, tight, '{ "a" :\n 1 }')
        assert _accepts(compiler, tight, '{"a": 1}')  # xgrammar's separators: ", " and ": "


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    from litestar.testing import TestClient
    from plugin_fake_engine import FakeAsyncLLM

    from lorastar.plugin import LoraStarConfig, create_app

    with TestClient(create_app(LoraStarConfig(async_engine=FakeAsyncLLM()))) as c:
        yield c


UNIQUE = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
MSGS = [{"role": "user", "content": "hi"}]
TOOL = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": UNIQUE}}},
}


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/v1/completions", {"prompt": "hi", "guided_json": UNIQUE}, "guided_json"),
        ("/v1/completions", {"prompt": "hi", "structured_outputs": {"json": UNIQUE}}, "structured_outputs"),
        (
            "/v1/chat/completions",
            {
                "messages": MSGS,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": UNIQUE}},
            },
            "response_format",
        ),
        (
            "/v1/responses",
            {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": UNIQUE}}},
            "text",
        ),
    ],
)
def test_an_ignored_keyword_is_a_400_naming_the_field_sent(
    client: Any, route: str, body: dict[str, Any], param: str
) -> None:
    r = client.post(
        route, json={**body, "max_tokens" if route != "/v1/responses" else "max_output_tokens": 4}
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (
        err["param"] == param and "'uniqueItems'" in err["message"] and "does not enforce" in err["message"]
    )
    assert "guided_json" not in err["message"] or param == "guided_json", err["message"]


@pytest.mark.parametrize(
    "regex", ["(?=a)a", "(?<!a)b", r"(a)\1", r"\bword\b", "(?i)abc", "a\x00b"]
)  # lookarounds, a backreference, a word boundary, a flag, a NUL
def test_a_regex_xgrammar_cannot_do_is_a_400(client: Any, regex: str) -> None:
    for body in ({"guided_regex": regex}, {"structured_outputs": {"regex": regex}}):
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, **body})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == next(iter(body)), r.text


@pytest.mark.parametrize("choice", [[], [1], [""], ["a", None]])
def test_a_choice_that_is_no_list_of_strings_is_a_400(client: Any, choice: list[Any]) -> None:
    for body in ({"guided_choice": choice}, {"structured_outputs": {"choice": choice}}):
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(body)), r.text


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Callable[[str], str]) -> LLM:
    return LLM(tiny_model_dir("llama-gqa"), num_kv_blocks=64, max_model_len=256)


def test_stop_strings_length_and_n_cut_the_json_as_vllm(llm: LLM) -> None:
    """vLLM applies a stop string and max_tokens after the grammar: the text is cut where they say
    (not valid JSON, finish_reason "stop" / "length"), each of n samples on its own matcher."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    base = {"guided_json": schema, "disable_any_whitespace": True, "temperature": 1.0, "seed": 5}
    cut = llm.generate("hi", SamplingParams(**base, n=3, max_tokens=40, stop=['"']))[0].outputs
    assert [(c.text, c.finish_reason, c.stop_reason) for c in cut] == [("{", "stop", '"')] * 3
    short = llm.generate("hi", SamplingParams(**base, n=2, max_tokens=2))[0].outputs
    for c in short:
        assert c.finish_reason == "length" and c.text.startswith('{"') and len(c.token_ids) == 2
        with pytest.raises(json.JSONDecodeError):
            json.loads(c.text)
    with pytest.raises(InvalidParamError) as e:
        llm.generate("hi", SamplingParams(guided_json=UNIQUE, max_tokens=4))
    assert e.value.param == "guided_json"
    assert not llm.engine.requests
    llm.engine.check_invariants()


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_a_forced_tool_schema_is_served_without_the_keywords_xgrammar_ignores(
    client: Any, tool_choice: Any
) -> None:
    """A tool's parameters describe a function (pydantic writes ``uniqueItems`` for a set): a forced
    call decodes under them less what xgrammar would ignore anyway (the same grammar), as before,
    instead of a 400 the client could not act on; vLLM's default backend serves it too."""
    from lorastar.engine.structured import unenforced_json_feature

    engine = client.app.plugins.get("LoraStarPlugin").service.engine
    body = {"messages": MSGS, "tools": [TOOL], "tool_choice": tool_choice, "max_tokens": 4}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    sent = json.loads(engine.last_params.guided_json)
    assert unenforced_json_feature(sent) is None and "uniqueItems" not in json.dumps(sent)
    assert "items" in json.dumps(sent)  # the rest of the schema is kept
