"""The router inside a real Envoy, in front of three emulated regions
(near ~5 ms, mid ~40 ms, far ~120 ms; prefill 0.2 ms/token; 8 slots each).
Probe tick 300 ms in these tests."""

import threading
import time
import urllib.request

import harness
from harness import chat, filler

TICK_S = 0.3


def wait_stat(envoy, name, predicate, timeout=10.0):
    return harness.until(lambda: envoy.stat("wasmcustom.llm_geo_router." + name), predicate, timeout, name)


def conversation_on_mid(fleet, seed, turns=1):
    """Start a conversation with an ~8 KB system prompt while `near` is down,
    so that its prefix lives in `mid`; then bring `near` back."""
    near = fleet.engines["near"]
    near.set_state(healthy=False)
    wait_stat(fleet.envoy, "region.near.healthy", lambda v: v == 0)
    msgs = [{"role": "system", "content": filler(seed, 8000)}]
    replies = []
    for t in range(turns):
        msgs.append({"role": "user", "content": f"question {t} about {seed}"})
        r = chat(fleet.port, msgs)
        assert r.status == 200, r.body
        replies.append(r)
        msgs.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
    near.set_state(healthy=True)
    wait_stat(fleet.envoy, "region.near.healthy", lambda v: v == 1)
    return msgs, replies


def test_cold_prompts_go_to_the_nearest_region(fleet):
    for i in range(6):
        r = chat(fleet.port, [{"role": "user", "content": filler(f"cold{i}", 2000)}])
        assert r.status == 200, r.body
        assert r.replica == "near", r.headers
        assert r.route["reason"] == "rtt"
        assert int(r.headers["x-engine-cached-tokens"]) == 0
    # The decision is also in filter state, for access logs (buffered by
    # Envoy: complete once it has stopped).
    fleet.envoy.stop()
    lines = [l for l in fleet.envoy.log().splitlines() if l.startswith("[access]")]
    assert sum('decision="region=near; reason=rtt; ttft_ms=' in l for l in lines) == 6, lines[-3:]


def test_conversation_follows_its_prefix(fleet):
    msgs, first = conversation_on_mid(fleet, "convo-a")
    assert first[0].replica == "mid"
    hits = 0
    for turn in range(1, 6):
        msgs.append({"role": "user", "content": f"follow-up {turn}: and then what?"})
        r = chat(fleet.port, msgs)
        assert r.status == 200
        cached = int(r.headers["x-engine-cached-tokens"])
        # Served where the prefix is, and the engine really had it (> 1,500 of ~2,050 tokens).
        if r.replica == "mid" and cached > 1500:
            hits += 1
        assert r.route["reason"] == "cache", r.route
        msgs.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
    assert hits >= 5, f"{hits} of 5 turns after the first hit the warm region"


