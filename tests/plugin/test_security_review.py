"""Security review of the plugin: what an API caller (not the operator) can learn about the server.

An adapter pushed to the disk tier (beyond ``max_cpu_loras``) is re-read from its folder on its next
request; when that folder has gone, the request's 400 carried the engine's message, which starts with
the folder's absolute server path. vLLM's errors never show server paths to API callers, and the
plugin shows a folder by its name elsewhere (``/v1/models``' ``root``, the admin route's errors).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from plugin_support import engine_config

from lorastar.errors import AdapterError
from lorastar.plugin.errors import hide_paths, to_api_error


@pytest.fixture(scope="module")
def disk_tier(
    tiny_model_dir: Path, adapter_root: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    """A real engine holding one adapter in host memory: of ``inner`` (under the adapter root) and
    ``outer`` (a start-up adapter outside it), the one loaded first is on the disk tier; both
    folders are then removed."""
    from litestar import Litestar
    from litestar.testing import TestClient

    from lorastar.plugin import LoraStarConfig, LoraStarPlugin

    base = tmp_path_factory.mktemp("secret-server-dir")
    root, private = base / "adapters", base / "private"
    shutil.copytree(adapter_root / "alpha", root / "inner")
    shutil.copytree(adapter_root / "beta", private / "outer")
    plugin = LoraStarPlugin(
        LoraStarConfig(
            engine=engine_config(tiny_model_dir, num_kv_blocks=64, max_loras=1, max_cpu_loras=1),
            served_model_name="tiny",
            adapters={"outer": str(private / "outer"), "inner": str(root / "inner")},
            adapter_root=root,
        )
    )
    with TestClient(Litestar(plugins=[plugin])) as c:
        tiers = {a.name: a.tier for a in plugin.engine.list_adapters()}
        assert tiers["outer"] == "disk", tiers  # loaded first: dropped from host memory
        shutil.rmtree(root / "inner")
        shutil.rmtree(private / "outer")
        c.secret = str(base)  # type: ignore[attr-defined]
        yield c


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ],
)
def test_a_vanished_disk_tier_adapter_does_not_leak_its_server_path(
    disk_tier: Any, route: str, body: dict[str, Any]
) -> None:
    r = disk_tier.post(route, json={**body, "model": "outer"})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert disk_tier.secret not in r.text and "/private" not in message, message
    assert message.startswith("outer: ") and "reloading adapter ['outer'] failed" in message, message
    assert disk_tier.get("/health").status_code == 200


def test_adapter_errors_show_folder_names_not_server_paths() -> None:
    exc = AdapterError(
        "/srv/my adapters/alpha/adapter_config.json: cannot read adapter config: "
        "[Errno 2] No such file or directory: '/srv/my adapters/alpha/adapter_config.json'"
    )
    err = to_api_error(exc)
    assert err.status_code == 400 and "/srv" not in err.message and "my adapters" not in err.message
    assert err.message.startswith("alpha/adapter_config.json: cannot read adapter config")  # its folder
    # what is not a server path stays as it was: a client's name, hub ids and URLs
    for text in (
        "adapter name 'a b' must not contain whitespace or '/'",
        "org/name is not in the cache; see https://huggingface.co/org/name",
    ):
        assert hide_paths(text) == text


def test_metrics_require_api_key_without_keys_says_the_route_stays_open(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """It was silently open: the operator asked for a guard that had nothing to guard with."""
    from plugin_fake_engine import FakeAsyncLLM

    from lorastar.plugin import LoraStarConfig, create_app

    with caplog.at_level("WARNING", logger="lorastar.plugin"):
        create_app(LoraStarConfig(async_engine=FakeAsyncLLM(), metrics_require_api_key=True))
    assert any("metrics_require_api_key without api_keys" in r.message for r in caplog.records)
