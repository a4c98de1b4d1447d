//! The ClusterPool controller (DESIGN.md §4.3): keeps `size` unclaimed clusters (plus one per pending
//! claim), each built from a leased ClusterDeploymentCustomization when the pool has an inventory;
//! assigns clusters to claims; replaces broken and stale clusters; reports per-entry inventory
//! status, conditions, Events and metrics. Hive's known bugs are fixed (see the research notes):
//! broken and stale clusters are replaced even when the inventory cannot back `size`, failed patches
//! leave nothing behind and do not stall the pool, only this pool's leases are repaired or released.
//!
//! This file is the driver: [`reconcile_pool`] names every step of a pass and what each hands to
//! the next; the steps live in their own files, the values they share in [`super::pass`].

use std::sync::Arc;

use jiff::Timestamp;
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::runtime::controller::Action;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, ResourceExt};
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::buckets::Buckets;
use super::execute::{self, Deletions};
use super::membership::PoolIdentity;
use super::metrics::record_metrics;
use super::observe::observe;
use super::pass::{Caches, Ctx, FIELD_MANAGER, Observed, PoolError, RESYNC, Wake};
use super::patch_share::NAMESPACE_PATCH_SHARE_USED;
use super::plan::{self, Plan, Progress};
use super::repair::{self, Repaired, Scope};
use super::status;
pub use super::version::pool_version;
use super::{
    POOL_FINALIZER, POOL_NAME_LABEL, POOL_NAMESPACE_LABEL, cdc_finalizer, claim, hosts, installer_image, lease_state,
    limits,
};
use crate::api::inventory::BareMetalAsset;
use crate::api::pools::{
    ClusterClaim, ClusterDeployment, ClusterDeploymentCustomization, ClusterPool, ClusterPoolStatus,
    InventoryEntryState,
};
use crate::bounds::DOCUMENT_TOO_LARGE;
use crate::context::events::publish;
use crate::context::tenant::TenantContext;
use crate::runtime::conditions::{DesiredCondition, set_condition};
use crate::runtime::controller::{Permit, Scaffold};
use crate::runtime::finalizer::{self, Cleanup};
use crate::runtime::status_writer::apply_status;

/// The controller's name, as its metrics and its tenant's start know it.
pub(crate) const CONTROLLER: &str = "clusterpool";

type Cdc = ClusterDeploymentCustomization;

/// Runs the controller until `cancel` fires.
pub(crate) async fn run(context: Arc<TenantContext>, cancel: CancellationToken) {
    let caches = &context.caches;
    let pools = caches.tenant_guarded::<ClusterPool>();
    let cds = caches.tenant_guarded::<ClusterDeployment>();
    let cdcs = caches.tenant_guarded::<Cdc>();
    let claims = caches.tenant_guarded::<ClusterClaim>();
    let namespaces = caches.tenant::<Namespace>(POOL_NAME_LABEL);
    let assets = caches.tenant_guarded::<BareMetalAsset>();
    let stores = Caches {
        pools: pools.store(),
        cds: cds.store(),
        cdcs: cdcs.store(),
        claims: claims.store(),
        namespaces: namespaces.store(),
        assets: assets.store(),
    };
    let ctx = Arc::new(Ctx::new(context.clone(), stores));
    let (pools_of_cdc_store, pools_of_asset_store) = (pools.store(), pools.store());
    let (siblings, limit) = (pools.store(), context.shared.settings.namespace_max_pools);
    Scaffold::new(CONTROLLER, context, &pools)
        // A pool being deleted frees its place in its namespace for a refused one.
        .watches(&pools, move |pool| {
            if pool.metadata.deletion_timestamp.is_none() {
                return Vec::new();
            }
            limits::admitted_by_deletion(&pool, &siblings.state(), limit)
                .iter()
                .map(|p| ObjectRef::from_obj(&**p))
                .collect()
        })
        .watches(&cds, |cd| pools_of_cluster(&cd))
        .watches(&claims, |claim| pool_of_claim(&claim))
        .watches(&cdcs, move |cdc| pools_of_cdc(&pools_of_cdc_store, &cdc))
        .watches(&assets, move |asset| pools_of_asset(&pools_of_asset_store, &asset))
        .watches(&namespaces, |ns| pool_of_namespace(&ns))
        .run(ctx, reconcile, &cancel)
        .await;
}

/// The pool a cluster names, and the pool it was made by (whose count changes when someone edits
/// the reference away).
fn pools_of_cluster(cd: &ClusterDeployment) -> Vec<ObjectRef<ClusterPool>> {
    let named = cd
        .spec
        .cluster_pool_ref
        .as_ref()
        .map(|r| ObjectRef::new(&r.pool_name).within(&r.namespace));
    let labels = cd.labels();
    let made_by = labels
        .get(POOL_NAME_LABEL)
        .zip(labels.get(POOL_NAMESPACE_LABEL))
        .map(|(name, ns)| ObjectRef::new(name).within(ns));
    let mut pools: Vec<ObjectRef<ClusterPool>> = named.into_iter().chain(made_by).collect();
    pools.dedup();
    pools
}

