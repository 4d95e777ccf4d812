"""The Istio manifests (envoy/istio/) and the OCI image (oci/Dockerfile).

No Kubernetes here: the Envoy configuration inside the manifests (the
EXTENSION_CONFIG and HTTP_FILTER patches, the early header mutation, the
cluster_header route, the VirtualService's fallback route, the ServiceEntry
clusters with the failover patch, the bootstrap override's singleton, and
the exchange: the gateway's added listener or the sidecar's inbound patches,
the peers' Service and DestinationRule, and the sidecar's PeerAuthentication
and AuthorizationPolicy) is extracted and assembled into one Envoy bootstrap
per Envoy, as istiod and the Istio agent would assemble it, with the local
.wasm instead of the OCI image, emulated engines instead of the regions'
hosts, loopback addresses instead of pod IPs, and certificates from a test
CA served over file SDS instead of the agent's. A real Envoy validates it
and routes requests through it. The plugin JSON in the manifests is checked
against envoy/envoy.yaml's so the two cannot drift apart, and the manifests
against Istio's (and Kubernetes') schemas when the npm packages that carry
them install.
"""

from __future__ import annotations

import copy
import http.client
import json
import random
import re
import shutil
import socket
import ssl
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

import harness
from harness import chat, filler

ISTIO = harness.ROOT / "envoy" / "istio"
INSTALL = harness.ROOT / "docs" / "INSTALL.md"
# The ConfigMap that holds the built .wasm (docs/INSTALL.md creates it).
WASM_CONFIGMAP = "llm-geo-router-wasm"
DOCKERFILE = harness.ROOT / "oci" / "Dockerfile"
WASM_TYPE = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
RBAC_TYPE = "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC"
TLS_SOCKET = "envoy.transport_sockets.tls"
# What istio-agent delivers under a filter's name when it cannot fetch or
# verify the module (pkg/wasm/convert.go): for a FAIL_OPEN filter an RBAC
# filter without rules (allows everything), for any other a deny-all one.
AGENT_ALLOW = {"@type": RBAC_TYPE, "rules_stat_prefix": "wasm-default-allow"}
AGENT_DENY = {"@type": RBAC_TYPE, "rules": {}, "rules_stat_prefix": "wasm-default-deny"}
# The plugin's internal request headers, never forwarded upstream; the
# engine's (x-llm-tier, x-llm-kv-action) are.
INTERNAL_HEADERS = ("x-llm-cluster", "x-llm-pool", "x-llm-stream")
HCM = "envoy.filters.network.http_connection_manager"
ROUTER_FILTER = "envoy.filters.http.router"

# The only plugin-JSON fields allowed to differ from envoy/envoy.yaml's: the
# clusters are named by Istio (outbound|<port>||<host>), and a cluster name
# with '|' is no valid :authority for the probe's callouts, so each region,
# and the exchange's peers, name their host.
ISTIO_FIELDS = ("cluster", "fallback_cluster", "authority")
ISTIO_EXCHANGE_FIELDS = ("cluster", "authority")

# Where the emulated engines stand in for the manifests' hosts.
HOST_ENGINE = {
    "near.llm.example.com": "near", "mid.llm.example.com": "mid", "far.llm.example.com": "far",
    "near-fallback.llm.example.com": "near_fallback", "mid-fallback.llm.example.com": "mid_fallback",
    "far-fallback.llm.example.com": "far_fallback",
}

# (filter manifest, routing manifest, patch context of the clients' listener)
FLAVOURS = {
    "gateway": ("gateway.yaml", "gateway-routing.yaml", "GATEWAY"),
    "sidecar": ("sidecar.yaml", "sidecar-routing.yaml", "SIDECAR_OUTBOUND"),
}
# Each flavour's probe (its bootstrap override) and its exchange's Service,
# DestinationRule (and, for sidecars, PeerAuthentication and
# AuthorizationPolicy). The two probes differ in the exchange's cluster.
BOOTSTRAPS = {"gateway": "bootstrap.yaml", "sidecar": "sidecar-bootstrap.yaml"}
EXCHANGES = {"gateway": "gateway-exchange.yaml", "sidecar": "sidecar-exchange.yaml"}
CLIENT_FILTERS = ["llm_geo_router_guard", "llm_geo_router_router"]
EXCHANGE_FILTER = "llm_geo_router_exchange"
EXCHANGE_LISTENER = "llm_exchange"
# The bootstrap's cluster through which istio-agent serves every proxy its
# workload certificate ("default") and the mesh's root ("ROOTCA") over SDS.
SDS_CLUSTER = "sds-grpc"


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


def patches(name: str, apply_to: str, context: str | None = None) -> list[dict]:
    """The EnvoyFilter patches of `name` that apply to `apply_to` (and match
    `context`, if given; extension configs match none)."""
    return [p for d in docs(name) if d["kind"] == "EnvoyFilter"
            for p in d["spec"]["configPatches"] if p["applyTo"] == apply_to
            and (context is None or p.get("match", {}).get("context") == context)]


def client_patches(flavour: str, apply_to: str) -> list[dict]:
    """The patches of the clients' listener and routes (not the exchange's)."""
    name, _, context = FLAVOURS[flavour]
    return patches(name, apply_to, context)


def envoy_filter(flavour: str) -> dict:
    (ef,) = [d for d in docs(FLAVOURS[flavour][0]) if d["kind"] == "EnvoyFilter"]
    return ef


def bootstrap_override(flavour: str) -> dict:
    (cm,) = docs(BOOTSTRAPS[flavour])
    assert cm["kind"] == "ConfigMap"
    return json.loads(cm["data"]["custom_bootstrap.json"])


def singleton(flavour: str) -> dict:
    (ext,) = bootstrap_override(flavour)["bootstrap_extensions"]
    return ext


def extension_configs(name: str) -> dict[str, dict]:
    return {p["patch"]["value"]["name"]: p["patch"]["value"] for p in patches(name, "EXTENSION_CONFIG")}


def plugin_of(wasm_config: dict) -> dict:
    return json.loads(wasm_config["configuration"]["value"])


def embedded_plugin_jsons(flavour: str) -> dict[str, dict]:
    """Every plugin JSON of a flavour: its probe's and its filters'."""
    out = {f"{BOOTSTRAPS[flavour]} probe": plugin_of(singleton(flavour)["typed_config"]["config"])}
    name = FLAVOURS[flavour][0]
    for ext_name, ext in extension_configs(name).items():
        out[f"{name} {ext_name}"] = plugin_of(ext["typed_config"]["config"])
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
    for f in ISTIO_EXCHANGE_FIELDS:
        p.get("exchange", {}).pop(f, None)
    return p


def demo_config() -> dict:
    return yaml.safe_load(harness.DEMO_CONFIG.read_text())


# --- the exchange's Kubernetes and Istio resources ---------------------------------


def exchange_doc(flavour: str, kind: str) -> dict:
    (d,) = [d for d in docs(EXCHANGES[flavour]) if d["kind"] == kind]
    return d


def peers_service(flavour: str) -> tuple[str, dict]:
    """The host of the exchange's Service and its one port."""
    svc = exchange_doc(flavour, "Service")
    (port,) = svc["spec"]["ports"]
    return f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc.cluster.local", port


def peers_cluster_name(flavour: str) -> str:
    host, port = peers_service(flavour)
    return f"outbound|{port['port']}||{host}"


def gateway_exchange_listener() -> dict:
    (p,) = patches("gateway.yaml", "LISTENER", "GATEWAY")
    assert p["patch"]["operation"] == "ADD"
    return p["patch"]["value"]


def exchange_port(flavour: str) -> int:
    """The port each Envoy takes the peers' messages on: the gateway's added
    listener's, the sidecar's inbound patches' (one for all of them)."""
    if flavour == "gateway":
        return gateway_exchange_listener()["address"]["socket_address"]["port_value"]
    ports = {p["match"]["listener"]["portNumber"] for p in patches("sidecar.yaml", "HTTP_FILTER", "SIDECAR_INBOUND")}
    ports |= {p["match"]["routeConfiguration"]["portNumber"] for p in patches("sidecar.yaml", "HTTP_ROUTE", "SIDECAR_INBOUND")}
    (port,) = ports
    return port


