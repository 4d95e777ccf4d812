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

import yaml

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
             f"+ prefill {route.get('prefill_ms', '?')} + queue {route.get('queue_ms', '?')}") if route else "no routing decision"
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
            # The other Envoy takes the next turn: wait for the placement to
            # reach it (the exchange sends once a probe tick).
            other = demo.lb.envoys[(demo.lb.last + 1) % len(demo.lb.envoys)]
            merged = other.stat("wasmcustom.llm_geo_router.exchange.merged")
            deadline = time.monotonic() + 5
            while other.stat("wasmcustom.llm_geo_router.exchange.merged") <= merged and time.monotonic() < deadline:
                time.sleep(0.05)
            note(f"the other Envoy learnt the placement after {5 - (deadline - time.monotonic()):.1f} s")
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
    heading(5, "a prompt far beyond the 4096-token context llama-server states (meta.n_ctx) is refused "
               "at the edge, in the engine's words, and reaches no engine")
    before = [engine_metrics(e)["llamacpp:prompt_tokens_total"] for e in fleet.engines.values()]
    r = show("a 60 KB prompt", chat([{"role": "user", "content": prose("long", 60000)}]))
    check(r.status == 400, f"over-context prompt: HTTP {r.status}")
    try:
        note(f"error: {r.json()['error']}")
    except (ValueError, KeyError, TypeError):
        check(False, f"over-context prompt: no OpenAI error body: {r.body[:200]!r}")
    after = [engine_metrics(e)["llamacpp:prompt_tokens_total"] for e in fleet.engines.values()]
    check(after == before, f"an engine processed the refused prompt: {before} -> {after}")


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
        for name in harness.DEMO_REGIONS:
            fleet.engines[name] = harness.start_llama(name, run_dir, ctx=4096 * SLOTS, parallel=SLOTS)
        fleet.replicas = {n: [e] for n, e in fleet.engines.items()}
        plugin = harness.plugin_config(yaml.safe_load(harness.DEMO_CONFIG.read_text()))
        regions = [{**r, "engine": "llamacpp"} for r in plugin["regions"]]
        fleet.exchange_ports = [harness.free_port(), harness.free_port()]
        for i in range(2):
            cfg = harness.render_config(fleet.engines, harness.free_port(), harness.free_port(),
                                        {"regions": regions}, peers=(fleet.exchange_ports[i], fleet.exchange_ports))
            fleet.envoys.append(harness.start_envoy(run_dir, cfg, name=f"envoy{i}"))
        deadline = time.monotonic() + 30
        while not all(e.stat(f"wasmcustom.llm_geo_router.region.{n}.max_model_len") > 0
                      for e in fleet.envoys for n in harness.DEMO_REGIONS):
            if time.monotonic() > deadline:
                raise RuntimeError("the probes did not read every region's context limit")
            time.sleep(0.1)
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
