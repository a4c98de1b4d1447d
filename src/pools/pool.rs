//! The ClusterPool controller (DESIGN.md §4.3): keeps `size` unclaimed clusters (plus one per pending
//! claim), each built from a leased ClusterDeploymentCustomization when the pool has an inventory;
//! assigns clusters to claims; replaces broken and stale clusters; reports per-entry inventory
//! status, conditions, Events and metrics. Hive's known bugs are fixed (see the research notes):
//! broken and stale clusters are replaced even when the inventory cannot back `size`, failed patches
//! leave nothing behind and do not stall the pool, only this pool's leases are repaired or released.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use jiff::Timestamp;
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::runtime::controller::Action;
use kube::runtime::finalizer::{Error as FinalizerError, Event as FinalizerEvent, finalizer};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, ResourceExt};
use serde_json::json;
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::buckets::Buckets;
use super::execute::{self, Placement};
use super::membership::{self, PoolIdentity};
use super::plan::{self, Plan, Progress};
use super::status::{self, record_metrics};
use super::{
    POOL_FINALIZER, POOL_NAME_LABEL, POOL_NAMESPACE_LABEL, cdc_finalizer, claim, failure_domains, hosts, leases,
    limits, machines, repair,
};
use crate::api::inventory::BareMetalAsset;
use crate::api::pools::{
    ClusterClaim, ClusterDeployment, ClusterDeploymentCustomization, ClusterPool, ClusterPoolStatus,
    InventoryEntryState, MachineFailureDomain,
};
use crate::context::events::publish;
use crate::context::tenant::TenantContext;
use crate::runtime::conditions::{DesiredCondition, set_condition};
use crate::runtime::controller::{Permit, ReconcileError, Scaffold};
use crate::runtime::panics::ReconcilePanic;
use crate::runtime::status_writer::apply_status;
use crate::runtime::written::Written;

type Cdc = ClusterDeploymentCustomization;

/// The field manager of the pool controller's writes to pool status.
pub const FIELD_MANAGER: &str = "stackd/pool";

/// How long a CD this controller created (or deleted) may be missing from (or still live in) the
/// cache before the cache is believed again.
const EXPECTATION_TTL: Duration = Duration::from_secs(60);
/// A pool is looked at again at least this often (lease ages, backoffs and lifetimes also requeue).
pub(super) const RESYNC: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    #[error("tenant API request failed: {0}")]
    Tenant(#[from] kube::Error),
    #[error("finalizer: {0}")]
    Finalizer(String),
    /// A deleted pool still waits for something; not a failure: the pool is looked at again then.
    #[error("cleanup pending")]
    CleanupPending(Action),
    #[error(transparent)]
    Panicked(#[from] ReconcilePanic),
}

impl ReconcileError for PoolError {
    fn metric_label(&self) -> &'static str {
        match self {
            PoolError::Tenant(_) => "tenant_api",
            PoolError::Finalizer(_) => "finalizer",
            PoolError::CleanupPending(_) => "cleanup_pending",
            PoolError::Panicked(_) => "panic",
        }
    }
}

/// Creations and deletions not yet seen in the cache, per pool (Hive's "expectations").
#[derive(Default)]
struct Expectations {
    created: HashMap<String, Instant>,
    deleted: HashMap<String, Instant>,
}

pub(super) struct Ctx {
    pub(super) tenant: Arc<TenantContext>,
    /// Every pool of the tenant, to rank a pool among its namespace's.
    pools: Store<ClusterPool>,
    pub(super) cds: Store<ClusterDeployment>,
    pub(super) cdcs: Store<Cdc>,
    claims: Store<ClusterClaim>,
    pub(super) namespaces: Store<Namespace>,
    pub(super) assets: Store<BareMetalAsset>,
    expectations: Mutex<HashMap<String, Expectations>>,
    /// Failure-domain records planned for new clusters, until their status shows them.
    pub(super) records: Mutex<HashMap<String, Vec<MachineFailureDomain>>>,
    /// The last status this controller wrote per pool: until the cache shows the version it
    /// produced, the cached status is older than what we know.
    pub(super) written: Written<ClusterPoolStatus>,
    /// ClusterDeployments naming a pool that did not create them.
    refusals: membership::Refusals,
}

