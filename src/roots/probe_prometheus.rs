//! The probe's `prometheus` load source: one query per full round for
//! every region using it, each answer read as of when Prometheus scraped
//! the engines, against this Envoy's in-flight requests at that time.

use crate::config::LoadSource;
use crate::roots::probe::{Kind, Probe, ALL_REGIONS};
use crate::shared::host_api::{CalloutResponse, Level, ProbeHost};
use crate::shared::names::{Global, RegionStat, Stat};

/// Samples of this Envoy's in-flight requests kept per region, one per
/// tick: enough to find the count when Prometheus scraped the engines.
const INFLIGHT_HISTORY: usize = 128;

impl Probe {
    /// This Envoy's in-flight requests to each region using the
    /// `prometheus` source, kept for when Prometheus scraped its engines.
    pub(super) fn record_inflight(&mut self, host: &mut dyn ProbeHost, now: u64) {
        if self.prom_path.is_none() {
            return;
        }
        for (i, r) in self.cfg.regions.iter().enumerate() {
            if r.load_source != LoadSource::Prometheus {
                continue;
            }
            let inflight = host.stat(Stat::Region(i, RegionStat::RqActive)) as f64;
            if let Some(h) = self.inflight_history.get_mut(i) {
                if h.len() >= INFLIGHT_HISTORY {
                    h.pop_front();
                }
                h.push_back((now, inflight));
            }
        }
    }

    /// This Envoy's in-flight requests to `region` at `at_ms`: the last
    /// tick's count at or before then (the oldest kept if none is).
    fn inflight_at(&self, region: usize, at_ms: u64, now_inflight: f64) -> f64 {
        let Some(h) = self.inflight_history.get(region) else {
            return now_inflight;
        };
        h.iter()
            .rev()
            .find(|(t, _)| *t <= at_ms)
            .or(h.front())
            .map_or(now_inflight, |(_, v)| *v)
    }

    /// The `prometheus` source's one query for every region using it,
    /// unless the last one is still out.
    pub(super) fn query_prometheus(&mut self, host: &mut dyn ProbeHost, now: u64) {
        let (Some(path), Some(cluster)) = (&self.prom_path, &self.cfg.prometheus.cluster) else {
            return;
        };
        if self
            .pending
            .values()
            .any(|(_, k, _)| *k == Kind::Prometheus)
        {
            return;
        }
        let authority = self.cfg.prometheus.authority.as_deref().unwrap_or(cluster);
        let headers = [
            (":method", "GET"),
            (":path", path.as_str()),
            (":authority", authority),
            ("accept", "application/json"),
            ("user-agent", "llm-geo-router-probe"),
        ];
        host.count(Stat::Global(Global::ProbeCallouts), 1);
        let timeout = u64::from(self.cfg.probe.timeout_ms);
        match host.dispatch(cluster, &headers, None, timeout) {
            Ok(token) => {
                self.pending
                    .insert(token, (ALL_REGIONS, Kind::Prometheus, now));
            }
            Err(status) => {
                let e = format!("callout to cluster {cluster:?} refused by the host ({status}); is the cluster defined?");
                self.prometheus_failed(host, &e, now);
            }
        }
    }

    /// The Prometheus answer: each region using it gets its load summed
    /// over its replicas, as of when Prometheus scraped them; a region the
    /// answer has no complete figures for (or any region, when the query
    /// failed) has a failed scrape.
    pub(super) fn prometheus(
        &mut self,
        host: &mut dyn ProbeHost,
        status: Option<u32>,
        response: &mut dyn CalloutResponse,
        now: u64,
    ) {
        let read = match status {
            Some(s) if (200..300).contains(&s) => {
                match response.body(crate::engines::promql::MAX_ANSWER_BYTES + 1) {
                    Some(b) => crate::engines::promql::parse_answer(&self.cfg, &b),
                    None => Err("the answer has no body".to_string()),
                }
            }
            Some(s) => Err(format!("status {s}")),
            None => Err("no response (timeout or connection failure)".to_string()),
        };
        let loads = match read {
            Ok(l) => l,
            Err(e) => return self.prometheus_failed(host, &e, now),
        };
        self.prom_warned = false;
        let cfg = self.cfg.clone();
        let mut missing = Vec::new();
        for (i, r) in cfg.regions.iter().enumerate() {
            if r.load_source != LoadSource::Prometheus {
                continue;
            }
            let inflight_now = host.stat(Stat::Region(i, RegionStat::RqActive)) as f64;
            match loads.get(&i) {
                Some(load) => {
                    // As of the scrape, never in the future of this answer.
                    let at = load.scraped_ms.map_or(now, |t| t.min(now));
                    let inflight = self.inflight_at(i, at, inflight_now);
                    self.check_capacity(host, i, load.sample.cache_capacity.as_ref());
                    self.fleet.on_replicas(i, load.replicas);
                    let restart =
                        self.fleet
                            .on_metrics(&cfg, i, Some(load.sample.clone()), inflight, at);
                    // Stamped at this answer, not at Prometheus' oldest
                    // scrape: the restarted replica's came later.
                    if let Some(r) = restart {
                        self.engine_restarted(host, i, r, now);
                    }
                    self.fleet.on_engine_clock(i, at);
                    if let Some(w) = self.metrics_warned.get_mut(i) {
                        *w = false;
                    }
                }
                None => {
                    host.count(Stat::Region(i, RegionStat::MetricsScrapeFailure), 1);
                    self.fleet.on_metrics(&cfg, i, None, inflight_now, now);
                    if let Some(w) = self.metrics_warned.get_mut(i).filter(|w| !**w) {
                        *w = true;
                        missing.push(format!("{} ({{{}}})", r.name, r.selector()));
                    }
                }
            }
        }
        if !missing.is_empty() {
            host.log(
                Level::Warn,
                &format!("llm-geo-router probe: Prometheus has no complete load figures (waiting, running, one replica or more) for region(s) {}; check prometheus_selector and that Prometheus scrapes their engines", missing.join(", ")),
            );
        }
        self.publish(host, now);
    }

