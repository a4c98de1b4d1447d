//! The BareMetalAsset controller (DESIGN.md §5): mirrors role and cluster into labels, checks the
//! BMC credentials Secret (and owns it when nobody else does), delivers the host to its installed
//! cluster and detaches it again, and reports all of it with conditions and Events.
//!
//! A reconcile observes (the asset, the cached ClusterDeployments and their namespaces, the
//! credentials Secret), decides in `plan`, carries the decision out here, builds the status in
//! `status` and writes it. Only clusters the asset may reach are delivered to or detached from
//! (`reach`); the managed cluster is talked to in the background (`remote`), never while a
//! reconcile waits.

mod awaited;
pub(crate) use awaited::LOOKUPS_PER_NAMESPACE;
mod plan;
mod reach;
mod remote;
mod status;

use std::sync::Arc;
use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{OwnerReference, Time};
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, ResourceExt};
use serde_json::Value;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;
use tracing::warn;

use self::awaited::{AwaitedSecrets, Lookups};
use self::plan::{DELIVERED_TO_ANNOTATION, Delivery, Detach, HostReport, Snapshot, Step};
use self::remote::{Intent, Outcome, Poll, RemoteWork, cluster_at_fault};
use super::delivery;
use super::remote_host::DeliveryError;
use crate::api::inventory::BareMetalAsset;
use crate::api::pools::{ClusterDeployment, POOL_NAME_LABEL};
use crate::context::events::publish;
use crate::context::tenant::TenantContext;
use crate::runtime::api_errors::{is_conflict, is_not_found};
use crate::runtime::controller::{Permit, ReconcileError, Scaffold};
use crate::runtime::informers::refusals::Refusals;
use crate::runtime::panics::ReconcilePanic;
use crate::runtime::retry;
use crate::runtime::status_writer::apply_status;

/// The controller's name, as its metrics and its tenant's start know it.
pub(crate) const CONTROLLER: &str = "baremetalasset";

/// The field manager of BareMetalAsset status writes.
pub(crate) const FIELD_MANAGER: &str = "stackd/asset";

