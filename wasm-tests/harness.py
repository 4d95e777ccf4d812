"""Real-Envoy test harness: builds nothing itself (scripts/test builds first),
starts engine emulators and a real Envoy 1.40 on free loopback ports, waits
until they are ready, and tears everything down even when a test fails.

The Envoy configuration is the repository's own `envoy/envoy.yaml`, loaded
with PyYAML and rewritten only where a test must differ: ports, the .wasm
path, and plugin-configuration overrides merged into the JSON all three
roots share.
"""

from __future__ import annotations

import copy
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
WASM = ROOT / "target" / "wasm32-wasip1" / "release" / "llm_geo_router.wasm"
EMULATOR = ROOT / "target" / "release" / "engine-emulator"
ENVOY = ROOT / ".venv" / "bin" / "envoy"
DEMO_CONFIG = ROOT / "envoy" / "envoy.yaml"
RUNS = ROOT / "wasm-tests" / "_runs"

# The demo's three regions: name -> (cluster, emulated network delay ms, engine kind).
DEMO_REGIONS = {
    "near": ("region_near", 5, "vllm"),
    "mid": ("region_mid", 40, "vllm"),
    "far": ("region_far", 120, "sglang"),
}
# Their fallback pools (started only by tests that need them).
FALLBACK_REGIONS = {
    "near_fallback": ("region_near_fallback", 5, "vllm"),
    "mid_fallback": ("region_mid_fallback", 40, "vllm"),
    "far_fallback": ("region_far_fallback", 120, "vllm"),
}
ALL_ENGINES = {**DEMO_REGIONS, **FALLBACK_REGIONS}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deep_merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in override.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def wasm_plugins(cfg: dict):
    """Every wasm plugin config (singleton and filters) in an Envoy bootstrap."""
    for ext in cfg.get("bootstrap_extensions", []):
        tc = ext.get("typed_config", {})
        if "WasmService" in tc.get("@type", ""):
            yield tc["config"]
    for lis in cfg.get("static_resources", {}).get("listeners", []):
        for chain in lis.get("filter_chains", []):
            for f in chain.get("filters", []):
                hcm = f.get("typed_config", {})
                for hf in hcm.get("http_filters", []):
                    tc = hf.get("typed_config", {})
                    if tc.get("@type", "").endswith("filters.http.wasm.v3.Wasm"):
                        yield tc["config"]


def plugin_config(cfg: dict) -> dict:
    return json.loads(next(wasm_plugins(cfg))["configuration"]["value"])


@dataclass
class Engine:
    name: str
    port: int
    proc: subprocess.Popen
    log_path: Path
    args: list

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def admin(self, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method="POST" if data else "GET")
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    def stats(self) -> dict:
        return self.admin("/admin/stats")

    def set_state(self, **state) -> dict:
        return self.admin("/admin/state", state)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


# Emulator flags that may be given more than once; any other flag given
# twice is an error (exit code 2).
REPEATABLE_ENGINE_FLAGS = {"--echo-header", "--client-delay-ms"}


def merge_engine_flags(base: list, extra: list) -> list:
    """Emulator flags `base` with `extra` applied: a flag in `extra` replaces
    the same flag in `base`, a repeatable one is added. A flag takes one
    value (`--flag value` or `--flag=value`) unless the next argument is
    another flag (a switch such as `--enable-cache-report`)."""
    def pairs(args: list) -> list[tuple[str, str | None]]:
        out, i = [], 0
        while i < len(args):
            arg = str(args[i])
            if arg.startswith("--") and "=" in arg:
                flag, value = arg.split("=", 1)
                out.append((flag, value))
                i += 1
            elif i + 1 < len(args) and not str(args[i + 1]).startswith("--"):
                out.append((arg, str(args[i + 1])))
                i += 2
            else:
                out.append((arg, None))
                i += 1
        return out

    extra_pairs = pairs(extra)
    replaced = {flag for flag, _ in extra_pairs if flag not in REPEATABLE_ENGINE_FLAGS}
    merged = [p for p in pairs(base) if p[0] not in replaced] + extra_pairs
    return [x for flag, value in merged for x in ((flag,) if value is None else (flag, value))]


