//! Where a request goes whose body the router does not read
//! (`Router::place`): the stored response's region for
//! `/v1/responses/{id}` paths; else the configured `default_region` while
//! it is a candidate with a free slot; else the cost's choice without a
//! prompt.

use crate::config::{Config, HolderUnavailable};
use crate::decision::cost;
use crate::decision::pipeline::{
    cost_decision, holder_unavailable, keeps_responses, residency, stored_where_unavailable,
    Prompt, Refusal, Router,
};
use crate::fleet::snapshot::Snapshot;
use crate::shared::store::SharedStore;

/// What the host knows about a request whose body the router does not
/// read (`/v1/embeddings`, `/v1/models`, `/v1/responses/{id}`, a body it
/// will not interpret, ...).
#[derive(Debug, Clone, Copy)]
pub struct UnreadInputs<'a> {
    pub residency: Option<&'a str>,
    pub snapshot: Option<&'a Snapshot>,
    pub snapshot_index: &'a [Option<usize>],
    pub inflight: &'a [f64],
    pub now_ms: u64,
    /// The stored response the path names (`/v1/responses/{id}...`).
    pub response_id: Option<&'a str>,
}

/// Where an unread request goes, and why (the decision header's reason).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placed {
    pub region: usize,
    /// `response` (the stored response's region), `default` (the
    /// configured `default_region`, routable with a free slot), else the
    /// cost's reason (`rtt`, `load`, `pin`, `fallback`, ...).
    pub reason: &'static str,
    /// The path names a stored response this Envoy has no record of.
    pub unknown_response: bool,
}

impl Router {
    /// Place a request without reading its body: the stored response's
    /// region for `/v1/responses/{id}` paths; otherwise the best routable
    /// region by round trip and load (no prompt, no directory), the
    /// configured `default_region` preferred while it is a candidate with
    /// a free slot. Never an unhealthy, ejected or release-mismatched
    /// region while another can take it.
    pub fn place(
        &self,
        cfg: &Config,
        store: &mut dyn SharedStore,
        inp: &UnreadInputs,
    ) -> Result<Placed, Refusal> {
        let allowed = residency(cfg, inp.residency)?;
        let d = cost_decision(
            cfg,
            inp.snapshot,
            inp.snapshot_index,
            inp.inflight,
            inp.now_ms,
            &Prompt::unread(allowed.as_deref()),
        );
        let mut unknown_response = false;
        if let Some(id) = inp.response_id {
            let holder = self
                .responses
                .lookup(store, id, inp.now_ms)
                .and_then(|n| cfg.regions.iter().position(|r| r.name == n))
                .filter(|&h| keeps_responses(inp.snapshot, inp.snapshot_index, h));
            match holder {
                None => unknown_response = true,
                Some(h) => match holder_unavailable(
                    &d,
                    h,
                    allowed.as_deref(),
                    inp.snapshot,
                    inp.snapshot_index,
                ) {
                    None => {
                        return Ok(Placed {
                            region: h,
                            reason: cost::Reason::Response.as_str(),
                            unknown_response,
                        })
                    }
                    Some(why) if cfg.responses.holder_unavailable == HolderUnavailable::Reject => {
                        return Err(stored_where_unavailable(
                            cfg,
                            id,
                            h,
                            why,
                            "is stored",
                            "no other region has it. Retry later.",
                        ));
                    }
                    Some(_) => {}
                },
            }
        }
        let preferred = cfg.default_region.as_ref().and_then(|name| {
            let i = cfg.regions.iter().position(|r| &r.name == name)?;
            let c = d.costs.get(i)?;
            (c.candidate && c.wait_ms <= 0.0).then_some(i)
        });
        Ok(match preferred {
            Some(i) => Placed {
                region: i,
                reason: "default",
                unknown_response,
            },
            None => Placed {
                region: d.region,
                reason: d.reason.as_str(),
                unknown_response,
            },
        })
    }
}
