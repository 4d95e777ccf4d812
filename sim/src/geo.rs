//! The geo-router as deployed: one Envoy per client region, each with its
//! own plugin state, running the plugin's own state machines: per request
//! the guard's and the router's (`guard::GuardStream`,
//! `router::RouterStream`), per tick and per callout answer the probe's
//! (`probe::Probe`), over an in-memory host (`shared::host_api::Recorder`: this
//! Envoy's stats, shared data and queue). This module only turns the
//! simulation's events into theirs.

use std::collections::HashMap;
use std::rc::Rc;

use crate::topology::Topology;
use engine_emulator::openai;
use llm_geo_router::config::Config;
use llm_geo_router::decision::cost::Reason;
use llm_geo_router::fleet::view::View;
use llm_geo_router::learning::outcome;
use llm_geo_router::roots::guard::{Guard, GuardStream};
use llm_geo_router::roots::probe::Probe;
use llm_geo_router::roots::router::{RouterShared, RouterStream};
use llm_geo_router::shared::flow::Flow;
use llm_geo_router::shared::host_api::{Answer, Recorder};
use llm_geo_router::shared::names::{CODE_DETAILS_PROPERTY, RESPONSE_FLAGS_PROPERTY};
use serde_json::{json, Map, Value};

/// What the plugin is told about the engines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Knowledge {
    /// What an operator knows: region names, clusters, slot counts
    /// (`max_concurrency`) and a capacity estimate from them at the
    /// documented default service time; everything else at its documented
    /// default (`prefill_ms_per_token`, `service_ms`, `rtt_ms`). Round trips
    /// come from the probe, prefill rates and weights from online tuning.
    /// The headline.
    Operator,
    /// The engines' exact figures: each region's prefill rate, a service
    /// time from the trace's own mean output length, and every round trip
    /// from the fleet file. A limit, not a deployment.
    Exact,
}

impl Knowledge {
    pub fn as_str(self) -> &'static str {
        match self {
            Knowledge::Operator => "operator",
            Knowledge::Exact => "exact",
        }
    }
}

/// Where the geo-router reads each region's load (waiting and running
/// requests) from, and the `max_concurrency` its operator configures for
/// it. With one engine per region every variant but `Prometheus` is the
/// plugin as it always ran.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Source {
    /// `load_source: scrape`: the probe reads `/metrics` through the
    /// region's cluster, which lands on one replica, the one the region's
    /// entry point picks for it; the operator configures `max_concurrency`
    /// as `slots` says.
    Scrape(Slots),
    /// `load_source: prometheus`: one query per full probe round to the
    /// `prometheus` cluster, answered with the sums over the region's
    /// replicas as of Prometheus' last scrape of each (every `interval_ms`);
    /// `max_concurrency` is one replica's (the plugin multiplies it by the
    /// replicas the answer counts).
    Prometheus { interval_ms: f64 },
}

/// What an operator with a `scrape` source configures as `max_concurrency`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slots {
    /// The region's total (replicas × each one's slots): the region's
    /// capacity, as one plans it. The default.
    Region,
    /// One replica's (vLLM's `max_num_seqs`), knowing that the scrape reads
    /// one replica.
    Replica,
}

impl Default for Source {
    fn default() -> Self {
        Source::Scrape(Slots::Region)
    }
}

/// Prometheus' default `scrape_interval`.
pub const DEFAULT_PROMETHEUS_INTERVAL_MS: f64 = 15_000.0;

/// The Envoy cluster the simulated plugin reaches Prometheus by.
pub const PROMETHEUS_CLUSTER: &str = "prometheus";

impl Source {
    /// `scrape`, `scrape-replica` or `prometheus` (at
    /// `DEFAULT_PROMETHEUS_INTERVAL_MS`; `interval_ms` sets it).
    pub fn parse(text: &str) -> Result<Source, String> {
        match text.trim() {
            "scrape" => Ok(Source::Scrape(Slots::Region)),
            "scrape-replica" => Ok(Source::Scrape(Slots::Replica)),
            "prometheus" => Ok(Source::Prometheus {
                interval_ms: DEFAULT_PROMETHEUS_INTERVAL_MS,
            }),
            t => Err(format!(
                "unknown load source '{t}'; known: scrape, scrape-replica, prometheus"
            )),
        }
    }

