"""Live benchmark: one trace replayed in real time (time-scaled), open loop,
through each router under test in front of the same three emulated regions,
with time to first token (TTFT) measured at the client.

    scripts/bench-live                     # setup, builds, runs this, updates docs
    .venv/bin/python wasm-tests/bench_live.py [--trace T.jsonl] [--json-out F] [options]

Routers (each in front of its own fresh set of three engine emulators, near
5 ms, mid 40 ms, far 120 ms away as in the demo, so every run starts with
cold caches):

- `plugin`: Envoy from envoy/envoy.yaml (harness.render_config, its
  exchange kept: a deployment of this one Envoy, as shipped), told only
  what an operator knows: each region's slots (max_concurrency) and a
  capacity estimate from them at the default service time; prefill rate,
  service time and RTT at their defaults (`plugin_overrides`);
- `round_robin`, `least_request`, `ring_hash`: Envoy without the plugin,
  one cluster with the three engines as endpoints
  (envoy/bench/live-round-robin.yaml, live-least-request.yaml,
  live-ring-hash.yaml; ring_hash hashes `x-session-id`);
- `mesh`: the service-mesh default, Istio's locality failover as Envoy
  runs it (envoy/bench/live-mesh.yaml): near at priority 0, mid at 1, far at
  2 (by the emulated round trips), LEAST_REQUEST within a priority, active
  HTTP health checks and outlier detection;
- `smg`: SGLang's model gateway (`smg launch --policy cache_aware`, PyPI
  smg, the successor of sglang-router) with the three engines as
  `--worker-urls`;
- `vllm_router`: vLLM's router (`vllm-router --policy cache_aware`, PyPI
  vllm-router) likewise, in front of three vLLM-mode engines (it matches
  prefixes on the token ids each worker's `/v1/chat/completions/render`
  gives, which SGLang does not serve);
  a peer that is not installed or does not start is reported as not run,
  with the reason. `PEERS` pins both versions; scripts/bench-live installs
  them.

Seeds: `--scenario S --seeds 3 4 5` generates each seed's trace and fleet
(`llm-geo-router generate`), runs every router on each, and reports per seed
and over the seeds the ratio plugin TTFT p95 (and mean) / the best other
router's, with the geometric mean and the spread.

Trace: JSONL, one request a line sorted by `t_ms`: `{"t_ms", "session",
"client_region", "tier", "segments": [[id, n_tokens], ...], "output_tokens"}`.
The prompt is the concatenation of the segments, each expanded exactly as the
Rust simulator does (`expand_segment`). Without `--trace` a small built-in
trace is generated (`builtin_trace`).

Time scale: `--time-scale 0.25` replays the trace 4x faster AND makes the
engines 4x faster (the emulators' prefill and decode ms per token are the
unscaled rates times the scale), so the load on each engine (utilisation,
queueing) is that of the unscaled trace. The network delays are not scaled:
they are the geography under test.

Replay: open loop, each request fires at its scheduled time whatever the
others are doing (one thread per request in flight, at most
`--max-inflight`, never more than the trace has); streaming; TTFT = from
sending the request to the first SSE `data:` line; e2e = to the end of the
stream. Single vantage point: the replayer runs on loopback, so every
request sees the same client-to-region delays whatever its
`client_region` (which is recorded, not used). wasm-tests/bench_live_geo.py
(scripts/bench-live-geo) is the several-vantage variant: each request enters
at the router of its own client region, behind an emulated WAN.

Output per router: TTFT mean/p50/p95/p99, e2e p50/p95, requests per region
(`x-engine-replica`, cross-checked with the emulators' /admin/stats), cache
hit token ratio (sum `x-engine-cached-tokens` / sum `x-engine-prompt-tokens`),
session moves (consecutive turns of a session on different regions), errors.
A table on stdout, `--json-out` for JSON, `--doc` rewrites the `## Live
benchmark` section of docs/BENCHMARKS.md (only that section).
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import platform
import random
import re
import shlex
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

ROOT = harness.ROOT
CLI = ROOT / "target" / "release" / "llm-geo-router"
PYTHON = ROOT / ".venv" / "bin" / "python"
PATH = "/v1/chat/completions"
MODEL = "emulated-model"
REGIONS = list(harness.DEMO_REGIONS)  # near, mid, far
LIVE_YAML = {
    "round_robin": ROOT / "envoy" / "bench" / "live-round-robin.yaml",
    "least_request": ROOT / "envoy" / "bench" / "live-least-request.yaml",
    "ring_hash": ROOT / "envoy" / "bench" / "live-ring-hash.yaml",
    "mesh": ROOT / "envoy" / "bench" / "live-mesh.yaml",
}
ROUTERS = ["plugin", "round_robin", "least_request", "ring_hash", "mesh", "smg", "vllm_router"]
TIER_KEYS = {"paid": "sk-demo-paid", "critical": "sk-demo-critical"}
SECTION = "## Live benchmark"
# A request counts as queued at the engine when it waited this long for a
# slot (x-engine-queue-ms); below it is the emulator's own wake-up jitter.
QUEUED_MS = 10
# Pause between reads of a stream after its first token (see one_request).
READ_PAUSE_S = 0.01

# ------------------------------------------------------- segment expansion

M64 = (1 << 64) - 1


def fnv1a64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & M64
    return h


def mix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def expand_segment(seg_id: str, n: int) -> str:
    """Segment `[id, n]` as prompt text, byte for byte as the Rust simulator:
    token k is three lowercase letters from mix64(fnv1a64(id) + k) and a
    space (4 bytes a token)."""
    seed = fnv1a64(seg_id.encode())
    out = []
    for k in range(n):
        x = mix64((seed + k) & M64)
        out.append(chr(97 + x % 26) + chr(97 + (x >> 8) % 26) + chr(97 + (x >> 16) % 26) + " ")
    return "".join(out)


# Pinned like sim/src/trace.rs's own test (segment_text("sys-3", 4) is
# "dvf pvu moc oxc "), one token further.
_EXPANSION_VECTOR = ("sys-3", 5, "dvf pvu moc oxc uey ")


class Segments:
    """Expanded segments, each id expanded once (a shorter `n` of the same id
    is a prefix of a longer one)."""

    def __init__(self) -> None:
        self.text: dict[str, str] = {}

    def get(self, seg_id: str, n: int) -> str:
        have = self.text.get(seg_id, "")
        if len(have) < 4 * n:
            have = expand_segment(seg_id, n)
            self.text[seg_id] = have
        return have[: 4 * n]


# ------------------------------------------------------------------- trace

def load_trace(path: Path) -> list[dict]:
    reqs = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        r = json.loads(line)
        for k in ("t_ms", "session", "segments", "output_tokens"):
            if k not in r:
                raise ValueError(f"{path}:{i}: missing {k}")
        reqs.append(r)
    reqs.sort(key=lambda r: r["t_ms"])
    return reqs


def builtin_trace(seed: int, duration_s: float, sessions_per_s: float) -> list[dict]:
    """A small multi-turn chat trace in the generator's format: sessions
    arrive as a Poisson process; each has a tier, a client region, one of 4
    system prompts, often one of 8 shared documents, and 1 to 8 turns; turn i
    resends the whole conversation so far (system, document, every earlier
    user turn and answer) plus its new user turn, 4 to 12 s after the previous
    turn started."""
    rng = random.Random(seed)
    sys_sizes = [600, 900, 1200, 1600]
    doc_sizes = [rng.randint(1500, 6000) for _ in range(8)]
    reqs = []
    t = 0.0
    n = 0
    while True:
        t += rng.expovariate(sessions_per_s)
        if t >= duration_s:
            break
        sid = f"s{n}"
        n += 1
        tier = rng.choices(["free", "paid", "critical"], [0.70, 0.25, 0.05])[0]
        region = rng.choice(["na", "eu", "ap"])
        k = rng.randrange(len(sys_sizes))
        history = [[f"sys-{k}", sys_sizes[k]]]
        if rng.random() < 0.6:
            d = rng.randrange(len(doc_sizes))
            history.append([f"doc-{d}", doc_sizes[d]])
        turns = min(8, 1 + int(rng.expovariate(1 / 2.5)))
        at = t
        for i in range(turns):
            if at >= duration_s:
                break
            history.append([f"{sid}-u{i}", rng.randint(30, 400)])
            out = rng.randint(60, 400)
            reqs.append({"t_ms": round(at * 1000, 1), "session": sid, "client_region": region, "tier": tier,
                         "segments": [list(s) for s in history], "output_tokens": out})
            history.append([f"{sid}-a{i}", out])
            at += rng.uniform(4.0, 12.0)
    reqs.sort(key=lambda r: r["t_ms"])
    return reqs


def generator_available() -> bool:
    if not CLI.exists():
        return False
    try:
        out = subprocess.run([str(CLI), "--help"], capture_output=True, text=True, timeout=30)
    except OSError:
        return False
    return re.search(r"^\s+generate\s", out.stdout + out.stderr, re.M) is not None


def generate_trace(scenario: str, seed: int, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [str(CLI), "generate", "--scenario", scenario, "--seed", str(seed), "--out", str(out_dir)]
    subprocess.run(cmd, check=True, timeout=300)
    return out_dir / "trace.jsonl"


# ---------------------------------------------------------------- requests

@dataclass
class Prepared:
    idx: int
    t_ms: float
    session: str
    tier: str
    client_region: str
    turn: int
    body: bytes
    headers: dict


def prepare(trace: list[dict]) -> list[Prepared]:
    segs = Segments()
    turns: dict[str, int] = {}
    out = []
    for i, r in enumerate(trace):
        content = "".join(segs.get(str(s[0]), int(s[1])) for s in r["segments"])
        # Compact, keys sorted: the same bytes as the simulator's
        # trace::request_body (serde_json's json! without preserve_order).
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}],
                           "max_tokens": int(r["output_tokens"]), "stream": True},
                          separators=(",", ":"), sort_keys=True).encode()
        tier = r.get("tier") or "free"
        h = {"content-type": "application/json", "x-session-id": str(r["session"])}
        if tier in TIER_KEYS:
            h["authorization"] = f"Bearer {TIER_KEYS[tier]}"
        turn = turns.get(r["session"], 0)
        turns[r["session"]] = turn + 1
        out.append(Prepared(i, float(r["t_ms"]), str(r["session"]), tier, str(r.get("client_region", "")),
                            turn, body, h))
    return out


def trace_info(trace: list[dict]) -> dict:
    prompt = [sum(int(s[1]) for s in r["segments"]) for r in trace]
    span = (trace[-1]["t_ms"] - trace[0]["t_ms"]) / 1000 if len(trace) > 1 else 0.0
    tiers: dict[str, int] = {}
    for r in trace:
        tiers[r.get("tier") or "free"] = tiers.get(r.get("tier") or "free", 0) + 1
    return {
        "requests": len(trace),
        "sessions": len({r["session"] for r in trace}),
        "span_s": round(span, 1),
        "rate_rps": round(len(trace) / span, 2) if span > 0 else None,
        "prompt_tokens_mean": round(sum(prompt) / len(prompt)) if prompt else 0,
        "prompt_tokens_max": max(prompt, default=0),
        "output_tokens_mean": round(sum(int(r["output_tokens"]) for r in trace) / len(trace)) if trace else 0,
        "tiers": tiers,
    }


# ------------------------------------------------------------------ replay

@dataclass
class Result:
    idx: int
    session: str
    turn: int
    tier: str
    lag_ms: float = 0.0
    sent_ms: float = 0.0  # since the replay's start
    status: int = 0
    error: str | None = None
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    replica: str | None = None
    cached: int = 0
    prompt: int = 0
    queue_ms: int = 0
    route: str | None = None


def one_request(port: int, p: Prepared, due: float, timeout: float, start: float) -> Result:
    res = Result(p.idx, p.session, p.turn, p.tier)
    t0 = time.monotonic()
    res.lag_ms = (t0 - due) * 1000
    res.sent_ms = (t0 - start) * 1000
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", PATH, body=p.body, headers=p.headers)
        resp = conn.getresponse()
        res.status = resp.status
        h = {k.lower(): v for k, v in resp.getheaders()}
        res.replica = h.get("x-engine-replica")
        res.cached = int(h.get("x-engine-cached-tokens", 0) or 0)
        res.prompt = int(h.get("x-engine-prompt-tokens", 0) or 0)
        res.queue_ms = int(h.get("x-engine-queue-ms", 0) or 0)
        res.route = h.get("x-llm-route")
        if resp.status != 200:
            resp.read()
            res.error = f"status_{resp.status}"
            return res
        while True:
            line = resp.readline()
            if not line:
                res.error = "no_data"
                return res
            if line.startswith(b"data:"):
                res.ttft_ms = (time.monotonic() - t0) * 1000
                break
        tail = line
        if resp.chunked:
            # The rest of the stream as raw bytes, in few reads: parsing
            # every per-token chunk in Python, for dozens of streams at
            # once, would hold the GIL long enough to delay other threads'
            # dispatch and first bytes (what is measured). The sleep batches
            # the events; it adds at most READ_PAUSE_S to e2e.
            while not tail.endswith(b"\r\n0\r\n\r\n"):
                chunk = resp.fp.read1(1 << 20)
                if not chunk:
                    break
                tail = (tail + chunk)[-128:]
                time.sleep(READ_PAUSE_S)
        else:
            tail = (tail + resp.read())[-128:]
        res.e2e_ms = (time.monotonic() - t0) * 1000
        if b"data: [DONE]" not in tail:
            res.error = "no_done"
    except Exception as e:  # noqa: BLE001 - every failure is a counted error
        res.error = f"exception_{type(e).__name__}"
    finally:
        conn.close()
    return res


def replay(port, preps: list[Prepared], time_scale: float, max_inflight: int,
           timeout: float) -> tuple[list[Result], dict]:
    """Sends every request at its scheduled time (open loop), each on its own
    thread, at most `max_inflight` (and never more than the trace has) in
    flight; returns the results and the client's own figures (how many were
    in flight at most, how long the dispatcher waited for a free thread).
    `port`: the router's port, or a function of the request giving it (the
    several-vantage benchmark sends each request to its client region's
    router)."""
    port_of = port if callable(port) else (lambda _p: port)
    results: list[Result | None] = [None] * len(preps)
    bound = max(1, min(max_inflight, len(preps)))
    sem = threading.BoundedSemaphore(bound)
    lock = threading.Lock()
    inflight = [0, 0]  # now, max
    threads = []

    def run(i: int, p: Prepared, due: float) -> None:
        with lock:
            inflight[0] += 1
            inflight[1] = max(inflight[1], inflight[0])
        try:
            results[i] = one_request(port_of(p), p, due, timeout, start)
        finally:
            with lock:
                inflight[0] -= 1
            sem.release()

    blocked = 0.0
    base = preps[0].t_ms if preps else 0.0
    start = time.monotonic() + 0.1
    for i, p in enumerate(preps):
        due = start + (p.t_ms - base) * time_scale / 1000
        now = time.monotonic()
        if due > now:
            time.sleep(due - now)
        if not sem.acquire(blocking=False):
            w = time.monotonic()
            sem.acquire()
            blocked += time.monotonic() - w
        th = threading.Thread(target=run, args=(i, p, due), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join(timeout + 5)
    out = [r if r is not None else Result(p.idx, p.session, p.turn, p.tier, error="not_finished")
           for r, p in zip(results, preps)]
    return out, {"inflight_bound": bound, "inflight_max": inflight[1], "dispatcher_blocked_ms": round(blocked * 1000, 1)}


# ----------------------------------------------------------------- routers

ENGINE_DEFAULTS = {"max_concurrency": 8, "prefill_ms_per_token": 0.2, "decode_ms_per_token": 8.0,
                   "cache_tokens": 200000}


def engine_figures(args) -> tuple[dict[str, dict], str]:
    """Unscaled figures of each live region's engine: a command-line option
    wins, else the fleet file's region in the same position (near, mid, far
    take the fleet's first, second, third region), else ENGINE_DEFAULTS.
    The network delays are always the demo's (5/40/120 ms)."""
    fleet_regions = []
    if args.fleet:
        fleet_regions = json.loads(args.fleet.read_text()).get("regions", [])
    out = {}
    for i, name in enumerate(REGIONS):
        fr = fleet_regions[i] if i < len(fleet_regions) else {}
        fig = {}
        for k, default in ENGINE_DEFAULTS.items():
            v = getattr(args, k)
            fig[k] = v if v is not None else type(default)(fr.get(k, default))
        fig["from_fleet"] = fr.get("name")
        out[name] = fig
    if fleet_regions:
        shown = Path(args.fleet).resolve()
        shown = shown.relative_to(ROOT) if shown.is_relative_to(ROOT) else args.fleet
        how = (f"with the figures of `{shown}`'s regions (" + ", ".join(
            f"{n} = {f['from_fleet']}" for n, f in out.items() if f["from_fleet"])
            + "; the network delays stay the demo's)")
    else:
        how = "with the replayer's default figures"
    given = [k for k in ENGINE_DEFAULTS if getattr(args, k) is not None]
    if given:
        how += ", but " + ", ".join(f"`--{k.replace('_', '-')}`" for k in given) + " from the command line"
    return out, how