fn pool_of_claim(claim: &ClusterClaim) -> Option<ObjectRef<ClusterPool>> {
    claim
        .namespace()
        .map(|ns| ObjectRef::new(&claim.spec.cluster_pool_name).within(&ns))
}

/// The pools of the CDC's namespace that list it, hold its lease or put their finalizer on it.
fn pools_of_cdc(pools: &Store<ClusterPool>, cdc: &Cdc) -> Vec<ObjectRef<ClusterPool>> {
    let ns = cdc.namespace().unwrap_or_default();
    let holder = lease_state::lease_holder(cdc).and_then(|(pool, _)| pool);
    pools
        .state()
        .into_iter()
        .filter(|p| p.namespace().as_deref() == Some(ns.as_str()))
        .filter(|p| {
            let name = p.name_any();
            let listed = p.spec.inventory.iter().flatten().any(|e| e.name == cdc.name_any());
            listed || holder.as_deref() == Some(name.as_str()) || cdc.finalizers().contains(&cdc_finalizer(&name))
        })
        .map(|p| ObjectRef::from_obj(&*p))
        .collect()
}

/// Assets feed the failure domains and hosts of the baremetal pools in their namespace.
fn pools_of_asset(pools: &Store<ClusterPool>, asset: &BareMetalAsset) -> Vec<ObjectRef<ClusterPool>> {
    let ns = asset.namespace().unwrap_or_default();
    pools
        .state()
        .into_iter()
        .filter(|p| p.namespace().as_deref() == Some(ns.as_str()) && p.spec.platform.baremetal.is_some())
        .map(|p| ObjectRef::from_obj(&*p))
        .collect()
}

fn pool_of_namespace(ns: &Namespace) -> Option<ObjectRef<ClusterPool>> {
    let labels = ns.labels();
    Some(ObjectRef::new(labels.get(POOL_NAME_LABEL)?).within(labels.get(POOL_NAMESPACE_LABEL)?))
}

async fn reconcile(pool: Arc<ClusterPool>, ctx: Arc<Ctx>, _permit: Permit) -> Result<Action, PoolError> {
    let deleting_pool = pool.metadata.deletion_timestamp.is_some();
    if !deleting_pool && let Some(refusal) = refusal(&pool, &ctx) {
        return refuse(&pool, &ctx, refusal).await;
    }
    if !deleting_pool && let Some(refused) = installer_image::refuse_if_not_allowed(&pool, &ctx.tenant).await {
        return refused.map_err(PoolError::from);
    }
    if deleting_pool && !pool.finalizers().iter().any(|f| f == POOL_FINALIZER) {
        // Nothing left to hold the deletion for; only CDC finalizers of this pool may remain.
        let observed = observe(&pool, &ctx).await?;
        repair::leases(&ctx.tenant, &Scope::of(&pool, &observed), observed.cdcs.clone()).await?;
        return Ok(Action::await_change());
    }
    let pools = Api::<ClusterPool>::namespaced(ctx.tenant.client.clone(), &pool.namespace().unwrap_or_default());
    let ctx = ctx.as_ref();
    finalizer::reconcile(
        &pools,
        POOL_FINALIZER,
        pool,
        |pool| async move { reconcile_pool(&pool, ctx).await },
        |pool| async move { clean_up(&pool, ctx).await },
    )
    .await
}