    /// `scrape`, `scrape-replica` or `prometheus@<interval>ms`.
    pub fn label(self) -> String {
        match self {
            Source::Scrape(Slots::Region) => "scrape".into(),
            Source::Scrape(Slots::Replica) => "scrape-replica".into(),
            Source::Prometheus { interval_ms } => format!("prometheus@{interval_ms}ms"),
        }
    }

    /// The `max_concurrency` the operator configures for `region`.
    pub fn max_concurrency(self, region: &crate::topology::Region) -> u32 {
        match self {
            Source::Scrape(Slots::Region) => region.slots(),
            Source::Scrape(Slots::Replica) | Source::Prometheus { .. } => region.max_concurrency,
        }
    }
}

/// The plugin configuration one client region's Envoy gets: the fleet's
/// regions as `knowledge` allows, their load read as `source` says, the
/// tier taken from the trace as a trusted header, and `overrides` (a
/// partial plugin configuration, everything but `regions`) merged on top.
/// `capacity_rps` is always the region's (all its replicas).
pub fn plugin_config(
    fleet: &Topology,
    client: usize,
    knowledge: Knowledge,
    mean_output_tokens: f64,
    source: Source,
    overrides: Option<&Value>,
) -> Result<Config, String> {
    let default_service_ms = llm_geo_router::config::DEFAULT_SERVICE_MS;
    let regions: Vec<Value> = fleet
        .regions
        .iter()
        .enumerate()
        .map(|(r, region)| {
            let slots = f64::from(region.slots());
            let mut v = match knowledge {
                Knowledge::Operator => json!({
                    "name": region.name,
                    "cluster": region.name,
                    "capacity_rps": slots * 1000.0 / default_service_ms,
                    "max_concurrency": source.max_concurrency(region),
                }),
                Knowledge::Exact => {
                    // The mean time a request holds a slot is dominated by decode.
                    let service_ms = (region.decode_ms_per_token * mean_output_tokens).max(1.0);
                    json!({
                        "name": region.name,
                        "cluster": region.name,
                        "capacity_rps": slots * 1000.0 / service_ms,
                        "max_concurrency": source.max_concurrency(region),
                        "prefill_ms_per_token": region.prefill_ms_per_token,
                        "service_ms": service_ms,
                        "rtt_ms": fleet.rtt(client, r),
                    })
                }
            };
            if let (Source::Prometheus { .. }, Value::Object(o)) = (source, &mut v) {
                o.insert("load_source".into(), json!("prometheus"));
            }
            v
        })
        .collect();
    // The simulated engines end every stream with a usage chunk, as vLLM
    // with --enable-force-include-usage does: the operator says so.
    let mut doc = json!({
        "regions": regions,
        "tiers": {"trust_header": true},
        "directory": {"stream_usage": "always"},
    });
    if let (Source::Prometheus { .. }, Value::Object(d)) = (source, &mut doc) {
        d.insert(
            "prometheus".into(),
            json!({ "cluster": PROMETHEUS_CLUSTER }),
        );
    }
    if let Some(o) = overrides {
        let Value::Object(o) = o else {
            return Err("must be a JSON object (a plugin configuration without regions)".into());
        };
        if o.contains_key("regions") {
            return Err(
                "regions: come from the fleet file; give only the other plugin settings".into(),
            );
        }
        if let Value::Object(d) = &mut doc {
            merge(d, o);
        }
    }
    let bytes = serde_json::to_vec(&doc).map_err(|e| e.to_string())?;
    Config::parse(&bytes).map_err(|e| e.to_string())
}

/// Deep merge: objects merge key by key, anything else replaces.
fn merge(into: &mut Map<String, Value>, from: &Map<String, Value>) {
    for (k, v) in from {
        match (into.get_mut(k), v) {
            (Some(Value::Object(a)), Value::Object(b)) => merge(a, b),
            _ => {
                into.insert(k.clone(), v.clone());
            }
        }
    }
}

