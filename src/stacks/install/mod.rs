//! The StackInstall / ClusterStackInstall controller (DESIGN.md §3.2, install half of §3.4): runs the
//! install Job on the host, reads and verifies its output, applies the CRDs and the Stack on the
//! tenant, and on deletion removes them again in order.

mod admission;
mod applied;
mod complete;
pub mod crd_policy;
pub mod job;
mod job_lifecycle;
mod object;
mod output;
pub mod package;
pub mod pod_wait;
mod reconcile;
mod status;
mod uninstall;
mod unpacked;

use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::runtime::controller::Action;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio_util::sync::CancellationToken;

use crate::api::stacks::{ClusterStackInstall, InstallSpec, PermissionScope, Stack, StackInstall, StackInstallStatus};
use crate::context::tenant::{TenantContext, TenantError};
use crate::host::labels::{TENANT_KIND_ANNOTATION, TENANT_NAME_ANNOTATION, TENANT_NAMESPACE_ANNOTATION};
use crate::runtime::controller::{Permit, ReconcileError, Scaffold};
use crate::runtime::finalizer::{self, Cleanup, FinalizerError};
use crate::runtime::panics::ReconcilePanic;
use crate::runtime::written::Written;
use crate::stacks::crd_changes::CrdChanges;
use crate::stacks::{INSTALL_FINALIZER, crd_parent_label};

/// The two install kinds differ only in the permission scope of the stacks they install.
pub trait InstallKind:
    Resource<DynamicType = (), Scope = NamespaceResourceScope>
    + Clone
    + Debug
    + Serialize
    + DeserializeOwned
    + Send
    + Sync
    + 'static
{
    const SCOPE: PermissionScope;
    /// The kind's controller, named by the kind (its `controller` metric label).
    const CONTROLLER: &'static str;
    /// The other install kind: a StackInstall and a ClusterStackInstall of one name in one
    /// namespace would share a Stack, so admission weighs each against the other.
    type Other: InstallKind;
    fn install(&self) -> &InstallSpec;
    fn install_status(&self) -> Option<&StackInstallStatus>;
    /// The tenant's cache of this kind.
    fn cache(ctx: &InstallContext) -> &Store<Self>;
}

impl InstallKind for StackInstall {
    const SCOPE: PermissionScope = PermissionScope::Namespaced;
    const CONTROLLER: &'static str = "StackInstall";
    type Other = ClusterStackInstall;
    fn install(&self) -> &InstallSpec {
        &self.spec.install
    }
    fn install_status(&self) -> Option<&StackInstallStatus> {
        self.status.as_ref()
    }
    fn cache(ctx: &InstallContext) -> &Store<Self> {
        &ctx.stack_installs
    }
}

impl InstallKind for ClusterStackInstall {
    const SCOPE: PermissionScope = PermissionScope::Cluster;
    const CONTROLLER: &'static str = "ClusterStackInstall";
    type Other = StackInstall;
    fn install(&self) -> &InstallSpec {
        &self.spec.install
    }
    fn install_status(&self) -> Option<&StackInstallStatus> {
        self.status.as_ref()
    }
    fn cache(ctx: &InstallContext) -> &Store<Self> {
        &ctx.cluster_stack_installs
    }
}

/// The field manager of the install controller's writes to tenant objects.
const FIELD_MANAGER: &str = "stackd/install";

/// `Ready=False` reasons that say an install failed and why (published as Warning Events), as
/// opposed to one still on its way.
pub const FAILURE_REASONS: &[&str] = &[
    "InstallJobFailed",
    "InvalidPackage",
    "PermissionScopeMismatch",
    "PodSpecRefused",
    "InvalidDeploymentSpec",
    "CRDConflict",
    "CRDGroupReserved",
    "ConversionWebhookRefused",
    "CRDTerminating",
    "HostObjectConflict",
    "StackConflict",
    "PullSecretMissing",
    "InvalidPullSecretName",
    "PullSecretRefused",
    "TooManyPullSecrets",
    "TooManyCRDs",
    "TooManyInstalls",
    "RegistryNotAllowed",
    pod_wait::PACKAGE_PULL_FAILED,
    pod_wait::INSTALL_OUT_OF_MEMORY,
    crate::host::quota_share::REASON,
];

/// What one install controller reads from: its caches of host Jobs, tenant CRDs, Stacks and the
/// installs of both kinds (a namespace's bound counts them all).
pub struct InstallContext {
    pub tenant: Arc<TenantContext>,
    pub jobs: Store<Job>,
    /// The pods of the tenant's host objects, for what the kubelet says of an install Job's pod.
    pub pods: Store<Pod>,
    pub crds: Store<CustomResourceDefinition>,
    pub stacks: Store<Stack>,
    pub stack_installs: Store<StackInstall>,
    pub cluster_stack_installs: Store<ClusterStackInstall>,
    pub stackd_image: String,
    /// What each install Job's output came to, until the Job changes.
    unpacked: Arc<unpacked::Reads>,
    /// The last status written to each install.
    written: Arc<Written<StackInstallStatus>>,
    /// The installs admitted past `--namespace-max-installs`, both kinds', until cached as started.
    admitted: Arc<admission::Admitted>,
}

