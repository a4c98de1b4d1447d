//! Labels and annotations on every host object, naming the tenant and the tenant parent.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Resource;

use super::names::label_value;
use crate::runtime::informers::report::HostParent;

pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";
pub const MANAGED_BY: &str = "stackd";
pub const TENANT_LABEL: &str = "stackd.dev/tenant";
pub const PARENT_KIND_LABEL: &str = "stackd.dev/parent-kind";
pub const PARENT_NAMESPACE_LABEL: &str = "stackd.dev/parent-namespace";
pub const PARENT_NAME_LABEL: &str = "stackd.dev/parent-name";

pub const TENANT_KIND_ANNOTATION: &str = "stackd.dev/tenant-kind";
pub const TENANT_NAMESPACE_ANNOTATION: &str = "stackd.dev/tenant-namespace";
pub const TENANT_NAME_ANNOTATION: &str = "stackd.dev/tenant-name";
pub const TENANT_UID_ANNOTATION: &str = "stackd.dev/tenant-uid";

/// The tenant object a host object belongs to.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Parent {
    /// Kind of the tenant object, e.g. `StackInstall`.
    pub kind: String,
    /// Namespace of the tenant object; `None` for cluster-scoped parents.
    pub namespace: Option<String>,
    pub name: String,
    /// `metadata.uid` of the tenant object: tells a recreated parent from the original.
    pub uid: String,
}

impl Parent {
    pub fn new(kind: &str, namespace: Option<&str>, name: &str, uid: &str) -> Self {
        Parent {
            kind: kind.to_string(),
            namespace: namespace.map(str::to_string),
            name: name.to_string(),
            uid: uid.to_string(),
        }
    }

    /// The labels every host object of this parent carries.
    pub fn labels(&self, tenant: &str) -> BTreeMap<String, String> {
        BTreeMap::from([
            (MANAGED_BY_LABEL.to_string(), MANAGED_BY.to_string()),
            (TENANT_LABEL.to_string(), label_value(tenant)),
            (PARENT_KIND_LABEL.to_string(), label_value(&self.kind)),
            (
                PARENT_NAMESPACE_LABEL.to_string(),
                label_value(self.namespace.as_deref().unwrap_or_default()),
            ),
            (PARENT_NAME_LABEL.to_string(), label_value(&self.name)),
        ])
    }

    /// The annotations every host object of this parent carries: the full, untruncated identity.
    pub fn annotations(&self) -> BTreeMap<String, String> {
        BTreeMap::from([
            (TENANT_KIND_ANNOTATION.to_string(), self.kind.clone()),
            (
                TENANT_NAMESPACE_ANNOTATION.to_string(),
                self.namespace.clone().unwrap_or_default(),
            ),
            (TENANT_NAME_ANNOTATION.to_string(), self.name.clone()),
            (TENANT_UID_ANNOTATION.to_string(), self.uid.clone()),
        ])
    }

    /// The label selector of every host object of this parent in `tenant`.
    pub fn selector(&self, tenant: &str) -> String {
        selector_of(&self.labels(tenant))
    }
}

/// The label selector of every host object of `tenant`.
pub fn tenant_selector(tenant: &str) -> String {
    format!("{MANAGED_BY_LABEL}={MANAGED_BY},{TENANT_LABEL}={}", label_value(tenant))
}

