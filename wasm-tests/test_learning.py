"""What an answer teaches goes to the region whose engine gave it, in a real
Envoy: the prefix directory, the session record and the stored-response map
are written when the answer starts, for the region whose host served the
last try (its endpoint metadata), never for the region first chosen, and
never for an answer the engine refused.

The probe runs once every 15 s here, busy or not (the fleet's start waits
up to 20 s for its second snapshot), so that after near's
engine is killed the router keeps believing near healthy and choosing it:
each request's connection is refused and Envoy retries it on another
region's engine (retry_priority), as in test_faults' retry test. Each test
checks that no probe round ran while it did."""

import harness
from harness import chat, filler, probe_ticks

SLOW_PROBE = {"probe": {"tick_ms": 15000, "busy_tick_ms": 15000, "timeout_ms": 1000,
                        "snapshot_max_age_ms": 45000}}


def responses(port, body):
    return harness.request(port, "POST", "/v1/responses", body, timeout=30)


def test_stored_responses_made_on_a_retry_are_followed_to_their_holder(fleet_factory):
    fleet = fleet_factory(SLOW_PROBE)
    envoy = fleet.envoy
    ticks = probe_ticks(envoy)
    fleet.engines["near"].kill()
    stored = []
    for i in range(4):
        r = responses(fleet.port, {"model": "emulated-model", "input": filler(f"conv-{i}", 400),
                                   "store": True, "max_output_tokens": 4})
        assert r.status == 200, r.body
        assert r.route["region"] == "near", r.route
        assert r.replica in ("mid", "far"), r.replica
        stored.append((r.json()["id"], r.replica))
    # near comes back; the router still takes it for the best region.
    fleet.restart_engine("near")
    follow = []
    for i, (rid, holder) in enumerate(stored):
        r = responses(fleet.port, {"model": "emulated-model", "input": f"and then? {i}",
                                   "previous_response_id": rid, "max_output_tokens": 4})
        follow.append((r.status, r.replica, holder, r.route.get("reason")))
    assert probe_ticks(envoy) == ticks, "a probe round ran during the test; it needs a longer tick"
    print("follow-ups (status, served by, holder, reason):", follow)
    assert all(s == 200 and rep == holder and why == "response" for s, rep, holder, why in follow), follow
    # The four answers and their four follow-ups (stored too, by default).
    assert envoy.stat("wasmcustom.llm_geo_router.router.responses_recorded") == 8


def test_a_prompt_retried_from_near_is_believed_held_where_it_ran(fleet_factory):
    fleet = fleet_factory(SLOW_PROBE)
    envoy = fleet.envoy
    ticks = probe_ticks(envoy)
    doc = filler("shared-document", 8000)
    fleet.engines["near"].kill()
    first = chat(fleet.port, [{"role": "user", "content": doc}, {"role": "user", "content": "summarise"}])
    assert first.status == 200, first.body
    assert first.route["region"] == "near" and first.replica in ("mid", "far"), (first.route, first.replica)
    fleet.restart_engine("near")
    # The same document again, on a healthy near: held by the replica that
    # served it, not by near, which never saw it.
    again = chat(fleet.port, [{"role": "user", "content": doc}, {"role": "user", "content": "and the details?"}])
    assert probe_ticks(envoy) == ticks, "a probe round ran during the test; it needs a longer tick"
    assert again.status == 200, again.body
    print("first:", first.replica, first.route, "again:", again.replica, again.route)
    assert again.route["region"] == first.replica, again.route
    assert again.route["reason"] == "cache", again.route
    assert int(again.route["cached_tokens"]) > 1000, again.route
    assert again.replica == first.replica
    # The engine confirms: it had the prompt cached.
    usage = again.json()["usage"]
    assert (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) > 1000, usage


def test_a_prompt_the_engine_refused_is_believed_nowhere(fleet_factory):
    # The router does not know near's context limit (no model card read
    # yet: the probe has not looked since the engine restarted with a
    # smaller one), so it forwards the prompt and the engine refuses it.
    fleet = fleet_factory(SLOW_PROBE)
    envoy = fleet.envoy
    ticks = probe_ticks(envoy)
    fleet.restart_engine("near", extra=["--max-model-len", "512"])
    doc = filler("too-long", 8000)
    for attempt in range(2):
        r = chat(fleet.port, [{"role": "user", "content": doc}])
        print("attempt", attempt, r.status, r.route)
        assert r.status == 400, (r.status, r.body)
        assert r.route["region"] == "near", r.route
        assert r.route["reason"] != "cache" and r.route["cached_tokens"] == "0", r.route
    assert probe_ticks(envoy) == ticks, "a probe round ran during the test; it needs a longer tick"
