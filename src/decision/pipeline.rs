//! One routing decision, end to end, over explicit inputs: parse the body,
//! hash the prompt, look up the prefix directory and the session record,
//! decide, decide migration (`Router::route`); then, once the answer has
//! started and the region whose host served it is known, record the prefix
//! and the session there (`Router::learn`). Nothing is recorded at decision
//! time: a request retried elsewhere, refused by its engine or failed never
//! tells a region that it holds the prompt. The `router` filter, the
//! `explain` CLI, the simulator and the benchmarks all run these same
//! functions; only the host layer gathers their inputs from Envoy.
//!
//! Around it, apart: where a request goes whose body is not read
//! (`placement`), the decision header (`header`), and what a served
//! request teaches (`recording`).

use crate::cache::directory::{Directory, Keep, Lookup, Lru, RecentIntake, Retention};
use crate::cache::sessions::{SessionEntry, Sessions};
use crate::cache::stored_responses::ResponseMap;
use crate::config::{Config, HolderUnavailable};
use crate::decision::choice;
use crate::decision::cost::{self, Decision};
use crate::decision::inputs::Inputs;
use crate::decision::migration::{self, KvAction};
use crate::fleet::snapshot::Snapshot;
use crate::fleet::tokens;
use crate::request::limits::{self, EngineRefusal, Exceeded};
use crate::request::openai::{self, Endpoint, RequestError};
use crate::request::prefix::{Checkpoint, PromptHasher};
use crate::shared::store::SharedStore;

/// The per-configuration parts of routing.
#[derive(Debug, Clone, Copy)]
pub struct Router {
    pub dir: Directory,
    pub sessions: Sessions,
    pub responses: ResponseMap,
}

/// What the host knows about one request besides its body.
#[derive(Debug, Clone, Copy)]
pub struct RouteInputs<'a> {
    pub endpoint: Endpoint,
    pub body: &'a [u8],
    /// The session header's value, if sent.
    pub session_header: Option<&'a str>,
    /// The residency header's value, if configured and sent.
    pub residency: Option<&'a str>,
    /// A fresh snapshot, if any, and each configured region's index in it.
    pub snapshot: Option<&'a Snapshot>,
    pub snapshot_index: &'a [Option<usize>],
    /// Per configured region: this Envoy's in-flight requests.
    pub inflight: &'a [f64],
    pub now_ms: u64,
    /// The guard sent the request to the fallback pool: another engine, so
    /// neither the prefix directory nor the session record learn from it.
    pub fallback: bool,
}

/// A routed request.
#[derive(Debug, Clone, PartialEq)]
pub struct Routed {
    pub decision: Decision,
    pub kv: Option<KvAction>,
    pub stream: bool,
    /// A stream that ends with a usage chunk because its request asked
    /// (`stream_options.include_usage`; every Responses API stream).
    pub stream_usage: bool,
    pub prompt_tokens: u64,
    /// Shared-data calls this decision made (reads; the writes come with
    /// `Router::learn`).
    pub shared_data_calls: u32,
    /// What the directory and the session record learn once the serving
    /// region is known; `None` for the fallback pool, whose engines are
    /// other ones.
    pub learning: Option<Learning>,
    /// The request names a stored response this Envoy has no record of.
    pub unknown_response: bool,
    /// A Responses API request whose answer the engine stores (`store`):
    /// its id is to be recorded.
    pub store_response: bool,
}

