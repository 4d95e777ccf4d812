"""Load from Prometheus in a real Envoy against a real Prometheus (issue
17): `near` is three emulator replicas behind its Envoy cluster, two slots
each; one of them is saturated (2 running, 6 waiting). With
`load_source: prometheus` the probe's one query per round gives near's
total load and its three replicas, so the router prices near by all of it
(8 requests on 6 slots: a queue) and sends new prompts to mid until the
load is gone. With the direct scrape on the same region, each scrape lands
on the one replica Envoy's load balancer picks: the router sees a random
replica's queue, 6 or 0. Probe tick 300 ms, Prometheus scrape 1 s."""

import time

import yaml

import harness
from harness import chat
from test_routing import wait_stat

FAST = {"probe": {"tick_ms": 300, "timeout_ms": 300, "snapshot_max_age_ms": 3000}}
PER_REPLICA = 2


def regions(**near) -> list[dict]:
    """The demo's regions, with these fields set on near."""
    cfg = yaml.safe_load(harness.DEMO_CONFIG.read_text())
    out = harness.plugin_config(cfg)["regions"]
    for r in out:
        if r["name"] == "near":
            r.update(near)
    return out


def gauge(envoy, name):
    return envoy.stat(f"wasmcustom.llm_geo_router.{name}")


def fleet_with_saturated_replica(fleet_factory, overrides, prometheus):
    fleet = fleet_factory({**FAST, **overrides}, engine_extra={"near": ["--max-concurrency", str(PER_REPLICA)]},
                          replicas={"near": 3}, prometheus=prometheus)
    busy = fleet.replicas["near"][2]
    load = harness.saturate(busy, 8, max_tokens=20000)
    deadline = time.time() + 10 + harness.STALL_S
    while (busy.stats()["running"], busy.stats()["waiting"]) != (2, 6):
        assert time.time() < deadline, busy.stats()
        time.sleep(0.05)
    return fleet, load


def test_prometheus_source_prices_a_region_by_all_its_replicas(fleet_factory):
    fleet, load = fleet_with_saturated_replica(fleet_factory, {
        "regions": regions(max_concurrency=PER_REPLICA, load_source="prometheus"),
        "prometheus": {"cluster": harness.PROMETHEUS_CLUSTER},
    }, prometheus=True)
    envoy = fleet.envoy
    try:
        assert wait_stat(envoy, "region.near.replicas", lambda v: v == 3, timeout=15) == 3
        # The region's total: 6 waiting and 2 running, every round, whichever
        # replica holds them.
        wait_stat(envoy, "region.near.engine_waiting", lambda v: v == 6, timeout=15)
        # (Before Prometheus first scraped the replicas, its answers had no
        # figures for near: failed scrapes. None since.)
        failures = gauge(envoy, "region.near.metrics_scrape_failure")
        seen = set()
        for _ in range(10):
            seen.add((gauge(envoy, "region.near.engine_waiting"), gauge(envoy, "region.near.engine_running")))
            time.sleep(0.3)
        assert seen == {(6, 2)}, seen
        # 8 requests on near's 6 slots: new prompts go to mid, every one.
        for i in range(6):
            r = chat(fleet.port, [{"role": "user", "content": f"while near is full {i}"}])
            assert r.status == 200 and r.route["region"] == "mid", r.route
        assert gauge(envoy, "region.near.metrics_scrape_failure") == failures
    finally:
        load.close()
    # The load is gone: near, the nearest, is priced free again.
    wait_stat(envoy, "region.near.engine_waiting", lambda v: v == 0, timeout=15)
    wait_stat(envoy, "region.near.engine_running", lambda v: v == 0, timeout=15)
    # (A few tries: one RTT sample on a loaded machine can make mid look
    # as close for a moment.)
    routes = []
    for i in range(5):
        r = chat(fleet.port, [{"role": "user", "content": f"near is free again {i}"}])
        assert r.status == 200
        routes.append(r.route["region"])
        if routes[-1] == "near":
            break
    assert routes[-1] == "near", routes


def test_prometheus_that_fails_is_a_failed_scrape_never_a_crash(fleet_factory):
    fleet = fleet_factory({**FAST, "regions": regions(load_source="prometheus"),
                           "prometheus": {"cluster": harness.PROMETHEUS_CLUSTER, "path": "/api/v1/nothing"}},
                          prometheus=True)
    envoy = fleet.envoy
    wait_stat(envoy, "region.near.metrics_scrape_failure", lambda v: v >= 3, timeout=15)
    assert "Prometheus query failed: status 404" in envoy.log()
    # Health comes from the health callout: near stays routable.
    assert gauge(envoy, "region.near.healthy") == 1
    r = chat(fleet.port, [{"role": "user", "content": "still routed"}])
    assert r.status == 200 and r.route["reason"] != "fallback", r.route


def test_the_direct_scrape_of_the_same_region_sees_a_random_replica(fleet_factory):
    # An operator on the scrape source configures the region's total slots.
    fleet, load = fleet_with_saturated_replica(fleet_factory, {
        "regions": regions(max_concurrency=3 * PER_REPLICA),
    }, prometheus=False)
    envoy = fleet.envoy
    try:
        seen = set()
        deadline = time.time() + 10 + harness.STALL_S
        while time.time() < deadline and not {0, 6} <= seen:
            seen.add(gauge(envoy, "region.near.engine_waiting"))
            time.sleep(0.1)
        # Each scrape reads one replica: the saturated one (6 waiting) or an
        # idle one (0), never the region's total as one figure per round.
        assert {0, 6} <= seen, seen
        assert gauge(envoy, "region.near.replicas") == 1
    finally:
        load.close()


def test_prometheus_source_sums_each_replicas_cache_capacity(fleet_factory):
    # Three vLLM replicas of unequal pools behind near, and SGLang far, both
    # through Prometheus: the capacity is the sum of what each replica
    # states (count x max would say 600000 for near).
    from test_probe import _engine_capacity

    rs = regions(load_source="prometheus")
    for r in rs:
        if r["name"] == "far":
            r["load_source"] = "prometheus"
    fleet = fleet_factory({**FAST, "regions": rs, "prometheus": {"cluster": harness.PROMETHEUS_CLUSTER}},
                          engine_extra={"near-0": ["--cache-tokens", "50000"],
                                        "near-1": ["--cache-tokens", "100000"],
                                        "near-2": ["--cache-tokens", "200000"],
                                        "far": ["--cache-tokens", "123457"]},
                          replicas={"near": 3}, prometheus=True)
    envoy = fleet.envoy
    stated = [_engine_capacity(e) for e in fleet.replicas["near"]]
    assert stated == [50000, 100000, 200000], stated
    far = _engine_capacity(fleet.engines["far"])
    wait_stat(envoy, "region.near.kv_capacity_tokens", lambda v: v == sum(stated), timeout=15)
    wait_stat(envoy, "region.far.kv_capacity_tokens", lambda v: v == far, timeout=15)
    # mid is scraped directly: its engine's default pool.
    mid = _engine_capacity(fleet.engines["mid"])
    assert gauge(envoy, "region.mid.kv_capacity_tokens") == mid
    assert gauge(envoy, "region.near.kv_capacity_rejected") == 0
    assert "KV-cache capacity" not in envoy.log()