def exchange_identities(flavour: str) -> list[str]:
    """The SPIFFE identities the flavour's exchange admits: the gateway
    listener's SAN match, the principals the sidecars' AuthorizationPolicy
    does not deny."""
    if flavour == "gateway":
        tls = gateway_exchange_listener()["filter_chains"][0]["transport_socket"]["typed_config"]
        sans = tls["common_tls_context"]["combined_validation_context"]["default_validation_context"][
            "match_typed_subject_alt_names"]
        assert all(s["san_type"] == "URI" and set(s["matcher"]) == {"exact"} for s in sans), sans
        return [s["matcher"]["exact"] for s in sans]
    ap = exchange_doc("sidecar", "AuthorizationPolicy")
    (rule,) = ap["spec"]["rules"]
    (src,) = rule["from"]
    return ["spiffe://" + p for p in src["source"]["notPrincipals"]]


# --- static checks -----------------------------------------------------------------


def test_plugin_json_matches_the_demo_config_except_the_istio_fields():
    """Each flavour's plugin JSON (its probe's and its three filters') is
    envoy/envoy.yaml's but for the names Istio gives: the regions' clusters
    and authorities, and the exchange's cluster and authority. The exchange
    block is compared field by field: only those two may differ, and both
    must be there when envoy.yaml turns the exchange on."""
    demo = harness.plugin_config(demo_config())
    assert demo["exchange"]["cluster"], "envoy.yaml runs the exchange"
    by_flavour = {}
    for flavour in FLAVOURS:
        embedded = embedded_plugin_jsons(flavour)
        assert len(embedded) == 4, embedded.keys()
        for where, plugin in embedded.items():
            assert without_istio_fields(plugin) == without_istio_fields(demo), where
            assert [r["name"] for r in plugin["regions"]] == [r["name"] for r in demo["regions"]], where
            for r, d in zip(plugin["regions"], demo["regions"]):
                assert {f for f in ("cluster", "fallback_cluster") if f in r} == \
                       {f for f in ("cluster", "fallback_cluster") if f in d}, (where, r["name"])
                assert "authority" in r, (where, r["name"])
            # Renamed, not dropped: without exchange.cluster the plugin runs
            # without the exchange.
            assert set(ISTIO_EXCHANGE_FIELDS) <= set(plugin.get("exchange", {})), (where, plugin.get("exchange"))
        first = next(iter(embedded.values()))
        for where, plugin in embedded.items():
            assert plugin == first, f"{where} differs from its probe's"
        by_flavour[flavour] = first
    # Between the flavours only the exchange's peers differ: each flavour's
    # own Envoys.
    gw, sc = (copy.deepcopy(by_flavour[f]) for f in ("gateway", "sidecar"))
    assert gw["exchange"] != sc["exchange"]
    for p in (gw, sc):
        for f in ISTIO_EXCHANGE_FIELDS:
            del p["exchange"][f]
    assert gw == sc


def test_plugin_clusters_are_the_ones_istio_generates_for_the_service_entries():
    clusters = service_clusters()
    for flavour in FLAVOURS:
        for where, plugin in embedded_plugin_jsons(flavour).items():
            for r in plugin["regions"]:
                for f in ("cluster", "fallback_cluster"):
                    assert r[f] in clusters, (where, r["name"], f, r[f])
                assert r["authority"] == clusters[r["cluster"]][0], (where, r["name"])
            # The exchange's peers: the outbound cluster of the flavour's
            # Service of its own pods, and that Service's host.
            host, _ = peers_service(flavour)
            assert plugin["exchange"]["cluster"] == peers_cluster_name(flavour), where
            assert plugin["exchange"]["authority"] == host, where
    # The fallback route in each VirtualService goes to a region's cluster.
    for flavour, (_, routing, _) in FLAVOURS.items():
        vs = next(d for d in docs(routing) if d["kind"] == "VirtualService")
        dest = vs["spec"]["http"][0]["route"][0]["destination"]
        assert f"outbound|{dest['port']['number']}||{dest['host']}" in clusters, flavour


def demo_exchange_filter() -> dict:
    (c,) = [c for c in harness.wasm_plugins(demo_config()) if c.get("root_id") == "exchange"]
    return c


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_filters_are_ecds_references_guard_then_router_before_envoys_router(flavour):
    name, _, context = FLAVOURS[flavour]
    exts = extension_configs(name)
    assert set(exts) == {*CLIENT_FILTERS, EXCHANGE_FILTER}
    for ext_name, ext in exts.items():
        tc = ext["typed_config"]
        assert tc["@type"] == WASM_TYPE
        c = tc["config"]
        assert c["name"] == ext_name
        assert c["root_id"] == ext_name.rsplit("_", 1)[1]
        assert c["vm_config"]["vm_id"] == "llm_geo_router"
        assert c["allow_on_headers_stop_iteration"] is True
        # The client filters fail open; the exchange never lets a peer's
        # message through unchecked.
        assert c["failure_policy"] == ("FAIL_CLOSED" if ext_name == EXCHANGE_FILTER else "FAIL_OPEN")
        remote = c["vm_config"]["code"]["remote"]
        assert remote["http_uri"]["uri"].startswith(("oci://", "https://"))
        assert isinstance(remote["sha256"], str) and len(remote["sha256"]) == 64
    # The exchange filter is envoy.yaml's but for the module's source.
    ours = copy.deepcopy(exts[EXCHANGE_FILTER]["typed_config"]["config"])
    theirs = copy.deepcopy(demo_exchange_filter())
    for c in (ours, theirs):
        del c["vm_config"]["code"], c["configuration"]
    assert ours == theirs
    filters = client_patches(flavour, "HTTP_FILTER")
    assert [f["patch"]["value"]["name"] for f in filters] == CLIENT_FILTERS
    for f in filters:
        # Each INSERT_BEFORE the router lands after the previous insert.
        assert f["patch"]["operation"] == "INSERT_BEFORE"
        assert f["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"] == ROUTER_FILTER
        cd = f["patch"]["value"]["config_discovery"]
        assert cd["config_source"] == {"ads": {}, "initial_fetch_timeout": "0s"}
        # The Wasm config, and the RBAC allow filter istio-agent substitutes
        # when the module cannot be fetched.
        assert cd["type_urls"] == [WASM_TYPE, RBAC_TYPE]
    # Every HTTP_FILTER patch is the clients' or the exchange's.
    assert len(patches(name, "HTTP_FILTER")) == len(filters) + (flavour == "sidecar")


def test_probe_singleton_shares_the_vm_id_and_reloads():
    for flavour in FLAVOURS:
        ext = singleton(flavour)
        tc = ext["typed_config"]
        assert ext["name"] == "envoy.bootstrap.wasm"
        assert tc["singleton"] is True
        c = tc["config"]
        assert (c["root_id"], c["failure_policy"], c["vm_config"]["vm_id"]) == ("probe", "FAIL_RELOAD", "llm_geo_router")
        # A bootstrap extension cannot be pulled by the Istio agent: a local file.
        assert c["vm_config"]["code"]["local"]["filename"].startswith("/")
    # The two bootstrap overrides differ only in the plugin JSON (whose
    # difference the test above bounds).
    gw, sc = (bootstrap_override(f) for f in FLAVOURS)
    for b in (gw, sc):
        del b["bootstrap_extensions"][0]["typed_config"]["config"]["configuration"]["value"]
    assert gw == sc
    names = [docs(BOOTSTRAPS[f])[0]["metadata"]["name"] for f in FLAVOURS]
    assert len(set(names)) == 2, names


GATEWAY_VALUES = "gateway-values.yaml"
POD_PATCH = "sidecar-pod-patch.yaml"


def listener_ports(flavour: str) -> set[int]:
    return {p["match"]["listener"]["portNumber"]
            for p in client_patches(flavour, "HTTP_FILTER") + client_patches(flavour, "NETWORK_FILTER")}