/// `k=v,k=v` for a set of labels.
pub fn selector_of(labels: &BTreeMap<String, String>) -> String {
    labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// The tenant object a host object was made for, from its name (`<tenant ns>.<name><suffix>`: set
/// at creation, which nobody on the host can change) and its identity annotations, which must agree
/// with that name. `None` when they do not, or the name says no namespace (a capped one).
pub fn parent_of_host_object(meta: &ObjectMeta) -> Option<HostParent> {
    let annotations = meta.annotations.as_ref()?;
    let (namespace, _) = meta.name.as_deref()?.split_once('.')?;
    let annotation = |key: &str| annotations.get(key).filter(|v| !v.is_empty()).cloned();
    if annotation(TENANT_NAMESPACE_ANNOTATION).as_deref() != Some(namespace) {
        return None;
    }
    let kind = annotation(TENANT_KIND_ANNOTATION)?;
    let reference = ObjectReference {
        api_version: Some(parent_api_version(&kind)?),
        kind: Some(kind),
        namespace: Some(namespace.to_string()),
        name: annotation(TENANT_NAME_ANNOTATION),
        uid: annotation(TENANT_UID_ANNOTATION),
        ..Default::default()
    };
    Some(HostParent {
        reference,
        namespace: namespace.to_string(),
    })
}

/// The API version of a tenant kind that owns host objects.
fn parent_api_version(kind: &str) -> Option<String> {
    use crate::api::{inventory::*, pools::*, stacks::*};
    let version = match kind {
        "StackInstall" => StackInstall::api_version(&()),
        "ClusterStackInstall" => ClusterStackInstall::api_version(&()),
        "Stack" => Stack::api_version(&()),
        "ClusterPool" => ClusterPool::api_version(&()),
        "ClusterDeploymentCustomization" => ClusterDeploymentCustomization::api_version(&()),
        "ClusterDeployment" => ClusterDeployment::api_version(&()),
        "ClusterClaim" => ClusterClaim::api_version(&()),
        "BareMetalAsset" => BareMetalAsset::api_version(&()),
        _ => return None,
    };
    Some(version.into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_name_tenant_and_parent() {
        let parent = Parent::new("StackInstall", Some("team-a"), "sample", "uid-1");
        let labels = parent.labels("acme");
        assert_eq!(labels[MANAGED_BY_LABEL], "stackd");
        assert_eq!(labels[TENANT_LABEL], "acme");
        assert_eq!(labels[PARENT_KIND_LABEL], "StackInstall");
        assert_eq!(labels[PARENT_NAMESPACE_LABEL], "team-a");
        assert_eq!(labels[PARENT_NAME_LABEL], "sample");
        assert_eq!(parent.annotations()[TENANT_UID_ANNOTATION], "uid-1");
    }

    #[test]
    fn long_parent_names_are_hashed_in_labels_but_whole_in_annotations() {
        let name = "n".repeat(80);
        let parent = Parent::new("Stack", Some("ns"), &name, "u");
        assert_eq!(parent.labels("t")[PARENT_NAME_LABEL].len(), 63);
        assert_eq!(parent.annotations()[TENANT_NAME_ANNOTATION], name);
    }

    #[test]
    fn cluster_scoped_parent_has_empty_namespace_label() {
        let parent = Parent::new("Thing", None, "x", "u");
        assert_eq!(parent.labels("t")[PARENT_NAMESPACE_LABEL], "");
    }

    #[test]
    fn a_host_object_names_its_parent_only_when_its_name_and_annotations_agree() {
        let parent = Parent::new("ClusterDeployment", Some("team-a"), "c1", "uid-1");
        let mut meta = ObjectMeta {
            name: Some("team-a.c1-output".into()),
            annotations: Some(parent.annotations()),
            ..Default::default()
        };
        let found = parent_of_host_object(&meta).unwrap();
        assert_eq!(found.namespace, "team-a");
        assert_eq!(found.reference.name.as_deref(), Some("c1"));
        assert_eq!(
            found.reference.api_version.as_deref(),
            Some("pools.stackd.dev/v1alpha1")
        );
        meta.annotations
            .as_mut()
            .unwrap()
            .insert(TENANT_NAMESPACE_ANNOTATION.into(), "team-b".into());
        assert_eq!(parent_of_host_object(&meta), None, "annotations pointing elsewhere");
    }

    #[test]
    fn selectors_list_every_label() {
        let parent = Parent::new("Stack", Some("ns"), "s", "u");
        let selector = parent.selector("t");
        assert!(selector.contains("stackd.dev/tenant=t"));
        assert!(selector.contains("stackd.dev/parent-name=s"));
        assert_eq!(
            tenant_selector("t"),
            "app.kubernetes.io/managed-by=stackd,stackd.dev/tenant=t"
        );
    }
}
