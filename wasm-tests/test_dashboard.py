"""The Grafana dashboard with data (issue 48): a real Envoy with the plugin in
front of three emulated regions, a real Prometheus scraping its
/stats/prometheus as deploy/prometheus/prometheus.yml does, and headless
Chromium (Debian's) rendering every panel of
deploy/grafana/dashboards/llm-geo-router.json from that Prometheus.

Grafana's server is not packaged by Debian, PyPI or npm, the only
registries this project installs from, so the page Chromium renders is
ours (wasm-tests/dashboard/render.html): it sends each panel's queries as
Grafana does (query_range, Grafana's $__rate_interval, the panel's legend
template) and draws the series at the panel's place. What this catches is
what a broken dashboard shows in Grafana: a query Prometheus refuses, a
metric or label that does not exist (no data), a label the legend names
but the series lacks. Grafana's own drawing is not tested. The screenshot
is kept in the run directory (dashboard.png). The fleet is conftest's
`fleet` (probe tick 300 ms)."""

from __future__ import annotations

import html.parser
import json
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import harness
from harness import filler, stream_chat

DASHBOARD = harness.ROOT / "deploy" / "grafana" / "dashboards" / "llm-geo-router.json"
PAGE = harness.ROOT / "wasm-tests" / "dashboard" / "render.html"
SCRAPE_S = 2
# The issue-48 row: TTFT p50/p95, the router's error, tokens, duration and
# failures, per region; and panels every scene with traffic feeds.
WHAT_CLIENTS_SEE = {27, 28, 29, 30}
ALWAYS_FED = {2, 3, 4, 13, 14, 16}


def chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        raise RuntimeError("missing chromium: run scripts/setup (it installs Debian's chromium)")
    return path


class Panels(html.parser.HTMLParser):
    """The rendered page's panels: id -> their data-* attributes."""

    def __init__(self):
        super().__init__()
        self.panels: dict[int, dict[str, str]] = {}
        self.title = ""
        self._in_title = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "div" and a.get("class") == "panel":
            self.panels[int(a["data-id"])] = {k[5:]: v or "" for k, v in a.items() if k.startswith("data-")}
        self._in_title = tag == "title"

    def handle_data(self, data):
        if self._in_title:
            self.title += data

    def handle_endtag(self, tag):
        self._in_title = False