/// What the guard and the router did with one request.
#[derive(Debug, Clone, PartialEq)]
pub enum Handled {
    /// The level sheds the tier (429).
    Shed,
    /// The level caps the tier's prompt length (413).
    TooLong,
    Routed(Routing),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    pub region: usize,
    pub reason: Reason,
    /// The body after the guard rewrote it (`max_tokens` clamped).
    pub clamped_body: Option<Vec<u8>>,
    /// The queue wait predicted for the chosen region (streams).
    pub predicted_queue_ms: Option<f32>,
}

/// A probe callout the simulation must answer: its target is read half a
/// round trip later and the answer arrives a round trip later.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Callout {
    pub token: u32,
    pub to: To,
}

/// Where a probe callout goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum To {
    /// The entry point of `region` (its cluster): the metrics scrape
    /// (`metrics`) or another callout (health, model list).
    Region { region: usize, metrics: bool },
    /// The `prometheus` cluster's instant query.
    Prometheus,
    /// An exchange message to a peer Envoy (`exchange.cluster`): the
    /// simulation picks the peer as the cluster's round robin would.
    Peers,
}

/// The simulated deployment's `exchange.cluster`.
pub const PEERS_CLUSTER: &str = "peers";

/// One Envoy of the geo-router: the plugin's own guard, router and probe
/// state machines over an in-memory host (its stats, shared data and
/// queue), driven by the simulation's events as Envoy would drive them.
pub struct Envoy {
    pub cfg: Rc<Config>,
    guard: Guard,
    router: RouterShared,
    probe: Probe,
    view: View,
    host: Recorder,
    /// Routed requests in flight, by the simulation's request index.
    streams: HashMap<usize, RouterStream>,
    /// Metrics callouts the probe sent (all regions).
    pub scrapes: u64,
    /// Queries the probe sent Prometheus.
    pub queries: u64,
    /// Exchange messages sent and not yet handed to the simulation: token
    /// to body.
    peer_bodies: HashMap<u32, Vec<u8>>,
    /// The peers' cluster's round robin: the next host.
    pub next_peer: usize,
}

impl Envoy {
    /// `id`: distinct per Envoy, it names the Envoy in the exchange.
    pub fn new(cfg: Config, now_ms: u64, id: u64) -> Envoy {
        let cfg = Rc::new(cfg);
        let mut host = Recorder {
            now_ms,
            ..Recorder::default()
        };
        // The owner names the Envoy in the exchange: one per Envoy.
        let mut probe = Probe::new(cfg.clone(), format!("sim-{id}"), now_ms);
        probe.start(&mut host);
        Envoy {
            guard: Guard::new(cfg.clone(), now_ms),
            router: RouterShared::new(cfg.clone()),
            probe,
            view: View::new(),
            host,
            streams: HashMap::new(),
            scrapes: 0,
            queries: 0,
            peer_bodies: HashMap::new(),
            next_peer: 0,
            cfg,
        }
    }

