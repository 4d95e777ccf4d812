//! The router filter on the answer: its response headers (counted as the
//! region's, or a local reply that is not), its first bytes (what a
//! successful answer teaches, charged to the region whose host served the
//! last try), the engine's `usage` and a stored response's id read from its
//! body, and at the end how the request ended (`outcome`). The request side
//! is `roots::router`.

use crate::cache::stored_responses;
use crate::config::Config;
use crate::learning::outcome::{flags, Ending, VIA_UPSTREAM};
use crate::learning::usage::UsageScan;
use crate::roots::router::{RouterShared, RouterStream};
use crate::shared::flow::Flow;
use crate::shared::host_api::StreamHost;
use crate::shared::names::{
    ErrorType, Global, RegionHistogram, RegionStat, Stat, TokenType, ATTEMPTS_PROPERTY,
    CODE_DETAILS_PROPERTY, HOST_REGION_PROPERTY, OBSERVATIONS_QUEUE, RESPONSE_FLAGS_PROPERTY,
};

impl RouterStream {
    /// The response headers arrived (an engine's, or a local reply's).
    pub fn on_response_headers(
        &mut self,
        shared: &RouterShared,
        host: &mut dyn StreamHost,
    ) -> Flow {
        let Some(region) = self.sent else {
            return Flow::Continue;
        };
        // Envoy answers in the region's place when no route matches, for a
        // direct response, or for a filter after this one: that answer is
        // not the region's. One property read; a second only for a reply
        // that did not come from upstream (an upstream failure's is the
        // region's).
        let via_upstream = host
            .property(&CODE_DETAILS_PROPERTY)
            .is_some_and(|d| d == VIA_UPSTREAM.as_bytes());
        self.local = !via_upstream
            && host
                .property(&RESPONSE_FLAGS_PROPERTY)
                .and_then(u64_le)
                .unwrap_or(0)
                & flags::UPSTREAM_FAILURE
                == 0;
        if self.local {
            self.pending = None;
            self.usage = None;
            self.head = None;
            return Flow::Continue;
        }
        self.count_sent(host, region);
        if let (Some(name), Some(value)) = (&shared.cfg.headers.decision, &self.decision_header) {
            host.add_response_header(name, value);
        }
        self.status = host.response_status();
        // Only a successful stream's first byte is a time to first
        // token, and only a successful answer reports usage.
        if !self.status.is_some_and(|s| (200..300).contains(&s)) {
            self.pending = None;
            self.usage = None;
            self.head = None;
        }
        Flow::Continue
    }

    /// Count the request in the region's `rq_total`, once.
    fn count_sent(&mut self, host: &mut dyn StreamHost, region: usize) {
        if !std::mem::replace(&mut self.counted, true) {
            host.count(Stat::Region(region, RegionStat::RqTotal), 1);
        }
    }

    /// Whether the next response byte is news: the first of a stream whose
    /// TTFT is measured, or of a successful answer whose serving region is
    /// to learn the prompt. Every other chunk costs nothing.
    pub fn awaiting_first_byte(&self) -> bool {
        self.pending.is_some() || self.learns() || self.times_first_byte()
    }

    /// Whether response body chunks are wanted at all: the first byte of a
    /// measured stream, the body of an answer whose `usage` is read, or a
    /// stored response's first bytes. Otherwise a chunk costs nothing.
    pub fn wants_response_body(&self) -> bool {
        self.pending.is_some()
            || self.usage.is_some()
            || self.head.is_some()
            || self.learns()
            || self.times_first_byte()
    }

    /// A successful stream whose first byte is its client's TTFT has not
    /// started yet.
    fn times_first_byte(&self) -> bool {
        self.ttft && !self.started && self.status.is_some_and(|s| (200..300).contains(&s))
    }

    /// A successful answer to a routed request has not started yet: its
    /// first bytes will teach the directory.
    fn learns(&self) -> bool {
        !self.started
            && self.status.is_some_and(|s| (200..300).contains(&s))
            && self.decided.as_ref().is_some_and(|d| d.learning.is_some())
    }

    /// A response body chunk of `size` bytes passes (`end_of_stream`: the
    /// last). When its `usage` is read, the whole chunk is scanned: the
    /// usage may be anywhere in the body (vLLM puts the prompt's logprobs
    /// and token ids after it). Nothing is parsed before the end.
    pub fn on_response_body(
        &mut self,
        shared: &RouterShared,
        host: &mut dyn StreamHost,
        size: usize,
        end_of_stream: bool,
    ) {
        if size > 0 && !self.started {
            self.on_first_byte(shared, host);
        }
        if size > 0 && self.head.is_some() {
            self.read_head(shared, host, size);
        }
        let Some(scan) = &mut self.usage else {
            return;
        };
        scan_chunk(scan, host, size);
        if end_of_stream {
            self.report_usage(shared, host, true);
        }
    }

