"""Incremental detokenization across the tokenizer kinds real models use (Llama-2 / Mistral / Gemma
metaspace with byte fallback, Llama-3 / Qwen byte-level BPE with added tokens, WordPiece, Unigram),
checked against ``decode`` of the output ids in the prompt's context (vLLM's text)."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from lorastar.engine.detokenizer import IncrementalDetokenizer
from lorastar.engine.output_processor import OutputProcessor
from lorastar.engine.outputs import EngineCoreOutput, SampleDelta
from lorastar.engine.sampling import RequestOutputKind, SamplingParams

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello world, translate this!",
    "Café naïve déjà vu, don't it's: (parens) [brackets] <tags> 1234567890",
] * 5
_BYTES = [f"<0x{i:02X}>" for i in range(256)]
_SPECIALS = ["<s>", "</s>", "<|eot_id|>", "<|im_start|>"]
_ADDED = [
    AddedToken("<think>", normalized=False, special=False),
    AddedToken("[TOOL]", normalized=True, special=False),
]


def _wrap(tk: Tokenizer) -> PreTrainedTokenizerFast:
    tk.add_special_tokens(_SPECIALS)
    tk.add_tokens(_ADDED)
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<s>", eos_token="</s>", additional_special_tokens=_SPECIALS[2:]
    )


def _metaspace(decoder: str) -> PreTrainedTokenizerFast:
    """SentencePiece-converted BPE with byte fallback: "llama" (Strip decoder: Llama-2, Mistral),
    "metaspace" (Metaspace decoder) or "gemma" (no prepended "▁", nothing stripped)."""

    def configure(tk: Tokenizer) -> None:
        if decoder == "gemma":
            tk.normalizer = normalizers.Replace(" ", "▁")
        else:
            tk.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
        steps = [decoders.ByteFallback()]
        if decoder == "metaspace":
            steps.append(decoders.Metaspace(prepend_scheme="first", split=False))
        else:
            steps = [decoders.Replace("▁", " "), *steps, decoders.Fuse()]
        if decoder == "llama":
            steps.append(decoders.Strip(" ", 1, 0))
        tk.decoder = decoders.Sequence(steps)

    trained = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    configure(trained)
    trainer = trainers.BpeTrainer(vocab_size=380, special_tokens=["<unk>", *_BYTES], limit_alphabet=80)
    trained.train_from_iterator(_CORPUS, trainer)
    model = json.loads(trained.to_str())["model"]  # rebuilt: byte tokens are ordinary vocabulary
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tk = Tokenizer(models.BPE(model["vocab"], merges, unk_token="<unk>", byte_fallback=True))
    configure(tk)
    return _wrap(tk)


def _byte_level() -> PreTrainedTokenizerFast:
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tk.train_from_iterator(_CORPUS, trainers.BpeTrainer(vocab_size=360, initial_alphabet=alphabet))
    return _wrap(tk)


def _wordpiece() -> PreTrainedTokenizerFast:
    tk = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tk.normalizer = normalizers.BertNormalizer(lowercase=False)
    tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tk.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    tk.train_from_iterator(_CORPUS, trainers.WordPieceTrainer(vocab_size=200, special_tokens=["[UNK]"]))
    return _wrap(tk)


def _unigram() -> PreTrainedTokenizerFast:
    tk = Tokenizer(models.Unigram())
    tk.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    tk.decoder = decoders.Metaspace(prepend_scheme="always")
    tk.train_from_iterator(
        _CORPUS, trainers.UnigramTrainer(vocab_size=150, unk_token="<unk>", special_tokens=["<unk>"])
    )
    return _wrap(tk)


_KINDS: dict[str, Callable[[], PreTrainedTokenizerFast]] = {
    "llama": lambda: _metaspace("llama"),
    "metaspace": lambda: _metaspace("metaspace"),
    "gemma": lambda: _metaspace("gemma"),
    "byte_level": _byte_level,
    "wordpiece": _wordpiece,
    "unigram": _unigram,
}
_TOKS: dict[str, PreTrainedTokenizerFast] = {}


def _tok(kind: str) -> PreTrainedTokenizerFast:
    if kind not in _TOKS:
        _TOKS[kind] = _KINDS[kind]()
    return _TOKS[kind]


class _DecodeOnly:
    """A tokenizer with ``decode`` alone: the Python windowed-decode path."""

    def __init__(self, t: PreTrainedTokenizerFast) -> None:
        self.decode = t.decode


def _ids(tok: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _in_context(tok: PreTrainedTokenizerFast, prompt: list[int], out: list[int], skip: bool) -> str:
    """vLLM's text: the output ids' text after the prompt's (its first token keeps its space)."""
    kw = {"skip_special_tokens": skip, "clean_up_tokenization_spaces": False}
    full, before = tok.decode(prompt + out, **kw), tok.decode(prompt, **kw)
    assert full.startswith(before)
    return full[len(before) :]


