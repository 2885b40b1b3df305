"""LLMEngine: one step = schedule, run, update; ``LLM`` and ``AsyncLLM`` wrap it. With
``async_scheduling``, step N+1 is launched before step N's tokens are read back."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lorastar.adapters.peft import LoRAWeights, ModelSpec, load_peft_adapter
from lorastar.adapters.registry import AdapterInfo, AdapterRegistry
from lorastar.config import EngineConfig
from lorastar.engine.beam import BeamState
from lorastar.engine.block_manager import BlockManager, KVCacheUsage
from lorastar.engine.generation_config import defaults_source, generation_defaults
from lorastar.engine.host_memory import keep_freed_memory
from lorastar.engine.input_processor import InputProcessor, PromptInputs, TokenizerLoader
from lorastar.engine.kv_calibration import CALIBRATION_TEXT, calibrate_kv_scales
from lorastar.engine.metrics import EngineStats, SpecDecodeStats, TokenHistogram
from lorastar.engine.output_processor import OutputProcessor
from lorastar.engine.outputs import EngineCoreOutput, RawLogprobs, RequestMetrics, RequestOutput, SampleDelta
from lorastar.engine.prompt_logprobs import KeptBlock, PromptLogprobsCache, score_prompt_rows
from lorastar.engine.request import OutputIds, Request, SeqStatus, Sequence, check_priority_value
from lorastar.engine.runner import KVCacheSpec, ModelRunner, ModelRunnerOutput
from lorastar.engine.sampler import (
    BadWords,
    ChoicePaths,
    PendingSample,
    PendingTokens,
    RowLogprobs,
    Sampler,
    SamplingMetadata,
    SamplingRow,
    make_generator,
)
from lorastar.engine.sampling import (
    RequestOutputKind,
    SamplingParams,
    bad_words_token_ids,
    bounded_logprobs,
    logprobs_cap,
)
from lorastar.engine.scheduler import Scheduler, SchedulerOutput
from lorastar.engine.spec_decode import accepted, propose_ngram, token_array
from lorastar.engine.structured import GrammarCompiler, GrammarRow
from lorastar.engine.thinking_budget import ThinkingBudget
from lorastar.engine.threads import run_in_fresh_thread
from lorastar.errors import (
    AdapterError,
    AdapterExistsError,
    AdapterNotFoundError,
    EngineOverloadedError,
    InvalidParamError,
    LimitExceededError,
)
from lorastar.kernels import cpu_native
from lorastar.layers.lora import LoRADeviceState
from lorastar.models.layer_types import uniform_window
from lorastar.models.loader import DTYPES as _DTYPES
from lorastar.models.loader import checkpoint_dtype, load_model, read_hf_config
from lorastar.quant.kv_cache import KV_CACHE_DTYPES as _KV_DTYPES

logger = logging.getLogger("lorastar")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(slots=True)
class _InFlight:
    """A launched step whose sampled tokens have not been read back (async scheduling): each
    sampling sequence with the position of its placeholder, in the sampled ids' row order."""

    out: SchedulerOutput
    targets: list[tuple[Sequence, int]]
    sample: PendingSample


def _can_draft(seq: Sequence) -> bool:
    """Whether ``seq`` may run drafts (speculative decoding): it must have sampled before (an n > 1
    request forks at its first token) and not be a beam. Whatever reads the output (penalties,
    ``min_tokens``, bad words, a choice, a grammar's matcher, a thinking budget) reads it at each
    drafted row up to that row's position (``_draft_rows``); the matchers and budgets that follow
    it step through the drafts and are taken back after sampling (``_process``)."""
    row = seq.sampling_row
    return row is not None and not seq.num_placeholders and seq.request.beam is None


def _draft_rows(seq: Sequence, row: SamplingRow, d: int) -> list[SamplingRow]:
    """The sampling rows of a sequence with ``d`` drafts: row ``i`` samples the token after draft
    ``i`` as if drafts ``1..i`` were its output (they are, wherever row ``i`` counts), so penalties,
    ``min_tokens``, bad words, a choice, a grammar and a thinking budget see exactly that output.
    The one row where none reads the output."""
    p = row.params
    n = len(seq.token_ids) - d  # the tokens before the drafts
    if (
        p.repetition_penalty == 1.0
        and not p.frequency_penalty
        and not p.presence_penalty
        and row.bad_words is None
        and row.choices is None
        and row.grammar is None
        and row.thinking is None
        and n - seq.num_prompt_tokens >= p.min_tokens
    ):
        return [row] * (d + 1)
    return [
        dataclasses.replace(row, output_token_ids=OutputIds(seq.token_ids, seq.num_prompt_tokens, n + i))
        for i in range(d + 1)
    ]


def _allowed_drafts(row: SamplingRow, drafts: list[int]) -> int:
    """How many leading ``drafts`` the row's grammar, choice and thinking budget allow after its
    output: the rest are not run (as vLLM's scheduler validates drafts against the grammar), since
    a refused draft can never be kept."""
    output = row.output_token_ids
    k = len(drafts) if row.grammar is None else row.grammar.valid_drafts(output, drafts)
    if row.thinking is not None:
        k = row.thinking.valid_drafts(output, drafts[:k])
    if row.choices is not None:
        out = list(output)
        j = 0
        while j < k and drafts[j] in row.choices.allowed(out + drafts[:j]):
            j += 1
        k = j
    return k


def _rewind_generator(gen: torch.Generator, state: torch.Tensor, kept: int) -> None:
    """A seeded drafted sequence's generator as plain steps leave it: one draw per kept token, not
    one per row (the sampler's draw, ``Sampler._draw``), so its tokens do not depend on how many
    drafts the batch let it run. ``state``: before the step's draws; none drawn (greedy): as is."""
    if torch.equal(gen.get_state(), state):
        return
    gen.set_state(state)
    for _ in range(kept):
        torch.rand(1, dtype=torch.float64, generator=gen, device=gen.device)


def _needs_sync(req: Request) -> bool:
    """Requests whose sampling forks sequences on the host (beams; n > 1 until its samples have
    forked, after which they are n plain sequences), or whose prompt logprobs go through the host:
    while one is live, async scheduling runs steps one at a time. Penalties read the previous token
    on the device (``PendingTokens``); the rows of ``_reads_host`` read it on the host once the
    step in flight is complete."""
    params = req.params
    return params.use_beam_search or (params.n > 1 and not req.forked) or params.prompt_logprobs is not None


def _reads_host(req: Request) -> bool:
    """Requests whose sampling reads the output so far on the host: a bad word of several tokens,
    guided_choice, a grammar, a thinking budget. While one is live, an async step completes the
    step in flight (its tokens put in place, its outputs built) after launching the model and
    before sampling: the host reads a known output while the device runs the forward (vLLM v1
    fills its grammar bitmasks the same way, beside the forward)."""
    return (
        (req.bad_words is not None and bool(req.bad_words.multi))
        or req.choices is not None
        or req.grammar is not None
        or req.params.thinking_token_budget is not None
    )


# The scheduler's and adapter registry's callbacks: module functions bound (functools.partial) to
# the parts they use, never to the engine. Bound methods made reference cycles that kept a dropped
# engine's weights and KV cache until Python's next cyclic GC, which GPU memory pressure never runs
# (a benchmark making one engine after another ran out of memory on an H100).


def _reserve_adapter(registry: AdapterRegistry, seq: Sequence, pinned: set[str]) -> bool:
    """The scheduler's ``ensure_adapter`` (every running sequence with an adapter, every step)."""
    entry = seq.request.adapter_entry
    return entry is not None and registry.try_reserve(entry, pinned) is not None


def _prompt_logprobs_hits(bm: BlockManager, cache: PromptLogprobsCache, seq: Sequence, n: int) -> int:
    """How many of ``seq``'s first ``n`` cached blocks have their prompt logprobs kept."""
    k = seq.request.params.prompt_logprobs or 0
    hits = 0
    for h in bm.hashes(seq, n):
        if cache.get(h, k) is None:
            break
        hits += 1
    return hits


def _load_slot(state: LoRADeviceState, slot: int, w: LoRAWeights) -> None:
    state.load_slot(slot, w.content_hash, w.weights)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is available")
    return torch.device(device)


def resolve_dtype(dtype: Any, device: torch.device, cfg: dict[str, Any]) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
        return dtype
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32  # the safe (and, measured, fastest) CPU dtype
    ckpt = checkpoint_dtype(cfg)
    return ckpt if ckpt != torch.float32 else torch.bfloat16


