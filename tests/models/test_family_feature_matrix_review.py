"""Engine features on the non-Llama families, against transformers (base) and PEFT (adapters), greedy
token for token: prompts longer than the sliding window through a tiny chunked-prefill budget (chunks
cross the window mid-chunk), prefix-cache hits of such prompts, preemption under a small KV pool, two
adapters on every target (Phi-3's fused ones) in one batch, beam search and n > 1 (copy-on-write over
a table with released blocks), an FP8 KV cache (against transformers with K/V rounded through the same
scales), on-the-fly FP8 weights on Phi-3's fused modules and Gemma's int8 tied embedding (against
transformers computing the same scheme), Phi-3 with a sliding window, and prefix-cache hits of a long
prompt once its blocks behind the window are evicted."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import DynamicCache

from lorastar import LLM, SamplingParams
from lorastar.engine.block_manager import NULL_BLOCK
from tests.adapters.test_lora_vs_peft import _targets_of, peft_greedy, peft_reference
from tests.conftest import ALL_TARGETS, hf_model, make_peft_adapters
from tests.models.test_llama_vs_hf import hf_greedy, mixed_prompts
from tests.models.test_sliding_window import _run_recording_logits

# Phi-3 with a sliding window (Phi-3-mini's config has one; the shared tiny model none): the same
# weights, config.json edited. Every layer windowed: the engine frees blocks behind the window.
_ALL_WINDOWED: dict[str, tuple[str, dict[str, Any]]] = {
    "phi3-window": ("phi3", {"sliding_window": 20}),
}


def _model(tiny_model_dir, tmp_path_factory, name: str) -> str:  # noqa: ANN001
    if name not in _ALL_WINDOWED:
        return tiny_model_dir(name)
    base, edit = _ALL_WINDOWED[name]
    path = Path(shutil.copytree(tiny_model_dir(base), tmp_path_factory.mktemp(name), dirs_exist_ok=True))
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **edit}))
    return str(path)


GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@functools.cache
def _hf(path: str) -> torch.nn.Module:
    return hf_model(path).eval()


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def _teacher_forced_check(
    llm: LLM, hf: torch.nn.Module, prompts: list[list[int]], tol: float, **hf_kw: Any
) -> None:
    """Each prompt's greedy tokens are the argmax of ``hf``'s teacher-forced logits, and every decode
    step's logits are within ``tol`` (relative to max |logit|) of them."""
    outs, logits = _run_recording_logits(llm, prompts, GREEDY)
    for p, o in zip(prompts, outs):
        full = p + o
        with torch.no_grad():
            want = hf(input_ids=torch.tensor([full]), **{k: v() for k, v in hf_kw.items()}).logits[0]
        for n in range(len(p), len(full)):
            got = logits[tuple(full[:n])]
            assert _rel(got, want[n - 1]) < tol, f"prompt of {len(p)}, step {n - len(p)}"
            top2 = want[n - 1].topk(2).values
            if top2[0] - top2[1] > 2 * tol * want[n - 1].abs().max():  # not a near tie at this tolerance
                assert full[n] == int(want[n - 1].argmax()), f"prompt of {len(p)}, step {n - len(p)}"
    llm.engine.check_invariants()
    assert llm.kv_cache_usage()["num_used_blocks"] == 0


# ---- FP8 KV cache ------------------------------------------------------------------------------


class _RoundedKVCache(DynamicCache):
    """transformers' cache holding K/V rounded through fp8 with per-layer scales, as the engine's fp8
    cache stores them (the prefill attends over what the cache holds, in both)."""

    def __init__(self, scales: tuple[list[float], list[float]], dtype: torch.dtype, **kw: Any) -> None:
        super().__init__(**kw)
        self.scales, self.dtype = scales, dtype

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, *a: Any, **kw: Any):  # noqa: ANN201
        ks, vs = self.scales[0][layer_idx], self.scales[1][layer_idx]
        k, v = ((x / s).to(self.dtype).to(x.dtype) * s for x, s in ((k, ks), (v, vs)))
        return super().update(k, v, layer_idx, *a, **kw)


