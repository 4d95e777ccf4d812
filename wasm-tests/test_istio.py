"""The Istio manifests (envoy/istio/) and the OCI image (oci/Dockerfile).

No Kubernetes here: the Envoy configuration inside the manifests (the
EXTENSION_CONFIG and HTTP_FILTER patches, the early header mutation, the
cluster_header route, the VirtualService's fallback route, the ServiceEntry
clusters with the failover patch, the bootstrap override's singleton) is
extracted and assembled into one Envoy bootstrap, as istiod and the Istio
agent would assemble it, with the local .wasm instead of the OCI image and
emulated engines instead of the regions' hosts. A real Envoy validates it
and routes requests through it. The plugin JSON in the manifests is checked
against envoy/envoy.yaml's so the two cannot drift apart, and the manifests
against Istio's CRD schemas when the npm package that carries them installs.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

import harness
from harness import chat

ISTIO = harness.ROOT / "envoy" / "istio"
INSTALL = harness.ROOT / "docs" / "INSTALL.md"
# The ConfigMap that holds the built .wasm (docs/INSTALL.md creates it).
WASM_CONFIGMAP = "llm-geo-router-wasm"
DOCKERFILE = harness.ROOT / "oci" / "Dockerfile"
WASM_TYPE = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
RBAC_TYPE = "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC"
# What istio-agent delivers under a filter's name when it cannot fetch or
# verify the module and the filter is FAIL_OPEN (pkg/wasm/convert.go,
# allowHTTPTypedConfig: an RBAC filter without rules allows everything).
AGENT_ALLOW = {"@type": RBAC_TYPE, "rules_stat_prefix": "wasm-default-allow"}
# The plugin's internal request headers, never forwarded upstream; the
# engine's (x-llm-tier, x-llm-kv-action) are.
INTERNAL_HEADERS = ("x-llm-cluster", "x-llm-pool", "x-llm-stream")
HCM = "envoy.filters.network.http_connection_manager"

# The only plugin-JSON fields allowed to differ from envoy/envoy.yaml's: the
# clusters are named by Istio (outbound|<port>||<host>), and a cluster name
# with '|' is no valid :authority for the probe's callouts, so each region
# names its host.
ISTIO_FIELDS = ("cluster", "fallback_cluster", "authority")

# Where the emulated engines stand in for the manifests' hosts.
HOST_ENGINE = {
    "near.llm.example.com": "near", "mid.llm.example.com": "mid", "far.llm.example.com": "far",
    "near-fallback.llm.example.com": "near_fallback", "mid-fallback.llm.example.com": "mid_fallback",
    "far-fallback.llm.example.com": "far_fallback",
}

# (filter manifest, routing manifest, patch context)
FLAVOURS = {
    "gateway": ("gateway.yaml", "gateway-routing.yaml", "GATEWAY"),
    "sidecar": ("sidecar.yaml", "sidecar-routing.yaml", "SIDECAR_OUTBOUND"),
}


def docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((ISTIO / name).read_text()) if d]


def server(flavour: str) -> tuple[str, int]:
    """The host and port istiod builds the virtual host from: the Gateway
    server's (gateway), the ServiceEntry's (sidecar)."""
    _, routing, _ = FLAVOURS[flavour]
    if flavour == "gateway":
        gw = next(d for d in docs(routing) if d["kind"] == "Gateway")
        (srv,) = gw["spec"]["servers"]
        (host,) = srv["hosts"]
        return host, srv["port"]["number"]
    se = next(d for d in docs(routing) if d["kind"] == "ServiceEntry")
    (host,) = se["spec"]["hosts"]
    (port,) = se["spec"]["ports"]
    return host, port["number"]


def vhost(flavour: str) -> str:
    host, port = server(flavour)
    return f"{host}:{port}"


def patches(name: str, apply_to: str) -> list[dict]:
    return [p for d in docs(name) if d["kind"] == "EnvoyFilter"
            for p in d["spec"]["configPatches"] if p["applyTo"] == apply_to]


def bootstrap_override() -> dict:
    (cm,) = docs("bootstrap.yaml")
    assert cm["kind"] == "ConfigMap"
    return json.loads(cm["data"]["custom_bootstrap.json"])


def singleton() -> dict:
    (ext,) = bootstrap_override()["bootstrap_extensions"]
    return ext


def extension_configs(name: str) -> dict[str, dict]:
    return {p["patch"]["value"]["name"]: p["patch"]["value"] for p in patches(name, "EXTENSION_CONFIG")}


def embedded_plugin_jsons() -> dict[str, dict]:
    out = {"bootstrap.yaml probe": json.loads(singleton()["typed_config"]["config"]["configuration"]["value"])}
    for flavour, (name, *_rest) in FLAVOURS.items():
        for ext_name, ext in extension_configs(name).items():
            out[f"{name} {ext_name}"] = json.loads(ext["typed_config"]["config"]["configuration"]["value"])
    return out


def service_clusters() -> dict[str, tuple[str, int]]:
    """Istio's cluster name of every ServiceEntry host and port -> (host, port)."""
    out = {}
    for d in docs("regions.yaml"):
        if d["kind"] == "ServiceEntry":
            for host in d["spec"]["hosts"]:
                for port in d["spec"]["ports"]:
                    out[f"outbound|{port['number']}||{host}"] = (host, port["number"])
    return out


