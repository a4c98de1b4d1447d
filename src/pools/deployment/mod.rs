//! The ClusterDeployment controller (DESIGN.md §4.2, §4.3 item 11): provisions each cluster with an
//! installer Job on the host, copies its admin kubeconfig to the tenant, retries a failed install up
//! to `installAttemptsLimit`, and on deletion runs the destroy Job, then releases the CDC, then
//! removes its finalizer.
//!
//! A reconcile observes (the ClusterDeployment, its host Jobs and Secrets from the caches, the
//! tenant Secrets it needs), decides in `plan`, carries the decision out in `provision` or
//! `deprovision` with the host objects of `installer`, and records the outcome through
//! `status`.

mod admin_kubeconfig;
mod deprovision;
mod installer;
mod plan;
mod provision;
mod status;

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use jiff::Timestamp;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::PostParams;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Resource, ResourceExt};
use tokio_util::sync::CancellationToken;

use self::status::Outcome;
use crate::api::pools::ClusterDeployment;
use crate::context::events::publish;
use crate::context::tenant::TenantContext;
use crate::host::Parent;
use crate::host::apply::HostWriteError;
use crate::host::labels::{TENANT_KIND_ANNOTATION, TENANT_NAME_ANNOTATION, TENANT_NAMESPACE_ANNOTATION};
use crate::runtime::api_errors::is_conflict;
use crate::runtime::cache::{is_filled, reflect};
use crate::runtime::metrics::Metrics;
use crate::runtime::panics::{self, ReconcilePanic};
use crate::runtime::readiness::Readiness;
use crate::runtime::recovery::NoTriggerBackoff;
use crate::runtime::retry;
use crate::runtime::shutdown::run_controller;

const KIND: &str = "ClusterDeployment";

/// Label naming the ClusterDeployment on the admin kubeconfig Secret stackd creates.
pub const CLUSTER_DEPLOYMENT_LABEL: &str = "pools.stackd.dev/cluster-deployment";
/// The uid of that ClusterDeployment: with the labels, it proves stackd made the Secret for it.
pub const CLUSTER_DEPLOYMENT_UID_ANNOTATION: &str = "pools.stackd.dev/cluster-deployment-uid";

