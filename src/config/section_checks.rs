//! The checks of the sections `Config::validate` hands off: the ladder and
//! tiers, release parity and assessment, migration, residency and the
//! exchange, each against the rest of the configuration where it refers to it.

use crate::config::document::Config;
use crate::config::error::{
    fraction, non_negative, positive, valid_header_name, valid_name, ConfigError,
};
use crate::config::ladder::LADDER_RUNGS;
use crate::config::probe::ReleaseSource;

impl Config {
    pub(super) fn validate_ladder(&self) -> Result<(), ConfigError> {
        let l = &self.ladder;
        for i in 0..LADDER_RUNGS {
            let (up, down) = (l.up_at.get(i).copied(), l.down_at.get(i).copied());
            let (Some(up), Some(down)) = (up, down) else {
                continue;
            };
            positive(&format!("ladder.up_at[{i}]"), up)?;
            if !(down.is_finite() && down > up) {
                return Err(ConfigError::new(
                    format!("ladder.down_at[{i}]"),
                    format!("{down} must be greater than up_at[{i}] ({up}), or the level flaps"),
                ));
            }
            if i > 0 && l.up_at.get(i - 1).is_some_and(|prev| up > *prev) {
                return Err(ConfigError::new(
                    format!("ladder.up_at[{i}]"),
                    "thresholds must not increase from one rung to the next",
                ));
            }
        }
        non_negative("ladder.dwell_s", l.dwell_s)?;
        if let Some(f) = l.forced_level {
            if usize::from(f) > LADDER_RUNGS {
                return Err(ConfigError::new(
                    "ladder.forced_level",
                    format!("{f} must be within 0..={LADDER_RUNGS}"),
                ));
            }
        }
        if l.levels.len() != LADDER_RUNGS + 1 {
            return Err(ConfigError::new(
                "ladder.levels",
                format!(
                    "has {} entries; exactly {} (levels 0..=5) are required",
                    l.levels.len(),
                    LADDER_RUNGS + 1
                ),
            ));
        }
        for (i, level) in l.levels.iter().enumerate() {
            for (tier, policy) in level {
                if !self.tiers.names.contains(tier) {
                    return Err(ConfigError::new(
                        format!("ladder.levels[{i}].{tier}"),
                        "is not a tier named in tiers.names",
                    ));
                }
                for (f, v) in [
                    ("max_prompt_tokens", policy.max_prompt_tokens),
                    ("max_tokens", policy.max_tokens),
                ] {
                    if v == Some(0) {
                        return Err(ConfigError::new(
                            format!("ladder.levels[{i}].{tier}.{f}"),
                            "must be at least 1 (use shed to refuse a tier)",
                        ));
                    }
                }
            }
        }
        if !matches!(l.shed_status, 429 | 503) {
            return Err(ConfigError::new(
                "ladder.shed_status",
                format!("{} must be 429 or 503", l.shed_status),
            ));
        }
        for (i, k) in l.operator_keys.iter().enumerate() {
            if k.len() != 64 || !k.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
                return Err(ConfigError::new(
                    format!("ladder.operator_keys[{i}]"),
                    "must be the lowercase hex SHA-256 (64 chars) of an operator token",
                ));
            }
        }
        for (i, level) in l.levels.iter().enumerate() {
            for (tier, policy) in level {
                if policy.fallback_model.is_some() && !policy.fallback {
                    return Err(ConfigError::new(
                        format!("ladder.levels[{i}].{tier}.fallback_model"),
                        "is only used with fallback: true",
                    ));
                }
                if policy.fallback_model.is_some() {
                    let missing = self
                        .regions
                        .iter()
                        .enumerate()
                        .find(|(_, r)| r.fallback_cluster.is_none());
                    if let Some((j, r)) = missing {
                        return Err(ConfigError::new(
                            format!("ladder.levels[{i}].{tier}.fallback_model"),
                            format!(
                                "needs a fallback_cluster in every region (regions[{j}] {:?} has none): the renamed model would reach the main pool",
                                r.name
                            ),
                        ));
                    }
                }
                if policy
                    .fallback_model
                    .as_deref()
                    .is_some_and(|m| m.trim().is_empty())
                {
                    return Err(ConfigError::new(
                        format!("ladder.levels[{i}].{tier}.fallback_model"),
                        "must not be empty",
                    ));
                }
            }
        }
        let [lo, hi] = l.retry_after_s;
        if lo == 0 || hi < lo {
            return Err(ConfigError::new(
                "ladder.retry_after_s",
                format!("[{lo}, {hi}] must be [min, max] with 1 <= min <= max"),
            ));
        }
        Ok(())
    }

    pub(super) fn validate_release(&self) -> Result<(), ConfigError> {
        let r = &self.release;
        if let Some(d) = &r.expected {
            if d.trim().is_empty() {
                return Err(ConfigError::new("release.expected", "must not be empty"));
            }
        }
        let ok = match r.source {
            ReleaseSource::HealthHeader => valid_header_name(&r.name),
            ReleaseSource::HealthJson => !r.name.is_empty(),
            ReleaseSource::MetricsLabel => r
                .name
                .split_once('/')
                .is_some_and(|(m, l)| !m.is_empty() && !l.is_empty()),
        };
        if !ok {
            return Err(ConfigError::new(
                "release.name",
                format!("{:?} does not fit release.source (a header name, a JSON field, or metric/label)", r.name),
            ));
        }
        non_negative("release.ramp_s", r.ramp_s)?;
        let a = &self.assessment;
        non_negative("assessment.region_down_minutes", a.region_down_minutes)?;
        fraction("assessment.capacity_fraction_min", a.capacity_fraction_min)?;
        for (i, r) in self.regions.iter().enumerate() {
            if r.fallback_cluster
                .as_deref()
                .is_some_and(|c| c.trim().is_empty())
            {
                return Err(ConfigError::new(
                    format!("regions[{i}].fallback_cluster"),
                    "must not be empty",
                ));
            }
        }
        Ok(())
    }

    pub(super) fn validate_migration(&self) -> Result<(), ConfigError> {
        let m = &self.migration;
        if !valid_header_name(&m.header) {
            return Err(ConfigError::new(
                "migration.header",
                format!("{:?} is not a lowercase HTTP header name", m.header),
            ));
        }
        match &m.model {
            Some(model) => model
                .validate()
                .map_err(|e| ConfigError::new("migration.model", e))?,
            None if m.enabled => {
                return Err(ConfigError::new(
                    "migration.model",
                    "is required when migration.enabled is true",
                ))
            }
            None => {}
        }
        positive("migration.bandwidth_gbps", m.bandwidth_gbps)?;
        let u = m.fetch_path_utilization;
        if !(u.is_finite() && (0.0..1.0).contains(&u)) {
            return Err(ConfigError::new(
                "migration.fetch_path_utilization",
                format!("{u} must be within [0, 1)"),
            ));
        }
        positive("migration.service_rate_per_s", m.service_rate_per_s)?;
        for (i, l) in m.links.iter().enumerate() {
            for (f, name) in [("from", &l.from), ("to", &l.to)] {
                if !self.regions.iter().any(|r| &r.name == name) {
                    return Err(ConfigError::new(
                        format!("migration.links[{i}].{f}"),
                        format!("{name:?} is not the name of a configured region"),
                    ));
                }
            }
            if let Some(v) = l.rtt_ms {
                non_negative(&format!("migration.links[{i}].rtt_ms"), v)?;
            }
            if let Some(v) = l.bandwidth_gbps {
                positive(&format!("migration.links[{i}].bandwidth_gbps"), v)?;
            }
        }
        Ok(())
    }

    pub(super) fn validate_residency(&self) -> Result<(), ConfigError> {
        let r = &self.residency;
        if let Some(h) = &r.header {
            if !valid_header_name(h) {
                return Err(ConfigError::new(
                    "residency.header",
                    format!("{h:?} is not a lowercase HTTP header name"),
                ));
            }
            if r.allowed.is_empty() {
                return Err(ConfigError::new(
                    "residency.allowed",
                    "must list at least one residency when residency.header is set",
                ));
            }
        }
        for (value, regions) in &r.allowed {
            let at = format!("residency.allowed.{value}");
            // The header value is trimmed before lookup: a key that cannot
            // equal a trimmed header value could never be matched.
            if value.is_empty()
                || value.trim() != value
                || !value.chars().all(|c| (' '..='~').contains(&c))
            {
                return Err(ConfigError::new(
                    format!("residency.allowed.{value:?}"),
                    "a residency value must be non-empty printable ASCII without \
                     surrounding whitespace (header values are matched after trimming)",
                ));
            }
            if regions.is_empty() {
                return Err(ConfigError::new(at, "must name at least one region"));
            }
            for name in regions {
                if !self.regions.iter().any(|x| &x.name == name) {
                    return Err(ConfigError::new(
                        at,
                        format!("{name:?} is not the name of a configured region"),
                    ));
                }
            }
        }
        Ok(())
    }

    pub(super) fn validate_tiers(&self) -> Result<(), ConfigError> {
        let t = &self.tiers;
        if t.names.is_empty() {
            return Err(ConfigError::new(
                "tiers.names",
                "must name at least one tier",
            ));
        }
        for (i, n) in t.names.iter().enumerate() {
            if !valid_name(n) {
                return Err(ConfigError::new(
                    format!("tiers.names[{i}]"),
                    format!("{n:?} must be 1..=32 chars of [a-z0-9_]"),
                ));
            }
            if t.names.iter().take(i).any(|o| o == n) {
                return Err(ConfigError::new(
                    format!("tiers.names[{i}]"),
                    format!("{n:?} is used twice"),
                ));
            }
        }
        if !t.names.contains(&t.default) {
            return Err(ConfigError::new(
                "tiers.default",
                format!("{:?} is not in tiers.names", t.default),
            ));
        }
        for (hash, tier) in &t.api_keys {
            if hash.len() != 64 || !hash.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
                return Err(ConfigError::new(
                    "tiers.api_keys",
                    format!(
                        "key {hash:?} must be the lowercase hex SHA-256 (64 chars) of an API key"
                    ),
                ));
            }
            if !t.names.contains(tier) {
                return Err(ConfigError::new(
                    format!("tiers.api_keys.{hash}"),
                    format!("{tier:?} is not in tiers.names"),
                ));
            }
        }
        Ok(())
    }

    pub(super) fn validate_exchange(&self) -> Result<(), ConfigError> {
        let x = &self.exchange;
        if let Some(c) = &x.cluster {
            if c.is_empty() || c.len() > 256 || c.bytes().any(|b| b.is_ascii_control()) {
                return Err(ConfigError::new(
                    "exchange.cluster",
                    "must be a cluster name (1..=256 printable bytes)",
                ));
            }
        }
        if let Some(a) = &x.authority {
            if a.is_empty() || a.len() > 256 || a.bytes().any(|b| b.is_ascii_control() || b == b' ')
            {
                return Err(ConfigError::new(
                    "exchange.authority",
                    "must be a host name (1..=256 printable bytes, no spaces)",
                ));
            }
        }
        if !x.path.starts_with('/')
            || x.path.len() > 256
            || x.path
                .bytes()
                .any(|b| !b.is_ascii_graphic() || b == b'?' || b == b'#')
        {
            return Err(ConfigError::new(
                "exchange.path",
                format!(
                    "{:?} must be an absolute path without query (at most 256 bytes)",
                    x.path
                ),
            ));
        }
        if let Some(ms) = x.interval_ms {
            if !(50..=60_000).contains(&ms) {
                return Err(ConfigError::new(
                    "exchange.interval_ms",
                    format!("{ms} must be within 50..=60000"),
                ));
            }
        }
        if !(1..=16).contains(&x.fanout) {
            return Err(ConfigError::new(
                "exchange.fanout",
                format!("{} must be within 1..=16", x.fanout),
            ));
        }
        if !(1024..=4 << 20).contains(&x.max_message_bytes) {
            return Err(ConfigError::new(
                "exchange.max_message_bytes",
                format!("{} must be within 1024..=4194304", x.max_message_bytes),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(json: &str) -> ConfigError {
        Config::parse(json.as_bytes()).unwrap_err()
    }

    #[test]
    fn ladder_levels_must_name_known_tiers() {
        let e = err(r#"{"regions":[{"name":"a","cluster":"c","capacity_rps":1}],
            "ladder":{"levels":[{},{},{},{},{},{"gold":{"shed":true}}]}}"#);
        assert_eq!(e.field, "ladder.levels[5].gold");
    }

    #[test]
    fn residency_values_that_no_header_can_match_are_refused() {
        // Found by the `config` fuzz target: a key with surrounding
        // whitespace was accepted, and then had no mask.
        for key in [" eu", "eu ", "", "e\\u0001u", "\\u00e9u"] {
            let e = err(&format!(
                r#"{{"regions":[{{"name":"a","cluster":"c","capacity_rps":1}}],
                "residency":{{"header":"x-r","allowed":{{"{key}":["a"]}}}}}}"#
            ));
            assert!(e.field.starts_with("residency.allowed."), "{key:?}: {e}");
        }
        let ok = Config::parse(
            br#"{"regions":[{"name":"a","cluster":"c","capacity_rps":1}],
            "residency":{"header":"x-r","allowed":{"eu west":["a"]}}}"#,
        )
        .unwrap();
        assert_eq!(ok.residency_mask(" eu west "), Some(vec![true]));
    }
}