# The engines serve a 128k-context model (Llama 3.1 class): the traces' long
# agentic prompts are 30-45k of the engines' own tokens, past the emulator's
# default --max-model-len of 32768, which would refuse them with a 400.
MAX_MODEL_LEN = 131072


def engine_args(fig: dict, time_scale: float) -> list[str]:
    return ["--max-concurrency", str(fig["max_concurrency"]),
            "--prefill-ms-per-token", f"{fig['prefill_ms_per_token'] * time_scale:g}",
            "--decode-ms-per-token", f"{fig['decode_ms_per_token'] * time_scale:g}",
            "--cache-tokens", str(fig["cache_tokens"]),
            "--max-model-len", str(MAX_MODEL_LEN)]


def start_engines(run_dir: Path, figs: dict[str, dict], time_scale: float,
                  mode: str | None = None) -> dict[str, harness.Engine]:
    """The three regions' emulators, each in the demo's mode (far is
    SGLang) unless `mode` sets one for all."""
    engines = {}
    try:
        for name, (_, delay, demo_mode) in harness.DEMO_REGIONS.items():
            engines[name] = harness.start_engine(name, run_dir, delay, mode or demo_mode,
                                                 engine_args(figs[name], time_scale))
    except Exception:
        for e in engines.values():
            e.kill()
        raise
    return engines