def route_matches(flavour: str) -> list[dict]:
    return [p["match"]["routeConfiguration"] for p in client_patches(flavour, "HTTP_ROUTE")]


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
    assert listener_ports("gateway") == {svc_port["targetPort"]}
    for m in route_matches("gateway"):
        assert m["portNumber"] == server_port
        assert m["vhost"]["name"] == f"{host}:{server_port}"
    # The gateway the manifests select is the one the values install.
    for d in docs("gateway.yaml") + docs("gateway-routing.yaml") + docs(EXCHANGES["gateway"]):
        sel = d["spec"].get("workloadSelector", {}).get("labels") or d["spec"].get("selector")
        if sel:
            assert sel == {"istio": "ingressgateway"}, d["metadata"]["name"]
    # The exchange's port is none of the public Service's: only the peers'
    # Service exposes it.
    assert exchange_port("gateway") not in {p["targetPort"] for p in values["service"]["ports"]}


def test_sidecar_ports_are_llm_internals_and_not_the_regions():
    """The sidecar's filters patch the outbound listener and route
    configuration of llm.internal's port, which no region shares (every
    region host has its own outbound listener on its port)."""
    host, port = server("sidecar")
    assert listener_ports("sidecar") == {port}
    for m in route_matches("sidecar"):
        assert m["portNumber"] == port and m["vhost"]["name"] == f"{host}:{port}"
    region_ports = {p["number"] for d in docs("regions.yaml") if d["kind"] == "ServiceEntry"
                    for p in d["spec"]["ports"]}
    assert port not in region_ports, (port, region_ports)
    assert exchange_port("sidecar") not in region_ports | {port}


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


def probe_module_dir_and_file(flavour: str) -> tuple[str, str]:
    path = Path(singleton(flavour)["typed_config"]["config"]["vm_config"]["code"]["local"]["filename"])
    return str(path.parent), path.name


def test_gateway_values_mount_the_probe_module_and_the_bootstrap_override():
    """The gateway template ignores the userVolume annotations: the module
    comes through the chart's volumes/volumeMounts, the bootstrap through
    the bootstrapOverride annotation the gateway template honours."""
    (values,) = docs(GATEWAY_VALUES)
    (cm,) = docs(BOOTSTRAPS["gateway"])
    assert values["podAnnotations"]["sidecar.istio.io/bootstrapOverride"] == cm["metadata"]["name"]
    assert not any(k.startswith("sidecar.istio.io/userVolume") for k in values["podAnnotations"])
    directory, _ = probe_module_dir_and_file("gateway")
    (vol,) = values["volumes"]
    (mount,) = values["volumeMounts"]
    assert mount["name"] == vol["name"] and mount["mountPath"] == directory and mount["readOnly"] is True
    assert vol["configMap"]["name"] == WASM_CONFIGMAP


def test_gateway_values_run_two_replicas_or_more_as_the_exchanges_identity():
    """More than one Envoy is what the exchange is for; the chart runs its
    autoscaler unless disabled, from minReplicas (else replicaCount). The
    service account is the one whose SPIFFE identity the exchange listener
    admits, in the namespace of the EnvoyFilter that adds it (the chart's
    default account, the release name, is not in the values)."""
    (values,) = docs(GATEWAY_VALUES)
    autoscaling = values.get("autoscaling", {})
    replicas = autoscaling["minReplicas"] if autoscaling.get("enabled", True) else values["replicaCount"]
    assert replicas >= 2, values
    assert values["serviceAccount"].get("create", True) is True
    namespace = envoy_filter("gateway")["metadata"]["namespace"]
    assert exchange_identities("gateway") == [
        f"spiffe://cluster.local/ns/{namespace}/sa/{values['serviceAccount']['name']}"]


def test_sidecar_pod_patch_mounts_the_probe_module_and_selects_the_filters():
    (patch,) = docs(POD_PATCH)
    meta = patch["spec"]["template"]["metadata"]
    (cm,) = docs(BOOTSTRAPS["sidecar"])
    assert meta["annotations"]["sidecar.istio.io/bootstrapOverride"] == cm["metadata"]["name"]
    ef = envoy_filter("sidecar")
    assert ef["spec"]["workloadSelector"]["labels"].items() <= meta["labels"].items()
    volumes, mounts = rendered_user_volumes(meta["annotations"])
    directory, _ = probe_module_dir_and_file("sidecar")
    (vol,) = volumes
    (mount,) = mounts
    assert mount["name"] == vol["name"] and mount["mountPath"] == directory and mount["readOnly"] is True
    assert vol["configMap"]["name"] == WASM_CONFIGMAP


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_exchange_service_is_the_flavours_pods_on_the_exchange_port(flavour):
    """The peers' Service selects the pods the flavour's EnvoyFilter patches
    (so its outbound cluster's endpoints are exactly the deployment's
    Envoys), in their namespace, on the port their exchange listens on, and
    only for that namespace. The DestinationRule of its host balances round
    robin and always originates Istio's mTLS."""
    svc = exchange_doc(flavour, "Service")
    ef = envoy_filter(flavour)
    assert svc["metadata"]["namespace"] == ef["metadata"]["namespace"]
    assert svc["spec"]["selector"] == ef["spec"]["workloadSelector"]["labels"]
    assert svc["metadata"]["annotations"]["networking.istio.io/exportTo"] == "."
    host, port = peers_service(flavour)
    assert port["targetPort"] == exchange_port(flavour)
    # HTTP, for istiod: the sidecar's inbound chain gets an HTTP connection
    # manager the exchange filter is patched into.
    assert port["appProtocol"] == "http" and port["name"].startswith("http")
    if flavour == "sidecar":
        # A headless Service would give sidecars an ORIGINAL_DST cluster, in
        # which the probe's callouts (no original destination) find no host.
        assert svc["spec"].get("clusterIP") != "None"
    dr = exchange_doc(flavour, "DestinationRule")
    assert dr["metadata"]["namespace"] == svc["metadata"]["namespace"]
    assert dr["spec"]["host"] == host and dr["spec"]["exportTo"] == ["."]
    tp = dr["spec"]["trafficPolicy"]
    assert tp["loadBalancer"] == {"simple": "ROUND_ROBIN"}
    assert tp["tls"] == {"mode": "ISTIO_MUTUAL"}
    assert "outlierDetection" not in tp


def sds_secret_configs(tls_context: dict) -> list[dict]:
    """Every SdsSecretConfig of a TLS context (certificate and validation)."""
    ctx = tls_context["common_tls_context"]
    return [*ctx.get("tls_certificate_sds_secret_configs", []),
            ctx["combined_validation_context"]["validation_context_sds_secret_config"]]


def istio_sds(name: str) -> dict:
    """An SdsSecretConfig as istiod writes its own (pkg/model/authentication.go)."""
    return {"name": name, "sds_config": {
        "api_config_source": {"api_type": "GRPC", "set_node_on_first_message_only": True,
                              "transport_api_version": "V3",
                              "grpc_services": [{"envoy_grpc": {"cluster_name": SDS_CLUSTER}}]},
        "resource_api_version": "V3", "initial_fetch_timeout": "0s"}}


def test_gateway_exchange_listener_terminates_istio_mtls_for_the_gateways_own_identity():
    """A listener an EnvoyFilter adds gets neither istiod's mTLS nor an
    AuthorizationPolicy's RBAC filter: it carries them itself. It requires
    a client certificate from Istio's CA (ROOTCA), presents the workload's
    (default), both from istio-agent's SDS as istiod writes them, and admits
    only the gateway's identity. Its HTTP side is envoy.yaml's peers'
    listener, the exchange filter served over ECDS."""
    lis = gateway_exchange_listener()
    assert lis["name"] == EXCHANGE_LISTENER
    assert lis["address"]["socket_address"]["address"] == "0.0.0.0"
    (chain,) = lis["filter_chains"]
    assert set(chain) == {"transport_socket", "filters"}  # no match: every connection
    ts = chain["transport_socket"]
    assert ts["name"] == TLS_SOCKET
    tls = ts["typed_config"]
    assert tls["@type"].endswith("tls.v3.DownstreamTlsContext")
    assert tls["require_client_certificate"] is True
    assert [s["name"] for s in sds_secret_configs(tls)] == ["default", "ROOTCA"]
    for s in sds_secret_configs(tls):
        assert s == istio_sds(s["name"])
    assert len(exchange_identities("gateway")) == 1
    (hcm_filter,) = chain["filters"]
    assert hcm_filter["name"] == HCM
    hcm = copy.deepcopy(hcm_filter["typed_config"])
    (demo_lis,) = [l for l in demo_config()["static_resources"]["listeners"] if l["name"] == EXCHANGE_LISTENER]
    demo_hcm = copy.deepcopy(demo_lis["filter_chains"][0]["filters"][0]["typed_config"])
    ours, theirs = hcm.pop("http_filters"), demo_hcm.pop("http_filters")
    assert hcm == demo_hcm
    assert [f["name"] for f in ours] == [f["name"] for f in theirs] == [EXCHANGE_FILTER, ROUTER_FILTER]
    cd = ours[0]["config_discovery"]
    assert cd["config_source"] == {"ads": {}, "initial_fetch_timeout": "0s"}
    # The deny-all RBAC filter the agent substitutes for a FAIL_CLOSED one.
    assert cd["type_urls"] == [WASM_TYPE, RBAC_TYPE]
    assert ours[1] == theirs[1]
    # Istio's own mTLS and authorization would not reach this listener:
    # the gateway flavour ships neither (an ALLOW policy on the gateway
    # would also deny its public traffic).
    assert {d["kind"] for d in docs(EXCHANGES["gateway"])} == {"Service", "DestinationRule"}


