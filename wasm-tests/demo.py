"""The local three-region demo: three emulated engine replicas (near 5 ms,
mid 40 ms, far 120 ms away) behind two real Envoy 1.40s running the plugin
from envoy/envoy.yaml, one deployment sharing what each Envoy learns (the
exchange), and a short scripted traffic run that shows each routing
decision. Requests alternate between the two Envoys as behind a load
balancer: a conversation's turns go through both. Run it through
`scripts/demo`, which installs and builds first.

Every request prints one line: what it was, the Envoy it went through,
the HTTP status, the replica that served it (`x-engine-replica`), the tokens that replica found cached
(`x-engine-cached-tokens`), and the router's reason and TTFT terms (from the
`x-llm-route` decision header the demo configuration turns on).

Each scene checks that the plugin did what the heading says; any deviation is
printed with the reason and makes the exit status 1. Everything started here
is torn down on every exit path.
"""

from __future__ import annotations

import signal
import sys
import threading
import time

import yaml

import harness
from harness import Fleet, Response, chat, filler, fresh_run_dir, request

# The probe period the demo runs with: envoy/envoy.yaml's, unchanged.
TICK_S = harness.plugin_config(yaml.safe_load(harness.DEMO_CONFIG.read_text())).get("probe", {}).get("tick_ms", 1000) / 1000
PROBE_WAIT_S = 8.0  # generous bound for unhealthy_after/healthy_after (2 ticks each)
BACKLOG = 30  # requests parked on the paused `mid` engine in scene 3

failures: list[str] = []
served: dict[str, int] = {}
t_start = time.monotonic()


def elapsed() -> str:
    return f"{time.monotonic() - t_start:5.1f}s"


def heading(n: int, text: str) -> None:
    print(f"\n[{elapsed()}] Scene {n}: {text}", flush=True)


def note(text: str) -> None:
    print(f"           {text}", flush=True)


def check(ok: bool, why: str) -> bool:
    if not ok:
        failures.append(why)
        print(f"           !! NOT AS EXPECTED: {why}", flush=True)
    return ok


class Balancer:
    """The demo's load balancer: each request to the next Envoy in turn."""

    def __init__(self, fleet: Fleet):
        self.envoys = fleet.envoys
        self.n = 0

    def next(self) -> int:
        self.last = self.n % len(self.envoys)
        self.n += 1
        return self.last

    def port(self) -> int:
        return self.envoys[self.next()].port


lb: Balancer


def show(label: str, r: Response) -> Response:
    label = f"{label} [envoy {lb.last + 1}]"
    route = r.route
    replica = r.replica or "-"
    if r.status < 400 and r.replica:
        served[r.replica] = served.get(r.replica, 0) + 1
    cached = r.headers.get("x-engine-cached-tokens", "-")
    if "reason" in route:
        terms = (f"reason={route['reason']:<8} ttft {route.get('ttft_ms', '?'):>6} ms = "
                 f"rtt {route.get('rtt_ms', '?')} + prefill {route.get('prefill_ms', '?')} "
                 f"+ wait {route.get('wait_ms', '?')} + load {route.get('load_ms', '?')}")
        if "runner_up" in route:
            terms += f"  (runner-up {route['runner_up']} {route.get('runner_up_ttft_ms', '?')} ms)"
    else:
        terms = "no routing decision"
    print(f"  {label:<50} {r.status}  {replica:<5} cached={cached:<5} {terms}", flush=True)
    return r


def expect_route(r: Response, what: str, region: str, reason: str | None = None) -> None:
    got = r.route
    check(r.status == 200, f"{what}: HTTP {r.status}, expected 200 (body {r.body[:200]!r})")
    check(r.replica == region, f"{what}: served by {r.replica!r}, expected {region!r}")
    check(got.get("region") == region,
          f"{what}: router chose region {got.get('region')!r}, expected {region!r} (x-llm-route: {r.headers.get('x-llm-route')!r})")
    if reason is not None:
        check(got.get("reason") == reason,
              f"{what}: router reason {got.get('reason')!r}, expected {reason!r} (x-llm-route: {r.headers.get('x-llm-route')!r})")