def without_istio_fields(plugin: dict) -> dict:
    p = copy.deepcopy(plugin)
    for r in p.get("regions", []):
        for f in ISTIO_FIELDS:
            r.pop(f, None)
    return p


# --- static checks -----------------------------------------------------------------


def test_plugin_json_matches_the_demo_config_except_the_istio_fields():
    demo = harness.plugin_config(yaml.safe_load(harness.DEMO_CONFIG.read_text()))
    embedded = embedded_plugin_jsons()
    assert len(embedded) == 5, embedded.keys()
    for where, plugin in embedded.items():
        assert without_istio_fields(plugin) == without_istio_fields(demo), where
        assert [r["name"] for r in plugin["regions"]] == [r["name"] for r in demo["regions"]], where
    first = next(iter(embedded.values()))
    for where, plugin in embedded.items():
        assert plugin == first, f"{where} differs from the probe's"


def test_plugin_clusters_are_the_ones_istio_generates_for_the_service_entries():
    clusters = service_clusters()
    for where, plugin in embedded_plugin_jsons().items():
        for r in plugin["regions"]:
            for f in ("cluster", "fallback_cluster"):
                assert r[f] in clusters, (where, r["name"], f, r[f])
            assert r["authority"] == clusters[r["cluster"]][0], (where, r["name"])
    # The fallback route in each VirtualService goes to a region's cluster.
    for flavour, (_, routing, _) in FLAVOURS.items():
        vs = next(d for d in docs(routing) if d["kind"] == "VirtualService")
        dest = vs["spec"]["http"][0]["route"][0]["destination"]
        assert f"outbound|{dest['port']['number']}||{dest['host']}" in clusters, flavour


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_filters_are_ecds_references_guard_then_router_before_envoys_router(flavour):
    name, _, context = FLAVOURS[flavour]
    exts = extension_configs(name)
    assert set(exts) == {"llm_geo_router_guard", "llm_geo_router_router"}
    for ext_name, ext in exts.items():
        tc = ext["typed_config"]
        assert tc["@type"] == WASM_TYPE
        c = tc["config"]
        assert c["root_id"] == ext_name.rsplit("_", 1)[1]
        assert c["vm_config"]["vm_id"] == "llm_geo_router"
        assert c["allow_on_headers_stop_iteration"] is True
        assert c["failure_policy"] == "FAIL_OPEN"
        remote = c["vm_config"]["code"]["remote"]
        assert remote["http_uri"]["uri"].startswith(("oci://", "https://"))
        assert isinstance(remote["sha256"], str) and len(remote["sha256"]) == 64
    filters = patches(name, "HTTP_FILTER")
    assert [f["patch"]["value"]["name"] for f in filters] == ["llm_geo_router_guard", "llm_geo_router_router"]
    for f in filters:
        # Each INSERT_BEFORE the router lands after the previous insert.
        assert f["patch"]["operation"] == "INSERT_BEFORE"
        assert f["match"]["context"] == context
        assert f["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"] == "envoy.filters.http.router"
        cd = f["patch"]["value"]["config_discovery"]
        assert cd["config_source"] == {"ads": {}, "initial_fetch_timeout": "0s"}
        # The Wasm config, and the RBAC allow filter istio-agent substitutes
        # when the module cannot be fetched.
        assert cd["type_urls"] == [WASM_TYPE, RBAC_TYPE]


def test_probe_singleton_shares_the_vm_id_and_reloads():
    ext = singleton()
    tc = ext["typed_config"]
    assert ext["name"] == "envoy.bootstrap.wasm"
    assert tc["singleton"] is True
    c = tc["config"]
    assert (c["root_id"], c["failure_policy"], c["vm_config"]["vm_id"]) == ("probe", "FAIL_RELOAD", "llm_geo_router")
    # A bootstrap extension cannot be pulled by the Istio agent: a local file.
    assert c["vm_config"]["code"]["local"]["filename"].startswith("/")


GATEWAY_VALUES = "gateway-values.yaml"
POD_PATCH = "sidecar-pod-patch.yaml"


def listener_ports(name: str) -> set[int]:
    return {p["match"]["listener"]["portNumber"] for p in patches(name, "HTTP_FILTER") + patches(name, "NETWORK_FILTER")}


def route_matches(name: str) -> list[dict]:
    return [p["match"]["routeConfiguration"] for p in patches(name, "HTTP_ROUTE")]


def test_gateway_ports_follow_the_helm_values_and_the_gateway_server():
    """istiod matches listener patches on the port the proxy listens on (the
    Service's targetPort for the Gateway server's port) and route patches on
    the route configuration's name, http.<Gateway server port>. Both are
    read from the files an operator installs: the Helm values and the
    Gateway, not from constants."""
    (values,) = docs(GATEWAY_VALUES)
    host, server_port = server("gateway")
    (svc_port,) = [p for p in values["service"]["ports"] if p["port"] == server_port]
    # The chart's default mapping (manifests/charts/gateway/values.yaml).
    assert {(p["name"], p["port"], p["targetPort"]) for p in values["service"]["ports"]} >= {
        ("status-port", 15021, 15021), ("http2", 80, 80), ("https", 443, 443)}
    assert listener_ports("gateway.yaml") == {svc_port["targetPort"]}
    for m in route_matches("gateway.yaml"):
        assert m["portNumber"] == server_port
        assert m["vhost"]["name"] == f"{host}:{server_port}"
    # The gateway the manifests select is the one the values install.
    for d in docs("gateway.yaml") + docs("gateway-routing.yaml"):
        sel = d["spec"].get("workloadSelector", {}).get("labels") or d["spec"].get("selector")
        if sel:
            assert sel == {"istio": "ingressgateway"}, d["metadata"]["name"]


