//! The topology file (JSON; `--fleet`, `fleet.json` by convention): where clients are, the engine regions with their
//! round trips from each client region, their engine figures, optionally
//! the round trips between engine regions (for a router deployed in one
//! region: `sim::Deployment::Global`), and (an extension for scenario d)
//! outages during which a region's engine refuses and drops requests and
//! fails its health checks.

use engine_emulator::model::DEFAULT_PREFILL_OVERHEAD_MS;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Replicas a region may have.
pub const MAX_REPLICAS: u32 = 64;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Topology {
    /// Where requests come from; one router (Envoy) per client region.
    pub client_regions: Vec<String>,
    pub regions: Vec<Region>,
    /// Extension: periods during which a region is lost.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub outages: Vec<Outage>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Region {
    /// Plugin region name: 1..=32 chars of `[a-z0-9_]`.
    pub name: String,
    /// One network round trip between each client region and this region.
    pub rtt_ms: BTreeMap<String, f64>,
    /// Requests the engine runs at once; beyond this they queue (FIFO).
    /// With `replicas`, per replica.
    pub max_concurrency: u32,
    pub prefill_ms_per_token: f64,
    pub decode_ms_per_token: f64,
    /// Optional: what every request costs before its first token whatever
    /// its prompt (the emulator's `--prefill-overhead-ms`: scheduling, the
    /// first forward pass, HTTP). Default the emulator's, 10 ms, as vLLM
    /// 0.32 measured.
    #[serde(
        default = "default_prefill_overhead_ms",
        skip_serializing_if = "is_default_prefill_overhead_ms"
    )]
    pub prefill_overhead_ms: f64,
    /// Prefix cache capacity in tokens (per replica: each has its own).
    pub cache_tokens: u64,
    /// Optional: engine replicas behind the region's one entry point, each
    /// with `max_concurrency` slots and its own `cache_tokens` of cache;
    /// the entry point balances requests over them (`sim`: Envoy's
    /// least-request). Default 1.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub replicas: u32,
    /// Optional: one network round trip between this region and other
    /// engine regions (its own name: within the region, default 0). The
    /// matrix is symmetric: a pair may be given on either side, or on both
    /// with the same value. A pair given on neither side is estimated
    /// (`Topology::region_rtt`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub region_rtt_ms: BTreeMap<String, f64>,
}

fn one() -> u32 {
    1
}

fn default_prefill_overhead_ms() -> f64 {
    DEFAULT_PREFILL_OVERHEAD_MS
}

fn is_default_prefill_overhead_ms(v: &f64) -> bool {
    *v == DEFAULT_PREFILL_OVERHEAD_MS
}

fn is_one(n: &u32) -> bool {
    *n == 1
}