    /// A stored response's first bytes: once its `id` is read, record the
    /// region that holds it (one shared-data write per response).
    fn read_head(&mut self, shared: &RouterShared, host: &mut dyn StreamHost, size: usize) {
        let (Some(head), Some(region)) = (&mut self.head, self.served) else {
            return;
        };
        let n = head.wanted(size);
        let id = match host.response_body(0, n) {
            Some(bytes) => head.push(&bytes),
            None => None,
        };
        let bit = 1u64 << region.min(63);
        if let Some(id) = id {
            self.head = None;
            // An engine known to keep no Responses: nothing to follow.
            if self.keeps_none & bit != 0 {
                return;
            }
            let Some(r) = shared.cfg.regions.get(region) else {
                return;
            };
            let now = host.now_ms();
            if self.keeping_unknown & bit != 0 {
                if let Ok(region) = u16::try_from(region) {
                    to_probe(host, &stored_responses::encode_store_check(region, &id));
                }
            }
            shared.router.responses.record(host, &id, &r.name, now);
            if shared.cfg.exchange.enabled() {
                if let Ok(region) = u16::try_from(region) {
                    let note = crate::cache::exchange::encode_note(
                        &crate::cache::exchange::Body::Response {
                            region,
                            at_ms: now,
                            hash: shared.router.responses.id_hash(&id),
                        },
                    );
                    to_probe(host, &note);
                }
            }
            host.count(Stat::Global(Global::RouterResponsesRecorded), 1);
        } else if head.exhausted() {
            self.head = None;
        }
    }

    /// The answer ended: the engine's `usage`, if it gave one, goes to the
    /// probe with what the router believed; `missing` counts an answer
    /// that ended without one.
    fn report_usage(
        &mut self,
        shared: &RouterShared,
        host: &mut dyn StreamHost,
        count_missing: bool,
    ) {
        let Some(scan) = self.usage.take() else {
            return;
        };
        let usage = scan.usage();
        if let (Some(u), Some(served)) = (usage, self.served) {
            let tokens = [
                (TokenType::Input, Some(u.prompt_tokens)),
                (TokenType::Output, u.completion_tokens),
                (TokenType::CachedInput, u.cached_tokens),
            ];
            for (t, n) in tokens {
                if let Some(n) = n {
                    host.record(
                        Stat::RegionHistogram(served, RegionHistogram::TokenUsage(t)),
                        n,
                    );
                }
            }
            self.output_tokens = u.completion_tokens;
        }
        if let (Some(served), Some(learning)) = (
            self.served,
            self.decided.as_mut().and_then(|d| d.learning.as_mut()),
        ) {
            shared.router.note_intake(host, learning, served, usage);
        }
        let report = usage.and_then(|u| self.decided.as_ref()?.usage_report(u, self.served?));
        match report {
            Some(r) => to_probe(host, &r.encode()),
            None if count_missing => host.count(Stat::Global(Global::RouterUsageMissing), 1),
            None => {}
        }
    }

    /// The first bytes of the answer arrived. A successful answer's engine
    /// holds the prompt now: the region whose host served the last try is
    /// recorded as holding it (the prefix directory, the session record).
    /// A stream's observed TTFT goes to the probe when that region is the
    /// one routed to and Envoy did not retry (a retry's first byte follows
    /// a failed try: neither region's TTFT).
    pub fn on_first_byte(&mut self, shared: &RouterShared, host: &mut dyn StreamHost) {
        if std::mem::replace(&mut self.started, true) {
            return;
        }
        let (Some(routed), true) = (
            self.routed,
            self.status.is_some_and(|s| (200..300).contains(&s)),
        ) else {
            return;
        };
        let attempts = host
            .property(&ATTEMPTS_PROPERTY)
            .and_then(u64_le)
            .unwrap_or(1);
        self.served = served_region(&shared.cfg, host, routed, attempts);
        let now = host.now_ms();
        self.first_byte_ms = Some(now);
        if let (true, Some(served)) = (self.ttft, self.served) {
            host.record(
                Stat::RegionHistogram(served, RegionHistogram::TimeToFirstToken),
                now.saturating_sub(self.arrived_ms),
            );
        }
        if let (Some(served), Some(learning)) = (
            self.served,
            self.decided.as_mut().and_then(|d| d.learning.as_mut()),
        ) {
            if shared.router.learn(host, learning, served, now) > 0 {
                share_placement(shared, host, learning, served);
            }
            if self.usage.is_none() {
                // No usage to wait for: the prefill as believed.
                shared.router.note_intake(host, learning, served, None);
            }
        }
        let Some(mut p) = self.pending.take() else {
            return;
        };
        p.observation.observed_ms = now.saturating_sub(p.routed_ms) as f32;
        if attempts <= 1 && self.served == Some(routed) {
            to_probe(host, &p.observation.encode());
            // The router's own error on the region it chose: observed
            // minus the TTFT it expected there (the physical terms the
            // tuner checks; the cost's prices are not a time).
            let o = &p.observation;
            let error = f64::from(o.observed_ms) - f64::from(o.rtt_ms + o.queue_ms + o.prefill_ms);
            let (h, ms) = if error >= 0.0 {
                (RegionHistogram::TtftErrorLate, error)
            } else {
                (RegionHistogram::TtftErrorEarly, -error)
            };
            host.record(Stat::RegionHistogram(routed, h), ms.round() as u64);
        }
    }