/// The lookups a decision made, kept until the region that served the
/// request is known: then that region is recorded as holding the prompt,
/// and its belief checked against the engine's `usage`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Learning {
    pub(super) checkpoints: Vec<Checkpoint>,
    pub(super) lookup: Lookup,
    pub(super) session: Option<SessionEntry>,
    /// The prompt as the session record names it: blocks, last block's hash.
    pub(super) prefix: (u32, u64),
    /// The region the session record credited with the whole previous
    /// prompt, and when it served it.
    pub(super) session_credit: Option<(usize, u64)>,
    pub(super) block_bytes: u64,
    pub(super) routed_ms: u64,
    pub(super) prompt_bytes: u64,
    pub(super) model: Option<String>,
    /// Recorded already (`Router::learn` writes once).
    pub(super) recorded: bool,
    /// When it was recorded (the answer's first bytes); 0: not yet.
    pub(super) served_ms: u64,
    /// Engine tokens per byte the decision used, and whether some region's
    /// cache is modelled (its prefills then go to `RecentIntake`).
    pub(super) tokens_per_byte: f64,
    pub(super) modelled: bool,
    /// The request continues a stored response (`previous_response_id`):
    /// the engine prefills a history the router never saw, so its usage
    /// and time to first token say nothing about this prompt's bytes or
    /// what the directory believed, and are not reported for learning.
    pub(super) history_unseen: bool,
    /// Noted in `RecentIntake` already.
    pub(super) intake_noted: bool,
    /// Restamped at the answer's end already (`Router::finish`).
    pub(super) finished: bool,
    /// When `finish` restamped the chain.
    pub(super) finished_ms: u64,
    /// `learn` wrote the session record.
    pub(super) session_written: bool,
}

/// Why a request is not routed.
#[derive(Debug, Clone, PartialEq)]
pub enum Refusal {
    /// Not a valid request: 400 (or pass-through, per configuration).
    Invalid(RequestError),
    /// The residency value is not allow-listed: always 400.
    UnknownResidency(String),
    /// Every allowed region's engine is sure to refuse the output the
    /// request asks for (`limits::refuses_output`): 400 as the engine of
    /// the region with the largest limit answers it.
    ContextLength {
        refusal: EngineRefusal,
        exceeded: Exceeded,
    },
    /// The stored response the request continues (`previous_response_id`)
    /// is held by a region that cannot take it now, and the configuration
    /// says not to reroute (`responses.holder_unavailable`): 503.
    HolderUnavailable(String),
}

/// The residency pin's mask for the header's value, if one was sent; an
/// unknown value is refused rather than routed somewhere it may not go.
pub(super) fn residency(cfg: &Config, value: Option<&str>) -> Result<Option<Vec<bool>>, Refusal> {
    let Some(value) = value else {
        return Ok(None);
    };
    match cfg.residency_mask(value) {
        Some(mask) => Ok(Some(mask)),
        None => {
            let known: Vec<&str> = cfg.residency.allowed.keys().map(String::as_str).collect();
            Err(Refusal::UnknownResidency(format!(
                "unknown data residency {value:?}; known: {}",
                known.join(", ")
            )))
        }
    }
}

impl Router {
    pub fn new(cfg: &Config) -> Router {
        Router {
            dir: Directory::new(cfg),
            sessions: Sessions::new(cfg),
            responses: ResponseMap::new(cfg),
        }
    }

