//! The fleet file (JSON): where clients are, the engine regions with their
//! round trips from each client region, their engine figures, and (an
//! extension for scenario d) outages during which a region's engine refuses
//! and drops requests and fails its health checks.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fleet {
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
    pub max_concurrency: u32,
    pub prefill_ms_per_token: f64,
    pub decode_ms_per_token: f64,
    /// Prefix cache capacity in tokens.
    pub cache_tokens: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Outage {
    pub region: String,
    pub from_ms: f64,
    pub to_ms: f64,
}

impl Fleet {
    /// Parses and validates; the error names the field.
    pub fn parse(bytes: &[u8]) -> Result<Fleet, String> {
        let f: Fleet =
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
            if r.max_concurrency == 0 {
                return Err(format!("{}: must be at least 1", at("max_concurrency")));
            }
            for (f, v) in [
                ("prefill_ms_per_token", r.prefill_ms_per_token),
                ("decode_ms_per_token", r.decode_ms_per_token),
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

    /// One round trip from client region `client` to region `region`.
    pub fn rtt(&self, client: usize, region: usize) -> f64 {
        match (self.client_regions.get(client), self.regions.get(region)) {
            (Some(c), Some(r)) => r.rtt_ms.get(c).copied().unwrap_or(0.0),
            _ => 0.0,
        }
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
        let f = Fleet::parse(OK.as_bytes()).unwrap();
        assert_eq!(f.rtt(1, 0), 82.0);
        assert_eq!(f.client_index("eu"), Some(1));
        assert_eq!(f.outages.len(), 1);
    }

    #[test]
    fn errors_name_the_field() {
        let bad = |from: &str, to: &str| Fleet::parse(OK.replace(from, to).as_bytes()).unwrap_err();
        assert!(bad(r#""eu": 82"#, r#""xx": 82"#)
            .starts_with("regions[0].rtt_ms: has no round trip for client region \"eu\""));
        assert!(bad(r#""max_concurrency": 24"#, r#""max_concurrency": 0"#)
            .starts_with("regions[0].max_concurrency"));
        assert!(bad(r#""region": "iad""#, r#""region": "fra""#).starts_with("outages[0].region"));
        assert!(bad(r#""to_ms": 20"#, r#""to_ms": 5"#).starts_with("outages[0]:"));
        assert!(bad(r#""name": "iad""#, r#""name": "IAD""#).starts_with("regions[0].name"));
        assert!(bad("max_concurrency", "max_conc").contains("unknown field"));
    }
}
