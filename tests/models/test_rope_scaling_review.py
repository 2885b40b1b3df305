"""RoPE scaling as real checkpoints spell it, past the original context: lorastar's logits equal
transformers' for the same tiny random model (tolerance of the model tests)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.models.test_family_config_variants_review import LONGROPE, _lorastar_logits, _save


@pytest.mark.parametrize("spelling", [{"type": "su"}, {"rope_type": "su"}, {"type": "su", "rope_type": "su"}])
def test_phi3_legacy_su_longrope_loads_as_longrope(tmp_path: Path, spelling: dict[str, Any]) -> None:
    """Early Phi-3 128k checkpoints (transformers 4.38-era config.json) name longrope ``"su"``; vLLM
    renames it to longrope. transformers 5's Phi3Config renames it only after completing the RoPE
    parameters (so without original_max_position_embeddings) and then refuses them: the load used to
    fail with a KeyError. Long factors past the original 32 positions, as transformers' longrope."""
    top = {"original_max_position_embeddings": 32, "max_position_embeddings": 128}
    hf = _save(tmp_path, "Phi3", {**top, "rope_parameters": LONGROPE}, None)
    path = tmp_path / "config.json"
    raw = json.loads(path.read_text())
    raw.pop("rope_parameters")
    factors = {k: LONGROPE[k] for k in ("short_factor", "long_factor")}
    raw.update(rope_theta=10000.0, rope_scaling={**factors, **spelling})
    path.write_text(json.dumps(raw))
    ids = torch.randint(3, 256, (80,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([ids])).logits[0].float()  # read before the edit: "longrope"
    got = _lorastar_logits(tmp_path, ids, 128)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}


@pytest.mark.parametrize(("length", "max_positions"), [(30, 32), (32, 32), (64, 64)])
def test_dynamic_ntk_equals_transformers(tmp_path: Path, length: int, max_positions: int) -> None:
    """Dynamic NTK (``rope_type: dynamic``, older Llama fine-tunes): it was refused at load. Within
    ``max_position_embeddings`` (32 here) transformers' RoPE is plain, and so is lorastar's when the
    engine stays within it. Past it the base is fixed for ``factor`` times the context, as vLLM does,
    which is transformers' base for a forward of exactly that length (64)."""
    hf = _save(tmp_path, "Llama", {"max_position_embeddings": 32, "rope_parameters": DYNAMIC}, None)
    ids = torch.randint(3, 256, (length,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([ids])).logits[0].float()
    got = _lorastar_logits(tmp_path, ids, max_positions)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_dynamic_ntk_extends_max_model_len_by_its_factor(tmp_path: Path) -> None:
    """vLLM's derived context for dynamic NTK: ``factor`` times ``max_position_embeddings``; and the
    fixed base is used only past the original context."""
    from lorastar.engine.engine import rope_scaled_max_len
    from lorastar.layers.rotary import dynamic_ntk_past_context, rope_inv_freq

    cfg = {
        "max_position_embeddings": 32,
        "rope_scaling": {"type": "dynamic", "factor": 2.0},
        "rope_theta": 1e4,
    }
    assert rope_scaled_max_len(cfg) == 64
    assert not dynamic_ntk_past_context(cfg, 32) and dynamic_ntk_past_context(cfg, 33)
    plain, _ = rope_inv_freq({"max_position_embeddings": 32, "rope_theta": 1e4}, 16)
    assert torch.equal(rope_inv_freq(cfg, 16, 32)[0], plain)
    assert (rope_inv_freq(cfg, 16, 64)[0][1:] < plain[1:]).all()  # a larger base: lower frequencies


def test_an_engine_past_the_dynamic_context_warns_and_one_past_the_factor_is_refused(
    tiny_model_dir, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:  # noqa: ANN001
    import logging
    import shutil

    from lorastar import LLM

    folder = tmp_path / "dyn"
    shutil.copytree(tiny_model_dir("llama-gqa"), folder)
    raw = json.loads((folder / "config.json").read_text())
    raw.pop("rope_parameters", None)
    raw.update(
        max_position_embeddings=64, rope_theta=10000.0, rope_scaling={"type": "dynamic", "factor": 2.0}
    )
    (folder / "config.json").write_text(json.dumps(raw))
    kw: dict[str, Any] = {"num_kv_blocks": 32}
    with caplog.at_level(logging.WARNING, logger="lorastar"):
        LLM(str(folder), max_model_len=64, **kw)
        assert "dynamic NTK" not in caplog.text
        LLM(str(folder), max_model_len=128, **kw)
        assert "dynamic NTK RoPE past max_position_embeddings (64)" in caplog.text
    with pytest.raises(ValueError, match=r"RoPE-scaled length \(128\)"):
        LLM(str(folder), max_model_len=129, **kw)


def test_longrope_picks_its_factors_from_the_length_the_kv_cache_allows(tiny_model_dir) -> None:  # noqa: ANN001
    """max_model_len 256 asks for LongRoPE's long factors (past the original 64 positions); a KV cache
    of 64 tokens lowers it to 64, where every sequence stays within the original context and
    transformers uses the short factors. The model was built for 256 and kept the long ones: its
    logits differed from transformers' on every sequence. The factors now follow the lowered length."""
    from transformers import AutoModelForCausalLM

    from lorastar import LLM, SamplingParams
    from tests.models.test_llama_vs_hf import hf_greedy, mixed_prompts

    path = tiny_model_dir("phi4-mini")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, num_kv_blocks=4, block_size=16, max_model_len=256)
    assert llm.engine.max_model_len == 64
    prompts = mixed_prompts(8, [9, 33, 50])
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 12), f"prompt of {len(p)} tokens"
    # The last prompt's logits (the greedy tokens of this tiny model hardly feel the factors)
    eng = llm.engine
    eng.add_request(prompts[-1], SamplingParams(temperature=0, max_tokens=1))
    out = eng.scheduler.schedule()
    got = eng.runner.execute(out, None).logits[0]
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([prompts[-1]])).logits[0, -1]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
