//! The bounds stackd holds every document it builds from tenant input to (DESIGN.md §8 "Blast
//! radius", §10): install configs with their inlined credentials and templates, the Secret data read
//! to render them, the Secrets stackd writes (to the tenant and the host), the installer's output
//! Secret, a stack package's install output and what is kept of it, and what stackd tells users
//! about any of them (condition messages, Event notes, a package's problems). What stackd *caches*
//! of a tenant's objects is bounded per object, namespace and tenant by
//! [`crate::runtime::memory_budget`]. One place owns them and their defaults; the operator sets some by flag
//! ([`DocumentLimits`]). Each is checked *before* the work or the allocation it bounds: a Secret's
//! size is known from its (bounded) read before its values are copied anywhere, a render adds up
//! what it will inline before it builds it ([`RenderBudget`]), and a JSON document is measured by a
//! walk that stops at the first bound it passes ([`measure`]), never recursing, so neither a huge
//! nor a deeply nested document can exhaust memory or the thread's stack while it is measured.
//!
//! The test at the end walks the source for the places that build such documents and fails when one
//! does not go through this module.

use std::fmt::{self, Write};

use k8s_openapi::api::core::v1::Secret;
use serde_json::Value;

use crate::runtime::memory_budget::ByteSize;

/// The largest install config stackd renders, serialized as compact JSON.
pub(crate) const MAX_CONFIG_BYTES: usize = 1 << 20;
/// The deepest nesting of lists and mappings in an install config stackd renders (a real one nests
/// fewer than ten levels). `serde_json::Value`'s clone, drop and serialization recurse, so a
/// document must never get far past this.
pub(crate) const MAX_CONFIG_DEPTH: usize = 64;

/// The most data a Secret holds (Kubernetes refuses more): stackd writes none larger, and says why
/// instead of sending one the API server would refuse.
pub(crate) const MAX_WRITTEN_SECRET_BYTES: usize = 1 << 20;

/// `--max-render-secret-bytes` when not given: a template, pull secret or credentials Secret of a
/// real tenant is a few KiB; half a MiB leaves room for big templates and bundles of CAs.
pub const DEFAULT_RENDER_SECRET_BYTES: &str = "512Ki";
/// `--max-render-bytes` when not given: the install config's own bound, which what a render inlines
/// must fit in anyway.
pub const DEFAULT_RENDER_BYTES: &str = "1Mi";
/// `--namespace-render-bytes-per-second` and `--namespace-render-burst-bytes`.
pub const DEFAULT_RENDER_SHARE_PER_SECOND: &str = "4Mi";
pub const DEFAULT_RENDER_SHARE_BURST: &str = "32Mi";
/// `--max-installer-output-bytes` when not given: the keys stackd reads ([`OUTPUT_KEYS`]) at their
/// most, where a real installer writes some 10 KiB.
pub const DEFAULT_INSTALLER_OUTPUT_BYTES: &str = "320Ki";
/// `--max-installer-output-keys` when not given: an installer writes two.
pub const DEFAULT_INSTALLER_OUTPUT_KEYS: usize = 8;

/// The keys stackd reads from the installer's output Secret, and how many bytes of each at most
/// (checked before anything is parsed): an admin kubeconfig with its certificates is some 10 KiB,
/// `metadata.json` a few hundred bytes.
pub(crate) const OUTPUT_KEYS: [(&str, usize); 2] = [("kubeconfig", 256 * 1024), ("metadata.json", 64 * 1024)];

/// The bounds an operator sets by flag; [`DocumentLimits::default`] are the flags' defaults, which
/// a normal tenant never meets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DocumentLimits {
    /// Data (keys and values) of one tenant Secret read to render a document: an install-config
    /// template, a pull secret, platform or BMC credentials (`--max-render-secret-bytes`).
    pub render_secret_bytes: usize,
    /// Secret data one render reads and inlines in total: every host's BMC credentials of one
    /// cluster, the template, pull secret and credentials of one pool (`--max-render-bytes`).
    pub render_bytes: usize,
    /// Data of the installer's output Secret (`--max-installer-output-bytes`).
    pub installer_output_bytes: usize,
    /// Keys of the installer's output Secret (`--max-installer-output-keys`).
    pub installer_output_keys: usize,
    /// The render work (Secret bytes read, install-config bytes measured after each patch) one
    /// tenant namespace may cause a second on average (`--namespace-render-bytes-per-second`),
    /// and at once (`--namespace-render-burst-bytes`).
    pub render_share_per_second: u64,
    pub render_share_burst: u64,
}

