//! The BareMetalAsset controller (DESIGN.md §5): mirrors role and cluster into labels, checks the
//! BMC credentials Secret (and owns it when nobody else does), delivers the host to its installed
//! cluster and detaches it again, and reports all of it with conditions and Events.
//!
//! A reconcile observes (the asset, the cached ClusterDeployments, the credentials Secret),
//! decides in `plan`, carries the decision out here, builds the status in `status` and writes it.

mod plan;
mod status;

use std::sync::Arc;
use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{OwnerReference, Time};
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, ResourceExt};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

pub use self::plan::role_label;
use self::plan::{Delivery, Detach, HostReport, Snapshot, Step};
use super::delivery;
use crate::api::inventory::BareMetalAsset;
use crate::api::pools::ClusterDeployment;
use crate::context::events::publish;
use crate::context::tenant::TenantContext;
use crate::runtime::api_errors::{is_conflict, is_not_found};
use crate::runtime::controller::{Permit, ReconcileError, Scaffold};
use crate::runtime::informers::refusals::Refusals;
use crate::runtime::panics::ReconcilePanic;
use crate::runtime::retry;
use crate::runtime::status_writer::apply_status;

/// The field manager of BareMetalAsset status writes.
pub const FIELD_MANAGER: &str = "stackd/asset";

#[derive(Debug, thiserror::Error)]
pub enum AssetError {
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
    /// Clusters too large to cache: not destroyed ones (see `runtime::informers::refusals`).
    refused_cds: Refusals,
}

/// Runs the controller until `cancel` fires.
pub async fn run(context: Arc<TenantContext>, cancel: CancellationToken) {
    let assets = context.caches.tenant_guarded::<BareMetalAsset>();
    let cds = context.caches.tenant_guarded::<ClusterDeployment>();
    let ctx = Arc::new(Ctx {
        tenant: context.clone(),
        cds: cds.store(),
        refused_cds: cds.refusals(),
    });
    let assets_of_cd = assets.store();
    Scaffold::new("baremetalasset", context, &assets)
        // A ClusterDeployment appearing or going changes `ClusterDeploymentFound` of its assets.
        .watches(&cds, move |cd| {
            let name = cd.name_any();
            assets_of_cd
                .state()
                .into_iter()
                .filter(|a| a.spec.assigned_cluster() == Some(name.as_str()))
                .map(|a| ObjectRef::from_obj(&*a))
                .collect::<Vec<_>>()
        })
        .run(ctx, reconcile, &cancel)
        .await;
}

async fn reconcile(asset: Arc<BareMetalAsset>, ctx: Arc<Ctx>, permit: Permit) -> Result<Action, AssetError> {
    reconcile_asset(&asset, &ctx, permit).await
}

/// How often an asset whose cluster is too large to cache looks again.
const REFUSED_CLUSTER_RECHECK: std::time::Duration = std::time::Duration::from_secs(30);

/// Finalizer on an asset delivered to a cluster, until it is removed from there again.
pub const DELIVERY_FINALIZER: &str = "inventory.stackd.dev/delivery";
/// The cluster an asset was delivered to (it may have been unassigned since).
pub const DELIVERED_TO_ANNOTATION: &str = "inventory.stackd.dev/delivered-to";

fn cached_cd(ctx: &Ctx, name: Option<&str>) -> Option<Arc<ClusterDeployment>> {
    // The ClusterDeployment's namespace has its name.
    name.and_then(|name| ctx.cds.get(&ObjectRef::new(name).within(name)))
}

