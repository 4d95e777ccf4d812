"""Soak: steady load through a real Envoy with the plugin for a long time,
sampling Envoy's memory every interval, to show that nothing the plugin
keeps (prefix directory, session records, in-flight gauges, the probe's
state) grows with the number of requests served.

    .venv/bin/python wasm-tests/soak.py --minutes 20 --json-out bench/results/soak.json

The load mixes what could make state grow: multi-turn conversations whose
prompts get longer, a new distinct prompt and a new session id in every
other request (so the directory and the session table see an endless stream
of new keys), and some invalid bodies. Each sample records Envoy's RSS
(/proc), the allocator's figures from the admin `/memory` endpoint, the
router's counters, and the client's counts. The verdict compares the
warmed-up part of the run: the least-squares slope of RSS, and the mean of
the last third against the first third.

The plugin's shared-data keys cannot be listed through any Envoy API; their
number is bounded by construction (`directory.slots` slot keys and
`directory.slots` session keys, each a key modulo the slot count). The run
uses small slot counts (`--slots`, default 512) so that every slot is
overwritten many times over during the run: if anything grew per key
written, RSS would show it.
"""

import argparse
import json
import os
import random
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def admin_memory(envoy: harness.Envoy) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{envoy.admin_port}/memory", timeout=10) as r:
        return {k: int(v) for k, v in json.loads(r.read()).items() if str(v).isdigit()}


def slope_per_min(points: list[tuple[float, float]]) -> float:
    n = len(points)
    if n < 2:
        return 0.0
    mx = sum(t for t, _ in points) / n
    my = sum(v for _, v in points) / n
    var = sum((t - mx) ** 2 for t, _ in points)
    return 0.0 if var == 0 else sum((t - mx) * (v - my) for t, v in points) / var * 60.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--interval-s", type=float, default=30.0, help="sampling period")
    ap.add_argument("--warmup-s", type=float, default=120.0, help="left out of the verdict")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--slots", type=int, default=512, help="directory.slots (also the session table)")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()

    run_dir = harness.fresh_run_dir("soak")
    fleet = harness.Fleet(run_dir)
    overrides = {
        "probe": {"tick_ms": 500, "timeout_ms": 500, "snapshot_max_age_ms": 5000},
        "directory": {"slots": args.slots},
    }
    fleet.start(overrides)
    envoy = fleet.envoy
    stop = threading.Event()
    lock = threading.Lock()
    counts: dict[str, int] = {}

    def count(key: str) -> None:
        with lock:
            counts[key] = counts.get(key, 0) + 1

    def client(k: int) -> None:
        rnd = random.Random(k)
        convo = [{"role": "system", "content": harness.filler(f"soak-system-{k % 3}", 2000)}]
        i = 0
        while not stop.is_set():
            i += 1
            try:
                if i % 2 == 0:
                    # A new prompt and a new session every time.
                    msgs = [{"role": "user", "content": harness.filler(f"soak-new-{k}-{i}", rnd.randint(200, 6000))}]
                    r = harness.chat(envoy.port, msgs, headers={"x-session-id": f"s-{k}-{i}"}, timeout=30)
                elif i % 17 == 0:
                    r = harness.request(envoy.port, "POST", "/v1/chat/completions", '{"messages": [', timeout=30)
                else:
                    convo.append({"role": "user", "content": harness.filler(f"soak-turn-{k}-{i}", 300)})
                    if len(convo) > 40:
                        convo = convo[:1]
                    r = harness.chat(envoy.port, convo, headers={"x-session-id": f"c-{k}"}, timeout=30)
                    convo.append({"role": "assistant", "content": f"answer {i}"})
                count(str(r.status))
            except Exception as e:  # noqa: BLE001
                count(type(e).__name__)
            time.sleep(0.01)

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(args.clients)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    samples = []
    end = t0 + args.minutes * 60
    try:
        while True:
            now = time.monotonic()
            mem = admin_memory(envoy)
            rq = envoy.stats(r"llm_geo_router\.region\.[a-z0-9_]+\.rq_total$")
            with lock:
                snapshot = dict(counts)
            samples.append({
                "t_s": round(now - t0, 1),
                "rss_kb": rss_kb(envoy.proc.pid),
                "allocated_bytes": mem.get("allocated", 0),
                "heap_size_bytes": mem.get("heap_size", 0),
                "routed": sum(rq.values()),
                "client_responses": snapshot,
            })
            print(json.dumps(samples[-1]), flush=True)
            if now >= end:
                break
            time.sleep(min(args.interval_s, max(0.0, end - time.monotonic())))
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=40)
        traps = harness.traps(envoy)
        fleet.stop()

    warm = [s for s in samples if s["t_s"] >= args.warmup_s]
    third = max(1, len(warm) // 3)
    first, last = warm[:third], warm[-third:]
    mean = lambda xs, k: sum(x[k] for x in xs) / max(1, len(xs))  # noqa: E731
    total = samples[-1]["client_responses"] if samples else {}
    served = sum(v for k, v in total.items() if k.isdigit())
    verdict = {
        "rss_slope_kb_per_min": round(slope_per_min([(s["t_s"], s["rss_kb"]) for s in warm]), 1),
        "allocated_slope_kb_per_min": round(
            slope_per_min([(s["t_s"], s["allocated_bytes"] / 1024) for s in warm]), 1),
        "rss_first_third_kb": round(mean(first, "rss_kb")),
        "rss_last_third_kb": round(mean(last, "rss_kb")),
        "allocated_first_third_bytes": round(mean(first, "allocated_bytes")),
        "allocated_last_third_bytes": round(mean(last, "allocated_bytes")),
        "requests": served,
        "errors": {k: v for k, v in total.items() if not k.isdigit()},
        "traps": len(traps),
    }
    result = {
        "command": "wasm-tests/soak.py " + " ".join(sys.argv[1:]),
        "minutes": args.minutes, "interval_s": args.interval_s, "warmup_s": args.warmup_s,
        "clients": args.clients, "directory_slots": args.slots,
        "machine": f"{os.cpu_count()} cores",
        "samples": samples, "verdict": verdict,
    }
    print(json.dumps(verdict, indent=1))
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if not traps and not verdict["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