impl Default for DocumentLimits {
    fn default() -> Self {
        DocumentLimits {
            render_secret_bytes: 512 << 10,
            render_bytes: MAX_CONFIG_BYTES,
            installer_output_bytes: 320 << 10,
            installer_output_keys: DEFAULT_INSTALLER_OUTPUT_KEYS,
            render_share_per_second: 4 << 20,
            render_share_burst: 32 << 20,
        }
    }
}

/// A bound tenant input passed, as the condition and Event on its object say it: the field, its
/// size, the limit, the flag that sets it and how to fix it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Refused {
    /// What passed the bound: `Secret team/bmc (its largest key password)`, say.
    pub field: String,
    message: String,
}

impl Refused {
    /// `field` is `bytes`, over the `limit` stackd `what` (`flag`); `fix`.
    fn bytes(field: String, bytes: usize, limit: usize, what: &str, flag: &str, fix: &str) -> Refused {
        let (size, limit) = (ByteSize(bytes as u64), ByteSize(limit as u64));
        let message = format!("{field} is {size}, over the {limit} stackd {what} ({flag}); {fix}");
        Refused { field, message }
    }
}

/// The condition reason and Event reason of an object refused for one of these bounds.
pub(crate) const DOCUMENT_TOO_LARGE: &str = "DocumentTooLarge";

/// The size of a Secret's data: every key and value, `data` and `stringData`.
pub(crate) fn secret_data_bytes(secret: &Secret) -> usize {
    let data = secret.data.iter().flatten().map(|(k, v)| k.len() + v.0.len());
    let strings = secret.string_data.iter().flatten().map(|(k, v)| k.len() + v.len());
    data.chain(strings).fold(0, usize::saturating_add)
}

/// The largest key of a Secret's data, to name in a refusal.
fn largest_key(secret: &Secret) -> Option<&str> {
    let data = secret.data.iter().flatten().map(|(k, v)| (k, v.0.len()));
    let strings = secret.string_data.iter().flatten().map(|(k, v)| (k, v.len()));
    data.chain(strings).max_by_key(|(_, len)| *len).map(|(k, _)| k.as_str())
}

/// `Secret ns/name (key k)`, naming the Secret's largest key.
fn secret_field(namespace: &str, secret: &Secret) -> String {
    let name = secret.metadata.name.as_deref().unwrap_or_default();
    match largest_key(secret) {
        Some(key) => format!("Secret {namespace}/{name} (its largest key {key})"),
        None => format!("Secret {namespace}/{name}"),
    }
}

impl DocumentLimits {
    /// A tenant Secret read to render a document, checked as soon as it is read: nothing of it is
    /// copied or parsed past this bound.
    pub(crate) fn render_secret(&self, namespace: &str, secret: &Secret) -> Result<usize, Refused> {
        let bytes = secret_data_bytes(secret);
        if bytes > self.render_secret_bytes {
            return Err(Refused::bytes(
                secret_field(namespace, secret),
                bytes,
                self.render_secret_bytes,
                "reads from one Secret to render a document",
                "--max-render-secret-bytes",
                "make the Secret smaller",
            ));
        }
        Ok(bytes)
    }

    /// A budget for one render's Secret data.
    pub(crate) fn render_budget(&self) -> RenderBudget {
        RenderBudget {
            limit: self.render_bytes,
            used: 0,
        }
    }

    /// The installer's output Secret, checked from the cached copy before any of it is read.
    pub(crate) fn installer_output(&self, namespace: &str, secret: &Secret) -> Result<(), Refused> {
        let keys = secret.data.as_ref().map_or(0, |d| d.len()) + secret.string_data.as_ref().map_or(0, |d| d.len());
        let name = secret.metadata.name.as_deref().unwrap_or_default();
        if keys > self.installer_output_keys {
            let field = format!("host Secret {namespace}/{name}");
            let message = format!(
                "{field} has {keys} keys, more than the {} stackd reads from an installer's output (--max-installer-output-keys); the installer must write only kubeconfig and metadata.json",
                self.installer_output_keys
            );
            return Err(Refused { field, message });
        }
        let bytes = secret_data_bytes(secret);
        if bytes > self.installer_output_bytes {
            return Err(Refused::bytes(
                format!("host Secret {namespace}/{name}"),
                bytes,
                self.installer_output_bytes,
                "reads from an installer's output",
                "--max-installer-output-bytes",
                "the installer must write less",
            ));
        }
        Ok(())
    }
}