    /// The guard, then the router, for request `id`'s body.
    pub fn handle(
        &mut self,
        id: usize,
        body: &[u8],
        tier: &str,
        session: &str,
        now_ms: u64,
    ) -> Result<Handled, String> {
        let cfg = self.cfg.clone();
        let host = &mut self.host;
        host.now_ms = now_ms;
        host.request(&[
            (":method", "POST"),
            (":path", "/v1/chat/completions"),
            (&cfg.headers.tier, tier),
            (&cfg.headers.session, session),
        ]);
        let flow = GuardStream::new().on_whole_request(&self.guard, host, &mut self.view, body);
        match flow {
            Flow::Reply(r) if r.status == u32::from(cfg.ladder.shed_status) => {
                return Ok(Handled::Shed)
            }
            Flow::Reply(r) if r.status == 413 => return Ok(Handled::TooLong),
            Flow::Reply(r) => {
                return Err(format!(
                    "the guard refuses the body: {}",
                    String::from_utf8_lossy(&r.body)
                ))
            }
            Flow::Continue | Flow::Pause => {}
        }
        // The router sees the headers as the guard left them.
        let clamped_body = host.replaced_body.take();
        let body = clamped_body.as_deref().unwrap_or(body);
        let mut stream = RouterStream::new();
        if let Flow::Reply(r) = stream.on_whole_request(&self.router, host, &mut self.view, body) {
            return Err(format!(
                "the router refuses the request: {}",
                String::from_utf8_lossy(&r.body)
            ));
        }
        let Some(routed) = stream.decision() else {
            return Err("the router did not route an inference request".into());
        };
        let (region, reason) = (routed.decision.region, routed.decision.reason);
        // As the router measures it: a stream the main pool serves.
        let predicted_queue_ms = (routed.stream && reason != Reason::Fallback)
            .then(|| routed.observation().map(|o| o.queue_ms))
            .flatten();
        self.streams.insert(id, stream);
        Ok(Handled::Routed(Routing {
            region,
            reason,
            clamped_body,
            predicted_queue_ms,
        }))
    }

    /// The first byte of request `id`'s answer arrived.
    pub fn first_byte(&mut self, id: usize, now_ms: u64) {
        let host = &mut self.host;
        host.now_ms = now_ms;
        if let Some(s) = self.streams.get_mut(&id) {
            // Its response headers came first, with 200, from the engine
            // (as Envoy says of an upstream's answer).
            host.status = Some(200);
            host.properties.insert(
                CODE_DETAILS_PROPERTY.join("."),
                outcome::VIA_UPSTREAM.as_bytes().to_vec(),
            );
            s.on_response_headers(&self.router, host);
            s.on_first_byte(&self.router, host);
        }
    }

    /// Request `id` ended: answered completely (`ok`), or its region was
    /// lost under it (a connection failure, as Envoy would report it).
    /// `usage`: the engine's prompt and cached tokens, which the answer's
    /// last chunk carries as vLLM's does.
    pub fn done(&mut self, id: usize, ok: bool, usage: Option<(u64, u64)>, now_ms: u64) {
        let host = &mut self.host;
        host.now_ms = now_ms;
        let Some(mut s) = self.streams.remove(&id) else {
            return;
        };
        if let (true, Some((prompt, cached))) = (ok, usage) {
            // The answer's last chunk as the emulator's engines write it,
            // cached tokens reported on every answer (SGLang's
            // `--enable-cache-report`; vLLM's omits a 0).
            let meta = openai::ResponseMeta {
                id: "sim".to_string(),
                created: 0,
                model: "sim".to_string(),
            };
            let usage = openai::Usage {
                prompt_tokens: usize::try_from(prompt).unwrap_or(usize::MAX),
                completion_tokens: 1,
                cached_tokens: usize::try_from(cached).unwrap_or(usize::MAX),
                created_tokens: None,
                report: openai::CacheReport::SglangCacheReport,
            };
            host.response_chunk = openai::usage_chunk(openai::Kind::Chat, &meta, usage);
            host.response_chunk.extend_from_slice(openai::SSE_DONE);
            let len = host.response_chunk.len();
            s.on_response_body(&self.router, host, len, true);
        }
        host.next_stream();
        if !ok {
            let upstream_failure = outcome::flags::UPSTREAM_CONNECTION_FAILURE
                | outcome::flags::UPSTREAM_RETRY_LIMIT_EXCEEDED;
            host.properties.insert(
                RESPONSE_FLAGS_PROPERTY.join("."),
                upstream_failure.to_le_bytes().to_vec(),
            );
            host.status = Some(503);
            s.on_response_headers(&self.router, host);
        }
        s.on_log(&self.router, host);
    }

