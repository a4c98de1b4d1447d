//! The ClusterPool controller (DESIGN.md §4.3): keeps `size` unclaimed clusters (plus one per pending
//! claim), each built from a leased ClusterDeploymentCustomization when the pool has an inventory;
//! assigns clusters to claims; replaces broken and stale clusters; reports per-entry inventory
//! status, conditions, Events and metrics. Hive's known bugs are fixed (see the research notes):
//! broken and stale clusters are replaced even when the inventory cannot back `size`, failed patches
//! leave nothing behind and do not stall the pool, only this pool's leases are repaired or released.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use jiff::Timestamp;
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, Preconditions};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Api, ResourceExt};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;
use tracing::info;

use super::claim;
use super::create::{cluster_name, create_cluster, read_inputs};
use super::hosts;
use super::install_config;
use super::leases::{self as inventory, BROKEN_BY_CLOUD, BROKEN_BY_SYNTAX};
use super::machines::{self, MachinePlan};
use super::membership::{self, PoolIdentity};
use super::repair;
use super::status::{entry_statuses, record_metrics};
use super::{
    CDC_GENERATION_ANNOTATION, POOL_FINALIZER, POOL_NAME_LABEL, POOL_NAMESPACE_LABEL, POOL_VERSION_ANNOTATION,
    cdc_finalizer, set_finalizers,
};
use crate::api::inventory::BareMetalAsset;
use crate::api::pools::{
    ClusterClaim, ClusterDeployment, ClusterDeploymentCustomization, ClusterPool, ClusterPoolStatus,
    FailureDomainStatus, InventoryEntryState, MachineFailureDomain,
};
use crate::context::events::publish;
use crate::context::tenant::TenantContext;
use crate::runtime::api_errors::{is_conflict, is_not_found};
use crate::runtime::cache::{is_filled, reflect};
use crate::runtime::conditions::{DesiredCondition, is_true, set_condition};
use crate::runtime::metrics::{Metrics, PoolLabels};
use crate::runtime::panics::{self, ReconcilePanic};
use crate::runtime::readiness::Readiness;
use crate::runtime::recovery::NoTriggerBackoff;
use crate::runtime::retry;
use crate::runtime::shutdown::run_controller;

type Cdc = ClusterDeploymentCustomization;

/// How long a CD this controller created (or deleted) may be missing from (or still live in) the
/// cache before the cache is believed again.
const EXPECTATION_TTL: Duration = Duration::from_secs(60);
/// A pool is looked at again at least this often (lease ages, backoffs and lifetimes also requeue).
const RESYNC: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    #[error("tenant API request failed: {0}")]
    Tenant(#[from] kube::Error),
    #[error(transparent)]
    Panicked(#[from] ReconcilePanic),
}

/// Creations and deletions not yet seen in the cache, per pool (Hive's "expectations").
#[derive(Default)]
struct Expectations {
    created: HashMap<String, Instant>,
    deleted: HashMap<String, Instant>,
}

pub(super) struct Ctx {
    pub(super) tenant: Arc<TenantContext>,
    cds: Store<ClusterDeployment>,
    cdcs: Store<Cdc>,
    claims: Store<ClusterClaim>,
    namespaces: Store<Namespace>,
    pub(super) assets: Store<BareMetalAsset>,
    /// Resolves once the five caches above are filled.
    caches_filled: Readiness,
    expectations: Mutex<HashMap<String, Expectations>>,
    /// Failure-domain records planned for new clusters, until their status shows them.
    pub(super) records: Mutex<HashMap<String, Vec<MachineFailureDomain>>>,
    /// The last status this controller wrote per pool, with the resourceVersion it produced: until
    /// the cache shows that version, the cached status is older than what we know.
    pub(super) written: Mutex<HashMap<String, (u64, ClusterPoolStatus)>>,
    /// ClusterDeployments naming a pool that did not create them.
    refusals: membership::Refusals,
}

/// Runs the controller until `cancel` fires.
pub async fn run(context: Arc<TenantContext>, cancel: CancellationToken) {
    let client = context.client.clone();
    let (pools, pool_stream) = reflect(Api::<ClusterPool>::all(client.clone()), Default::default());
    let (cds, cd_stream) = reflect(Api::<ClusterDeployment>::all(client.clone()), Default::default());
    let (cdcs, cdc_stream) = reflect(Api::<Cdc>::all(client.clone()), Default::default());
    let (claims, claim_stream) = reflect(Api::<ClusterClaim>::all(client.clone()), Default::default());
    let (namespaces, ns_stream) = reflect(
        Api::<Namespace>::all(client.clone()),
        watcher::Config::default().labels(POOL_NAME_LABEL),
    );
    let (assets, asset_stream) = reflect(Api::<BareMetalAsset>::all(client.clone()), Default::default());
    let caches_filled = {
        let caches = (
            cds.clone(),
            cdcs.clone(),
            claims.clone(),
            namespaces.clone(),
            assets.clone(),
        );
        Readiness::after(async move {
            let (cds, cdcs, claims, namespaces, assets) = caches;
            cds.wait_until_ready().await.is_ok()
                && cdcs.wait_until_ready().await.is_ok()
                && claims.wait_until_ready().await.is_ok()
                && namespaces.wait_until_ready().await.is_ok()
                && assets.wait_until_ready().await.is_ok()
        })
    };
    let ctx = Arc::new(Ctx {
        tenant: context,
        cds,
        cdcs,
        claims,
        namespaces,
        assets,
        caches_filled,
        expectations: Mutex::default(),
        records: Mutex::default(),
        written: Mutex::default(),
        refusals: Mutex::default(),
    });
    let pools_of_cdc = pools.clone();
    let pools_of_asset = pools.clone();
    let shutdown = cancel.clone();
    let main_store = pools.clone();
    let run = Controller::for_stream(pool_stream, pools)
        .trigger_backoff(NoTriggerBackoff)
        // The pool a cluster names, and the pool it was made by (whose count changes when someone
        // edits the reference away).
        .watches_stream(cd_stream, |cd: ClusterDeployment| {
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
        })
        .watches_stream(claim_stream, |c: ClusterClaim| {
            c.namespace()
                .map(|ns| ObjectRef::new(&c.spec.cluster_pool_name).within(&ns))
        })
        .watches_stream(cdc_stream, move |cdc: Cdc| {
            let ns = cdc.namespace().unwrap_or_default();
            let holder = inventory::lease_holder(&cdc).and_then(|(pool, _)| pool);
            pools_of_cdc
                .state()
                .into_iter()
                .filter(|p| p.namespace().as_deref() == Some(ns.as_str()))
                .filter(|p| {
                    let name = p.name_any();
                    let listed = p.spec.inventory.iter().flatten().any(|e| e.name == cdc.name_any());
                    listed
                        || holder.as_deref() == Some(name.as_str())
                        || cdc.finalizers().contains(&cdc_finalizer(&name))
                })
                .map(|p| ObjectRef::from_obj(&*p))
                .collect::<Vec<_>>()
        })
        // Assets feed the failure domains and hosts of the baremetal pools in their namespace.
        .watches_stream(asset_stream, move |asset: BareMetalAsset| {
            let ns = asset.namespace().unwrap_or_default();
            pools_of_asset
                .state()
                .into_iter()
                .filter(|p| p.namespace().as_deref() == Some(ns.as_str()) && p.spec.platform.baremetal.is_some())
                .map(|p| ObjectRef::from_obj(&*p))
                .collect::<Vec<_>>()
        })
        .watches_stream(ns_stream, |ns: Namespace| {
            let labels = ns.labels();
            Some(ObjectRef::new(labels.get(POOL_NAME_LABEL)?).within(labels.get(POOL_NAMESPACE_LABEL)?))
        })
        .graceful_shutdown_on(async move { shutdown.cancelled().await })
        .run(reconcile, error_policy, ctx)
        .for_each(|_| std::future::ready(()));
    run_controller(run, &cancel, || is_filled(&main_store)).await;
}

fn error_policy(pool: Arc<ClusterPool>, err: &PoolError, ctx: Arc<Ctx>) -> Action {
    let key = format!("pool/{}/{}", pool.namespace().unwrap_or_default(), pool.name_any());
    let logged = (ctx.tenant.name.as_str(), "clusterpool", key.as_str());
    Action::requeue(retry::after_failure(&ctx.tenant.object_backoff, &key, logged, err))
}

/// Longest pool name: its clusters are named `<pool>-<5 characters>`, a namespace name (63).
const MAX_POOL_NAME: usize = 57;

/// A pool whose name is too long for its clusters' names gets no cluster, and says why.
async fn refuse_long_name(pool: &ClusterPool, ctx: &Ctx, pools: &Api<ClusterPool>) -> Result<Action, PoolError> {
    let name = pool.name_any();
    let message = format!(
        "The pool name is {} characters long; at most {MAX_POOL_NAME} leave room for the cluster names <pool>-<5 characters>: recreate the pool with a shorter name",
        name.len()
    );
    let mut status = pool.status.clone().unwrap_or_default();
    let changed = set_condition(
        &mut status.conditions,
        DesiredCondition {
            type_: "CapacityAvailable",
            status: false,
            reason: "InvalidName",
            message: message.clone(),
            observed_generation: pool.metadata.generation,
        },
        Time(Timestamp::now()),
    );
    if changed {
        pools
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(json!({"status": status})))
            .await?;
        publish(&ctx.tenant, pool, true, "InvalidName", message).await;
    }
    Ok(Action::await_change())
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

/// Why an unclaimed cluster is stale.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Stale {
    PoolVersion,
    EntryRemoved,
    EntryEdited,
}