#[derive(Debug, thiserror::Error)]
pub(crate) enum AssetError {
    #[error("tenant API request failed: {0}")]
    Tenant(#[from] kube::Error),
    #[error(transparent)]
    Panicked(#[from] ReconcilePanic),
}

impl ReconcileError for AssetError {
    fn metric_label(&self) -> &'static str {
        match self {
            AssetError::Tenant(_) => "tenant_api",
            AssetError::Panicked(_) => "panic",
        }
    }
}

struct Ctx {
    tenant: Arc<TenantContext>,
    cds: Store<ClusterDeployment>,
    /// Namespaces pools created for their clusters: what proves an asset may reach one.
    namespaces: Store<Namespace>,
    remote: RemoteWork,
    /// Clusters too large to cache: not destroyed ones (see `runtime::informers::refusals`).
    refused_cds: Refusals,
    /// Credentials Secrets assets wait on, looked at again once per Secret, not per asset.
    awaited: Arc<AwaitedSecrets>,
}

/// Runs the controller until `cancel` fires.
pub(crate) async fn run(context: Arc<TenantContext>, cancel: CancellationToken) {
    let assets = context.caches.tenant_guarded::<BareMetalAsset>();
    let cds = context.caches.tenant_guarded::<ClusterDeployment>();
    // The pool controller's watch of its clusters' namespaces, shared.
    let namespaces = context.caches.tenant::<Namespace>(POOL_NAME_LABEL);
    let (wake, woken) = tokio::sync::mpsc::unbounded_channel();
    let awaited = Arc::new(AwaitedSecrets::default());
    let lookups = Lookups {
        tenant: context.clone(),
        assets: assets.store(),
        wake: wake.clone(),
    };
    let interval = credentials_recheck(context.shared.settings.backoff.base);
    let _lookups = AbortOnDropHandle::new(tokio::spawn(awaited.clone().run(lookups, interval, cancel.clone())));
    let ctx = Arc::new(Ctx {
        tenant: context.clone(),
        cds: cds.store(),
        namespaces: namespaces.store(),
        remote: RemoteWork::new(context.shared.settings.backoff, wake, cancel.child_token()),
        refused_cds: cds.refusals(),
        awaited,
    });
    let (assets_of_cd, assets_of_namespace) = (assets.store(), assets.store());
    Scaffold::new(CONTROLLER, context, &assets)
        // A ClusterDeployment appearing or going changes `ClusterDeploymentFound` of its assets.
        .watches(&cds, move |cd| naming(&assets_of_cd, &cd.name_any()))
        // A cluster's namespace is the proof of who may reach it (the cluster has its name).
        .watches(&namespaces, move |ns| naming(&assets_of_namespace, &ns.name_any()))
        // A managed-cluster operation ended: its asset reads the outcome.
        .reconcile_on(UnboundedReceiverStream::new(woken))
        .run(ctx, reconcile, &cancel)
        .await;
}

/// The assets assigned or delivered to `cluster`.
fn naming(assets: &Store<BareMetalAsset>, cluster: &str) -> Vec<ObjectRef<BareMetalAsset>> {
    assets
        .state()
        .into_iter()
        .filter(|a| a.spec.assigned_cluster() == Some(cluster) || plan::delivered_to(a) == Some(cluster))
        .map(|a| ObjectRef::from_obj(&*a))
        .collect()
}

async fn reconcile(asset: Arc<BareMetalAsset>, ctx: Arc<Ctx>, _permit: Permit) -> Result<Action, AssetError> {
    reconcile_asset(&asset, &ctx).await
}

/// How often an asset whose cluster is too large to cache looks again.
const REFUSED_CLUSTER_RECHECK: std::time::Duration = std::time::Duration::from_secs(30);

/// The cached ClusterDeployment `name` (its namespace has its name) when an asset of `namespace`
/// may reach it; or why it may not, when it exists.
fn lookup(ctx: &Ctx, namespace: &str, name: Option<&str>) -> (Option<Arc<ClusterDeployment>>, Option<String>) {
    let Some(cd) = name.and_then(|name| ctx.cds.get(&ObjectRef::new(name).within(name))) else {
        return (None, None);
    };
    let cd_namespace = ctx.namespaces.get(&ObjectRef::new(&cd.namespace().unwrap_or_default()));
    match reach::check(namespace, &cd, cd_namespace.as_deref()) {
        Ok(()) => (Some(cd), None),
        Err(why) => (None, Some(why)),
    }
}

/// Nothing here waits on a managed cluster (see `remote`): the reconcile keeps its permit.
async fn reconcile_asset(asset: &BareMetalAsset, ctx: &Ctx) -> Result<Action, AssetError> {
    // A cluster that is too large to cache must not look destroyed (which would release the asset
    // while it is still in that cluster): wait until it can be read.
    let refused = |name: Option<&str>| name.is_some_and(|name| ctx.refused_cds.contains(Some(name), name));
    if refused(asset.spec.assigned_cluster()) || refused(plan::delivered_to(asset)) {
        return Ok(Action::requeue(REFUSED_CLUSTER_RECHECK));
    }
    let namespace = asset.namespace().unwrap_or_default();
    let (assigned, assigned_refused) = lookup(ctx, &namespace, asset.spec.assigned_cluster());
    let (delivered, delivered_refused) = lookup(ctx, &namespace, plan::delivered_to(asset));
    let snapshot = Snapshot {
        asset,
        assigned: assigned.as_deref(),
        delivered: delivered.as_deref(),
        assigned_refused,
        delivered_refused,
    };
    let assets = Api::<BareMetalAsset>::namespaced(ctx.tenant.client.clone(), &namespace);
    match plan::step(&snapshot) {
        Step::Detach(detach) => detach_asset(asset, ctx, detach, &assets).await,
        Step::Nothing => Ok(Action::await_change()),
        Step::Label(labels) => patch_metadata(&assets, asset, &plan::labels_patch(asset, &labels)).await,
        Step::Report => report(asset, ctx, &snapshot, &assets).await,
    }
}

/// A metadata merge patch carrying the asset's resourceVersion; the write's watch event brings the
/// asset back, and so does the change that made it conflict.
async fn patch_metadata(
    assets: &Api<BareMetalAsset>,
    asset: &BareMetalAsset,
    patch: &Value,
) -> Result<Action, AssetError> {
    match assets
        .patch(&asset.name_any(), &PatchParams::default(), &Patch::Merge(patch))
        .await
    {
        Ok(_) => Ok(Action::await_change()),
        Err(err) if is_conflict(&err) || is_not_found(&err) => Ok(Action::await_change()),
        Err(err) => Err(err.into()),
    }
}

/// Tenant Secrets are not watched (there are too many): how often the Secrets assets wait on are
/// looked at again (`awaited`).
pub(crate) fn credentials_recheck(backoff_base: Duration) -> Duration {
    backoff_base.saturating_mul(10).min(Duration::from_secs(30))
}

/// Checks the credentials and the cluster, delivers the host, and writes what it found. While the
/// delivery runs nothing is written: the asset is reconciled again when it ends.
async fn report(
    asset: &BareMetalAsset,
    ctx: &Ctx,
    snapshot: &Snapshot<'_>,
    assets: &Api<BareMetalAsset>,
) -> Result<Action, AssetError> {
    let credentials = observe_credentials(asset, ctx).await?;
    adopt_credentials(asset, &credentials).await?;
    if !credentials.verdict.ok {
        // The lookups of `awaited` wake the asset when the Secret changes.
        await_credentials(asset, ctx, credentials.secret.as_ref());
    }
    let mut requeue = None;
    let host = match plan::delivery(snapshot, credentials.verdict.ok) {
        Delivery::NoCluster => None,
        Delivery::Held(host) => Some(host),
        Delivery::Record(patch) => return patch_metadata(assets, asset, &patch).await,
        Delivery::Deliver { cluster, cd } => match deliver(asset, ctx, cd, cluster, credentials.secret.as_ref()) {
            None => return Ok(Action::await_change()),
            Some((host, after)) => {
                requeue = after;
                Some(host)
            }
        },
    };
    let report = status::Report {
        secret_exists: credentials.secret.is_some(),
        credentials: credentials.verdict,
        cluster: plan::cluster_found(snapshot),
        host,
    };
    if !write_report(asset, ctx, report, assets).await? {
        return Ok(Action::await_change());
    }
    Ok(requeue.map_or_else(Action::await_change, Action::requeue))
}

/// The asset's BMC credentials Secret as the tenant holds it, and what it is worth.
struct Credentials {
    secret: Option<Secret>,
    verdict: plan::Verdict,
    secrets: Api<Secret>,
}

/// Reads the credentials Secret (tenant Secrets are not cached: there are too many), unless it is
/// known to be missing.
async fn observe_credentials(asset: &BareMetalAsset, ctx: &Ctx) -> Result<Credentials, AssetError> {
    let namespace = asset.namespace().unwrap_or_default();
    let secrets = Api::<Secret>::namespaced(ctx.tenant.client.clone(), &namespace);
    let name = &asset.spec.bmc.credentials_name;
    let secret = match ctx.awaited.known_missing(&namespace, name) {
        true => None,
        false => secrets.get_opt(name).await?,
    };
    let limits = &ctx.tenant.shared.settings.document_limits;
    let verdict = plan::credentials(secret.as_ref(), name, &namespace, limits);
    Ok(Credentials {
        secret,
        verdict,
        secrets,
    })
}

/// The asset waits for its credentials Secret, as read (`None`: missing), to change.
fn await_credentials(asset: &BareMetalAsset, ctx: &Ctx, secret: Option<&Secret>) {
    let version = secret.and_then(|s| s.metadata.resource_version.clone());
    let namespace = asset.namespace().unwrap_or_default();
    ctx.awaited
        .await_change(&namespace, &asset.spec.bmc.credentials_name, version);
}

/// Makes the asset the credentials Secret's owner when the plan says so.
async fn adopt_credentials(asset: &BareMetalAsset, credentials: &Credentials) -> Result<(), AssetError> {
    let Some(secret) = &credentials.secret else {
        return Ok(());
    };
    match plan::secret_owner(asset, secret) {
        Some(owner) => own_secret(secret, owner, &credentials.secrets).await,
        None => Ok(()),
    }
}

/// Writes the status `report` makes, when it changed, and then its Events; false when the asset
/// is gone.
async fn write_report(
    asset: &BareMetalAsset,
    ctx: &Ctx,
    report: status::Report,
    assets: &Api<BareMetalAsset>,
) -> Result<bool, AssetError> {
    let (status, notes) = status::build(asset, report, Time(Timestamp::now()));
    if status == asset.status.clone().unwrap_or_default() {
        return Ok(true);
    }
    match apply_status(assets, asset, FIELD_MANAGER, &status, None).await {
        Ok(_) => {}
        Err(err) if is_not_found(&err) => return Ok(false),
        Err(err) => return Err(err.into()),
    }
    for note in notes {
        publish(&ctx.tenant, asset, note.warning, note.reason, note.message).await;
    }
    Ok(true)
}

/// The delivery of the host to the installed cluster: what to report and when to look again once
/// it ended (`None`: at a change); `None` while it runs (it was started now, or earlier).
fn deliver(
    asset: &BareMetalAsset,
    ctx: &Ctx,
    cd: &ClusterDeployment,
    cluster: &str,
    secret: Option<&Secret>,
) -> Option<(HostReport, Option<Duration>)> {
    let secret_version = secret.and_then(|s| s.metadata.resource_version.clone());
    let intent = Intent {
        detach: false,
        cluster: cluster.to_string(),
        basis: format!(
            "{:?}/{secret_version:?}/{:?}",
            asset.metadata.generation, cd.metadata.uid
        ),
    };
    let start = || {
        let (client, timeout) = (
            ctx.tenant.client.clone(),
            ctx.tenant.shared.settings.managed_cluster_timeout,
        );
        let (asset, cd, cluster) = (asset.clone(), cd.clone(), cluster.to_string());
        let credentials = secret.and_then(|s| s.data.clone()).unwrap_or_default();
        async move {
            let remote = delivery::cluster_client(&client, &cd, timeout).await?;
            delivery::deliver(&remote, &asset, &credentials, &cluster).await
        }
    };
    let name = asset.name_any();
    match ctx.remote.poll(ObjectRef::from_obj(asset), intent, start) {
        Poll::Running => None,
        Poll::ClusterBackingOff { failures, left } => Some((plan::backing_off(asset, cluster, failures), Some(left))),
        Poll::Done(outcome) => {
            let after = after_delivery(asset, ctx, cluster, &outcome, secret);
            Some((plan::delivered(&outcome, &name, cluster), after))
        }
    }
}

/// When to look at a delivered asset again (`None`: when its credentials change).
fn after_delivery(
    asset: &BareMetalAsset,
    ctx: &Ctx,
    cluster: &str,
    outcome: &Outcome,
    secret: Option<&Secret>,
) -> Option<Duration> {
    let tenant = &ctx.tenant;
    let key = format!(
        "bma-delivery/{}/{}",
        asset.namespace().unwrap_or_default(),
        asset.name_any()
    );
    match outcome {
        Ok(true) => {
            tenant.object_backoff.succeeded(&key);
            // The credentials may change: they are propagated when they do.
            await_credentials(asset, ctx, secret);
            None
        }
        Ok(false) => Some(Duration::from_millis(500)),
        // The cluster's own backoff, shared by all its assets, grows with every failure.
        Err(err) if cluster_at_fault(err) => Some(cluster_retry(ctx, cluster, err)),
        Err(err) => {
            let logged = (tenant.name.as_str(), "baremetalasset-delivery", key.as_str());
            Some(retry::after_failure(&tenant.object_backoff, &key, logged, err))
        }
    }
}

/// How long `cluster`, which just failed to answer, is left alone.
fn cluster_retry(ctx: &Ctx, cluster: &str, err: &DeliveryError) -> Duration {
    let waiting = ctx.remote.backoff.waiting(cluster);
    let (failures, left) = waiting.unwrap_or((1, ctx.tenant.shared.settings.backoff.base));
    warn!(cluster, failures, retry_in = ?left, error = %err, "managed cluster did not answer");
    left
}

/// Makes the asset the Secret's controller owner with an update carrying the cached
/// resourceVersion (the daemon may update tenant Secrets, not patch them).
async fn own_secret(secret: &Secret, owner: OwnerReference, secrets: &Api<Secret>) -> Result<(), AssetError> {
    let mut owned = secret.clone();
    owned.metadata.owner_references = Some(vec![owner]);
    owned.metadata.managed_fields = None;
    match secrets
        .replace(&secret.name_any(), &PostParams::default(), &owned)
        .await
    {
        Ok(_) => Ok(()),
        // Someone changed it meanwhile: look at it again next time.
        Err(err) if is_conflict(&err) || is_not_found(&err) => Ok(()),
        Err(err) => Err(err.into()),
    }
}

/// The one detach path (§5): remove the BareMetalHost and its Secret from the cluster the asset was
/// delivered to and wait until they are gone (skipped for a cluster being deleted or gone, refused
/// for one the asset may not reach), then drop the finalizer.
async fn detach_asset(
    asset: &BareMetalAsset,
    ctx: &Ctx,
    detach: Detach<'_>,
    assets: &Api<BareMetalAsset>,
) -> Result<Action, AssetError> {
    match detach {
        Detach::Release => {}
        Detach::ClusterDestroyed { cluster } => {
            let note = format!("Cluster {cluster} is being deleted or gone; its BareMetalHost is not removed there");
            publish(&ctx.tenant, asset, false, "ClusterDestroyed", note).await;
        }
        Detach::Refused { cluster, why } => {
            let note = format!(
                "The delivery record (annotation {DELIVERED_TO_ANNOTATION}) names cluster {cluster}: {why}. \
                 Nothing was removed there; the record is dropped"
            );
            publish(&ctx.tenant, asset, true, reach::RECORD_REFUSED, note).await;
        }
        Detach::Remote { cluster, cd } => match remove_from_cluster(asset, ctx, cd, &cluster).await {
            Removal::Gone => {}
            Removal::Running => return Ok(Action::await_change()),
            Removal::Again(wait) => return Ok(Action::requeue(wait)),
        },
    }
    patch_metadata(assets, asset, &plan::release_patch(asset)).await
}

/// Where removing a host from its cluster stands.
enum Removal {
    Gone,
    /// The removal runs; the asset is reconciled again when it ends.
    Running,
    /// Not gone yet, or it failed: look again after this.
    Again(Duration),
}

/// Removes the host from the cluster, in the background.
async fn remove_from_cluster(asset: &BareMetalAsset, ctx: &Ctx, cd: &ClusterDeployment, cluster: &str) -> Removal {
    let tenant = &ctx.tenant;
    let intent = Intent {
        detach: true,
        cluster: cluster.to_string(),
        basis: format!("{:?}", cd.metadata.uid),
    };
    let start = || {
        let (client, timeout) = (tenant.client.clone(), tenant.shared.settings.managed_cluster_timeout);
        let (asset, cd) = (asset.clone(), cd.clone());
        async move {
            let remote = delivery::cluster_client(&client, &cd, timeout).await?;
            delivery::detach(&remote, &asset).await
        }
    };
    match ctx.remote.poll(ObjectRef::from_obj(asset), intent, start) {
        Poll::Running => Removal::Running,
        Poll::ClusterBackingOff { left, .. } => Removal::Again(left),
        Poll::Done(Ok(true)) => {
            let note = format!(
                "BareMetalHost {} and its Secret were removed from cluster {cluster}",
                asset.name_any()
            );
            publish(tenant, asset, false, "HostRemoved", note).await;
            Removal::Gone
        }
        Poll::Done(Ok(false)) => Removal::Again(Duration::from_millis(300)),
        Poll::Done(Err(err)) => {
            publish(tenant, asset, true, "DetachFailed", err.to_string()).await;
            let wait = if cluster_at_fault(&err) {
                cluster_retry(ctx, cluster, &err)
            } else {
                Duration::from_secs(5)
            };
            Removal::Again(wait)
        }
    }
}
