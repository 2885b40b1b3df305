"""Detokenizer and stop-string edge cases: the output text is ``decode(output ids)`` (vLLM's rule) and
never raises, whatever bytes the prompt ends with or the model emits."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import AutoTokenizer

from lorastar import LLM
from lorastar.engine.detokenizer import IncrementalDetokenizer
from lorastar.engine.output_processor import OutputProcessor
from lorastar.engine.outputs import EngineCoreOutput, SampleDelta
from lorastar.engine.sampling import RequestOutputKind, SamplingParams
from lorastar.models.default import default_model_dir


@pytest.fixture(scope="module")
def tok():  # noqa: ANN201
    return AutoTokenizer.from_pretrained(default_model_dir())


@pytest.fixture(scope="module")
def byte_fallback_tok() -> Tokenizer:
    """Byte tokens <0x00>..<0xFF> and "a", decoded as Llama's byte fallback does (a run of byte
    tokens that is not valid UTF-8 becomes one U+FFFD per byte)."""
    vocab = {"<unk>": 0, **{f"<0x{i:02X}>": i + 1 for i in range(256)}, "a": 257}
    tk = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tk.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    return tk


class _DecodeOnly:
    """A tokenizer with ``decode`` alone: the Python windowed-decode path."""

    def __init__(self, t) -> None:  # noqa: ANN001
        self.decode = t.decode


def _stream(t, prompt: list[int], out: list[int]) -> str:  # noqa: ANN001
    d = IncrementalDetokenizer(t, prompt)
    deltas = [d.add(x) for x in out] + [d.flush()]
    assert "".join(deltas) == d.text
    return d.text


def _run(proc: OutputProcessor, out: list[int]) -> str:
    """Feed ``out`` one token a step (the last ends it by length); the joined DELTA text."""
    text = ""
    for i, t in enumerate(out):
        fin = i == len(out) - 1
        outs, _ = proc.process(
            [EngineCoreOutput("r", [SampleDelta(0, [t], finish_reason="length" if fin else None)])]
        )
        text += "".join(o.outputs[0].text for o in outs)
    return text


# ---------------------------------------------------------------------- a prompt cut inside a character


@pytest.mark.parametrize("text", ["Say hi 🚀", "日本語", "x 👍🏽"])
def test_prompt_ids_ending_inside_a_character_add_no_prompt_text(tok, text: str) -> None:  # noqa: ANN001
    """Prompt token ids cut mid-character (a generation cut at max_tokens, continued): DecodeStream,
    seeded with a tail whose text ends in U+FFFD, took its prefix as "" and emitted the prompt tail's
    text ("Say hi 🚀 ok"); the Python path dropped the output's first byte (" ok")."""
    full = tok.encode(text)
    cut = len(full) - 1
    assert tok.decode(full[:cut]).endswith("\ufffd")
    out = [*full[cut:], *tok.encode(" ok")]
    for t in (tok, _DecodeOnly(tok)):
        assert _stream(t, full[:cut], out) == tok.decode(out)
    proc = OutputProcessor(tok)
    proc.add_request(
        "r", None, full[:cut], SamplingParams(max_tokens=50, output_kind=RequestOutputKind.DELTA)
    )
    assert _run(proc, out) == tok.decode(out)


def test_llm_generate_after_prompt_ids_cut_inside_a_character(tiny_model_dir) -> None:  # noqa: ANN001
    llm = LLM(tiny_model_dir("llama-gqa"), num_kv_blocks=64, max_model_len=128)
    prompt = llm.tokenizer.encode("Say hi 🚀")[:-1]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0]
    assert out.text == llm.tokenizer.decode(out.token_ids)
    assert not out.text.startswith("Say")


# ---------------------------------------------------------------------- invalid UTF-8 from byte tokens


@pytest.mark.parametrize("seq", [[0xC3, 0xA9, 0xA9], [0x41, 0x80], [0xE6, 0x97, 0x41, 0x80]])
def test_byte_fallback_invalid_utf8_never_raises(byte_fallback_tok: Tokenizer, seq: list[int]) -> None:
    """A valid run of byte tokens ("é", "A") that a later stray byte makes invalid: byte fallback
    rewrites the text already emitted to U+FFFD, and DecodeStream raised "Invalid prefix
    encountered" out of the request's step. The text goes on (U+FFFD for the bad bytes)."""
    tk = byte_fallback_tok
    out = [b + 1 for b in seq] + [257, 257]
    assert tk.decode(out).endswith("\ufffdaa")
    fast = _stream(tk, [257], out)
    assert fast == _stream(_DecodeOnly(tk), [257], out)
    assert fast.endswith("\ufffdaa")
    proc = OutputProcessor(tk)
    proc.add_request(
        "r", None, [257], SamplingParams(max_tokens=50, stop=["aa"], output_kind=RequestOutputKind.DELTA)
    )
    text = _run(proc, out)
    assert text == fast[: -len("aa")] and text.endswith("\ufffd")


# ---------------------------------------------------------------------- stop strings (behaviour pinned)


def test_stop_completed_by_the_text_of_a_held_back_character(tok) -> None:  # noqa: ANN001
    """ " 🚀" is three byte-level tokens; the space is held back with the incomplete emoji, so a stop
    " " is found (and nothing partial streamed) only once the emoji completes."""
    out = tok.encode("ab 🚀 cd")
    for include, want in ((False, "ab"), (True, "ab ")):
        proc = OutputProcessor(tok)
        params = SamplingParams(
            max_tokens=50,
            stop=[" 🚀 c", " "],
            include_stop_str_in_output=include,
            output_kind=RequestOutputKind.DELTA,
        )
        proc.add_request("r", None, [1], params)
        assert _run(proc, out) == want