DEFAULT_SERVICE_MS = 2000.0  # docs/CONFIG.md, regions[].service_ms default


def plugin_overrides(figs: dict[str, dict], time_scale: float, info: dict) -> dict:
    """The demo's plugin configuration with what an operator knows of these
    engines: their slots (`max_concurrency`) and a capacity estimate from
    them at the documented default service time, scaled as the engines'
    compute is: the emulators run `time_scale` x the unscaled compute times,
    and an operator of engines that much faster knows it (an unscaled
    estimate sheds work these engines have the slots for). Never the
    engines' exact figures nor anything computed from the trace: prefill
    rate, service time and RTT stay at their defaults (the probe measures
    RTT, online tuning fits the prefill rate and the weights). Everything
    else as in envoy/envoy.yaml."""
    del info  # what the operator does not know
    cfg = yaml.safe_load(harness.DEMO_CONFIG.read_text())
    regions = harness.plugin_config(cfg)["regions"]
    for r in regions:
        fig = figs[r["name"]]
        for known_only_to_the_engines in ("prefill_ms_per_token", "service_ms", "rtt_ms"):
            r.pop(known_only_to_the_engines, None)
        r["max_concurrency"] = fig["max_concurrency"]
        r["capacity_rps"] = round(fig["max_concurrency"] * 1000 / (DEFAULT_SERVICE_MS * time_scale), 2)
    return {"regions": regions}


class RouterRun:
    name = ""
    port = 0
    extra: dict

    def pids(self) -> list[int]:
        return []

    def stop(self) -> None:
        pass

    def finish(self) -> dict:
        return {}


class PluginRun(RouterRun):
    name = "plugin"

    def __init__(self, run_dir: Path, engines: dict, overrides: dict):
        self.extra = {}
        # As envoy/envoy.yaml ships, its exchange kept: a deployment of this
        # one Envoy (its peers' cluster lists only itself, so it has nobody
        # to share with; bench_live_geo.py runs one Envoy per client region).
        own = harness.free_port()
        cfg = harness.render_config(engines, harness.free_port(), harness.free_port(), overrides,
                                    peers=(own, [own]))
        self.envoy = harness.start_envoy(run_dir, cfg, name="envoy")
        fleet = harness.Fleet(run_dir, engines=engines, envoys=[self.envoy])
        fleet.wait_snapshot(self.envoy)
        self.port = self.envoy.port

    def pids(self) -> list[int]:
        return [self.envoy.proc.pid]

    def finish(self) -> dict:
        s = self.envoy.stats()
        short = {k.replace("wasmcustom.llm_geo_router.", ""): v for k, v in s.items()}
        keep = {k: v for k, v in short.items()
                if k.startswith(("router.decision.", "ladder.", "guard.", "tuning.", "router.invalid"))
                or re.match(r"region\.[a-z]+\.(rq_total|upstream_failure|prefill_us_per_token|rtt_ms)$", k)}
        return {"envoy_stats": dict(sorted(keep.items())), "traps": harness.traps(self.envoy)}

    def stop(self) -> None:
        self.envoy.stop()


def lb_endpoints(cluster: dict) -> list[dict]:
    """A cluster's endpoints in the order its file lists them, across its
    locality groups (one group for the plain load balancers, one per
    region, nearest first, for the mesh)."""
    return [ep for group in cluster["load_assignment"]["endpoints"] for ep in group["lb_endpoints"]]


# Envoy's counters of the `regions` cluster worth keeping: how much it
# retried, and (the mesh) whether health checks or outlier detection ever
# took a region out, which is what moves its traffic off the nearest one.
LB_STATS = (r"cluster\.regions\.(upstream_rq_total|upstream_rq_retry|upstream_cx_total|health_check\.failure"
            r"|outlier_detection\.ejections_enforced_total)$")


class EnvoyLbRun(RouterRun):
    def __init__(self, name: str, run_dir: Path, engines: dict):
        self.name = name
        self.extra = {}
        cfg = yaml.safe_load(LIVE_YAML[name].read_text())
        cfg["admin"]["address"]["socket_address"]["port_value"] = harness.free_port()
        cfg["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"] = harness.free_port()
        (cluster,) = cfg["static_resources"]["clusters"]
        for ep, region in zip(lb_endpoints(cluster), REGIONS, strict=True):
            ep["endpoint"]["address"]["socket_address"]["port_value"] = engines[region].port
        self.envoy = harness.start_envoy(run_dir, cfg, name="envoy")
        self.port = self.envoy.port

    def pids(self) -> list[int]:
        return [self.envoy.proc.pid]

    def finish(self) -> dict:
        return {"envoy_stats": self.envoy.stats(LB_STATS)}

    def stop(self) -> None:
        self.envoy.stop()


@dataclass(frozen=True)
class Peer:
    """A cache-aware router as its users run it: its PyPI distribution at
    the version the scripts install, and its command line."""

    key: str
    dist: str
    version: str
    label: str
    # What it is, for the docs.
    what: str
    # Every engine in this mode for this peer (None: the demo's modes).
    engine_mode: str | None
    # Why its command line is what it is, for the docs.
    deployment: str

    def command(self, port: int, workers: list[str], prometheus_port: int) -> list[str]:
        bin_dir = ROOT / ".venv" / "bin"
        # Bound to loopback, and its Prometheus listener on a free port
        # (both default to fixed ports that a second instance, one per
        # client region, would collide on): plumbing, not policy.
        where = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
                 "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port)]
        if self.key == "smg":
            # cache_aware is smg's default policy (docs/reference/configuration.md),
            # named so the record says which; its thresholds and worker overload
            # protection stay at their defaults. A 1 s drain on SIGTERM (default
            # 180 s) only shortens the benchmark's teardown.
            return [str(bin_dir / "smg"), "launch", *where, "--policy", "cache_aware",
                    "--shutdown-grace-period-secs", "1", "--log-level", "warn"]
        # vllm-router: cache_aware is its default too (`vllm-router --help`);
        # it has no prefix-aware policy of another name.
        return [str(bin_dir / "vllm-router"), *where, "--policy", "cache_aware", "--log-level", "warning"]


PEERS = {
    "smg": Peer(
        "smg", "smg", "1.13.0", "smg", "SGLang's model gateway, which supersedes sglang-router", None,
        "`smg launch --policy cache_aware`, its default policy, at its default thresholds: cache threshold 0.3, "
        "balance thresholds 64 and 1.5, worker overload protection at 8 waiting requests or 0.8 KV-cache usage; "
        "for HTTP workers it keeps an approximate prefix tree over the request text and polls each engine's "
        "`/metrics` for load every 10 s"),
    "vllm_router": Peer(
        "vllm_router", "vllm-router", "0.1.17", "vllm-router", "vLLM's router", "vllm",
        "`vllm-router --policy cache_aware`, its default policy, at its default thresholds: cache threshold 0.3, "
        "balance thresholds 64 and 1.5; before it chooses, it asks every worker for the request's token ids at "
        "`/v1/chat/completions/render` and matches prefixes on those, so every request waits for the slowest "
        "worker's answer; its engines all run in vLLM mode, as its users run it: SGLang has no render route"),
}


def installed_version(dist: str) -> str | None:
    """The version of a distribution installed in .venv, or None."""
    try:
        out = subprocess.run([str(PYTHON), "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"],
                             capture_output=True, text=True, timeout=60)
    except OSError:
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def peer_versions() -> dict[str, str | None]:
    """Each peer's installed version (None: not installed), keyed by its
    distribution."""
    return {p.dist: installed_version(p.dist) for p in PEERS.values()}


def notable(lines: list[str]) -> list[str]:
    """The reading lines that qualify a table: contention warnings, routers
    that did not run, served only part of the trace, or had errors."""
    return [l for l in lines if l.startswith("Warning") or " did not run: " in l or " had errors: " in l
            or " so they do not compare with the others'" in l]