def start_engine(name: str, run_dir: Path, delay_ms: float, mode: str = "vllm", extra: list | None = None,
                 port: int = 0) -> Engine:
    log_path = run_dir / f"engine-{name}.log"
    args = [str(EMULATOR), *merge_engine_flags([
        "--listen", f"127.0.0.1:{port}", "--name", name, "--mode", mode,
        "--network-delay-ms", str(delay_ms), "--max-concurrency", "8", "--prefill-ms-per-token", "0.2",
        "--decode-ms-per-token", "1", "--echo-header", "x-llm-tier", "--echo-header", "x-llm-cluster",
        "--echo-header", "x-llm-kv-action",
        # Engines as the docs tell operators to run them: each answer
        # reports its cached tokens (docs/INSTALL.md).
        "--enable-cache-report" if mode == "sglang" else "--enable-prompt-tokens-details",
    ], extra or [])]
    out = open(log_path, "w")
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=out, text=True)
    deadline = time.time() + 15
    line = ""
    while time.time() < deadline:
        line = proc.stdout.readline()
        if line or proc.poll() is not None:
            break
    m = re.search(r"listening on 127\.0\.0\.1:(\d+)", line or "")
    if not m:
        proc.kill()
        raise RuntimeError(f"emulator {name} did not start: {line!r}; see {log_path}")
    # Keep draining stdout so the emulator never blocks on a full pipe.
    threading_drain(proc.stdout, out)
    return Engine(name, int(m.group(1)), proc, log_path, args)


def threading_drain(stream, sink) -> None:
    import threading

    def run():
        for line in stream:
            sink.write(line)
            sink.flush()

    threading.Thread(target=run, daemon=True).start()