impl Region {
    /// Slots the region runs at once: `max_concurrency` × `replicas`.
    pub fn slots(&self) -> u32 {
        self.max_concurrency.saturating_mul(self.replicas.max(1))
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Outage {
    pub region: String,
    pub from_ms: f64,
    pub to_ms: f64,
}

impl Topology {
    /// Parses and validates; the error names the field.
    pub fn parse(bytes: &[u8]) -> Result<Topology, String> {
        let f: Topology =
            serde_json::from_slice(bytes).map_err(|e| format!("not a fleet description: {e}"))?;
        f.validate()?;
        Ok(f)
    }

    pub fn validate(&self) -> Result<(), String> {
        if self.client_regions.is_empty() {
            return Err("client_regions: must name at least one client region".into());
        }
        for (i, c) in self.client_regions.iter().enumerate() {
            if c.is_empty() || self.client_regions.iter().take(i).any(|o| o == c) {
                return Err(format!("client_regions[{i}]: {c:?} is empty or used twice"));
            }
        }
        if self.regions.is_empty() {
            return Err("regions: must name at least one region".into());
        }
        for (i, r) in self.regions.iter().enumerate() {
            let at = |f: &str| format!("regions[{i}].{f}");
            let name_ok = (1..=32).contains(&r.name.len())
                && r.name
                    .bytes()
                    .all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_'));
            if !name_ok {
                return Err(format!(
                    "{}: {:?} must be 1..=32 chars of [a-z0-9_]",
                    at("name"),
                    r.name
                ));
            }
            if self.regions.iter().take(i).any(|o| o.name == r.name) {
                return Err(format!("{}: {:?} is used twice", at("name"), r.name));
            }
            for c in &self.client_regions {
                match r.rtt_ms.get(c) {
                    Some(v) if v.is_finite() && *v >= 0.0 => {}
                    Some(v) => {
                        return Err(format!("{}.{c}: {v} must be a number >= 0", at("rtt_ms")))
                    }
                    None => {
                        return Err(format!(
                            "{}: has no round trip for client region {c:?}",
                            at("rtt_ms")
                        ))
                    }
                }
            }
            if let Some(k) = r.rtt_ms.keys().find(|k| !self.client_regions.contains(k)) {
                return Err(format!(
                    "{}.{k}: {k:?} is not in client_regions",
                    at("rtt_ms")
                ));
            }
            for (other, v) in &r.region_rtt_ms {
                let at = format!("{}.{other}", at("region_rtt_ms"));
                let Some(o) = self.regions.iter().find(|o| &o.name == other) else {
                    return Err(format!("{at}: {other:?} is not a region"));
                };
                if !(v.is_finite() && *v >= 0.0) {
                    return Err(format!("{at}: {v} must be a number >= 0"));
                }
                if let Some(back) = o.region_rtt_ms.get(&r.name) {
                    if back != v {
                        return Err(format!(
                            "{at}: {v} differs from regions[{}].region_rtt_ms.{}: {back} \
                             (one round trip, the same both ways)",
                            self.regions
                                .iter()
                                .position(|x| x.name == *other)
                                .unwrap_or(0),
                            r.name
                        ));
                    }
                }
            }
            if r.max_concurrency == 0 {
                return Err(format!("{}: must be at least 1", at("max_concurrency")));
            }
            if !(1..=MAX_REPLICAS).contains(&r.replicas) {
                return Err(format!(
                    "{}: {} must be 1 to {MAX_REPLICAS}",
                    at("replicas"),
                    r.replicas
                ));
            }
            for (f, v) in [
                ("prefill_ms_per_token", r.prefill_ms_per_token),
                ("decode_ms_per_token", r.decode_ms_per_token),
                ("prefill_overhead_ms", r.prefill_overhead_ms),
            ] {
                if !(v.is_finite() && v >= 0.0) {
                    return Err(format!("{}: {v} must be a number >= 0", at(f)));
                }
            }
        }
        for (i, o) in self.outages.iter().enumerate() {
            if !self.regions.iter().any(|r| r.name == o.region) {
                return Err(format!(
                    "outages[{i}].region: {:?} is not a region",
                    o.region
                ));
            }
            if !(o.from_ms.is_finite()
                && o.to_ms.is_finite()
                && 0.0 <= o.from_ms
                && o.from_ms < o.to_ms)
            {
                return Err(format!(
                    "outages[{i}]: from_ms {} and to_ms {} must satisfy 0 <= from_ms < to_ms",
                    o.from_ms, o.to_ms
                ));
            }
            let overlaps = self
                .outages
                .iter()
                .take(i)
                .any(|p| p.region == o.region && p.from_ms < o.to_ms && o.from_ms < p.to_ms);
            if overlaps {
                return Err(format!(
                    "outages[{i}]: overlaps an earlier outage of {:?}",
                    o.region
                ));
            }
        }
        Ok(())
    }

    /// Every region as `replicas` engine replicas behind its entry point,
    /// each with 1/`replicas` of the region's slots (rounded to the nearest
    /// whole slot, at least one: replicas are alike, as one deployment's
    /// pods are, so the region's total may move by a slot or two) and of its
    /// prefix cache. `replicas` 1 gives the fleet back unchanged where it has
    /// one engine per region.
    pub fn split_replicas(&self, replicas: u32) -> Result<Topology, String> {
        if !(1..=MAX_REPLICAS).contains(&replicas) {
            return Err(format!("replicas: {replicas} must be 1 to {MAX_REPLICAS}"));
        }
        let mut f = self.clone();
        for r in &mut f.regions {
            let slots = f64::from(r.slots());
            let cache = r.cache_tokens.saturating_mul(u64::from(r.replicas.max(1)));
            r.max_concurrency = ((slots / f64::from(replicas)).round() as u32).max(1);
            r.cache_tokens = cache / u64::from(replicas);
            r.replicas = replicas;
        }
        f.validate()?;
        Ok(f)
    }

    /// One round trip from client region `client` to region `region`.
    pub fn rtt(&self, client: usize, region: usize) -> f64 {
        match (self.client_regions.get(client), self.regions.get(region)) {
            (Some(c), Some(r)) => r.rtt_ms.get(c).copied().unwrap_or(0.0),
            _ => 0.0,
        }
    }

    /// One round trip between engine regions `a` and `b` (a router in `a`
    /// forwarding to the engine in `b`): the fleet's `region_rtt_ms` when it
    /// gives the pair (either side), 0 within a region, else the estimate
    /// documented in bench/README.md:
    ///
    /// `max over client regions c of |rtt(c, a) − rtt(c, b)|`
    ///
    /// the triangle inequality's lower bound, the smallest round trip the
    /// fleet's own client figures allow. It leans in favour of a router
    /// placed away from its clients, but not past the point where going
    /// through it would be quicker than going straight to the engine: with
    /// it, `rtt(c, a) + region_rtt(a, b) >= rtt(c, b)` for every client
    /// region. For the generated scenarios (iad, fra, icn) it gives 242, 419
    /// and 276 ms (iad–fra, iad–icn, fra–icn), set by na's 37 / 279 / 456 ms
    /// and eu's 24 ms to fra.
    pub fn region_rtt(&self, a: usize, b: usize) -> f64 {
        let (Some(ra), Some(rb)) = (self.regions.get(a), self.regions.get(b)) else {
            return 0.0;
        };
        if let Some(v) = ra
            .region_rtt_ms
            .get(&rb.name)
            .or_else(|| rb.region_rtt_ms.get(&ra.name))
        {
            return *v;
        }
        if a == b {
            return 0.0;
        }
        (0..self.client_regions.len())
            .map(|c| (self.rtt(c, a) - self.rtt(c, b)).abs())
            .fold(0.0, f64::max)
    }

    pub fn region_index(&self, name: &str) -> Option<usize> {
        self.regions.iter().position(|r| r.name == name)
    }

    pub fn client_index(&self, name: &str) -> Option<usize> {
        self.client_regions.iter().position(|c| c == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OK: &str = r#"{"client_regions": ["na","eu"], "regions": [
        {"name": "iad", "rtt_ms": {"na": 9, "eu": 82}, "max_concurrency": 24,
         "prefill_ms_per_token": 0.09, "decode_ms_per_token": 22, "cache_tokens": 600000}],
        "outages": [{"region": "iad", "from_ms": 10, "to_ms": 20}]}"#;

    #[test]
    fn parses_the_documented_format() {
        let f = Topology::parse(OK.as_bytes()).unwrap();
        assert_eq!(f.rtt(1, 0), 82.0);
        assert_eq!(f.client_index("eu"), Some(1));
        assert_eq!(f.outages.len(), 1);
    }

    #[test]
    fn errors_name_the_field() {
        let bad =
            |from: &str, to: &str| Topology::parse(OK.replace(from, to).as_bytes()).unwrap_err();
        assert!(bad(r#""eu": 82"#, r#""xx": 82"#)
            .starts_with("regions[0].rtt_ms: has no round trip for client region \"eu\""));
        assert!(bad(r#""max_concurrency": 24"#, r#""max_concurrency": 0"#)
            .starts_with("regions[0].max_concurrency"));
        assert!(bad(r#""region": "iad""#, r#""region": "fra""#).starts_with("outages[0].region"));
        assert!(bad(r#""to_ms": 20"#, r#""to_ms": 5"#).starts_with("outages[0]:"));
        assert!(bad(r#""name": "iad""#, r#""name": "IAD""#).starts_with("regions[0].name"));
        assert!(bad("max_concurrency", "max_conc").contains("unknown field"));
        let rtt = r#""cache_tokens": 600000"#;
        assert!(
            bad(rtt, r#""cache_tokens": 1, "region_rtt_ms": {"fra": 80}"#)
                .starts_with("regions[0].region_rtt_ms.fra: \"fra\" is not a region")
        );
        assert!(
            bad(rtt, r#""cache_tokens": 1, "region_rtt_ms": {"iad": -1}"#)
                .starts_with("regions[0].region_rtt_ms.iad: -1 must be a number >= 0")
        );
    }

    fn three(extra_iad: &str, extra_fra: &str) -> Topology {
        Topology::parse(
            format!(
                r#"{{"client_regions": ["na", "eu", "ap"], "regions": [
                {{"name": "iad", "rtt_ms": {{"na": 37, "eu": 95, "ap": 210}}, "max_concurrency": 1,
                 "prefill_ms_per_token": 0, "decode_ms_per_token": 1, "cache_tokens": 1{extra_iad}}},
                {{"name": "fra", "rtt_ms": {{"na": 279, "eu": 24, "ap": 260}}, "max_concurrency": 1,
                 "prefill_ms_per_token": 0, "decode_ms_per_token": 1, "cache_tokens": 1{extra_fra}}},
                {{"name": "icn", "rtt_ms": {{"na": 456, "eu": 300, "ap": 41}}, "max_concurrency": 1,
                 "prefill_ms_per_token": 0, "decode_ms_per_token": 1, "cache_tokens": 1}}]}}"#
            )
            .as_bytes(),
        )
        .unwrap()
    }

    #[test]
    fn region_round_trips_given_or_estimated() {
        // Estimated: the largest difference of two regions' round trips from
        // one client region (na's for iad–fra and iad–icn, eu's for fra–icn).
        let f = three("", "");
        assert_eq!(f.region_rtt(0, 1), 242.0);
        assert_eq!(f.region_rtt(1, 0), 242.0);
        assert_eq!(f.region_rtt(0, 2), 419.0);
        assert_eq!(f.region_rtt(1, 2), 276.0);
        assert_eq!(f.region_rtt(2, 2), 0.0);
        // No client goes faster through a router than straight to the engine.
        for (c, g, r) in
            (0..3).flat_map(|c| (0..3).flat_map(move |g| (0..3).map(move |r| (c, g, r))))
        {
            assert!(
                f.rtt(c, g) + f.region_rtt(g, r) >= f.rtt(c, r),
                "{c} {g} {r}"
            );
        }
        // Given on either side, or both alike; the other pairs still estimated.
        let f = three(r#", "region_rtt_ms": {"fra": 85, "iad": 2}"#, "");
        assert_eq!((f.region_rtt(0, 1), f.region_rtt(1, 0)), (85.0, 85.0));
        assert_eq!(f.region_rtt(0, 0), 2.0);
        assert_eq!(f.region_rtt(1, 2), 276.0);
        let f = three(
            r#", "region_rtt_ms": {"fra": 85}"#,
            r#", "region_rtt_ms": {"iad": 85}"#,
        );
        assert_eq!(f.region_rtt(1, 0), 85.0);
        let e = Topology::parse(
            &serde_json::to_vec(&{
                let mut f = three(r#", "region_rtt_ms": {"fra": 85}"#, "");
                f.regions[1].region_rtt_ms.insert("iad".into(), 90.0);
                f
            })
            .unwrap(),
        )
        .unwrap_err();
        assert!(
            e.starts_with(
                "regions[0].region_rtt_ms.fra: 85 differs from regions[1].region_rtt_ms.iad: 90"
            ),
            "{e}"
        );
    }

    #[test]
    fn a_region_splits_into_alike_replicas() {
        let f = Topology::parse(OK.as_bytes()).unwrap();
        assert_eq!(f.regions[0].replicas, 1);
        // Written without replicas while there is one.
        let text = serde_json::to_string(&f).unwrap();
        assert!(!text.contains("replicas"), "{text}");
        assert_eq!(f.split_replicas(1).unwrap(), f);
        // 24 slots and 600000 tokens of cache: 3 replicas of 8 and 200000.
        let three = f.split_replicas(3).unwrap();
        let r = &three.regions[0];
        assert_eq!(
            (r.replicas, r.max_concurrency, r.cache_tokens, r.slots()),
            (3, 8, 200_000, 24)
        );
        assert_eq!(
            Topology::parse(&serde_json::to_vec(&three).unwrap()),
            Ok(three.clone())
        );
        // Rounded to whole slots, alike: 24 / 5 is 4.8, 5 each.
        let five = f.split_replicas(5).unwrap();
        assert_eq!(
            (five.regions[0].max_concurrency, five.regions[0].slots()),
            (5, 25)
        );
        // From the region's total, whatever it was split into before.
        assert_eq!(
            three.split_replicas(2).unwrap().regions[0].max_concurrency,
            12
        );
        assert_eq!(
            three.split_replicas(1).unwrap().regions[0].cache_tokens,
            600_000
        );
        assert!(f.split_replicas(0).unwrap_err().contains("must be 1 to 64"));
        let bad =
            |from: &str, to: &str| Topology::parse(OK.replace(from, to).as_bytes()).unwrap_err();
        let mc = r#""max_concurrency": 24"#;
        assert!(bad(mc, r#""max_concurrency": 24, "replicas": 0"#)
            .starts_with("regions[0].replicas: 0 must be 1 to 64"));
    }
}
