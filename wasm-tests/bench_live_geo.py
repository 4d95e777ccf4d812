"""Live benchmark at several vantage points: one trace replayed open loop,
time-scaled, through each router under test, every request entering at the
router that serves ITS client region, in front of one emulated engine per
engine region, with a client-to-region and region-to-region WAN emulated the
same way for every router; time to first token (TTFT) at the client.

    scripts/bench-live-geo                          # setup, builds, runs this
    .venv/bin/python wasm-tests/bench_live_geo.py [--fleet F --trace T] [options]

The single-vantage benchmark (wasm-tests/bench_live.py) stays as it is; this
module reuses its trace handling, request preparation and replay.

Geography: a fleet file as `llm-geo-router generate` writes it.
`client_regions` are the vantage points; `regions[].rtt_ms` maps client
region -> round trip to that engine region; the optional
`regions[].region_rtt_ms` maps engine region -> round trip between engine
regions. Without it the region-to-region round trip is estimated as
max over client regions c of |rtt(c, a) - rtt(c, b)| (a lower bound by the
triangle inequality; the output says when it was estimated). Without
`--fleet/--trace`: `llm-geo-router generate --scenario SCENARIO --seed SEED`
(default scenario e).

WAN emulation (the same for every router):

- each engine region is ONE emulator process whose `--client-delay-ms`
  entries give, per client region c, the delay RTT(c, region) before a
  response's first byte, and per pseudo-client `dc-<g>` (a router that lives
  in engine region g) the region-to-region round trip RTT(g, region)
  (`--intra-region-rtt-ms` for g = region);
- the header that selects the delay (`x-client-region`) is added by
  infrastructure, never by the router under test: one "WAN" Envoy (plain
  Envoy, no plugin, config generated here: `wan_config`) has a listener per
  (vantage V, engine region R) that sets `x-client-region: V` (overwriting any
  value the request had) and proxies to R's emulator. Every router reaches
  engine R from vantage V through that listener;
- a router deployed in an engine region G serves clients of every region:
  client region c reaches it through a WAN listener whose fault filter
  (`envoy.filters.http.fault`, fixed delay, 100 % of requests) delays each
  request by RTT(c, G) before forwarding it; from there it reaches engine R
  through the (dc-G, R) listener. RTTs are never time-scaled.

Routers, each on fresh emulators and a fresh WAN Envoy (cold caches):

- `geo_router`: one Envoy 1.40 with the plugin per client region
  (envoy/envoy.yaml via harness.render_config; each its own probe, prefix
  directory and shared data, the client regions' Envoys one deployment
  sharing through the exchange as envoy/envoy.yaml ships it; `--exchange
  off`: each on its own), its clusters the WAN listeners of its vantage
  (each region's cluster: that region, then the others at priority 1, as in
  envoy/envoy.yaml), configured with only what an operator knows: region
  names, clusters, `max_concurrency` (slots) and `capacity_rps` = slots x
  1000 / 2000 (the documented default service time). No
  `prefill_ms_per_token`, `service_ms` or `rtt_ms`: the probe measures the
  round trips, online tuning (on by default) fits the rest;
- `ring_hash` (on `x-session-id`) and `least_request`: Envoy without the
  plugin (envoy/bench/live-*.yaml), one per client region, the WAN listeners
  of its vantage as the cluster's endpoints;
- `mesh`: the service-mesh default (envoy/bench/live-mesh.yaml: Istio's
  locality failover as Envoy runs it), one Envoy per client region, each
  engine region a locality at a priority by its round trip from that client
  region (nearest at 0, the next at 1, ...), LEAST_REQUEST within a priority,
  active HTTP health checks and outlier detection;
- `smg_per_region` and `vllm_router_per_region`: SGLang's model gateway
  (`smg launch --policy cache_aware`) and vLLM's router (`vllm-router
  --policy cache_aware`), one per client region, the WAN listeners of its
  vantage as `--worker-urls` (bench_live.PEERS: pinned versions, command
  lines);
- `smg_global` and `vllm_router_global`: one of each in engine region G
  (`--global-region`, default: the region with the lowest demand-weighted
  RTT over the replayed requests), workers = the (dc-G, R) listeners, client
  region c entering through the fault-delay listener of RTT(c, G).

A peer that is not installed or does not start is reported as not run, with
the reason.

Seeds: `--seeds 3 4 5` runs every router on each seed's scenario and
reports each seed's ratio geo-router p95 / best other router's p95 over all
clients, their geometric mean and their spread.

Replay: the trace's requests (a `--window-s` of it), open loop, time-scaled
(engines' prefill and decode scaled as in bench_live.py, RTTs not), each sent
to the entry of its own `client_region`. Output: per router and per vantage
TTFT mean/p50/p95/p99, requests per engine region, cache hit ratio; overall
per router; the ratio geo-router p95 / best other router's p95 (every other
router is a realistic deployment); JSON (`--json-out`), per-vantage TTFT CDF
plots (SVG, `--plots-dir`), and with `--doc` the section
`## Live benchmark, several vantage points` of docs/BENCHMARKS.md (only it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_live as bl  # noqa: E402
import harness  # noqa: E402

ROOT = harness.ROOT
SECTION = "## Live benchmark, several vantage points"
CLIENT_REGION_HEADER = "x-client-region"
ROUTERS = ["geo_router", "ring_hash", "least_request", "mesh", "smg_per_region", "smg_global",
           "vllm_router_per_region", "vllm_router_global"]
LABEL = {"geo_router": "geo-router", "ring_hash": "envoy ring_hash", "least_request": "envoy least_request",
         "mesh": "mesh locality failover",
         "smg_per_region": "smg per-client-region", "smg_global": "smg global",
         "vllm_router_per_region": "vllm-router per-client-region", "vllm_router_global": "vllm-router global"}
DEFAULT_SERVICE_MS = 2000.0  # docs/CONFIG.md, regions[].service_ms default


# ----------------------------------------------------------------- geography

class Geo:
    """Client regions, engine regions and the round trips between them."""

    def __init__(self, fleet: dict, intra_region_ms: float):
        self.fleet = fleet
        self.clients: list[str] = list(fleet["client_regions"])
        self.regions: list[str] = [r["name"] for r in fleet["regions"]]
        self.by_name = {r["name"]: r for r in fleet["regions"]}
        self.intra_region_ms = intra_region_ms
        for r in fleet["regions"]:
            missing = [c for c in self.clients if c not in r.get("rtt_ms", {})]
            if missing:
                raise ValueError(f"fleet: region {r['name']} has no rtt_ms for {missing}")
        # The fleet gives each pair once, on either side (symmetric); a pair
        # it does not give is estimated, and the output says so.
        given = {r["name"]: r.get("region_rtt_ms") or {} for r in fleet["regions"]}
        self.region_rtt_estimated = False
        self.rr: dict[tuple[str, str], float] = {}
        for a in self.regions:
            for b in self.regions:
                if a == b:
                    self.rr[a, b] = intra_region_ms
                elif b in given[a]:
                    self.rr[a, b] = float(given[a][b])
                elif a in given[b]:
                    self.rr[a, b] = float(given[b][a])
                else:
                    self.region_rtt_estimated = True
                    self.rr[a, b] = max(abs(self.rtt(c, a) - self.rtt(c, b)) for c in self.clients)

    def rtt(self, client: str, region: str) -> float:
        """Round trip from a client region (or `dc-<region>`) to an engine region."""
        if client.startswith("dc-"):
            return self.rr[client[3:], region]
        return float(self.by_name[region]["rtt_ms"][client])

    def nearest(self, client: str) -> str:
        return min(self.regions, key=lambda r: self.rtt(client, r))

    def client_delays(self, region: str) -> dict[str, float]:
        """An engine region's `--client-delay-ms` entries: every client region
        and every `dc-<region>` pseudo-client."""
        out = {c: self.rtt(c, region) for c in self.clients}
        out.update({f"dc-{g}": self.rr[g, region] for g in self.regions})
        return out

    def weighted_rtt(self, region: str, demand: dict[str, int]) -> float:
        n = sum(demand.get(c, 0) for c in self.clients) or 1
        return sum(demand.get(c, 0) * self.rtt(c, region) for c in self.clients) / n


def obtain_scenario(args, out_dir: Path) -> tuple[Path, Path, str]:
    """(fleet.json, trace.jsonl, how the docs name them)."""
    if args.fleet or args.trace:
        if not (args.fleet and args.trace):
            raise SystemExit("bench-live-geo: give both --fleet and --trace, or neither")
        return args.fleet, args.trace, args.trace_label or f"`{args.trace}` with `{args.fleet}`"
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [str(bl.CLI), "generate", "--scenario", args.scenario, "--seed", str(args.seed), "--out", str(out_dir)]
    why = f"{bl.CLI} is not built"
    if bl.CLI.exists():
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if p.returncode == 0 and (out_dir / "trace.jsonl").exists():
            return (out_dir / "fleet.json", out_dir / "trace.jsonl",
                    f"`llm-geo-router generate --scenario {args.scenario} --seed {args.seed}`")
        text = [l.strip() for l in (p.stderr + p.stdout).splitlines() if l.strip()]
        first = next((l for l in text if "error" in l.lower()), text[0] if text else "no output")
        why = f"`llm-geo-router {shlex.join(cmd[1:6])}` failed ({first})"
    raise SystemExit(f"bench-live-geo: {why}")


# ------------------------------------------------------------------ WAN Envoy

def _sanitize(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", s)


def _static_cluster(name: str, port: int) -> dict:
    return {"name": name, "connect_timeout": "1s", "type": "STATIC",
            "circuit_breakers": {"thresholds": [{"max_connections": 100000, "max_pending_requests": 100000,
                                                 "max_requests": 100000, "max_retries": 100}]},
            "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}]}]}}


def _proxy_listener(name: str, port: int, cluster: str, headers_to_add: dict | None = None,
                    delay_ms: float | None = None) -> dict:
    vhost: dict = {"name": name, "domains": ["*"],
                   "routes": [{"match": {"prefix": "/"}, "route": {"cluster": cluster, "timeout": "300s"}}]}
    if headers_to_add:
        vhost["request_headers_to_add"] = [
            {"header": {"key": k, "value": v}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
            for k, v in headers_to_add.items()]
    filters = []
    if delay_ms is not None:
        filters.append({"name": "envoy.filters.http.fault", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault",
            "delay": {"fixed_delay": f"{delay_ms / 1000:.6f}s",
                      "percentage": {"numerator": 100, "denominator": "HUNDRED"}}}})
    filters.append({"name": "envoy.filters.http.router", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}})
    return {"name": name, "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
            "per_connection_buffer_limit_bytes": 4194304,
            "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
                         "HttpConnectionManager",
                "stat_prefix": name, "codec_type": "AUTO",
                "route_config": {"name": name, "virtual_hosts": [vhost]},
                "http_filters": filters}}]}]}


def wan_config(admin_port: int, engine_ports: dict[str, int], vantages: list[str],
               hops: list[dict] | None = None) -> tuple[dict, dict[tuple[str, str], int], dict[tuple[str, str], int]]:
    """The WAN Envoy's bootstrap: for each (vantage V, engine region R) a
    listener that sets `x-client-region: V` (overwriting) and proxies to R's
    emulator; for each hop `{"router": name, "client": c, "delay_ms": d,
    "port": p}` a listener that delays every request by d ms (fault filter)
    and proxies to 127.0.0.1:p (a router living in a region). Returns the
    config, the (V, R) -> port map and the (router, c) -> port map."""
    listeners, clusters = [], []
    for r, port in engine_ports.items():
        clusters.append(_static_cluster(f"engine_{_sanitize(r)}", port))
    lanes: dict[tuple[str, str], int] = {}
    for v in vantages:
        for r in engine_ports:
            p = harness.free_port()
            lanes[v, r] = p
            listeners.append(_proxy_listener(f"wan_{_sanitize(v)}_{_sanitize(r)}", p, f"engine_{_sanitize(r)}",
                                             headers_to_add={CLIENT_REGION_HEADER: v}))
    hop_ports: dict[tuple[str, str], int] = {}
    seen = set()
    for h in hops or []:
        cl = f"router_{_sanitize(h['router'])}"
        if cl not in seen:
            seen.add(cl)
            clusters.append(_static_cluster(cl, h["port"]))
        p = harness.free_port()
        hop_ports[h["router"], h["client"]] = p
        listeners.append(_proxy_listener(f"hop_{_sanitize(h['router'])}_{_sanitize(h['client'])}", p, cl,
                                         delay_ms=h["delay_ms"]))
    cfg = {"admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
           "static_resources": {"listeners": listeners, "clusters": clusters}}
    return cfg, lanes, hop_ports


# ------------------------------------------------------------------- engines

def start_region_engines(run_dir: Path, geo: Geo, time_scale: float) -> dict[str, harness.Engine]:
    """One emulator per engine region, its delays per client region and per
    dc-<region> pseudo-client; without the header (never, through the WAN
    Envoy) no delay."""
    engines: dict[str, harness.Engine] = {}
    try:
        for r in geo.regions:
            engines[r] = harness.start_engine(r, run_dir, 0, "vllm", start_flags(geo, r, time_scale))
    except Exception:
        for e in engines.values():
            e.kill()
        raise
    return engines


def start_wan(run_dir: Path, engines: dict, vantages: list[str], hops: list[dict]):
    cfg, lanes, hop_ports = wan_config(harness.free_port(), {r: e.port for r, e in engines.items()}, vantages, hops)
    envoy = harness.start_envoy(run_dir, cfg, name="envoy-wan", concurrency=2)
    return envoy, lanes, hop_ports


# ------------------------------------------------------------------- routers

class Deployment:
    """A router under test: its processes and the entry port per client region."""

    name = ""
    entry: dict[str, int]

    def __init__(self):
        self.entry = {}
        self.envoys: list[harness.Envoy] = []
        self.procs: list[subprocess.Popen] = []

    def pids(self) -> list[int]:
        return [e.proc.pid for e in self.envoys] + [p.pid for p in self.procs]

    def finish(self) -> dict:
        return {}

    def stop(self) -> None:
        for e in self.envoys:
            e.stop()
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=10)


def geo_plugin_regions(geo: Geo) -> list[dict]:
    """What an operator knows: names, clusters, slots, and capacity from the
    documented default service time. Nothing measured."""
    return [{"name": r, "cluster": f"region_{r}", "max_concurrency": int(geo.by_name[r]["max_concurrency"]),
             "capacity_rps": round(int(geo.by_name[r]["max_concurrency"]) * 1000 / DEFAULT_SERVICE_MS, 3)}
            for r in geo.regions]


def geo_router_config(geo: Geo, vantage: str, lanes: dict, admin_port: int, port: int, extra: dict,
                      peers: tuple[int, list[int]] | None = None) -> dict:
    """envoy/envoy.yaml with the plugin's regions replaced and its clusters
    replaced by the WAN listeners of this vantage: each region's cluster is
    its own lane, then (priority 1, for retries) the other regions' lanes,
    every endpoint naming its region in metadata, as in envoy/envoy.yaml.
    `peers`: this Envoy's place in the deployment's exchange, as shipped
    (harness.set_exchange); None: each Envoy on its own."""
    overrides = harness.deep_merge({"regions": geo_plugin_regions(geo)}, extra)
    cfg = harness.render_config(None, admin_port, port, overrides, peers=peers)
    kept = [c for c in cfg["static_resources"]["clusters"] if c["name"] == harness.PEERS_CLUSTER]

    def ep(r: str) -> dict:
        return {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": lanes[vantage, r]}}},
                "metadata": {"filter_metadata": {"llm_geo_router": {"region": r}}}}

    clusters = []
    for r in geo.regions:
        others = [o for o in geo.regions if o != r]
        groups = [{"lb_endpoints": [ep(r)]}]
        if others:
            groups.append({"priority": 1, "lb_endpoints": [ep(o) for o in others]})
        clusters.append({"name": f"region_{r}", "connect_timeout": "1s", "type": "STATIC",
                         "load_assignment": {"cluster_name": f"region_{r}", "endpoints": groups}})
    cfg["static_resources"]["clusters"] = clusters + kept
    # The route for requests a failed-open router never saw: the region an
    # operator in this client region knows to be nearest.
    for rt in harness.routes(cfg):
        if rt.get("route", {}).get("cluster"):
            rt["route"]["cluster"] = f"region_{geo.nearest(vantage)}"
    return cfg


def wait_probed(envoy: harness.Envoy, regions: list[str], timeout: float = 30.0) -> dict[str, int]:
    """Until the probe has published twice and measured every region's RTT;
    returns the RTTs (ms)."""
    deadline = time.time() + timeout
    rtts: dict[str, int] = {}
    while time.time() < deadline:
        s = envoy.stats(r"llm_geo_router\.(probe\.snapshot_version|region\.[a-z0-9_]+\.rtt_ms)$")
        rtts = {r: s.get(f"wasmcustom.llm_geo_router.region.{r}.rtt_ms", 0) for r in regions}
        if s.get("wasmcustom.llm_geo_router.probe.snapshot_version", 0) >= 2 and all(v > 0 for v in rtts.values()):
            return rtts
        time.sleep(0.2)
    raise RuntimeError(f"no complete fleet snapshot after {timeout} s ({rtts}); see {envoy.log_path}")


class GeoRouter(Deployment):
    name = "geo_router"

    def __init__(self, run_dir: Path, geo: Geo, lanes: dict, concurrency: int, extra: dict,
                 exchange: bool = True):
        super().__init__()
        self.geo = geo
        self.config_regions = geo_plugin_regions(geo)
        # As envoy/envoy.yaml ships: the client regions' Envoys share through
        # the exchange (one deployment); without it each is on its own.
        ports = [harness.free_port() for _ in geo.clients]
        try:
            for i, v in enumerate(geo.clients):
                peers = (ports[i], ports) if exchange else None
                cfg = geo_router_config(geo, v, lanes, harness.free_port(), harness.free_port(), extra, peers)
                env = harness.start_envoy(run_dir, cfg, name=f"envoy-geo-{v}", concurrency=concurrency)
                self.envoys.append(env)
                self.entry[v] = env.port
            self.probed_at_start = {v: wait_probed(e, geo.regions) for v, e in zip(geo.clients, self.envoys)}
        except Exception:
            self.stop()
            raise

    def finish(self) -> dict:
        out = {}
        for v, env in zip(self.geo.clients, self.envoys):
            s = {k.replace("wasmcustom.llm_geo_router.", ""): val for k, val in env.stats().items()}
            keep = {k: val for k, val in s.items()
                    if k.startswith(("router.decision.", "ladder.", "tuning.", "router.invalid"))
                    or re.match(r"region\.[a-z0-9_]+\.(rq_total|upstream_failure|prefill_us_per_token|rtt_ms)$", k)}
            out[v] = {"envoy_stats": dict(sorted(keep.items())), "traps": harness.traps(env),
                      "rtt_ms_at_start": self.probed_at_start[v]}
        return {"per_vantage": out, "plugin_regions": self.config_regions}


def lb_config(name: str, geo: Geo, vantage: str, lanes: dict) -> dict:
    """envoy/bench/live-<name>.yaml for the Envoy of one client region, its
    endpoints the WAN listeners of that vantage: one group for the plain load
    balancers; for the mesh, one locality per engine region at a priority by
    its round trip from this client region (nearest at 0), as Istio's
    locality failover orders them."""
    cfg = yaml.safe_load(bl.LIVE_YAML[name].read_text())
    cfg["admin"]["address"]["socket_address"]["port_value"] = harness.free_port()
    cfg["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"] = harness.free_port()
    (cluster,) = cfg["static_resources"]["clusters"]

    def ep(r: str) -> dict:
        return {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": lanes[vantage, r]}}}}

    if name == "mesh":
        by_rtt = sorted(geo.regions, key=lambda r: geo.rtt(vantage, r))
        cluster["load_assignment"]["endpoints"] = [
            {"locality": {"region": r}, "priority": i, "lb_endpoints": [ep(r)]} for i, r in enumerate(by_rtt)]
    else:
        cluster["load_assignment"]["endpoints"] = [{"lb_endpoints": [ep(r) for r in geo.regions]}]
    return cfg


class EnvoyLb(Deployment):
    def __init__(self, name: str, run_dir: Path, geo: Geo, lanes: dict, concurrency: int):
        super().__init__()
        self.name = name
        self.geo = geo
        try:
            for v in geo.clients:
                cfg = lb_config(name, geo, v, lanes)
                env = harness.start_envoy(run_dir, cfg, name=f"envoy-{name}-{v}", concurrency=concurrency)
                self.envoys.append(env)
                self.entry[v] = env.port
        except Exception:
            self.stop()
            raise

    def finish(self) -> dict:
        return {"per_vantage": {v: {"envoy_stats": e.stats(bl.LB_STATS)} for v, e in zip(self.geo.clients, self.envoys)}}


def peer_key(name: str) -> str:
    """The bench_live.PEERS key of a peer deployment's name."""
    return name.removesuffix("_per_region").removesuffix("_global")


