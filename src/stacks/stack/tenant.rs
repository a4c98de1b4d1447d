//! Objects the stack controller creates on the tenant: how they are marked as a Stack's, mapped back
//! to it, and written (create, or replace from the cached copy only when a field differs).

use std::collections::BTreeMap;
use std::fmt::Debug;

use kube::api::{ObjectMeta, PostParams};
use kube::runtime::reflector::ObjectRef;
use kube::{Api, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

use crate::api::stacks::Stack;
use crate::host::apply::{Applied, contains};
use crate::host::labels::{MANAGED_BY, MANAGED_BY_LABEL};
use crate::host::names::label_value;
use crate::runtime::api_errors::is_conflict;

/// Names the Stack a tenant object belongs to: `<namespace>/<name>`.
pub const STACK_ANNOTATION: &str = "stacks.stackd.dev/stack";
pub const STACK_NAMESPACE_LABEL: &str = "stacks.stackd.dev/stack-namespace";
pub const STACK_NAME_LABEL: &str = "stacks.stackd.dev/stack-name";

/// The Stack whose tenant objects are being written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TenantIdentity {
    pub namespace: String,
    pub name: String,
}

impl TenantIdentity {
    pub fn of(stack: &Stack) -> Self {
        TenantIdentity {
            namespace: stack.namespace().unwrap_or_default(),
            name: stack.name_any(),
        }
    }

    fn labels(&self) -> BTreeMap<String, String> {
        BTreeMap::from([
            (MANAGED_BY_LABEL.to_string(), MANAGED_BY.to_string()),
            (STACK_NAMESPACE_LABEL.to_string(), label_value(&self.namespace)),
            (STACK_NAME_LABEL.to_string(), label_value(&self.name)),
        ])
    }

    fn annotation(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// Metadata of a namespaced object in the Stack's namespace, owned by the Stack when `owner` is given.
    pub fn meta(&self, name: &str, owner: Option<&OwnerReference>) -> ObjectMeta {
        ObjectMeta {
            name: Some(name.to_string()),
            namespace: Some(self.namespace.clone()),
            labels: Some(self.labels()),
            annotations: Some(BTreeMap::from([(STACK_ANNOTATION.to_string(), self.annotation())])),
            owner_references: owner.map(|o| vec![o.clone()]),
            ..Default::default()
        }
    }

    /// Metadata of a cluster-scoped object (never owned: a namespaced owner is not allowed there).
    pub fn meta_cluster(&self, name: &str) -> ObjectMeta {
        ObjectMeta {
            namespace: None,
            ..self.meta(name, None)
        }
    }

    /// Whether a tenant object was written for this Stack.
    pub fn owns<K: Resource>(&self, object: &K) -> bool {
        object.labels().get(MANAGED_BY_LABEL).map(String::as_str) == Some(MANAGED_BY)
            && object.annotations().get(STACK_ANNOTATION) == Some(&self.annotation())
    }
}

/// The Stack a tenant object of ours belongs to, from its annotation.
pub fn stack_of<K: Resource>(object: &K) -> Option<ObjectRef<Stack>> {
    let (namespace, name) = object.annotations().get(STACK_ANNOTATION)?.split_once('/')?;
    Some(ObjectRef::new(name).within(namespace))
}

/// Why a tenant write failed.
#[derive(Debug, thiserror::Error)]
pub enum TenantWriteError {
    #[error("tenant {kind} {name} already exists and was not created by stackd for this stack; delete or rename it")]
    Conflict { kind: String, name: String },
    #[error("tenant API request failed: {0}")]
    Api(#[from] kube::Error),
}

/// Creates `desired`, or replaces the cached `observed` copy (with its resourceVersion) when a field
/// stackd sets differs. An object at the name that is not this Stack's is left alone.
pub async fn ensure<K>(
    api: &Api<K>,
    identity: &TenantIdentity,
    desired: &K,
    observed: Option<&K>,
) -> Result<Applied, TenantWriteError>
where
    K: Resource + Clone + Debug + Serialize + DeserializeOwned,
    K::DynamicType: Default,
{
    let name = desired.name_any();
    let existing = match observed {
        Some(observed) => observed.clone(),
        None => match api.create(&PostParams::default(), desired).await {
            Ok(_) => return Ok(Applied::Created),
            // The cache is behind: read what is there and decide from it.
            Err(err) if is_conflict(&err) => api.get(&name).await?,
            Err(err) => return Err(err.into()),
        },
    };
    if !identity.owns(&existing) {
        return Err(TenantWriteError::Conflict {
            kind: K::kind(&K::DynamicType::default()).into_owned(),
            name: match existing.namespace() {
                Some(ns) => format!("{ns}/{name}"),
                None => name,
            },
        });
    }
    if contains(&existing, desired) {
        return Ok(Applied::Unchanged);
    }
    // Overlay what stackd sets on what is there, so fields others fill (a token Secret's data) stay.
    let mut merged = serde_json::to_value(&existing).map_err(kube::Error::SerdeError)?;
    json_patch::merge(
        &mut merged,
        &serde_json::to_value(desired).map_err(kube::Error::SerdeError)?,
    );
    let replacement: K = serde_json::from_value(merged).map_err(kube::Error::SerdeError)?;
    api.replace(&name, &PostParams::default(), &replacement).await?;
    Ok(Applied::Updated)
}
