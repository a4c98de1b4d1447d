//! Events on tenant objects.

use k8s_openapi::api::core::v1::ObjectReference;
use kube::Resource;
use kube::runtime::events::EventType;

use super::tenant::TenantContext;
use crate::runtime::events::{event, log_unpublished};

/// Publishes an Event on a tenant object; a failure to publish never fails a reconcile.
pub async fn publish<K>(context: &TenantContext, object: &K, warning: bool, reason: &str, note: String)
where
    K: Resource<DynamicType = ()>,
{
    let type_ = if warning { EventType::Warning } else { EventType::Normal };
    let reference: ObjectReference = object.object_ref(&());
    if let Err(err) = context
        .recorder
        .publish(&event(type_, reason, reason, note), &reference)
        .await
    {
        log_unpublished(&err);
    }
}
