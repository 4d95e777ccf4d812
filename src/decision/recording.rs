//! What a routed request teaches, once the region whose engine served it
//! is known: the prefix and the session recorded there (`Router::learn`;
//! restamped when the answer ends, `Router::finish`), the news of it for
//! the other Envoys (`Router::written`, `Router::session_written`), this
//! Envoy's prefill for the regions whose caches are modelled
//! (`Router::note_intake`), and the reports on the decision: what it
//! believed a region held against the engine's `usage`
//! (`Routed::usage_report`), what it predicted against the observed TTFT
//! (`Routed::observation`).

use crate::cache::directory::RecentIntake;
use crate::decision::pipeline::{Learning, Routed, Router};
use crate::learning::tuning::Observation;
use crate::shared::store::SharedStore;

/// What the directory believed a region held, in the router's unit
/// (canonical bytes), and how old that belief was.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Belief {
    pub routed_ms: u64,
    pub prompt_bytes: u64,
    /// Bytes of the prompt believed held there (within its cache horizon).
    pub believed_bytes: u64,
    /// When that was last served there: the oldest stamp of its directory
    /// entries read as held (or the session record that credited it).
    pub held_ms: Option<u64>,
    /// The newest stamp of an entry there that its horizon set aside.
    pub cut_ms: Option<u64>,
    pub model: Option<String>,
}

impl Learning {
    /// What the decision believed `region` held.
    pub fn belief(&self, region: usize) -> Belief {
        let held_ms = match self.session_credit {
            Some((r, at_ms)) if r == region => Some(at_ms),
            _ => self.lookup.oldest_hit_ms(region),
        };
        Belief {
            routed_ms: self.routed_ms,
            prompt_bytes: self.prompt_bytes,
            believed_bytes: u64::from(self.lookup.cached_blocks.get(region).copied().unwrap_or(0))
                * self.block_bytes,
            held_ms,
            cut_ms: self.lookup.cut_ms(region),
            model: self.model.clone(),
        }
    }
}

impl Routed {
    /// The report for the probe once the engine's `usage` is known, for the
    /// region whose engine gave it (`served`), against what the decision
    /// believed that region held.
    pub fn usage_report(
        &self,
        usage: crate::learning::usage::Usage,
        served: usize,
    ) -> Option<crate::learning::usage::UsageReport> {
        let learning = self.learning.as_ref().filter(|l| !l.history_unseen)?;
        let b = learning.belief(served);
        let clamp = |v: u64| u32::try_from(v).unwrap_or(u32::MAX - 1);
        Some(crate::learning::usage::UsageReport {
            region: u16::try_from(served).ok()?,
            routed_ms: b.routed_ms,
            prompt_bytes: clamp(b.prompt_bytes),
            believed_bytes: clamp(b.believed_bytes),
            held_ms: b.held_ms.unwrap_or(0),
            cut_ms: b.cut_ms.unwrap_or(0),
            served_ms: learning.served_ms,
            prompt_tokens: clamp(usage.prompt_tokens),
            cached_tokens: usage.cached_tokens.map(clamp),
            model: b.model,
        })
    }

    /// The terms predicted for the chosen region, unweighted, for tuning;
    /// `observed_ms` is filled in when the first byte arrives.
    pub fn observation(&self) -> Option<Observation> {
        if self.learning.as_ref().is_some_and(|l| l.history_unseen) {
            return None;
        }
        let d = &self.decision;
        let c = d.costs.get(d.region)?;
        Some(Observation {
            region: u16::try_from(d.region).ok()?,
            rtt_ms: c.rtt_ms as f32,
            queue_ms: c.wait_ms as f32,
            uncached_tokens: u32::try_from(c.prompt_tokens.saturating_sub(c.cached_tokens))
                .unwrap_or(u32::MAX),
            prefill_ms: c.prefill_ms as f32,
            observed_ms: 0.0,
        })
    }
}

