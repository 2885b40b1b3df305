"""lorastar: serve one base LLM with many LoRA adapters, inside a Litestar app."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# OpenMP threads that spin while waiting collapse throughput when the cores are shared
# (measured on 2 busy cores: 2.7 tok/s spinning vs 30.1 passive). libgomp reads this when torch
# loads it, so it only takes effect if lorastar is imported before torch; the user's value wins.
# ``lorastar serve`` / ``lorastar engine`` own their cores and add a brief spin (__main__.py).
_USER_OPENMP_ENV = {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ}
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "AsyncLLM",
    "SamplingParams",
    "RequestOutputKind",
    "RequestOutput",
    "CompletionOutput",
    "EngineConfig",
    "Logprob",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
]

if TYPE_CHECKING:
    from lorastar.config import EngineConfig
    from lorastar.engine.async_engine import AsyncLLM
    from lorastar.engine.llm import LLM
    from lorastar.engine.outputs import (
        BeamSearchOutput,
        BeamSearchSequence,
        CompletionOutput,
        EmbeddingOutput,
        EmbeddingRequestOutput,
        Logprob,
        RequestOutput,
    )
    from lorastar.engine.sampling import BeamSearchParams, RequestOutputKind, SamplingParams

_LAZY = {
    "LLM": "lorastar.engine.llm",
    "AsyncLLM": "lorastar.engine.async_engine",
    "SamplingParams": "lorastar.engine.sampling",
    "RequestOutputKind": "lorastar.engine.sampling",
    "RequestOutput": "lorastar.engine.outputs",
    "CompletionOutput": "lorastar.engine.outputs",
    "Logprob": "lorastar.engine.outputs",
    "EngineConfig": "lorastar.config",
    "BeamSearchParams": "lorastar.engine.sampling",
    "BeamSearchOutput": "lorastar.engine.outputs",
    "BeamSearchSequence": "lorastar.engine.outputs",
    "EmbeddingOutput": "lorastar.engine.outputs",
    "EmbeddingRequestOutput": "lorastar.engine.outputs",
}


def __getattr__(name: str) -> Any:  # lazy: `import lorastar` stays cheap (no torch until used)
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lorastar' has no attribute {name!r}")
