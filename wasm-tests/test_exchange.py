"""Many Envoys, one view (issue 26): three Envoys in front of the demo
regions share what each learns through the plugin's exchange (the probe's
callouts to the peers' cluster, the `exchange` filter on a listener only
peers reach), as envoy/envoy.yaml ships it: its `llm_exchange` listener,
its `llm_geo_router_peers` cluster and its `exchange` block, with the
ports moved (harness.set_exchange)."""

from __future__ import annotations

import copy
import http.client
import http.server
import re
import ssl
import struct
import threading
import time
import urllib.error
import urllib.request

import pytest

import yaml

import harness
from harness import chat, filler

FAST = {"probe": {"tick_ms": 300, "timeout_ms": 300, "snapshot_max_age_ms": 3000}}


def stat(envoy, name):
    return envoy.stat("wasmcustom.llm_geo_router." + name)


def wait_all(envoys, name, predicate, timeout=15.0):
    return harness.until(lambda: [stat(e, name) for e in envoys], lambda vs: all(predicate(v) for v in vs),
                         timeout, name)


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
    """An exchange message in the plugin's layout (src/cache/exchange/message.rs,
    version 2): one group from `sender` with one placement, and an
    all-zero checksum (these are refused before it is read: another layout)."""
    body = struct.pack("<HQIIB", region, int(time.time() * 1000), 200, 7, len(placement_hashes))
    body += b"".join(struct.pack("<Q", h) for h in placement_hashes)
    item = struct.pack("<IBH", 1, 1, len(body)) + body
    group = struct.pack("<QBH", sender, 0, 1) + item
    head = b"LGRX" + struct.pack("<BBIQQH", 2, 0, layout, sender, int(time.time() * 1000), 1)
    return head + group + bytes(8)


def post(port: int, path: str, body: bytes) -> int:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method="POST",
                                 headers={"content-type": "application/octet-stream"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def exchange_path() -> str:
    return harness.plugin_config(yaml.safe_load(harness.DEMO_CONFIG.read_text()))["exchange"].get(
        "path", "/llm-geo-router/exchange")


def test_forged_or_damaged_messages_change_nothing(fleet_factory):
    fleet, ports = start(fleet_factory, n=2)
    e1, e2 = fleet.envoys
    wait_all(fleet.envoys, "exchange.peers", lambda v: v == 1)
    path = exchange_path()
    # On the client listener the exchange path is just an unknown path: the
    # router sends it to a region, whose engine does not know it.
    assert post(e1.port, path, message(0, 42, [1, 2, 3])) == 404
    # On the peers' listener, from a peer of the deployment: garbage, a
    # truncated message, another layout and an oversized body are refused
    # and counted, never merged.
    refused = stat(e1, "exchange.refused")
    assert harness.post_peer(ports[0], path, b"garbage") == 400
    assert harness.post_peer(ports[0], path, message(0, 42, [1, 2, 3])) == 400  # layout 0: foreign
    assert harness.post_peer(ports[0], path, b"LGRX\x02") == 400
    assert harness.post_peer(ports[0], path, b"x" * (300 * 1024)) == 413
    assert harness.post_peer(ports[0], "/other", b"") == 404
    assert stat(e1, "exchange.refused") == refused + 4
    # Routing is unchanged: a cold prompt still goes to near.
    r = chat(e1.port, [{"role": "user", "content": "after the forgeries"}])
    assert r.status == 200 and r.replica == "near" and r.route["reason"] == "rtt", r.route


def refused_without_a_response(port: int, **kw) -> str:
    """What a connection to a peers' listener that Envoy refuses at the
    handshake raises (never an HTTP status): its type and words."""
    try:
        status = harness.post_peer(port, exchange_path(), b"garbage", **kw)
    except (OSError, http.client.HTTPException) as e:
        return f"{type(e).__name__}: {e}"
    raise AssertionError(f"answered {status}: the listener heard a peer it must refuse")


def test_a_peer_without_the_deployments_certificate_is_never_heard(fleet_factory, run_dir):
    fleet, ports = start(fleet_factory, n=2)
    e1, _ = fleet.envoys
    wait_all(fleet.envoys, "exchange.peers", lambda v: v == 1)
    # The peers talk over mutual TLS: each Envoy heard the other.
    assert stat(e1, "exchange.received") > 0 and stat(e1, "exchange.refused") == 0
    listener = f"listener.127.0.0.1_{ports[0]}.ssl"
    before = e1.stats(re.escape(listener))
    received = stat(e1, "exchange.received")
    # Plain HTTP, TLS with no certificate, and TLS with a certificate of
    # another CA that names the deployment just the same: each refused at
    # the handshake, before a byte reaches the plugin.
    other = harness.peer_certs(run_dir / "other-ca")
    assert (other / "peer.pem").read_bytes() != (harness.PEER_CERTS / "peer.pem").read_bytes()
    with pytest.raises((OSError, http.client.HTTPException)):
        post(ports[0], exchange_path(), b"garbage")
    no_cert = refused_without_a_response(ports[0], client_cert=False)
    foreign = refused_without_a_response(ports[0], certs=other)
    print("no certificate:", no_cert, "| another CA:", foreign)
    after = e1.stats(re.escape(listener))
    rose = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    print("listener TLS stats that rose:", rose)
    assert rose.get(f"{listener}.fail_verify_no_cert", 0) >= 1, rose
    assert rose.get(f"{listener}.fail_verify_error", 0) >= 1, rose
    assert stat(e1, "exchange.refused") == 0
    # The control: the same request with the deployment's certificate
    # reaches the plugin, which refuses the garbage and counts it.
    assert harness.post_peer(ports[0], exchange_path(), b"garbage") == 400
    assert stat(e1, "exchange.refused") == 1
    assert stat(e1, "exchange.received") >= received


class Recorder:
    """A peer of the deployment that only listens: a TLS server with the
    deployment's certificate, requiring one of its senders too, keeping
    every exchange message posted to it."""

    def __init__(self):
        outer = self
        self.bodies: list[bytes] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                n = int(self.headers.get("content-length", 0))
                outer.bodies.append(self.rfile.read(n))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args):
                pass

        certs = harness.peer_certs()
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(certs / "peer.pem"), str(certs / "peer.key"))
        ctx.load_verify_locations(str(certs / "peers-ca.pem"))
        ctx.verify_mode = ssl.CERT_REQUIRED
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self):
        self.server.shutdown()