def test_sidecar_exchange_port_is_mtls_and_the_client_identities_only():
    """The sidecar's exchange is the inbound chain istiod builds for the
    Service's port: the PeerAuthentication makes that port (only) STRICT, the
    AuthorizationPolicy denies it to every principal but the client
    workloads' own (and leaves their other ports alone), the exchange
    filter sits before Envoy's router, and a direct 404 route keeps every
    other request from the application's port."""
    ef = envoy_filter("sidecar")
    selector = ef["spec"]["workloadSelector"]["labels"]
    namespace = ef["metadata"]["namespace"]
    port = exchange_port("sidecar")
    pa = exchange_doc("sidecar", "PeerAuthentication")
    assert pa["metadata"]["namespace"] == namespace
    assert pa["spec"]["selector"]["matchLabels"] == selector
    assert "mtls" not in pa["spec"]  # the workloads' other ports as the mesh says
    assert pa["spec"]["portLevelMtls"] == {port: {"mode": "STRICT"}}
    ap = exchange_doc("sidecar", "AuthorizationPolicy")
    assert ap["metadata"]["namespace"] == namespace
    assert ap["spec"]["selector"]["matchLabels"] == selector
    assert ap["spec"]["action"] == "DENY"
    (rule,) = ap["spec"]["rules"]
    assert rule["to"] == [{"operation": {"ports": [str(port)]}}]
    identities = exchange_identities("sidecar")
    assert identities and all(i.startswith(f"spiffe://cluster.local/ns/{namespace}/sa/") for i in identities)
    assert not any(i.endswith("/sa/default") for i in identities)
    (f,) = patches("sidecar.yaml", "HTTP_FILTER", "SIDECAR_INBOUND")
    assert f["patch"]["operation"] == "INSERT_BEFORE"
    assert f["match"]["listener"]["filterChain"]["filter"] == {"name": HCM, "subFilter": {"name": ROUTER_FILTER}}
    assert f["patch"]["value"]["name"] == EXCHANGE_FILTER
    cd = f["patch"]["value"]["config_discovery"]
    assert cd["config_source"] == {"ads": {}, "initial_fetch_timeout": "0s"}
    assert cd["type_urls"] == [WASM_TYPE, RBAC_TYPE]
    (r,) = patches("sidecar.yaml", "HTTP_ROUTE", "SIDECAR_INBOUND")
    assert r["patch"]["operation"] == "INSERT_FIRST"
    assert "vhost" not in r["match"]["routeConfiguration"]
    assert r["patch"]["value"]["match"] == {"prefix": "/"}
    assert r["patch"]["value"]["direct_response"] == {"status": 404}
    # Nothing else is patched into the inbound side.
    assert len([p for d in docs("sidecar.yaml") if d["kind"] == "EnvoyFilter" for p in d["spec"]["configPatches"]
                if p.get("match", {}).get("context") == "SIDECAR_INBOUND"]) == 2


def test_install_doc_names_what_the_manifests_use():
    """docs/INSTALL.md's Istio steps create the module's ConfigMap with
    `kubectl create` (apply's last-applied annotation cannot hold 0.6 MiB),
    name the files shipped here, and require Istio 1.28."""
    text = INSTALL.read_text()
    istio = text[text.index("## Istio\n"):text.index("## docker-compose")]
    creates = re.findall(rf"kubectl (?:-n \S+ )?create configmap {WASM_CONFIGMAP} \\\n\s+--from-file=", istio)
    assert len(creates) == 2, creates  # gateway and sidecars
    assert not re.search(r"kubectl[^\n]* apply[^\n]*--from-file", istio)
    shipped = sorted(p.name for p in ISTIO.glob("*.yaml"))
    for f in shipped:
        assert f"`{f}`" in istio, f
    for f in (*BOOTSTRAPS.values(), *EXCHANGES.values(), "gateway-routing.yaml", "sidecar-routing.yaml",
              "regions.yaml", "gateway.yaml", "sidecar.yaml"):
        assert f"apply -f envoy/istio/{f}" in istio, f
    assert "1.28" in istio and "istioctl proxy-config ecds" in istio
    assert harness.WASM.stat().st_size > 256 * 1024  # why apply would fail


def test_every_route_to_an_engine_removes_the_internal_headers():
    """The cluster_header routes and the VirtualService's fallback route
    forward none of the plugin's internal headers."""
    for flavour, (name, routing, _) in FLAVOURS.items():
        for p in client_patches(flavour, "HTTP_ROUTE"):
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


# --- what stands in for the cluster around the exchange -----------------------------


@dataclass
class Pki:
    """A mesh CA and one workload certificate per SPIFFE identity, as
    istio-agent would serve them over SDS (default, ROOTCA), as files."""
    directory: Path
    ca: Path
    certs: dict[str, tuple[Path, Path]]

    def sds_files(self, identity: str) -> dict[str, Path]:
        """File SDS resources for an Envoy running as `identity` (file SDS
        takes one secret a file)."""
        cert, key = self.certs[identity]
        slug = re.sub(r"[^A-Za-z0-9]+", "_", identity)
        out = {"default": self.directory / f"sds-default-{slug}.yaml", "ROOTCA": self.directory / "sds-rootca.yaml"}
        secret = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
        out["default"].write_text(yaml.safe_dump({"resources": [{"@type": secret, "name": "default", "tls_certificate": {
            "certificate_chain": {"filename": str(cert)}, "private_key": {"filename": str(key)}}}]}))
        out["ROOTCA"].write_text(yaml.safe_dump({"resources": [{"@type": secret, "name": "ROOTCA", "validation_context": {
            "trusted_ca": {"filename": str(self.ca)}}}]}))
        return out

    def client(self, identity: str | None) -> ssl.SSLContext:
        """A TLS client presenting `identity`'s certificate (None: none)."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False  # Istio checks the URI SAN, not a host name
        ctx.load_verify_locations(self.ca)
        if identity is not None:
            ctx.load_cert_chain(*self.certs[identity])
        return ctx


def make_pki(directory: Path, identities: list[str]) -> Pki:
    """Certificates shaped as Istio's CA issues them: the identity as a URI
    SAN, for client and server use."""
    directory.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=directory, timeout=30)

    ca, ca_key = directory / "ca.pem", directory / "ca.key"
    run("req", "-x509", *ec, "-keyout", str(ca_key), "-out", str(ca), "-subj", "/O=cluster.local", "-days", "2")
    certs = {}
    for i, identity in enumerate(identities):
        cert, key, csr, ext = (directory / f"id{i}.{s}" for s in ("pem", "key", "csr", "ext"))
        ext.write_text(f"subjectAltName=critical,URI:{identity}\nbasicConstraints=critical,CA:FALSE\n"
                       "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth,clientAuth\n")
        run("req", "-new", *ec, "-keyout", str(key), "-out", str(csr), "-subj", "/O=cluster.local")
        run("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-set_serial", str(i + 2),
            "-days", "2", "-extfile", str(ext), "-out", str(cert))
        certs[identity] = (cert, key)
    return Pki(directory, ca, certs)


def port_free(address: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((address, port))
        except OSError:
            return False
    return True


def pod_addresses(n: int, port: int) -> list[str]:
    """Loopback addresses standing in for n pods' IPs, each free on `port`
    (the exchange's port itself, as every pod listens on it)."""
    for _ in range(50):
        a, b = random.randrange(1, 255), random.randrange(0, 255)
        addresses = [f"127.{a}.{b}.{i + 2}" for i in range(n)]
        if all(port_free(x, port) for x in addresses):
            return addresses
    raise RuntimeError(f"no loopback addresses with port {port} free")


@dataclass
class Peers:
    """The deployment this Envoy is one of: every Envoy's pod address (its
    own at `index`), each listening on the exchange's port, and the
    certificates its agent serves (None: left to the agent's SDS, as istiod
    writes it, for --mode validate, which fetches nothing)."""
    addresses: list[str]
    index: int
    pki: Pki | None = None


# The sds-grpc cluster of Istio's bootstrap (tools/packaging/common/
# envoy_bootstrap.json): istio-agent's SDS server on a Unix socket.
ISTIO_SDS_GRPC = {
    "name": SDS_CLUSTER, "type": "STATIC", "connect_timeout": "1s",
    "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http2_protocol_options": {}}}},
    "load_assignment": {"cluster_name": SDS_CLUSTER, "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
        "pipe": {"path": "./var/run/secrets/workload-spiffe-uds/socket"}}}}]}]},
}


