//! The top-level modules import each other in one direction only (README's layout: `api` and
//! `runtime`, then `host`, `context`, the controllers, `tenancy`, `daemon`, the commands). A cycle
//! means a module cannot be read, tested or moved without the other; this test finds every one by
//! scanning `src/` for `crate::<module>` paths.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// For each (importer, imported) pair of top-level modules, the files (relative to `src/`) that
/// name the imported one.
type Edges = BTreeMap<(String, String), BTreeSet<String>>;

fn rust_files(dir: &Path, found: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()));
    for entry in entries {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            rust_files(&path, found);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            found.push(path);
        }
    }
}

/// The top-level modules: every directory and file of `src/` but the crate roots.
fn top_level_modules(src: &Path) -> BTreeSet<String> {
    let entries = std::fs::read_dir(src).expect("src/ is readable");
    entries
        .map(|entry| entry.expect("a directory entry").path())
        .filter_map(|path| {
            let stem = path.file_stem()?.to_str()?.to_string();
            let module = path.is_dir() || path.extension().is_some_and(|ext| ext == "rs");
            (module && stem != "lib" && stem != "main").then_some(stem)
        })
        .collect()
}

/// The top-level modules `source` names as `crate::<module>`, comments left out (a doc link is
/// no import).
fn named_modules<'a>(source: &'a str, modules: &'a BTreeSet<String>) -> impl Iterator<Item = &'a str> + 'a {
    source
        .lines()
        .filter(|line| !line.trim_start().starts_with("//"))
        .flat_map(|line| {
            line.match_indices("crate::")
                .map(move |(at, _)| &line[at + "crate::".len()..])
        })
        .filter_map(|rest| {
            let name = rest.split(|c: char| !(c.is_alphanumeric() || c == '_')).next()?;
            modules.get(name).map(String::as_str)
        })
}

fn edges(src: &Path) -> Edges {
    let modules = top_level_modules(src);
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut edges = Edges::new();
    for file in files {
        let relative = file.strip_prefix(src).expect("under src/");
        let owner = relative.components().next().expect("a first component");
        let owner = Path::new(owner.as_os_str())
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or_default();
        if !modules.contains(owner) {
            continue;
        }
        let source = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("cannot read {}: {e}", file.display()));
        for imported in named_modules(&source, &modules) {
            if imported != owner {
                edges
                    .entry((owner.to_string(), imported.to_string()))
                    .or_default()
                    .insert(relative.display().to_string());
            }
        }
    }
    edges
}

/// Every module `from` reaches by following edges, with the path that reaches it first.
fn reachable(from: &str, edges: &Edges) -> BTreeMap<String, Vec<String>> {
    let mut paths = BTreeMap::from([(from.to_string(), vec![from.to_string()])]);
    let mut queue = vec![from.to_string()];
    while let Some(module) = queue.pop() {
        let path = paths[&module].clone();
        for (importer, imported) in edges.keys() {
            if *importer == module && !paths.contains_key(imported) {
                let mut longer = path.clone();
                longer.push(imported.clone());
                paths.insert(imported.clone(), longer);
                queue.push(imported.clone());
            }
        }
    }
    paths
}

/// One line per cycle through an edge `a -> b` (b reaches a again), naming the files of each edge.
fn cycles(edges: &Edges) -> Vec<String> {
    let mut found = BTreeSet::new();
    for (importer, imported) in edges.keys() {
        let Some(back) = reachable(imported, edges).remove(importer) else {
            continue;
        };
        let mut cycle = vec![importer.clone()];
        cycle.extend(back);
        // The same cycle is found from each of its edges: keep the rotation starting at its smallest.
        let start = (0..cycle.len() - 1).min_by_key(|&i| &cycle[i]).unwrap_or(0);
        let rotated: Vec<String> = cycle[start..cycle.len() - 1]
            .iter()
            .chain(&cycle[..=start])
            .cloned()
            .collect();
        found.insert(rotated);
    }
    found
        .into_iter()
        .map(|cycle| {
            let steps: Vec<String> = cycle
                .windows(2)
                .map(|pair| {
                    let files = &edges[&(pair[0].clone(), pair[1].clone())];
                    let files: Vec<&str> = files.iter().map(String::as_str).collect();
                    format!("  {} -> {}: {}", pair[0], pair[1], files.join(", "))
                })
                .collect();
            format!("{}\n{}", cycle.join(" -> "), steps.join("\n"))
        })
        .collect()
}

#[test]
fn top_level_modules_import_each_other_without_cycles() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let edges = edges(&src);
    assert!(
        edges.contains_key(&("tenancy".to_string(), "context".to_string())),
        "the scan found no tenancy -> context import; is it still reading src/?"
    );
    let cycles = cycles(&edges);
    assert!(
        cycles.is_empty(),
        "top-level modules import each other in a cycle; move what both need to a lower module:\n{}",
        cycles.join("\n")
    );
}

#[test]
fn a_cycle_is_reported_with_the_files_of_each_edge() {
    let edge = |a: &str, b: &str, file: &str| ((a.to_string(), b.to_string()), BTreeSet::from([file.to_string()]));
    let edges = Edges::from([
        edge("pools", "inventory", "pools/hosts.rs"),
        edge("inventory", "tenancy", "inventory/mod.rs"),
        edge("tenancy", "pools", "tenancy/tenant.rs"),
        edge("tenancy", "api", "tenancy/tenant.rs"),
    ]);
    assert_eq!(
        cycles(&edges),
        vec![
            "inventory -> tenancy -> pools -> inventory\n  inventory -> tenancy: inventory/mod.rs\n  tenancy -> pools: tenancy/tenant.rs\n  pools -> inventory: pools/hosts.rs"
        ]
    );
}
