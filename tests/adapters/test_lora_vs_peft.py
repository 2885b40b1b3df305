"""A mixed batch (base rows + four adapters of different ranks and targets) equals PEFT."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from peft import PeftModel

from lorastar import LLM, SamplingParams
from lorastar.kernels.lora import lora_shrink
from tests.conftest import hf_model, make_peft_adapters

ADAPTERS = {
    "a": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "b": dict(r=8, lora_alpha=16, use_rslora=True,
              target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "c": dict(r=16, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "d": dict(r=2, lora_alpha=32, target_modules=["k_proj", "o_proj"]),
}  # fmt: skip


_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
          "up_proj": "gate_up_proj"}  # fmt: skip


def _targets_of(base: torch.nn.Module, names: list[str]) -> list[str]:
    """The same targets on a base whose checkpoint fuses q/k/v and gate/up (Phi-3): the fused modules."""
    layers = getattr(base.model, "layers", None)  # None: a multimodal model (its language_model's)
    if layers is None or not hasattr(layers[0].self_attn, "qkv_proj"):
        return names
    return sorted({_FUSED.get(n, n) for n in names})


def make_adapters(base_dir: str, out: Path, scale: float = 0.3) -> dict[str, str]:
    return make_peft_adapters(base_dir, out, ADAPTERS, seed=100, scale=scale, map_targets=_targets_of)


def peft_reference(base_dir: str, paths: dict[str, str]) -> PeftModel:
    base = hf_model(base_dir, torch.float32)
    names = list(paths)
    model = PeftModel.from_pretrained(base, paths[names[0]], adapter_name=names[0])
    for n in names[1:]:
        model.load_adapter(paths[n], adapter_name=n)
    return model.eval()


def peft_greedy(model: PeftModel, prompt: list[int], adapter: str | None, n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
        do_sample=False, pad_token_id=0, adapter_names=[adapter or "__base__"],
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def peft_last_logits(model: PeftModel, prompt: list[int], adapter: str | None) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([prompt]), adapter_names=[adapter or "__base__"]).logits[0, -1]


@pytest.mark.parametrize(
    "name",
    [
        "llama-gqa",
        "qwen2",
        "qwen3",
        "mistral-window",
        "gemma2",
        "gemma3",
        "gemma3-mm",
        "mistral3-mm",
        "ministral3-mm",
        "smollm3",
        "granite",
        "olmo2",
        "olmo3",
        "phi3",
        "phi4-mini",
    ],
)
def test_mixed_batch_matches_peft(tiny_model_dir, tmp_path: Path, name: str) -> None:
    base_dir = tiny_model_dir(name)
    paths = make_adapters(base_dir, tmp_path)
    ref = peft_reference(base_dir, paths)
    # phi4-mini: short LongRoPE factors, as transformers uses them below 64 tokens (layers/rotary.py).
    extra = {"max_model_len": 64} if name == "phi4-mini" else {}
    llm = LLM(base_dir, num_kv_blocks=256, max_loras=4, max_lora_rank=16, **extra)
    for n, p in paths.items():
        llm.load_adapter(n, p)
    rng = random.Random(7)
    order = [None, "a", "b", "c", "d", "a", None, "c", "b", "d"]
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randrange(1, 40))] for _ in order]

    # Logits at the last prompt token, all rows in one forward pass.
    eng = llm.engine
    for p, a in zip(prompts, order):
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=1), adapter=a)
    out = eng.scheduler.schedule()
    assert len(out.scheduled) == len(prompts)
    logits = eng.runner.execute(out, eng._adapter_slots(out)).logits
    if name.startswith("phi"):  # fused-module LoRA: on CPU one shrink serves q/k/v (gate/up)
        fused = [lora for _, lora in eng.lora_state.slots if len(lora.slice_names) > 1]
        targeted = [lora for lora in fused if any(lora.slot_slices)]
        assert targeted and all(any(lora.slot_shared_a) for lora in targeted)
    for row, (p, a) in enumerate(zip(prompts, order)):
        want = peft_last_logits(ref, p, a)
        torch.testing.assert_close(logits[row], want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    for rid in list(eng.requests):
        eng.abort_request(rid)

    # Greedy generation, token for token.
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), adapter=order)
    for p, a, o in zip(prompts, order, outs):
        assert o.outputs[0].token_ids == peft_greedy(ref, p, a, 8), f"adapter {a}"
    same_prompt = llm.generate(
        [prompts[0]] * 5, SamplingParams(temperature=0, max_tokens=8), adapter=order[:5]
    )
    assert len({tuple(o.outputs[0].token_ids) for o in same_prompt}) > 1  # adapters change outputs
    eng.check_invariants()
    assert llm.kv_cache_usage()["num_used_blocks"] == 0


def test_smollm2_mixed_adapters_match_peft(tmp_path: Path) -> None:
    from lorastar.models.default import default_model_dir

    base_dir = str(default_model_dir())
    paths = make_adapters(base_dir, tmp_path, scale=0.05)
    ref = peft_reference(base_dir, paths)
    llm = LLM(num_kv_blocks=128, max_loras=4, max_lora_rank=16)
    for n, p in paths.items():
        llm.load_adapter(n, p)
    tok = llm.tokenizer
    order = [None, "a", "b", "c", "d"]
    prompts = [tok("The capital of France is")["input_ids"]] * len(order)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), adapter=order)
    for p, a, o in zip(prompts, order, outs):
        assert o.outputs[0].token_ids == peft_greedy(ref, p, a, 6), f"adapter {a}"
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) > 1  # adapters change outputs


def _gpu_layout_llm(
    base_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, max_loras: int
) -> tuple[LLM, PeftModel]:
    """An engine on CPU with the GPU slot layout (``GpuLoRASlots``, its Triton kernels interpreted)
    and the four adapters loaded, and their PEFT reference."""
    import lorastar.layers.lora as lora_layers

    monkeypatch.setattr(lora_layers, "lora_slots_class", lambda device: lora_layers.GpuLoRASlots)
    paths = make_adapters(base_dir, tmp_path)
    # cpu_gemm="torch": oneDNN's packed weights (CPU only) cannot be stacked
    llm = LLM(base_dir, num_kv_blocks=64, max_loras=max_loras, max_lora_rank=16, cpu_gemm="torch")
    for n, p in paths.items():
        llm.load_adapter(n, p)
    assert all(isinstance(lora, lora_layers.GpuLoRASlots) for _, lora in llm.engine.lora_state.slots)
    return llm, peft_reference(base_dir, paths)


@pytest.mark.parametrize(
    ("name", "stacked"),
    [("llama-gqa", False), ("llama-gqa", True), ("phi3", False), ("phi3", True),
     ("qwen2", True), ("qwen3", True), ("gemma3", True)],  # stacked bias; q/k norms, gelu on strided views
)  # fmt: skip
def test_gpu_lora_layout_matches_peft(
    tiny_model_dir, tmp_path: Path, name: str, stacked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU path end to end on CPU: the engine with ``GpuLoRASlots`` (every slice of a fused
    linear in one buffer, the runner's ``slot_runs``, one shrink and one expand launch per linear
    through the Triton kernels, interpreted; ``stacked``: the shrink in the base GEMM, one expand)
    equals PEFT for a mixed batch of four adapters with different ranks and targets (Phi-3: LoRA
    on the fused modules)."""
    import lorastar.layers.lora as lora_layers

    monkeypatch.setattr(lora_layers, "STACKED_MAX_BYTES", 8 << 20 if stacked else 0)
    shrinks = []  # stacked: every step has fewer than STACKED_MAX_ROWS rows, so no separate shrink
    monkeypatch.setattr(lora_layers, "lora_shrink", lambda *a, **k: shrinks.append(lora_shrink(*a, **k)))
    llm, ref = _gpu_layout_llm(tiny_model_dir(name), tmp_path, monkeypatch, max_loras=4)
    eng = llm.engine
    assert all((lora.stacked is not None) == stacked for _, lora in eng.lora_state.slots)
    order = ["c", None, "a", "b", "d", "a"]
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randrange(2, 12))] for _ in order]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), adapter=order)
    for p, a, o in zip(prompts, order, outs):
        assert o.outputs[0].token_ids == peft_greedy(ref, p, a, 4), f"adapter {a}"
    assert bool(shrinks) != stacked
    eng.check_invariants()
    assert llm.kv_cache_usage()["num_used_blocks"] == 0


@pytest.mark.parametrize("name", ["llama-gqa", "phi3"])
def test_stacked_slots_reused_by_other_adapters_match_peft(
    tiny_model_dir, tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two stacked GPU slots (interpreted) for four adapters of different ranks and targets: each
    slot's A rows under the base weight and its B are taken over by adapters that target other
    modules with other ranks, and every batch still equals PEFT (a row left behind by the
    previous adapter would add its delta to the next one's)."""
    llm, ref = _gpu_layout_llm(tiny_model_dir(name), tmp_path, monkeypatch, max_loras=2)
    eng = llm.engine
    assert all(lora.stacked is not None for _, lora in eng.lora_state.slots)
    rng = random.Random(5)
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for order in (["a", "b", None], ["c", "d"], ["d", None, "a"], ["b", "c"]):  # every slot re-used
        prompts = [[rng.randrange(3, 49152) for _ in range(rng.randrange(2, 10))] for _ in order]
        for p, a, o in zip(prompts, order, llm.generate(prompts, sp, adapter=order)):
            assert o.outputs[0].token_ids == peft_greedy(ref, p, a, 3), f"adapter {a} in {order}"
    eng.check_invariants()
