//! Keeps each tenant's host ResourceQuota and LimitRange (`crate::host::quota`) in place.

use std::fmt::Debug;
use std::sync::Arc;

use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use kube::Resource;
use kube::api::Api;
use kube::runtime::reflector::{self, Store, reflector};
use kube::runtime::{WatchStreamExt, watcher};
use serde::de::DeserializeOwned;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::context::tenant::{TenantContext, TenantError};
use crate::host::quota::ensure_both;
use crate::runtime::cache::is_filled;
use crate::runtime::metrics::Metrics;
use crate::runtime::recovery::WatchBackoff;

/// Keeps the tenant's ResourceQuota and LimitRange as the flags say, repairing them when they are
/// edited or deleted (both are watched, filtered to this tenant). `applied` turns true after the
/// first success: the controllers that create pods start only then. Run it once the daemon may
/// write in the host namespace.
pub async fn run(
    context: Arc<TenantContext>,
    cancel: CancellationToken,
    applied: watch::Sender<bool>,
) -> Result<(), TenantError> {
    let namespace = context.host_namespace.clone();
    let (quotas, quota_events) = watch_all(Api::namespaced(context.host.clone(), &namespace), &context);
    let (limit_ranges, limit_events) = watch_all(Api::namespaced(context.host.clone(), &namespace), &context);
    let mut events = futures::stream::select(quota_events, limit_events);
    let labels = Metrics::controller(&context.name, "host-quota");
    let mut failures = 0u32;
    // API errors announce no event, so a failed reconcile schedules its own retry.
    let mut retry: Option<tokio::time::Instant> = None;
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            _ = sleep_until(retry), if retry.is_some() => {}
            event = events.next() => match event {
                None => return Err(TenantError::Controller("host quota watch ended".into())),
                Some(Err(err)) => {
                    warn!(tenant = %context.name, error = %err, "host quota watch failed; retrying");
                    continue;
                }
                Some(Ok(())) => {}
            },
        }
        if !(is_filled(&quotas) && is_filled(&limit_ranges)) {
            continue;
        }
        context.shared.metrics.reconciles.get_or_create(&labels).inc();
        let ensured = ensure_both(
            &context.host,
            &context.name,
            &namespace,
            &context.shared.settings.tenant_quota,
            &quotas,
            &limit_ranges,
        );
        match ensured.await {
            Ok(writes) => {
                failures = 0;
                retry = None;
                if writes > 0 {
                    info!(tenant = %context.name, namespace = %namespace, writes, "tenant quota and limits applied");
                }
                applied.send_replace(true);
            }
            Err(err) => {
                failures += 1;
                context.shared.metrics.reconcile_errors.get_or_create(&labels).inc();
                let delay = context.shared.settings.backoff.delay(failures);
                warn!(tenant = %context.name, namespace = %namespace, error = %err, retry_in = ?delay, "tenant quota not applied");
                retry = Some(tokio::time::Instant::now() + delay);
            }
        }
    }
}

/// A cache of this tenant's objects of one kind, and a stream that yields on every watch event,
/// the first (empty) list included: a namespace without the object must hear of it to create it.
fn watch_all<K>(
    api: Api<K>,
    context: &TenantContext,
) -> (Store<K>, BoxStream<'static, Result<(), kube::runtime::watcher::Error>>)
where
    K: Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned + Send + Sync + 'static,
{
    let (store, writer) = reflector::store();
    let events = reflector(writer, watcher(api, context.host_watch_config()))
        .backoff(WatchBackoff::default())
        .map_ok(|_| ())
        .boxed();
    (store, events)
}

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    if let Some(deadline) = deadline {
        tokio::time::sleep_until(deadline).await;
    }
}
