"""Review of the live operator page (``/lorastar/``) and its stats route: a server with ``api_keys``,
counters that reset or vanish while the engine restarts, a server that stops answering, and a poll
(or a Prometheus scrape) waiting for the engine's lock. A fake engine; the page in headless Chromium
with its timers sped up 20x (the polling logic is unchanged)."""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from litestar import Litestar
from plugin_fake_engine import FakeAsyncLLM
from plugin_support import ServerThread

from lorastar.plugin import LoraStarConfig, LoraStarPlugin

KEY = "ops-key"
FAST_TIMERS = """{ const st = window.setTimeout.bind(window);
  window.setTimeout = (f, ms, ...a) => st(f, (ms || 0) / 20, ...a); }"""


class GatedEngine(FakeAsyncLLM):
    """The fake with the real stats' fields; ``gate`` armed, ``stats()`` waits as the real one waits
    for the engine lock during a step."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.entered = threading.Event()
        self.release = threading.Event()

    def stats(self) -> Any:
        if self.armed:
            self.entered.set()
            self.release.wait(30)
        s = super().stats()
        return SimpleNamespace(**vars(s), num_blocks=100, num_used_blocks=0, max_loras=4)


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[ServerThread, GatedEngine]]:
    engine = GatedEngine()
    app = Litestar(plugins=[LoraStarPlugin(LoraStarConfig(async_engine=engine, api_keys=[KEY]))])
    with ServerThread(app) as srv:
        yield srv, engine


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("CI=true but no chromium: `make test` installs Debian's chromium")
        pytest.skip("no chromium on this machine (apt-get install chromium)")
    sync_playwright = pytest.importorskip("playwright.sync_api").sync_playwright
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


def _page(browser: Any) -> Any:
    page = browser.new_page()
    page.add_init_script(FAST_TIMERS)
    return page


def _snap(t: float, gen: int | None) -> dict[str, Any]:
    s: dict[str, Any] = {"time": t, "model": "m", "healthy": True, "adapters": []}
    if gen is not None:  # none while the engine restarts (stats() is None then)
        s.update(generation_tokens_total=gen, num_running=0, num_waiting=0, kv_cache_usage=0.0)
    return s


def test_page_with_api_keys_asks_for_the_key(server: Any, browser: Any) -> None:
    srv, _ = server
    # The page (no data in it) opens in a browser, which cannot send a Bearer header on navigation;
    # the stats stay guarded. Static files revalidate, so an upgrade's app.js is not a stale one.
    html = httpx.get(srv.url + "/lorastar/", timeout=10)
    assert html.status_code == 200 and "<title>lorastar</title>" in html.text
    assert "no-cache" in httpx.get(srv.url + "/lorastar/app.js", timeout=10).headers.get("cache-control", "")
    assert httpx.get(srv.url + "/lorastar/stats", timeout=10).status_code == 401
    page = _page(browser)
    try:
        page.goto(srv.url + "/lorastar/")
        page.wait_for_selector("#auth", state="visible", timeout=5000)
        assert "API key" in (page.text_content("#error") or "")
        page.fill("#key", KEY)
        page.click("#auth button")
        page.wait_for_function("document.getElementById('model').textContent === 'fake-model'", timeout=5000)
        page.wait_for_selector("#auth", state="hidden", timeout=5000)
        assert page.text_content("#error") == ""
    finally:
        page.close()


def test_tokens_per_second_survives_restart_and_counter_reset(server: Any, browser: Any) -> None:
    srv, _ = server
    # 100 tokens; the server restarted (its counter from 0); the engine restarting (no counters);
    # counting again. Never a negative or NaN rate, nor a NaN in the chart.
    snaps = [_snap(0, 100), _snap(1, 5), _snap(2, None), _snap(3, 25), _snap(4, 45)]
    served: list[int] = []

    def handle(route: Any) -> None:
        i = len(served)
        served.append(i)
        snap = snaps[i] if i < len(snaps) else _snap(i, 45)  # then idle
        route.fulfill(status=200, content_type="application/json", body=json.dumps(snap))

    page = _page(browser)
    try:
        page.add_init_script(
            """window.seen = []; addEventListener("DOMContentLoaded", () => new MutationObserver(() =>
              window.seen.push(document.getElementById("tps").textContent)).observe(
              document.getElementById("tps"), {childList: true, characterData: true, subtree: true}));"""
        )
        page.route("**/lorastar/stats", handle)
        page.goto(srv.url + "/lorastar/")
        page.wait_for_function("window.seen.length >= 3", timeout=5000)
        seen = page.evaluate("window.seen")
        assert seen[:3] == ["5.0", "20.0", "0.0"], seen
        points = page.get_attribute("#line", "points") or ""
        assert points and "NaN" not in points, points
        assert "NaN" not in (page.text_content("#chartlabel") or "")
    finally:
        page.close()


def test_page_says_so_when_the_server_stops_answering_and_recovers(server: Any, browser: Any) -> None:
    srv, _ = server
    hung: list[Any] = []

    def handle(route: Any) -> None:
        if not hung:  # the first poll never answers (a server gone without closing the connection)
            hung.append(route)
            return
        route.fulfill(status=200, content_type="application/json", body=json.dumps(_snap(1, 1)))

    page = _page(browser)
    try:
        page.route("**/lorastar/stats", handle)
        page.goto(srv.url + "/lorastar/")
        page.wait_for_function(
            "document.getElementById('error').textContent.includes('no answer')", timeout=5000
        )
        page.wait_for_function("document.getElementById('model').textContent === 'm'", timeout=5000)
        assert page.text_content("#error") == ""
    finally:
        page.unroute_all(behavior="ignoreErrors")
        page.close()


@pytest.mark.parametrize("path", ["/lorastar/stats", "/metrics"])
def test_poll_waiting_for_the_engine_lock_does_not_stall_the_server(server: Any, path: str) -> None:
    srv, engine = server
    engine.entered.clear()
    engine.release.clear()
    engine.armed = True
    got: list[int] = []
    t = threading.Thread(
        target=lambda: got.append(
            httpx.get(srv.url + path, headers={"Authorization": f"Bearer {KEY}"}, timeout=30).status_code
        )
    )
    t.start()
    try:
        assert engine.entered.wait(10)
        # While the poll waits (an in-process engine's stats() takes the lock a step holds), the
        # event loop still answers everyone else.
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
    finally:
        engine.armed = False
        engine.release.set()
        t.join(30)
    assert got == [200]