def rope_scaled_max_len(cfg: dict[str, Any]) -> int:
    """The context a scaled RoPE (linear, dynamic, yarn) extends to, as vLLM derives it: ``factor``
    times ``max_position_embeddings`` (yarn: times its ``original_max_position_embeddings``); 0 where
    none. Gemma 3's ``max_position_embeddings`` already counts its scaling (vLLM skips it too)."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    if not isinstance(params, dict) or "gemma3" in str(cfg.get("model_type", "")):
        return 0
    nested = bool(params) and all(isinstance(v, dict) for v in params.values())  # per layer type
    max_pos = int(cfg.get("max_position_embeddings", 8192))
    scaled = 0
    for p in params.values() if nested else [params]:
        kind = p.get("rope_type", p.get("type", "default"))
        factor = p.get("factor")
        if kind not in ("linear", "dynamic", "yarn") or "short_factor" in p or not factor:
            continue  # llama3 and longrope: max_position_embeddings is already the scaled length
        base = max_pos
        if kind == "yarn":
            base = int(
                cfg.get("original_max_position_embeddings")
                or p.get("original_max_position_embeddings")
                or max_pos
            )
        scaled = max(scaled, int(base * float(factor)))
    return scaled


class LLMEngine(PromptInputs):
    def __init__(
        self, config: EngineConfig, *, lazy_tokenizer: bool = False, tokenizer: TokenizerLoader | None = None
    ) -> None:
        """``lazy_tokenizer``: load the tokenizer when first needed, not here (an engine core in its
        own process, whose frontend tokenizes: ``TokenizerLoader``). ``tokenizer``: reuse a loader
        (a rebuilt engine of the same config)."""
        self.config = config
        if config.model is None:
            from lorastar.models.default import default_model_dir

            self.model_dir = Path(default_model_dir())
            self.model_name = DEFAULT_MODEL_NAME
        else:
            from lorastar.hub import model_folder_name, resolve_folder

            self.model_dir = resolve_folder(  # a folder or a hub id
                config.model, revision=config.revision, cache_dir=config.download_dir
            )
            self.model_name = model_folder_name(config.model)
        tokenizer_dir = self.model_dir
        if config.tokenizer:  # before the model load, not minutes after it
            from lorastar.hub import is_hub_id, resolve_folder

            tokenizer_dir = Path(config.tokenizer).expanduser()
            if is_hub_id(str(config.tokenizer)):  # fetched (or found in the HF cache) as the model is
                tokenizer_dir = resolve_folder(
                    config.tokenizer,
                    kind="tokenizer",
                    revision=config.tokenizer_revision,
                    cache_dir=config.download_dir,
                )
            elif not tokenizer_dir.is_dir():
                raise ValueError(f"tokenizer: folder {config.tokenizer!r} does not exist")
        self.hf_config = read_hf_config(self.model_dir)
        # The model creator's sampling defaults (vLLM's --generation-config auto); before the load
        self.default_sampling = generation_defaults(
            self.model_dir, config.generation_config, config.override_generation_config
        )
        if self.default_sampling:
            logger.info(
                "Default sampling parameters from %s: %s (requests that set them override them; "
                "generation_config='vllm' turns the model's off)",
                defaults_source(config.generation_config, config.override_generation_config),
                self.default_sampling,
            )
        self.device = resolve_device(config.device)
        self.async_scheduling = (
            config.async_scheduling if config.async_scheduling is not None else self.device.type == "cuda"
        )
        if self.async_scheduling and self.device.type != "cuda":
            logger.info(
                "async_scheduling on %s: a step runs in the calling thread, nothing overlaps", self.device
            )
        self.speculative = config.speculative_config
        if self.speculative is not None:  # (EngineConfig refuses async_scheduling=True with it)
            self.async_scheduling = False  # the default on CUDA: drafts are verified on the host
        self.spec_stats = SpecDecodeStats(self.speculative.num_speculative_tokens if self.speculative else 0)
        if self.device.type == "cpu" and config.tune_malloc:
            keep_freed_memory()
        self.dtype = resolve_dtype(config.dtype, self.device, self.hf_config)
        cfg = self.hf_config
        max_pos = int(cfg.get("max_position_embeddings", 8192))
        max_len = config.max_model_len or min(max_pos, 8192)
        scaled = rope_scaled_max_len(cfg)
        if max_len > max(max_pos, scaled):
            raise ValueError(
                f"max_model_len ({max_len}) exceeds the model's max_position_embeddings ({max_pos})"
                + (f" and its RoPE-scaled length ({scaled})" if scaled > max_pos else "")
            )
        if max_len > max_pos:
            from lorastar.layers.rotary import dynamic_ntk_past_context

            if dynamic_ntk_past_context(cfg, max_len):
                logger.warning(
                    "dynamic NTK RoPE past max_position_embeddings (%d): its base is fixed for %d positions, "
                    "as vLLM does; transformers recomputes it for each length, so logits differ from "
                    "transformers' on sequences of other lengths (max_model_len <= %d serves exactly)",
                    max_pos,
                    scaled,
                    max_pos,
                )

        from lorastar.quant import get_quant_config
        from lorastar.quant.embedding_int8 import embedding_method

        self.quant_config = get_quant_config(cfg, config.quantization, self.dtype)
        qc = self.quant_config
        if qc is not None and qc.devices is not None and self.device.type not in qc.devices:
            raise ValueError(
                f"quantization={qc.name!r} runs on {'/'.join(qc.devices)}, not {self.device.type}"
            )
        self.model, ckpt_kv_scales = load_model(
            self.model_dir,
            cfg,
            dtype=self.dtype,
            device=self.device,
            quant=self.quant_config,
            max_positions=max_len,
            embedding_method=embedding_method(config.embedding_quantization),
        )
        self.cpu_gemm = "torch"  # the GEMM behind dense CPU linears (layers/cpu_gemm.py)
        if self.device.type == "cpu":
            from lorastar.layers.cpu_gemm import choose_backend
            from lorastar.layers.linear import UnquantizedLinearMethod

            dense = [
                lin.weight for lin in self.model.linears().values()
                if isinstance(lin.quant_method, UnquantizedLinearMethod)
            ]  # fmt: skip
            head = self.model.head_weight()  # packed too: with int8 linears it is the only fp32 GEMM
            largest = max(dense + ([head] if head is not None else []), key=lambda w: w.numel(), default=None)
            self.cpu_gemm = choose_backend(config.cpu_gemm, largest)
            if self.cpu_gemm == "onednn":
                self.model.pack_for_cpu()
        # C++ ops (kernels/cpu_native.py) where they build: decode attention, decode-row LoRA and the
        # elementwise steps of fp32 and bf16 models.
        self.cpu_kernels = "torch"
        if self.device.type == "cpu" and self.dtype in cpu_native.DTYPES and config.cpu_kernels != "torch":
            if cpu_native.load() is not None:
                self.cpu_kernels = "native"
                self.model.use_native_cpu_ops()
            elif config.cpu_kernels == "native":
                raise ValueError("cpu_kernels='native': the C++ ops did not build here (needs g++ and ninja)")
        self.tokenizer_dir = tokenizer_dir
        self.tokenizer_loader = tokenizer or TokenizerLoader(self.tokenizer_dir, config.chat_template)
        if not lazy_tokenizer:
            self.tokenizer_loader.get()
        self.eos_token_ids = _eos_ids(self.model_dir, lambda: self.tokenizer.eos_token_id)
        self.vocab_size = self.model.vocab_size
        # the most top logprobs a request may ask for (EngineConfig.max_logprobs, resolved)
        self.max_logprobs = logprobs_cap(config.max_logprobs, self.vocab_size)
        # Structured outputs: the tokenizer's table is built at the first request with a grammar.
        self.grammars = GrammarCompiler(self.tokenizer_loader.get, self.vocab_size, self.eos_token_ids)

        # Adapter slots before the KV cache takes what memory is left (stacked A rows, layers/lora.py).
        self.model_spec = ModelSpec.from_model(self.model)
        self.lora_state = LoRADeviceState(
            self.model.linears(), config.max_loras, config.max_lora_rank, self.dtype, self.device
        )
        if self.device.type == "cuda":
            # Stacking (layers/lora.py) copied linears' weights; the old copies sit in torch's
            # cache, which mem_get_info counts as used: hand them back before the KV cache is sized.
            torch.cuda.empty_cache()

        # ---- KV cache ----
        kv_dtype = self.dtype if config.kv_cache_dtype == "auto" else _KV_DTYPES[config.kv_cache_dtype]
        spec = KVCacheSpec(
            0,
            config.block_size,
            self.model.num_layers,
            self.model.num_kv_heads,
            self.model.head_dim,
            kv_dtype,
        )
        spec.num_blocks = config.num_kv_blocks or self._auto_num_blocks(spec)
        k_scales, v_scales = ckpt_kv_scales.resolve(config.kv_cache_dtype)  # 1.0 unless an fp8 cache
        if config.kv_cache_dtype != "auto" and not ckpt_kv_scales.from_checkpoint:  # fp8, none shipped
            k_scales, v_scales = calibrate_kv_scales(
                self.model, self.tokenizer.encode(CALIBRATION_TEXT)[:max_len], dtype=self.dtype, device=self.device,
                block_size=config.block_size,
                cache_dtype=kv_dtype,
            )  # fmt: skip
        self.kv_scales = (k_scales, v_scales)

        # ---- adapters ----
        self._read_adapter = functools.partial(
            load_peft_adapter, spec=self.model_spec, max_rank=config.max_lora_rank
        )  # [path] -> LoRAWeights
        self.registry = AdapterRegistry(
            config.max_loras,
            config.max_cpu_loras,
            loader=self._read_adapter,
            on_slot_assigned=functools.partial(_load_slot, self.lora_state),
        )
        self.kv_spec = spec
        # A sequence holds every block it wrote, unless all layers slide over one window: then at
        # most the window plus one chunk (block_manager.release_outside_window), whatever its length.
        window = uniform_window(self.model.layer_windows)
        chunk = config.max_num_batched_tokens or max(2048, config.block_size)
        held = -(-(window + chunk) // spec.block_size) + 2 if window else spec.num_blocks + 1
        self._window_blocks = held if window else 0  # the most one sequence holds (0: no bound)
        self.max_model_len = (
            max_len if held <= spec.num_blocks else min(max_len, spec.num_blocks * spec.block_size)
        )
        if self.max_model_len < max_len:  # longrope's factors, dynamic NTK's base: for the new length
            from lorastar.layers.rotary import RotaryEmbedding

            for m in self.model.modules():
                if isinstance(m, RotaryEmbedding):
                    m.fit_to(self.max_model_len)
        if config.max_model_len and self.max_model_len < config.max_model_len:
            # vLLM refuses this; we keep serving what fits, and say so once (the summary repeats it)
            logger.warning(
                "max_model_len=%d does not fit in the KV cache (%d blocks of %d tokens): lowered to %d;"
                " raise kv_cache_memory or num_kv_blocks to serve the full length",
                config.max_model_len, spec.num_blocks, spec.block_size, self.max_model_len,
            )  # fmt: skip
        self.max_prompt_bytes = config.max_prompt_bytes or 64 * self.max_model_len
        self.inputs = InputProcessor(
            self.tokenizer_loader,
            model_name=self.model_name,
            max_model_len=self.max_model_len,
            max_prompt_bytes=self.max_prompt_bytes,
            vocab_size=self.vocab_size,
        )
        self.runner = ModelRunner(
            self.model, spec, self.device, k_scales=k_scales, v_scales=v_scales, lora_state=self.lora_state,
            cuda_graph_max_batch=0 if config.enforce_eager else min(config.max_num_seqs, 256),
            max_model_len=self.max_model_len, native_cpu_kernels=self.cpu_kernels == "native",
        )  # fmt: skip
        salt = f"{self.model_dir.resolve()}|{self.dtype}|{kv_dtype}|{config.quantization}"
        self.block_manager = BlockManager(
            spec.num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching, salt=salt,
            sliding_window=window,
        )  # fmt: skip
        self.prompt_logprobs_cache = PromptLogprobsCache()
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens or max(2048, config.block_size),
            max_loras=config.max_loras,
            ensure_adapter=functools.partial(_reserve_adapter, self.registry),
            prompt_logprobs_hits=functools.partial(
                _prompt_logprobs_hits, self.block_manager, self.prompt_logprobs_cache
            ),
            max_prefix_waits=32,  # share a prefix computed in flight (scheduler docstring)
            policy=config.scheduling_policy,
        )
        self.iteration_tokens = TokenHistogram()
        self.sampler = Sampler(seed=config.seed, device=self.device, eos_token_id=list(self.eos_token_ids))
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.lock = threading.RLock()  # AsyncLLM adds/aborts from other threads
        # The in-process frontend: text, stop strings and outputs from the core's deltas (a
        # frontend of the core process keeps its own; this one then stays empty).
        self.output_processor = OutputProcessor(self.tokenizer_loader)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.adapter_tokens: dict[str, int] = {}
        self._inflight: _InFlight | None = None  # async scheduling: the step launched last
        self._num_sync_requests = 0  # live requests that make async scheduling wait (_needs_sync)
        self._num_host_readers = 0  # live requests whose sampling reads the output on the host (_reads_host)
        # Live requests with prompt logprobs, with an adapter, and embedding ones: while there are
        # none, a step skips the passes over its sequences that only those need (check_invariants
        # counts them).
        self._num_prompt_logprobs = 0
        self._num_adapter_requests = 0
        self._num_embeds = 0

    # ---- setup helpers --------------------------------------------------------------------
    def _auto_num_blocks(self, spec: KVCacheSpec) -> int:
        mem = self.config.kv_cache_memory
        if mem is None:
            if self.device.type == "cuda":
                # Free memory includes torch's cached-but-unused bytes (mem_get_info counts them as
                # used): stacking (layers/lora.py) frees weight copies into segments that a live
                # tensor shares, so empty_cache cannot return them; on an H100 run of a 230 MB
                # model ~100 MB stayed so. The runtime's activations reuse them; the cache itself
                # is one allocation from the driver, hence at most the driver's free bytes.
                free, total = torch.cuda.mem_get_info(self.device)
                cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
                util = self.config.gpu_memory_utilization
                if util is None:
                    mem = min(int((free + cached) * 0.8), free)
                else:  # what the fraction of the total leaves over what the device holds now
                    mem = min(int((total * util - (total - free - cached)) * 0.8), free)
                    if mem < spec.bytes_per_block:
                        raise ValueError(
                            f"gpu_memory_utilization={util}: {total * util / 2**30:.1f} GiB of the GPU's "
                            f"{total / 2**30:.1f} GiB leave no room for a KV cache after the "
                            f"{(total - free - cached) / 2**30:.1f} GiB the device holds now; raise it"
                        )
            else:
                if self.config.gpu_memory_utilization is not None:
                    logger.warning("gpu_memory_utilization is ignored on CPU: set kv_cache_memory (bytes)")
                mem = 1 << 30
        return max(1, mem // spec.bytes_per_block)

    # ---- adapters -------------------------------------------------------------------------
    def load_adapter(self, name: str, path: str | Path, *, new: bool = False) -> AdapterInfo:
        """Read + validate (outside the engine lock: decoding goes on), then register. ``new``: the
        name must not be registered (AdapterExistsError, checked under the lock that registers it),
        else a load of a registered name replaces its weights (in-flight requests keep the old)."""
        from lorastar.hub import is_hub_id, resolve_folder

        local = str(path)
        if is_hub_id(local):  # org/name that is no local path: the HF cache or a download
            try:
                local = str(resolve_folder(local, kind="adapter", cache_dir=self.config.download_dir))
            except ValueError as exc:
                raise AdapterError(str(exc)) from exc
        weights = self._read_adapter(local)
        with self.lock:
            if new and name in self.registry:
                raise AdapterExistsError(f"The lora adapter '{name}' has already been loaded.")
            self.registry.register(name, local, weights)
            # Under the lock: an unload (or another load) of the name cannot come in between.
            return next(i for i in self.registry.list() if i.name == name)

    def unload_adapter(self, name: str) -> None:
        with self.lock:
            if name not in self.registry:
                raise AdapterNotFoundError(f"adapter {name!r} is not loaded")
            self.registry.unregister(name)
            # no series for a name gone (one per name ever served would grow without bound); its
            # requests still in flight drop it again as they end (_finish_request)
            self.adapter_tokens.pop(name, None)

    def list_adapters(self) -> list[AdapterInfo]:
        return self.registry.list()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block and the prompt logprobs kept with them (vLLM's
        ``reset_prefix_cache``: benchmarks run cold again); False, with nothing forgotten, while any
        request holds KV blocks."""
        with self.lock:
            if not self.block_manager.reset_prefix_cache():
                return False
            self.prompt_logprobs_cache.clear()
            return True

    # ---- requests -------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        """The model's transformers tokenizer (loaded now if ``lazy_tokenizer`` left it unloaded)."""
        return self.tokenizer_loader.get()

    def check_limits(self, params: SamplingParams, num_prompt_tokens: int) -> None:
        """The configured per-request limits, and whether the request can ever fit the KV cache."""
        cfg = self.config
        if params.n > cfg.max_n:
            raise LimitExceededError("n", f"n must be at most {cfg.max_n} (max_n), got {params.n}.")
        stops = params.stop or []
        if len(stops) > cfg.max_stop_strings:
            raise LimitExceededError(
                "stop", f"stop has {len(stops)} strings; at most {cfg.max_stop_strings} are allowed."
            )
        if any(len(st) > cfg.max_stop_string_length for st in stops):
            raise LimitExceededError(
                "stop", f"stop strings must be at most {cfg.max_stop_string_length} characters long."
            )
        if len(params.logit_bias or ()) > cfg.max_logit_bias:
            raise LimitExceededError(
                "logit_bias", f"logit_bias may hold at most {cfg.max_logit_bias} tokens (max_logit_bias)."
            )
        self._check_vocab("logit_bias", params.logit_bias or ())
        self._check_vocab("allowed_token_ids", params.allowed_token_ids or ())
        for name in ("reasoning_start_token_id", "reasoning_end_token_id"):
            if (tok := getattr(params, name)) is not None:
                self._check_vocab(name, (tok,))
        self._check_vocab("thinking_budget_message_ids", params.thinking_budget_message_ids or ())
        if len(params.guided_choice or ()) > cfg.max_guided_choices:
            raise LimitExceededError(
                "guided_choice",
                f"guided_choice may hold at most {cfg.max_guided_choices} choices (max_guided_choices).",
            )
        if len(params.bad_words or ()) > cfg.max_bad_words:
            raise LimitExceededError(
                "bad_words", f"bad_words may hold at most {cfg.max_bad_words} words (max_bad_words)."
            )
        if len(params.stop_token_ids or []) > cfg.max_stop_token_ids:
            raise LimitExceededError(
                "stop_token_ids", f"stop_token_ids may hold at most {cfg.max_stop_token_ids} ids."
            )
        if params.use_beam_search:
            # Beams advance in lockstep: all of them must hold their blocks at once, or the
            # scheduler preempts one to grow another forever. Full prompt blocks are shared: a
            # preempted beam gets them back from the prefix cache; without it, it recomputes its
            # prompt into blocks of its own (so the sharing can't be counted on).
            bs = self.kv_spec.block_size
            total = min(num_prompt_tokens + params.max_tokens, self.max_model_len)
            shared = num_prompt_tokens // bs if self.block_manager.enable_prefix_caching else 0
            need = shared + params.n * (-(-total // bs) - shared)
            if self._window_blocks:
                # Every layer slides: a beam holds at most the window plus one chunk, however long
                # (release_outside_window; the bound max_model_len is sized with).
                need = min(need, params.n * self._window_blocks)
            if need > self.kv_spec.num_blocks:
                raise LimitExceededError(
                    "n",
                    f"beam search with n={params.n} needs up to {need} KV cache blocks for this prompt "
                    f"and max_tokens, but the cache has {self.kv_spec.num_blocks}: lower n or max_tokens.",
                )

    def _check_vocab(self, name: str, ids: Iterable[int]) -> None:
        """The sampling field ``name``'s token ids (given, or its text's) all inside the vocabulary."""
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidParamError(
                name, f"{name} holds token {bad}, outside the vocabulary [0, {self.vocab_size})."
            )

    def _encoder(self, name: str, texts: Sequence_[str]) -> Callable[[str], list[int]]:
        """Text -> ids without special tokens, for the strings of sampling field ``name``, once they
        pass the prompt's byte bound (``max_prompt_bytes``) together."""
        self.inputs.check_prompt_size(texts, name)
        return functools.partial(self.tokenizer.encode, add_special_tokens=False)

    def _bad_words(self, params: SamplingParams) -> BadWords | None:
        """``params.bad_words`` as the sampler applies them, tokenized as vLLM does."""
        if not params.bad_words:
            return None
        words = bad_words_token_ids(self._encoder("bad_words", params.bad_words), params.bad_words)
        self._check_vocab("bad_words", itertools.chain.from_iterable(words))
        return BadWords.from_token_ids(words)

    def _choices(self, params: SamplingParams) -> ChoicePaths | None:
        """``params.guided_choice`` as token paths, each choice its own tokenization."""
        if params.guided_choice is None:
            return None
        encode = self._encoder("guided_choice", params.guided_choice)
        paths = [encode(c) for c in params.guided_choice]
        if not all(paths):
            raise InvalidParamError(
                "guided_choice", "guided_choice holds a choice that tokenizes to nothing."
            )
        self._check_vocab("guided_choice", itertools.chain.from_iterable(paths))
        return ChoicePaths.from_token_ids(paths, self.eos_token_ids)

    def compile_grammar(self, params: SamplingParams) -> Any:
        """``params``' JSON schema, regex or grammar compiled for this model (None: none), once its
        text passes the prompt's byte bound (``max_prompt_bytes``)."""
        spec = params.grammar_spec
        if spec is None:
            return None
        self.inputs.check_prompt_size([spec[1]], spec[0])
        return self.grammars.compile(params)

    def num_queued_requests(self) -> int:
        """Requests waiting for their first step (preempted sequences of started ones excluded)."""
        return sum(
            1 for s in self.scheduler.waiting if s.index == 0 and s.request.first_scheduled_time is None
        )

    def validate_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        return self.inputs.validate_prompt(prompt)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        adapter: str | None = None,
        request_id: str | None = None,
        grammar: Any = None,
        priority: int = 0,
    ) -> Request:
        """Validate and queue one request; on any error nothing is queued or held. Its outputs
        come from ``step`` (text, stop strings: the output processor). ``grammar`` and
        ``priority``: as for ``add_core_request``."""
        return self.add_core_request(
            prompt, params, adapter=adapter, request_id=request_id, grammar=grammar, priority=priority,
            _frontend=True,
        )  # fmt: skip

    def check_priority(self, priority: Any) -> None:
        """``InvalidParamError`` unless ``priority`` is a request priority this engine takes: an int
        in int64's range, and 0 unless it schedules by priority (vLLM refuses one as well)."""
        check_priority_value(priority)
        if priority and not self.scheduler.by_priority:
            raise InvalidParamError(
                "priority",
                f"priority {priority}: this engine schedules first come, first served; start it with "
                "--scheduling-policy priority (EngineConfig(scheduling_policy='priority')) to use priorities",
            )

    def preload_adapter(self, name: str) -> None:
        """Read adapter ``name`` into host memory if it is only on disk, before ``add_request``
        takes the engine's lock: ``acquire`` reads it under that lock otherwise, and every running
        request waits for the read and hash. On a thread that exits afterwards, so no second
        OpenMP pool stays (engine/threads.py)."""
        if self.registry.on_disk(name):
            run_in_fresh_thread(self.registry.preload, name, thread_name="lorastar-adapter-read")

    def add_core_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        adapter: str | None = None,
        request_id: str | None = None,
        grammar: Any = None,
        priority: int = 0,
        _frontend: bool = False,
    ) -> Request:
        """``add_request`` for the core alone: its outputs come from ``step_core`` (a frontend in
        another process detokenizes them). ``_frontend``: ``add_request``'s registration with the
        in-process output processor, under the same lock as the queueing (else a step on the
        engine thread could run the request before the processor knows it, and drop its outputs).
        ``grammar``: ``params``' structured-output constraint compiled already (``self.grammars``;
        a core process compiles off its step loop). ``priority``: lower is served first under
        ``scheduling_policy="priority"`` (``EngineConfig.scheduling_policy``); must be 0 under FCFS."""
        self.check_priority(priority)
        if params is None:
            params = SamplingParams()
        elif isinstance(params, Mapping):
            params = SamplingParams.from_dict(dict(params))
        elif not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams or a dict, got {type(params).__name__}")
        if params.use_beam_search and params.stop:
            raise InvalidParamError("stop", "stop: stop strings are not supported with use_beam_search")
        text, ids = self.validate_prompt(prompt)
        params = bounded_logprobs(params, self.max_logprobs, self.vocab_size)  # -1: the whole vocabulary
        self.check_limits(params, len(ids))
        bad_words, choices = self._bad_words(params), self._choices(params)
        if grammar is None:
            grammar = self.compile_grammar(params)
        if adapter is not None:
            self.preload_adapter(adapter)
        with self.lock:
            rid = request_id if request_id is not None else f"req-{next(self._ids)}"
            if rid in self.requests:
                raise ValueError(f"request_id {rid!r} is already in use")
            max_waiting = self.config.max_waiting
            # (the queue's length bounds the count: only a queue that long is counted, not each add's)
            if (
                max_waiting is not None
                and len(self.scheduler.waiting) >= max_waiting
                and (queued := self.num_queued_requests()) >= max_waiting
            ):
                raise EngineOverloadedError(
                    f"{queued} requests are waiting (max_waiting={max_waiting}); retry later"
                )
            entry = self.registry.acquire(adapter) if adapter is not None else None
            req = Request(rid, text, ids, params, adapter_name=adapter, adapter_entry=entry,
                          adapter_key=entry.content_hash if entry is not None else None,
                          priority=priority)  # fmt: skip
            if params.prompt_logprobs is not None:
                req.prompt_logprobs = [None] * len(ids)
                self._num_prompt_logprobs += 1
            self._num_adapter_requests += entry is not None
            self._num_embeds += params.embed
            if params.use_beam_search:
                req.beam = BeamState(params.n, params.length_penalty, self.eos_token_ids, params.ignore_eos,
                                     tuple(params.stop_token_ids or ()), num_logprobs=params.logprobs)  # fmt: skip
            seq = req.sequences[0]
            self._init_seq(seq)
            if _frontend:
                self.output_processor.add_request(rid, text, ids, params, adapter)
            self.requests[rid] = req
            req.bad_words, req.choices, req.grammar = bad_words, choices, grammar
            req.holds_sync = _needs_sync(req)
            self._num_sync_requests += req.holds_sync
            req.reads_host = _reads_host(req)
            self._num_host_readers += req.reads_host
            self.scheduler.add(seq)
            return req

    def _init_seq(self, seq: Sequence) -> None:
        req = seq.request
        if req.params.seed is not None and seq.generator is None:
            seq.generator = make_generator(req.params.seed, self.device)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        with self.lock:
            out = self.abort_core_request(request_id)
            if out is None:
                self.output_processor.drop(request_id)
                return None
            outs, _ = self.output_processor.process([out])
            return outs[0] if outs else None

    def abort_core_request(self, request_id: str) -> EngineCoreOutput | None:
        with self.lock:
            req = self.requests.get(request_id)
            if req is None:
                return None
            self.scheduler.abort(req)
            return self._finish_request(req)

    def finish_sample(self, request_id: str, index: int, stop: str) -> EngineCoreOutput | None:
        """Finish sample ``index`` of a request, which the frontend saw end on the stop string
        ``stop``; the request's final core output if that was its last running sample."""
        with self.lock:
            req = self.requests.get(request_id)
            if req is None:
                return None
            for seq in req.sequences:
                if seq.index == index and not seq.is_finished:
                    self.scheduler.finish(seq, "stop", stop)
            return self._finish_request(req) if req.is_finished else None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step: the outputs to hand out, per each request's ``output_kind``."""
        with self.lock:
            outputs, stops = self.output_processor.process(self.step_core())
            for rid, index, stop in stops:
                self.finish_sample(rid, index, stop)
            return outputs

    def step_core(self) -> list[EngineCoreOutput]:
        """One step of the core: schedule, run, sample; each touched request's new tokens (with
        ``async_scheduling``: the previous step's, this one's come with the next call)."""
        with self.lock:
            if self.async_scheduling:
                return self._step_async()
            return self._step_sync()

    def _step_sync(self) -> list[EngineCoreOutput]:  # under self.lock (step_core)
        if self.speculative is None:
            return self._run_sync()
        drafted = self._propose_drafts()
        try:
            return self._run_sync()
        except BaseException:  # a failed step's requests end with what they had: no draft goes out
            for seq in drafted:
                self.scheduler.drop_drafts(seq)
            raise

    def _run_sync(self) -> list[EngineCoreOutput]:
        out = self.scheduler.schedule()
        self.runner.batch.remove(out.finished_seq_ids)  # their rows, before any new one
        if out.is_empty:
            return []
        now = time.monotonic()
        tokens = 0
        for sch in out.scheduled:  # before running: a failed step knows whom it involved
            req = sch.seq.request
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            tokens += sch.num_new_tokens
        prompt_logprobs = self._num_prompt_logprobs > 0
        if prompt_logprobs:
            self._seed_prompt_logprobs(out)
        result = self.runner.execute(
            out, self._adapter_slots(out), prompt_logprobs=prompt_logprobs, embeddings=self._num_embeds > 0
        )
        self._keep_embeddings(out, result)
        self.iteration_tokens.observe(tokens)
        self.scheduler.update(out)
        if prompt_logprobs:
            self._store_prompt_logprobs(out, result)
        return self._process(out, result.logits)

    # ---- speculative decoding (engine/spec_decode.py) -----------------------------------------
    def _propose_drafts(self) -> list[Sequence]:
        """Append drafted tokens to each running sequence that is about to decode and may draft;
        returns them."""
        spec = self.speculative
        assert spec is not None
        drafted: list[Sequence] = []
        running = self.scheduler.running
        if spec.disable_by_batch_size is not None and len(running) >= spec.disable_by_batch_size:
            return drafted
        for seq in running:
            if seq.num_tokens - seq.num_computed_tokens != 1 or not _can_draft(seq):
                continue
            p = seq.request.params
            k = min(
                spec.num_speculative_tokens,
                p.max_tokens - seq.num_output_tokens - 1,  # the last token a step adds is not a draft
                self.max_model_len - seq.num_tokens - 1,
            )
            if k <= 0:
                continue
            toks = propose_ngram(token_array(seq), spec.prompt_lookup_min, spec.prompt_lookup_max, k)
            row = seq.sampling_row
            if toks and (row.grammar is not None or row.choices is not None or row.thinking is not None):
                toks = toks[: _allowed_drafts(row, toks)]
            if toks:
                seq.token_ids.extend(toks)
                seq.num_draft_tokens = len(toks)
                drafted.append(seq)
        return drafted

    def _verify(
        self, seq: Sequence, d: int, rows: list[tuple[list[int], list[RowLogprobs | None] | None]]
    ) -> tuple[list[int], list[RowLogprobs | None] | None]:
        """The tokens ``seq``'s ``1 + d`` rows give (see engine/spec_decode.py): its drafts leave
        ``token_ids`` and the confirmed ones come back through ``_append``."""
        drafts = seq.token_ids[len(seq.token_ids) - d :]
        sampled = [r[0][0] for r in rows]
        j = accepted(drafts, sampled)
        self.spec_stats.observe(d, j)
        self.scheduler.drop_drafts(seq)
        lps = None if rows[0][1] is None else [r[1][0] for r in rows[: j + 1]]  # type: ignore[index]
        return sampled[: j + 1], lps

    def _append_verified(
        self,
        targets: list[Sequence],
        new_tokens: list[tuple[list[int], list[RowLogprobs | None] | None]],
        drafted: dict[int, int],
        now: float,
        touched: dict[str, Request],
        rewind: dict[int, torch.Tensor],
    ) -> None:
        """``_process``'s appends when some rows verify drafts: each drafted sequence keeps its
        confirmed drafts' KV (computed this step; its full blocks enter the prefix cache even when
        the sequence finishes on a later one, as plain steps leave them) and gives back the blocks
        of the rejected ones;
        ``rewind``: seeded drafted sequences' generator states before the draws (first row -> state)."""
        bm = self.block_manager
        i = 0
        while i < len(targets):
            seq = targets[i]
            d = drafted.get(i, 0)
            toks, lps = self._verify(seq, d, new_tokens[i : i + d + 1]) if d else new_tokens[i]
            if (state := rewind.get(i)) is not None:
                _rewind_generator(seq.sampling_row.generator, state, len(toks))
            i += d + 1
            for k, tok in enumerate(toks):  # up to the first that finishes the sequence
                if k:  # toks[k - 1] was a kept draft: computed this step, cached before any finish
                    seq.num_computed_tokens += 1
                    bm.commit(seq)
                self._append(seq, tok, lps[k] if lps is not None else None, now)
                if seq.is_finished:
                    break
            touched[seq.request.request_id] = seq.request
            if d and not seq.is_finished:
                bm.release_outside_window(seq)
                bm.trim(seq)

    # ---- async scheduling ---------------------------------------------------------------------
    # Step N+1 is scheduled and launched before step N's sampled ids are read back: each sequence
    # N sampled for holds a placeholder token (``Sequence.num_placeholders``) that the scheduler
    # counts like any token, N+1's input ids for those positions are N's sampled ids on the device
    # (``runner.patch_input_ids``), and N's outputs are built while the device runs N+1. Blocks get
    # their prefix-cache hashes only once every token in them is known (``Scheduler.commit``). A
    # sequence found finished at N (EOS, a stop token; aborted, a stop string) has its N+1 token
    # dropped; freeing its blocks at once is safe because one device stream runs the steps in
    # order. One step in flight at most; the steps of requests that fork on the host or score their
    # prompts (``_needs_sync``) run one at a time; while a request whose sampling reads its output
    # on the host is live (``_reads_host``: a grammar, guided_choice, a bad word of several tokens, a
    # thinking budget), step N is completed inside N+1's launch, after the forward and before
    # sampling, so its host work still runs while the device computes.
    def _step_async(self) -> list[EngineCoreOutput]:
        prev, self._inflight = self._inflight, None
        if self._num_sync_requests:
            outputs = self._complete(prev) if prev is not None else []
            return outputs + self._step_sync()
        out = self.scheduler.schedule()
        self.runner.batch.remove(out.finished_seq_ids)
        if out.is_empty:
            return self._complete(prev) if prev is not None else []
        early: list[EngineCoreOutput] | None = [] if prev is not None and self._num_host_readers else None
        launched = self._launch(out, prev, early)
        outputs = early if early is not None else self._complete(prev) if prev is not None else []
        self._inflight = launched
        return outputs

    def _launch(
        self,
        out: SchedulerOutput,
        prev: _InFlight | None,
        complete_into: list[EngineCoreOutput] | None = None,
    ) -> _InFlight:
        """Run ``out`` and sample it on the device; give each sampling sequence its placeholder.
        ``complete_into`` (with ``prev``): complete ``prev`` into that list once the model is
        launched, before sampling: rows that read their output on the host (``_reads_host``) then
        read it whole."""
        now = time.monotonic()
        patch_src: list[int] = []
        patch_dst: list[int] = []
        tokens = 0
        for i, sch in enumerate(out.scheduled):
            seq = sch.seq
            if seq.request.first_scheduled_time is None:
                seq.request.first_scheduled_time = now
            if seq.num_placeholders and sch.samples:  # its input is the last, unknown token
                patch_src.append(seq.placeholder_row)
                patch_dst.append(i)
            tokens += sch.num_new_tokens
        if patch_src and prev is None:  # a placeholder outlived its step: its input would be garbage
            raise RuntimeError("async scheduling: a placeholder token has no step in flight")
        patch = (prev.sample.token_ids, patch_src, patch_dst) if prev is not None and patch_src else None
        result = self.runner.execute(
            out, self._adapter_slots(out), patch, prompt_logprobs=self._num_prompt_logprobs > 0,
            embeddings=self._num_embeds > 0,
        )  # fmt: skip
        self._keep_embeddings(out, result)
        self.iteration_tokens.observe(tokens)
        self.scheduler.update(out, commit=False)
        if prev is not None and complete_into is not None:  # the device runs the forward meanwhile
            complete_into.extend(self._complete(prev))
            prev = None  # no placeholder is left
        rows: list[SamplingRow] = []
        seqs: list[Sequence] = []
        pending = PendingTokens(prev.sample.token_ids, [], []) if prev is not None else None
        for sch in out.scheduled:
            if not sch.samples:
                continue
            seq = sch.seq
            row = seq.sampling_row
            if row is None:  # no fan-out or beams here (_needs_sync)
                row = seq.sampling_row = self._sampling_row(seq, seq.generator)
            if seq.num_placeholders and pending is not None:  # penalties read its token on the device
                pending.rows.append(len(rows))
                pending.src.append(seq.placeholder_row)
            rows.append(row)
            seqs.append(seq)
        sample = self.sampler.launch(
            result.logits, rows, self.runner.batch.sampling_metadata(seqs), no_sync=True, pending=pending
        )
        targets: list[tuple[Sequence, int]] = []
        for j, seq in enumerate(seqs):
            if seq.status is SeqStatus.FINISHED:  # ended by the step completed above: its row is dropped
                targets.append((seq, -1))
                continue
            seq.token_ids.append(0)  # any valid id: read only through placeholder-aware paths
            seq.num_placeholders += 1
            seq.placeholder_row = j
            n = seq.num_tokens
            if n - seq.num_prompt_tokens >= seq.request.params.max_tokens or n >= self.max_model_len:
                seq.ends_pending = True
            targets.append((seq, n - 1))
        return _InFlight(out, targets, sample)

    def _complete(self, step: _InFlight) -> list[EngineCoreOutput]:
        """Read ``step``'s tokens back, put them in place of its placeholders, and build outputs."""
        sampled = step.sample.result()
        now = time.monotonic()
        live: list[tuple[Sequence, int, int, RowLogprobs | None]] = []
        for (seq, pos), tok, lp in zip(step.targets, sampled.token_ids, sampled.logprobs):
            if seq.status is SeqStatus.FINISHED:  # ended while in flight: its token is dropped
                continue
            seq.token_ids[pos] = tok
            seq.num_placeholders -= 1
            live.append((seq, pos, tok, lp))
        self.scheduler.commit(step.out)  # every token of the computed blocks is known now
        touched: dict[str, Request] = {}
        for seq, pos, tok, lp in live:
            self._append(seq, tok, lp, now, pos)
            if seq.is_finished and seq.num_placeholders:  # the next step's token goes too
                del seq.token_ids[pos + 1 :]
                seq.num_placeholders = 0
            touched[seq.request.request_id] = seq.request
        return self._outputs(touched)

    # ---- prompt logprobs and the prefix cache (see engine/prompt_logprobs.py) -----------------
    def _seed_prompt_logprobs(self, out: SchedulerOutput) -> None:
        """A request admitted on a prefix-cache hit: its cached positions' logprobs come from the
        kept blocks, the first computed position's from the last kept block's hidden row."""
        bs = self.block_manager.block_size
        for s in out.scheduled:
            seq, req = s.seq, s.seq.request
            store = req.prompt_logprobs
            if store is None or seq.index != 0 or s.start == 0 or s.start >= seq.num_prompt_tokens:
                continue
            if store[s.start] is not None:  # computed by an earlier chunk (or before a preemption)
                continue
            k = req.params.prompt_logprobs or 0
            blocks = [
                self.prompt_logprobs_cache.get(h, k) for h in self.block_manager.hashes(seq, s.start // bs)
            ]
            if not blocks or any(b is None for b in blocks):  # the scheduler admitted only kept hits
                raise RuntimeError("prompt logprobs of a prefix-cache hit are missing")
            for j, b in enumerate(blocks):
                for i, e in enumerate(b.entries):  # type: ignore[union-attr]
                    if store[j * bs + i] is None:
                        store[j * bs + i] = e
            (store[s.start],) = score_prompt_rows(
                self.runner.model.compute_logits, blocks[-1].last_hidden[None],  # type: ignore[union-attr]
                [seq.token_ids[s.start]], k, self.vocab_size,
            )  # fmt: skip
            req.prompt_blocks_kept = max(req.prompt_blocks_kept, len(blocks))

    def _store_prompt_logprobs(self, out: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """File each chunk's prompt logprobs by position (a recomputed chunk after preemption
        finds its positions filled and keeps the first values); keep complete prompt blocks."""
        bs = self.block_manager.block_size
        for s in out.scheduled:
            seq, req = s.seq, s.seq.request
            store = req.prompt_logprobs
            if store is None or seq.index != 0:
                continue
            chunk = result.prompt_logprobs.get(seq.seq_id)
            if chunk is not None:
                first, entries = chunk
                for pos, e in enumerate(entries, start=first):
                    if store[pos] is None:
                        store[pos] = e
            if not self.block_manager.enable_prefix_caching:
                continue
            req.prompt_hidden.update(result.prompt_hidden.get(seq.seq_id, {}))
            j = req.prompt_blocks_kept
            while (j + 1) * bs <= seq.num_prompt_tokens and (j + 1) * bs - 1 in req.prompt_hidden:
                if any(store[p] is None for p in range(max(1, j * bs), (j + 1) * bs)):
                    break
                block = KeptBlock(
                    req.params.prompt_logprobs or 0,
                    store[j * bs : (j + 1) * bs],
                    req.prompt_hidden.pop((j + 1) * bs - 1),
                )
                if self.prompt_logprobs_cache.fits(block, j + 1):
                    self.prompt_logprobs_cache.put(self.block_manager.hashes(seq, j + 1)[j], block)
                j += 1
            req.prompt_blocks_kept = j

    def _adapter_slots(self, out: SchedulerOutput) -> dict[str, int] | None:
        if not self._num_adapter_requests:
            return None
        slots: dict[str, int] = {}
        for s in out.scheduled:
            entry = s.seq.request.adapter_entry
            if entry is not None and entry.slot is not None:
                slots[entry.content_hash] = entry.slot
        return slots or None

    def _process(self, out: SchedulerOutput, logits: torch.Tensor) -> list[EngineCoreOutput]:
        now = time.monotonic()
        rows: list[SamplingRow] = []
        seqs: list[Sequence] = []  # whose parameters each row samples with (a fork's: its parent)
        forks: list[tuple[int, int, torch.Generator | None]] = []  # (row, sample index k > 0, generator)
        logit_rows: list[int] = []
        beam_rows: list[tuple[Sequence, int]] = []
        drafted: dict[int, int] = {}  # first row of a drafted sequence -> its drafts
        rewind: dict[int, torch.Tensor] = {}  # first row of a seeded drafted one -> its generator's state
        marks: list[tuple[Any, Any]] = []  # drafted rows' matchers and budgets -> their state before
        r = 0
        for s in out.scheduled:
            if not s.samples:
                continue
            seq = s.seq
            row = seq.sampling_row
            if row is not None and s.num_drafts:  # a row per draft and one after them, in order
                d = s.num_drafts
                drafted[len(rows)] = d
                if row.generator is not None:  # seeded: rewound to one draw per kept token
                    rewind[len(rows)] = row.generator.get_state()
                # They step through the drafts as their rows are sampled; taken back after.
                marks += [(x, x.checkpoint()) for x in (row.grammar, row.thinking) if x is not None]
                rows += _draft_rows(seq, row, d)
                seqs += [seq] * (d + 1)
                logit_rows += range(r, r + d + 1)
                r += d + 1
                continue
            if row is not None:  # sampled before: no beam, no fan-out (an n > 1 request forked then)
                rows.append(row)
                seqs.append(seq)
                logit_rows.append(r)
                r += 1
                continue
            req = seq.request
            if req.beam is not None:
                beam_rows.append((seq, r))
                r += 1
                continue
            fan = req.params.n if (req.params.n > 1 and not req.forked) else 1
            for k in range(fan):
                # Sample k of a seeded request draws from its own generator seeded seed + k (vLLM's
                # rule): its tokens never depend on when a sibling stops (a frontend's stop string
                # reaches a core process a step or two late).
                gen = seq.generator
                if k > 0 and req.params.seed is not None:
                    gen = make_generator((req.params.seed + k) % 2**64, self.device)  # seed <= 2**64 - 1
                # Its fields never change: built once per sequence (a fork's at the fork).
                row = self._sampling_row(seq, gen)
                if k == 0:
                    seq.sampling_row = row
                else:
                    forks.append((len(rows), k, gen))
                rows.append(row)
                seqs.append(seq)
                logit_rows.append(r)
            r += 1
        touched: dict[str, Request] = {}
        if rows:
            sample_logits = logits  # beam rows below index the step's logits, not these
            # Fan-out rows repeat a logits row; beam rows are not here (their count can equal the
            # fan-out's extra rows: the sizes then agree, the rows do not).
            if beam_rows or len(rows) != logits.shape[0]:
                sample_logits = logits.index_select(0, torch.tensor(logit_rows, device=logits.device))
            try:
                new_tokens = self._sample(sample_logits, rows, self.runner.batch.sampling_metadata(seqs))
            finally:
                for x, state in marks:
                    x.restore(state)
            # Fork n > 1 samples first: they share the parent's blocks as they are *before* any
            # token is appended (the parent may finish on its first token and free them).
            targets = seqs
            if forks:
                targets = list(seqs)
                for j, k, gen in forks:
                    seq = seqs[j]
                    child = Sequence(
                        seq.request, k, seq.token_ids[: seq.num_prompt_tokens], seq.num_prompt_tokens
                    )
                    child.generator = gen
                    self.scheduler.add_forked(seq, child)
                    self._init_seq(child)
                    seq.request.sequences.append(child)
                    seq.request.forked = True
                    self._release_sync(seq.request)
                    targets[j] = child
            if drafted:
                self._append_verified(targets, new_tokens, drafted, now, touched, rewind)
            else:
                append = self._append
                for seq, (toks, lps) in zip(targets, new_tokens):
                    if len(toks) == 1:  # the usual step: one token (no loop: per row, 256 a step)
                        append(seq, toks[0], None if lps is None else lps[0], now)
                    else:
                        for i, tok in enumerate(toks):  # up to the first that finishes the sequence
                            append(seq, tok, lps[i] if lps is not None else None, now)
                            if seq.is_finished:
                                break
                    touched[seq.request.request_id] = seq.request
        if beam_rows:
            self._beam_proposals(beam_rows, logits, touched)
        return self._outputs(touched)

    def _outputs(self, touched: dict[str, Request]) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        running = SeqStatus.RUNNING
        for req in touched.values():
            seqs = req.sequences
            if req.beam is None and len(seqs) == 1 and req.num_outputs and seqs[0].status is running:
                # The common step (one sample, running, past its first output): _core_output's
                # result without its branches; per request and step, so it counts at 256 of them.
                req.num_outputs += 1
                outputs.append(EngineCoreOutput(
                    req.request_id, [self._sample_delta(seqs[0], req.params.logprobs is not None)],
                    False, False, req.num_cached_tokens, None, _metrics(req),
                ))  # fmt: skip
            elif req.is_finished:
                outputs.append(self._finish_request(req))
            elif req.beam is None or req.params.output_kind == RequestOutputKind.CUMULATIVE:
                # Every step of a sample goes out (the frontend finds stop strings in its text);
                # beam search streams its hypotheses only when asked for cumulative outputs.
                outputs.append(self._core_output(req, False))
        return outputs

    def _sampling_row(self, seq: Sequence, generator: torch.Generator | None) -> SamplingRow:
        """The sampler's view of ``seq``: its fields never change, so it is built once (a fork's at
        the fork); the output ids are read in place."""
        req = seq.request
        p = req.params
        grammar = (
            GrammarRow(req.grammar, self.eos_token_ids, p.reasoning_start_token_id, p.reasoning_end_token_id)
            if req.grammar is not None
            else None
        )
        thinking = (
            ThinkingBudget(
                p.thinking_token_budget,
                p.reasoning_start_token_id,
                p.reasoning_end_token_id,
                p.thinking_budget_message_ids or (),
            )
            if p.thinking_token_budget is not None and p.reasoning_end_token_id is not None
            else None
        )
        return SamplingRow(req.params, req.prompt_token_ids, OutputIds(seq.token_ids, seq.num_prompt_tokens),
                           generator, self.eos_token_ids, bad_words=req.bad_words, choices=req.choices,
                           grammar=grammar, thinking=thinking)  # fmt: skip

    def _sample(
        self, logits: torch.Tensor, rows: list[SamplingRow], meta: SamplingMetadata | None = None
    ) -> list[tuple[list[int], list[RowLogprobs | None] | None]]:
        """Each row's new tokens in order, with their logprobs (None: not asked for). The sampler
        gives one token a row (a drafted sequence's rows are verified after this, in ``_verify``);
        everything after this takes several tokens a row too (tests/engine/test_multi_token_steps.py
        hands them in here): ``_append`` stops at the first token that finishes the sequence, the
        scheduler computes the KV of appended tokens in the next step (as a chunk; kept drafts' KV
        is this step's), and outputs carry every new token of the step."""
        sampled = self.sampler(logits, rows, meta)  # [rows] token ids
        return [([t], None if lp is None else [lp]) for t, lp in zip(sampled.token_ids, sampled.logprobs)]

    # ---- beam search ------------------------------------------------------------------------
    def _beam_proposals(
        self, rows: list[tuple[Sequence, int]], logits: torch.Tensor, touched: dict[str, Request]
    ) -> None:
        idx = torch.tensor([r for _, r in rows], device=logits.device)
        lp = torch.log_softmax(logits.index_select(0, idx).float(), dim=-1)  # [R, vocab]
        for i, (seq, _) in enumerate(rows):  # min_tokens: no hypothesis ends before (HF's min_new_tokens)
            if seq.num_output_tokens < seq.request.params.min_tokens:
                ends = [t for t in seq.request.beam.end_ids if t < lp.shape[-1]]
                if ends:
                    lp[i, ends] = float("-inf")
        k = min(
            max(max(2 * s.request.beam.width, s.request.beam.num_logprobs or 0) for s, _ in rows),
            lp.shape[-1],
        )
        vals, toks = lp.topk(k, dim=-1)
        vals, toks = vals.tolist(), toks.tolist()
        for (seq, _), v, t in zip(rows, vals, toks):
            beam = seq.request.beam
            w = 2 * beam.width
            beam.pending[seq.seq_id] = [(seq.cumulative_logprob + a, b) for a, b in zip(v[:w], t[:w])]
            if beam.num_logprobs is not None:
                top = max(w, beam.num_logprobs)
                beam.step_logprobs[seq.seq_id] = list(zip(t[:top], v[:top]))
            touched[seq.request.request_id] = seq.request
        for req in {seq.request.request_id: seq.request for seq, _ in rows}.values():
            live = [s for s in req.sequences if not s.is_finished]
            if all(s.seq_id in req.beam.pending for s in live):
                self._beam_step(req, live)

    def _beam_step(self, req: Request, live: list[Sequence]) -> None:
        st = req.beam
        now = time.monotonic()
        beams = [(s.seq_id, s.output_token_ids, s.cumulative_logprob) for s in live]
        chosen = st.select(beams)
        by_id = {s.seq_id: s for s in live}
        want_lp = st.num_logprobs is not None
        if want_lp:  # hypotheses that ended on this step's proposals: their parent's logprobs + the end
            for h in st.finished:
                if h.logprobs is None:
                    h.logprobs = [*by_id[h.source].logprobs, st.token_logprobs(h.source, h.token_ids[-1])]
        used: set[int] = set()
        targets: list[tuple[Sequence, int, float]] = []
        entries: list[list[tuple[int, float, int]] | None] = []  # each target's new logprobs entry
        for sid, tok, score in chosen:  # fork extra uses of a parent before any append
            parent = by_id[sid]
            entries.append(st.token_logprobs(sid, tok) if want_lp else None)
            if sid in used:
                child = Sequence(req, 0, list(parent.token_ids), parent.num_prompt_tokens)
                if want_lp:
                    child.logprobs = list(parent.logprobs)
                self.scheduler.add_forked(parent, child)
                req.sequences.append(child)
                targets.append((child, tok, score))
            else:
                used.add(sid)
                targets.append((parent, tok, score))
        st.step_logprobs.clear()
        for s in live:
            if s.seq_id not in used:  # pruned beam: its blocks go back now
                self.scheduler.finish(s, "stop")
                req.sequences.remove(s)
        req.forked = True
        if req.first_token_time is None:
            req.first_token_time = now
            self.prompt_tokens_total += req.num_prompt_tokens  # its prefill is done (vLLM's count)
        req.last_token_time = now
        for (seq, tok, score), entry in zip(targets, entries):
            seq.token_ids.append(tok)
            seq.cumulative_logprob = score
            if entry is not None:
                seq.logprobs.append(entry)
            self.generation_tokens_total += 1
        if req.adapter_name and targets:  # as _append counts a sampled token
            name = req.adapter_name
            self.adapter_tokens[name] = self.adapter_tokens.get(name, 0) + len(targets)
        for i, (seq, _, _) in enumerate(targets):
            seq.index = i
        if targets and not st.done:
            head = targets[0][0]
            if head.num_output_tokens >= req.params.max_tokens or head.num_tokens >= self.max_model_len:
                st.finish_all([(s.seq_id, s.output_token_ids, s.cumulative_logprob) for s, _, _ in targets])
                if want_lp:
                    by_seq = {s.seq_id: s for s, _, _ in targets}
                    for h in st.finished:
                        if h.logprobs is None:
                            h.logprobs = list(by_seq[h.source].logprobs)
        if st.done:
            for s in list(req.sequences):
                self.scheduler.finish(s, "length")

    def _append(
        self, seq: Sequence, tok: int, lp: dict[int, tuple[float, int]] | None, now: float, pos: int = -1
    ) -> None:
        """Account the new token ``tok`` (``pos``: already written there, in place of a placeholder)
        and end the sequence if it ends it."""
        req = seq.request
        p = req.params
        if req.first_token_time is None:
            req.first_token_time = now
            # Prompt tokens count once the prefill is done (vLLM's count): a request aborted
            # before it ran adds none, a long one's prompt shows before it ends.
            self.prompt_tokens_total += req.num_prompt_tokens
        req.last_token_time = now
        if pos < 0:
            seq.token_ids.append(tok)
            end = len(seq.token_ids)
        else:
            end = pos + 1
        if not p.embed:  # an embedding request's one token is no output: counted by none
            self.generation_tokens_total += 1
            if req.adapter_name:
                self.adapter_tokens[req.adapter_name] = self.adapter_tokens.get(req.adapter_name, 0) + 1
        if lp is not None:
            seq.logprobs.append([(t, v, rank) for t, (v, rank) in lp.items()])
            if tok in lp:
                seq.cumulative_logprob += lp[tok][0]
        # Stop strings are the frontend's (engine/output_processor.py): they need the text.
        n_out = end - seq.num_prompt_tokens
        if tok in self.eos_token_ids and not p.ignore_eos and n_out >= p.min_tokens:
            self.scheduler.finish(seq, "stop", None)
        elif p.stop_token_ids and tok in p.stop_token_ids and n_out >= p.min_tokens:
            self.scheduler.finish(seq, "stop", tok)
        elif n_out >= p.max_tokens or end >= self.max_model_len:
            self.scheduler.finish(seq, "length", None)

    @staticmethod
    def _keep_embeddings(out: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """Embedding requests' hidden rows onto their requests (sent with the final output)."""
        if result.embeddings:
            for s in out.scheduled:
                if (row := result.embeddings.get(s.seq.seq_id)) is not None:
                    s.seq.request.embedding = row

    def _core_output(self, req: Request, finished: bool) -> EngineCoreOutput:
        """The request's step for the frontend: each sample's tokens since the last output (beam
        search: the hypotheses whole), the prompt logprobs with the first output."""
        params, beam = req.params, req.beam
        want_lp = params.logprobs is not None
        samples: list[SampleDelta] = []
        if beam is None:
            samples = [self._sample_delta(seq, want_lp) for seq in req.sequences]
        elif beam.done:
            for i, h in enumerate(beam.finished):
                # Ended on EOS (stop_reason None) or a stop token id (that id), as a sample does;
                # with ignore_eos an EOS is a token like any other.
                last = h.token_ids[-1] if h.token_ids else None
                if last is not None and last in beam.end_ids:
                    eos = not params.ignore_eos and last in self.eos_token_ids
                    samples.append(SampleDelta(i, list(h.token_ids), h.logprobs, h.sum_logprob, "stop",
                                               None if eos else last))  # fmt: skip
                else:
                    samples.append(SampleDelta(i, list(h.token_ids), h.logprobs, h.sum_logprob, "length"))
        else:
            for seq in req.sequences:
                samples.append(SampleDelta(seq.index, seq.output_token_ids, list(seq.logprobs) if want_lp else None,
                                           seq.cumulative_logprob if want_lp else None,
                                           seq.finish_reason, seq.stop_reason))  # fmt: skip
        if finished and len(samples) < params.n:  # aborted before its samples forked: n of them
            samples += aborted_samples(params, {d.index for d in samples})
        req.num_outputs += 1
        # Positional: one of these per touched request a step, and keywords cost more.
        return EngineCoreOutput(
            req.request_id, samples, finished, beam is not None, req.num_cached_tokens,
            self._prompt_logprobs_output(req) if req.num_outputs == 1 else None, _metrics(req),
            req.embedding.tolist() if finished and req.embedding is not None else None,
        )  # fmt: skip

    @staticmethod
    def _sample_delta(seq: Sequence, want_lp: bool) -> SampleDelta:
        """A sample's tokens (and logprobs) since its last output; counts them as sent."""
        end = len(seq.token_ids) - seq.num_placeholders  # placeholders: not tokens yet
        sent, seq.sent_tokens = seq.sent_tokens, end - seq.num_prompt_tokens
        return SampleDelta(
            seq.index, seq.token_ids[seq.num_prompt_tokens + sent : end],
            seq.logprobs[sent:] if want_lp else None, None, seq.finish_reason, seq.stop_reason,
        )  # fmt: skip

    def _prompt_logprobs_output(self, req: Request) -> list[RawLogprobs | None] | None:
        """Per prompt position: ``None`` for position 0, then ``(token_id, logprob, rank)`` of the
        prompt token and the top k (the frontend names them). Built for the request's first core
        output (outputs start after the whole prompt has run)."""
        store = req.prompt_logprobs
        if store is None or any(e is None for e in store[1:]):  # none, or aborted mid-prompt
            return None
        k = req.params.prompt_logprobs or 0  # kept blocks may hold more than this request's k
        result: list[RawLogprobs | None] = [None]
        for tok, e in zip(req.prompt_token_ids[1:], store[1:]):
            top = zip(e.top_ids[:k], e.top_logprobs[:k])
            result.append([(tok, e.logprob, e.rank), *((t, v, rank) for rank, (t, v) in enumerate(top, 1))])
        return result

    def _release_sync(self, req: Request) -> None:
        """``req`` no longer needs steps run one at a time (an n > 1 request once forked)."""
        if req.holds_sync and not _needs_sync(req):
            req.holds_sync = False
            self._num_sync_requests -= 1

    def _finish_request(self, req: Request) -> EngineCoreOutput:
        req.finished_time = time.monotonic()
        if self.requests.pop(req.request_id, None) is not None:
            self._num_sync_requests -= req.holds_sync
            req.holds_sync = False
            self._num_host_readers -= req.reads_host
            req.reads_host = False
            self._num_prompt_logprobs -= req.prompt_logprobs is not None
            self._num_embeds -= req.params.embed
            if not self.requests:  # the step in flight has only ended sequences left: nothing to read
                self._inflight = None
        for seq in req.sequences:  # ended with a step in flight (async scheduling): not tokens
            if seq.num_placeholders:
                del seq.token_ids[-seq.num_placeholders :]
                seq.num_placeholders = 0
        if req.adapter_entry is not None:
            self.registry.release(req.adapter_entry)
            req.adapter_entry = None
            self._num_adapter_requests -= 1
            if req.adapter_name not in self.registry:  # unloaded while it ran (unload_adapter)
                self.adapter_tokens.pop(req.adapter_name, None)
        return self._core_output(req, finished=True)

    def close(self) -> None:
        """Drop the weights, adapter slots and KV cache (a rebuilt engine replaces this one).
        Request bookkeeping stays readable; stepping a closed engine raises."""
        with self.lock:
            self._inflight = None
            for name in ("runner", "model", "lora_state"):
                self.__dict__.pop(name, None)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---- introspection ------------------------------------------------------------------------
    def kv_cache_usage(self) -> KVCacheUsage:
        with self.lock:
            return self.block_manager.usage(self.scheduler.all_sequences())

    def stats(self) -> EngineStats:
        with self.lock:
            sched = self.scheduler
            bm = self.block_manager
            adapters: dict[str, dict[str, int]] = {}
            # As vLLM counts: each of an n > 1 request's samples is a request of its own (vLLM adds
            # n child requests to its core), so the gauges that gateways route on weigh its load;
            # one not forked yet (waiting, prefilling) counts n. A beam is one, as vLLM's beam
            # search runs each beam as a request.
            counts = {"running": 0, "waiting": 0}
            for state, seqs in (("running", sched.running), ("waiting", sched.waiting)):
                for seq in seqs:
                    req = seq.request
                    k = req.params.n if req.beam is None and not req.forked else 1
                    counts[state] += k
                    if req.adapter_name is not None:
                        d = adapters.setdefault(req.adapter_name, {"running": 0, "waiting": 0})
                        d[state] += k
            return EngineStats(
                num_running=counts["running"],
                num_waiting=counts["waiting"],
                kv_cache_usage=bm.num_used_blocks / bm.num_blocks,
                num_blocks=bm.num_blocks,
                num_used_blocks=bm.num_used_blocks,
                num_preemptions=sched.stats.num_preemptions,
                prefix_cache_queries=sched.stats.prefix_queries,
                prefix_cache_hits=sched.stats.prefix_hits,
                prompt_tokens_total=self.prompt_tokens_total,
                generation_tokens_total=self.generation_tokens_total,
                max_loras=self.config.max_loras,
                adapters=adapters,
                adapter_generation_tokens=dict(self.adapter_tokens),
                adapter_tiers=self.registry.tiers(),
                block_size=bm.block_size,
                cache_dtype=self.config.kv_cache_dtype,
                enable_prefix_caching=bm.enable_prefix_caching,
                iteration_tokens=self.iteration_tokens.snapshot(),
                spec_decode=self.spec_stats.snapshot() if self.speculative is not None else None,
            )

    def check_invariants(self) -> None:
        """Raise if block refcounts, adapter refcounts, the runner's persistent block-table rows or
        the count of requests that hold steps synchronous are inconsistent (tests call this)."""
        with self.lock:
            holding = sum(r.holds_sync for r in self.requests.values())
            if holding != self._num_sync_requests:
                raise AssertionError(f"{self._num_sync_requests} sync requests counted, {holding} live")
            reading = sum(r.reads_host for r in self.requests.values())
            if reading != self._num_host_readers:
                raise AssertionError(
                    f"{self._num_host_readers} host-reading requests counted, {reading} live"
                )
            scoring = sum(r.prompt_logprobs is not None for r in self.requests.values())
            if scoring != self._num_prompt_logprobs:
                raise AssertionError(
                    f"{self._num_prompt_logprobs} prompt-logprob requests counted, {scoring} live"
                )
            embeds = sum(r.params.embed for r in self.requests.values())
            if embeds != self._num_embeds:
                raise AssertionError(f"{self._num_embeds} embedding requests counted, {embeds} live")
            adapted = sum(r.adapter_entry is not None for r in self.requests.values())
            if adapted != self._num_adapter_requests:
                raise AssertionError(f"{self._num_adapter_requests} adapter requests counted, {adapted} live")
            self.block_manager.check_invariants(self.scheduler.all_sequences())
            bs = self.block_manager.block_size
            for seq in self.scheduler.all_sequences():
                if seq.num_draft_tokens:
                    raise AssertionError(f"seq {seq.seq_id} holds drafts between steps")
                if len(seq.block_table) > -(-seq.num_tokens // bs):
                    raise AssertionError(f"seq {seq.seq_id} holds blocks past its tokens")
            self.registry.check_invariants()
            if "runner" in self.__dict__:
                self.runner.batch.check(self.scheduler.all_sequences())


def aborted_samples(
    params: SamplingParams, have: set[int] | frozenset[int] = frozenset()
) -> list[SampleDelta]:
    """The ``n`` samples (less those in ``have``) of a request aborted before they forked or ran:
    no tokens, finish_reason "abort" (empty logprobs where asked for)."""
    lps: list[Any] | None = [] if params.logprobs is not None else None
    return [SampleDelta(k, [], lps, None, "abort") for k in range(params.n) if k not in have]


def _metrics(req: Request) -> RequestMetrics:
    return RequestMetrics(
        req.arrival_time,
        req.first_scheduled_time,
        req.first_token_time,
        req.last_token_time,
        req.finished_time,
    )


def _eos_ids(model_dir: Path, tokenizer_eos: Callable[[], int | None]) -> tuple[int, ...]:
    """``generation_config.json``'s EOS ids, else the tokenizer's (``tokenizer_eos``, called only then)."""
    import json

    ids: list[int] = []
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        e = json.loads(gen.read_text()).get("eos_token_id")
        ids.extend(e if isinstance(e, list) else [e] if e is not None else [])
    if not ids and (eos := tokenizer_eos()) is not None:
        ids.append(eos)
    return tuple(dict.fromkeys(int(i) for i in ids))
