"""``POST /reset_prefix_cache`` (vLLM's route, behind its dev mode there; here behind the admin
token, as the adapter admin routes are): 200 once the cached prefixes are gone (the next request's
``usage.prompt_tokens_details.cached_tokens`` is 0 again), 401 without the token."""

from __future__ import annotations

from pathlib import Path

from litestar.testing import TestClient

from lorastar.config import EngineConfig
from lorastar.plugin import LoraStarConfig, create_app

BODY = {"prompt": "the cat sat on the mat and looked at the dog " * 3, "max_tokens": 2, "temperature": 0}


def test_the_route_resets_the_cache_for_the_admin(tiny_model_dir: Path) -> None:
    engine = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=32, block_size=4, cpu_gemm="torch")
    with TestClient(create_app(LoraStarConfig(engine=engine, admin_token="adm"))) as c:

        def cached() -> int:
            r = c.post("/v1/completions", json=BODY)
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert cached() == 0 and cached() > 0
        r = c.post("/reset_prefix_cache")
        assert r.status_code == 401, r.text
        r = c.post("/reset_prefix_cache", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401, r.text
        assert cached() > 0  # still cached
        r = c.post("/reset_prefix_cache", headers={"Authorization": "Bearer adm"})
        assert r.status_code == 200, r.text
        assert cached() == 0
