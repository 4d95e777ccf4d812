"""docker-compose.yml and its Envoy configuration. envoy/envoy-compose.yaml is
generated from envoy/envoy.yaml (the configuration the local demo and this
suite run), so the two cannot drift; regenerate it after changing
envoy/envoy.yaml:

    .venv/bin/python wasm-tests/test_compose.py --write

test_configs.py loads the generated file in `envoy --mode validate`. Docker
itself does not run here: these tests check the compose file's references,
not a running stack.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import yaml

import harness

COMPOSE = harness.ROOT / "docker-compose.yml"
COMPOSE_CONFIG = harness.ROOT / "envoy" / "envoy-compose.yaml"

# Where the demo's engines listen on loopback -> the compose service that
# plays the same engine (every service listens on port 8000).
SERVICES = {
    18001: "near",
    18002: "mid",
    18003: "far",
    18011: "near-fallback",
    18012: "mid-fallback",
    18013: "far-fallback",
}
SERVICE_PORT = 8000
# The demo's two Envoys' peers' listeners on loopback (envoy/envoy.yaml's
# llm_geo_router_peers cluster) -> the compose service of each Envoy; both
# containers listen for peers on the first one's port.
ENVOYS = {10001: "envoy", 10011: "envoy-2"}
PEER_PORT = 10001
WASM_IN_CONTAINER = "/etc/envoy/llm_geo_router.wasm"
# The peer certificates (mutual TLS on the exchange): envoy/certs, made by
# scripts/peer-certs, mounted read-only.
CERTS_IN_DEMO = "envoy/certs/"
CERTS_IN_CONTAINER = "/etc/envoy/certs/"
WASM_IN_DEMO = "target/wasm32-wasip1/release/llm_geo_router.wasm"

HEADER = """\
# GENERATED from envoy/envoy.yaml; do not edit. Regenerate with
#   .venv/bin/python wasm-tests/test_compose.py --write
# (wasm-tests/test_compose.py fails when this file and envoy/envoy.yaml differ).
#
# The docker-compose variant of the local demo (docker-compose.yml). It differs
# from envoy/envoy.yaml only where a container differs from loopback:
#   - admin and listeners bind 0.0.0.0, so other containers (Prometheus, the
#     other Envoy) and the published ports reach them;
#   - every endpoint is a compose service resolved by name (STRICT_DNS, IPv4)
#     instead of a loopback address: the engines on port 8000, the two
#     Envoys (envoy, envoy-2) on their peers' port 10001;
#   - the .wasm is read from /etc/envoy/llm_geo_router.wasm, a bind mount of
#     target/wasm32-wasip1/release/llm_geo_router.wasm.
#
"""


def render(demo_text: str) -> str:
    """envoy/envoy-compose.yaml as it must read, from envoy/envoy.yaml's text
    (text, not parsed YAML, so that the comments carry over)."""
    lines = demo_text.splitlines(keepends=True)
    # The demo's header comment (everything before the first key) says how to
    # run the demo; the compose file gets its own.
    first_key = next(i for i, l in enumerate(lines) if re.match(r"[a-z_]+:", l))
    body = "".join(lines[first_key:])
    # Of that header, the paragraph on the three roots is kept.
    roots = next(i for i, l in enumerate(lines) if "root ids" in l)
    roles = "".join(lines[roots:first_key])
    out = HEADER + roles + body

    def once(pattern: str, repl: str, count: int | None = None) -> None:
        nonlocal out
        out, n = re.subn(pattern, repl, out)
        if n == 0 or (count is not None and n != count):
            raise ValueError(f"envoy/envoy.yaml changed shape: {pattern!r} matched {n} times")

    once(r"(?m)^(\s+)socket_address: \{ address: 127\.0\.0\.1, port_value: (9901|10000|10001) \}$",
         r"\1socket_address: { address: 0.0.0.0, port_value: \2 }", count=3)
    once(re.escape(f"filename: {WASM_IN_DEMO}"), f"filename: {WASM_IN_CONTAINER}", count=4)
    once(re.escape(f"filename: {CERTS_IN_DEMO}"), f"filename: {CERTS_IN_CONTAINER}", count=3)

    def endpoint(m: re.Match) -> str:
        port = int(m.group(1))
        if port in ENVOYS:
            return f"address: {ENVOYS[port]}, port_value: {PEER_PORT}"
        if port not in SERVICES:
            raise ValueError(f"envoy/envoy.yaml: endpoint port {port} has no compose service")
        return f"address: {SERVICES[port]}, port_value: {SERVICE_PORT}"

    out, n = re.subn(r"address: 127\.0\.0\.1, port_value: (\d+)", endpoint, out)
    if n == 0:
        raise ValueError("envoy/envoy.yaml changed shape: no endpoint on 127.0.0.1")
    once(r"(?m)^(\s+)type: STATIC\n", r"\1type: STRICT_DNS\n\1dns_lookup_family: V4_ONLY\n")
    if "127.0.0.1" in out:
        raise ValueError("a 127.0.0.1 address is left in the compose configuration")
    return out


def expected() -> str:
    return render(harness.DEMO_CONFIG.read_text())


def test_compose_envoy_config_is_generated_from_the_demo_config():
    assert COMPOSE_CONFIG.read_text() == expected(), (
        "envoy/envoy-compose.yaml is out of date: run .venv/bin/python wasm-tests/test_compose.py --write")


def strip_compose_differences(cfg: dict) -> dict:
    """The parsed config with the compose differences undone, for a check
    that does not rely on render()'s text substitutions."""
    for sa in (cfg["admin"]["address"]["socket_address"],
               *(l["address"]["socket_address"] for l in cfg["static_resources"]["listeners"])):
        sa["address"] = "127.0.0.1"
    for p in harness.wasm_plugins(cfg):
        p["vm_config"]["code"]["local"]["filename"] = WASM_IN_DEMO

    harness.move_cert_paths(cfg, [CERTS_IN_CONTAINER], lambda name: CERTS_IN_DEMO + name)
    by_service = {(s, SERVICE_PORT): port for port, s in SERVICES.items()}
    by_service.update({(s, PEER_PORT): port for port, s in ENVOYS.items()})
    for cl in cfg["static_resources"]["clusters"]:
        assert cl.pop("type") == "STRICT_DNS" and cl.pop("dns_lookup_family") == "V4_ONLY"
        cl["type"] = "STATIC"
        for group in cl["load_assignment"]["endpoints"]:
            for lb in group["lb_endpoints"]:
                sa = lb["endpoint"]["address"]["socket_address"]
                sa["port_value"] = by_service[(sa["address"], sa["port_value"])]
                sa["address"] = "127.0.0.1"
    return cfg