class PeerPerRegion(Deployment):
    """A peer router per client region, in that region: its workers are the
    WAN listeners of its vantage."""

    def __init__(self, name: str, run_dir: Path, geo: Geo, lanes: dict):
        super().__init__()
        self.name = name
        self.key = peer_key(name)
        self.cmds = {}
        try:
            started = []
            for v in geo.clients:
                port = harness.free_port()
                proc, cmd, log = bl.start_peer(self.key, run_dir, v, port,
                                               [f"http://127.0.0.1:{lanes[v, r]}" for r in geo.regions])
                self.procs.append(proc)
                self.cmds[v] = shlex.join(cmd)
                self.entry[v] = port
                started.append((proc, port, log))
            for proc, port, log in started:
                bl.wait_peer(self.key, proc, port, len(geo.regions), log)
        except Exception:
            self.stop()
            raise

    def finish(self) -> dict:
        return {"commands": self.cmds}


class PeerGlobal(Deployment):
    """One peer router in engine region G; its port is chosen before the WAN
    Envoy starts (the hop listeners point at it), the process after."""

    def __init__(self, name: str, region: str):
        super().__init__()
        self.name = name
        self.key = peer_key(name)
        self.region = region
        self.port = harness.free_port()
        self.cmd = ""

    def hops(self, geo: Geo) -> list[dict]:
        return [{"router": self.name, "client": c, "delay_ms": geo.rtt(c, self.region), "port": self.port}
                for c in geo.clients]

    def start(self, run_dir: Path, geo: Geo, lanes: dict, hop_ports: dict) -> None:
        v = f"dc-{self.region}"
        try:
            proc, cmd, log = bl.start_peer(self.key, run_dir, v, self.port,
                                           [f"http://127.0.0.1:{lanes[v, r]}" for r in geo.regions])
            self.procs.append(proc)
            self.cmd = shlex.join(cmd)
            bl.wait_peer(self.key, proc, self.port, len(geo.regions), log)
        except Exception:
            self.stop()
            raise
        self.entry = {c: hop_ports[self.name, c] for c in geo.clients}

    def finish(self) -> dict:
        return {"command": self.cmd, "region": self.region}


