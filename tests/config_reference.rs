//! docs/CONFIG.md against the serde types: every field the plugin accepts
//! is documented there, and every JSON path documented there is a field.
//!
//! The fields come from serde itself: every configuration struct has
//! `deny_unknown_fields`, so an unknown key at a place in the document makes
//! the parse fail with "unknown field `…`, expected one of `a`, `b`, …",
//! which lists that struct's fields exactly.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeSet;

use llm_geo_router::config::Config;

const REGION: &str = r#"{"name":"near","cluster":"region_near","capacity_rps":1}"#;

/// Where each configuration struct sits, as (documented path prefix, a
/// document that puts an unknown key `zz_unknown` inside that struct, first,
/// before anything a missing required field could be reported for).
fn places() -> Vec<(&'static str, String)> {
    let with = |inner: &str| format!(r#"{{"regions":[{REGION}],{inner}}}"#);
    vec![
        ("", format!(r#"{{"zz_unknown":1,"regions":[{REGION}]}}"#)),
        (
            "regions[].",
            r#"{"regions":[{"zz_unknown":1,"name":"near","cluster":"c"}]}"#.to_string(),
        ),
        ("headers.", with(r#""headers":{"zz_unknown":1}"#)),
        ("prefix.", with(r#""prefix":{"zz_unknown":1}"#)),
        ("directory.", with(r#""directory":{"zz_unknown":1}"#)),
        ("cost.", with(r#""cost":{"zz_unknown":1}"#)),
        ("probe.", with(r#""probe":{"zz_unknown":1}"#)),
        ("ladder.", with(r#""ladder":{"zz_unknown":1}"#)),
        (
            "ladder.levels[].<tier>.",
            with(r#""ladder":{"levels":[{"free":{"zz_unknown":1}}]}"#),
        ),
        ("tiers.", with(r#""tiers":{"zz_unknown":1}"#)),
        ("residency.", with(r#""residency":{"zz_unknown":1}"#)),
        ("tuning.", with(r#""tuning":{"zz_unknown":1}"#)),
        ("migration.", with(r#""migration":{"zz_unknown":1}"#)),
        (
            "migration.model.",
            with(r#""migration":{"model":{"zz_unknown":1}}"#),
        ),
        (
            "migration.links[].",
            with(r#""migration":{"links":[{"zz_unknown":1}]}"#),
        ),
        ("release.", with(r#""release":{"zz_unknown":1}"#)),
        ("assessment.", with(r#""assessment":{"zz_unknown":1}"#)),
        ("context.", with(r#""context":{"zz_unknown":1}"#)),
        ("responses.", with(r#""responses":{"zz_unknown":1}"#)),
        ("prometheus.", with(r#""prometheus":{"zz_unknown":1}"#)),
        ("body_wait.", with(r#""body_wait":{"zz_unknown":1}"#)),
        ("exchange.", with(r#""exchange":{"zz_unknown":1}"#)),
    ]
}

/// The fields serde lists for the struct at `doc`'s unknown key.
fn fields(doc: &str) -> Vec<String> {
    let err = match serde_json::from_str::<Config>(doc) {
        Ok(_) => panic!("{doc}: an unknown key was accepted"),
        Err(e) => e.to_string(),
    };
    let list = err
        .split("expected one of ")
        .nth(1)
        .or_else(|| err.split("expected ").nth(1))
        .unwrap_or_else(|| panic!("{doc}: no field list in {err:?}"));
    let list = list.split(" at line").next().unwrap_or(list);
    // serde writes `a`, `a or b`, or `a, b, c` (and, for several, `…, or z`
    // in some versions).
    list.split(", ")
        .flat_map(|f| f.split(" or "))
        .map(|f| {
            f.trim()
                .trim_start_matches("or ")
                .trim_matches('`')
                .to_string()
        })
        .filter(|f| !f.is_empty())
        .collect()
}

/// The backticked first cells of the tables of docs/CONFIG.md that describe
/// configuration paths.
fn documented() -> BTreeSet<String> {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/CONFIG.md"))
        .expect("docs/CONFIG.md");
    let mut out = BTreeSet::new();
    let mut in_config_table = false;
    for line in doc.lines() {
        if line.starts_with("| JSON path |") {
            in_config_table = true;
            continue;
        }
        if !line.starts_with('|') {
            in_config_table = false;
            continue;
        }
        if !in_config_table || line.starts_with("|---") {
            continue;
        }
        let first = line.split('|').nth(1).unwrap_or("").trim();
        if let Some(path) = first.strip_prefix('`').and_then(|s| s.strip_suffix('`')) {
            out.insert(path.to_string());
        }
    }
    out
}

/// Whether serde refuses `doc` for its unknown key `zz_unknown`, that is,
/// whether the value holding that key is a configuration struct.
fn is_struct_place(doc: &str) -> bool {
    match serde_json::from_str::<Config>(doc) {
        Ok(_) => false,
        Err(e) => e.to_string().contains("unknown field `zz_unknown`"),
    }
}

#[test]
fn every_top_level_section_has_a_place() {
    // A section missing from `places()` is never compared with
    // docs/CONFIG.md (as `exchange.` once was): every top-level field whose
    // value is a struct, or an array of structs, must have its place.
    let all = places();
    let places: BTreeSet<&str> = all.iter().map(|(p, _)| *p).collect();
    let top = all
        .iter()
        .find(|(p, _)| p.is_empty())
        .map(|(_, d)| d.as_str())
        .expect("the top level's place");
    let mut missing = Vec::new();
    for f in fields(top) {
        let object = if f == "regions" {
            r#"{"regions":{"zz_unknown":1}}"#.to_string()
        } else {
            format!(r#"{{"regions":[{REGION}],"{f}":{{"zz_unknown":1}}}}"#)
        };
        let array = if f == "regions" {
            r#"{"regions":[{"zz_unknown":1}]}"#.to_string()
        } else {
            format!(r#"{{"regions":[{REGION}],"{f}":[{{"zz_unknown":1}}]}}"#)
        };
        if is_struct_place(&object) && !places.contains(format!("{f}.").as_str()) {
            missing.push(format!("{f}."));
        }
        if is_struct_place(&array) && !places.contains(format!("{f}[].").as_str()) {
            missing.push(format!("{f}[]."));
        }
    }
    assert!(
        missing.is_empty(),
        "configuration sections not compared with docs/CONFIG.md (add them to places()): {missing:?}"
    );
}

#[test]
fn every_field_is_documented_and_every_documented_path_is_a_field() {
    let documented = documented();
    assert!(
        documented.len() > 50,
        "found only {} documented paths",
        documented.len()
    );
    let mut accepted = BTreeSet::new();
    for (prefix, doc) in places() {
        for f in fields(&doc) {
            accepted.insert(format!("{prefix}{f}"));
        }
    }
    let undocumented: Vec<_> = accepted.difference(&documented).collect();
    let unknown: Vec<_> = documented.difference(&accepted).collect();
    assert!(
        undocumented.is_empty() && unknown.is_empty(),
        "fields missing from docs/CONFIG.md: {undocumented:?}; documented paths that are not fields: {unknown:?}"
    );
}

#[test]
fn the_documented_full_example_parses() {
    // The "every field with its default" example in docs/CONFIG.md, if it
    // has one, must be accepted as it stands.
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/CONFIG.md"))
        .expect("docs/CONFIG.md");
    let mut blocks = Vec::new();
    let mut current: Option<String> = None;
    for line in doc.lines() {
        match (&mut current, line.trim_start()) {
            (None, l) if l.starts_with("```json") => current = Some(String::new()),
            (Some(b), l) if l.starts_with("```") => {
                blocks.push(std::mem::take(b));
                current = None;
            }
            (Some(b), _) => {
                b.push_str(line);
                b.push('\n');
            }
            _ => {}
        }
    }
    let full: Vec<_> = blocks
        .iter()
        .filter(|b| b.contains("\"regions\"") && b.contains("\"cost\""))
        .collect();
    assert!(
        !full.is_empty(),
        "no full configuration example in docs/CONFIG.md"
    );
    for b in full {
        if let Err(e) = Config::parse(b.as_bytes()) {
            panic!("docs/CONFIG.md example refused: {e}\n{b}");
        }
    }
}
