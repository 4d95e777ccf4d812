//! Whether each region's engine keeps the Responses it produces. vLLM 0.32
//! stores them only with `VLLM_ENABLE_RESPONSES_API_STORE=1`, and its
//! answer does not say whether it did. A router that followed a response
//! to an engine that never kept it pinned the follow-up there for nothing,
//! and while that region was down answered 503
//! `response_region_unavailable` for a response that exists nowhere. So the
//! probe checks: the first response a router records at a region whose
//! keeping is unknown comes here (`STORE_CHECK_TAG` on the observations
//! queue), and the probe asks that region's engine for it once
//! (`GET /v1/responses/{id}`): 200, kept; 404, not. Known again as unknown
//! when the region comes back from an outage (perhaps redeployed).

use crate::roots::probe::{Kind, Probe};
use crate::shared::host_api::{CalloutResponse, Level, ProbeHost};
use crate::shared::names::{Global, Stat};

impl Probe {
    /// A router recorded response `id` at `region`: check it there unless
    /// the region's keeping is known or a check is under way.
    pub(super) fn check_store(&mut self, host: &mut dyn ProbeHost, region: usize, id: &str) {
        let Some(r) = self.cfg.regions.get(region) else {
            return;
        };
        if self.fleet.stores_responses(region).is_some()
            || self
                .pending
                .values()
                .any(|(ri, k, _)| *ri == region && *k == Kind::StoreCheck)
        {
            return;
        }
        let path = format!("/v1/responses/{id}");
        let authority = self.cfg.region_authority(region).unwrap_or(&r.cluster);
        let headers = [
            (":method", "GET"),
            (":path", path.as_str()),
            (":authority", authority),
            ("user-agent", "llm-geo-router-probe"),
        ];
        host.count(Stat::Global(Global::ProbeCallouts), 1);
        let timeout = u64::from(self.cfg.probe.timeout_ms);
        if let Ok(token) = host.dispatch(&r.cluster, &headers, None, timeout) {
            self.pending
                .insert(token, (region, Kind::StoreCheck, host.now_ms()));
        }
    }

    /// The engine answered a store check: 200 it keeps its Responses, 404
    /// it does not; anything else (no answer, another status) says
    /// nothing, and the next recorded response is checked.
    pub(super) fn store_checked(
        &mut self,
        host: &mut dyn ProbeHost,
        region: usize,
        status: Option<u32>,
        _response: &mut dyn CalloutResponse,
        now: u64,
    ) {
        let stores = match status {
            Some(200) => true,
            Some(404) => false,
            _ => return,
        };
        if !self.fleet.on_stores_responses(region, stores) {
            return;
        }
        let name = self
            .cfg
            .regions
            .get(region)
            .map_or("?", |r| r.name.as_str());
        host.log(
            Level::Info,
            &if stores {
                format!("llm-geo-router probe: region {name}: its engine keeps the Responses it produces; follow-ups go back to it")
            } else {
                format!("llm-geo-router probe: region {name}: its engine does not keep the Responses it produces (vLLM: VLLM_ENABLE_RESPONSES_API_STORE unset); follow-ups are not pinned to it")
            },
        );
        self.publish(host, now);
    }
}
