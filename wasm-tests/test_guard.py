"""The guard inside a real Envoy: the ladder climbs under demand over
capacity and recovers after the dwell; each level's caps apply per tier;
the tier comes from the API key, never from a client-sent header."""

import threading
import time

import yaml

import harness
from harness import chat, filler
from test_routing import wait_stat

PAID = {"authorization": "Bearer sk-demo-paid"}
CRITICAL = {"authorization": "Bearer sk-demo-critical"}


def demo_plugin():
    return harness.plugin_config(yaml.safe_load(harness.DEMO_CONFIG.read_text()))


def overrides(capacity_rps, **ladder):
    regions = demo_plugin()["regions"]
    for r in regions:
        r["capacity_rps"] = capacity_rps
    return {
        "regions": regions,
        "probe": {"tick_ms": 300, "timeout_ms": 300, "snapshot_max_age_ms": 3000},
        "ladder": ladder,
    }


def level_of(envoy):
    return envoy.stat("wasmcustom.llm_geo_router.ladder.level")


def check_level_five_policies(port):
    # free: shed with a jittered Retry-After in the configured range.
    retry = []
    for i in range(40):
        r = chat(port, [{"role": "user", "content": f"free {i}"}])
        assert r.status == 429, (r.status, r.body)
        err = r.json()["error"]
        assert err["code"] == "degraded_mode_shed" and err["type"] == "rate_limit_error"
        retry.append(int(r.headers["retry-after"]))
    assert all(5 <= v <= 30 for v in retry), retry
    assert len(set(retry)) >= 8, f"Retry-After not spread: {sorted(set(retry))}"
    # paid: prompt cap 8192 tokens (about 32 KB) -> 413.
    r = chat(port, [{"role": "user", "content": filler("big", 40_000)}], headers=PAID)
    assert r.status == 413, r.body
    assert r.json()["error"]["code"] == "context_length_exceeded"
    # paid: max_tokens clamped to 256 in the body; the engine parsed it, so
    # Content-Length was right.
    r = chat(port, [{"role": "user", "content": "short paid"}], headers=PAID, max_tokens=1000)
    assert r.status == 200, r.body
    assert r.json()["usage"]["completion_tokens"] == 256
    r = chat(port, [{"role": "user", "content": "paid mct"}], headers=PAID, max_tokens=None,
             max_completion_tokens=900)
    assert r.status == 200 and r.json()["usage"]["completion_tokens"] == 256
    # critical: untouched.
    r = chat(port, [{"role": "user", "content": "critical"}], headers=CRITICAL, max_tokens=300)
    assert r.status == 200 and r.json()["usage"]["completion_tokens"] == 300
    assert r.headers["x-echo-x-llm-tier"] == "critical"


def test_ladder_climbs_one_rung_per_tick_applies_caps_and_recovers_per_dwell(fleet_factory):
    fleet = fleet_factory(overrides(1, dwell_s=2))
    envoy = fleet.envoy
    stop = threading.Event()

    def load():
        i = 0
        while not stop.is_set():
            try:
                chat(fleet.port, [{"role": "user", "content": f"load {i}"}], timeout=10)
            except OSError:
                pass
            i += 1
            time.sleep(0.05)

    threads = [threading.Thread(target=load) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        wait_stat(envoy, "ladder.level", lambda v: v == 5, timeout=15)
        ups = harness.ladder_changes(envoy)
        assert [c.level for c in ups] == [1, 2, 3, 4, 5], ups
        # One rung per probe tick, never two at once.
        assert [b.tick - a.tick for a, b in zip(ups, ups[1:])] == [1, 1, 1, 1], ups
        check_level_five_policies(fleet.port)
        assert envoy.stat("wasmcustom.llm_geo_router.guard.tier.free.shed") >= 40
        assert envoy.stat("wasmcustom.llm_geo_router.guard.tier.paid.prompt_too_long") == 1
        assert envoy.stat("wasmcustom.llm_geo_router.guard.tier.paid.max_tokens_clamped") == 2
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=20)
    # Demand gone: one rung down per 2 s dwell (the probe's own clock: Envoy
    # logs each change when the probe makes it, to the millisecond).
    wait_stat(envoy, "ladder.level", lambda v: v == 0, timeout=40)
    downs = harness.ladder_changes(envoy)[len(ups):]
    assert [c.level for c in downs] == [4, 3, 2, 1, 0], downs
    gaps = [b.at_s - a.at_s for a, b in zip(downs, downs[1:])]
    assert all(g >= 2.0 - 0.05 for g in gaps), gaps
    r = chat(fleet.port, [{"role": "user", "content": "free again"}])
    assert r.status == 200
    assert not harness.traps(envoy)


def test_forged_tier_header_is_ignored(fleet_factory):
    fleet = fleet_factory(overrides(20, forced_level=5))
    harness_wait_level(fleet.envoy, 5)
    r = chat(fleet.port, [{"role": "user", "content": "i am critical, trust me"}],
             headers={"x-llm-tier": "critical"})
    assert r.status == 429
    # A paid key with a forged header is still paid: capped, and the engine sees "paid".
    r = chat(fleet.port, [{"role": "user", "content": "paid"}], headers={**PAID, "x-llm-tier": "critical"},
             max_tokens=1000)
    assert r.status == 200
    assert r.json()["usage"]["completion_tokens"] == 256
    assert r.headers["x-echo-x-llm-tier"] == "paid"
    r = chat(fleet.port, [{"role": "user", "content": "crit"}], headers=CRITICAL, max_tokens=300)
    assert r.status == 200 and r.json()["usage"]["completion_tokens"] == 300


def harness_wait_level(envoy, level, timeout=10):
    harness.until(lambda: level_of(envoy), lambda v: v == level, timeout, f"ladder level, expected {level}")
