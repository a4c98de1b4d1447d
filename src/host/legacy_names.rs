//! Host objects an older stackd named with the shorter hash (see `super::names`): found and moved to
//! their current names when a tenant starts, before its controllers look for them by name, so that
//! an upgrade neither leaks them nor runs them twice.
//!
//! An object is taken for one only when its name is exactly what the older scheme made of its
//! identity annotations and one of the role suffixes of DESIGN.md §2 (its 40-bit hash included):
//! the name proves the role, and so the current name. Then:
//! - a Secret is copied to its current name and the old one deleted: it may hold what an installer
//!   wrote (a cluster's admin kubeconfig and metadata), which nothing could make again;
//! - anything else is deleted, and its controller makes it again under its current name: a stack's
//!   Deployment is replaced, an install Job runs again (applying the same package changes nothing),
//!   a cluster's install attempt starts over (as its controller does with any Job it does not
//!   know). Pull-secret copies (a random suffix) go with their Job, which owns them.

use std::collections::BTreeMap;

use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, ListParams, PostParams, Preconditions, PropagationPolicy,
};
use kube::{Client, ResourceExt};
use tracing::{info, warn};

use super::labels::{TENANT_NAME_ANNOTATION, TENANT_NAMESPACE_ANNOTATION, TENANT_UID_ANNOTATION, tenant_selector};
use super::names::{NameKind, host_name, legacy_host_name};
use crate::runtime::api_errors::{is_conflict, is_gone_or_conflict};

/// Install attempts whose Job names are recognised (`-install-<n>`).
const ATTEMPTS: u32 = 1000;

/// The fixed role suffixes of DESIGN.md §2.
fn suffixes() -> impl Iterator<Item = String> {
    [
        "",
        "-install",
        "-token",
        "-install-config",
        "-output",
        "-installer",
        "-destroy",
    ]
    .into_iter()
    .map(String::from)
    .chain((0..ATTEMPTS).map(|attempt| format!("-install-{attempt}")))
}

/// The cap a host kind's names get.
pub fn name_kind(kind: &str) -> NameKind {
    match kind {
        "Job" | "Deployment" => NameKind::LabelBound,
        _ => NameKind::Object,
    }
}

/// Whether `name` ends the way the older scheme ended capped names: `-` and 10 hex characters.
fn looks_legacy(name: &str) -> bool {
    let bytes = name.as_bytes();
    bytes.len() > 11
        && bytes[bytes.len() - 11] == b'-'
        && bytes[bytes.len() - 10..]
            .iter()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b))
}

/// The current name of a host object of `kind` when `name` is the one an older stackd gave it,
/// from its identity annotations; `None` for every other object.
pub fn current_name(kind: &str, name: &str, annotations: &BTreeMap<String, String>) -> Option<String> {
    if !looks_legacy(name) {
        return None;
    }
    let namespace = annotations
        .get(TENANT_NAMESPACE_ANNOTATION)
        .map(String::as_str)
        .filter(|ns| !ns.is_empty());
    let parent = annotations.get(TENANT_NAME_ANNOTATION)?;
    let kind = name_kind(kind);
    suffixes().find_map(|suffix| {
        let legacy = legacy_host_name(namespace, parent, &suffix, kind)?;
        (legacy == name).then(|| host_name(namespace, parent, &suffix, kind))
    })
}

/// Moves this tenant's host objects of `kinds` that carry an older name; returns what moved, as
/// `Kind old -> new`.
pub async fn move_to_current_names(
    host: &Client,
    tenant: &str,
    namespace: &str,
    kinds: &[ApiResource],
) -> Result<Vec<String>, kube::Error> {
    let mut moved = Vec::new();
    for kind in kinds {
        let api: Api<DynamicObject> = Api::namespaced_with(host.clone(), namespace, kind);
        let listed = api
            .list_metadata(&ListParams::default().labels(&tenant_selector(tenant)))
            .await?;
        for object in listed.items {
            let (name, annotations) = (object.name_any(), object.annotations().clone());
            let Some(current) = current_name(&kind.kind, &name, &annotations) else {
                continue;
            };
            if kind.kind == "Secret" && !copy(&api, &name, &current).await? {
                continue;
            }
            delete(&api, &name, object.metadata.uid.clone()).await?;
            info!(tenant = %tenant, kind = %kind.kind, from = %name, to = %current, "moved a host object named by an older stackd to its current name");
            moved.push(format!("{} {name} -> {current}", kind.kind));
        }
    }
    Ok(moved)
}