/// Secret data one render has read so far, against `--max-render-bytes`: charged *before* what is
/// charged is built into the document.
#[derive(Debug)]
pub(crate) struct RenderBudget {
    limit: usize,
    used: usize,
}

impl RenderBudget {
    /// Adds `bytes` that `field` brings into the render; refused past the bound, naming `field`.
    pub(crate) fn charge(&mut self, bytes: usize, field: impl FnOnce() -> String) -> Result<(), Refused> {
        self.used = self.used.saturating_add(bytes);
        if self.used > self.limit {
            return Err(Refused::bytes(
                field(),
                self.used,
                self.limit,
                "reads and inlines to render one document",
                "--max-render-bytes",
                "use smaller Secrets, or fewer of them for one cluster",
            ));
        }
        Ok(())
    }
}

/// A Secret stackd is about to write (to the tenant or the host), checked before the request: one
/// the API server would refuse is not sent, and the object it is for says why.
pub(crate) fn written_secret(namespace: &str, secret: &Secret) -> Result<(), Refused> {
    let name = secret.metadata.name.as_deref().unwrap_or_default();
    written_bytes(|| format!("the Secret {namespace}/{name}"), secret_data_bytes(secret))
}

/// [`written_secret`] for data of `bytes` that `field` would be, measured before it is built.
pub(crate) fn written_bytes(field: impl FnOnce() -> String, bytes: usize) -> Result<(), Refused> {
    if bytes > MAX_WRITTEN_SECRET_BYTES {
        return Err(Refused::bytes(
            field(),
            bytes,
            MAX_WRITTEN_SECRET_BYTES,
            "writes into one Secret (the most a Kubernetes Secret holds)",
            "not configurable",
            "make the template, patches or Secrets it is built from smaller",
        ));
    }
    Ok(())
}

/// What stackd tells users (condition messages, Event notes) fits kube-apiserver's limits; defined
/// beside the runtime that writes them, which this module sits above.
pub use crate::runtime::text_bounds::{CUT_MARK, MAX_CONDITION_MESSAGE_BYTES, MAX_EVENT_NOTE_BYTES, fit_text};

/// The largest install output stream of a stack package, both when it is written and when it is
/// read: its CRDs, its controller's Deployment, its metadata.
pub const MAX_INSTALL_STREAM_BYTES: usize = 8 * 1024 * 1024;
/// Install output kept at most per install controller (one tenant, one install kind) between its
/// read and its apply. A package is a few KiB to a few hundred; a tenant making many large ones
/// pending costs it re-reads when they are applied, not memory.
pub const MAX_KEPT_PACKAGE_BYTES: usize = 1024 * 1024;
/// The largest UI metadata file of a package read (a readme, a ui-schema, an icon).
pub const MAX_UI_METADATA_FILE_BYTES: u64 = 64 * 1024;
/// The most UI annotations one CRD carries, in bytes of values.
pub const MAX_UI_METADATA_CRD_BYTES: usize = 128 * 1024;
/// The most problems of one package told in full (the rest are counted).
pub const MAX_PACKAGE_PROBLEMS: usize = 20;

/// The most a stack's token copy on the host holds (its token, CA bundle and namespace; a real one
/// is a few KiB): the tenant Secret it is copied from lies in a namespace tenant users can write.
pub(crate) const MAX_TOKEN_COPY_BYTES: usize = 64 << 10;

/// A stack's token copy of `bytes`, checked before it is built.
pub(crate) fn token_copy(field: impl FnOnce() -> String, bytes: usize) -> Result<(), Refused> {
    if bytes > MAX_TOKEN_COPY_BYTES {
        return Err(Refused::bytes(
            field(),
            bytes,
            MAX_TOKEN_COPY_BYTES,
            "copies of a stack's token to the host",
            "not configurable",
            "delete the token Secret: stackd makes it again and the tenant's token controller fills it",
        ));
    }
    Ok(())
}

