"""Opt-in int8 token embedding and lm_head (``EngineConfig.embedding_quantization="int8"``).

AWQ / GPTQ checkpoints keep the embedding (and a tied lm_head) 16-bit, and on a small model it is a
large share of the weights (SmolLM2-135M: the 49152 x 576 tied table is 21% of the bf16 model).
Once loaded, each table becomes per-row symmetric int8 (``Int8EmbeddingMethod``, the method of the
model's ``VocabEmbedding`` layers):

  ``qweight [vocab, hidden]`` int8 in -127..127, ``scale [vocab]`` fp32, ``W[v] ~= qweight[v] * scale[v]``

The lookup dequantizes only the gathered rows; the logits never build a full-precision table: the
row scale factors out of each output column, ``logits[:, v] = (x @ qweight[v]) * scale[v]``, so the
table is converted a bounded block of rows at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lorastar.layers.embedding import EmbeddingMethod, UnquantizedEmbeddingMethod, VocabEmbedding

EMBEDDING_QUANT_METHODS = ("int8",)

# Elements of one temporary block (quantization, logits): 4M -> 8 MiB in bf16, 16 MiB in fp32. The
# logits take at most LOGIT_BLOCKS blocks (larger ones for large tables): every block costs a few
# kernel launches, which dominate decode-sized batches on a GPU.
CHUNK_ELEMS = 1 << 22
LOGIT_BLOCKS = 8


def quantize_rows_int8(w: torch.Tensor, chunk_elems: int = CHUNK_ELEMS) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8: ``w [rows, cols]`` -> ``(q [rows, cols] int8, scale [rows] fp32)``.

    ``scale = max|w[r]| / 127`` and ``q = round(w / scale)``, so ``|w - q * scale| <= scale / 2``.
    An all-zero row gets scale 0 (and q 0)."""
    rows, cols = w.shape
    q = torch.empty(rows, cols, dtype=torch.int8, device=w.device)
    scale = torch.empty(rows, dtype=torch.float32, device=w.device)
    step = max(1, chunk_elems // max(cols, 1))
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        wf = w[lo:hi].float()
        s = wf.abs().amax(dim=1) / 127
        # Dividing by a clamped scale keeps zero rows at q = 0 instead of 0/0.
        q[lo:hi] = (
            torch.round(wf / s.clamp(min=torch.finfo(torch.float32).tiny)[:, None])
            .clamp_(-127, 127)
            .to(torch.int8)
        )
        scale[lo:hi] = s
    return q, scale


class Int8EmbeddingMethod(EmbeddingMethod):
    """Per-row int8 table: ``qweight`` and ``scale`` are parameters (not buffers), so parameter-based
    weight counts include them; the float ``weight`` the checkpoint filled is freed."""

    def __init__(self, chunk_elems: int = CHUNK_ELEMS) -> None:
        self.chunk_elems = chunk_elems

    def process_weights_after_loading(self, layer: VocabEmbedding) -> None:
        w = layer.weight
        q, s = quantize_rows_int8(w.data, self.chunk_elems)
        del layer.weight  # unregister: the last reference to the float table
        layer.qweight = nn.Parameter(q, requires_grad=False)
        layer.scale = nn.Parameter(s, requires_grad=False)
        if w.device.type == "cuda":
            del w
            # Hand the freed table back so the KV-cache sizing (free device memory) can use it.
            torch.cuda.empty_cache()

    def _rows(self, layer: VocabEmbedding, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        # One formula for lookup and reference: the gathered rows equal the dequantized table's rows.
        return (q.float() * s[:, None]).to(layer.dtype)

    def dequantize(self, layer: VocabEmbedding) -> torch.Tensor:
        """The whole table in the layer's dtype (a full-size copy: for references and tests)."""
        return self._rows(layer, layer.qweight, layer.scale)

    def embedding(self, layer: VocabEmbedding, ids: torch.Tensor) -> torch.Tensor:
        """``ids [...]`` -> ``[..., hidden]``: only the looked-up rows are dequantized."""
        flat = ids.reshape(-1)
        rows = self._rows(layer, layer.qweight.index_select(0, flat), layer.scale.index_select(0, flat))
        return rows.view(*ids.shape, layer.embedding_dim)

    def use_native_cpu_ops(self, layer: VocabEmbedding) -> None:
        """fp32 and bf16 logits on CPU through the C++ op (``cpu_native.int8_logits``) on a copy of the
        table packed sixteen rows side by side (the row-major one stays for the lookup: int8 tables
        then take two bytes an element, where a tied fp32 table and its oneDNN copy take eight).
        Measured with 2 threads, SmolLM2's 49,152 x 576 table at 1 / 8 / 32 rows: 1.6 / 2.4 / 14 ms,
        against 47 / 67 / 66 for the torch form below (the table widened, then ``F.linear``) and
        5.5 / 6.4 / 14 for the fp32 table packed for oneDNN; Gemma 3's 262,144 x 640 at 1 row: 16 ms
        against 295 and 31. bf16 rows are widened to fp32 and the logits rounded to bf16 once (torch's
        bf16 form rounds ``x @ q`` before the scale too)."""
        from lorastar.kernels import cpu_native

        if layer.qweight.device.type == "cpu" and layer.dtype in (torch.float32, torch.bfloat16):
            layer.qweight_packed = cpu_native.int8_pack(layer.qweight.data)

    def logits(self, layer: VocabEmbedding, x: torch.Tensor) -> torch.Tensor:
        """``x [rows, hidden] @ W.T -> [rows, vocab]`` in ``x.dtype``, a block of vocab rows at a time
        (fp32 and bf16 on CPU with the C++ ops: one pass over the packed table)."""
        packed = getattr(layer, "qweight_packed", None)
        if packed is not None and x.dtype in (torch.float32, torch.bfloat16) and x.dim() == 2:
            from lorastar.kernels import cpu_native

            out = cpu_native.int8_logits(x.float().contiguous(), packed, layer.scale)  # [rows, vocab] fp32
            return out if x.dtype == torch.float32 else out.to(x.dtype)
        vocab, hidden = layer.qweight.shape
        block = max(self.chunk_elems, vocab * hidden // LOGIT_BLOCKS)
        step = max(1, block // max(hidden, 1))
        out = torch.empty(x.shape[0], vocab, dtype=x.dtype, device=x.device)
        for lo in range(0, vocab, step):
            hi = min(vocab, lo + step)
            q, s = layer.qweight[lo:hi], layer.scale[lo:hi]
            if x.dtype == torch.float16:
                # x @ q alone is up to 127x the logit and can overflow fp16: scale the block first
                # (in place: fp32 product rounded to fp16, the dequantized table's values).
                out[:, lo:hi] = F.linear(x, q.to(x.dtype).mul_(s[:, None]))
            else:
                # int8 values are exact in bf16/fp32; the row scale is applied per output column
                # (in fp32, written straight into the output).
                torch.mul(F.linear(x, q.to(x.dtype)), s, out=out[:, lo:hi])
        return out


def embedding_method(name: str | None) -> type[EmbeddingMethod]:
    """The method for ``EngineConfig.embedding_quantization`` (``None``: the table as loaded); the
    model makes one instance per table."""
    if name is None:
        return UnquantizedEmbeddingMethod
    if name not in EMBEDDING_QUANT_METHODS:
        raise ValueError(
            f"embedding_quantization must be None or one of {EMBEDDING_QUANT_METHODS}, got {name!r}"
        )
    return Int8EmbeddingMethod
