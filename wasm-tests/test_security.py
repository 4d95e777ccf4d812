"""No client can steer the plugin or read through it: internal headers sent
by a client are stripped (with the VMs working, and with the filters gone as
FAIL_OPEN leaves them after a trap); prompts never reach Envoy's log; the
shared-data structures stay bounded whatever the prompts and sessions; the
hash seed is configurable and proxies with the same seed agree.

Config-time failures (a configuration that would keep a VM from starting is
refused before Envoy serves) are covered by test_configs.py."""

from __future__ import annotations

import concurrent.futures
import json
import random
import threading
import time
import urllib.request

import pytest

import harness
from harness import chat, request

TICK = {"tick_ms": 300, "timeout_ms": 300, "snapshot_max_age_ms": 3000}
FORGED = {
    "x-llm-cluster": "region_far",
    "x-llm-pool": "fallback",
    "x-llm-tier": "critical",
    "x-llm-kv-action": "fetch; from=far; tokens=999999",
    "x-llm-route": "region=far; reason=cache",
}
FAST = ["--max-concurrency", "64", "--prefill-ms-per-token", "0.0005", "--decode-ms-per-token", "0.05"]


def test_client_sent_internal_headers_are_ignored(fleet):
    decided = []
    for i in range(20):
        r = chat(fleet.port, [{"role": "user", "content": f"forged headers {i}"}], headers=FORGED)
        assert r.status == 200
        # Served where the router decided, on its own cost terms, not where
        # the client's x-llm-cluster (far) and x-llm-route said. Cold
        # prompts go to the nearest region by measured round trip: near,
        # unless a busy machine made a probe's sample of near slow (seen in
        # CI: mid, with near measured at 116 ms).
        assert r.replica == r.route["region"], r.route
        assert r.route["reason"] == "rtt" and "ttft_ms" in r.route, r.route
        decided.append(r.route["region"])
        # Internal: removed before the upstream (the router's decision is in
        # x-llm-route, checked above).
        assert r.headers["x-echo-x-llm-cluster"] == "-"
        assert r.headers["x-echo-x-llm-tier"] == "free"
        assert r.headers["x-echo-x-llm-kv-action"] == "-"
    # The forged cluster would have sent every request to far.
    assert "far" not in decided and "near" in decided, decided
    assert fleet.envoy.stat("wasmcustom.llm_geo_router.region.near.fallback_rq_total") == 0
    # Other paths too: the router's region, never the client's choice.
    r = request(fleet.port, "GET", "/v1/models", headers=FORGED)
    # An engine answered (its echo) where the router decided (/v1/models
    # answers carry no x-engine-replica).
    assert r.status == 200 and r.route["region"] in ("near", "mid"), r.route
    assert r.headers["x-echo-x-llm-cluster"] == "-"
    assert r.headers["x-echo-x-llm-tier"] == "free"


def test_failed_open_filters_leave_no_client_header_in_force(run_dir):
    """What FAIL_OPEN leaves after a VM trap: the HTTP filters are skipped.
    The demo configuration without the plugin's filters must still route to
    the nearest region and strip every internal header. (Before the early
    header mutation, Envoy picked the route on the client's x-llm-cluster
    before the header_mutation filter removed it: such a request went to
    region_far.)"""
    engines = {n: harness.start_engine(n, run_dir, d, m) for n, (_, d, m) in harness.DEMO_REGIONS.items()}
    envoy = None
    try:
        cfg = harness.render_config(engines, harness.free_port(), harness.free_port(), {"probe": TICK})
        hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        hcm["http_filters"] = [f for f in hcm["http_filters"] if "wasm" not in f["typed_config"]["@type"]]
        envoy = harness.start_envoy(run_dir, cfg, "envoy-failed-open")
        for i in range(10):
            r = chat(envoy.port, [{"role": "user", "content": f"failed open {i}"}], headers=FORGED)
            assert r.status == 200
            assert r.replica == "near", r.headers
            for h in ("x-llm-cluster", "x-llm-tier", "x-llm-kv-action"):
                assert r.headers[f"x-echo-{h}"] == "-", (h, r.headers)
            assert "x-llm-route" not in r.headers
    finally:
        if envoy:
            envoy.stop()
        for e in engines.values():
            e.kill()