/// Why a reconcile failed; it is retried with backoff.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error("tenant API request failed: {0}")]
    Tenant(#[source] kube::Error),
    #[error(transparent)]
    Host(#[from] crate::host::apply::HostWriteError),
    #[error("host API request failed: {0}")]
    HostApi(#[source] kube::Error),
    /// Not transparent: the retry reads the finalizer error itself in the chain.
    #[error("{0}")]
    Finalizer(#[from] FinalizerError),
    #[error(transparent)]
    Panicked(#[from] ReconcilePanic),
}

impl ReconcileError for InstallError {
    fn metric_label(&self) -> &'static str {
        match self {
            InstallError::Tenant(_) => "tenant_api",
            InstallError::Host(_) => "host_write",
            InstallError::HostApi(_) => "host_api",
            InstallError::Finalizer(_) => "finalizer",
            InstallError::Panicked(_) => "panic",
        }
    }
}

/// One reconcile of an install (§3.2, §3.4) inside its finalizer: the finalizer is added before
/// anything else is done, and removed once the uninstall is finished.
async fn reconcile<K: InstallKind>(
    install: Arc<K>,
    ctx: Arc<InstallContext>,
    _permit: Permit,
) -> Result<Action, InstallError> {
    let namespace = install.namespace().unwrap_or_default();
    let api: Api<K> = Api::namespaced(ctx.tenant.client.clone(), &namespace);
    let deleting = install.meta().deletion_timestamp.is_some();
    let uid = install.uid().unwrap_or_default();
    let ctx = ctx.as_ref();
    let outcome = finalizer::reconcile(
        &api,
        INSTALL_FINALIZER,
        install,
        |install| async move {
            let (action, report) = reconcile::apply(install.as_ref(), ctx).await?;
            if let Some(report) = report {
                status::publish(install.as_ref(), ctx, report).await?;
            }
            Ok(action)
        },
        |install| async move {
            match uninstall::run(install.as_ref(), ctx).await? {
                uninstall::Progress::Done => Ok(Cleanup::Done),
                uninstall::Progress::Waiting(action, report) => {
                    status::publish(install.as_ref(), ctx, report).await?;
                    Ok(Cleanup::Pending(action))
                }
            }
        },
    )
    .await;
    if deleting {
        ctx.unpacked.forget(&uid);
        ctx.written.forget(&uid);
        ctx.admitted.forget(&namespace, &uid);
    }
    outcome
}

/// The controllers [`run`] starts.
pub const CONTROLLERS: [&str; 2] = [StackInstall::CONTROLLER, ClusterStackInstall::CONTROLLER];

/// Runs the StackInstall and ClusterStackInstall controllers of one tenant until `cancel`.
pub async fn run(context: Arc<TenantContext>, cancel: CancellationToken) -> Result<(), TenantError> {
    let admitted = Arc::new(admission::Admitted::default());
    tokio::join!(
        run_kind::<StackInstall>(context.clone(), admitted.clone(), cancel.clone()),
        run_kind::<ClusterStackInstall>(context, admitted, cancel),
    );
    Ok(())
}

async fn run_kind<K: InstallKind>(
    context: Arc<TenantContext>,
    admitted: Arc<admission::Admitted>,
    cancel: CancellationToken,
) {
    let caches = &context.caches;
    // Deletions matter too: a replaced Job's deletion lets its successor be created, a deleted
    // Stack lets its install's uninstall go on.
    let (jobs, crds, stacks) = (
        caches.host::<Job>(),
        caches.tenant_crds(),
        caches.tenant_guarded::<Stack>(),
    );
    let installs = caches.tenant_guarded::<K>();
    let pods = caches.host_selected::<Pod>(&crate::host::pod_trouble::pods_selector(&context.name));
    let (stack_installs, cluster_stack_installs) = (
        caches.tenant_guarded::<StackInstall>(),
        caches.tenant_guarded::<ClusterStackInstall>(),
    );
    let stackd_image = context.shared.settings.stackd_image.clone();
    let reads = Arc::new(unpacked::Reads::default());
    let written = Arc::new(Written::default());
    let ctx = Arc::new(InstallContext {
        tenant: context.clone(),
        jobs: jobs.store(),
        pods: pods.store(),
        crds: crds.store(),
        stacks: stacks.store(),
        stack_installs: stack_installs.store(),
        cluster_stack_installs: cluster_stack_installs.store(),
        stackd_image,
        unpacked: reads.clone(),
        written: written.clone(),
        admitted,
    });
    let (install_store, applied_stacks, crd_store) = (installs.store(), stacks.store(), crds.store());
    let crd_changes = CrdChanges::default();
    let on_job = context.clone();
    let pod_jobs = jobs.store();
    let (refused_stacks, refused_clusters) = (install_store.clone(), install_store.clone());
    let (stack_store, cluster_store) = (stack_installs.store(), cluster_stack_installs.store());
    Scaffold::ignoring_own_writes(K::CONTROLLER, context, &installs, written)
        .watches(&jobs, move |job| {
            // The cache has shown this Job: its creation is no longer pending.
            on_job.host_writes.seen(job.as_ref());
            install_of::<K>(job.as_ref())
        })
        // What the kubelet says of an install Job's pod is the install's status.
        .watches(&pods, move |pod| {
            crate::host::pod_trouble::job_of(&pod_jobs, pod.as_ref()).and_then(|job| install_of::<K>(job.as_ref()))
        })
        // By name, not owner reference: a Stack at the install's name that another controls, or
        // one whose owner reference was removed, concerns the install as much as its own.
        .watches(&stacks, |stack| {
            Some(ObjectRef::new(&stack.name_any()).within(&stack.namespace().unwrap_or_default()))
        })
        .watches(&crds, move |crd| {
            let change = crd_changes.note(&crd_store, &crd);
            installs_using(&install_store, &applied_stacks, &reads, &crd, change.content)
        })
        // An install going frees a place in its namespace (`--namespace-max-installs`).
        .watches(&stack_installs, move |install| {
            admission::refused_in_namespace_of(&refused_stacks, &stack_store, install.as_ref())
        })
        .watches(&cluster_stack_installs, move |install| {
            admission::refused_in_namespace_of(&refused_clusters, &cluster_store, install.as_ref())
        })
        .run(ctx, reconcile::<K>, &cancel)
        .await;
}

/// The install of either kind a host object belongs to, from its identity annotations.
pub(crate) struct InstallAt {
    pub kind: String,
    pub namespace: String,
    pub name: String,
}

pub(crate) fn install_at(object: &impl Resource) -> Option<InstallAt> {
    let annotations = object.meta().annotations.as_ref()?;
    let kind = annotations.get(TENANT_KIND_ANNOTATION)?;
    if kind != StackInstall::kind(&()).as_ref() && kind != ClusterStackInstall::kind(&()).as_ref() {
        return None;
    }
    Some(InstallAt {
        kind: kind.clone(),
        namespace: annotations.get(TENANT_NAMESPACE_ANNOTATION)?.clone(),
        name: annotations.get(TENANT_NAME_ANNOTATION)?.clone(),
    })
}

/// The install of kind `K` at the namespace and name of the install a host object belongs to. The
/// other kind's objects count too: both kinds map a name to the same install Job, so an install
/// refused because the other kind holds that Job hears when it goes.
fn install_of<K: InstallKind>(object: &impl Resource) -> Option<ObjectRef<K>> {
    let at = install_at(object)?;
    Some(ObjectRef::new(&at.name).within(&at.namespace))
}

/// The installs a change of `crd` concerns: when what installs wait for in it `changed` (anything
/// but the stacks' labels, see [`crate::stacks::crd_changes`]), those using it (they labelled it) until their package is applied (they wait
/// for it to be Established) or while they are uninstalled (which drops their label and may delete
/// it): an install whose package is applied reads no CRD, it reports its Stack. And on any change,
/// those refused because of a tenant CRD whose package has a CRD of its name or in its group, so
/// they look again (other CRD changes cannot lift their refusal).
fn installs_using<K: InstallKind>(
    installs: &Store<K>,
    stacks: &Store<Stack>,
    reads: &unpacked::Reads,
    crd: &CustomResourceDefinition,
    changed: bool,
) -> Vec<ObjectRef<K>> {
    let labels = crd.labels();
    let (name, group) = (crd.name_any(), crd.spec.group.as_str());
    installs
        .state()
        .iter()
        .filter(|install| {
            let label = crd_parent_label(&install.namespace().unwrap_or_default(), &install.name_any());
            (changed && labels.contains_key(&label) && !past_its_crds(install.as_ref(), stacks))
                || (refused_for_a_crd(install.as_ref())
                    && reads.concerns(&install.uid().unwrap_or_default(), &name, group))
        })
        .map(|install| ObjectRef::from_obj(install.as_ref()))
        .collect()
}

/// Whether `install` no longer looks at CRDs: it is not being deleted and the cache shows its
/// package applied. A cache that does not show the Stack yet wakes it once more, which is harmless.
fn past_its_crds<K: InstallKind>(install: &K, stacks: &Store<Stack>) -> bool {
    let package = job::package_image(install.install());
    install.meta().deletion_timestamp.is_none() && applied::cached_applied_stack(install, stacks, &package).is_some()
}

/// `Ready=False` reasons that a change of the tenant's CRDs may lift.
const CRD_WAIT_REASONS: &[&str] = &["CRDConflict", "CRDTerminating"];

fn refused_for_a_crd<K: InstallKind>(install: &K) -> bool {
    install.install_status().is_some_and(|status| {
        status
            .conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "False" && CRD_WAIT_REASONS.contains(&c.reason.as_str()))
    })
}

/// How long to wait for a Job to finish before looking again, as a safety net for a lost watch event.
const SAFETY_NET: Duration = Duration::from_secs(300);
