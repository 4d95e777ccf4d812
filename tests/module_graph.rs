//! The plugin's modules form no import cycle: each core module depends only
//! on modules below it, and only the host layer (`host`) uses proxy-wasm.
//! Read from the source: every `crate::<module>` (or
//! `crate::<folder>::<module>`) a file names is an edge; the nodes are
//! files (`decision::cost`), each folder's `mod.rs` only declares them.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// A file's module path under `src/`: `decision::cost` for
/// `src/decision/cost.rs`, `decision` for its `mod.rs`, `config::regions`
/// for `src/config/regions.rs`.
fn module_of(path: &Path, src: &Path) -> String {
    let rel = path.strip_prefix(src).unwrap_or(path);
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if let Some(last) = parts.last_mut() {
        *last = last.trim_end_matches(".rs").to_string();
    }
    if parts.len() > 1 && parts.last().is_some_and(|l| l == "mod") {
        parts.pop();
    }
    parts.join("::")
}

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let p = entry.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

/// Every `crate::<path>` a file names outside its tests is an edge to the
/// longest prefix of that path that is a file (`crate::decision::cost::X`
/// is `decision::cost`; `crate::config::regions::Region` is
/// `config::regions` once `config` is a folder). A folder's `mod.rs` depends
/// on the files it declares, since it re-exports them.
fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let nodes: BTreeSet<String> = files.iter().map(|f| module_of(f, &src)).collect();
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in files {
        let from = module_of(&f, &src);
        if from == "lib" {
            continue;
        }
        let text = std::fs::read_to_string(&f).unwrap();
        // Test modules may use anything.
        let code = text.split("#[cfg(test)]").next().unwrap_or("");
        let edges = g.entry(from.clone()).or_default();
        for (i, _) in code.match_indices("crate::") {
            let mut rest = &code[i + 7..];
            let mut path = String::new();
            let mut found = String::new();
            loop {
                let part = ident(rest);
                if part.is_empty() {
                    break;
                }
                if !path.is_empty() {
                    path.push_str("::");
                }
                path.push_str(&part);
                if nodes.contains(&path) {
                    found = path.clone();
                }
                match rest.get(part.len()..).and_then(|r| r.strip_prefix("::")) {
                    Some(next) => rest = next,
                    None => break,
                }
            }
            if !found.is_empty() && found != from {
                edges.insert(found);
            }
        }
        if f.file_name().is_some_and(|n| n == "mod.rs") {
            for line in code.lines() {
                let l = line.trim_start();
                let l = l.strip_prefix("pub ").unwrap_or(l);
                let l = l.strip_prefix("pub(crate) ").unwrap_or(l);
                if let Some(m) = l.strip_prefix("mod ") {
                    let m = ident(m);
                    if !m.is_empty() {
                        edges.insert(format!("{from}::{m}"));
                    }
                }
            }
        }
    }
    g
}

fn cycle_from(
    g: &BTreeMap<String, BTreeSet<String>>,
    node: &str,
    path: &mut Vec<String>,
    done: &mut BTreeSet<String>,
) -> Option<Vec<String>> {
    if let Some(at) = path.iter().position(|n| n == node) {
        let mut c = path[at..].to_vec();
        c.push(node.to_string());
        return Some(c);
    }
    if done.contains(node) {
        return None;
    }
    path.push(node.to_string());
    for next in g.get(node).into_iter().flatten() {
        if let Some(c) = cycle_from(g, next, path, done) {
            return Some(c);
        }
    }
    path.pop();
    done.insert(node.to_string());
    None
}

#[test]
fn no_import_cycles_in_src() {
    let g = graph();
    assert!(g.len() > 30, "read {} modules", g.len());
    let mut done = BTreeSet::new();
    for node in g.keys() {
        let cycle = cycle_from(&g, node, &mut Vec::new(), &mut done);
        assert!(
            cycle.is_none(),
            "import cycle: {}",
            cycle.unwrap().join(" -> ")
        );
    }
}

#[test]
fn only_the_host_layer_uses_proxy_wasm_and_no_core_module_uses_the_host() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    for f in files {
        let module = module_of(&f, &src);
        let text = std::fs::read_to_string(&f).unwrap();
        if !module.starts_with("host") && module != "lib" {
            assert!(
                !text.contains("proxy_wasm"),
                "{} uses proxy_wasm",
                f.display()
            );
        }
    }
    for (module, edges) in graph() {
        if !module.starts_with("host") {
            assert!(
                !edges.iter().any(|e| e == "host" || e.starts_with("host::")),
                "{module} imports the host layer"
            );
        }
    }
}

/// The layout the architecture is read from: no folder under `src/` holds
/// more than 12 files, at most 8 files sit directly in `src/`, and no file
/// runs past 800 lines before its `#[cfg(test)]` tests (issue 29).
#[test]
fn folders_stay_small_and_files_short() {
    const FOLDER_FILES: usize = 12;
    const TOP_FILES: usize = 8;
    const LINES_BEFORE_TESTS: usize = 800;
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut per_folder: BTreeMap<std::path::PathBuf, usize> = BTreeMap::new();
    let mut problems = Vec::new();
    for f in &files {
        let folder = f.parent().unwrap().to_path_buf();
        *per_folder.entry(folder).or_default() += 1;
        let text = std::fs::read_to_string(f).unwrap();
        let before_tests = text
            .lines()
            .position(|l| l.trim_start() == "#[cfg(test)]")
            .unwrap_or_else(|| text.lines().count());
        if before_tests > LINES_BEFORE_TESTS {
            problems.push(format!(
                "{} runs {before_tests} lines before its tests (at most {LINES_BEFORE_TESTS})",
                f.strip_prefix(&src).unwrap().display()
            ));
        }
    }
    for (folder, n) in &per_folder {
        let (limit, name) = if *folder == src {
            (TOP_FILES, "src/".to_string())
        } else {
            let rel = folder.strip_prefix(&src).unwrap().display().to_string();
            (FOLDER_FILES, format!("src/{rel}/"))
        };
        if *n > limit {
            problems.push(format!("{name} holds {n} files (at most {limit})"));
        }
    }
    assert!(problems.is_empty(), "layout: {}", problems.join("; "));
}