/// Where one of the pool's clusters stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Bucket {
    Deleting,
    /// Claimed, and its claim is gone: delete it.
    Released,
    Claimed,
    Broken,
    Ready,
    Installing,
}

fn bucket(cd: &ClusterDeployment, claims: &BTreeMap<String, Arc<ClusterClaim>>, deleted: bool) -> Bucket {
    let status = cd.status.clone().unwrap_or_default();
    if cd.metadata.deletion_timestamp.is_some() || deleted {
        return Bucket::Deleting;
    }
    if let Some(claim) = cd.spec.cluster_pool_ref.as_ref().and_then(|r| r.claim_name.as_ref()) {
        let gone = claims
            .get(claim)
            .is_none_or(|c| c.metadata.deletion_timestamp.is_some());
        return if gone { Bucket::Released } else { Bucket::Claimed };
    }
    if is_true(&status.conditions, "ProvisionStopped") {
        Bucket::Broken
    } else if status.installed {
        Bucket::Ready
    } else {
        Bucket::Installing
    }
}

pub(super) fn cdc_of(cd: &ClusterDeployment) -> Option<String> {
    cd.spec
        .cluster_pool_ref
        .as_ref()
        .and_then(|r| r.cluster_deployment_customization.as_ref())
        .map(|r| r.name.clone())
}

pub(super) fn created(cd: &ClusterDeployment) -> Timestamp {
    cd.metadata.creation_timestamp.as_ref().map(|t| t.0).unwrap_or_default()
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
}

impl Round {
    pub(super) fn soon(&mut self, after: Duration) {
        self.requeue = self.requeue.min(after.max(Duration::from_millis(100)));
    }
}

async fn reconcile(pool: Arc<ClusterPool>, ctx: Arc<Ctx>) -> Result<Action, PoolError> {
    let tenant = &ctx.tenant;
    let labels = Metrics::controller(&tenant.name, "clusterpool");
    tenant.shared.metrics.reconciles.get_or_create(&labels).inc();
    // Concurrent reconciles must not await `Store::wait_until_ready` themselves: it wakes only its
    // last waiter (see runtime::readiness).
    if !ctx.caches_filled.wait().await {
        return Ok(Action::await_change());
    }
    let Ok(_permit) = tenant.reconcile_permits.acquire().await else {
        return Ok(Action::await_change());
    };
    let key = format!("pool/{}/{}", pool.namespace().unwrap_or_default(), pool.name_any());
    let result = panics::contain(reconcile_pool(&pool, &ctx)).await;
    match &result {
        Ok(_) => tenant.object_backoff.succeeded(&key),
        Err(_) => {
            tenant.shared.metrics.reconcile_errors.get_or_create(&labels).inc();
        }
    }
    result
}