@pytest.mark.parametrize(("name", "kv"), [("gemma2", "fp8"), ("phi3", "fp8_e5m2")])
def test_fp8_kv_cache_follows_transformers_on_the_same_rounded_kv(tiny_model_dir, name: str, kv: str) -> None:
    """Against the unquantized model fp8 K/V moves these logits by up to 25% (Gemma 2's final cap
    leaves them tiny) and flips greedy tokens; against transformers attending over K/V rounded with
    the engine's calibrated scales they agree to float noise (1e-3: one rounding may land apart)."""
    path = tiny_model_dir(name)
    llm = LLM(path, num_kv_blocks=64, block_size=8, max_num_batched_tokens=16, kv_cache_dtype=kv)
    scales = (llm.engine.runner.k_scales, llm.engine.runner.v_scales)
    assert all(s != 1.0 for s in scales[0])  # calibrated, not the unit default
    dtype = torch.float8_e4m3fn if kv == "fp8" else torch.float8_e5m2
    hf = _hf(path)
    cache = functools.partial(_RoundedKVCache, scales, dtype, config=hf.config)
    _teacher_forced_check(llm, hf, mixed_prompts(5, [45]), 1e-3, past_key_values=cache)


# ---- on-the-fly weight quantization, int8 embedding -----------------------------------------------


def _fp8_per_token(x: torch.Tensor) -> torch.Tensor:
    s = x.abs().amax(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).eps) / 448.0
    return (x / s).to(torch.float8_e4m3fn).to(x.dtype) * s


