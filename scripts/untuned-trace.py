#!/usr/bin/env python3
"""A three-client-region fleet and trace for reporting only (issue 28's "a
trace you did not tune on"). Nothing in the plugin or its defaults was chosen
on it: it was written after the defaults, and a change tuned on it must not
cite it. Its shape differs from scenarios a-g on purpose: four engine regions
(one small and far from most traffic), client regions in South America,
Europe and South-East Asia whose demand follows the sun (each region's share
rises and falls over the run), and a mix of chat behind shared system
prompts, retrieval over shared documents, coding agents with long private
contexts, and one-off prompts.

    scripts/untuned-trace.py OUT_DIR [--seed N] [--cache-share F]

writes OUT_DIR/fleet.json and OUT_DIR/trace.jsonl for `llm-geo-router
simulate`. `--cache-share F` sizes each region's prefix cache at F times the
tokens of the distinct prefixes the trace sends (default: large caches,
600k-800k tokens per region)."""

import argparse
import random
from untuned_fleet import lognormal, write

CLIENTS = ["sa", "eu", "sea"]
# name: (slots, prefill ms/token, cache tokens, rtt from sa / eu / sea)
REGIONS = {
    "ord": (32, 0.08, 800_000, (140.0, 95.0, 220.0)),
    "dub": (24, 0.10, 600_000, (190.0, 14.0, 170.0)),
    "gru": (16, 0.12, 400_000, (12.0, 195.0, 330.0)),
    "sin": (24, 0.09, 600_000, (330.0, 170.0, 10.0)),
}
INTER = {("ord", "dub"): 80.0, ("ord", "gru"): 128.0, ("ord", "sin"): 210.0,
         ("dub", "gru"): 180.0, ("dub", "sin"): 160.0, ("gru", "sin"): 325.0}
DECODE_MS = 18.0
DURATION_MS = 360_000.0



def zipf_pick(rng, n, s):
    weights = [1.0 / (k + 1) ** s for k in range(n)]
    return rng.choices(range(n), weights)[0]


def client_at(rng, t_ms):
    # Follow the sun: sea peaks early, eu in the middle, sa late.
    x = t_ms / DURATION_MS
    shares = [0.15 + 0.5 * max(0.0, x - 0.5), 0.2 + 0.35 * (1 - abs(x - 0.5) * 2), 0.15 + 0.5 * max(0.0, 0.5 - x)]
    return rng.choices(CLIENTS, shares)[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--cache-share", type=float, default=None)
    ap.add_argument("--rate", type=float, default=2.6, help="sessions per second")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    systems = [lognormal(rng, 1200, 0.5, 400, 3000) for _ in range(8)]
    docs = [lognormal(rng, 6000, 0.45, 2500, 14000) for _ in range(60)]
    tiers = ["free", "paid", "critical"]
    trace = []
    t = 0.0
    n = 0
    while True:
        t += rng.expovariate(args.rate / 1000.0)
        if t >= DURATION_MS:
            break
        n += 1
        name = f"u{args.seed}-{n}"
        client = client_at(rng, t)
        tier = rng.choices(tiers, [0.35, 0.55, 0.10])[0]
        kind = rng.choices(["chat", "rag", "agent", "oneoff"], [0.45, 0.25, 0.20, 0.10])[0]
        if kind == "chat":
            s = zipf_pick(rng, len(systems), 1.1)
            segs = [(f"sys{s}", systems[s]), (f"{name}-u0", lognormal(rng, 150, 0.7, 10, 2000))]
            turns = min(12, 1 + int(rng.expovariate(1 / 4.0)))
            out, user, gap = (250, 0.6, 20, 1200), (150, 0.7, 10, 2000), (4000.0, 8000.0)
        elif kind == "rag":
            d = zipf_pick(rng, len(docs), 0.9)
            segs = [("rag-sys", 300), (f"doc{d}", docs[d]), (f"{name}-u0", lognormal(rng, 90, 0.5, 20, 400))]
            turns = rng.choices([1, 2, 3], [0.6, 0.3, 0.1])[0]
            out, user, gap = (150, 0.5, 20, 600), (80, 0.5, 10, 400), (6000.0, 10000.0)
        elif kind == "agent":
            segs = [("agent-sys", 2200), (f"{name}-repo", lognormal(rng, 18000, 0.3, 9000, 32000))]
            turns = rng.randint(5, 20)
            out, user, gap = (300, 0.6, 40, 1500), (1200, 0.8, 200, 6000), (1000.0, 2000.0)
        else:
            segs = [(f"{name}-p", lognormal(rng, 1200, 0.9, 100, 8000))]
            turns = 1
            out, user, gap = (300, 0.7, 20, 1500), (0, 0, 0, 0), (0.0, 0.0)
        at = t
        for k in range(turns):
            if k:
                at += gap[0] + rng.expovariate(1 / gap[1])
            o = lognormal(rng, *out)
            trace.append({"t_ms": round(at, 3), "session": name, "client_region": client, "tier": tier,
                          "segments": [list(x) for x in segs], "output_tokens": o})
            segs = segs + [(f"{name}-a{k}", o), (f"{name}-u{k + 1}", lognormal(rng, *user))]
            # The next turn comes after this one's expected duration and a
            # think (or tool) time, whatever the router does.
            at += o * DECODE_MS
    cache = write(args.out, trace, CLIENTS, REGIONS, INTER, DECODE_MS, args.cache_share)
    print(f"{len(trace)} requests, {n} sessions, caches {cache}")


if __name__ == "__main__":
    main()
