//! Stacks (DESIGN.md §3): the package format, the install controller and the stack controller.

pub mod copy;
pub(crate) mod crd_changes;
pub mod crd_v1beta1;
pub mod install;
pub mod pod_policy;
pub mod pull_secrets;
pub mod rbac_verbs;
pub mod stack;
pub mod stream;
pub mod ui_metadata;
pub mod unpack;

use sha2::{Digest, Sha256};

/// The image of the install Job's containers (and of templating stacks' `stackd-tools`) when
/// `--stackd-image` is not given.
pub fn default_stackd_image() -> String {
    format!("stackd:{}", env!("CARGO_PKG_VERSION"))
}

/// Finalizer of StackInstall and ClusterStackInstall.
pub const INSTALL_FINALIZER: &str = "stacks.stackd.dev/install";
/// Finalizer of Stack.
pub const STACK_FINALIZER: &str = "stacks.stackd.dev/stack";
/// Label on tenant CRDs that a stack install created: only these are ever changed or deleted by stackd.
/// The user and group stackd's pods run as when nothing names one: not root, as the restricted Pod
/// Security Standard requires, and the `nonroot` user of distroless images.
pub const NON_ROOT_ID: i64 = 65532;
pub const MANAGED_CRD_LABEL: &str = "stacks.stackd.dev/managed";
/// Prefix of the multi-parent label on tenant CRDs: one label per Stack that uses the CRD.
pub const CRD_PARENT_LABEL_PREFIX: &str = "parent.stacks.stackd.dev/";

/// The label a tenant CRD carries while the Stack `namespace/name` uses it. A CRD without any such
/// label is no longer referenced and is deleted when its last install goes.
pub fn crd_parent_label(namespace: &str, stack: &str) -> String {
    let digest = Sha256::digest(format!("{namespace}/{stack}").as_bytes());
    format!("{CRD_PARENT_LABEL_PREFIX}{}", &hex::encode(digest)[..16])
}

/// The group of the StackDefinitions stackd writes for templating stacks (Crossplane's): no package
/// creates CRDs there, and no stack gets permissions there beyond reading its own StackDefinition.
pub const COMPATIBILITY_GROUP: &str = "packages.crossplane.io";

/// Who an API group belongs to when it is not a package's to use: stackd's own domain (every group
/// under `stackd.dev`, so groups stackd adds later are covered too), the group of the
/// StackDefinitions it writes ([`COMPATIBILITY_GROUP`]), and Kubernetes' (`k8s.io`,
/// `kubernetes.io`, the core group, and every group without a dot: `apps`, `batch`, `policy`, ...
/// are Kubernetes' built-in groups, and a CRD group needs a dot anyway). Packages create no CRDs
/// there and stacks get no permissions there.
pub fn reserved_group_owner(group: &str) -> Option<&'static str> {
    let under = |domain: &str| group == domain || group.ends_with(&format!(".{domain}"));
    if under("stackd.dev") {
        Some("stackd")
    } else if group == COMPATIBILITY_GROUP {
        Some("stackd's Crossplane compatibility (StackDefinition)")
    } else if !group.contains('.') || under("k8s.io") || under("kubernetes.io") {
        Some("Kubernetes")
    } else {
        None
    }
}

/// True when a label or annotation key is in stackd's domain: only stackd sets those, so they are
/// dropped from anything a package or a user hands in.
pub fn is_stackd_key(key: &str) -> bool {
    match key.split_once('/') {
        Some((prefix, _)) => prefix == "stackd.dev" || prefix.ends_with(".stackd.dev"),
        None => false,
    }
}

/// True when some Stack still uses a CRD with these labels.
pub fn crd_is_referenced(labels: &std::collections::BTreeMap<String, String>) -> bool {
    labels.keys().any(|key| key.starts_with(CRD_PARENT_LABEL_PREFIX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stackd_and_kubernetes_groups_are_reserved() {
        for group in [
            "stacks.stackd.dev",
            "pools.stackd.dev",
            "inventory.stackd.dev",
            "future.stackd.dev",
            "stackd.dev",
        ] {
            assert_eq!(reserved_group_owner(group), Some("stackd"), "{group}");
        }
        for group in [
            "",
            "apps.k8s.io",
            "rbac.authorization.k8s.io",
            "k8s.io",
            "node.kubernetes.io",
            "apps",
            "batch",
            "policy",
            "autoscaling",
        ] {
            assert_eq!(reserved_group_owner(group), Some("Kubernetes"), "{group}");
        }
        for group in ["samples.example.org", "notstackd.dev", "cluster.x-k8s.io", "kyverno.io"] {
            assert_eq!(reserved_group_owner(group), None, "{group}");
        }
    }

    #[test]
    fn stackd_keys_are_recognised_by_their_prefix() {
        assert!(is_stackd_key("stackd.dev/tenant"));
        assert!(is_stackd_key("parent.stacks.stackd.dev/abc"));
        assert!(is_stackd_key("stacks.stackd.dev/managed"));
        assert!(!is_stackd_key("example.com/owner"));
        assert!(!is_stackd_key("app"));
        assert!(!is_stackd_key("notstackd.dev/x"));
    }
}