/// One pass over a live pool: observe → repair leases → claims → plan and delete → add clusters →
/// repair hosts → reap namespaces → free CDCs marked available → status. Each step hands what it
/// found or did to the next.
async fn reconcile_pool(pool: &ClusterPool, ctx: &Ctx) -> Result<Action, PoolError> {
    let observed = observe(pool, ctx).await?;
    let scope = Scope::of(pool, &observed);
    let repaired = repair::leases(&ctx.tenant, &scope, observed.cdcs.clone()).await?;
    let buckets = Buckets::sort(&observed.cds, &observed.claims, &observed.expected_deleted);
    // Claims (§4.3.10): oldest claim first gets the oldest ready cluster.
    let assigned = claim::assign(&ctx.tenant, pool, &observed.cds, &observed.claims, buckets).await?;
    let mut buckets = assigned.buckets;
    let (plan, deletions) =
        plan_and_delete(pool, ctx, &observed, &repaired, assigned.pending_claims, &mut buckets).await?;
    tracing::debug!(pool = %pool.name_any(), capacity = ?plan.capacity, "capacity");
    let executed = execute::run(ctx, pool, &plan, &observed, deletions).await?;
    ctx.expect_deleted(pool, &executed.deleted);
    let clusters = (&observed.live, &observed.expected_created);
    let hosts_wake = hosts::repair(pool, ctx, &observed.assets, clusters, &executed.hosts_taken).await?;
    // Empty pool namespaces (a CD never created, or one deleted) are reaped after the minimum age.
    let min_age = ctx.tenant.shared.settings.lease_min_age;
    let reap_wake = execute::reap_namespaces(ctx, &PoolIdentity::of(pool), &observed.expected_created, min_age).await?;
    // The inventory's free CDCs read Available=True, once this pass's leases are taken.
    let (fresh, free_wake) = repair::mark_free(&ctx.tenant, &scope, &repaired.cdcs, executed.fresh.clone()).await?;
    let report = status::Report {
        pool,
        observed: &observed,
        cdcs: &fresh.over(&repaired.cdcs),
        buckets: &buckets,
        plan: &plan,
        executed: &executed,
    };
    let status = status::build(&report, Time(Timestamp::now()));
    write_status(pool, ctx, &status).await?;
    announce(pool, ctx, &observed.previous, &status).await;
    let (ns, name) = (pool.namespace().unwrap_or_default(), pool.name_any());
    record_metrics(ctx, &ns, &name, &buckets, &plan.stale, &status);
    let mut wake = repaired.wake.and(assigned.wake).and(executed.wake);
    if let Some(after) = plan.wake {
        wake.soon(after);
    }
    Ok(wake.and(hosts_wake).and(reap_wake).and(free_wake).action())
}

/// A deleted pool (§4.3.9): its clusters go, then its finalizers on CDCs; pending until
/// then, so that the pool's own finalizer stays.
async fn clean_up(pool: &ClusterPool, ctx: &Ctx) -> Result<Cleanup, PoolError> {
    let observed = observe(pool, ctx).await?;
    let repaired = repair::leases(&ctx.tenant, &Scope::of(pool, &observed), observed.cdcs.clone()).await?;
    let buckets = Buckets::sort(&observed.cds, &observed.claims, &observed.expected_deleted);
    let cleanup = execute::deleted_pool(pool, ctx, &observed.cds, &buckets, &repaired.cdcs).await?;
    if let Cleanup::Done = cleanup {
        ctx.written.forget(&pool.uid().unwrap_or_default());
    }
    Ok(cleanup)
}

/// Plans the pass and carries out its deletions. A broken cluster whose CDC changed since the
/// cache (409 on its BrokenByCloud mark) stays for the next pass, and the plan is made again
/// without it from what was already done.
async fn plan_and_delete(
    pool: &ClusterPool,
    ctx: &Ctx,
    observed: &Observed,
    repaired: &Repaired,
    pending_claims: i64,
    buckets: &mut Buckets,
) -> Result<(Plan, Deletions), PoolError> {
    let version = pool_version(pool);
    let mut progress = Progress::default();
    let mut deleted: Vec<String> = Vec::new();
    let mut fresh = repaired.fresh.clone();
    let mut wake = Wake::default();
    loop {
        let inputs = plan::Inputs {
            pool,
            version: &version,
            inventory: &observed.inventory,
            cds: &observed.cds,
            expected_created: &observed.expected_created,
            cdcs: &repaired.cdcs,
            fresh: &fresh,
            previous: &observed.previous,
            backoff: ctx.tenant.shared.settings.backoff,
            assets: &observed.assets,
            pending_claims,
            contradiction: observed.contradiction.is_some(),
            namespace_room: namespace_room(pool, ctx),
        };
        let planned = plan::plan(&inputs, buckets, &progress);
        let done = execute::deletes(ctx, pool, &planned.deletes, &repaired.cdcs, buckets, fresh).await?;
        deleted.extend(done.deleted);
        (fresh, wake) = (done.fresh, wake.and(done.wake));
        match done.kept {
            None => {
                let deletions = Deletions {
                    deleted,
                    kept: None,
                    fresh,
                    wake,
                };
                return Ok((planned, deletions));
            }
            Some(cd) => progress.record(&planned, &deleted, cd),
        }
    }
}

/// Clusters the pools of `pool`'s namespace may still make: each cluster has a namespace, objects
/// and host work of its own, all of which the pool's namespace asked for (`--namespace-max-clusters`).
fn namespace_room(pool: &ClusterPool, ctx: &Ctx) -> i64 {
    let limit = ctx.tenant.shared.settings.namespace_max_clusters;
    if limit == 0 {
        return i64::MAX;
    }
    let namespace = pool.namespace();
    let of_namespace = ctx
        .cds
        .state()
        .iter()
        .filter(|cd| cd.labels().get(POOL_NAMESPACE_LABEL) == namespace.as_ref())
        .count();
    i64::try_from(limit.saturating_sub(of_namespace)).unwrap_or(i64::MAX)
}