def serve(prom: harness.Prometheus) -> ThreadingHTTPServer:
    """The page, the dashboard and Prometheus's API on one origin."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.startswith("/api/v1/"):
                try:
                    with urllib.request.urlopen(prom.url + self.path, timeout=20) as r:
                        status, body = r.status, r.read()
                except urllib.error.HTTPError as e:  # Prometheus's 400 for a bad query: its JSON error
                    status, body = e.code, e.read()
                kind = "application/json"
            elif self.path.startswith("/render.html"):
                status, body, kind = 200, PAGE.read_bytes(), "text/html"
            elif self.path == "/dashboard.json":
                status, body, kind = 200, DASHBOARD.read_bytes(), "application/json"
            else:
                status, body, kind = 404, b"not found", "text/plain"
            self.send_response(status)
            self.send_header("content-type", kind)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def render(url: str, out_png, height: int) -> Panels:
    """Chromium's DOM once the page's queries answered, and its screenshot."""
    common = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
              "--disable-dev-shm-usage", f"--window-size=1600,{height}", "--virtual-time-budget=30000"]
    dom = subprocess.run(common + ["--dump-dom", url], capture_output=True, text=True, timeout=180)
    assert dom.returncode == 0, dom.stderr[-2000:]
    shot = subprocess.run(common + [f"--screenshot={out_png}", url], capture_output=True, text=True, timeout=180)
    assert shot.returncode == 0 and out_png.exists(), shot.stderr[-2000:]
    panels = Panels()
    panels.feed(dom.stdout)
    return panels


def wait_stat(envoy, name: str, want: int, timeout: float = 30.0) -> None:
    harness.until(lambda: envoy.stat(f"wasmcustom.llm_geo_router.{name}"), lambda v: v == want, timeout,
                  f"{name}, waiting for {want}")


def test_the_dashboards_panels_render_with_data(fleet):
    envoy, port = fleet.envoy, fleet.port
    prom = harness.start_prometheus(fleet.run_dir, {"envoy": [envoy.admin_port]}, scrape_interval=f"{SCRAPE_S}s",
                                    metrics_path="/stats/prometheus", job="envoy")
    try:
        served: set[str] = set()
        answered = 0

        def send(tag: str, n: int) -> list[dict]:
            nonlocal answered
            out = [stream_chat(port, filler(f"{tag}-{i}-{time.time()}", 400), max_tokens=6) for i in range(n)]
            for r in out:
                if r["status"] == 200:
                    served.add(r["replica"])
                    answered += 1
            return out

        # Over about 20 s, so that every rate window sees Envoy's stats
        # flushes (every 5 s): answered by near, a few failed there with
        # the engine's 500, then answered elsewhere while near is down.
        for round_ in range(3):
            send(f"dash-near-{round_}", 4)
            time.sleep(2)
        fleet.engines["near"].set_state(fail_status=500)
        failed = [r for r in send("dash-fail", 3) if r["status"] == 500]
        fleet.engines["near"].set_state(fail_status=0)
        assert failed, "no request failed at near"
        fleet.engines["near"].set_state(healthy=False)
        wait_stat(envoy, "region.near.healthy", 0)
        for round_ in range(3):
            send(f"dash-away-{round_}", 4)
            time.sleep(2)
        assert len(served) >= 2, served
        # Until Prometheus has scraped every answer's TTFT sample.
        deadline = time.time() + 30
        while True:
            got = prom.query("sum(gen_ai_server_time_to_first_token_milliseconds_count)")
            have = float(got[0]["value"][1]) if got else 0.0
            if have >= answered or time.time() > deadline:
                break
            time.sleep(0.5)
        assert have == answered, (have, answered)
        time.sleep(2 * SCRAPE_S)

        server = serve(prom)
        try:
            dash = json.loads(DASHBOARD.read_text())
            height = 30 * max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in dash["panels"])
            url = (f"http://127.0.0.1:{server.server_port}/render.html"
                   f"?range=60&step=2&scrape={SCRAPE_S}&width=1600")
            png = fleet.run_dir / "dashboard.png"
            page = render(url, png, height)
        finally:
            server.shutdown()
    finally:
        prom.stop()

    assert page.title == "rendered", page.title
    want = {p["id"] for p in dash["panels"] if p["type"] != "row"}
    assert set(page.panels) == want, (sorted(page.panels), sorted(want))
    # Every query of every panel is one Prometheus accepts.
    errors = {i: p["error"] for i, p in page.panels.items() if p.get("error")}
    assert not errors, errors
    # The panels this traffic feeds have data.
    empty = {i: page.panels[i]["title"] for i in WHAT_CLIENTS_SEE | ALWAYS_FED if int(page.panels[i]["series"]) == 0}
    assert not empty, empty

    def regions(i: int) -> set[str]:
        return {name.split(" ")[0] for name in json.loads(page.panels[i]["nonzero"])}

    # TTFT, the router's error and tokens: a series other than 0 for each
    # region that served and no other, named by it through the tag
    # extraction (a lost label would leave a nameless series). Envoy
    # exports a region's histograms before its first sample: far's
    # tokens are a series of zeros, its quantiles and mean error none.
    for i in (27, 28, 29):
        assert regions(i) == served, (page.panels[i]["title"], regions(i), served)
    assert "near upstream_5xx /s" in json.loads(page.panels[30]["legend"]), page.panels[30]["legend"]
    assert png.stat().st_size > 20_000, png.stat().st_size
