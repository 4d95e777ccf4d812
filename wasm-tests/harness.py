"""Real-Envoy test harness: builds nothing itself (scripts/test builds first),
starts engine emulators and a real Envoy 1.40 on free loopback ports, waits
until they are ready, and tears everything down even when a test fails.

The Envoy configuration is the repository's own `envoy/envoy.yaml`, loaded
with PyYAML and rewritten only where a test must differ: ports, the .wasm
path, and plugin-configuration overrides merged into the JSON all the
roots share; a region started as several replicas gets one endpoint per
replica, and a fleet with a Prometheus gets a `prometheus` cluster. The
file's exchange (a deployment of Envoys sharing what each learns) is kept,
with its ports moved, for a fleet started `shared`, and taken out whole
otherwise: each Envoy on its own, as without the `exchange` block.

A region may run as several emulator replicas (`Fleet.start(replicas=
{"near": 3})`), and a real Prometheus (/usr/bin/prometheus, installed by
scripts/setup) can scrape them (`start_prometheus`, `Fleet.start(prometheus=
True)`) for tests of load read from a Prometheus API.
"""

from __future__ import annotations

import copy
import difflib
import http.client
import json
import os
import random
import re
import shutil
import signal
import socket
import ssl
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
PROMETHEUS = Path("/usr/bin/prometheus")
# The Envoy cluster render_config adds for a fleet's Prometheus.
PROMETHEUS_CLUSTER = "prometheus"

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


def terminate(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 10 s, if it still runs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _listen_ports() -> range:
    """Ports to listen on: below the kernel's ephemeral range, from which
    every outgoing connection takes its source port. A port the kernel
    picked free (bind to 0) is in that range, and beside a busy machine's
    clients one was taken as a source port before the Envoy it was picked
    for bound it ("cannot bind ...: Address already in use", run 14 in
    docs/RELIABILITY.md)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 49152  # the IANA ephemeral range, macOS's and Windows' default
    return range(10000, low) if low > 12000 else range(1024, low)


_LISTEN_PORTS = _listen_ports()
_handed: set[int] = set()
_rng = random.Random()


def free_port() -> int:
    """A port nothing listens on, outside the ephemeral range, not handed
    out before by this process (so two servers started together never get
    the same one)."""
    for _ in range(1000):
        port = _rng.choice(_LISTEN_PORTS)
        if port in _handed:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed.add(port)
        return port
    raise RuntimeError(f"no free port in {_LISTEN_PORTS}")


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


def engine_flag_pairs(args: list) -> list[tuple[str, str | None]]:
    """Emulator arguments as (flag, value) pairs, in order. A flag takes one
    value (`--flag value` or `--flag=value`) unless the next argument is
    another flag (a switch such as `--enable-cache-report`: value None)."""
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


def merge_engine_flags(base: list, extra: list) -> list:
    """Emulator flags `base` with `extra` applied: a flag in `extra` replaces
    the same flag in `base`, a repeatable one is added (engine_flag_pairs
    reads them)."""
    extra_pairs = engine_flag_pairs(extra)
    replaced = {flag for flag, _ in extra_pairs if flag not in REPEATABLE_ENGINE_FLAGS}
    merged = [p for p in engine_flag_pairs(base) if p[0] not in replaced] + extra_pairs
    return [x for flag, value in merged for x in ((flag,) if value is None else (flag, value))]


def engine_flags(name: str, delay_ms: float, mode: str = "vllm", extra: list | None = None,
                 port: int = 0, plain: bool = False) -> list[str]:
    """The emulator's arguments start_engine runs it with (see there)."""
    base = ["--listen", f"127.0.0.1:{port}", "--name", name, "--mode", mode]
    if not plain:
        base += [
            "--network-delay-ms", str(delay_ms), "--max-concurrency", "8", "--prefill-ms-per-token", "0.2",
            "--decode-ms-per-token", "1", "--echo-header", "x-llm-tier", "--echo-header", "x-llm-cluster",
            "--echo-header", "x-llm-kv-action",
            # Engines as the docs tell operators to run them: each answer
            # reports its cached tokens (docs/INSTALL.md).
            "--enable-cache-report" if mode == "sglang" else "--enable-prompt-tokens-details",
            # The release the demo's parity check expects (envoy/envoy.yaml:
            # no engine reports one by itself, docs/INSTALL.md).
            "--release", "sha256:release-a",
        ]
        if mode == "vllm":
            # vLLM keeps Responses only with its store on, as the docs tell
            # operators who serve previous_response_id
            # (VLLM_ENABLE_RESPONSES_API_STORE=1); and the fleet's engines
            # answer /v1/embeddings (a route the router does not read), which
            # a generative vLLM model would answer 404.
            base += ["--responses-store", "--embedding-model"]
    return merge_engine_flags(base, extra or [])


def start_engine(name: str, run_dir: Path, delay_ms: float, mode: str = "vllm", extra: list | None = None,
                 port: int = 0, plain: bool = False) -> Engine:
    """An emulator replica with the fleet's test settings (network delay,
    timing, echoed headers, the demo's release digest), `extra` replacing
    any of them; `plain`: only `extra` beyond the address, name and mode
    (the emulator as the engine it copies would be started)."""
    log_path = run_dir / f"engine-{name}.log"
    args = [str(EMULATOR), *engine_flags(name, delay_ms, mode, extra, port, plain)]
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


# llama.cpp's llama-server, built once from the pinned PyPI sdist's source
# and cached by scripts/llama-server-build (scripts/setup runs it), with its
# tiny random-weight model over the real Llama-3 vocabulary.
LLAMA_BUILD = ROOT / "scripts" / "llama-server-build"
# The model name the llama-server regions answer to (--alias): what clients
# send, and what their /v1/models lists.
LLAMA_MODEL = "tiny-llama3"


def llama_server() -> tuple[Path, Path]:
    """(llama-server, the tiny model), as scripts/llama-server-build reports
    them: at once from its cache, or after building on a machine where
    scripts/setup has not run."""
    r = subprocess.run([str(LLAMA_BUILD)], capture_output=True, text=True, timeout=3600, cwd=ROOT)
    if r.returncode != 0:
        raise RuntimeError(f"scripts/llama-server-build failed ({r.returncode}): {r.stderr[-2000:]}")
    paths = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
    return Path(paths["LLAMA_SERVER"]), Path(paths["LLAMA_TINY_MODEL"])


def start_llama(name: str, run_dir: Path, ctx: int = 16384, parallel: int = 4, port: int = 0) -> Engine:
    """A real llama-server on a loopback port serving the tiny model as
    LLAMA_MODEL, its metrics on: `parallel` slots of ctx / parallel tokens
    of context each (the per-request limit its /v1/models reports as
    meta.n_ctx). Ready once /health answers 200 (it answers 503 while the
    model loads)."""
    binary, model = llama_server()
    port = port or free_port()
    log_path = run_dir / f"llama-{name}.log"
    args = [str(binary), "-m", str(model), "--alias", LLAMA_MODEL, "--host", "127.0.0.1", "--port", str(port),
            "--metrics", "-c", str(ctx), "--parallel", str(parallel), "--threads", "1",
            # HTTP threads to spare beyond the slots (its default is
            # max(parallel + 2, cores - 1)): with more requests held open
            # than that, /health and /metrics wait in its accept queue, and
            # a probe or a test reading a saturated engine times out
            # (CI: a test's /metrics read with 8 requests held, 6 threads).
            "--threads-http", str(parallel + 16)]
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=open(log_path, "w"), cwd=run_dir)
    try:
        wait_http_ok(f"llama-server {name}", proc, f"http://127.0.0.1:{port}/health", log_path, time.time() + 60)
    except RuntimeError:
        proc.kill()
        proc.wait(timeout=10)
        raise
    return Engine(name, port, proc, log_path, args)


