//! What a run amounts to: TTFT and end-to-end distributions, cache hit token
//! ratio, counts, per-region requests, utilisation and occupancy (hot
//! spots); as the `--json` object and as a table.
//!
//! Percentiles are nearest-rank: p(q) is the ⌈q·n⌉-th smallest value. TTFT
//! counts every request whose first token reached its client; e2e every
//! request completed.

use crate::sim::{Run, Status};
use crate::topology::Topology;
use crate::workload::Workload;
use serde_json::{json, Map, Value};
use std::collections::{BTreeMap, HashMap};

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dist {
    pub mean: f64,
    pub p50: f64,
    pub p95: f64,
    pub p99: f64,
}

/// Nearest-rank percentile of sorted values.
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted
        .get(rank.clamp(1, sorted.len()) - 1)
        .copied()
        .unwrap_or(f64::NAN)
}

/// A request waited for a slot if it got one more than this after reaching
/// its engine.
pub const QUEUED_MS: f64 = 0.5;

/// One region's occupancy over the middle half of the trace: requests at
/// its engine (running and waiting) as a fraction of its slots
/// (`max_concurrency`), sampled every `sim::SAMPLE_MS`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Occupancy {
    pub p50: f64,
    pub p95: f64,
    pub max: f64,
    /// The fraction of samples with a request waiting for a slot.
    pub queue_time_share: f64,
}

/// Of the requests an engine admitted (gave a slot), the fraction that
/// waited for it more than `QUEUED_MS`; `None` if none was admitted.
pub fn queued_share(run: &Run) -> Option<f64> {
    let admitted: Vec<f64> = run.records.iter().filter_map(|r| r.queued_ms).collect();
    if admitted.is_empty() {
        return None;
    }
    let queued = admitted.iter().filter(|q| **q > QUEUED_MS).count();
    Some(queued as f64 / admitted.len() as f64)
}

/// Per region (by name): its occupancy from `run.occupancy`, `None` without
/// a sample (a span too short) or without slots.
pub fn occupancy(fleet: &Topology, run: &Run) -> BTreeMap<String, Option<Occupancy>> {
    fleet
        .regions
        .iter()
        .enumerate()
        .map(|(r, region)| {
            let samples = run.occupancy.get(r).map_or(&[][..], Vec::as_slice);
            let slots = f64::from(region.slots());
            let o = (!samples.is_empty() && slots > 0.0).then(|| {
                let mut v: Vec<f64> = samples.iter().map(|(n, _)| f64::from(*n) / slots).collect();
                v.sort_by(f64::total_cmp);
                let waiting = samples.iter().filter(|(_, w)| *w > 0).count();
                Occupancy {
                    p50: percentile(&v, 0.50),
                    p95: percentile(&v, 0.95),
                    max: v.last().copied().unwrap_or(f64::NAN),
                    queue_time_share: waiting as f64 / samples.len() as f64,
                }
            });
            (region.name.clone(), o)
        })
        .collect()
}

