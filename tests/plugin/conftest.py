"""Fixtures of the plugin tests: a tiny random Llama (SmolLM2's tokenizer), tiny real PEFT adapters,
and a real uvicorn server on 127.0.0.1 in a background thread."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # plugin_support, plugin_fake_engine

from plugin_support import TOKENIZER_FILES, ServerThread, engine_config, make_adapter  # noqa: E402

# ----------------------------------------------------------------------------- tiny model + adapters


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama (hidden 64) with SmolLM2's tokenizer and chat template."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lorastar.models.default import default_model_dir

    src = default_model_dir(progress=False)
    out = tmp_path_factory.mktemp("tiny-llama")
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # larger weights: sharper logits, so greedy is not a near-tie lottery
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


@pytest.fixture(scope="session")
def adapter_root(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``alpha``, ``beta``, ``gamma`` under one root (the runtime-loading root of the tests)."""
    root = tmp_path_factory.mktemp("adapters")
    for i, name in enumerate(("alpha", "beta", "gamma")):
        make_adapter(tiny_model_dir, root / name, seed=100 + i)
    return root


@pytest.fixture(scope="session")
def real_server(tiny_model_dir: Path, adapter_root: Path) -> Iterator[Any]:
    """The shared live server: a Litestar app with its own route + the plugin (real engine)."""
    from litestar import Litestar, get

    from lorastar.plugin import LoraStarConfig, LoraStarPlugin

    @get("/app-own")
    async def own() -> dict[str, str]:
        return {"mine": "yes"}

    plugin = LoraStarPlugin(
        LoraStarConfig(
            engine=engine_config(tiny_model_dir),
            served_model_name="tiny",
            adapters={"alpha": str(adapter_root / "alpha"), "beta": str(adapter_root / "beta")},
            adapter_root=adapter_root,
            admin_token="admin-secret",
        )
    )
    app = Litestar(route_handlers=[own], plugins=[plugin])
    with ServerThread(app) as srv:
        srv.plugin = plugin  # type: ignore[attr-defined]
        yield srv
