"""The adapter lifecycle over HTTP and the CLI against vLLM's dynamic LoRA serving
(``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``, ``/v1/models``): status codes, error shapes,
duplicates, bad folders, unloads under load, and what ``/v1/models`` shows. Real tiny engine."""

from __future__ import annotations

import shutil
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from plugin_support import engine_config, engine_idle, make_adapter, wait_until

ADMIN = {"Authorization": "Bearer adm"}
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def root(adapter_root: Path, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    r = tmp_path_factory.mktemp("lifecycle-adapters")
    for n in ("alpha", "beta", "gamma"):
        shutil.copytree(adapter_root / n, r / n)
    make_adapter(tiny_model_dir, r / "big", seed=7, rank=16)  # above the server's max_lora_rank=8
    (r / "afile").write_text("x")
    (r / "noweights").mkdir()
    shutil.copy(adapter_root / "alpha" / "adapter_config.json", r / "noweights")
    (r / "corrupt").mkdir()
    shutil.copy(adapter_root / "alpha" / "adapter_config.json", r / "corrupt")
    (r / "corrupt" / "adapter_model.safetensors").write_bytes(b"garbage" * 10)
    return r


@pytest.fixture(scope="module")
def hub_snapshot(adapter_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``beta`` as huggingface_hub caches ``testorg/beta-lora`` (what a hub id resolves to)."""
    snap = tmp_path_factory.mktemp("hf") / "models--testorg--beta-lora" / "snapshots" / COMMIT
    shutil.copytree(adapter_root / "beta", snap)
    return snap


@pytest.fixture(scope="module")
def client(tiny_model_dir: Path, root: Path, hub_snapshot: Path) -> Iterator[Any]:
    from litestar import Litestar
    from litestar.testing import TestClient

    from lorastar.plugin import LoraStarConfig, LoraStarPlugin

    plugin = LoraStarPlugin(
        LoraStarConfig(
            engine=engine_config(tiny_model_dir, num_kv_blocks=64, max_loras=1, max_lora_rank=8),
            served_model_name="tiny",
            adapters={"alpha": str(root / "alpha"), "hubbeta": str(hub_snapshot)},
            adapter_root=root,
            admin_token="adm",
        )
    )
    with TestClient(Litestar(plugins=[plugin])) as c:
        c.plugin = plugin  # type: ignore[attr-defined]
        yield c


def load(c: Any, name: str, path: str, **kw: Any) -> Any:
    return c.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path, **kw}, headers=ADMIN)


def unload(c: Any, name: str) -> Any:
    return c.post("/v1/unload_lora_adapter", json={"lora_name": name}, headers=ADMIN)


def model_ids(c: Any) -> list[str]:
    return [m["id"] for m in c.get("/v1/models").json()["data"]]


def error(r: Any, status: int, param: str | None) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["param"] == param, err
    assert err["type"] == ("NotFoundError" if status == 404 else "BadRequestError"), err
    return str(err["message"])


def test_bad_adapter_names_are_400_naming_lora_name(client: Any) -> None:
    # Was a 400 naming lora_path (the registry refused the name after the folder had been read).
    for name in ("a b", "org/name", "tab\tname"):
        msg = error(load(client, name, "gamma"), 400, "lora_name")
        assert repr(name)[1:-1] in msg or name in msg
    assert "a b" not in model_ids(client)
    # A name vLLM users send is fine: odd characters, retrievable with /v1/models/{id} (URL-encoded).
    assert load(client, "odd:1@é", "gamma").status_code == 200
    assert client.get("/v1/models/odd%3A1%40%C3%A9").json()["root"] == "gamma"
    assert unload(client, "odd:1@é").status_code == 200


def test_models_root_of_a_hub_adapter_is_its_id(client: Any) -> None:
    # Was the snapshot's commit hash: vLLM's card shows the path given (the hub id).
    card = client.get("/v1/models/hubbeta").json()
    assert card["root"] == "testorg/beta-lora" and card["parent"] == "tiny", card
    assert client.get("/v1/models/alpha").json()["root"] == "alpha"  # under adapter_root: relative


def test_load_unload_errors_match_vllm(client: Any) -> None:
    c = client
    before = model_ids(c)
    # A name loaded already (same or other content): 400, the first one stays.
    for path in ("alpha", "beta"):
        assert "already been loaded" in error(load(c, "alpha", path), 400, "lora_name")
    assert c.get("/v1/models/alpha").json()["root"] == "alpha"
    assert "clashes with the base" in error(load(c, "tiny", "gamma"), 400, "lora_name")
    assert "max_lora_rank=8" in error(load(c, "big", "big"), 400, "lora_path")
    for path in ("afile", "noweights", "corrupt", "nope"):  # a file, no weights, garbage, missing
        error(load(c, "bad", path), 400, "lora_path")
    assert "Both 'lora_name' and 'lora_path'" in error(load(c, "", "gamma"), 400, "lora_name")
    msg = error(unload(c, "zzz"), 404, "lora_name")
    assert msg == "The lora adapter 'zzz' cannot be found."
    r = c.post("/v1/completions", json={"model": "zzz", "prompt": "hi", "max_tokens": 2})
    assert error(r, 404, "model") == "The model `zzz` does not exist."
    assert model_ids(c) == before


def test_models_follow_loads_and_unloads_at_once(client: Any) -> None:
    c = client
    assert load(c, "g1", "gamma").text == "Success: LoRA adapter 'g1' added successfully."
    assert "g1" in model_ids(c)
    assert c.post("/v1/completions", json={"model": "g1", "prompt": "hi", "max_tokens": 2}).status_code == 200
    assert unload(c, "g1").text == "Success: LoRA adapter 'g1' removed successfully."
    assert "g1" not in model_ids(c) and c.get("/v1/models/g1").status_code == 404
    r = c.post("/v1/completions", json={"model": "g1", "prompt": "hi", "max_tokens": 2})
    assert error(r, 404, "model") == "The model `g1` does not exist."
    # load_inplace of an unknown name loads it; of a known one replaces it; a bad one keeps the old.
    assert load(c, "g2", "gamma", load_inplace=True).status_code == 200
    assert load(c, "g2", "beta", load_inplace=True).status_code == 200
    error(load(c, "g2", "corrupt", load_inplace=True), 400, "lora_path")
    assert c.get("/v1/models/g2").json()["root"] == "beta"
    assert unload(c, "g2").status_code == 200


def test_concurrent_loads_of_one_name_load_once(client: Any) -> None:
    c = client
    codes: list[int] = []
    threads = [
        threading.Thread(target=lambda p=p: codes.append(load(c, "cc", p).status_code))
        for p in ("alpha", "beta", "gamma", "beta")
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(codes) == [200, 400, 400, 400]
    assert model_ids(c).count("cc") == 1
    assert unload(c, "cc").status_code == 200


def test_unload_with_requests_running_and_waiting_for_the_slot(
    client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """max_loras=1: requests on two adapters take turns on the one slot; unloading both names
    meanwhile lets every request finish, and nothing (slot, KV block, reference) stays held."""
    c = client
    engine = c.plugin.engine
    for name, path in (("u1", "beta"), ("u2", "gamma")):
        assert load(c, name, path).status_code == 200
    results: list[tuple[int, str | None]] = []

    def run(model: str) -> None:
        body = {"model": model, "prompt": "hello", "max_tokens": 24, "ignore_eos": True}
        r = c.post("/v1/completions", json=body)
        results.append((r.status_code, r.json()["choices"][0]["finish_reason"] if r.is_success else r.text))

    # The step loop is held until all five are submitted, then runs 3 steps (one adapter's rows
    # running, the others waiting for the slot) and is held again while both names are unloaded.
    steps_left, cond, step = [0], threading.Condition(), engine.engine.step

    def gated_step() -> Any:
        with cond:
            cond.wait_for(lambda: steps_left[0] != 0, timeout=30)
            steps_left[0] -= steps_left[0] > 0
        return step()

    def allow(n: int) -> None:
        with cond:
            steps_left[0] = n
            cond.notify_all()

    monkeypatch.setattr(engine.engine, "step", gated_step)
    threads = [threading.Thread(target=run, args=(m,)) for m in ("u1", "u2", "u1", "u2", "alpha")]
    for t in threads:
        t.start()
    try:
        # (u1 has hubbeta's content: one entry, so the counts are read per name)
        want = {"u1": 2, "u2": 2, "alpha": 1}
        assert wait_until(
            lambda: {a.name: a.in_flight for a in engine.list_adapters() if a.name in want} == want,
            timeout=30,
        )
        allow(3)
        assert wait_until(lambda: steps_left[0] == 0, timeout=30)
        assert unload(c, "u1").status_code == 200 and unload(c, "u2").status_code == 200
        assert not {"u1", "u2"} & set(model_ids(c))  # gone from the list at once
    finally:
        allow(-1)  # unlimited
    for t in threads:
        t.join(timeout=60)
    assert results == [(200, "length")] * 5
    assert wait_until(lambda: engine_idle(engine))
    engine.engine.registry.check_invariants()
    assert [a.name for a in engine.list_adapters()] == ["alpha", "hubbeta"]


def test_serve_loads_an_adapter_given_relative_to_adapter_root(
    tiny_model_dir: Path, root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``lorastar serve --lora-modules a=alpha --adapter-root ROOT``: the check found ``alpha`` under
    ROOT, but the config kept ``alpha``, loaded from the working directory: startup failed."""
    from litestar.testing import TestClient

    from lorastar.plugin import cli

    served: dict[str, Any] = {}

    def fake_run(app: Any, sock: socket.socket, log_level: str) -> None:
        served["app"] = app
        sock.close()

    monkeypatch.setattr(cli, "run_server", fake_run)
    monkeypatch.chdir(tmp_path)  # no `alpha` here
    r = CliRunner().invoke(
        cli.main,
        ["serve", str(tiny_model_dir), "--lora-modules", "a=alpha", "--adapter-root", str(root),
         "--port", "0", "--no-engine-process", "--device", "cpu", "--dtype", "float32",
         "--max-model-len", "256", "--num-kv-blocks", "32", "--max-lora-rank", "8"],
    )  # fmt: skip
    assert r.exit_code == 0, (r.output, r.exception)
    app = served["app"]
    assert Path(app.plugins.get("LoraStarPlugin").config.adapters["a"]) == root / "alpha"
    with TestClient(app) as c:
        assert "a" in model_ids(c)
