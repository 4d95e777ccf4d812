"""The demo on a real engine nobody here wrote: three regions of llama.cpp's
`llama-server` (built from the pinned PyPI sdist's source by
scripts/llama-server-build; a tiny random-weight model over the real Llama-3
vocabulary, 4 slots of 4096 tokens each) behind two Envoys sharing what each
learns, from envoy/envoy.yaml with every region's `engine` set to
`llamacpp`. Run it through `scripts/demo --engine llama.cpp`.

The regions are all on loopback, so their round trips are alike: what
decides is what each engine holds and how loaded it is, as llama.cpp's own
`/metrics`, `/v1/models` and usage reports say. Each scene checks what its
heading says; any deviation makes the exit status 1.
"""

from __future__ import annotations

import signal
import sys
import time


import demo
import harness
from demo import check, elapsed, heading, note
from harness import Fleet, Response, request
from test_llamacpp import MODEL, SLOTS, Saturation, engine_metrics, prose

served: dict[str, int] = {}


def show(label: str, r: Response) -> Response:
    route = r.route
    try:
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    except (ValueError, KeyError, TypeError):
        cached = "-"
    if r.status < 400 and route.get("region"):
        served[route["region"]] = served.get(route["region"], 0) + 1
    terms = (f"reason={route.get('reason', '-'):<8} ttft {route.get('ttft_ms', '?'):>6} ms = rtt {route.get('rtt_ms', '?')} "
             f"+ prefill {route.get('prefill_ms', '?')} + wait {route.get('wait_ms', '?')} + load {route.get('load_ms', '?')}") if route else "no routing decision"
    print(f"  {label + f' [envoy {demo.lb.last + 1}]':<44} {r.status}  {route.get('region', '-'):<5} "
          f"cached={cached!s:<5} {terms}", flush=True)
    return r


def chat(messages: list, max_tokens: int = 4) -> Response:
    return request(demo.lb.port(), "POST", "/v1/chat/completions",
                   {"model": MODEL, "max_tokens": max_tokens, "messages": messages})


def scene_cold() -> None:
    heading(1, "cold prompts: nothing cached anywhere and the regions about equally near (loopback); a prompt "
               "shorter than a block ties on the same key everywhere, so both Envoys send each to the same region")
    regions = set()
    for topic in ("tides", "volcanoes", "glaciers", "monsoons"):
        r = show(f"cold prompt ({topic})", chat([{"role": "user", "content": f"Explain {topic} briefly."}]))
        check(r.status == 200 and r.route.get("reason") == "rtt", f"cold prompt {topic}: HTTP {r.status}, {r.route}")
        regions.add(r.route.get("region"))
    check(len(regions) == 1, f"short cold prompts through two Envoys went to {regions}: the Envoys disagree")


def scene_conversation() -> str:
    heading(2, "a 4-turn conversation with a ~1,100-token system prompt: every next turn, through either "
               "Envoy, goes back to the region holding its prefix, and llama-server confirms the cached tokens")
    messages = [{"role": "system", "content": prose("harbour", 6000)}]
    home = None
    for turn, q in enumerate(["Which ship came first?", "And its cargo?", "Its crew?", "The weather?"], 1):
        messages.append({"role": "user", "content": q})
        r = show(f"conversation turn {turn}", chat(messages))
        check(r.status == 200, f"turn {turn}: HTTP {r.status}")
        if turn == 1:
            home = r.route.get("region")
            # The other Envoy takes the next turn: wait until this one has
            # sent a message since (the exchange sends once a probe tick,
            # and the placement was noted before the answer came back),
            # and for its transit on loopback.
            sender = demo.lb.envoys[demo.lb.last]
            sent = sender.stat("wasmcustom.llm_geo_router.exchange.sent")
            t0 = time.monotonic()
            while sender.stat("wasmcustom.llm_geo_router.exchange.sent") <= sent and time.monotonic() - t0 < 5:
                time.sleep(0.05)
            time.sleep(0.3)
            note(f"Envoy {demo.lb.last + 1} sent its next exchange message {time.monotonic() - t0 - 0.3:.1f} s later")
        else:
            check(r.route.get("region") == home and r.route.get("reason") == "cache",
                  f"turn {turn}: {r.route}, expected {home} for cache")
            cached = r.json().get("usage", {}).get("prompt_tokens_details", {}).get("cached_tokens", 0)
            check(cached > 1000, f"turn {turn}: llama-server reused {cached} tokens, expected the system prompt's")
        messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"] or "."})
    return home or "near"


