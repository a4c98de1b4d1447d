//! Each tenant's namespace on the host, and the RoleBinding that gives the daemon its
//! namespace-scoped permissions there (DESIGN.md §1 "Host namespace per tenant").

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::rbac::v1::{RoleBinding, RoleRef, Subject};
use kube::api::{Api, DeleteParams, ObjectMeta, Patch, PatchParams, PostParams, Preconditions};
use kube::{Client, ResourceExt};
use serde_json::json;

use super::labels::{MANAGED_BY, MANAGED_BY_LABEL, TENANT_LABEL};
use super::names::label_value;
use crate::runtime::api_errors::is_already_exists;

/// The ClusterRole the daemon binds in every tenant namespace; it holds `bind` on this one only.
pub const TENANT_NAMESPACE_ROLE: &str = "stackd-tenant-namespace";
/// Pod Security admission level enforced on tenant namespaces.
pub const POD_SECURITY_ENFORCE_LABEL: &str = "pod-security.kubernetes.io/enforce";
/// Set on a namespace stackd found without a tenant label and took over: purge empties it but
/// leaves the namespace itself, because stackd did not create it.
pub const ADOPTED_ANNOTATION: &str = "stackd.dev/adopted";
const FIELD_MANAGER: &str = "stackd/tenant";

/// The daemon's own ServiceAccount on the host, the subject of the RoleBinding.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceAccountRef {
    pub namespace: String,
    pub name: String,
}

impl std::str::FromStr for ServiceAccountRef {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.split_once('/') {
            Some((namespace, name)) if !namespace.is_empty() && !name.is_empty() => Ok(ServiceAccountRef {
                namespace: namespace.to_string(),
                name: name.to_string(),
            }),
            _ => Err(format!("expected NAMESPACE/NAME, got {s:?}")),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum NamespaceError {
    #[error(
        "host namespace {namespace} belongs to tenant {owner:?}; choose another --tenant-namespace-template or rename the tenant file"
    )]
    OtherTenant { namespace: String, owner: String },
    #[error("host namespace {0} is being deleted; it is recreated once the deletion finishes")]
    Terminating(String),
    #[error(
        "RoleBinding {namespace}/{TENANT_NAMESPACE_ROLE} exists but was not created by stackd; remove it so stackd can bind its role"
    )]
    ForeignRoleBinding { namespace: String },
    #[error("host API error: {0}")]
    Api(#[from] kube::Error),
}

/// The labels of a tenant's host namespace.
pub fn namespace_labels(tenant: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (MANAGED_BY_LABEL.to_string(), MANAGED_BY.to_string()),
        (TENANT_LABEL.to_string(), label_value(tenant)),
        (POD_SECURITY_ENFORCE_LABEL.to_string(), "restricted".to_string()),
    ])
}

/// Makes the namespace and its RoleBinding what they should be, starting from what the caller
/// observed (its watch caches); returns the number of writes made, zero when nothing differed.
pub async fn ensure(
    host: &Client,
    tenant: &str,
    namespace: &str,
    subject: &ServiceAccountRef,
    observed_namespace: Option<&Namespace>,
    observed_binding: Option<&RoleBinding>,
) -> Result<usize, NamespaceError> {
    let mut writes = ensure_namespace(host, tenant, namespace, observed_namespace).await?;
    writes += ensure_binding(host, tenant, namespace, subject, observed_binding).await?;
    Ok(writes)
}

async fn ensure_namespace(
    host: &Client,
    tenant: &str,
    name: &str,
    observed: Option<&Namespace>,
) -> Result<usize, NamespaceError> {
    let api: Api<Namespace> = Api::all(host.clone());
    let desired = namespace_labels(tenant);
    let existing = match observed {
        Some(ns) => ns.clone(),
        None => {
            let ns = Namespace {
                metadata: ObjectMeta {
                    name: Some(name.to_string()),
                    labels: Some(desired.clone()),
                    ..Default::default()
                },
                ..Default::default()
            };
            match api.create(&post_params(), &ns).await {
                Ok(_) => return Ok(1),
                Err(err) if is_already_exists(&err) => api.get(name).await?,
                Err(err) => return Err(err.into()),
            }
        }
    };
    if existing.metadata.deletion_timestamp.is_some() {
        return Err(NamespaceError::Terminating(name.to_string()));
    }
    let labels = existing.labels();
    match labels.get(TENANT_LABEL) {
        Some(owner) if *owner != label_value(tenant) => {
            return Err(NamespaceError::OtherTenant {
                namespace: name.to_string(),
                owner: owner.clone(),
            });
        }
        _ => {}
    }
    let missing: BTreeMap<&String, &String> = desired.iter().filter(|(k, v)| labels.get(*k) != Some(*v)).collect();
    if missing.is_empty() {
        return Ok(0);
    }
    let mut patch = json!({ "metadata": { "labels": missing } });
    if !labels.contains_key(TENANT_LABEL) {
        patch["metadata"]["annotations"] = json!({ ADOPTED_ANNOTATION: "true" });
    }
    api.patch(
        name,
        &PatchParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..Default::default()
        },
        &Patch::Merge(patch),
    )
    .await?;
    Ok(1)
}