def peer_not_installed(key: str, versions: dict[str, str | None]) -> str | None:
    """Why a peer cannot run, or None. Another version than the pinned one
    runs (the result records which) after a warning."""
    peer = PEERS[key]
    have = versions.get(peer.dist)
    if have is None:
        return f"{peer.dist} is not installed in .venv (`.venv/bin/pip install {peer.dist}=={peer.version}`)"
    if have != peer.version:
        print(f"bench-live: warning: {peer.dist} {have} is installed, not the pinned {peer.version}",
              file=sys.stderr)
    return None


def start_peer(key: str, run_dir: Path, label: str, port: int, workers: list[str]
               ) -> tuple[subprocess.Popen, list[str], Path]:
    cmd = PEERS[key].command(port, workers, harness.free_port())
    log = run_dir / f"{PEERS[key].dist}-{label}.log"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log, "w"), cwd=ROOT)
    return proc, cmd, log


def wait_peer(key: str, proc: subprocess.Popen, port: int, n_workers: int, log: Path,
              timeout: float = 90.0) -> None:
    """Until the peer's /readiness (smg and vllm-router both serve it) counts
    every worker registered and healthy: smg registers them in the
    background after it starts listening."""
    deadline = time.time() + timeout
    last = ""
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{PEERS[key].dist} exited with {proc.returncode}: {tail(log)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readiness", timeout=2) as r:
                last = r.read().decode()
                ready = json.loads(last)
                if r.status == 200 and ready.get("healthy_workers") == ready.get("total_workers") == n_workers:
                    return
        except OSError as e:
            last = str(e)
        except ValueError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{PEERS[key].dist} not ready with {n_workers} workers in {timeout:.0f} s "
                       f"(last: {last}); see {log}")


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


class PeerRun(RouterRun):
    def __init__(self, key: str, run_dir: Path, engines: dict):
        self.name = key
        self.extra = {}
        self.port = harness.free_port()
        self.proc, self.cmd, self.log_path = start_peer(key, run_dir, "router", self.port,
                                                        [engines[r].url for r in REGIONS])
        try:
            wait_peer(key, self.proc, self.port, len(REGIONS), self.log_path)
        except Exception:
            self.stop()
            raise

    def pids(self) -> list[int]:
        return [self.proc.pid]

    def finish(self) -> dict:
        return {"command": shlex.join(self.cmd)}

    def stop(self) -> None:
        stop_process(self.proc)


def cpu_times() -> tuple[int, int, int]:
    """(busy, total, irq) jiffies of the whole machine, from /proc/stat; irq
    (hard and soft interrupts, mostly this benchmark's own loopback traffic)
    is in busy but in no process's CPU time."""
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0, 0, 0
    idle = f[3] + (f[4] if len(f) > 4 else 0)
    irq = sum(f[5:7]) if len(f) > 6 else 0
    return sum(f) - idle, sum(f), irq


