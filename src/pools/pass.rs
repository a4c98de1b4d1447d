//! What one pass of the ClusterPool controller shares and hands from step to step: the
//! controller's context [`Ctx`] and error [`PoolError`], what the caches showed ([`Observed`]), and
//! the values the steps return — the CDC copies they wrote ([`Fresh`]), when to look again
//! ([`Wake`]) and what carrying out the plan did ([`Executed`]). It imports no other pool module,
//! so every step can depend on it without depending on another step.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Namespace;
use kube::ResourceExt;
use kube::runtime::controller::Action;
use kube::runtime::reflector::{ObjectRef, Store};

use crate::api::inventory::BareMetalAsset;
use crate::api::pools::{
    ClusterClaim, ClusterDeployment, ClusterDeploymentCustomization, ClusterPool, ClusterPoolStatus,
    FailureDomainStatus, MachineFailureDomain,
};
use crate::context::tenant::TenantContext;
use crate::runtime::controller::ReconcileError;
use crate::runtime::finalizer::FinalizerError;
use crate::runtime::panics::ReconcilePanic;
use crate::runtime::written::Written;

type Cdc = ClusterDeploymentCustomization;

/// The field manager of the pool controller's writes to pool status.
pub(super) const FIELD_MANAGER: &str = "stackd/pool";

/// A pool is looked at again at least this often (lease ages, backoffs and lifetimes also requeue).
pub(super) const RESYNC: Duration = Duration::from_secs(60);

/// How long a CD this controller created (or deleted) may be missing from (or still live in) the
/// cache before the cache is believed again.
const EXPECTATION_TTL: Duration = Duration::from_secs(60);

/// How soon a write that lost a race (409) or found its object gone is looked at again.
pub(super) const AFTER_A_LOST_RACE: Duration = Duration::from_millis(200);

