"""The demo on the engine most users run: three regions of real vLLM 0.32
(its CPU build from PyPI, installed by scripts/vllm-install; a small
random-weight Llama over the real Llama-3 vocabulary, a 4,096-token
context, 4 sequences at once) behind two Envoys sharing what each learns,
from envoy/envoy.yaml with every region's `engine` set to `vllm`. Run it
through `scripts/demo --engine vllm`.

The regions are all on loopback, so their round trips are alike: what
decides is what each engine holds and how loaded it is, as vLLM's own
`/metrics`, `/v1/models` and usage reports say. Each scene checks what its
heading says; any deviation makes the exit status 1.
"""

from __future__ import annotations

import json
import signal
import sys
import time

import demo
import harness
from demo import check, elapsed, heading, note
from harness import Fleet, Response, request
from test_vllm import LIMIT, MODEL, SEQS, Saturation, prose, vllm_metrics

served: dict[str, int] = {}


def show(label: str, r: Response) -> Response:
    route = r.route
    try:
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    except (ValueError, KeyError, TypeError):
        cached = "-"
    if r.status < 400 and route.get("region"):
        served[route["region"]] = served.get(route["region"], 0) + 1
    terms = (f"reason={route.get('reason', '-'):<8} believed {route.get('cached_tokens', '?'):>5} cached; "
             f"ttft {route.get('ttft_ms', '?'):>6} ms = rtt {route.get('rtt_ms', '?')} "
             f"+ prefill {route.get('prefill_ms', '?')} + wait {route.get('wait_ms', '?')} "
             f"+ load {route.get('load_ms', '?')}") if route else "no routing decision (answered at the edge)"
    print(f"  {label + f' [envoy {demo.lb.last + 1}]':<40} {r.status}  {route.get('region', '-'):<5} "
          f"vllm cached={cached!s:<5} {terms}", flush=True)
    return r


def chat(messages: list, max_tokens: int = 4) -> Response:
    return request(demo.lb.port(), "POST", "/v1/chat/completions",
                   {"model": MODEL, "max_tokens": max_tokens, "messages": messages}, timeout=120)


def scene_cold() -> None:
    heading(1, "cold prompts: nothing cached anywhere and the regions about equally near (loopback); a prompt "
               "shorter than a block ties on the same key everywhere, so both Envoys send each to the same region")
    regions = set()
    for topic in ("tides", "volcanoes", "glaciers", "monsoons"):
        r = show(f"cold prompt ({topic})", chat([{"role": "user", "content": f"Explain {topic} briefly."}]))
        check(r.status == 200, f"cold prompt {topic}: HTTP {r.status}")
        regions.add(r.route.get("region"))
    check(len(regions) == 1, f"short cold prompts through two Envoys went to {regions}: the Envoys disagree")


def scene_conversation() -> str:
    heading(2, "a 4-turn conversation with a ~1,100-token system prompt: every next turn, through either "
               "Envoy, goes back to the region holding its prefix, and vLLM confirms the cached tokens "
               "(whole 128-token blocks)")
    messages = [{"role": "system", "content": prose("harbour", 6000)}]
    home = None
    for turn, q in enumerate(["Which ship came first?", "And its cargo?", "Its crew?", "The weather?"], 1):
        messages.append({"role": "user", "content": q})
        r = show(f"conversation turn {turn}", chat(messages))
        check(r.status == 200, f"turn {turn}: HTTP {r.status}")
        if turn == 1:
            home = r.route.get("region")
            # The other Envoy takes the next turn: wait for this one's next
            # exchange message, and its transit on loopback.
            sender = demo.lb.envoys[demo.lb.last]
            sent = sender.stat("wasmcustom.llm_geo_router.exchange.sent")
            t0 = time.monotonic()
            while sender.stat("wasmcustom.llm_geo_router.exchange.sent") <= sent and time.monotonic() - t0 < 5:
                time.sleep(0.05)
            time.sleep(0.3)
        else:
            check(r.route.get("region") == home and r.route.get("reason") == "cache",
                  f"turn {turn}: {r.route}, expected {home} for cache")
            cached = r.json().get("usage", {}).get("prompt_tokens_details", {}).get("cached_tokens", 0)
            check(cached >= 1024 and cached % harness.VLLM_BLOCK == 0,
                  f"turn {turn}: vLLM reused {cached} tokens, expected the system prompt's whole blocks")
        messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"] or "."})
    return home or "near"