def gauge(fleet: Fleet, region: str, what: str, envoy: int = 0) -> int:
    return fleet.envoys[envoy].stat(f"wasmcustom.llm_geo_router.region.{region}.{what}")


def wait_gauge(fleet: Fleet, region: str, what: str, ok, timeout: float = PROBE_WAIT_S) -> tuple[bool, float]:
    """Poll a probe gauge at every Envoy until ok(value) at all; the demo
    waits on what the probes published, not on a fixed sleep, so a slow
    machine does not change the outcome."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if all(ok(gauge(fleet, region, what, i)) for i in range(len(fleet.envoys))):
            return True, time.monotonic() - t0
        time.sleep(0.05)
    return False, time.monotonic() - t0


def reply_text(r: Response) -> str:
    try:
        return r.json()["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        return "(no reply)"


def scene_cold(fleet: Fleet) -> None:
    heading(1, "three cold prompts (nothing cached anywhere) go to the nearest region, near")
    for i, topic in enumerate(["tides", "volcanoes", "glaciers"], 1):
        r = show(f"cold prompt {i} ({topic})",
                 chat(lb.port(), [{"role": "user", "content": f"Explain {topic} in one sentence."}]))
        expect_route(r, f"cold prompt {i}", "near", "rtt")


def scene_conversation(fleet: Fleet) -> list[dict]:
    heading(2, "a 4-turn conversation (8 KB system prompt) starts on mid while near is down, and stays "
               "on mid after near recovers: the cached prefix saves more prefill than the extra RTT costs. "
               "Its turns alternate between the Envoys: each knows what the other placed")
    near = fleet.engines["near"]
    near.set_state(healthy=False)
    ok, waited = wait_gauge(fleet, "near", "healthy", lambda v: v == 0)
    if check(ok, f"the probe did not mark near unhealthy within {PROBE_WAIT_S} s"):
        note(f"near's /health now answers 503; the probe marked it unhealthy after {waited:.1f} s "
             f"({waited / TICK_S:.1f} ticks)")
    system = "You are the support assistant of a shipping company. Policies follow. " + filler("policy", 8192)
    messages = [{"role": "system", "content": system}]
    questions = ["Where is parcel 1142?", "Can it be redirected?", "What does that cost?", "Book it, please."]
    for turn, q in enumerate(questions, 1):
        if turn == 2:
            near.set_state(healthy=True)
            ok, waited = wait_gauge(fleet, "near", "healthy", lambda v: v == 1)
            if check(ok, f"the probe did not mark near healthy again within {PROBE_WAIT_S} s"):
                note(f"near is healthy again (probe noticed after {waited:.1f} s)")
        messages.append({"role": "user", "content": q})
        r = show(f"conversation turn {turn}", chat(lb.port(), messages))
        if turn == 1:
            expect_route(r, "turn 1 (near unhealthy)", "mid", "rtt")
        else:
            expect_route(r, f"turn {turn} (near healthy, prefix cached on mid)", "mid", "cache")
            check(int(r.headers.get("x-engine-cached-tokens", "0")) > 1000,
                  f"turn {turn}: mid reports {r.headers.get('x-engine-cached-tokens')!r} cached tokens, "
                  "expected the ~2000-token system prompt")
        messages.append({"role": "assistant", "content": reply_text(r)})
    return messages


def scene_queue(fleet: Fleet, messages: list[dict]) -> None:
    heading(3, f"mid (the warm region) is paused with {BACKLOG} requests queued on it; "
               "the next turn goes to near for load")
    mid = fleet.engines["mid"]
    mid.set_state(paused=True)
    results: list[int] = []
    lock = threading.Lock()

    def background(i: int) -> None:
        # Straight to the engine's own port: through Envoy the router would
        # (rightly) not send them all to mid.
        try:
            status = chat(mid.port, [{"role": "user", "content": f"background job {i}"}], timeout=30).status
        except OSError as e:
            status = f"{type(e).__name__}"
        with lock:
            results.append(status)

    threads = [threading.Thread(target=background, args=(i,), daemon=True) for i in range(BACKLOG)]
    try:
        for t in threads:
            t.start()
        ok, waited = wait_gauge(fleet, "mid", "engine_waiting", lambda v: v >= BACKLOG)
        if check(ok, f"the probe did not see mid's queue of {BACKLOG} within {PROBE_WAIT_S} s "
                     f"(engine_waiting={gauge(fleet, 'mid', 'engine_waiting')})"):
            note(f"probe scraped mid: {gauge(fleet, 'mid', 'engine_waiting')} waiting, "
                 f"{gauge(fleet, 'mid', 'engine_running')} running (after {waited:.1f} s)")
        messages.append({"role": "user", "content": "Also, when will it arrive?"})
        r = show("conversation turn 5", chat(lb.port(), messages))
        expect_route(r, "turn 5 (mid queued)", "near", "load")
        messages.append({"role": "assistant", "content": reply_text(r)})
    finally:
        mid.set_state(paused=False)
        deadline = time.monotonic() + 20
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
    done = sum(1 for s in results if s == 200)
    note(f"mid unpaused; {done}/{BACKLOG} background requests completed")
    check(done == BACKLOG, f"only {done}/{BACKLOG} background requests to mid got 200: {sorted(map(str, results))}")


def scene_malformed(fleet: Fleet) -> None:
    heading(4, "a malformed JSON request is refused by the router with 400 and an OpenAI error body")
    body = b'{"model": "emulated-model", "messages": [{"role": "user", "content": "hi"}'
    r = show("truncated JSON body", request(lb.port(), "POST", "/v1/chat/completions", body))
    check(r.status == 400, f"malformed JSON: HTTP {r.status}, expected 400")
    check(r.replica is None, f"malformed JSON reached engine {r.replica!r}")
    try:
        err = r.json()["error"]
        note(f"error.type={err.get('type')!r} error.code={err.get('code')!r} error.message={err.get('message')!r}")
        check(err.get("type") == "invalid_request_error" and bool(err.get("message")),
              f"malformed JSON: error body {err!r} lacks type invalid_request_error or a message")
    except (ValueError, KeyError, TypeError):
        check(False, f"malformed JSON: body is not an OpenAI error JSON: {r.body[:200]!r}")


def scene_spoof(fleet: Fleet) -> None:
    heading(5, "a client sending x-llm-cluster: region_far cannot choose the region")
    r = show("cold prompt, x-llm-cluster: region_far",
             chat(lb.port(), [{"role": "user", "content": "Explain monsoons in one sentence."}],
                  headers={"x-llm-cluster": "region_far"}))
    expect_route(r, "spoofed cluster header", "near", "rtt")
    seen = r.headers.get("x-echo-x-llm-cluster")
    note(f"served by {r.headers.get('x-engine-replica')!r}; the engine received x-llm-cluster: {seen!r} "
         "(the route removes the router's internal headers upstream)")
    check(r.headers.get("x-engine-replica") == "near", f"served by {r.headers.get('x-engine-replica')!r}, expected near")
    check(seen == "-", f"the engine saw x-llm-cluster {seen!r}, expected none")


def scene_responses(fleet: Fleet) -> None:
    heading(6, "a Responses API conversation is stored by the engine that answered it (mid, while near "
               "is down); after near recovers, its follow-up (previous_response_id), through the other "
               "Envoy, goes back to mid, the only region that has it")
    near = fleet.engines["near"]
    near.set_state(healthy=False)
    ok, _ = wait_gauge(fleet, "near", "healthy", lambda v: v == 0)
    check(ok, f"the probe did not mark near unhealthy within {PROBE_WAIT_S} s")
    first = {"model": "emulated-model", "instructions": "Be brief.", "input": "Where is parcel 1142?",
             "max_output_tokens": 16}
    r = show("responses turn 1", request(lb.port(), "POST", "/v1/responses", first))
    expect_route(r, "responses turn 1 (near unhealthy)", "mid", "rtt")
    near.set_state(healthy=True)
    ok, _ = wait_gauge(fleet, "near", "healthy", lambda v: v == 1)
    check(ok, f"the probe did not mark near healthy again within {PROBE_WAIT_S} s")
    try:
        rid = r.json()["id"]
    except (ValueError, KeyError, TypeError):
        check(False, f"responses turn 1: no response id in {r.body[:200]!r}")
        return
    note(f"mid stored response {rid}")
    follow = {**first, "input": "Can it be redirected?", "previous_response_id": rid}
    r = show("responses turn 2 (previous_response_id)", request(lb.port(), "POST", "/v1/responses", follow))
    expect_route(r, "responses turn 2 (near healthy, response stored on mid)", "mid", "response")


def scene_streams(fleet: Fleet) -> None:
    heading(7, "streamed answers: each region's time to first token as clients see it, and the router's error")
    note("12 streamed chats asking for their usage, half of them turns of one long conversation;")
    note("each Envoy records TTFT, tokens and its own error per region (docs/STATS.md, Distributions)")
    system = filler("demo-stream-system", 6000)
    for i in range(12):
        content = f"{system} turn {i}" if i % 2 else f"Stream a short answer about topic {i}."
        r = harness.stream_chat(lb.port(), content, max_tokens=6)
        if r["status"] < 400 and r["replica"]:
            served[r["replica"]] = served.get(r["replica"], 0) + 1
        check(r["status"] == 200 and r["usage"] is not None,
              f"stream {i}: HTTP {r['status']}, usage {r['usage']!r}")
        print(f"  stream {i + 1:>2} [envoy {lb.last + 1}] {r['status']}  {r['replica'] or '-':<5} "
              f"first byte after {r['ttft_ms']:6.1f} ms, router expected "
              f"{r['route'].get('ttft_ms', '?')} ms", flush=True)


def histogram_summary(fleet: Fleet) -> None:
    """Each region's TTFT p50/p95 and the router's mean error, from both
    Envoys' /stats/prometheus (their buckets added)."""
    print(f"\n[{elapsed()}] Time to first token and the router's error per region, from /stats/prometheus "
          "(gen_ai_server_time_to_first_token_milliseconds, llm_geo_router_region_ttft_error_milliseconds)")
    # Envoy merges its workers' histograms at each stats flush (5 s).
    deadline = time.monotonic() + 15
    while True:
        scrapes = [harness.scrape(e) for e in fleet.envoys]
        merged = harness.Scrape("")
        for sc in scrapes:
            merged.types.update(sc.types)
            for name, rows in sc.samples.items():
                merged.samples.setdefault(name, []).extend(rows)
        ttft_n = merged.value("gen_ai_server_time_to_first_token_milliseconds_count")
        if ttft_n >= 12 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    check(ttft_n == 12, f"the Envoys recorded {ttft_n:.0f} times to first token for the 12 streams")
    err = "llm_geo_router_region_ttft_error_milliseconds"
    print(f"  {'region':<8} {'streams':>7} {'TTFT p50':>9} {'TTFT p95':>9} {'router error (mean)':>20}")
    for name in harness.DEMO_REGIONS:
        n = merged.value("gen_ai_server_time_to_first_token_milliseconds_count", cloud_region=name)
        p50 = merged.quantile("gen_ai_server_time_to_first_token_milliseconds", 0.5, cloud_region=name)
        p95 = merged.quantile("gen_ai_server_time_to_first_token_milliseconds", 0.95, cloud_region=name)
        count = merged.value(f"{err}_count", llm_geo_router_region=name)
        signed = (merged.value(f"{err}_sum", llm_geo_router_region=name, llm_geo_router_direction="late")
                  - merged.value(f"{err}_sum", llm_geo_router_region=name, llm_geo_router_direction="early"))
        fmt = lambda v: "-" if v is None else f"{v:.0f} ms"  # noqa: E731
        mean = f"{signed / count:+.0f} ms" if count else "-"
        print(f"  {name:<8} {n:>7.0f} {fmt(p50):>9} {fmt(p95):>9} {mean:>20}")


