//! The top-level modules import each other in one direction only (README's layout: `api` and
//! `runtime`, then `host`, `context`, the controllers, `tenancy`, `daemon`, the commands), and so do
//! the sibling files of every folder below them. A cycle means a module cannot be read, tested or
//! moved without the other; these tests find every one by scanning `src/` for `crate::` and
//! `super::` paths (test modules and comments left out; a name re-exported by the folder's own
//! `mod.rs` is not followed to the file that defines it).
//!
//! The modules on [`PURE_MODULES`] decide without doing: the last tests fail when one of them names
//! a client, the async runtime or a controller's context.

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

/// The module path of a file relative to `src/`: `embedded/http.rs` is `embedded::http`, a
/// `mod.rs` is its folder's module.
fn module_path(relative: &Path) -> Vec<String> {
    let mut path: Vec<String> = relative
        .with_extension("")
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if path.last().is_some_and(|last| last == "mod") {
        path.pop();
    }
    path
}

/// `source` without comment lines and without its test module (tests may import anything).
fn non_test_code(source: &str) -> String {
    let lines: Vec<&str> = source.lines().collect();
    let test_module = lines.windows(2).position(|pair| {
        pair[0].trim() == "#[cfg(test)]" && pair[1].trim_start().trim_start_matches("pub ").starts_with("mod ")
    });
    lines[..test_module.unwrap_or(lines.len())]
        .iter()
        .filter(|line| !line.trim_start().starts_with("//"))
        .copied()
        .collect::<Vec<_>>()
        .join("\n")
}

/// The paths of a `use` tree or an inline path starting at `text` (`super::{a, b::{c, d}}` gives
/// `super::a`, `super::b::c`, `super::b::d`), each as its segments.
fn use_tree(text: &[char], mut at: usize) -> (Vec<Vec<String>>, usize) {
    let mut segments = Vec::new();
    loop {
        while at < text.len() && text[at].is_whitespace() {
            at += 1;
        }
        if text.get(at) == Some(&'{') {
            at += 1;
            let mut paths = Vec::new();
            loop {
                while at < text.len() && (text[at].is_whitespace() || text[at] == ',') {
                    at += 1;
                }
                if at >= text.len() || text[at] == '}' {
                    at += 1;
                    break;
                }
                let (inner, next) = use_tree(text, at);
                paths.extend(inner.into_iter().map(|tail| [segments.clone(), tail].concat()));
                at = next.max(at + 1);
            }
            return (paths, at);
        }
        let start = at;
        while at < text.len() && (text[at].is_alphanumeric() || text[at] == '_' || text[at] == '*') {
            at += 1;
        }
        if at == start {
            return (vec![segments], at);
        }
        segments.push(text[start..at].iter().collect());
        if text.get(at) == Some(&':') && text.get(at + 1) == Some(&':') {
            at += 2;
        } else {
            return (vec![segments], at);
        }
    }
}

/// Every `crate::` and `super::` path `source` names, as module paths from the crate root, for
/// the file of module `module`.
fn named_paths(source: &str, module: &[String]) -> Vec<Vec<String>> {
    let text: Vec<char> = source.chars().collect();
    let mut found = Vec::new();
    for at in 0..text.len() {
        let starts = |word: &str| text[at..].iter().take(word.len()).copied().eq(word.chars());
        let joined = at > 0 && (text[at - 1].is_alphanumeric() || text[at - 1] == '_' || text[at - 1] == ':');
        if joined || !(starts("crate::") || starts("super::")) {
            continue;
        }
        for path in use_tree(&text, at).0 {
            let mut resolved = if path[0] == "crate" {
                Vec::new()
            } else {
                module.to_vec()
            };
            let mut rest = &path[usize::from(path[0] == "crate")..];
            while rest.first().is_some_and(|s| s == "super") {
                resolved.pop();
                rest = &rest[1..];
            }
            resolved.extend(rest.iter().cloned());
            found.push(resolved);
        }
    }
    found
}