pub fn dist(values: &[f64]) -> Option<Dist> {
    if values.is_empty() {
        return None;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    Some(Dist {
        mean: v.iter().sum::<f64>() / v.len() as f64,
        p50: percentile(&v, 0.50),
        p95: percentile(&v, 0.95),
        p99: percentile(&v, 0.99),
    })
}

#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    /// `geo-router`, or `<policy>@<deployment>` for a baseline.
    pub label: String,
    pub policy: &'static str,
    /// `oracle`, `per-client-region`, `global:<region>` (the geo-router:
    /// always `per-client-region`).
    pub deployment: String,
    /// Geo-router: Envoys per client region; 1 for a baseline.
    pub proxies: usize,
    pub ttft: Option<Dist>,
    pub e2e: Option<Dist>,
    pub cache_hit_token_ratio: f64,
    pub requests: u64,
    pub completed: u64,
    pub shed: u64,
    /// A level's cap applied: `max_tokens` clamped, or the prompt refused (413).
    pub capped: u64,
    pub failed: u64,
    pub per_region_requests: BTreeMap<String, u64>,
    /// Per region: slot time used / (slots × time), over the middle half of
    /// the trace's span.
    pub utilisation: BTreeMap<String, f64>,
    /// `queued_share`.
    pub queued_share: Option<f64>,
    /// `occupancy`.
    pub occupancy: BTreeMap<String, Option<Occupancy>>,
    /// Requests sent to another region than their session's previous one.
    pub session_moves: u64,
    /// Geo-router: decisions per reason.
    pub reasons: BTreeMap<&'static str, u64>,
    /// Geo-router: `/metrics` scrapes each Envoy's probe sent each region's
    /// engine per minute of the run, and the share of the run its probes
    /// ticked at the busy period.
    pub probe_scrapes_per_min: Option<f64>,
    pub probe_busy_share: Option<f64>,
    /// Geo-router: queries each Envoy's probe sent Prometheus per minute.
    pub probe_queries_per_min: Option<f64>,
    /// Geo-router: where it read the regions' load from (`geo::Source::label`).
    pub load_source: Option<String>,
}

pub fn summarize(fleet: &Topology, work: &Workload, run: &Run) -> Summary {
    let mut last: HashMap<&str, usize> = HashMap::new();
    let mut session_moves = 0;
    for (req, rec) in work.requests.iter().zip(&run.records) {
        if let Some(region) = rec.region {
            if last
                .insert(&req.session, region)
                .is_some_and(|p| p != region)
            {
                session_moves += 1;
            }
        }
    }
    let ttft: Vec<f64> = run.records.iter().filter_map(|r| r.ttft_ms).collect();
    let e2e: Vec<f64> = run.records.iter().filter_map(|r| r.e2e_ms).collect();
    let prompt: u64 = run.records.iter().map(|r| r.prompt_tokens).sum();
    let cached: u64 = run.records.iter().map(|r| r.cached_tokens).sum();
    let count = |s: Status| run.records.iter().filter(|r| r.status == s).count() as u64;
    let mut per_region: BTreeMap<String, u64> =
        fleet.regions.iter().map(|r| (r.name.clone(), 0)).collect();
    for r in &run.records {
        if let Some(name) = r.region.and_then(|i| fleet.regions.get(i)) {
            *per_region.entry(name.name.clone()).or_insert(0) += 1;
        }
    }
    let utilisation = fleet
        .regions
        .iter()
        .zip(&run.busy_ms)
        .map(|(r, busy)| {
            let (lo, hi) = run.window_ms;
            let cap = f64::from(r.slots()) * (hi - lo).max(1.0);
            (r.name.clone(), busy / cap)
        })
        .collect();
    Summary {
        label: run.label(),
        policy: run.policy.as_str(),
        deployment: run.deployment.to_string(),
        proxies: run.proxies,
        ttft: dist(&ttft),
        e2e: dist(&e2e),
        cache_hit_token_ratio: if prompt == 0 {
            0.0
        } else {
            cached as f64 / prompt as f64
        },
        requests: run.records.len() as u64,
        completed: count(Status::Completed),
        shed: count(Status::Shed),
        capped: count(Status::TooLong) + run.records.iter().filter(|r| r.clamped).count() as u64,
        failed: count(Status::Failed),
        per_region_requests: per_region,
        utilisation,
        queued_share: queued_share(run),
        occupancy: occupancy(fleet, run),
        session_moves,
        reasons: run.reasons.clone(),
        probe_scrapes_per_min: run.probe.map(|p| {
            let per = (p.envoys * fleet.regions.len()).max(1) as f64;
            p.scrapes as f64 / per / (run.end_ms.max(1.0) / 60_000.0)
        }),
        probe_busy_share: run
            .probe
            .map(|p| p.fast_ms / (p.envoys.max(1) as f64 * run.end_ms.max(1.0))),
        probe_queries_per_min: run
            .probe
            .map(|p| p.queries as f64 / p.envoys.max(1) as f64 / (run.end_ms.max(1.0) / 60_000.0)),
        load_source: run.source.map(|s| s.label()),
    }
}