def summary(fleet: Fleet) -> None:
    print(f"\n[{elapsed()}] Requests per region, both Envoys' counts added "
          "(Envoy stats wasmcustom.llm_geo_router.region.<name>.rq_total)")
    every = [e.stats() for e in fleet.envoys]

    def total(name: str) -> int:
        return sum(s.get(name, 0) for s in every)

    print(f"  {'region':<8} {'rq_total':>8} {'served (seen by demo)':>22} {'rq_active now':>14}")
    for name in harness.DEMO_REGIONS:
        rq = total(f"wasmcustom.llm_geo_router.region.{name}.rq_total")
        active = total(f"wasmcustom.llm_geo_router.region.{name}.rq_active")
        print(f"  {name:<8} {rq:>8} {served.get(name, 0):>22} {active:>14}")
        check(rq == served.get(name, 0),
              f"rq_total for {name} is {rq}, but the demo saw {served.get(name, 0)} requests served there")
        # Every request has finished: an in-flight count left over would skew
        # the queue term of every later decision.
        check(active == 0, f"rq_active for {name} is {active} with no request in flight")
    prefix = "wasmcustom.llm_geo_router.router.decision."
    reasons = {k[len(prefix):]: total(k) for k in sorted({k for s in every for k in s if k.startswith(prefix)})}
    print("  decisions: " + ", ".join(f"{k}={v}" for k, v in reasons.items()))
    print(f"  invalid requests refused by the router: {total('wasmcustom.llm_geo_router.router.invalid_request')}")
    print("  the exchange (wasmcustom.llm_geo_router.exchange.*):")
    for i, s in enumerate(every, 1):
        x = {k: s.get(f"wasmcustom.llm_geo_router.exchange.{k}", 0)
             for k in ("sent", "received", "merged", "refused", "peers")}
        print(f"    envoy {i}: " + ", ".join(f"{k}={v}" for k, v in x.items()))
        check(x["received"] > 0 and x["merged"] > 0 and x["refused"] == 0 and x["peers"] == len(fleet.envoys) - 1,
              f"envoy {i}'s exchange: {x}, expected messages received and merged from its one peer, none refused")
    for i, e in enumerate(fleet.envoys, 1):
        lines = harness.traps(e)
        print(f"  wasm VM traps/panics in envoy {i}'s log: {len(lines)}")
        for line in lines[:3]:
            print(f"    {line.strip()[:200]}")
        check(not lines, f"envoy {i} logged {len(lines)} wasm VM failures; see {e.log_path}")