# vLLM 0.32's CPU build, installed once into a venv of its own outside the
# repository by scripts/vllm-install (scripts/setup runs it), with a small
# random-weight Llama over the same Llama-3 vocabulary.
VLLM_INSTALL = ROOT / "scripts" / "vllm-install"
# The model name the vLLM regions answer to (--served-model-name).
VLLM_MODEL = "tiny-llama3"
# vLLM's CPU build caches in blocks of this many tokens (its default there;
# 16 on GPUs).
VLLM_BLOCK = 128


class VllmEngine(Engine):
    """A vLLM server: its engine core runs in a child process of the API
    server, in a process group of its own, so a kill takes the group."""

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)


def vllm_install() -> tuple[Path, Path]:
    """(the vLLM venv's python, the model folder), as scripts/vllm-install
    reports them: at once from its cache, or after installing on a machine
    where scripts/setup has not run."""
    r = subprocess.run([str(VLLM_INSTALL)], capture_output=True, text=True, timeout=3600, cwd=ROOT)
    if r.returncode != 0:
        raise RuntimeError(f"scripts/vllm-install failed ({r.returncode}): {r.stderr[-2000:]}")
    paths = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
    return Path(paths["VLLM_PYTHON"]), Path(paths["VLLM_TINY_MODEL"])


