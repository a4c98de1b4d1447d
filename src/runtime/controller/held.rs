//! What the user of an object held off sees: a refused object in its namespace (too large, or over
//! the namespace's share) holds up the controllers that read its kind there, and each object they
//! hold gets a `Held` condition and a Warning Event naming the refused object, the bound it passed
//! and how to release it. The condition is written by its own field manager, so the controller's
//! status writes neither see nor remove it; it goes once the object runs again.

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams};
use kube::runtime::events::EventType;
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde_json::{Value, json};
use tracing::debug;

use crate::runtime::events::{event, log_unpublished};
use crate::runtime::informers::refusals::{Cause, Refusal};
use crate::runtime::informers::report::NAMESPACE_OVER_BUDGET;
use crate::runtime::memory_budget::ByteSize;
use crate::runtime::text_bounds::{MAX_CONDITION_MESSAGE_BYTES, fit_text};

use super::Tenant;

/// The condition type on an object held off.
pub const HELD: &str = "Held";
/// The reason of the condition and Event on an object held off by an object over the size cap.
pub const HELD_BY_OBJECT_TOO_LARGE: &str = "HeldByObjectTooLarge";
/// The field manager of the `Held` condition: only it writes or removes it.
const FIELD_MANAGER: &str = "stackd-held";

/// The reason and message of the `Held` condition `refusal` puts on the objects it holds off.
pub fn why(refusal: &Refusal) -> (&'static str, String) {
    let refused = refusal.describe();
    let namespace = match refusal.holds.as_str() {
        "" => "every namespace of this tenant".to_string(),
        namespace => format!("namespace {namespace}"),
    };
    match &refusal.cause {
        Cause::OverBudget { overage, .. } => (
            NAMESPACE_OVER_BUDGET,
            format!(
                "stackd holds off its work in {namespace}: {refused} is not read, because {overage}. Delete or shrink objects of {namespace}; this object is served again the moment there is room. The tenant's other namespaces are served as before."
            ),
        ),
        Cause::TooLarge => (
            HELD_BY_OBJECT_TOO_LARGE,
            format!(
                "stackd holds off its work in {namespace} that reads {}s: {refused} is {} of JSON, over what stackd reads (--max-cached-object-bytes). Make it smaller or delete it; this object is served again the moment it is.",
                refusal.kind,
                ByteSize(refusal.json_bytes)
            ),
        ),
    }
}

/// Puts the `Held` condition and a Warning Event on `object`; false when the tenant did not take
/// them (it is down, say), so that it is told again at its next look.
pub async fn tell<K, T>(tenant: &T, object: &K, refusal: &Refusal) -> bool
where
    K: Resource<DynamicType = ()>,
    T: Tenant + ?Sized,
{
    let Some((client, recorder)) = tenant.publisher() else {
        return true;
    };
    let (reason, message) = why(refusal);
    let message = fit_text(message, MAX_CONDITION_MESSAGE_BYTES);
    let condition = json!({
        "type": HELD,
        "status": "True",
        "reason": reason,
        "message": message,
        "lastTransitionTime": Time(Timestamp::now()),
        "observedGeneration": object.meta().generation,
    });
    let written = apply_status(client, object, json!({ "conditions": [condition] })).await;
    let note = event(EventType::Warning, reason, "Hold", message);
    if let Err(err) = recorder.publish(&note, &object.object_ref(&())).await {
        log_unpublished(&err);
    }
    written
}

/// Removes the `Held` condition from `object` if it shows one: it runs again.
pub async fn clear<K, T>(tenant: &T, object: &K)
where
    K: Resource<DynamicType = ()> + Serialize,
    T: Tenant + ?Sized,
{
    let Some((client, _)) = tenant.publisher() else {
        return;
    };
    if shows_held(object) {
        apply_status(client, object, json!({})).await;
    }
}

/// Whether `object`'s status has a `Held` condition (written by an earlier look, maybe by an
/// earlier run of the daemon).
fn shows_held<K: Serialize>(object: &K) -> bool {
    let Ok(value) = serde_json::to_value(object) else {
        return false;
    };
    let conditions = value.pointer("/status/conditions").and_then(Value::as_array);
    conditions
        .into_iter()
        .flatten()
        .any(|condition| condition.get("type").and_then(Value::as_str) == Some(HELD))
}

/// Applies `status` as everything [`FIELD_MANAGER`] wants in `object`'s status.
async fn apply_status<K: Resource<DynamicType = ()>>(client: &Client, object: &K, status: Value) -> bool {
    let resource = ApiResource::erase::<K>(&());
    let api: Api<DynamicObject> = match object.namespace() {
        Some(namespace) => Api::namespaced_with(client.clone(), &namespace, &resource),
        None => Api::all_with(client.clone(), &resource),
    };
    let body = json!({
        "apiVersion": resource.api_version,
        "kind": resource.kind,
        "metadata": { "name": object.name_any() },
        "status": status,
    });
    let params = PatchParams::apply(FIELD_MANAGER).force();
    match api.patch_status(&object.name_any(), &params, &Patch::Apply(body)).await {
        Ok(_) => true,
        Err(err) => {
            debug!(error = %err, "could not write the Held condition");
            false
        }
    }
}
