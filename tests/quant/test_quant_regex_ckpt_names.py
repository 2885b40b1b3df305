"""``re:`` entries of quantization configs that name a multimodal checkpoint's prefix
(``re:.*language_model.*``): vLLM keeps that prefix in its module names, so such regexes match
there; the served model drops it, so they are matched against the checkpoint's names too."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file
from test_compressed_int_review import W4, W8, Scheme, _assert_same_logits, _group, _qconfig, _write_pair
from test_quant_names_review import MM_SKIP, Tensors, _act, _ct_fp8, _load, _write, fp8_channel, gptq

from lorastar.checkpoint_keys import LLAVA_LAYOUT, KeyMap
from lorastar.kernels.fp8 import ACT_TOKEN
from lorastar.layers.linear import UnquantizedLinearMethod
from lorastar.quant.compressed_int import CompressedTensorsWNA16LinearMethod
from lorastar.quant.gptq import GPTQLinearMethod
from lorastar.quant.utils import is_skipped, regex_names, target_lookup

LAYER0_MLP = r"re:^language_model\.model\.layers\.0\.mlp\..*"


def _original(src: str, prefix: str, parts: tuple[str, ...]) -> torch.Tensor:
    t = load_file(str(Path(src) / "model.safetensors"))
    return torch.cat([t[f"{prefix}.{p}.weight"] for p in parts]).to(torch.float16)


def test_regexes_see_the_checkpoint_names_of_a_served_layer() -> None:
    assert regex_names("model.layers.0.mlp.down_proj", LLAVA_LAYOUT) == (
        "model.layers.0.mlp.down_proj",
        "model.language_model.layers.0.mlp.down_proj",
        "language_model.model.layers.0.mlp.down_proj",
    )
    assert regex_names("lm_head", LLAVA_LAYOUT) == ("lm_head", "language_model.lm_head")
    assert regex_names("model.layers.0.mlp", KeyMap()) == ("model.layers.0.mlp",)
    down = "model.layers.0.mlp.down_proj"
    assert is_skipped(down, [LAYER0_MLP], {}, LLAVA_LAYOUT)
    assert not is_skipped(down, ["re:.*vision_tower.*", "re:multi_modal_projector.*"], {}, LLAVA_LAYOUT)
    assert is_skipped("lm_head", ["re:.*lm_head"], {}, LLAVA_LAYOUT)
    by_target = {"re:.*vision_tower.*": 1, "re:.*language_model.*down_proj$": 2, "Linear": 3}
    assert target_lookup(down, by_target, True, LLAVA_LAYOUT) == 2
    assert target_lookup("model.layers.0.self_attn.o_proj", by_target, True, LLAVA_LAYOUT) == 3


def test_compressed_int_prefixed_regexes_in_targets_and_ignore(
    tiny_model_dir: Callable[[str], str], tmp_path: Path
) -> None:
    """Mistral 3: a W8 group targets ``re:.*language_model.*o_proj$``, ``ignore`` skips layer 0's MLP
    by a ``re:^language_model\\.model\\.`` regex; logits equal the dequantized reference's."""

    def scheme_of(module: str) -> Scheme | None:
        if module.startswith(MM_SKIP) or module.startswith("language_model.model.layers.0.mlp."):
            return None
        return W8 if module.endswith("o_proj") else W4

    groups = [_group(W4, ["Linear"]), _group(W8, [r"re:.*language_model.*self_attn\.o_proj$"])]
    ignore = ["re:.*lm_head", "re:.*vision_tower.*", "re:multi_modal_projector.*", LAYER0_MLP]
    qdir, rdir = _write_pair(tiny_model_dir("mistral3-mm"), tmp_path, scheme_of, _qconfig(groups, ignore))
    model = _assert_same_logits(qdir, rdir)
    for proj in (model.layers[0].mlp.down_proj, model.layers[0].mlp.gate_up_proj):
        assert isinstance(proj.quant_method, UnquantizedLinearMethod)
    assert model.layers[1].mlp.down_proj.quant_method.scheme.bits == 4
    for layer in model.layers:
        assert layer.self_attn.o_proj.quant_method.scheme.bits == 8
        assert isinstance(layer.self_attn.qkv_proj.quant_method, CompressedTensorsWNA16LinearMethod)
        assert layer.self_attn.qkv_proj.quant_method.scheme.bits == 4


def test_fp8_compressed_tensors_prefixed_regex_ignore(
    tiny_model_dir: Callable[[str], str], tmp_path: Path
) -> None:
    """FP8_DYNAMIC on ``Linear``; ``ignore`` skips layer 1's attention by its checkpoint name."""
    src = tiny_model_dir("mistral3-mm")
    attn = "language_model.model.layers.1.self_attn"

    def quantize(module: str) -> Callable[[torch.Tensor], Tensors] | None:
        return None if module.startswith((*MM_SKIP, attn + ".")) else fp8_channel

    ignore = ["re:.*lm_head", "re:.*vision_tower.*", "re:.*multi_modal_projector.*", rf"re:^{attn}\..*"]
    model = _load(_write(src, tmp_path / "q", quantize, _ct_fp8([(["Linear"], False)], ignore)))
    qkv = model.layers[1].self_attn.qkv_proj
    assert isinstance(qkv.quant_method, UnquantizedLinearMethod)
    assert torch.equal(qkv.weight, _original(src, attn, ("q_proj", "k_proj", "v_proj")))
    assert isinstance(model.layers[1].self_attn.o_proj.quant_method, UnquantizedLinearMethod)
    assert _act(model.layers[0].self_attn.qkv_proj) == ACT_TOKEN
    assert _act(model.layers[1].mlp.down_proj) == ACT_TOKEN


def test_gptq_dynamic_negative_regex_names_the_checkpoint_prefix(
    tiny_model_dir: Callable[[str], str], tmp_path: Path
) -> None:
    """gptqmodel ``dynamic``: ``-:`` on ``language_model.model.layers.1.mlp`` leaves it unquantized."""
    src = tiny_model_dir("mistral3-mm")
    mlp = "language_model.model.layers.1.mlp"

    def quantize(module: str) -> Callable[[torch.Tensor], Tensors] | None:
        return None if module.startswith((*MM_SKIP, mlp + ".")) else gptq

    qc = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True,
          "checkpoint_format": "gptq", "modules_to_not_convert": ["vision_tower", "multi_modal_projector"],
          "dynamic": {rf"-:.*{mlp}\..*": {}}}  # fmt: skip
    model = _load(_write(src, tmp_path / "q", quantize, qc))
    down = model.layers[1].mlp.down_proj
    assert isinstance(down.quant_method, UnquantizedLinearMethod)
    assert torch.equal(down.weight, _original(src, mlp, ("down_proj",)))
    assert isinstance(model.layers[0].mlp.down_proj.quant_method, GPTQLinearMethod)