def prompt_of(rnd: random.Random, i: int) -> str:
    return f"PROMPT{i:04d}" + "".join(rnd.choice("abcdefghjkmnpqrstuvwxyz23456789") for _ in range(40))


def test_prompts_never_appear_in_envoy_logs(fleet_factory):
    # Level 5: free traffic is shed (429), paid prompts over 8192 tokens get
    # 413, paid max_tokens is clamped (the guard rewrites the body).
    fleet = fleet_factory({"probe": TICK, "ladder": {"forced_level": 5}})
    envoy = fleet.envoy
    paid = {"authorization": "Bearer sk-demo-paid"}
    critical = {"authorization": "Bearer sk-demo-critical"}
    rnd = random.Random(7)
    prompts = []
    statuses = []

    def send(method, path, body, headers=None, expect=None):
        r = request(fleet.port, method, path, body, headers, timeout=20)
        statuses.append(r.status)
        if expect is not None:
            assert r.status == expect, (path, r.status, r.body[:200])
        return r

    for i in range(10):
        p = [prompt_of(rnd, len(prompts) + k) for k in range(9)]
        prompts.extend(p)
        msg = lambda text: {"messages": [{"role": "user", "content": text}], "max_tokens": 900}  # noqa: E731
        send("POST", "/v1/chat/completions", msg(p[0]), critical, 200)
        send("POST", "/v1/chat/completions", msg(p[1]), paid, 200)  # clamped: body rewritten
        send("POST", "/v1/chat/completions", msg(p[2]), None, 429)  # free: shed
        send("POST", "/v1/chat/completions", msg(p[3] + " " + harness.filler("long", 40_000)), paid, 413)
        send("POST", "/v1/chat/completions", '{"messages": [{"role": "user", "content": "' + p[4], critical, 400)
        send("POST", "/v1/chat/completions", '{"messages": "' + p[5] + '"}', paid, 400)  # the guard's 400
        send("POST", "/v1/completions", {"prompt": p[6], "max_tokens": p[6]}, critical, 400)
        send("POST", "/v1/chat/completions", msg(p[7] + "x" * (5 << 20)), critical, 413)  # Envoy's limit
        send("POST", "/v1/embeddings", {"input": p[8]}, critical, 200)  # not read: placed by RTT and load
    # The session header is client data too.
    sessions = [prompt_of(rnd, 9000 + i) for i in range(5)]
    for s in sessions:
        send("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "s"}]},
             {**critical, "x-session-id": s}, 200)
    # Positive control: the access log is in the scanned log, with the path.
    send("GET", "/v1/models?marker=log-scan-control", None, critical, 200)
    envoy.stop()
    log = envoy.log()
    assert "marker=log-scan-control" in log, "the access log is not in the scanned output"
    assert log.count("[access]") >= len(statuses)
    leaks = []
    for p in prompts + sessions:
        subs = {p[k:k + 16] for k in range(len(p) - 15)}
        leaks += [s for s in subs if s in log]
    assert not leaks, leaks[:10]
    assert not harness.traps(envoy)
    print(f"\n{len(statuses)} requests ({sorted(set(statuses))}), {len(prompts)} prompts and {len(sessions)} "
          f"session ids: no 16-character substring in {len(log)} bytes of Envoy log")


def memory_allocated(envoy) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{envoy.admin_port}/memory", timeout=10) as r:
        return int(json.loads(r.read())["allocated"])


