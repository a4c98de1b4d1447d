//! Cluster pools (DESIGN.md §4): per tenant, a ClusterPool controller (inventory leasing, capacity,
//! claims, staleness), a ClusterDeployment controller (installer and destroy Jobs on the host) and a
//! ClusterClaim controller (claims naming a pool that does not exist).

mod buckets;
mod claim;
mod create;
mod deployment;
mod execute;
mod failure_domains;
mod host_selection;
mod hosts;
mod install_config;
mod installer_image;
mod judgement;
mod lease_state;
mod leases;
mod limits;
mod machines;
mod membership;
mod metrics;
mod observe;
mod pass;
mod patch_share;
mod plan;
pub mod pool;
mod record;
mod repair;
pub mod sample;
mod status;
mod templates;
mod version;

use std::fmt::Debug;
use std::sync::Arc;

use kube::api::{Patch, PatchParams};
use kube::{Api, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::context::tenant::{TenantContext, TenantError};

/// Group of every pool kind; finalizers and labels use it as their prefix.
pub(crate) const GROUP: &str = "pools.stackd.dev";
/// Finalizer on a ClusterDeployment until its destroy Job finished and its CDC was released.
pub(crate) const DEPROVISION_FINALIZER: &str = "pools.stackd.dev/deprovision";
/// Finalizer on a ClusterPool until its unclaimed clusters are gone.
pub(crate) const POOL_FINALIZER: &str = "pools.stackd.dev/clusters";
/// Labels on a pool cluster's namespace (and on the cluster); see [`membership`] for what proves
/// that a pool created a cluster.
pub(crate) use crate::api::pools::{POOL_NAME_LABEL, POOL_NAMESPACE_LABEL};
/// Annotations on a pool's ClusterDeployment.
pub(crate) const POOL_VERSION_ANNOTATION: &str = "pools.stackd.dev/pool-version";
pub(crate) const CDC_GENERATION_ANNOTATION: &str = "pools.stackd.dev/customization-generation";

/// The per-pool finalizer a pool puts on every CDC it has used (§4.3.9).
pub(crate) fn cdc_finalizer(pool: &str) -> String {
    format!("{GROUP}/{pool}")
}

/// The controllers [`run`] starts.
pub(crate) const CONTROLLERS: [&str; 3] = [pool::CONTROLLER, deployment::CONTROLLER, claim::CONTROLLER];

/// Starts the ClusterPool and ClusterDeployment controllers of one tenant and runs them until
/// `cancel` fires.
pub(crate) async fn run(context: Arc<TenantContext>, cancel: CancellationToken) -> Result<(), TenantError> {
    let mut controllers = tokio::task::JoinSet::new();
    controllers.spawn(pool::run(context.clone(), cancel.clone()));
    controllers.spawn(deployment::run(context.clone(), cancel.clone()));
    controllers.spawn(claim::run(context.clone(), cancel.clone()));
    // Each controller stops by itself on `cancel` (runtime::shutdown); one stopping before that is
    // a failure of the tenant.
    while let Some(result) = controllers.join_next().await {
        result.map_err(|e| TenantError::Controller(e.to_string()))?;
        if !cancel.is_cancelled() {
            return Err(TenantError::Controller("a pool controller stopped".into()));
        }
    }
    Ok(())
}

/// Runs tenant-sized work (parsing, patching and rendering documents of up to the install config's
/// bounds) on the blocking pool, off the async workers every tenant shares. A panic there is the
/// reconcile's own panic, contained like one.
pub(crate) async fn off_the_async_workers<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> T {
    match tokio::task::spawn_blocking(work).await {
        Ok(value) => value,
        Err(err) if err.is_panic() => std::panic::resume_unwind(err.into_panic()),
        // Only a runtime shutting down cancels blocking work: the reconcile goes with it.
        Err(_) => std::future::pending().await,
    }
}

/// Sets the finalizers of `object` with a merge patch carrying its resourceVersion, so a stale copy
/// gets 409 instead of overwriting someone else's finalizer change.
pub(crate) async fn set_finalizers<K>(api: &Api<K>, object: &K, finalizers: Vec<String>) -> Result<K, kube::Error>
where
    K: Resource + Clone + Debug + Serialize + DeserializeOwned,
{
    let patch = json!({"metadata": {
        "finalizers": finalizers,
        "resourceVersion": object.meta().resource_version,
    }});
    api.patch(&object.name_any(), &PatchParams::default(), &Patch::Merge(&patch))
        .await
}