impl Ctx {
    /// The clusters this controller created (deleted) for `pool` that the cache does not show (or
    /// still shows live) yet; entries the cache caught up with, or older than the TTL, are dropped.
    fn expectations_of(&self, pool: &ClusterPool) -> (BTreeSet<String>, BTreeSet<String>) {
        let mut all = self.expectations.lock().unwrap_or_else(|p| p.into_inner());
        let mine = all.entry(pool_key(pool)).or_default();
        let now = Instant::now();
        let cached = |cd: &str| self.cds.get(&ObjectRef::new(cd).within(cd));
        mine.created
            .retain(|cd, at| now.duration_since(*at) < EXPECTATION_TTL && cached(cd).is_none());
        mine.deleted.retain(|cd, at| {
            now.duration_since(*at) < EXPECTATION_TTL
                && cached(cd).is_some_and(|c| c.metadata.deletion_timestamp.is_none())
        });
        (
            mine.created.keys().cloned().collect(),
            mine.deleted.keys().cloned().collect(),
        )
    }

    pub(super) fn expect_created(&self, pool: &ClusterPool, cd: &str) {
        let mut all = self.expectations.lock().unwrap_or_else(|p| p.into_inner());
        all.entry(pool_key(pool))
            .or_default()
            .created
            .insert(cd.to_string(), Instant::now());
    }

    pub(super) fn forget_created(&self, pool: &ClusterPool, cd: &str) {
        let mut all = self.expectations.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(mine) = all.get_mut(&pool_key(pool)) {
            mine.created.remove(cd);
        }
    }

    fn expect_deleted(&self, pool: &ClusterPool, cds: &[String]) {
        if cds.is_empty() {
            return;
        }
        let mut all = self.expectations.lock().unwrap_or_else(|p| p.into_inner());
        let mine = all.entry(pool_key(pool)).or_default();
        for cd in cds {
            mine.deleted.insert(cd.clone(), Instant::now());
        }
    }
}

fn pool_key(pool: &ClusterPool) -> String {
    format!("{}/{}", pool.namespace().unwrap_or_default(), pool.name_any())
}