# ----------------------------------------------------------------- summaries

def wan_check(results: list[bl.Result], preps: list[bl.Prepared], geo: Geo, name: str,
              global_region: str | None) -> dict:
    """Per (vantage, serving region): the lowest TTFT seen and the round trip
    the WAN should have added; a TTFT below that means the delay was not
    applied."""
    low: dict[tuple[str, str], float] = {}
    for r in results:
        if r.ttft_ms is None or not r.replica:
            continue
        k = (preps[r.idx].client_region, r.replica)
        low[k] = min(low.get(k, math.inf), r.ttft_ms)
    out = {}
    for (v, reg), ms in sorted(low.items()):
        if name.endswith("_global") and global_region:
            floor = geo.rtt(v, global_region) + geo.rr[global_region, reg]
        else:
            floor = geo.rtt(v, reg)
        out[f"{v}->{reg}"] = {"min_ttft_ms": round(ms, 1), "wan_rtt_ms": round(floor, 1), "ok": ms >= floor - 2}
    return out


def summarize_router(name: str, results: list[bl.Result], preps: list[bl.Prepared], geo: Geo, engines: dict,
                     extra: dict, global_region: str | None) -> dict:
    slots = {r: int(geo.by_name[r]["max_concurrency"]) for r in geo.regions}
    overall = bl.summarize(results, engines, slots, geo.regions)
    per_vantage = {}
    for v in geo.clients:
        rs = [r for r in results if preps[r.idx].client_region == v]
        if rs:
            s = bl.summarize(rs, {}, None, geo.regions)
            s.pop("engines", None)
            per_vantage[v] = s
    overall["per_vantage"] = per_vantage
    overall["wan_check"] = wan_check(results, preps, geo, name, global_region)
    overall["runs"] = [extra]
    return overall


