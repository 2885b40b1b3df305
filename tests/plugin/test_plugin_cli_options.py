"""The ``lora`` group: options on each command, base-URL discovery, local relative paths, errors."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from plugin_fake_engine import FakeAsyncLLM
from plugin_support import ServerThread

from lorastar.plugin import LoraStarConfig, create_app
from lorastar.plugin.cli import main
from lorastar.plugin.lora_cli import _api_bases

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("opt-adapters")
    for name in ("one", "two"):
        (root / name).mkdir()
        (root / name / "adapter_config.json").write_text("{}")
    return root


@pytest.fixture(scope="module", params=["/v1", "/llm/api"])
def server(root: Path, request: pytest.FixtureRequest) -> Iterator[tuple[ServerThread, str]]:
    cfg = LoraStarConfig(
        async_engine=FakeAsyncLLM(), adapter_root=root, admin_token="tok", path=request.param
    )
    with ServerThread(create_app(cfg)) as srv:
        srv.fake = cfg.async_engine  # type: ignore[attr-defined]
        yield srv, request.param


def test_api_bases() -> None:
    assert _api_bases("http://h:1", "/v1") == ["http://h:1/v1", "http://h:1"]
    assert _api_bases("http://h:1/v1/", "/v1") == ["http://h:1/v1"]
    assert _api_bases("http://h:1/x", "/") == ["http://h:1/x"]


def test_options_on_each_command_and_base_url(
    server: tuple[ServerThread, str], root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    srv, path = server
    monkeypatch.delenv("LORASTAR_ADMIN_TOKEN", raising=False)
    monkeypatch.chdir(root)  # "one" is a local relative folder here
    runner = CliRunner()
    from lorastar.plugin.lora_cli import make_lora_group

    group = make_lora_group(plugin_path=path)
    for url in (srv.url, srv.url + path):
        r = runner.invoke(group, ["load", "x", "one", "--url", url, "--token", "tok"])
        assert r.exit_code == 0 and "added successfully" in r.output, (url, r.output)
        assert srv.fake.adapters["x"].path == str(root / "one")  # type: ignore[attr-defined]  # sent absolute
        r = runner.invoke(group, ["list", "--url", url])
        assert r.exit_code == 0 and "x" in r.output and str(root) not in r.output, r.output
        # group options and command options together: the command's win
        r = runner.invoke(
            group,
            ["--url", "http://127.0.0.1:1", "--token", "bad", "unload", "x", "--url", url, "--token", "tok"],
        )
        assert r.exit_code == 0 and "removed successfully" in r.output, r.output


def test_errors_are_one_line_with_nonzero_exit(server: tuple[ServerThread, str], tmp_path: Path) -> None:
    srv, path = server
    runner = CliRunner()
    from lorastar.plugin.lora_cli import make_lora_group

    group = make_lora_group(plugin_path=path)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    cases = {
        ("unload", "ghost", "--token", "tok"): "cannot be found. (HTTP 404)",
        ("unload", "ghost"): "(HTTP 401)",
        ("load", "y", str(outside), "--token", "tok"): "(HTTP 403)",
    }
    for args, text in cases.items():
        r = runner.invoke(group, [*args, "--url", srv.url])
        assert r.exit_code == 1 and text in r.output and r.output.count("\n") == 1, (args, r.output)
    r = runner.invoke(group, ["list", "--url", "http://127.0.0.1:9/nothing"])
    assert r.exit_code == 1 and "cannot reach" in r.output and r.output.count("\n") == 1, r.output
    r = runner.invoke(group, ["list", "--url", srv.url + "/nope"])
    assert r.exit_code == 1 and "no lorastar server" in r.output, r.output


def test_no_import_cycle_between_cli_and_plugin() -> None:
    # Each module imports cleanly first in a fresh interpreter, and plugin.py never imports cli.py.
    for mod in ("lorastar.plugin.cli", "lorastar.plugin.plugin", "lorastar.plugin.lora_cli"):
        code = (
            f"import sys, {mod}; assert 'lorastar.plugin.cli' not in sys.modules or {mod!r}.endswith('.cli')"
        )
        subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
    src = (REPO / "lorastar/plugin/plugin.py").read_text()
    assert "plugin.cli " not in src and "plugin.cli\n" not in src and "from lorastar.plugin.cli" not in src
    assert main.commands["lora"].name == "lora"
