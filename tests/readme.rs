//! README.md stays the five-minute entry page it promises: at most 120
//! lines, and its minimal configuration is one the plugin accepts.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use llm_geo_router::config::Config;

fn readme() -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md");
    std::fs::read_to_string(path).unwrap()
}

#[test]
fn the_readme_is_at_most_120_lines() {
    let n = readme().lines().count();
    assert!(n <= 120, "README.md has {n} lines");
}

#[test]
fn the_readmes_minimal_configuration_is_accepted_with_its_two_regions() {
    let text = readme();
    let start = text.find("```json\n").expect("a ```json block") + "```json\n".len();
    let len = text[start..].find("```").expect("the block's end");
    let cfg = Config::parse(&text.as_bytes()[start..start + len]).unwrap();
    let names: Vec<&str> = cfg.regions.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["us_east", "eu_west"]);
}
