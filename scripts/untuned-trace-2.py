#!/usr/bin/env python3
"""A second fleet and trace for reporting only (issue 46: "a second untuned
trace of another shape, written before you tune anything on it"). Written
on 2026-12-05 before any run on it; nothing in the plugin or its defaults
was chosen on it, and a change tuned on it must not cite it.

Its shape differs from scenarios a-g and from scripts/untuned-trace.py:

- five client regions (na-east, na-west, eu, in, au) and three engine
  regions of unequal size, as three providers sell them: a large one in
  us-east, a middle one in Europe, a small one in Mumbai with slower
  prefill;
- arrivals in bursts: every 60 s the rate triples for 15 s, so the fleet
  swings between half idle and overloaded;
- a customer-support assistant whose long system prompt (tool schemas,
  policies: 6-9k tokens, one per product) every conversation shares, so
  every region soon holds it and what differs between regions is each
  conversation's own turns;
- batch summarisation: single long unique documents (8-30k tokens, long
  answers) from na-west;
- code completion: short prompts over a few shared file headers, a few
  output tokens, at a high rate.

    scripts/untuned-trace-2.py OUT_DIR [--seed N] [--cache-share F]

writes OUT_DIR/fleet.json and OUT_DIR/trace.jsonl for `llm-geo-router
simulate`. `--cache-share F` sizes each region's prefix cache at F times the
tokens of the distinct prefixes the trace sends (default: 1M / 500k / 300k
tokens)."""

import argparse
import random
from untuned_fleet import lognormal, write

CLIENTS = ["na-east", "na-west", "eu", "in", "au"]
SHARE = [0.35, 0.15, 0.25, 0.15, 0.10]
# name: (slots, prefill ms/token, cache tokens, rtt from each client region)
REGIONS = {
    "use1": (48, 0.07, 1_000_000, (8.0, 65.0, 80.0, 190.0, 200.0)),
    "euw": (24, 0.09, 500_000, (80.0, 140.0, 12.0, 120.0, 280.0)),
    "aps": (12, 0.15, 300_000, (190.0, 220.0, 115.0, 15.0, 150.0)),
}
INTER = {("use1", "euw"): 75.0, ("use1", "aps"): 185.0, ("euw", "aps"): 115.0}
DECODE_MS = 20.0
DURATION_MS = 300_000.0
BURST_EVERY_MS, BURST_MS, BURST_FACTOR = 60_000.0, 15_000.0, 3.0



def rate_at(base, t_ms):
    return base * (BURST_FACTOR if (t_ms % BURST_EVERY_MS) < BURST_MS else 1.0)


def arrivals(rng, base_per_s):
    """A Poisson process whose rate triples in each burst (thinning)."""
    peak = base_per_s * BURST_FACTOR / 1000.0
    t = 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= DURATION_MS:
            return
        if rng.random() < rate_at(base_per_s, t) / 1000.0 / peak:
            yield t


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--cache-share", type=float, default=None)
    args = ap.parse_args()
    rng = random.Random(1_000_003 * args.seed + 46)
    products = [lognormal(rng, 7500, 0.12, 6000, 9000) for _ in range(4)]
    headers = [lognormal(rng, 600, 0.4, 200, 1500) for _ in range(30)]
    tiers = ["free", "paid", "critical"]
    trace = []

    def add(t, session, client, tier, segs, out):
        trace.append({"t_ms": round(t, 3), "session": session, "client_region": client, "tier": tier,
                      "segments": [list(x) for x in segs], "output_tokens": out})

    # Customer support: 1.2 conversations a second (bursts included).
    for n, t in enumerate(arrivals(rng, 1.2)):
        name = f"s{args.seed}-{n}"
        client = rng.choices(CLIENTS, SHARE)[0]
        tier = rng.choices(tiers, [0.3, 0.6, 0.1])[0]
        p = rng.choices(range(len(products)), [0.5, 0.25, 0.15, 0.10])[0]
        segs = [(f"support-{p}", products[p]), (f"{name}-u0", lognormal(rng, 120, 0.6, 10, 1500))]
        turns = 1 + min(15, int(rng.expovariate(1 / 4.0)))
        at = t
        for k in range(turns):
            o = lognormal(rng, 180, 0.6, 10, 1000)
            add(at, name, client, tier, segs, o)
            # Half the answers call a tool, whose result comes back before
            # the customer's next message, after the answer and a think time.
            tool = [(f"{name}-t{k}", lognormal(rng, 400, 1.0, 20, 4000))] if rng.random() < 0.5 else []
            segs = segs + [(f"{name}-a{k}", o)] + tool + [(f"{name}-u{k + 1}", lognormal(rng, 120, 0.6, 10, 1500))]
            at += o * DECODE_MS + 3000.0 + rng.expovariate(1 / 9000.0)
    # Batch summarisation from na-west: 0.15 documents a second.
    for n, t in enumerate(arrivals(rng, 0.15)):
        name = f"b{args.seed}-{n}"
        add(t, name, "na-west", "free",
            [("summarise", 150), (f"{name}-doc", lognormal(rng, 14000, 0.5, 8000, 30000))],
            lognormal(rng, 500, 0.4, 150, 1500))
    # Code completion: 5 a second, anywhere, a few tokens out.
    for n, t in enumerate(arrivals(rng, 5.0)):
        name = f"c{args.seed}-{n}"
        h = int(rng.paretovariate(1.2)) % len(headers)
        add(t, name, rng.choices(CLIENTS, SHARE)[0], "paid",
            [(f"file-{h}", headers[h]), (f"{name}-ctx", lognormal(rng, 250, 0.6, 20, 2000))],
            lognormal(rng, 24, 0.5, 4, 128))
    trace = [r for r in trace if r["t_ms"] < DURATION_MS]
    cache = write(args.out, trace, CLIENTS, REGIONS, INTER, DECODE_MS, args.cache_share)
    sessions = len({r["session"] for r in trace})
    print(f"{len(trace)} requests, {sessions} sessions, caches {cache}")


if __name__ == "__main__":
    main()