def sds_from(peers: Peers, flavour: str):
    """SdsSecretConfig by name: as istiod writes it (validate), or this
    Envoy's certificate files in its place (what the agent would serve)."""
    files = peers.pki.sds_files(exchange_identities(flavour)[0]) if peers.pki else None

    def sds(name: str) -> dict:
        if files is None:
            return istio_sds(name)
        return {"name": name, "sds_config": {"path_config_source": {"path": str(files[name])},
                                             "resource_api_version": "V3"}}
    return sds


def local_sds(tls_context: dict, sds) -> None:
    """The manifest's SDS references, each checked to be istiod's and
    pointed at what the agent would serve."""
    ctx = tls_context["common_tls_context"]
    for i, s in enumerate(ctx.get("tls_certificate_sds_secret_configs", [])):
        assert s == istio_sds(s["name"]), s
        ctx["tls_certificate_sds_secret_configs"][i] = sds(s["name"])
    cvc = ctx["combined_validation_context"]
    s = cvc["validation_context_sds_secret_config"]
    assert s == istio_sds(s["name"]), s
    cvc["validation_context_sds_secret_config"] = sds(s["name"])


def peers_cluster(flavour: str, peers: Peers) -> dict:
    """The outbound cluster istiod builds for the exchange's Service on this
    flavour's proxies: EDS of the pods (here STATIC, the pods' loopback
    stand-ins) with the DestinationRule's load balancer and connect
    timeout, and its TLS: ISTIO_MUTUAL (cluster_tls.go: the workload
    certificate, the root, SNI outbound_.<port>_._.<host>, the in-mesh ALPN,
    and the Service's pods' identities as the SANs to accept), also what
    auto mTLS picks without a tls setting if the pods carry the
    security.istio.io/tlsMode label (injected sidecars do, gateways do not:
    then plain text). A headless Service gives sidecars (not gateways) an
    ORIGINAL_DST cluster instead (cluster.go, convertResolution)."""
    host, port = peers_service(flavour)
    name = peers_cluster_name(flavour)
    tp = exchange_doc(flavour, "DestinationRule")["spec"]["trafficPolicy"]
    cluster = {"name": name, "type": "STATIC", "connect_timeout": tp["connectionPool"]["tcp"]["connectTimeout"],
               "lb_policy": tp.get("loadBalancer", {}).get("simple", "LEAST_REQUEST"),
               "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
                   {"endpoint": {"address": {"socket_address": {"address": a, "port_value": port["targetPort"]}}}}
                   for a in peers.addresses]}]}}
    if flavour == "sidecar" and exchange_doc(flavour, "Service")["spec"].get("clusterIP") == "None":
        cluster.update(type="ORIGINAL_DST", lb_policy="CLUSTER_PROVIDED")
        del cluster["load_assignment"]
    mode = tp.get("tls", {}).get("mode") or ("ISTIO_MUTUAL" if flavour == "sidecar" else "DISABLE")
    assert mode in ("ISTIO_MUTUAL", "DISABLE"), mode
    if mode == "DISABLE":
        return cluster
    sds = sds_from(peers, flavour)
    tls = {"@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
           "sni": f"outbound_.{port['port']}_._.{host}",
           "common_tls_context": {
               "alpn_protocols": ["istio-peer-exchange", "istio"],
               "tls_certificate_sds_secret_configs": [sds("default")],
               "combined_validation_context": {
                   "default_validation_context": {
                       "match_subject_alt_names": [{"exact": i} for i in exchange_identities(flavour)]},
                   "validation_context_sds_secret_config": sds("ROOTCA")}}}
    cluster["transport_socket"] = {"name": TLS_SOCKET, "typed_config": tls}
    return cluster


def authz_rbac(ap: dict) -> dict:
    """The HTTP RBAC filter istiod makes of the AuthorizationPolicy, for the
    fields the manifest uses (any other fails here, not silently)."""
    spec = ap["spec"]
    assert set(spec) == {"selector", "action", "rules"}, spec
    policies = {}
    for i, rule in enumerate(spec["rules"]):
        assert set(rule) == {"from", "to"}, rule
        principals, permissions = [], []
        for f in rule["from"]:
            ((kind, values),) = f["source"].items()
            assert kind in ("principals", "notPrincipals"), kind
            ids = {"or_ids": {"ids": [{"authenticated": {"principal_name": {"exact": f"spiffe://{v}"}}}
                                      for v in values]}}
            principals.append({"and_ids": {"ids": [{"not_id": ids} if kind == "notPrincipals" else ids]}})
        for t in rule["to"]:
            ((kind, values),) = t["operation"].items()
            assert kind == "ports", kind
            permissions.append({"and_rules": {"rules": [{"or_rules": {"rules": [
                {"destination_port": int(v)} for v in values]}}]}})
        policies[f"ns[{ap['metadata']['namespace']}]-policy[{ap['metadata']['name']}]-rule[{i}]"] = {
            "permissions": permissions, "principals": principals}
    return {"name": "envoy.filters.http.rbac", "typed_config": {
        "@type": RBAC_TYPE, "rules": {"action": spec["action"], "policies": policies}}}


# --- assembly -----------------------------------------------------------------------


