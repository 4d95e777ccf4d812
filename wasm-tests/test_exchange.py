"""Many Envoys, one view (issue 26): three Envoys in front of the demo
regions share what each learns through the plugin's exchange (the probe's
callouts to the peers' cluster, the `exchange` filter on a listener only
peers reach), as envoy/envoy.yaml ships it: its `llm_exchange` listener,
its `llm_geo_router_peers` cluster and its `exchange` block, with the
ports moved (harness.set_exchange)."""

from __future__ import annotations

import struct
import time
import urllib.request

import yaml

import harness
from harness import chat, filler

FAST = {"probe": {"tick_ms": 300, "timeout_ms": 300, "snapshot_max_age_ms": 3000}}


def stat(envoy, name):
    return envoy.stat("wasmcustom.llm_geo_router." + name)


def wait_all(envoys, name, predicate, timeout=15.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        values = [stat(e, name) for e in envoys]
        if all(predicate(v) for v in values):
            return values
        time.sleep(0.05)
    raise AssertionError(f"{name}: {values}")


def start(fleet_factory, shared=True, n=3):
    fleet = fleet_factory(FAST, envoys=n, shared=shared)
    return fleet, fleet.exchange_ports


def turn_on_mid(fleet, via, seed, envoys=None):
    """A first turn with an ~8 KB system prompt through Envoy `via` while
    `near` is down (so `mid` serves it), then `near` back up at every Envoy
    of `envoys` (default: all)."""
    envoys = envoys or fleet.envoys
    near = fleet.engines["near"]
    near.set_state(healthy=False)
    wait_all(envoys, "region.near.healthy", lambda v: v == 0)
    msgs = [{"role": "system", "content": filler(seed, 8000)},
            {"role": "user", "content": f"first question about {seed}"}]
    r = chat(via.port, msgs)
    assert r.status == 200 and r.replica == "mid", (r.status, r.route)
    msgs.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
    msgs.append({"role": "user", "content": "and the next one"})
    near.set_state(healthy=True)
    wait_all(envoys, "region.near.healthy", lambda v: v == 1)
    return msgs


def test_a_turn_learnt_through_one_envoy_is_routed_to_its_holder_by_another(fleet_factory):
    fleet, _ = start(fleet_factory)
    e1, e2, e3 = fleet.envoys
    msgs = turn_on_mid(fleet, e1, "shared-doc")
    # Envoy 1's placement reaches the others within about a tick.
    wait_all([e2, e3], "exchange.merged", lambda v: v >= 1, timeout=5)
    r = chat(e2.port, msgs)
    assert r.status == 200
    assert r.replica == "mid" and r.route["reason"] == "cache", r.route
    assert int(r.headers["x-engine-cached-tokens"]) > 1000, r.headers
    # Every Envoy sent, received and knows two live peers; nothing refused.
    for e in fleet.envoys:
        assert stat(e, "exchange.sent") > 0 and stat(e, "exchange.received") > 0
        assert stat(e, "exchange.refused") == 0
    wait_all(fleet.envoys, "exchange.peers", lambda v: v == 2)


def test_without_the_exchange_the_other_envoy_sends_the_turn_to_the_nearest(fleet_factory):
    # The control for the test above: the same steps, each Envoy on its own.
    fleet, _ = start(fleet_factory, shared=False, n=2)
    e1, e2 = fleet.envoys
    msgs = turn_on_mid(fleet, e1, "private-doc")
    time.sleep(1.0)
    r = chat(e2.port, msgs)
    assert r.status == 200 and r.replica == "near" and r.route["reason"] == "rtt", r.route


def test_with_one_peer_killed_the_others_keep_routing_and_say_so(fleet_factory):
    fleet, _ = start(fleet_factory)
    e1, e2, e3 = fleet.envoys
    wait_all(fleet.envoys, "exchange.peers", lambda v: v == 2)
    e3.proc.kill()
    e3.proc.wait(timeout=10)
    # The dead peer's messages fail (counted), and it stops counting as a
    # live peer within three send periods and a timeout.
    wait_all([e1, e2], "exchange.send_failed", lambda v: v >= 1, timeout=10)
    wait_all([e1, e2], "exchange.peers", lambda v: v == 1, timeout=10)
    merged = stat(e2, "exchange.merged")
    msgs = turn_on_mid(fleet, e1, "after-kill", envoys=[e1, e2])
    wait_all([e2], "exchange.merged", lambda v: v > merged, timeout=5)
    for i in range(5):
        r = chat(e2.port, [{"role": "user", "content": f"still routing {i}"}])
        assert r.status == 200 and r.replica == "near", r.route
    r = chat(e2.port, msgs)
    assert r.status == 200 and r.replica == "mid" and r.route["reason"] == "cache", r.route


def message(layout: int, sender: int, placement_hashes: list[int], region: int = 1) -> bytes:
    """An exchange message in the plugin's layout (src/cache/exchange/message.rs): one
    group from `sender` with one placement."""
    body = struct.pack("<HQIIB", region, int(time.time() * 1000), 200, 7, len(placement_hashes))
    body += b"".join(struct.pack("<Q", h) for h in placement_hashes)
    item = struct.pack("<IBH", 1, 1, len(body)) + body
    group = struct.pack("<QBH", sender, 0, 1) + item
    return b"LGRX" + struct.pack("<BBIQQH", 1, 0, layout, sender, int(time.time() * 1000), 1) + group


def post(port: int, path: str, body: bytes) -> int:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method="POST",
                                 headers={"content-type": "application/octet-stream"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def test_forged_or_damaged_messages_change_nothing(fleet_factory):
    fleet, ports = start(fleet_factory, n=2)
    e1, e2 = fleet.envoys
    wait_all(fleet.envoys, "exchange.peers", lambda v: v == 1)
    path = harness.plugin_config(yaml.safe_load(harness.DEMO_CONFIG.read_text()))["exchange"].get(
        "path", "/llm-geo-router/exchange")
    # On the client listener the exchange path is just an unknown path: the
    # router sends it to a region, whose engine does not know it.
    assert post(e1.port, path, message(0, 42, [1, 2, 3])) == 404
    # On the peers' listener: garbage, a truncated message, another layout
    # and an oversized body are refused and counted, never merged.
    refused = stat(e1, "exchange.refused")
    assert post(ports[0], path, b"garbage") == 400
    assert post(ports[0], path, message(0, 42, [1, 2, 3])) == 400  # layout 0: foreign
    assert post(ports[0], path, b"LGRX\x01") == 400
    assert post(ports[0], path, b"x" * (300 * 1024)) == 413
    assert post(ports[0], "/other", b"") == 404
    assert stat(e1, "exchange.refused") == refused + 4
    # Routing is unchanged: a cold prompt still goes to near.
    r = chat(e1.port, [{"role": "user", "content": "after the forgeries"}])
    assert r.status == 200 and r.replica == "near" and r.route["reason"] == "rtt", r.route


def test_the_ladder_sees_the_deployments_demand_and_drops_a_stopped_peers(fleet_factory):
    # 10 rps of capacity in all (10/3 per region, each Envoy given the whole
    # of it, as with the exchange docs/CONFIG.md says). Uneven traffic: 9
    # rps through Envoy 1, 3 through Envoy 2. Alone, each sees a ratio
    # above 1 (1.11 and 3.3) and stays at level 0; the deployment's 12 rps
    # give 0.83: level 1 at both (the band is wider than the default so
    # that the load's own noise stays in it: level 2 needs a ratio under
    # 0.75, 13.3 rps). Then Envoy 2 stops and its traffic moves to Envoy 1:
    # 12 rps there, and Envoy 2's last 3 rps must stop counting, or Envoy 1
    # would see 15 (0.67, level 2). Its level is then what one Envoy taking
    # all the traffic reaches: 1, and it never went above.
    from test_ladder import Load, regions
    ladder = {"dwell_s": 1, "up_at": [1.0, 0.75, 0.6, 0.5, 0.4], "down_at": [1.25, 0.95, 0.8, 0.65, 0.55]}
    probe = {"tick_ms": 1000, "busy_tick_ms": 1000, "timeout_ms": 500, "snapshot_max_age_ms": 5000,
             "demand_alpha": 0.3}
    fleet = fleet_factory({"regions": regions(10 / 3), "probe": probe, "ladder": ladder},
                          envoys=2, shared=True)
    e1, e2 = fleet.envoys
    with Load(e1.port, 9):
        with Load(e2.port, 3):
            wait_all(fleet.envoys, "ladder.level", lambda v: v == 1, timeout=30)
            # Each counts the other's demand: about 12 rps at both.
            demand = wait_all(fleet.envoys, "ladder.demand_rps", lambda v: 10 <= v <= 14, timeout=10)
            e2.proc.kill()
            e2.proc.wait(timeout=10)
        with Load(e1.port, 3):
            wait_all([e1], "exchange.peers", lambda v: v == 0, timeout=10)
            # A few controller steps on the survivor's own 12 rps.
            deadline = time.time() + 6
            while time.time() < deadline:
                assert stat(e1, "ladder.level") == 1
                time.sleep(0.2)
            alone = stat(e1, "ladder.demand_rps")
    print("deployment demand at both:", demand, "survivor alone:", alone,
          "changes:", harness.ladder_changes(e1))
    assert 10 <= alone <= 14, alone
    assert [c.level for c in harness.ladder_changes(e1)] == [1]