def _stream(t: object, prompt: list[int], out: list[int], skip: bool = True) -> str:
    d = IncrementalDetokenizer(t, prompt, skip_special_tokens=skip)  # type: ignore[arg-type]
    deltas = [d.add(x) for x in out] + [d.flush()]
    assert "".join(deltas) == d.text
    return d.text


def _run(
    tok: PreTrainedTokenizerFast, prompt: list[int], out: list[int], params: SamplingParams
) -> list[str]:
    """Feed ``out`` one token a step through the OutputProcessor (the last ends it by length)."""
    proc = OutputProcessor(tok)
    proc.add_request("r", None, prompt, params)
    texts: list[str] = []
    for i, t in enumerate(out):
        fin = "length" if i == len(out) - 1 else None
        outs, _ = proc.process([EngineCoreOutput("r", [SampleDelta(0, [t], finish_reason=fin)])])
        texts += [o.outputs[0].text for o in outs]
    return texts


# ---------------------------------------------------------------------- a prompt ending in byte-fallback text


@pytest.mark.parametrize("kind", ["llama", "metaspace"])
@pytest.mark.parametrize("prompt_text", ["Translate: 你好", "Hello 🚀🚀", "日本語"])
def test_first_token_keeps_its_space_after_byte_fallback_prompt(kind: str, prompt_text: str) -> None:
    """The prompt's last 5 tokens start inside a byte-fallback character: byte fallback decodes the
    whole byte run to U+FFFD, the context was trimmed to nothing, and "▁the" (decoded alone, its
    space stripped) lost its space: "the fox" where vLLM (and decode in context) has " the fox"."""
    tok = _tok(kind)
    prompt, out = _ids(tok, prompt_text), _ids(tok, prompt_text + " the fox")[len(_ids(tok, prompt_text)) :]
    assert "\ufffd" in tok.decode(prompt[-5:])  # the 5-token tail starts inside a character
    want = _in_context(tok, prompt, out, True)
    assert want == " the fox"
    for t in (tok, _DecodeOnly(tok)):
        assert _stream(t, prompt, out) == want
    params = SamplingParams(max_tokens=50, output_kind=RequestOutputKind.DELTA)
    assert "".join(_run(tok, prompt, out, params)) == want


# ---------------------------------------------------------------------- an incomplete character at the end


@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_incomplete_char_after_byte_fallback_char_flushes_one_replacement(kind: str) -> None:
    """Cut (max_tokens) inside a character right after a byte-fallback one ("你" + half of "好"):
    the flush decoded the held-back byte with the emitted "你", byte fallback turned the whole run
    into U+FFFD, and the text came out "你\\ufffd\\ufffd\\ufffd" (你's bytes again) for one byte."""
    tok = _tok(kind)
    out = _ids(tok, "ok 你好")[:-2]
    assert tok.convert_ids_to_tokens(out[-4:]) == ["<0xE4>", "<0xBD>", "<0xA0>", "<0xE5>"]
    want = _in_context(tok, [], out[:-1], True) + "\ufffd"
    for t in (tok, _DecodeOnly(tok)):
        assert _stream(t, [], out) == want
    params = SamplingParams(max_tokens=50, output_kind=RequestOutputKind.DELTA)
    assert "".join(_run(tok, [], out, params)) == want


# ---------------------------------------------------------------------- property: every kind


_PIECES = st.sampled_from(
    ["the", " fox", " ", "  ", "\n", ".", ",", "don't", "é", "—", "你", "好", "🚀", "👍🏽", "<think>", "[TOOL]", "<s>",
     "</s>", "<|eot_id|>", "<|im_start|>", "x", "Hello", " world"]
)  # fmt: skip


@pytest.mark.parametrize("kind", sorted(_KINDS))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pieces=st.lists(_PIECES, min_size=2, max_size=12), cut=st.integers(0, 10_000), skip=st.booleans())
def test_streamed_text_is_the_output_in_context(kind: str, pieces: list[str], cut: int, skip: bool) -> None:
    """Any text cut between two tokens (not inside a character): the DELTA pieces join to the final
    text, which is the output's text after the prompt's, on both decode paths."""
    tok = _tok(kind)
    ids = _ids(tok, "".join(pieces))
    if not ids:  # whitespace alone, for some kinds
        return
    cut %= len(ids)
    prompt, out = ids[:cut], ids[cut:]
    if "\ufffd" in tok.decode(prompt):  # prompt ids cut inside a character: decode(out) by design
        return
    want = _in_context(tok, prompt, out, skip)
    for t in (tok, _DecodeOnly(tok)):
        assert _stream(t, prompt, out, skip) == want
    deltas = _run(
        tok,
        prompt,
        out,
        SamplingParams(max_tokens=99, skip_special_tokens=skip, output_kind=RequestOutputKind.DELTA),
    )
    assert "".join(deltas) == want