impl Router {
    /// The answer to a routed request has started, from `served`'s engine
    /// (the region whose host served the last try): it now holds the
    /// prompt. Records the prefix and the session there, once; returns the
    /// shared-data calls made.
    pub fn learn(
        &self,
        store: &mut dyn SharedStore,
        learning: &mut Learning,
        served: usize,
        now_ms: u64,
    ) -> u32 {
        if std::mem::replace(&mut learning.recorded, true) {
            return 0;
        }
        learning.served_ms = now_ms;
        let mut calls = self.dir.record(
            store,
            &mut learning.lookup,
            &learning.checkpoints,
            served,
            now_ms,
            learning.prefix,
        );
        if let Some(s) = learning.session {
            let n = self
                .sessions
                .record(store, s, served, now_ms, learning.prefix);
            learning.session_written = n > 0;
            calls += n;
        }
        calls
    }

    /// The answer at `served` ended: where its cache is modelled, the
    /// prompt's chain is restamped now, since an engine frees a request's
    /// blocks (and starts their LRU recency) when it ends, and its decode
    /// pinned them until then; aged from the first byte, a long answer's
    /// prefix was believed evicted by intake it was safe from. Once;
    /// returns the calls made.
    pub fn finish(
        &self,
        store: &mut dyn SharedStore,
        learning: &mut Learning,
        served: usize,
        now_ms: u64,
    ) -> u32 {
        if !learning.modelled
            || !learning.recorded
            || learning.served_ms == 0
            || now_ms <= learning.served_ms
            || std::mem::replace(&mut learning.finished, true)
        {
            return 0;
        }
        learning.lookup.refresh_all(served);
        learning.finished_ms = now_ms;
        self.dir.record(
            store,
            &mut learning.lookup,
            &learning.checkpoints,
            served,
            now_ms,
            learning.prefix,
        )
    }

    /// The session record `learn` wrote, as news for the other Envoys:
    /// (session hash, stamp, prompt end). Once.
    pub fn session_written(&self, learning: &mut Learning) -> Option<(u64, u64, (u32, u64))> {
        if !std::mem::replace(&mut learning.session_written, false) {
            return None;
        }
        let s = learning.session?;
        Some((s.hash, learning.served_ms, learning.prefix))
    }

    /// What the last `learn` or `finish` wrote at `served`, as news for
    /// the other Envoys of the deployment (the exchange): the checkpoints
    /// written, their stamp and the prompt's end. `None` when nothing was
    /// written.
    pub fn written(&self, learning: &Learning, served: usize) -> Option<Written> {
        let hashes: Vec<u64> = learning
            .checkpoints
            .get(learning.lookup.written_from..)?
            .iter()
            .map(|c| c.hash)
            .collect();
        let stamp = if learning.finished {
            learning.finished_ms
        } else {
            learning.served_ms
        };
        if hashes.is_empty() || stamp == 0 {
            return None;
        }
        Some(Written {
            region: u16::try_from(served).ok()?,
            stamp,
            end: learning.prefix,
            hashes,
        })
    }

    /// This Envoy's prefill of the prompt at `served` (recorded by
    /// `learn`), for the regions whose caches are modelled: the engine's
    /// own count where the answer reported it (`usage`), else the prompt
    /// less what was believed held there. Once; returns the calls made.
    pub fn note_intake(
        &self,
        store: &mut dyn SharedStore,
        learning: &mut Learning,
        served: usize,
        usage: Option<crate::learning::usage::Usage>,
    ) -> u32 {
        if !learning.modelled
            || learning.served_ms == 0
            || std::mem::replace(&mut learning.intake_noted, true)
        {
            return 0;
        }
        // What the engine's cache took in: the prompt it prefilled and the
        // answer it generated (`Fleet::on_engine_clock`).
        let tokens = match usage {
            Some(crate::learning::usage::Usage {
                prompt_tokens,
                cached_tokens: Some(c),
                completion_tokens,
            }) => prompt_tokens
                .saturating_sub(c)
                .saturating_add(completion_tokens.unwrap_or(0)) as f64,
            _ => {
                let b = learning.belief(served);
                b.prompt_bytes.saturating_sub(b.believed_bytes) as f64 * learning.tokens_per_byte
            }
        };
        let Ok(region) = u16::try_from(served) else {
            return 0;
        };
        let tokens = tokens.round().clamp(0.0, f64::from(u32::MAX)) as u32;
        RecentIntake::note(
            store,
            region,
            learning.routed_ms,
            learning.served_ms,
            tokens,
        )
    }
}

