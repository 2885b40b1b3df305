"""Int8 W8A8 linear for the CPU: per-channel symmetric int8 weights, per-token dynamic int8
activations, int32 accumulation by ``torch._int_mm`` (oneDNN, VNNI where the CPU has it).

Why this op: on SmolLM2-135M's 30 layers of linears (2 threads, AVX-512 EPYC), GFLOP/s at
1 / 8 / 20 / 64 / 256 rows, whole op including the activation quantization and the fp32 epilogue:
oneDNN fp32 with prepacked weights 24 / 154 / 241 / 351 / 445, this op 34 / 194 / 343 / 605 / 639
(``[in, out]`` weight layout; ``[out, in]`` read transposed wins at one row, 50, and loses from 4).
fbgemm's ``quantized.linear_dynamic`` is faster still at 20+ rows (560 / 785) but quantizes the
activation with one scale for the whole batch, so a request's logits would depend on its
neighbours; per-token scales keep every row independent of the batch (the int32 product is exact).
``torch._weight_int8pack_mm`` (weight-only int8) runs at ~6 GFLOP/s here.
"""

from __future__ import annotations

import torch

INT8_MAX = 127.0


# compressed-tensors' symmetric int8 scale: amax over half its range (255 / 2), values clamped to
# [-128, 127]; what a W8A8 checkpoint's own forward quantizes activations with.
CT_INT8_HALF_RANGE = 127.5


def quantize_per_token(x: torch.Tensor, qmax: float = INT8_MAX) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row.

    Semantics: ``s = amax(|x|, -1) / qmax; q = clamp(round(x / s), -128, 127)``; ``x [M, K]`` ->
    (``q [M, K]`` int8, ``s [M, 1]`` fp32). ``qmax`` 127 (the default, vLLM's kernels') never needs
    the clamp; ``CT_INT8_HALF_RANGE`` is compressed-tensors'. An all-zero row gets a tiny positive
    scale (and zeros).
    """
    xf = x.float()
    s = xf.abs().amax(dim=-1, keepdim=True).clamp_(min=torch.finfo(torch.float32).tiny).div_(qmax)
    q = torch.round(xf / s)
    if qmax > INT8_MAX:
        q.clamp_(-128.0, INT8_MAX)
    return q.to(torch.int8), s


def quantize_weight_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` float weight -> (``[N, K]`` int8, ``[N]`` fp32 scales): ``W ~= q * s[:, None]``.
    Row-wise, so quantizing the shards of a fused layer one by one is exact."""
    q, s = quantize_per_token(w)
    return q, s.view(-1)


def int8_linear(
    x: torch.Tensor,
    weight_t: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    qmax: float = INT8_MAX,
) -> torch.Tensor:
    """W8A8 linear with per-token activation and per-channel weight scales.

    Semantics: ``y = (Qtok(x) @ Wq.float()) * sx * sw (+ bias)``; ``x [M, K]``, ``weight_t [K, N]``
    int8 (the weight transposed, contiguous), ``weight_scale [N]`` fp32 -> ``y [M, N]`` in ``x.dtype``;
    ``qmax``: as ``quantize_per_token``'s.
    """
    xq, xs = quantize_per_token(x, qmax)  # [M, K] int8, [M, 1]
    acc = torch._int_mm(xq, weight_t)  # [M, N] int32, exact
    y = torch.mul(acc, xs).mul_(weight_scale)  # fp32
    if bias is not None:
        y.add_(bias)
    return y if x.dtype == torch.float32 else y.to(x.dtype)
