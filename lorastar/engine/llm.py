"""LLM: the offline, synchronous API (vLLM's shape)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from typing import Any

from lorastar.adapters.registry import AdapterInfo
from lorastar.config import EngineConfig
from lorastar.engine.engine import LLMEngine
from lorastar.engine.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    EmbeddingRequestOutput,
    RequestOutput,
    embedding_result,
)
from lorastar.engine.sampling import BeamSearchParams, RequestOutputKind, SamplingParams, embedding_params

Prompt = str | list[int] | Mapping[str, Any]  # a dict: vLLM's TextPrompt / TokensPrompt


class LLM:
    """One base model, many adapters, batched generation.

    ``LLM()`` serves the embedded SmolLM2-135M-Instruct; ``LLM(model="path/to/hf_folder")`` any
    Llama / Mistral / Qwen2 / Qwen3 checkpoint. Keyword arguments are ``EngineConfig`` fields.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        config = EngineConfig.given(
            kwargs.pop("config", None), **kwargs, **({} if model is None else {"model": model})
        )
        self.engine = LLMEngine(config)
        # One generate()/chat() at a time: each steps the engine and keeps only its own requests'
        # final outputs, so a second caller's (another thread's) outputs would be lost to the first.
        self._run_lock = threading.Lock()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (vLLM's ``LLM.get_tokenizer``)."""
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate``/``chat`` use without ``sampling_params`` (vLLM's): the model's
        ``generation_config.json`` defaults (``EngineConfig.generation_config``), else the neutral ones."""
        return SamplingParams(**self.engine.default_sampling)

    # ---- adapters -------------------------------------------------------------------------
    def load_adapter(self, name: str, path: str) -> AdapterInfo:
        return self.engine.load_adapter(name, path)

    def unload_adapter(self, name: str) -> None:
        self.engine.unload_adapter(name)

    def list_adapters(self) -> list[AdapterInfo]:
        return self.engine.list_adapters()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's): the next prompts are computed again. False while a
        request holds KV blocks (never between ``generate`` calls)."""
        return self.engine.reset_prefix_cache()

    # ---- generation -------------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        adapter: str | None | Seq[str | None] = None,
        lora_request: Any = None,
        use_tqdm: bool = False,
        priority: Seq[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        ``prompts``: a string, a list of strings, or a list of token-id lists (one list of ints
        is one tokenized prompt), or vLLM's prompt dicts (``{"prompt": text}``,
        ``{"prompt_token_ids": ids}``). ``sampling_params`` and ``adapter`` may be one value or one
        per prompt. ``lora_request``: vLLM's ``LoRARequest`` (or a list, one per prompt) instead of
        ``adapter``: its ``lora_path`` is loaded under its ``lora_name`` unless that name is loaded.
        ``priority``: one int per prompt, lower served first (vLLM's; needs
        ``scheduling_policy="priority"``). Calls from several threads run one after another.
        """
        prompts = _prompt_list(prompts)
        n = len(prompts)
        params = _per_prompt(sampling_params, n, "sampling_params", SamplingParams)
        adapters = self._adapters(adapter, lora_request, n)
        if priority is not None:
            if not isinstance(priority, (list, tuple)):
                raise ValueError(
                    f"priority must be a list of ints (one per prompt), got {type(priority).__name__}"
                )
            if len(priority) != n:
                raise ValueError(f"priority has {len(priority)} entries for {n} prompts")
            for p in priority:
                self.engine.check_priority(p)
        return self._run(prompts, params, adapters, use_tqdm, priority)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        adapter: str | None | Seq[str | None] = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        lora_request: Any = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, with the model's chat template.
        ``continue_final_message`` (with ``add_generation_prompt=False``) continues the last message
        instead of starting a reply; ``chat_template_kwargs`` are extra template variables (vLLM's);
        ``tools``: OpenAI function definitions the template renders (the reply is text: tool calls in
        it are parsed by the HTTP route, ``LoraStarConfig.tool_call_parser``); ``lora_request`` as
        in ``generate``."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)  # type: ignore[list-item]
        prompts: list[Prompt] = [
            self.engine.apply_chat_template(
                c, add_generation_prompt,  # type: ignore[arg-type]
                continue_final_message=continue_final_message, chat_template_kwargs=chat_template_kwargs,
                tools=tools,
            )
            for c in convs
        ]  # fmt: skip
        n = len(prompts)
        params = _per_prompt(sampling_params, n, "sampling_params", SamplingParams)
        adapters = self._adapters(adapter, lora_request, n)
        return self._run(prompts, params, adapters, use_tqdm)

    def beam_search(
        self,
        prompts: Prompt | Seq[Prompt],
        params: BeamSearchParams,
        lora_request: Any = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's offline beam search: each prompt's ``beam_width`` best hypotheses, best first,
        with per-token logprobs (the token and the top ``2 * beam_width``). The prompts run
        batched, as ``generate`` runs them (``concurrency_limit`` is accepted for vLLM's
        signature; the scheduler bounds what runs at once). ``lora_request`` as in ``generate``."""
        for name in ("beam_width", "max_tokens"):
            v = getattr(params, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        sp = SamplingParams(
            n=params.beam_width, use_beam_search=True, temperature=0.0, max_tokens=params.max_tokens,
            ignore_eos=params.ignore_eos, length_penalty=params.length_penalty,
            include_stop_str_in_output=params.include_stop_str_in_output, logprobs=2 * params.beam_width,
        )  # fmt: skip
        prompts = _prompt_list(prompts)
        reqs = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        adapters = self._adapters(None, lora_request, len(prompts))
        outs = self._run(prompts, [sp] * len(prompts), adapters, use_tqdm)
        tok = self.get_tokenizer()
        results = []
        for out, req in zip(outs, reqs):
            seqs = []
            for o in out.outputs:
                tokens = [*out.prompt_token_ids, *o.token_ids]
                seqs.append(BeamSearchSequence(tokens, o.logprobs or [], req, o.cumulative_logprob or 0.0,
                                               tok.decode(tokens), o.finish_reason, o.stop_reason))  # fmt: skip
            results.append(BeamSearchOutput(seqs))
        return results

    def embed(
        self,
        prompts: Prompt | Seq[Prompt],
        *,
        adapter: str | None | Seq[str | None] = None,
        lora_request: Any = None,
        normalize: bool = True,
        use_tqdm: bool = False,
    ) -> list[EmbeddingRequestOutput]:
        """vLLM's ``LLM.embed``: each prompt's embedding, the last prompt token's final hidden state
        (the pooling of decoder embedding models such as Qwen3-Embedding), L2-normalized unless
        ``normalize=False``; with an adapter, the adapted model's. Prompts as in ``generate``
        (tokenized with the tokenizer's special tokens, as vLLM does)."""
        prompts = _prompt_list(prompts)
        adapters = self._adapters(adapter, lora_request, len(prompts))
        outs = self._run(prompts, [embedding_params()] * len(prompts), adapters, use_tqdm)
        return [embedding_result(out, normalize) for out in outs]

    def _adapters(self, adapter: Any, lora_request: Any, n: int) -> list[str | None]:
        """One adapter name (or None) per prompt, from ``adapter`` or vLLM's ``lora_request``; the
        requests' adapters not loaded yet are loaded first (all checked before any is loaded)."""
        if lora_request is None:
            return _per_prompt(adapter, n, "adapter", str)
        if adapter is not None:
            raise ValueError("give adapter or lora_request, not both")
        if isinstance(lora_request, (list, tuple)):
            if len(lora_request) != n:
                raise ValueError(f"lora_request has {len(lora_request)} entries for {n} prompts")
            reqs = list(lora_request)
        else:
            reqs = [lora_request] * n
        for r in reqs:
            name, path = getattr(r, "lora_name", None), getattr(r, "lora_path", None)
            if r is not None and not (isinstance(name, str) and isinstance(path, str)):
                raise ValueError(
                    "lora_request must be a LoRARequest (lora_name and lora_path as strings) or None,"
                    f" got {type(r).__name__}"
                )
        loaded = {a.name for a in self.engine.list_adapters()}
        for r in reqs:
            if r is not None and r.lora_name not in loaded:
                self.engine.load_adapter(r.lora_name, r.lora_path)
                loaded.add(r.lora_name)
        return [None if r is None else r.lora_name for r in reqs]

    def _run(
        self,
        prompts: list[Prompt],
        params: list[Any],
        adapters: list[Any],
        use_tqdm: bool,
        priority: Seq[int] | None = None,
    ) -> list[RequestOutput]:
        with self._run_lock:
            eng = self.engine
            # Validate everything first, so a bad prompt queues nothing.
            for p in prompts:
                eng.validate_prompt(p)
            # Only the final outputs are read here: the engine builds no per-step output for them.
            params = [_final_only(self.get_default_sampling_params() if sp is None else sp) for sp in params]
            ids: list[str] = []
            try:
                priorities = priority if priority is not None else [0] * len(prompts)
                for p, sp, ad, prio in zip(prompts, params, adapters, priorities):
                    ids.append(eng.add_request(p, sp, adapter=ad, priority=prio).request_id)
            except BaseException:
                for rid in ids:
                    eng.abort_request(rid)
                raise
            done: dict[str, RequestOutput] = {}
            bar = None
            if use_tqdm:
                from tqdm import tqdm

                bar = tqdm(total=len(ids), desc="generating")
            try:
                while len(done) < len(ids):
                    for out in eng.step():
                        if out.finished and out.request_id in ids:
                            done[out.request_id] = out
                            if bar is not None:
                                bar.update(1)
                    if not eng.has_unfinished() and len(done) < len(ids):
                        raise RuntimeError("engine went idle with unfinished requests")
            except BaseException:
                for rid in ids:
                    if rid not in done:
                        eng.abort_request(rid)
                raise
            finally:
                if bar is not None:
                    bar.close()
            return [done[r] for r in ids]

    def kv_cache_usage(self) -> dict[str, float | int]:
        return self.engine.kv_cache_usage().as_dict()


def _prompt_list(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    """One prompt (text, a dict, or one list of token ids) or a sequence of them, as a list."""
    if isinstance(prompts, (str, Mapping)) or (
        isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)
    ):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]


def _final_only(sp: SamplingParams | dict[str, Any] | None) -> SamplingParams:
    if sp is None:
        sp = SamplingParams()
    elif isinstance(sp, dict):
        sp = SamplingParams.from_dict(sp)
    return dataclasses.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY)


def _per_prompt(value: Any, n: int, name: str, kind: type) -> list[Any]:
    if value is None or isinstance(value, (kind, dict)):
        return [value] * n
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return list(value)
    raise ValueError(f"{name} must be a {kind.__name__} or a list of them, got {type(value).__name__}")