/// The directory entries one write stamped: `region` holds each
/// checkpoint of `hashes` as of `stamp`, as part of a prompt ending at
/// `end` (blocks, last block's hash).
#[derive(Debug, Clone, PartialEq)]
pub struct Written {
    pub region: u16,
    pub stamp: u64,
    pub end: (u32, u64),
    pub hashes: Vec<u64>,
}

#[cfg(test)]
mod tests {
    use crate::decision::pipeline::tests::{body, cfg, snap};
    use crate::decision::pipeline::{RouteInputs, Router};
    use crate::request::openai::Endpoint;
    use crate::shared::store::MemoryStore;

    #[test]
    fn what_a_request_teaches_goes_to_the_region_that_served_it() {
        let c = cfg();
        let s = snap(&c);
        let router = Router::new(&c);
        let mut store = MemoryStore::default();
        let system = "a long shared document for the whole conversation. ".repeat(200);
        let b = body(&system, 0);
        let mut inp = RouteInputs {
            endpoint: Endpoint::ChatCompletions,
            body: &b,
            session_header: Some("s1"),
            residency: None,
            snapshot: Some(&s),
            snapshot_index: &[Some(0), Some(1)],
            inflight: &[0.0, 0.0],
            now_ms: 1000,
            fallback: false,
        };
        let cached = |store: &mut MemoryStore, at: u64| {
            let b = body(&system, 9);
            let inp = RouteInputs {
                body: &b,
                session_header: None,
                now_ms: at,
                ..inp
            };
            let r = router.route(&c, store, &inp).unwrap();
            r.decision
                .costs
                .iter()
                .map(|c| c.cached_tokens)
                .collect::<Vec<_>>()
        };
        // Routed to near (closest), never answered (refused, failed):
        // nobody is believed to hold it.
        let first = router.route(&c, &mut store, &inp).unwrap();
        assert_eq!(first.decision.region, 0);
        assert_eq!(cached(&mut store, 2000), vec![0, 0]);
        // Routed to near, retried by Envoy and answered by mid: mid holds
        // it, near does not.
        inp.now_ms = 3000;
        let mut second = router.route(&c, &mut store, &inp).unwrap();
        assert_eq!(second.decision.region, 0);
        let learning = second.learning.as_mut().unwrap();
        router.learn(&mut store, learning, 1, 3500);
        let held = cached(&mut store, 4000);
        assert_eq!(held[0], 0, "{held:?}");
        assert!(held[1] > 1000, "{held:?}");
        // The session record names mid too, and the usage report is mid's,
        // against what was believed of mid (nothing, at decision time).
        inp.now_ms = 5000;
        let third = router.route(&c, &mut store, &inp).unwrap();
        assert_eq!(third.decision.region, 1, "the conversation follows mid");
        let usage = crate::learning::usage::Usage {
            prompt_tokens: 3000,
            cached_tokens: Some(0),
            completion_tokens: None,
        };
        let report = second.usage_report(usage, 1).unwrap();
        assert_eq!((report.region, report.believed_bytes), (1, 0));
        // The fallback pool's engines are other ones: nothing to learn.
        inp.fallback = true;
        let pooled = router.route(&c, &mut store, &inp).unwrap();
        assert!(pooled.learning.is_none());
        assert!(pooled.usage_report(usage, 1).is_none());
    }
}