/// The modules of folder `dir`: its files and its subfolders.
fn folder_modules(dir: &Path) -> BTreeSet<String> {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()));
    entries
        .map(|entry| entry.expect("a directory entry").path())
        .filter_map(|path| {
            let stem = path.file_stem()?.to_str()?.to_string();
            let module = path.is_dir() || path.extension().is_some_and(|ext| ext == "rs");
            (module && stem != "mod").then_some(stem)
        })
        .collect()
}

/// For each (importer, imported) pair of sibling modules of a folder below the top level, named
/// `folder/module`, the files that name the imported one.
fn sibling_edges(src: &Path) -> Edges {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut edges = Edges::new();
    for file in files {
        let relative = file.strip_prefix(src).expect("under src/");
        let module = module_path(relative);
        let source = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("cannot read {}: {e}", file.display()));
        for path in named_paths(&non_test_code(&source), &module) {
            for depth in 1..module.len() {
                let folder = &module[..depth];
                if path.len() <= depth || path[..depth] != *folder || path[depth] == module[depth] {
                    continue;
                }
                let dir = folder.iter().fold(src.to_path_buf(), |dir, part| dir.join(part));
                let siblings = if dir.is_dir() {
                    folder_modules(&dir)
                } else {
                    BTreeSet::new()
                };
                if siblings.contains(&module[depth]) && siblings.contains(&path[depth]) {
                    let folder = folder.join("/");
                    let key = (
                        format!("{folder}/{}", module[depth]),
                        format!("{folder}/{}", path[depth]),
                    );
                    edges.entry(key).or_default().insert(relative.display().to_string());
                }
            }
        }
    }
    edges
}

/// Modules that decide without doing (planners, builders, status builders, rules): they take what
/// a reconcile read and return values, and the controllers read and write. Paths relative to
/// `src/`; a folder (ending in `/`) stands for every file in it.
const PURE_MODULES: &[&str] = &[
    "bounds.rs",
    "embedded/defaults.rs",
    "embedded/kinds.rs",
    "embedded/kinds/",
    "embedded/name_rules.rs",
    "embedded/patch_engine/",
    "embedded/schema.rs",
    "embedded/selectors.rs",
    "embedded/validation.rs",
    "inventory/asset/plan.rs",
    "inventory/asset/reach.rs",
    "inventory/asset/status.rs",
    "pools/buckets.rs",
    "pools/deployment/admin_kubeconfig.rs",
    "pools/deployment/installer.rs",
    "pools/deployment/plan.rs",
    "pools/deployment/status.rs",
    "pools/failure_domains.rs",
    "pools/host_selection.rs",
    "pools/install_config.rs",
    "pools/lease_state.rs",
    "pools/limits.rs",
    "pools/plan.rs",
    "pools/status.rs",
    "pools/version.rs",
    "runtime/shards/assign.rs",
    "stacks/install/crd_policy.rs",
    "stacks/pod_policy.rs",
    "stacks/stack/build.rs",
    "stacks/stack/deployment.rs",
    "stacks/stack/outcome.rs",
    "stacks/stack/rbac.rs",
    "stacks/stack/validate.rs",
];

/// What a pure module may not name: a client or its typed handles, the async runtime, and the
/// controllers' contexts (which carry both).
const IMPURE_NAMES: &[&str] = &[
    "Api",
    "Client",
    "tokio",
    "tokio_util",
    "async",
    "Ctx",
    "Shared",
    "TenantContext",
    "StackContext",
    "InstallContext",
];