def proc_cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of these processes (all their threads)."""
    total = 0.0
    for pid in pids:
        try:
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            pass
    return total


def wait_idle(max_wait_s: float, busy_max: float = 0.3) -> float:
    """Waits (at most max_wait_s) until the machine is less than busy_max
    busy over one second; returns the last busy fraction seen."""
    deadline = time.monotonic() + max_wait_s
    while True:
        b0, t0, _ = cpu_times()
        time.sleep(1.0)
        b1, t1, _ = cpu_times()
        busy = (b1 - b0) / max(1, t1 - t0)
        if busy < busy_max or time.monotonic() >= deadline:
            return busy
        print(f"bench-live: the machine is {100 * busy:.0f} % busy; waiting for it to calm down", file=sys.stderr)


def tail(path: Path, n: int = 600) -> str:
    try:
        return re.sub(r"\x1b\[[0-9;]*m", "", path.read_text(errors="replace"))[-n:]
    except OSError:
        return ""


# --------------------------------------------------------------- summaries

def pct(values: list[float], q: float) -> float | None:
    """Percentile with linear interpolation between closest ranks."""
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def rnd(x: float | None, nd: int = 1) -> float | None:
    return None if x is None else round(x, nd)


def parse_route(raw: str | None) -> dict:
    if not raw:
        return {}
    return dict(p.strip().split("=", 1) for p in raw.split(";") if "=" in p)


def inflight_at(results: list[Result], t_ms: float, region: str, me: Result) -> int:
    """Requests of this run in flight to `region` at `t_ms`, by the client's
    own clock (sent, until the end of the stream)."""
    return sum(1 for o in results if o is not me and o.replica == region and o.e2e_ms is not None
               and o.sent_ms <= t_ms < o.sent_ms + o.e2e_ms)


def summarize(results: list[Result], engines: dict[str, dict], slots: dict[str, int] | None = None,
              regions: list[str] | None = None) -> dict:
    regions = REGIONS if regions is None else regions
    ok = [r for r in results if r.error is None]
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    e2e = [r.e2e_ms for r in ok if r.e2e_ms is not None]
    by_region = {name: 0 for name in regions}
    for r in results:
        if r.replica:
            by_region[r.replica] = by_region.get(r.replica, 0) + 1
    errors: dict[str, int] = {}
    for r in results:
        if r.error:
            errors[r.error] = errors.get(r.error, 0) + 1
    cached = sum(r.cached for r in results if r.replica)
    prompt = sum(r.prompt for r in results if r.replica)
    # Session moves: a turn served by another region than the session's
    # previous turn (in trace order).
    last: dict[str, str] = {}
    moves = follow = 0
    for r in sorted(results, key=lambda r: r.idx):
        if not r.replica:
            continue
        if r.session in last:
            follow += 1
            moves += last[r.session] != r.replica
        last[r.session] = r.replica
    queued = [r.queue_ms for r in results if r.replica]
    first_turn = [r.ttft_ms for r in ok if r.turn == 0 and r.ttft_ms is not None]
    later_turn = [r.ttft_ms for r in ok if r.turn > 0 and r.ttft_ms is not None]
    out = {
        "requests": len(results),
        "ok": len(ok),
        "errors": errors,
        "ttft_ms": {"mean": rnd(sum(ttft) / len(ttft)) if ttft else None, "p50": rnd(pct(ttft, 50)),
                    "p95": rnd(pct(ttft, 95)), "p99": rnd(pct(ttft, 99))},
        "ttft_ms_first_turn": {"p50": rnd(pct(first_turn, 50)), "p95": rnd(pct(first_turn, 95)), "n": len(first_turn)},
        "ttft_ms_later_turns": {"p50": rnd(pct(later_turn, 50)), "p95": rnd(pct(later_turn, 95)),
                                "n": len(later_turn)},
        "e2e_ms": {"p50": rnd(pct(e2e, 50)), "p95": rnd(pct(e2e, 95))},
        "requests_per_region": by_region,
        "cache_hit_token_ratio": round(cached / prompt, 4) if prompt else None,
        "cached_tokens": cached,
        "prompt_tokens": prompt,
        "engine_queue_ms": {"mean": rnd(sum(queued) / len(queued)) if queued else None,
                            "p95": rnd(pct(queued, 95)),
                            "queued_share": round(sum(q >= QUEUED_MS for q in queued) / len(queued), 3)
                            if queued else None},
        "session_moves": moves,
        "follow_up_turns": follow,
        "dispatch_lag_ms": {"p50": rnd(pct([r.lag_ms for r in results], 50), 2),
                            "max": rnd(max((r.lag_ms for r in results), default=None), 2)},
        "engines": engines,
    }
    routed = [(r, parse_route(r.route)) for r in results if r.route]
    if routed:
        reasons: dict[str, int] = {}
        by_reason: dict[str, list[Result]] = {}
        for r, d in routed:
            key = f"{d.get('region', '?')}:{d.get('reason', '?')}"
            reasons[key] = reasons.get(key, 0) + 1
            by_reason.setdefault(d.get("reason", "?"), []).append(r)
        out["decisions"] = dict(sorted(reasons.items()))
        out["by_reason"] = {
            reason: {
                "n": len(rs),
                "ttft_p50_ms": rnd(pct([r.ttft_ms for r in rs if r.ttft_ms is not None], 50)),
                "cache_hit_token_ratio": round(sum(r.cached for r in rs) / max(1, sum(r.prompt for r in rs)), 3),
                "predicted_queue_ms_gt0": sum(float(d.get("wait_ms", 0) or 0) + float(d.get("load_ms", 0) or 0) > 0
                                              for r, d in routed if d.get("reason") == reason),
                "engine_queued": sum(r.queue_ms >= QUEUED_MS for r in rs),
            } for reason, rs in sorted(by_reason.items())}
        out["ladder_levels"] = sorted({d.get("level", "?") for _, d in routed})
        pairs = [(float(d["ttft_ms"]), r.ttft_ms) for r, d in routed if "ttft_ms" in d and r.ttft_ms is not None]
        if pairs:
            out["predicted_ttft_ms_mean"] = rnd(sum(a for a, _ in pairs) / len(pairs))
            out["measured_ttft_ms_mean_same_requests"] = rnd(sum(b for _, b in pairs) / len(pairs))
        # The load guard: for each decision that passed a region over for its
        # load (`load`, `load-override`, `spread`), did the region passed over
        # have a free slot, by the client's own accounting (fewer requests of
        # this run in flight there than its engine has slots), and did the
        # router predict a wait there (`passed_over_wait_ms` > 0)? Issue 14's
        # target: no `load-override` with a free slot and no predicted wait.
        # Single-round runs only (sent_ms restarts each round).
        if slots and len({r.idx for r in results}) == len(results):
            for reason in ("load", "load-override", "spread"):
                moved = [(r, d) for r, d in routed if d.get("reason") == reason and d.get("passed_over") in slots]
                if not moved:
                    continue
                free = [(r, d) for r, d in moved
                        if inflight_at(results, r.sent_ms, d["passed_over"], r) < slots[d["passed_over"]]]
                out["by_reason"][reason]["passed_over_had_free_slot"] = len(free)
                out["by_reason"][reason]["passed_over_free_slot_and_no_predicted_wait"] = sum(
                    float(d.get("passed_over_wait_ms", 0) or 0) == 0 for _, d in free)
                out["by_reason"][reason]["passed_over_wait_ms_mean"] = rnd(
                    sum(float(d.get("passed_over_wait_ms", 0) or 0) for _, d in moved) / len(moved))
                out["by_reason"][reason]["move_ms_mean"] = rnd(
                    sum(float(d.get("move_ms", 0) or 0) for _, d in moved) / len(moved))
    return out


def engine_stats(engines: dict) -> dict:
    out = {}
    for name, e in engines.items():
        try:
            s = e.stats()
        except OSError as err:
            out[name] = {"error": str(err)}
            continue
        out[name] = {"chat_requests": s["requests"].get(PATH, 0), "completed": s["completed"],
                     "cache_hit_tokens": s["cache_hit_tokens"], "cache_query_tokens": s["cache_query_tokens"],
                     "health_probes": s["requests"].get("/health", 0), "metrics_scrapes": s["requests"].get("/metrics", 0),
                     # vllm-router asks every worker to render every request.
                     "render_requests": s["requests"].get("/v1/chat/completions/render", 0)}
    return out


def fmt(x, unit: str = "") -> str:
    return "–" if x is None else f"{x:.0f}{unit}"


def table(summaries: dict[str, dict], skipped: dict[str, str]) -> str:
    head = ("| router | ok / sent | TTFT mean | TTFT p50 | TTFT p95 | TTFT p99 | e2e p50 | e2e p95 "
            "| near / mid / far | cache hit | engine queue mean / p95 | session moves | errors |")
    rows = [head, "|" + "---|" * 13]
    for name, s in summaries.items():
        t, e = s["ttft_ms"], s["e2e_ms"]
        reg = s["requests_per_region"]
        errs = ", ".join(f"{k} {v}" for k, v in sorted(s["errors"].items())) or "0"
        hit = "–" if s["cache_hit_token_ratio"] is None else f"{100 * s['cache_hit_token_ratio']:.1f} %"
        rows.append(f"| {name} | {s['ok']} / {s['requests']} | {fmt(t['mean'])} | {fmt(t['p50'])} | {fmt(t['p95'])} "
                    f"| {fmt(t['p99'])} | {fmt(e['p50'])} | {fmt(e['p95'])} "
                    f"| {' / '.join(str(reg.get(r, 0)) for r in REGIONS)} | {hit} "
                    f"| {fmt(s['engine_queue_ms']['mean'])} / {fmt(s['engine_queue_ms']['p95'])} "
                    f"| {s['session_moves']} / {s['follow_up_turns']} | {errs} |")
    for name, why in skipped.items():
        rows.append(f"| {name} | not run: {why} |" + " |" * 11)
    return "\n".join(rows)


def reading(summaries: dict[str, dict], skipped: dict[str, str]) -> list[str]:
    """Plain statements read off the numbers, no adjectives the numbers do
    not carry."""
    out = []
    ran = {k: s for k, s in summaries.items() if s["ttft_ms"]["p50"] is not None}
    if not ran:
        return ["No router completed a request."]
    complete = {k: s for k, s in ran.items() if s["ok"] == s["requests"]}
    partial = [k for k in ran if k not in complete]
    if complete:
        scope = "" if not partial else " among the routers that served every request"
        for q in ("mean", "p50", "p95", "p99"):
            best = min(complete, key=lambda k: complete[k]["ttft_ms"][q])
            out.append(f"Lowest TTFT {q}{scope}: `{best}` ({complete[best]['ttft_ms'][q]:.0f} ms).")
    for k in partial:
        s = ran[k]
        out.append(f"`{k}` served {s['ok']} of {s['requests']} requests ({json.dumps(s['errors'])}); its TTFT "
                   f"and cache figures are over the requests it served, so they do not compare with the others'.")
    p = ran.get("plugin")
    if p:
        for k, s in ran.items():
            if k == "plugin":
                continue
            out.append(
                f"Plugin vs `{k}`: TTFT mean {p['ttft_ms']['mean']:.0f} vs {s['ttft_ms']['mean']:.0f} ms "
                f"({p['ttft_ms']['mean'] / s['ttft_ms']['mean']:.2f}x), p95 {p['ttft_ms']['p95']:.0f} vs "
                f"{s['ttft_ms']['p95']:.0f} ms ({p['ttft_ms']['p95'] / s['ttft_ms']['p95']:.2f}x), "
                f"cache hit {100 * (p['cache_hit_token_ratio'] or 0):.1f} vs "
                f"{100 * (s['cache_hit_token_ratio'] or 0):.1f} %, session moves {p['session_moves']} vs "
                f"{s['session_moves']}.")
        reg = p["requests_per_region"]
        n = sum(reg.values()) or 1
        out.append("Plugin's regions: " + ", ".join(f"{r} {100 * reg.get(r, 0) / n:.0f} %" for r in REGIONS)
                   + (f"; decisions (region:reason) {json.dumps(p.get('decisions', {}))}" if p.get("decisions") else "")
                   + ".")
        if p.get("predicted_ttft_ms_mean") is not None:
            out.append(f"The plugin's own TTFT prediction (`ttft_ms` of its decision header) averaged "
                       f"{p['predicted_ttft_ms_mean']:.0f} ms against {p['measured_ttft_ms_mean_same_requests']:.0f} ms "
                       f"measured at the client for the same requests.")
        br = p.get("by_reason", {})
        if br:
            out.append("Plugin by decision reason: " + "; ".join(
                f"`{r}` {v['n']} requests, TTFT p50 {fmt(v['ttft_p50_ms'])} ms, cache hit "
                f"{100 * v['cache_hit_token_ratio']:.0f} %, predicted queue > 0 in {v['predicted_queue_ms_gt0']}, "
                f"engine queue >= {QUEUED_MS} ms {v['engine_queued']}" for r, v in br.items()) + ".")
        for reason in ("load", "load-override", "spread"):
            lo = br.get(reason)
            if not lo or "passed_over_had_free_slot" not in lo:
                continue
            out.append(
                f"`{reason}`: {lo['n']} of {p['requests']} plugin decisions passed a region over for its load "
                f"(its predicted wait for a slot {fmt(lo['passed_over_wait_ms_mean'])} ms on average against "
                f"{fmt(lo['move_ms_mean'])} ms to move); the region passed over had a free slot by the client's "
                f"accounting in {lo['passed_over_had_free_slot']} of them, and a free slot with no predicted "
                f"wait in {lo['passed_over_free_slot_and_no_predicted_wait']}.")
    for k, s in summaries.items():
        lag = s["dispatch_lag_ms"]
        busy = max((r.get("machine_cpu_busy", 0) for r in s.get("runs", [])), default=0)
        others = max((r.get("others_cpu_busy", 0) for r in s.get("runs", [])), default=0)
        if (lag["p50"] or 0) > 5 or (lag["max"] or 0) > 200 or others > 0.15:
            out.append(f"Warning: during `{k}` the machine was {100 * busy:.0f} % busy ({100 * others:.0f} % by "
                       f"processes outside this benchmark, such as builds or other benchmarks; client dispatch lag p50 {lag['p50']:.1f} ms, max "
                       f"{lag['max']:.0f} ms): its figures include CPU contention, not only routing.")
    for k, s in summaries.items():
        if s["errors"] and k not in partial:
            out.append(f"`{k}` had errors: {json.dumps(s['errors'])}.")
    for k, why in skipped.items():
        out.append(f"`{k}` did not run: {why}.")
    return out


# ------------------------------------------------------------------- docs

def update_doc(path: Path, body: str) -> None:
    """Replaces (or appends) only the `## Live benchmark` section: from its
    heading to the next `## ` heading or the end."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    section = f"{SECTION}\n\n{body.strip()}\n"
    lines = text.splitlines(keepends=True)
    start = next((i for i, l in enumerate(lines) if l.rstrip() == SECTION), None)
    if start is None:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        end = next((j for j in range(start + 1, len(lines)) if lines[j].startswith("## ")), len(lines))
        rest = "".join(lines[end:])
        text = "".join(lines[:start]) + section + ("\n" + rest if rest else "")
    path.write_text(text)