    pub fn route(
        &self,
        cfg: &Config,
        store: &mut dyn SharedStore,
        inp: &RouteInputs,
    ) -> Result<Routed, Refusal> {
        let allowed = residency(cfg, inp.residency)?;
        let hasher = PromptHasher::new(cfg.prefix.block_bytes, cfg.prefix.hash_seed)
            .reserve_for(inp.body.len());
        let req = openai::parse(inp.endpoint, inp.body, hasher).map_err(Refusal::Invalid)?;
        // A region whose engine does not list the model would answer 404:
        // not a candidate while another lists it (the fallback pool is
        // other engines, whose lists the probe does not read).
        let allowed = match inp.snapshot.filter(|_| !inp.fallback) {
            Some(s) => limits::serving(cfg, req.model.as_deref(), s, inp.snapshot_index, allowed),
            None => allowed,
        };
        // The regions' context limits, before any shared-data call. The
        // fallback pool is other engines, whose limits the probe does not
        // read: unchecked, as a region whose limit is unknown.
        let limits = match inp.snapshot.filter(|_| !inp.fallback) {
            Some(s) => limits::check(cfg, &req, s, inp.snapshot_index, allowed.as_deref()),
            None => limits::Check::ALL_FIT,
        };
        if let Some(exceeded) = limits.exceeded {
            let engine = cfg
                .regions
                .get(exceeded.region)
                .map_or(crate::engines::metrics::EngineKind::Vllm, |r| r.engine);
            let state = inp
                .snapshot
                .and_then(|s| s.region_at(inp.snapshot_index, exceeded.region));
            return Err(Refusal::ContextLength {
                refusal: limits::refusal(
                    engine,
                    &exceeded,
                    limits::output_param(inp.endpoint, &req),
                    limits::prompt_tokens(&req, state),
                ),
                exceeded,
            });
        }
        let now = inp.now_ms;
        let mut calls = 0;
        // A stored response lives where it was produced (not through the
        // fallback pool, whose engines are other ones).
        let holder = match req.previous_response_id.as_deref() {
            Some(id) if !inp.fallback => {
                calls += 1;
                let name = self.responses.lookup(store, id, now);
                Some((
                    id,
                    name.and_then(|n| cfg.regions.iter().position(|r| r.name == n))
                        .filter(|&h| keeps_responses(inp.snapshot, inp.snapshot_index, h)),
                ))
            }
            _ => None,
        };
        // Each region's entries are believed as far as its engine is
        // believed to keep them: its LRU cache where its capacity is known,
        // else the learnt horizon, else the TTL (and no per-request vector).
        let model = req.model.as_deref();
        // Each modelled region's intake clock, with this Envoy's prefills.
        let modelled = inp
            .snapshot
            .is_some_and(|s| s.regions.iter().any(|r| r.cache_free_tokens.is_some()));
        let clocks: Vec<Vec<(u64, f64)>> = match inp.snapshot.filter(|_| modelled) {
            Some(snap) => {
                calls += 1;
                let (ring, _) = RecentIntake::read(store);
                (0..cfg.regions.len())
                    .map(|i| match snap.region_at(inp.snapshot_index, i) {
                        Some(r) if r.cache_free_tokens.is_some() => ring.merged(i, &r.cache_clock),
                        _ => Vec::new(),
                    })
                    .collect()
            }
            None => Vec::new(),
        };
        // Nothing stamped before a region's engine last restarted, whatever
        // the rule.
        let keep: Vec<Retention> = match inp.snapshot {
            Some(snap)
                if snap.regions.iter().any(|r| {
                    r.cache_free_tokens.is_some()
                        || r.cache_horizon_ms.is_some()
                        || r.cache_reset_ms.is_some()
                }) =>
            {
                let block_bytes = f64::from(cfg.prefix.block_bytes);
                (0..cfg.regions.len())
                    .map(|i| match snap.region_at(inp.snapshot_index, i) {
                        Some(st) => Retention {
                            keep: match (st.cache_free_tokens, st.cache_horizon_ms) {
                                (Some(free), _) => Keep::Lru(Lru {
                                    free_tokens: free,
                                    tokens_per_block: tokens::tokens_per_byte(Some(st), model)
                                        * block_bytes,
                                    clock: clocks.get(i).map_or(&[], Vec::as_slice),
                                }),
                                (None, Some(h)) => Keep::Horizon(h),
                                (None, None) => Keep::Ttl,
                            },
                            since_ms: st.cache_reset_ms.unwrap_or(0),
                        },
                        None => Retention::default(),
                    })
                    .collect()
            }
            _ => Vec::new(),
        };
        let mut lookup = self
            .dir
            .lookup_within(store, &req.prompt.checkpoints, now, &keep);
        self.dir.extend(
            &mut lookup,
            &req.prompt.checkpoints,
            |i| req.prompt.block_hash(i),
            now,
            &keep,
        );
        let session_key = inp.session_header.or(req.user.as_deref());
        let session = session_key.map(|k| {
            calls += 1;
            self.sessions.lookup(store, k, now)
        });
        // The region that served the session's previous prompt holds all of
        // it (and its output): credit it exactly when this prompt extends it,
        // not only to the directory's last checkpoint.
        // Within the region's cache horizon and since its engine last
        // restarted, as the directory's entries.
        let mut session_credit: Option<(usize, u64)> = None;
        if let Some(s) = session {
            if let (Some((region, at_ms)), Some((blocks, hash))) = (s.last, s.prefix) {
                let extends = blocks
                    .checked_sub(1)
                    .and_then(|i| req.prompt.block_hash(i as usize))
                    .is_some_and(|h| h == hash);
                let within = keep.get(region).is_none_or(|k| k.holds(at_ms, blocks, now));
                if let Some(b) = lookup
                    .cached_blocks
                    .get_mut(region)
                    .filter(|b| extends && within && **b < blocks)
                {
                    *b = blocks;
                    session_credit = Some((region, at_ms));
                }
            }
        }
        // Short prompts have no full block: the session key keeps a
        // conversation's first turns together.
        let first_block = req.prompt.first_block.or(session.map(|s| s.hash));
        let fleet_tpb = tokens::fleet_tokens_per_byte(inp.snapshot, model);
        let prompt_tokens = tokens::tokens_of(req.prompt.bytes, fleet_tpb);
        let mut decision = cost_decision(
            cfg,
            inp.snapshot,
            inp.snapshot_index,
            inp.inflight,
            inp.now_ms,
            &Prompt {
                cached_blocks: &lookup.cached_blocks,
                clocks: &clocks,
                tokens: prompt_tokens,
                bytes: req.prompt.bytes,
                tokens_per_byte: fleet_tpb,
                model,
                first_block,
                allowed: allowed.as_deref(),
                fits: limits.fits,
            },
        );
        let mut unknown_response = false;
        match holder {
            Some((_, None)) => unknown_response = true,
            Some((id, Some(h))) => match holder_unavailable(
                &decision,
                h,
                allowed.as_deref(),
                inp.snapshot,
                inp.snapshot_index,
            ) {
                None => {
                    // Neither the load guard nor the ramp moves a
                    // conversation away from its stored state.
                    // The region the cost chose, if not the holder, is the
                    // cheapest other: the runner-up.
                    let chosen = std::mem::replace(&mut decision.region, h);
                    decision.reason = cost::Reason::Response;
                    decision.passed_over = None;
                    if decision.runner_up == Some(h) {
                        decision.runner_up = (chosen != h).then_some(chosen);
                    }
                }
                Some(why) if cfg.responses.holder_unavailable == HolderUnavailable::Reject => {
                    return Err(stored_where_unavailable(
                        cfg,
                        id,
                        h,
                        why,
                        "named by previous_response_id is stored",
                        "it cannot be continued in another region. Retry later, or start a \
                         new conversation without previous_response_id.",
                    ));
                }
                Some(_) => {}
            },
            None => {}
        }
        let kv = migration_for(cfg, &decision, inp);
        let lookup_calls = lookup.calls;
        let learning = (!inp.fallback).then(|| Learning {
            checkpoints: req.prompt.checkpoints,
            lookup,
            session,
            prefix: (req.prompt.blocks, req.prompt.last_block.unwrap_or(0)),
            session_credit,
            block_bytes: u64::from(cfg.prefix.block_bytes),
            routed_ms: now,
            prompt_bytes: req.prompt.bytes,
            model: req.model,
            recorded: false,
            served_ms: 0,
            tokens_per_byte: fleet_tpb,
            modelled,
            history_unseen: req.previous_response_id.is_some(),
            intake_noted: false,
            finished: false,
            finished_ms: 0,
            session_written: false,
        });
        Ok(Routed {
            decision,
            kv,
            stream: req.stream,
            stream_usage: req.stream && (req.include_usage || inp.endpoint == Endpoint::Responses),
            prompt_tokens,
            shared_data_calls: lookup_calls + calls,
            learning,
            unknown_response,
            store_response: inp.endpoint == Endpoint::Responses && req.store,
        })
    }
}

