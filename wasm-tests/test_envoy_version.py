"""The plugin reads the running Envoy's version (xds.node.user_agent_build_version)
and says it once per Envoy: a warning on a build that can lose a request body
frame behind the router and the guard (envoyproxy/envoy#46842; which builds,
src/shared/envoy_version.rs and docs/INSTALL.md), else an info line naming it."""

import re
import subprocess

import harness


def test_the_probe_names_the_envoy_it_runs_on_once(fleet_factory):
    fleet = fleet_factory()
    envoy = fleet.envoy
    out = subprocess.run([str(harness.ENVOY), "--version"], capture_output=True, text=True).stdout
    # "envoy  version: <sha>/1.40.0/Clean/RELEASE/BoringSSL"
    m = re.search(r"/(\d+)\.(\d+)\.(\d+)(-dev)?/", out)
    assert m, out
    running = f"{m[1]}.{m[2]}.{m[3]}" + ("-dev" if m[4] else "")
    log = envoy.log()
    lines = [l for l in log.splitlines() if "llm-geo-router probe: running on Envoy" in l]
    assert len(lines) == 1, lines or log[-3000:]
    assert lines[0].endswith(f"running on Envoy {running}"), (lines[0], running)
    # The suite's Envoy (1.40.0) has the fix: no warning, and the version
    # was read (not the line for an unreadable one).
    assert "can silently lose a request body frame" not in log
    assert "the Envoy version is not readable here" not in log
