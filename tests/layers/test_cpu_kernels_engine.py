"""``cpu_kernels``: the C++ ops (decode attention, norms, activation, rotary) and the torch paths give
HF's greedy tokens."""

from __future__ import annotations

import pytest
import torch

from lorastar import LLM, SamplingParams
from lorastar.config import EngineConfig
from lorastar.kernels import cpu_native


def _outputs_per_mode(path: str, dtype: str, prompts: list[list[int]], sp: SamplingParams) -> dict[str, list]:
    """``prompts`` generated with ``cpu_kernels`` torch and native, after checking what each switched:
    decode attention (and LoRA's op), norms, rotary and the activation native in both dtypes."""
    outs = {}
    for mode in ("torch", "native"):
        llm = LLM(path, dtype=dtype, num_kv_blocks=64, cpu_kernels=mode)
        assert llm.engine.cpu_kernels == mode
        assert llm.engine.runner.native_cpu_kernels == (mode == "native")  # decode attention, LoRA
        layer = llm.engine.model.layers[0]
        native = [layer.post_attention_layernorm.native_cpu, layer.self_attn.rope.native_cpu]
        assert native == [mode == "native"] * 2
        assert (layer.mlp.act_and_mul.__name__ == "native_cpu_silu_and_mul") == (mode == "native")
        outs[mode] = llm.generate(prompts, sp)
    return outs


@pytest.mark.parametrize("name", ["llama-gqa", "qwen3"])
def test_engine_native_and_torch_attention_agree_with_transformers(tiny_model_dir, name: str) -> None:
    from transformers import AutoModelForCausalLM

    from tests.models.test_llama_vs_hf import hf_greedy, mixed_prompts

    if cpu_native.load() is None:
        pytest.skip("no C++ toolchain: the CPU attention op cannot build here")
    path = tiny_model_dir(name)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = mixed_prompts(12, [3, 40, 17, 70])
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    outs = _outputs_per_mode(path, "float32", prompts, sp)
    for p, a, b in zip(prompts, outs["torch"], outs["native"]):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids == hf_greedy(hf, p, 12)
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for tok, lp in la.items():
                assert abs(lb[tok].logprob - lp.logprob) < 1e-4


def test_auto_falls_back_and_native_refuses_without_the_op(tiny_model_dir, monkeypatch) -> None:
    monkeypatch.setattr(cpu_native, "load", lambda: None)  # as on a machine without g++
    path = tiny_model_dir("llama-gqa")
    assert LLM(path, num_kv_blocks=16).engine.cpu_kernels == "torch"
    with pytest.raises(ValueError, match="cpu_kernels='native'"):
        LLM(path, num_kv_blocks=16, cpu_kernels="native")
    with pytest.raises(ValueError, match="cpu_kernels must be one of"):
        EngineConfig(cpu_kernels="flash")


@pytest.mark.parametrize("name", ["llama-gqa", "qwen3"])
def test_bf16_engine_runs_attention_and_elementwise_ops_natively_and_decodes_like_transformers(
    tiny_model_dir, name: str
) -> None:
    """A bf16 model takes the C++ decode attention, norms, activation and rotary; its greedy tokens
    equal HF's bf16 greedy up to a near tie, and its logprobs stay within bf16's rounding of the
    torch forms'."""
    from transformers import AutoModelForCausalLM

    from tests.layers.test_cpu_gemm import greedy_matches_hf_up_to_a_near_tie
    from tests.models.test_llama_vs_hf import mixed_prompts

    if cpu_native.load() is None:
        pytest.skip("no C++ toolchain: the CPU ops cannot build here")
    path = tiny_model_dir(name)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    prompts = mixed_prompts(12, [3, 40, 17, 70])
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    outs = _outputs_per_mode(path, "bfloat16", prompts, sp)
    agree = 0
    for p, a, b in zip(prompts, outs["torch"], outs["native"]):
        agree += greedy_matches_hf_up_to_a_near_tie(hf, p, b.outputs[0].token_ids)
        n = next(
            (i for i, (x, y) in enumerate(zip(a.outputs[0].token_ids, b.outputs[0].token_ids)) if x != y), 10
        )
        for la, lb in zip(a.outputs[0].logprobs[: n + 1], b.outputs[0].logprobs[: n + 1]):
            for tok, lp in la.items():
                if tok in lb:
                    assert abs(lb[tok].logprob - lp.logprob) < 0.05
    assert agree >= len(prompts) - 1


