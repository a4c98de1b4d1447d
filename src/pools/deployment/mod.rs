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
mod output;
mod plan;
mod provision;
mod status;

use std::sync::Arc;
use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Pod, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::runtime::controller::Action;
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
use crate::pools::DEPROVISION_FINALIZER;
use crate::runtime::api_errors::is_conflict;
use crate::runtime::controller::{Permit, ReconcileError, Scaffold};
use crate::runtime::finalizer::{self, FinalizerError};
use crate::runtime::informers::refusals::Refusals;
use crate::runtime::panics::ReconcilePanic;
use crate::runtime::status_writer::apply_status;

/// The controller's name, as its metrics and its tenant's start know it.
pub(crate) const CONTROLLER: &str = "clusterdeployment";

const KIND: &str = "ClusterDeployment";

/// The field manager of ClusterDeployment status writes.
pub(crate) const FIELD_MANAGER: &str = "stackd/deployment";

/// Label naming the ClusterDeployment on the admin kubeconfig Secret stackd creates.
pub(crate) const CLUSTER_DEPLOYMENT_LABEL: &str = "pools.stackd.dev/cluster-deployment";
/// The uid of that ClusterDeployment: with the labels, it proves stackd made the Secret for it.
pub(crate) const CLUSTER_DEPLOYMENT_UID_ANNOTATION: &str = "pools.stackd.dev/cluster-deployment-uid";

#[derive(Debug, thiserror::Error)]
pub(crate) enum DeploymentError {
    #[error("tenant API request failed: {0}")]
    Tenant(#[source] kube::Error),
    #[error(transparent)]
    Host(#[from] HostWriteError),
    #[error("host API request failed: {0}")]
    HostApi(#[source] kube::Error),
    /// Not transparent: the retry reads the finalizer error itself in the chain.
    #[error("{0}")]
    Finalizer(#[from] FinalizerError),
    #[error(transparent)]
    Panicked(#[from] ReconcilePanic),
}

struct Ctx {
    tenant: Arc<TenantContext>,
    jobs: Store<Job>,
    /// The pods of the tenant's host objects, for what the kubelet says of an installer pod.
    pods: Store<Pod>,
    secrets: Store<Secret>,
    /// The host Secrets the cache refused (over `--max-cached-object-bytes`): each fails only its
    /// own cluster ([`refused_host_secret`]).
    refused_secrets: Refusals,
}

impl ReconcileError for DeploymentError {
    fn metric_label(&self) -> &'static str {
        match self {
            DeploymentError::Tenant(_) => "tenant_api",
            DeploymentError::Host(_) => "host_write",
            DeploymentError::HostApi(_) => "host_api",
            DeploymentError::Finalizer(_) => "finalizer",
            DeploymentError::Panicked(_) => "panic",
        }
    }
}

/// Runs the controller until `cancel` fires.
pub(crate) async fn run(context: Arc<TenantContext>, cancel: CancellationToken) {
    let caches = &context.caches;
    let cds = caches.tenant_guarded::<ClusterDeployment>();
    let (jobs, secrets) = (caches.host::<Job>(), caches.host::<Secret>());
    let pods = caches.host_selected::<Pod>(&crate::host::pod_trouble::pods_selector(&context.name));
    let pod_jobs = jobs.store();
    let ctx = Arc::new(Ctx {
        tenant: context.clone(),
        jobs: jobs.store(),
        pods: pods.store(),
        secrets: secrets.store(),
        refused_secrets: secrets.refusals(),
    });
    // Decisions need the host caches too (the scaffold waits for every watched cache): with an
    // empty one a deleted cluster would look as if it never had an installer, and be let go
    // without its destroy Job.
    // Every event of a host Secret means the cache has shown it: a creation is no longer pending.
    // A refused one (an installer padded its output) fails its own cluster only, never holds off
    // its namespace's, let alone (its marks stripped) every namespace's.
    let on_secret = context.clone();
    Scaffold::new(CONTROLLER, context, &cds)
        .watches(&jobs, |job| owner_of(job.as_ref()))
        // What the kubelet says of an installer pod is its cluster's status.
        .watches(&pods, move |pod| {
            crate::host::pod_trouble::job_of(&pod_jobs, pod.as_ref()).and_then(|job| owner_of(job.as_ref()))
        })
        .watches_unheld(&secrets, move |secret| {
            on_secret.host_writes.seen(secret.as_ref());
            owner_of(secret.as_ref())
        })
        .run(ctx, reconcile, &cancel)
        .await;
}

/// The ClusterDeployment a host object was made for, from its identity annotations.
fn owner_of<K: Resource>(object: &K) -> Option<ObjectRef<ClusterDeployment>> {
    let annotations = object.meta().annotations.as_ref()?;
    if annotations.get(TENANT_KIND_ANNOTATION).map(String::as_str) != Some(KIND) {
        return None;
    }
    let name = annotations.get(TENANT_NAME_ANNOTATION)?;
    let namespace = annotations.get(TENANT_NAMESPACE_ANNOTATION)?;
    Some(ObjectRef::new(name).within(namespace))
}

/// What stops this cluster when the cache refused one of its host Secrets (over
/// `--max-cached-object-bytes`): such a Secret is neither read nor taken for missing.
fn refused_host_secret(ctx: &Ctx, names: &installer::Names) -> Option<Outcome> {
    let host_ns = ctx.tenant.host_namespace.as_str();
    let refused = |name: &str| ctx.refused_secrets.contains(Some(host_ns), name);
    let why = |name: &str| {
        format!(
            "host Secret {host_ns}/{name} is larger than the {} stackd reads (--max-cached-object-bytes)",
            ctx.tenant.shared.settings.max_cached_object_bytes
        )
    };
    if refused(&names.output) {
        Some(Outcome::OutputRefused(why(&names.output)))
    } else if refused(&names.input) {
        Some(Outcome::InputsTooLarge(why(&names.input)))
    } else {
        None
    }
}

/// How soon a cluster stopped by a refused host Secret looks again: the Secret's own events may not
/// name the cluster (an installer can strip its marks).
const REFUSED_RECHECK: Duration = Duration::from_secs(30);

fn parent(cd: &ClusterDeployment) -> Parent {
    Parent::new(
        KIND,
        cd.namespace().as_deref(),
        &cd.name_any(),
        cd.metadata.uid.as_deref().unwrap_or_default(),
    )
}

/// The finalizer goes on first; deletion deprovisions, and the finalizer comes off once that is
/// done (a pending deprovision keeps it).
async fn reconcile(cd: Arc<ClusterDeployment>, ctx: Arc<Ctx>, _permit: Permit) -> Result<Action, DeploymentError> {
    let api = cd_api(&ctx, &cd);
    let ctx = ctx.as_ref();
    finalizer::reconcile(
        &api,
        DEPROVISION_FINALIZER,
        cd,
        |cd| async move { provision::provision(&cd, ctx).await },
        |cd| async move { deprovision::deprovision(&cd, ctx).await },
    )
    .await
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
    let mut status = cd.status.clone().unwrap_or_default();
    if !change(&mut status, Time(Timestamp::now())) {
        return Ok(false);
    }
    let version = cd.metadata.resource_version.as_deref();
    match apply_status(&cd_api(ctx, cd), cd, FIELD_MANAGER, &status, version).await {
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