    /// The stream ended: outcome accounting and the TTFT report.
    pub fn on_log(&mut self, shared: &RouterShared, host: &mut dyn StreamHost) {
        // An answer that ended with trailers never saw `end_of_stream` in
        // its body; a cancelled one has no usage (not counted missing).
        if self.status.is_some_and(|s| (200..300).contains(&s)) {
            self.report_usage(shared, host, false);
        }
        // The engine frees the prompt's blocks now, not at the first byte:
        // its LRU recency starts here.
        if let (Some(served), Some(learning)) = (
            self.served,
            self.decided.as_mut().and_then(|d| d.learning.as_mut()),
        ) {
            let now = host.now_ms();
            if shared.router.finish(host, learning, served, now) > 0 {
                share_placement(shared, host, learning, served);
            }
        }
        if let Some(region) = self.routed.take() {
            host.count(Stat::Region(region, RegionStat::RqActive), -1);
        }
        let Some(region) = self.sent.take() else {
            return;
        };
        if self.local {
            return;
        }
        // Ended before any response headers (the client left first): it
        // was on its way to the region.
        self.count_sent(host, region);
        // The fallback pool is other engines: its outcomes say nothing about
        // the region's own (Envoy's cluster stats show them).
        if self.fallback {
            return;
        }
        let ending = ending(&shared.cfg, host, self.status);
        let outcome = ending.outcome(region);
        self.record_duration(host, &ending, &outcome);
        if outcome.unattributed() {
            host.count(Stat::Global(Global::RouterOutcomeUnattributed), 1);
        }
        for (i, t) in outcome.charges().into_iter().flatten() {
            for (stat, n) in [
                (RegionStat::UpstreamFailure, t.failures),
                (RegionStat::UpstreamRqAnswered, t.answered),
                (RegionStat::ClientCancelled, t.cancelled),
            ] {
                if n > 0 {
                    host.count(Stat::Region(i, stat), i64::try_from(n).unwrap_or(i64::MAX));
                }
            }
        }
    }
}

impl RouterStream {
    /// The request's duration, in the region whose host served its last
    /// try: a success's, or a failure's by its `error.type`; and a
    /// successful stream's time per output token, when its usage said how
    /// many. Only requests the router decided on (not the fallback pool's).
    fn record_duration(
        &mut self,
        host: &mut dyn StreamHost,
        ending: &Ending,
        outcome: &crate::learning::outcome::Outcome,
    ) {
        let (Some(_), Some(region)) = (&self.decided, outcome.served) else {
            return;
        };
        let now = host.now_ms();
        let duration = now.saturating_sub(self.arrived_ms);
        let failed = if outcome.cancelled {
            Some(ErrorType::Cancelled)
        } else if outcome.failed && ending.flags & flags::UPSTREAM_FAILURE != 0 {
            Some(ErrorType::UpstreamFailure)
        } else if outcome.failed {
            Some(ErrorType::Upstream5xx)
        } else if !outcome.answered {
            // Neither the engine's answer nor its failure (Envoy answered
            // in its place): not the region's.
            return;
        } else if ending.status.is_some_and(|s| (400..500).contains(&s)) {
            Some(ErrorType::Upstream4xx)
        } else if ending.status.is_some_and(|s| (200..300).contains(&s)) {
            None
        } else {
            return;
        };
        let h = match failed {
            Some(e) => RegionHistogram::RequestDurationFailed(e),
            None => RegionHistogram::RequestDuration,
        };
        host.record(Stat::RegionHistogram(region, h), duration);
        if let (None, true, Some(first), Some(n)) =
            (failed, self.ttft, self.first_byte_ms, self.output_tokens)
        {
            if n > 1 {
                let us = now.saturating_sub(first).saturating_mul(1000) / (n - 1);
                host.record(
                    Stat::RegionHistogram(region, RegionHistogram::TimePerOutputToken),
                    us,
                );
            }
        }
    }
}

