//! What the probe reads from the engines themselves: a `/metrics` scrape,
//! a model list (the models served and the context limit), a release
//! digest (in a health answer or a metrics label), and the warnings about
//! their KV-cache capacity.

use crate::config::ReleaseSource;
use crate::engines::metrics::{parse_engine_metrics, CacheCapacity, EngineKind};
use crate::fleet::restart::Restart;
use crate::request::limits::{limit_field, parse_model_ids, parse_model_limit, MAX_LISTED_MODELS};
use crate::roots::probe::{CapacityWarned, Probe};
use crate::shared::host_api::{CalloutResponse, Level, ProbeHost};
use crate::shared::names::{RegionStat, Stat};

/// Health bodies read at most (a release digest in JSON).
const HEALTH_BODY_MAX: usize = 64 * 1024;

/// Model-list bodies read at most: a card is a few hundred bytes, so this
/// holds a model with hundreds of LoRA adapters; a longer list is refused.
const MODELS_BODY_MAX: usize = 256 * 1024;

/// A region's engine restarts are logged at most once in this long (each
/// is counted): a `scrape` through a balancer over several replicas reads
/// their counters in turn, and each fall would be a line.
const RESTART_LOG_MS: u64 = 60_000;

impl Probe {
    /// A release digest read; a region that changed release is redeployed,
    /// perhaps with another context limit: its model list is read again
    /// in the next round.
    pub(super) fn release(
        &mut self,
        host: &mut dyn ProbeHost,
        region: usize,
        digest: Option<String>,
    ) {
        // With parity configured, a region that reports no digest is never
        // held back (docs/CONFIG.md, `release`): said once, not silently.
        if let (Some(expected), Some(warned)) = (
            self.cfg.release.expected.as_deref(),
            self.digest_warned.get_mut(region),
        ) {
            if digest.is_some() {
                *warned = false;
            } else if !std::mem::replace(warned, true) {
                let r = &self.cfg.release;
                let name = self
                    .cfg
                    .regions
                    .get(region)
                    .map_or("?", |r| r.name.as_str());
                host.log(
                    Level::Warn,
                    &format!(
                        "llm-geo-router probe: region {name}: no release digest ({} {:?}); release parity ({expected}) does not apply to it until it reports one",
                        r.source.as_str(),
                        r.name
                    ),
                );
            }
        }
        let old = self.fleet.release(region);
        if old.is_some() && old != digest.as_deref() {
            self.models_due_now(region);
        }
        self.fleet.on_release(region, digest);
    }

    pub(super) fn models_due_now(&mut self, region: usize) {
        if let Some(d) = self.models_due.get_mut(region) {
            *d = self.rounds;
        }
    }

    /// A model list came back: the region's context limit, or, for anything
    /// else (an error status, no answer, a body too large or not a model
    /// list), one warning until a read succeeds again and a counter; the
    /// last limit read stands.
    pub(super) fn models(
        &mut self,
        host: &mut dyn ProbeHost,
        region: usize,
        status: Option<u32>,
        response: &mut dyn CalloutResponse,
        now: u64,
    ) {
        let Some(r) = self.cfg.regions.get(region) else {
            return;
        };
        let (name, path, engine) = (r.name.clone(), r.models_path.clone(), r.engine);
        let body = match status {
            Some(s) if (200..300).contains(&s) => match response.body(MODELS_BODY_MAX + 1) {
                Some(b) if b.len() > MODELS_BODY_MAX => Err(format!(
                    "the body is larger than {} KiB",
                    MODELS_BODY_MAX / 1024
                )),
                Some(b) => Ok(b),
                None => Err("the answer has no body".to_string()),
            },
            Some(s) => Err(format!("status {s}")),
            None => Err("no response".to_string()),
        };
        // The models it serves, whatever its limit says: a list without
        // limits still says which requests the region would refuse. One
        // publication for whatever the list changed.
        let mut changed = false;
        if let Ok(Ok(ids)) = body.as_deref().map(parse_model_ids) {
            let said = match ids.len() {
                0 => format!("more than {MAX_LISTED_MODELS} models (or an overlong id) in {path}: taken to serve any model"),
                n => format!("{n} model(s) listed in {path}"),
            };
            if self.fleet.on_models(region, ids) {
                host.log(
                    Level::Info,
                    &format!("llm-geo-router probe: region {name}: {said}"),
                );
                changed = true;
            }
        }
        let read = body.and_then(|b| parse_model_limit(engine, &b));
        match read {
            Ok(limit) => {
                if let Some(w) = self.models_warned.get_mut(region) {
                    *w = false;
                }
                if self.fleet.on_model_limit(region, limit) {
                    host.log(
                        Level::Info,
                        &format!(
                            "llm-geo-router probe: region {name}: context limit {limit} tokens ({} in {path})",
                            limit_field(engine)
                        ),
                    );
                    changed = true;
                }
            }
            Err(e) => {
                host.count(Stat::Region(region, RegionStat::ModelsReadFailure), 1);
                if let Some(w) = self.models_warned.get_mut(region).filter(|w| !**w) {
                    *w = true;
                    let stays = self
                        .fleet
                        .model_limit(region)
                        .map_or("unknown".to_string(), |l| format!("{l} tokens"));
                    host.log(
                        Level::Warn,
                        &format!("llm-geo-router probe: region {name}: model list {path} not read: {e}; its context limit stays {stays}"),
                    );
                }
            }
        }
        if changed {
            self.publish(host, now);
        }
    }