/// Logs and Events for what went wrong since the last status, once per transition rather than on
/// every pass: an inventory entry whose ClusterDeploymentCustomization is missing, failure domains
/// found contradicting themselves.
async fn announce(pool: &ClusterPool, ctx: &Ctx, previous: &ClusterPoolStatus, status: &ClusterPoolStatus) {
    let tenant = &ctx.tenant;
    let ns = pool.namespace().unwrap_or_default();
    let missing = |s: &ClusterPoolStatus, entry: &str| {
        s.inventory
            .iter()
            .any(|e| e.name == entry && e.status == InventoryEntryState::Missing)
    };
    for entry in status
        .inventory
        .iter()
        .filter(|e| missing(status, &e.name) && !missing(previous, &e.name))
    {
        warn!(cdc = %entry.name, "an inventory entry's ClusterDeploymentCustomization does not exist");
        let note = format!(
            "Inventory entry {}: ClusterDeploymentCustomization {ns}/{} does not exist; create it (the pool leases it then) or remove the entry from spec.inventory",
            entry.name, entry.name
        );
        publish(tenant, pool, true, "InventoryEntryMissing", note).await;
    }
    let contradiction = |s: &ClusterPoolStatus| {
        s.conditions
            .iter()
            .find(|c| c.type_ == status::FAILURE_DOMAINS_VALID && c.status == "False")
            .map(|c| c.message.clone())
    };
    if let Some(message) = contradiction(status)
        && contradiction(previous).as_ref() != Some(&message)
    {
        warn!(%message, "the pool's failure domains contradict themselves");
        publish(tenant, pool, true, status::INVALID_MACHINE_SPEC, message).await;
    }
    let too_large = |s: &ClusterPoolStatus| {
        s.conditions
            .iter()
            .find(|c| c.type_ == "CapacityAvailable" && c.reason == DOCUMENT_TOO_LARGE)
            .map(|c| c.message.clone())
    };
    if let Some(message) = too_large(status)
        && too_large(previous).as_ref() != Some(&message)
    {
        warn!(%message, "a document of the pool is past its bound; nothing is built from it");
        publish(tenant, pool, true, DOCUMENT_TOO_LARGE, message).await;
    }
    // Told when the wait begins, not for every second it names.
    let paced = |s: &ClusterPoolStatus| {
        s.conditions
            .iter()
            .find(|c| c.type_ == "CapacityAvailable" && c.reason == NAMESPACE_PATCH_SHARE_USED)
            .map(|c| c.message.clone())
    };
    if let Some(message) = paced(status)
        && paced(previous).is_none()
    {
        publish(tenant, pool, true, NAMESPACE_PATCH_SHARE_USED, message).await;
    }
}

/// Why a live pool gets no work done, if it does not (see [`limits`]).
fn refusal(pool: &ClusterPool, ctx: &Ctx) -> Option<limits::Refusal> {
    let limit = ctx.tenant.shared.settings.namespace_max_pools;
    limits::spec_refusal(pool).or_else(|| limits::namespace_refusal(pool, &ctx.pools.state(), limit))
}

/// A refused pool creates, repairs and deletes nothing; its condition and an Event say why. It is
/// looked at again when it changes, when an older pool of its namespace is deleted, and on the
/// resync.
async fn refuse(pool: &ClusterPool, ctx: &Ctx, refusal: limits::Refusal) -> Result<Action, PoolError> {
    let pools = Api::<ClusterPool>::namespaced(ctx.tenant.client.clone(), &pool.namespace().unwrap_or_default());
    let mut status = pool.status.clone().unwrap_or_default();
    let changed = set_condition(
        &mut status.conditions,
        DesiredCondition {
            type_: refusal.condition,
            status: false,
            reason: refusal.reason,
            message: refusal.message.clone(),
            observed_generation: pool.metadata.generation,
        },
        Time(Timestamp::now()),
    );
    if changed {
        apply_status(&pools, pool, FIELD_MANAGER, &status, None).await?;
        publish(&ctx.tenant, pool, true, refusal.reason, refusal.message).await;
    }
    Ok(Action::requeue(RESYNC))
}

/// Writes `status` when it differs from the pool's, and remembers the resourceVersion it produced.
async fn write_status(pool: &ClusterPool, ctx: &Ctx, status: &ClusterPoolStatus) -> Result<(), PoolError> {
    let old_status = pool.status.clone().unwrap_or_default();
    if *status == old_status {
        return Ok(());
    }
    let pools = Api::<ClusterPool>::namespaced(ctx.tenant.client.clone(), &pool.namespace().unwrap_or_default());
    let written = apply_status(&pools, pool, FIELD_MANAGER, status, None).await?;
    let uid = pool.uid().unwrap_or_default();
    ctx.written
        .record(&uid, written.metadata.resource_version, status.clone());
    Ok(())
}
