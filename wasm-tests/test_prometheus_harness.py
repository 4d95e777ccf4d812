"""The harness parts for regions of many replicas whose load is read from
Prometheus (issue 17), checked on their own, before the plugin reads
Prometheus: a region started as three emulator replicas behind its Envoy
cluster, a real Prometheus scraping every replica with `region` and
`replica` labels, and the `prometheus` cluster the probe will call.

One replica is saturated as an engine is under load: its running slots
full (--max-concurrency 2 here) with slow requests sent straight to it, and
more waiting in its queue. Prometheus must then report the region's total
queue and its three replicas."""

import urllib.request
from collections import Counter

import harness
from harness import chat

FAST = {"probe": {"tick_ms": 300, "timeout_ms": 300, "snapshot_max_age_ms": 3000}}
NEAR = ["near-0", "near-1", "near-2"]
WAITING = "sum by (region) (vllm:num_requests_waiting)"
RUNNING = "vllm:num_requests_running"


def cluster_hosts(envoy: harness.Envoy) -> dict[str, set[int]]:
    """Envoy's view of each cluster's endpoints (admin /clusters): ports."""
    with urllib.request.urlopen(f"http://127.0.0.1:{envoy.admin_port}/clusters", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, set[int]] = {}
    for line in text.splitlines():
        parts = line.split("::")
        if len(parts) >= 3 and parts[2] == "cx_active":
            out.setdefault(parts[0], set()).add(int(parts[1].rsplit(":", 1)[1]))
    return out


def test_three_replicas_share_near_and_prometheus_sums_their_load(fleet_factory):
    fleet = fleet_factory(FAST, engine_extra={"near-2": ["--max-concurrency", "2"]},
                          replicas={"near": 3}, prometheus=True)
    near = fleet.replicas["near"]
    prom = fleet.prometheus
    assert [e.name for e in near] == NEAR and len({e.port for e in near}) == 3
    assert fleet.engines["near"] is near[0]
    assert [e.name for e in fleet.replicas["mid"]] == ["mid"], "one replica by default, named as its region"

    # Envoy has the three replicas in near's cluster, and a cluster for Prometheus.
    hosts = cluster_hosts(fleet.envoy)
    assert {e.port for e in near} <= hosts["region_near"], hosts
    assert hosts[harness.PROMETHEUS_CLUSTER] == {prom.port}, hosts

    # Prometheus scrapes every replica, each labelled with its region and name.
    assert prom.by("up", "replica") == {**{n: 1.0 for n in NEAR}, "mid": 1.0, "far": 1.0}
    assert {s["metric"]["replica"]: s["metric"]["region"] for s in prom.query(RUNNING)} == {
        **{n: "near" for n in NEAR}, "mid": "mid"}  # far is SGLang: sglang:num_running_reqs

    # Envoy spreads near's requests over its replicas.
    path = "/v1/chat/completions"
    before = {e.name: e.stats()["requests"].get(path, 0) for e in near}
    served = Counter()
    # Cold prompts go to near, the nearest, unless one RTT sample of a
    # loaded machine makes mid look as close: count near's nine.
    for i in range(40):
        r = chat(fleet.port, [{"role": "user", "content": f"spread {i}"}])
        assert r.status == 200, (r.status, r.route)
        if r.route.get("region") == "near":
            served[r.replica] += 1
        if sum(served.values()) == 9:
            break
    assert sum(served.values()) == 9, served
    assert set(served) == set(NEAR), served
    assert {e.name: e.stats()["requests"].get(path, 0) - before[e.name] for e in near} == served

    # Saturate near-2: 2 requests running (its limit), 3 waiting.
    busy = near[2]
    load = harness.saturate(busy, 5, max_tokens=8000)  # 8 s of decode each
    try:
        until(lambda: (busy.stats()["running"], busy.stats()["waiting"]) == (2, 3))
        # Each replica's gauges are as of its last scrape (<= 1 s old): wait
        # until every replica has been scraped since the loads changed.
        prom.wait_for(f"sum by (replica) ({RUNNING})", {"near-0": 0.0, "near-1": 0.0, "near-2": 2.0, "mid": 0.0},
                      "replica")
        assert prom.wait_for(WAITING, {"near": 3.0, "mid": 0.0}) == {"near": 3.0, "mid": 0.0}
        assert prom.by(f"count by (region) ({RUNNING})") == {"near": 3.0, "mid": 1.0}
        assert prom.by('vllm:num_requests_waiting{region="near"}', "replica") == {
            "near-0": 0.0, "near-1": 0.0, "near-2": 3.0}
    finally:
        load.close()
    # The dropped requests leave the replica, and Prometheus sees the queue go.
    until(lambda: (busy.stats()["running"], busy.stats()["waiting"]) == (0, 0))
    prom.wait_for(WAITING, {"near": 0.0, "mid": 0.0})


def until(cond, timeout: float = 5.0) -> None:
    harness.until(cond, bool, timeout, "the condition")