    pub(super) fn metrics(
        &mut self,
        host: &mut dyn ProbeHost,
        region: usize,
        status: Option<u32>,
        response: &mut dyn CalloutResponse,
        now: u64,
    ) {
        let ok = status.is_some_and(|s| (200..300).contains(&s));
        let name = self
            .cfg
            .regions
            .get(region)
            .map_or("?", |r| r.name.as_str())
            .to_string();
        let engine = self.cfg.regions.get(region).map(|r| r.engine);
        let parsed = match (ok, engine) {
            (true, Some(engine)) => {
                let body = response.body(usize::MAX).unwrap_or_default();
                let label = (self.cfg.release.source == ReleaseSource::MetricsLabel)
                    .then_some(self.cfg.release.name.as_str());
                parse_engine_metrics(engine, &body, label).map_err(|e| e.to_string())
            }
            _ => Err(format!(
                "status {}",
                status.map_or("none (no response)".to_string(), |s| s.to_string())
            )),
        };
        let inflight = host.stat(Stat::Region(region, RegionStat::RqActive)) as f64;
        match parsed {
            Ok(sample) => {
                if let Some(w) = self.metrics_warned.get_mut(region) {
                    *w = false;
                }
                if self.cfg.release.source == ReleaseSource::MetricsLabel {
                    self.release(host, region, sample.release.clone());
                }
                self.check_capacity(host, region, sample.cache_capacity.as_ref());
                let restart = self
                    .fleet
                    .on_metrics(&self.cfg, region, Some(sample), inflight, now);
                if let Some(r) = restart {
                    self.engine_restarted(host, region, r, now);
                }
                self.fleet.on_engine_clock(region, now);
                self.publish(host, now);
            }
            Err(e) => {
                host.count(Stat::Region(region, RegionStat::MetricsScrapeFailure), 1);
                if let Some(w) = self.metrics_warned.get_mut(region).filter(|w| !**w) {
                    *w = true;
                    host.log(
                        Level::Warn,
                        &format!("llm-geo-router probe: region {name}: metrics scrape failed: {e}"),
                    );
                }
                self.fleet
                    .on_metrics(&self.cfg, region, None, inflight, now);
            }
        }
    }

    /// A good scrape (or Prometheus answer) at `now` showed the region's
    /// engine restarted (`fleet::restart`): its cache is empty, so from the
    /// next snapshot no entry the directory stamped before `now` is
    /// believed there (nor a session record). Counted every time; logged
    /// at most once per [`RESTART_LOG_MS`], with the restarts since.
    pub(super) fn engine_restarted(
        &mut self,
        host: &mut dyn ProbeHost,
        region: usize,
        restart: Restart,
        now: u64,
    ) {
        self.fleet.on_cache_reset(region, now);
        host.count(Stat::Region(region, RegionStat::EngineRestart), 1);
        let Some(logged) = self.restart_logged.get_mut(region) else {
            return;
        };
        if logged.0 != 0 && now.saturating_sub(logged.0) < RESTART_LOG_MS {
            logged.1 = logged.1.saturating_add(1);
            return;
        }
        let unlogged = std::mem::replace(logged, (now.max(1), 0)).1;
        let name = self
            .cfg
            .regions
            .get(region)
            .map_or("?", |r| r.name.as_str());
        let over = match restart.replicas {
            1 => String::new(),
            n => format!(", summed over {n} replicas"),
        };
        let since = match unlogged {
            0 => String::new(),
            n => format!(" ({n} more since the last such line)"),
        };
        host.log(
            Level::Warn,
            &format!(
                "llm-geo-router probe: region {name}: engine restart seen: its {} went back from {:.0} to {:.0} between two scrapes{over}; its prefix cache is taken as empty (what the region served before is no longer believed held there){since}",
                restart.counter.describe(),
                restart.before,
                restart.after,
            ),
        );
    }

    /// The engines' KV-cache capacity in a good scrape (or Prometheus
    /// answer): a refused figure is counted, and a refused or missing one
    /// is warned about once per region and kind until a valid one comes;
    /// the fleet keeps the last valid figure. A region whose capacity is
    /// configured (`cache_tokens`) is not warned about.
    pub(super) fn check_capacity(
        &mut self,
        host: &mut dyn ProbeHost,
        region: usize,
        capacity: Option<&CacheCapacity>,
    ) {
        let Some(r) = self.cfg.regions.get(region) else {
            return;
        };
        if let Some(CacheCapacity::Invalid(_)) = capacity {
            host.count(Stat::Region(region, RegionStat::CacheCapacityRejected), 1);
        }
        let kind = match capacity {
            Some(CacheCapacity::Tokens(_)) => CapacityWarned::Nothing,
            Some(CacheCapacity::Invalid(_)) => CapacityWarned::Refused,
            None => CapacityWarned::Missing,
        };
        let Some(warned) = self.capacity_warned.get_mut(region) else {
            return;
        };
        if kind == CapacityWarned::Nothing || r.cache_tokens().is_some() {
            *warned = CapacityWarned::Nothing;
            return;
        }
        if std::mem::replace(warned, kind) == kind {
            return;
        }
        let stays = self
            .fleet
            .engine_cache_tokens(region)
            .map_or("unknown".to_string(), |t| format!("{t} tokens"));
        let metric = match r.engine {
            EngineKind::Vllm => "vllm:cache_config_info (num_gpu_blocks x block_size)",
            EngineKind::Sglang => "sglang:max_total_num_tokens",
            EngineKind::Llamacpp => "llama.cpp has no such metric",
        };
        let what = match capacity {
            Some(CacheCapacity::Invalid(why)) => format!("KV-cache capacity ignored: {why}"),
            _ => format!("the engine exports no KV-cache capacity ({metric})"),
        };
        host.log(
            Level::Warn,
            &format!(
                "llm-geo-router probe: region {}: {what}; its capacity stays {stays} (set regions[].cache_tokens to give it)",
                r.name
            ),
        );
    }