def test_sidecar_ports_are_llm_internals_and_not_the_regions():
    """The sidecar's filters patch the outbound listener and route
    configuration of llm.internal's port, which no region shares (every
    region host has its own outbound listener on its port)."""
    host, port = server("sidecar")
    assert listener_ports("sidecar.yaml") == {port}
    for m in route_matches("sidecar.yaml"):
        assert m["portNumber"] == port and m["vhost"]["name"] == f"{host}:{port}"
    region_ports = {p["number"] for d in docs("regions.yaml") if d["kind"] == "ServiceEntry"
                    for p in d["spec"]["ports"]}
    assert port not in region_ports, (port, region_ports)


def rendered_user_volumes(annotations: dict) -> tuple[list[dict], list[dict]]:
    """The volumes and istio-proxy mounts the sidecar injection template
    makes of the userVolume annotations: `- name: "{{ $index }}"` then the
    value, for each key of the JSON object."""
    out = []
    for key in ("sidecar.istio.io/userVolume", "sidecar.istio.io/userVolumeMount"):
        obj = json.loads(annotations[key])
        assert isinstance(obj, dict), f"{key}: the documented form is a JSON object keyed by volume name"
        out.append([{"name": name, **spec} for name, spec in obj.items()])
    return out[0], out[1]


def probe_module_dir_and_file() -> tuple[str, str]:
    path = Path(singleton()["typed_config"]["config"]["vm_config"]["code"]["local"]["filename"])
    return str(path.parent), path.name


def test_gateway_values_mount_the_probe_module_and_the_bootstrap_override():
    """The gateway template ignores the userVolume annotations: the module
    comes through the chart's volumes/volumeMounts, the bootstrap through
    the bootstrapOverride annotation the gateway template honours."""
    (values,) = docs(GATEWAY_VALUES)
    (cm,) = docs("bootstrap.yaml")
    assert values["podAnnotations"]["sidecar.istio.io/bootstrapOverride"] == cm["metadata"]["name"]
    assert not any(k.startswith("sidecar.istio.io/userVolume") for k in values["podAnnotations"])
    directory, _ = probe_module_dir_and_file()
    (vol,) = values["volumes"]
    (mount,) = values["volumeMounts"]
    assert mount["name"] == vol["name"] and mount["mountPath"] == directory and mount["readOnly"] is True
    assert vol["configMap"]["name"] == WASM_CONFIGMAP


def test_sidecar_pod_patch_mounts_the_probe_module_and_selects_the_filters():
    (patch,) = docs(POD_PATCH)
    meta = patch["spec"]["template"]["metadata"]
    (cm,) = docs("bootstrap.yaml")
    assert meta["annotations"]["sidecar.istio.io/bootstrapOverride"] == cm["metadata"]["name"]
    (ef,) = [d for d in docs("sidecar.yaml") if d["kind"] == "EnvoyFilter"]
    assert ef["spec"]["workloadSelector"]["labels"].items() <= meta["labels"].items()
    volumes, mounts = rendered_user_volumes(meta["annotations"])
    directory, _ = probe_module_dir_and_file()
    (vol,) = volumes
    (mount,) = mounts
    assert mount["name"] == vol["name"] and mount["mountPath"] == directory and mount["readOnly"] is True
    assert vol["configMap"]["name"] == WASM_CONFIGMAP


def test_install_doc_names_what_the_manifests_use():
    """docs/INSTALL.md's Istio steps create the module's ConfigMap with
    `kubectl create` (apply's last-applied annotation cannot hold 0.6 MiB),
    name the files shipped here, and require Istio 1.28."""
    text = INSTALL.read_text()
    istio = text[text.index("## Istio\n"):text.index("## docker-compose")]
    creates = re.findall(rf"kubectl (?:-n \S+ )?create configmap {WASM_CONFIGMAP} \\\n\s+--from-file=", istio)
    assert len(creates) == 2, creates  # gateway and sidecars
    assert not re.search(r"kubectl[^\n]* apply[^\n]*--from-file", istio)
    for f in (GATEWAY_VALUES, POD_PATCH, "gateway.yaml", "sidecar.yaml", "bootstrap.yaml", "regions.yaml"):
        assert f in istio, f
    assert "1.28" in istio and "istioctl proxy-config ecds" in istio
    assert harness.WASM.stat().st_size > 256 * 1024  # why apply would fail


def test_every_route_to_an_engine_removes_the_internal_headers():
    """The cluster_header routes and the VirtualService's fallback route
    forward none of the plugin's internal headers."""
    for flavour, (name, routing, _) in FLAVOURS.items():
        for p in patches(name, "HTTP_ROUTE"):
            assert sorted(p["patch"]["value"]["request_headers_to_remove"]) == sorted(INTERNAL_HEADERS), flavour
            assert p["patch"]["value"]["route"]["auto_host_rewrite"] is True, flavour
        vs = next(d for d in docs(routing) if d["kind"] == "VirtualService")
        for h in vs["spec"]["http"]:
            if "route" in h:
                assert sorted(h["headers"]["request"]["remove"]) == sorted(INTERNAL_HEADERS), (flavour, h["name"])