/// The most data a host Secret stackd writes may hold: what Kubernetes allows, and what, written as
/// JSON (base64, some 4/3 of it, and its metadata), stackd's own cache still reads back under
/// `--max-cached-object-bytes` (`max_cached`).
pub fn host_secret_limit(max_cached: ByteSize) -> usize {
    let cached = usize::try_from(max_cached.0).unwrap_or(usize::MAX);
    MAX_WRITTEN_SECRET_BYTES.min(cached.saturating_sub(HOST_SECRET_METADATA) / 4 * 3)
}

/// Room left for a host Secret's metadata (labels, annotations, managed fields) in its JSON.
const HOST_SECRET_METADATA: usize = 8 << 10;

/// [`written_bytes`] for a host Secret held to `limit` ([`host_secret_limit`]).
pub(crate) fn host_secret_bytes(field: impl FnOnce() -> String, bytes: usize, limit: usize) -> Result<(), Refused> {
    if bytes > limit {
        return Err(Refused::bytes(
            field(),
            bytes,
            limit,
            "writes into one host Secret (it must fit --max-cached-object-bytes as JSON, and a Kubernetes Secret)",
            "--max-cached-object-bytes",
            "make the template, patches or Secrets it is built from smaller",
        ));
    }
    Ok(())
}

/// A document stackd renders as it writes it, stopped past `limit` (what is left for it in the
/// installer's input Secret, [`host_secret_limit`], beside the Secrets copied there) before its
/// length is known.
pub(crate) fn rendered_too_long(field: String, limit: usize) -> Refused {
    let limit = ByteSize(limit as u64);
    let message = format!(
        "{field} would be larger than the {limit} left for it in the installer's input Secret (which holds the pull secret and credentials too, and must fit --max-cached-object-bytes as JSON); make the template or patches it is built from smaller, or nest them less deeply"
    );
    Refused { field, message }
}

/// The bounds a document is held to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Bounds {
    pub(crate) max_bytes: usize,
    pub(crate) max_depth: usize,
}

/// The install config's bounds.
pub(crate) const INSTALL_CONFIG: Bounds = Bounds {
    max_bytes: MAX_CONFIG_BYTES,
    max_depth: MAX_CONFIG_DEPTH,
};

/// Which bound a document passed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Exceeded {
    #[error("it would be larger than {} serialized, the most stackd renders", show_bytes(*max_bytes))]
    Size { max_bytes: usize },
    #[error("it would nest lists and mappings deeper than {max_depth} levels, the most stackd renders")]
    Depth { max_depth: usize },
}

/// `1 MiB` for 1048576, else the bytes.
fn show_bytes(bytes: usize) -> String {
    if bytes >= 1 << 20 && bytes.is_multiple_of(1 << 20) {
        format!("{} MiB", bytes >> 20)
    } else if bytes >= 1 << 10 && bytes.is_multiple_of(1 << 10) {
        format!("{} KiB", bytes >> 10)
    } else {
        format!("{bytes} bytes")
    }
}

/// What a document within its bounds measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Measured {
    /// Its length as compact JSON (`serde_json::to_string`).
    pub(crate) bytes: usize,
    /// Levels of lists and mappings: 0 for a scalar, 1 for `{"a": 1}`.
    pub(crate) depth: usize,
    /// Values in it (scalars, lists and mappings): what copying or walking it costs beside its bytes.
    pub(crate) nodes: usize,
}

/// Where the walk is inside one list or mapping.
enum Frame<'a> {
    List(std::slice::Iter<'a, Value>),
    Mapping(serde_json::map::Iter<'a>),
}

/// Measures `value`, stopping at the first bound it passes. The work done is bounded by
/// `bounds.max_bytes` (every node adds at least one byte) and the memory by `bounds.max_depth`.
pub(crate) fn measure(value: &Value, bounds: Bounds) -> Result<Measured, Exceeded> {
    let mut walk = Walk {
        bounds,
        bytes: 0,
        depth: 0,
        nodes: 0,
        stack: Vec::new(),
    };
    walk.enter(value)?;
    while let Some(frame) = walk.stack.last_mut() {
        let next = match frame {
            Frame::List(items) => items.next(),
            Frame::Mapping(entries) => entries.next().map(|(key, value)| {
                // The key, quoted, and its colon.
                walk.bytes = walk.bytes.saturating_add(string_length(key) + 1);
                value
            }),
        };
        match next {
            Some(child) => walk.enter(child)?,
            None => {
                walk.stack.pop();
            }
        }
    }
    Ok(Measured {
        bytes: walk.bytes,
        depth: walk.depth,
        nodes: walk.nodes,
    })
}

struct Walk<'a> {
    bounds: Bounds,
    bytes: usize,
    depth: usize,
    nodes: usize,
    stack: Vec<Frame<'a>>,
}