    /// A probe tick: the callouts it sent, and the ladder level published.
    pub fn tick(&mut self, now_ms: u64) -> (Vec<Callout>, u8) {
        self.host.now_ms = now_ms;
        self.probe.on_tick(&mut self.host);
        let prometheus = self.cfg.prometheus.cluster.clone();
        let peers = self.cfg.exchange.cluster.clone();
        for (token, body) in self.host.callout_bodies.drain(..) {
            self.peer_bodies.insert(token, body);
        }
        let callouts = self
            .host
            .callouts
            .drain(..)
            .filter_map(|(token, cluster, path)| {
                if peers.as_deref() == Some(cluster.as_str()) {
                    return Some(Callout {
                        token,
                        to: To::Peers,
                    });
                }
                if prometheus.as_deref() == Some(cluster.as_str()) {
                    return Some(Callout {
                        token,
                        to: To::Prometheus,
                    });
                }
                let region = self.cfg.regions.iter().position(|r| r.cluster == cluster)?;
                let metrics = self.cfg.regions.get(region)?.metrics_path == path;
                Some(Callout {
                    token,
                    to: To::Region { region, metrics },
                })
            })
            .collect::<Vec<Callout>>();
        for c in &callouts {
            match c.to {
                To::Region { metrics: true, .. } => self.scrapes += 1,
                To::Prometheus => self.queries += 1,
                To::Region { .. } | To::Peers => {}
            }
        }
        (callouts, self.probe.fleet().level())
    }

    /// The probe's tick period as it last set it on its host (Envoy's
    /// timer): when its next tick is due.
    pub fn period_ms(&self) -> u64 {
        self.host
            .tick_ms
            .unwrap_or(u64::from(self.cfg.probe.tick_ms))
            .max(1)
    }

    /// What this Envoy's probe last published (shared data), if anything.
    pub fn snapshot(&self) -> Option<llm_geo_router::fleet::snapshot::Snapshot> {
        let (bytes, _) = self
            .host
            .store
            .map
            .get(llm_geo_router::shared::names::SNAPSHOT_KEY)?;
        llm_geo_router::fleet::snapshot::Snapshot::decode(bytes).ok()
    }

    /// The body of exchange callout `token` (once).
    pub fn take_peer_body(&mut self, token: u32) -> Option<Vec<u8>> {
        self.peer_bodies.remove(&token)
    }

    /// A peer's exchange message reaches this Envoy's peers' listener: the
    /// plugin's `exchange` filter takes it (queued for this Envoy's probe,
    /// merged at its next tick) or refuses it. Returns the status answered.
    pub fn exchange_in(&mut self, body: &[u8], now_ms: u64) -> u32 {
        use llm_geo_router::cache::exchange::ExchangeStream;
        use llm_geo_router::shared::flow::Flow;
        self.host.now_ms = now_ms;
        let length = body.len().to_string();
        self.host.request(&[
            (":method", "POST"),
            (":path", self.cfg.exchange.path.as_str()),
            ("content-length", length.as_str()),
        ]);
        let mut s = ExchangeStream::new();
        let flow = match s.on_request_headers(&self.cfg, &mut self.host, false) {
            Flow::Pause => s.on_request_body(&self.cfg, &mut self.host, body.len(), Some(body)),
            other => other,
        };
        match flow {
            Flow::Reply(r) => r.status,
            Flow::Continue | Flow::Pause => 404,
        }
    }

