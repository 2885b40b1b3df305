"""A tiny in-process stand-in for ``AsyncLLM`` (pure HTTP behaviour tests; no torch).

Tokens are characters (id = ord); the "model" echoes the prompt reversed, one char per step, an
adapter upper-cases it. It keeps the counters the plugin reads (running, aborts, blocks held).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from lorastar.engine.chat_content import template_content
from lorastar.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from lorastar.engine.sampling import RequestOutputKind, SamplingParams
from lorastar.errors import AdapterError, AdapterNotFoundError, EngineDeadError, EngineOverloadedError


class CharTokenizer:
    eos_token_id = 0

    def __len__(self) -> int:
        return 0x110000

    def __call__(self, text: str, **_: Any) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text)}

    def encode(self, text: str, **_: Any) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], **_: Any) -> str:
        return "".join(chr(i) for i in ids)


@dataclass
class FakeAdapter:
    name: str
    path: str
    rank: int = 8
    content_hash: str = "x"


@dataclass
class FakeStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    adapters: dict[str, dict[str, int]] = field(default_factory=dict)
    adapter_tiers: dict[str, str] = field(default_factory=dict)
    spec_decode: Any = None  # SpecDecodeStats with speculative decoding


class FakeAsyncLLM:
    def __init__(
        self, step_delay: float = 0.002, max_model_len: int = 256, max_waiting: int | None = None
    ) -> None:
        self.tokenizer = CharTokenizer()
        self.model_name = "fake-model"
        self.max_model_len = max_model_len
        self.step_delay = step_delay
        self.max_waiting = max_waiting
        self.max_logprobs = 20  # EngineConfig.max_logprobs's default
        self.tokenized_with_special_tokens: list[bool] = []  # each tokenize call's add_special_tokens
        self.rendered: list[
            tuple[list[dict], list[dict] | None]
        ] = []  # apply_chat_template's messages, tools
        self.errored = False
        self.restarting = False
        self.retry_after = 1.0
        self.adapters: dict[str, FakeAdapter] = {}
        self.running: dict[str, str | None] = {}
        self.last_adapter: str | None = None  # the adapter of the last request generated
        self.aborted: list[str] = []
        self.started = False
        self.total_prompt = 0
        self.total_gen = 0
        self.fail_after: int | None = None  # raise RuntimeError after this many steps (in-band errors)
        self.fail_on_submit: BaseException | None = None
        self.failed: dict[str, BaseException] = {}  # fail_streams: raised in the request's stream

    async def start(self) -> None:
        self.started = True

    async def shutdown(self, drain_timeout: float = 5.0) -> None:
        self.started = False

    def list_adapters(self) -> list[FakeAdapter]:
        return list(self.adapters.values())

    async def load_adapter(self, name: str, path: str, *, new: bool = False) -> None:
        import os

        from lorastar.errors import AdapterExistsError

        if new and name in self.adapters:
            raise AdapterExistsError(f"The lora adapter '{name}' has already been loaded.")

        if not os.path.isfile(os.path.join(path, "adapter_config.json")):
            raise AdapterError(f"lora_path {path} has no adapter_config.json")
        self.adapters[name] = FakeAdapter(name, path)

    async def unload_adapter(self, name: str) -> None:
        if name not in self.adapters:
            raise AdapterNotFoundError(f"adapter {name!r} is not loaded")
        del self.adapters[name]

    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        self.tokenized_with_special_tokens.append(add_special_tokens)
        return self.tokenizer.encode(prompt)

    def check_prompt_size(self, text: str | list[str], param: str = "prompt") -> None:
        pass

    @property
    def vocab_size(self) -> int:
        return 0x110000  # CharTokenizer: one id per code point

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
        *,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> list[int]:
        # what the template was given (not rendered here): content as a string template reads it
        messages = [
            {**m, "content": template_content(m.get("content"), "string", i)} for i, m in enumerate(messages)
        ]
        self.rendered.append((messages, tools))
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + (
            "<assistant>" if add_generation_prompt else ""
        )
        return self.tokenizer.encode(text)

    def stats(self) -> FakeStats:
        per: dict[str, dict[str, int]] = {}
        for a in self.running.values():
            if a:
                per.setdefault(a, {"running": 0, "waiting": 0})["running"] += 1
        return FakeStats(
            num_running=len(self.running),
            kv_cache_usage=len(self.running) / 100,
            prompt_tokens_total=self.total_prompt,
            generation_tokens_total=self.total_gen,
            adapters=per,
        )

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def fail_streams(self, exc: BaseException) -> int:
        rids = list(self.running)
        for rid in rids:
            self.failed[rid] = exc
            self.running.pop(rid, None)
        return len(rids)

    async def abort(self, request_id: str) -> None:
        if request_id in self.running:
            self.aborted.append(request_id)
            self.running.pop(request_id, None)

    async def reset_prefix_cache(self) -> bool:
        return not self.running

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        *,
        adapter: str | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        sp = sampling_params or SamplingParams()
        self.last_priority = priority
        self.last_params = sp
        if self.errored:
            raise EngineDeadError("engine is dead")
        if self.fail_on_submit is not None:
            raise self.fail_on_submit
        if adapter is not None and adapter not in self.adapters:
            raise AdapterNotFoundError(f"adapter {adapter!r} is not loaded")
        if self.max_waiting is not None and len(self.running) >= self.max_waiting:
            raise EngineOverloadedError("waiting queue is full")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt is longer than max_model_len ({len(ids)} >= {self.max_model_len})")
        rid = request_id or "r"
        self.running[rid] = adapter
        self.last_adapter = adapter
        self.total_prompt += len(ids)
        src = "".join(chr(i) for i in reversed(ids)) or "x"
        if adapter:
            src = src.upper()
        # The engine's timestamps, on its clock (time.monotonic), as the real one reports them
        metrics = RequestMetrics(arrival_time=time.monotonic())
        metrics.first_scheduled_time = metrics.arrival_time
        outs = [
            CompletionOutput(index=i, text="", token_ids=[], logprobs=[] if sp.logprobs is not None else None)
            for i in range(sp.n)
        ]
        sent: dict[int, tuple[int, int]] = {}  # DELTA: characters and tokens handed out per choice
        try:
            for step in range(sp.max_tokens):
                await asyncio.sleep(self.step_delay)
                if self.fail_after is not None and step >= self.fail_after:
                    raise RuntimeError("boom: secret internal detail")
                if rid in self.failed:
                    raise self.failed.pop(rid)
                if rid not in self.running:
                    for o in outs:
                        o.finish_reason = "abort"
                        if sp.output_kind == RequestOutputKind.DELTA:  # nothing new, only the end
                            o.text, o.token_ids = o.text[sent.get(o.index, (0, 0))[0] :], []
                            o.logprobs = [] if o.logprobs is not None else None
                    yield RequestOutput(
                        rid, prompt if isinstance(prompt, str) else None, ids, outs, True, adapter
                    )
                    return
                for o in outs:
                    ch = src[(step + o.index) % len(src)]
                    o.token_ids.append(ord(ch))
                    o.text += ch
                    if o.logprobs is not None:
                        o.logprobs.append(
                            {
                                ord(ch): Logprob(math.log(0.5), 1, ch),
                                ord("z"): Logprob(math.log(0.25), 2, "z"),
                            }
                        )
                    stop = next((s for s in sp.stop or [] if s in o.text), None)
                    if stop is not None:
                        o.text = o.text[: o.text.index(stop)]
                        o.finish_reason, o.stop_reason = "stop", stop
                    elif step + 1 == sp.max_tokens:
                        o.finish_reason = "length"
                self.total_gen += sp.n
                metrics.last_token_time = time.monotonic()
                if metrics.first_token_time is None:
                    metrics.first_token_time = metrics.last_token_time
                done = all(o.finish_reason for o in outs)
                if sp.output_kind == RequestOutputKind.FINAL_ONLY and not done:
                    continue
                delta = sp.output_kind == RequestOutputKind.DELTA  # as the engine: only what is new
                shown = []
                for o in outs:
                    c, t = sent.get(o.index, (0, 0)) if delta else (0, 0)
                    shown.append(
                        CompletionOutput(
                            o.index,
                            o.text[c:],
                            o.token_ids[t:],
                            None,
                            o.logprobs[t:] if o.logprobs is not None else None,
                            o.finish_reason,
                            o.stop_reason,
                        )
                    )
                    sent[o.index] = (max(c, len(o.text)), len(o.token_ids))
                yield RequestOutput(
                    rid,
                    prompt if isinstance(prompt, str) else None,
                    ids,
                    shown,
                    done,
                    adapter,
                    num_cached_tokens=0,
                    metrics=metrics,
                )
                if done:
                    self.running.pop(rid, None)  # finished: not an abort
                    return
        finally:  # closed before it finished (the caller went away): the engine aborts it
            if self.running.pop(rid, "gone") != "gone":
                self.aborted.append(rid)


class ScriptedLLM(FakeAsyncLLM):
    """The fake engine answering the last message's text reversed (no role markers), so a test
    writes the model's answer (``say``); the messages the template got are in ``rendered``."""

    def apply_chat_template(self, messages: list[dict], *args: Any, **kw: Any) -> list[int]:
        super().apply_chat_template(messages, *args, **kw)
        self.template_kwargs = kw.get("chat_template_kwargs")  # the last request's template variables
        return self.tokenizer.encode(self.rendered[-1][0][-1]["content"] or "x")


def say(answer: str) -> str:
    """The last message that makes ``ScriptedLLM`` answer ``answer``."""
    return answer[::-1]


class TagTokenizer:
    """One id for each thinking tag (900, 901), the wrapped tokenizer's otherwise (a fake engine's
    ``CharTokenizer`` spells them a character a token)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def encode(self, text: str, **kw: Any) -> list[int]:
        return {"<think>": [900], "</think>": [901]}.get(text) or self.inner.encode(text, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