def flood(port: int, start: int, n: int, threads: int = 16) -> list[int]:
    """n distinct prompts (about 12 blocks each) and n distinct session ids."""
    def one(i: int) -> int:
        body = {"messages": [{"role": "user", "content": f"distinct {i} " + harness.filler(f"d{i}", 760)}],
                "max_tokens": 1}
        return chat(port, body["messages"], headers={"x-session-id": f"session-{i}"}, timeout=20, max_tokens=1).status
    with concurrent.futures.ThreadPoolExecutor(threads) as ex:
        return list(ex.map(one, range(start, start + n)))


# The bound under test, and the control's room for every key the load makes.
BOUNDED_SLOTS, ROOMY_SLOTS = 64, 1_048_576


@pytest.mark.parametrize("slots", [BOUNDED_SLOTS, ROOMY_SLOTS], ids=["bounded", "control-room-for-every-key"])
def test_shared_data_stays_bounded_under_distinct_prompts_and_sessions(fleet_factory, slots):
    """The prefix directory and the session records live in `directory.slots`
    fixed keys each; nothing a client sends adds a key. Envoy exposes no
    shared-data key count, so the test watches what it can: Envoy's heap
    (`/memory` allocated) across 30,000 distinct prompts and session ids.
    Unbounded keys would add at least 13 per request (12 prefix blocks and a
    session), some 400,000 keys. The control runs the same load with
    `directory.slots` 1,048,576 (room for every key: what the bound
    prevents, keys growing with what clients send), and the heap must be
    seen to grow there (13 MiB per 10,000 seen), or the measure could not
    tell a bound from none."""
    fleet = fleet_factory({"probe": TICK, "ladder": {"forced_level": 0}, "directory": {"slots": slots}},
                          engine_extra={n: FAST for n in harness.DEMO_REGIONS})
    envoy = fleet.envoy
    assert all(s == 200 for s in flood(fleet.port, 0, 2000))  # warm-up
    samples = [memory_allocated(envoy)]
    for k in range(3):
        statuses = flood(fleet.port, 2000 + k * 10_000, 10_000)
        assert all(s == 200 for s in statuses), sorted(set(statuses))
        samples.append(memory_allocated(envoy))
    growth = [b - a for a, b in zip(samples, samples[1:])]
    print(f"\nslots {slots}: Envoy allocated after warm-up and each 10,000 requests: "
          f"{[round(s / 2**20, 1) for s in samples]} MiB; growth per 10,000: {[round(g / 2**20, 2) for g in growth]} MiB")
    (harness.RUNS / f"shared-data-bound-{slots}.json").write_text(json.dumps(
        {"slots": slots, "requests": 32_000, "allocated_bytes": samples, "growth_bytes": growth}, indent=2) + "\n")
    if slots == BOUNDED_SLOTS:
        # No trend: the last 10,000 add less than 2 MiB (unbounded keys: >10 MiB).
        assert growth[-1] < 2 * 2**20, growth
        assert samples[-1] - samples[0] < 6 * 2**20, samples
    else:
        # The control: every 10,000 distinct prompts and sessions add keys
        # the heap shows, far past the bounded case's limits.
        assert all(g > 8 * 2**20 for g in growth), growth
        assert samples[-1] - samples[0] > 24 * 2**20, samples
    assert not harness.traps(envoy)