def vllm_env(kv_space_gib: int = 1, store: bool = False) -> dict:
    """The environment a vLLM CPU server needs here (docs/INSTALL.md): a KV
    space of its own (its default takes 92 % of a NUMA node and dies), no
    thread pinning to core 0, one OpenMP thread, no hub."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.update({
        "VLLM_CPU_KVCACHE_SPACE": str(int(kv_space_gib)),  # whole GiB: vLLM 0.32 refuses "1.0"
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    })
    if store:
        env["VLLM_ENABLE_RESPONSES_API_STORE"] = "1"
    return env


def launch_vllm(name: str, run_dir: Path, max_model_len: int = 4096, max_num_seqs: int = 8, port: int = 0,
                kv_space_gib: int = 1, store: bool = False, extra: list | None = None) -> Engine:
    """Starts a real vLLM OpenAI server on a loopback port serving the tiny
    model as VLLM_MODEL, as the docs tell operators to run it (prefix
    caching, prompt-token details), without waiting for it (start-up takes
    30-45 s: start several, then wait_vllm each)."""
    python, model = vllm_install()
    port = port or free_port()
    log_path = run_dir / f"vllm-{name}.log"
    args = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", VLLM_MODEL, "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
            "--enable-prefix-caching", "--enable-prompt-tokens-details", "--enforce-eager",
            "--disable-uvicorn-access-log", *(extra or [])]
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=open(log_path, "w"), cwd=run_dir, env=vllm_env(kv_space_gib, store),
                            start_new_session=True)
    return VllmEngine(name, port, proc, log_path, args)


def wait_vllm(engine: Engine, timeout: float = 240.0) -> Engine:
    """Until the server's /health answers 200 (it refuses connections while
    it loads)."""
    try:
        wait_http_ok(f"vllm {engine.name}", engine.proc, f"{engine.url}/health", engine.log_path,
                     time.time() + timeout)
    except RuntimeError:
        stop_vllm(engine)
        raise
    return engine


def stop_vllm(engine: Engine) -> None:
    """SIGTERM to the server's process group (its engine core is a child
    process), then SIGKILL after 20 s."""
    if engine.proc.poll() is not None:
        return
    try:
        os.killpg(engine.proc.pid, signal.SIGTERM)
        engine.proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(engine.proc.pid, signal.SIGKILL)
        engine.proc.wait(timeout=10)
    except ProcessLookupError:
        pass


SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


class Scrape:
    """/stats/prometheus parsed: name -> type, and name -> [(labels, value)]."""

    def __init__(self, text: str):
        self.types: dict[str, str] = {}
        self.samples: dict[str, list[tuple[dict, float]]] = {}
        for line in text.splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split(" ", 3)
                self.types[name] = kind
            elif line and not line.startswith("#"):
                m = SAMPLE.match(line)
                assert m, f"unparsable line {line!r}"
                labels = dict(LABEL.findall(m.group(2) or ""))
                self.samples.setdefault(m.group(1), []).append((labels, float(m.group(3))))

    def metric(self, sample: str) -> str:
        """The metric a sample belongs to: a histogram's `_bucket`, `_sum`
        and `_count` samples are its own."""
        for suffix in ("_bucket", "_sum", "_count"):
            base = sample.removesuffix(suffix)
            if base != sample and self.types.get(base) == "histogram":
                return base
        return sample

    def labels(self, name: str) -> set[str]:
        return {k for labels, _ in self.samples.get(name, []) for k in labels}

    def value(self, name: str, **labels) -> float:
        return sum(v for l, v in self.samples.get(name, []) if all(l.get(k) == x for k, x in labels.items()))


    def quantile(self, name: str, q: float, **labels) -> float | None:
        """The q-quantile of histogram `name` over the series with these
        labels (their buckets added), interpolated in its bucket as
        Prometheus' histogram_quantile does; None with no sample."""
        buckets: dict[float, float] = {}
        for l, v in self.samples.get(name + "_bucket", []):
            if all(l.get(k) == x for k, x in labels.items()):
                le = float(l["le"])
                buckets[le] = buckets.get(le, 0.0) + v
        bounds = sorted(buckets)
        if not bounds or buckets[bounds[-1]] == 0:
            return None
        rank = q * buckets[bounds[-1]]
        lower, below = 0.0, 0.0
        for le in bounds:
            if buckets[le] >= rank:
                if le == float("inf"):
                    return lower
                return lower + (le - lower) * (rank - below) / max(buckets[le] - below, 1e-9)
            lower, below = le, buckets[le]
        return lower


def scrape(envoy: "Envoy") -> Scrape:
    """The Envoy's /stats/prometheus, parsed."""
    with urllib.request.urlopen(f"http://127.0.0.1:{envoy.admin_port}/stats/prometheus", timeout=10) as r:
        return Scrape(r.read().decode())


class MissingStat(LookupError):
    """Envoy.stat asked for a stat Envoy does not have."""


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

    def stat(self, name: str, missing_ok: bool = False) -> int:
        """The value of the stat named exactly `name`. A stat Envoy does
        not have is an error (MissingStat, naming the closest stats Envoy
        has), never a 0: a renamed or misspelled stat would otherwise pass
        every `== 0`. The plugin defines its stats when it starts, so they
        exist with 0 before first use; pass `missing_ok=True` (then a
        missing stat reads 0) only for one Envoy creates on first use."""
        value = self.stats(re.escape(name) + "$").get(name)
        if value is not None:
            return value
        if missing_ok:
            return 0
        # Close matches among the stats of the same first name part
        # (`wasmcustom`, `cluster`, ...), else among all of them.
        have = list(self.stats(re.escape(name.split(".")[0] + ".")) or self.stats(""))
        close = difflib.get_close_matches(name, have, n=5, cutoff=0.6)
        raise MissingStat(f"Envoy has no stat {name!r}; closest: {close or 'none'}; see {self.log_path}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        terminate(self.proc)


def static_cluster(name: str, port: int) -> dict:
    """A STATIC plain-HTTP/1.1 cluster of one loopback endpoint, declared as
    envoy/envoy.yaml declares its region clusters."""
    return {
        "name": name,
        "connect_timeout": "1s",
        "type": "STATIC",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}]}],
        },
    }


# The Envoy cluster of the deployment's exchange listeners (the plugin's
# `exchange.cluster`), and the listener each Envoy answers peers on.
PEERS_CLUSTER = "llm_geo_router_peers"
EXCHANGE_LISTENER = "llm_exchange"
# The deployment's peer certificates envoy/envoy.yaml names (relative to the
# repository root): mutual TLS on the peers' listener and cluster.
PEER_CERTS = ROOT / "envoy" / "certs"
PEER_SAN = "llm-geo-router-peer"


def peer_certs(directory: Path = PEER_CERTS) -> Path:
    """The demo deployment's CA and peer certificate (scripts/peer-certs,
    which scripts/setup runs; made here if missing)."""
    if not (directory / "peer.pem").is_file():
        subprocess.run([str(ROOT / "scripts" / "peer-certs"), str(directory)], check=True, timeout=60)
    return directory


