"""The CPU GEMM backend for linears: oneDNN with weights prepacked once, or torch's default.

Measured on SmolLM2-135M's linear shapes (30 layers, fp32, 2 threads, AVX-512 EPYC), GFLOP/s at 1 /
5 / 20 / 64 / 256 rows: torch's default ``F.linear`` (MKL) 8.8 / - / 75 / 132 / -; oneDNN with the
weight reordered once into its blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, the
path inductor's CPU codegen takes with frozen weights) 24 / 109 / 255 / 352 / 457. numpy's OpenBLAS
reaches 20 / 31 / 78 / 163 / 220 but needs its own thread pool, which contends with torch's
(end to end 10x slower with both at 2 threads). Whole engine, SmolLM2, 128 + 64 tokens: 24.9 / 68 /
136 tok/s at 1 / 5 / 20 concurrent with torch's GEMM, 54.6 / 180 / 226 with oneDNN (linears and
lm_head), same greedy tokens.

bf16 weights are packed too where the CPU has bf16 arithmetic (``packable``): torch's ``F.linear``
reorders the weight for oneDNN on every call. SmolLM2's linears, 2 threads, Xeon with AMX, ms per
whole-model pass at 1 / 16 / 64 / 256 rows: bf16 with torch 17.2 / 19.5 / 38.3 / 110, bf16 packed
9.5 / 10.1 / 27.8 / 93, fp32 packed 16.2 / 35.3 / 109 / 375 (weights hot in cache; end to end see
the README's CPU section).

``choose_backend("auto")`` measures both on the model's own largest linear at 1 and 32 rows and
keeps oneDNN unless torch's is clearly faster at both (``TORCH_MARGIN``).
"""

from __future__ import annotations

import time

import torch

BACKENDS = ("auto", "torch", "onednn")


def onednn_available() -> bool:
    try:
        return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):  # pragma: no cover - builds without oneDNN
        return False


def packable(dtype: torch.dtype) -> bool:
    """Whether linears of ``dtype`` run on oneDNN here: fp32 wherever oneDNN is built in, bf16 only
    where the CPU has bf16 arithmetic (AVX512-BF16 or AMX; elsewhere oneDNN emulates it). Not fp16:
    packed, it measured level with torch's ``F.linear`` end to end (SmolLM2 at 1 / 16 / 64 requests:
    0.83x / 1.08x / 1.03x its tokens/s, an AVX512-FP16 Xeon)."""
    if not onednn_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):  # pragma: no cover - builds without the check
            return False
    return False


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` reordered once into oneDNN's blocked layout (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Semantics: ``x @ W.T + bias`` for ``x [..., in]``, ``W`` packed by ``pack`` -> ``[..., out]``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _time(fn, reps: int = 5) -> float:  # noqa: ANN001
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return time.perf_counter() - t


# "auto" keeps oneDNN unless torch's GEMM is this much faster at both sizes. A plain "whichever is
# faster" flipped from one engine to the next where the two are close (SmolLM2's lm_head at one row,
# torch / oneDNN time 1.01-1.25 over five tries on an Xeon VM), and the two round differently, so
# the same prompt's logits, and on a near tie its greedy tokens, changed between restarts.
TORCH_MARGIN = 1.25


def choose_backend(requested: str, weight: torch.Tensor | None) -> str:
    """``"torch"`` or ``"onednn"`` for CPU linears. ``"auto"`` times both on ``weight``
    (the model's largest linear) at 1 and 32 rows (best of 3, a few ms) and keeps oneDNN unless
    torch's GEMM is ``TORCH_MARGIN`` times faster at both: the same choice on every start of one
    machine unless the two sit near that margin, where near-equal speeds tipped it either way."""
    if requested not in BACKENDS:
        raise ValueError(f"cpu_gemm must be one of {BACKENDS}, got {requested!r}")
    if requested == "torch" or weight is None:
        return "torch"
    if not onednn_available():
        if requested == "onednn":
            raise ValueError("cpu_gemm='onednn': this torch build has no oneDNN (mkldnn) linear")
        return "torch"
    if not packable(weight.dtype):  # fp16, or bf16 on a CPU without bf16 arithmetic
        return "torch"
    if requested == "onednn":
        return "onednn"
    onednn_s, torch_s = [], []
    with torch.inference_mode():
        packed = pack(weight)
        for rows in (1, 32):
            x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
            onednn_s.append(min(_time(lambda x=x: packed_linear(x, packed)) for _ in range(3)))
            torch_s.append(min(_time(lambda x=x: torch.nn.functional.linear(x, weight)) for _ in range(3)))
    return pick(onednn_s, torch_s)


def pick(onednn_s: list[float], torch_s: list[float]) -> str:
    """The rule behind ``auto``, from each backend's seconds at the same sizes."""
    if len(onednn_s) != len(torch_s) or not onednn_s:
        raise ValueError("pick: one time per size for each backend")
    clearly_slower = all(o >= TORCH_MARGIN * t for o, t in zip(onednn_s, torch_s))
    return "torch" if clearly_slower else "onednn"