def scene_load(fleet: Fleet, region: str) -> None:
    heading(3, f"{region}'s slots are full and llama-server defers more requests: cold prompts go elsewhere")
    engine = fleet.engines[region]
    load = Saturation(engine, SLOTS + 4)
    try:
        deadline = time.monotonic() + 20
        while engine_metrics(engine).get("llamacpp:requests_deferred", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        waited = time.monotonic()
        while time.monotonic() - waited < 10 and not all(
                e.stat(f"wasmcustom.llm_geo_router.region.{region}.engine_waiting") >= 2 for e in fleet.envoys):
            time.sleep(0.05)
        m = engine_metrics(engine)
        note(f"llama-server {region}: {m.get('llamacpp:requests_processing', 0):.0f} processing, "
             f"{m.get('llamacpp:requests_deferred', 0):.0f} deferred; the probes read "
             f"{[e.stat(f'wasmcustom.llm_geo_router.region.{region}.engine_waiting') for e in fleet.envoys]} waiting")
        for i in range(6):
            r = show(f"cold prompt {i + 1} under load", chat([{"role": "user", "content": f"Under load {i}: hello"}]))
            check(r.status == 200 and r.route.get("region") != region,
                  f"cold prompt {i + 1}: {r.route}, expected a region other than {region}")
    finally:
        load.close()


def scene_context(fleet: Fleet) -> None:
    heading(5, "a prompt far beyond the 4096-token context llama-server states (meta.n_ctx): only the engine "
               "counts its tokens, so the edge sends it on and llama-server refuses it in its own words")
    rejected = [e.stat("wasmcustom.llm_geo_router.router.context_rejected") for e in fleet.envoys]
    r = show("a 60 KB prompt", chat([{"role": "user", "content": prose("long", 60000)}]))
    check(r.status == 400, f"over-context prompt: HTTP {r.status}")
    try:
        err = r.json()["error"]
        note(f"llama-server's error: {err}")
        check(err.get("type") == "exceed_context_size_error", f"not llama-server's refusal: {err}")
    except (ValueError, KeyError, TypeError):
        check(False, f"over-context prompt: no OpenAI error body: {r.body[:200]!r}")
    after = [e.stat("wasmcustom.llm_geo_router.router.context_rejected") for e in fleet.envoys]
    check(after == rejected, f"the edge refused a prompt on its estimate: {rejected} -> {after}")


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    for path in (harness.WASM, harness.ENVOY):
        if not path.exists():
            print(f"demo: {path} is missing; run scripts/demo --engine llama.cpp", file=sys.stderr)
            return 2
    run_dir = harness.fresh_run_dir("demo-llamacpp")
    fleet = Fleet(run_dir)
    print(f"[{elapsed()}] Starting three llama-server regions (near, mid, far on loopback) and two Envoys "
          f"sharing; logs in {run_dir.relative_to(harness.ROOT)}", flush=True)
    try:
        fleet.start_llama(envoys=2, shared=True, slots=SLOTS)
        demo.lb = demo.Balancer(fleet)
        print(f"[{elapsed()}] Envoys on 127.0.0.1:{fleet.envoys[0].port} and :{fleet.envoys[1].port}; "
              f"every region healthy, its context limit read from llama-server", flush=True)
        scene_cold()
        home = scene_conversation()
        scene_load(fleet, home)
        demo.scene_malformed(fleet)
        scene_context(fleet)
        print(f"\n[{elapsed()}] Requests served per region (seen by the demo): {served}")
        for i, e in enumerate(fleet.envoys, 1):
            lines = harness.traps(e)
            check(not lines, f"envoy {i} logged wasm VM failures: {lines[:2]}")
    except Exception as exc:  # noqa: BLE001 - any harness failure is a demo failure
        demo.failures.append(f"{type(exc).__name__}: {exc}")
        print(f"\n!! demo aborted: {type(exc).__name__}: {exc}", flush=True)
    finally:
        fleet.stop()
    print(f"\n[{elapsed()}] ", end="")
    if demo.failures:
        print(f"FAILED: {len(demo.failures)} expectation(s) not met; logs in {run_dir.relative_to(harness.ROOT)}")
        for f in demo.failures:
            print(f"  - {f}")
        return 1
    print("OK: every scene behaved as described.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