def scene_load(fleet: Fleet, region: str) -> None:
    heading(3, f"{region}'s {SEQS} sequences are busy and more requests wait in vLLM's queue: cold prompts go "
               "elsewhere")
    engine = fleet.engines[region]
    load = Saturation(engine, SEQS + 4)
    try:
        deadline = time.monotonic() + 60
        while vllm_metrics(engine).get("vllm:num_requests_waiting", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        waited = time.monotonic()
        while time.monotonic() - waited < 10 and not all(
                e.stat(f"wasmcustom.llm_geo_router.region.{region}.engine_waiting") >= 2 for e in fleet.envoys):
            time.sleep(0.05)
        m = vllm_metrics(engine)
        note(f"vLLM {region}: {m.get('vllm:num_requests_running', 0):.0f} running, "
             f"{m.get('vllm:num_requests_waiting', 0):.0f} waiting; the probes read "
             f"{[e.stat(f'wasmcustom.llm_geo_router.region.{region}.engine_waiting') for e in fleet.envoys]} waiting")
        for i in range(6):
            r = show(f"cold prompt {i + 1} under load", chat([{"role": "user", "content": f"Under load {i}: hello"}]))
            check(r.status == 200 and r.route.get("region") != region,
                  f"cold prompt {i + 1}: {r.route}, expected a region other than {region}")
    finally:
        load.close(engine)


def scene_context(fleet: Fleet) -> None:
    heading(5, f"vLLM's context rule ({LIMIT} tokens): a max_tokens above it is refused at the edge with "
               "vLLM's own answer; a prompt too long is vLLM's to count and refuse")
    body = {"model": MODEL, "max_tokens": 5000, "messages": [{"role": "user", "content": "hi"}]}
    edge = show("max_tokens 5000", request(demo.lb.port(), "POST", "/v1/chat/completions", body))
    engine = request(fleet.engines["near"].port, "POST", "/v1/chat/completions", body)
    check(edge.status == 400 and json.loads(edge.body) == json.loads(engine.body),
          f"the edge's answer differs from vLLM's: {edge.body[:200]!r} vs {engine.body[:200]!r}")
    note(f"vLLM's own answer, given at the edge: {edge.body.decode()[:160]}...")
    digits = " ".join(f"{i * 7919 % 1000000:06d}" for i in range(1500))
    r = show("a ~7,500-token prompt", chat([{"role": "user", "content": digits}]))
    check(r.status == 400 and r.route.get("region") in harness.DEMO_REGIONS,
          f"an over-context prompt: HTTP {r.status}, {r.route}: expected the engine's 400")


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    for path in (harness.WASM, harness.ENVOY):
        if not path.exists():
            print(f"demo: {path} is missing; run scripts/demo --engine vllm", file=sys.stderr)
            return 2
    run_dir = harness.fresh_run_dir("demo-vllm")
    fleet = Fleet(run_dir)
    print(f"[{elapsed()}] Starting three vLLM 0.32 regions (near, mid, far on loopback; 30-90 s) and two Envoys "
          f"sharing; logs in {run_dir.relative_to(harness.ROOT)}", flush=True)
    try:
        fleet.start_vllm(envoys=2, shared=True, max_model_len=LIMIT,
                         vllm={n: {"max_num_seqs": SEQS} for n in harness.DEMO_REGIONS})
        demo.lb = demo.Balancer(fleet)
        print(f"[{elapsed()}] Envoys on 127.0.0.1:{fleet.envoys[0].port} and :{fleet.envoys[1].port}; "
              f"every region healthy, its context limit read from vLLM", flush=True)
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
