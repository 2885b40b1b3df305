"""FP8 (e4m3) linear: activation quantization + ``torch._scaled_mm`` or an upcast fallback.

W8A8 as compressed-tensors declares it: the input is quantized per token (dynamic), per tensor
(dynamic) or with a static per-tensor scale, the weight is stored in e4m3 with per-channel scales
(per-tensor scales are expanded to one per output row when a layer is fused).

``torch._scaled_mm`` runs on CUDA GPUs with compute capability >= 8.9 (Ada, Hopper). Elsewhere (CPU,
older GPUs) the upcast path fake-quantizes the input and dequantizes the weight in the model dtype:
the same numbers transformers' compressed-tensors forward computes.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
_EPS = float(torch.finfo(torch.float32).eps)

ACT_NONE = "none"  # weight-only
ACT_TOKEN = "token"  # dynamic per-token scales
ACT_TENSOR_DYNAMIC = "tensor_dynamic"  # dynamic per-tensor scale
ACT_TENSOR_STATIC = "tensor_static"  # static per-tensor scale from the checkpoint


def scaled_mm_supported(device: torch.device) -> bool:
    """FP8 tensor-core matmul available (``LORASTAR_FP8_SCALED_MM=0`` forces the upcast path)."""
    if (
        device.type != "cuda"
        or not hasattr(torch, "_scaled_mm")
        or os.environ.get("LORASTAR_FP8_SCALED_MM") == "0"
    ):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``fp8(clamp(x / scale))`` with ``scale`` broadcastable to ``x`` (division in ``x.dtype``)."""
    return torch.clamp(x / scale.to(x.dtype), -FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dynamic_scale(x: torch.Tensor, per_token: bool) -> torch.Tensor:
    """``amax / 448`` per row (``[M, 1]``) or for the whole tensor (``[1, 1]``), in ``x.dtype``.

    compressed-tensors' observer: the range includes 0 and the scale is clamped to fp32 eps."""
    if per_token:
        amax = x.abs().amax(dim=-1, keepdim=True)
    else:
        amax = x.abs().amax().reshape(1, 1)
    return torch.clamp(amax / FP8_MAX, min=_EPS).to(x.dtype)


def quantize_weight_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` float weight -> (``[N, K]`` e4m3, ``[N]`` fp32 scales) for on-the-fly FP8."""
    wf = w.float()
    scale = torch.clamp(wf.abs().amax(dim=1) / FP8_MAX, min=_EPS)  # [N]
    return torch.clamp(wf / scale[:, None], -FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def fp8_linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] e4m3
    weight_scale: torch.Tensor,  # [N] fp32, one per output row
    *,
    act: str,
    input_scale: torch.Tensor | None = None,  # [1] (ACT_TENSOR_STATIC)
    bias: torch.Tensor | None = None,
    use_scaled_mm: bool | None = None,
) -> torch.Tensor:
    """``y [M, N] = Q(x) @ (weight * weight_scale).T (+ bias)`` in ``x.dtype``."""
    if use_scaled_mm is None:
        use_scaled_mm = scaled_mm_supported(x.device)
    if act == ACT_NONE or not use_scaled_mm:
        return _upcast_linear(x, weight, weight_scale, act=act, input_scale=input_scale, bias=bias)
    if act == ACT_TOKEN:
        sx = dynamic_scale(x.float(), per_token=True)  # [M, 1] fp32
    elif act == ACT_TENSOR_DYNAMIC:
        sx = dynamic_scale(x.float(), per_token=False)  # [1, 1]
    else:
        assert input_scale is not None
        sx = input_scale.float().reshape(1, 1)
    xq = quantize_fp8(x.float(), sx)  # [M, K] e4m3
    m, k = xq.shape
    n = weight.shape[0]
    # _scaled_mm needs K and N multiples of 16 and a column-major second operand (weight.t()).
    if k % 16 or n % 16:
        return _upcast_linear(x, weight, weight_scale, act=act, input_scale=input_scale, bias=bias)
    one = torch.ones((), dtype=torch.float32, device=x.device)
    # Unit scales + fp32 output, then the row/column scales: supported on every FP8 GPU for any
    # scale granularity, and the product is the same fp32 sum the rowwise variant computes.
    acc = torch._scaled_mm(xq, weight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)  # [M, N]
    y = acc * sx * weight_scale.float().view(1, n)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def _upcast_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    act: str,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    dtype = x.dtype
    if act == ACT_TOKEN:
        sx = dynamic_scale(x, per_token=True)
    elif act == ACT_TENSOR_DYNAMIC:
        sx = dynamic_scale(x, per_token=False)
    elif act == ACT_TENSOR_STATIC:
        assert input_scale is not None
        sx = input_scale.to(dtype).reshape(1, 1)
    else:
        sx = None
    if sx is not None:
        x = quantize_fp8(x, sx).to(dtype) * sx  # fake quantization, as compressed-tensors does
    w = weight.to(dtype) * weight_scale.to(dtype).view(-1, 1)  # [N, K], a per-call temporary
    return F.linear(x, w, None if bias is None else bias.to(dtype))