def fmt(x) -> str:
    return "–" if x is None else f"{x:.0f}"


def display_name(name: str, global_region: str | None) -> str:
    return f"{LABEL[name]}:{global_region}" if name.endswith("_global") else LABEL[name]


def table(summaries: dict[str, dict], geo: Geo, skipped: dict[str, str], global_region: str | None) -> str:
    regs = " / ".join(geo.regions)
    rows = [f"| router | vantage | ok / sent | TTFT mean | p50 | p95 | p99 | {regs} | cache hit | errors |",
            "|" + "---|" * 10]
    for name, s in summaries.items():
        for v, sv in [*s["per_vantage"].items(), ("all", s)]:
            t = sv["ttft_ms"]
            reg = sv["requests_per_region"]
            hit = "–" if sv["cache_hit_token_ratio"] is None else f"{100 * sv['cache_hit_token_ratio']:.1f} %"
            errs = ", ".join(f"{k} {n}" for k, n in sorted(sv["errors"].items())) or "0"
            label = display_name(name, global_region)
            v_cell = "**all**" if v == "all" else v
            rows.append(f"| {label} | {v_cell} | {sv['ok']} / {sv['requests']} | {fmt(t['mean'])} | {fmt(t['p50'])} "
                        f"| {fmt(t['p95'])} | {fmt(t['p99'])} | {' / '.join(str(reg.get(r, 0)) for r in geo.regions)} "
                        f"| {hit} | {errs} |")
    for name, why in skipped.items():
        rows.append(f"| {display_name(name, global_region)} | not run: {why} |" + " |" * 8)
    return "\n".join(rows)


def ratios(summaries: dict[str, dict], geo: Geo) -> dict:
    """geo-router p95 / the best other router's p95, overall and per vantage
    (routers that served every request of that scope only)."""
    g = summaries.get("geo_router")
    if not g:
        return {}
    out = {}
    for scope in ["all", *geo.clients]:
        def get(s):
            return s if scope == "all" else s["per_vantage"].get(scope)
        gs = get(g)
        peers = {k: get(s) for k, s in summaries.items() if k != "geo_router" and get(s)}
        peers = {k: s for k, s in peers.items() if s["ok"] == s["requests"] and s["ttft_ms"]["p95"] is not None}
        if not gs or gs["ttft_ms"]["p95"] is None or not peers:
            continue
        best = min(peers, key=lambda k: peers[k]["ttft_ms"]["p95"])
        out[scope] = {"geo_router_p95_ms": gs["ttft_ms"]["p95"], "best_peer": best,
                      "best_peer_p95_ms": peers[best]["ttft_ms"]["p95"],
                      "ratio": round(gs["ttft_ms"]["p95"] / peers[best]["ttft_ms"]["p95"], 3),
                      "geo_router_served_all": gs["ok"] == gs["requests"]}
    return out


def reading(summaries: dict, geo: Geo, rat: dict, skipped: dict, global_region: str | None,
            geo_extra: dict | None) -> list[str]:
    out = []
    for scope, r in rat.items():
        where = "over all clients" if scope == "all" else f"for clients in {scope}"
        out.append(f"Geo-router TTFT p95 {where}: {r['geo_router_p95_ms']:.0f} ms against "
                   f"{r['best_peer_p95_ms']:.0f} ms for the best other router "
                   f"(`{display_name(r['best_peer'], global_region)}`): ratio {r['ratio']:.2f}"
                   + ("" if r["geo_router_served_all"] else " (the geo-router did not serve every request)") + ".")
    g = summaries.get("geo_router")
    if g:
        parts = []
        for v, s in g["per_vantage"].items():
            reg = s["requests_per_region"]
            n = sum(reg.values()) or 1
            near = geo.nearest(v)
            parts.append(f"{v}: " + ", ".join(f"{r} {100 * reg.get(r, 0) / n:.0f} %" for r in geo.regions)
                         + f" (nearest {near})")
        out.append("Where the geo-router sent each client region: " + "; ".join(parts) + ".")
        if geo_extra:
            pv = geo_extra.get("per_vantage", {})
            meas = []
            for v, d in pv.items():
                rt = d.get("rtt_ms_at_start", {})
                meas.append(f"{v}: " + ", ".join(f"{r} {rt.get(r, 0)} ms (fleet {geo.rtt(v, r):g})" for r in geo.regions))
            if meas:
                out.append("RTTs the geo-router's probes measured before the replay: " + "; ".join(meas) + ".")
            lv = sorted({x for x in g.get("ladder_levels", []) if x != "?"})
            if lv and lv != ["0"]:
                out.append(f"Ladder levels seen in the geo-router's decisions: {', '.join(lv)}.")
    for name, s in summaries.items():
        bad = {k: v for k, v in s["wan_check"].items() if not v["ok"]}
        if bad:
            out.append(f"Warning: `{display_name(name, global_region)}` had requests faster than the emulated WAN "
                       f"allows ({json.dumps(bad)}): the delay was not applied to them.")
        lag = s["dispatch_lag_ms"]
        others = max((r.get("others_cpu_busy", 0) for r in s.get("runs", [])), default=0)
        busy = max((r.get("machine_cpu_busy", 0) for r in s.get("runs", [])), default=0)
        if (lag["p50"] or 0) > 5 or (lag["max"] or 0) > 200 or others > 0.15:
            out.append(f"Warning: during `{display_name(name, global_region)}` the machine was {100 * busy:.0f} % "
                       f"busy ({100 * others:.0f} % by other processes; client dispatch lag p50 {lag['p50']:.1f} ms, "
                       f"max {lag['max']:.0f} ms): its figures include CPU contention.")
        if s["errors"]:
            out.append(f"`{display_name(name, global_region)}` had errors: {json.dumps(s['errors'])}.")
    for k, why in skipped.items():
        out.append(f"`{display_name(k, global_region)}` did not run: {why}.")
    return out