def test_no_outlier_detection_on_the_region_clusters():
    # It would move the probe's health callouts to the failover endpoints
    # and hide a lost region (docs/OPERATIONS.md, "Losing a region").
    for d in docs("regions.yaml"):
        if d["kind"] == "DestinationRule":
            policy = d["spec"].get("trafficPolicy", {})
            assert "outlierDetection" not in policy and "loadBalancer" not in policy, d["metadata"]["name"]


def test_oci_dockerfile_is_the_compat_wasm_image():
    lines = [l.strip() for l in DOCKERFILE.read_text().splitlines() if l.strip() and not l.strip().startswith("#")]
    assert lines[0] == "FROM scratch"
    assert [l.split()[0] for l in lines] == ["FROM", "COPY"], lines
    _, src, dest = lines[1].split()
    # The source is where `cargo build --release --target wasm32-wasip1` puts it.
    assert harness.ROOT / src == harness.WASM, src
    assert harness.WASM.exists()
    assert dest in ("plugin.wasm", "./plugin.wasm", "/plugin.wasm")
    ignore = [l for l in (harness.ROOT / "oci" / "Dockerfile.dockerignore").read_text().splitlines()
              if l and not l.startswith("#")]
    assert ignore == ["*", f"!{src}"]
    header = DOCKERFILE.read_text()
    assert "cargo build --release --target wasm32-wasip1 -p llm-geo-router" in header
    # Single platform, no attestations: the pushed digest is the image
    # manifest's, the one istio-agent compares with sha256.
    build = " ".join(l.lstrip("# ").rstrip("\\ ") for l in header.splitlines()
                     if "docker buildx build" in l or "-f oci/Dockerfile" in l)
    for flag in ("docker buildx build", "--platform linux/amd64", "--provenance=false", "--sbom=false",
                 "-f oci/Dockerfile -t <registry>/llm-geo-router:<tag> --push ."):
        assert flag in build, (flag, build)
    assert "docker buildx imagetools inspect <registry>/llm-geo-router:<tag>" in header


# --- the manifests' Envoy configuration in a real Envoy -----------------------------


def local_wasm(wasm_config: dict) -> dict:
    """The filter configuration as the Istio agent hands it to Envoy: the
    module downloaded to a local file."""
    c = copy.deepcopy(wasm_config)
    c["config"]["vm_config"]["code"] = {"local": {"filename": str(harness.WASM)}}
    return c


def vs_routes(routing: str) -> list[dict]:
    """The VirtualService's HTTP routes as Envoy routes (only what these use)."""
    vs = next(d for d in docs(routing) if d["kind"] == "VirtualService")
    out = []
    for h in vs["spec"]["http"]:
        if "directResponse" in h:
            dr = h["directResponse"]
            out.append({"name": h["name"], "match": {"prefix": "/"},
                        "direct_response": {"status": dr["status"], "body": {"inline_string": dr["body"]["string"]}}})
        else:
            (m,) = h["match"]
            dest = h["route"][0]["destination"]
            r = {"name": h["name"], "match": {"prefix": m["uri"]["prefix"]},
                 "route": {"cluster": f"outbound|{dest['port']['number']}||{dest['host']}",
                           "timeout": h["timeout"]}}
            if "headers" in h:
                assert set(h["headers"]) == {"request"} and set(h["headers"]["request"]) == {"remove"}
                r["request_headers_to_remove"] = h["headers"]["request"]["remove"]
            out.append(r)
    return out


