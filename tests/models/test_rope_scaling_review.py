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