    /// The Prometheus query failed: a failed scrape for every region using
    /// it, one warning until a query succeeds again.
    fn prometheus_failed(&mut self, host: &mut dyn ProbeHost, e: &str, now: u64) {
        let cfg = self.cfg.clone();
        for (i, r) in cfg.regions.iter().enumerate() {
            if r.load_source == LoadSource::Prometheus {
                host.count(Stat::Region(i, RegionStat::MetricsScrapeFailure), 1);
                let inflight = host.stat(Stat::Region(i, RegionStat::RqActive)) as f64;
                self.fleet.on_metrics(&cfg, i, None, inflight, now);
            }
        }
        if !std::mem::replace(&mut self.prom_warned, true) {
            host.log(
                Level::Warn,
                &format!("llm-geo-router probe: Prometheus query failed: {e}; a failed scrape for every region it serves"),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::roots::probe::tests::{answer_all, cfg, published, started, tick, T0, VLLM};
    use crate::shared::host_api::{Answer, Recorder};
    use std::rc::Rc;

    /// A Prometheus answer for mid: load, `replicas` and the prefix
    /// counters' sum `queries`, scraped at `at_ms`.
    fn mid_answer(replicas: u32, queries: u64, at_ms: u64) -> String {
        let at = at_ms as f64 / 1000.0;
        format!(
            r#"{{"status":"success","data":{{"resultType":"vector","result":[{}]}}}}"#,
            [
                prom_series("mid", "waiting", "0", at),
                prom_series("mid", "running", "1", at),
                prom_series("mid", "replicas", &replicas.to_string(), at),
                prom_series("mid", "prefix_queries", &queries.to_string(), at),
                prom_series("mid", "prefix_hits", "0", at),
                prom_series("mid", "scraped", &format!("{at}"), at),
            ]
            .join(",")
        )
    }

    #[test]
    fn a_sum_over_as_many_replicas_that_went_back_is_a_restart() {
        let c = cfg(r#","prometheus":{"cluster":"prom"}"#);
        let c = Rc::new({
            let mut c = (*c).clone();
            c.regions[1].load_source = LoadSource::Prometheus;
            c
        });
        let mut host = Recorder::default();
        let mut p = started(&c, "a", &mut host);
        let mut round = |host: &mut Recorder, at: u64, replicas: u32, queries: u64| {
            tick(&mut p, host, at);
            let body = mid_answer(replicas, queries, at - 300);
            for (token, cluster, _) in std::mem::take(&mut host.callouts) {
                let mut a = Answer {
                    status: Some(200),
                    ..Answer::default()
                };
                if cluster == "prom" {
                    a.body = body.as_bytes().to_vec();
                } else {
                    a.body = VLLM.as_bytes().to_vec();
                }
                host.now_ms = at + 5;
                p.on_callout_response(host, token, &mut a);
            }
            host.now_ms = at;
            (
                host.value(Stat::Region(1, RegionStat::EngineRestart)),
                published(host).regions[1].cache_reset_ms,
            )
        };
        assert_eq!(round(&mut host, T0 + 1000, 3, 90_000), (0, None));
        // One replica's scrape failed: it drops out of the sum, no restart;
        // back, the sum is over three again.
        assert_eq!(round(&mut host, T0 + 2000, 2, 60_000), (0, None));
        assert_eq!(round(&mut host, T0 + 3000, 3, 91_000), (0, None));
        // Over three, less than before: one of them restarted. The reset is
        // when the answer came, not Prometheus' oldest scrape.
        assert_eq!(round(&mut host, T0 + 4000, 3, 61_000), (1, Some(T0 + 4005)));
        assert!(host.logs.iter().any(|(_, m)| m.contains(
            "region mid: engine restart seen: its prefix-cache queries counter went back from 91000 to 61000 between two scrapes, summed over 3 replicas;"
        )));
    }

    fn prom_series(region: &str, signal: &str, v: &str, at_s: f64) -> String {
        format!(
            r#"{{"metric":{{"llm_geo_region":"{region}","llm_geo_signal":"{signal}"}},"value":[{at_s},"{v}"]}}"#
        )
    }

    #[test]
    fn prometheus_regions_are_read_in_one_query_summed_over_replicas() {
        let c = cfg(r#","prometheus":{"cluster":"prom"}"#);
        let c = Rc::new({
            let mut c = (*c).clone();
            c.regions[1].load_source = LoadSource::Prometheus;
            c
        });
        let mut host = Recorder::default();
        let mut p = started(&c, "a", &mut host);
        // This Envoy has 2 requests in flight to mid now, 1 a tick earlier.
        host.stats.insert(Stat::Region(1, RegionStat::RqActive), 1);
        tick(&mut p, &mut host, T0 + 50);
        answer_all(&mut p, &mut host, 5, Some(200), VLLM);
        host.stats.insert(Stat::Region(1, RegionStat::RqActive), 2);
        tick(&mut p, &mut host, T0 + 1050);
        let calls: Vec<(String, String)> = host
            .callouts
            .iter()
            .map(|(_, c, p)| (c.clone(), p.clone()))
            .collect();
        assert!(calls.contains(&("cn".into(), "/metrics".into())));
        assert!(
            !calls.contains(&("cm".into(), "/metrics".into())),
            "mid is not scraped"
        );
        let queries: Vec<&(String, String)> = calls.iter().filter(|(c, _)| c == "prom").collect();
        assert_eq!(queries.len(), 1, "one query per round: {calls:?}");
        assert!(queries[0]
            .1
            .starts_with("/api/v1/query?query=label_replace"));
        // Prometheus scraped mid's 3 replicas at T0 + 500 (between the ticks).
        let at = (T0 + 500) as f64 / 1000.0;
        let body = format!(
            r#"{{"status":"success","data":{{"resultType":"vector","result":[{}]}}}}"#,
            [
                prom_series("mid", "waiting", "6", at),
                prom_series("mid", "running", "24", at),
                prom_series("mid", "replicas", "3", at),
                prom_series("mid", "scraped", &format!("{at}"), at),
            ]
            .join(",")
        );
        let sent = host.now_ms;
        for (token, cluster, _) in std::mem::take(&mut host.callouts) {
            let mut a = Answer {
                status: Some(200),
                ..Answer::default()
            };
            if cluster == "prom" {
                a.body = body.as_bytes().to_vec();
            }
            host.now_ms = sent + 5;
            p.on_callout_response(&mut host, token, &mut a);
        }
        let mid = published(&host).regions[1].clone();
        assert_eq!(
            (mid.waiting, mid.running, mid.replicas),
            (6.0, 24.0, Some(3))
        );
        assert!(mid.metrics_ok);
        assert_eq!(mid.scraped_ms, Some(T0 + 500), "as of Prometheus' scrape");
        assert_eq!(mid.inflight_at_scrape, 1.0, "this Envoy's in-flight then");
        assert_eq!(mid.slots(8), 24);
        assert_eq!(host.value(Stat::Region(1, RegionStat::Replicas)), 3);
        // A failed query: a failed scrape for mid, one warning. (The first
        // round's query was answered with the metrics text: one already.)
        let before = host.value(Stat::Region(1, RegionStat::MetricsScrapeFailure));
        assert_eq!(before, 1);
        assert!(host
            .logs
            .iter()
            .any(|(_, m)| m.contains("not a Prometheus API answer")));
        for _ in 0..2 {
            let next = host.now_ms + 1000;
            tick(&mut p, &mut host, next);
            let sent = host.now_ms;
            for (token, cluster, _) in std::mem::take(&mut host.callouts) {
                let mut a = Answer {
                    status: Some(200),
                    ..Answer::default()
                };
                if cluster == "prom" {
                    a.status = Some(503);
                }
                host.now_ms = sent + 5;
                p.on_callout_response(&mut host, token, &mut a);
            }
        }
        assert_eq!(
            host.value(Stat::Region(1, RegionStat::MetricsScrapeFailure)),
            3
        );
        let warns = host
            .logs
            .iter()
            .filter(|(_, m)| m.contains("Prometheus query failed: status 503"))
            .count();
        assert_eq!(warns, 1);
        assert!(!published(&host).regions[1].metrics_ok);
    }
}
