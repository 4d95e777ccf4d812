"""What Prometheus sees: a real Envoy running the plugin with the demo
configuration (and its stats_tags), after ordinary, invalid, shed, capped and
fallback-pool traffic. Regions, tiers and decision reasons are labels, not
parts of metric names; every metric docs/STATS.md names is exported with the
documented type and labels, every plugin metric exported is documented, and
the Grafana dashboard queries only exported metrics and labels."""

from __future__ import annotations

import json
import re
import time
import urllib.request

import pytest

import harness
from harness import Scrape, chat, filler, request

STATS_DOC = harness.ROOT / "docs" / "STATS.md"
DASHBOARD = harness.ROOT / "deploy" / "grafana" / "dashboards" / "llm-geo-router.json"
PAID = {"authorization": "Bearer sk-demo-paid"}
OPERATOR = {"authorization": "Bearer demo-operator-token"}
REGIONS = {"near", "mid", "far"}
TIERS = {"free", "paid", "critical"}
REASONS = {"cache", "load", "rtt", "load_override", "spread", "pin", "context", "fallback", "response"}

def wait_level(envoy, level: int, timeout: float = 10.0) -> None:
    harness.until(lambda: envoy.stat("wasmcustom.llm_geo_router.ladder.level"), lambda v: v == level, timeout,
                  f"the ladder, waiting for level {level}")


@pytest.fixture(scope="module")
def scraped():
    fleet = harness.Fleet(harness.fresh_run_dir("test_stats"))
    try:
        fleet.start({"probe": {"tick_ms": 300, "timeout_ms": 300, "snapshot_max_age_ms": 3000}}, fallback=True)
        port, envoy = fleet.port, fleet.envoy
        for i in range(6):
            assert chat(port, [{"role": "user", "content": f"stats {i}"}]).status == 200
        assert request(port, "POST", "/v1/chat/completions", b'{"model": ').status == 400
        # Level 5: free traffic is shed, paid prompts are capped and max_tokens lowered.
        assert request(port, "POST", "/llm-geo-router/ladder", {"level": 5}, headers=OPERATOR).status == 200
        wait_level(envoy, 5)
        assert chat(port, [{"role": "user", "content": "shed"}]).status == 429
        assert chat(port, [{"role": "user", "content": filler("big", 40_000)}], headers=PAID).status == 413
        assert chat(port, [{"role": "user", "content": "clamp"}], headers=PAID, max_tokens=1000).status == 200
        # Level 4: free traffic goes to the fallback pool.
        assert request(port, "POST", "/llm-geo-router/ladder", {"level": 4}, headers=OPERATOR).status == 200
        wait_level(envoy, 4)
        assert chat(port, [{"role": "user", "content": "to the pool"}]).status == 200
        url = f"http://127.0.0.1:{envoy.admin_port}"
        with urllib.request.urlopen(url + "/stats/prometheus", timeout=10) as r:
            prom = Scrape(r.read().decode())
        with urllib.request.urlopen(url + "/stats", timeout=10) as r:
            text = r.read().decode()
        yield prom, text
    finally:
        fleet.stop()


def documented() -> dict[str, tuple[str, set[str]]]:
    """docs/STATS.md's table rows: name -> (type, label names)."""
    out = {}
    for line in STATS_DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[0].startswith("`"):
            continue
        name = cells[0].strip("`")
        assert name not in out, f"{name} documented twice"
        out[name] = (cells[1], set(re.findall(r"`([a-z_]+)`", cells[2])))
    assert len(out) >= 30, "docs/STATS.md tables not found"
    return out


PLUGIN_PREFIXES = ("llm_geo_router_", "gen_ai_")


def test_regions_tiers_and_reasons_are_labels_not_name_parts(scraped):
    prom, _ = scraped
    names = [n for n in prom.samples if n.startswith(PLUGIN_PREFIXES)]
    entity = REGIONS | TIERS | {"cache", "load", "pin"}
    for n in names:
        parts = set(n.split("_"))
        assert not parts & entity, f"{n} still carries a region, tier or reason"
    samples = prom.samples["llm_geo_router_region_rq_total"]
    assert {l["llm_geo_router_region"] for l, _ in samples} == REGIONS
    assert {l["llm_geo_router_tier"] for l, _ in prom.samples["llm_geo_router_guard_tier_shed"]} == TIERS
    assert {l["llm_geo_router_reason"] for l, _ in prom.samples["llm_geo_router_router_decision"]} == REASONS
    per_region = prom.samples["llm_geo_router_region_decision"]
    assert {(l["llm_geo_router_region"], l["llm_geo_router_reason"]) for l, _ in per_region} == {
        (r, why) for r in REGIONS for why in REASONS}
    assert {l["wasm_plugin"] for l, _ in prom.samples["envoy_wasm_vm_reload"]} == {
        "llm_geo_router_probe", "llm_geo_router_guard", "llm_geo_router_router"}


def test_admin_stats_keep_the_full_names(scraped):
    # The suite and operators read /stats with the region in the name.
    _, text = scraped
    for name in ("wasmcustom.llm_geo_router.region.near.rq_active",
                 "wasmcustom.llm_geo_router.region.far.rq_total",
                 "wasmcustom.llm_geo_router.region.mid.decision.load_override",
                 "wasmcustom.llm_geo_router.router.decision.rtt",
                 "wasmcustom.llm_geo_router.guard.tier.free.shed",
                 "wasmcustom.llm_geo_router.probe.snapshot_version",
                 "wasm.llm_geo_router_probe.vm_reload"):
        assert re.search(rf"^{re.escape(name)}: \d+$", text, re.M), name