def _int8_per_token(x: torch.Tensor) -> torch.Tensor:
    s = x.abs().amax(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / 127.0
    return torch.round(x / s).clamp(-127, 127) * s


def _scheme_reference(path: str, llm: LLM, quant: str) -> torch.nn.Module:
    """transformers' model with each linear set to the engine's dequantized weight and its input
    rounded per token as the engine's W8A8 scheme does (Phi-3's fused slices written back fused)."""
    hf = hf_model(path).eval()
    mods = dict(hf.named_modules())
    model = llm.engine.model
    mapping = type(model).packed_modules_mapping
    hook = _fp8_per_token if quant == "fp8" else _int8_per_token
    done = 0
    with torch.no_grad():
        for prefix, layer in model.linears().items():
            w = layer.quant_method.dequantized_weight(layer)  # [out, in]
            block, _, fused = prefix.rpartition(".")
            if prefix in mods:
                pieces = [(prefix, w)]
            else:
                parts = mapping.get(fused, [fused])
                pieces = [(f"{block}.{p}", x) for p, x in zip(parts, w.split(layer.output_sizes, dim=0))]
            for module, x in pieces:
                mods[module].weight.copy_(x)
                mods[module].register_forward_pre_hook(lambda _m, args: (hook(args[0]),))
                done += 1
    assert done == sum(isinstance(m, torch.nn.Linear) for n, m in mods.items() if "layers." in n)
    return hf


@pytest.mark.parametrize(("name", "quant"), [("phi3", "fp8")])
def test_on_the_fly_weight_quantization_follows_the_scheme_in_transformers(
    tiny_model_dir, name: str, quant: str
) -> None:
    """quantization="fp8" on Phi-3: fused qkv_proj / gate_up_proj quantized per output row, each slice's
    dequantized weight written back to transformers' fused module (int8 / Gemma: same scheme, measured
    to flip roundings at 1% here, so not compared token for token)."""
    path = tiny_model_dir(name)
    llm = LLM(
        path, num_kv_blocks=64, block_size=8, max_num_batched_tokens=16, quantization=quant, cpu_gemm="torch"
    )
    _teacher_forced_check(llm, _scheme_reference(path, llm, quant), mixed_prompts(6, [45]), 1e-2)


@pytest.mark.parametrize("name", ["gemma2"])
def test_int8_embedding_follows_transformers_with_the_dequantized_tables(tiny_model_dir, name: str) -> None:
    """embedding_quantization="int8": Gemma's tied table, scaled by sqrt(hidden) in, soft-capped out."""
    path = tiny_model_dir(name)
    llm = LLM(path, num_kv_blocks=64, block_size=8, max_num_batched_tokens=16, embedding_quantization="int8")
    model, hf = llm.engine.model, hf_model(path).eval()
    assert model.lm_head is model.embed_tokens  # one int8 table; transformers' head is tied too
    with torch.no_grad():
        hf.get_input_embeddings().weight.copy_(model.embed_tokens.method.dequantize(model.embed_tokens))
    _teacher_forced_check(llm, hf, mixed_prompts(7, [45]), 1e-4)


# ---- adapters --------------------------------------------------------------------------------

_ADAPTERS = {
    "all": dict(r=8, target_modules=list(ALL_TARGETS)),
    "some": dict(r=4, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"]),
}


@pytest.mark.parametrize("name", ["gemma2", "phi3"])
def test_two_adapters_past_the_window_with_chunks_prefix_hits_and_preemption_match_peft(
    tiny_model_dir, tmp_path: Path, name: str
) -> None:
    """Two adapters (one on every target: Phi-3's qkv_proj / gate_up_proj) and the base in one batch,
    prompts several windows long in 16-token chunks, one prompt repeated under the same adapter (a
    prefix hit) and one under the other (no hit: the adapter is in the hash), in a pool that preempts."""
    path = tiny_model_dir(name)
    paths = make_peft_adapters(path, tmp_path, _ADAPTERS, seed=3, map_targets=_targets_of)
    ref = peft_reference(path, paths)
    llm = LLM(path, num_kv_blocks=12, block_size=8, max_num_batched_tokens=16, max_num_seqs=3, max_loras=2,
              max_lora_rank=8)  # fmt: skip
    for n, p in paths.items():
        llm.load_adapter(n, p)
    prompts = mixed_prompts(21, [60, 30, 60, 40, 60])
    prompts[2] = prompts[4] = list(prompts[0])
    order = ["all", "some", "all", None, "some"]
    outs = llm.generate(prompts, GREEDY, adapter=order)
    for p, a, o in zip(prompts, order, outs):
        assert o.outputs[0].token_ids == peft_greedy(ref, p, a, GREEDY.max_tokens), f"adapter {a}"
    assert outs[0].outputs[0].token_ids != outs[4].outputs[0].token_ids  # the adapters do differ
    stats = llm.engine.scheduler.stats
    assert stats.num_preemptions > 0 and stats.prefix_hits > 0
    llm.engine.check_invariants()
    assert llm.kv_cache_usage()["num_used_blocks"] == 0


# ---- beam search and n > 1 -----------------------------------------------------------------------


def _hf_beams(hf: torch.nn.Module, prompt: list[int], width: int, n: int) -> list[list[int]]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, num_return_sequences=width,
                      do_sample=False, max_new_tokens=n, early_stopping=False, pad_token_id=0)  # fmt: skip
    return [row[len(prompt) :].tolist() for row in out]


@pytest.mark.parametrize("name", ["mistral-window"])
def test_beam_search_and_n_past_the_window_match_transformers(
    tiny_model_dir, tmp_path_factory, name: str
) -> None:  # noqa: ANN001
    """Beams forked from a table whose early entries the window released, prefilled in 8-token chunks,
    beside an n=2 greedy request of the same prompt."""
    path = _model(tiny_model_dir, tmp_path_factory, name)
    hf = _hf(path)
    llm = LLM(path, num_kv_blocks=40, block_size=4, max_num_batched_tokens=8)
    prompt = mixed_prompts(13, [44])[0]
    beam = SamplingParams(n=3, use_beam_search=True, max_tokens=8, temperature=0)
    eng = llm.engine
    req = eng.add_request(prompt, beam)
    fan = eng.add_request(prompt, SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True))
    holes, done = 0, {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = [o.token_ids for o in out.outputs]
        eng.check_invariants()
        holes = max([holes] + [s.block_table.count(NULL_BLOCK) for r in (req, fan) for s in r.sequences])
    assert holes > 0  # the window released blocks the beams had shared
    assert done[req.request_id] == _hf_beams(hf, prompt, 3, 8)
    assert done[fan.request_id] == [hf_greedy(hf, prompt, 8)] * 2
    assert llm.kv_cache_usage()["num_used_blocks"] == 0


# ---- Phi-3 with a window ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["phi3-window"])
def test_all_windowed_variants_free_blocks_and_match_transformers(
    tiny_model_dir, tmp_path_factory, name: str
) -> None:  # noqa: ANN001
    """Every layer windowed: the engine frees blocks behind the window, and prompt logprobs in chunks
    across it, then tokens and logits (the same prompt again: a prefix hit past the window) still equal
    transformers'."""
    path = _model(tiny_model_dir, tmp_path_factory, name)
    llm = LLM(path, num_kv_blocks=40, block_size=8, max_num_batched_tokens=16)
    assert llm.engine._window_blocks > 0
    prompts = mixed_prompts(3, [9, 70])
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    out = llm.generate([prompts[1]], sp)[0]
    _teacher_forced_check(llm, _hf(path), prompts, 1e-4)  # the long prompt again: a hit past the window
    assert llm.engine.scheduler.stats.prefix_hits > 0
    with torch.no_grad():
        want = torch.log_softmax(_hf(path)(input_ids=torch.tensor([prompts[1]])).logits[0].double(), -1)
    got = [out.prompt_logprobs[i][t].logprob for i, t in enumerate(prompts[1]) if i]
    torch.testing.assert_close(
        torch.tensor(got, dtype=torch.float64), want[:-1].gather(1, torch.tensor(prompts[1][1:])[:, None])[:, 0],
        rtol=0, atol=1e-4,
    )  # fmt: skip
    assert llm.kv_cache_usage()["num_used_blocks"] == 0


def test_a_long_prompt_still_hits_the_cache_after_its_blocks_behind_the_window_are_evicted(
    tiny_model_dir,  # noqa: ANN001
) -> None:
    """Every layer slides (Mistral): a hit reads only the blocks inside the first query's window. The
    blocks behind it were released first, so they are the first evicted; requiring them too (the hash
    chain walked from block 0) lost every hit of a long prompt once another request took a few blocks
    (vLLM's sliding-window manager looks for the window's blocks only). Outputs stay transformers'."""
    path = tiny_model_dir("mistral-window")
    llm = LLM(path, num_kv_blocks=8, block_size=8, max_num_batched_tokens=16)
    long, short = mixed_prompts(1, [96, 20])
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = llm.generate([long], sp)[0].outputs[0].token_ids
    llm.generate([short], sp)  # takes the least recently freed blocks: the long prompt's first ones
    stats = llm.engine.scheduler.stats
    before = stats.prefix_hits
    again = llm.generate([long], sp)[0].outputs[0].token_ids
    assert stats.prefix_hits - before == 88  # 11 blocks (the last token's is computed), 8 of them dead
    assert again == first == hf_greedy(_hf(path), long, 4)
    # Prompt logprobs were kept for the first 6 blocks only (a 48-token prefix asked for them): a hit
    # cut there would end inside the evicted blocks, so none is taken, and they equal transformers'.
    plp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=0)
    llm.generate([long[:48]], plp)
    llm.generate([long], sp)
    llm.generate([short], sp)
    out = llm.generate([long], plp)[0]
    assert out.outputs[0].token_ids == first
    with torch.no_grad():
        want = torch.log_softmax(_hf(path)(input_ids=torch.tensor([long])).logits[0].double(), -1)
    got = torch.tensor(
        [out.prompt_logprobs[i][t].logprob for i, t in enumerate(long) if i], dtype=torch.float64
    )
    torch.testing.assert_close(
        got, want[:-1].gather(1, torch.tensor(long[1:])[:, None])[:, 0], rtol=0, atol=1e-4
    )
    llm.engine.check_invariants()
    assert llm.kv_cache_usage()["num_used_blocks"] == 0