@dataclass
class Envoy:
    proc: subprocess.Popen
    admin_port: int
    port: int
    log_path: Path
    config_path: Path

    def stats(self, pattern: str = "llm_geo_router") -> dict[str, int]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/stats?filter={pattern}", timeout=10) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            try:
                out[name.strip()] = int(value)
            except ValueError:
                pass
        return out

    def stat(self, name: str) -> int:
        return self.stats(re.escape(name) + "$").get(name, 0)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def render_config(engines: dict[str, Engine] | None, admin_port: int, port: int,
                  overrides: dict | None = None, base: Path = DEMO_CONFIG) -> dict:
    cfg = yaml.safe_load(base.read_text())
    cfg["admin"]["address"]["socket_address"]["port_value"] = admin_port
    for lis in cfg["static_resources"]["listeners"]:
        lis["address"]["socket_address"]["port_value"] = port
    if engines is not None:
        # An engine's port in the demo config is its cluster's first
        # endpoint; every endpoint on that port (a region cluster's failover
        # endpoints too) is moved to where the test started the engine.
        by_cluster = {c: e for n, (c, _, _) in ALL_ENGINES.items() if (e := engines.get(n))}
        clusters = cfg["static_resources"]["clusters"]
        demo_port = {cl["name"]: cl["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
                     ["address"]["socket_address"]["port_value"] for cl in clusters}
        moved = {demo_port[c]: e.port for c, e in by_cluster.items() if c in demo_port}
        for cl in clusters:
            for group in cl["load_assignment"]["endpoints"]:
                for lb in group["lb_endpoints"]:
                    sa = lb["endpoint"]["address"]["socket_address"]
                    if sa["port_value"] in moved:
                        sa["port_value"] = moved[sa["port_value"]]
    plugin = deep_merge(plugin_config(cfg), overrides or {})
    for p in wasm_plugins(cfg):
        p["vm_config"]["code"]["local"]["filename"] = str(WASM)
        p["configuration"]["value"] = json.dumps(plugin)
    return cfg


def validate(config_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(ENVOY), "--mode", "validate", "-c", str(config_path), "-l", "info"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


def start_envoy(run_dir: Path, cfg: dict, name: str = "envoy", concurrency: int = 2) -> Envoy:
    config_path = run_dir / f"{name}.yaml"
    config_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    log_path = run_dir / f"{name}.log"
    admin_port = cfg["admin"]["address"]["socket_address"]["port_value"]
    port = cfg["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"]
    # Logs go to stderr (unbuffered), not --log-path (flushed late), so a
    # test can read a line right after the event.
    proc = subprocess.Popen(
        [str(ENVOY), "-c", str(config_path), "--concurrency", str(concurrency), "-l", "info",
         "--base-id", str(admin_port), "--disable-hot-restart"],
        stdout=subprocess.DEVNULL, stderr=open(log_path, "w"), cwd=ROOT)
    env = Envoy(proc, admin_port, port, log_path, config_path)
    try:
        wait_ready(proc, admin_port, log_path)
    except RuntimeError:
        env.stop()
        raise
    return env


def wait_ready(proc: subprocess.Popen, admin_port: int, log_path: Path, timeout: float = 60.0) -> None:
    """Until Envoy's admin /ready answers 200; raises if Envoy exits or the
    timeout passes (the caller stops the process)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"envoy exited with {proc.returncode}; see {log_path}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"envoy not ready in {timeout:.0f} s; see {log_path}")


@dataclass
class Response:
    status: int
    headers: dict
    body: bytes
    ttfb_ms: float
    total_ms: float

    def json(self):
        return json.loads(self.body)

    @property
    def replica(self) -> str | None:
        return self.headers.get("x-engine-replica")

    @property
    def route(self) -> dict:
        raw = self.headers.get("x-llm-route", "")
        return dict(p.strip().split("=", 1) for p in raw.split(";") if "=" in p)


def request(port: int, method: str, path: str, body: bytes | str | dict | None = None,
            headers: dict | None = None, timeout: float = 30.0) -> Response:
    if isinstance(body, dict):
        body = json.dumps(body)
    if isinstance(body, str):
        body = body.encode()
    h = {"content-type": "application/json"}
    h.update(headers or {})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t0 = time.monotonic()
    try:
        conn.request(method, path, body=body, headers=h)
        resp = conn.getresponse()
        t1 = time.monotonic()
        data = resp.read()
        t2 = time.monotonic()
        return Response(resp.status, {k.lower(): v for k, v in resp.getheaders()}, data,
                        (t1 - t0) * 1000, (t2 - t0) * 1000)
    finally:
        conn.close()


def chat(port: int, messages: list, headers: dict | None = None, timeout: float = 30.0, **fields) -> Response:
    body = {"model": "emulated-model", "messages": messages, "max_tokens": 4, **fields}
    return request(port, "POST", "/v1/chat/completions", body, headers, timeout)


def filler(seed: str, n_bytes: int) -> str:
    """Deterministic prompt text of about n_bytes (distinct per seed)."""
    words = []
    i = 0
    total = 0
    while total < n_bytes:
        w = f"{seed}-{i * 2654435761 % 100003:05d}"
        words.append(w)
        total += len(w) + 1
        i += 1
    return " ".join(words)[:n_bytes]


@dataclass
class Fleet:
    """Three emulated regions and one Envoy, as in the demo."""

    run_dir: Path
    engines: dict[str, Engine] = field(default_factory=dict)
    fallbacks: dict[str, Engine] = field(default_factory=dict)
    envoys: list[Envoy] = field(default_factory=list)

    @property
    def envoy(self) -> Envoy:
        return self.envoys[0]

    @property
    def port(self) -> int:
        return self.envoy.port

    def start(self, overrides: dict | None = None, engine_extra: dict | None = None, envoys: int = 1,
              fallback: bool = False, envoy_edit=None) -> "Fleet":
        for name, (_, delay, mode) in DEMO_REGIONS.items():
            self.engines[name] = start_engine(name, self.run_dir, delay, mode, (engine_extra or {}).get(name))
        if fallback:
            for name, (_, delay, mode) in FALLBACK_REGIONS.items():
                self.fallbacks[name] = start_engine(name, self.run_dir, delay, mode)
        for i in range(envoys):
            cfg = render_config({**self.engines, **self.fallbacks}, free_port(), free_port(), overrides)
            if envoy_edit is not None:
                envoy_edit(cfg)
            self.envoys.append(start_envoy(self.run_dir, cfg, name=f"envoy{i}"))
        for e in self.envoys:
            self.wait_snapshot(e)
        return self

    def wait_snapshot(self, envoy: Envoy, timeout: float = 20.0) -> None:
        """Until the probe has published and measured every region's RTT."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            s = envoy.stats(r"llm_geo_router\.(probe\.snapshot_version|region\.[a-z0-9_]+\.rtt_ms)$")
            rtts = [s.get(f"wasmcustom.llm_geo_router.region.{n}.rtt_ms", 0) for n in self.engines]
            if s.get("wasmcustom.llm_geo_router.probe.snapshot_version", 0) >= 2 and all(v > 0 for v in rtts):
                return
            time.sleep(0.1)
        raise RuntimeError(f"no complete fleet snapshot after {timeout} s; see {envoy.log_path}")

    def restart_engine(self, name: str, extra: list | None = None) -> Engine:
        old = self.engines[name]
        old.kill()
        _, delay, mode = DEMO_REGIONS[name]
        self.engines[name] = start_engine(name, self.run_dir, delay, mode, extra, port=old.port)
        return self.engines[name]

    def stop(self) -> None:
        for e in self.envoys:
            e.stop()
        for e in [*self.engines.values(), *self.fallbacks.values()]:
            e.kill()


def routes(cfg: dict) -> list[dict]:
    """The routes of the (first) listener's virtual host in an Envoy bootstrap."""
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm["route_config"]["virtual_hosts"][0]["routes"]


def stream_route(cfg: dict) -> dict:
    """The route the router's streamed requests take (matched on x-llm-stream)."""
    (route,) = [r for r in routes(cfg)
                if any(h.get("name") == "x-llm-stream" for h in r["match"].get("headers", []))]
    return route["route"]


def probe_ticks(envoy: Envoy) -> int:
    """Probe rounds run so far (the plugin's own clock for tests)."""
    return envoy.stat("wasmcustom.llm_geo_router.probe.ticks")


def wait_ticks(envoy: Envoy, n: int, timeout: float = 60.0) -> int:
    """Until the probe has run `n` more rounds; returns the tick count. The
    timeout only bounds a stuck probe: on a slow machine ticks come later,
    and the wait is for them, not for wall-clock time."""
    target = probe_ticks(envoy) + n
    deadline = time.time() + timeout
    while time.time() < deadline:
        t = probe_ticks(envoy)
        if t >= target:
            return t
        time.sleep(0.05)
    raise AssertionError(f"the probe ran fewer than {n} rounds in {timeout} s; see {envoy.log_path}")


LADDER_LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3})\].*llm-geo-router probe: ladder level (\d) "
                         r"\(.*; probe tick (\d+)\)")