/// What the cost reads of a request besides the fleet: its prompt, and
/// where it may go.
pub(super) struct Prompt<'a> {
    /// Per configured region: blocks of the prompt it holds.
    pub cached_blocks: &'a [u32],
    /// Per configured region: its engine's intake clock, with this
    /// Envoy's prefills (empty: not modelled).
    pub clocks: &'a [Vec<(u64, f64)>],
    /// Its tokens, estimated fleet-wide at `tokens_per_byte`.
    pub tokens: u64,
    /// Bytes of canonical prompt text.
    pub bytes: u64,
    pub tokens_per_byte: f64,
    pub model: Option<&'a str>,
    /// Rendezvous key for ties.
    pub first_block: Option<u64>,
    /// The residency pin (and the regions serving the model), if any.
    pub allowed: Option<&'a [bool]>,
    /// Per configured region (bit i): whether the request fits its context
    /// limit.
    pub fits: u64,
}

impl<'a> Prompt<'a> {
    /// A request whose body is not read: no prompt, no model, and every
    /// region able to take it by its context limit.
    pub(super) fn unread(allowed: Option<&'a [bool]>) -> Self {
        Prompt {
            cached_blocks: &[],
            clocks: &[],
            tokens: 0,
            bytes: 0,
            tokens_per_byte: tokens::PRIOR_TOKENS_PER_BYTE,
            model: None,
            first_block: None,
            allowed,
            fits: limits::Check::ALL_FIT.fits,
        }
    }
}

