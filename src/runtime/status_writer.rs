//! The one way a controller writes a tenant object's status: server-side apply to the status
//! subresource, as the field manager of its controller. The status sent is the whole status that
//! manager owns, so a field it stops sending is removed: no null-filling of fields gone out of use.

use kube::Resource;
use kube::api::{Patch, PatchParams};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

/// Whether the write is guarded by the object's resourceVersion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precondition {
    /// The status is the writer's alone: write it whatever happened to the object meanwhile.
    None,
    /// Send `object`'s `metadata.resourceVersion`: a stale copy gets a 409 instead of a write.
    ResourceVersion,
}

/// Writes `status` as the whole status `field_manager` owns on `object` (server-side apply to the status subresource).
pub async fn apply_status<K>(
    api: &kube::Api<K>,
    object: &K,
    field_manager: &str,
    status: Value,
    precondition: Precondition,
) -> Result<K, kube::Error>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug,
{
    let meta = object.meta();
    let name = meta.name.clone().unwrap_or_default();
    let body = status_body::<K>(&name, meta.resource_version.as_deref(), status, precondition);
    let params = PatchParams::apply(field_manager).force();
    api.patch_status(&name, &params, &Patch::Apply(body)).await
}

fn status_body<K: Resource<DynamicType = ()>>(
    name: &str,
    resource_version: Option<&str>,
    status: Value,
    precondition: Precondition,
) -> Value {
    let mut metadata = json!({ "name": name });
    if let (Precondition::ResourceVersion, Some(version)) = (precondition, resource_version) {
        metadata["resourceVersion"] = json!(version);
    }
    json!({
        "apiVersion": K::api_version(&()),
        "kind": K::kind(&()),
        "metadata": metadata,
        "status": status,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::stacks::Stack;

    #[test]
    fn the_body_names_the_object_and_carries_only_the_status() {
        let body = status_body::<Stack>("db", Some("7"), json!({"observedGeneration": 2}), Precondition::None);
        assert_eq!(
            body,
            json!({
                "apiVersion": "stacks.stackd.dev/v1alpha1",
                "kind": "Stack",
                "metadata": {"name": "db"},
                "status": {"observedGeneration": 2},
            })
        );
    }

    #[test]
    fn a_resource_version_precondition_sends_the_version_read() {
        let body = status_body::<Stack>("db", Some("7"), json!({}), Precondition::ResourceVersion);
        assert_eq!(body["metadata"], json!({"name": "db", "resourceVersion": "7"}));
    }
}