    /// The release digest in a health response, per `release.source`.
    pub(super) fn health_release(&self, response: &mut dyn CalloutResponse) -> Option<String> {
        let r = &self.cfg.release;
        match r.source {
            ReleaseSource::HealthHeader => response.header(&r.name),
            ReleaseSource::HealthJson => {
                let body = response.body(HEALTH_BODY_MAX)?;
                let v: serde_json::Value = serde_json::from_slice(&body).ok()?;
                v.get(&r.name)?.as_str().map(str::to_string)
            }
            ReleaseSource::MetricsLabel => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::fleet::snapshot::Snapshot;
    use crate::roots::probe::tests::{answer_all, cfg, published, started, tick, MODELS, T0, VLLM};
    use crate::shared::host_api::{Answer, Recorder};
    use std::rc::Rc;

    #[test]
    fn a_region_reporting_no_digest_under_parity_is_said_once() {
        let c = cfg(r#","release":{"expected":"sha256:a","source":"health_json","name":"digest"}"#);
        let mut host = Recorder::default();
        let mut p = started(&c, "a", &mut host);
        // near: no digest, then one, then none again; the others report it.
        for (i, near) in ["{}", "{}", r#"{"digest":"sha256:a"}"#, "{}", "{}"]
            .iter()
            .enumerate()
        {
            tick(&mut p, &mut host, T0 + 1000 * (i as u64 + 1));
            host.now_ms += 5;
            for (token, cluster, path) in std::mem::take(&mut host.callouts) {
                let body = match (cluster.as_str(), path.as_str()) {
                    (_, "/metrics") => VLLM.as_bytes().to_vec(),
                    ("cn", _) => near.as_bytes().to_vec(),
                    _ => br#"{"digest":"sha256:a"}"#.to_vec(),
                };
                let mut a = Answer {
                    status: Some(200),
                    body,
                    ..Answer::default()
                };
                p.on_callout_response(&mut host, token, &mut a);
            }
        }
        let said: Vec<&str> = host
            .logs
            .iter()
            .filter(|(_, m)| m.contains("no release digest"))
            .map(|(_, m)| m.as_str())
            .collect();
        assert_eq!(said.len(), 2, "{said:?}");
        assert_eq!(said[0], "llm-geo-router probe: region near: no release digest (health_json \"digest\"); release parity (sha256:a) does not apply to it until it reports one");
        // Routed as docs/CONFIG.md says: no digest is no mismatch.
        assert!(p.fleet.snapshot(&c, T0 + 6000).regions[0].release_ok);
    }

    #[test]
    fn garbage_metrics_refused_callouts_and_releases() {
        let c = cfg(r#","release":{"expected":"sha256:a","source":"health_json","name":"digest"}"#);
        let mut host = Recorder {
            refuse_clusters: vec!["cm".into()],
            ..Recorder::default()
        };
        let mut p = started(&c, "a", &mut host);
        for i in 0..3 {
            tick(&mut p, &mut host, T0 + 1000 * (i + 1));
            let sent = host.now_ms;
            host.now_ms += 5;
            for (token, _, path) in std::mem::take(&mut host.callouts) {
                let mut a = Answer {
                    status: Some(200),
                    body: if path == "/metrics" {
                        b"\x00garbage{".to_vec()
                    } else {
                        br#"{"digest":"sha256:a"}"#.to_vec()
                    },
                    ..Answer::default()
                };
                p.on_callout_response(&mut host, token, &mut a);
            }
            host.now_ms = sent;
        }
        let warned = |what: &str| host.logs.iter().filter(|(_, m)| m.contains(what)).count();
        // Once per region, not per tick.
        assert_eq!(warned("region near: metrics scrape failed"), 1);
        assert_eq!(warned("region mid: callout to cluster \"cm\" refused"), 1);
        assert_eq!(
            host.value(Stat::Region(0, RegionStat::MetricsScrapeFailure)),
            3
        );
        assert_eq!(
            host.value(Stat::Region(1, RegionStat::HealthProbeFailure)),
            3
        );
        // Health by the health probe: near up, on the expected release; mid
        // (no callout possible) down.
        let snap = p.fleet.snapshot(&c, T0 + 4000);
        assert!(snap.regions[0].healthy && snap.regions[0].release_ok);
        assert!(!snap.regions[1].healthy);
    }

    #[test]
    fn another_familys_metrics_are_a_failed_scrape_and_never_an_idle_engine() {
        // near is configured as SGLang but runs vLLM, saturated: 8 running
        // on its 8 slots, 8 waiting. mid is vLLM, idle.
        let c = Rc::new(
            Config::parse(
                br#"{"regions":[
                  {"name":"near","cluster":"cn","capacity_rps":5,"rtt_ms":5,"max_concurrency":8,"engine":"sglang"},
                  {"name":"mid","cluster":"cm","capacity_rps":5,"rtt_ms":40,"max_concurrency":8}],
                  "probe":{"tick_ms":1000,"timeout_ms":500}}"#,
            )
            .unwrap(),
        );
        const SATURATED: &str =
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
vllm:num_requests_running{model_name=\"m\"} 8.0\nvllm:num_requests_waiting{model_name=\"m\"} 8.0\n";
        const IDLE: &str = "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n";
        const SGLANG: &str = "sglang:num_running_reqs 1\nsglang:num_queue_reqs 0\n";
        let mut host = Recorder::default();
        let mut p = started(&c, "a", &mut host);
        let round = |p: &mut Probe, host: &mut Recorder, at: u64, near: &str| {
            tick(p, host, at);
            for (token, cluster, path) in std::mem::take(&mut host.callouts) {
                let mut a = Answer {
                    status: Some(200),
                    ..Answer::default()
                };
                if path == "/metrics" {
                    a.body = if cluster == "cn" { near } else { IDLE }.into();
                }
                // near 5 ms away, mid 40.
                host.now_ms = at + if cluster == "cn" { 5 } else { 40 };
                p.on_callout_response(host, token, &mut a);
            }
            host.now_ms = at;
        };
        for i in 1..=3 {
            round(&mut p, &mut host, T0 + 1000 * i, SATURATED);
        }
        // Counted at every scrape, warned once, naming the region, the
        // family expected and what came back.
        assert_eq!(
            host.value(Stat::Region(0, RegionStat::MetricsScrapeFailure)),
            3
        );
        assert_eq!(
            host.value(Stat::Region(1, RegionStat::MetricsScrapeFailure)),
            0
        );
        let warnings = |host: &Recorder| -> Vec<String> {
            host.logs
                .iter()
                .map(|(_, m)| m.clone())
                .filter(|m| m.contains("region near: metrics scrape failed"))
                .collect()
        };
        assert_eq!(
            warnings(&host),
            ["llm-geo-router probe: region near: metrics scrape failed: metrics payload has no sglang load figure (sglang:num_queue_reqs, sglang:num_running_reqs); its first sample is vllm:num_requests_running (is regions[].engine right?)"]
        );
        // Priced as unknown load: a cold prompt goes to mid, not to the
        // nearest region taken for idle.
        let snap = published(&host);
        assert!(!snap.regions[0].metrics_ok && snap.regions[0].load_unknown);
        let decide = |snap: &Snapshot| {
            crate::decision::choice::decide(&crate::decision::inputs::Inputs {
                config: &c,
                snapshot: Some(snap),
                snapshot_index: &[Some(0), Some(1)],
                cached_blocks: &[0, 0],
                clocks: &[],
                inflight: &[0.0, 0.0],
                prompt_tokens: 100,
                prompt_bytes: 400,
                tokens_per_byte: 0.25,
                model: None,
                first_block: Some(7),
                allowed: None,
                fits: u64::MAX,
                now_ms: T0 + 3000,
            })
        };
        assert_eq!(decide(&snap).region, 1, "{:?}", decide(&snap).costs);
        // The right family's figures: known again, and the warning re-armed.
        round(&mut p, &mut host, T0 + 4000, SGLANG);
        let snap = published(&host);
        assert!(snap.regions[0].metrics_ok && !snap.regions[0].load_unknown);
        assert_eq!(decide(&snap).region, 0);
        round(&mut p, &mut host, T0 + 5000, SATURATED);
        assert_eq!(warnings(&host).len(), 2);
    }

    /// The model-list callouts of the last round, answered `ms` later with
    /// `status` and `body` (the other callouts are answered 200, empty).
    fn answer_models(
        p: &mut Probe,
        host: &mut Recorder,
        status: Option<u32>,
        body: &[u8],
    ) -> usize {
        let mut n = 0;
        for (token, _, path) in std::mem::take(&mut host.callouts) {
            let mut a = Answer {
                status: Some(200),
                ..Answer::default()
            };
            if path == "/v1/models" {
                n += 1;
                a.status = status;
                a.body = body.to_vec();
            }
            p.on_callout_response(host, token, &mut a);
        }
        n
    }

    #[test]
    fn the_context_limit_is_read_at_start_then_every_refresh_and_on_recovery() {
        let c =
            cfg(r#","context":{"refresh_ticks":3},"release":{"source":"health_json","name":"d"}"#);
        let mut host = Recorder::default();
        let mut p = started(&c, "a", &mut host);
        let limit = |p: &mut Probe| {
            p.fleet
                .snapshot(&c, T0)
                .regions
                .iter()
                .map(|r| r.max_model_len)
                .collect::<Vec<_>>()
        };
        tick(&mut p, &mut host, T0 + 50);
        assert_eq!(
            answer_models(&mut p, &mut host, Some(200), MODELS.as_bytes()),
            2
        );
        assert_eq!(limit(&mut p), [Some(32768), Some(32768)]);
        assert!(host.logs.iter().any(|(_, m)| m == "llm-geo-router probe: region near: context limit 32768 tokens (max_model_len in /v1/models)"));
        // Not again in rounds 2 and 3; again in round 4.
        let mut reads = Vec::new();
        for round in 2..=7u64 {
            tick(&mut p, &mut host, T0 + 1000 * round);
            reads.push(answer_models(
                &mut p,
                &mut host,
                Some(200),
                br#"{"data":[{"max_model_len":8192}]}"#,
            ));
        }
        assert_eq!(reads, [0, 0, 2, 0, 0, 2]);
        assert_eq!(limit(&mut p), [Some(8192), Some(8192)]);
    }

    #[test]
    fn a_region_back_from_an_outage_or_on_another_release_is_read_again() {
        let c = cfg(
            r#","context":{"refresh_ticks":1000},"release":{"source":"health_json","name":"d"}"#,
        );
        let mut host = Recorder::default();
        let mut p = started(&c, "a", &mut host);
        // Each round: health as `health(cluster)` says, with that release;
        // the model lists read (by cluster).
        let round = |p: &mut Probe,
                     host: &mut Recorder,
                     at: u64,
                     health: &dyn Fn(&str) -> (u32, &'static str)| {
            tick(p, host, T0 + 1000 * at);
            let mut read = Vec::new();
            for (token, cluster, path) in std::mem::take(&mut host.callouts) {
                let (status, release) = health(&cluster);
                let mut a = Answer {
                    status: Some(200),
                    ..Answer::default()
                };
                match path.as_str() {
                    "/health" => {
                        a.status = Some(status);
                        a.body = format!(r#"{{"d":"{release}"}}"#).into_bytes();
                    }
                    "/v1/models" => {
                        a.body = MODELS.as_bytes().to_vec();
                        read.push(cluster);
                    }
                    _ => {}
                }
                p.on_callout_response(host, token, &mut a);
            }
            read
        };
        let up = |_: &str| (200, "one");
        assert_eq!(round(&mut p, &mut host, 1, &up), ["cn", "cm"]);
        assert!(round(&mut p, &mut host, 2, &up).is_empty());
        // near down for two rounds (unhealthy), up for two (healthy again):
        // read in the round after.
        let near_down = |c: &str| {
            if c == "cn" {
                (503, "one")
            } else {
                (200, "one")
            }
        };
        for at in 3..=4 {
            assert!(round(&mut p, &mut host, at, &near_down).is_empty());
        }
        for at in 5..=6 {
            assert!(round(&mut p, &mut host, at, &up).is_empty());
        }
        assert_eq!(round(&mut p, &mut host, 7, &up), ["cn"]);
        // mid redeployed on another release: read in the round after.
        let mid_two = |c: &str| {
            if c == "cm" {
                (200, "two")
            } else {
                (200, "one")
            }
        };
        assert!(round(&mut p, &mut host, 8, &mid_two).is_empty());
        assert_eq!(round(&mut p, &mut host, 9, &mid_two), ["cm"]);
        assert!(round(&mut p, &mut host, 10, &mid_two).is_empty());
    }

    #[test]
    fn a_model_list_that_cannot_be_read_leaves_the_limit_and_warns_once() {
        let c = cfg(r#","context":{"refresh_ticks":1}"#);
        let mut host = Recorder::default();
        let mut p = started(&c, "a", &mut host);
        let huge = format!(
            r#"{{"data":[{{"max_model_len":4096,"pad":"{}"}}]}}"#,
            "x".repeat(MODELS_BODY_MAX)
        );
        let bad: [(Option<u32>, &[u8]); 7] = [
            (Some(200), b"\x00garbage{"),
            (Some(200), br#"{"data":[{"max_model_len":"4096"}]}"#),
            (
                Some(200),
                br#"{"data":[{"id":"lora","max_model_len":null}]}"#,
            ),
            (Some(200), huge.as_bytes()),
            (Some(404), MODELS.as_bytes()),
            (None, b""),
            (Some(200), b""),
        ];
        for (i, (status, body)) in bad.iter().enumerate() {
            tick(&mut p, &mut host, T0 + 1000 * (i as u64 + 1));
            answer_models(&mut p, &mut host, *status, body);
        }
        assert_eq!(
            host.value(Stat::Region(0, RegionStat::ModelsReadFailure)),
            7
        );
        let warnings: Vec<&str> = host
            .logs
            .iter()
            .map(|(_, m)| m.as_str())
            .filter(|m| m.contains("region near: model list"))
            .collect();
        assert_eq!(
            warnings,
            ["llm-geo-router probe: region near: model list /v1/models not read: model list is not JSON: expected value at line 1 column 1; its context limit stays unknown"]
        );
        assert_eq!(p.fleet.model_limit(0), None);
        // Read once, the limit stands through failures; a success re-arms
        // the warning.
        tick(&mut p, &mut host, T0 + 10_000);
        answer_models(
            &mut p,
            &mut host,
            Some(200),
            br#"{"data":[{"max_model_len":4096}]}"#,
        );
        tick(&mut p, &mut host, T0 + 11_000);
        answer_models(&mut p, &mut host, Some(200), huge.as_bytes());
        assert_eq!(p.fleet.model_limit(0), Some(4096));
        assert!(host.logs.iter().any(|(_, m)| m == "llm-geo-router probe: region near: model list /v1/models not read: the body is larger than 256 KiB; its context limit stays 4096 tokens"));
        assert_eq!(host.value(Stat::Region(0, RegionStat::MaxModelLen)), 4096);
    }

    #[test]
    fn cache_capacity_gauge_follows_the_engine_unless_configured_and_warns_once_per_kind() {
        let c = Rc::new(
            Config::parse(
                br#"{"regions":[
                  {"name":"near","cluster":"cn","capacity_rps":5,"rtt_ms":5},
                  {"name":"mid","cluster":"cm","capacity_rps":5,"rtt_ms":40,"cache_tokens":5000}],
                  "probe":{"tick_ms":1000,"timeout_ms":500}}"#,
            )
            .unwrap(),
        );
        let mut host = Recorder::default();
        let mut p = started(&c, "a", &mut host);
        let info = |blocks: &str| {
            format!("{VLLM}vllm:cache_config_info{{block_size=\"16\",cache_dtype=\"auto\",num_gpu_blocks=\"{blocks}\",num_gpu_blocks_override=\"None\"}} 1.0\n")
        };
        let bodies = [
            VLLM.to_string(),
            VLLM.to_string(),
            info("None"),
            info("-3"),
            info("1024"),
            info("0"),
            info("0"),
        ];
        let mut gauges = Vec::new();
        for (i, body) in bodies.iter().enumerate() {
            tick(&mut p, &mut host, T0 + 1000 * (i as u64 + 1));
            answer_all(&mut p, &mut host, 5, Some(200), body);
            gauges.push((
                host.value(Stat::Region(0, RegionStat::CacheCapacityTokens)),
                host.value(Stat::Region(1, RegionStat::CacheCapacityTokens)),
            ));
        }
        // Unknown is 0 on the gauge; the override wins from the start; a
        // refused figure leaves the last valid one.
        assert_eq!(
            gauges,
            [
                (0, 5000),
                (0, 5000),
                (0, 5000),
                (0, 5000),
                (16_384, 5000),
                (16_384, 5000),
                (16_384, 5000)
            ]
        );
        assert_eq!(published(&host).regions[0].cache_tokens, Some(16_384));
        assert_eq!(published(&host).regions[1].cache_tokens, Some(5000));
        // The block of 16 tokens, read even while the capacity was refused.
        assert_eq!(published(&host).regions[0].block_tokens, Some(16));
        assert_eq!(
            host.value(Stat::Region(0, RegionStat::CacheBlockTokens)),
            16
        );
        // Four refused figures at near, four at mid (counted, not warned).
        assert_eq!(
            host.value(Stat::Region(0, RegionStat::CacheCapacityRejected)),
            4
        );
        assert_eq!(
            host.value(Stat::Region(1, RegionStat::CacheCapacityRejected)),
            4
        );
        let warnings: Vec<&str> = host
            .logs
            .iter()
            .map(|(_, m)| m.as_str())
            .filter(|m| m.contains("capacity"))
            .collect();
        assert_eq!(
            warnings,
            [
                "llm-geo-router probe: region near: the engine exports no KV-cache capacity (vllm:cache_config_info (num_gpu_blocks x block_size)); its capacity stays unknown (set regions[].cache_tokens to give it)",
                "llm-geo-router probe: region near: KV-cache capacity ignored: vllm:cache_config_info num_gpu_blocks=\"None\" is not a whole number in 1..=1000000000000; its capacity stays unknown (set regions[].cache_tokens to give it)",
                "llm-geo-router probe: region near: KV-cache capacity ignored: vllm:cache_config_info num_gpu_blocks=\"0\" is not a whole number in 1..=1000000000000; its capacity stays 16384 tokens (set regions[].cache_tokens to give it)",
            ]
        );
    }

    /// A vLLM scrape of `VLLM`'s load with its prefix-cache counters at
    /// `queries` (and no hits).
    fn with_counters(queries: u64) -> String {
        format!("{VLLM}vllm:prefix_cache_queries_total{{model_name=\"m\"}} {queries}.0\nvllm:prefix_cache_hits_total{{model_name=\"m\"}} 0.0\n")
    }

    /// One round at `at`: every callout answered 5 ms later, health 200,
    /// each region's metrics as `metrics(cluster)` says.
    fn round_with(p: &mut Probe, host: &mut Recorder, at: u64, metrics: &dyn Fn(&str) -> String) {
        tick(p, host, at);
        host.now_ms = at + 5;
        for (token, cluster, path) in std::mem::take(&mut host.callouts) {
            let mut a = Answer {
                status: Some(200),
                ..Answer::default()
            };
            if path == "/metrics" {
                a.body = metrics(&cluster).into_bytes();
            }
            p.on_callout_response(host, token, &mut a);
        }
        host.now_ms = at;
    }

    /// A prompt the fleet's `mid` served at `served` (routed and answered
    /// through the pipeline over the probe's shared data), then the
    /// decision for its next turn at `at`.
    fn next_turn(
        c: &Config,
        host: &mut Recorder,
        served: Option<u64>,
        at: u64,
    ) -> crate::decision::cost::Decision {
        next_turn_in(c, host, None, served, at)
    }

    /// The same, in session `session` if any.
    fn next_turn_in(
        c: &Config,
        host: &mut Recorder,
        session: Option<&str>,
        served: Option<u64>,
        at: u64,
    ) -> crate::decision::cost::Decision {
        use crate::decision::pipeline::{RouteInputs, Router};
        let router = Router::new(c);
        let doc = "a long document the conversation is about. ".repeat(300);
        let body = |turn: usize| {
            serde_json::to_vec(&serde_json::json!({
                "messages": [{"role": "system", "content": doc}, {"role": "user", "content": format!("turn {turn}")}]
            }))
            .unwrap()
        };
        let snap = published(host);
        if let Some(t) = served {
            let b = body(0);
            let inp = RouteInputs {
                endpoint: crate::request::openai::Endpoint::ChatCompletions,
                body: &b,
                session_header: session,
                residency: None,
                snapshot: Some(&snap),
                snapshot_index: &[Some(0), Some(1)],
                inflight: &[0.0, 0.0],
                now_ms: t,
                fallback: false,
            };
            let mut first = router.route(c, &mut host.store, &inp).unwrap();
            router.learn(
                &mut host.store,
                first.learning.as_mut().unwrap(),
                1,
                t + 100,
            );
        }
        let b = body(1);
        let inp = RouteInputs {
            endpoint: crate::request::openai::Endpoint::ChatCompletions,
            body: &b,
            session_header: session,
            residency: None,
            snapshot: Some(&snap),
            snapshot_index: &[Some(0), Some(1)],
            inflight: &[0.0, 0.0],
            now_ms: at,
            fallback: false,
        };
        router.route(c, &mut host.store, &inp).unwrap().decision
    }

    #[test]
    fn an_engine_restart_forgets_what_its_region_served_before() {
        use crate::decision::cost::Reason;
        let c = cfg("");
        let mut host = Recorder::default();
        let mut p = started(&c, "a", &mut host);
        round_with(&mut p, &mut host, T0 + 1000, &|_| with_counters(50_000));
        // mid served the prompt: its next turn goes there for its cache.
        let d = next_turn(&c, &mut host, Some(T0 + 1500), T0 + 1800);
        assert_eq!((d.region, d.reason), (1, Reason::Cache), "{:?}", d.costs);
        assert!(d.costs[1].cached_tokens > 500, "{:?}", d.costs);
        round_with(&mut p, &mut host, T0 + 2000, &|_| with_counters(51_000));
        let d = next_turn(&c, &mut host, None, T0 + 2100);
        assert_eq!((d.region, d.reason), (1, Reason::Cache), "{:?}", d.costs);
        // mid's engine restarted: its counters start again from 0. What it
        // served before is not in its cache.
        round_with(&mut p, &mut host, T0 + 3000, &|cluster| {
            with_counters(if cluster == "cm" { 700 } else { 52_000 })
        });
        let d = next_turn(&c, &mut host, None, T0 + 3100);
        assert_eq!(d.costs[1].cached_tokens, 0, "{:?}", d.costs);
        assert_eq!((d.region, d.reason), (0, Reason::Rtt), "{:?}", d.costs);
        // Published, counted and said once, for mid only.
        let snap = published(&host);
        assert_eq!(snap.regions[1].cache_reset_ms, Some(T0 + 3005));
        assert_eq!(snap.regions[0].cache_reset_ms, None);
        assert_eq!(host.value(Stat::Region(1, RegionStat::EngineRestart)), 1);
        assert_eq!(host.value(Stat::Region(0, RegionStat::EngineRestart)), 0);
        let said: Vec<&str> = host
            .logs
            .iter()
            .map(|(_, m)| m.as_str())
            .filter(|m| m.contains("restart"))
            .collect();
        assert_eq!(said, ["llm-geo-router probe: region mid: engine restart seen: its prefix-cache queries counter went back from 51000 to 700 between two scrapes; its prefix cache is taken as empty (what the region served before is no longer believed held there)"]);
        // Served there again after the restart: believed again.
        let d = next_turn(&c, &mut host, Some(T0 + 3200), T0 + 3500);
        assert_eq!((d.region, d.reason), (1, Reason::Cache), "{:?}", d.costs);
        // Restarts in quick succession (or a balancer reading replicas in
        // turn) are each counted, and said at most once a minute.
        for (i, q) in [5_000, 10, 6_000, 20].into_iter().enumerate() {
            round_with(&mut p, &mut host, T0 + 4000 + 1000 * i as u64, &|cluster| {
                with_counters(if cluster == "cm" { q } else { 53_000 })
            });
        }
        assert_eq!(host.value(Stat::Region(1, RegionStat::EngineRestart)), 3);
        round_with(&mut p, &mut host, T0 + 63_005, &|cluster| {
            with_counters(if cluster == "cm" { 0 } else { 53_000 })
        });
        assert_eq!(host.value(Stat::Region(1, RegionStat::EngineRestart)), 4);
        let said: Vec<&str> = host
            .logs
            .iter()
            .map(|(_, m)| m.as_str())
            .filter(|m| m.contains("restart"))
            .collect();
        assert_eq!(said.len(), 2, "{said:?}");
        assert!(said[1].ends_with("from 20 to 0 between two scrapes; its prefix cache is taken as empty (what the region served before is no longer believed held there) (2 more since the last such line)"), "{}", said[1]);
        assert_eq!(
            published(&host).regions[1].cache_reset_ms,
            Some(T0 + 63_010)
        );
    }

    #[test]
    fn a_restart_empties_a_modelled_cache_and_a_session_too() {
        use crate::decision::cost::Reason;
        // mid's capacity is known: its LRU cache is modelled, aged by its
        // intake clock; a restart sets that clock back, which never read
        // as an eviction. The conversation also names mid in its session
        // record.
        let c = cfg("");
        let mut host = Recorder::default();
        let mut p = started(&c, "a", &mut host);
        let info = |q: u64| {
            format!(
                "{}vllm:cache_config_info{{block_size=\"16\",num_gpu_blocks=\"100000\"}} 1.0\n",
                with_counters(q)
            )
        };
        round_with(&mut p, &mut host, T0 + 1000, &|_| info(50_000));
        assert!(published(&host).regions[1].cache_free_tokens.is_some());
        let s = Some("conversation-1");
        let d = next_turn_in(&c, &mut host, s, Some(T0 + 1500), T0 + 1800);
        assert_eq!((d.region, d.reason), (1, Reason::Cache), "{:?}", d.costs);
        round_with(&mut p, &mut host, T0 + 2000, &|c| {
            info(if c == "cm" { 300 } else { 50_000 })
        });
        let d = next_turn_in(&c, &mut host, s, None, T0 + 2100);
        assert_eq!(d.costs[1].cached_tokens, 0, "{:?}", d.costs);
        assert_eq!(d.region, 0, "{:?}", d.costs);
    }

    #[test]
    fn a_restart_no_scrape_saw_is_bounded_by_the_processs_start() {
        use crate::decision::cost::Reason;
        // mid's engine died and came back between two of this probe's
        // scrapes of it with no good one before (the probe had just
        // started): no counter went back and no start time changed, so no
        // restart is seen. Its new process's start still says what its
        // cache cannot hold.
        let c = cfg("");
        let started_at = |ms: u64| {
            move |cluster: &str| {
                let start = if cluster == "cm" { ms } else { T0 - 3_600_000 };
                format!(
                    "{}process_start_time_seconds {}\n",
                    with_counters(700),
                    start as f64 / 1000.0
                )
            }
        };
        for (start, believed) in [
            // After the prompt was served: not held.
            (T0 + 2500, false),
            // Before it (the same process served it): held.
            (T0 + 1000, true),
            // After now: the engine's clock is ahead of ours, no bound.
            (T0 + 60_000, true),
        ] {
            let mut host = Recorder::default();
            let mut p = started(&c, "a", &mut host);
            round_with(&mut p, &mut host, T0 + 1000, &|_| {
                "\x00garbage{".to_string()
            });
            let d = next_turn(&c, &mut host, Some(T0 + 1500), T0 + 1800);
            assert_eq!((d.region, d.reason), (1, Reason::Cache), "{:?}", d.costs);
            round_with(&mut p, &mut host, T0 + 3000, &started_at(start));
            let d = next_turn(&c, &mut host, None, T0 + 3100);
            assert_eq!(
                d.costs[1].cached_tokens > 500,
                believed,
                "start {start}: {:?}",
                d.costs
            );
            assert_eq!(host.value(Stat::Region(1, RegionStat::EngineRestart)), 0);
            let reset = published(&host).regions[1].cache_reset_ms;
            assert_eq!(
                reset,
                (start <= T0 + 3005).then_some(start),
                "start {start}"
            );
        }
    }

    #[test]
    fn a_scrape_without_the_counters_is_no_restart() {
        use crate::decision::cost::Reason;
        let c = cfg("");
        let mut host = Recorder::default();
        let mut p = started(&c, "a", &mut host);
        round_with(&mut p, &mut host, T0 + 1000, &|_| with_counters(50_000));
        let d = next_turn(&c, &mut host, Some(T0 + 1500), T0 + 1800);
        assert_eq!((d.region, d.reason), (1, Reason::Cache), "{:?}", d.costs);
        // A good scrape without the prefix counters (an exporter that
        // leaves them out, a foreign page with the load series), then
        // garbage: neither reads as a counter gone to 0.
        round_with(&mut p, &mut host, T0 + 2000, &|_| VLLM.to_string());
        round_with(&mut p, &mut host, T0 + 3000, &|_| {
            "\x00garbage{".to_string()
        });
        round_with(&mut p, &mut host, T0 + 4000, &|_| with_counters(50_100));
        let d = next_turn(&c, &mut host, None, T0 + 4100);
        assert_eq!((d.region, d.reason), (1, Reason::Cache), "{:?}", d.costs);
        assert!(d.costs[1].cached_tokens > 500, "{:?}", d.costs);
    }
}
