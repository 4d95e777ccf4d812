//! Fields an earlier release took and this one does not: the list, their
//! removal from a configuration before it is parsed (one warning each), and
//! the shared-data key that has each warning logged once per Envoy.

/// What replaced the held prompts' share bound (two removed fields).
const HELD_SHARE_BOUND_GONE: &str =
    "nothing: a prompt some region holds is not spread by a share of \
     the in-flight work; it leaves the region holding it only when that region is full and its \
     wait exceeds what the move costs (docs/ROUTING.md, \"What each rule is worth\")";

/// What replaced the queue's fitted weight (three removed fields).
const QUEUE_WEIGHT_GONE: &str =
    "nothing: the queue enters the cost unweighted, a predicted ms of wait as one ms, \
     like every other term; a weight fitted on the observed TTFT paid nothing as shipped \
     (docs/ROUTING.md, \"What each rule is worth\")";

/// Fields an earlier release took and this one does not: `(section, field,
/// what replaced it)`. A configuration that still sets one is accepted, the
/// field ignored, with one warning naming the replacement (for one release;
/// then they are unknown fields, refused).
pub const REMOVED_FIELDS: &[(&str, &str, &str)] = &[
    (
        "cost",
        "w_rtt",
        "nothing: the round trip enters the cost as the probe measures it, in ms \
         (docs/ROUTING.md, \"What each rule is worth\")",
    ),
    (
        "tuning",
        "w_rtt_min",
        "nothing: the round trip is not weighted, so there is no weight to bound",
    ),
    (
        "tuning",
        "w_rtt_max",
        "nothing: the round trip is not weighted, so there is no weight to bound",
    ),
    (
        "cost",
        "spread_margin_ms",
        "nothing: the near-tie draw is gone, a prompt goes to the least expected \
         TTFT (docs/ROUTING.md, \"What each rule is worth\")",
    ),
    (
        "cost",
        "spread_share",
        "nothing: the near-tie draw is gone, a prompt goes to the least expected \
         TTFT (docs/ROUTING.md, \"What each rule is worth\")",
    ),
    (
        "cost",
        "tie_ms",
        "nothing: only regions of exactly the least expected TTFT tie (rendezvous \
         breaks them); a difference within a band is a difference (docs/ROUTING.md, \
         \"What each rule is worth\")",
    ),
    (
        "cost",
        "session_slack_ms",
        "nothing: a session's previous region is not kept by a margin; what it \
         holds of the session's prompt enters the expected TTFT as cached tokens, \
         from the session record (docs/ROUTING.md, \"What each rule is worth\")",
    ),
    (
        "cost",
        "congestion_cap",
        "the externality term: the delay a request adds to the requests arriving \
         at a region while it is there, from the region's occupancy and slots, \
         with no cap to set (docs/ROUTING.md, \"What each rule is worth\")",
    ),
    ("cost", "w_queue", QUEUE_WEIGHT_GONE),
    ("tuning", "w_queue_min", QUEUE_WEIGHT_GONE),
    ("tuning", "w_queue_max", QUEUE_WEIGHT_GONE),
    ("cost", "bounded_load_epsilon", HELD_SHARE_BOUND_GONE),
    ("cost", "bounded_load_floor", HELD_SHARE_BOUND_GONE),
    (
        "prefix",
        "bytes_per_token",
        "the engines' own count: tokens per byte of prompt are measured from each \
         answer's usage.prompt_tokens, per region and model (4 bytes per token until \
         the first answer) (docs/ROUTING.md, \"What the engines report\")",
    ),
    (
        "directory",
        "learn_from_usage",
        "nothing: the usage ending each answer is always read and learnt from \
         (docs/ROUTING.md, \"What the engines report\")",
    ),
    (
        "tuning",
        "enabled",
        "nothing: the prefill times are always fitted on the observed TTFT \
         (docs/ROUTING.md, \"Online tuning\")",
    ),
    (
        "probe",
        "rtt_alpha",
        "probe.rtt_window: a region's round trip is the least of its last rtt_window \
         health round trips, not an average",
    ),
];