/// Runs the controller until `cancel` fires.
pub async fn run(context: Arc<TenantContext>, cancel: CancellationToken) {
    let caches = &context.caches;
    let pools = caches.tenant_guarded::<ClusterPool>();
    let cds = caches.tenant_guarded::<ClusterDeployment>();
    let cdcs = caches.tenant_guarded::<Cdc>();
    let claims = caches.tenant_guarded::<ClusterClaim>();
    let namespaces = caches.tenant::<Namespace>(POOL_NAME_LABEL);
    let assets = caches.tenant_guarded::<BareMetalAsset>();
    let ctx = Arc::new(Ctx {
        tenant: context.clone(),
        pools: pools.store(),
        cds: cds.store(),
        cdcs: cdcs.store(),
        claims: claims.store(),
        namespaces: namespaces.store(),
        assets: assets.store(),
        expectations: Mutex::default(),
        records: Mutex::default(),
        written: Written::default(),
        refusals: Mutex::default(),
    });
    let (pools_of_cdc_store, pools_of_asset_store) = (pools.store(), pools.store());
    let (siblings, limit) = (pools.store(), context.shared.settings.namespace_max_pools);
    Scaffold::new("clusterpool", context, &pools)
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
    let holder = leases::lease_holder(cdc).and_then(|(pool, _)| pool);
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

/// Everything one reconcile found and decided, for the status at the end.
pub(super) struct Round {
    requeue: Duration,
    /// Entries whose attempts grow by one (a cluster built from it broke).
    pub(super) broken_entries: BTreeSet<String>,
    /// Entries leased this round, with the generation applied.
    pub(super) leased: BTreeMap<String, i64>,
    /// Fresh copies of CDCs written this round.
    pub(super) written: BTreeMap<String, Cdc>,
    pub(super) syntax_errors: BTreeMap<String, String>,
    pub(super) missing_dependencies: Vec<String>,
    /// Assets assigned this round (the cache may not show them yet).
    pub(super) hosts_taken: BTreeSet<String>,
    /// Why a cluster could not get its bare-metal hosts.
    pub(super) insufficient_hosts: Option<String>,
    /// Why the pool's failure domains contradict themselves (§6 merge rules): no cluster is added.
    pub(super) contradiction: Option<String>,
}

impl Round {
    pub(super) fn new() -> Round {
        Round {
            requeue: RESYNC,
            broken_entries: BTreeSet::new(),
            leased: BTreeMap::new(),
            written: BTreeMap::new(),
            syntax_errors: BTreeMap::new(),
            missing_dependencies: Vec::new(),
            hosts_taken: BTreeSet::new(),
            insufficient_hosts: None,
            contradiction: None,
        }
    }

    pub(super) fn soon(&mut self, after: Duration) {
        self.requeue = self.requeue.min(after.max(Duration::from_millis(100)));
    }
}

async fn reconcile(pool: Arc<ClusterPool>, ctx: Arc<Ctx>, _permit: Permit) -> Result<Action, PoolError> {
    let deleting_pool = pool.metadata.deletion_timestamp.is_some();
    if !deleting_pool && let Some(refusal) = refusal(&pool, &ctx) {
        return refuse(&pool, &ctx, refusal).await;
    }
    if !deleting_pool && let Some(refused) = super::installer_image::refuse_if_not_allowed(&pool, &ctx.tenant).await {
        return refused.map_err(PoolError::from);
    }
    if deleting_pool && !pool.finalizers().iter().any(|f| f == POOL_FINALIZER) {
        // Nothing left to hold the deletion for; only CDC finalizers of this pool may remain.
        let mut seen = observe(&pool, &ctx).await?;
        repair_leases(&pool, &ctx, &mut seen, &mut Round::new()).await?;
        return Ok(Action::await_change());
    }
    let pools = Api::<ClusterPool>::namespaced(ctx.tenant.client.clone(), &pool.namespace().unwrap_or_default());
    let outcome = finalizer(&pools, POOL_FINALIZER, pool, |event| async {
        match event {
            FinalizerEvent::Apply(pool) => reconcile_pool(&pool, &ctx).await,
            FinalizerEvent::Cleanup(pool) => clean_up(&pool, &ctx).await,
        }
    })
    .await;
    match outcome {
        Ok(action) => Ok(action),
        Err(FinalizerError::ApplyFailed(err)) => Err(err),
        Err(FinalizerError::CleanupFailed(PoolError::CleanupPending(action))) => Ok(action),
        Err(FinalizerError::CleanupFailed(err)) => Err(err),
        // Our cached pool was older than our own last write (its finalizers changed): that write's
        // watch event brings the current copy and another reconcile.
        Err(
            FinalizerError::AddFinalizer(kube::Error::Api(status))
            | FinalizerError::RemoveFinalizer(kube::Error::Api(status)),
        ) if status.code == 409 || status.code == 422 => Ok(Action::requeue(Duration::from_millis(200))),
        Err(FinalizerError::RemoveFinalizer(kube::Error::Api(status))) if status.code == 404 => {
            Ok(Action::await_change())
        }
        Err(FinalizerError::AddFinalizer(err) | FinalizerError::RemoveFinalizer(err)) => Err(err.into()),
        Err(other) => Err(PoolError::Finalizer(other.to_string())),
    }
}

/// One pass over a live pool: observe → repair leases → buckets → claims → plan → execute → free
/// CDCs marked available → status.
async fn reconcile_pool(pool: &ClusterPool, ctx: &Ctx) -> Result<Action, PoolError> {
    let mut round = Round::new();
    let mut seen = observe(pool, ctx).await?;
    let cdcs = repair_leases(pool, ctx, &mut seen, &mut round).await?;
    let mut buckets = Buckets::sort(&seen.cds, &seen.claims, &seen.expected_deleted);
    // Claims (§4.3.10): oldest claim first gets the oldest ready cluster.
    let pending_claims = claim::assign(&ctx.tenant, pool, &seen.cds, &seen.claims, &mut buckets, &mut round).await?;
    let world = World {
        seen: &seen,
        cdcs: &cdcs,
        pending_claims,
    };
    converge(pool, ctx, &world, buckets, round).await
}

/// A deleted pool (§4.3.9): its clusters go, then its finalizers on CDCs; `CleanupPending` until
/// then, so that the pool's own finalizer stays.
async fn clean_up(pool: &ClusterPool, ctx: &Ctx) -> Result<Action, PoolError> {
    let mut round = Round::new();
    let mut seen = observe(pool, ctx).await?;
    let cdcs = repair_leases(pool, ctx, &mut seen, &mut round).await?;
    let buckets = Buckets::sort(&seen.cds, &seen.claims, &seen.expected_deleted);
    execute::deleted_pool(pool, ctx, &seen.cds, &buckets, &cdcs).await?;
    ctx.written.forget(&pool.uid().unwrap_or_default());
    Ok(Action::await_change())
}

/// Repairs the pool's leases before anything is decided from them (§4.3.2, §4.3.6, §4.3.9) and
/// returns the CDCs as they are now.
async fn repair_leases(
    pool: &ClusterPool,
    ctx: &Ctx,
    seen: &mut Seen,
    round: &mut Round,
) -> Result<BTreeMap<String, Arc<Cdc>>, PoolError> {
    let cached = std::mem::take(&mut seen.cdcs);
    let (listed, pools) = scope_lists(pool, ctx, seen);
    let (name, ns) = (pool.name_any(), pool.namespace().unwrap_or_default());
    let scope = repair_scope(pool, seen, &name, &ns, &listed, &pools);
    repair::leases(&ctx.tenant, &scope, cached, round).await
}

/// The pool's inventory entries and the pools of its namespace, for [`repair_scope`].
fn scope_lists<'a>(pool: &ClusterPool, ctx: &Ctx, seen: &'a Seen) -> (BTreeSet<&'a str>, BTreeSet<String>) {
    let ns = pool.namespace().unwrap_or_default();
    let listed = seen.inventory.iter().map(String::as_str).collect();
    let pools = ctx
        .pools
        .state()
        .iter()
        .filter(|p| p.namespace().as_deref() == Some(ns.as_str()))
        .map(|p| p.name_any())
        .collect();
    (listed, pools)
}

