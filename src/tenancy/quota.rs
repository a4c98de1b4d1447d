//! Keeps each tenant's host ResourceQuota and LimitRange (`crate::host::quota`) and its
//! NetworkPolicy (`crate::host::network_policy`) in place.
//!
//! Only the NetworkPolicy is watched: it is the tenant's isolation, put back the moment a host
//! administrator opens it. The quota and LimitRange are fairness, and are read when the tenant
//! starts (before any of its pods is made) and then every sweep interval: a host-side edit of
//! either is put back within that interval, and the host serves two watches fewer per tenant
//! (issue 32, BENCHMARKS.md).

use std::sync::Arc;

use futures::StreamExt;
use kube::api::Api;
use tokio::sync::watch;
use tokio_stream::wrappers::IntervalStream;
use tokio_util::sync::CancellationToken;
use tracing::info;

use super::host_namespace::{HostSetupError, watch_host};
use crate::context::tenant::{TenantContext, TenantError};
use crate::host::network_policy::ensure_policy;
use crate::host::quota::ensure_both;
use crate::runtime::controller::Singleton;

/// Keeps the tenant's ResourceQuota, LimitRange and NetworkPolicy as the flags say, repairing them
/// when they are edited or deleted. `applied` turns true after the first success: the controllers
/// that create pods start only then. Run it once the daemon may write in the host namespace.
pub async fn run(
    context: Arc<TenantContext>,
    cancel: CancellationToken,
    applied: watch::Sender<bool>,
) -> Result<(), TenantError> {
    let namespace = context.host_namespace.clone();
    let (policies, policy_events) = watch_host(
        Api::namespaced(context.host.clone(), &namespace),
        context.host_watch_config(),
    );
    // The NetworkPolicy's first list brings the first reconcile; the checks follow it, each
    // tenant's at its own point of the interval (tenants that start together do not list together).
    let checks = IntervalStream::new(context.sweeps()).map(|_| Ok(()));
    let reconcile = |_permit| {
        let (context, applied) = (context.clone(), applied.clone());
        let policies = policies.clone();
        async move {
            let (tenant, namespace) = (&context.name, &context.host_namespace);
            let settings = &context.shared.settings;
            let (quota, monitoring) = (&settings.tenant_quota, settings.monitoring_namespace.as_deref());
            let mut writes = ensure_both(&context.host, tenant, namespace, quota).await?;
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
        .watches(policies.clone(), policy_events)
        .triggered_by(|| true, checks)
        .run(reconcile, &cancel)
        .await;
    Ok(())
}