@pytest.mark.parametrize("mode", ["torch", "native"])
def test_bf16_engine_with_an_adapter_decodes_like_peft(
    tiny_model_dir, tmp_path, monkeypatch, mode: str
) -> None:  # noqa: ANN001
    """A bf16 model with LoRA, its decode rows' adapter through the C++ SGMV op (``native``) or
    torch's matmuls: a batch of base and adapter rows, each against HF / PEFT in bf16 up to a near
    tie."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    import lorastar.layers.lora as lora_layer
    from tests.conftest import make_peft_adapter
    from tests.layers.test_cpu_gemm import greedy_matches_hf_up_to_a_near_tie
    from tests.models.test_llama_vs_hf import mixed_prompts

    if cpu_native.load() is None:
        pytest.skip("no C++ toolchain: the CPU ops cannot build here")
    path = tiny_model_dir("llama-gqa")
    adapter = make_peft_adapter(
        path, tmp_path / "a", seed=3, targets=("q_proj", "v_proj", "o_proj", "down_proj")
    )
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16), adapter
    ).eval()
    llm = LLM(path, dtype="bfloat16", num_kv_blocks=64, max_loras=2, max_lora_rank=16, cpu_kernels=mode)
    assert llm.engine.cpu_kernels == mode
    calls: list[torch.dtype] = []
    op = lora_layer.lora_segments
    monkeypatch.setattr(lora_layer, "lora_segments", lambda x, *a: (calls.append(x.dtype), op(x, *a))[1])
    llm.load_adapter("a", adapter)
    prompts = mixed_prompts(21, [30, 9, 50, 21])
    names = ["a", None, "a", None]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), adapter=names)
    agree = [
        greedy_matches_hf_up_to_a_near_tie(peft if name else base, p, o.outputs[0].token_ids)
        for p, o, name in zip(prompts, outs, names)
    ]
    assert sum(agree) >= len(prompts) - 1
    assert set(calls) == (set() if mode == "torch" else {torch.bfloat16})  # native: the op ran, in bf16
    llm.engine.check_invariants()


def test_gemma_norms_take_the_cpp_op_in_fp32_only(monkeypatch) -> None:  # noqa: ANN001
    """GemmaRMSNorm (``(1 + w)`` multiplied in fp32) through the C++ rms_norm with ``1 + w`` as its
    weight: within a few ulp of its torch form on rows and contiguous 3-D inputs; strided head views
    (Gemma 3's q/k norms) and bf16 keep the torch form, bit for bit."""
    from lorastar.layers.norm import GemmaRMSNorm

    if cpu_native.load() is None:
        pytest.skip("no C++ toolchain: the CPU ops cannot build here")
    gen = torch.Generator().manual_seed(0)
    ref, nat = GemmaRMSNorm(96, 1e-6, torch.float32), GemmaRMSNorm(96, 1e-6, torch.float32)
    w = torch.randn(96, generator=gen) * 0.3
    ref.weight.data.copy_(w)
    nat.weight.data.copy_(w)
    nat.use_native_cpu_ops()
    assert ref.plus_one is None and nat.plus_one is not None
    calls = []
    op = cpu_native.rms_norm
    monkeypatch.setattr(cpu_native, "rms_norm", lambda *a: (calls.append(a[0].shape), op(*a))[1])
    x = torch.randn(7, 96, generator=gen) * 3
    torch.testing.assert_close(nat(x), ref(x), rtol=1e-6, atol=1e-6)
    x3 = torch.randn(5, 4, 96, generator=gen)
    torch.testing.assert_close(nat(x3), ref(x3), rtol=1e-6, atol=1e-6)
    assert calls == [(7, 96), (20, 96)]
    heads = torch.randn(5, 3 * 96 + 8, generator=gen)[:, : 3 * 96].view(5, 3, 96)  # strided rows
    assert torch.equal(nat(heads), ref(heads)) and len(calls) == 2
    half = GemmaRMSNorm(96, 1e-6, torch.bfloat16)
    half.use_native_cpu_ops()
    assert half.plus_one is None
