//! Host object names: `<tenant ns>.<name>` plus a role suffix, capped with a hash when too long.
//!
//! Names are deterministic so a controller can find its host objects again, and never parsed back:
//! the full tenant identity lives in annotations.
//!
//! A capped name keeps 20 hex characters (80 bits) of SHA-256 of the full name. Two tenant
//! namespaces that share a long prefix are told apart by that hash alone, so it must resist a
//! second preimage: a user naming an object so that it caps to another namespace's host name would
//! leave that object with `HostObjectConflict`. stackd before 0.2 kept 10 (40 bits: minutes on a
//! GPU); [`legacy_host_name`] is that older name, which `super::legacy_names` moves to the new one
//! when a tenant starts.

use sha2::{Digest, Sha256};

/// Longest name of kinds whose name ends up in a label value (Job → `job-name`, Deployment and the
/// pod templates → pod-template labels), and the longest label value.
pub const LABEL_VALUE_MAX: usize = 63;
/// Longest name of every other kind (a DNS-1123 subdomain).
pub const OBJECT_NAME_MAX: usize = 253;
/// Hex characters of SHA-256 kept in a capped host name (80 bits).
const NAME_HASH_LEN: usize = 20;
/// Hex characters kept in a capped label value. Labels are always matched together with the
/// parent-namespace label, which is never capped (namespaces have at most 63 characters): a
/// collision of two parent names lies within one namespace, whose users own both objects anyway.
const LABEL_HASH_LEN: usize = 10;
/// Hex characters older stackd kept in capped host names (see the module docs).
const LEGACY_NAME_HASH_LEN: usize = 10;

/// Which cap a host name gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NameKind {
    /// Jobs, Deployments and anything else whose name is copied into a label value: 63.
    LabelBound,
    /// Secrets, ServiceAccounts, Roles and other objects: 253.
    Object,
}

impl NameKind {
    pub fn max_len(self) -> usize {
        match self {
            NameKind::LabelBound => LABEL_VALUE_MAX,
            NameKind::Object => OBJECT_NAME_MAX,
        }
    }
}

/// The host name of the tenant object `(namespace, name)` in the role given by `suffix` (e.g.
/// `-install`, or "" for the main object); cluster-scoped parents have no namespace.
pub fn host_name(namespace: Option<&str>, name: &str, suffix: &str, kind: NameKind) -> String {
    cap(&full_name(namespace, name, suffix), kind.max_len(), NAME_HASH_LEN)
}

/// The name stackd before 0.2 gave the same object, when it differs from [`host_name`]'s (only
/// capped names do).
pub fn legacy_host_name(namespace: Option<&str>, name: &str, suffix: &str, kind: NameKind) -> Option<String> {
    let full = full_name(namespace, name, suffix);
    (full.len() > kind.max_len()).then(|| cap(&full, kind.max_len(), LEGACY_NAME_HASH_LEN))
}

/// `<ns>.<name><suffix>`, or `<name><suffix>` for a cluster-scoped parent: the name before capping.
pub fn full_name(namespace: Option<&str>, name: &str, suffix: &str) -> String {
    match namespace {
        Some(ns) if !ns.is_empty() => format!("{ns}.{name}{suffix}"),
        _ => format!("{name}{suffix}"),
    }
}

/// A label value for `value`, hashed to 63 characters when longer.
pub fn label_value(value: &str) -> String {
    cap(value, LABEL_VALUE_MAX, LABEL_HASH_LEN)
}

/// `value` unchanged when it fits in `max`; otherwise a prefix without trailing `.`/`-`, then `-` and
/// the first `hash_len` hex characters of SHA-256 of the whole `value`.
fn cap(value: &str, max: usize, hash_len: usize) -> String {
    if value.len() <= max {
        return value.to_string();
    }
    let hash = hex::encode(Sha256::digest(value.as_bytes()));
    let keep = floor_char_boundary(value, max.saturating_sub(hash_len + 1));
    let prefix = value[..keep].trim_end_matches(['.', '-']);
    format!("{prefix}-{}", &hash[..hash_len])
}