@dataclass
class LevelChange:
    at_s: float  # when the probe logged it (Envoy's log clock, ms resolution)
    level: int
    tick: int  # the probe round that made it


def ladder_changes(envoy: Envoy) -> list[LevelChange]:
    """Every ladder level change, as the probe logged it when it made it: a
    record of the plugin's own, not a poll of a gauge that can miss a step."""
    from datetime import datetime

    out = []
    for line in envoy.log().splitlines():
        m = LADDER_LINE.match(line)
        if m:
            at = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S.%f").timestamp()
            out.append(LevelChange(at, int(m.group(2)), int(m.group(3))))
    return out


def region_stats(envoy: Envoy, region: str) -> dict[str, int]:
    """The plugin's per-region counters and gauges, by short name."""
    prefix = f"wasmcustom.llm_geo_router.region.{region}."
    return {k[len(prefix):]: v for k, v in envoy.stats(re.escape(prefix)).items() if k.startswith(prefix)}


TRAP_PATTERNS = re.compile(r"(panic|Uncaught|Function: proxy_on_\S+ failed|wasm trap|VM failed|out of bounds)", re.I)


def traps(envoy: Envoy) -> list[str]:
    """Log lines that show a VM trap or panic (Envoy logs each one)."""
    return [l for l in envoy.log().splitlines() if TRAP_PATTERNS.search(l)]


def fresh_run_dir(name: str) -> Path:
    d = RUNS / re.sub(r"[^A-Za-z0-9_.-]", "_", name)
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    return d
