"""Scheduling never changes what a request outputs on a quantized base or an FP8 KV cache either:
AWQ / GPTQ (act-order, 8-bit) / FP8 checkpoints, int8 and FP8 quantized at load, and FP8 caches
with the checkpoint's K/V scales or scales calibrated at load, with and without adapters, give the
same completions on a roomy engine without prefix caching and on tight ones (chunked prefills,
preemption by recompute, prefix-cache hits, async scheduling); an abort mid-way leaves the others
alone and nothing leaks. The CPU prefill of a whole prompt used to attend over its unquantized K/V
while a chunk after cached context (a prefix hit, a chunked or recomputed prompt) and every later
token read the FP8 cache: the same prompt gave different logprobs, and tokens at near ties, by
schedule (vLLM and the Triton path read the cache for every row)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from quant_fixtures import fixture_dir, have_fixture, read_config
from safetensors.torch import save_file

from lorastar import LLM, SamplingParams
from lorastar.engine.engine import LLMEngine
from lorastar.forward_context import ForwardContext
from lorastar.kernels.paged_attention import reshape_and_cache
from lorastar.layers.attention import attention_forward, build_attention_metadata
from tests.conftest import make_peft_adapter
from tests.engine.test_schedule_invariance_review import _run, _same
from tests.layers.test_attention_backends import padded_block_tables, paged_layout

_V = 380  # token ids below every base's vocabulary (the quant fixtures have 384)
_SHARED = [(7 * i + 11) % _V + 3 for i in range(9)]


def _prompt(n: int, k: int) -> list[int]:
    return [(31 * i + 17 * k) % _V + 3 for i in range(n)]


# (prompt, params, adapter): each fits the tight cache (10 blocks of 4) alone; two share a prefix.
_REQS: list[tuple[list[int], SamplingParams, str | None]] = [
    (_SHARED + _prompt(13, 0), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2), None),
    (_prompt(18, 1), SamplingParams(temperature=0.9, seed=5, max_tokens=7, ignore_eos=True, logprobs=1), "a0"),
    (_SHARED + _prompt(3, 2), SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=5, ignore_eos=True), None),
    (_prompt(9, 3), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=1), "a1"),
    (_SHARED + _prompt(13, 0), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0), None),
]  # fmt: skip
_ROOMY: dict[str, Any] = dict(
    num_kv_blocks=128, block_size=4, max_num_batched_tokens=256, max_num_seqs=16, enable_prefix_caching=False
)
_TIGHT: dict[str, Any] = dict(
    num_kv_blocks=10, block_size=4, max_num_batched_tokens=8, max_num_seqs=3, max_loras=1
)
_ASYNC: dict[str, Any] = {**_TIGHT, "max_num_batched_tokens": 7, "max_loras": 2, "async_scheduling": True}
# base -> (model folder or tiny-model name, engine options)
_BASES: dict[str, tuple[str, dict[str, Any]]] = {
    "awq_g32": ("awq_g32", {}),
    "gptq_act": ("gptq_act", {}),
    "gptq_8bit+kv-fp8-calibrated": ("gptq_8bit", {"kv_cache_dtype": "fp8"}),
    "fp8_tensor+kv-e5m2": ("fp8_tensor", {"kv_cache_dtype": "fp8_e5m2"}),
    "fp8_kv+kv-fp8-checkpoint-scales": ("fp8_kv", {"kv_cache_dtype": "fp8"}),
    "int8-on-the-fly+kv-fp8": ("tiny:llama-gqa", {"quantization": "int8", "kv_cache_dtype": "fp8"}),
    "fp8-on-the-fly": ("tiny:llama-gqa", {"quantization": "fp8"}),
}


def _write_adapter(base: str, out: Path, seed: int, r: int) -> str:
    """A PEFT LoRA folder (q/v/down) for a quant fixture, written directly (PEFT would need the
    quantization library to load the base)."""
    cfg = read_config(base)
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    shapes = {"self_attn.q_proj": (h, cfg["num_attention_heads"] * d),
              "self_attn.v_proj": (h, cfg["num_key_value_heads"] * d), "mlp.down_proj": (inter, h)}  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for mod, (fan_in, fan_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{mod}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, fan_in, generator=g) * 0.3
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, r, generator=g) * 0.3
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": 2 * r, "lora_dropout": 0.0,
        "bias": "none", "target_modules": ["q_proj", "v_proj", "down_proj"],
    }))  # fmt: skip
    return str(out)


@pytest.fixture(scope="module")
def bases(tiny_model_dir, tmp_path_factory) -> dict[str, tuple[str, dict[str, str]]]:  # noqa: ANN001
    """base -> (model folder, {adapter name: folder}), made on first use."""
    root = Path(tmp_path_factory.mktemp("quant-schedule-adapters"))
    made: dict[str, tuple[str, dict[str, str]]] = {}

    class Lazy(dict):
        def __missing__(self, key: str) -> tuple[str, dict[str, str]]:
            src = _BASES[key][0]
            if src not in made:
                out = root / src.replace(":", "-")
                if src.startswith("tiny:"):
                    path = tiny_model_dir(src.removeprefix("tiny:"))
                    ads = {
                        f"a{k}": make_peft_adapter(path, out / f"a{k}", k, r=4 * (k + 1)) for k in range(2)
                    }
                else:
                    path = str(fixture_dir(src))
                    ads = {f"a{k}": _write_adapter(src, out / f"a{k}", k, 4 * (k + 1)) for k in range(2)}
                made[src] = (path, ads)
            return made[src]

    return Lazy()


def _engine(model: tuple[str, dict[str, str]], opts: dict[str, Any], cfg: dict[str, Any]) -> LLMEngine:
    path, adapters = model
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=64, max_lora_rank=8, **opts, **cfg)
    for name, folder in adapters.items():
        llm.load_adapter(name, folder)
    return llm.engine


def _available(name: str) -> bool:
    src = _BASES[name][0]
    return src.startswith("tiny:") or have_fixture(src)


_CASES = [n for n in _BASES if _available(n)]


@pytest.mark.parametrize("name", _CASES)
def test_quantized_outputs_do_not_depend_on_the_schedule(bases, name: str) -> None:  # noqa: ANN001
    """The roomy engine (no prefix cache: every prompt cold, in one chunk) and a tight one
    (chunked prefills, preemption, prefix-cache hits; async scheduling for the FP8-cache bases)
    give the same completions, logprobs and prompt logprobs."""
    opts = _BASES[name][1]
    ref = _run(_engine(bases[name], opts, _ROOMY), _REQS)
    engine = _engine(bases[name], opts, _ASYNC if "kv_cache_dtype" in opts else _TIGHT)
    outs = _run(engine, _REQS)
    assert engine.scheduler.stats.num_preemptions > 0 and engine.scheduler.stats.prefix_hits > 0
    # e5m2 keeps 2 mantissa bits: a K/V element whose float value differs by noise between the
    # schedules (GEMMs over other row counts) can round to the neighbouring e5m2 value, 25% away,
    # and move later logprobs by ~1e-2 (0.0082 on an AVX-512 Xeon, tokens equal; the e4m3 caches
    # there: 2e-6). The bug this guards against (a prefill over unquantized K/V) is not that.
    tol = 2e-2 if "e5m2" in name else 2e-3
    for a, b in zip(ref, outs):
        _same(a, b, tol=tol)


@pytest.mark.skipif("fp8_kv+kv-fp8-checkpoint-scales" not in _CASES, reason="fp8_kv fixture missing")
def test_fp8_cache_aborts_mid_prefill_or_preempted_leave_others_alone(bases) -> None:  # noqa: ANN001
    """Aborting a preempted request, or one part-way through its chunked prefill, on an FP8 cache
    with checkpoint scales: the others' outputs are the roomy engine's and nothing leaks."""
    name = "fp8_kv+kv-fp8-checkpoint-scales"
    opts = _BASES[name][1]
    ref = _run(_engine(bases[name], opts, _ROOMY), _REQS)
    for victim, step, state in ((1, 6, "preempted"), (4, 18, "chunked")):
        outs = _run(_engine(bases[name], opts, _TIGHT), _REQS, abort=(victim, step, state))
        for i, (a, b) in enumerate(zip(ref, outs)):
            if i != victim:
                _same(a, b)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_cpu_fp8_prefill_attends_over_what_the_cache_holds(cache_dtype: torch.dtype) -> None:
    """A whole-prompt prefill on CPU gives the rows that a chunk after the same cached context
    gives (both attend over the FP8 cache's values, as the Triton kernel does)."""
    gen = torch.Generator().manual_seed(3)
    hq, hkv, d, n = 4, 2, 16, 9
    q, k, v = (torch.randn(n, h, d, generator=gen) * 3 for h in (hq, hkv, hkv))
    outs = []
    for seqs in ([(0, n)], [(5, n - 5)]):  # one chunk; 5 tokens cached, then the rest
        tables, slots, q_lens, seq_lens, nblk = paged_layout(seqs)
        caches = [
            (torch.zeros(nblk, 4, hkv, d).to(cache_dtype), torch.zeros(nblk, 4, hkv, d).to(cache_dtype))
        ]
        ctx_slots = [tables[0][p // 4] * 4 + p % 4 for p in range(seqs[0][0])]
        reshape_and_cache(k[: seqs[0][0]], v[: seqs[0][0]], *caches[0], torch.tensor(ctx_slots), 0.5, 0.25)
        md = build_attention_metadata(
            slots, q_lens, seq_lens, padded_block_tables(tables), block_size=4, device=torch.device("cpu")
        )
        ctx = ForwardContext(attn=md, kv_caches=caches, k_scales=[0.5], v_scales=[0.25])
        lo = seqs[0][0]
        outs.append(attention_forward(q[lo:], k[lo:], v[lo:], ctx, 0, d**-0.5)[-(n - 5) :])
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
