"""Degraded-mode ladder, assessment and release parity inside a real Envoy:
capacity loss raises the ladder one rung per tick and the assessment pages,
recovery steps down one rung per dwell, a ratio near a threshold does not
flap, a region on another release gets nothing and is reported as
rollback, a recovered region is ramped back in, free traffic goes to the
fallback pool at level 4, and an operator can hold a level at runtime."""

import threading
import time

import yaml

import harness
from harness import chat, filler, request
from test_routing import wait_stat

TICK = {"tick_ms": 300, "timeout_ms": 300, "snapshot_max_age_ms": 3000}
OPERATOR = {"authorization": "Bearer demo-operator-token"}


def regions(capacity_rps):
    rs = harness.plugin_config(yaml.safe_load(harness.DEMO_CONFIG.read_text()))["regions"]
    for r in rs:
        r["capacity_rps"] = capacity_rps
    return rs


def stat(envoy, name):
    return envoy.stat("wasmcustom.llm_geo_router." + name)


class Load:
    """Open-loop request arrivals at `rps`, from one scheduling thread: each
    request runs on its own thread, so a slow answer (a loaded machine)
    does not lower the arrival rate the ladder measures, as a closed loop's
    would (a CI run saw 12 rps arrive as about 10)."""

    def __init__(self, port, rps):
        self.port, self.period, self.stop = port, 1.0 / rps, threading.Event()
        self.thread = threading.Thread(target=self.run)
        self.requests = []

    def one(self, i):
        try:
            chat(self.port, [{"role": "user", "content": f"load {i}"}], timeout=10,
                 headers={"authorization": "Bearer sk-demo-critical"})
        except OSError:
            pass

    def run(self):
        start, i = time.monotonic(), 0
        while not self.stop.is_set():
            t = threading.Thread(target=self.one, args=(i,), daemon=True)
            t.start()
            self.requests.append(t)
            i += 1
            self.stop.wait(max(0.0, start + i * self.period - time.monotonic()))

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(timeout=20)
        for t in self.requests:
            t.join(timeout=10)


def test_capacity_loss_raises_the_ladder_and_pages_then_recovers_per_dwell(fleet_factory):
    # Demand is an EWMA of arrivals per tick (300 ms; 250 ms while the
    # ladder is up): at 10 rps a tick sees 2 to 4 arrivals, and timer jitter
    # or a stalled client moves some to the next tick. With the default
    # alpha 0.5 one 4-arrival tick lifted the estimate past level 5's
    # threshold (a fresh-clone CI run rose one rung too far); with alpha
    # 0.2 and the default thresholds, one tick that saw no arrival (a
    # busy machine's stall) took level 4's band, [0.45, 0.60) of 5.25 rps,
    # from under the estimate: the climb held for a tick (run 12 in
    # docs/RELIABILITY.md). What this test checks is the climb's steps,
    # not the default thresholds (fleet/state.rs checks those), so level 4's
    # band is widened here: 5.25 rps of capacity for 10 rps (ratio 0.525)
    # is level 4 for any demand from 6.4 to 26 rps, which takes three
    # arrival-less ticks in a row to leave. Level 0 holds below a ratio of
    # 0.9: before the kill (15.75 rps) for any demand up to 17.5 rps, and
    # in the tick or two when one killed region is seen and the other not
    # (10.5 rps) up to 11.7 rps.
    probe = {**TICK, "demand_alpha": 0.2}
    ladder = {"dwell_s": 2, "up_at": [0.9, 0.875, 0.85, 0.825, 0.2],
              "down_at": [1.0, 0.975, 0.95, 0.925, 0.3]}
    fleet = fleet_factory({"regions": regions(5.25), "probe": probe, "ladder": ladder,
                           "assessment": {"region_down_minutes": 0.02}})
    envoy = fleet.envoy
    with Load(fleet.port, 10):
        # The demand EWMA has settled near 10 rps (against 15.75 rps).
        wait_stat(envoy, "ladder.demand_rps", lambda v: v >= 9, timeout=20)
        assert stat(envoy, "ladder.level") == 0
        assert stat(envoy, "assessment.state") == 0
        fleet.engines["mid"].kill()
        fleet.engines["far"].kill()
        # Capacity 5.25 rps for 10 rps: ratio 0.525 -> levels 1..4 (not < 0.2).
        wait_stat(envoy, "ladder.level", lambda v: v >= 4, timeout=15)
        ups = harness.ladder_changes(envoy)
        assert [c.level for c in ups] == [1, 2, 3, 4], ups
        # One rung per probe tick, never two at once.
        assert [b.tick - a.tick for a, b in zip(ups, ups[1:])] == [1, 1, 1], ups
        # Two signals (health and scrape) for 1.2 s: page and propose failover.
        wait_stat(envoy, "assessment.state", lambda v: v == 2, timeout=6)
        fleet.restart_engine("mid")
        fleet.restart_engine("far")
        wait_stat(envoy, "region.far.healthy", lambda v: v == 1)
        wait_stat(envoy, "ladder.level", lambda v: v == 0, timeout=30)
    downs = harness.ladder_changes(envoy)[len(ups):]
    assert [c.level for c in downs] == [3, 2, 1, 0], downs
    # One rung down per 2 s dwell (the probe's own clock; Envoy logs the
    # change when the probe makes it, to the millisecond).
    gaps = [b.at_s - a.at_s for a, b in zip(downs, downs[1:])]
    assert all(g >= 2.0 - 0.05 for g in gaps), gaps
    wait_stat(envoy, "assessment.state", lambda v: v == 0)
    log = envoy.log()
    for state in ("scale_dr_and_raise_ladder", "page_and_propose_failover", "ok"):
        assert f"llm-geo-router probe: assessment {state}" in log, state


