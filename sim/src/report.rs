//! What a run amounts to: TTFT and end-to-end distributions, cache hit token
//! ratio, counts, per-region requests and utilisation; as the `--json`
//! object and as a table.
//!
//! Percentiles are nearest-rank: p(q) is the ⌈q·n⌉-th smallest value. TTFT
//! counts every request whose first token reached its client; e2e every
//! request completed.

use crate::fleet::Fleet;
use crate::sim::{Run, Status};
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
    /// Requests sent to another region than their session's previous one.
    pub session_moves: u64,
    /// Geo-router: decisions per reason.
    pub reasons: BTreeMap<&'static str, u64>,
}

pub fn summarize(fleet: &Fleet, work: &Workload, run: &Run) -> Summary {
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
            let cap = f64::from(r.max_concurrency) * (hi - lo).max(1.0);
            (r.name.clone(), busy / cap)
        })
        .collect();
    Summary {
        label: run.label(),
        policy: run.policy.as_str(),
        deployment: run.deployment.to_string(),
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
        session_moves,
        reasons: run.reasons.clone(),
    }
}

/// Every request's outcome as one JSON object (`simulate --requests`).
pub fn request_lines(fleet: &Fleet, work: &Workload, run: &Run) -> Vec<Value> {
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
    for x in summaries.iter().filter(|x| !x.reasons.is_empty()) {
        let parts: Vec<String> = x.reasons.iter().map(|(r, n)| format!("{r} {n}")).collect();
        s.push_str(&format!(
            "\n{} decisions by reason: {}\n",
            x.label,
            parts.join(", ")
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
