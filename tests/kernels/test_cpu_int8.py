"""The CPU int8 logits op (``cpu_native.int8_logits`` on ``int8_pack``'s layout, ``csrc/cpu_int8.cpp``)
against the float64 reference, over row counts around its 8-row passes, table sizes around its 16-row
packs and K with and without vector tails; and the int8 lm_head that uses it, in the engine."""

from __future__ import annotations

import pytest
import torch

from lorastar import LLM, SamplingParams
from lorastar.kernels import cpu_native
from lorastar.kernels.reference import ref_int8_logits
from lorastar.quant.embedding_int8 import quantize_rows_int8
from tests.kernels.test_cpu_native import _op


@pytest.mark.parametrize("m", [1, 3, 8, 9, 20])
@pytest.mark.parametrize(("n", "k"), [(1, 7), (15, 64), (16, 576), (17, 33), (1000, 576)])
def test_int8_logits_match_reference(m: int, n: int, k: int) -> None:
    _op()
    gen = torch.Generator().manual_seed(m * 100 + n + k)
    q, s = quantize_rows_int8(torch.randn(n, k, generator=gen))
    x = torch.randn(m, k, generator=gen)
    packed = cpu_native.int8_pack(q)
    assert packed.shape == (-(-n // 16), k, 16)
    rows = torch.arange(n)
    assert torch.equal(packed[rows // 16, :, rows % 16], q)  # table row 16 b + j at [b, :, j]
    assert not packed.reshape(-1, k, 16)[-1, :, n - 16 * (-(-n // 16) - 1) :].any()  # padding rows zero
    got, want = cpu_native.int8_logits(x, packed, s), ref_int8_logits(x, q, s)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_int8_lm_head_takes_the_op_and_decodes_as_the_torch_form(
    tiny_model_dir, monkeypatch, dtype: str
) -> None:  # noqa: ANN001
    """``embedding_quantization="int8"`` on CPU: with the C++ ops the logits come from the op (a spy
    counts its calls), within 1e-5 relative of the torch form's (``cpu_kernels="torch"``) in fp32 and
    two bf16 roundings in bf16 (the torch form rounds ``x @ q`` before the scale); fp32: same greedy
    tokens."""
    _op()
    calls = []
    op = cpu_native.int8_logits
    monkeypatch.setattr(cpu_native, "int8_logits", lambda *a: calls.append(a[0].shape) or op(*a))
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 9, 200, 31], list(range(40, 90))]
    outs, logits = {}, {}
    for mode in ("native", "torch"):
        llm = LLM(
            tiny_model_dir("llama-gqa"), num_kv_blocks=64, embedding_quantization="int8", cpu_kernels=mode,
            dtype=dtype,
        )  # fmt: skip
        head = llm.engine.model.lm_head
        assert (getattr(head, "qweight_packed", None) is not None) == (mode == "native")
        outs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        hidden = torch.randn(3, head.embedding_dim, generator=torch.Generator().manual_seed(1))
        hidden = hidden.to(getattr(torch, dtype))
        logits[mode] = llm.engine.model.compute_logits(hidden)
    assert calls and all(shape[0] >= 1 for shape in calls)
    assert logits["native"].dtype == getattr(torch, dtype)
    want = logits["torch"].float()
    if dtype == "float32":
        assert outs["native"] == outs["torch"]
        torch.testing.assert_close(logits["native"], want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    else:  # two bf16 roundings apart at most: 2 ** -7 of the value (of the largest logit near 0)
        tol = 2**-7
        torch.testing.assert_close(
            logits["native"].float(), want, rtol=tol, atol=tol * want.abs().max().item()
        )
