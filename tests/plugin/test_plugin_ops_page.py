"""The live operator page (``/lorastar/``) and its stats route: JSON over a real engine, and the page
in headless Chromium (Debian's package, through playwright) showing live numbers, with a screenshot."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
SCREENSHOT = REPO / "build" / "screenshots" / "operator_page.png"


def _traffic(srv: Any) -> None:
    for model, n in (("alpha", 2), ("tiny", 1)):
        for _ in range(n):
            r = httpx.post(
                srv.url + "/v1/completions",
                json={
                    "model": model,
                    "prompt": "Hello",
                    "max_tokens": 5,
                    "temperature": 0,
                    "ignore_eos": True,
                },
                timeout=60,
            )
            assert r.status_code == 200, r.text


def test_stats_route_counts_traffic(real_server: Any) -> None:
    before = httpx.get(real_server.url + "/lorastar/stats", timeout=10).json()
    _traffic(real_server)
    s = httpx.get(real_server.url + "/lorastar/stats", timeout=10).json()
    assert s["model"] == "tiny" and s["healthy"] and s["device"] == "cpu" and s["num_blocks"] > 0
    assert s["generation_tokens_total"] >= before["generation_tokens_total"] + 15
    rows = {a["name"]: a for a in s["adapters"]}
    old = {a["name"]: a for a in before["adapters"]}
    assert rows["tiny"]["base"] and rows["tiny"]["requests"] == old["tiny"]["requests"] + 1
    assert rows["alpha"]["requests"] == old["alpha"]["requests"] + 2
    assert rows["alpha"]["generation_tokens"] == old["alpha"]["generation_tokens"] + 10
    assert rows["alpha"]["rank"] == 4 and rows["alpha"]["tier"] in ("device", "cpu", "disk")
    page = httpx.get(real_server.url + "/lorastar/", timeout=10)
    assert page.status_code == 200 and "<title>lorastar</title>" in page.text
    js = httpx.get(real_server.url + "/lorastar/app.js", timeout=10)
    assert js.status_code == 200 and 'fetch("stats"' in js.text


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(
                "CI=true but no chromium: `make test` installs Debian's chromium (apt-get install chromium)"
            )
        pytest.skip("no chromium on this machine (apt-get install chromium)")
    return path


def test_page_in_headless_chromium_shows_live_numbers(real_server: Any) -> None:
    browser_path = _chromium()
    sync_playwright = pytest.importorskip("playwright.sync_api").sync_playwright
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 900, "height": 640})
            page.goto(real_server.url + "/lorastar")  # without the slash: the page adds it
            page.wait_for_url("**/lorastar/", timeout=20000)
            page.wait_for_function("document.getElementById('model').textContent === 'tiny'", timeout=20000)
            _traffic(real_server)
            # a poll after the traffic: the alpha row counts its requests, the chart has points
            page.wait_for_function(
                "Number(document.querySelector('tr[data-adapter=alpha] td:nth-child(6)').textContent) >= 2",
                timeout=20000,
            )
            page.wait_for_function(
                "document.getElementById('line').getAttribute('points').split(' ').length >= 2", timeout=20000
            )
            gen = page.text_content("#gen") or ""
            assert int(gen.replace(",", "")) >= 15
            assert (page.text_content("#kvblocks") or "").endswith("blocks")
            assert "device" in (page.text_content("#meta") or "") or "cpu" in (
                page.text_content("#meta") or ""
            )
            assert page.text_content("#error") == ""
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SCREENSHOT), full_page=True)
        finally:
            browser.close()
    assert SCREENSHOT.stat().st_size > 10_000


def test_grafana_dashboard_queries_metrics_the_server_exports(real_server: Any) -> None:
    import json
    import re

    dash = json.loads((REPO / "examples" / "grafana" / "lorastar.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    names = {n for e in exprs for n in re.findall(r"\b((?:vllm|lorastar):[a-z_]+)", e)}
    assert len(names) >= 12
    _traffic(real_server)
    exported = httpx.get(real_server.url + "/metrics", timeout=10).text
    samples = set(re.findall(r"^((?:vllm|lorastar):[a-z_]+)[{ ]", exported, re.M))
    missing = sorted(n for n in names if n not in samples)
    assert not missing, missing
