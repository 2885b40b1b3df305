"""The frontend's half of the output path (vLLM v1's ``OutputProcessor``): the core's per-step
deltas (``EngineCoreOutput``: new token ids, raw logprobs, finish reasons) in, ``RequestOutput``s
out, with incremental detokenization and stop strings here instead of in the core.

The core finishes a sample on EOS, a stop token id or a length limit; a stop string is only
visible in text, so it is found here, and the sample is reported back to be finished in the core
(``process`` returns them; the in-process ``LLMEngine`` finishes them before its step returns, a
frontend of the core process sends ``FinishSamples``). Precedence as before the split: EOS, then
stop token ids, then stop strings, then the length limit. Torch-free: a tokenizer is all it needs.

Thread-safety: one caller at a time (``LLMEngine`` holds its lock; the core client its own).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lorastar.engine.detokenizer import IncrementalDetokenizer, find_stop, hold_back
from lorastar.engine.input_processor import resolve_tokenizer
from lorastar.engine.outputs import (
    CompletionOutput,
    EngineCoreOutput,
    Logprob,
    RawLogprobs,
    RequestOutput,
    SampleDelta,
    SampleLogprobs,
)
from lorastar.engine.sampling import RequestOutputKind, SamplingParams


@dataclass(eq=False)
class _Sample:
    """One of a request's ``n`` outputs as the frontend has built it so far."""

    index: int
    detok: IncrementalDetokenizer | None  # None: beam search (hypotheses are decoded whole)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: SampleLogprobs = field(default_factory=list)
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0  # DELTA: output tokens and text characters handed out already
    sent_chars: int = 0
    sent_finish: bool = False  # DELTA: its finish went out (a finished sample is not sent again)
    held: list[int] = field(default_factory=list)  # hold_back's memo over this sample's growing text


@dataclass(eq=False)
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter: str | None
    samples: dict[int, _Sample] = field(default_factory=dict)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_outputs: int = 0

    @property
    def all_finished(self) -> bool:
        if len(self.samples) < self.params.n:
            return False
        if len(self.samples) == 1:
            return next(iter(self.samples.values())).finish_reason is not None
        return all(s.finish_reason is not None for s in self.samples.values())