fn repair_scope<'a>(
    pool: &ClusterPool,
    seen: &'a Seen,
    name: &'a str,
    ns: &'a str,
    listed: &'a BTreeSet<&'a str>,
    pools: &'a BTreeSet<String>,
) -> repair::Scope<'a> {
    repair::Scope {
        name,
        ns,
        deleting_pool: pool.metadata.deletion_timestamp.is_some(),
        listed,
        pools,
        cds: &seen.cds,
        live: &seen.live,
        expected_created: &seen.expected_created,
    }
}

/// Plans the pass, carries it out and writes the status, for a pool that is not being deleted.
async fn converge(
    pool: &ClusterPool,
    ctx: &Ctx,
    world: &World<'_>,
    mut buckets: Buckets,
    mut round: Round,
) -> Result<Action, PoolError> {
    let seen = world.seen;
    let assets = machines::pool_assets(pool, ctx);
    let domains = machines::domains(pool, &assets);
    round.contradiction = failure_domains::contradiction(&pool.spec, &domains);
    let mut usage = machines::usage(ctx, &seen.cds, &seen.expected_created);
    let (plan, deleted) = delete_as_planned(pool, ctx, world, &assets, &mut buckets, &mut round).await?;
    round.broken_entries = plan.broken_entries.clone();
    if let Some(wake) = plan.wake {
        round.soon(wake);
    }
    round.insufficient_hosts = plan.insufficient_hosts.clone();
    tracing::debug!(pool = %pool.name_any(), capacity = ?plan.capacity, "capacity");
    if let Some(add) = &plan.add {
        let placement = Placement {
            domains: &domains,
            usage: &mut usage,
        };
        execute::add_clusters(pool, ctx, &pool_version(pool), add, placement, &mut round).await?;
    }
    ctx.expect_deleted(pool, &deleted);
    hosts::repair(pool, ctx, &assets, &seen.live, &seen.expected_created, &mut round).await?;
    // Empty pool namespaces (a CD never created, or one deleted) are reaped after the minimum age.
    execute::reap_namespaces(ctx, &PoolIdentity::of(pool), &seen.expected_created, &mut round).await?;
    // The inventory's free CDCs read Available=True, once this pass's leases are taken.
    let (listed, pools) = scope_lists(pool, ctx, seen);
    let (name, ns) = (pool.name_any(), pool.namespace().unwrap_or_default());
    let scope = repair_scope(pool, seen, &name, &ns, &listed, &pools);
    repair::mark_free(&ctx.tenant, &scope, world.cdcs, &mut round).await?;
    let report = status::Report {
        pool,
        previous: &seen.previous,
        inventory: &seen.inventory,
        cds: &seen.cds,
        buckets: &buckets,
        deleted: &deleted,
        domains: &domains,
        cdcs: world.cdcs,
        round: &round,
        plan: &plan,
    };
    let status = status::build(&report, Time(Timestamp::now()));
    write_status(pool, ctx, &status).await?;
    announce(pool, ctx, &seen.previous, &status).await;
    record_metrics(ctx, &ns, &name, &buckets, &plan.stale, &status);
    Ok(Action::requeue(round.requeue))
}