/// The cost's decision for `prompt` over the host's view of the fleet.
/// `route` and `place` both decide through it.
pub(super) fn cost_decision(
    cfg: &Config,
    snapshot: Option<&Snapshot>,
    snapshot_index: &[Option<usize>],
    inflight: &[f64],
    now_ms: u64,
    prompt: &Prompt,
) -> Decision {
    choice::decide(&Inputs {
        config: cfg,
        snapshot,
        snapshot_index,
        cached_blocks: prompt.cached_blocks,
        clocks: prompt.clocks,
        inflight,
        prompt_tokens: prompt.tokens,
        prompt_bytes: prompt.bytes,
        tokens_per_byte: prompt.tokens_per_byte,
        model: prompt.model,
        first_block: prompt.first_block,
        allowed: prompt.allowed,
        fits: prompt.fits,
        now_ms,
    })
}

/// The refusal of a request for stored response `id` whose region `h`
/// cannot take it (`why`), with what the client can do (`then`).
pub(super) fn stored_where_unavailable(
    cfg: &Config,
    id: &str,
    h: usize,
    why: &str,
    what: &str,
    then: &str,
) -> Refusal {
    let name = cfg.regions.get(h).map_or("?", |r| r.name.as_str());
    Refusal::HolderUnavailable(format!(
        "The response '{id}' {what} in region '{name}', which cannot take requests now \
         ({why}); {then}"
    ))
}

/// Why region `h`, which holds a stored response, cannot take the request
/// that continues it; `None` when it can. Only what makes the region unable
/// to serve counts (health, passive ejection, release parity, the
/// residency pin, its context limit); load and the failback ramp do not.
/// Whether region `h`'s engine may hold a response recorded there: not
/// when the probe found it keeps none (vLLM without its Responses store);
/// a record there names a response that exists nowhere, so the request is
/// routed as any other and an engine answers that it does not know it.
pub(super) fn keeps_responses(
    snapshot: Option<&Snapshot>,
    index: &[Option<usize>],
    h: usize,
) -> bool {
    snapshot
        .and_then(|s| s.region_at(index, h))
        .and_then(|r| r.stores_responses)
        != Some(false)
}

pub(super) fn holder_unavailable(
    d: &Decision,
    h: usize,
    allowed: Option<&[bool]>,
    snapshot: Option<&Snapshot>,
    index: &[Option<usize>],
) -> Option<&'static str> {
    if allowed.is_some_and(|a| !a.get(h).copied().unwrap_or(false)) {
        return Some("outside the request's data residency, or not serving its model");
    }
    // No snapshot: nothing is known against it, as for routing.
    let c = d.costs.get(h)?;
    // A holder whose health probes only went unanswered (a vLLM decoding
    // on few cores answers `/health` late) is still sent the follow-up:
    // it is the one place that can answer it, where a 503 here is certain.
    // An engine that answers it is down, one ejected for failing
    // requests, or one on another release (restarted: the response is
    // gone) is not.
    let silent = snapshot
        .and_then(|s| s.region_at(index, h))
        .is_some_and(|r| r.unanswered && r.release_ok);
    if !c.healthy && !silent {
        return Some("unhealthy, ejected or on another release");
    }
    if c.over_context {
        return Some("the request exceeds its context limit");
    }
    None
}

