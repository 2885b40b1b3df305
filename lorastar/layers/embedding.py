"""The token embedding and the lm_head: one vocab table layer, stored and multiplied by a method.

``VocabEmbedding`` is ``[vocab, hidden]``: ``forward(ids)`` looks rows up, ``logits(x)`` is the
lm_head (``x @ W.T``). A tied model uses one module for both. How the table is stored is its
``EmbeddingMethod`` (vLLM's ``VocabParallelEmbedding`` + ``quant_method``), chosen when the model is
built, as linears' quant methods are: the checkpoint fills a float ``weight`` and
``process_weights_after_loading`` turns it into the method's form (``quant/embedding_int8.py``'s
per-row int8 for ``EngineConfig.embedding_quantization="int8"``). No module is swapped afterwards.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lorastar.layers.cpu_gemm import pack, packable, packed_linear


class EmbeddingMethod:
    """How a ``VocabEmbedding`` stores its table, looks rows up and computes logits.

    Invariant: before ``process_weights_after_loading`` the layer holds a float ``weight``
    ``[vocab, hidden]`` (what the checkpoint loader fills); after it, whatever ``embedding`` and
    ``logits`` read."""

    def create_weights(self, layer: VocabEmbedding, vocab: int, hidden: int, dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(vocab, hidden, dtype=dtype), requires_grad=False)

    def process_weights_after_loading(self, layer: VocabEmbedding) -> None:
        pass

    def embedding(self, layer: VocabEmbedding, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def logits(self, layer: VocabEmbedding, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def float_weight(self, layer: VocabEmbedding) -> torch.Tensor | None:
        """The float table ``[vocab, hidden]`` the logits multiply by, or None (not stored so)."""
        return None


class UnquantizedEmbeddingMethod(EmbeddingMethod):
    """The table as loaded; on CPU the lm_head may run on a oneDNN-packed copy (``pack_for_cpu``)."""

    def embedding(self, layer: VocabEmbedding, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, layer.weight)  # [..., hidden]

    def logits(self, layer: VocabEmbedding, x: torch.Tensor) -> torch.Tensor:
        if layer.weight_packed is not None:
            return packed_linear(x, layer.weight_packed)  # [rows, vocab]
        return F.linear(x, layer.weight)  # [rows, vocab]

    def float_weight(self, layer: VocabEmbedding) -> torch.Tensor | None:
        w = layer.weight
        return w if w.numel() else None

    def pack_for_cpu(self, layer: VocabEmbedding, keep_table: bool) -> bool:
        """Prepack a CPU table for the logits (``layers/cpu_gemm.py``; dtypes: ``packable``). ``keep_table``: the
        lookup still reads the dense table (a tied embedding); else the packed copy replaces it."""
        w = layer.weight
        if w.device.type != "cpu" or not packable(w.dtype) or not w.numel():
            return False
        layer.weight_packed = pack(w.data)
        if not keep_table:
            w.data = torch.empty(0, dtype=w.dtype)
        return True


class VocabEmbedding(nn.Module):
    """A ``[vocab, hidden]`` table: the token embedding (``forward``) and an lm_head (``logits``)."""

    def __init__(
        self, vocab: int, hidden: int, dtype: torch.dtype, method: EmbeddingMethod | None = None
    ) -> None:
        super().__init__()
        self.num_embeddings = vocab
        self.embedding_dim = hidden
        self.dtype = dtype  # what forward returns
        self.weight_packed: torch.Tensor | None = None  # oneDNN-packed lm_head (CPU backend)
        self.method = method if method is not None else UnquantizedEmbeddingMethod()
        self.method.create_weights(self, vocab, hidden, dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.method.embedding(self, input_ids)  # [..., hidden]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.logits(self, x)  # [rows, vocab] in x.dtype

    def use_native_cpu_ops(self) -> None:
        """The method's C++ form where it has one (the int8 table's logits)."""
        hook = getattr(self.method, "use_native_cpu_ops", None)
        if hook is not None:
            hook(self)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, {type(self.method).__name__}, dtype={self.dtype}"
        )