# Where the repository's Envoy configs name the peer certificates: the
# demo's (relative to the repository root) and the compose file's (inside
# the container).
CERT_DIRS_IN_CONFIGS = ("envoy/certs/", "/etc/envoy/certs/")


def move_cert_paths(node, prefixes, to) -> None:
    """Every `filename` of a parsed Envoy config that starts with one of
    `prefixes`, moved under `to(name)` (`name`: what follows the prefix)."""
    if isinstance(node, dict):
        for k, v in node.items():
            prefix = next((p for p in prefixes if isinstance(v, str) and v.startswith(p)), None)
            if k == "filename" and prefix is not None:
                node[k] = to(v.removeprefix(prefix))
            else:
                move_cert_paths(v, prefixes, to)
    elif isinstance(node, list):
        for v in node:
            move_cert_paths(v, prefixes, to)


def absolute_cert_paths(node) -> None:
    """Every peer certificate's `filename` of a parsed Envoy config pointed
    at the deployment's certificates here (an absolute path), so that an
    Envoy started anywhere finds them."""
    move_cert_paths(node, CERT_DIRS_IN_CONFIGS, lambda name: str(peer_certs() / name))


def peer_tls_context(certs: Path | None = None, client_cert: bool = True):
    """A client TLS context as a peer of the deployment makes it (its CA
    trusted, the peers' name checked), presenting the peer certificate of
    `certs` (default the deployment's) unless `client_cert` is false."""
    trusted = peer_certs()
    ctx = ssl.create_default_context(cafile=str(trusted / "peers-ca.pem"))
    ctx.check_hostname = True
    if client_cert:
        d = certs or trusted
        ctx.load_cert_chain(str(d / "peer.pem"), str(d / "peer.key"))
    return ctx


def post_peer(port: int, path: str, body: bytes, certs: Path | None = None,
              client_cert: bool = True, timeout: float = 10) -> int:
    """POSTs `body` to an Envoy's peers' listener as a peer does (mutual
    TLS, SNI and name llm-geo-router-peer); the HTTP status."""
    raw = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    with peer_tls_context(certs, client_cert).wrap_socket(raw, server_hostname=PEER_SAN) as tls:
        tls.sendall(f"POST {path} HTTP/1.1\r\nhost: {PEER_SAN}\r\n"
                    f"content-type: application/octet-stream\r\ncontent-length: {len(body)}\r\n"
                    f"connection: close\r\n\r\n".encode() + body)
        resp = http.client.HTTPResponse(tls)
        resp.begin()
        resp.read()
        return resp.status


def set_exchange(cfg: dict, peers: tuple[int, list[int]] | None) -> None:
    """The exchange of envoy/envoy.yaml (its `llm_exchange` listener, its
    PEERS_CLUSTER and the plugin's `exchange` block) made that of one Envoy
    of a deployment on loopback: `peers` is (this Envoy's exchange port,
    every Envoy's exchange port, its own included, as a headless Service
    lists it). With None the exchange is taken out whole: one Envoy on its
    own, as without the `exchange` block."""
    res = cfg["static_resources"]
    if peers is None:
        res["listeners"] = [l for l in res["listeners"] if l["name"] != EXCHANGE_LISTENER]
        res["clusters"] = [c for c in res["clusters"] if c["name"] != PEERS_CLUSTER]
        for p in wasm_plugins(cfg):
            plugin = json.loads(p["configuration"]["value"])
            plugin.pop("exchange", None)
            p["configuration"]["value"] = json.dumps(plugin)
        return
    own, ports = peers
    (lis,) = [l for l in res["listeners"] if l["name"] == EXCHANGE_LISTENER]
    lis["address"]["socket_address"]["port_value"] = own
    (cl,) = [c for c in res["clusters"] if c["name"] == PEERS_CLUSTER]
    (group,) = cl["load_assignment"]["endpoints"]
    template = group["lb_endpoints"][0]
    group["lb_endpoints"] = []
    for port in ports:
        lb = copy.deepcopy(template)
        lb["endpoint"]["address"]["socket_address"]["port_value"] = port
        group["lb_endpoints"].append(lb)


