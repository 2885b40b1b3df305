"""Load a Llama-family model from an HF folder (single or sharded safetensors), quant-aware."""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from lorastar.checkpoint_keys import KeyMap
from lorastar.hub import adapter_hint
from lorastar.layers.embedding import EmbeddingMethod, VocabEmbedding
from lorastar.layers.linear import Linear, load_shard
from lorastar.models.llama import LlamaForCausalLM
from lorastar.models.registry import check_architecture, model_class
from lorastar.quant.base import QuantConfig
from lorastar.quant.kv_cache import KVScales

logger = logging.getLogger(__name__)

# RoPE buffers some checkpoints store (ColossalAI's cos/sin caches too): vLLM skips them.
_IGNORED = re.compile(r"rotary_emb\.(inv_freq|cos_cached|sin_cached)$")


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"model folder {str(model_dir)!r} has no config.json{adapter_hint(model_dir)}")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: not a JSON object")
    cfg.setdefault("model_type", "llama")
    check_architecture(cfg)  # a multimodal architecture not listed fails here, naming what is
    cfg = model_class(cfg).text_config(cfg)
    if "text_config" in cfg and "hidden_size" not in cfg:
        raise ValueError(f"{path}: multimodal configs are not supported")
    return cfg


# The model dtypes by name (EngineConfig.dtype, config.json's dtype / torch_dtype).
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def checkpoint_dtype(cfg: dict[str, Any]) -> torch.dtype:
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return DTYPES.get(str(name).replace("torch.", ""), torch.float32)


def safetensors_files(model_dir: str | Path) -> list[Path]:
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({d / f for f in weight_map.values()})
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index}: not a safetensors index (no valid weight_map: {e!r})") from e
        single = d / "model.safetensors"
        if single.is_file() and not all(f.is_file() for f in files):
            # save_pretrained over a sharded save leaves the old index: transformers reads the file
            logger.warning("%s lists shards that are gone: reading %s, as transformers does", index, single)
            files = [single]
    else:
        files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model folder {str(d)!r} has no .safetensors weights (only safetensors are read)")
    for f in files:
        if not f.is_file():
            raise ValueError(f"missing checkpoint shard {f}")
    return files