def test_traffic_lands_on_the_labelled_series(scraped):
    prom, _ = scraped
    assert prom.value("llm_geo_router_region_rq_total") >= 7
    assert sum(prom.value("llm_geo_router_router_decision", llm_geo_router_reason=r) for r in REASONS) >= 7
    assert prom.value("llm_geo_router_router_invalid_request") == 1
    assert prom.value("llm_geo_router_guard_tier_shed", llm_geo_router_tier="free") == 1
    assert prom.value("llm_geo_router_guard_tier_prompt_too_long", llm_geo_router_tier="paid") == 1
    assert prom.value("llm_geo_router_guard_tier_max_tokens_clamped", llm_geo_router_tier="paid") == 1
    assert prom.value("llm_geo_router_guard_tier_fallback", llm_geo_router_tier="free") == 1
    assert prom.value("llm_geo_router_region_fallback_rq_total") == 1
    assert prom.value("llm_geo_router_ladder_level") == 4
    assert prom.value("llm_geo_router_ladder_override_active") == 1
    for r in REGIONS:
        assert prom.value("llm_geo_router_region_healthy", llm_geo_router_region=r) == 1
        assert prom.value("llm_geo_router_region_rtt_ms", llm_geo_router_region=r) > 0


def test_every_documented_metric_is_exported_with_its_type_and_labels(scraped):
    prom, _ = scraped
    for name, (kind, labels) in documented().items():
        assert name in prom.types, f"docs/STATS.md names {name}, which Envoy does not export"
        assert prom.types[name] == kind, f"{name}: documented {kind}, exported {prom.types[name]}"
        if kind == "histogram":
            for suffix, extra in (("_count", set()), ("_sum", set()), ("_bucket", {"le"})):
                have = prom.labels(name + suffix)
                assert have == labels | extra, f"{name}{suffix}: documented labels {labels | extra}, exported {have}"
            continue
        assert name in prom.samples, f"docs/STATS.md names {name}, which Envoy does not export"
        assert prom.labels(name) == labels, f"{name}: documented labels {labels}, exported {prom.labels(name)}"


def test_every_exported_plugin_metric_is_documented(scraped):
    prom, _ = scraped
    docs = documented()
    missing = sorted({prom.metric(n) for n in prom.samples if n.startswith(PLUGIN_PREFIXES)} - set(docs))
    assert not missing, f"exported but not in docs/STATS.md: {missing}"


PROMQL_WORDS = {"sum", "min", "max", "avg", "count", "rate", "increase", "irate", "by", "without", "on",
                "ignoring", "group_left", "group_right", "and", "or", "unless", "offset", "bool", "topk",
                "bottomk", "histogram_quantile", "clamp_min", "clamp_max", "abs", "delta", "deriv",
                "avg_over_time", "max_over_time", "min_over_time", "changes", "resets", "time", "vector",
                "scalar", "label_replace"}


def dashboard_queries() -> list[str]:
    out = []

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                out.append(node["expr"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(json.loads(DASHBOARD.read_text()))
    return out


def promql_names(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) an expression uses."""
    labels = set()
    for inside in re.findall(r"\{([^}]*)\}", expr):
        labels |= set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", inside))
    for inside in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", expr):
        labels |= set(re.findall(r"[a-zA-Z_][a-zA-Z0-9_]*", inside))
    rest = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"", " ", expr)
    rest = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", rest)
    metrics = {w for w in re.findall(r"(?<![\w$.])[a-zA-Z_:][a-zA-Z0-9_:]*", rest) if w not in PROMQL_WORDS}
    return metrics, labels


def test_dashboard_queries_only_exported_metrics_and_labels(scraped):
    prom, _ = scraped
    queries = dashboard_queries()
    assert len(queries) >= 20
    used = set()
    all_labels = {k for n in prom.samples for k in prom.labels(n)} | {"instance", "job"}
    for q in queries:
        metrics, labels = promql_names(q)
        assert metrics, f"no metric in {q!r}"
        for m in metrics:
            assert m in prom.samples, f"dashboard query {q!r} uses {m}, which Envoy does not export"
        assert labels <= all_labels, f"dashboard query {q!r} uses labels {labels - all_labels}"
        used |= metrics
    # Legends name labels as {{label}}.
    legends = set(re.findall(r"\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}", DASHBOARD.read_text()))
    assert legends <= all_labels, f"dashboard legends use labels {legends - all_labels}"
    # The panels the README promises.
    for m in ("llm_geo_router_region_rq_total", "llm_geo_router_router_decision", "llm_geo_router_ladder_level",
              "llm_geo_router_ladder_capacity_ratio_pct", "llm_geo_router_ladder_demand_rps",
              "llm_geo_router_ladder_capacity_rps", "llm_geo_router_assessment_state",
              "llm_geo_router_region_healthy", "llm_geo_router_tuning_observations",
              "llm_geo_router_region_upstream_failure"):
        assert m in used, f"no dashboard panel uses {m}"


def test_promql_name_extraction():
    assert promql_names('sum by (a_b) (rate(m_x{c="d", e=~"f"}[$__rate_interval])) / 1000') == (
        {"m_x"}, {"a_b", "c", "e"})
