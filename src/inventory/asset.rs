//! The BareMetalAsset controller (DESIGN.md §5): mirrors role and cluster into labels, checks the
//! BMC credentials Secret (and owns it when nobody else does), and reports whether the assigned
//! ClusterDeployment exists, with conditions and Events.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use jiff::Timestamp;
use k8s_openapi::api::core::v1::{ObjectReference, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{OwnerReference, Time};
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Resource, ResourceExt};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use super::delivery;
use super::{CLUSTER_LABEL, ROLE_LABEL};
use crate::api::inventory::{AssetRole, BareMetalAsset, BareMetalAssetStatus};
use crate::api::pools::ClusterDeployment;
use crate::pools::{is_conflict, is_not_found, publish};
use crate::runtime::cache::{is_filled, reflect};
use crate::runtime::conditions::{DesiredCondition, set_condition};
use crate::runtime::metrics::Metrics;
use crate::runtime::panics::{self, ReconcilePanic};
use crate::runtime::readiness::Readiness;
use crate::runtime::recovery::NoTriggerBackoff;
use crate::runtime::retry;
use crate::runtime::shutdown::run_controller;
use crate::tenancy::tenant::TenantContext;

#[derive(Debug, thiserror::Error)]
pub enum AssetError {
    #[error("tenant API request failed: {0}")]
    Tenant(#[from] kube::Error),
    #[error(transparent)]
    Panicked(#[from] ReconcilePanic),
}

struct Ctx {
    tenant: Arc<TenantContext>,
    cds: Store<ClusterDeployment>,
    /// Resolves once `cds` is filled.
    cds_filled: Readiness,
}

/// Runs the controller until `cancel` fires.
pub async fn run(context: Arc<TenantContext>, cancel: CancellationToken) {
    let client = context.client.clone();
    let (assets, asset_stream) = reflect(Api::<BareMetalAsset>::all(client.clone()), Default::default());
    let (cds, cd_stream) = reflect(Api::<ClusterDeployment>::all(client), Default::default());
    let cds_filled = {
        let cds = cds.clone();
        Readiness::after(async move { cds.wait_until_ready().await.is_ok() })
    };
    let ctx = Arc::new(Ctx {
        tenant: context,
        cds,
        cds_filled,
    });
    let assets_of_cd = assets.clone();
    let shutdown = cancel.clone();
    let main_store = assets.clone();
    let run = Controller::for_stream(asset_stream, assets)
        .trigger_backoff(NoTriggerBackoff)
        // A ClusterDeployment appearing or going changes `ClusterDeploymentFound` of its assets.
        .watches_stream(cd_stream, move |cd: ClusterDeployment| {
            let name = cd.name_any();
            assets_of_cd
                .state()
                .into_iter()
                .filter(|a| a.spec.assigned_cluster() == Some(name.as_str()))
                .map(|a| ObjectRef::from_obj(&*a))
                .collect::<Vec<_>>()
        })
        .graceful_shutdown_on(async move { shutdown.cancelled().await })
        .run(reconcile, error_policy, ctx)
        .for_each(|_| std::future::ready(()));
    run_controller(run, &cancel, || is_filled(&main_store)).await;
}

fn error_policy(asset: Arc<BareMetalAsset>, err: &AssetError, ctx: Arc<Ctx>) -> Action {
    let key = format!("bma/{}/{}", asset.namespace().unwrap_or_default(), asset.name_any());
    let logged = (ctx.tenant.name.as_str(), "baremetalasset", key.as_str());
    Action::requeue(retry::after_failure(&ctx.tenant.object_backoff, &key, logged, err))
}

async fn reconcile(asset: Arc<BareMetalAsset>, ctx: Arc<Ctx>) -> Result<Action, AssetError> {
    let tenant = &ctx.tenant;
    let labels = Metrics::controller(&tenant.name, "baremetalasset");
    tenant.shared.metrics.reconciles.get_or_create(&labels).inc();
    // Not `Store::wait_until_ready` from concurrent reconciles: it wakes only its last waiter.
    if !ctx.cds_filled.wait().await {
        return Ok(Action::await_change());
    }
    let Ok(permit) = tenant.reconcile_permits.acquire().await else {
        return Ok(Action::await_change());
    };
    let key = format!("bma/{}/{}", asset.namespace().unwrap_or_default(), asset.name_any());
    let result = panics::contain(reconcile_asset(&asset, &ctx, permit)).await;
    match &result {
        Ok(_) => tenant.object_backoff.succeeded(&key),
        Err(_) => {
            tenant.shared.metrics.reconcile_errors.get_or_create(&labels).inc();
        }
    }
    result
}

/// The label value of a role; "" for an asset that may fill either.
pub fn role_label(role: Option<AssetRole>) -> &'static str {
    match role.unwrap_or_default() {
        AssetRole::Master => "master",
        AssetRole::Worker => "worker",
        AssetRole::Unspecified => "",
    }
}

/// The labels the asset's spec asks for; `None` values are removed.
fn wanted_labels(asset: &BareMetalAsset) -> BTreeMap<String, Option<String>> {
    BTreeMap::from([
        (ROLE_LABEL.to_string(), Some(role_label(asset.spec.role).to_string())),
        (
            CLUSTER_LABEL.to_string(),
            asset.spec.assigned_cluster().map(String::from),
        ),
    ])
}

/// `permit` bounds tenant API load; it is given back before talking to a managed cluster, which
/// may be slow or unreachable and must not starve the tenant's other controllers.
async fn reconcile_asset(
    asset: &BareMetalAsset,
    ctx: &Ctx,
    permit: tokio::sync::SemaphorePermit<'_>,
) -> Result<Action, AssetError> {
    let tenant = &ctx.tenant;
    let ns = asset.namespace().unwrap_or_default();
    let name = asset.name_any();
    let assets = Api::<BareMetalAsset>::namespaced(tenant.client.clone(), &ns);
    let has_finalizer = asset.finalizers().iter().any(|f| f == DELIVERY_FINALIZER);
    let delivered_to = asset.annotations().get(DELIVERED_TO_ANNOTATION).map(String::as_str);
    let deleting = asset.metadata.deletion_timestamp.is_some();
    if has_finalizer && (deleting || delivered_to != asset.spec.assigned_cluster()) {
        // Detaching may talk to the managed cluster (see above).
        drop(permit);
        return Ok(detach_if_needed(asset, ctx, &assets)
            .await?
            .unwrap_or_else(Action::await_change));
    }
    if asset.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }

    // Labels first, with the resourceVersion: a pool assigning the asset meanwhile wins.
    let current = asset.labels();
    let label_patch: serde_json::Map<String, Value> = wanted_labels(asset)
        .into_iter()
        .filter(|(k, v)| current.get(k) != v.as_ref())
        .map(|(k, v)| (k, v.map_or(Value::Null, Value::String)))
        .collect();
    if !label_patch.is_empty() {
        let patch = json!({"metadata": {
            "labels": label_patch,
            "resourceVersion": asset.metadata.resource_version,
        }});
        return match assets
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            // The write's watch event brings the asset back.
            Ok(_) => Ok(Action::await_change()),
            Err(err) if is_conflict(&err) || is_not_found(&err) => Ok(Action::await_change()),
            Err(err) => Err(err.into()),
        };
    }

    let mut status: BareMetalAssetStatus = asset.status.clone().unwrap_or_default();
    let old = status.clone();
    let now = Time(Timestamp::now());
    let generation = asset.metadata.generation;
    let mut events: Vec<(bool, &'static str, String)> = Vec::new();
    let mut requeue = None;

    // Credentials.
    let secrets = Api::<Secret>::namespaced(tenant.client.clone(), &ns);
    let secret_name = asset.spec.bmc.credentials_name.clone();
    let secret = secrets.get_opt(&secret_name).await?;
    let (found, reason, message) = match &secret {
        None => (
            false,
            "SecretNotFound",
            format!("Secret {secret_name} in namespace {ns} does not exist; create it with keys username and password"),
        ),
        Some(s) => {
            let keys = s.data.clone().unwrap_or_default();
            let missing: Vec<&str> = ["username", "password"]
                .into_iter()
                .filter(|k| !keys.contains_key(*k))
                .collect();
            if missing.is_empty() {
                (
                    true,
                    "SecretFound",
                    format!("Secret {secret_name} in namespace {ns} has the BMC credentials"),
                )
            } else {
                (
                    false,
                    "SecretInvalid",
                    format!(
                        "Secret {secret_name} in namespace {ns} lacks the keys {}; add them",
                        missing.join(", ")
                    ),
                )
            }
        }
    };
    if set_condition(
        &mut status.conditions,
        DesiredCondition {
            type_: "CredentialsFound",
            status: found,
            reason,
            message: message.clone(),
            observed_generation: generation,
        },
        now.clone(),
    ) {
        events.push((
            !found,
            if found {
                "CredentialsFound"
            } else {
                "CredentialsNotFound"
            },
            message,
        ));
    }
    if !found {
        // Tenant Secrets are not watched (there are too many); look again soon.
        let settings = &tenant.shared.settings;
        requeue = Some(settings.backoff.base.saturating_mul(10).min(Duration::from_secs(30)));
    }
    if let Some(secret) = &secret {
        own_secret(asset, secret, &secrets).await?;
        let reference = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Secret".into()),
            name: Some(secret_name.clone()),
            namespace: Some(ns.clone()),
            ..Default::default()
        };
        if !status.related_objects.contains(&reference) {
            status.related_objects.retain(|r| r.kind.as_deref() != Some("Secret"));
            status.related_objects.push(reference);
        }
    }

    // The assigned ClusterDeployment (its namespace has its name).
    let (cd_found, cd_reason, cd_message) = match asset.spec.assigned_cluster() {
        None => (
            false,
            "NoneSpecified",
            "The asset is not assigned to a cluster".to_string(),
        ),
        Some(cluster) => {
            let cd = ctx.cds.get(&ObjectRef::new(cluster).within(cluster));
            match cd {
                Some(_) => (
                    true,
                    "ClusterDeploymentFound",
                    format!("ClusterDeployment {cluster} exists"),
                ),
                None => (
                    false,
                    "ClusterDeploymentNotFound",
                    format!("ClusterDeployment {cluster} (in namespace {cluster}) does not exist"),
                ),
            }
        }
    };
    set_condition(
        &mut status.conditions,
        DesiredCondition {
            type_: "ClusterDeploymentFound",
            status: cd_found,
            reason: cd_reason,
            message: cd_message,
            observed_generation: generation,
        },
        now.clone(),
    );

    // Delivery to the installed cluster.
    if let Some(cluster) = asset.spec.assigned_cluster()
        && let Some(cd) = ctx.cds.get(&ObjectRef::new(cluster).within(cluster))
    {
        let installed = cd.status.as_ref().is_some_and(|s| s.installed) && cd.metadata.deletion_timestamp.is_none();
        let outcome: Option<(bool, &'static str, String)> = if !installed {
            Some((
                false,
                "WaitingForCluster",
                format!("Cluster {cluster} is not installed yet"),
            ))
        } else if !found {
            Some((false, "CredentialsNotFound", "The BMC credentials are missing".into()))
        } else if asset.annotations().get(DELIVERED_TO_ANNOTATION).map(String::as_str) != Some(cluster)
            || !asset.finalizers().iter().any(|f| f == DELIVERY_FINALIZER)
        {
            // The finalizer first, so the host is always removed from the cluster again.
            let mut finalizers = asset.finalizers().to_vec();
            if !finalizers.iter().any(|f| f == DELIVERY_FINALIZER) {
                finalizers.push(DELIVERY_FINALIZER.into());
            }
            let patch = json!({"metadata": {
                "finalizers": finalizers,
                "annotations": {DELIVERED_TO_ANNOTATION: cluster},
                "resourceVersion": asset.metadata.resource_version,
            }});
            return match assets
                .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => Ok(Action::await_change()),
                Err(err) if is_conflict(&err) || is_not_found(&err) => Ok(Action::await_change()),
                Err(err) => Err(err.into()),
            };
        } else {
            drop(permit);
            let credentials = secret.as_ref().and_then(|s| s.data.clone()).unwrap_or_default();
            let result = match delivery::cluster_client(&tenant.client, &cd).await {
                Ok(remote) => delivery::deliver(&remote, asset, &credentials, cluster).await,
                Err(err) => Err(err),
            };
            // Tenant Secrets are not watched: look at the credentials again now and then.
            let settings = &tenant.shared.settings;
            requeue = Some(settings.backoff.base.saturating_mul(10).min(Duration::from_secs(30)));
            match result {
                Ok(true) => {
                    tenant.object_backoff.succeeded(&format!("bma-delivery/{ns}/{name}"));
                    Some((
                        true,
                        "HostCreated",
                        format!(
                            "BareMetalHost {name} and its Secret are on cluster {cluster} in namespace {}",
                            delivery::MACHINE_API_NAMESPACE
                        ),
                    ))
                }
                Ok(false) => {
                    requeue = Some(Duration::from_millis(500));
                    Some((
                        false,
                        "HostReplacing",
                        format!("BareMetalHost {name} is being replaced on cluster {cluster}"),
                    ))
                }
                Err(err) => {
                    // A cluster that does not answer is asked again on the probe interval, so
                    // delivery resumes seconds after it is back; other failures back off.
                    let key = format!("bma-delivery/{ns}/{name}");
                    let logged = (tenant.name.as_str(), "baremetalasset-delivery", key.as_str());
                    requeue = Some(retry::after_failure(&tenant.object_backoff, &key, logged, &err));
                    Some((
                        false,
                        err.reason(),
                        format!("Cannot deliver to cluster {cluster}: {err}"),
                    ))
                }
            }
        };
        if let Some((ok, reason, message)) = outcome {
            let changed = set_condition(
                &mut status.conditions,
                DesiredCondition {
                    type_: "HostCreated",
                    status: ok,
                    reason,
                    message: message.clone(),
                    observed_generation: generation,
                },
                now.clone(),
            );
            set_condition(
                &mut status.conditions,
                DesiredCondition {
                    type_: "HostProvisioningInProgress",
                    status: !ok && installed,
                    reason,
                    message: message.clone(),
                    observed_generation: generation,
                },
                now,
            );
            if changed && installed {
                events.push((!ok, reason, message));
            }
            if ok {
                let reference = ObjectReference {
                    api_version: Some("metal3.io/v1alpha1".into()),
                    kind: Some("BareMetalHost".into()),
                    name: Some(name.clone()),
                    namespace: Some(delivery::MACHINE_API_NAMESPACE.into()),
                    ..Default::default()
                };
                if !status.related_objects.contains(&reference) {
                    status.related_objects.push(reference);
                }
            }
        }
    } else {
        status
            .conditions
            .retain(|c| c.type_ != "HostCreated" && c.type_ != "HostProvisioningInProgress");
        status
            .related_objects
            .retain(|r| r.kind.as_deref() != Some("BareMetalHost"));
    }

    if status != old {
        match assets
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(json!({"status": status})))
            .await
        {
            Ok(_) => {}
            Err(err) if is_not_found(&err) => return Ok(Action::await_change()),
            Err(err) => return Err(err.into()),
        }
        for (warning, reason, note) in events {
            publish(tenant, asset, warning, reason, note).await;
        }
    }
    Ok(requeue.map_or_else(Action::await_change, Action::requeue))
}