def clusters(ports: dict[str, int]) -> list[dict]:
    """The ServiceEntry clusters (DNS hosts replaced by the emulators'
    loopback ports), the DestinationRule's connect timeout, and the failover
    patch merged as istiod merges it."""
    dr = next(d for d in docs("regions.yaml") if d["kind"] == "DestinationRule")
    timeout = dr["spec"]["trafficPolicy"]["connectionPool"]["tcp"]["connectTimeout"]

    def endpoint(host: str, port: int, metadata: dict | None = None) -> dict:
        assert port == 8000
        # A STRICT_DNS endpoint's hostname is the name it resolved (what
        # auto_host_rewrite sends as Host).
        ep = {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1",
                                                          "port_value": ports[HOST_ENGINE[host]]}},
                           "hostname": host}}
        if metadata:
            ep["metadata"] = metadata
        return ep

    out = {}
    for name, (host, port) in service_clusters().items():
        out[name] = {"name": name, "connect_timeout": timeout, "type": "STATIC",
                     "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [endpoint(host, port)]}]}}
    for p in patches("regions.yaml", "CLUSTER"):
        assert p["patch"]["operation"] == "MERGE"
        m = p["match"]["cluster"]
        cl = out[f"outbound|{m['portNumber']}||{m['service']}"]
        for group in p["patch"]["value"]["load_assignment"]["endpoints"]:
            cl["load_assignment"]["endpoints"].append({"priority": group["priority"], "lb_endpoints": [
                endpoint(lb["endpoint"]["address"]["socket_address"]["address"],
                         lb["endpoint"]["address"]["socket_address"]["port_value"], lb.get("metadata"))
                for lb in group["lb_endpoints"]]})
    return list(out.values())


def assemble(flavour: str, ports: dict[str, int], admin_port: int, port: int, run_dir: Path | None,
             plugin_override: dict | None = None, wasm_filters: bool = True,
             drop_allow_stop_iteration: bool = False, agent_allow: bool = False,
             type_urls: list[str] | None = None) -> dict:
    """One Envoy bootstrap from the manifests. With run_dir, the filters are
    fetched over ECDS (from files, where Istio serves them over ADS);
    without, their configurations are inline (for --mode validate, which
    starts no subscription). agent_allow: ECDS delivers what istio-agent
    does when it cannot fetch the module (an allow-all RBAC filter under
    each filter's name); type_urls replaces the manifests' list."""
    name, routing, context = FLAVOURS[flavour]
    vhost_name = vhost(flavour)
    exts = extension_configs(name)

    def plugin_json(c: dict) -> dict:
        if plugin_override:
            v = json.loads(c["configuration"]["value"])
            c["configuration"]["value"] = json.dumps(harness.deep_merge(v, plugin_override))
        return c

    http_filters = []
    for f in patches(name, "HTTP_FILTER") if wasm_filters else []:
        ref = f["patch"]["value"]
        tc = local_wasm(exts[ref["name"]]["typed_config"])
        if drop_allow_stop_iteration:
            # What istiod < 1.28 makes of the patch: the field discarded.
            del tc["config"]["allow_on_headers_stop_iteration"]
        plugin_json(tc["config"])
        if agent_allow:
            tc = copy.deepcopy(AGENT_ALLOW)
        if run_dir is None:
            http_filters.append({"name": ref["name"], "typed_config": tc})
        else:
            path = run_dir / f"ecds-{ref['name']}.yaml"
            path.write_text(yaml.safe_dump({"resources": [{
                "@type": "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig",
                "name": ref["name"], "typed_config": tc}]}, sort_keys=False))
            cd = copy.deepcopy(ref["config_discovery"])
            cd["config_source"] = {"path_config_source": {"path": str(path)}, "resource_api_version": "V3"}
            if type_urls is not None:
                cd["type_urls"] = type_urls
            http_filters.append({"name": ref["name"], "config_discovery": cd})
    http_filters.append({"name": "envoy.filters.http.router", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}})

    (early,) = patches(name, "NETWORK_FILTER")
    assert early["match"]["listener"]["filterChain"]["filter"]["name"] == HCM
    hcm = {"@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
           "stat_prefix": "llm_ingress", "http_filters": http_filters}
    merged = copy.deepcopy(early["patch"]["value"]["typed_config"])
    assert merged.pop("@type") == hcm["@type"]
    hcm.update(merged)

    # INSERT_FIRST patches in order, each before the routes already there
    # (istiod's patchHTTPRoutes: without a route match, prepended).
    routes = vs_routes(routing)
    for route in patches(name, "HTTP_ROUTE"):
        assert route["patch"]["operation"] == "INSERT_FIRST"
        assert route["match"]["routeConfiguration"]["vhost"]["name"] == vhost_name
        assert "route" not in route["match"]["routeConfiguration"]["vhost"]
        routes.insert(0, copy.deepcopy(route["patch"]["value"]))
    hcm["route_config"] = {"name": "istio_route", "virtual_hosts": [
        {"name": vhost_name, "domains": ["*"], "routes": routes}]}

    ext = copy.deepcopy(singleton())
    cfg = ext["typed_config"]["config"]
    cfg["vm_config"]["code"]["local"]["filename"] = str(harness.WASM)
    plugin_json(cfg)
    return {
        # Istio's bootstrap names the node; filesystem ECDS requires it.
        "node": {"id": f"istio-{flavour}", "cluster": f"istio-{flavour}"},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "bootstrap_extensions": [ext],
        "static_resources": {
            "listeners": [{"name": "istio_listener",
                           "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
                           "filter_chains": [{"filters": [{"name": HCM, "typed_config": hcm}]}]}],
            "clusters": clusters(ports),
        },
    }


DUMMY_PORTS = {e: 1 for e in HOST_ENGINE.values()}


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_assembled_istio_config_validates(flavour, run_dir):
    cfg = assemble(flavour, DUMMY_PORTS, harness.free_port(), harness.free_port(), None)
    path = run_dir / f"istio-{flavour}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    r = harness.validate(path)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    # Validate mode configures the filters (not the bootstrap singleton):
    # the plugin JSON with Istio's cluster names is accepted.
    for role in ("guard", "router"):
        assert f"llm-geo-router {role}: configured" in out, out[-3000:]


FAST_PROBE = {"probe": {"tick_ms": 300, "timeout_ms": 300, "snapshot_max_age_ms": 3000}}
FORGED = {"x-llm-cluster": "outbound|8000||far.llm.example.com", "x-llm-tier": "critical", "x-llm-kv-action": "fetch"}


# Besides the harness's (x-llm-tier, x-llm-cluster, x-llm-kv-action): what
# else the engines echo of the request they received.
ECHO = ["--echo-header", "x-llm-pool", "--echo-header", "x-llm-stream", "--echo-header", "host"]