/// The [`IMPURE_NAMES`] `source` uses outside its tests and comments, as whole words (`ApiError`
/// is no `Api`).
fn impure_names(source: &str) -> BTreeSet<&'static str> {
    let code = non_test_code(source);
    let words: BTreeSet<&str> = code
        .lines()
        .map(|line| line.split(" // ").next().unwrap_or_default())
        .flat_map(|line| line.split(|c: char| !(c.is_alphanumeric() || c == '_')))
        .collect();
    IMPURE_NAMES
        .iter()
        .copied()
        .filter(|name| words.contains(name))
        .collect()
}

/// The files of [`PURE_MODULES`], each one present (a moved module fails the test, so the list
/// cannot lose one unnoticed).
fn pure_files(src: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for module in PURE_MODULES {
        let path = src.join(module);
        if module.ends_with('/') {
            let mut in_folder = Vec::new();
            rust_files(&path, &mut in_folder);
            // A folder's `tests.rs` is its test module, which may use anything.
            files.extend(in_folder.into_iter().filter(|file| !file.ends_with("tests.rs")));
        } else {
            assert!(
                path.is_file(),
                "{module} is on PURE_MODULES but not in src/: update the list"
            );
            files.push(path);
        }
    }
    files
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

#[test]
fn sibling_files_of_a_folder_import_each_other_without_cycles() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let edges = sibling_edges(&src);
    assert!(
        edges.contains_key(&("stacks/install".to_string(), "stacks/unpack".to_string())),
        "the scan found no stacks/install -> stacks/unpack import; is it still reading src/?"
    );
    assert!(
        edges.contains_key(&("embedded/verbs".to_string(), "embedded/served".to_string())),
        "the scan found no embedded/verbs -> embedded/served import; is it still reading src/embedded/?"
    );
    let cycles = cycles(&edges);
    assert!(
        cycles.is_empty(),
        "sibling files import each other in a cycle; move what both need to a module of its own:\n{}",
        cycles.join("\n")
    );
}

#[test]
fn braced_and_nested_paths_resolve_to_the_sibling_they_name() {
    let module: Vec<String> = ["embedded", "http"].map(String::from).to_vec();
    let source = "use super::{verb::Verb, store::{Store, Write}};\nlet x = super::super::runtime::cause::diagnose(e);\nuse crate::embedded::watch;";
    let named = named_paths(source, &module);
    let shown: Vec<String> = named.iter().map(|path| path.join("::")).collect();
    assert_eq!(
        shown,
        [
            "embedded::verb::Verb",
            "embedded::store::Store",
            "embedded::store::Write",
            "runtime::cause::diagnose",
            "embedded::watch",
        ]
    );
}

#[test]
fn pure_modules_name_no_client_runtime_or_context() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let files = pure_files(&src);
    assert!(
        files.len() > PURE_MODULES.len(),
        "the folders of PURE_MODULES hold no file"
    );
    let impure: Vec<String> = files
        .iter()
        .filter_map(|file| {
            let source =
                std::fs::read_to_string(file).unwrap_or_else(|e| panic!("cannot read {}: {e}", file.display()));
            let names = impure_names(&source);
            let relative = file.strip_prefix(&src).expect("under src/").display();
            (!names.is_empty()).then(|| format!("  {relative}: {names:?}"))
        })
        .collect();
    assert!(
        impure.is_empty(),
        "a pure module names a client, the async runtime or a controller context; hand it the values \
         it decides from, and do the reading and writing in the controller:\n{}",
        impure.join("\n")
    );
}

#[test]
fn a_pure_module_naming_a_client_or_context_is_caught() {
    let source = "//! Pure: no Api, no Client.\nuse kube::{Api, ResourceExt};\nuse crate::runtime::ApiError;\n\
                  fn plan(ctx: &Ctx, budget: &ContextBudget) -> Plan { todo() } // not async\n\
                  #[cfg(test)]\nmod tests {\n    use tokio::time::sleep;\n}\n";
    assert_eq!(impure_names(source), BTreeSet::from(["Api", "Ctx"]));
    assert!(impure_names("fn plan(observed: &Observed) -> Plan { todo() }").is_empty());
}
