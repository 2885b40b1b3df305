"""The oneDNN CPU GEMM backend: same products as ``F.linear`` (fp32 rounding only), same greedy
tokens as transformers, the dense copy dropped and recoverable, and clear errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lorastar import LLM, SamplingParams
from lorastar.config import EngineConfig
from lorastar.layers.cpu_gemm import choose_backend, onednn_available, pack, packable, packed_linear, pick
from lorastar.layers.linear import Linear

pytestmark = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 80, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(rows, 80, generator=g)
    torch.testing.assert_close(packed_linear(x, pack(w), b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_layer_pack_drops_dense_copy_and_unpacks_on_demand() -> None:
    lin = Linear(32, [16, 8], bias=True, prefix="p", slice_names=["a", "b"], params_dtype=torch.float32)
    with torch.no_grad():
        lin.weight.normal_()
        lin.bias.normal_()
    w = lin.weight.detach().clone()
    x = torch.randn(5, 32)
    want = lin(x)
    assert lin.quant_method.pack_for_cpu(lin)
    assert lin.weight.numel() == 0 and lin.weight_packed is not None
    torch.testing.assert_close(lin(x), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin.quant_method.dequantized_weight(lin), w)


def test_engine_backends_agree_with_transformers(tiny_model_dir) -> None:
    from transformers import AutoModelForCausalLM

    from tests.models.test_llama_vs_hf import hf_greedy, mixed_prompts

    path = tiny_model_dir("llama-gqa")  # untied: the lm_head's dense copy is dropped too
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = mixed_prompts(11, [3, 40, 17])
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    outs = {}
    for backend in ("torch", "onednn"):
        llm = LLM(path, num_kv_blocks=64, cpu_gemm=backend)
        assert llm.engine.cpu_gemm == backend
        outs[backend] = llm.generate(prompts, sp)
    model = llm.engine.model
    assert model.lm_head.weight_packed is not None and model.lm_head.weight.numel() == 0
    for p, a, b in zip(prompts, outs["torch"], outs["onednn"]):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids == hf_greedy(hf, p, 10)
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for tok, lp in la.items():
                assert abs(lb[tok].logprob - lp.logprob) < 1e-4


def test_choices_and_errors() -> None:
    w = torch.randn(64, 64)
    assert choose_backend("torch", w) == "torch"
    assert choose_backend("onednn", w) == "onednn"
    assert choose_backend("auto", w) in ("torch", "onednn")
    assert choose_backend("auto", w.half()) == "torch"  # 32-bit weights only
    with pytest.raises(ValueError, match="cpu_gemm must be one of"):
        choose_backend("mkl", w)
    with pytest.raises(ValueError, match="cpu_gemm must be one of"):
        EngineConfig(cpu_gemm="blas")


@pytest.mark.parametrize(
    ("onednn_s", "torch_s", "want"),
    [
        ([1.0, 1.0], [1.0, 1.0], "onednn"),  # level: the same choice every start
        ([1.1, 1.2], [1.0, 1.0], "onednn"),  # torch a little faster (noise-sized): still oneDNN
        ([1.0, 2.0], [1.0, 1.0], "onednn"),  # torch well ahead at 32 rows only
        ([2.0, 1.3], [1.0, 1.0], "torch"),  # torch well ahead at both sizes
    ],
)
def test_auto_keeps_onednn_unless_torch_wins_clearly(
    onednn_s: list[float], torch_s: list[float], want: str
) -> None:
    """``auto``'s rule from (1 row, 32 rows) seconds per backend. It picked whichever was faster,
    and where the two were close that flipped between starts (and with it the logits' last bits)."""
    assert pick(onednn_s, torch_s) == want
    with pytest.raises(ValueError):
        pick([1.0], [1.0, 1.0])  # one time per size on each side


bf16_packable = pytest.mark.skipif(
    not packable(torch.bfloat16), reason="this CPU has no bf16 arithmetic (AVX512-BF16 / AMX) for oneDNN"
)


@bf16_packable
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_packed_bf16_linear_rounds_like_f_linear(rows: int) -> None:
    """bf16 products against the fp32 product of the same bf16 inputs: the packed GEMM's error is
    the bf16 rounding of its output, as torch's own bf16 ``F.linear``'s is."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 80, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16()
    x = torch.randn(rows, 80, generator=g).bfloat16()
    exact = F.linear(x.float(), w.float(), b.float())
    got = packed_linear(x, pack(w), b)
    assert got.dtype == torch.bfloat16
    bound = (F.linear(x, w, b).float() - exact).abs().max().item() + 2**-8 * exact.abs().max().item()
    assert (got.float() - exact).abs().max().item() <= bound


@bf16_packable
def test_bf16_layer_packs_and_unpacks_exactly() -> None:
    lin = Linear(32, [16, 8], bias=False, prefix="p", slice_names=["a", "b"], params_dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.normal_()
    w = lin.weight.detach().clone()
    assert lin.quant_method.pack_for_cpu(lin)
    assert lin.weight.numel() == 0 and lin.weight_packed is not None
    assert torch.equal(lin.quant_method.dequantized_weight(lin), w)
    half = Linear(32, [16], bias=False, prefix="h", slice_names=["h"], params_dtype=torch.float16)
    assert not half.quant_method.pack_for_cpu(half)  # fp16 stays on torch's path (no faster packed)


@bf16_packable
@pytest.mark.parametrize("name", ["llama-gqa", "qwen2"])
def test_bf16_engine_on_onednn_scores_and_decodes_like_transformers(tiny_model_dir, name: str) -> None:
    """A bf16 model with its linears and lm_head packed: prompt logprobs against HF's fp32 forward,
    no further off than HF's own bf16 forward is; greedy tokens equal HF's bf16 greedy up to the first
    near tie."""
    from transformers import AutoModelForCausalLM

    from tests.models.test_llama_vs_hf import mixed_prompts

    path = tiny_model_dir(name)
    hf = {
        dt: AutoModelForCausalLM.from_pretrained(path, dtype=dt).eval()
        for dt in (torch.float32, torch.bfloat16)
    }
    llm = LLM(path, dtype="bfloat16", cpu_gemm="onednn", num_kv_blocks=64)
    model = llm.engine.model
    assert llm.engine.cpu_gemm == "onednn"
    assert all(lin.weight_packed is not None and lin.weight.numel() == 0 for lin in model.linears().values())
    assert model.lm_head.weight_packed is not None
    prompts = mixed_prompts(3, [40, 17, 90])
    outs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    )
    near_ties = 0
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            lp = {dt: torch.log_softmax(m(torch.tensor([ids])).logits[0].float(), -1) for dt, m in hf.items()}
        tgt = torch.tensor(ids[1:])[:, None]
        truth = lp[torch.float32][:-1].gather(1, tgt)[:, 0]
        hf_err = (lp[torch.bfloat16][:-1].gather(1, tgt)[:, 0] - truth).abs().max().item()
        got = torch.tensor([out.prompt_logprobs[p][ids[p]].logprob for p in range(1, len(ids))])
        assert (got - truth).abs().max().item() <= 2 * hf_err + 1e-3, ((got - truth).abs().max(), hf_err)
        near_ties += not greedy_matches_hf_up_to_a_near_tie(hf[torch.bfloat16], ids, out.outputs[0].token_ids)
    assert near_ties < len(prompts)  # most continuations agree all the way


def greedy_matches_hf_up_to_a_near_tie(hf, ids: list[int], tokens: list[int]) -> bool:  # noqa: ANN001
    """``tokens`` against ``hf``'s (a 16-bit model's) greedy choice after ``ids`` and each earlier
    token. True if all match; a first difference must be a near tie (the two logits within a few
    steps of bf16's 8-bit mantissa), which ends the comparison (False)."""
    seq = list(ids)
    for tok in tokens:
        with torch.no_grad():
            logits = hf(torch.tensor([seq])).logits[0, -1].float()
        want = int(logits.argmax())
        if tok != want:
            assert logits[want] - logits[tok] <= 4 * 2**-8 * logits[want].abs().clamp(min=1), (tok, want)
            return False
        seq.append(tok)
    return True