def same_for_all(d: dict) -> bool:
    vals = [json.dumps(v, sort_keys=True) for v in d.values()]
    return len(set(vals)) == 1


def reflow(text: str, width: int = 78) -> str:
    """Refills prose paragraphs and list items; leaves tables and indented
    (code) blocks as they are."""
    out = []
    for block in text.strip("\n").split("\n\n"):
        if block.startswith(("|", "    ")):
            out.append(block)
        elif block.startswith("- "):
            items = ("\n" + block).split("\n- ")[1:]
            out.append("\n".join(textwrap.fill(" ".join(i.split()), width, initial_indent="- ",
                                                subsequent_indent="  ", break_long_words=False,
                                                break_on_hyphens=False) for i in items))
        else:
            out.append(textwrap.fill(" ".join(block.split()), width, break_long_words=False,
                                     break_on_hyphens=False))
    return "\n\n".join(out) + "\n"


def engines_text(result: dict) -> str:
    a = result["config"]
    flags = a["engine_flags"]
    figs = a["engines_unscaled"]
    if same_for_all(flags):
        f0 = next(iter(figs.values()))
        return (f"each `{' '.join(next(iter(flags.values())))}` (unscaled {f0['prefill_ms_per_token']:g} ms "
                f"prefill and {f0['decode_ms_per_token']:g} ms decode per token)")
    return "; ".join(f"{n} `{' '.join(f)}`" for n, f in flags.items())


def plugin_text(result: dict) -> str:
    regions = {r["name"]: {k: r[k] for k in ("max_concurrency", "capacity_rps") if k in r}
               for r in result["plugin_overrides"]["regions"]}
    if same_for_all(regions):
        plug = "every region " + ", ".join(f"`{k}` {v}" for k, v in next(iter(regions.values())).items())
    else:
        plug = "; ".join(f"{n} " + ", ".join(f"`{k}` {v}" for k, v in r.items()) for n, r in regions.items())
    extra = {k: v for k, v in result["plugin_overrides"].items() if k != "regions"}
    if extra:
        plug += f"; and `{json.dumps(extra)}`"
    return plug


def peer_text(key: str, name: str, versions: dict) -> str:
    """One sentence on a peer: what it is, its version, how it runs."""
    peer = PEERS[key]
    v = versions.get(peer.dist) or "not installed"
    return f"`{name}` is {peer.what}: {peer.label} {v}, run as {peer.deployment}."


def routers_text(result: dict) -> str:
    """What each router under test is and how it is deployed."""
    versions = result.get("peer_versions", {})
    return f"""\
Routers: `plugin` (Envoy 1.40 with `envoy/envoy.yaml`, the region figures
set to what an operator knows of the emulated engines; {result.get("plugin_source", "")}); Envoy without the
plugin over one cluster of the three regions with `round_robin`,
`least_request`, and `ring_hash` on `x-session-id`; `mesh`, the service-mesh
default (Istio's locality failover as Envoy runs it,
`envoy/bench/live-mesh.yaml`): near at priority 0, mid at 1, far at 2 by
their round trips, `LEAST_REQUEST` within a priority, Istio's default retry
policy, active HTTP health checks on `/health` at Kubernetes readiness-probe
defaults and outlier detection at Envoy's defaults, so every request goes to
the nearest healthy region; and two cache-aware routers, each with the three
emulators as `--worker-urls`. {peer_text("smg", "smg", versions)}
{peer_text("vllm_router", "vllm_router", versions)}"""


def caveats(a: dict, many_seeds: bool) -> str:
    return f"""\
What this does not show. It is a single vantage point: the replayer runs on
loopback, so every request sees the same client-to-region delays (5/40/120
ms) whatever its `client_region`; a real client population spread over
regions would see other distances, and the nearest region would differ per
client. The engines are emulators (a prefix cache, FIFO admission to a fixed
number of slots, prefill and decode as timed sleeps), not GPUs. Compute is
time-scaled and the network delays are not, so distance weighs
{1 / a["time_scale"]:g}x more against compute than in the unscaled trace. The
client, Envoy, the peers and the emulators share one {os.cpu_count()}-core
machine. One run per router{"" if a["rounds"] == 1 else f" and round ({a['rounds']} rounds)"}{" and seed" if many_seeds else ""}; while
developing this benchmark, repeated runs moved a router's TTFT mean by tens
of ms, and by hundreds when other processes kept the machine busy (the
warnings say when that happened): read the ordering and large gaps, not
small differences."""


COLUMNS = """\
Columns: `ok / sent`: requests that streamed to `[DONE]`; TTFT: from
sending the request to the first SSE `data:` line, in ms, over the requests
served; `near / mid / far`: requests per region (`x-engine-replica`);
`cache hit`: sum of the engines' `x-engine-cached-tokens` over sum of
`x-engine-prompt-tokens`; `engine queue`: the engines' own wait for a slot
(`x-engine-queue-ms`); `session moves`: follow-up turns served by another
region than the session's previous turn, of all follow-up turns."""


def trace_text(result: dict) -> str:
    a = result["config"]
    t = result["trace"]
    return f"""\
Trace: {t["source"]}: {t["requests"]} requests in {t["sessions"]} sessions
over {t["span_s"]} s of trace time ({t["rate_rps"]} requests/s), replayed in
{round(t["span_s"] * a["time_scale"], 1)} s per router (`--time-scale {a["time_scale"]}`); prompts of
{t["prompt_tokens_mean"]} tokens on average (at most {t["prompt_tokens_max"]}), {t["output_tokens_mean"]} output
tokens on average; tiers {json.dumps(t["tiers"])}. Engines, {a["engines_source"]}:
{engines_text(result)}."""


def ratio_text(rat: dict) -> str:
    if not rat:
        return "No ratio: the plugin or every other router did not serve every request."
    parts = [f"{q} {r['plugin_ms']:.0f} vs {r['best_peer_ms']:.0f} ms (`{r['best_peer']}`): **{r['ratio']:.2f}**"
             + ("" if r["plugin_served_all"] else " (the plugin did not serve every request)")
             for q, r in rat.items()]
    return "Plugin TTFT / the best other router's: " + "; ".join(parts) + "."


def doc_section(result: dict, tbl: str, lines: list[str]) -> str:
    a = result["config"]
    routers_ran = ", ".join(f"`{k}`" for k in result["routers"])
    return reflow(f"""\
Each router in front of the same three emulated regions (near 5 ms, mid 40 ms,
far 120 ms away, the demo's: `emulator`), replaying one trace
open loop in real time, time-scaled, with time to first token (TTFT) and
end-to-end time measured at the client. Every router gets a fresh set of
emulators (cold prefix caches) and the same requests at the same (scaled)
times. {routers_text(result)} Ran: {routers_ran}.

Command (`scripts/bench-live` runs it after `scripts/setup` and the release
builds, then rewrites this section):

    {result["command"]}

{trace_text(result)} Plugin: {plugin_text(result)}
(`capacity_rps` = slots x 1000 / (the documented default `service_ms` of
2000 x the time scale {a["time_scale"]:g}), the engines' compute being that
much faster); everything else as in `envoy/envoy.yaml`. Rounds: {a["rounds"]}.
Machine: {result["machine"]}; run {result["finished"]}.

{tbl}

{ratio_text(result.get("ratios", {}))}

{COLUMNS}

Reading (generated from the numbers above):

{chr(10).join("- " + line for line in lines)}

{caveats(a, False)}
""")


def plugin_row(seed_result: dict) -> dict:
    """The plugin's summary in one seed's result ({} if it did not run)."""
    return seed_result.get("routers", {}).get("plugin", {})


def served_all(seed_result: dict) -> bool:
    """Whether the plugin served every request of that seed (shed none)."""
    p = plugin_row(seed_result)
    return p.get("ok") == p.get("requests")