/// Every request's outcome as one JSON object (`simulate --requests`).
pub fn request_lines(fleet: &Topology, work: &Workload, run: &Run) -> Vec<Value> {
    work.requests
        .iter()
        .zip(&run.records)
        .enumerate()
        .map(|(i, (req, rec))| {
            let status = match rec.status {
                Status::Completed => "completed",
                Status::Shed => "shed",
                Status::TooLong => "too_long",
                Status::Failed => "failed",
            };
            json!({
                "policy": run.label(),
                "deployment": run.deployment.to_string(),
                "index": i,
                "t_ms": req.t_ms,
                "session": req.session,
                "client_region": req.client_region,
                "region": rec.region.and_then(|r| fleet.regions.get(r)).map(|r| r.name.as_str()),
                "status": status,
                "ttft_ms": rec.ttft_ms,
                "e2e_ms": rec.e2e_ms,
                "prompt_tokens": rec.prompt_tokens,
                "cached_tokens": rec.cached_tokens,
                "queued_ms": rec.queued_ms,
                "reason": rec.reason,
            })
        })
        .collect()
}

fn dist_json(d: Option<Dist>) -> Value {
    match d {
        Some(d) => json!({"mean": d.mean, "p50": d.p50, "p95": d.p95, "p99": d.p99}),
        None => json!({"mean": null, "p50": null, "p95": null, "p99": null}),
    }
}

/// The `--json` object: `{"policies": {"<label>": {...}}}`, the label
/// `geo-router` or `<policy>@<deployment>`.
pub fn to_json(summaries: &[Summary]) -> Value {
    let mut policies = Map::new();
    for s in summaries {
        policies.insert(
            s.label.clone(),
            json!({
                "policy": s.policy,
                "deployment": s.deployment,
                "ttft_ms": dist_json(s.ttft),
                "e2e_ms": dist_json(s.e2e),
                "cache_hit_token_ratio": s.cache_hit_token_ratio,
                "requests": s.requests,
                "completed": s.completed,
                "shed": s.shed,
                "capped": s.capped,
                "per_region_requests": s.per_region_requests,
                "proxies": s.proxies,
                "utilisation": s.utilisation,
                "queued_share": s.queued_share,
                "occupancy": s.occupancy.iter().map(|(name, o)| {
                    let v = o.map_or(Value::Null, |o| json!({"p50": o.p50, "p95": o.p95, "max": o.max}));
                    (name.clone(), v)
                }).collect::<Map<String, Value>>(),
                "queue_time_share": s.occupancy.iter().map(|(name, o)| {
                    (name.clone(), json!(o.map(|o| o.queue_time_share)))
                }).collect::<Map<String, Value>>(),
                "reasons": s.reasons,
                "probe_scrapes_per_min": s.probe_scrapes_per_min,
                "probe_busy_share": s.probe_busy_share,
                "probe_queries_per_min": s.probe_queries_per_min,
                "load_source": s.load_source,
            }),
        );
    }
    json!({ "policies": policies })
}