def start_istio_fleet(flavour: str, run_dir: Path, wasm_filters: bool = True, plugin_override: dict | None = None,
                      drop_allow_stop_iteration: bool = False, agent_allow: bool = False,
                      type_urls: list[str] | None = None, wait_snapshot: bool = True) -> harness.Fleet:
    fleet = harness.Fleet(run_dir)
    try:
        for n, (_, delay, mode) in {**harness.DEMO_REGIONS, **harness.FALLBACK_REGIONS}.items():
            engine = harness.start_engine(n, run_dir, delay, mode, extra=ECHO)
            (fleet.engines if n in harness.DEMO_REGIONS else fleet.fallbacks)[n] = engine
        ports = {n: e.port for n, e in {**fleet.engines, **fleet.fallbacks}.items()}
        cfg = assemble(flavour, ports, harness.free_port(), harness.free_port(), run_dir,
                       harness.deep_merge(copy.deepcopy(FAST_PROBE), plugin_override or {}), wasm_filters,
                       drop_allow_stop_iteration, agent_allow, type_urls)
        fleet.envoys.append(harness.start_envoy(run_dir, cfg, name=f"envoy-{flavour}"))
        if wait_snapshot:
            fleet.wait_snapshot(fleet.envoy)
    except Exception:
        fleet.stop()
        raise
    return fleet


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_istio_config_routes_through_the_plugin(flavour, run_dir):
    """The probe measured every region (wait_snapshot), and the router picks
    the region and sets the cluster Istio named: cold prompts go to the
    nearest region, a client-sent cluster header is ignored. What reaches
    the engine: the tier the guard resolved, none of the plugin's internal
    headers (removed by the route once it is chosen), and the Host of the
    endpoint (auto_host_rewrite), streamed or not."""
    fleet = start_istio_fleet(flavour, run_dir)
    try:
        for i in range(4):
            stream = {"stream": True} if i % 2 else {}
            r = chat(fleet.port, [{"role": "user", "content": f"istio {flavour} cold prompt {i}"}],
                     headers={**FORGED, "x-llm-pool": "fallback", "x-llm-stream": "true"}, **stream)
            assert r.status == 200, r.body[:300]
            assert r.replica == "near", r.headers
            assert r.route["region"] == "near" and r.route["reason"] == "rtt", r.route
            for h in INTERNAL_HEADERS:
                assert r.headers[f"x-echo-{h}"] == "-", (h, r.headers)
            assert r.headers["x-echo-x-llm-tier"] == "free"
            assert r.headers["x-echo-host"] == "near.llm.example.com"
        r = harness.request(fleet.port, "GET", "/metrics")
        assert r.status == 404
        assert not harness.traps(fleet.envoy)
    finally:
        fleet.stop()


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_without_the_filters_the_fallback_route_and_early_mutation_hold(flavour, run_dir):
    """What FAIL_OPEN leaves: no wasm filter ran. The VirtualService's
    fallback route sends the request to the nearest region, and the early
    header mutation has removed the client's x-llm-cluster (naming far)
    before the cluster_header route could match it."""
    fleet = start_istio_fleet(flavour, run_dir, wasm_filters=False)
    try:
        for i in range(3):
            r = chat(fleet.port, [{"role": "user", "content": f"failed open {i}"}], headers=FORGED)
            assert r.status == 200, r.body[:300]
            assert r.replica == "near", r.headers
            for h in ("x-llm-cluster", "x-llm-tier", "x-llm-kv-action"):
                assert r.headers[f"x-echo-{h}"] == "-", (h, r.headers)
    finally:
        fleet.stop()


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_failed_module_download_fails_open_through_the_rbac_substitute(flavour, run_dir):
    """What istio-agent does when it cannot fetch or verify the module:
    ECDS delivers an allow-all RBAC filter under each filter's name. With
    the manifests' type_urls Envoy takes it and requests pass, unrouted,
    through the fallback route (nearest region); with only the Wasm type
    (the manifests before) the same delivery is refused and the filter,
    left without a configuration, answers 500."""
    fleet = start_istio_fleet(flavour, run_dir, agent_allow=True, wait_snapshot=False)
    try:
        for i in range(3):
            r = chat(fleet.port, [{"role": "user", "content": f"module missing {i}"}], headers=FORGED, timeout=10)
            assert r.status == 200, r.body[:300]
            assert r.replica == "near" and "x-llm-route" not in r.headers, r.headers
            assert r.headers["x-echo-x-llm-cluster"] == "-"
        ecds = fleet.envoy.stats("extension_config_discovery")
        for name in extension_configs(FLAVOURS[flavour][0]):
            assert ecds[f"extension_config_discovery.http_filter.{name}.update_success"] == 1, ecds
        # The RBAC filter, not a Wasm VM, answered: no plugin stat moved.
        assert fleet.envoy.stat("wasmcustom.llm_geo_router.arrivals") == 0
    finally:
        fleet.stop()
    fleet = start_istio_fleet(flavour, run_dir, agent_allow=True, type_urls=[WASM_TYPE], wait_snapshot=False)
    try:
        r = chat(fleet.port, [{"role": "user", "content": "module missing, rbac refused"}], timeout=10)
        assert r.status == 500, (r.status, r.body[:300])
        ecds = fleet.envoy.stats("extension_config_discovery")
        for name in extension_configs(FLAVOURS[flavour][0]):
            assert ecds[f"extension_config_discovery.http_filter.{name}.update_rejected"] == 1, ecds
        assert "filter config has type URL envoy.extensions.filters.http.rbac.v3.RBAC" in fleet.envoy.log()
    finally:
        fleet.stop()


