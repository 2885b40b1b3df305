"""Helpers shared by the quantization methods."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import torch

from lorastar.checkpoint_keys import KeyMap

T = TypeVar("T")

# Bound on the temporary dequantized tile on the CPU path (elements): no full-precision copy of a
# layer is ever kept, and even the per-call temporary stays small for big layers.
_CHUNK_ELEMS = 1 << 24


def unfused_prefixes(prefix: str, packed: Mapping[str, Sequence[str]]) -> list[str]:
    """``model.layers.0.self_attn.qkv_proj`` -> the q/k/v module names (``packed``: the model's
    ``packed_modules_mapping``); other prefixes unchanged."""
    head, _, last = prefix.rpartition(".")
    parts = packed.get(last)
    if parts is None:
        return [prefix]
    return [f"{head}.{p}" if head else p for p in parts]


def regex_names(name: str, key_map: KeyMap) -> tuple[str, ...]:
    """What a config's regex is matched against for the served layer ``name``: the name, then the
    checkpoint's names of it (``KeyMap.sources``: ``language_model.model.layers.0.mlp``), which vLLM
    keeps in its module names."""
    if not key_map.renames:
        return (name,)
    return tuple(n[:-1] for n in key_map.sources(name + "."))


def regex_match(pattern: str, name: str, key_map: KeyMap) -> bool:
    """``re.match`` of ``pattern`` on the served layer ``name`` or on a checkpoint name of it."""
    return any(re.match(pattern, n) for n in regex_names(name, key_map))


def _matches(name: str, pattern: str, key_map: KeyMap) -> bool:
    if pattern.startswith("re:"):
        return regex_match(pattern[3:], name, key_map)
    # Plain names match a whole dotted component run (vLLM/transformers convention).
    return name == pattern or name.endswith("." + pattern) or ("." + pattern + ".") in ("." + name + ".")


def fused_lookup(
    prefix: str, packed: Mapping[str, Sequence[str]], lookup: Callable[[str], T | None], mixed: str
) -> T | None:
    """``lookup`` of the layer at ``prefix``: the value its parts share (a fused layer's q/k/v), or,
    when none of them has one (None), the fused module's own (checkpoints that store it fused and
    configs that name it: Phi-3's ``qkv_proj``). Parts that disagree cannot be served fused: a
    ValueError saying ``mixed`` (formatted with ``parts``)."""
    parts = unfused_prefixes(prefix, packed)
    found = [lookup(p) for p in parts]
    if parts != [prefix] and all(f is None for f in found):
        return lookup(prefix)
    if any(f != found[0] for f in found):
        raise ValueError(f"{prefix}: {mixed.format(parts=parts)}; cannot fuse them")
    return found[0]


def is_skipped(
    prefix: str, skip: list[str], packed: Mapping[str, Sequence[str]], key_map: KeyMap = KeyMap()
) -> bool:
    """Whether the layer at ``prefix`` is left unquantized by the checkpoint's ignore list: all of a
    fused layer's parts or none (``fused_lookup``). ``re:`` entries also match the checkpoint's names
    of the layer (``regex_names``)."""
    if not skip:
        return False

    def listed(name: str) -> bool | None:
        return True if any(_matches(name, s, key_map) for s in skip) else None

    return fused_lookup(prefix, packed, listed, "the checkpoint quantizes only some of {parts}") is True


def served_name(entry: str, key_map: KeyMap) -> str:
    """A plain layer name of a config (the checkpoint's: ``language_model.model.layers.0.mlp``) as the
    served model names it; ``re:`` patterns and names of unserved parts unchanged (vLLM's
    ``apply_vllm_mapper``)."""
    if entry.startswith("re:"):
        return entry
    served = key_map(entry + ".")
    return entry if served is None else served[:-1]


def served_names(entries: Sequence[str], key_map: KeyMap) -> list[str]:
    """``served_name`` of each entry of a skip / ignore list."""
    return [served_name(e, key_map) for e in entries]


def target_lookup(
    name: str, by_target: Mapping[str, T], by_class: bool = True, key_map: KeyMap = KeyMap()
) -> T | None:
    """compressed-tensors' (and vLLM's) target precedence, whatever the group order: a layer-name
    target (served names), then a ``re:`` one (served or checkpoint names: ``regex_names``), then
    the class ``Linear`` (unless not ``by_class``). ``by_target``: target -> value, a target
    repeated in a later group being that group's."""
    for t in by_target:
        if not t.startswith("re:") and t != "Linear" and (name == t or name.endswith("." + t)):
            return by_target[t]
    names = regex_names(name, key_map)
    for t in by_target:
        if t.startswith("re:") and any(re.match(t[3:], n) for n in names):
            return by_target[t]
    return by_target.get("Linear") if by_class else None


def target_fused_lookup(
    prefix: str, packed: Mapping[str, Sequence[str]], lookup: Callable[[str, bool], T | None], mixed: str
) -> T | None:
    """``fused_lookup`` of a ``target_lookup`` (``lookup(name, by_class)``): when no target names a
    part, a fused checkpoint's module (Phi-3's ``qkv_proj``) may be named itself, which wins over
    the class target ``Linear`` that every part matches."""
    parts = unfused_prefixes(prefix, packed)
    if parts != [prefix] and all(lookup(p, False) is None for p in parts):
        return lookup(prefix, True)
    return fused_lookup(prefix, packed, lambda name: lookup(name, True), mixed)


def adopt_scales_dtype(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Keep group scales in the checkpoint's own float dtype (fp16 for AutoAWQ / GPTQ): the weight is
    dequantized in that dtype, exactly as the tools that wrote it do (and as transformers runs it)."""
    if (
        loaded.dtype.is_floating_point
        and loaded.element_size() > 1
        and loaded.dtype != param.dtype
        and not getattr(param, "loaded_shards", None)
    ):
        param.data = param.data.to(loaded.dtype)


def matmul_dequant_chunked(
    x: torch.Tensor,  # [M, K]
    n_out: int,
    align: int,
    dequant: Callable[[int, int], torch.Tensor],  # (lo, hi) -> W[:, lo:hi] as [K, hi - lo]
) -> torch.Tensor:
    """``x @ W`` where ``W`` is dequantized a block of output columns at a time."""
    k = x.shape[1]
    step = max(align, (_CHUNK_ELEMS // max(k, 1)) // align * align)
    if step >= n_out:
        return x @ dequant(0, n_out)
    out = torch.empty(x.shape[0], n_out, dtype=x.dtype, device=x.device)
    for lo in range(0, n_out, step):
        hi = min(n_out, lo + step)
        out[:, lo:hi] = x @ dequant(lo, hi)
    return out
