//! Stacks (DESIGN.md §3): the package format, the install controller and the stack controller.

pub mod install;
pub mod pod_policy;
pub mod stack;
pub mod stream;
pub mod unpack;

use sha2::{Digest, Sha256};

/// Finalizer of StackInstall and ClusterStackInstall.
pub const INSTALL_FINALIZER: &str = "stacks.stackd.dev/install";
/// Finalizer of Stack.
pub const STACK_FINALIZER: &str = "stacks.stackd.dev/stack";
/// Prefix of the multi-parent label on tenant CRDs: one label per Stack that uses the CRD.
pub const CRD_PARENT_LABEL_PREFIX: &str = "parent.stacks.stackd.dev/";

/// The label a tenant CRD carries while the Stack `namespace/name` uses it. A CRD without any such
/// label is no longer referenced and is deleted when its last install goes.
pub fn crd_parent_label(namespace: &str, stack: &str) -> String {
    let digest = Sha256::digest(format!("{namespace}/{stack}").as_bytes());
    format!("{CRD_PARENT_LABEL_PREFIX}{}", &hex::encode(digest)[..16])
}

/// True when some Stack still uses a CRD with these labels.
pub fn crd_is_referenced(labels: &std::collections::BTreeMap<String, String>) -> bool {
    labels.keys().any(|key| key.starts_with(CRD_PARENT_LABEL_PREFIX))
}