impl<'a> Walk<'a> {
    /// Counts `value`'s own bytes (brackets and separators for a list or mapping, whose items come
    /// later) and steps into it.
    fn enter(&mut self, value: &'a Value) -> Result<(), Exceeded> {
        let own = match value {
            Value::Null | Value::Bool(true) => 4,
            Value::Bool(false) => 5,
            Value::Number(number) => display_length(number),
            Value::String(text) => string_length(text),
            Value::Array(items) => {
                self.stack.push(Frame::List(items.iter()));
                2 + items.len().saturating_sub(1)
            }
            Value::Object(entries) => {
                self.stack.push(Frame::Mapping(entries.iter()));
                2 + entries.len().saturating_sub(1)
            }
        };
        self.nodes += 1;
        self.depth = self.depth.max(self.stack.len());
        if self.stack.len() > self.bounds.max_depth {
            return Err(Exceeded::Depth {
                max_depth: self.bounds.max_depth,
            });
        }
        self.bytes = self.bytes.saturating_add(own);
        if self.bytes > self.bounds.max_bytes {
            return Err(Exceeded::Size {
                max_bytes: self.bounds.max_bytes,
            });
        }
        Ok(())
    }
}

/// The length of `text` as a JSON string, quotes and escapes included (as serde_json writes it).
fn string_length(text: &str) -> usize {
    let escapes: usize = text
        .bytes()
        .map(|byte| match byte {
            b'"' | b'\\' | b'\n' | b'\r' | b'\t' | 0x08 | 0x0c => 1,
            0x00..=0x1f => 5,
            _ => 0,
        })
        .sum();
    text.len() + escapes + 2
}