#[derive(Debug, thiserror::Error)]
pub(crate) enum PoolError {
    #[error("tenant API request failed: {0}")]
    Tenant(#[from] kube::Error),
    /// Not transparent: the retry reads the finalizer error itself in the chain.
    #[error("{0}")]
    Finalizer(#[from] FinalizerError),
    #[error(transparent)]
    Panicked(#[from] ReconcilePanic),
    /// A Secret stackd would write passed its bound (a backstop: the pass refuses what it renders
    /// before anything is created).
    #[error(transparent)]
    TooLarge(crate::bounds::Refused),
}

impl ReconcileError for PoolError {
    fn metric_label(&self) -> &'static str {
        match self {
            PoolError::Tenant(_) => "tenant_api",
            PoolError::Finalizer(_) => "finalizer",
            PoolError::Panicked(_) => "panic",
            PoolError::TooLarge(_) => "too_large",
        }
    }
}

/// Creations and deletions not yet seen in the cache, per pool (Hive's "expectations").
#[derive(Default)]
struct Expectations {
    created: HashMap<String, Instant>,
    deleted: HashMap<String, Instant>,
}

/// ClusterDeployments that name a pool which did not create them, per pool (key `ns/name`), by
/// uid: each is reported once, and one whose namespace is not in the cache is not looked up again.
pub(super) type Refusals = Mutex<HashMap<String, BTreeSet<String>>>;

/// The pool controller's context: the tenant, its caches, and what this controller remembers
/// between passes.
pub(super) struct Ctx {
    pub(super) tenant: Arc<TenantContext>,
    /// Every pool of the tenant, to rank a pool among its namespace's.
    pub(super) pools: Store<ClusterPool>,
    pub(super) cds: Store<ClusterDeployment>,
    pub(super) cdcs: Store<Cdc>,
    pub(super) claims: Store<ClusterClaim>,
    pub(super) namespaces: Store<Namespace>,
    pub(super) assets: Store<BareMetalAsset>,
    expectations: Mutex<HashMap<String, Expectations>>,
    /// Failure-domain records planned for new clusters, until their status shows them.
    pub(super) records: Mutex<HashMap<String, Vec<MachineFailureDomain>>>,
    /// The last status this controller wrote per pool: until the cache shows the version it
    /// produced, the cached status is older than what we know.
    pub(super) written: Written<ClusterPoolStatus>,
    pub(super) refusals: Refusals,
    /// The parsed install-config templates, shared by the pools naming one.
    pub(super) templates: super::templates::Templates,
    /// What applying CDC patches lately cost each namespace.
    pub(super) patch_shares: super::patch_share::PatchShares,
}

/// The caches [`Ctx`] reads.
pub(super) struct Caches {
    pub(super) pools: Store<ClusterPool>,
    pub(super) cds: Store<ClusterDeployment>,
    pub(super) cdcs: Store<Cdc>,
    pub(super) claims: Store<ClusterClaim>,
    pub(super) namespaces: Store<Namespace>,
    pub(super) assets: Store<BareMetalAsset>,
}

impl Ctx {
    pub(super) fn new(tenant: Arc<TenantContext>, caches: Caches) -> Ctx {
        let limits = &tenant.shared.settings.document_limits;
        let patch_shares =
            super::patch_share::PatchShares::new(limits.render_share_per_second, limits.render_share_burst);
        Ctx {
            tenant,
            pools: caches.pools,
            cds: caches.cds,
            cdcs: caches.cdcs,
            claims: caches.claims,
            namespaces: caches.namespaces,
            assets: caches.assets,
            expectations: Mutex::default(),
            records: Mutex::default(),
            written: Written::default(),
            refusals: Mutex::default(),
            templates: super::templates::Templates::default(),
            patch_shares,
        }
    }

    /// The clusters this controller created (deleted) for `pool` that the cache does not show (or
    /// still shows live) yet; entries the cache caught up with, or older than the TTL, are dropped.
    pub(super) fn expectations_of(&self, pool: &ClusterPool) -> (BTreeSet<String>, BTreeSet<String>) {
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

    pub(super) fn expect_deleted(&self, pool: &ClusterPool, cds: &[String]) {
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

/// When the pool is looked at again: the soonest any step asked for, at most [`RESYNC`] away and
/// at least 100 ms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Wake(Duration);

impl Default for Wake {
    fn default() -> Wake {
        Wake(RESYNC)
    }
}

impl Wake {
    /// Wakes `after` from now (or sooner, if already asked for).
    pub(super) fn soon(&mut self, after: Duration) {
        self.0 = self.0.min(after.max(Duration::from_millis(100)));
    }

    /// The sooner of two wakes.
    pub(super) fn and(self, other: Wake) -> Wake {
        Wake(self.0.min(other.0))
    }

    pub(super) fn action(self) -> Action {
        Action::requeue(self.0)
    }
}

/// Copies of CDCs this pass wrote, by name: newer than the cache's, so every later step decides
/// and writes from them.
#[derive(Clone, Debug, Default)]
pub(super) struct Fresh(BTreeMap<String, Cdc>);

impl Fresh {
    pub(super) fn get(&self, name: &str) -> Option<&Cdc> {
        self.0.get(name)
    }

    /// Keeps `written` as the newest copy of its CDC.
    pub(super) fn record(&mut self, written: Cdc) {
        self.0.insert(written.name_any(), written);
    }

    /// The copy of CDC `name` to decide from: the one this pass wrote, else `cached`. The cache may
    /// lag our write; a copy another writer changed since is answered with 409 by the next status
    /// write (resourceVersions are opaque: they are never ordered here).
    pub(super) fn newest(&self, name: &str, cached: Option<&Arc<Cdc>>) -> Option<Arc<Cdc>> {
        self.get(name).map(|c| Arc::new(c.clone())).or_else(|| cached.cloned())
    }

    /// `cdcs` with the copies this pass wrote in place of theirs.
    pub(super) fn over(&self, cdcs: &BTreeMap<String, Arc<Cdc>>) -> BTreeMap<String, Arc<Cdc>> {
        let mut now = cdcs.clone();
        for (name, cdc) in &self.0 {
            now.insert(name.clone(), Arc::new(cdc.clone()));
        }
        now
    }
}

/// What the caches show of one pool, corrected by this controller's own writes they do not show
/// yet.
#[derive(Default)]
pub(super) struct Observed {
    /// The pool's status as last known: the cached one, unless this controller wrote one the cache
    /// does not show yet (so counters such as `attempts` are never lost to a stale cache).
    pub(super) previous: ClusterPoolStatus,
    pub(super) expected_created: BTreeSet<String>,
    pub(super) expected_deleted: BTreeSet<String>,
    /// Clusters this pool created (§8): a reference alone is never trusted.
    pub(super) cds: Vec<Arc<ClusterDeployment>>,
    /// Every cluster in a namespace this pool created, member or not.
    pub(super) live: BTreeSet<String>,
    pub(super) claims: BTreeMap<String, Arc<ClusterClaim>>,
    /// The pool's inventory entries, each once, in spec order.
    pub(super) inventory: Vec<String>,
    /// The CDCs of the pool's namespace.
    pub(super) cdcs: BTreeMap<String, Arc<Cdc>>,
    /// The names of the pools of the pool's namespace.
    pub(super) pools: BTreeSet<String>,
    /// The BareMetalAssets the pool selects (none unless it is a baremetal pool).
    pub(super) assets: Vec<Arc<BareMetalAsset>>,
    /// The pool's failure domains.
    pub(super) domains: BTreeMap<String, FailureDomainStatus>,
    /// Why the pool's failure domains contradict themselves (§6 merge rules): no cluster is added.
    pub(super) contradiction: Option<String>,
}

/// What carrying out the plan did, for the steps after it and the status.
#[derive(Debug, Default)]
pub(super) struct Executed {
    /// Clusters deleted.
    pub(super) deleted: Vec<String>,
    /// Entries leased, with the generation applied.
    pub(super) leased: BTreeMap<String, i64>,
    /// Entries whose patches do not apply, with the error.
    pub(super) syntax_errors: BTreeMap<String, String>,
    /// Secrets (or their contents) the pool needs and lacks.
    pub(super) missing_dependencies: Vec<String>,
    /// Assets assigned (the cache may not show them yet).
    pub(super) hosts_taken: BTreeSet<String>,
    /// Why a new cluster could not get its bare-metal hosts, found while assigning them.
    pub(super) insufficient_hosts: Option<String>,
    /// A document the pass would build passed a bound of [`crate::bounds`] (which, and how to fix
    /// it): nothing was built.
    pub(super) too_large: Option<String>,
    /// Why a new cluster's machines cannot be placed, found while placing them: no cluster is added.
    pub(super) contradiction: Option<String>,
    /// The namespace used its share of the work of rendering: no entry is tried until it is back.
    pub(super) patch_share_used: Option<String>,
    /// The CDC copies written so far in the pass, these steps' included.
    pub(super) fresh: Fresh,
    pub(super) wake: Wake,
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn cdc(name: &str, version: &str) -> Cdc {
        serde_json::from_value(json!({
            "apiVersion": "pools.stackd.dev/v1alpha1", "kind": "ClusterDeploymentCustomization",
            "metadata": {"name": name, "namespace": "team", "resourceVersion": version},
            "spec": {"installConfigPatches": []},
        }))
        .unwrap()
    }

    #[test]
    fn a_pass_wakes_at_the_soonest_time_asked_for_within_bounds() {
        assert_eq!(Wake::default(), Wake(RESYNC));
        let mut wake = Wake::default();
        wake.soon(Duration::from_secs(3600));
        assert_eq!(wake, Wake(RESYNC), "never later than the resync");
        wake.soon(Duration::from_secs(5));
        wake.soon(Duration::from_secs(9));
        assert_eq!(wake, Wake(Duration::from_secs(5)));
        let mut now = Wake::default();
        now.soon(Duration::ZERO);
        assert_eq!(now, Wake(Duration::from_millis(100)), "never a busy loop");
        assert_eq!(wake.and(now), now);
        assert_eq!(Wake::default().and(wake), wake);
    }

    #[test]
    fn the_copy_a_pass_wrote_is_newer_than_the_cached_one() {
        let cached: BTreeMap<String, Arc<Cdc>> = [
            ("a".to_string(), Arc::new(cdc("a", "1"))),
            ("b".to_string(), Arc::new(cdc("b", "1"))),
        ]
        .into();
        let mut fresh = Fresh::default();
        fresh.record(cdc("a", "2"));
        fresh.record(cdc("c", "5"));
        let version = |c: Option<Arc<Cdc>>| c.and_then(|c| c.metadata.resource_version.clone());
        assert_eq!(version(fresh.newest("a", cached.get("a"))).as_deref(), Some("2"));
        assert_eq!(version(fresh.newest("b", cached.get("b"))).as_deref(), Some("1"));
        assert_eq!(fresh.newest("d", None), None);
        let now = fresh.over(&cached);
        let versions: Vec<(&str, Option<&str>)> = now
            .iter()
            .map(|(n, c)| (n.as_str(), c.metadata.resource_version.as_deref()))
            .collect();
        assert_eq!(versions, vec![("a", Some("2")), ("b", Some("1")), ("c", Some("5"))]);
    }
}