def test_retry_to_another_region_carries_that_regions_host(run_dir):
    """auto_host_rewrite: the near region refuses connections before the
    probe has noticed; the route retries on the failover endpoints
    (priority 1: mid, far), and the try that is served carries its own
    region's host, not near's (what TLS's auto SNI follows too)."""
    fleet = start_istio_fleet("gateway", run_dir)
    try:
        fleet.engines["near"].kill()
        r = chat(fleet.port, [{"role": "user", "content": "near is gone"}], timeout=10)
        assert r.status == 200, r.body[:300]
        assert r.route.get("region") == "near", "the probe noticed first: rerun"
        assert r.replica in ("mid", "far"), r.headers
        assert r.headers["x-echo-host"] == f"{r.replica}.llm.example.com"
    finally:
        fleet.stop()


MISSING_FIELD = "allow_on_headers_stop_iteration"


@pytest.mark.parametrize("on_timeout", ["pass_through", "reject"])
def test_body_wait_guard_without_allow_on_headers_stop_iteration(on_timeout, run_dir):
    """The manifests' filters as istiod < 1.28 delivers them: without
    allow_on_headers_stop_iteration, Envoy stops the whole stream when the
    router pauses for the body and never delivers it. The router's root
    tick expires the pause after body_wait.timeout_ms, logs the
    misconfiguration once naming the field, and lets the request through
    unrouted (the fallback route) or answers 503, as body_wait.on_timeout
    says. No trap: the resumed stream's headers are not touched again."""
    timeout_ms = 400
    fleet = start_istio_fleet("gateway", run_dir, plugin_override={
        "body_wait": {"timeout_ms": timeout_ms, "on_timeout": on_timeout}}, drop_allow_stop_iteration=True)
    try:
        for i in range(3):
            r = chat(fleet.port, [{"role": "user", "content": f"no allow {i}"}], timeout=10)
            # Not before the bound, and well before any stream timeout.
            assert timeout_ms * 0.9 <= r.total_ms < timeout_ms + 2000, r.total_ms
            if on_timeout == "pass_through":
                # Unrouted: the fallback route to the nearest region, no
                # decision header, no cluster header upstream.
                assert r.status == 200, r.body[:300]
                assert r.replica == "near" and "x-llm-route" not in r.headers, r.headers
            else:
                assert r.status == 503, r.body[:300]
                assert r.json()["error"]["code"] == "body_wait_timeout"
        log = fleet.envoy.log()
        lines = [l for l in log.splitlines() if "MISCONFIGURED" in l]
        # Once per worker (concurrency 2), naming the field.
        assert 1 <= len(lines) <= 2, lines
        assert all(MISSING_FIELD in l for l in lines)
        assert fleet.envoy.stat("wasmcustom.llm_geo_router.router.body_wait_timeout") == 3
        assert not harness.traps(fleet.envoy)
    finally:
        fleet.stop()


def test_body_wait_guard_covers_the_guard_filter_when_a_level_caps_the_tier(run_dir):
    """At ladder level 3 the guard caps free requests' output tokens, so it
    too pauses for the body: without the field it waits the bound, says so
    once naming the field, resumes the request, and the router (which then
    pauses the same way) does the same: the request passes unrouted after
    about two bounds instead of hanging."""
    timeout_ms = 400
    fleet = start_istio_fleet("gateway", run_dir, plugin_override={
        "ladder": {"forced_level": 3}, "body_wait": {"timeout_ms": timeout_ms}}, drop_allow_stop_iteration=True)
    try:
        assert fleet.envoy.stat("wasmcustom.llm_geo_router.ladder.level") == 3
        for i in range(2):
            r = chat(fleet.port, [{"role": "user", "content": f"capped, no allow {i}"}], timeout=10)
            assert r.status == 200, r.body[:300]
            assert r.replica == "near" and "x-llm-route" not in r.headers, r.headers
            assert 2 * timeout_ms * 0.9 <= r.total_ms < 2 * timeout_ms + 3000, r.total_ms
        log = fleet.envoy.log()
        for role in ("guard", "router"):
            lines = [l for l in log.splitlines() if f"llm-geo-router {role}: MISCONFIGURED" in l]
            assert 1 <= len(lines) <= 2 and all(MISSING_FIELD in l for l in lines), (role, lines)
            assert fleet.envoy.stat(f"wasmcustom.llm_geo_router.{role}.body_wait_timeout") == 2
        assert not harness.traps(fleet.envoy)
    finally:
        fleet.stop()


def test_body_wait_with_the_field_only_trips_on_a_client_that_withholds_its_body(run_dir):
    """The guard's false positive, with the field set: a client that sends
    its headers, then nothing for longer than the bound, is let through
    unrouted (no trap: the resumed stream's headers are not touched), and
    a client that sends at once is routed with no count."""
    import socket
    timeout_ms = 400
    fleet = start_istio_fleet("gateway", run_dir, plugin_override={"body_wait": {"timeout_ms": timeout_ms}})
    try:
        r = chat(fleet.port, [{"role": "user", "content": "prompt at once"}], timeout=10)
        assert r.status == 200 and r.route["region"] == "near", r.headers
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "late body"}], "max_tokens": 4})
        with socket.create_connection(("127.0.0.1", fleet.port), timeout=10) as sock:
            sock.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nhost: llm.example.com\r\n"
                          f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode())
            time.sleep(timeout_ms * 2 / 1000)
            sock.sendall(body.encode())
            head = sock.recv(65536).decode(errors="replace")
        assert head.startswith("HTTP/1.1 200"), head[:300]
        assert "x-engine-replica: near" in head.lower() and "x-llm-route" not in head.lower(), head[:600]
        assert fleet.envoy.stat("wasmcustom.llm_geo_router.router.body_wait_timeout") == 1
        assert not harness.traps(fleet.envoy)
    finally:
        fleet.stop()