/// `permit` bounds tenant API load; it is given back before talking to a managed cluster, which
/// may be slow or unreachable and must not starve the tenant's other controllers.
async fn reconcile_asset(asset: &BareMetalAsset, ctx: &Ctx, permit: Permit) -> Result<Action, AssetError> {
    // A cluster in another namespace that is too large to cache must not look destroyed (which
    // would release the asset while it is still in that cluster): wait until it can be read.
    let refused = |name: Option<&str>| name.is_some_and(|name| ctx.refused_cds.contains(Some(name), name));
    if refused(asset.spec.assigned_cluster()) || refused(plan::delivered_to(asset)) {
        return Ok(Action::requeue(REFUSED_CLUSTER_RECHECK));
    }
    let assigned = cached_cd(ctx, asset.spec.assigned_cluster());
    let delivered = cached_cd(ctx, plan::delivered_to(asset));
    let snapshot = Snapshot {
        asset,
        assigned: assigned.as_deref(),
        delivered: delivered.as_deref(),
    };
    let assets = Api::<BareMetalAsset>::namespaced(ctx.tenant.client.clone(), &asset.namespace().unwrap_or_default());
    match plan::step(&snapshot) {
        Step::Detach(detach) => {
            // Detaching may talk to the managed cluster (see above).
            permit.release();
            detach_asset(asset, ctx, detach, &assets).await
        }
        Step::Nothing => Ok(Action::await_change()),
        Step::Label(labels) => patch_metadata(&assets, asset, &plan::labels_patch(asset, &labels)).await,
        Step::Report => report(asset, ctx, &snapshot, &assets, permit).await,
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

/// Tenant Secrets are not watched (there are too many): how soon to look at the credentials again.
fn credentials_recheck(tenant: &TenantContext) -> Duration {
    let settings = &tenant.shared.settings;
    settings.backoff.base.saturating_mul(10).min(Duration::from_secs(30))
}

/// Checks the credentials and the cluster, delivers the host, and writes what it found.
async fn report(
    asset: &BareMetalAsset,
    ctx: &Ctx,
    snapshot: &Snapshot<'_>,
    assets: &Api<BareMetalAsset>,
    permit: Permit,
) -> Result<Action, AssetError> {
    let ns = asset.namespace().unwrap_or_default();
    let secrets = Api::<Secret>::namespaced(ctx.tenant.client.clone(), &ns);
    let secret_name = &asset.spec.bmc.credentials_name;
    let secret = secrets.get_opt(secret_name).await?;
    let credentials = plan::credentials(secret.as_ref(), secret_name, &ns);
    let mut requeue = (!credentials.ok).then(|| credentials_recheck(&ctx.tenant));
    if let Some(secret) = &secret
        && let Some(owner) = plan::secret_owner(asset, secret)
    {
        own_secret(secret, owner, &secrets).await?;
    }
    let host = match plan::delivery(snapshot, credentials.ok) {
        Delivery::NoCluster => None,
        Delivery::Held(host) => Some(host),
        Delivery::Record(patch) => return patch_metadata(assets, asset, &patch).await,
        Delivery::Deliver { cluster, cd } => {
            permit.release();
            let (host, after) = deliver(asset, ctx, cd, cluster, secret.as_ref()).await;
            requeue = Some(after);
            Some(host)
        }
    };
    let report = status::Report {
        credentials,
        secret_exists: secret.is_some(),
        cluster: plan::cluster_found(snapshot),
        host,
    };
    let (status, notes) = status::build(asset, report, Time(Timestamp::now()));
    if status != asset.status.clone().unwrap_or_default() {
        match apply_status(assets, asset, FIELD_MANAGER, &status, None).await {
            Ok(_) => {}
            Err(err) if is_not_found(&err) => return Ok(Action::await_change()),
            Err(err) => return Err(err.into()),
        }
        for note in notes {
            publish(&ctx.tenant, asset, note.warning, note.reason, note.message).await;
        }
    }
    Ok(requeue.map_or_else(Action::await_change, Action::requeue))
}

/// Creates or updates the host on the installed cluster; returns what to report and when to look
/// again.
async fn deliver(
    asset: &BareMetalAsset,
    ctx: &Ctx,
    cd: &ClusterDeployment,
    cluster: &str,
    secret: Option<&Secret>,
) -> (HostReport, Duration) {
    let tenant = &ctx.tenant;
    let credentials = secret.and_then(|s| s.data.clone()).unwrap_or_default();
    let result =
        match delivery::cluster_client(&tenant.client, cd, tenant.shared.settings.managed_cluster_timeout).await {
            Ok(remote) => delivery::deliver(&remote, asset, &credentials, cluster).await,
            Err(err) => Err(err),
        };
    let name = asset.name_any();
    let key = format!("bma-delivery/{}/{name}", asset.namespace().unwrap_or_default());
    let after = match &result {
        Ok(true) => {
            tenant.object_backoff.succeeded(&key);
            // The credentials may change: they are propagated on the recheck.
            credentials_recheck(tenant)
        }
        Ok(false) => Duration::from_millis(500),
        // A cluster that does not answer is asked again on the probe interval, so delivery
        // resumes seconds after it is back; other failures back off.
        Err(err) => {
            let logged = (tenant.name.as_str(), "baremetalasset-delivery", key.as_str());
            retry::after_failure(&tenant.object_backoff, &key, logged, err)
        }
    };
    (plan::delivered(&result, &name, cluster), after)
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
/// delivered to and wait until they are gone (skipped for a cluster being deleted or gone), then
/// drop the finalizer.
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
        Detach::Remote { cluster, cd } => {
            if let Some(wait) = remove_from_cluster(asset, &ctx.tenant, cd, &cluster).await {
                return Ok(Action::requeue(wait));
            }
        }
    }
    patch_metadata(assets, asset, &plan::release_patch(asset)).await
}

/// Removes the host from the cluster; `Some(wait)` until it is gone.
async fn remove_from_cluster(
    asset: &BareMetalAsset,
    tenant: &TenantContext,
    cd: &ClusterDeployment,
    cluster: &str,
) -> Option<Duration> {
    let result =
        match delivery::cluster_client(&tenant.client, cd, tenant.shared.settings.managed_cluster_timeout).await {
            Ok(remote) => delivery::detach(&remote, asset).await,
            Err(err) => Err(err),
        };
    match result {
        Ok(true) => {
            let note = format!(
                "BareMetalHost {} and its Secret were removed from cluster {cluster}",
                asset.name_any()
            );
            publish(tenant, asset, false, "HostRemoved", note).await;
            None
        }
        Ok(false) => Some(Duration::from_millis(300)),
        Err(err) => {
            publish(tenant, asset, true, "DetachFailed", err.to_string()).await;
            Some(Duration::from_secs(5))
        }
    }
}