def render_config(engines: dict[str, Engine | list[Engine]] | None, admin_port: int, port: int,
                  overrides: dict | None = None, base: Path = DEMO_CONFIG,
                  prometheus_port: int | None = None, peers: tuple[int, list[int]] | None = None) -> dict:
    """The demo Envoy config on the given ports. `engines` maps an engine
    name of ALL_ENGINES to the engine started for it, or to the list of
    replicas started for that region (each becomes an endpoint wherever the
    demo config has the region's engine). With `prometheus_port`, a STATIC
    cluster PROMETHEUS_CLUSTER points at a Prometheus on that loopback port.
    `peers` is this Envoy's place in a deployment sharing through the
    exchange (see set_exchange); without it the Envoy is on its own."""
    cfg = yaml.safe_load(base.read_text())
    cfg["admin"]["address"]["socket_address"]["port_value"] = admin_port
    set_exchange(cfg, peers)
    absolute_cert_paths(cfg)
    for lis in cfg["static_resources"]["listeners"]:
        if lis["name"] != EXCHANGE_LISTENER:
            lis["address"]["socket_address"]["port_value"] = port
    if engines is not None:
        # An engine's port in the demo config is its cluster's first
        # endpoint; every endpoint on that port (a region cluster's failover
        # endpoints too) is moved to where the test started the engine, or
        # becomes one endpoint per replica (same metadata: same region).
        as_list = {n: (e if isinstance(e, list) else [e]) for n, e in engines.items()}
        by_cluster = {c: es for n, (c, _, _) in ALL_ENGINES.items() if (es := as_list.get(n))}
        clusters = cfg["static_resources"]["clusters"]
        demo_port = {cl["name"]: cl["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
                     ["address"]["socket_address"]["port_value"] for cl in clusters}
        moved = {demo_port[c]: [e.port for e in es] for c, es in by_cluster.items() if c in demo_port}
        for cl in clusters:
            for group in cl["load_assignment"]["endpoints"]:
                out = []
                for lb in group["lb_endpoints"]:
                    ports = moved.get(lb["endpoint"]["address"]["socket_address"]["port_value"])
                    for p in ports or [None]:
                        lb2 = copy.deepcopy(lb)
                        if p is not None:
                            lb2["endpoint"]["address"]["socket_address"]["port_value"] = p
                        out.append(lb2)
                group["lb_endpoints"] = out
    if prometheus_port is not None:
        cfg["static_resources"]["clusters"].append(static_cluster(PROMETHEUS_CLUSTER, prometheus_port))
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


# How much longer than its timeout a wait for an event keeps looking. Beside
# busy_load.py a test process has waited up to 15 s for a CPU (the sleeper's
# worst, docs/RELIABILITY.md); a wait's timeout bounds a stuck component,
# never how soon the event must come (a test that means that asserts it), so
# a stall must not spend it.
STALL_S = 20.0


def until(probe, ok, timeout: float, what):
    """Calls `probe()` until `ok` holds for its value and returns that value;
    raises AssertionError naming `what` (a string, or a function that makes
    one) and the last value once `timeout`
    plus STALL_S has passed. The value is read again after the deadline, so
    a stall that crosses it cannot fail a wait whose event has come."""
    deadline = time.time() + timeout + STALL_S
    while True:
        value = probe()
        if ok(value):
            return value
        if time.time() > deadline:
            what = what() if callable(what) else what
            raise AssertionError(f"{what}: {value!r} after {timeout} s (+{STALL_S:.0f} s for a stall)")
        time.sleep(0.05)


def wait_ready(proc: subprocess.Popen, admin_port: int, log_path: Path, timeout: float = 60.0) -> None:
    """Until Envoy's admin /ready answers 200; raises if Envoy exits or the
    timeout passes (the caller stops the process)."""
    wait_http_ok("envoy", proc, f"http://127.0.0.1:{admin_port}/ready", log_path, time.time() + timeout)


def wait_http_ok(what: str, proc: subprocess.Popen, url: str, log_path: Path, deadline: float) -> None:
    """Until `url` answers 200; raises if `proc` exits first or `deadline`
    (a time.time() value) passes."""
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}; see {log_path}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.time() > deadline:
            raise RuntimeError(f"{what} not ready by its deadline; see {log_path}")
        time.sleep(0.1)


@dataclass
class Response:
    status: int
    headers: dict
    body: bytes
    ttfb_ms: float
    total_ms: float
    started: float = 0.0  # time.monotonic() when the request was sent

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
                        (t1 - t0) * 1000, (t2 - t0) * 1000, t0)
    finally:
        conn.close()


def chat(port: int, messages: list, headers: dict | None = None, timeout: float = 30.0, **fields) -> Response:
    body = {"model": "emulated-model", "messages": messages, "max_tokens": 4, **fields}
    return request(port, "POST", "/v1/chat/completions", body, headers, timeout)