fn desired_binding(tenant: &str, namespace: &str, subject: &ServiceAccountRef) -> RoleBinding {
    RoleBinding {
        metadata: ObjectMeta {
            name: Some(TENANT_NAMESPACE_ROLE.to_string()),
            namespace: Some(namespace.to_string()),
            labels: Some(BTreeMap::from([
                (MANAGED_BY_LABEL.to_string(), MANAGED_BY.to_string()),
                (TENANT_LABEL.to_string(), label_value(tenant)),
            ])),
            ..Default::default()
        },
        role_ref: RoleRef {
            api_group: "rbac.authorization.k8s.io".to_string(),
            kind: "ClusterRole".to_string(),
            name: TENANT_NAMESPACE_ROLE.to_string(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".to_string(),
            name: subject.name.clone(),
            namespace: Some(subject.namespace.clone()),
            ..Default::default()
        }]),
    }
}

async fn ensure_binding(
    host: &Client,
    tenant: &str,
    namespace: &str,
    subject: &ServiceAccountRef,
    observed: Option<&RoleBinding>,
) -> Result<usize, NamespaceError> {
    let api: Api<RoleBinding> = Api::namespaced(host.clone(), namespace);
    let desired = desired_binding(tenant, namespace, subject);
    let existing = match observed {
        Some(binding) => binding.clone(),
        None => match api.create(&post_params(), &desired).await {
            Ok(_) => return Ok(1),
            Err(err) if is_already_exists(&err) => api.get(TENANT_NAMESPACE_ROLE).await?,
            Err(err) => return Err(err.into()),
        },
    };
    let ours = existing.labels().get(MANAGED_BY_LABEL).map(String::as_str) == Some(MANAGED_BY)
        && existing.labels().get(TENANT_LABEL) == Some(&label_value(tenant));
    if !ours {
        return Err(NamespaceError::ForeignRoleBinding {
            namespace: namespace.to_string(),
        });
    }
    if existing.role_ref == desired.role_ref && existing.subjects == desired.subjects {
        return Ok(0);
    }
    if existing.role_ref != desired.role_ref {
        // roleRef is immutable: replace the binding, guarded by its uid.
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: existing.uid(),
                resource_version: None,
            }),
            ..Default::default()
        };
        api.delete(TENANT_NAMESPACE_ROLE, &params).await?;
        api.create(&post_params(), &desired).await?;
        return Ok(2);
    }
    let mut updated = existing;
    updated.subjects = desired.subjects;
    api.replace(TENANT_NAMESPACE_ROLE, &post_params(), &updated).await?;
    Ok(1)
}

fn post_params() -> PostParams {
    PostParams {
        field_manager: Some(FIELD_MANAGER.to_string()),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespaces_enforce_the_restricted_pod_security_level() {
        let labels = namespace_labels("acme");
        assert_eq!(labels[POD_SECURITY_ENFORCE_LABEL], "restricted");
        assert_eq!(labels[TENANT_LABEL], "acme");
    }

    #[test]
    fn service_account_refs_parse_namespace_slash_name() {
        assert_eq!(
            "stackd-system/stackd".parse::<ServiceAccountRef>(),
            Ok(ServiceAccountRef {
                namespace: "stackd-system".into(),
                name: "stackd".into()
            })
        );
        assert!("stackd".parse::<ServiceAccountRef>().is_err());
    }

    #[test]
    fn the_binding_grants_the_fixed_cluster_role_to_the_daemon() {
        let subject = ServiceAccountRef {
            namespace: "stackd-system".into(),
            name: "stackd".into(),
        };
        let binding = desired_binding("acme", "tenant-acme-controllers", &subject);
        assert_eq!(binding.role_ref.name, TENANT_NAMESPACE_ROLE);
        assert_eq!(binding.role_ref.kind, "ClusterRole");
        let subjects = binding.subjects.unwrap_or_default();
        assert_eq!(subjects[0].namespace.as_deref(), Some("stackd-system"));
    }
}
