"""Read and validate PEFT LoRA adapter folders (adapter_config.json + adapter_model.safetensors).

Everything that would make the served output differ from PEFT's own forward is refused with an
``AdapterError`` naming the file and the problem: we never silently serve a "close enough" adapter.
The loaded weights are normalized to float32 with the LoRA scaling folded into B, so the engine
computes ``y += (x @ A.T) @ B.T`` with no per-adapter scalar.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lorastar.checkpoint_keys import KeyMap
from lorastar.errors import AdapterError

log = logging.getLogger("lorastar")

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PICKLE_NAMES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")

# The Llama-family linears an adapter may target, and the submodule each lives under: the model's
# ``supported_lora_modules`` unpacked (adapters/ sits below models/; a test pins the two together).
MODULE_GROUP: dict[str, str] = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
    # Checkpoints with fused projections (Phi-3): adapters target the fused module itself.
    "qkv_proj": "self_attn",
    "gate_up_proj": "mlp",
}
SUPPORTED_MODULES: tuple[str, ...] = tuple(MODULE_GROUP)

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# PEFT writes `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`; older/other tools
# drop the `base_model.model.` prefix or keep the adapter name (`.lora_A.default.weight`).
_KEY_RE = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(?P<layer>\d+)\.(?P<group>[A-Za-z_]\w*)\."
    r"(?P<module>[A-Za-z_]\w*)\.lora_(?P<ab>[AB])(?:\.[\w-]+)?\.weight$"
)
# Module paths of a multimodal model (transformers' LLaVA-style layout): an adapter trained on one.
_MULTIMODAL_PATH = re.compile(r"(?:^|\.)(?:language_model|vision_tower|multi_modal_projector)\.")
# VeLoRA's projection buffer (``velora_config``): only its training backward reads it; PEFT's eval
# forward is plain LoRA, so the adapter is served without it.
_TRAINING_ONLY_RE = re.compile(r"\.lora_velora_embed(?:\.[\w-]+)?$")
_LORA_MODULE_RE = re.compile(r"(?:^|\.)(?P<module>[^.]+)\.lora_(?:A|B|embedding_A|embedding_B)(?:\.|$)")

# LoraConfig fields whose truthy value changes the forward pass in a way plain LoRA serving
# cannot reproduce (or adds weights we would ignore). Value: human-readable reason.
_REFUSED_FLAGS: dict[str, str] = {
    "use_dora": "DoRA (use_dora: true) is not supported; merge it into the base or retrain as plain LoRA",
    "lora_bias": "lora_bias: true (a bias on lora_B) is not supported",
    "layer_replication": "layer_replication is not supported",
    "trainable_token_indices": "trainable_token_indices (trained embedding rows) is not supported",
    "target_parameters": "target_parameters (LoRA on raw nn.Parameters, e.g. MoE experts) is not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "use_qalora": "QA-LoRA (use_qalora: true) is not supported",
    "use_bdlora": "block-diagonal LoRA (use_bdlora) is not supported",
    "arrow_config": "Arrow routing (arrow_config) is not supported",
    "kasa_config": "KaSA (kasa_config) is not supported",
    "monteclora_config": "MonteCLoRA (monteclora_config) is not supported",
}

# init_lora_weights values whose initialization also rewrites the base weights (PEFT repeats it
# when it loads the adapter): such an adapter was trained against that changed base, so serving it
# on the shared base would be base + B.A, not what PEFT computes. Others ("gaussian", "eva",
# "orthogonal", True/False...) only set A and B before training and are served exactly.
_BASE_CHANGING_INITS: dict[str, str] = {
    "pissa": "PiSSA trains against the base less its principal components",
    "corda": "CorDA trains against the base less its initial B.A",
    "olora": "OLoRA trains against the base less its initial B.A",
    "loftq": "LoftQ trains against a quantized base",
    # PEFT's from_pretrained cannot redo it (no gradients): it silently serves base + B.A.
    "lora_ga": "LoRA-GA trains against the base less its initial B.A",
}


def _base_changing_init(value: object) -> str | None:
    """The reason a ``init_lora_weights`` value cannot be served on the shared base, or None."""
    if not isinstance(value, str):
        return None
    key = value.lower()
    key = "pissa" if key.startswith("pissa") else "corda" if key.startswith("corda") else key
    return _BASE_CHANGING_INITS.get(key)


@dataclass
class ModelSpec:
    """What an adapter must match in the base: layer count and each target's (in, out) features;
    ``key_map`` and ``unserved_lora_modules``: the model's renames of module paths and the LoRA targets
    of its unserved parts (a multimodal checkpoint served as text: ``checkpoint_keys``)."""

    num_layers: int
    module_shapes: dict[str, tuple[int, int]]
    key_map: KeyMap = field(default_factory=KeyMap)
    unserved_lora_modules: tuple[str, ...] = ()

    @classmethod
    def from_model(cls, model: Any) -> ModelSpec:
        """The spec of a built model, read off its linears in layer 0 (``model.linears()``: each has
        ``slice_names``, ``input_size``, ``output_sizes``): a fused linear's parts by their own names
        (q_proj, k_proj, ...), or only the fused name where the checkpoint itself stores the fused
        module (``model.checkpoint_fused``: Phi-3, whose adapters target qkv_proj / gate_up_proj)."""
        fused_checkpoint = bool(getattr(model, "checkpoint_fused", False))
        shapes: dict[str, tuple[int, int]] = {}
        for prefix, lin in model.linears().items():
            if prefix.split(".")[:3] != ["model", "layers", "0"]:
                continue
            outs = list(lin.output_sizes)
            if len(outs) > 1 and not fused_checkpoint:
                shapes |= {part: (lin.input_size, n) for part, n in zip(lin.slice_names, outs)}
            else:
                shapes[prefix.rpartition(".")[2]] = (lin.input_size, sum(outs))
        return cls(
            num_layers=int(model.num_layers),
            module_shapes=shapes,
            key_map=getattr(model, "key_map", KeyMap()),
            unserved_lora_modules=tuple(getattr(model, "unserved_lora_modules", ())),
        )


@dataclass
class LoRAWeights:
    """A validated adapter. ``weights[(layer, module)] = (A [r, in] fp32, B [out, r] fp32 * scaling)``.

    ``rank`` is the largest rank over the modules (they differ only with ``rank_pattern``);
    ``alpha``/``use_rslora`` are the config's header values, kept for display and hashing.
    """

    path: str
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: frozenset[str]
    content_hash: str
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    def nbytes(self) -> int:
        return sum(
            a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values()
        )


def _fail(where: Path, problem: str) -> AdapterError:
    return AdapterError(f"{where}: {problem}")


def _read_config(cfg_path: Path) -> dict[str, Any]:
    try:
        text = cfg_path.read_text(encoding="utf-8")
    except OSError as e:
        raise _fail(cfg_path, f"cannot read adapter config: {e}") from e
    try:
        cfg = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _fail(cfg_path, f"corrupt JSON in adapter config: {e}") from e
    if not isinstance(cfg, dict):
        raise _fail(cfg_path, f"adapter config must be a JSON object, got {type(cfg).__name__}")
    return cfg


def _as_number(cfg_path: Path, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _fail(cfg_path, f"{name} must be a finite number, got {value!r}")
    return float(value)


def _as_rank(cfg_path: Path, name: str, value: Any, max_rank: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(cfg_path, f"{name} must be an integer, got {value!r}")
    if value < 1:
        raise _fail(cfg_path, f"{name}={value}: rank must be >= 1")
    if value > max_rank:
        raise _fail(cfg_path, f"{name}={value} exceeds max_lora_rank={max_rank}")
    return value


def _pattern_value(patterns: dict[str, Any], key: str, default: Any) -> Any:
    # Same rule as peft.utils.other.get_pattern_key: first pattern matching a dotted suffix of the key.
    for pat, val in patterns.items():
        if re.match(rf"(.*\.)?({pat})$", key):
            return val
    return default


def _unselected(cfg: dict[str, Any], key: str) -> str | None:
    """Why PEFT would not put a LoRA layer on module ``key``, or None when it would.

    Same rule as peft's ``check_target_module_exists``: ``exclude_modules`` first, then a string
    ``target_modules`` is a full-match regex ("all-linear" in any case: every linear), a list matches
    the exact key or a dotted suffix, and ``layers_to_transform`` (``layers_pattern``) narrows a
    suffix match to those layer indices. PEFT ignores the tensors of a module it did not wrap."""
    targets, exclude = cfg["target_modules"], cfg.get("exclude_modules")
    if exclude:
        if isinstance(exclude, str):
            if re.fullmatch(exclude, key):
                return f"exclude_modules={exclude!r} excludes"
        elif key in exclude or any(key.endswith(f".{e}") for e in exclude):
            return f"exclude_modules={exclude!r} excludes"
    if isinstance(targets, str):
        if targets.lower() == "all-linear" or re.fullmatch(targets, key):
            return None
        return f"target_modules={targets!r} does not select"
    if key in targets:
        return None
    if not any(key.endswith(f".{t}") for t in targets):
        return f"target_modules={targets!r} does not select"
    layers = cfg.get("layers_to_transform")
    if layers is None or layers == []:
        return None
    pattern = cfg.get("layers_pattern")
    if not pattern:  # the first numbered segment
        m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
    else:
        for pat in [pattern] if isinstance(pattern, str) else pattern:
            if (m := re.match(rf"(?:^|.*?\.){pat}\.(?P<idx>\d+)\.", key)) is not None:
                break
    wanted = [layers] if isinstance(layers, int) else layers
    if m is None or int(m["idx"]) not in wanted:
        return f"layers_to_transform={layers!r} (layers_pattern={pattern!r}) does not select"
    return None


def _check_regex(cfg_path: Path, name: str, pattern: str, template: str = "{}") -> None:
    try:
        re.compile(template.format(pattern))
    except re.error as e:
        raise _fail(cfg_path, f"{name} regex {pattern!r} is invalid: {e}") from e


def _is_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def _validate_config(
    cfg_path: Path,
    cfg: dict[str, Any],
    supported: tuple[str, ...],
    max_rank: int,
    unserved: tuple[str, ...] = (),
) -> None:
    peft_type = cfg.get("peft_type")
    if not isinstance(peft_type, str) or peft_type.upper() != "LORA":
        raise _fail(cfg_path, f"peft_type {peft_type!r} is not supported (only LORA adapters are served)")
    for flag, reason in _REFUSED_FLAGS.items():
        if cfg.get(flag):
            raise _fail(cfg_path, f"refused: {reason}")
    init = cfg.get("init_lora_weights")
    if (why := _base_changing_init(init)) is not None:
        raise _fail(
            cfg_path,
            f"refused: init_lora_weights={init!r} ({why}; it was trained against a base changed at "
            "initialization, and the base here is shared). Convert it to a plain LoRA first: PEFT's "
            "save_pretrained(..., path_initial_model_for_weight_conversion=<the initial adapter>)",
        )
    if cfg.get("modules_to_save"):
        raise _fail(
            cfg_path,
            f"refused: modules_to_save={cfg['modules_to_save']!r} (fully trained copies of base modules "
            "cannot be shared across a multi-adapter batch)",
        )
    bias = cfg.get("bias", "none")
    if bias != "none":
        raise _fail(cfg_path, f"refused: bias={bias!r} (only bias='none' is supported)")
    targets = cfg.get("target_modules")
    if isinstance(targets, str):
        if targets.lower() != "all-linear":
            try:
                re.compile(targets)
            except re.error as e:
                raise _fail(cfg_path, f"target_modules regex {targets!r} is invalid: {e}") from e
    elif isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets):
        # A Llama-family name this model lacks (q_proj on Phi-3, qkv_proj on Llama) matches no module
        # of the HF model either: PEFT wrapped none, so it is a no-op (a tensor for it is refused below).
        unknown = sorted({t for t in targets if t.rsplit(".", 1)[-1] not in (*MODULE_GROUP, *unserved)})
        if unknown:
            raise _fail(
                cfg_path,
                f"unsupported target_modules {unknown}; supported modules: {list(supported)}",
            )
    else:
        raise _fail(
            cfg_path, f"target_modules must be a non-empty list of names or a regex string, got {targets!r}"
        )
    exclude = cfg.get("exclude_modules")
    if isinstance(exclude, str):
        _check_regex(cfg_path, "exclude_modules", exclude)
    elif exclude is not None and not _is_str_list(exclude):
        raise _fail(cfg_path, f"exclude_modules must be a list of names or a regex string, got {exclude!r}")
    layers = cfg.get("layers_to_transform")
    if layers is not None and not (_is_int_list([layers]) or _is_int_list(layers)):
        raise _fail(cfg_path, f"layers_to_transform must be an integer or a list of them, got {layers!r}")
    pattern = cfg.get("layers_pattern")
    if pattern is not None and not (isinstance(pattern, str) or _is_str_list(pattern)):
        raise _fail(cfg_path, f"layers_pattern must be a string or a list of them, got {pattern!r}")
    for pat in [pattern] if isinstance(pattern, str) else pattern or ():
        _check_regex(cfg_path, "layers_pattern", pat, r"(?:^|.*?\.){}\.(?P<idx>\d+)\.")
    _as_rank(cfg_path, "r", cfg.get("r", 8), max_rank)
    _as_number(cfg_path, "lora_alpha", cfg.get("lora_alpha", 8))
    for pname, conv in (("rank_pattern", _as_rank), ("alpha_pattern", None)):
        pat = cfg.get(pname) or {}
        if not isinstance(pat, dict):
            raise _fail(cfg_path, f"{pname} must be a mapping, got {pat!r}")
        for k, v in pat.items():
            _check_regex(cfg_path, f"{pname} key", k, r"(.*\.)?({})$")  # as PEFT matches it
            if conv is not None:
                conv(cfg_path, f"{pname}[{k!r}]", v, max_rank)
            else:
                _as_number(cfg_path, f"{pname}[{k!r}]", v)


def _read_tensors(w_path: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    try:
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(w_path), framework="pt", device="cpu") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
        return out
    except Exception as e:  # safetensors raises SafetensorError / OSError / ValueError on bad files
        raise _fail(w_path, f"corrupt or unreadable safetensors file: {e}") from e


def _content_hash(
    rank: int,
    alpha: float,
    use_rslora: bool,
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
) -> str:
    # Over the normalized (fp32, scaling folded) tensors, never the path or name: identical content
    # under two names/paths/dtypes-of-storage must dedupe, and the prefix cache keys on this.
    h = hashlib.sha256()
    h.update(f"lora|r={rank}|alpha={float(alpha)!r}|rslora={bool(use_rslora)}\n".encode())
    for layer, module in sorted(weights):
        for tag, t in zip("AB", weights[(layer, module)]):
            t = t.contiguous()
            h.update(f"{layer}.{module}.{tag}|{t.dtype}|{tuple(t.shape)}\n".encode())
            h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def load_peft_adapter(path: str | Path, spec: ModelSpec, *, max_rank: int) -> LoRAWeights:
    """Read, validate and normalize one PEFT LoRA folder for the base described by ``spec``."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise _fail(folder, "adapter folder does not exist" if not folder.exists() else "not a folder")
    folder = folder.resolve()
    cfg_path, w_path = folder / CONFIG_NAME, folder / WEIGHTS_NAME
    if not cfg_path.is_file():
        raise _fail(cfg_path, f"missing {CONFIG_NAME}")
    if not w_path.is_file():
        pickles = [n for n in PICKLE_NAMES if (folder / n).is_file()]
        if pickles:
            raise _fail(
                folder / pickles[0],
                f"refused: only safetensors are read (pickle files can run code); convert to {WEIGHTS_NAME}",
            )
        raise _fail(w_path, f"missing {WEIGHTS_NAME}")

    supported = tuple(m for m in SUPPORTED_MODULES if m in spec.module_shapes)
    cfg = _read_config(cfg_path)
    _validate_config(cfg_path, cfg, supported, max_rank, spec.unserved_lora_modules)
    r_cfg: int = cfg.get("r", 8)
    alpha_cfg = float(cfg.get("lora_alpha", 8))
    use_rslora = bool(cfg.get("use_rslora", False))
    rank_pattern: dict[str, int] = cfg.get("rank_pattern") or {}
    alpha_pattern: dict[str, float] = cfg.get("alpha_pattern") or {}

    raw = _read_tensors(w_path)
    if not raw:
        raise _fail(w_path, "no tensors in the adapter weights file")

    # Group tensors into (layer, module) -> {A, B}, refusing anything that is not a supported LoRA pair.
    pairs: dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]] = {}
    # The module path PEFT matched target_modules / rank_pattern against, where the model renames it
    # (a multimodal base: ``model.language_model.layers.0.self_attn.q_proj``).
    stored_paths: dict[tuple[int, str], str] = {}
    unserved = 0
    for key, t in raw.items():
        if _TRAINING_ONLY_RE.search(key):
            continue
        path = key.removeprefix("base_model.model.")
        served = spec.key_map(path)
        if served is None:  # LoRA on a part not served (a vision tower): no effect on text
            unserved += 1
            continue
        m = _KEY_RE.match(served)
        if m is None or m["module"] not in MODULE_GROUP or MODULE_GROUP[m["module"]] != m["group"]:
            if "lora_magnitude_vector" in key:
                raise _fail(w_path, f"refused: DoRA magnitude tensor {key!r} (DoRA is not supported)")
            if re.search(r"\.lora_[AB](?:\.[\w-]+)?\.bias$", key):
                raise _fail(w_path, f"refused: LoRA bias tensor {key!r} (lora_bias is not supported)")
            mm = _LORA_MODULE_RE.search(key)
            if mm is None:
                raise _fail(
                    w_path,
                    f"refused: tensor {key!r} is not a LoRA A/B weight (modules_to_save or other extras)",
                )
            if not spec.key_map.renames and _MULTIMODAL_PATH.search(path):  # a base served as text only
                raise _fail(
                    w_path,
                    f"tensor {key!r} adapts a multimodal model (its language_model / vision_tower paths), "
                    "and this base is a text-only model: serve the multimodal checkpoint it was trained on",
                )
            raise _fail(
                w_path,
                f"unsupported target module {mm['module']!r} (tensor {key!r}); supported modules: {list(supported)}",
            )
        layer, module = int(m["layer"]), m["module"]
        if module not in spec.module_shapes:
            raise _fail(
                w_path,
                f"unsupported target module {module!r} (tensor {key!r}); supported modules: {list(supported)}",
            )
        if layer >= spec.num_layers:
            raise _fail(
                w_path,
                f"tensor {key!r}: layer index {layer} out of range (base has {spec.num_layers} layers)",
            )
        slot = pairs.setdefault((layer, module), {})
        if m["ab"] in slot:
            raise _fail(
                w_path,
                f"duplicate lora_{m['ab']} tensor for layer {layer} {module}: {slot[m['ab']][0]!r} and {key!r}",
            )
        if t.dtype not in _FLOAT_DTYPES:
            raise _fail(
                w_path,
                f"tensor {key!r} has dtype {t.dtype}; only float16/bfloat16/float32/float64 are accepted",
            )
        slot[m["ab"]] = (key, t)
        if served != path:
            stored_paths[(layer, module)] = path.split(".lora_", 1)[0]
    if unserved:
        if not pairs:
            raise _fail(
                w_path,
                f"all {unserved} tensors adapt parts this model does not serve (the vision tower or "
                "projector of a multimodal checkpoint served as text): nothing applies to text",
            )
        log.info(
            "adapter %s: skipped %d tensors of parts not served (vision tower, projector)", folder, unserved
        )
    if not pairs:
        raise _fail(w_path, "no LoRA A/B weights in the adapter weights file")

    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    max_r = 0
    for (layer, module), ab in sorted(pairs.items()):
        missing = [x for x in "AB" if x not in ab]
        if missing:
            raise _fail(
                w_path,
                f"layer {layer} {module}: lora_{missing[0]} is missing (have {ab[next(iter(ab))][0]!r})",
            )
        (ka, a), (_, b) = ab["A"], ab["B"]
        in_f, out_f = spec.module_shapes[module]
        peft_key = stored_paths.get((layer, module), f"model.layers.{layer}.{MODULE_GROUP[module]}.{module}")
        if (why := _unselected(cfg, peft_key)) is not None:
            raise _fail(
                cfg_path,
                f"tensor {ka!r} targets {peft_key!r}, which {why} (PEFT ignores its tensors)",
            )
        r = _pattern_value(rank_pattern, peft_key, r_cfg)
        alpha = float(_pattern_value(alpha_pattern, peft_key, alpha_cfg))
        if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (r, in_f) or tuple(b.shape) != (out_f, r):
            raise _fail(
                w_path,
                f"layer {layer} {module}: shapes A {list(a.shape)}, B {list(b.shape)} do not match the base "
                f"(expected A [{r}, {in_f}], B [{out_f}, {r}] for rank {r})",
            )
        # copy=True: a float32 tensor from safe_open is a view of the file's memory map, so a file
        # rewritten in place (cp over it) would change a registered adapter's A under its hash.
        a32, b32 = a.to(torch.float32, copy=True), b.to(torch.float32)
        if not (torch.isfinite(a32).all() and torch.isfinite(b32).all()):
            raise _fail(w_path, f"layer {layer} {module}: non-finite values (NaN/inf) in the LoRA weights")
        scaling = alpha / math.sqrt(r) if use_rslora else alpha / r
        # Fold the scaling into B once here, so kernels need no per-slot scalar.
        weights[(layer, module)] = (a32.contiguous(), (b32 * scaling).contiguous())
        max_r = max(max_r, r)

    return LoRAWeights(
        path=str(folder),
        rank=max_r,
        alpha=alpha_cfg,
        use_rslora=use_rslora,
        target_modules=frozenset(mod for _, mod in weights),
        content_hash=_content_hash(r_cfg, alpha_cfg, use_rslora, weights),
        weights=weights,
    )