def items_of(msg: bytes, regions: int) -> int:
    """The items a well-formed exchange message carries (its layout in
    src/cache/exchange/mod.rs), reading it to the checksum exactly."""
    at = 4 + 1 + 1 + 4 + 8 + 8
    (groups,) = struct.unpack_from("<H", msg, at)
    at += 2
    n = 0
    for _ in range(groups):
        at += 8
        if msg[at] == 1:
            at += 8 + 8 + 4 * regions
        at += 1
        (items,) = struct.unpack_from("<H", msg, at)
        at += 2
        for _ in range(items):
            (length,) = struct.unpack_from("<H", msg, at + 5)
            at += 7 + length
        n += items
    assert at == len(msg) - 8, (at, len(msg))
    return n


def test_a_damaged_or_replayed_message_changes_nothing(fleet_factory):
    # Every Envoy's peers' cluster lists a listening peer too, which keeps
    # what they send: real messages, as the other Envoy receives them.
    recorder = Recorder()

    def also_the_recorder(cfg):
        (cl,) = [c for c in cfg["static_resources"]["clusters"] if c["name"] == harness.PEERS_CLUSTER]
        group = cl["load_assignment"]["endpoints"][0]["lb_endpoints"]
        extra = copy.deepcopy(group[0])
        extra["endpoint"]["address"]["socket_address"]["port_value"] = recorder.port
        group.append(extra)

    try:
        fleet = fleet_factory(FAST, envoys=2, shared=True, envoy_edit=also_the_recorder)
        e1, e2 = fleet.envoys
        port2 = fleet.exchange_ports[1]
        wait_all(fleet.envoys, "exchange.peers", lambda v: v == 1)
        # News at Envoy 1 (a placement and the answer's usage), merged at
        # Envoy 2; then quiet until nothing more is news.
        r = chat(e1.port, [{"role": "user", "content": filler("replayed", 3000)}])
        assert r.status == 200
        wait_all([e2], "exchange.merged", lambda v: v >= 2, timeout=5)
        merged = stat(e2, "exchange.merged")
        deadline = time.time() + 10
        while True:
            time.sleep(1.0)
            now = stat(e2, "exchange.merged")
            if now == merged:
                break
            merged = now
            assert time.time() < deadline, "Envoy 2 keeps merging news with no traffic"
        regions = len(harness.plugin_config(yaml.safe_load(harness.DEMO_CONFIG.read_text()))["regions"])
        news = [m for m in list(recorder.bodies) if items_of(m, regions) > 0]
        assert news, f"the recorder kept {len(recorder.bodies)} messages, none with news"
        msg = max(news, key=len)
        items = items_of(msg, regions)
        path = exchange_path()
        refused, duplicate = stat(e2, "exchange.refused"), stat(e2, "exchange.duplicate")

        # Damaged: one bit flipped in the sender, a count, an item, the last
        # payload byte and the checksum. Each refused whole and counted,
        # each said in the log.
        log_before = e2.log().count("damaged: its checksum does not match its bytes")
        spots = [12, 26, len(msg) // 2, len(msg) - 9, len(msg) - 1]
        for at in spots:
            b = bytearray(msg)
            b[at] ^= 0x01
            assert harness.post_peer(port2, path, bytes(b)) == 400, at
        assert stat(e2, "exchange.refused") == refused + len(spots)
        assert e2.log().count("damaged: its checksum does not match its bytes") == log_before + len(spots)

        # Replayed whole, three times: a well-formed message from a peer, so
        # answered (the control for the damaged copies above), but nothing
        # in it is news any more.
        for _ in range(3):
            assert harness.post_peer(port2, path, msg) == 204
        wait_all([e2], "exchange.duplicate", lambda v: v >= duplicate + 3 * items, timeout=5)
        assert stat(e2, "exchange.merged") == merged
        assert stat(e2, "exchange.refused") == refused + len(spots)
    finally:
        recorder.stop()


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