/// Logs and Events for what went wrong since the last status, once per transition rather than on
/// every pass: an inventory entry whose ClusterDeploymentCustomization is missing, failure domains
/// found contradicting themselves.
async fn announce(pool: &ClusterPool, ctx: &Ctx, previous: &ClusterPoolStatus, status: &ClusterPoolStatus) {
    let tenant = &ctx.tenant;
    let (ns, name) = (pool.namespace().unwrap_or_default(), pool.name_any());
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
        warn!(tenant = %tenant.name, namespace = %ns, pool = %name, cdc = %entry.name, "an inventory entry's ClusterDeploymentCustomization does not exist");
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
        warn!(tenant = %tenant.name, namespace = %ns, pool = %name, %message, "the pool's failure domains contradict themselves");
        publish(tenant, pool, true, status::INVALID_MACHINE_SPEC, message).await;
    }
}

/// What the caches show of one pool, corrected by this controller's own writes they do not show yet.
struct Seen {
    /// The pool's status as last known (see [`last_status`]).
    previous: ClusterPoolStatus,
    expected_created: BTreeSet<String>,
    expected_deleted: BTreeSet<String>,
    /// Clusters this pool created (§8): a reference alone is never trusted.
    cds: Vec<Arc<ClusterDeployment>>,
    /// Every cluster in a namespace this pool created, member or not.
    live: BTreeSet<String>,
    claims: BTreeMap<String, Arc<ClusterClaim>>,
    /// The pool's inventory entries, each once, in spec order.
    inventory: Vec<String>,
    /// The CDCs of the pool's namespace.
    cdcs: BTreeMap<String, Arc<Cdc>>,
}

async fn observe(pool: &ClusterPool, ctx: &Ctx) -> Result<Seen, PoolError> {
    let ns = pool.namespace().unwrap_or_default();
    let name = pool.name_any();
    let previous = last_status(ctx, pool);
    let (expected_created, expected_deleted) = ctx.expectations_of(pool);
    let identity = PoolIdentity::of(pool);
    let clusters = membership::clusters(&ctx.tenant, &ctx.cds, &ctx.namespaces, &ctx.refusals, &identity).await?;
    let claims = ctx
        .claims
        .state()
        .into_iter()
        .filter(|c| c.namespace().as_deref() == Some(ns.as_str()) && c.spec.cluster_pool_name == name)
        .map(|c| (c.name_any(), c))
        .collect();
    let mut seen_entries = BTreeSet::new();
    let inventory = pool
        .spec
        .inventory
        .iter()
        .flatten()
        .map(|e| e.name.clone())
        .filter(|n| seen_entries.insert(n.clone()))
        .collect();
    let cdcs = ctx
        .cdcs
        .state()
        .into_iter()
        .filter(|c| c.namespace().as_deref() == Some(ns.as_str()))
        .map(|c| (c.name_any(), c))
        .collect();
    Ok(Seen {
        previous,
        expected_created,
        expected_deleted,
        cds: clusters.members,
        live: clusters.live,
        claims,
        inventory,
        cdcs,
    })
}

/// The pool's world once its leases are repaired and its claims assigned.
struct World<'a> {
    seen: &'a Seen,
    /// The CDCs after the lease repair.
    cdcs: &'a BTreeMap<String, Arc<Cdc>>,
    pending_claims: i64,
}

