"""LoRA adapters (full-precision A/B) on AWQ, GPTQ and FP8 bases, in one mixed batch, vs the
reference: the dequantized base written as a plain HF checkpoint + PEFT (``adapter_names``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from quant_fixtures import fixture_dir, present, read_config, reference

peft = pytest.importorskip("peft")
loader = pytest.importorskip("lorastar.models.loader", reason="engine loader not available")

from transformers import AutoModelForCausalLM  # noqa: E402

from lorastar import LLM, SamplingParams  # noqa: E402
from lorastar.quant import get_quant_config  # noqa: E402
from tests.conftest import make_peft_adapters  # noqa: E402

ADAPTERS = {
    "a": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]},
    "b": {"r": 8, "lora_alpha": 16,
          "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]},
}  # fmt: skip


def dequantized_hf_dir(name: str, out: Path) -> Path:
    """Write the base as lorastar dequantizes it: a plain fp32 HF checkpoint."""
    from safetensors.torch import save_file

    cfg = read_config(name)
    model, _ = loader.load_model(
        fixture_dir(name), cfg, dtype=torch.float32, device=torch.device("cpu"),
        quant=get_quant_config(cfg, None, torch.float32), max_positions=256,
    )  # fmt: skip
    state: dict[str, torch.Tensor] = {}
    linear_params = set()
    for prefix, lin in model.linears().items():
        w = lin.quant_method.dequantized_weight(lin).float()  # [out, in]
        block = prefix.rsplit(".", 1)[0]
        offs = lin.slice_offsets()
        for i, part in enumerate(lin.slice_names):
            state[f"{block}.{part}.weight"] = w[offs[i] : offs[i + 1]].contiguous()
        linear_params.update(
            f"{prefix.removeprefix('model.')}.{n}" for n, _ in lin.named_parameters(recurse=False)
        )
    for n, p in model.named_parameters():
        if n in linear_params:
            continue
        state["lm_head.weight" if n == "lm_head" else f"model.{n}"] = p.detach().float().contiguous()
    out.mkdir(parents=True)
    save_file(state, str(out / "model.safetensors"))
    plain = {k: v for k, v in cfg.items() if k != "quantization_config"}
    plain["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(plain))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(fixture_dir(name) / f, out / f)
    return out


def make_adapters(base_dir: Path, out: Path) -> dict[str, str]:
    return make_peft_adapters(base_dir, out, ADAPTERS, seed=10)


def quantize_inputs_like_checkpoint(model: torch.nn.Module, name: str) -> int:
    """W8A8 bases (FP8, compressed-tensors int8) also quantize each base linear's input (per token,
    or with the checkpoint's static scale). Give the reference's base linears the same input
    quantization (the LoRA A/B path keeps the unquantized input, as in lorastar). Returns the
    number of hooked linears."""
    from quant_fixtures import checkpoint

    from lorastar.kernels.fp8 import FP8_MAX
    from lorastar.kernels.int8 import CT_INT8_HALF_RANGE

    ck = checkpoint(name)
    hooked = 0
    for qual, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear) or "_proj" not in qual or "lora_" in qual:
            continue
        key = qual.removeprefix("base_model.model.").removesuffix(".base_layer")
        static = ck.get(f"{key}.input_scale")

        def hook(m, args, static=static):  # noqa: ANN001, ANN202
            x = args[0]
            if name == "w8a8":  # compressed-tensors' int8 rounding: amax / 127.5, clamped
                s = x.abs().amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
                s = s / CT_INT8_HALF_RANGE
                return (torch.clamp(torch.round(x / s), -128, 127) * s,)
            if static is None:
                s = (x.abs().amax(dim=-1, keepdim=True) / FP8_MAX).to(x.dtype)
            else:
                s = static.to(x.dtype)
            q = torch.clamp(x / s, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(x.dtype) * s
            return (q,)

        mod.register_forward_pre_hook(hook)
        hooked += 1
    return hooked


@pytest.mark.parametrize(
    "name", present(("awq_g32", "gptq_act", "fp8_channel", "fp8_tensor", "w4a16_asym", "w8a8"))
)
def test_lora_on_quantized_base_matches_peft(name: str, tmp_path: Path) -> None:
    base_dir = dequantized_hf_dir(name, tmp_path / "base")
    paths = make_adapters(base_dir, tmp_path / "adapters")
    ref_base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    ref = peft.PeftModel.from_pretrained(ref_base, paths["a"], adapter_name="a")
    ref.load_adapter(paths["b"], adapter_name="b")
    ref.eval()
    if name.startswith("fp8") or name == "w8a8":
        assert quantize_inputs_like_checkpoint(ref, name) == 7 * read_config(name)["num_hidden_layers"]

    llm = LLM(model=str(fixture_dir(name)), device="cpu", dtype="float32", num_kv_blocks=64, max_loras=2,
              max_lora_rank=8, enable_prefix_caching=False)  # fmt: skip
    for n, p in paths.items():
        llm.load_adapter(n, p)
    r = reference(name)
    prompts = [r["input_ids"][i, : int(r["prompt_len"][i])].tolist() for i in range(r["input_ids"].shape[0])]
    batch = [(prompts[0], None), (prompts[0], "a"), (prompts[1], "b"), (prompts[2], "a"), (prompts[2], "b")]

    eng = llm.engine
    for p, a in batch:
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=1), adapter=a)
    out = eng.scheduler.schedule()
    assert len(out.scheduled) == len(batch)
    logits = eng.runner.execute(out, eng._adapter_slots(out)).logits
    # The dequantized base is exactly what lorastar multiplies by (FP8: with the same input
    # quantization hooked into the reference); an FP8 rounding flip may still move a logit a little.
    tol = 1e-4 if not name.startswith("fp8") else 1e-3
    worst = 0.0
    for row, (p, a) in enumerate(batch):
        with torch.no_grad():
            want = ref(input_ids=torch.tensor([p]), adapter_names=[a or "__base__"]).logits[0, -1]
        err = ((logits[row] - want).abs().max() / want.abs().max()).item()
        worst = max(worst, err)
        assert err < tol, f"{name} adapter {a}: relative logit error {err:.2e}"
    print(f"{name}: LoRA on quantized base vs dequantized base + PEFT: max relative logit error {worst:.2e}")
    assert not torch.allclose(logits[0], logits[1])  # the adapter changes the output
    for rid in list(eng.requests):
        eng.abort_request(rid)