/// How a routed request ended, from Envoy's stream info: two property
/// reads, a third only after a retry (which region's host served it), a
/// fourth only for a 5xx without an upstream flag (whose 5xx it was).
fn ending(cfg: &Config, host: &mut dyn StreamHost, status: Option<u32>) -> Ending {
    let mut e = Ending {
        flags: host
            .property(&RESPONSE_FLAGS_PROPERTY)
            .and_then(u64_le)
            .unwrap_or(0),
        status,
        via_upstream: None,
        attempts: host
            .property(&ATTEMPTS_PROPERTY)
            .and_then(u64_le)
            .map_or(1, |n| u32::try_from(n).unwrap_or(u32::MAX)),
        host_region: None,
    };
    // Without a retry the try went to the routed region's own endpoints.
    if e.attempts > 1 {
        e.host_region = host
            .property(&HOST_REGION_PROPERTY)
            .and_then(|name| cfg.regions.iter().position(|r| r.name.as_bytes() == name));
    }
    if e.needs_details() {
        e.via_upstream = host
            .property(&CODE_DETAILS_PROPERTY)
            .map(|d| d == VIA_UPSTREAM.as_bytes());
    }
    e
}

/// The region whose host served the last try of a request routed to
/// `routed`: the one its endpoint metadata names (`llm_geo_router.region`);
/// without metadata, `routed` when there was no retry (the region's own
/// endpoints come first in its cluster), else unknown.
fn served_region(
    cfg: &Config,
    host: &mut dyn StreamHost,
    routed: usize,
    attempts: u64,
) -> Option<usize> {
    let named = host
        .property(&HOST_REGION_PROPERTY)
        .and_then(|name| cfg.regions.iter().position(|r| r.name.as_bytes() == name));
    named.or((attempts <= 1).then_some(routed))
}

/// With the exchange on, what the directory write just made goes to the
/// probe, for the deployment's other Envoys.
fn share_placement(
    shared: &RouterShared,
    host: &mut dyn StreamHost,
    learning: &mut crate::decision::pipeline::Learning,
    served: usize,
) {
    if !shared.cfg.exchange.enabled() {
        return;
    }
    if let Some((hash, at_ms, (blocks, last))) = shared.router.session_written(learning) {
        if let Ok(region) = u16::try_from(served) {
            let note =
                crate::cache::exchange::encode_note(&crate::cache::exchange::Body::Session {
                    region,
                    at_ms,
                    hash,
                    blocks,
                    last,
                });
            to_probe(host, &note);
        }
    }
    if let Some(w) = shared.router.written(learning, served) {
        let note = crate::cache::exchange::encode_note(&crate::cache::exchange::Body::Placement {
            region: w.region,
            stamp: w.stamp,
            blocks: w.end.0,
            tag: w.end.1 as u32,
            hashes: w.hashes,
        });
        to_probe(host, &note);
    }
}

/// The most bytes of a chunk read in one host call. Envoy may hand over a
/// large chunk (a buffered body): read whole, it would grow the VM's memory
/// to its size for good (a wasm memory never shrinks). A stream's chunk,
/// or a body as Envoy usually passes it (a slice at a time), is one call.
pub(super) const READ_MAX: usize = 64 * 1024;

/// Hands every byte of the chunk being passed to the usage scan.
fn scan_chunk(scan: &mut UsageScan, host: &mut dyn StreamHost, size: usize) {
    let mut at = 0;
    while at < size {
        let want = (size - at).min(READ_MAX);
        let read = host.response_body(at, want);
        if let Some(bytes) = &read {
            scan.push(bytes);
        }
        if read.as_ref().is_none_or(|b| b.len() < want) {
            // The rest of the chunk is not seen: nothing is joined across.
            scan.gap();
            return;
        }
        at += want;
    }
}

/// Hand a message to the probe; one the host dropped is counted
/// (`queue.dropped`).
fn to_probe(host: &mut dyn StreamHost, message: &[u8]) {
    if !host.enqueue(OBSERVATIONS_QUEUE, message) {
        host.count(Stat::Global(Global::QueueDropped), 1);
    }
}

/// An integer property (Envoy serialises them as 8 little-endian bytes).
fn u64_le(b: Vec<u8>) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(..8)?.try_into().ok()?))
}