#[derive(Debug, thiserror::Error)]
pub enum DeploymentError {
    #[error("tenant API request failed: {0}")]
    Tenant(#[source] kube::Error),
    #[error(transparent)]
    Host(#[from] HostWriteError),
    #[error("host API request failed: {0}")]
    HostApi(#[source] kube::Error),
    #[error(transparent)]
    Panicked(#[from] ReconcilePanic),
}

struct Ctx {
    tenant: Arc<TenantContext>,
    jobs: Store<Job>,
    secrets: Store<Secret>,
    /// Decisions need the host caches too: with an empty one a deleted cluster would look as if it
    /// never had an installer, and be let go without its destroy Job.
    caches_filled: Readiness,
}

/// Runs the controller until `cancel` fires.
pub async fn run(context: Arc<TenantContext>, cancel: CancellationToken) {
    let host_config = context.host_watch_config();
    let (cds, cd_stream) = reflect(
        Api::<ClusterDeployment>::all(context.client.clone()),
        Default::default(),
    );
    let (jobs, job_stream) = reflect(
        Api::<Job>::namespaced(context.host.clone(), &context.host_namespace),
        host_config.clone(),
    );
    let (secrets, secret_stream) = reflect(
        Api::<Secret>::namespaced(context.host.clone(), &context.host_namespace),
        host_config,
    );
    // Not the ClusterDeployment store: the controller awaits its own main store, and a second
    // waiter on a store is never woken (see runtime::readiness).
    let caches_filled = {
        let caches = (jobs.clone(), secrets.clone());
        Readiness::after(async move {
            let (jobs, secrets) = caches;
            jobs.wait_until_ready().await.is_ok() && secrets.wait_until_ready().await.is_ok()
        })
    };
    let ctx = Arc::new(Ctx {
        tenant: context.clone(),
        jobs,
        secrets,
        caches_filled,
    });
    let shutdown = cancel.clone();
    let main_store = cds.clone();
    let run = Controller::for_stream(cd_stream, cds)
        .trigger_backoff(NoTriggerBackoff)
        .watches_stream(job_stream, owner_of)
        .watches_stream(secret_stream, owner_of)
        .graceful_shutdown_on(async move { shutdown.cancelled().await })
        .run(reconcile, error_policy, ctx)
        .for_each(|_| std::future::ready(()));
    run_controller(run, &cancel, || is_filled(&main_store)).await;
}

/// The ClusterDeployment a host object was made for, from its identity annotations.
fn owner_of<K: Resource>(object: K) -> Option<ObjectRef<ClusterDeployment>> {
    let annotations = object.meta().annotations.as_ref()?;
    if annotations.get(TENANT_KIND_ANNOTATION).map(String::as_str) != Some(KIND) {
        return None;
    }
    let name = annotations.get(TENANT_NAME_ANNOTATION)?;
    let namespace = annotations.get(TENANT_NAMESPACE_ANNOTATION)?;
    Some(ObjectRef::new(name).within(namespace))
}

fn error_policy(cd: Arc<ClusterDeployment>, err: &DeploymentError, ctx: Arc<Ctx>) -> Action {
    let key = format!("cd/{}/{}", cd.namespace().unwrap_or_default(), cd.name_any());
    let logged = (ctx.tenant.name.as_str(), "clusterdeployment", key.as_str());
    Action::requeue(retry::after_failure(&ctx.tenant.object_backoff, &key, logged, err))
}

fn parent(cd: &ClusterDeployment) -> Parent {
    Parent::new(
        KIND,
        cd.namespace().as_deref(),
        &cd.name_any(),
        cd.metadata.uid.as_deref().unwrap_or_default(),
    )
}

async fn reconcile(cd: Arc<ClusterDeployment>, ctx: Arc<Ctx>) -> Result<Action, DeploymentError> {
    let tenant = &ctx.tenant;
    let labels = Metrics::controller(&tenant.name, "clusterdeployment");
    tenant.shared.metrics.reconciles.get_or_create(&labels).inc();
    // Not `Store::wait_until_ready` from concurrent reconciles: it wakes only its last waiter.
    if !ctx.caches_filled.wait().await {
        return Ok(Action::await_change());
    }
    let Ok(_permit) = tenant.reconcile_permits.acquire().await else {
        return Ok(Action::await_change());
    };
    let result = if cd.metadata.deletion_timestamp.is_some() {
        panics::contain(deprovision::deprovision(&cd, &ctx)).await
    } else {
        panics::contain(provision::provision(&cd, &ctx)).await
    };
    match &result {
        Ok(_) => {
            tenant
                .object_backoff
                .succeeded(&format!("cd/{}/{}", cd.namespace().unwrap_or_default(), cd.name_any()))
        }
        Err(_) => {
            tenant.shared.metrics.reconcile_errors.get_or_create(&labels).inc();
        }
    }
    result
}

fn cd_api(ctx: &Ctx, cd: &ClusterDeployment) -> Api<ClusterDeployment> {
    Api::namespaced(ctx.tenant.client.clone(), &cd.namespace().unwrap_or_default())
}

/// Cached host objects of this cluster.
fn owned<K: Resource<DynamicType = ()> + Clone>(store: &Store<K>, parent: &Parent, tenant: &str) -> Vec<K> {
    let wanted = parent.labels(tenant);
    store
        .state()
        .into_iter()
        .filter(|o| {
            let labels = o.meta().labels.clone().unwrap_or_default();
            wanted.iter().all(|(k, v)| labels.get(k) == Some(v))
        })
        .map(|o| (*o).clone())
        .collect()
}

/// Writes the CD's status with its resourceVersion as precondition; a conflict is left to the
/// watch event that caused it. Returns whether anything was written.
async fn set_status(
    cd: &ClusterDeployment,
    ctx: &Ctx,
    change: impl FnOnce(&mut crate::api::pools::ClusterDeploymentStatus, Time) -> bool,
) -> Result<bool, DeploymentError> {
    let mut updated = cd.clone();
    let status = updated.status.get_or_insert_with(Default::default);
    if !change(status, Time(Timestamp::now())) {
        return Ok(false);
    }
    updated.metadata.managed_fields = None;
    match cd_api(ctx, cd)
        .replace_status(&cd.name_any(), &PostParams::default(), &updated)
        .await
    {
        Ok(_) => Ok(true),
        Err(err) if is_conflict(&err) => Ok(false),
        Err(err) => Err(DeploymentError::Tenant(err)),
    }
}

/// Records `outcome` in the status and, once written, publishes its Event. Returns whether it
/// wrote.
async fn report(cd: &ClusterDeployment, ctx: &Ctx, outcome: &Outcome) -> Result<bool, DeploymentError> {
    let generation = cd.metadata.generation;
    let written = set_status(cd, ctx, |status, now| outcome.record(status, generation, now)).await?;
    if written && let Some(note) = outcome.note() {
        publish(&ctx.tenant, cd, note.warning, note.reason, note.message).await;
    }
    Ok(written)
}

/// Tenant Secrets are not watched (there are too many): how soon to look at one again.
fn tenant_secret_recheck(ctx: &Ctx) -> Duration {
    let settings = &ctx.tenant.shared.settings;
    settings.backoff.base.saturating_mul(10).min(Duration::from_secs(30))
}