def test_compose_envoy_config_differs_from_the_demo_only_in_addresses_and_wasm_path():
    compose = strip_compose_differences(yaml.safe_load(COMPOSE_CONFIG.read_text()))
    demo = yaml.safe_load(harness.DEMO_CONFIG.read_text())
    # Same keys in the same order too (cluster "type" moved: compare parsed).
    for cl in demo["static_resources"]["clusters"]:
        cl["type"] = cl.pop("type")
    for cl in compose["static_resources"]["clusters"]:
        cl["type"] = cl.pop("type")
    assert compose == demo


def compose_file() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_every_file_docker_compose_mounts_or_builds_from_exists():
    services = compose_file()["services"]
    checked = []
    for name, svc in services.items():
        build = svc.get("build")
        if build:
            context = harness.ROOT / build.get("context", ".")
            assert context.is_dir(), f"{name}: build context {context} missing"
            dockerfile = context / build.get("dockerfile", "Dockerfile")
            assert dockerfile.is_file(), f"{name}: {dockerfile} missing"
            checked.append(dockerfile)
        for v in svc.get("volumes", []):
            if isinstance(v, str):
                source = v.split(":")[0]
                assert source.startswith("."), f"{name}: named volume {v!r}, expected a bind mount"
            else:
                if v.get("type") != "bind":
                    continue
                source = v["source"]
            path = (harness.ROOT / source).resolve()
            # The .wasm is build output; the suite does not start without it.
            assert path.exists(), f"{name}: mounts {source}, which does not exist"
            checked.append(path)
    assert harness.WASM in checked
    assert COMPOSE_CONFIG in checked