def test_ratio_near_a_threshold_does_not_flap(fleet_factory):
    # 10 rps of capacity; the load alternates between 12 rps (ratio 0.83,
    # below up_at[0] = 1.0) and 9.2 rps (1.09, above it but below
    # down_at[0] = 1.25), so the ratio crosses the first rung's threshold
    # back and forth inside the hysteresis band. The level must rise once
    # and hold, not follow each crossing. The band is wider than the
    # default (1.0 / 1.1) so that the load's own noise stays inside it.
    ladder = {"dwell_s": 1, "up_at": [1.0, 0.75, 0.6, 0.5, 0.4], "down_at": [1.25, 0.95, 0.8, 0.65, 0.55]}
    # probe.ticks counts every round, and a ladder above 0 makes the fleet
    # busy (a round every busy_tick_ms, 250 ms): a phase of 4 "ticks" then
    # lasted 1 s, one controller step, and the demand EWMA never reached
    # either rate (a CI run saw 91..107 % throughout). Every round full.
    tick = {**TICK, "tick_ms": 1000, "busy_tick_ms": 1000, "timeout_ms": 500, "demand_alpha": 0.5}
    fleet = fleet_factory({"regions": regions(10 / 3), "probe": tick, "ladder": ladder})
    envoy = fleet.envoy
    samples = []

    def phase(rps, ticks, record=True):
        with Load(fleet.port, rps / 2), Load(fleet.port, rps / 2):
            end = harness.probe_ticks(envoy) + ticks
            while harness.probe_ticks(envoy) < end:
                if record:
                    samples.append((rps, stat(envoy, "ladder.capacity_ratio_pct"), stat(envoy, "ladder.level")))
                time.sleep(0.05)

    # Warm-up: the demand EWMA starts from nothing ("plenty" of capacity).
    phase(12, 3, record=False)
    for rps in (9.2, 12, 9.2, 12):
        phase(rps, 4)
    ratios = [r for _, r, _ in samples]
    print("ratio % per phase:", [(rps, min(r for p, r, _ in samples if p == rps), max(r for p, r, _ in samples
                                                                                      if p == rps))
                                 for rps in (12, 9.2)], "changes:", harness.ladder_changes(envoy))
    # The ratio did cross up_at[0] (100 %) in both directions ...
    crossings = [(a < 100) != (b < 100) for a, b in zip(ratios, ratios[1:])]
    downward = any(a >= 100 > b for a, b in zip(ratios, ratios[1:]))
    upward = any(a < 100 <= b for a, b in zip(ratios, ratios[1:]))
    assert downward and upward and sum(crossings) >= 3, ratios
    # ... inside the band: never a reason to reach level 2 or to step down.
    assert 75 < min(ratios) and max(ratios) < 125, ratios
    # One change, to level 1, held through every crossing.
    assert [c.level for c in harness.ladder_changes(envoy)] == [1]
    assert stat(envoy, "ladder.level") == 1


RAMP_S = 10.0
# How far this test's clock may be from the ramp's: the ramp starts at most
# RAMP_START_S before the test sees the assessment back at ok (the probe's
# snapshot that made near routable, then the stat poll), and a decision's
# snapshot is at most RAMP_LAG_S (a probe tick and a margin) older than it.
RAMP_START_S, RAMP_LAG_S = 0.5, 0.4


