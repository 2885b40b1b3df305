"""Paged decode attention on the CPU as a small C++ op, built once per machine with torch's
extension builder (``csrc/cpu_attention.cpp``; semantics there and in ``reference.ref_paged_attention``).

Why: the torch path gathers every decode row's blocks into a new tensor per layer and step
(``index_select``) and SDPA reads the copy again: at 20 concurrent SmolLM2 requests that gather was
11% and SDPA 12.6% of the step. The op reads each cached K/V byte once, straight from its block.

The build (g++ and ninja, ~20 s, cached under ``TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``)
happens on the first ``load()``; where it cannot build, ``load()`` returns ``None`` and callers keep
the torch path.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "cpu_attention.cpp"
_state: dict[str, ModuleType | None] = {}


def load() -> ModuleType | None:
    """The compiled op module (built on first call, then cached), or ``None`` if it cannot build."""
    if "ext" in _state:
        return _state["ext"]
    ext: ModuleType | None = None
    try:
        from torch.utils.cpp_extension import load_inline

        # -fopenmp: at::parallel_for is an inline `omp parallel` (torch's backend here is OpenMP); the
        # op links libgomp.so.1, which resolves to the copy torch already loaded: one thread pool.
        flags = ["-O3", "-fopenmp"]
        if os.environ.get("LORASTAR_CPU_NATIVE", "1") != "0":
            flags.append("-march=native")
        ext = load_inline(
            "lorastar_cpu_attention",
            cpp_sources=_SOURCE.read_text(),
            functions=["paged_decode"],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, no headers: keep the torch path
        log.warning("CPU paged attention op did not build (%s); using the gather + SDPA path", e)
    _state["ext"] = ext
    return ext


def paged_decode(
    q: torch.Tensor,  # [T, Hq, D] fp32
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D] fp32
    v_cache: torch.Tensor,  # [NB, BS, Hkv, D] fp32
    rows: torch.Tensor,  # [Bd] int64: the decode rows of q
    gather: torch.Tensor,  # [Bd, nblk] int64: row b's blocks from the one holding lo[b]
    lo: torch.Tensor,  # [Bd] int64: first key position row b sees
    lens: torch.Tensor,  # [Bd] int64: context length (row b sits at lens[b] - 1)
    out: torch.Tensor,  # [T, Hq, D] fp32: rows written in place
    *,
    scale: float,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Semantics: ``out[rows[b], h] = softmax(cap(scale * q[rows[b], h] @ K[lo[b]:lens[b], h // G].T))
    @ V[lo[b]:lens[b], h // G]``, K/V read block-wise from the caches (see ``csrc/cpu_attention.cpp``)."""
    ext = load()
    if ext is None:
        raise RuntimeError("the CPU paged attention op is not available on this machine")
    ext.paged_decode(q, k_cache, v_cache, rows, gather, lo, lens, out, scale, softcap)
    return out