def test_docker_compose_runs_the_generated_config_the_tested_envoy_and_every_endpoint_service():
    c = compose_file()
    services = c["services"]
    version = harness.subprocess.run([str(harness.ENVOY), "--version"], capture_output=True, text=True).stdout
    assert "/1.40.0/" in version, version
    # Both Envoys of the deployment, each a host of the peers' cluster, run
    # the generated config and the built .wasm; the peers' port is
    # published on no host port (only the compose network reaches it).
    published = []
    for name in ENVOYS.values():
        envoy = services[name]
        assert envoy["image"] == "envoyproxy/envoy:v1.40.0", name
        mounts = {v["target"]: v["source"] for v in envoy["volumes"] if isinstance(v, dict)}
        config_arg = envoy["command"][envoy["command"].index("-c") + 1]
        assert mounts[config_arg] == "./envoy/envoy-compose.yaml", name
        assert mounts[WASM_IN_CONTAINER] == "./" + WASM_IN_DEMO, name
        assert mounts[CERTS_IN_CONTAINER.rstrip("/")] == "./" + CERTS_IN_DEMO.rstrip("/"), name
        ports = [p.rsplit(":", 1) for p in envoy["ports"]]
        assert all(host.startswith("127.0.0.1:") for host, _ in ports), envoy["ports"]
        assert sorted(int(inner) for _, inner in ports) == [9901, 10000], (name, envoy["ports"])
        published += [host for host, _ in ports]
    assert len(set(published)) == len(published), published
    # Every endpoint the config names is a service that listens on 8000.
    for port, name in SERVICES.items():
        cmd = services[name]["command"]
        assert cmd[cmd.index("--listen") + 1] == f"0.0.0.0:{SERVICE_PORT}", name
    # Prometheus scrapes Envoy's admin /stats/prometheus.
    prom = yaml.safe_load((harness.ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    job = next(j for j in prom["scrape_configs"] if j["job_name"] == "envoy")
    assert job["metrics_path"] == "/stats/prometheus"
    assert job["static_configs"][0]["targets"] == [f"{name}:9901" for name in ENVOYS.values()]


def comparable_flags(args: list) -> list[tuple[str, object]]:
    """Emulator arguments by flag name (harness.engine_flag_pairs), sorted,
    a number's value as a number ("5" and "5.0" alike)."""
    def value(v):
        try:
            return float(v)
        except (TypeError, ValueError):
            return v
    return sorted(((f, value(v)) for f, v in harness.engine_flag_pairs(args)), key=repr)


def test_compose_engines_run_as_the_suite_runs_them():
    # Every emulator flag harness.start_engine gives the engine, by name and
    # value (repeated ones as often), and no other, apart from where it
    # listens (checked above).
    services = compose_file()["services"]
    for name, (_, delay, mode) in harness.ALL_ENGINES.items():
        cmd = [str(a) for a in services[name.replace("_", "-")]["command"]]
        got = [p for p in comparable_flags(cmd) if p[0] != "--listen"]
        want = [p for p in comparable_flags(harness.engine_flags(name, delay, mode)) if p[0] != "--listen"]
        missing = [p for p in want if p not in got]
        unexpected = [p for p in got if p not in want]
        assert got == want, (name, {"missing from docker-compose": missing, "not in the suite": unexpected})


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        COMPOSE_CONFIG.write_text(expected())
        print(f"wrote {COMPOSE_CONFIG.relative_to(harness.ROOT)}")
    elif sys.argv[1:] == ["--check"]:
        sys.exit(0 if COMPOSE_CONFIG.read_text() == expected() else 1)
    else:
        sys.exit("usage: test_compose.py --write | --check")
