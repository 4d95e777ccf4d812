"""What each kind of proxy-wasm host call costs in Envoy 1.40's V8 runtime:
the overhead benchmark's harness (wasm-tests/bench_overhead.py, 4 KB fixed
bodies, 16 connections, plain Envoy alternated) run with the probe module
bench/hostcalls (the smallest router: pause, body copy, cluster header,
route cache) instead of the plugin, making N more calls of one kind per
request. Cost per call = (added CPU µs/rq − the `none` run's) / N.

    scripts/bench-hostcalls                  # builds the module, runs this
"""

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_overhead as b  # noqa: E402
import harness  # noqa: E402

ROOT = harness.ROOT
PROBE = ROOT / "bench" / "hostcalls" / "target" / "wasm32-wasip1" / "release" / "hostcall_probe.wasm"
KINDS = [("none", 0), ("get_metric", 100), ("increment_metric", 100), ("get_header", 100),
         ("get_header_map", 30), ("set_header", 50), ("get_shared_data", 50), ("set_shared_data", 50),
         ("get_current_time", 100), ("set_property", 50), ("get_property", 30)]


def run(kind: str, n: int) -> float:
    """Added Envoy CPU µs per request of the probe module doing N calls."""
    harness.WASM = PROBE
    b.wait_snapshot = lambda *a, **k: None
    b.probe_one = lambda t, body: {"x-llm-route": "region=probe"}
    b.check_run = lambda *a, **k: []
    orig = b.split_config

    def split(path, ports, admin, port):
        ing, up = orig(path, ports, admin, port)
        ing.pop("bootstrap_extensions", None)
        for p in harness.wasm_plugins(ing):
            p["configuration"]["value"] = f"{kind}:{n}"
        return ing, up

    b.split_config = split
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"hostcalls-{kind}.json"
    sys.argv = ["bench_overhead.py", "--duration", "3", "--rounds", "2", "--latency-duration", "0",
                "--modes", "fixed", "--sizes", "4096", "--stream-duration", "0", "--json", str(out)]
    try:
        b.main()
    finally:
        b.split_config = orig
    case = json.loads(out.read_text())["cases"][0]["summary"]
    return case["added_cpu_us_per_rq"]


def main() -> int:
    if not PROBE.exists():
        raise SystemExit(f"missing {PROBE}: run scripts/bench-hostcalls (it builds it)")
    added = {}
    for kind, n in KINDS:
        added[kind] = (run(kind, n), n)
    base = added["none"][0]
    print("\n| host call | calls per request | added CPU µs/rq | µs per call |")
    print("|---|---:|---:|---:|")
    for kind, (us, n) in added.items():
        per = "—" if n == 0 else f"{(us - base) / n:.3f}"
        print(f"| `{kind}` | {n} | {us:.1f} | {per} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