def assemble(flavour: str, ports: dict[str, int], admin_port: int, port: int, run_dir: Path | None,
             peers: Peers, plugin_override: dict | None = None, wasm_filters: bool = True,
             drop_allow_stop_iteration: bool = False, agent_allow: bool = False,
             type_urls: list[str] | None = None, name: str = "envoy") -> dict:
    """One Envoy bootstrap from the manifests: the clients' listener on
    `port`, the exchange's on this Envoy's pod address, the region clusters
    and the peers' cluster. With run_dir, the filters are fetched over ECDS
    (from files, where Istio serves them over ADS); without, their
    configurations are inline (for --mode validate, which starts no
    subscription). agent_allow: ECDS delivers what istio-agent does when it
    cannot fetch the module (an RBAC filter under each filter's name, allow
    or deny as the filter fails open or closed); type_urls replaces the
    manifests' list."""
    fname, routing, _ = FLAVOURS[flavour]
    vhost_name = vhost(flavour)
    exts = extension_configs(fname)

    def plugin_json(c: dict) -> dict:
        if plugin_override:
            v = json.loads(c["configuration"]["value"])
            c["configuration"]["value"] = json.dumps(harness.deep_merge(v, plugin_override))
        return c

    def http_filter(ref: dict) -> dict | None:
        """An HTTP_FILTER patch's (or the added listener's) ECDS reference,
        as Envoy gets it."""
        if not wasm_filters:
            return None
        tc = local_wasm(exts[ref["name"]]["typed_config"])
        if drop_allow_stop_iteration:
            # What istiod < 1.28 makes of the patch: the field discarded.
            del tc["config"]["allow_on_headers_stop_iteration"]
        plugin_json(tc["config"])
        if agent_allow:
            tc = copy.deepcopy(AGENT_ALLOW if tc["config"]["failure_policy"] == "FAIL_OPEN" else AGENT_DENY)
        if run_dir is None:
            return {"name": ref["name"], "typed_config": tc}
        path = run_dir / f"ecds-{name}-{ref['name']}.yaml"
        path.write_text(yaml.safe_dump({"resources": [{
            "@type": "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig",
            "name": ref["name"], "typed_config": tc}]}, sort_keys=False))
        cd = copy.deepcopy(ref["config_discovery"])
        cd["config_source"] = {"path_config_source": {"path": str(path)}, "resource_api_version": "V3"}
        if type_urls is not None:
            cd["type_urls"] = type_urls
        return {"name": ref["name"], "config_discovery": cd}

    router = {"name": ROUTER_FILTER, "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}
    http_filters = [f for p in client_patches(flavour, "HTTP_FILTER") if (f := http_filter(p["patch"]["value"]))]
    http_filters.append(router)

    (early,) = client_patches(flavour, "NETWORK_FILTER")
    assert early["match"]["listener"]["filterChain"]["filter"]["name"] == HCM
    hcm = {"@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
           "stat_prefix": "llm_ingress", "http_filters": http_filters}
    merged = copy.deepcopy(early["patch"]["value"]["typed_config"])
    assert merged.pop("@type") == hcm["@type"]
    hcm.update(merged)

    # INSERT_FIRST patches in order, each before the routes already there
    # (istiod's patchHTTPRoutes: without a route match, prepended).
    routes = vs_routes(routing)
    for route in client_patches(flavour, "HTTP_ROUTE"):
        assert route["patch"]["operation"] == "INSERT_FIRST"
        assert route["match"]["routeConfiguration"]["vhost"]["name"] == vhost_name
        assert "route" not in route["match"]["routeConfiguration"]["vhost"]
        routes.insert(0, copy.deepcopy(route["patch"]["value"]))
    hcm["route_config"] = {"name": "istio_route", "virtual_hosts": [
        {"name": vhost_name, "domains": ["*"], "routes": routes}]}

    address = peers.addresses[peers.index]
    sds = sds_from(peers, flavour)
    extra_clusters = [peers_cluster(flavour, peers)]
    if peers.pki is None:
        extra_clusters.append(copy.deepcopy(ISTIO_SDS_GRPC))
    if flavour == "gateway":
        exchange = copy.deepcopy(gateway_exchange_listener())
        exchange["address"]["socket_address"]["address"] = address
        (chain,) = exchange["filter_chains"]
        local_sds(chain["transport_socket"]["typed_config"], sds)
        (ex_hcm,) = chain["filters"]
        resolved = [http_filter(f) if "config_discovery" in f else f for f in ex_hcm["typed_config"]["http_filters"]]
        ex_hcm["typed_config"]["http_filters"] = [f for f in resolved if f]
    else:
        exchange, app = sidecar_inbound(peers, sds, http_filter, copy.deepcopy(router))
        extra_clusters.append(app)

    ext = copy.deepcopy(singleton(flavour))
    cfg = ext["typed_config"]["config"]
    cfg["vm_config"]["code"]["local"]["filename"] = str(harness.WASM)
    plugin_json(cfg)
    return {
        # Istio's bootstrap names the node; filesystem ECDS requires it.
        "node": {"id": f"istio-{flavour}-{name}", "cluster": f"istio-{flavour}"},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "bootstrap_extensions": [ext],
        "static_resources": {
            "listeners": [{"name": "istio_listener",
                           "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
                           "filter_chains": [{"filters": [{"name": HCM, "typed_config": hcm}]}]},
                          exchange],
            "clusters": clusters(ports) + extra_clusters,
        },
    }


def sidecar_inbound(peers: Peers, sds, http_filter, router: dict) -> tuple[dict, dict]:
    """The inbound filter chain istiod builds for the exchange's port of a
    sidecar (here a listener of its own on the pod's address and that port,
    where Istio has a chain of its virtual inbound listener matching the
    port): mTLS as the PeerAuthentication says, the AuthorizationPolicy's
    RBAC filter, Istio's route to the application's port (inbound|<port>||),
    and the manifest's inbound patches applied to them. Also the cluster of
    that application port, where nothing listens."""
    port = exchange_port("sidecar")
    pa = exchange_doc("sidecar", "PeerAuthentication")
    assert pa["spec"]["portLevelMtls"][port] == {"mode": "STRICT"}
    # istiod's inbound mTLS (ApplyToCommonTLSContext, validateClient): any
    # certificate of the mesh's CA; the identity is the RBAC filter's job.
    tls = {"@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
           "require_client_certificate": True,
           "common_tls_context": {
               "alpn_protocols": ["h2", "http/1.1"],
               "tls_certificate_sds_secret_configs": [sds("default")],
               "combined_validation_context": {"default_validation_context": {},
                                               "validation_context_sds_secret_config": sds("ROOTCA")}}}
    inbound = f"inbound|{port}||"
    filters = [authz_rbac(exchange_doc("sidecar", "AuthorizationPolicy")), router]
    for p in patches("sidecar.yaml", "HTTP_FILTER", "SIDECAR_INBOUND"):
        assert p["match"]["listener"]["portNumber"] == port
        assert p["patch"]["operation"] == "INSERT_BEFORE"
        assert p["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"] == ROUTER_FILTER
        f = http_filter(p["patch"]["value"])
        if f:
            filters.insert(filters.index(router), f)
    routes = [{"name": "default", "match": {"prefix": "/"}, "route": {"cluster": inbound, "timeout": "0s"}}]
    for p in patches("sidecar.yaml", "HTTP_ROUTE", "SIDECAR_INBOUND"):
        assert p["match"]["routeConfiguration"]["portNumber"] == port
        assert p["patch"]["operation"] == "INSERT_FIRST"
        routes.insert(0, copy.deepcopy(p["patch"]["value"]))
    hcm = {"@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
           "stat_prefix": f"inbound_0.0.0.0_{port}", "codec_type": "AUTO",
           "route_config": {"name": inbound, "virtual_hosts": [
               {"name": f"inbound|http|{port}", "domains": ["*"], "routes": routes}]},
           "http_filters": filters}
    listener = {"name": f"virtualInbound-{port}",
                "address": {"socket_address": {"address": peers.addresses[peers.index], "port_value": port}},
                "filter_chains": [{"transport_socket": {"name": TLS_SOCKET, "typed_config": tls},
                                   "filters": [{"name": HCM, "typed_config": hcm}]}]}
    app = {"name": inbound, "type": "STATIC", "connect_timeout": "1s", "load_assignment": {
        "cluster_name": inbound, "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {"socket_address": {
            "address": "127.0.0.1", "port_value": harness.free_port()}}}}]}]}}
    return listener, app


DUMMY_PORTS = {e: 1 for e in HOST_ENGINE.values()}


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_assembled_istio_config_validates(flavour, run_dir):
    """The manifests' configuration as istiod delivers it, the exchange's
    SDS references included (to the stand-in of the bootstrap's sds-grpc
    cluster), loads in Envoy; validate mode configures the three filters
    (not the bootstrap singleton), so the plugin JSON with Istio's cluster
    names and the exchange is accepted by each."""
    peers = Peers(["127.0.0.2"], 0)
    cfg = assemble(flavour, DUMMY_PORTS, harness.free_port(), harness.free_port(), None, peers)
    path = run_dir / f"istio-{flavour}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    r = harness.validate(path)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    for role in ("guard", "router", "exchange"):
        assert f"llm-geo-router {role}: configured" in out, out[-3000:]


FAST_PROBE = {"probe": {"tick_ms": 300, "timeout_ms": 300, "snapshot_max_age_ms": 3000}}
FORGED = {"x-llm-cluster": "outbound|8000||far.llm.example.com", "x-llm-tier": "critical", "x-llm-kv-action": "fetch"}


# Besides the harness's (x-llm-tier, x-llm-cluster, x-llm-kv-action): what
# else the engines echo of the request they received.
ECHO = ["--echo-header", "x-llm-pool", "--echo-header", "x-llm-stream", "--echo-header", "host"]


