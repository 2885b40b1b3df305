"""The demo app (examples/app.py) on the embedded SmolLM2 with the trained demo adapters, over HTTP."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from plugin_support import ServerThread

DEMO_ADAPTERS = Path(__file__).resolve().parents[2] / "examples" / "adapters"
NEEDED = ("uppercase", "json")


@pytest.mark.skipif(
    not all((DEMO_ADAPTERS / n / "adapter_config.json").is_file() for n in NEEDED),
    reason="the demo adapters (examples/adapters) are not there",
)
def test_demo_app_serves_the_trained_adapters() -> None:
    import examples.app
    from lorastar.config import EngineConfig

    app = examples.app.create_app(engine=EngineConfig(device="cpu", max_model_len=512, num_kv_blocks=128))
    with ServerThread(app) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        ids = [m.id for m in client.models.list().data]
        assert ids[0] == "SmolLM2-135M-Instruct" and set(NEEDED) <= set(ids)
        messages = [{"role": "user", "content": "What is the capital of France?"}]

        def ask(model: str) -> str:
            r = client.chat.completions.create(model=model, messages=messages, max_tokens=32, temperature=0)
            return (r.choices[0].message.content or "").strip()

        assert "Paris" in ask(ids[0])
        upper = ask("uppercase")
        assert upper == upper.upper() and any(c.isalpha() for c in upper)
        assert isinstance(json.loads(ask("json"))["answer"], str)