def main() -> int:
    # SIGTERM (e.g. from a CI timeout) unwinds through the finally below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    for path in (harness.WASM, harness.EMULATOR, harness.ENVOY):
        if not path.exists():
            print(f"demo: {path} is missing; run scripts/demo (it installs and builds first)", file=sys.stderr)
            return 2
    run_dir = fresh_run_dir("demo")
    fleet = Fleet(run_dir)
    print(f"[{elapsed()}] Starting emulated regions near (5 ms), mid (40 ms), far (120 ms, sglang) "
          f"and two Envoys sharing; logs in {run_dir.relative_to(harness.ROOT)}", flush=True)
    global lb
    try:
        fleet.start(envoys=2, shared=True)
        lb = Balancer(fleet)
        for i, (e, peers) in enumerate(zip(fleet.envoys, fleet.exchange_ports), 1):
            print(f"[{elapsed()}] Envoy {i} listening on 127.0.0.1:{e.port} (admin {e.admin_port}, "
                  f"peers {peers}); probe snapshot published", flush=True)
        scene_cold(fleet)
        messages = scene_conversation(fleet)
        scene_queue(fleet, messages)
        scene_malformed(fleet)
        scene_spoof(fleet)
        scene_responses(fleet)
        scene_streams(fleet)
        summary(fleet)
        histogram_summary(fleet)
    except Exception as exc:  # noqa: BLE001 - report any harness failure as a demo failure
        failures.append(f"{type(exc).__name__}: {exc}")
        print(f"\n!! demo aborted: {type(exc).__name__}: {exc}", flush=True)
    finally:
        fleet.stop()
    print(f"\n[{elapsed()}] ", end="")
    if failures:
        print(f"FAILED: {len(failures)} expectation(s) not met; Envoy and engine logs in "
              f"{run_dir.relative_to(harness.ROOT)}")
        for f in failures:
            print(f"  - {f}")
        return 1
    print("OK: every scene behaved as described.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