def stream_chat(port: int, content: str, max_tokens: int = 8, timeout: float = 30.0) -> dict:
    """One streamed chat asking for its usage, timed as its client sees it:
    to the first body byte, to the end. Returns the status, the route
    header's terms, the engine replica, the usage and when it was sent
    (time.monotonic())."""
    body = json.dumps({"model": "emulated-model", "stream": True, "max_tokens": max_tokens,
                       "stream_options": {"include_usage": True},
                       "messages": [{"role": "user", "content": content}]})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t0 = time.monotonic()
    try:
        conn.request("POST", "/v1/chat/completions", body=body, headers={"content-type": "application/json"})
        resp = conn.getresponse()
        first = resp.read(1)
        t1 = time.monotonic()
        rest = first + resp.read()
        t2 = time.monotonic()
        headers = {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()
    usage = None
    for line in rest.decode(errors="replace").splitlines():
        if line.startswith("data: {"):
            chunk = json.loads(line[len("data: "):])
            if chunk.get("usage"):
                usage = chunk["usage"]
    route = dict(p.strip().split("=", 1) for p in headers.get("x-llm-route", "").split(";") if "=" in p)
    return {"status": resp.status, "route": route, "replica": headers.get("x-engine-replica"),
            "ttft_ms": (t1 - t0) * 1000, "total_ms": (t2 - t0) * 1000, "usage": usage, "started": t0}


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
class Prometheus:
    """A real Prometheus on loopback scraping emulator replicas (every
    sample carries the target's `region` and `replica` labels)."""

    proc: subprocess.Popen
    port: int
    run_dir: Path
    config_path: Path
    log_path: Path
    targets: dict[str, list[tuple[str, int]]]  # region -> [(replica, port)]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def api(self, path: str, **params) -> dict:
        """GET /api/v1/<path>; the answer's `data` (raises on an API error)."""
        from urllib.parse import urlencode

        url = f"{self.url}/api/v1/{path}" + (f"?{urlencode(params)}" if params else "")
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus {path} {params}: {body}")
        return body["data"]

    def query(self, promql: str) -> list:
        """An instant query at now: the result list as the API returns it
        (for a vector: [{"metric": {labels}, "value": [ts, "v"]}, ...])."""
        return self.api("query", query=promql)["result"]

    def by(self, promql: str, label: str = "region") -> dict[str, float]:
        """An instant vector query as {value of `label`: sample value}."""
        return {s["metric"].get(label, ""): float(s["value"][1]) for s in self.query(promql)}

    def wait_for(self, promql: str, expected: dict[str, float], label: str = "region",
                 timeout: float = 10.0) -> dict[str, float]:
        """Until `by(promql, label)` equals `expected` (a scrape or two
        behind the engines); returns it, or raises with the last answer."""
        return until(lambda: self.by(promql, label), lambda got: got == expected, timeout,
                     f"prometheus {promql!r}, expected {expected}")

    def wait_targets_up(self, timeout: float = 20.0) -> None:
        """Until every target has been scraped and is up."""
        want = {r for ts in self.targets.values() for r, _ in ts}
        deadline = time.time() + timeout + STALL_S
        up: dict = {}
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}; see {self.log_path}")
            try:
                up = self.by("up", "replica")
            except OSError:
                up = {}
            if set(up) == want and all(v == 1 for v in up.values()):
                return
            time.sleep(0.2)
        raise RuntimeError(f"prometheus targets not all up after {timeout} s: {up}; see {self.log_path}")

    def stop(self) -> None:
        terminate(self.proc)