/// The length of `shown`'s text, without allocating it.
fn display_length(shown: &impl fmt::Display) -> usize {
    struct Count(usize);
    impl Write for Count {
        fn write_str(&mut self, s: &str) -> fmt::Result {
            self.0 += s.len();
            Ok(())
        }
    }
    let mut count = Count(0);
    let _ = write!(count, "{shown}");
    count.0
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    const WIDE: Bounds = Bounds {
        max_bytes: usize::MAX,
        max_depth: 1000,
    };

    #[test]
    fn the_size_is_the_compact_json_length() {
        for value in [
            json!(null),
            json!(false),
            json!(-12.5e300),
            json!(18446744073709551615u64),
            json!("plain"),
            json!("quote \" backslash \\ newline \n bell \u{7} tab \t é"),
            json!([]),
            json!({}),
            json!([1, [2, [3]], {"a": [], "b\"": {"c": null}}]),
            json!({"apiVersion": "v1", "metadata": {"name": "x"}, "list": [true, "on", 1e3]}),
        ] {
            let measured = measure(&value, WIDE).unwrap();
            assert_eq!(measured.bytes, serde_json::to_string(&value).unwrap().len(), "{value}");
        }
    }

    #[test]
    fn depth_counts_levels_of_lists_and_mappings() {
        assert_eq!(measure(&json!("x"), WIDE).unwrap().depth, 0);
        assert_eq!(measure(&json!({"a": 1}), WIDE).unwrap().depth, 1);
        assert_eq!(measure(&json!({"a": [[{}]], "b": []}), WIDE).unwrap().depth, 4);
    }

    #[test]
    fn a_document_past_a_bound_says_which() {
        let tight = Bounds {
            max_bytes: 10,
            max_depth: 2,
        };
        assert_eq!(
            measure(&json!({"a": "0123456789"}), tight),
            Err(Exceeded::Size { max_bytes: 10 })
        );
        assert_eq!(measure(&json!([[[]]]), tight), Err(Exceeded::Depth { max_depth: 2 }));
        assert_eq!(measure(&json!([[1]]), tight).unwrap().depth, 2);
        let message = Exceeded::Size {
            max_bytes: MAX_CONFIG_BYTES,
        }
        .to_string();
        assert!(message.contains("larger than 1 MiB serialized"), "{message}");
    }

    #[test]
    fn a_huge_document_is_measured_only_up_to_the_bound() {
        // A million elements: the walk stops after about a hundred of them.
        let huge = Value::Array(vec![json!(0); 1_000_000]);
        let bounds = Bounds {
            max_bytes: 200,
            max_depth: 4,
        };
        assert_eq!(measure(&huge, bounds), Err(Exceeded::Size { max_bytes: 200 }));
    }

    #[test]
    fn a_deep_document_is_measured_without_recursion() {
        // Built and torn down iteratively: Value's own drop would recurse 100000 levels.
        let mut deep = json!(0);
        for _ in 0..100_000 {
            deep = Value::Array(vec![deep]);
        }
        assert_eq!(
            measure(&deep, INSTALL_CONFIG),
            Err(Exceeded::Depth {
                max_depth: MAX_CONFIG_DEPTH
            })
        );
        let mut rest = deep;
        while let Value::Array(mut items) = rest {
            rest = items.pop().unwrap_or(Value::Null);
        }
    }

    /// Conditions and Events are built in one place each, which fits what they say to these bounds.
    #[test]
    fn conditions_and_events_are_built_only_where_their_text_is_bounded() {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut dirs = vec![src.clone()];
        let mut builders = Vec::new();
        while let Some(dir) = dirs.pop() {
            for entry in std::fs::read_dir(&dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    dirs.push(path);
                    continue;
                }
                let relative = path.strip_prefix(&src).unwrap().display().to_string();
                if relative.starts_with("embedded/") || relative.starts_with("bench/") {
                    continue;
                }
                let text = std::fs::read_to_string(&path).unwrap_or_default();
                let code = text.split("#[cfg(test)]").next().unwrap_or_default();
                let builds = code.lines().map(str::trim_start).any(|line| {
                    !line.starts_with("//")
                        && ["Condition {", "Event {"]
                            .iter()
                            .any(|literal| line.starts_with(literal) || line.contains(&format!("({literal}")))
                });
                if builds {
                    builders.push(relative);
                }
            }
        }
        builders.sort();
        assert_eq!(builders, ["runtime/conditions.rs", "runtime/events.rs"]);
        for file in builders {
            let text = std::fs::read_to_string(src.join(&file)).unwrap();
            assert!(
                text.contains("text_bounds::"),
                "{file} builds text without runtime::text_bounds"
            );
        }
    }

    #[test]
    fn a_text_is_cut_on_a_character_boundary_with_a_mark() {
        assert_eq!(fit_text("short".into(), 10), "short");
        let cut = fit_text("é".repeat(100), 11);
        assert!(cut.len() <= 11 && cut.ends_with(CUT_MARK), "{cut}");
    }

    /// What marks a place that builds a document from input: a Secret's data being set, an install
    /// config generated, rendered or given its hosts. Matched at the start of a line.
    const BUILDERS: &[&str] = &[
        "data: Some(",
        "string_data: Some(",
        "install_config::generate(",
        "install_config::to_yaml(",
        "hosts::render(",
    ];

    /// Files that build documents without going through this module, and why that is bounded.
    const EXEMPT: &[(&str, &str)] = &[
        (
            "pools/deployment/installer.rs",
            "the host input Secret from data plan::inputs measured (bounds::host_secret_bytes) and the empty output Secret",
        ),
        (
            "pools/deployment/admin_kubeconfig.rs",
            "the admin kubeconfig, read only within bounds::OUTPUT_KEYS and --max-installer-output-bytes",
        ),
        (
            "inventory/delivery.rs",
            "BMC credentials whose Secret the asset's CredentialsFound held to --max-render-secret-bytes",
        ),
        (
            "runtime/shards/keeper.rs",
            "the shard map, which runtime::shards::assign::plan keeps under its MAX_MAP_BYTES; its names come from the operator's tenants directory and Tenant objects, not from a tenant",
        ),
    ];

    /// Every file of `src/` (but the test-only and embedded-server ones) that builds a document
    /// from input names this module, or is exempt with its reason: a builder added without a
    /// bound fails here.
    #[test]
    fn every_place_that_builds_a_document_goes_through_the_bounds() {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut files = Vec::new();
        let mut dirs = vec![src.clone()];
        while let Some(dir) = dirs.pop() {
            for entry in std::fs::read_dir(&dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    dirs.push(path);
                } else if path.extension().is_some_and(|e| e == "rs") {
                    files.push(path);
                }
            }
        }
        let mut unbounded = Vec::new();
        let mut builders = 0;
        for path in files {
            let relative = path.strip_prefix(&src).unwrap().display().to_string();
            // The embedded API server, the bench and `stackd dev` build test fixtures, not tenants'.
            if ["embedded/", "bench/", "dev.rs", "bounds.rs", "module_layers.rs"]
                .iter()
                .any(|skip| relative.starts_with(skip))
            {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            // Test modules build fixtures.
            let code = text.split("#[cfg(test)]").next().unwrap_or_default();
            let builds = code
                .lines()
                .map(str::trim_start)
                .any(|line| BUILDERS.iter().any(|marker| line.starts_with(marker)));
            if !builds {
                continue;
            }
            builders += 1;
            let bounded = code.contains("crate::bounds") || code.contains("bounds::");
            let exempt = EXEMPT.iter().any(|(file, _)| *file == relative);
            if !bounded && !exempt {
                unbounded.push(relative);
            }
        }
        assert!(
            builders >= 5,
            "the walk found only {builders} builders: is it looking at src/?"
        );
        assert!(
            unbounded.is_empty(),
            "these files build documents from input without crate::bounds (bound them before building, or add them to EXEMPT with the reason they are bounded): {unbounded:?}"
        );
    }

    #[test]
    fn a_secret_read_to_render_is_bounded_and_named_by_its_largest_key() {
        let limits = DocumentLimits {
            render_secret_bytes: 100,
            ..DocumentLimits::default()
        };
        let mut secret = Secret::default();
        secret.metadata.name = Some("bmc".into());
        secret.data = Some(
            [("username", 4), ("password", 200)]
                .into_iter()
                .map(|(k, n)| (k.to_string(), k8s_openapi::ByteString(vec![b'x'; n])))
                .collect(),
        );
        let refused = limits.render_secret("team", &secret).unwrap_err().to_string();
        assert!(
            refused.contains("Secret team/bmc (its largest key password)"),
            "{refused}"
        );
        assert!(refused.contains("--max-render-secret-bytes"), "{refused}");
        assert!(!refused.contains("xxx"), "never the value: {refused}");
        let mut budget = DocumentLimits::default().render_budget();
        assert!(budget.charge(MAX_CONFIG_BYTES, || "first".into()).is_ok());
        let over = budget.charge(1, || "the second".into()).unwrap_err().to_string();
        assert!(over.starts_with("the second is 1 MiB"), "{over}");
        assert!(over.contains("--max-render-bytes"), "{over}");
    }

    #[test]
    fn an_installer_output_is_bounded_in_bytes_and_keys() {
        let limits = DocumentLimits {
            installer_output_bytes: 64,
            installer_output_keys: 2,
            ..DocumentLimits::default()
        };
        let mut secret = Secret::default();
        secret.metadata.name = Some("ns.c-output".into());
        let data = |keys: &[(&str, usize)]| {
            keys.iter()
                .map(|(k, n)| (k.to_string(), k8s_openapi::ByteString(vec![b'x'; *n])))
                .collect()
        };
        secret.data = Some(data(&[("kubeconfig", 10), ("metadata.json", 10)]));
        assert_eq!(limits.installer_output("host", &secret), Ok(()));
        secret.data = Some(data(&[("kubeconfig", 100)]));
        let refused = limits.installer_output("host", &secret).unwrap_err().to_string();
        assert!(refused.contains("--max-installer-output-bytes"), "{refused}");
        secret.data = Some(data(&[("a", 1), ("b", 1), ("c", 1)]));
        let refused = limits.installer_output("host", &secret).unwrap_err().to_string();
        assert!(refused.contains("has 3 keys, more than the 2"), "{refused}");
    }

    #[test]
    fn a_host_secret_must_fit_the_cache_as_json() {
        assert_eq!(host_secret_limit(ByteSize(512 << 10)), (504 << 10) / 4 * 3);
        assert_eq!(host_secret_limit(ByteSize(1 << 40)), MAX_WRITTEN_SECRET_BYTES);
    }
}
