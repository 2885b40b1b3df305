"""EngineConfig: the one validated set of engine settings."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_DEVICES = ("auto", "cpu", "cuda")
_DTYPES = ("auto", "float32", "float16", "bfloat16")
_DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's --dtype choices
_KV_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
_QUANT = (None, "awq", "gptq", "fp8", "int8", "compressed-tensors")
_EMBED_QUANT = (None, "int8")
_CPU_GEMM = ("auto", "torch", "onednn")
_CPU_KERNELS = ("auto", "torch", "native")
_SPEC_METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``--speculative-config``): each step a sequence also runs the
    tokens a proposer drafts, and keeps those the model would have produced itself, plus one more.
    Outputs are the same as without it: greedy token for token (near ties excepted: a draft is
    verified in a multi-token pass), sampled ones in distribution."""

    method: str = "ngram"
    """``"ngram"`` (prompt lookup): the tokens that followed the latest n-gram's earliest earlier
    occurrence in the prompt and output (vLLM's rule). No draft model to load."""

    num_speculative_tokens: int = 4
    """Most tokens drafted per sequence and step."""

    prompt_lookup_max: int = 5
    """Longest n-gram matched (the longest match wins)."""

    prompt_lookup_min: int = 5
    """Shortest n-gram matched."""

    disable_by_batch_size: int | None = None
    """No drafts in a step that runs at least this many sequences (vLLM's v0 option): a batch large
    enough to make a step compute-bound gains nothing from them (on 2 CPU cores, 8 sequences;
    ``benchmarks/spec_decode.py``). ``None``: always draft."""

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpeculativeConfig:
        """vLLM's JSON keys; a missing lookup bound takes the other's value, both missing are 5
        (vLLM's defaults). ``ValueError`` names a bad key or value."""
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict (vLLM's JSON), got {d!r}")
        d = dict(d)
        if d.get("model") in ("ngram", "[ngram]"):  # vLLM's older spelling of the method
            d.setdefault("method", "ngram")
            del d["model"]
        known = {
            "method",
            "num_speculative_tokens",
            "prompt_lookup_max",
            "prompt_lookup_min",
            "disable_by_batch_size",
        }
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(
                f"speculative_config: unsupported key(s) {', '.join(unknown)} (lorastar drafts with "
                "method 'ngram': num_speculative_tokens, prompt_lookup_max, prompt_lookup_min, "
                "disable_by_batch_size)"
            )
        method = d.get("method", "ngram")
        if method == "[ngram]":
            method = "ngram"
        if "num_speculative_tokens" not in d:
            raise ValueError("speculative_config: num_speculative_tokens is required")
        lo, hi = d.get("prompt_lookup_min"), d.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = 5
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        return cls(method, d["num_speculative_tokens"], hi, lo, d.get("disable_by_batch_size"))  # type: ignore[arg-type]

    def __post_init__(self) -> None:
        if self.method not in _SPEC_METHODS:
            raise ValueError(
                f"speculative_config: method must be one of {_SPEC_METHODS} (draft models, EAGLE and "
                f"MTP are not supported), got {self.method!r}"
            )
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config: {name} must be a positive integer, got {v!r}")
        b = self.disable_by_batch_size
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 1):
            raise ValueError(
                f"speculative_config: disable_by_batch_size must be a positive integer, got {b!r}"
            )
        if self.num_speculative_tokens > 64:
            raise ValueError(
                f"speculative_config: num_speculative_tokens must be at most 64, got {self.num_speculative_tokens}"
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )


