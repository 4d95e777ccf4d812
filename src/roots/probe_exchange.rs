//! The probe's side of the exchange with the deployment's other Envoys:
//! a message out every `exchange.interval_ms`, a peer's message merged in
//! (its usage reports to the calibration), and the live peers' load
//! exported to the gauges and the fleet.

use crate::cache::exchange::{Apply, Body, Load, Message};
use crate::learning::calibration::Verdict;
use crate::learning::usage::UsageReport;
use crate::roots::probe::{Kind, Probe, ALL_REGIONS};
use crate::shared::host_api::{Level, ProbeHost};
use crate::shared::names::{Global, RegionStat, Stat};

/// What of a peer's news the probe applies itself: the usage reports, to
/// its calibration (the exchange filter wrote the placements and stored
/// responses to shared data as the message arrived).
#[derive(Default)]
struct Usage(Vec<UsageReport>);

impl Apply for Usage {
    fn apply(&mut self, _origin: u64, body: &Body) {
        if let Body::Usage(b) = body {
            if let Some(r) = UsageReport::decode(b) {
                self.0.push(r);
            }
        }
    }
}

impl Probe {
    /// How long a peer's load counts after its last message: three send
    /// periods and a callout timeout (a peer that stopped sending costs
    /// only its own contribution, and only until then).
    fn peer_fresh_ms(&self) -> u64 {
        3 * self.cfg.exchange_interval_ms() + u64::from(self.cfg.probe.timeout_ms)
    }

    /// A peer's message, as this Envoy's exchange filter queued it (it
    /// checked it whole; it is checked again here, as the queue is shared
    /// data any root could write).
    pub(super) fn merge_peer(&mut self, host: &mut dyn ProbeHost, bytes: &[u8]) {
        let now = host.now_ms();
        let regions = self.cfg.regions.len();
        let max = self.cfg.exchange.max_message_bytes as usize;
        let Some(x) = self.exchange.as_mut() else {
            return;
        };
        let msg = match Message::decode(bytes, x.layout(), regions, max) {
            Ok(m) => m,
            Err(e) => {
                host.count(Stat::Global(Global::ExchangeRefused), 1);
                host.log(
                    Level::Warn,
                    &format!("llm-geo-router probe: exchange: a queued message refused: {e}"),
                );
                return;
            }
        };
        let sent_ms = msg.sent_ms;
        let mut usage = Usage::default();
        let merged = x.merge(msg, now, &mut usage);
        let usage = usage.0;
        if merged.own {
            return;
        }
        host.count(Stat::Global(Global::ExchangeReceived), 1);
        host.count(Stat::Global(Global::ExchangeMerged), merged.fresh as i64);
        host.count(
            Stat::Global(Global::ExchangeDuplicate),
            merged.duplicate as i64,
        );
        host.set_gauge(
            Stat::Global(Global::ExchangeLagMs),
            now.saturating_sub(sent_ms),
        );
        for r in usage {
            let region = usize::from(r.region);
            if let Some(Verdict::Refuted) = self.fleet.on_usage(&r) {
                host.count(Stat::Region(region, RegionStat::CacheBeliefRefuted), 1);
            }
        }
        self.export_peers(host, now);
    }

    /// The live peers' in-flight requests (the routers read the gauges)
    /// and demand (the ladder's), as of `now`: after each merge, and at
    /// each send, so that a peer gone quiet stops counting at once.
    fn export_peers(&mut self, host: &mut dyn ProbeHost, now: u64) {
        let fresh = self.peer_fresh_ms();
        let Some(x) = &self.exchange else {
            return;
        };
        let inflight = x.peer_inflight(now, fresh);
        for (i, v) in inflight.iter().enumerate() {
            host.set_gauge(Stat::Region(i, RegionStat::PeerRqActive), v.round() as u64);
        }
        let since = x.peer_inflight_since(&self.fleet.scraped_ms(), now, fresh);
        self.fleet.set_peer_inflight_delta(&since);
        host.set_gauge(
            Stat::Global(Global::ExchangePeers),
            x.live_peers(now, fresh) as u64,
        );
    }

    /// Every `exchange.interval_ms`: the outbox and this Envoy's load, to
    /// `exchange.fanout` peers.
    pub(super) fn send_exchange(&mut self, host: &mut dyn ProbeHost, now: u64) {
        let interval = self.cfg.exchange_interval_ms();
        let fast = u64::from(self.cfg.probe.busy_tick_ms());
        if self.exchange.is_none()
            || self
                .exchange_sent_ms
                .is_some_and(|t| now.saturating_sub(t) + fast / 2 < interval)
        {
            return;
        }
        let inflight = (0..self.cfg.regions.len())
            .map(|i| {
                let v = host.stat(Stat::Region(i, RegionStat::RqActive));
                u32::try_from(v).unwrap_or(u32::MAX)
            })
            .collect();
        let own = Load {
            taken_ms: now,
            arrivals: host.stat(Stat::Global(Global::Arrivals)),
            inflight,
        };
        self.export_peers(host, now);
        let fresh = self.peer_fresh_ms();
        let Some(x) = self.exchange.as_mut() else {
            return;
        };
        let (calls, direct) = crate::cache::exchange::plan(
            self.cfg.exchange.fanout as usize,
            x.live_peers(now, fresh),
        );
        x.direct = direct;
        let dropped = std::mem::take(&mut x.dropped);
        if dropped > 0 {
            host.count(Stat::Global(Global::ExchangeDropped), dropped as i64);
        }
        let body = x.take_message(own, now);
        self.exchange_sent_ms = Some(now);
        let Some(cluster) = self.cfg.exchange.cluster.clone() else {
            return;
        };
        let authority = self
            .cfg
            .exchange
            .authority
            .clone()
            .unwrap_or_else(|| cluster.clone());
        let length = body.len().to_string();
        let headers = [
            (":method", "POST"),
            (":path", self.cfg.exchange.path.as_str()),
            (":authority", authority.as_str()),
            ("content-type", "application/octet-stream"),
            ("content-length", length.as_str()),
            ("user-agent", "llm-geo-router-exchange"),
        ];
        let timeout = u64::from(self.cfg.probe.timeout_ms);
        // A callout answered after two timeouts is forgotten: at most
        // `fanout` of them per interval are out.
        let out = self
            .pending
            .values()
            .filter(|(_, k, _)| *k == Kind::Exchange)
            .count();
        for _ in out..calls {
            match host.dispatch(&cluster, &headers, Some(&body), timeout) {
                Ok(token) => {
                    self.pending
                        .insert(token, (ALL_REGIONS, Kind::Exchange, now));
                    host.count(Stat::Global(Global::ExchangeSent), 1);
                    host.count(Stat::Global(Global::ExchangeBytesSent), body.len() as i64);
                }
                Err(status) => {
                    host.count(Stat::Global(Global::ExchangeSendFailed), 1);
                    if !std::mem::replace(&mut self.exchange_warned, true) {
                        host.log(
                            Level::Warn,
                            &format!(
                                "llm-geo-router probe: exchange: callout to cluster {cluster:?} refused by the host ({status}); is the cluster defined?"
                            ),
                        );
                    }
                    break;
                }
            }
        }
    }
}