/// The configuration without the removed fields it sets, and a warning for
/// each; `None` when it sets none (or is not a JSON object: the parse then
/// says what is wrong).
pub(super) fn strip_removed(bytes: &[u8]) -> Option<(Vec<u8>, Vec<String>)> {
    // Cheap test first: most configurations name no removed field.
    let text = std::str::from_utf8(bytes).ok()?;
    if !REMOVED_FIELDS.iter().any(|(_, f, _)| text.contains(f)) {
        return None;
    }
    let mut value: serde_json::Value = serde_json::from_slice(bytes).ok()?;
    let mut warnings = Vec::new();
    for (section, field, instead) in REMOVED_FIELDS {
        let removed = value
            .get_mut(*section)
            .and_then(serde_json::Value::as_object_mut)
            .and_then(|o| o.remove(*field));
        if removed.is_some() {
            warnings.push(format!(
                "{section}.{field} is no longer a setting and is ignored; replaced by {instead}. \
                 Remove it: the next release refuses it"
            ));
        }
    }
    // Written back as text and parsed as any configuration is: parsing a
    // `Value` into the types would build their deserializers a second time
    // (about 140 KB of module).
    let stripped = serde_json::to_vec(&value).ok()?;
    (!warnings.is_empty()).then_some((stripped, warnings))
}

/// The shared-data key that records `warning` as logged.
pub(super) fn warned_key(warning: &str) -> String {
    format!(
        "llm_geo_router.config_warned.{:016x}",
        xxhash_rust::xxh3::xxh3_64(warning.as_bytes())
    )
}

#[cfg(test)]
mod tests {
    use crate::config::document::Config;

    #[test]
    fn a_removed_field_is_ignored_with_one_warning_per_envoy() {
        let json = |cost: &str| {
            format!(
                r#"{{"regions":[{{"name":"a","cluster":"a","capacity_rps":1}}],"cost":{cost}}}"#
            )
        };
        let c = Config::parse(json(r#"{"w_rtt":1.5,"placement_floor":0.5}"#).as_bytes()).unwrap();
        assert_eq!(c.cost.placement_floor, 0.5);
        assert_eq!(c.warnings.len(), 1);
        assert!(c.warnings[0].starts_with("cost.w_rtt is no longer a setting"));
        let mut store = crate::shared::store::MemoryStore::default();
        assert_eq!(c.unlogged_warnings(&mut store).len(), 1);
        assert!(c.unlogged_warnings(&mut store).is_empty(), "logged once");
        // Each section's removed fields, each said.
        let c = Config::parse(
            br#"{"regions":[{"name":"a","cluster":"a","capacity_rps":1}],
                "tuning":{"w_rtt_min":0.5,"w_rtt_max":2,"w_queue_max":3},"probe":{"rtt_alpha":0.3}}"#,
        )
        .unwrap();
        assert_eq!(c.warnings.len(), 4, "{:?}", c.warnings);
        assert!(
            c.warnings[2].starts_with("tuning.w_queue_max is no longer a setting")
                && c.warnings[2].contains("unweighted"),
            "{:?}",
            c.warnings
        );
        assert!(
            c.warnings[3].contains("probe.rtt_window"),
            "{:?}",
            c.warnings
        );
        // None set: no warning; a wrong field next to a removed one is
        // still refused.
        assert!(Config::parse(json(r#"{"placement_floor":0.5}"#).as_bytes())
            .unwrap()
            .warnings
            .is_empty());
        let e =
            Config::parse(json(r#"{"w_rtt":0.5,"placement_floorx":3}"#).as_bytes()).unwrap_err();
        assert!(e.to_string().contains("placement_floorx"), "{e}");
        // The name in another section is not the removed field.
        let e = Config::parse(
            br#"{"regions":[{"name":"a","cluster":"a","capacity_rps":1}],"probe":{"w_rtt":1}}"#,
        )
        .unwrap_err();
        assert!(e.to_string().contains("w_rtt"), "{e}");
    }
}