def test_warm_region_with_a_long_queue_is_avoided(fleet):
    msgs, _ = conversation_on_mid(fleet, "convo-b")
    mid = fleet.engines["mid"]
    mid.set_state(paused=True)
    results = []

    def background(i):
        body = ('{"messages":[{"role":"user","content":"bg %d"}],"max_tokens":1}' % i).encode()
        req = urllib.request.Request(mid.url + "/v1/chat/completions", data=body,
                                     headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                results.append(resp.status)
        except Exception as e:  # noqa: BLE001 - recorded and asserted below
            results.append(repr(e))

    threads = [threading.Thread(target=background, args=(i,)) for i in range(30)]
    for t in threads:
        t.start()
    try:
        # The probe sees the queue at its next scrape.
        wait_stat(fleet.envoy, "region.mid.engine_waiting", lambda v: v >= 25)
        msgs.append({"role": "user", "content": "one more question"})
        r = chat(fleet.port, msgs)
        assert r.status == 200
        assert r.replica == "near", r.route
        assert r.route["reason"] == "load", r.route
        assert r.route["runner_up"] != "mid", r.route
        # Queue cost at mid: (30 + 1 - 8) / 8 slots x 400 ms = 1150 ms, more
        # than the ~320 ms of prefill its cache saves: near's whole expected
        # TTFT is below mid's wait alone. (Not a fixed bound on near's: its
        # terms are measured, and a busy machine raised them to 606 ms in
        # CI, against 600.)
        assert r.route["passed_over"] == "mid", r.route
        assert float(r.route["ttft_ms"]) < float(r.route["passed_over_wait_ms"]), r.route
    finally:
        mid.set_state(paused=False)
        for t in threads:
            t.join(timeout=60)
    assert results == [200] * 30


def test_client_cannot_choose_the_cluster(fleet):
    r = chat(fleet.port, [{"role": "user", "content": filler("pick-far", 500)}],
             headers={"x-llm-cluster": "region_far"})
    assert r.status == 200
    assert r.replica == "near" and r.route["region"] == "near"
    # The cluster header is internal: the engine receives neither the
    # client's value nor the router's.
    assert r.headers["x-echo-x-llm-cluster"] == "-"
    # Also for requests the router does not understand (their answers name
    # no replica: the engines' request counts show where it went; far's
    # probe may read /v1/models too, but only every refresh_ticks ticks).
    def models_served():
        return {n: e.stats()["requests"].get("/v1/models", 0) for n, e in fleet.engines.items()}
    before = models_served()
    r = harness.request(fleet.port, "GET", "/v1/models", headers={"x-llm-cluster": "region_far"})
    after = models_served()
    assert r.status == 200
    assert r.route["region"] == "near", (r.route, fleet.envoy.stats(r"region\.[a-z]+\.rtt_ms$"))
    assert r.headers["x-echo-x-llm-cluster"] == "-"
    assert after["near"] > before["near"] and after["far"] == before["far"], (before, after)


def test_killed_region_is_not_routed_to_once_detected_and_loses_no_request(fleet):
    # Under load (four clients), the nearest region's engine is killed.
    log = []  # (start, status, decision's region, replica that answered, end)
    stop = threading.Event()

    def traffic(k):
        i = 0
        while not stop.is_set():
            start = time.monotonic()
            try:
                r = chat(fleet.port, [{"role": "user", "content": filler(f"kill{k}-{i}", 300)}], timeout=10)
                log.append((start, r.status, r.route.get("region"), r.replica, time.monotonic()))
            except Exception as e:  # noqa: BLE001
                log.append((start, repr(e), None, None, time.monotonic()))
            i += 1
            time.sleep(0.02)

    clients = [threading.Thread(target=traffic, args=(k,)) for k in range(4)]
    for t in clients:
        t.start()
    try:
        wait_stat(fleet.envoy, "region.near.rq_total", lambda v: v >= 10)
        # The kill is complete once the process is reaped: a request that
        # started while it was dying may have reached the engine, and one the
        # engine has seen is never retried (it may have done the work).
        kill_started = time.monotonic()
        fleet.engines["near"].kill()
        killed_at = time.monotonic()
        # Detected: the probe has published near as out of routing (the
        # gauge is exported after the snapshot is written).
        wait_stat(fleet.envoy, "region.near.healthy", lambda v: v == 0)
        detected_at = time.monotonic()
        deadline = time.time() + 30
        while sum(1 for e in log if e[0] > detected_at) < 20 and time.time() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        for t in clients:
            t.join(timeout=30)
    # Requests still in flight at the kill may fail; those well before may not.
    before = [e for e in log if e[4] < kill_started]
    assert before and all(e[1] == 200 for e in before)
    assert any(e[3] == "near" for e in before)
    in_flight = [e for e in log if e[0] <= killed_at and e[4] >= kill_started]
    # Not one request sent after the kill is lost: until the probe marks the
    # region unhealthy the router still picks it, the connection is refused,
    # and Envoy retries on the next priority of the region's cluster (the
    # other regions' engines; envoy/envoy.yaml, retry_priority).
    after_kill = [e for e in log if e[0] > killed_at]
    lost = [e for e in after_kill if e[1] != 200]
    assert not lost, lost[:5]
    window = [e for e in after_kill if e[0] <= detected_at]
    retried = [e for e in window if e[2] == "near"]
    assert all(e[3] != "near" for e in retried), retried[:5]
    # Once detected, the router itself chooses another region: the
    # decision, not only the replica that answered (a retry would hide a
    # decision for near behind another region's answer).
    after = [e for e in log if e[0] > detected_at]
    assert len(after) >= 20
    assert not [e for e in after if e[2] == "near"], [e for e in after if e[2] == "near"][:5]
    print(f"in flight at the kill: {len(in_flight)} (failed: {sum(e[1] != 200 for e in in_flight)}); "
          f"sent before detection: {len(window)}, routed to near and retried elsewhere: {len(retried)}, "
          f"lost: 0; after detection: {len(after)}, none routed to near")
    # The region comes back: after `healthy_after` good probes, cold prompts return to it.
    fleet.restart_engine("near")
    wait_stat(fleet.envoy, "region.near.healthy", lambda v: v == 1)
    r = chat(fleet.port, [{"role": "user", "content": filler("back", 300)}])
    assert r.status == 200 and r.replica == "near" and r.route["region"] == "near"