class OutputProcessor:
    """Turns core deltas into ``RequestOutput``s of each request's ``output_kind``."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer  # or a TokenizerLoader: loaded when the first output needs it
        self.requests: dict[str, _RequestState] = {}
        self._names: dict[int, str] = {}  # token id -> its text alone (logprobs' decoded_token)

    @property
    def tokenizer(self) -> Any:
        return resolve_tokenizer(self._tokenizer)

    def _name(self, token_id: int) -> str:
        name = self._names.get(token_id)
        if name is None:
            name = self._names[token_id] = self.tokenizer.decode([token_id])
        return name

    def _named(self, raw: RawLogprobs) -> dict[int, Logprob]:
        """``{token_id: Logprob}`` from raw entries (the chosen token first, then the top k). A token
        listed twice keeps its first place and the lower rank: tied at the top, the chosen token's
        own rank counts every tied logprob (2 for a two-way tie), its top-k entry says 1, which is
        what vLLM reports (its dict keeps the later entry)."""
        out: dict[int, Logprob] = {}
        for t, v, rank in raw:
            have = out.get(t)
            if have is None:
                out[t] = Logprob(v, rank, self._name(t))
            elif rank is not None and (have.rank is None or rank < have.rank):
                have.rank = rank
        return out

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        adapter: str | None = None,
    ) -> None:
        self.requests[request_id] = _RequestState(request_id, prompt, prompt_token_ids, params, adapter)

    def drop(self, request_id: str) -> None:
        """Forget a request (failed, or abandoned by its caller)."""
        self.requests.pop(request_id, None)

    def process(
        self, core_outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput], list[tuple[str, int, str]]]:
        """The outputs to hand out for one step, and the samples a stop string finished here
        (``(request_id, index, stop)``) for the core to finish. A core output for a request
        already finished here is ignored."""
        outputs: list[RequestOutput] = []
        stops: list[tuple[str, int, str]] = []
        for co in core_outputs:
            st = self.requests.get(co.request_id)
            if st is None:
                continue
            if co.whole:
                self._whole(st, co.samples)
            else:
                for delta in co.samples:
                    hit = self._append(st, delta)
                    if hit is not None:
                        stops.append((st.request_id, delta.index, hit))
            if co.prompt_logprobs is not None and st.prompt_logprobs is None:
                st.prompt_logprobs = [None if e is None else self._named(e) for e in co.prompt_logprobs]
            finished = co.finished or (not co.whole and st.all_finished)
            kind = st.params.output_kind
            if finished:
                del self.requests[st.request_id]
            elif kind == RequestOutputKind.FINAL_ONLY:
                continue
            outputs.append(self._output(st, co, finished))
        return outputs, stops

    # ---- building the samples ------------------------------------------------------------------
    def _sample(self, st: _RequestState, index: int) -> _Sample:
        s = st.samples.get(index)
        if s is None:
            detok = IncrementalDetokenizer(
                self.tokenizer, st.prompt_token_ids, skip_special_tokens=st.params.skip_special_tokens
            )
            s = st.samples[index] = _Sample(index, detok)
            if st.params.logprobs is not None:
                s.cumulative_logprob = 0.0
        return s

    def _append(self, st: _RequestState, delta: SampleDelta) -> str | None:
        """Add a sample's new tokens; the stop string that finished it here, if any."""
        s = self._sample(st, delta.index)
        if s.finish_reason is not None:  # finished here by a stop string; the core ran on
            return None
        p = st.params
        detok = s.detok
        assert detok is not None
        last = len(delta.token_ids) - 1
        unchecked = 0  # characters of text the loop's stop-string search has not seen
        for i, tok in enumerate(delta.token_ids):
            s.token_ids.append(tok)
            if delta.logprobs is not None:
                lp = delta.logprobs[i]
                s.logprobs.append(self._named(lp))
                s.cumulative_logprob = (s.cumulative_logprob or 0.0) + next(
                    (v for t, v, _ in lp if t == tok), 0.0
                )
            # EOS and stop token ids (the core's "stop" on the last token) come before stop strings;
            # their own text is left out unless include_stop_str_in_output, as vLLM's detokenizer
            # does (with skip_special_tokens=False an EOS would otherwise end the text).
            if i == last and delta.finish_reason == "stop":
                if p.include_stop_str_in_output:
                    new_text = detok.add(tok)
                    s.text += new_text
                    unchecked = len(new_text)
                break
            new_text = detok.add(tok)
            s.text += new_text
            # vLLM's rule: stop strings count from output token min_tokens + 1, the first one
            # EOS may be (the sampler bans it until min_tokens are out).
            if p.stop and len(s.token_ids) > p.min_tokens:
                hit = find_stop(s.text, len(new_text), p.stop, p.include_stop_str_in_output)
                if hit is not None:
                    cut, stop_str = hit
                    s.text = s.text[:cut]
                    s.finish_reason, s.stop_reason = "stop", stop_str
                    return stop_str
        if delta.finish_reason is not None:
            reason, stop_reason = delta.finish_reason, delta.stop_reason
            if reason != "abort":
                # Text held back for an incomplete character ("b " of "b " + half an emoji), out
                # with the EOS kept or at the flush, is text too: a stop string in it cuts it (and
                # comes before the length limit; EOS and stop token ids stay the reason).
                new_text = detok.flush()
                s.text += new_text
                unchecked += len(new_text)
                if p.stop and len(s.token_ids) > p.min_tokens:
                    hit = find_stop(s.text, unchecked, p.stop, p.include_stop_str_in_output)
                    if hit is not None:
                        s.text = s.text[: hit[0]]
                        if reason == "length":
                            reason, stop_reason = "stop", hit[1]
            s.finish_reason, s.stop_reason = reason, stop_reason
        return None

    def _whole(self, st: _RequestState, samples: list[SampleDelta]) -> None:
        """Beam search: the hypotheses replace what was there (they change wholesale)."""
        st.samples = {}
        keep_stop = st.params.include_stop_str_in_output
        for d in samples:
            # The EOS / stop token that ended a hypothesis: in its ids, in its text only when asked
            # (as a sample's, _append).
            ids = d.token_ids[:-1] if d.finish_reason == "stop" and not keep_stop else d.token_ids
            text = self.tokenizer.decode(ids, skip_special_tokens=st.params.skip_special_tokens)
            lps = [self._named(e) for e in d.logprobs] if d.logprobs else []
            st.samples[d.index] = _Sample(
                d.index, None, list(d.token_ids), text, lps, d.cumulative_logprob,
                d.finish_reason, d.stop_reason,
            )  # fmt: skip

    # ---- the output --------------------------------------------------------------------------------
    def _output(self, st: _RequestState, co: EngineCoreOutput, finished: bool) -> RequestOutput:
        p = st.params
        delta = p.output_kind == RequestOutputKind.DELTA and not co.whole
        want_lp = p.logprobs is not None
        outs = []
        samples = st.samples.values()
        for s in samples if len(samples) == 1 else sorted(samples, key=lambda s: s.index):
            if delta and s.sent_finish:  # n > 1: a sample that finished earlier has nothing new
                continue
            text = s.text
            if s.finish_reason is None and p.stop:
                text = text[: len(text) - hold_back(text, p.stop, s.held)]  # never stream a partial stop
            ids, lps = s.token_ids, s.logprobs
            if p.embed:  # its one sampled token is no result (the embedding is)
                text, ids, lps = "", [], []
            if delta:
                text, s.sent_chars = text[s.sent_chars :], max(s.sent_chars, len(text))
                ids, lps = ids[s.sent_tokens :], lps[s.sent_tokens :]
                s.sent_tokens = len(s.token_ids)
                s.sent_finish = s.finish_reason is not None
            else:
                ids, lps = list(ids), list(lps)
            outs.append(
                CompletionOutput(
                    index=s.index,
                    text=text,
                    token_ids=ids,
                    cumulative_logprob=s.cumulative_logprob if (want_lp or co.whole) else None,
                    logprobs=lps if want_lp else None,
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                )
            )
        st.num_outputs += 1
        return RequestOutput(
            request_id=st.request_id,
            prompt=st.prompt,
            prompt_token_ids=st.prompt_token_ids,
            outputs=outs,
            finished=finished,
            adapter=st.adapter,
            num_cached_tokens=co.num_cached_tokens,
            prompt_logprobs=None if delta and st.num_outputs > 1 else st.prompt_logprobs,
            metrics=co.metrics,
            embedding=co.embedding,
        )