/// The fetch-or-recompute decision when the request leaves the region that
/// holds its prefix (a pin, the load bound or the queue moved it).
fn migration_for(cfg: &Config, d: &Decision, inp: &RouteInputs) -> Option<KvAction> {
    if !cfg.migration.enabled {
        return None;
    }
    let state = |i: usize| {
        inp.snapshot
            .and_then(|s| s.region_at(inp.snapshot_index, i))
    };
    let rtt: Vec<f64> = cfg
        .regions
        .iter()
        .enumerate()
        .map(|(i, r)| state(i).and_then(|s| s.rtt_ms).unwrap_or(r.rtt_ms))
        .collect();
    let util: Vec<f64> = cfg
        .regions
        .iter()
        .zip(&d.costs)
        .enumerate()
        .map(|(i, (r, c))| {
            let slots = state(i).map_or(r.max_concurrency.max(1), |s| s.slots(r.max_concurrency));
            c.occupancy / f64::from(slots)
        })
        .collect();
    kv_action(cfg, d, &rtt, &util)
}

/// The migration decision for a routing decision, if one is due: the chosen
/// region holds at least `min_prefix_tokens` fewer cached tokens than the
/// best-holding healthy region. `rtt_ms` is each region's RTT from this
/// proxy; `utilization` each region's compute-queue utilisation.
fn kv_action(cfg: &Config, d: &Decision, rtt_ms: &[f64], utilization: &[f64]) -> Option<KvAction> {
    let m = &cfg.migration;
    let model = m.model.as_ref().filter(|_| m.enabled)?;
    let chosen = d.costs.get(d.region)?;
    let (from, holder) = d
        .costs
        .iter()
        .enumerate()
        // The holder may be outside a residency pin: it is only read from.
        .filter(|(i, c)| *i != d.region && c.healthy)
        .max_by_key(|(_, c)| c.cached_tokens)?;
    let tokens = holder.cached_tokens.saturating_sub(chosen.cached_tokens);
    if tokens < m.min_prefix_tokens.max(1) {
        return None;
    }
    let (to_name, from_name) = (
        cfg.regions.get(d.region)?.name.as_str(),
        cfg.regions.get(from)?.name.as_str(),
    );
    let link = m.links.iter().find(|l| {
        (l.from == from_name && l.to == to_name) || (l.from == to_name && l.to == from_name)
    });
    let link_rtt = link.and_then(|l| l.rtt_ms).unwrap_or_else(|| {
        rtt_ms.get(from).copied().unwrap_or(0.0) + rtt_ms.get(d.region).copied().unwrap_or(0.0)
    });
    let gbps = link
        .and_then(|l| l.bandwidth_gbps)
        .unwrap_or(m.bandwidth_gbps);
    let util = utilization.get(d.region).copied().unwrap_or(0.0);
    let plan = migration::decide(
        model,
        tokens,
        link_rtt,
        gbps,
        m.fetch_path_utilization,
        util,
        m.service_rate_per_s,
    );
    Some(KvAction { plan, from, tokens })
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::decision::cost::Reason;
    use crate::shared::openai_error::Code;
    use crate::shared::store::MemoryStore;

    pub(crate) fn cfg() -> Config {
        Config::parse(
            br#"{"regions":[
              {"name":"near","cluster":"cn","capacity_rps":5,"rtt_ms":5,"max_concurrency":8,"prefill_ms_per_token":0.2},
              {"name":"mid","cluster":"cm","capacity_rps":5,"rtt_ms":40,"max_concurrency":8,"prefill_ms_per_token":0.2}],
              "residency":{"header":"x-r","allowed":{"eu":["mid"]}}}"#,
        )
        .unwrap()
    }

    pub(crate) fn snap(c: &Config) -> Snapshot {
        Snapshot::all_healthy(c)
    }

    #[test]
    fn a_stored_response_whose_region_is_unavailable_is_refused_in_one_wording() {
        let c = cfg();
        let text = |r: Refusal| match r {
            Refusal::HolderUnavailable(m) => m,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            text(stored_where_unavailable(
                &c,
                "resp_1",
                1,
                "unhealthy",
                "is stored",
                "no other region has it. Retry later."
            )),
            "The response 'resp_1' is stored in region 'mid', which cannot take requests now \
             (unhealthy); no other region has it. Retry later."
        );
        assert_eq!(
            text(stored_where_unavailable(
                &c,
                "resp_2",
                0,
                "ejected",
                "named by previous_response_id is stored",
                "it cannot be continued in another region. Retry later, or start a new \
                 conversation without previous_response_id."
            )),
            "The response 'resp_2' named by previous_response_id is stored in region 'near', \
             which cannot take requests now (ejected); it cannot be continued in another \
             region. Retry later, or start a new conversation without previous_response_id."
        );
    }

    pub(crate) fn body(system: &str, turn: usize) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": format!("turn {turn}")}],
            "stream": true
        }))
        .unwrap()
    }

    #[test]
    fn a_conversation_follows_its_prefix_and_the_pin_refuses_unknown_values() {
        let c = cfg();
        let s = snap(&c);
        let router = Router::new(&c);
        let mut store = MemoryStore::default();
        let system = "you are a helpful assistant. ".repeat(300);
        let b = body(&system, 0);
        let mut inp = RouteInputs {
            endpoint: Endpoint::ChatCompletions,
            body: &b,
            session_header: Some("s1"),
            residency: Some("eu"),
            snapshot: Some(&s),
            snapshot_index: &[Some(0), Some(1)],
            inflight: &[0.0, 0.0],
            now_ms: 1000,
            fallback: false,
        };
        let mut first = router.route(&c, &mut store, &inp).unwrap();
        assert_eq!(
            (first.decision.region, first.decision.reason),
            (1, Reason::Pin)
        );
        assert!(first.stream);
        assert!(first.observation().is_some());
        assert!(store.map.is_empty(), "nothing recorded before the answer");
        let learning = first.learning.as_mut().unwrap();
        assert!(router.learn(&mut store, learning, 1, 1500) > 0);
        assert_eq!(router.learn(&mut store, learning, 1, 1500), 0, "once");
        let b2 = body(&system, 1);
        inp.body = &b2;
        inp.residency = None;
        inp.now_ms = 2000;
        let second = router.route(&c, &mut store, &inp).unwrap();
        assert_eq!(
            (second.decision.region, second.decision.reason),
            (1, Reason::Cache)
        );
        assert!(
            second.shared_data_calls <= 2 * 9 + 4,
            "{}",
            second.shared_data_calls
        );
        let text = second.describe(&c, 0);
        assert!(
            text.starts_with("region=mid; reason=cache; ttft_ms="),
            "{text}"
        );
        // Each term in ms, and they add up to the expected TTFT.
        let term = |name: &str| -> f64 {
            text.split("; ")
                .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("no {name} in {text}"))
        };
        let terms = ["rtt_ms", "prefill_ms", "wait_ms", "load_ms"].map(term);
        assert!(
            (terms.iter().sum::<f64>() - term("ttft_ms")).abs() <= 0.2,
            "{text}"
        );
        // Refused before any shared-data call: nothing read or written.
        let calls = |store: &MemoryStore| (store.gets, store.sets);
        let before = calls(&store);
        inp.residency = Some("mars");
        assert!(matches!(
            router.route(&c, &mut store, &inp),
            Err(Refusal::UnknownResidency(_))
        ));
        assert_eq!(
            calls(&store),
            before,
            "(reads, writes) for an unknown residency"
        );
        inp.residency = None;
        inp.body = b"{";
        assert!(matches!(
            router.route(&c, &mut store, &inp),
            Err(Refusal::Invalid(_))
        ));
        assert_eq!(calls(&store), before, "(reads, writes) for an invalid body");
    }

    #[test]
    fn an_output_no_engine_takes_is_refused_and_a_long_prompt_goes_to_the_largest_limit() {
        let c = cfg();
        let mut s = snap(&c);
        s.regions[0].max_model_len = Some(4096);
        s.regions[1].max_model_len = Some(8192);
        let router = Router::new(&c);
        let mut store = MemoryStore::default();
        // About 12,500 tokens estimated: beyond both limits, but only the
        // engine counts a prompt's tokens. Not refused at the edge: the
        // region with the largest limit takes it and its engine judges
        // (issue 45, items 1 and 2).
        let b = body(&"long ".repeat(10_000), 0);
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
        let r = router.route(&c, &mut store, &inp).unwrap();
        assert_eq!((r.decision.region, r.decision.reason), (1, Reason::Context));
        // max_tokens above every limit: vLLM refuses it whatever the
        // prompt, and so does the edge, in vLLM's words.
        let b = br#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":9000}"#;
        inp.body = b;
        let mut store = MemoryStore::default();
        match router.route(&c, &mut store, &inp) {
            Err(Refusal::ContextLength { refusal, exceeded }) => {
                assert_eq!(
                    (exceeded.region, exceeded.limit, exceeded.output),
                    (1, 8192, 9000)
                );
                assert_eq!(
                    (refusal.error_type, refusal.param, refusal.code),
                    ("BadRequestError", Some("max_tokens"), Code::Status(400))
                );
                assert_eq!(
                    refusal.message,
                    "max_tokens=9000 cannot be greater than max_model_len=8192. Please request fewer output tokens. (parameter=max_tokens, value=9000)"
                );
            }
            other => panic!("{other:?}"),
        }
        // Refused before any shared-data call: nothing read, nothing
        // written.
        assert_eq!(
            (store.gets, store.sets, store.map.len()),
            (0, 0, 0),
            "shared-data reads, writes and keys for a request refused on its context"
        );
        // mid can take that output: routed there, for its context.
        let mut roomy = s.clone();
        roomy.regions[1].max_model_len = Some(32768);
        inp.snapshot = Some(&roomy);
        let r = router.route(&c, &mut store, &inp).unwrap();
        assert_eq!((r.decision.region, r.decision.reason), (1, Reason::Context));
        // The fallback pool's engines are not the regions': not checked.
        inp.snapshot = Some(&s);
        inp.fallback = true;
        assert!(router.route(&c, &mut store, &inp).is_ok());
    }
}