def test_without_the_guard_the_misconfigured_router_hangs(run_dir):
    """What the guard prevents (and what makes the tests above fail-able):
    with body_wait.timeout_ms 0 (no guard) the same request gets no answer,
    and it never reaches an engine: Envoy stopped the stream in the filter
    chain. Without the misconfiguration, the same plugin configuration
    answers at once: the hang is the missing field, not the 0."""
    def chats_received(fleet):
        return sum(e.stats()["requests"].get("/v1/chat/completions", 0) for e in fleet.engines.values())

    fleet = start_istio_fleet("gateway", run_dir, plugin_override={"body_wait": {"timeout_ms": 0}},
                              drop_allow_stop_iteration=True)
    try:
        with pytest.raises(TimeoutError):
            chat(fleet.port, [{"role": "user", "content": "hangs"}], timeout=3)
        assert chats_received(fleet) == 0
    finally:
        fleet.stop()
    fleet = start_istio_fleet("gateway", run_dir, plugin_override={"body_wait": {"timeout_ms": 0}})
    try:
        r = chat(fleet.port, [{"role": "user", "content": "hangs"}], timeout=3)
        assert r.status == 200 and r.route["region"] == "near", (r.status, r.headers)
        assert chats_received(fleet) == 1
    finally:
        fleet.stop()


# --- Istio CRD schemas ---------------------------------------------------------------

SCHEMA_PACKAGE = "@kubernetes-models/istio@3.0.1"
SCHEMA_DIR = harness.RUNS / "_istio-schemas"
MODELS = {
    ("networking.istio.io/v1alpha3", "EnvoyFilter"): "networking.istio.io/v1alpha3/EnvoyFilter",
    ("networking.istio.io/v1", "ServiceEntry"): "networking.istio.io/v1/ServiceEntry",
    ("networking.istio.io/v1", "DestinationRule"): "networking.istio.io/v1/DestinationRule",
    ("networking.istio.io/v1", "Gateway"): "networking.istio.io/v1/Gateway",
    ("networking.istio.io/v1", "VirtualService"): "networking.istio.io/v1/VirtualService",
}
VALIDATE_JS = """
import { readFileSync } from "node:fs";
const docs = JSON.parse(readFileSync(0, "utf8"));
const failures = [];
for (const [model, doc] of docs) {
  const mod = await import("@kubernetes-models/istio/" + model);
  const Kind = mod[doc.kind];
  try { new Kind(doc).validate(); } catch (e) { failures.push(`${doc.kind}/${doc.metadata.name}: ${e.message}`); }
}
console.log(JSON.stringify(failures));
"""


def schema_package() -> Path:
    """The npm package with Istio's CRD schemas (the OpenAPI schemas of the
    CRDs, compiled to validators), installed once under wasm-tests/_runs."""
    if not (shutil.which("node") and shutil.which("npm")):
        pytest.skip("node/npm not installed: cannot install the Istio CRD schemas")
    if not (SCHEMA_DIR / "node_modules" / "@kubernetes-models" / "istio").exists():
        SCHEMA_DIR.mkdir(parents=True, exist_ok=True)
        (SCHEMA_DIR / "package.json").write_text('{"private": true, "type": "module"}\n')
        try:
            r = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--silent", SCHEMA_PACKAGE],
                               cwd=SCHEMA_DIR, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            pytest.skip(f"npm install {SCHEMA_PACKAGE} timed out")
        if r.returncode != 0:
            pytest.skip(f"npm install {SCHEMA_PACKAGE} failed: {r.stderr[-500:]}")
    return SCHEMA_DIR


def test_manifests_validate_against_the_istio_crd_schemas():
    pkg = schema_package()
    batch, kinds = [], set()
    for path in sorted(ISTIO.glob("*.yaml")):
        for d in yaml.safe_load_all(path.read_text()):
            # Helm values and a pod patch have no kind: tested above.
            if d and d.get("kind") and d["kind"] != "ConfigMap":
                batch.append([MODELS[(d["apiVersion"], d["kind"])], d])
                kinds.add(d["kind"])
    assert kinds == {k for _, k in MODELS}
    script = pkg / "validate.mjs"
    script.write_text(VALIDATE_JS)
    r = subprocess.run(["node", str(script)], input=json.dumps(batch), cwd=pkg, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout) == []
    # The validator does refuse what the schemas forbid.
    bad = copy.deepcopy(next(b for b in batch if b[1]["kind"] == "EnvoyFilter"))
    bad[1]["spec"]["configPatches"][0]["applyTo"] = "FILTER_THAT_DOES_NOT_EXIST"
    r = subprocess.run(["node", str(script)], input=json.dumps([bad]), cwd=pkg, capture_output=True,
                       text=True, timeout=120)
    assert "applyTo" in r.stdout, r.stdout + r.stderr
