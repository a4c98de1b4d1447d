//! Keeps the tenant's host namespace and the daemon's RoleBinding there as they should be,
//! repairing them when they are edited or deleted: both are watched (one watch per replica,
//! [`crate::host::namespace_watch`], whose events about this namespace wake it), never polled.

use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::Resource;
use kube::api::{Api, ListParams};
use kube::runtime::reflector::{self, Store, reflector};
use kube::runtime::watcher;
use serde::de::DeserializeOwned;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::context::tenant::{TenantContext, TenantError};
use crate::host::labels::tenant_selector;
use crate::host::namespace::{self, NamespaceError};
use crate::host::quota::QuotaError;
use crate::runtime::api_errors::{answer_message, is_forbidden};
use crate::runtime::controller::{ReconcileError, Singleton};
use crate::runtime::panics::ReconcilePanic;
use crate::runtime::recovery::{WatchBackoff, retry_watch};

/// Why setting up the tenant's host namespace failed; retried with backoff.
#[derive(Debug, thiserror::Error)]
pub(super) enum HostSetupError {
    #[error(transparent)]
    Namespace(#[from] NamespaceError),
    #[error(transparent)]
    Quota(#[from] QuotaError),
    #[error(transparent)]
    Panicked(#[from] ReconcilePanic),
}

impl ReconcileError for HostSetupError {
    fn metric_label(&self) -> &'static str {
        match self {
            HostSetupError::Namespace(_) => "host_namespace",
            HostSetupError::Quota(_) => "host_quota",
            HostSetupError::Panicked(_) => "panic",
        }
    }
}

/// A cache of the objects `api` lists under `config`, and a stream that yields on
/// every watch event, the first (empty) list included.
pub(super) fn watch_host<K>(
    api: Api<K>,
    config: watcher::Config,
) -> (
    Store<K>,
    impl Stream<Item = Result<(), watcher::Error>> + Send + 'static,
)
where
    K: Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned + Send + Sync + 'static,
{
    let (store, writer) = reflector::store();
    let events = retry_watch(
        reflector(writer, watcher(api, config)).boxed(),
        None,
        WatchBackoff::default(),
    )
    .map_ok(|_| ());
    (store, events)
}

/// Runs the host namespace controller until `cancel`. `ready` turns true once the namespace and
/// the RoleBinding exist and the daemon's access through the RoleBinding works.
pub(super) async fn run(
    context: Arc<TenantContext>,
    cancel: CancellationToken,
    ready: tokio::sync::watch::Sender<bool>,
) -> Result<(), TenantError> {
    let watch = context.shared.namespaces.clone();
    let changes = watch.changes_of(&context.host_namespace);
    let reconcile = |_permit| {
        let (context, ready, cancel) = (context.clone(), ready.clone(), cancel.clone());
        async move {
            let name = &context.host_namespace;
            let shared = &context.shared.namespaces;
            let observed_ns = match shared.namespace(name) {
                Some(ns) => Some(ns),
                // Not labelled as a tenant's (yet, or any more): the server says whether it exists.
                None => Api::<Namespace>::all(context.host.clone())
                    .get_opt(name)
                    .await
                    .map_err(NamespaceError::Api)?
                    .map(Arc::new),
            };
            let observed_rb = shared.binding(name);
            let subject = &context.shared.settings.rbac_subject;
            let (ns, rb) = (observed_ns.as_deref(), observed_rb.as_deref());
            let writes = namespace::ensure(&context.host, &context.name, name, subject, ns, rb).await?;
            if writes > 0 {
                info!(writes, "host namespace reconciled");
            }
            if !*ready.borrow() {
                await_access(&context, &cancel).await;
                ready.send_replace(true);
            }
            Ok::<_, HostSetupError>(())
        }
    };
    Singleton::new("host-namespace", context.clone())
        .object(&context.host_namespace)
        .triggered_by(move || watch.filled(), changes)
        .run(reconcile, &cancel)
        .await;
    Ok(())
}

/// How long a 403 in a new host namespace is taken for RBAC that has not taken effect yet.
const ACCESS_GRACE: Duration = Duration::from_secs(10);

/// Waits (quietly, for at most [`ACCESS_GRACE`]) until the daemon may read in its host namespace:
/// kube-apiserver's authorizer sees a new RoleBinding a moment after it is created.
async fn await_access(context: &TenantContext, cancel: &CancellationToken) {
    let secrets: Api<Secret> = Api::namespaced(context.host.clone(), &context.host_namespace);
    let probe = ListParams::default().labels(&tenant_selector(&context.name)).limit(1);
    let deadline = tokio::time::Instant::now() + ACCESS_GRACE;
    loop {
        match secrets.list_metadata(&probe).await {
            Err(err) if is_forbidden(&err) => {
                if tokio::time::Instant::now() > deadline {
                    warn!(message = %answer_message(&err), "the daemon's RoleBinding in the host namespace does not grant access; check the stackd-tenant-namespace ClusterRole");
                    return;
                }
                debug!("host namespace access not in effect yet; waiting");
            }
            // Anything else (access, or another trouble the controllers will report) ends the wait.
            _ => return,
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
        }
    }
}