#[cfg(test)]
mod kv_action_tests {
    use super::*;
    use crate::decision::cost::{Cost, Reason};
    use crate::decision::migration::MigrationAction;

    fn cfg(extra: &str) -> Config {
        Config::parse(
            format!(
                r#"{{"regions":[{{"name":"near","cluster":"n","capacity_rps":1,"rtt_ms":5}},
                {{"name":"mid","cluster":"m","capacity_rps":1,"rtt_ms":40}}],
                "migration":{{"enabled":true,"model":{{"layers":80,"kv_heads":8,"head_dim":128,
                "params":70e9,"tflops":989,"mfu":0.4}}{extra}}}}}"#
            )
            .as_bytes(),
        )
        .unwrap()
    }

    fn decision(region: usize, cached: [u64; 2]) -> Decision {
        Decision {
            region,
            runner_up: None,
            reason: Reason::Pin,
            costs: cached
                .iter()
                .map(|&c| Cost {
                    cached_tokens: c,
                    healthy: true,
                    candidate: true,
                    ..Cost::default()
                })
                .collect(),
            passed_over: None,
        }
    }

    #[test]
    fn fetch_on_a_fast_link_recompute_on_a_slow_one() {
        let fast = cfg(r#","links":[{"from":"mid","to":"near","rtt_ms":70,"bandwidth_gbps":100}]"#);
        let a = kv_action(&fast, &decision(0, [0, 8000]), &[5.0, 40.0], &[0.1, 0.1]).unwrap();
        assert_eq!(a.plan.action, MigrationAction::Fetch);
        assert_eq!((a.from, a.tokens), (1, 8000));
        assert_eq!(a.header_value("mid"), "fetch; from=mid; tokens=8000");
        let slow = cfg(r#","bandwidth_gbps":5"#);
        let a = kv_action(&slow, &decision(0, [0, 8000]), &[5.0, 40.0], &[0.1, 0.1]).unwrap();
        assert_eq!(a.plan.action, MigrationAction::Recompute);
        assert_eq!(a.header_value("mid"), "recompute; tokens=8000");
    }

    #[test]
    fn nothing_when_disabled_short_or_already_local() {
        let c = cfg("");
        assert!(kv_action(&c, &decision(1, [0, 8000]), &[5.0, 40.0], &[0.0, 0.0]).is_none());
        assert!(kv_action(&c, &decision(0, [0, 100]), &[5.0, 40.0], &[0.0, 0.0]).is_none());
        let mut off = cfg("");
        off.migration.enabled = false;
        assert!(kv_action(&off, &decision(0, [0, 8000]), &[5.0, 40.0], &[0.0, 0.0]).is_none());
        let e = Config::parse(
            br#"{"regions":[{"name":"a","cluster":"a","capacity_rps":1}],"migration":{"enabled":true}}"#,
        )
        .unwrap_err();
        assert_eq!(e.field, "migration.model");
    }
}