fn floor_char_boundary(s: &str, mut index: usize) -> usize {
    while !s.is_char_boundary(index) {
        index -= 1;
    }
    index
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_examples_map_namespace_dot_name() {
        assert_eq!(
            host_name(Some("crossplane-system"), "provider-gcp", "", NameKind::LabelBound),
            "crossplane-system.provider-gcp"
        );
        assert_eq!(
            host_name(Some("dev"), "stack-wordpress", "", NameKind::Object),
            "dev.stack-wordpress"
        );
    }

    #[test]
    fn cluster_scoped_parents_map_to_their_name() {
        assert_eq!(host_name(None, "gcp", "-install", NameKind::LabelBound), "gcp-install");
    }

    #[test]
    fn suffix_is_appended_before_capping() {
        let name = host_name(Some("ns"), &"a".repeat(60), "-install", NameKind::LabelBound);
        assert_eq!(name.len(), 63);
        let hash = hex::encode(Sha256::digest(format!("ns.{}-install", "a".repeat(60)).as_bytes()));
        assert!(
            name.ends_with(&format!("-{}", &hash[..20])),
            "hash covers the suffix: {name}"
        );
    }

    #[test]
    fn names_at_the_cap_are_kept_and_one_over_is_hashed_with_80_bits() {
        let at = "x".repeat(63);
        assert_eq!(host_name(None, &at, "", NameKind::LabelBound), at);
        let over = "x".repeat(64);
        let capped = host_name(None, &over, "", NameKind::LabelBound);
        assert_eq!(capped.len(), 63);
        assert!(capped.starts_with(&format!("{}-", "x".repeat(42))), "{capped}");
        let hash = &capped[43..];
        assert_eq!(hash.len(), 20);
        assert!(hash.chars().all(|c| c.is_ascii_hexdigit()), "{hash}");
        let at = "y".repeat(253);
        assert_eq!(host_name(None, &at, "", NameKind::Object), at);
        let capped = host_name(None, &"y".repeat(254), "", NameKind::Object);
        assert_eq!(capped.len(), 253);
    }

    #[test]
    fn capping_is_deterministic_and_distinguishes_names() {
        let a = host_name(Some(&"n".repeat(40)), &"s".repeat(40), "", NameKind::LabelBound);
        let b = host_name(Some(&"n".repeat(40)), &"s".repeat(40), "", NameKind::LabelBound);
        let c = host_name(
            Some(&"n".repeat(40)),
            &format!("{}t", "s".repeat(39)),
            "",
            NameKind::LabelBound,
        );
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn no_trailing_dot_or_dash_before_the_hash() {
        // The cut falls right after the namespace's dot, and after a dash.
        let ns = "n".repeat(41);
        let name = host_name(Some(&ns), &"s".repeat(30), "", NameKind::LabelBound);
        assert!(!name.contains(".-"), "{name}");
        assert!(name.starts_with(&format!("{ns}-")), "{name}");
        let dashed = format!("{}-{}", "d".repeat(41), "e".repeat(30));
        let capped = host_name(None, &dashed, "", NameKind::LabelBound);
        assert!(!capped.contains("--"), "{capped}");
        assert_eq!(capped.len(), 62);
    }

    #[test]
    fn two_namespaces_sharing_a_long_prefix_get_names_told_apart_by_80_bits() {
        let prefix = "p".repeat(52);
        let a = host_name(Some(&format!("{prefix}-one")), "app", "-install", NameKind::LabelBound);
        let b = host_name(Some(&format!("{prefix}-two")), "app", "-install", NameKind::LabelBound);
        assert_ne!(a, b);
        assert_eq!(a[..42], b[..42], "the same prefix");
        assert_ne!(a[43..], b[43..]);
    }

    #[test]
    fn the_legacy_name_is_the_older_40_bit_one_and_shares_the_hash_prefix() {
        let ns = "this-is-just-a-really-long-namespace-name-at-the-character-max";
        let legacy = legacy_host_name(Some(ns), "stack", "-install", NameKind::LabelBound).unwrap();
        let full = format!("{ns}.stack-install");
        let hash = hex::encode(Sha256::digest(full.as_bytes()));
        assert_eq!(legacy, format!("{}-{}", &ns[..52], &hash[..10]));
        let current = host_name(Some(ns), "stack", "-install", NameKind::LabelBound);
        assert!(current.ends_with(&hash[..20]), "{current}");
        assert_eq!(
            legacy_host_name(Some("ns"), "short", "-install", NameKind::LabelBound),
            None
        );
    }

    #[test]
    fn the_troubleshooting_example_gets_a_valid_job_name() {
        let ns = "this-is-just-a-really-long-namespace-name-at-the-character-max";
        let name = "stack-with-a-really-long-resource-name-so-long-that-it-will-be-truncated";
        let job = host_name(Some(ns), name, "-install", NameKind::LabelBound);
        assert!(job.len() <= 63);
        assert!(
            job.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
        );
        assert!(job.starts_with(&ns[..42]));
        let secret = host_name(Some(ns), name, "-token", NameKind::Object);
        assert_eq!(
            secret,
            format!("{ns}.{name}-token"),
            "253 leaves room for the full name"
        );
    }

    #[test]
    fn label_values_over_63_are_hashed() {
        assert_eq!(label_value("short"), "short");
        assert_eq!(label_value(&"v".repeat(64)).len(), 63);
        assert_eq!(label_value(""), "");
    }
}
