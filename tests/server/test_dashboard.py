"""The engine dashboard on a real `pagedllm serve` (issue 29; docs/dashboard.md).

- The data endpoint: behind the API key (no key, a bad key: 401), read-only (POST, PUT,
  DELETE: 405), its counters equal /metrics' at rest, snapshots shared within 250 ms; the
  page's files are served without the key, an unknown file is a 404.
- A real browser (Debian's chromium, driven by Playwright): the page asks for the key, then
  while a long request runs the grid shows used blocks, the request is in the running list,
  clicking it outlines as many cells as its block table has blocks, hovering its first block
  names its owners; when it is over (the
  test closes its stream: the server aborts it) the grid shows no used block. Screenshots go to $PAGEDLLM_TEST_ARTIFACTS (default test-artifacts/).
- `--disable-dashboard`: both routes 404, a completion still succeeds.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import serving
from tests.server.helpers import MAX_MODEL_LEN, metric, read_metrics, wait_idle

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

STATE = "/v1/internal/engine_state"
ARTIFACTS = Path(os.environ.get("PAGEDLLM_TEST_ARTIFACTS", "test-artifacts")) / "dashboard"


def test_engine_state_needs_the_key_and_is_read_only(server, http):
    assert httpx.get(f"{server.url}{STATE}").status_code == 401
    bad = httpx.get(f"{server.url}{STATE}", headers={"Authorization": "Bearer wrong"})
    assert bad.status_code == 401 and bad.json()["error"]["code"] == 401
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        assert http.request(method, STATE, json={}).status_code == 405, method
    # the page's files carry no data: served without the key
    page = httpx.get(f"{server.url}/dashboard")
    assert page.status_code == 200 and "<canvas" not in page.text and "dashboard.js" in page.text
    js = httpx.get(f"{server.url}/dashboard/dashboard.js")
    assert js.status_code == 200 and "javascript" in js.headers["content-type"]
    css = httpx.get(f"{server.url}/dashboard/dashboard.css")
    assert css.status_code == 200 and "text/css" in css.headers["content-type"]
    for text in (page.text, js.text, css.text):  # works offline: nothing from a CDN
        assert "http://" not in text and "https://" not in text and "//cdn" not in text
    assert httpx.get(f"{server.url}/dashboard/secrets.txt").status_code == 404
    assert httpx.post(f"{server.url}/dashboard").status_code == 401  # only GET is open
    # still serving after all that
    done = http.post("/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": "Hi",
                                              "max_tokens": 3})
    assert done.status_code == 200, done.text


def test_engine_state_counters_equal_metrics_at_rest(http):
    # a prefix hit: the same long prompt twice
    prompt = "The block manager keeps every sequence's KV cache in fixed-size blocks. " * 6
    for _ in range(2):
        r = http.post("/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": prompt,
                                               "max_tokens": 4, "n": 2, "temperature": 1.0})
        assert r.status_code == 200, r.text
    m = wait_idle(http)
    time.sleep(0.3)  # past the shared snapshot's 250 ms
    data = http.get(STATE).json()
    assert len(data["engines"]) == 1
    snap = data["engines"][0]
    k = snap["counters"]
    assert k["prefix_cache_hits"] > 0
    assert k["prefix_cache_hits"] == metric(m, "vllm:prefix_cache_hits_total")
    assert k["prefix_cache_queries"] == metric(m, "vllm:prefix_cache_queries_total")
    assert k["num_preemptions"] == metric(m, "vllm:num_preemptions_total")
    assert k["generation_tokens_total"] == metric(m, "vllm:generation_tokens_total")
    counts = snap["blocks"]["counts"]
    assert counts["used"] + counts["shared"] == 0 == metric(m, "pagedllm:kv_cache_used_blocks")
    assert counts["cached"] > 0 and sum(counts.values()) == snap["config"]["num_blocks"]
    assert snap["config"]["max_model_len"] == MAX_MODEL_LEN
    # a second poll within 250 ms gets the same snapshot: the core made one
    first, second = http.get(STATE).json(), http.get(STATE).json()
    assert first["served_at"] == second["served_at"]
    assert "history" not in first["engines"][0]
    # ?history=1: the last minutes of the stats the core sent, one sample a second
    history = http.get(STATE, params={"history": 1}).json()["engines"][0]["history"]
    assert len(history) >= 1 and all(a["t"] < b["t"] for a, b in zip(history, history[1:]))
    last = history[-1]
    assert last["prefix_cache_hits"] <= k["prefix_cache_hits"] and last["kv_num_blocks"] == snap["config"]["num_blocks"]
    assert history[0]["num_batched_tokens_total"] <= last["num_batched_tokens_total"]


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("no chromium: scripts/setup-venv.sh installs Debian's package (apt-get install chromium)")
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install .[test])")
    return path


def test_dashboard_in_a_real_browser(server, http):
    chromium = _chromium()
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    wait_idle(http)
    result: dict = {}

    stop = threading.Event()

    prompt = ("PagedAttention keeps the KV cache of every sequence in fixed-size blocks, maps "
              "each sequence's positions to blocks through a block table, and shares blocks "
              "between sequences that have the same prefix. Write a long story about it. ") * 3

    def stream(request_id: str, n: int) -> None:
        """A streamed request long enough to outlast the checks (1500 tokens); the test ends
        it by closing the stream (the server aborts it), so its length does not depend on how
        fast this machine is."""
        body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 1500,
                "ignore_eos": True, "temperature": 1.0 if n > 1 else 0.0, "n": n, "stream": True,
                "request_id": request_id}
        try:
            with httpx.Client(base_url=server.url, headers=server.headers, timeout=300.0) as own:
                with own.stream("POST", "/v1/completions", json=body) as resp:
                    result[request_id] = resp.status_code
                    for _ in resp.iter_lines():
                        result["chunks"] = result.get("chunks", 0) + 1
                        if stop.is_set():
                            break
        except Exception as exc:  # reported by the main thread
            result["error"] = repr(exc)

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True,
                                    args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(f"{server.url}/dashboard")
            # the server has an API key: the page asks for it once
            page.wait_for_selector("#key-form:not([hidden])", timeout=10_000)
            page.fill("#key-input", server.api_key)
            page.click("#key-form button")
            page.wait_for_selector("#key-form", state="hidden", timeout=10_000)
            grid = page.locator("section.engine[data-engine='0'] canvas.grid").first
            page.wait_for_function(
                "() => document.querySelector('section.engine canvas.grid')?.dataset.blocks", timeout=10_000)
            assert int(grid.get_attribute("data-blocks")) > 0
            assert int(grid.get_attribute("data-used")) == 0

            # a long request, and one of n = 3 samples on the same prompt (a prefix hit,
            # then three tables sharing its blocks)
            workers = [threading.Thread(target=stream, args=("dashboard-long", 1))]
            workers[0].start()
            item = page.locator("ul[data-queue='running'] li.request[data-request-id*='dashboard-long']")
            item.wait_for(timeout=60_000)
            page.wait_for_function(
                "() => Number(document.querySelector('section.engine canvas.grid').dataset.used) > 0",
                timeout=10_000)
            workers.append(threading.Thread(target=stream, args=("dashboard-shared", 3)))
            workers[1].start()
            page.locator("li.request[data-request-id*='dashboard-shared']").wait_for(timeout=60_000)
            item.click()
            # every cell of its table outlined: as many as the request holds blocks
            page.wait_for_function(
                """() => { const li = document.querySelector("li.request[data-request-id*='dashboard-long']");
                           const g = document.querySelector('section.engine canvas.grid');
                           return li && Number(g.dataset.highlighted) > 0
                                  && g.dataset.highlighted === li.dataset.blocks; }""", timeout=10_000)
            blocks = int(page.locator("li.request[data-request-id*='dashboard-long']").get_attribute("data-blocks"))
            snap = http.get(STATE).json()["engines"][0]
            req = next(r for r in snap["requests"] if "dashboard-long" in r["request_id"])
            table = req["seqs"][0]["block_tables"][0]
            assert len(table) == len(set(table)) and abs(len(table) - blocks) <= 1  # it grows meanwhile
            assert page.locator(".details").first.is_visible()
            time.sleep(1.5)  # a few polls of history for the charts
            page.screenshot(path=str(ARTIFACTS / "dashboard_running.png"), full_page=True)
            # hovering a cell names its owners: the first block of the prompt, shared by both
            first = table[0]
            cols, cell = int(grid.get_attribute("data-cols")), int(grid.get_attribute("data-cell"))
            box = grid.bounding_box()
            page.mouse.move(box["x"] + (first % cols) * cell + cell / 2,
                            box["y"] + (first // cols) * cell + cell / 2)
            tip = page.locator("#tooltip")
            tip.wait_for(state="visible", timeout=5_000)
            assert tip.inner_text().startswith(f"block {first}: ")
            assert "dashboard-long" in tip.inner_text(), tip.inner_text()

            stop.set()  # client gone: the server aborts the request and frees its blocks
            for worker in workers:
                worker.join(timeout=120)
            assert result.get("dashboard-long") == result.get("dashboard-shared") == 200, result
            assert result.get("chunks", 0) > 2, result
            page.wait_for_function(
                "() => document.querySelector('section.engine canvas.grid').dataset.used === '0'",
                timeout=15_000)
            assert page.locator("ul[data-queue='running'] li.request").count() == 0
            # the tooltip under the still mouse follows the redraws: the block has no owner now
            page.wait_for_function(
                """(b) => { const t = document.getElementById('tooltip');
                            return !t.hidden && t.textContent.startsWith('block ' + b + ': ')
                                   && !t.textContent.includes('owners'); }""", arg=first, timeout=5_000)
            page.screenshot(path=str(ARTIFACTS / "dashboard_idle.png"), full_page=True)
            assert errors == []
        finally:
            browser.close()
    m = wait_idle(http)
    assert metric(m, "pagedllm:kv_cache_used_blocks") == 0


def test_disable_dashboard():
    with serving(["-m", "pagedllm.entrypoints.cli", "serve", "--kv-cache-space", "0.1",
                  "--max-model-len", "512", "--disable-dashboard"]) as srv:
        with httpx.Client(base_url=srv.url, headers=srv.headers, timeout=120.0) as c:
            assert c.get("/dashboard").status_code == 404
            assert c.get("/dashboard/dashboard.js").status_code == 404
            assert c.get(STATE).status_code == 404
            r = c.post("/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": "Hi",
                                                "max_tokens": 3})
            assert r.status_code == 200, r.text
