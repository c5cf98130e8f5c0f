"""The engine dashboard: `GET /dashboard` (a static page) and its one data endpoint.

`GET /v1/internal/engine_state` answers every engine core's snapshot (engine/dashboard_snapshot.py),
each made by the core between two steps through the existing utility call, so the engine pays
nothing while nobody watches. Snapshots are shared for `MIN_INTERVAL_S`: however many pages
poll, each core makes at most four a second. The endpoint is read-only (GET only) and sits
behind `--api-key` like the API; the page's files hold no data and are served without the
key (a browser cannot send a header with a plain page load): the page asks for the key once
and sends it as a Bearer header on each poll. `--disable-dashboard` leaves out both routes.
docs/dashboard.md has the page, the JSON schema and the measured cost.
"""

from __future__ import annotations

import asyncio
import time
from importlib import resources
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Query
from fastapi.responses import JSONResponse, Response

from pagedllm.engine.dashboard_snapshot import add_request_timings
from pagedllm.entrypoints.openai.errors import OpenAIError

if TYPE_CHECKING:
    from pagedllm.engine.async_engine import AsyncLLMEngine

DASHBOARD_PATH = "/dashboard"
STATE_PATH = "/v1/internal/engine_state"
MIN_INTERVAL_S = 0.25  # the fastest a core is asked for a snapshot
POLL_INTERVAL_MS = 500  # what the page polls at
UTILITY_TIMEOUT_S = 10.0
# The page's files (pagedllm/entrypoints/static, package data) and their media types.
STATIC_FILES = {
    "index.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}


def is_dashboard_page(path: str) -> bool:
    """The page's own files, served without the API key (they carry no engine data)."""
    return path == DASHBOARD_PATH or path.startswith(DASHBOARD_PATH + "/")


def _static_file(name: str) -> bytes:
    return resources.files("pagedllm.entrypoints.static").joinpath(name).read_bytes()


class EngineStateSource:
    """Every core's snapshot, at most one per `MIN_INTERVAL_S`, with the front end's timings."""

    def __init__(self, engine: "AsyncLLMEngine", min_interval_s: float = MIN_INTERVAL_S) -> None:
        self.engine = engine
        self.min_interval_s = min_interval_s
        self._lock = asyncio.Lock()
        self._last: dict[str, Any] | None = None
        self._last_at = 0.0
        self.num_snapshots = 0  # made by the cores (tests read it)

    async def get(self) -> dict[str, Any]:
        async with self._lock:
            if self._last is not None and time.monotonic() - self._last_at < self.min_interval_s:
                return self._last
            self._last = await self._collect()
            self._last_at = time.monotonic()
            return self._last

    async def _collect(self) -> dict[str, Any]:
        engine = self.engine
        indices = [i for i in range(len(engine.clients)) if i not in engine.dead_engines]
        results = await asyncio.gather(*(
            asyncio.wait_for(engine.call_utility("engine_state", engine_index=i), UTILITY_TIMEOUT_S)
            for i in indices), return_exceptions=True)
        now = time.time()
        engines = []
        for i, result in zip(indices, results):
            if isinstance(result, BaseException):
                engines.append({"engine_index": i, "error": f"{type(result).__name__}: {result}"})
                continue
            self.num_snapshots += 1
            add_request_timings(result, engine.output_processor, now)
            result["counters"].update(self._front_end_counters(i))
            engines.append(result)
        for i, why in sorted(engine.dead_engines.items()):
            engines.append({"engine_index": i, "error": str(why)})
        return {"served_at": now, "poll_interval_ms": POLL_INTERVAL_MS,
                "min_interval_ms": int(self.min_interval_s * 1000),
                "engines": sorted(engines, key=lambda e: e["engine_index"])}

    def _front_end_counters(self, index: int) -> dict[str, float]:
        """Token counters only the front end has, read from /metrics' own registry."""
        metrics = self.engine.metrics
        if metrics is None:
            return {}
        labels = {"model_name": metrics.model_name, "engine": str(index)}
        out = {}
        for key, series in (("generation_tokens_total", "vllm:generation_tokens_total"),
                            ("prompt_tokens_total", "vllm:prompt_tokens_total")):
            value = metrics.registry.get_sample_value(series, labels)
            out[key] = value if value is not None else 0.0
        return out


def install_dashboard(app: FastAPI, engine: "AsyncLLMEngine") -> EngineStateSource:
    """Add the page and the data endpoint to `app`."""
    source = EngineStateSource(engine)

    @app.get(STATE_PATH)
    async def engine_state(history: bool = Query(False)) -> JSONResponse:
        """`?history=1`: also each core's last minutes (engine/stats_history.py), which a page
        asks for once, when it opens."""
        data = await source.get()
        if history:
            data = dict(data, engines=[
                dict(e, history=engine.stats_history.samples(e["engine_index"]))
                for e in data["engines"]])
        return JSONResponse(data, headers={"Cache-Control": "no-store"})

    @app.get(DASHBOARD_PATH)
    async def dashboard_page() -> Response:
        return _file_response("index.html")

    @app.get(DASHBOARD_PATH + "/{name}")
    async def dashboard_file(name: str) -> Response:
        if name not in STATIC_FILES:
            raise OpenAIError(f"No dashboard file {name!r}.", 404)
        return _file_response(name)

    app.state.engine_state_source = source
    return source


def _file_response(name: str) -> Response:
    return Response(_static_file(name), media_type=STATIC_FILES[name],
                    headers={"Cache-Control": "no-cache"})