@dataclass
class IstioFleet:
    """A harness.Fleet of the manifests' Envoys, with the mesh they stand in."""
    fleet: harness.Fleet
    flavour: str
    addresses: list[str]
    peer_port: int  # the exchange's, on every address
    pki: Pki

    def __getattr__(self, attr):
        return getattr(self.fleet, attr)

    def intruder(self) -> str:
        """A workload of the mesh (the CA knows it) that is not a peer."""
        return next(i for i in self.pki.certs if i not in exchange_identities(self.flavour))

    def listener_stats(self, i: int) -> dict[str, int]:
        prefix = f"listener.{self.addresses[i]}_{self.peer_port}."
        return {k[len(prefix):]: v for k, v in self.envoys[i].stats(re.escape(prefix)).items()}

    def post(self, i: int, body: bytes, identity: str | None = "own", path: str = "/llm-geo-router/exchange",
             tls: bool = True) -> int:
        """A POST to Envoy i's exchange port as a peer would send it (mTLS
        with the flavour's identity, or `identity`'s, or no certificate);
        the status, or raises what the connection raised."""
        if identity == "own":
            identity = exchange_identities(self.flavour)[0]
        if tls:
            conn = http.client.HTTPSConnection(self.addresses[i], self.peer_port, timeout=10,
                                               context=self.pki.client(identity))
        else:
            conn = http.client.HTTPConnection(self.addresses[i], self.peer_port, timeout=10)
        try:
            conn.request("POST", path, body=body, headers={"content-type": "application/octet-stream"})
            resp = conn.getresponse()
            resp.read()
            return resp.status
        finally:
            conn.close()


def start_istio_fleet(flavour: str, run_dir: Path, wasm_filters: bool = True, plugin_override: dict | None = None,
                      drop_allow_stop_iteration: bool = False, agent_allow: bool = False,
                      type_urls: list[str] | None = None, wait_snapshot: bool = True, envoys: int = 1) -> IstioFleet:
    """The engines, then `envoys` Envoys of the flavour, each on its own
    pod address with the exchange's port, all of them in every one's peers'
    cluster (a single Envoy is its own only peer, as a one-replica
    deployment's Service lists it)."""
    fleet = harness.Fleet(run_dir)
    try:
        for n, (_, delay, mode) in {**harness.DEMO_REGIONS, **harness.FALLBACK_REGIONS}.items():
            engine = harness.start_engine(n, run_dir, delay, mode, extra=ECHO)
            (fleet.engines if n in harness.DEMO_REGIONS else fleet.fallbacks)[n] = engine
        ports = {n: e.port for n, e in {**fleet.engines, **fleet.fallbacks}.items()}
        port = exchange_port(flavour)
        addresses = pod_addresses(envoys, port)
        namespace = envoy_filter(flavour)["metadata"]["namespace"]
        pki = make_pki(run_dir / "pki", [*exchange_identities(flavour),
                                         f"spiffe://cluster.local/ns/{namespace}/sa/not-a-peer"])
        override = harness.deep_merge(copy.deepcopy(FAST_PROBE), plugin_override or {})
        for i in range(envoys):
            name = f"envoy-{flavour}-{i}"
            cfg = assemble(flavour, ports, harness.free_port(), harness.free_port(), run_dir,
                           Peers(addresses, i, pki), override, wasm_filters, drop_allow_stop_iteration,
                           agent_allow, type_urls, name=name)
            fleet.envoys.append(harness.start_envoy(run_dir, cfg, name=name))
        if wait_snapshot:
            for e in fleet.envoys:
                fleet.wait_snapshot(e)
                fleet.wait_rtt_settled(e)
    except Exception:
        fleet.stop()
        raise
    return IstioFleet(fleet, flavour, addresses, port, pki)


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


def plugin_stat(envoy: harness.Envoy, name: str) -> int:
    return envoy.stat("wasmcustom.llm_geo_router." + name)


def wait_stat(envoys: list, name: str, predicate, timeout: float = 15.0) -> list[int]:
    return harness.until(lambda: [plugin_stat(e, name) for e in envoys], lambda vs: all(predicate(v) for v in vs),
                         timeout, name)


def turn_on_mid(fleet: IstioFleet, via: harness.Envoy, seed: str) -> list[dict]:
    """A conversation's first turn (an ~8 KB system prompt) through Envoy
    `via` while near is down, so mid serves it and holds its prefix; then
    near back up at every Envoy. Returns the conversation with its next
    turn, which the nearest region would serve cold."""
    near = fleet.engines["near"]
    near.set_state(healthy=False)
    wait_stat(fleet.envoys, "region.near.healthy", lambda v: v == 0)
    msgs = [{"role": "system", "content": filler(seed, 8000)},
            {"role": "user", "content": f"first question about {seed}"}]
    r = chat(via.port, msgs)
    assert r.status == 200 and r.replica == "mid", (r.status, r.route)
    msgs.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
    msgs.append({"role": "user", "content": "and the next one"})
    near.set_state(healthy=True)
    wait_stat(fleet.envoys, "region.near.healthy", lambda v: v == 1)
    return msgs


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_two_envoys_of_the_manifests_share_what_each_learns(flavour, run_dir):
    """Two replicas (gateway) or two client pods' sidecars (sidecar), each
    assembled from the manifests: the exchange's listener or inbound chain,
    its filter over ECDS, the peers' cluster of the Service with its
    DestinationRule's ISTIO_MUTUAL, and the plugin JSON naming that cluster,
    on two loopback addresses standing in for the pods' IPs and certificates
    of the flavour's identity. A conversation's first turn through Envoy 1
    lands in mid while near is down; near comes back; its next turn through
    Envoy 2, which never saw it, goes to mid for its cache, not to near."""
    fleet = start_istio_fleet(flavour, run_dir, envoys=2)
    try:
        e1, e2 = fleet.envoys
        wait_stat(fleet.envoys, "exchange.peers", lambda v: v == 1)
        merged = plugin_stat(e2, "exchange.merged")
        msgs = turn_on_mid(fleet, e1, f"istio-{flavour}-doc")
        wait_stat([e2], "exchange.merged", lambda v: v > merged, timeout=5)
        r = chat(e2.port, msgs)
        assert r.status == 200, r.body[:300]
        assert r.replica == "mid" and r.route["reason"] == "cache", r.route
        assert int(r.headers["x-engine-cached-tokens"]) > 1000, r.headers
        for i, e in enumerate(fleet.envoys):
            assert plugin_stat(e, "exchange.sent") > 0 and plugin_stat(e, "exchange.received") > 0
            assert plugin_stat(e, "exchange.refused") == 0
            # Every message came over the manifests' mTLS.
            s = fleet.listener_stats(i)
            assert s["ssl.handshake"] > 0 and s.get("ssl.fail_verify_san", 0) == 0, s
            assert not harness.traps(e)
    finally:
        fleet.stop()