@pytest.mark.parametrize("seed3", ["other", "same"])
def test_hash_seed_is_configurable_and_proxies_with_one_seed_agree(fleet_factory, seed3):
    """Three Envoys of one deployment sharing through the exchange, each
    listing all three as peers: Envoys 1 and 2 with one seed, Envoy 3 with
    another (u64 max), or, as the control, the same one. Block hashes are
    seeded, so a placement learnt through Envoy 1 means the same prefix to
    Envoy 2, which routes the next turn to its holder. Envoy 3 receives the
    same messages: of another seed it refuses them whole as of another
    layout (and the others refuse its), merges nothing and routes the turn
    as a cold prompt, to the nearest region; of the same seed it merges
    them and routes the turn to its holder too."""
    seed_a = 1
    seed_b = 2**64 - 1 if seed3 == "other" else seed_a
    base = {"probe": TICK, "ladder": {"forced_level": 0}}
    fleet = fleet_factory(base, envoys=0)
    ports = [harness.free_port() for _ in range(3)]
    for i, seed in enumerate((seed_a, seed_a, seed_b)):
        cfg = harness.render_config(fleet.engines, harness.free_port(), harness.free_port(),
                                    {**base, "prefix": {"hash_seed": seed}}, peers=(ports[i], ports))
        fleet.envoys.append(harness.start_envoy(fleet.run_dir, cfg, name=f"envoy{i}-seed-{seed}"))
    fleet.exchange_ports = ports
    for e in fleet.envoys:
        fleet.wait_snapshot(e)
    e1, e2, e3 = fleet.envoys
    stat = lambda e, n: e.stat("wasmcustom.llm_geo_router." + n)  # noqa: E731
    counts = lambda: [(stat(e, "exchange.received"), stat(e, "exchange.refused"), stat(e, "exchange.merged"))  # noqa: E731
                      for e in fleet.envoys]

    def wait_all(name, predicate, timeout=15.0):
        harness.until(lambda: [stat(e, name) for e in fleet.envoys], lambda vs: all(predicate(v) for v in vs),
                      timeout, name)

    def until(cond, timeout=10.0):
        harness.until(cond, bool, timeout, lambda: f"(received, refused, merged) per Envoy {counts()}")

    # A first turn with an ~8 KB system prompt through Envoy 1 while near
    # is down, so mid serves it; then near back up everywhere.
    near = fleet.engines["near"]
    near.set_state(healthy=False)
    wait_all("region.near.healthy", lambda v: v == 0)
    msgs = [{"role": "system", "content": harness.filler("seeded", 8000)},
            {"role": "user", "content": "first question"}]
    r = chat(e1.port, msgs)
    assert r.status == 200 and r.replica == "mid", r.route
    msgs += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
             {"role": "user", "content": "and the next one"}]
    near.set_state(healthy=True)
    wait_all("region.near.healthy", lambda v: v == 1)
    # Envoy 3 routes too, so it has news to send.
    r = chat(e3.port, [{"role": "user", "content": "a prompt of the other seed"}])
    assert r.status == 200
    # Envoy 2 has merged Envoy 1's news; Envoy 1 sent the same message to
    # Envoy 3 in that round. Two more rounds from each of its peers reach
    # Envoy 3 after that, so whatever it makes of the news it has made.
    until(lambda: stat(e2, "exchange.merged") >= 1)
    handled = lambda e: stat(e, "exchange.received") + stat(e, "exchange.refused")  # noqa: E731
    h0 = handled(e3)
    until(lambda: handled(e3) >= h0 + 4)
    # The same seed: the turn goes to its holder from the other Envoy.
    r = chat(e2.port, msgs)
    assert r.status == 200 and r.replica == "mid" and r.route["reason"] == "cache", r.route
    r = chat(e3.port, msgs)
    if seed3 == "other":
        # Envoy 3 heard every message and refused each as of another
        # layout; so did the others Envoy 3's: it merged nothing, and the
        # turn is cold there.
        assert stat(e3, "exchange.refused") >= 4 and stat(e3, "exchange.received") == 0, counts()
        assert stat(e3, "exchange.merged") == 0, counts()
        assert stat(e1, "exchange.refused") >= 1 and stat(e2, "exchange.refused") >= 1, counts()
        for e in fleet.envoys:
            assert "another layout" in e.log()
        assert r.status == 200 and r.replica == "near" and r.route["reason"] == "rtt", r.route
    else:
        # The control: the same messages, merged; the turn goes to its holder.
        assert all(stat(e, "exchange.refused") == 0 for e in fleet.envoys), counts()
        assert stat(e3, "exchange.merged") >= 1, counts()
        assert r.status == 200 and r.replica == "mid" and r.route["reason"] == "cache", r.route
    for e in fleet.envoys:
        assert not harness.traps(e)
