//! Keeps each tenant's host ResourceQuota and LimitRange (`crate::host::quota`) and its
//! NetworkPolicy (`crate::host::network_policy`) in place.

use std::sync::Arc;

use kube::api::Api;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::info;

use super::host_namespace::{HostSetupError, watch_host};
use crate::context::tenant::{TenantContext, TenantError};
use crate::host::network_policy::ensure_policy;
use crate::host::quota::ensure_both;
use crate::runtime::controller::Singleton;

/// Keeps the tenant's ResourceQuota, LimitRange and NetworkPolicy as the flags say, repairing them
/// when they are edited or deleted (all are watched, filtered to this tenant). `applied` turns true
/// after the first success: the controllers that create pods start only then. Run it once the
/// daemon may write in the host namespace.
pub async fn run(
    context: Arc<TenantContext>,
    cancel: CancellationToken,
    applied: watch::Sender<bool>,
) -> Result<(), TenantError> {
    let namespace = context.host_namespace.clone();
    let (quotas, quota_events) = watch_host(
        Api::namespaced(context.host.clone(), &namespace),
        context.host_watch_config(),
    );
    let (limit_ranges, limit_events) = watch_host(
        Api::namespaced(context.host.clone(), &namespace),
        context.host_watch_config(),
    );
    let (policies, policy_events) = watch_host(
        Api::namespaced(context.host.clone(), &namespace),
        context.host_watch_config(),
    );
    let reconcile = |_permit| {
        let (context, applied) = (context.clone(), applied.clone());
        let (quotas, limit_ranges, policies) = (quotas.clone(), limit_ranges.clone(), policies.clone());
        async move {
            let (tenant, namespace) = (&context.name, &context.host_namespace);
            let settings = &context.shared.settings;
            let (quota, monitoring) = (&settings.tenant_quota, settings.monitoring_namespace.as_deref());
            let mut writes = ensure_both(&context.host, tenant, namespace, quota, &quotas, &limit_ranges).await?;
            let policy = ensure_policy(&context.host, tenant, namespace, monitoring, &policies).await?;
            writes += usize::from(policy.wrote());
            if writes > 0 {
                info!(writes, "tenant quota, limits and network policy applied");
            }
            applied.send_replace(true);
            Ok::<_, HostSetupError>(())
        }
    };
    Singleton::new("host-quota", context.clone())
        .object(&context.host_namespace)
        .watches(quotas.clone(), quota_events)
        .watches(limit_ranges.clone(), limit_events)
        .watches(policies.clone(), policy_events)
        .run(reconcile, &cancel)
        .await;
    Ok(())
}
