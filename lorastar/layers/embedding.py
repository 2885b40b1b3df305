"""Opt-in int8 token embedding and lm_head (``EngineConfig.embedding_quantization="int8"``).

AWQ / GPTQ checkpoints keep the embedding (and a tied lm_head) 16-bit, and on a small model it is a
large share of the weights (SmolLM2-135M: the 49152 x 576 tied table is 21% of the bf16 model).
After loading, each table is replaced by per-row symmetric int8:

  ``qweight [vocab, hidden]`` int8 in -127..127, ``scale [vocab]`` fp32, ``W[v] ~= qweight[v] * scale[v]``

The lookup dequantizes only the gathered rows; the logits never build a full-precision table: the
row scale factors out of each output column, ``logits[:, v] = (x @ qweight[v]) * scale[v]``, so the
table is converted a bounded block of rows at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

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


class Int8Embedding(nn.Module):
    """An int8 table serving both as the token embedding (``forward``) and as an lm_head (``logits``).

    ``dtype`` is the model's compute dtype: what ``forward`` returns. ``qweight`` and ``scale`` are
    parameters (not buffers) so that parameter-based weight counts include them."""

    def __init__(
        self, qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, chunk_elems: int = CHUNK_ELEMS
    ) -> None:
        super().__init__()
        if qweight.dtype != torch.int8 or qweight.dim() != 2 or scale.shape != qweight.shape[:1]:
            raise ValueError(
                f"Int8Embedding needs int8 [vocab, hidden] and scale [vocab], got {qweight.dtype} "
                f"{tuple(qweight.shape)} and {tuple(scale.shape)}"
            )
        self.qweight = nn.Parameter(qweight, requires_grad=False)
        self.scale = nn.Parameter(scale.float(), requires_grad=False)
        self.dtype = dtype
        self.chunk_elems = chunk_elems

    @classmethod
    def from_float(cls, weight: torch.Tensor, chunk_elems: int = CHUNK_ELEMS) -> Int8Embedding:
        q, s = quantize_rows_int8(weight, chunk_elems)
        return cls(q, s, weight.dtype, chunk_elems)

    @property
    def num_embeddings(self) -> int:
        return self.qweight.shape[0]

    @property
    def embedding_dim(self) -> int:
        return self.qweight.shape[1]

    def _rows(self, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        # One formula for lookup and reference: the gathered rows equal the dequantized table's rows.
        return (q.float() * s[:, None]).to(self.dtype)

    def dequantize(self) -> torch.Tensor:
        """The whole table in ``dtype`` (a full-size copy: for references and tests, not serving)."""
        return self._rows(self.qweight, self.scale)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids [...]`` -> ``[..., hidden]``: only the looked-up rows are dequantized."""
        flat = input_ids.reshape(-1)
        rows = self._rows(self.qweight.index_select(0, flat), self.scale.index_select(0, flat))
        return rows.view(*input_ids.shape, self.embedding_dim)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """``x [rows, hidden] @ W.T -> [rows, vocab]`` in ``x.dtype``, a block of vocab rows at a time."""
        vocab, hidden = self.qweight.shape
        block = max(self.chunk_elems, vocab * hidden // LOGIT_BLOCKS)
        step = max(1, block // max(hidden, 1))
        out = torch.empty(x.shape[0], vocab, dtype=x.dtype, device=x.device)
        for lo in range(0, vocab, step):
            hi = min(vocab, lo + step)
            q, s = self.qweight[lo:hi], self.scale[lo:hi]
            if x.dtype == torch.float16:
                # x @ q alone is up to 127x the logit and can overflow fp16: scale the block first
                # (in place: fp32 product rounded to fp16, the dequantized table's values).
                out[:, lo:hi] = F.linear(x, q.to(x.dtype).mul_(s[:, None]))
            else:
                # int8 values are exact in bf16/fp32; the row scale is applied per output column
                # (in fp32, written straight into the output).
                torch.mul(F.linear(x, q.to(x.dtype)), s, out=out[:, lo:hi])
        return out

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 per-row, dtype={self.dtype}"


def quantize_embeddings(model: nn.Module, method: str | None) -> None:
    """Replace ``model.embed_tokens`` (and an untied ``model.lm_head`` parameter) by int8 tables,
    freeing the originals.

    A tied model keeps one shared table: ``compute_logits`` reads ``embed_tokens`` when ``lm_head`` is
    ``None``."""
    if method is None:
        return
    if method not in EMBEDDING_QUANT_METHODS:
        raise ValueError(
            f"embedding_quantization must be None or one of {EMBEDDING_QUANT_METHODS}, got {method!r}"
        )
    device = None
    embed = model.embed_tokens
    if isinstance(embed, nn.Embedding):
        device = embed.weight.device
        model.embed_tokens = Int8Embedding.from_float(embed.weight.data)
    head = model.lm_head
    if isinstance(head, torch.Tensor):
        device = head.device
        qhead = Int8Embedding.from_float(head.data)
        del model.lm_head  # unregister the parameter: nn.Module refuses a module under its name
        model.lm_head = qhead
    del embed, head  # the last references to the 16-bit tables
    if device is not None and device.type == "cuda":
        # Hand the freed tables back so the KV-cache sizing (free device memory) can use them.
        torch.cuda.empty_cache()
