//! The one way a controller writes a tenant object's status: server-side apply to the status
//! subresource, with the controller's own field manager and `force` (the controller owns the status
//! it computes). The applied status is the whole status the controller wants: a field it no longer
//! sends is removed by the server, so nothing is ever cleared by writing `null`.
//!
//! Optimistic concurrency (a lease, an assignment) is asked for by passing the `resourceVersion` the
//! decision was made on: the server then answers 409 Conflict when the object changed meanwhile.

use std::fmt::Debug;

use kube::api::{Patch, PatchParams};
use kube::{Api, Resource};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::json;

/// Applies `status` as the whole status `field_manager` wants on object `name`, and returns the
/// object written (its `resourceVersion` is what the write produced). With `resource_version`, the
/// write is made only if the object is still at that version (409 Conflict otherwise).
pub async fn apply_status<K>(
    api: &Api<K>,
    name: &str,
    field_manager: &str,
    status: &impl Serialize,
    resource_version: Option<&str>,
) -> Result<K, kube::Error>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug,
{
    let body = apply_body::<K>(name, status, resource_version)?;
    let params = PatchParams::apply(field_manager).force();
    api.patch_status(name, &params, &Patch::Apply(body)).await
}

fn apply_body<K: Resource<DynamicType = ()>>(
    name: &str,
    status: &impl Serialize,
    resource_version: Option<&str>,
) -> Result<serde_json::Value, kube::Error> {
    let mut metadata = json!({"name": name});
    if let Some(version) = resource_version {
        metadata["resourceVersion"] = json!(version);
    }
    Ok(json!({
        "apiVersion": K::api_version(&()),
        "kind": K::kind(&()),
        "metadata": metadata,
        "status": serde_json::to_value(status).map_err(kube::Error::SerdeError)?,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;

    #[test]
    fn the_body_names_the_object_and_carries_a_version_only_when_asked() {
        let status = json!({"ready": 1});
        let plain = apply_body::<ConfigMap>("c", &status, None).unwrap();
        assert_eq!(
            plain,
            json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "status": {"ready": 1}})
        );
        let guarded = apply_body::<ConfigMap>("c", &status, Some("42")).unwrap();
        assert_eq!(guarded["metadata"]["resourceVersion"], "42");
    }
}
