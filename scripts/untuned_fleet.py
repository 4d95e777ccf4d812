"""What the untuned-trace scripts share: their lognormal draw, and writing
a trace and its fleet (OUT/fleet.json, OUT/trace.jsonl) for `llm-geo-router
simulate`, each region's cache as the script sets it or, with
`cache_share`, that share of the distinct prefix tokens the trace sends."""

import json
import math
from pathlib import Path


def lognormal(rng, median, sigma, lo, hi):
    return int(round(min(hi, max(lo, median * math.exp(rng.gauss(0.0, sigma))))))


def write(out, trace, clients, regions, inter, decode_ms, cache_share=None):
    """`regions`: name -> (slots, prefill ms/token, cache tokens, rtt from
    each client region); `inter`: (a, b) -> region-to-region rtt. Sorts
    the trace; returns the caches written."""
    trace.sort(key=lambda r: r["t_ms"])
    cache = {name: c for name, (_, _, c, _) in regions.items()}
    if cache_share is not None:
        # Distinct prefix tokens the trace sends: each distinct segment once.
        distinct = {}
        for r in trace:
            for sid, n_tok in r["segments"]:
                distinct[sid] = n_tok
        total = sum(distinct.values())
        cache = {name: max(1000, int(total * cache_share)) for name in regions}
    fleet = []
    for name, (slots, prefill, _, rtts) in regions.items():
        fleet.append({
            "name": name, "rtt_ms": dict(zip(clients, rtts)), "max_concurrency": slots,
            "prefill_ms_per_token": prefill, "decode_ms_per_token": decode_ms, "cache_tokens": cache[name],
            "region_rtt_ms": {b: ms for (a, b), ms in inter.items() if a == name},
        })
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fleet.json").write_text(json.dumps({"client_regions": clients, "regions": fleet}, indent=1) + "\n")
    with open(out / "trace.jsonl", "w") as f:
        for r in trace:
            f.write(json.dumps(r, separators=(",", ":")) + "\n")
    return cache