# --------------------------------------------------------------------- plots

PALETTE = ["#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#000000", "#999999"]


def _esc(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def cdf_svg(title: str, series: list[tuple[str, list[float]]]) -> str:
    """TTFT CDF, log x axis (ms), one line per series; plain SVG in the style
    of sim/src/plot.rs."""
    W, H, L, R, T, B = 900.0, 460.0, 78.0, 290.0, 48.0, 62.0
    vals = [x for _, v in series for x in v if x > 0]
    lo = 10 ** math.floor(math.log10(min(vals))) if vals else 1.0
    hi = 10 ** math.ceil(math.log10(max(vals))) if vals else 10.0
    hi = max(hi, lo * 10)

    def px(v: float) -> float:
        return L + (math.log10(max(v, lo)) - math.log10(lo)) / (math.log10(hi) - math.log10(lo)) * (W - L - R)

    def py(q: float) -> float:
        return H - B - q * (H - T - B)

    s = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W:g}" height="{H:g}" viewBox="0 0 {W:g} {H:g}" '
         f'font-family="Helvetica, Arial, sans-serif" font-size="13">',
         f'<rect width="{W:g}" height="{H:g}" fill="#ffffff"/>',
         f'<text x="{(L + W - R) / 2:.1f}" y="26" text-anchor="middle" font-size="16" font-weight="bold">'
         f'{_esc(title)}</text>']
    for q in (0, 0.25, 0.5, 0.75, 1.0):
        y = py(q)
        s.append(f'<line x1="{L}" y1="{y:.1f}" x2="{W - R}" y2="{y:.1f}" stroke="#e4e4e4"/>'
                 f'<text x="{L - 8}" y="{y + 4:.1f}" text-anchor="end">{q:g}</text>')
    y95 = py(0.95)
    s.append(f'<line x1="{L}" y1="{y95:.1f}" x2="{W - R}" y2="{y95:.1f}" stroke="#777" stroke-dasharray="5,4"/>'
             f'<text x="{L + 6}" y="{y95 - 4:.1f}" font-size="11" fill="#555">p95</text>')
    d = lo
    decades = round(math.log10(hi / lo))
    marks = (1, 2, 5) if decades <= 3 else (1,)
    while d <= hi * 1.0001:
        for m in marks:
            v = d * m
            if lo * 0.999 <= v <= hi * 1.001:
                x = px(v)
                lab = f"{v / 1000:g} s" if v >= 1000 else f"{v:g}"
                s.append(f'<line x1="{x:.1f}" y1="{T}" x2="{x:.1f}" y2="{H - B}" stroke="#e4e4e4"/>'
                         f'<text x="{x:.1f}" y="{H - B + 20}" text-anchor="middle">{lab}</text>')
        d *= 10
    s.append(f'<rect x="{L}" y="{T}" width="{W - L - R}" height="{H - T - B}" fill="none" stroke="#333"/>')
    s.append(f'<text x="{(L + W - R) / 2:.1f}" y="{H - 18}" text-anchor="middle">TTFT at the client, ms (log)</text>')
    s.append(f'<text x="20" y="{(H - B + T) / 2:.1f}" text-anchor="middle" '
             f'transform="rotate(-90 20 {(H - B + T) / 2:.1f})">fraction of requests</text>')
    for i, (label, v) in enumerate(series):
        col = PALETTE[i % len(PALETTE)]
        xs = sorted(x for x in v if x > 0)
        if xs:
            n = len(xs)
            pts = [(px(xs[0]), py(0.0))]
            for k, x in enumerate(xs):
                pts.append((px(x), py(k / n)))
                pts.append((px(x), py((k + 1) / n)))
            path = " ".join(f"{'M' if j == 0 else 'L'}{a:.1f},{b:.1f}" for j, (a, b) in enumerate(pts))
            s.append(f'<path d="{path}" fill="none" stroke="{col}" stroke-width="2"/>')
        y = T + 10 + 22 * i
        s.append(f'<line x1="{W - R + 16}" y1="{y}" x2="{W - R + 44}" y2="{y}" stroke="{col}" stroke-width="3"/>'
                 f'<text x="{W - R + 50}" y="{y + 4}">{_esc(label)} (n={len(xs)})</text>')
    s.append("</svg>")
    return "\n".join(s) + "\n"


def write_plots(out_dir: Path, per_router: dict, preps: list, geo: Geo, global_region: str | None) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for scope in [*geo.clients, "all"]:
        series = []
        for name, results in per_router.items():
            v = [r.ttft_ms for r in results if r.error is None and r.ttft_ms is not None
                 and (scope == "all" or preps[r.idx].client_region == scope)]
            series.append((display_name(name, global_region), v))
        title = ("TTFT CDF, all client regions" if scope == "all" else f"TTFT CDF, clients in {scope}")
        p = out_dir / f"ttft_cdf_{_sanitize(scope)}.svg"
        p.write_text(cdf_svg(title, series))
        paths.append(p)
    return paths


# ---------------------------------------------------------------------- docs

def update_doc(path: Path, body: str) -> None:
    """Replaces only the `## Live benchmark, several vantage points` section;
    when absent, inserts it after the `## Live benchmark` section (else at the
    end)."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    section = f"{SECTION}\n\n{body.strip()}\n"
    lines = text.splitlines(keepends=True)

    def end_of(i: int) -> int:
        return next((j for j in range(i + 1, len(lines)) if lines[j].startswith("## ")), len(lines))

    start = next((i for i, l in enumerate(lines) if l.rstrip() == SECTION), None)
    if start is not None:
        end = end_of(start)
    else:
        live = next((i for i, l in enumerate(lines) if l.rstrip() == bl.SECTION), None)
        start = end = end_of(live) if live is not None else len(lines)
    rest = "".join(lines[end:])
    head = "".join(lines[:start])
    if head and not head.endswith("\n\n"):
        head = head.rstrip("\n") + "\n\n"
    path.write_text(head + section + ("\n" + rest if rest else ""))


def geography_text(result: dict) -> str:
    a = result["config"]
    g = result["geography"]
    rtt_rows = ["| engine region | " + " | ".join(g["client_regions"]) + " | "
                + " | ".join(f"{r} (region)" for r in g["regions"]) + " |",
                "|" + "---|" * (1 + len(g["client_regions"]) + len(g["regions"]))]
    for r in g["regions"]:
        rtt_rows.append(f"| {r} | " + " | ".join(f"{g['rtt_ms'][c][r]:g}" for c in g["client_regions"]) + " | "
                        + " | ".join(f"{g['region_rtt_ms'][r][o]:g}" for o in g["regions"]) + " |")
    rr_src = ("estimated as the largest difference of two regions' RTTs from one client region (the fleet has "
              "no `region_rtt_ms`)" if g["region_rtt_estimated"] else "from the fleet's `region_rtt_ms`")
    return (f"Clients in {len(g['client_regions'])} regions ({', '.join(g['client_regions'])}), one emulated engine "
            f"per engine region ({', '.join(g['regions'])}). Geography (round trips, ms; region to region {rr_src}; "
            f"{a['intra_region_rtt_ms']:g} ms within a region):\n\n" + "\n".join(rtt_rows))


def routers_text(result: dict) -> str:
    """What each router under test is and how it is deployed."""
    versions = result.get("peer_versions", {})
    return f"""\