def seeds_doc_section(combined: dict) -> str:
    """The section for a run over several seeds: each seed's ratio, their
    geometric mean and spread, then each seed's table."""
    per_seed = combined["per_seed"]
    first = per_seed[0]
    a = first["config"]
    summ = combined["summary"]
    rows = ["| seed | requests | plugin served | plugin TTFT p95 | best other p95 | ratio p95 | plugin TTFT mean "
            "| best other mean | ratio mean |", "|" + "---|" * 9]
    for r in per_seed:
        rat = r.get("ratios", {})
        cells = []
        for q in ("p95", "mean"):
            x = rat.get(q)
            cells += ([f"{x['plugin_ms']:.0f}", f"{x['best_peer_ms']:.0f} (`{x['best_peer']}`)", f"{x['ratio']:.2f}"]
                      if x else ["–", "–", "–"])
        p = plugin_row(r)
        served = f"{p.get('ok', '–')}" + ("" if served_all(r) else " **(shed: not like-for-like)**")
        rows.append(f"| {r['seed']} | {r['trace']['requests']} | {served} | " + " | ".join(cells) + " |")
    over = []
    for q in ("p95", "mean"):
        sp = summ.get(q)
        if sp:
            over.append(f"TTFT {q}: geometric mean **{sp['geomean']:.2f}** (min {sp['min']:.2f}, max {sp['max']:.2f}, "
                        f"{sp['n']} seeds)")
    shed = [r["seed"] for r in per_seed if not served_all(r)]
    if shed:
        over.append(f"not like-for-like: the plugin shed requests on seed(s) {', '.join(map(str, shed))}, so its "
                    "figures there are over an easier set")
    seeds_md = []
    for r in per_seed:
        warn = notable(r["reading"])
        seeds_md.append(f"### Seed {r['seed']}\n\n{trace_text(r)} Run {r['finished']}.\n\n{r['table']}\n\n"
                        f"{ratio_text(r.get('ratios', {}))}"
                        + ("\n\n" + "\n".join("- " + l for l in warn) if warn else ""))
    routers_ran = ", ".join(f"`{k}`" for k in first["routers"])
    return reflow(f"""\
Each router in front of the same three emulated regions (near 5 ms, mid 40 ms,
far 120 ms away, the demo's: `emulator`), replaying one trace
open loop in real time, time-scaled, with time to first token (TTFT) and
end-to-end time measured at the client; once per seed, every router on fresh
emulators (cold prefix caches) with the same requests at the same (scaled)
times. {routers_text(first)} Ran: {routers_ran}.

Command (`scripts/bench-live` with `BENCH_LIVE_SEEDS` runs it after
`scripts/setup` and the release builds, then rewrites this section):

    {combined["command"]}

Seeds {", ".join(str(r["seed"]) for r in per_seed)} of scenario `{combined["scenario"]}` (held out: the plugin's
defaults were chosen on seeds 1-2), each trace's own fleet file for the
engines' figures. Plugin: {plugin_text(first)} (`capacity_rps` = slots x 1000
/ (the documented default `service_ms` of 2000 x the time scale {a["time_scale"]:g}),
the engines' compute being that much faster); everything else as in
`envoy/envoy.yaml`. Machine: {combined["machine"]}; finished {combined["finished"]}.

Plugin TTFT / the best other router's on that seed (among the routers that
served every request; lower is better):

{chr(10).join(rows)}

Over the seeds, plugin / best other router: {"; ".join(over) if over else "no seed had a ratio"}.

{COLUMNS}

{(chr(10) * 2).join(seeds_md)}

{caveats(a, True)}
""")


def ratios(summaries: dict[str, dict]) -> dict:
    """The plugin's TTFT p95 and mean over the best other router's, among
    the routers that served every request (each a realistic deployment)."""
    p = summaries.get("plugin")
    if not p or p["ttft_ms"]["p95"] is None:
        return {}
    peers = {k: s for k, s in summaries.items()
             if k != "plugin" and s["ok"] == s["requests"] and s["ttft_ms"]["p95"] is not None}
    out = {}
    for q in ("p95", "mean"):
        if not peers:
            break
        best = min(peers, key=lambda k: peers[k]["ttft_ms"][q])
        out[q] = {"plugin_ms": p["ttft_ms"][q], "best_peer": best, "best_peer_ms": peers[best]["ttft_ms"][q],
                  "ratio": round(p["ttft_ms"][q] / peers[best]["ttft_ms"][q], 3),
                  "plugin_served_all": p["ok"] == p["requests"]}
    return out


def spread(per_seed: dict[int, float]) -> dict | None:
    """Ratios per seed, their geometric mean and their range."""
    if not per_seed:
        return None
    vals = list(per_seed.values())
    return {"per_seed": per_seed, "n": len(vals), "geomean": round(math.exp(sum(map(math.log, vals)) / len(vals)), 3),
            "min": min(vals), "max": max(vals)}


def plugin_source() -> str:
    """Which plugin was measured: the .wasm's digest and the commit it was
    built from, and whether src/ had uncommitted changes."""
    import hashlib
    try:
        digest = hashlib.sha256(harness.WASM.read_bytes()).hexdigest()[:12]
    except OSError:
        digest = "missing"
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=ROOT, timeout=30).stdout.strip() or "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "src"], capture_output=True, text=True,
                               cwd=ROOT, timeout=30).stdout.strip()
    except OSError:
        head, dirty = "unknown", ""
    return f"`llm_geo_router.wasm` sha256 {digest}…, built at commit {head}" + (
        " with uncommitted changes in `src/`" if dirty else "")


# -------------------------------------------------------------------- main

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, help="trace.jsonl (default: the built-in trace)")
    ap.add_argument("--trace-label", help="how the docs name the trace (default: its path)")
    ap.add_argument("--window-s", type=float, default=None,
                    help="replay only the first this many seconds of trace time")
    ap.add_argument("--max-requests", type=int, default=None, help="replay at most this many requests")
    ap.add_argument("--seed", type=int, default=1, help="seed of the built-in trace")
    ap.add_argument("--duration-s", type=float, default=100.0, help="built-in trace: seconds of trace time")
    ap.add_argument("--sessions-per-s", type=float, default=2.0, help="built-in trace: session arrival rate")
    ap.add_argument("--time-scale", type=float, default=0.25,
                    help="trace time and engine compute are multiplied by this (0.25: 4x faster)")
    ap.add_argument("--fleet", type=Path,
                    help="fleet.json of the generator: the engines' slots, prefill and decode rates and cache "
                         "size per region (in order: near, mid, far); the network delays stay 5/40/120 ms")
    ap.add_argument("--max-concurrency", type=int, default=None,
                    help=f"each engine's running slots (default: --fleet, else {ENGINE_DEFAULTS['max_concurrency']})")
    ap.add_argument("--prefill-ms-per-token", type=float, default=None,
                    help="unscaled engine prefill rate; the emulator gets this x time-scale "
                         f"(default: --fleet, else {ENGINE_DEFAULTS['prefill_ms_per_token']})")
    ap.add_argument("--decode-ms-per-token", type=float, default=None,
                    help="unscaled engine decode rate; the emulator gets this x time-scale "
                         f"(default: --fleet, else {ENGINE_DEFAULTS['decode_ms_per_token']})")
    ap.add_argument("--cache-tokens", type=int, default=None,
                    help=f"each engine's prefix cache, tokens (default: --fleet, else {ENGINE_DEFAULTS['cache_tokens']})")
    ap.add_argument("--plugin-config", type=json.loads, default={},
                    help="JSON merged into the plugin's configuration after the region figures "
                         "(e.g. '{\"cost\": {\"placement_floor\": 1.0}}')")
    ap.add_argument("--routers", default=",".join(ROUTERS), help=f"comma-separated subset of {','.join(ROUTERS)}")
    ap.add_argument("--rounds", type=int, default=1, help="times every router replays the trace (alternated)")
    ap.add_argument("--max-inflight", type=int, default=256, help="client threads in flight at most")
    ap.add_argument("--timeout-s", type=float, default=120.0, help="per-request timeout")
    ap.add_argument("--wait-idle-s", type=float, default=0.0,
                    help="before each router's run, wait up to this long for the machine to be < 30 %% busy")
    ap.add_argument("--json-out", type=Path, help="write the results as JSON here")
    ap.add_argument("--doc", type=Path, help="rewrite the '## Live benchmark' section of this Markdown file")
    ap.add_argument("--command-label", help="the command the docs show (default: this command line)")
    ap.add_argument("--scenario",
                    help="with --seeds: generate each seed's trace and fleet (`llm-geo-router generate --scenario "
                         "S --seed N`) instead of --trace/--fleet")
    ap.add_argument("--seeds", type=int, nargs="+",
                    help="with --scenario: run every router on each of these seeds' traces and report the spread "
                         "(held-out seeds: 3 and up)")
    args = ap.parse_args()

    # Threads waiting for the GIL get it within 1 ms (default 5 ms), so a
    # thread that has just received its first byte is not kept waiting long.
    sys.setswitchinterval(0.001)
    assert fnv1a64(b"a") == 0xAF63DC4C8601EC8C
    assert expand_segment(*_EXPANSION_VECTOR[:2]) == _EXPANSION_VECTOR[2]
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    bad = [r for r in routers if r not in ROUTERS]
    if bad or args.time_scale <= 0:
        ap.error(f"unknown router(s) {bad}" if bad else "--time-scale must be > 0")
    if bool(args.scenario) != bool(args.seeds):
        ap.error("--scenario and --seeds go together")
    if args.scenario and (args.trace or args.fleet):
        ap.error("--scenario/--seeds generate the trace and fleet: leave out --trace and --fleet")

    runs_root = harness.fresh_run_dir("bench-live")
    versions = peer_versions()
    command = args.command_label or shlex.join([".venv/bin/python", "wasm-tests/bench_live.py", *sys.argv[1:]])
    results = []
    if args.scenario:
        if not generator_available():
            print(f"bench-live: {CLI} has no `generate` subcommand (build it: cargo build --release -p "
                  "llm-geo-router-cli)", file=sys.stderr)
            return 2
        for seed in args.seeds:
            out = runs_root / f"seed-{seed}"
            gen = out / "scenario"
            generate_trace(args.scenario, seed, gen)
            label = f"`llm-geo-router generate --scenario {args.scenario} --seed {seed}`" + (
                f", its first {args.window_s:g} s" if args.window_s is not None else "")
            seed_args = argparse.Namespace(**{**vars(args), "trace": gen / "trace.jsonl",
                                              "fleet": gen / "fleet.json"})
            print(f"bench-live: seed {seed} ({args.seeds.index(seed) + 1} of {len(args.seeds)})", file=sys.stderr)
            result = run_once(seed_args, list(routers), versions, out, load_trace(gen / "trace.jsonl"), label)
            result["seed"] = seed
            results.append(result)
    else:
        if args.trace:
            trace = load_trace(args.trace)
            source = args.trace_label or f"`{args.trace}`"
        else:
            trace = builtin_trace(args.seed, args.duration_s, args.sessions_per_s)
            source = (f"the built-in trace of `wasm-tests/bench_live.py` (`--seed {args.seed} --duration-s "
                      f"{args.duration_s:g} --sessions-per-s {args.sessions_per_s:g}`)")
        results.append(run_once(args, list(routers), versions, runs_root, trace, source))

    finished = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    machine = f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"
    for r in results:
        r["command"] = command
    if len(results) == 1:
        out_json = results[0]
        body = doc_section(results[0], results[0]["table"], results[0]["reading"])
    else:
        summary = {q: spread({r["seed"]: r["ratios"][q]["ratio"] for r in results if q in r.get("ratios", {})})
                   for q in ("p95", "mean")}
        out_json = {"command": command, "finished": finished, "machine": machine, "scenario": args.scenario,
                    "seeds": args.seeds, "peer_versions": versions, "summary": summary, "per_seed": results}
        body = seeds_doc_section(out_json)
        for q, sp in summary.items():
            if sp:
                print(f"bench-live: plugin / best other router, TTFT {q}, per seed "
                      f"{json.dumps(sp['per_seed'])}: geomean {sp['geomean']:.3f} (min {sp['min']:.3f}, "
                      f"max {sp['max']:.3f})")
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(out_json, indent=2) + "\n")
        print(f"bench-live: wrote {args.json_out}", file=sys.stderr)
    if args.doc:
        update_doc(args.doc, body)
        print(f"bench-live: updated the '{SECTION}' section of {args.doc}", file=sys.stderr)
    return 0


