"""The small routes against vLLM's and OpenAI's: ``/v1/models/{id}`` for names holding "/" (OpenAI's
client sends ``org/name`` as ``org%2Fname``), the base of ``lorastar serve org/name`` (an HF cache
snapshot) named and rooted as the hub repo, never by the snapshot's commit hash, and ``/detokenize``
decoding off the event loop."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from plugin_fake_engine import FakeAsyncLLM
from plugin_support import ServerThread

from lorastar.plugin import LoraStarConfig, create_app
from lorastar.plugin.service import LoraStarService

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def snapshot(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tiny_model_dir`` where ``lorastar serve testorg/tiny-llama`` finds it: an HF cache snapshot."""
    snap = tmp_path_factory.mktemp("hf") / "models--testorg--tiny-llama" / "snapshots" / COMMIT
    snap.parent.mkdir(parents=True)
    snap.symlink_to(tiny_model_dir, target_is_directory=True)
    return snap


class HeldDecodeLLM(FakeAsyncLLM):
    """The fake engine whose tokenizer's decode (a huge token list) waits for ``release``."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()
        tok = self.tokenizer
        decode = tok.decode

        def held(ids: list[int], **kw: Any) -> str:
            self.entered.set()
            assert self.release.wait(30)
            return decode(ids, **kw)

        tok.decode = held  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def slashed() -> Iterator[httpx.Client]:
    """A fake engine served as ``Qwen/Qwen3-0.6B`` and ``plain``, with an adapter ``org/lora``."""
    engine = FakeAsyncLLM()
    app = create_app(LoraStarConfig(async_engine=engine, served_model_name=["Qwen/Qwen3-0.6B", "plain"]))
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        from plugin_fake_engine import FakeAdapter

        engine.adapters["org/lora"] = FakeAdapter("org/lora", "/srv/adapters/org-lora")
        yield c


def test_retrieve_a_model_whose_name_holds_a_slash(slashed: httpx.Client) -> None:
    """``GET /v1/models/{id}`` answered 404 (Litestar's, no ``param``) for every served name or
    adapter of the ``org/name`` form, as vLLM serves hub models by default: the route's parameter
    stopped at the first "/". OpenAI's client sends the id percent-encoded (``Qwen%2FQwen3-0.6B``)."""
    for path in ("/v1/models/Qwen/Qwen3-0.6B", "/v1/models/Qwen%2FQwen3-0.6B"):
        r = slashed.get(path)
        assert r.status_code == 200, (path, r.text)
        assert r.json()["id"] == "Qwen/Qwen3-0.6B" and r.json()["parent"] is None
    card = slashed.get("/v1/models/org%2Flora").json()
    assert card["id"] == "org/lora" and card["parent"] == "Qwen/Qwen3-0.6B"
    assert slashed.get("/v1/models/plain").json()["id"] == "plain"
    for unknown in ("/v1/models/Qwen/nope", "/v1/models/ghost"):
        r = slashed.get(unknown)
        assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text
        assert (
            r.json()["error"]["message"]
            == f"The model `{unknown.removeprefix('/v1/models/')}` does not exist."
        )
    listed = slashed.get("/v1/models").json()  # the list route is unchanged
    assert [m["id"] for m in listed["data"]] == ["Qwen/Qwen3-0.6B", "plain", "org/lora"]


def test_openai_client_retrieves_a_hub_named_model(slashed: httpx.Client) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=str(slashed.base_url) + "/v1", api_key="x", max_retries=0)
    assert client.models.retrieve("Qwen/Qwen3-0.6B").id == "Qwen/Qwen3-0.6B"


def test_a_hub_snapshot_is_named_by_its_repo_not_its_commit(snapshot: Path) -> None:
    """``lorastar serve org/name`` hands the plugin the HF cache snapshot folder: the base was served
    as the commit hash (``model="0123..."``), so every client's ``model`` was a 404. It is the repo's
    name, as ``LoraStarConfig(model="org/name")`` names it, and its ``root`` the hub id (vLLM's)."""
    service = LoraStarService(LoraStarConfig(model=str(snapshot)))
    assert service.served_model_names == ("tiny-llama",)  # before the engine is built
    engine = FakeAsyncLLM()
    with (
        ServerThread(create_app(LoraStarConfig(model=str(snapshot), async_engine=engine))) as srv,
        httpx.Client(base_url=srv.url, timeout=30) as c,
    ):
        card = c.get("/v1/models").json()["data"][0]
    assert card["root"] == "testorg/tiny-llama" and COMMIT not in str(card)


def test_the_engine_names_a_hub_snapshot_by_its_repo(snapshot: Path) -> None:
    """The engine's ``model_name`` (what ``lorastar serve`` and an engine core report as the served
    name) of a snapshot folder."""
    from plugin_support import engine_config

    from lorastar import LLM
    from lorastar.hub import model_folder_name, snapshot_hub_id

    llm = LLM(config=engine_config(snapshot, num_kv_blocks=16, max_num_seqs=2))
    assert llm.engine.model_name == "tiny-llama"
    assert snapshot_hub_id(snapshot) == "testorg/tiny-llama" and model_folder_name(snapshot) == "tiny-llama"
    assert model_folder_name("/models/my-model") == "my-model" and snapshot_hub_id("/models/x") is None
    assert model_folder_name("testorg/tiny-llama") == "tiny-llama"


def test_detokenize_decodes_off_the_event_loop() -> None:
    """``/detokenize`` decoded on the event loop: a big token list (a 10 MB body holds ~2M ids, 0.75 s
    for SmolLM2's tokenizer) stalled every other request and stream meanwhile. Here the decode is
    held until ``/version`` has answered: on the event loop, ``/version`` could not answer."""
    engine = HeldDecodeLLM()
    with (
        ServerThread(create_app(LoraStarConfig(async_engine=engine))) as srv,
        httpx.Client(base_url=srv.url, timeout=30) as c,
    ):
        result: dict[str, Any] = {}

        def detok() -> None:
            result["r"] = httpx.post(srv.url + "/detokenize", json={"tokens": [104, 105]}, timeout=30)

        t = threading.Thread(target=detok)
        t.start()
        try:
            assert engine.entered.wait(30)  # the decode is under way, and held
            try:
                answered = c.get("/version", timeout=5).status_code == 200
            except httpx.TimeoutException:
                answered = False
        finally:
            engine.release.set()
            t.join()
    assert answered, "/version could not answer while /detokenize decoded"
    assert result["r"].status_code == 200 and result["r"].json() == {"prompt": "hi"}