/// Plans the pass and carries out its deletions; returns the plan and the clusters deleted. A
/// broken cluster whose CDC changed since the cache (409 on its BrokenByCloud mark) stays for the
/// next pass, and the plan is made again without it from what was already done.
async fn delete_as_planned(
    pool: &ClusterPool,
    ctx: &Ctx,
    world: &World<'_>,
    assets: &[Arc<BareMetalAsset>],
    buckets: &mut Buckets,
    round: &mut Round,
) -> Result<(Plan, Vec<String>), PoolError> {
    let version = pool_version(pool);
    let settings = &ctx.tenant.shared.settings;
    let mut progress = Progress::default();
    let mut deleted: Vec<String> = Vec::new();
    loop {
        let inputs = plan::Inputs {
            pool,
            version: &version,
            inventory: &world.seen.inventory,
            cds: &world.seen.cds,
            expected_created: &world.seen.expected_created,
            cdcs: world.cdcs,
            written: &round.written,
            previous: &world.seen.previous,
            backoff: settings.backoff,
            assets,
            pending_claims: world.pending_claims,
            contradiction: round.contradiction.is_some(),
        };
        let planned = plan::plan(&inputs, buckets, &progress);
        let kept = execute::deletes(ctx, pool, &planned.deletes, world.cdcs, buckets, round, &mut deleted).await?;
        match kept {
            None => return Ok((planned, deleted)),
            Some(cd) => progress.record(&planned, &deleted, cd),
        }
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

/// The pool version of §4.3.8: a hash of what every cluster is built from, plus a marker when the
/// pool has an inventory (so editing entries never changes it).
pub fn pool_version(pool: &ClusterPool) -> String {
    let s = &pool.spec;
    let fields = json!([
        s.platform,
        s.base_domain,
        s.installer_image,
        s.install_config_secret_template_ref,
        s.pull_secret_ref,
        s.control_plane,
        s.compute,
        s.failure_domains,
        s.availability_zones,
        s.control_plane_availability_zones,
        s.control_plane_omit_availability_zone,
        s.host_selector,
    ]);
    let mut hasher = Sha256::new();
    hasher.update(fields.to_string().as_bytes());
    if s.inventory.is_some() {
        hasher.update(b"hasInventory");
    }
    hex::encode(hasher.finalize())[..16].to_string()
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

/// The pool's status as last known: the cached one, unless this controller wrote one the cache
/// does not show yet (so counters such as `attempts` are never lost to a stale cache).
fn last_status(ctx: &Ctx, pool: &ClusterPool) -> ClusterPoolStatus {
    let cached = pool.status.clone().unwrap_or_default();
    let uid = pool.uid().unwrap_or_default();
    ctx.written
        .current(&uid, pool.metadata.resource_version.as_deref(), cached)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::pools::{ClusterPoolSpec, InventoryEntry};

    fn pool(spec: ClusterPoolSpec) -> ClusterPool {
        ClusterPool::new("p", spec)
    }

    #[test]
    fn the_version_changes_with_the_inventory_marker_but_not_with_its_entries() {
        let base = ClusterPoolSpec {
            base_domain: "example.com".into(),
            installer_image: "installer:1".into(),
            ..Default::default()
        };
        let without = pool_version(&pool(base.clone()));
        let entry = |n: &str| InventoryEntry {
            name: n.into(),
            ..Default::default()
        };
        let one = pool_version(&pool(ClusterPoolSpec {
            inventory: Some(vec![entry("a")]),
            ..base.clone()
        }));
        let two = pool_version(&pool(ClusterPoolSpec {
            inventory: Some(vec![entry("b"), entry("a")]),
            ..base.clone()
        }));
        assert_ne!(without, one);
        assert_eq!(one, two);
        let resized = pool_version(&pool(ClusterPoolSpec {
            size: 7,
            ..base.clone()
        }));
        assert_eq!(without, resized, "size is not part of the version");
        let other = pool_version(&pool(ClusterPoolSpec {
            base_domain: "other.com".into(),
            ..base
        }));
        assert_ne!(without, other);
    }
}
