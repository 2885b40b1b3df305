"""Opt-in int8 embedding / lm_head (``embedding_quantization="int8"``): the per-row scheme, the
lookup and logits against the dequantized table, and the engine end to end against a model whose
tables are replaced by that dequantized table (an exact reference: same weights, float math)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from quant_fixtures import fixture_dir, have_fixture, read_config

from lorastar import LLM, EngineConfig, SamplingParams
from lorastar.layers.embedding import VocabEmbedding
from lorastar.models.llama import LlamaForCausalLM
from lorastar.quant.embedding_int8 import (
    CHUNK_ELEMS,
    Int8EmbeddingMethod,
    embedding_method,
    quantize_rows_int8,
)
from tests.conftest import prefill_logits

# fp32 logits through the int8 head vs x @ dequantized.T: only the summation order differs (the row
# scale is applied after the int8 matmul), so the gap is float rounding, relative to max |logit|.
LOGIT_TOL = 1e-5
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _table(vocab: int = 1000, hidden: int = 48, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(vocab, hidden, generator=g) * torch.rand(vocab, 1, generator=g)  # rows of varied range
    w[7] = 0.0  # an all-zero row (scale 0)
    return w


def _int8_table(w: torch.Tensor, chunk_elems: int = CHUNK_ELEMS) -> VocabEmbedding:
    """A table layer filled with ``w`` (as the checkpoint loader fills it), then quantized."""
    layer = VocabEmbedding(*w.shape, w.dtype, Int8EmbeddingMethod(chunk_elems))
    layer.weight.data.copy_(w)
    layer.method.process_weights_after_loading(layer)
    return layer


def _deq(layer: VocabEmbedding) -> torch.Tensor:
    assert isinstance(layer.method, Int8EmbeddingMethod)
    return layer.method.dequantize(layer)


def test_round_trip_error_is_at_most_half_a_step_per_row() -> None:
    w = _table()
    q, s = quantize_rows_int8(w, chunk_elems=48 * 64)  # several quantization chunks
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (1000,)
    assert int(q.abs().max()) == 127
    deq = q.float() * s[:, None]
    err = (w - deq).abs().amax(dim=1)
    assert bool((err <= s / 2 * (1 + 1e-6)).all())
    assert s[7] == 0 and bool((q[7] == 0).all())
    torch.testing.assert_close(s, w.abs().amax(dim=1) / 127)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lookup_equals_dequantized_table_rows(dtype: torch.dtype) -> None:
    emb = _int8_table(_table().to(dtype))
    deq = _deq(emb)
    assert deq.dtype == dtype
    ids = torch.tensor([[0, 7, 999, 3], [3, 3, 500, 1]])
    out = emb(ids)
    assert out.shape == (2, 4, 48) and out.dtype == dtype
    assert torch.equal(out, deq[ids])


@pytest.mark.parametrize("chunk_elems", [48 * 100, 1 << 22])  # 8 blocks of vocab rows / one block
def test_logits_equal_matmul_with_dequantized_table(chunk_elems: int) -> None:
    emb = _int8_table(_table(), chunk_elems=chunk_elems)
    x = torch.randn(5, 48, generator=torch.Generator().manual_seed(1))
    ref = x @ _deq(emb).T
    got = emb.logits(x)
    assert got.shape == (5, 1000) and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=LOGIT_TOL, atol=LOGIT_TOL * ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_logits_follow_the_fp32_reference(dtype: torch.dtype) -> None:
    # fp16 takes the dequantize-the-block path (x @ q alone could overflow fp16); both round once
    # more than fp32, so the bound is a few steps of the format at the largest logit.
    emb = _int8_table(_table().to(dtype), chunk_elems=48 * 100)
    x = torch.randn(5, 48, generator=torch.Generator().manual_seed(2)).to(dtype)
    ref = x.float() @ _deq(emb).float().T
    got = emb.logits(x)
    assert got.dtype == dtype
    assert ((got.float() - ref).abs().max() / ref.abs().max()).item() < 4 * torch.finfo(dtype).eps


def _teacher_forced_logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    """One prefill of ``ids`` through the engine's runner metadata; fp32 logits of every row (CPU)."""
    return prefill_logits(model, ids).float().cpu()