    /// A callout's answer arrived.
    pub fn answer(&mut self, token: u32, mut answer: Answer, now_ms: u64) {
        self.host.now_ms = now_ms;
        self.probe
            .on_callout_response(&mut self.host, token, &mut answer);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use llm_geo_router::config::LoadSource;

    fn fleet() -> Topology {
        Topology::parse(
            br#"{"client_regions": ["na", "eu"], "regions": [
              {"name": "iad", "rtt_ms": {"na": 10, "eu": 80}, "max_concurrency": 20,
               "prefill_ms_per_token": 0.1, "decode_ms_per_token": 20, "cache_tokens": 100000},
              {"name": "fra", "rtt_ms": {"na": 80, "eu": 10}, "max_concurrency": 10,
               "prefill_ms_per_token": 0.2, "decode_ms_per_token": 25, "cache_tokens": 100000}]}"#,
        )
        .unwrap()
    }

    #[test]
    fn config_comes_from_the_fleet_with_overrides() {
        let f = fleet();
        let c = plugin_config(&f, 1, Knowledge::Exact, 100.0, Source::default(), None).unwrap();
        assert_eq!(c.regions[0].rtt_ms, 80.0);
        assert_eq!(c.regions[1].service_ms, 2500.0);
        assert_eq!(c.regions[1].prefill_ms_per_token, 0.2);
        assert_eq!(c.regions[1].capacity_rps, 4.0);
        assert_eq!(c.regions[0].capacity_rps, 10.0);
        assert!(c.tiers.trust_header);
        // What an operator knows: slots; the rest at the documented defaults,
        // whatever the engines and the trace are.
        let c = plugin_config(&f, 1, Knowledge::Operator, 100.0, Source::default(), None).unwrap();
        let d =
            Config::parse(br#"{"regions": [{"name": "x", "cluster": "x", "capacity_rps": 1}]}"#)
                .unwrap();
        let d = &d.regions[0];
        for (r, slots) in c.regions.iter().zip([20.0, 10.0]) {
            assert_eq!(r.rtt_ms, d.rtt_ms);
            assert_eq!(r.service_ms, d.service_ms);
            assert_eq!(r.prefill_ms_per_token, d.prefill_ms_per_token);
            assert_eq!(r.capacity_rps, slots * 1000.0 / d.service_ms);
        }
        assert_eq!(c.regions[1].max_concurrency, 10);
        let o =
            json!({"cost": {"placement_floor": 0.5}, "probe": {"tick_ms": 500, "timeout_ms": 500}});
        let c = plugin_config(&f, 0, Knowledge::Exact, 100.0, Source::default(), Some(&o)).unwrap();
        assert_eq!((c.cost.placement_floor, c.probe.tick_ms), (0.5, 500));
        let e = plugin_config(
            &f,
            0,
            Knowledge::Operator,
            100.0,
            Source::default(),
            Some(&json!({"regions": []})),
        )
        .unwrap_err();
        assert!(e.starts_with("regions:"), "{e}");
        let e = plugin_config(
            &f,
            0,
            Knowledge::Operator,
            100.0,
            Source::default(),
            Some(&json!({"cost": {"w_rt": 1}})),
        )
        .unwrap_err();
        assert!(e.contains("w_rt"), "{e}");
    }

    #[test]
    fn what_the_operator_configures_for_each_load_source() {
        let f = fleet().split_replicas(2).unwrap();
        let cfg = |source| plugin_config(&f, 0, Knowledge::Operator, 100.0, source, None).unwrap();
        // Scrape: the region's total (default) or one replica's slots; no
        // Prometheus.
        let c = cfg(Source::default());
        assert_eq!(
            (c.regions[0].max_concurrency, c.regions[1].max_concurrency),
            (20, 10)
        );
        assert_eq!(c.regions[0].load_source, LoadSource::Scrape);
        assert_eq!(c.prometheus.cluster, None);
        let c = cfg(Source::Scrape(Slots::Replica));
        assert_eq!(
            (c.regions[0].max_concurrency, c.regions[1].max_concurrency),
            (10, 5)
        );
        // Prometheus: per replica, every region read from the cluster.
        let c = cfg(Source::Prometheus {
            interval_ms: 15_000.0,
        });
        assert_eq!(c.regions[0].max_concurrency, 10);
        assert!(c
            .regions
            .iter()
            .all(|r| r.load_source == LoadSource::Prometheus));
        assert_eq!(c.prometheus.cluster.as_deref(), Some(PROMETHEUS_CLUSTER));
        // The capacity estimate is the region's whatever the source.
        assert_eq!(
            c.regions[0].capacity_rps,
            cfg(Source::default()).regions[0].capacity_rps
        );
        assert_eq!(
            Source::parse("prometheus").unwrap().label(),
            "prometheus@15000ms"
        );
        assert!(Source::parse("pull").unwrap_err().contains("known: scrape"));
    }
}
