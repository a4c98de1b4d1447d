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

/// On a host object only stackd writes: the uid of another host object stackd made for the same
/// parent whose metadata a tenant's token may change (an installer's output Secret). It proves that
/// object stackd's, and names its parent, whatever its own annotations say.
pub const OUTPUT_UID_ANNOTATION: &str = "pools.stackd.dev/output-secret-uid";

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
/// at creation by stackd, which nobody on the host can change) and its identity annotations, which
/// must agree with that name. An installer may strip or rewrite the annotations of its output
/// Secret: then the name alone tells the tenant namespace (so a refused Secret holds up that
/// namespace only, never all of them), and the labels, when they agree with it, the object.
/// `None` when the name says no namespace (a capped one).
pub fn parent_of_host_object(meta: &ObjectMeta) -> Option<HostParent> {
    let (namespace, _) = meta.name.as_deref()?.split_once('.')?;
    let annotations = meta.annotations.clone().unwrap_or_default();
    let annotation = |key: &str| annotations.get(key).filter(|v| !v.is_empty()).cloned();
    if annotation(TENANT_NAMESPACE_ANNOTATION).as_deref() != Some(namespace) {
        return Some(parent_from_labels(meta, namespace));
    }
    let Some(kind) = annotation(TENANT_KIND_ANNOTATION) else {
        return Some(parent_from_labels(meta, namespace));
    };
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

/// The parent of a host object whose annotations do not agree with its name: the object its labels
/// name when they agree with the name's namespace, else only that namespace.
fn parent_from_labels(meta: &ObjectMeta, namespace: &str) -> HostParent {
    let labels = meta.labels.clone().unwrap_or_default();
    let label = |key: &str| labels.get(key).filter(|v| !v.is_empty()).cloned();
    let mut reference = ObjectReference {
        namespace: Some(namespace.to_string()),
        ..Default::default()
    };
    if label(PARENT_NAMESPACE_LABEL).as_deref() == Some(namespace)
        && let Some(kind) = label(PARENT_KIND_LABEL)
        && let Some(api_version) = parent_api_version(&kind)
    {
        reference.api_version = Some(api_version);
        reference.kind = Some(kind);
        reference.name = label(PARENT_NAME_LABEL);
    }
    HostParent {
        reference,
        namespace: namespace.to_string(),
    }
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
        let named = parent_of_host_object(&meta).unwrap();
        assert_eq!(
            named.namespace, "team-a",
            "annotations pointing elsewhere count for nothing"
        );
        assert_eq!(named.reference.name, None, "no labels to name the object");
    }

    #[test]
    fn a_host_object_stripped_of_its_annotations_still_holds_up_its_own_namespace_only() {
        let parent = Parent::new("ClusterDeployment", Some("team-a"), "c1", "uid-1");
        let mut meta = ObjectMeta {
            name: Some("team-a.c1-output".into()),
            labels: Some(parent.labels("acme")),
            ..Default::default()
        };
        let found = parent_of_host_object(&meta).unwrap();
        assert_eq!(found.namespace, "team-a");
        assert_eq!(found.reference.name.as_deref(), Some("c1"));
        assert_eq!(found.reference.kind.as_deref(), Some("ClusterDeployment"));
        assert_eq!(found.reference.uid, None);
        // Labels naming another namespace are not believed; the name still tells its own.
        meta.labels
            .as_mut()
            .unwrap()
            .insert(PARENT_NAMESPACE_LABEL.into(), "team-b".into());
        let found = parent_of_host_object(&meta).unwrap();
        assert_eq!((found.namespace.as_str(), found.reference.name), ("team-a", None));
        meta.name = Some("capped-without-a-namespace".into());
        assert_eq!(parent_of_host_object(&meta), None);
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