async fn reconcile_pool(pool: &ClusterPool, ctx: &Ctx) -> Result<Action, PoolError> {
    let tenant = &ctx.tenant;
    let ns = pool.namespace().unwrap_or_default();
    let name = pool.name_any();
    let key = format!("{ns}/{name}");
    let pools = Api::<ClusterPool>::namespaced(tenant.client.clone(), &ns);
    let cdc_api = Api::<Cdc>::namespaced(tenant.client.clone(), &ns);
    let settings = &tenant.shared.settings;
    let base_status = last_status(ctx, &key, pool);
    let mut round = Round {
        requeue: RESYNC,
        broken_entries: BTreeSet::new(),
        leased: BTreeMap::new(),
        written: BTreeMap::new(),
        syntax_errors: BTreeMap::new(),
        missing_dependencies: Vec::new(),
        hosts_taken: BTreeSet::new(),
        insufficient_hosts: None,
    };

    if name.len() > MAX_POOL_NAME && pool.metadata.deletion_timestamp.is_none() {
        return refuse_long_name(pool, ctx, &pools).await;
    }
    if pool.metadata.deletion_timestamp.is_none() && !pool.finalizers().iter().any(|f| f == POOL_FINALIZER) {
        let mut finalizers = pool.finalizers().to_vec();
        finalizers.push(POOL_FINALIZER.into());
        return match set_finalizers(&pools, pool, finalizers).await {
            Ok(_) => Ok(Action::await_change()),
            Err(err) if is_conflict(&err) => Ok(Action::requeue(Duration::from_millis(200))),
            Err(err) => Err(err.into()),
        };
    }

    // What the cache says, corrected by our own writes it has not shown yet.
    let (expected_created, expected_deleted) = {
        let mut all = ctx.expectations.lock().unwrap_or_else(|p| p.into_inner());
        let mine = all.entry(key.clone()).or_default();
        let now = Instant::now();
        mine.created.retain(|cd, at| {
            now.duration_since(*at) < EXPECTATION_TTL && ctx.cds.get(&ObjectRef::new(cd).within(cd)).is_none()
        });
        mine.deleted.retain(|cd, at| {
            now.duration_since(*at) < EXPECTATION_TTL
                && ctx
                    .cds
                    .get(&ObjectRef::new(cd).within(cd))
                    .is_some_and(|c| c.metadata.deletion_timestamp.is_none())
        });
        (
            mine.created.keys().cloned().collect::<BTreeSet<_>>(),
            mine.deleted.keys().cloned().collect::<BTreeSet<_>>(),
        )
    };
    // Only clusters this pool created (§8): a reference alone is never trusted.
    let identity = PoolIdentity::of(pool);
    let clusters = membership::clusters(tenant, &ctx.cds, &ctx.namespaces, &ctx.refusals, &identity).await?;
    let cds = clusters.members;
    let live = clusters.live;
    let claims: BTreeMap<String, Arc<ClusterClaim>> = ctx
        .claims
        .state()
        .into_iter()
        .filter(|c| c.namespace().as_deref() == Some(ns.as_str()) && c.spec.cluster_pool_name == name)
        .map(|c| (c.name_any(), c))
        .collect();
    let inventory: Vec<String> = {
        let mut seen = BTreeSet::new();
        pool.spec
            .inventory
            .iter()
            .flatten()
            .map(|e| e.name.clone())
            .filter(|n| seen.insert(n.clone()))
            .collect()
    };
    let listed: BTreeSet<&str> = inventory.iter().map(String::as_str).collect();
    let cdcs: BTreeMap<String, Arc<Cdc>> = ctx
        .cdcs
        .state()
        .into_iter()
        .filter(|c| c.namespace().as_deref() == Some(ns.as_str()))
        .map(|c| (c.name_any(), c))
        .collect();
    let finalizer = cdc_finalizer(&name);
    let held_by_us = |cdc: &Cdc| inventory::lease_holder(cdc).is_some_and(|(p, _)| p.as_deref() == Some(name.as_str()));

    let deleting_pool = pool.metadata.deletion_timestamp.is_some();
    let cdcs = repair::leases(
        tenant,
        &name,
        &ns,
        deleting_pool,
        &listed,
        cdcs,
        &cds,
        &live,
        &expected_created,
        &mut round,
    )
    .await?;

    let version = pool_version(pool);
    let mut buckets: BTreeMap<String, Bucket> = cds
        .iter()
        .map(|cd| {
            (
                cd.name_any(),
                bucket(cd, &claims, expected_deleted.contains(&cd.name_any())),
            )
        })
        .collect();
    let stale_reason = |cd: &ClusterDeployment| -> Option<Stale> {
        let annotations = cd.annotations();
        if annotations.get(POOL_VERSION_ANNOTATION) != Some(&version) {
            return Some(Stale::PoolVersion);
        }
        let entry = cdc_of(cd)?;
        if !listed.contains(entry.as_str()) {
            return Some(Stale::EntryRemoved);
        }
        let generation = cdcs.get(&entry).and_then(|c| c.metadata.generation);
        let built_from = annotations
            .get(CDC_GENERATION_ANNOTATION)
            .and_then(|g| g.parse::<i64>().ok());
        (generation.is_some() && built_from.is_some() && generation != built_from).then_some(Stale::EntryEdited)
    };

    if deleting_pool {
        return reconcile_deleted(pool, ctx, &cds, &buckets, &cdcs, &finalizer).await;
    }

    // Claims (§4.3.10): oldest claim first gets the oldest ready cluster.
    let pending_claims = claim::assign(tenant, pool, &cds, &claims, &mut buckets, &mut round).await?;

    // Capacity (§4.3.5).
    let count = |b: Bucket| buckets.values().filter(|x| **x == b).count() as i64;
    let installing =
        count(Bucket::Installing) + expected_created.iter().filter(|c| !buckets.contains_key(*c)).count() as i64;
    let deleting = count(Bucket::Deleting);
    let mut room = pool
        .spec
        .max_concurrent
        .map_or(i64::MAX, |m| i64::from(m) - installing - deleting);
    let cd_by_name: BTreeMap<String, Arc<ClusterDeployment>> =
        cds.iter().map(|cd| (cd.name_any(), cd.clone())).collect();
    let cd_api = |cd: &str| Api::<ClusterDeployment>::namespaced(tenant.client.clone(), cd);
    let mut deleted_now: Vec<String> = Vec::new();

    // Clusters whose claim was deleted go first, then broken ones.
    for (wanted, why) in [
        (Bucket::Released, "its claim was deleted"),
        (Bucket::Broken, "its install failed installAttemptsLimit times"),
    ] {
        // A cluster stopped on its machine spec would be rebuilt identically: it stays (and says
        // why) until the pool's configuration changes and makes it stale.
        let mut victims: Vec<&Arc<ClusterDeployment>> = cds
            .iter()
            .filter(|cd| buckets[&cd.name_any()] == wanted && !invalid_machine_spec(cd))
            .collect();
        victims.sort_by_key(|cd| created(cd));
        for cd in victims {
            if room <= 0 {
                break;
            }
            if wanted == Bucket::Broken
                && let Some(entry) = cdc_of(cd)
            {
                round.broken_entries.insert(entry.clone());
                if let Some(cdc) = cdcs.get(&entry)
                    && inventory::lease_holder(cdc) == Some((Some(name.clone()), Some(cd.name_any())))
                {
                    let message = format!(
                        "Cluster {} failed to install; this may or may not be the fault of the patches. It is retried after a backoff",
                        cd.name_any()
                    );
                    match inventory::set_apply_result(&cdc_api, cdc, BROKEN_BY_CLOUD, message.clone()).await {
                        Ok(written) => {
                            if let Some(written) = written {
                                round.written.insert(entry.clone(), written);
                            }
                            publish(tenant, &**cdc, true, BROKEN_BY_CLOUD, message).await;
                        }
                        Err(err) if is_conflict(&err) => {
                            round.soon(Duration::from_millis(200));
                            continue;
                        }
                        Err(err) => return Err(err.into()),
                    }
                }
            }
            delete_cd(&cd_api(&cd.name_any()), cd, why).await?;
            publish(
                tenant,
                pool,
                wanted == Bucket::Broken,
                "ClusterDeleted",
                format!("Deleted ClusterDeployment {}: {why}", cd.name_any()),
            )
            .await;
            buckets.insert(cd.name_any(), Bucket::Deleting);
            deleted_now.push(cd.name_any());
            room -= 1;
        }
    }

    // Which inventory entries could back a cluster, and which are free now.
    let cdc_now = |written: &BTreeMap<String, Cdc>, entry: &str| -> Option<Cdc> {
        written
            .get(entry)
            .cloned()
            .or_else(|| cdcs.get(entry).map(|c| (**c).clone()))
    };
    let attempts_of = |entry: &str| -> i32 {
        base_status
            .inventory
            .iter()
            .find(|e| e.name == entry)
            .map_or(0, |e| e.attempts)
    };
    let backoff = |attempts: i32| -> Duration {
        let base = settings.backoff.base;
        base.saturating_mul(1u32 << attempts.clamp(0, 16) as u32)
            .min(settings.backoff.max)
    };
    let mut backing = 0i64;
    let mut free: Vec<(inventory::Rank, String)> = Vec::new();
    if pool.spec.inventory.is_some() {
        for entry in &inventory {
            let Some(cdc) = cdc_now(&round.written, entry) else {
                continue;
            };
            if cdc.metadata.deletion_timestamp.is_some() && !held_by_us(&cdc) {
                continue;
            }
            let holder = inventory::lease_holder(&cdc);
            if let Some((pool_name, _)) = &holder
                && pool_name.as_deref() != Some(name.as_str())
            {
                continue;
            }
            if holder.is_none() && inventory::apply_reason(&cdc) == Some(BROKEN_BY_SYNTAX) {
                continue;
            }
            let attempts = attempts_of(entry) + i32::from(round.broken_entries.contains(entry));
            let wait = backoff(attempts);
            if holder.is_none() {
                match inventory::rank(&cdc, || wait) {
                    Some(rank) => free.push((rank, entry.clone())),
                    None if inventory::apply_reason(&cdc) == Some(BROKEN_BY_CLOUD) => {
                        let since = inventory::apply_since(&cdc).unwrap_or_default();
                        round.soon(wait.saturating_sub(since));
                    }
                    None => {}
                }
            }
            backing += 1;
        }
        free.sort();
    }
    // Entries held by clusters that are claimed or going away are not available to unclaimed ones.
    let held_elsewhere = cds
        .iter()
        .filter(|cd| {
            matches!(
                buckets[&cd.name_any()],
                Bucket::Claimed | Bucket::Released | Bucket::Deleting
            )
        })
        .filter(|cd| cdc_of(cd).is_some_and(|e| listed.contains(e.as_str())))
        .count() as i64;
    let held_by_claims = cds
        .iter()
        .filter(|cd| buckets[&cd.name_any()] == Bucket::Claimed)
        .filter(|cd| cdc_of(cd).is_some_and(|e| listed.contains(e.as_str())))
        .count() as i64;
    // What the inventory can back for unclaimed clusters once deletions finish.
    let capacity = (backing - held_by_claims).max(0);
    let wanted = i64::from(pool.spec.size) + pending_claims;
    let assets = machines::pool_assets(pool, ctx);
    let domains = machines::domains(pool, &assets);
    let mut usage = machines::usage(ctx, &cds, &expected_created);
    let target = if pool.spec.inventory.is_some() {
        wanted.min((backing - held_elsewhere).max(0))
    } else {
        wanted
    };
    let unclaimed: Vec<&Arc<ClusterDeployment>> = cds
        .iter()
        .filter(|cd| {
            matches!(
                buckets[&cd.name_any()],
                Bucket::Installing | Bucket::Ready | Bucket::Broken
            )
        })
        .collect();
    let pending_created = expected_created.iter().filter(|c| !buckets.contains_key(*c)).count() as i64;
    let drift = unclaimed.len() as i64 + pending_created - target;
    let total_live = buckets.values().filter(|b| **b != Bucket::Deleting).count() as i64 + pending_created;
    let size_room = pool.spec.max_size.map_or(i64::MAX, |m| i64::from(m) - total_live);
    let stale: Vec<(&Arc<ClusterDeployment>, Stale)> = unclaimed
        .iter()
        .filter_map(|cd| stale_reason(cd).map(|why| (*cd, why)))
        .collect();

    tracing::debug!(pool = %name, unclaimed = unclaimed.len(), pending_created, target, backing, held_elsewhere, wanted, installing, room, "capacity");
    if drift < 0 {
        let mut to_add = (-drift).min(size_room).min(room);
        if pool.spec.platform.baremetal.is_some() {
            // Capacity on bare metal: only as many clusters as the free assets can back.
            let capacity = hosts::capacity(pool, &assets);
            let backable = capacity.clusters.min(i64::MAX as usize) as i64;
            if backable < to_add {
                let (masters, workers) = hosts::needed(pool);
                round.insufficient_hosts = Some(format!(
                    "The pool needs {} more clusters; its free BareMetalAssets back {backable}, and a cluster needs {masters} control-plane and {workers} worker hosts where the rest can fill only {} and {} (control-plane hosts have role master or none, workers role worker or none); add assets matching spec.hostSelector or lower spec.size",
                    -drift, capacity.next_masters, capacity.next_workers
                ));
                to_add = backable;
            }
        }
        if to_add > 0 {
            let placement = Placement {
                domains: &domains,
                usage: &mut usage,
            };
            add_clusters(pool, ctx, &version, to_add, free, placement, &mut round).await?;
        }
    } else if drift > 0 && room > 0 {
        // Excess: installing ones (newest first), then ready ones (newest first).
        let mut excess: Vec<&Arc<ClusterDeployment>> = unclaimed.clone();
        excess.sort_by_key(|cd| {
            (
                buckets[&cd.name_any()] != Bucket::Installing,
                std::cmp::Reverse(created(cd)),
            )
        });
        for cd in excess.into_iter().take(drift.min(room) as usize) {
            delete_cd(&cd_api(&cd.name_any()), cd, "excess").await?;
            publish(
                tenant,
                pool,
                false,
                "ClusterDeleted",
                format!(
                    "Deleted ClusterDeployment {}: the pool has more clusters than it needs",
                    cd.name_any()
                ),
            )
            .await;
            deleted_now.push(cd.name_any());
        }
    } else if drift == 0 && installing == 0 && room > 0 && deleted_now.is_empty() {
        // One stale cluster at a time, and only while the pool is otherwise steady (§4.3.8).
        let mut oldest = stale.clone();
        oldest.sort_by_key(|(cd, _)| created(cd));
        if let Some((cd, why)) = oldest.first() {
            delete_cd(&cd_api(&cd.name_any()), cd, "stale").await?;
            let reason = match why {
                Stale::PoolVersion => "the pool's configuration changed",
                Stale::EntryRemoved => "its inventory entry was removed",
                Stale::EntryEdited => "its ClusterDeploymentCustomization was edited",
            };
            publish(
                tenant,
                pool,
                false,
                "StaleClusterReplaced",
                format!(
                    "Deleted ClusterDeployment {}: {reason}; a current one replaces it",
                    cd.name_any()
                ),
            )
            .await;
            deleted_now.push(cd.name_any());
        }
    }
    if !deleted_now.is_empty() {
        let mut all = ctx.expectations.lock().unwrap_or_else(|p| p.into_inner());
        let mine = all.entry(key.clone()).or_default();
        for cd in &deleted_now {
            mine.deleted.insert(cd.clone(), Instant::now());
        }
    }

    hosts::repair(pool, ctx, &assets, &live, &expected_created, &mut round).await?;

    // Empty pool namespaces (a CD never created, or one deleted) are reaped after the minimum age.
    reap_namespaces(ctx, &identity, &expected_created, &mut round).await?;

    // Status.
    let unclaimed_now: Vec<&Arc<ClusterDeployment>> = cds
        .iter()
        .filter(|cd| !deleted_now.contains(&cd.name_any()))
        .filter(|cd| {
            matches!(
                buckets[&cd.name_any()],
                Bucket::Installing | Bucket::Ready | Bucket::Broken
            )
        })
        .collect();
    let mut status = base_status.clone();
    let old_status = pool.status.clone().unwrap_or_default();
    let ready_count = unclaimed_now
        .iter()
        .filter(|cd| buckets[&cd.name_any()] == Bucket::Ready)
        .count() as i32;
    let installing_now = unclaimed_now
        .iter()
        .filter(|cd| buckets[&cd.name_any()] == Bucket::Installing)
        .count() as i32;
    status.size = unclaimed_now.len() as i32;
    status.ready = ready_count;
    status.standby = installing_now;
    status.platform = pool.spec.platform.name().map(String::from);
    status.observed_generation = pool.metadata.generation;
    status.failure_domains = domains.clone();
    status.inventory = entry_statuses(
        &base_status,
        &inventory,
        &|e| cdc_now(&round.written, e),
        &cd_by_name,
        &round,
        &stale,
        &name,
    );
    let now = Time(Timestamp::now());
    let generation = pool.metadata.generation;
    let mut set = |type_: &'static str, ok: bool, reason: &'static str, message: String| {
        set_condition(
            &mut status.conditions,
            DesiredCondition {
                type_,
                status: ok,
                reason,
                message,
                observed_generation: generation,
            },
            now.clone(),
        );
    };
    if round.missing_dependencies.is_empty() {
        set(
            "MissingDependencies",
            false,
            "DependenciesFound",
            "Every Secret the pool refers to exists".into(),
        );
    } else {
        set(
            "MissingDependencies",
            true,
            "MissingDependencies",
            format!(
                "Create the missing Secrets in namespace {ns}: {}",
                round.missing_dependencies.join(", ")
            ),
        );
    }
    if pool.spec.inventory.is_some() {
        let mut problems: BTreeMap<&str, Vec<String>> = BTreeMap::new();
        for entry in &status.inventory {
            let state = match entry.status {
                InventoryEntryState::BrokenBySyntax => "BrokenBySyntax",
                InventoryEntryState::BrokenByCloud => "BrokenByCloud",
                InventoryEntryState::Missing => "Missing",
                _ => continue,
            };
            let detail = round
                .syntax_errors
                .get(&entry.name)
                .map_or_else(|| entry.name.clone(), |e| format!("{} ({e})", entry.name));
            problems.entry(state).or_default().push(detail);
        }
        if problems.is_empty() {
            set(
                "InventoryValid",
                true,
                "Valid",
                format!("All {} inventory entries are usable", inventory.len()),
            );
        } else {
            let listing: Vec<String> = problems.iter().map(|(k, v)| format!("{k}: {}", v.join(", "))).collect();
            set(
                "InventoryValid",
                false,
                "Invalid",
                format!(
                    "Some inventory entries cannot be used ({}); fix the patches of BrokenBySyntax entries, create Missing ones, or remove them from spec.inventory",
                    listing.join("; ")
                ),
            );
        }
    }
    let at_max = pool.spec.max_size.is_some_and(|m| total_live >= i64::from(m));
    if at_max {
        set(
            "CapacityAvailable",
            false,
            "MaxCapacity",
            format!(
                "The pool is at its maxSize of {} clusters, claimed and unclaimed",
                pool.spec.max_size.unwrap_or_default()
            ),
        );
    } else if let Some(message) = &round.insufficient_hosts {
        set("CapacityAvailable", false, "InsufficientHosts", message.clone());
    } else if pool.spec.inventory.is_some() && wanted > capacity {
        set(
            "CapacityAvailable",
            false,
            "InventoryExhausted",
            format!(
                "The pool needs {wanted} unclaimed clusters (size plus pending claims) but its inventory can back only {capacity}; add ClusterDeploymentCustomizations to spec.inventory or lower spec.size"
            ),
        );
    } else {
        set(
            "CapacityAvailable",
            true,
            "Available",
            "The pool can add clusters".into(),
        );
    }
    if pool.spec.platform.vsphere.is_some() {
        if domains.is_empty() {
            set(
                "FailureDomainsUnsupported",
                false,
                "NoFailureDomains",
                "The pool defines no failure domains".into(),
            );
        } else {
            set(
                "FailureDomainsUnsupported",
                true,
                "FailureDomainsUnsupported",
                "Failure domains are not supported on vSphere and are ignored; remove spec.failureDomains and spec.availabilityZones".into(),
            );
        }
    }
    if stale.is_empty() {
        set(
            "AllClustersCurrent",
            true,
            "ClusterDeploymentsCurrent",
            "Every unclaimed cluster is current".into(),
        );
    } else {
        let names: Vec<String> = stale.iter().map(|(cd, _)| cd.name_any()).collect();
        set(
            "AllClustersCurrent",
            false,
            "SomeClusterDeploymentsStale",
            format!(
                "{} unclaimed clusters were built from an older pool or inventory configuration and are replaced one at a time: {}",
                names.len(),
                names.join(", ")
            ),
        );
    }
    set(
        "DeletionPossible",
        true,
        "DeletionPossible",
        "Deleting the pool deletes its unclaimed clusters".into(),
    );
    if status != old_status {
        let mut patch = json!({"status": status});
        // A merge patch keeps map keys it does not mention: removed domains are sent as null.
        for gone in old_status.failure_domains.keys() {
            if !status.failure_domains.contains_key(gone) {
                patch["status"]["failureDomains"][gone] = Value::Null;
            }
        }
        let written = pools
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(patch))
            .await?;
        if let Some(rv) = resource_version(&written) {
            let mut all = ctx.written.lock().unwrap_or_else(|p| p.into_inner());
            all.insert(key.clone(), (rv, status.clone()));
        }
    }
    record_metrics(ctx, &ns, &name, &buckets, &stale, &status);
    Ok(Action::requeue(round.requeue))
}

