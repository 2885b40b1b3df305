"""``lorastar serve``'s vLLM-shared options and ``LoraStarConfig``'s validation, against vLLM's
``vllm serve`` (cli_args.py, chat_utils.py): CliRunner with ``run_server`` replaced, no model loaded."""

from __future__ import annotations

import json
import logging
import socket
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from plugin_fake_engine import FakeAsyncLLM

from lorastar.plugin import LoraStarConfig, cli, create_app
from lorastar.plugin.cli import main


@pytest.fixture
def folders(tmp_path: Path) -> dict[str, Path]:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    out = {"model": model}
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text("{}")
        out[name] = tmp_path / name
    return out


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What ``lorastar serve`` would have run (the config), without running it."""
    seen: dict[str, Any] = {}

    def fake_run(app: Any, sock: socket.socket, log_level: str) -> None:
        seen["config"] = app.plugins.get("LoraStarPlugin").config
        sock.close()

    monkeypatch.setattr(cli, "run_server", fake_run)
    return seen


def _serve(*args: str) -> Any:
    return CliRunner().invoke(main, ["serve", "--port", "0", *args])


def _one_line_error(r: Any, text: str) -> None:
    assert r.exit_code == 2, (r.exit_code, r.output, r.exception)
    assert r.output.startswith("Error: ") and r.output.count("\n") == 1 and text in r.output, r.output


# ---- --chat-template ------------------------------------------------------------------------------


def test_long_inline_chat_template_is_the_template(served: dict[str, Any]) -> None:
    # vLLM: a value that cannot be opened as a file and has Jinja characters is the template. A
    # real template is longer than a file name may be: that was an OSError traceback, exit 1.
    tpl = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% endfor %}" * 6
    assert len(tpl) > 255 and "/" not in tpl
    r = _serve("--chat-template", tpl)
    assert r.exit_code == 0, (r.output, r.exception)
    assert served["config"].engine.chat_template == tpl


def test_unreadable_chat_template_file_is_one_line(served: dict[str, Any], tmp_path: Path) -> None:
    bad = tmp_path / "t.jinja"
    bad.write_bytes(b"\xff\xfe{{ x }}")  # not UTF-8: was a UnicodeDecodeError traceback
    _one_line_error(_serve("--chat-template", str(bad)), "--chat-template: cannot read")
    assert "config" not in served


# ---- --lora-modules -------------------------------------------------------------------------------


def test_lora_modules_takes_several_values_after_one_flag(
    served: dict[str, Any], folders: dict[str, Path]
) -> None:
    # vLLM's --lora-modules is nargs='+': `--lora-modules a=X b=Y` (was: "model folder 'b=Y' does
    # not exist"); MODEL after them, as a folder, is still the model.
    b_json = json.dumps({"name": "b", "path": str(folders["b"]), "base_model_name": "m"})
    r = _serve("--lora-modules", f"a={folders['a']}", b_json, f"c={folders['c']}", str(folders["model"]))
    assert r.exit_code == 0, (r.output, r.exception)
    cfg = served["config"]
    assert cfg.model == str(folders["model"])
    assert cfg.adapters == {"a": str(folders["a"]), "b": str(folders["b"]), "c": str(folders["c"])}


def test_lora_modules_equals_form_and_adapter_flag_spread_too(
    served: dict[str, Any], folders: dict[str, Path]
) -> None:
    r = _serve(
        str(folders["model"]), f"--lora-modules=a={folders['a']}", f"b={folders['b']}",
        "--max-loras", "2", "--adapter", f"c={folders['c']}",
    )  # fmt: skip
    assert r.exit_code == 0, (r.output, r.exception)
    assert list(served["config"].adapters) == ["a", "b", "c"]
    assert served["config"].engine.max_loras == 2


def test_lora_modules_spread_stops_at_other_options(served: dict[str, Any], folders: dict[str, Path]) -> None:
    # A value with '=' after another option belongs to that option.
    r = _serve("--lora-modules", f"a={folders['a']}", "--served-model-name", "x=y")
    assert r.exit_code == 0, (r.output, r.exception)
    assert served["config"].adapters == {"a": str(folders["a"])}
    assert served["config"].served_model_name == "x=y"


def test_lora_modules_json_with_surrounding_spaces(served: dict[str, Any], folders: dict[str, Path]) -> None:
    # Was "expected NAME=PATH" for a JSON value with a leading space (a shell continuation line).
    r = _serve("--lora-modules", f' {{"name": "a", "path": "{folders["a"]}"}} ')
    assert r.exit_code == 0, (r.output, r.exception)
    assert served["config"].adapters == {"a": str(folders["a"])}


# ---- --api-key and LoraStarConfig's validation ----------------------------------------------------


def test_empty_api_key_is_a_usage_error(served: dict[str, Any]) -> None:
    # An empty key (`--api-key "$UNSET"`) can never be sent: it locked every route for good.
    _one_line_error(_serve("--api-key", ""), "api_keys must hold non-empty strings")
    assert "config" not in served


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"api_keys": [None]}, "api_keys must hold non-empty strings, got NoneType"),
        ({"api_keys": ["good", 5]}, "api_keys must hold non-empty strings, got int"),
        ({"api_keys": 7}, "api_keys must be a list of strings or None, got int"),
        ({"admin_token": 123}, "admin_token must be a string or None, got int"),
        ({"retry_after_seconds": "1"}, "retry_after_seconds must be a number >= 0"),
        ({"shutdown_drain_timeout": -1}, "shutdown_drain_timeout must be a number >= 0"),
        ({"shutdown_drain_timeout": "5"}, "shutdown_drain_timeout must be a number >= 0"),
        ({"served_model_name": ["a", ""]}, "served_model_name must be a string, a list of distinct"),
        ({"served_model_name": ["a", "a"]}, "served_model_name must be a string, a list of distinct"),
        ({"served_model_name": []}, "served_model_name must be a string, a list of distinct"),
        ({"served_model_name": 5}, "served_model_name must be a string, a list of distinct"),
    ],
)
def test_bad_config_values_name_the_field(kwargs: dict[str, Any], text: str) -> None:
    with pytest.raises(ValueError, match="^" + text):
        LoraStarConfig(async_engine=FakeAsyncLLM(), **kwargs)


@pytest.mark.parametrize("env", ["VLLM_API_KEY", "LORASTAR_API_KEY"])
def test_api_key_from_the_environment_as_vllm_serve(
    served: dict[str, Any], monkeypatch: pytest.MonkeyPatch, env: str
) -> None:
    # vllm serve guards its routes with VLLM_API_KEY: a deployment moved over must not open up.
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.delenv("LORASTAR_API_KEY", raising=False)
    monkeypatch.setenv(env, "k1 k2")
    assert _serve().exit_code == 0 and served["config"].api_keys == ["k1", "k2"]
    assert _serve("--api-key", "flag").exit_code == 0 and served["config"].api_keys == ["flag"]


def test_api_key_never_echoed_in_the_error() -> None:
    with pytest.raises(ValueError) as info:
        LoraStarConfig(api_keys=["s3cret-key", ""])
    assert "s3cret" not in str(info.value)


def test_good_api_key_collections_still_guard(caplog: pytest.LogCaptureFixture) -> None:
    from litestar.testing import TestClient

    caplog.set_level(logging.WARNING)
    for keys in ("k1", ("k1", "k2"), {"k1"}, []):
        cfg = LoraStarConfig(async_engine=FakeAsyncLLM(), api_keys=keys)
        with TestClient(create_app(cfg)) as c:
            assert c.get("/v1/models", headers={"Authorization": "Bearer k1"}).status_code == 200
            want = 200 if keys == [] else 401
            r = c.get("/v1/models", headers={"Authorization": "Bearer nope"})
            assert r.status_code == want, (keys, r.text)
            assert c.get("/health").status_code == 200  # open, as vLLM's


# ---- several --served-model-name ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "names", "model"),
    [
        (("MODEL", "--served-model-name", "a", "b"), ["a", "b"], "MODEL"),  # vLLM's form
        (("--model", "MODEL", "--served-model-name", "a", "b"), ["a", "b"], "MODEL"),
        (("--served-model-name", "a", "b", "--model", "MODEL"), ["a", "b"], "MODEL"),
        (("--served-model-name", "a", "--served-model-name", "b", "MODEL"), ["a", "b"], "MODEL"),
        (("--served-model-name", "a", "MODEL"), "a", "MODEL"),  # MODEL after one name stays MODEL
        (("--max-num-seqs", "4", "MODEL", "--served-model-name", "a", "b", "c"), ["a", "b", "c"], "MODEL"),
        (("MODEL", "--served-model-name", "a", "b", "--port", "0"), ["a", "b"], "MODEL"),
    ],
)
def test_several_served_model_names_as_vllm_serve(
    served: dict[str, Any], folders: dict[str, Path], args: tuple[str, ...], names: Any, model: str
) -> None:
    argv = [str(folders["model"]) if a == "MODEL" else a for a in args]
    r = _serve(*argv)
    assert r.exit_code == 0, r.output
    cfg = served["config"]
    assert cfg.served_model_name == names and cfg.model == str(folders["model"])


def test_an_adapter_named_as_any_served_name_is_refused(
    served: dict[str, Any], folders: dict[str, Path]
) -> None:
    r = _serve(str(folders["model"]), "--served-model-name", "x", "a", "--lora-modules", f"a={folders['a']}")
    _one_line_error(r, "adapter 'a' has the base model's served name")
    _one_line_error(_serve("--served-model-name", "x", "--served-model-name", "x"), "list of distinct")


def test_every_served_name_selects_the_base_and_is_listed(folders: dict[str, Path]) -> None:
    """vLLM: each served name is a model card and selects the base (a response echoes the name the
    request gave); the first is reported where no name was given, and is the adapters' parent."""
    from litestar.testing import TestClient

    engine = FakeAsyncLLM()
    cfg = LoraStarConfig(
        async_engine=engine,
        served_model_name=["base", "alias"],
        adapters={"ad": str(folders["a"])},
        admin_token="t",
        adapter_root=folders["b"].parent,
    )
    with TestClient(create_app(cfg)) as c:
        cards = c.get("/v1/models").json()["data"]
        assert [(m["id"], m["parent"]) for m in cards] == [("base", None), ("alias", None), ("ad", "base")]
        assert c.get("/v1/models/alias").json()["id"] == "alias"
        for name in ("base", "alias"):
            r = c.post("/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["model"] == name, r.text
            assert engine.last_adapter is None
        r = c.post("/v1/completions", json={"model": "ad", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and engine.last_adapter == "ad"
        r = c.post(
            "/v1/load_lora_adapter",
            json={"lora_name": "alias", "lora_path": "b"},
            headers={"Authorization": "Bearer t"},
        )
        assert r.status_code == 400 and "clashes with the base model's name" in r.text
    import asyncio

    from lorastar.plugin.service import LoraStarService

    cfg = LoraStarConfig(
        async_engine=FakeAsyncLLM(), served_model_name=["x", "base"], adapters={"base": str(folders["a"])}
    )
    with pytest.raises(ValueError, match="'base' is the base model's served name"):
        asyncio.run(LoraStarService(cfg).start())


# ---- vLLM flags lorastar has no use for -------------------------------------------------------------


def test_vllm_flags_that_ask_for_what_lorastar_does_are_accepted(served: dict[str, Any]) -> None:
    """Scripts copied from ``vllm serve`` pass these; each was 'No such option', exit 2."""
    r = _serve(
        "--trust-remote-code", "--enable-chunked-prefill", "--disable-log-requests", "--disable-log-stats",
        "--tensor-parallel-size", "1", "-pp", "1", "--enable-lora", "--gpu-memory-utilization", "0.9",
    )  # fmt: skip
    assert r.exit_code == 0, (r.output, r.exception)
    assert served["config"].engine.gpu_memory_utilization == 0.9


@pytest.mark.parametrize("flag", ["--tensor-parallel-size", "-tp", "--pipeline-parallel-size"])
def test_more_than_one_device_is_a_usage_error(served: dict[str, Any], flag: str) -> None:
    r = _serve(flag, "2")
    _one_line_error(r, "lorastar runs an engine on one device")
    assert "config" not in served


# ---- CORS (vLLM's --allowed-origins and co.) ----------------------------------------------------------


def test_allowed_origins_answer_browser_preflights(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chat page on another origin calling the API: its preflight had no CORS answer (there was no
    way to allow it). vLLM's flags, JSON lists; without --allowed-origins no origin is allowed."""
    from litestar.testing import TestClient

    apps: list[Any] = []

    def fake_run(app: Any, sock: socket.socket, log_level: str) -> None:
        apps.append(app)
        sock.close()

    monkeypatch.setattr(cli, "run_server", fake_run)
    assert _serve("--allowed-origins", '["https://chat.example"]').exit_code == 0
    assert _serve().exit_code == 0
    allowed, default = apps
    assert allowed.cors_config.allow_origins == ["https://chat.example"] and default.cors_config is None
    # the same CORS config on an app with a fake engine: a preflight from the allowed origin only
    app = create_app(LoraStarConfig(async_engine=FakeAsyncLLM()), cors_config=allowed.cors_config)
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    with TestClient(app) as client:
        r = client.options("/v1/chat/completions", headers={"Origin": "https://chat.example", **ask})
        assert r.status_code == 204 and r.headers["access-control-allow-origin"] == "https://chat.example"
        r = client.get("/v1/models", headers={"Origin": "https://chat.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://chat.example"
        r = client.get("/v1/models", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in r.headers


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--allowed-origins", "*"), ("--allowed-origins", '{"a": 1}'), ("--allowed-methods", "[1]")],
)
def test_cors_flags_take_json_lists(served: dict[str, Any], flag: str, value: str) -> None:
    extra = [] if flag == "--allowed-origins" else ["--allowed-origins", '["*"]']
    _one_line_error(_serve(*extra, flag, value), f"{flag} takes a JSON list of strings")