Routers, each on fresh emulators (cold caches): `geo-router` (one Envoy 1.40
with the plugin per client region, {result.get('plugin_source', '')}, configured
with region names, clusters, `max_concurrency` and `capacity_rps` = slots x
1000 / 2000 only: no RTTs, prefill rates or service times, which the probe and
online tuning find); Envoy `ring_hash` on `x-session-id` and `least_request`
(one per client region); `mesh` (one Envoy per client region, the service-mesh
default: Istio's locality failover as Envoy runs it, `envoy/bench/live-mesh.yaml`,
each engine region a locality at a priority by its round trip from that client
region, nearest at 0, `LEAST_REQUEST` within a priority, Istio's default
retry policy, active HTTP health checks on `/health` at Kubernetes
readiness-probe defaults and outlier detection at Envoy's defaults, so each
client region's requests go to its nearest healthy engine region); and two
cache-aware routers, each per client region and as one global instance, the
WAN listeners of their vantage as `--worker-urls`.
{bl.peer_text("smg", "smg", versions)} {bl.peer_text("vllm_router", "vllm-router", versions)}
Per-client-region routers are in their clients' region (no hop before them)."""


WAN_TEXT = """\
WAN: each engine's emulator delays a response's first byte by the round trip
from the request's `x-client-region` (`--client-delay-ms` per client region and
per `dc-<region>` pseudo-client); that header is set, overwriting, by a plain
Envoy ("WAN Envoy", config generated by the benchmark) with one listener per
(vantage, engine region), so no router under test sets it: every request a
router sends an engine (inference, a health check, a metrics scrape,
vllm-router's render) pays the round trip between them. A router deployed in
one engine region G (`<router> global:G`) is reached by client region c
through a WAN Envoy listener whose fault filter delays every request by
RTT(c, G), and reaches the engines as `dc-G`."""


def caveats(a: dict, n_clients: int, many_seeds: bool) -> str:
    return f"""\
What this does not show. The engines are emulators (prefix cache, FIFO
admission to a fixed number of slots, prefill and decode as timed sleeps). A
round trip is charged once, before the first byte; bandwidth, loss and TCP
setup are not emulated. Compute is time-scaled and round trips are not, so
distance weighs {1 / a["time_scale"]:g}x more against compute than in the unscaled
trace. The geo-router's capacity figures are per Envoy (each of the
{n_clients} claims every region's whole capacity). Everything shares one
{os.cpu_count()}-core machine; one run per router{" and seed" if many_seeds else ""}: read large gaps, not small
differences."""


def trace_text(result: dict) -> str:
    a = result["config"]
    t = result["trace"]
    compute = {n: " ".join(f[2:8]) for n, f in a["engine_flags"].items()}  # past --max-concurrency N

    def slots(flags: list[str]) -> str:
        i = flags.index("--max-concurrency") if "--max-concurrency" in flags else -1
        return flags[i + 1] if 0 <= i < len(flags) - 1 else "?"

    engines = ", ".join(f"{n} {slots(f)} slots" for n, f in a["engine_flags"].items()) + "; " + (
        f"each `{next(iter(compute.values()))}`" if len(set(compute.values())) == 1
        else "; ".join(f"{n} `{c}`" for n, c in compute.items())) + " (scaled), plus the delays above"
    return f"""\
Trace: {t["source"]}: {t["requests"]} requests in {t["sessions"]} sessions over
{t["span_s"]} s of trace time, replayed in {round(t["span_s"] * a["time_scale"], 1)} s per router
(`--time-scale {a["time_scale"]}`: compute scaled, round trips not); requests per
client region {json.dumps(t["per_client"])}; prompts of {t["prompt_tokens_mean"]} tokens on
average, {t["output_tokens_mean"]} output tokens on average. Engines: {engines}."""


def ratio_text(result: dict) -> str:
    rat = result["ratios"].get("all")
    if not rat:
        return "No ratio: the geo-router or every other router did not run."
    return (f"Geo-router TTFT p95 over all clients / the best other router's: **{rat['ratio']:.2f}** "
            f"({rat['geo_router_p95_ms']:.0f} vs {rat['best_peer_p95_ms']:.0f} ms, "
            f"`{display_name(rat['best_peer'], result.get('global_region'))}`)."
            + ("" if rat["geo_router_served_all"] else " The geo-router did not serve every request."))


COLUMNS = """\
Columns: TTFT in ms over the requests served; per engine region: requests
served there (`x-engine-replica`); `cache hit`: the engines' cached prompt
tokens over prompt tokens."""


def doc_section(result: dict, tbl: str, lines: list[str], plots: list[str]) -> str:
    a = result["config"]
    plot_md = "\n\n".join(f"![{Path(p).stem}]({p})" for p in plots)
    return bl.reflow(f"""\
The several-vantage-point variant of the live benchmark
(`wasm-tests/bench_live_geo.py`): each request entering at the router that
serves its own client region, with a wide-area network emulated the same way
for every router; TTFT measured at the client. {geography_text(result)}

{WAN_TEXT}

{routers_text(result)}

Command:

    {result["command"]}

{trace_text(result)} Machine: {result["machine"]}; run {result["finished"]}.

{tbl}

{ratio_text(result)}

{COLUMNS}

Reading (generated from the numbers above):

{chr(10).join("- " + line for line in lines)}

{plot_md}

{caveats(a, len(result["geography"]["client_regions"]), False)}
""")


def seeds_doc_section(combined: dict, plots: list[str]) -> str:
    """The section for a run over several seeds: each seed's ratio, their
    geometric mean and spread, then each seed's geography and table."""
    per_seed = combined["per_seed"]
    first = per_seed[0]
    a = first["config"]
    rows = ["| seed | requests | geo-router TTFT p95 | best other p95 | ratio |", "|---|---|---|---|---|"]
    for r in per_seed:
        rat = r["ratios"].get("all")
        rows.append(f"| {r['seed']} | {r['trace']['requests']} | " + (
            f"{rat['geo_router_p95_ms']:.0f} | {rat['best_peer_p95_ms']:.0f} "
            f"(`{display_name(rat['best_peer'], r.get('global_region'))}`) | {rat['ratio']:.2f} |"
            if rat else "– | – | – |"))
    sp = combined["summary"].get("p95")
    over = (f"geometric mean **{sp['geomean']:.2f}** (min {sp['min']:.2f}, max {sp['max']:.2f}, {sp['n']} seeds)"
            if sp else "no seed had a ratio")
    # The scenario's geography, once when every seed has the same.
    def where(r: dict) -> list:
        return [r["geography"][k] for k in ("client_regions", "regions", "rtt_ms", "region_rtt_ms")]

    one_geo = all(where(r) == where(first) for r in per_seed)
    seeds_md = []
    for r in per_seed:
        warn = bl.notable(r["reading"])
        seeds_md.append(f"### Seed {r['seed']}\n\n" + ("" if one_geo else f"{geography_text(r)}\n\n")
                        + f"{trace_text(r)} Run {r['finished']}.\n\n"
                        f"{r['table']}\n\n{ratio_text(r)}"
                        + ("\n\n" + "\n".join("- " + l for l in warn) if warn else ""))
    plot_md = "\n\n".join(f"![{Path(p).stem}]({p})" for p in plots)
    return bl.reflow(f"""\
The several-vantage-point variant of the live benchmark
(`wasm-tests/bench_live_geo.py`): each request entering at the router that
serves its own client region, with a wide-area network emulated the same way
for every router; TTFT measured at the client; once per seed, every router
on fresh emulators.{(" " + geography_text(first)) if one_geo else ""}

{WAN_TEXT}

{routers_text(first)}

Command:

    {combined["command"]}

Seeds {", ".join(str(r["seed"]) for r in per_seed)} of scenario `{combined["scenario"]}` (held out: the plugin's
defaults were chosen on seeds 1-2), each seed's own fleet and trace. Machine:
{combined["machine"]}; finished {combined["finished"]}.

Geo-router TTFT p95 over all clients / the best other router's on that seed
(among the routers that served every request; lower is better):

{chr(10).join(rows)}

Over the seeds: {over}.

{COLUMNS}

{(chr(10) * 2).join(seeds_md)}

{"TTFT CDFs of seed " + str(first["seed"]) + ":" if plots else ""}

{plot_md}

{caveats(a, len(first["geography"]["client_regions"]), True)}
""")


# ---------------------------------------------------------------------- main

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fleet", type=Path, help="fleet.json (with --trace); default: generate --scenario")
    ap.add_argument("--trace", type=Path, help="trace.jsonl (with --fleet)")
    ap.add_argument("--trace-label", help="how the docs name --trace/--fleet")
    ap.add_argument("--scenario", default="e", help="scenario to generate without --fleet/--trace (default e)")
    ap.add_argument("--seed", type=int, default=1, help="seed of the generated scenario")
    ap.add_argument("--seeds", type=int, nargs="+",
                    help="run every router on each of these seeds' scenarios (instead of --seed) and report each "
                         "seed's ratio, their geometric mean and spread (held-out seeds: 3 and up)")
    ap.add_argument("--window-s", type=float, default=150.0, help="replay the first this many seconds of trace time")
    ap.add_argument("--max-requests", type=int, default=None, help="replay at most this many requests")
    ap.add_argument("--time-scale", type=float, default=0.5,
                    help="trace time and engine compute are multiplied by this (0.5: 2x faster); RTTs are not")
    ap.add_argument("--intra-region-rtt-ms", type=float, default=1.0,
                    help="round trip between a router and an engine in the same region")
    ap.add_argument("--global-region", default="auto",
                    help="engine region of the global peers, smg_global and vllm_router_global (auto: the "
                         "lowest demand-weighted RTT of each seed's trace)")
    ap.add_argument("--routers", default=",".join(ROUTERS), help=f"comma-separated subset of {','.join(ROUTERS)}")
    ap.add_argument("--envoy-concurrency", type=int, default=1, help="worker threads of each router Envoy")
    ap.add_argument("--exchange", choices=["on", "off"], default="on",
                    help="the geo-router's Envoys share through the exchange, as envoy/envoy.yaml ships "
                         "(on, the default), or each is on its own (off)")
    ap.add_argument("--plugin-config", type=json.loads, default={},
                    help="JSON merged into the geo-router's plugin configuration (default: none)")
    ap.add_argument("--max-inflight", type=int, default=256, help="client threads in flight at most")
    ap.add_argument("--timeout-s", type=float, default=120.0, help="per-request timeout")
    ap.add_argument("--wait-idle-s", type=float, default=0.0,
                    help="before each router's run, wait up to this long for the machine to be < 30 %% busy")
    ap.add_argument("--json-out", type=Path, help="write the results as JSON here")
    ap.add_argument("--plots-dir", type=Path, help="write the TTFT CDF plots (SVG) here")
    ap.add_argument("--doc", type=Path, help=f"rewrite the '{SECTION}' section of this Markdown file")
    ap.add_argument("--command-label", help="the command the docs show (default: this command line)")
    args = ap.parse_args()

    sys.setswitchinterval(0.001)
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    bad = [r for r in routers if r not in ROUTERS]
    if bad or args.time_scale <= 0:
        ap.error(f"unknown router(s) {bad}" if bad else "--time-scale must be > 0")
    if args.seeds and (args.fleet or args.trace):
        ap.error("--seeds generates each seed's scenario: leave out --fleet and --trace")

    runs_root = harness.fresh_run_dir("bench-live-geo")
    versions = bl.peer_versions()
    command = args.command_label or shlex.join([".venv/bin/python", "wasm-tests/bench_live_geo.py", *sys.argv[1:]])
    runs = []
    for seed in args.seeds or [args.seed]:
        out = runs_root / f"seed-{seed}" if args.seeds else runs_root
        out.mkdir(exist_ok=True)
        if args.seeds:
            print(f"bench-live-geo: seed {seed} ({args.seeds.index(seed) + 1} of {len(args.seeds)})", file=sys.stderr)
        run = run_once(argparse.Namespace(**{**vars(args), "seed": seed}), list(routers), versions, out)
        if run is None:
            return 2
        run[0]["command"] = command
        if args.seeds:
            run[0]["seed"] = seed
        runs.append(run)

    plots: list[str] = []
    if args.plots_dir:
        # The first seed's CDFs: one set of plots whatever the seeds.
        result, per_router, preps, geo = runs[0]
        paths = write_plots(args.plots_dir, per_router, preps, geo, result["global_region"])
        print(f"bench-live-geo: wrote {len(paths)} plots into {args.plots_dir}", file=sys.stderr)
        if args.doc:
            plots = [os.path.relpath(p, args.doc.resolve().parent) for p in (q.resolve() for q in paths)]

    results = [r for r, *_ in runs]
    if not args.seeds:
        out_json = results[0]
        body = doc_section(results[0], results[0]["table"], results[0]["reading"], plots)
    else:
        summary = {"p95": bl.spread({r["seed"]: r["ratios"]["all"]["ratio"] for r in results
                                      if "all" in r["ratios"]})}
        out_json = {"command": command, "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                    "machine": results[0]["machine"], "scenario": args.scenario, "seeds": args.seeds,
                    "peer_versions": versions, "summary": summary, "per_seed": results}
        body = seeds_doc_section(out_json, plots)
        sp = summary["p95"]
        if sp:
            print(f"bench-live-geo: geo-router / best other router, TTFT p95 over all clients, per seed "
                  f"{json.dumps(sp['per_seed'])}: geomean {sp['geomean']:.3f} (min {sp['min']:.3f}, "
                  f"max {sp['max']:.3f})")
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(out_json, indent=2) + "\n")
        print(f"bench-live-geo: wrote {args.json_out}", file=sys.stderr)
    if args.doc:
        update_doc(args.doc, body)
        print(f"bench-live-geo: updated the '{SECTION}' section of {args.doc}", file=sys.stderr)
    return 0


