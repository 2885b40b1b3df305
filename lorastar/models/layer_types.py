"""Which layers attend through a sliding window, read from an HF config (one rule for every family)."""

from __future__ import annotations

from typing import Any


def layer_windows(cfg: dict[str, Any]) -> list[int]:
    """Per-layer sliding window in tokens (0: full attention), as transformers builds its masks.

    transformers 5 writes ``layer_types`` ("sliding_attention" / "full_attention"); older configs
    imply them: Mistral windows every layer when ``sliding_window`` is set; Qwen2/Qwen3 only with
    ``use_sliding_window``, from layer ``max_window_layers`` on; Gemma 2 alternates (even layers
    local); Gemma 3 makes every ``sliding_window_pattern``-th layer global. Llama, Granite and OLMo 2
    attend fully whatever ``sliding_window`` says unless ``layer_types`` name windowed layers
    (transformers' modeling never reads the field; vLLM reads it only through ``layer_types``).
    """
    n = int(cfg["num_hidden_layers"])
    window = int(cfg.get("sliding_window") or 0)
    model_type = cfg.get("model_type", "llama")
    if model_type in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        window = 0
    if model_type in ("llama", "granite", "olmo2") and not cfg.get("layer_types"):
        window = 0
    if window <= 0:
        return [0] * n
    types = cfg.get("layer_types")
    if not types:
        if model_type in ("qwen2", "qwen3"):
            first = int(cfg.get("max_window_layers", n))
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
        elif model_type == "gemma2":
            types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
        elif model_type in ("gemma3", "gemma3_text"):
            pattern = int(cfg.get("sliding_window_pattern", 6))
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
        else:
            types = ["sliding_attention"] * n
    if len(types) != n:
        raise ValueError(f"config has {len(types)} layer_types for {n} layers")
    return [window if t == "sliding_attention" else 0 for t in types]


def uniform_window(windows: list[int]) -> int:
    """The window every layer shares (0 if any layer attends fully): blocks before it can be freed."""
    return windows[0] if windows and windows[0] > 0 and all(w == windows[0] for w in windows) else 0
