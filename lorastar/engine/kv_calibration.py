"""FP8 KV-cache scales computed at load time when the checkpoint carries none.

One eager forward over a fixed calibration text writes K (after RoPE) and V of every layer into
a small temporary cache in the model dtype; each layer's scale maps ``HEADROOM`` times its
observed ``amax`` onto the fp8 format's largest value. The headroom is wide on purpose: one short
text does not see the largest keys real prompts produce, a saturated value costs far more than a
small one falling into fp8's subnormal range, and fp8's relative precision is the same anywhere in
its normal range. On SmolLM2 (amax ~20 for K, ~14 for V) the greedy agreement with the 16-bit
cache is 100% over 16 tokens (96.9% with unit scales) and ~76% over 32 with this headroom and with
vLLM's tighter ``amax / 200`` alike (``benchmarks/results/quant.md``): the margin is for models
whose keys exceed the calibration text's, not a measured gain.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lorastar.engine.input_batch import InputBatch, device_inputs
from lorastar.engine.request import Request
from lorastar.engine.sampling import SamplingParams
from lorastar.engine.scheduler import ScheduledSeq
from lorastar.forward_context import ForwardContext

if TYPE_CHECKING:
    from lorastar.models.llama import LlamaForCausalLM

HEADROOM = 16.0

CALIBRATION_TEXT = (
    "The quick brown fox jumps over the lazy dog. In 1905 Albert Einstein published four papers "
    "that changed physics: on the photoelectric effect, Brownian motion, special relativity and "
    "the equivalence of mass and energy. def fib(n):\n    return n if n < 2 else fib(n - 1) + "
    "fib(n - 2)\n\nQ: What is the capital of France? A: Paris. Les chiens aboient, la caravane "
    "passe. 東京は日本の首都です。 1, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144."
)


@torch.inference_mode()
def calibrate_kv_scales(
    model: LlamaForCausalLM,
    token_ids: list[int],
    *,
    dtype: torch.dtype,
    device: torch.device,
    block_size: int,
    cache_dtype: torch.dtype,
) -> tuple[list[float], list[float]]:
    """Per-layer ``(k_scales, v_scales)`` for an fp8 ``cache_dtype`` from one forward over
    ``token_ids`` (one sequence): ``scale = HEADROOM * amax / finfo(cache_dtype).max``."""
    if not token_ids:
        raise ValueError("KV-scale calibration needs at least one token")
    n = len(token_ids)
    num_blocks = -(-n // block_size)
    shape = (num_blocks, block_size, model.num_kv_heads, model.head_dim)
    caches = [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(model.num_layers)
    ]
    # One sequence owning blocks 0..num_blocks-1, through the steps' own input preparation.
    seq = Request("kv-calibration", None, list(token_ids), SamplingParams(max_tokens=1)).sequences[0]
    seq.block_table = list(range(num_blocks))
    inputs = InputBatch(block_size, n).prepare([ScheduledSeq(seq, 0, n)])
    ids, positions, md = device_inputs(inputs, block_size=block_size, device=device)
    model(ids, positions, ForwardContext(attn=md, kv_caches=caches))
    fp8_max = float(torch.finfo(cache_dtype).max)
    k_scales, v_scales = [], []
    for k, v in caches:
        for cache, out in ((k, k_scales), (v, v_scales)):
            amax = float(cache.abs().amax().float())
            out.append(HEADROOM * amax / fp8_max if amax > 0 else 1.0)  # all-zero layer: keep 1.0
    return k_scales, v_scales
