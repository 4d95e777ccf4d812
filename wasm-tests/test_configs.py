"""Every Envoy configuration in the repository loads in a real Envoy, and an
invalid plugin configuration is refused with a log line naming the field."""

import json
import subprocess
from pathlib import Path

import pytest
import yaml

import harness

# envoy/istio holds Kubernetes manifests and Helm values, whose Envoy
# configuration test_istio.py assembles and runs.
CONFIGS = sorted(p for p in (harness.ROOT / "envoy").rglob("*.yaml")
                 if "kind:" not in p.read_text() and "istio" not in p.relative_to(harness.ROOT / "envoy").parts)


def localised(path: Path, run_dir: Path) -> Path:
    """The config with its .wasm path pointed at the local build and its peer
    certificates at the deployment's (the compose file names the paths
    inside the container)."""
    cfg = yaml.safe_load(path.read_text())
    harness.absolute_cert_paths(cfg)
    for p in harness.wasm_plugins(cfg):
        p["vm_config"]["code"]["local"]["filename"] = str(harness.WASM)
    out = run_dir / path.name
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return out


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(harness.ROOT)))
def test_repository_config_validates(path, run_dir):
    r = harness.validate(localised(path, run_dir))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "OK" in r.stdout + r.stderr


def test_demo_config_validates_as_written():
    # As the demo runs it: from the repository root, relative .wasm path.
    r = harness.validate(harness.DEMO_CONFIG)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    # The bootstrap singleton (probe) is not started in validate mode.
    for role in ("guard", "router"):
        assert f"llm-geo-router {role}: configured" in out


BAD = [
    ({"regions": []}, "regions: must name at least one region"),
    ({"probe": {"tick_ms": 10}}, "probe.tick_ms: must be at least 50"),
    ({"ladder": {"down_at": [1.1, 0.5, 0.85, 0.7, 0.55]}}, "ladder.down_at[1]"),
    ({"headers": {"cluster": "Bad Header"}}, "headers.cluster"),
    ({"tiers": {"default": "gold"}}, "tiers.default"),
    ({"cost": {"placement_floor": 1.5}}, "cost.placement_floor"),
    ({"tuning": {"min_samples": 0}}, "tuning.min_samples"),
    ({"typo_field": 1}, "unknown field `typo_field`"),
]


def validate_plugin(run_dir, name, edit):
    """`envoy --mode validate` of the demo configuration with every plugin's
    configuration changed by `edit(plugin)`: its return code and output."""
    cfg = harness.render_config(None, harness.free_port(), harness.free_port())
    plugin = harness.plugin_config(cfg)
    edit(plugin)
    for p in harness.wasm_plugins(cfg):
        p["configuration"]["value"] = json.dumps(plugin)
    path = run_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    r = harness.validate(path)
    return r.returncode, r.stdout + r.stderr


@pytest.mark.parametrize("override,expected", BAD, ids=[e for _, e in BAD])
def test_invalid_plugin_config_is_refused_with_the_field(override, expected, run_dir):
    rc, out = validate_plugin(run_dir, "bad", lambda plugin: plugin.update(override))
    assert rc != 0, "Envoy accepted an invalid plugin configuration"
    lines = [l for l in out.splitlines() if "invalid configuration" in l]
    assert lines, out[-3000:]
    assert expected in lines[0], lines[0]
    assert "configuration refused" in lines[0]


def test_a_removed_field_is_accepted_with_one_warning_naming_its_replacement(run_dir):
    def removed_fields(plugin):
        plugin.setdefault("cost", {}).update({"w_rtt": 1.5, "tie_ms": 3, "w_queue": 2,
                                              "bounded_load_floor": 0.7, "placement_floor": 0.3})
        plugin.setdefault("tuning", {}).update({"w_rtt_min": 0.5, "enabled": False, "w_queue_min": 0})
        plugin.setdefault("probe", {}).update({"rtt_alpha": 0.3})
        plugin.setdefault("prefix", {}).update({"bytes_per_token": 3.5})
        plugin.setdefault("directory", {}).update({"learn_from_usage": False})

    rc, out = validate_plugin(run_dir, "removed", removed_fields)
    assert rc == 0, out[-3000:]
    # Guard and router both configure (validate mode starts no probe), on
    # the main thread and each worker: one line per removed field all the
    # same.
    for field, instead in [("cost.w_rtt", "the round trip enters the cost as the probe measures it"),
                           ("cost.tie_ms", "exactly the least expected TTFT"),
                           ("tuning.w_rtt_min", "the round trip is not weighted"),
                           ("probe.rtt_alpha", "probe.rtt_window"),
                           ("prefix.bytes_per_token", "measured from each answer's usage.prompt_tokens"),
                           ("directory.learn_from_usage", "always read and learnt from"),
                           ("tuning.enabled", "always fitted on the observed TTFT"),
                           ("cost.bounded_load_floor", "leaves the region holding it only when"),
                           ("cost.w_queue", "the queue enters the cost unweighted"),
                           ("tuning.w_queue_min", "the queue enters the cost unweighted")]:
        lines = [l for l in out.splitlines() if f"{field} is no longer a setting" in l]
        assert len(lines) == 1, (field, lines or out[-3000:])
        assert instead in lines[0] and "next release refuses it" in lines[0], lines[0]
    # A field still in force is not warned about.
    assert "placement_floor is no longer" not in out


def test_non_json_configuration_is_refused(run_dir):
    cfg = harness.render_config(None, harness.free_port(), harness.free_port())
    for p in harness.wasm_plugins(cfg):
        p["configuration"]["value"] = "regions: [near]"
    path = run_dir / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    r = harness.validate(path)
    assert r.returncode != 0
    assert "invalid configuration: configuration: is not valid for this plugin" in r.stdout + r.stderr


def test_envoy_refuses_to_start_with_an_invalid_probe_config(run_dir):
    # Validate mode does not start the bootstrap singleton; a real start does.
    cfg = harness.render_config(None, harness.free_port(), harness.free_port())
    probe = next(harness.wasm_plugins(cfg))
    probe["configuration"]["value"] = json.dumps({"regions": [{"name": "x", "cluster": "c", "capacity_rps": -1}]})
    path = run_dir / "bad-probe.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    r = subprocess.run([str(harness.ENVOY), "-c", str(path), "--disable-hot-restart", "--base-id",
                        str(harness.free_port())], capture_output=True, text=True, timeout=60)
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert ("llm-geo-router probe: invalid configuration: regions[0].capacity_rps: "
            "-1 must be a finite number > 0; configuration refused") in out, out[-3000:]