@dataclass
class EngineConfig:
    """Everything the engine needs to start. Invalid values raise ``ValueError`` naming the field."""

    model: str | None = None
    """HF folder (config.json + safetensors + tokenizer). ``None`` uses the embedded SmolLM2-135M-Instruct."""

    device: str = "auto"
    """``"auto"`` (CUDA when present, else CPU), ``"cpu"`` or ``"cuda"``."""

    dtype: Any = "auto"
    """``"auto"`` (the checkpoint's dtype on GPU, bfloat16 for a float32 one; float32 on CPU),
    ``"float32"``, ``"float16"``, ``"bfloat16"`` or a ``torch.dtype``; vLLM's ``"half"`` and
    ``"float"`` are read as float16 and float32."""

    block_size: int = 16
    """Tokens per KV cache block."""

    max_num_seqs: int = 64
    """Most sequences in one engine step."""

    max_num_batched_tokens: int | None = None
    """Token budget of one step (decodes first, then prefill chunks). ``None``: max(2048, block_size)."""

    max_model_len: int | None = None
    """Longest prompt + output. ``None``: the model's ``max_position_embeddings`` (capped at 8192)."""

    num_kv_blocks: int | None = None
    """KV blocks to allocate. ``None``: sized from ``kv_cache_memory`` / GPU free memory."""

    kv_cache_memory: int | None = None
    """Bytes for the KV cache when ``num_kv_blocks`` is unset. ``None``: 1 GiB on CPU; on GPU 80% of
    the free memory, torch's cached-but-unused bytes counted as free (at most the driver's free)."""

    gpu_memory_utilization: float | None = None
    """vLLM's ``--gpu-memory-utilization``: the fraction of the GPU's total memory the device may hold
    in all once the KV cache is allocated. The cache gets 80% of what that fraction leaves after the
    weights (the rest: activations, as in the default), at most the driver's free bytes. ``None``:
    ``kv_cache_memory``'s default. Ignored on CPU (with a warning: use ``kv_cache_memory``)."""

    kv_cache_dtype: str = "auto"
    """``"auto"`` (the model dtype), ``"fp8"`` (e4m3) or ``"fp8_e5m2"``. FP8 uses the checkpoint's
    per-layer K/V scales, else scales computed at load from one calibration forward."""

    quantization: str | None = None
    """``None`` reads the checkpoint's ``quantization_config``; ``"awq"``/``"gptq"``/``"compressed-tensors"``
    (FP8 or int4/int8 weight-only, vLLM's name) check it;
    ``"fp8"`` quantizes a 16-bit checkpoint at load time (or checks an FP8 one); ``"int8"`` (CPU)
    quantizes its linears to per-channel int8 at load, activations per token at run time (W8A8:
    1.4-1.7x the fp32 GEMM, a quarter of the weight bytes; ``quant/int8.py``)."""

    cpu_gemm: str = "auto"
    """GEMM for fp32 linears and the lm_head on CPU, and bf16 ones where the CPU has bf16 arithmetic
    (AVX512-BF16, AMX): ``"onednn"`` (weights prepacked once at load; 2-3x torch's default on
    SmolLM2's fp32 shapes, see ``layers/cpu_gemm.py``), ``"torch"`` (``F.linear``),
    or ``"auto"``: both timed at load on the model's largest linear, oneDNN kept unless torch's is
    clearly faster (a margin, so the choice, and with it the logits' last bits, is the same on every
    start)."""

    cpu_kernels: str = "auto"
    """Decode attention, decode-row LoRA, RMSNorm, the gated activation and rotary of fp32 and bf16
    models on CPU: ``"native"`` (small C++ ops, built once per machine with g++ and ninja, ~30 s, then cached:
    attention reads K/V straight from the paged cache, LoRA reads each adapter at its true rank, the
    elementwise steps are one pass each; ``kernels/cpu_native.py``), ``"torch"`` (blocks gathered
    then SDPA; LoRA as bmm over a slot grid; torch's composite norm, activation and rotary), or
    ``"auto"``: native where it builds, torch otherwise."""

    tune_malloc: bool = True
    """On CPU (Linux, glibc): ask malloc to keep freed memory for reuse (``mallopt`` mmap and trim
    thresholds of 1 GiB) instead of unmapping it on every free. A step's large buffers (the logits
    of 256 rows x 49,152 tokens are 50 MB) were otherwise mapped and page-faulted anew every step:
    SmolLM2 offline (2 threads, 128+64 tokens) 299 -> 359 tok/s at 32 requests, 345 -> 376 at 64,
    no change at 1 and 4 (engine/host_memory.py). Process-wide and kept until exit (the heap holds
    on to its peak); ``False`` leaves malloc alone."""

    embedding_quantization: str | None = None
    """``None`` keeps the token embedding and lm_head as loaded (16-bit, as AWQ/GPTQ checkpoints store
    them); ``"int8"`` quantizes them per row after loading (one shared table when tied), about half
    the bytes of bf16. Works with or without ``quantization``."""

    max_loras: int = 8
    """Distinct adapters in one step (device slots)."""

    max_lora_rank: int = 64
    """Largest adapter rank accepted."""

    max_cpu_loras: int | None = None
    """Adapters kept in host memory (LRU beyond that, reloaded from disk on demand). ``None`` (the
    default): 64, or ``max_loras`` where that is more (as ``lorastar serve``; it must be at least
    ``max_loras``)."""

    enable_prefix_caching: bool = True
    """Share the KV blocks of identical prompt prefixes (hash chain of tokens + adapter content)."""

    enforce_eager: bool = False
    """Run every step eagerly. ``False``: on CUDA, decode steps of up to ``min(max_num_seqs, 256)``
    sequences replay captured CUDA graphs (at small batches kernel launches, not the GPU, set the
    step time); captured lazily per padded batch size."""

    async_scheduling: bool | None = None
    """Schedule and launch step N+1 before reading step N's sampled tokens back (vLLM's
    ``--async-scheduling``, mini-sglang's overlap loop): N+1's input ids are taken from N's
    sampled ids on the device, and N's outputs are built while the device runs N+1, so on a GPU
    the host's output processing and scheduling overlap the forward. Outputs are the same as
    without it (greedy and seeded sampling token for token); a sequence that ends at step N has
    one extra token computed and dropped. While any live request uses beam search or prompt
    logprobs, or an ``n > 1`` request has not forked its samples yet, steps run one at a time
    (they fork or read on the host); penalties count the previous token on the device; requests
    whose sampling reads the output on the host (a grammar, guided_choice, a bad word of several
    tokens, a thinking budget) complete the step in flight between the forward and sampling. On a CPU
    nothing overlaps (a step runs in the calling thread). ``None`` (default): on for CUDA, off
    elsewhere; measured on an H200 (1.1B Llama, bf16, 128+64 tokens) at 1.02x / 1.30x / 1.42x the
    tokens/s of one-at-a-time steps for 1 / 16 / 64 requests, 1.26x / 1.20x / 1.32x with 16
    adapters (README, GPU)."""

    speculative_config: SpeculativeConfig | dict[str, Any] | None = None
    """Speculative decoding, as vLLM's JSON (``{"method": "ngram", "num_speculative_tokens": 4,
    "prompt_lookup_max": 4}``; see ``SpeculativeConfig``), read into a ``SpeculativeConfig``.
    ``None``: off. Beam searches draft nothing; every other request does, each drafted position
    reading the output up to itself (penalties, ``min_tokens``, bad words), a grammar's matcher or
    a thinking budget stepping through the drafts and rolled back after sampling; drafts a grammar,
    choice or spent budget refuses are cut before the step. Steps run one at a time (no
    ``async_scheduling``)."""

    seed: int = 0
    """Seed of the sampler's default generator (requests with their own ``seed`` use their own)."""

    max_waiting: int | None = None
    """Most requests queued and not yet started; past it new requests are refused with
    ``EngineOverloadedError`` (the server answers 503 + ``Retry-After``). Preempted sequences of
    admitted requests do not count. ``None``: unbounded (offline ``LLM.generate`` queues all its
    prompts at once); the plugin defaults to 256."""

    scheduling_policy: str = "fcfs"
    """Order of the waiting queue and of preemption (vLLM's ``--scheduling-policy``). ``"fcfs"``:
    first come, first served; a request's ``priority`` must be 0. ``"priority"``: by each request's
    ``priority`` (lower first; default 0), then arrival: running requests take each step's token
    budget in that order, the waiting queue is admitted in it, and the lowest-priority request
    is the one preempted when KV blocks run out; a waiting request that finds every
    ``max_num_seqs`` seat taken preempts running ones of a strictly lower priority to get in
    (vLLM v1 waits for a seat: its issue #40004). Equal priorities never preempt each other; beam
    searches neither take seats this way nor give theirs."""

    max_n: int = 128
    """Largest ``n`` (samples, or beams with ``use_beam_search``) of one request. A beam search
    whose beams cannot all fit the KV cache at once is refused whatever this says."""

    max_stop_strings: int = 64
    """Most ``stop`` strings in one request (each is matched against new text every step)."""

    max_stop_string_length: int = 256
    """Longest ``stop`` string, in characters."""

    max_stop_token_ids: int = 256
    """Most ``stop_token_ids`` in one request."""

    max_logprobs: int = 20
    """Most top logprobs a request may ask for, per generated token (``logprobs``, chat's
    ``top_logprobs``) and per prompt position (``prompt_logprobs``); more is refused with a 400
    naming the field. vLLM's ``--max-logprobs`` and its default, OpenAI's cap; ``-1``: no cap
    (the vocabulary's size: a distillation run reading a teacher's top 100, say). A request's
    ``-1`` (vLLM's) asks for the whole vocabulary. Each returned logprob costs the response about
    40 bytes of JSON and the engine about 70 bytes while it is built: ``prompt_logprobs=-1`` on a
    1,000-token prompt is 49 million of them, so an uncapped server trusts its clients (as vLLM
    warns of its -1). Kept prompt logprobs (for the prefix cache) are bounded whatever the cap."""

    max_logit_bias: int = 1024
    """Most ``logit_bias`` entries in one request. Every step adds each of a request's entries to
    each of its rows (n of them). SmolLM2, CPU, n = 128, per step: 220-244 ms plain; with a
    whole-vocabulary bias 2254-2285 ms while the bias was added entry by entry in Python, 254-277
    ms now that it is kept as arrays; with 1024 entries 236-238 ms."""

    max_bad_words: int = 256
    """Most ``bad_words`` in one request. Each is tokenized once; a step looks up only the words
    that could end at a row's next token, so their number costs memory, not time per step."""

    max_guided_choices: int = 256
    """Most ``guided_choice`` strings in one request (each is tokenized when the request is added)."""

    max_prompt_bytes: int | None = None
    """Largest text prompt (UTF-8 bytes; chat: all message contents together), checked before
    tokenizing. ``None``: 64 bytes per token of ``max_model_len``, far above real text."""

    tokenizer: str | None = None
    """Tokenizer folder. ``None``: the model's own."""

    revision: str | None = None
    """Branch, tag or commit of a ``model`` given as a Hugging Face id (vLLM's ``--revision``): pins
    what a production server loads. ``None``: the default branch. Ignored for a local folder."""

    download_dir: str | None = None
    """Folder that a ``model``, ``tokenizer`` or adapter given as a Hugging Face id downloads to and
    is looked up in (vLLM's ``--download-dir``: a volume of its own, say). ``None``: the Hugging
    Face cache (``HF_HOME`` / ``HF_HUB_CACHE``)."""

    tokenizer_revision: str | None = None
    """Branch, tag or commit of a ``tokenizer`` given as a Hugging Face id (vLLM's
    ``--tokenizer-revision``). ``None``: the default branch."""

    chat_template: str | None = None
    """Jinja chat template replacing the tokenizer's, or a file holding one (read here, as vLLM's
    ``--chat-template``). ``None``: the tokenizer's own."""

    generation_config: str = "auto"
    """Sampling defaults for requests that leave them unset (vLLM's ``--generation-config``):
    ``"auto"``, the model's ``generation_config.json`` (temperature, top_p, top_k, min_p,
    repetition_penalty; ``max_new_tokens`` caps ``max_tokens``); ``"vllm"``, none (OpenAI's
    neutral values); or a folder holding a ``generation_config.json``."""

    override_generation_config: dict[str, Any] | None = None
    """Sampling defaults set over ``generation_config``'s (vLLM's ``--override-generation-config``),
    e.g. ``{"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 512}``: a request that leaves one
    unset gets it. Keys as in ``generation_config.json``: temperature, top_p, top_k, min_p,
    repetition_penalty, max_new_tokens; with ``generation_config="vllm"`` they are the only
    defaults. A key or value a request could not use is refused when the engine starts."""

    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form options for experiments (ignored by the engine core)."""

    def __post_init__(self) -> None:
        if isinstance(self.dtype, str) and self.dtype in _DTYPE_ALIASES:  # vLLM's --dtype names too
            self.dtype = _DTYPE_ALIASES[self.dtype]
        if (
            self.max_cpu_loras is None
            and isinstance(self.max_loras, int)
            and not isinstance(self.max_loras, bool)
        ):
            self.max_cpu_loras = max(64, self.max_loras)  # (max_loras=100 alone used to be refused)
        if isinstance(self.speculative_config, dict):
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        if isinstance(self.chat_template, (str, os.PathLike)) and "{" not in str(self.chat_template):
            # vLLM's --chat-template: a file, else the template itself (a path was used as the text)
            path = Path(self.chat_template).expanduser()
            try:
                is_file = path.is_file()
            except (OSError, ValueError):  # e.g. "File name too long": validate() names it
                is_file = False
            if is_file:
                try:
                    self.chat_template = path.read_text(encoding="utf-8")
                except (OSError, UnicodeDecodeError) as exc:
                    raise ValueError(f"chat_template: cannot read {str(path)!r}: {exc}") from exc
        self.validate()

    def validate(self) -> None:
        if self.device not in _DEVICES:
            raise ValueError(f"device must be one of {_DEVICES}, got {self.device!r}")
        is_torch_dtype = f"{type(self.dtype).__module__}.{type(self.dtype).__qualname__}" == "torch.dtype"
        if self.dtype not in _DTYPES if isinstance(self.dtype, str) else not is_torch_dtype:
            raise ValueError(f"dtype must be one of {_DTYPES} or a torch.dtype, got {self.dtype!r}")
        if self.kv_cache_dtype not in _KV_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {_KV_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.quantization not in _QUANT:
            raise ValueError(f"quantization must be one of {_QUANT}, got {self.quantization!r}")
        if self.cpu_gemm not in _CPU_GEMM:
            raise ValueError(f"cpu_gemm must be one of {_CPU_GEMM}, got {self.cpu_gemm!r}")
        if self.cpu_kernels not in _CPU_KERNELS:
            raise ValueError(f"cpu_kernels must be one of {_CPU_KERNELS}, got {self.cpu_kernels!r}")
        if self.embedding_quantization not in _EMBED_QUANT:
            raise ValueError(
                f"embedding_quantization must be one of {_EMBED_QUANT}, got {self.embedding_quantization!r}"
            )
        for name in ("enable_prefix_caching", "enforce_eager", "tune_malloc"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be a bool or None, got {self.async_scheduling!r}")
        for name in (
            "block_size",
            "max_num_seqs",
            "max_loras",
            "max_lora_rank",
            "max_cpu_loras",
            "max_n",
            "max_stop_strings",
            "max_stop_string_length",
            "max_stop_token_ids",
            "max_logit_bias",
            "max_bad_words",
            "max_guided_choices",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name in (
            "max_num_batched_tokens",
            "max_model_len",
            "num_kv_blocks",
            "kv_cache_memory",
            "max_waiting",
            "max_prompt_bytes",
        ):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {v!r}")
        m = self.max_logprobs
        if not isinstance(m, int) or isinstance(m, bool) or m < -1:
            raise ValueError(f"max_logprobs must be -1 (no cap) or an integer >= 0, got {m!r}")
        u = self.gpu_memory_utilization
        if u is not None and (isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {u!r}")
        if self.chat_template is not None and (
            not isinstance(self.chat_template, str) or "{" not in self.chat_template
        ):
            raise ValueError(
                f"chat_template must be a Jinja template or a file holding one, got {self.chat_template!r}"
            )
        if not isinstance(self.generation_config, str) or not (
            self.generation_config in ("auto", "vllm") or Path(self.generation_config).expanduser().is_dir()
        ):
            raise ValueError(
                f"generation_config must be 'auto', 'vllm' or a folder, got {self.generation_config!r}"
            )
        if self.download_dir is not None:
            if not isinstance(self.download_dir, str | os.PathLike) or not str(self.download_dir):
                raise ValueError(f"download_dir must be a folder path or None, got {self.download_dir!r}")
            self.download_dir = os.fspath(self.download_dir)
            folder = Path(self.download_dir).expanduser()
            if folder.exists() and not folder.is_dir():
                raise ValueError(f"download_dir {self.download_dir!r} exists and is not a folder")
        if self.override_generation_config is not None and not isinstance(
            self.override_generation_config, dict
        ):
            raise ValueError(
                "override_generation_config must be a dict such as {'temperature': 0.6}, "
                f"got {self.override_generation_config!r}"
            )
        if self.speculative_config is not None and not isinstance(self.speculative_config, SpeculativeConfig):
            raise ValueError(
                f"speculative_config must be a dict or a SpeculativeConfig, got {self.speculative_config!r}"
            )
        if self.speculative_config is not None and self.async_scheduling is True:
            # refused here, as vLLM's config does (the CLI's usage error, not a failed engine start)
            raise ValueError("speculative_config and async_scheduling cannot be combined yet")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}"
            )
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        # torch's Generator.manual_seed takes [-2**63, 2**64): anything else failed after the model load
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")

    @classmethod
    def given(cls, config: EngineConfig | None, **kwargs: Any) -> EngineConfig:
        """``config``, else one built from engine options ``kwargs``; both: a ValueError (the
        options would be ignored)."""
        if config is None:
            return cls.from_kwargs(**kwargs)
        if kwargs:
            raise ValueError(f"give config or engine options ({', '.join(sorted(kwargs))}), not both")
        return config

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(**kwargs)