def test_region_on_another_release_gets_nothing_and_is_reported_then_ramps_back(fleet_factory):
    # The nearest region is on another release: every cold prompt, which
    # would go to near, goes to mid instead.
    fleet = fleet_factory({"probe": TICK, "release": {"ramp_s": RAMP_S}},
                          engine_extra={"near": ["--release", "sha256:release-b"]})
    envoy = fleet.envoy
    wait_stat(envoy, "assessment.state", lambda v: v == 3)
    served = []
    for i in range(30):
        r = chat(fleet.port, [{"role": "user", "content": filler(f"parity-{i}", 300)}])
        assert r.status == 200
        served.append(r.replica)
    print("with near on release-b:", {n: served.count(n) for n in set(served)})
    assert served.count("near") == 0
    assert served.count("mid") > 20
    assert "llm-geo-router probe: assessment rollback" in envoy.log()
    # near comes back on the expected release: ramped in linearly over
    # ramp_s, a prompt going there when rendezvous(first block, near) / 2^64
    # is below the ramp's share (seconds since it became routable / ramp_s),
    # else to mid, the next nearest. Sent until 2 s past the ramp's end.
    fleet.restart_engine("near")
    wait_stat(envoy, "assessment.state", lambda v: v == 0)
    t0 = time.time()
    seen = []  # (seconds since t0 when sent, went to near)
    i = 0
    while time.time() - t0 < RAMP_S + 2:
        t = time.time() - t0
        r = chat(fleet.port, [{"role": "user", "content": filler(f"ramp-{i}", 300)}])
        assert r.status == 200 and r.replica in ("near", "mid"), (r.status, r.route)
        seen.append((t, r.replica == "near"))
        i += 1
    # The share a prompt sent at t met: between these bounds.
    clip = lambda x: min(1.0, max(0.0, x))  # noqa: E731
    low = [clip((t - RAMP_LAG_S) / RAMP_S) for t, _ in seen]
    high = [clip((t + RAMP_START_S) / RAMP_S) for t, _ in seen]
    mids = [round(t, 2) for t, near in seen if not near]
    after = [t for t, _ in seen if t >= RAMP_S + RAMP_LAG_S]
    print(f"ramp: {len(seen)} prompts over {seen[-1][0]:.1f} s, {len(mids)} to mid, the last at "
          f"{max(mids, default=0):.2f} s; {len(after)} after the ramp's end")
    # Fully ramped by ramp_s: every prompt from then on goes to near.
    assert len(after) >= 5, after
    assert not [t for t in mids if t >= RAMP_S + RAMP_LAG_S], ("mid after the ramp's end", mids[-10:])
    # And not before: prompts whose rendezvous is above the share still go
    # to mid in the ramp's second half (a ramp 2x or more too short, full
    # by ramp_s / 2 + a tick, sends none there then).
    assert max(mids, default=0) >= RAMP_S / 2, ("ramped in before ramp_s / 2", mids[-10:])
    # Linear: as many went to near as the share they met says, within
    # three standard deviations.
    near = sum(n for _, n in seen)
    mid_p = [(a + b) / 2 for a, b in zip(low, high)]
    sd = sum(p * (1 - p) for p in mid_p) ** 0.5
    assert sum(low) - 3 * sd <= near <= sum(high) + 3 * sd, (near, sum(low), sum(high), sd)
    # In the first second, at most a tenth of the share and then some.
    early = [n for t, n in seen if t < 1.0]
    assert sum(early) <= max(2, 0.35 * len(early)), early


def test_free_traffic_goes_to_the_fallback_pool_at_level_four(fleet_factory):
    fleet = fleet_factory({"probe": TICK, "ladder": {"forced_level": 4}}, fallback=True)
    wait_stat(fleet.envoy, "ladder.level", lambda v: v == 4)
    r = chat(fleet.port, [{"role": "user", "content": "free at level 4"}], max_tokens=1000)
    assert r.status == 200
    assert r.replica == "near_fallback"
    assert r.json()["usage"]["completion_tokens"] == 256
    assert "pool=fallback" in r.headers["x-llm-route"]
    # A client cannot put itself in (or out of) a pool.
    r = chat(fleet.port, [{"role": "user", "content": "paid"}], headers={
        "authorization": "Bearer sk-demo-paid", "x-llm-pool": "fallback"})
    assert r.status == 200 and r.replica == "near"
    assert stat(fleet.envoy, "region.near.fallback_rq_total") == 1
    assert stat(fleet.envoy, "guard.tier.free.fallback") == 1


def test_operator_holds_a_level_at_runtime(fleet):
    envoy = fleet.envoy
    path = "/llm-geo-router/ladder"
    assert request(fleet.port, "POST", path, {"level": 3}).status == 403
    assert request(fleet.port, "POST", path, {"level": 3}, headers={"authorization": "Bearer wrong"}).status == 403
    assert request(fleet.port, "GET", path, headers=OPERATOR).status == 405
    r = request(fleet.port, "POST", path, {"level": 9}, headers=OPERATOR)
    assert r.status == 400 and r.json()["error"]["param"] == "level"
    r = request(fleet.port, "POST", path, {"level": 3}, headers=OPERATOR)
    assert r.status == 200 and r.json() == {"override": 3}
    wait_stat(envoy, "ladder.level", lambda v: v == 3)
    assert stat(envoy, "ladder.override_active") == 1
    # Level 3 caps free traffic at 256 output tokens.
    r = chat(fleet.port, [{"role": "user", "content": "capped"}], max_tokens=1000)
    assert r.status == 200 and r.json()["usage"]["completion_tokens"] == 256
    r = request(fleet.port, "POST", path, {"level": None}, headers=OPERATOR)
    assert r.status == 200 and r.json() == {"override": None}
    wait_stat(envoy, "ladder.override_active", lambda v: v == 0)
    assert "operator set the ladder override to Some(3)" in envoy.log()