def _dequantized_reference(path: str, int8: LLM, **kw: object) -> LLM:
    """The same checkpoint with its tables replaced by the int8 engine's dequantized tables."""
    ref = LLM(path, **{"device": "cpu", "num_kv_blocks": 64, "enable_prefix_caching": False, **kw})
    model, qmodel = ref.engine.model, int8.engine.model
    assert isinstance(qmodel.embed_tokens.method, Int8EmbeddingMethod)
    assert not isinstance(model.embed_tokens.method, Int8EmbeddingMethod)
    model.embed_tokens.weight.data.copy_(_deq(qmodel.embed_tokens))
    if model.lm_head is not model.embed_tokens:
        assert isinstance(qmodel.lm_head.method, Int8EmbeddingMethod)
        model.lm_head.weight.data = _deq(qmodel.lm_head)  # (the oneDNN backend emptied the dense copy)
    if model.lm_head.weight_packed is not None:  # oneDNN backend: the head's packed copy is what runs
        from lorastar.layers.cpu_gemm import pack

        model.lm_head.weight_packed = pack(model.lm_head.weight.data)
    return ref


def _embedding_bytes(model: LlamaForCausalLM) -> int:
    params = {id(p): p for t in (model.embed_tokens, model.lm_head) for p in t.parameters()}
    return sum(p.numel() * p.element_size() for p in params.values())


@pytest.mark.parametrize("name", ["llama-mha-llama3", "llama-gqa"])  # tied, untied
def test_llm_int8_embedding_matches_dequantized_reference(tiny_model_dir, name: str) -> None:
    path = tiny_model_dir(name)
    int8 = LLM(
        path, device="cpu", num_kv_blocks=64, enable_prefix_caching=False, embedding_quantization="int8"
    )
    model = int8.engine.model
    tied = model.lm_head is model.embed_tokens
    assert isinstance(model.embed_tokens.method, Int8EmbeddingMethod)
    assert tied == (name == "llama-mha-llama3")
    if not tied:
        assert isinstance(model.lm_head.method, Int8EmbeddingMethod)
    # No float [vocab, hidden] table is left anywhere in the model.
    vocab, hidden = model.vocab_size, model.embed_tokens.embedding_dim
    assert not [
        n for n, p in model.named_parameters() if p.is_floating_point() and p.shape == (vocab, hidden)
    ]

    ref = _dequantized_reference(path, int8)
    ids = [int(t) for t in torch.randint(3, vocab, (40,), generator=torch.Generator().manual_seed(3))]
    got = _teacher_forced_logits(model, ids)
    want = _teacher_forced_logits(ref.engine.model, ids)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= LOGIT_TOL, f"max logit error {err:.2e} relative to max |logit|"

    prompts = [ids[:5], ids[10:30], [ids[0]]]
    outs = int8.generate(prompts, GREEDY)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    assert [o.outputs[0].token_ids for o in outs] == [
        o.outputs[0].token_ids for o in ref.generate(prompts, GREEDY)
    ]

    # fp32 table 4 bytes/element -> int8 1 byte + one fp32 scale per row: (hidden + 4) / (4 hidden).
    ratio = _embedding_bytes(model) / _embedding_bytes(ref.engine.model)
    assert ratio == pytest.approx((hidden + 4) / (4 * hidden)) and ratio < 0.27


def test_quantize_frees_the_float_table() -> None:
    w = _table()
    layer = VocabEmbedding(*w.shape, w.dtype, Int8EmbeddingMethod())
    layer.weight.data.copy_(w)
    ref = weakref.ref(layer.weight)
    layer.method.process_weights_after_loading(layer)
    gc.collect()
    assert ref() is None and "weight" not in dict(layer.named_parameters())
    assert {n: p.dtype for n, p in layer.named_parameters()} == {
        "qweight": torch.int8,
        "scale": torch.float32,
    }