/// Makes the asset the Secret's controller owner, only when nobody owns it yet (a Secret shared
/// or owned elsewhere is left alone).
async fn own_secret(asset: &BareMetalAsset, secret: &Secret, secrets: &Api<Secret>) -> Result<(), AssetError> {
    if !secret.owner_references().is_empty() {
        return Ok(());
    }
    let owner = OwnerReference {
        api_version: BareMetalAsset::api_version(&()).into_owned(),
        kind: BareMetalAsset::kind(&()).into_owned(),
        name: asset.name_any(),
        uid: asset.metadata.uid.clone().unwrap_or_default(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    };
    // An update carrying the cached resourceVersion (the daemon may update tenant Secrets, not patch).
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

/// Finalizer on an asset delivered to a cluster, until it is removed from there again.
pub const DELIVERY_FINALIZER: &str = "inventory.stackd.dev/delivery";
/// The cluster an asset was delivered to (it may have been unassigned since).
pub const DELIVERED_TO_ANNOTATION: &str = "inventory.stackd.dev/delivered-to";

/// The one detach path (§5), for deletion and for unassignment or reassignment alike: remove the
/// BareMetalHost and its Secret from the cluster the asset was delivered to and wait until they
/// are gone, then drop the finalizer. A cluster being deleted or gone is skipped
/// (`ClusterDestroyed`). `None` when there is nothing to detach.
async fn detach_if_needed(
    asset: &BareMetalAsset,
    ctx: &Ctx,
    assets: &Api<BareMetalAsset>,
) -> Result<Option<Action>, AssetError> {
    let has_finalizer = asset.finalizers().iter().any(|f| f == DELIVERY_FINALIZER);
    let delivered_to = asset.annotations().get(DELIVERED_TO_ANNOTATION).cloned();
    let deleting = asset.metadata.deletion_timestamp.is_some();
    let Some(cluster) = delivered_to.clone().filter(|_| has_finalizer) else {
        // A finalizer without a record of where the host went: nothing to remove remotely.
        if has_finalizer {
            return finish_detach(asset, assets).await.map(Some);
        }
        return Ok(None);
    };
    if !deleting && asset.spec.assigned_cluster() == Some(cluster.as_str()) {
        return Ok(None);
    }
    let tenant = &ctx.tenant;
    let cd = ctx.cds.get(&ObjectRef::new(&cluster).within(&cluster));
    let live = cd
        .as_ref()
        .filter(|cd| cd.metadata.deletion_timestamp.is_none() && cd.status.as_ref().is_some_and(|s| s.installed));
    match live {
        None => {
            publish(
                tenant,
                asset,
                false,
                "ClusterDestroyed",
                format!("Cluster {cluster} is being deleted or gone; its BareMetalHost is not removed there"),
            )
            .await;
        }
        Some(cd) => {
            let remote = match delivery::cluster_client(&tenant.client, cd).await {
                Ok(remote) => remote,
                Err(err) => {
                    publish(tenant, asset, true, "DetachFailed", err.to_string()).await;
                    return Ok(Some(Action::requeue(Duration::from_secs(5))));
                }
            };
            match delivery::detach(&remote, asset).await {
                Ok(true) => {
                    publish(
                        tenant,
                        asset,
                        false,
                        "HostRemoved",
                        format!(
                            "BareMetalHost {} and its Secret were removed from cluster {cluster}",
                            asset.name_any()
                        ),
                    )
                    .await;
                }
                Ok(false) => return Ok(Some(Action::requeue(Duration::from_millis(300)))),
                Err(err) => {
                    publish(tenant, asset, true, "DetachFailed", err.to_string()).await;
                    return Ok(Some(Action::requeue(Duration::from_secs(5))));
                }
            }
        }
    }
    finish_detach(asset, assets).await.map(Some)
}

async fn finish_detach(asset: &BareMetalAsset, assets: &Api<BareMetalAsset>) -> Result<Action, AssetError> {
    let finalizers: Vec<String> = asset
        .finalizers()
        .iter()
        .filter(|f| *f != DELIVERY_FINALIZER)
        .cloned()
        .collect();
    let patch = json!({"metadata": {
        "finalizers": finalizers,
        "annotations": {DELIVERED_TO_ANNOTATION: null},
        "resourceVersion": asset.metadata.resource_version,
    }});
    match assets
        .patch(&asset.name_any(), &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Ok(_) => Ok(Action::await_change()),
        Err(err) if is_conflict(&err) || is_not_found(&err) => Ok(Action::await_change()),
        Err(err) => Err(err.into()),
    }
}