def run_once(args, routers: list[str], versions: dict, runs_root: Path, trace: list[dict], source: str) -> dict:
    """Every router in `routers` on one trace (each on fresh engines, for
    `--rounds` rounds); the result as written to JSON, with its table and
    reading."""
    if args.window_s is not None and trace:
        t_end = trace[0]["t_ms"] + args.window_s * 1000
        trace = [r for r in trace if r["t_ms"] < t_end]
    if args.max_requests is not None:
        trace = trace[: args.max_requests]
    if not trace:
        raise SystemExit("bench-live: the trace is empty")
    (runs_root / "trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in trace))
    info = trace_info(trace)
    print(f"bench-live: trace: {source}: {json.dumps(info)}", file=sys.stderr)
    t_prep = time.monotonic()
    preps = prepare(trace)
    print(f"bench-live: {len(preps)} bodies prepared in {time.monotonic() - t_prep:.1f} s", file=sys.stderr)

    figs, figs_source = engine_figures(args)
    overrides = harness.deep_merge(plugin_overrides(figs, args.time_scale, info), args.plugin_config)
    skipped: dict[str, str] = {}
    for key in PEERS:
        why = peer_not_installed(key, versions) if key in routers else None
        if why:
            skipped[key] = why
            routers.remove(key)

    per_router: dict[str, list[Result]] = {r: [] for r in routers}
    engines_by_router: dict[str, list] = {r: [] for r in routers}
    extras: dict[str, list] = {r: [] for r in routers}
    for rnd_i in range(args.rounds):
        order = routers[rnd_i % len(routers):] + routers[: rnd_i % len(routers)]
        for name in order:
            if name in skipped:
                continue
            run_dir = runs_root / f"{rnd_i}-{name}"
            run_dir.mkdir()
            engines = start_engines(run_dir, figs, args.time_scale, PEERS[name].engine_mode if name in PEERS else None)
            router = None
            try:
                try:
                    if name == "plugin":
                        router = PluginRun(run_dir, engines, overrides)
                    elif name in PEERS:
                        router = PeerRun(name, run_dir, engines)
                    else:
                        router = EnvoyLbRun(name, run_dir, engines)
                except Exception as e:  # noqa: BLE001
                    if name not in PEERS:
                        raise
                    skipped[name] = f"{PEERS[name].dist} did not start: {e}"
                    print(f"bench-live: {skipped[name]}", file=sys.stderr)
                    continue
                print(f"bench-live: round {rnd_i + 1}/{args.rounds}: {name} on :{router.port} ...", file=sys.stderr)
                idle_before = wait_idle(args.wait_idle_s) if args.wait_idle_s > 0 else None
                pids = [os.getpid(), *router.pids(), *(e.proc.pid for e in engines.values())]
                t0 = time.monotonic()
                busy0, total0, irq0 = cpu_times()
                own0 = proc_cpu_s(pids)
                res, client = replay(router.port, preps, args.time_scale, args.max_inflight, args.timeout_s)
                busy1, total1, irq1 = cpu_times()
                own1 = proc_cpu_s(pids)
                took = time.monotonic() - t0
                per_router[name].extend(res)
                engines_by_router[name].append(engine_stats(engines))
                extra = router.finish()
                extra["replay_s"] = round(took, 1)
                extra["client"] = client
                extra["engine_modes"] = {n: e.args[e.args.index("--mode") + 1] for n, e in engines.items()}
                tick = os.sysconf("SC_CLK_TCK")
                extra["machine_cpu_busy"] = round((busy1 - busy0) / max(1, total1 - total0), 3)
                # Busy share of the machine taken by processes other than
                # this benchmark's (other builds, benchmarks): contention.
                extra["others_cpu_busy"] = round(max(0.0, (busy1 - busy0 - (irq1 - irq0)) / tick - (own1 - own0))
                                                 / max(1e-9, (total1 - total0) / tick), 3)
                if idle_before is not None:
                    extra["machine_busy_before"] = round(idle_before, 3)
                extras[name].append(extra)
                (run_dir / "requests.jsonl").write_text(
                    "".join(json.dumps(r.__dict__) + "\n" for r in res))
                errs = sum(1 for r in res if r.error)
                print(f"bench-live: {name}: {len(res)} requests in {took:.1f} s, {errs} errors", file=sys.stderr)
            finally:
                if router is not None:
                    router.stop()
                for e in engines.values():
                    e.kill()
    # A peer that failed to start in a later round keeps the rounds it ran.
    for name in [n for n in skipped if n in per_router]:
        if per_router[name]:
            del skipped[name]
        else:
            del per_router[name]

    summaries = {}
    for name in ROUTERS:
        if name in per_router and per_router[name]:
            merged: dict[str, dict] = {}
            for es in engines_by_router[name]:
                for eng, st in es.items():
                    m = merged.setdefault(eng, {})
                    for k, v in st.items():
                        m[k] = m.get(k, 0) + v if isinstance(v, int) else v
            summaries[name] = summarize(per_router[name], merged,
                                        {n: f["max_concurrency"] for n, f in figs.items()})
            summaries[name]["runs"] = extras[name]
    tbl = table(summaries, skipped)
    lines = reading(summaries, skipped)
    rat = ratios(summaries)
    print(tbl)
    print("\n".join("- " + l for l in lines))
    print(ratio_text(rat))

    return {
        "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}",
        "config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                   "engines_unscaled": figs,
                   "engines_source": figs_source,
                   "engine_flags": {n: engine_args(f, args.time_scale) for n, f in figs.items()},
                   "engine_network_delay_ms": {n: d for n, (_, d, _) in harness.DEMO_REGIONS.items()},
                   "engine_modes": {n: m for n, (_, _, m) in harness.DEMO_REGIONS.items()},
                   "engine_modes_per_peer": {k: p.engine_mode for k, p in PEERS.items() if p.engine_mode}},
        "trace": {"source": source, **info},
        "plugin_overrides": overrides,
        "plugin_source": plugin_source(),
        "peer_versions": versions,
        "skipped": skipped,
        "routers": summaries,
        "ratios": rat,
        "table": tbl,
        "reading": lines,
        "runs_dir": str(runs_root),
    }


if __name__ == "__main__":
    sys.exit(main())