def refused(call) -> str:
    """What a connection the exchange's port refuses raised (TLS alert,
    reset, closed before a response)."""
    try:
        status = call()
    except (ssl.SSLError, ConnectionError, http.client.HTTPException, OSError) as e:
        return type(e).__name__
    raise AssertionError(f"answered {status}")


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_only_the_deployments_identity_reaches_the_exchange(flavour, run_dir):
    """The exchange's port speaks only Istio's mTLS, and only to the
    flavour's own identity. A peer's malformed message is read and refused
    (400), another path gets 404. A workload of the same mesh with another
    identity is refused: at the handshake by the gateway's listener (its SAN
    check), with 403 by the sidecar's RBAC filter (the AuthorizationPolicy);
    no certificate, and plain text, fail the handshake. Only the peer's
    message reached the exchange filter, and the other replica's (or pod's)
    own messages, over the same port and checks, are merged: news learnt
    there (a turn served by mid) is news here."""
    fleet = start_istio_fleet(flavour, run_dir, envoys=2)
    try:
        e, other = fleet.envoys
        before = {n: plugin_stat(e, f"exchange.{n}") for n in ("refused", "merged")}
        assert fleet.post(0, b"garbage") == 400
        assert fleet.post(0, b"", path="/other") == 404
        if flavour == "gateway":
            refused(lambda: fleet.post(0, b"garbage", identity=fleet.intruder()))
            assert fleet.listener_stats(0)["ssl.fail_verify_san"] == 1
        else:
            assert fleet.post(0, b"garbage", identity=fleet.intruder()) == 403
            rbac = e.stats(r"rbac\.denied$")
            assert sum(rbac.values()) == 1, rbac
        refused(lambda: fleet.post(0, b"garbage", identity=None))
        assert fleet.listener_stats(0)["ssl.fail_verify_no_cert"] == 1
        refused(lambda: fleet.post(0, b"garbage", tls=False))
        # The deployment's own peer is heard: its news is merged.
        turn_on_mid(fleet, other, f"istio-{flavour}-identity")
        wait_stat([e], "exchange.merged", lambda v: v > before["merged"], timeout=5)
        assert plugin_stat(e, "exchange.refused") == before["refused"] + 1
        if flavour == "gateway":
            assert fleet.listener_stats(0)["ssl.fail_verify_san"] == 1
        else:
            assert sum(e.stats(r"rbac\.denied$").values()) == 1
        assert not harness.traps(e)
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
    ECDS delivers an RBAC filter under each filter's name, allow-all for
    the client filters (FAIL_OPEN), deny-all for the exchange's
    (FAIL_CLOSED). With the manifests' type_urls Envoy takes them: clients'
    requests pass, unrouted, through the fallback route (nearest region),
    and a peer's message gets 403, never reaching a filter that would merge
    it. With only the Wasm type (the manifests before) the same delivery is
    refused and each filter, left without a configuration, answers 500."""
    fleet = start_istio_fleet(flavour, run_dir, agent_allow=True, wait_snapshot=False)
    try:
        for i in range(3):
            r = chat(fleet.port, [{"role": "user", "content": f"module missing {i}"}], headers=FORGED, timeout=10)
            assert r.status == 200, r.body[:300]
            assert r.replica == "near" and "x-llm-route" not in r.headers, r.headers
            assert r.headers["x-echo-x-llm-cluster"] == "-"
        assert fleet.post(0, b"garbage") == 403
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
        assert fleet.post(0, b"garbage") == 500
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
    # A slow probe, and near killed just after one of its rounds: the next
    # is 5 s away, so the router still takes near for serving. With the
    # 300 ms tick, a busy machine let a round see near gone first.
    fleet = start_istio_fleet("gateway", run_dir, plugin_override={
        "probe": {"tick_ms": 5000, "busy_tick_ms": 5000, "snapshot_max_age_ms": 15000}})
    try:
        harness.wait_ticks(fleet.envoy, 1)
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
            r = chat(fleet.port, [{"role": "user", "content": f"no allow {i}"}], timeout=30)
            # Not before the bound, and well before any stream timeout (the
            # route's 60 s), with room for a busy machine's stalls (runs
            # beside busy_load.py saw up to 15 s; most are under 3 s).
            assert timeout_ms * 0.9 <= r.total_ms < timeout_ms + 20_000, r.total_ms
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
            r = chat(fleet.port, [{"role": "user", "content": f"capped, no allow {i}"}], timeout=30)
            assert r.status == 200, r.body[:300]
            assert r.replica == "near" and "x-llm-route" not in r.headers, r.headers
            assert 2 * timeout_ms * 0.9 <= r.total_ms < 2 * timeout_ms + 20_000, r.total_ms
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

# Istio's CRDs, and Kubernetes' core kinds (the peers' Services, the
# bootstrap ConfigMaps).
SCHEMA_PACKAGES = ("@kubernetes-models/istio@3.0.1", "kubernetes-models@5.1.0")
SCHEMA_DIR = harness.RUNS / "_istio-schemas"
MODELS = {
    ("networking.istio.io/v1alpha3", "EnvoyFilter"): "@kubernetes-models/istio/networking.istio.io/v1alpha3/EnvoyFilter",
    ("networking.istio.io/v1", "ServiceEntry"): "@kubernetes-models/istio/networking.istio.io/v1/ServiceEntry",
    ("networking.istio.io/v1", "DestinationRule"): "@kubernetes-models/istio/networking.istio.io/v1/DestinationRule",
    ("networking.istio.io/v1", "Gateway"): "@kubernetes-models/istio/networking.istio.io/v1/Gateway",
    ("networking.istio.io/v1", "VirtualService"): "@kubernetes-models/istio/networking.istio.io/v1/VirtualService",
    ("security.istio.io/v1", "PeerAuthentication"): "@kubernetes-models/istio/security.istio.io/v1/PeerAuthentication",
    ("security.istio.io/v1", "AuthorizationPolicy"): "@kubernetes-models/istio/security.istio.io/v1/AuthorizationPolicy",
    ("v1", "Service"): "kubernetes-models/v1/Service",
    ("v1", "ConfigMap"): "kubernetes-models/v1/ConfigMap",
}
VALIDATE_JS = """
import { readFileSync } from "node:fs";
const docs = JSON.parse(readFileSync(0, "utf8"));
const failures = [];
for (const [model, doc] of docs) {
  const mod = await import(model);
  const Kind = mod[doc.kind];
  try { new Kind(doc).validate(); } catch (e) { failures.push(`${doc.kind}/${doc.metadata.name}: ${e.message}`); }
}
console.log(JSON.stringify(failures));
"""


def schema_package() -> Path:
    """The npm packages with Istio's CRD schemas and Kubernetes' (the OpenAPI
    schemas, compiled to validators), installed once under wasm-tests/_runs.
    A missing tool or a failed install fails the test, as test_oci.py does
    on a missing tool: a skip would let a schema regression pass green.
    Node.js and npm are on the project's machines (Node.js 20; Debian's
    `nodejs` and `npm` packages elsewhere), and the npm registry is reached."""
    for tool in ("node", "npm"):
        if not shutil.which(tool):
            pytest.fail(f"missing {tool}: install Node.js and npm (Debian's nodejs and npm packages) "
                        "to check the manifests against the Istio CRD schemas", pytrace=False)
    modules = SCHEMA_DIR / "node_modules"
    if not all((modules / pkg.rsplit("@", 1)[0]).exists() for pkg in SCHEMA_PACKAGES):
        SCHEMA_DIR.mkdir(parents=True, exist_ok=True)
        (SCHEMA_DIR / "package.json").write_text('{"private": true, "type": "module"}\n')
        try:
            r = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--loglevel=error", *SCHEMA_PACKAGES],
                               cwd=SCHEMA_DIR, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            pytest.fail(f"npm install {' '.join(SCHEMA_PACKAGES)} timed out after 300 s", pytrace=False)
        if r.returncode != 0:
            pytest.fail(f"npm install {' '.join(SCHEMA_PACKAGES)} failed ({r.returncode}): {r.stderr[-1500:]}",
                        pytrace=False)
    return SCHEMA_DIR


def test_manifests_validate_against_the_istio_crd_schemas():
    pkg = schema_package()
    batch, kinds = [], set()
    for path in sorted(ISTIO.glob("*.yaml")):
        for d in yaml.safe_load_all(path.read_text()):
            # Helm values and a pod patch have no kind: tested above.
            if d and d.get("kind"):
                batch.append([MODELS[(d["apiVersion"], d["kind"])], d])
                kinds.add(d["kind"])
    assert kinds == {k for _, k in MODELS}
    script = pkg / "validate.mjs"
    script.write_text(VALIDATE_JS)
    r = subprocess.run(["node", str(script)], input=json.dumps(batch), cwd=pkg, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout) == []
    # The validators do refuse what the schemas forbid.
    bad = copy.deepcopy(next(b for b in batch if b[1]["kind"] == "EnvoyFilter"))
    bad[1]["spec"]["configPatches"][0]["applyTo"] = "FILTER_THAT_DOES_NOT_EXIST"
    bad_svc = copy.deepcopy(next(b for b in batch if b[1]["kind"] == "Service"))
    bad_svc[1]["spec"]["ports"][0]["port"] = "ten thousand and one"
    bad_pa = copy.deepcopy(next(b for b in batch if b[1]["kind"] == "PeerAuthentication"))
    bad_pa[1]["spec"]["portLevelMtls"] = {"10001": {"mode": "STRICTEST"}}
    r = subprocess.run(["node", str(script)], input=json.dumps([bad, bad_svc, bad_pa]), cwd=pkg,
                       capture_output=True, text=True, timeout=120)
    failures = json.loads(r.stdout)
    assert len(failures) == 3, r.stdout + r.stderr
    assert "applyTo" in failures[0] and "port" in failures[1] and "mode" in failures[2], failures