/// The newer of a copy this pass wrote and the cached one (by resourceVersion).
fn newest(written: Option<Cdc>, cached: Option<Arc<Cdc>>) -> Option<Arc<Cdc>> {
    let version = |c: &Cdc| {
        c.metadata
            .resource_version
            .as_deref()
            .and_then(|v| v.parse::<u64>().ok())
    };
    match (written, cached) {
        (Some(w), Some(c)) if version(&c) > version(&w) => Some(c),
        (Some(w), _) => Some(Arc::new(w)),
        (None, c) => c,
    }
}

fn resource_version(pool: &ClusterPool) -> Option<u64> {
    pool.metadata.resource_version.as_deref()?.parse().ok()
}

/// The pool's status as last known: the cached one, unless this controller wrote a newer one the
/// cache does not show yet (so counters such as `attempts` are never lost to a stale cache).
fn last_status(ctx: &Ctx, key: &str, pool: &ClusterPool) -> ClusterPoolStatus {
    let cached = pool.status.clone().unwrap_or_default();
    let all = ctx.written.lock().unwrap_or_else(|p| p.into_inner());
    match (all.get(key), resource_version(pool)) {
        (Some((written, status)), Some(seen)) if *written > seen => status.clone(),
        _ => cached,
    }
}

async fn delete_cd(api: &Api<ClusterDeployment>, cd: &ClusterDeployment, why: &str) -> Result<(), PoolError> {
    info!(cluster = %cd.name_any(), reason = why, "deleting cluster");
    let params = DeleteParams {
        preconditions: Some(Preconditions {
            uid: cd.metadata.uid.clone(),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    match api.delete(&cd.name_any(), &params).await {
        Ok(_) => Ok(()),
        Err(err) if is_not_found(&err) || is_conflict(&err) => Ok(()),
        Err(err) => Err(err.into()),
    }
}

/// Adds up to `count` clusters (§4.3.2 order: name → lease → namespace, Secrets, ClusterDeployment).
/// The pool's failure domains and their use so far, for placing new clusters' machines.
pub(super) struct Placement<'a> {
    pub(super) domains: &'a BTreeMap<String, FailureDomainStatus>,
    pub(super) usage: &'a mut BTreeMap<String, usize>,
}

/// True when the cluster was stopped because its machines cannot be placed.
fn invalid_machine_spec(cd: &ClusterDeployment) -> bool {
    cd.status.as_ref().is_some_and(|s| {
        s.conditions
            .iter()
            .any(|c| c.type_ == "ProvisionStopped" && c.status == "True" && c.reason == "InvalidMachineSpec")
    })
}

async fn add_clusters(
    pool: &ClusterPool,
    ctx: &Ctx,
    version: &str,
    count: i64,
    mut free: Vec<(inventory::Rank, String)>,
    placement: Placement<'_>,
    round: &mut Round,
) -> Result<(), PoolError> {
    let Some(inputs) = read_inputs(pool, ctx, round).await? else {
        return Ok(());
    };
    let tenant = &ctx.tenant;
    let ns = pool.namespace().unwrap_or_default();
    let name = pool.name_any();
    let cdc_api = Api::<Cdc>::namespaced(tenant.client.clone(), &ns);
    free.reverse();
    for _ in 0..count {
        let cd_name = cluster_name(&name);
        let mut config = install_config::generate(&inputs.template, &pool.spec, &cd_name);
        let mut usage = placement.usage.clone();
        let plan: MachinePlan = machines::plan(pool, placement.domains, &mut usage, &mut config);
        let mut leased: Option<Cdc> = None;
        if pool.spec.inventory.is_some() {
            // Try entries in order until one applies and its lease write wins.
            while let Some((_, entry)) = free.pop() {
                let cached = ctx.cdcs.get(&ObjectRef::new(&entry).within(&ns));
                let Some(cdc) = newest(round.written.get(&entry).cloned(), cached) else {
                    continue;
                };
                let mut patched = config.clone();
                if let Err(error) = install_config::apply_patches(&mut patched, &cdc.spec.install_config_patches) {
                    round.syntax_errors.insert(entry.clone(), error.clone());
                    match inventory::set_apply_result(&cdc_api, &cdc, BROKEN_BY_SYNTAX, error.clone()).await {
                        Ok(Some(written)) => {
                            round.written.insert(entry.clone(), written);
                            publish(
                                tenant,
                                &*cdc,
                                true,
                                BROKEN_BY_SYNTAX,
                                format!("Patches do not apply: {error}"),
                            )
                            .await;
                            publish(
                                tenant,
                                pool,
                                true,
                                "InventoryInvalid",
                                format!("ClusterDeploymentCustomization {entry}: {error}"),
                            )
                            .await;
                        }
                        Ok(None) => {}
                        Err(err) if is_conflict(&err) => {}
                        Err(err) => return Err(err.into()),
                    }
                    continue;
                }
                match inventory::lease(&cdc_api, &cdc, &cd_name, &name).await {
                    // Leased by someone else since this pass began.
                    Ok(None) => continue,
                    Ok(Some(written)) => {
                        round
                            .leased
                            .insert(entry.clone(), cdc.metadata.generation.unwrap_or_default());
                        round.written.insert(entry.clone(), written.clone());
                        publish(
                            tenant,
                            &written,
                            false,
                            "Leased",
                            format!("Leased for ClusterDeployment {cd_name} of ClusterPool {name}"),
                        )
                        .await;
                        config = patched;
                        leased = Some(written);
                        break;
                    }
                    // Someone else leased it first: take the next one.
                    Err(err) if is_conflict(&err) => {
                        info!(tenant = %tenant.name, pool = %name, cdc = %entry, "lost the lease race; trying the next entry");
                        continue;
                    }
                    Err(err) => return Err(err.into()),
                }
            }
            if leased.is_none() {
                return Ok(());
            }
        }
        let mut plan = plan;
        if pool.spec.platform.baremetal.is_some() {
            // §4.3.2 order: after the lease, before the namespace and the ClusterDeployment.
            let Some(chosen) = hosts::take(pool, ctx, &cd_name, placement.domains, &usage, round).await? else {
                if let Some(cdc) = &leased {
                    match inventory::release(&cdc_api, cdc, &cd_name, &name).await {
                        Ok(_) => {}
                        // Left to the repair after the minimum age.
                        Err(err) if is_conflict(&err) => {}
                        Err(err) => return Err(err.into()),
                    }
                }
                return Ok(());
            };
            let secrets = Api::<k8s_openapi::api::core::v1::Secret>::namespaced(tenant.client.clone(), &ns);
            hosts::render(&mut config, &chosen, &secrets).await?;
            plan.records = hosts::records(&chosen);
            plan.hosts = hosts::cluster_hosts(&chosen);
            machines::commit(&mut usage, &plan.records);
        }
        {
            let mut all = ctx.expectations.lock().unwrap_or_else(|p| p.into_inner());
            all.entry(format!("{ns}/{name}"))
                .or_default()
                .created
                .insert(cd_name.clone(), Instant::now());
        }
        *placement.usage = usage;
        machines::remember(ctx, &cd_name, &plan.records);
        if let Err(err) = create_cluster(pool, ctx, &inputs, &cd_name, version, &config, leased.as_ref(), &plan).await {
            // Not coming: stop counting it. Its lease and namespace are repaired after the minimum age.
            let mut all = ctx.expectations.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(mine) = all.get_mut(&format!("{ns}/{name}")) {
                mine.created.remove(&cd_name);
            }
            return Err(err);
        }
        info!(tenant = %tenant.name, pool = %name, cluster = %cd_name, cdc = ?leased.as_ref().map(|c| c.name_any()), "cluster created");
        publish(
            tenant,
            pool,
            false,
            "ClusterCreated",
            match &leased {
                Some(cdc) => format!(
                    "Created ClusterDeployment {cd_name} from ClusterDeploymentCustomization {}",
                    cdc.name_any()
                ),
                None => format!("Created ClusterDeployment {cd_name}"),
            },
        )
        .await;
    }
    Ok(())
}

/// Deletes the namespaces this pool created that hold no ClusterDeployment (of anyone's) once they
/// are older than the minimum age; a namespace merely labelled like the pool's is never deleted.
async fn reap_namespaces(
    ctx: &Ctx,
    pool: &PoolIdentity,
    expected_created: &BTreeSet<String>,
    round: &mut Round,
) -> Result<(), PoolError> {
    let name = pool.name.as_str();
    let min_age = ctx.tenant.shared.settings.lease_min_age;
    let api = Api::<Namespace>::all(ctx.tenant.client.clone());
    let inhabited: BTreeSet<String> = ctx.cds.state().iter().filter_map(|cd| cd.namespace()).collect();
    for namespace in ctx.namespaces.state() {
        if !membership::created_by(&namespace, pool) || namespace.metadata.deletion_timestamp.is_some() {
            continue;
        }
        let ns_name = namespace.name_any();
        if inhabited.contains(&ns_name) || expected_created.contains(&ns_name) {
            continue;
        }
        let created = namespace
            .metadata
            .creation_timestamp
            .as_ref()
            .map(|t| t.0)
            .unwrap_or_default();
        // Creation timestamps have whole seconds: count the age from the end of that second.
        let age = Duration::try_from(Timestamp::now().duration_since(created))
            .unwrap_or_default()
            .saturating_sub(Duration::from_secs(1));
        if age < min_age {
            round.soon(min_age - age);
            continue;
        }
        // The cache of clusters can lag behind their creation (another daemon's, or ours under
        // load): a namespace is empty only if the server says so.
        if holds_a_cluster(ctx, &ns_name).await? {
            continue;
        }
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: namespace.metadata.uid.clone(),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        match api.delete(&ns_name, &params).await {
            Ok(_) => {
                info!(tenant = %ctx.tenant.name, pool = %name, namespace = %ns_name, "reaped an empty pool namespace")
            }
            Err(err) if is_not_found(&err) || is_conflict(&err) => {}
            Err(err) => return Err(err.into()),
        }
    }
    Ok(())
}

/// Whether the tenant's server lists a ClusterDeployment in `namespace`.
async fn holds_a_cluster(ctx: &Ctx, namespace: &str) -> Result<bool, PoolError> {
    let api = Api::<ClusterDeployment>::namespaced(ctx.tenant.client.clone(), namespace);
    let listed = api.list_metadata(&ListParams::default().limit(1)).await?;
    Ok(!listed.items.is_empty())
}

/// Pool deletion (§4.3.9): delete the unclaimed clusters, keep the pool until every cluster is
/// gone, and strip this pool's finalizer from every CDC that carries it.
async fn reconcile_deleted(
    pool: &ClusterPool,
    ctx: &Ctx,
    cds: &[Arc<ClusterDeployment>],
    buckets: &BTreeMap<String, Bucket>,
    cdcs: &BTreeMap<String, Arc<Cdc>>,
    finalizer: &str,
) -> Result<Action, PoolError> {
    let tenant = &ctx.tenant;
    let ns = pool.namespace().unwrap_or_default();
    let name = pool.name_any();
    if !pool.finalizers().iter().any(|f| f == POOL_FINALIZER) {
        return Ok(Action::await_change());
    }
    // Unclaimed clusters go, within maxConcurrent (installing and deleting ones count).
    let busy = buckets
        .values()
        .filter(|b| matches!(b, Bucket::Installing | Bucket::Deleting))
        .count() as i64;
    let mut room = pool.spec.max_concurrent.map_or(i64::MAX, |m| i64::from(m) - busy);
    for cd in cds {
        let bucket = buckets[&cd.name_any()];
        if !matches!(
            bucket,
            Bucket::Installing | Bucket::Ready | Bucket::Broken | Bucket::Released
        ) {
            continue;
        }
        // Deleting an installing cluster frees an installing slot as it takes a deleting one.
        if bucket != Bucket::Installing {
            if room <= 0 {
                continue;
            }
            room -= 1;
        }
        let api = Api::<ClusterDeployment>::namespaced(tenant.client.clone(), &cd.name_any());
        delete_cd(&api, cd, "pool deleted").await?;
    }
    let pools = Api::<ClusterPool>::namespaced(tenant.client.clone(), &ns);
    if !cds.is_empty() {
        let names: Vec<String> = cds.iter().map(|cd| cd.name_any()).collect();
        let mut status: ClusterPoolStatus = pool.status.clone().unwrap_or_default();
        let changed = set_condition(
            &mut status.conditions,
            DesiredCondition {
                type_: "DeletionPossible",
                status: false,
                reason: "ClusterDeploymentsPendingCleanup",
                message: format!(
                    "Waiting for these clusters to be deleted (claimed ones go when their claims are deleted): {}",
                    names.join(", ")
                ),
                observed_generation: pool.metadata.generation,
            },
            Time(Timestamp::now()),
        );
        if changed {
            pools
                .patch_status(&name, &PatchParams::default(), &Patch::Merge(json!({"status": status})))
                .await?;
        }
        return Ok(Action::requeue(RESYNC));
    }
    let cdc_api = Api::<Cdc>::namespaced(tenant.client.clone(), &ns);
    for cdc in cdcs.values() {
        if cdc.finalizers().iter().any(|f| f == finalizer) {
            let rest: Vec<String> = cdc.finalizers().iter().filter(|f| *f != finalizer).cloned().collect();
            match set_finalizers(&cdc_api, cdc, rest).await {
                Ok(_) => {}
                Err(err) if is_not_found(&err) => {}
                Err(err) if is_conflict(&err) => return Ok(Action::requeue(Duration::from_millis(200))),
                Err(err) => return Err(err.into()),
            }
        }
    }
    let rest: Vec<String> = pool
        .finalizers()
        .iter()
        .filter(|f| *f != POOL_FINALIZER)
        .cloned()
        .collect();
    match set_finalizers(&pools, pool, rest).await {
        Ok(_) => {}
        Err(err) if is_not_found(&err) => {}
        Err(err) if is_conflict(&err) => return Ok(Action::requeue(Duration::from_millis(200))),
        Err(err) => return Err(err.into()),
    }
    let labels = |state: &str| PoolLabels::new(&tenant.name, &ns, &name, state);
    for state in [
        "installing",
        "ready",
        "claimed",
        "broken",
        "stale",
        "deleting",
        "available",
        "reserved",
        "cdc_broken",
    ] {
        tenant.shared.metrics.pool_clusters.remove(&labels(state));
    }
    Ok(Action::await_change())
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