def run_once(args, routers: list[str], versions: dict, runs_root: Path):
    """Every router in `routers` on one scenario (`args.seed`, or --fleet
    and --trace), each on fresh engines and a fresh WAN; (result, the
    per-request results per router, the prepared requests, the geography),
    or None when the trace cannot be replayed."""
    fleet_path, trace_path, source = obtain_scenario(args, runs_root / "scenario")
    geo = Geo(json.loads(fleet_path.read_text()), args.intra_region_rtt_ms)
    if geo.region_rtt_estimated:
        print("bench-live-geo: the fleet has no regions[].region_rtt_ms; region-to-region round trips are "
              "estimated as max over client regions of |rtt(c, a) - rtt(c, b)|", file=sys.stderr)
    trace = bl.load_trace(trace_path)
    if args.window_s is not None and trace:
        t_end = trace[0]["t_ms"] + args.window_s * 1000
        trace = [r for r in trace if r["t_ms"] < t_end]
    if args.max_requests is not None:
        trace = trace[: args.max_requests]
    unknown = sorted({r.get("client_region") for r in trace} - set(geo.clients), key=str)
    if not trace or unknown:
        print(f"bench-live-geo: {'the trace is empty' if not trace else f'unknown client regions {unknown}'}",
              file=sys.stderr)
        return None
    (runs_root / "trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in trace))
    info = bl.trace_info(trace)
    info["per_client"] = {c: sum(1 for r in trace if r["client_region"] == c) for c in geo.clients}
    print(f"bench-live-geo: trace: {source}: {json.dumps(info)}", file=sys.stderr)
    preps = bl.prepare(trace)

    if args.global_region == "auto":
        global_region = min(geo.regions, key=lambda r: geo.weighted_rtt(r, info["per_client"]))
    elif args.global_region in geo.regions:
        global_region = args.global_region
    else:
        raise SystemExit(f"bench-live-geo: --global-region {args.global_region!r} is not one of {geo.regions}")
    weighted = {r: round(geo.weighted_rtt(r, info["per_client"]), 1) for r in geo.regions}
    print(f"bench-live-geo: demand-weighted RTT per region {weighted}; global peers in {global_region}",
          file=sys.stderr)

    skipped: dict[str, str] = {}
    for name in [r for r in routers if peer_key(r) in bl.PEERS]:
        why = bl.peer_not_installed(peer_key(name), versions)
        if why:
            skipped[name] = why
            routers.remove(name)

    per_router: dict[str, list[bl.Result]] = {}
    summaries: dict[str, dict] = {}
    geo_extra = None
    vantages_base = list(geo.clients)
    for name in routers:
        run_dir = runs_root / name
        run_dir.mkdir()
        engines = start_region_engines(run_dir, geo, args.time_scale)
        wan = None
        dep: Deployment | None = None
        try:
            hops: list[dict] = []
            vantages = list(vantages_base)
            if name.endswith("_global"):
                dep = PeerGlobal(name, global_region)
                hops = dep.hops(geo)
                vantages.append(f"dc-{global_region}")
            wan, lanes, hop_ports = start_wan(run_dir, engines, vantages, hops)
            try:
                if name == "geo_router":
                    dep = GeoRouter(run_dir, geo, lanes, args.envoy_concurrency, args.plugin_config,
                                    exchange=args.exchange == "on")
                elif name in ("ring_hash", "least_request", "mesh"):
                    dep = EnvoyLb(name, run_dir, geo, lanes, args.envoy_concurrency)
                elif name.endswith("_per_region"):
                    dep = PeerPerRegion(name, run_dir, geo, lanes)
                else:
                    dep.start(run_dir, geo, lanes, hop_ports)
            except Exception as e:  # noqa: BLE001
                if peer_key(name) not in bl.PEERS:
                    raise
                skipped[name] = f"{bl.PEERS[peer_key(name)].dist} did not start: {e}"
                print(f"bench-live-geo: {skipped[name]}", file=sys.stderr)
                continue
            entry = dict(dep.entry)
            print(f"bench-live-geo: {name}: entries {entry} ...", file=sys.stderr)
            idle_before = bl.wait_idle(args.wait_idle_s) if args.wait_idle_s > 0 else None
            pids = [os.getpid(), wan.proc.pid, *dep.pids(), *(e.proc.pid for e in engines.values())]
            t0 = time.monotonic()
            busy0, total0, irq0 = bl.cpu_times()
            own0 = bl.proc_cpu_s(pids)
            res, client = bl.replay(lambda p: entry[p.client_region], preps, args.time_scale, args.max_inflight,
                                    args.timeout_s)
            busy1, total1, irq1 = bl.cpu_times()
            own1 = bl.proc_cpu_s(pids)
            took = time.monotonic() - t0
            estats = bl.engine_stats(engines)
            extra = dep.finish()
            extra.update({"replay_s": round(took, 1), "client": client, "entries": entry,
                          "wan_envoy_config": str(wan.config_path)})
            tick = os.sysconf("SC_CLK_TCK")
            extra["machine_cpu_busy"] = round((busy1 - busy0) / max(1, total1 - total0), 3)
            extra["others_cpu_busy"] = round(max(0.0, (busy1 - busy0 - (irq1 - irq0)) / tick - (own1 - own0))
                                             / max(1e-9, (total1 - total0) / tick), 3)
            if idle_before is not None:
                extra["machine_busy_before"] = round(idle_before, 3)
            if name == "geo_router":
                geo_extra = extra
            (run_dir / "requests.jsonl").write_text(
                "".join(json.dumps({**r.__dict__, "client_region": preps[r.idx].client_region}) + "\n" for r in res))
            per_router[name] = res
            summaries[name] = summarize_router(name, res, preps, geo, estats, extra,
                                               global_region if name.endswith("_global") else None)
            errs = sum(1 for r in res if r.error)
            print(f"bench-live-geo: {name}: {len(res)} requests in {took:.1f} s, {errs} errors", file=sys.stderr)
        finally:
            if dep is not None:
                dep.stop()
            if wan is not None:
                wan.stop()
            for e in engines.values():
                e.kill()

    tbl = table(summaries, geo, skipped, global_region)
    rat = ratios(summaries, geo)
    lines = reading(summaries, geo, rat, skipped, global_region, geo_extra)
    print(tbl)
    print("\n".join("- " + l for l in lines))

    result = {
        "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}",
        "config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                   "engine_flags": {r: [x for x in start_flags(geo, r, args.time_scale)] for r in geo.regions}},
        "geography": {"client_regions": geo.clients, "regions": geo.regions,
                      "rtt_ms": {c: {r: geo.rtt(c, r) for r in geo.regions} for c in geo.clients},
                      "region_rtt_ms": {a: {b: geo.rr[a, b] for b in geo.regions} for a in geo.regions},
                      "region_rtt_estimated": geo.region_rtt_estimated,
                      "fleet": str(fleet_path), "demand_weighted_rtt_ms": weighted},
        "trace": {"source": source, **info},
        "global_region": global_region,
        "plugin_source": bl.plugin_source(),
        "peer_versions": versions,
        "skipped": skipped,
        "routers": summaries,
        "ratios": rat,
        "table": tbl,
        "reading": lines,
        "runs_dir": str(runs_root),
    }
    return result, per_router, preps, geo


def start_flags(geo: Geo, region: str, time_scale: float) -> list[str]:
    """The emulator flags of an engine region (for the record)."""
    fig = geo.by_name[region]
    flags = bl.engine_args({k: fig.get(k, d) for k, d in bl.ENGINE_DEFAULTS.items()}, time_scale)
    flags += ["--client-region-header", CLIENT_REGION_HEADER]
    for c, ms in geo.client_delays(region).items():
        flags += ["--client-delay-ms", f"{c}={ms:g}"]
    return flags


if __name__ == "__main__":
    sys.exit(main())