def start_prometheus(run_dir: Path, targets: dict[str, list], scrape_interval: str = "1s",
                     timeout: float = 30.0, wait_targets: bool = True, metrics_path: str = "/metrics",
                     job: str = "engines") -> Prometheus:
    """Starts /usr/bin/prometheus on a free loopback port, scraping each
    target's `metrics_path` on 127.0.0.1 every `scrape_interval` (job
    `job`), and waits until
    it is ready and (unless not `wait_targets`: then call wait_targets_up)
    has scraped every target once (all `up`). Prometheus 2.42 applies its
    targets on a fixed 5 s tick, so the first scrapes come ~5 s after start.

    `targets` maps a region to its replicas: Engines (labelled with their
    names) or bare ports (labelled `<region>-<i>`). Every series gets the
    labels `region` and `replica` (and Prometheus' own `job`, `instance`).
    Config, log (prometheus.log) and TSDB (prom-data/) are in run_dir."""
    if not PROMETHEUS.exists():
        raise RuntimeError(f"missing {PROMETHEUS}: run scripts/setup (it installs Prometheus)")
    named = {region: [(t.name, t.port) if isinstance(t, Engine) else (f"{region}-{i}", int(t))
                      for i, t in enumerate(ts)] for region, ts in targets.items()}
    config = {
        "global": {"scrape_interval": scrape_interval, "scrape_timeout": scrape_interval,
                   "evaluation_interval": scrape_interval},
        "scrape_configs": [{
            "job_name": job,
            "metrics_path": metrics_path,
            "static_configs": [{"targets": [f"127.0.0.1:{port}"], "labels": {"region": region, "replica": name}}
                               for region, ts in named.items() for name, port in ts],
        }],
    }
    config_path = run_dir / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    log_path = run_dir / "prometheus.log"
    port = free_port()
    proc = subprocess.Popen(
        [str(PROMETHEUS), f"--config.file={config_path}", f"--storage.tsdb.path={run_dir / 'prom-data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--web.enable-lifecycle"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(log_path, "w"), cwd=run_dir)
    prom = Prometheus(proc, port, run_dir, config_path, log_path, named)
    try:
        deadline = time.time() + timeout
        wait_http_ok("prometheus", proc, f"{prom.url}/-/ready", log_path, deadline)
        if wait_targets:
            prom.wait_targets_up(max(1.0, deadline - time.time()))
    except BaseException:
        prom.stop()
        raise
    return prom


class Load:
    """`n` concurrent slow chat requests sent straight to one replica (not
    through Envoy), each decoding `max_tokens` tokens: with more requests
    than the replica's --max-concurrency, the rest wait in its queue, as on
    a saturated engine (vllm:num_requests_running at the limit,
    vllm:num_requests_waiting > 0). close() drops the connections."""

    def __init__(self, engine: Engine, n: int, max_tokens: int = 5000, timeout: float = 60.0):
        import threading

        self.engine = engine
        self.conns = [http.client.HTTPConnection("127.0.0.1", engine.port, timeout=timeout) for _ in range(n)]
        self.statuses: list[int | None] = [None] * n
        body = json.dumps({"model": "emulated-model", "max_tokens": max_tokens,
                           "messages": [{"role": "user", "content": "saturate"}]})

        def run(i: int, conn: http.client.HTTPConnection) -> None:
            try:
                conn.request("POST", "/v1/chat/completions", body=body,
                             headers={"content-type": "application/json"})
                resp = conn.getresponse()
                resp.read()
                self.statuses[i] = resp.status
            except (OSError, http.client.HTTPException):
                pass  # close() dropped it, or the replica was stopped

        self.threads = [threading.Thread(target=run, args=(i, c), daemon=True) for i, c in enumerate(self.conns)]
        for t in self.threads:
            t.start()

    def close(self) -> None:
        for c in self.conns:
            sock = c.sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        for t in self.threads:
            t.join(timeout=5)


def saturate(engine: Engine, n: int, max_tokens: int = 5000) -> Load:
    """Saturates one replica with `n` concurrent slow requests (see Load)."""
    return Load(engine, n, max_tokens)


@dataclass
class Fleet:
    """Three emulated regions and one Envoy, as in the demo.

    A region is one emulator by default, named as the region; started with
    `replicas={"near": 3}` it is three, named near-0, near-1, near-2 (the
    emulator's --name: their x-engine-replica header and /admin/stats
    name), all endpoints of the region's cluster. `replicas[region]` lists
    a region's replicas; `engines[region]` is its first."""

    run_dir: Path
    engines: dict[str, Engine] = field(default_factory=dict)
    fallbacks: dict[str, Engine] = field(default_factory=dict)
    envoys: list[Envoy] = field(default_factory=list)
    replicas: dict[str, list[Engine]] = field(default_factory=dict)
    prometheus: Prometheus | None = None
    # Each Envoy's peers' listener port, when the fleet is shared.
    exchange_ports: list[int] = field(default_factory=list)

    def __post_init__(self):
        for name, e in self.engines.items():
            self.replicas.setdefault(name, [e])

    @property
    def envoy(self) -> Envoy:
        return self.envoys[0]

    @property
    def port(self) -> int:
        return self.envoy.port

    def start(self, overrides: dict | None = None, engine_extra: dict | None = None, envoys: int = 1,
              fallback: bool = False, envoy_edit=None, replicas: dict[str, int] | None = None,
              prometheus: bool = False, scrape_interval: str = "1s", shared: bool = False) -> "Fleet":
        """Starts the engines, then (with `prometheus`) a Prometheus scraping
        every replica of the three regions, then the Envoys (with a cluster
        PROMETHEUS_CLUSTER when there is a Prometheus). `engine_extra` maps
        a region to flags for all its replicas, or a replica name (near-2)
        to flags for that one (applied after the region's). With `shared`
        the Envoys are one deployment sharing what they learn, through
        envoy/envoy.yaml's exchange (each Envoy's peers' port is in
        `exchange_ports`); without it each is on its own."""
        extra = engine_extra or {}
        for name, (_, delay, mode) in DEMO_REGIONS.items():
            n = (replicas or {}).get(name, 1)
            if n < 1:
                raise ValueError(f"{name}: {n} replicas")
            names = [name] if n == 1 else [f"{name}-{i}" for i in range(n)]
            self.replicas[name] = []
            for rname in names:
                flags = merge_engine_flags(extra.get(name) or [], extra.get(rname) or []) \
                    if rname != name else extra.get(name)
                self.replicas[name].append(start_engine(rname, self.run_dir, delay, mode, flags))
            self.engines[name] = self.replicas[name][0]
        if fallback:
            for name, (_, delay, mode) in FALLBACK_REGIONS.items():
                self.fallbacks[name] = start_engine(name, self.run_dir, delay, mode)
        if prometheus:
            # Its first scrapes come ~5 s after it starts: wait for them
            # while the Envoys start.
            self.prometheus = start_prometheus(self.run_dir, dict(self.replicas), scrape_interval,
                                               wait_targets=False)
        prom_port = self.prometheus.port if self.prometheus else None
        if shared:
            self.exchange_ports = [free_port() for _ in range(envoys)]
        for i in range(envoys):
            peers = (self.exchange_ports[i], self.exchange_ports) if shared else None
            cfg = render_config({**self.replicas, **self.fallbacks}, free_port(), free_port(), overrides,
                                prometheus_port=prom_port, peers=peers)
            if envoy_edit is not None:
                envoy_edit(cfg)
            self.envoys.append(start_envoy(self.run_dir, cfg, name=f"envoy{i}"))
        for e in self.envoys:
            self.wait_snapshot(e)
            self.wait_rtt_settled(e)
        if self.prometheus is not None:
            self.prometheus.wait_targets_up()
        return self

    def start_llama(self, overrides: dict | None = None, envoys: int = 1, shared: bool = False,
                    slots: int = 4, slot_ctx: int = 4096) -> "Fleet":
        """Three real llama-server regions (start_llama: `slots` slots of
        `slot_ctx` tokens each) in place of the emulators, then the Envoys,
        every region's `engine` set to `llamacpp`; ready once every Envoy's
        probe has every region healthy and its context limit read (their
        loopback round trips may read 0 ms, so not wait_snapshot)."""
        for name in DEMO_REGIONS:
            self.engines[name] = start_llama(name, self.run_dir, ctx=slot_ctx * slots, parallel=slots)
        return self.start_envoys_for_engines("llamacpp", overrides, envoys, shared)

    def start_vllm(self, overrides: dict | None = None, envoys: int = 1, shared: bool = False,
                   max_model_len: int = 4096, vllm: dict[str, dict] | None = None) -> "Fleet":
        """Three real vLLM 0.32 regions (launch_vllm; `vllm` maps a region
        to launch_vllm's keyword arguments for it) in place of the
        emulators, then the Envoys with envoy/envoy.yaml's regions (every
        `engine` is `vllm` there); ready once every Envoy's probe has every
        region healthy and its context limit read."""
        per = vllm or {}
        launched = [launch_vllm(name, self.run_dir, **{"max_model_len": max_model_len, **per.get(name, {})})
                    for name in DEMO_REGIONS]
        try:
            for e in launched:
                self.engines[e.name] = wait_vllm(e)
        except BaseException:
            for e in launched:
                stop_vllm(e)
            raise
        return self.start_envoys_for_engines("vllm", overrides, envoys, shared)

    def start_envoys_for_engines(self, engine: str, overrides: dict | None, envoys: int,
                                 shared: bool) -> "Fleet":
        """The Envoys in front of real engines already in `self.engines`,
        envoy/envoy.yaml's regions with every `engine` set to `engine`;
        ready once every probe has every region healthy and its limit read."""
        self.replicas = {n: [e] for n, e in self.engines.items()}
        demo = plugin_config(yaml.safe_load(DEMO_CONFIG.read_text()))
        regions = [{**r, "engine": engine} for r in demo["regions"]]
        overrides = {**(overrides or {}), "regions": regions}
        if shared:
            self.exchange_ports = [free_port() for _ in range(envoys)]
        for i in range(envoys):
            peers = (self.exchange_ports[i], self.exchange_ports) if shared else None
            cfg = render_config(self.engines, free_port(), free_port(), overrides, peers=peers)
            self.envoys.append(start_envoy(self.run_dir, cfg, name=f"envoy{i}"))
        self.wait_limits()
        return self

    def wait_limits(self, timeout: float = 30.0) -> None:
        """Until every Envoy's probe has every region healthy and its
        context limit read (real engines on loopback: their round trips may
        read 0 ms, so not wait_snapshot)."""
        deadline = time.time() + timeout + STALL_S
        for e in self.envoys:
            while True:
                s = e.stats(r"llm_geo_router\.region\.[a-z]+\.(healthy|max_model_len)$")
                if all(s.get(f"wasmcustom.llm_geo_router.region.{n}.{k}", 0)
                       for n in DEMO_REGIONS for k in ("healthy", "max_model_len")):
                    break
                if time.time() > deadline:
                    raise RuntimeError(f"regions not ready: {s}; see {e.log_path}")
                time.sleep(0.1)

    def wait_snapshot(self, envoy: Envoy, timeout: float = 20.0) -> None:
        """Until the probe has published and measured every region's RTT."""
        def complete(s: dict) -> bool:
            rtts = [s.get(f"wasmcustom.llm_geo_router.region.{n}.rtt_ms", 0) for n in self.engines]
            return s.get("wasmcustom.llm_geo_router.probe.snapshot_version", 0) >= 2 and all(v > 0 for v in rtts)

        until(lambda: envoy.stats(r"llm_geo_router\.(probe\.snapshot_version|region\.[a-z0-9_]+\.rtt_ms)$"),
              complete, timeout, f"no complete fleet snapshot; see {envoy.log_path}")

    def wait_rtt_settled(self, envoy: Envoy, timeout: float = 15.0) -> None:
        """Until the probe's measured round trips rank the emulated regions
        as their network delays do, the nearest within 20 ms of its own.
        A stall of a busy machine can inflate a fleet's first samples (seen:
        near at 116 ms against its 5 ms, and cold prompts then went to mid,
        rightly on what the router measured); the probe keeps the least of
        its last samples, so a quiet round or two brings it back. Tests that
        take near for the nearest start from there; past the timeout they
        start as they are and judge by the router's decisions."""
        delays = {n: DEMO_REGIONS[n][1] for n in self.engines if n in DEMO_REGIONS}
        order = sorted(delays, key=delays.get)
        deadline = time.time() + timeout
        while time.time() < deadline:
            s = envoy.stats(r"llm_geo_router\.region\.[a-z0-9_]+\.rtt_ms$")
            rtt = [s.get(f"wasmcustom.llm_geo_router.region.{n}.rtt_ms", 0) for n in order]
            if all(a < b for a, b in zip(rtt, rtt[1:])) and 0 < rtt[0] <= delays[order[0]] + 20:
                return
            time.sleep(0.1)

    def restart_engine(self, name: str, extra: list | None = None, replica: int = 0) -> Engine:
        """Restarts region `name`'s engine (its replica number `replica`)
        on the same port, under the same name."""
        reps = self.replicas.setdefault(name, [self.engines[name]])
        old = reps[replica]
        old.kill()
        _, delay, mode = DEMO_REGIONS[name]
        reps[replica] = start_engine(old.name, self.run_dir, delay, mode, extra, port=old.port)
        self.engines[name] = reps[0]
        return reps[replica]

    def stop(self) -> None:
        try:
            for e in self.envoys:
                e.stop()
        finally:
            try:
                if self.prometheus is not None:
                    self.prometheus.stop()
            finally:
                engines = [*self.engines.values(), *self.fallbacks.values(),
                           *(e for es in self.replicas.values() for e in es)]
                for e in {id(e): e for e in engines}.values():
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
    return until(lambda: probe_ticks(envoy), lambda t: t >= target, timeout,
                 f"the probe ran fewer than {n} rounds; see {envoy.log_path}")


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