class WeightLoader:
    """Routes checkpoint tensors into the model's (fused, possibly quantized) parameters.

    Each linear's checkpoint modules are its slice names (from the model's
    ``packed_modules_mapping``): ``{block}.q_proj.*`` goes to shard 0 of ``{block}.qkv_proj``. A
    checkpoint that stores the fused tensor itself (Phi-3's ``qkv_proj`` / ``gate_up_proj``) fills
    every shard at once."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self.linears = model.linears()
        self._route: dict[str, tuple[Linear, int | None]] = {}  # checkpoint module -> (layer, shard)
        for prefix, layer in self.linears.items():
            block = prefix.rpartition(".")[0]
            fused = len(layer.slice_names) > 1
            for i, part in enumerate(layer.slice_names):
                self._route[f"{block}.{part}"] = (layer, i if fused else None)
            if fused:
                self._route.setdefault(prefix, (layer, None))  # the fused tensor, all shards
        self.kv_scales = KVScales(model.num_layers)
        self._plain = {n: p for n, p in model.named_parameters() if not _is_linear_param(n)}
        self._loaded_plain: set[str] = set()

    def load(self, name: str, tensor: torch.Tensor) -> None:
        stored, served = name, self.model.key_map(name)
        if served is None:  # a part not served (a multimodal checkpoint's vision tower)
            return
        name = served
        if _IGNORED.search(name):
            return
        if self.kv_scales.add(name, tensor):
            return
        module, _, suffix = name.rpartition(".")
        route = self._route.get(module)
        if route is not None:
            if suffix == "bias" and route[0].bias is None and not tensor.any():
                return  # AutoGPTQ stores zero biases for bias-free linears: vLLM skips them too
            route[0].weight_loader(suffix, tensor, route[1], name)
            return
        target = name if name.startswith("lm_head.") else name.removeprefix("model.")
        if target == "lm_head.weight" and self.model.tie_word_embeddings:
            return  # tied embeddings: some checkpoints still store a copy
        param = self._plain.get(target)
        if param is None:
            raise ValueError(f"unexpected tensor {stored!r} in checkpoint")
        load_shard(param, [], tensor, None, name)
        self._loaded_plain.add(target)

    def finish(self) -> None:
        missing = sorted(set(self._plain) - self._loaded_plain)
        if missing:  # named as the checkpoint names them (the decoder's under ``model.``)
            names = [n if n.startswith("lm_head.") else f"model.{n}" for n in missing[:5]]
            raise ValueError(f"checkpoint is missing tensor(s): {', '.join(names)}")
        self._plain.clear()  # a method may replace a parameter (and free it) below
        for table in self.model.modules():  # each module once: a tied table is one module
            if isinstance(table, VocabEmbedding):
                table.method.process_weights_after_loading(table)
        for prefix, layer in self.linears.items():
            fused = len(layer.output_sizes) > 1
            want = set(range(len(layer.output_sizes))) if fused else {None}
            for pname, p in layer.named_parameters(recurse=False):
                if not hasattr(p, "output_dim"):  # not a checkpoint tensor (derived by the method)
                    continue
                loaded = getattr(p, "loaded_shards", set())
                if fused and None in loaded and len(loaded) > 1:  # one would silently overwrite the other
                    raise ValueError(
                        f"checkpoint has both the fused {prefix}.{pname} and its parts "
                        f"({', '.join(layer.slice_names)}): keep one"
                    )
                lost = set() if None in loaded else want - loaded  # None: loaded fused, whole
                if lost:
                    block = prefix.rsplit(".", 1)[0]
                    names = [f"{block}.{layer.slice_names[s or 0]}.{pname}" for s in sorted(lost, key=str)]
                    raise ValueError(f"checkpoint is missing tensor(s): {', '.join(names)}")
            layer.quant_method.process_weights_after_loading(layer)


def _stores_its_own_lm_head(names: dict[Path, list[str]], key_map: KeyMap) -> bool:
    """Whether a checkpoint whose config ties the embeddings stores an lm_head that differs from its
    embed_tokens. transformers (5.x) then leaves them untied: Mistral 3's config class defaults the
    top-level ``tie_word_embeddings`` to true, so a fine-tune of Mistral Small 3.1 saved by it says
    "tied" beside the model's own lm_head. A stored copy equal to the table (some checkpoints keep
    one) stays tied. Reads the two tables only when both are stored."""
    where: dict[str, tuple[Path, str]] = {}
    for f, keys in names.items():
        for name in keys:
            served = key_map(name)
            if served in ("lm_head.weight", "model.embed_tokens.weight"):
                where[served] = (f, name)
    if len(where) < 2:
        return False
    tables = []
    for f, name in where.values():
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            tables.append(sf.get_tensor(name))
    return tables[0].shape != tables[1].shape or not torch.equal(tables[0], tables[1])


def _bare_backbone(names: dict[Path, list[str]]) -> bool:
    """Whether the checkpoint stores a decoder without its ``model.`` prefix and without an lm_head
    (``embed_tokens.weight``, ``layers.*``, ``norm.weight``): Qwen3-Embedding's released checkpoints,
    and sentence-transformers' save of a decoder backbone. vLLM loads them under ``model.`` for its
    pooling runner; so does this loader."""
    keys = [k for ks in names.values() for k in ks]
    return "embed_tokens.weight" in keys and not any(k.startswith(("model.", "lm_head.")) for k in keys)


def _lfs_hint(f: Path) -> str:
    """A hint where ``f`` is a Git LFS pointer (a repo cloned without git-lfs), else ''."""
    with open(f, "rb") as fh:
        head = fh.read(64)
    return (
        "; it is a Git LFS pointer: run `git lfs pull`" if head.startswith(b"version https://git-lfs") else ""
    )


def _is_linear_param(name: str) -> bool:
    return bool(re.search(r"_proj\.", name))


def load_model(
    model_dir: str | Path,
    cfg: dict[str, Any],
    *,
    dtype: torch.dtype,
    device: torch.device,
    quant: QuantConfig | None,
    max_positions: int,
    embedding_method: Callable[[], EmbeddingMethod] | None = None,
) -> tuple[LlamaForCausalLM, KVScales]:
    """Build the model on ``device`` and fill it from the folder's safetensors.

    Returns the model and any per-layer KV-cache scales the checkpoint declares.
    ``embedding_method``: how the embedding / lm_head tables are stored (None: as loaded).
    """
    files = safetensors_files(model_dir)
    names: dict[Path, list[str]] = {}  # headers only: the tie check and the bar's total
    for f in files:
        with (
            contextlib.suppress(OSError, RuntimeError, SafetensorError),  # reported by the load below
            safe_open(str(f), framework="pt", device="cpu") as sf,
        ):
            names[f] = list(sf.keys())
    cls = model_class(cfg)
    bare = _bare_backbone(names)
    if bare:
        logger.info(
            "%s: a decoder stored without the 'model.' prefix (an embedding model's backbone)", model_dir
        )
        if not cfg.get("tie_word_embeddings"):
            logger.warning(
                "%s: the checkpoint stores no lm_head (an embedding model): its embeddings are exact, "
                "and the embedding table stands in for the lm_head, so generated text means nothing",
                model_dir,
            )
            cfg = {**cfg, "tie_word_embeddings": True}
    if cfg.get("tie_word_embeddings") and _stores_its_own_lm_head(names, cls.key_map):
        logger.warning(
            "%s: config.json ties the lm_head to embed_tokens but the checkpoint stores a different "
            "lm_head: serving it untied, as transformers loads it",
            model_dir,
        )
        cfg = {**cfg, "tie_word_embeddings": False}
    with torch.device(device):
        model = cls(cfg, dtype, quant, max_positions, embedding_method)
    loader = WeightLoader(model)
    total = sum(len(k) for k in names.values())
    # A per-tensor bar on a terminal (tqdm's disable=None: off when stderr is not a TTY, e.g. logs).
    bar = tqdm(total=total, desc=f"Loading {Path(model_dir).name}", unit="tensor", disable=None)
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                for name in sf.keys():
                    loader.load(f"model.{name}" if bare else name, sf.get_tensor(name).to(device))
                    bar.update()
        except (OSError, RuntimeError, SafetensorError) as e:  # safetensors raises these for corrupt files
            if isinstance(e, SafetensorError) or "safetensors" in str(e).lower():
                raise ValueError(f"{f}: corrupt safetensors file ({e}){_lfs_hint(f)}") from e
            raise
    bar.close()
    loader.finish()
    model.eval()
    return model, loader.kv_scales