/// A table for people: one row per run, the oracle rows marked as the
/// limit they are.
pub fn to_text(summaries: &[Summary]) -> String {
    let f = |d: Option<Dist>, pick: fn(&Dist) -> f64| {
        d.map_or("-".to_string(), |d| format!("{:.0}", pick(&d)))
    };
    let w = summaries
        .iter()
        .map(|x| x.label.chars().count())
        .max()
        .unwrap_or(0)
        .max(17);
    let mut s = format!(
        "{:<w$} {:>8} {:>8} {:>8} {:>9} {:>9} {:>6} {:>6} {:>6} {:>6} {:>6}\n",
        "policy",
        "ttft p50",
        "ttft p95",
        "ttft p99",
        "ttft mean",
        "e2e mean",
        "hit",
        "done",
        "shed",
        "capped",
        "failed"
    );
    for x in summaries {
        s.push_str(&format!(
            "{:<w$} {:>8} {:>8} {:>8} {:>9} {:>9} {:>6.3} {:>6} {:>6} {:>6} {:>6}\n",
            x.label,
            f(x.ttft, |d| d.p50),
            f(x.ttft, |d| d.p95),
            f(x.ttft, |d| d.p99),
            f(x.ttft, |d| d.mean),
            f(x.e2e, |d| d.mean),
            x.cache_hit_token_ratio,
            x.completed,
            x.shed,
            x.capped,
            x.failed,
        ));
    }
    s.push_str(
        "\nrequests per region (utilisation of its slots in the middle half of the trace):\n",
    );
    for x in summaries {
        let parts: Vec<String> = x
            .per_region_requests
            .iter()
            .map(|(name, n)| {
                let u = x.utilisation.get(name).copied().unwrap_or(0.0);
                format!("{name} {n} ({:.0} %)", 100.0 * u)
            })
            .collect();
        s.push_str(&format!(
            "  {:<w$} {}; session moves {}\n",
            x.label,
            parts.join(", "),
            x.session_moves
        ));
    }
    s.push_str(
        "\nhot spots: requests that waited for a slot; per region, requests at the engine \
         (running + waiting) / slots every 1 s in the middle half, p95 and max, \
         and the share of samples with one waiting:\n",
    );
    for x in summaries {
        let parts: Vec<String> = x
            .occupancy
            .iter()
            .map(|(name, o)| match o {
                Some(o) => format!(
                    "{name} {:.2}/{:.2} q {:.0} %",
                    o.p95,
                    o.max,
                    100.0 * o.queue_time_share
                ),
                None => format!("{name} -"),
            })
            .collect();
        let queued = x
            .queued_share
            .map_or("-".to_string(), |q| format!("{:.1} %", 100.0 * q));
        s.push_str(&format!(
            "  {:<w$} queued {queued}; {}\n",
            x.label,
            parts.join(", ")
        ));
    }
    for x in summaries.iter().filter(|x| !x.reasons.is_empty()) {
        let parts: Vec<String> = x.reasons.iter().map(|(r, n)| format!("{r} {n}")).collect();
        s.push_str(&format!(
            "\n{} decisions by reason: {}\n",
            x.label,
            parts.join(", ")
        ));
    }
    for x in summaries.iter().filter(|x| x.proxies > 1) {
        s.push_str(&format!(
            "\n{}: {} Envoys per client region, each request to the next in turn\n",
            x.label, x.proxies
        ));
    }
    if summaries.iter().any(|x| x.deployment == "oracle") {
        s.push_str(
            "\n@oracle: one instance that sees every queue and prefix exactly and at once, \
             at no network position: the limit, not a peer.\n",
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::deploy::Deployment;
    use crate::policy::PolicyName;
    use crate::trace::TraceRequest;

    /// Two slots in near (10 ms from na), two in far.
    fn fleet() -> Topology {
        Topology::parse(
            br#"{"client_regions": ["na"], "regions": [
              {"name": "near", "rtt_ms": {"na": 10}, "max_concurrency": 2,
               "prefill_ms_per_token": 0.5, "decode_ms_per_token": 10, "cache_tokens": 100000},
              {"name": "far", "rtt_ms": {"na": 120}, "max_concurrency": 2,
               "prefill_ms_per_token": 0.5, "decode_ms_per_token": 10, "cache_tokens": 100000}]}"#,
        )
        .unwrap()
    }

    fn req(t_ms: f64, session: &str, out: u32) -> TraceRequest {
        TraceRequest {
            t_ms,
            session: session.into(),
            client_region: "na".into(),
            tier: "paid".into(),
            segments: vec![(session.to_string(), 10)],
            output_tokens: out,
        }
    }

    /// Nearest sends everything to near. At 0: A (about 2.5 s of decode),
    /// B and C (10 s): C waits for A's slot until about 2.5 s. At 8 s: D,
    /// which waits for B's slot until about 10 s. The span is 8 s, the
    /// middle half 2-6 s: samples at 2, 3, 4 and 5 s.
    fn hot_run() -> (Topology, Workload, Run) {
        let f = fleet();
        let trace = vec![
            req(0.0, "a", 250),
            req(0.0, "b", 1000),
            req(0.0, "c", 1000),
            req(8000.0, "d", 5),
        ];
        let w = Workload::new(&f, trace).unwrap();
        let r = crate::sim::run(&f, &w, PolicyName::Nearest, &Deployment::Oracle, None).unwrap();
        (f, w, r)
    }

    #[test]
    fn occupancy_is_sampled_every_second_in_the_middle_half() {
        let (f, w, r) = hot_run();
        assert_eq!(r.window_ms, (2000.0, 6000.0));
        // (at the engine, of them waiting): A, B, C with C waiting; then B, C.
        assert_eq!(r.occupancy[0], [(3, 1), (2, 0), (2, 0), (2, 0)]);
        assert_eq!(r.occupancy[1], [(0, 0); 4]);
        let o = occupancy(&f, &r);
        // Nearest rank of [1, 1, 1, 1.5] over 2 slots.
        assert_eq!(
            o["near"],
            Some(Occupancy {
                p50: 1.0,
                p95: 1.5,
                max: 1.5,
                queue_time_share: 0.25
            })
        );
        assert_eq!(
            o["far"],
            Some(Occupancy {
                p50: 0.0,
                p95: 0.0,
                max: 0.0,
                queue_time_share: 0.0
            })
        );
        let s = summarize(&f, &w, &r);
        let j = &to_json(&[s])["policies"]["nearest@oracle"];
        assert_eq!(
            j["occupancy"]["near"],
            json!({"p50": 1.0, "p95": 1.5, "max": 1.5})
        );
        assert_eq!(j["queue_time_share"]["near"], 0.25);
        assert_eq!(j["queue_time_share"]["far"], 0.0);
        // Too short a trace for a sample: null, not 0.
        let one = Workload::new(&f, vec![req(0.0, "a", 5)]).unwrap();
        let r = crate::sim::run(&f, &one, PolicyName::Nearest, &Deployment::Oracle, None).unwrap();
        assert_eq!(occupancy(&f, &r)["near"], None);
        let j = to_json(&[summarize(&f, &one, &r)]);
        assert_eq!(
            j["policies"]["nearest@oracle"]["occupancy"]["near"],
            Value::Null
        );
    }

    #[test]
    fn queued_share_counts_the_admitted_requests_that_waited() {
        let (f, w, mut r) = hot_run();
        let queued: Vec<bool> = r
            .records
            .iter()
            .map(|x| x.queued_ms.unwrap() > 100.0)
            .collect();
        // C and D waited (seconds), A and B did not.
        assert_eq!(queued, [false, false, true, true]);
        assert_eq!(queued_share(&r), Some(0.5));
        assert_eq!(summarize(&f, &w, &r).queued_share, Some(0.5));
        // The threshold is 0.5 ms; a request never admitted does not count.
        for (rec, q) in r
            .records
            .iter_mut()
            .zip([Some(0.5), Some(0.6), None, Some(0.0)])
        {
            rec.queued_ms = q;
        }
        assert_eq!(queued_share(&r), Some(1.0 / 3.0));
        for rec in &mut r.records {
            rec.queued_ms = None;
        }
        assert_eq!(queued_share(&r), None);
    }

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), 50.0);
        assert_eq!(percentile(&v, 0.95), 95.0);
        assert_eq!(percentile(&v, 0.99), 99.0);
        assert_eq!(percentile(&[7.0], 0.99), 7.0);
        let d = dist(&[3.0, 1.0, 2.0]).unwrap();
        assert_eq!((d.mean, d.p50, d.p95), (2.0, 2.0, 3.0));
        assert!(dist(&[]).is_none());
    }
}