/// Copies the object `from` to `to`; false when `to` is taken by an object of another parent (the
/// old one then stays).
async fn copy(api: &Api<DynamicObject>, from: &str, to: &str) -> Result<bool, kube::Error> {
    let Some(old) = api.get_opt(from).await? else {
        return Ok(false);
    };
    let mut copy = old.clone();
    copy.metadata = kube::api::ObjectMeta {
        name: Some(to.to_string()),
        namespace: old.metadata.namespace.clone(),
        labels: old.metadata.labels.clone(),
        annotations: old.metadata.annotations.clone(),
        owner_references: old.metadata.owner_references.clone(),
        ..Default::default()
    };
    match api.create(&PostParams::default(), &copy).await {
        Ok(_) => Ok(true),
        Err(err) if is_conflict(&err) => {
            let existing = api.get(to).await?;
            let uid = |o: &DynamicObject| o.annotations().get(TENANT_UID_ANNOTATION).cloned();
            let same_parent = uid(&existing).is_some() && uid(&existing) == uid(&old);
            if !same_parent {
                warn!(from = %from, to = %to, "a host object of another parent holds the current name; the old one stays");
            }
            Ok(same_parent)
        }
        Err(err) => Err(err),
    }
}

async fn delete(api: &Api<DynamicObject>, name: &str, uid: Option<String>) -> Result<(), kube::Error> {
    let params = DeleteParams {
        propagation_policy: Some(PropagationPolicy::Background),
        preconditions: Some(Preconditions {
            uid,
            resource_version: None,
        }),
        ..Default::default()
    };
    match api.delete(name, &params).await {
        Ok(_) => Ok(()),
        Err(err) if is_gone_or_conflict(&err) => Ok(()),
        Err(err) => Err(err),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::Parent;

    const LONG_NS: &str = "a-namespace-long-enough-that-install-job-names-are-capped";

    fn annotations(kind: &str, namespace: &str, name: &str) -> BTreeMap<String, String> {
        Parent::new(kind, Some(namespace), name, "uid-1").annotations()
    }

    #[test]
    fn an_old_capped_name_is_recognised_and_given_its_current_name() {
        let found = annotations("StackInstall", LONG_NS, "sample");
        let legacy = legacy_host_name(Some(LONG_NS), "sample", "-install", NameKind::LabelBound).unwrap();
        let current = host_name(Some(LONG_NS), "sample", "-install", NameKind::LabelBound);
        assert_eq!(current_name("Job", &legacy, &found), Some(current.clone()));
        assert_eq!(current_name("Job", &current, &found), None, "already current");
        let attempt = legacy_host_name(Some(LONG_NS), "sample", "-install-7", NameKind::LabelBound).unwrap();
        assert!(current_name("Job", &attempt, &found).is_some());
        let long = "c".repeat(250);
        let output = legacy_host_name(Some("team"), &long, "-output", NameKind::Object).unwrap();
        let cd = annotations("ClusterDeployment", "team", &long);
        assert_eq!(
            current_name("Secret", &output, &cd),
            Some(host_name(Some("team"), &long, "-output", NameKind::Object))
        );
    }

    #[test]
    fn other_names_are_left_alone() {
        let found = annotations("StackInstall", "team", "app-0123456789");
        // Uncapped, though it ends like a capped name.
        assert_eq!(current_name("Job", "team.app-0123456789", &found), None);
        // The old shape, but not this parent's hash.
        let other = annotations("StackInstall", LONG_NS, "sample");
        let forged = format!("{}-0123456789", &LONG_NS[..52]);
        assert_eq!(current_name("Job", &forged, &other), None);
        // A random pull-secret suffix cannot be told: it goes with its Job.
        let pull = legacy_host_name(Some(LONG_NS), &"s".repeat(200), "-pull-0-bcdfg", NameKind::Object).unwrap();
        assert_eq!(
            current_name("Secret", &pull, &annotations("StackInstall", LONG_NS, &"s".repeat(200))),
            None
        );
    }
}