def test_loaded_int8_tables_replace_the_float_ones(tiny_model_dir) -> None:
    from lorastar.models.loader import load_model, read_hf_config

    path = tiny_model_dir("llama-gqa")  # untied: embedding and lm_head both go
    kw = {"dtype": torch.float32, "device": torch.device("cpu"), "quant": None, "max_positions": 64}
    model, _ = load_model(path, read_hf_config(path), **kw)
    qmodel, _ = load_model(path, read_hf_config(path), **kw, embedding_method=embedding_method("int8"))
    assert qmodel.lm_head is not qmodel.embed_tokens
    before = sum(p.numel() * p.element_size() for p in model.parameters())
    after = sum(p.numel() * p.element_size() for p in qmodel.parameters())
    v, h = model.lm_head.weight.shape
    assert before - after == 2 * (v * h * 4 - (v * h + v * 4))
    names = dict(qmodel.named_parameters())
    assert "lm_head.weight" not in names and "embed_tokens.weight" not in names
    assert names["lm_head.qweight"].dtype == torch.int8
    for table, dense in (
        (qmodel.lm_head, model.lm_head.weight),
        (qmodel.embed_tokens, model.embed_tokens.weight),
    ):
        assert bool(((_deq(table) - dense).abs() <= table.scale[:, None] / 2 + 1e-7).all())


@pytest.mark.skipif(not have_fixture("awq_g32"), reason="AWQ fixture missing")
def test_int4_checkpoint_with_int8_embedding() -> None:
    """AWQ decoder linears + int8 lm_head and embedding (untied fp16 checkpoint)."""
    path = str(fixture_dir("awq_g32"))
    assert read_config("awq_g32").get("tie_word_embeddings") is False
    int8 = LLM(
        path, device="cpu", num_kv_blocks=64, enable_prefix_caching=False, embedding_quantization="int8"
    )
    ref = _dequantized_reference(path, int8)
    ids = list(range(5, 5 + 37))
    got = _teacher_forced_logits(int8.engine.model, ids)
    want = _teacher_forced_logits(ref.engine.model, ids)
    assert ((got - want).abs().max() / want.abs().max()).item() <= LOGIT_TOL
    outs = int8.generate([ids[:9]], GREEDY)
    assert outs[0].outputs[0].token_ids == ref.generate([ids[:9]], GREEDY)[0].outputs[0].token_ids


@pytest.mark.gpu
@pytest.mark.skipif(not have_fixture("awq_g32"), reason="AWQ fixture missing")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_int8_embedding(dtype: str) -> None:
    """CUDA, 16-bit compute: the float tables' memory is given back, and the logits follow the
    dequantized reference within the rounding of the 16-bit logits."""
    from lorastar.models.loader import load_model
    from lorastar.quant import get_quant_config

    path = str(fixture_dir("awq_g32"))
    cfg = read_config("awq_g32")
    tdtype = getattr(torch, dtype)
    dev = torch.device("cuda")
    model, _ = load_model(
        path, cfg, dtype=tdtype, device=dev, quant=get_quant_config(cfg, None, tdtype), max_positions=64
    )
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(dev)
    del model
    v, h = cfg["vocab_size"], cfg["hidden_size"]
    qmodel, _ = load_model(
        path, cfg, dtype=tdtype, device=dev, quant=get_quant_config(cfg, None, tdtype), max_positions=64,
        embedding_method=embedding_method("int8"),
    )  # fmt: skip
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated(dev)
    # Two 16-bit tables (untied) out, two int8 tables + fp32 scales in; allocator rounds to 512 B.
    assert abs(before - held - 2 * (v * h * 2 - (v * h + v * 4))) <= 4 * 512
    del qmodel

    kw = {"device": "cuda", "dtype": dtype, "num_kv_blocks": 64, "enable_prefix_caching": False}
    int8 = LLM(path, embedding_quantization="int8", **kw)
    ref = _dequantized_reference(path, int8, **kw)
    ids = list(range(5, 5 + 37))
    got = _teacher_forced_logits(int8.engine.model, ids)
    want = _teacher_forced_logits(ref.engine.model, ids)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 4 * torch.finfo(tdtype).eps
    assert int8.generate([ids[:9]], GREEDY)[0].outputs[0].token_ids
    assert int8.engine.model.embed_tokens.qweight.is_cuda


@pytest.mark.parametrize("bad", ["int4", "fp8", "INT8", 8])
def test_bad_embedding_quantization_is_rejected(bad: object) -> None:
    with pytest.raises(ValueError, match="embedding_quantization"):
        EngineConfig(embedding_quantization=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="embedding_quantization"):
        LLM(device="cpu", embedding_quantization=bad)  # fails in the config, before any loading
    with pytest.raises(ValueError, match="embedding_quantization"):
        embedding_method(bad)  # type: ignore[arg-type]
