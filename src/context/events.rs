//! Events on tenant objects.

use k8s_openapi::api::core::v1::ObjectReference;
use kube::Resource;
use kube::runtime::events::{Event, EventType};
use tracing::debug;

use super::tenant::TenantContext;

/// Publishes an Event on a tenant object; a failure to publish never fails a reconcile.
pub async fn publish<K>(context: &TenantContext, object: &K, warning: bool, reason: &str, note: String)
where
    K: Resource<DynamicType = ()>,
{
    let event = Event {
        type_: if warning { EventType::Warning } else { EventType::Normal },
        reason: reason.into(),
        note: Some(note),
        action: reason.into(),
        secondary: None,
    };
    let reference: ObjectReference = object.object_ref(&());
    if let Err(err) = context.recorder.publish(&event, &reference).await {
        debug!(error = %err, "cannot publish an event");
    }
}
