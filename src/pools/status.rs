//! What a pool reports (DESIGN.md §4.1 status, §4.3): its counts, the per-entry inventory status
//! of the status-revision seed and its conditions, built without any request from what the
//! reconcile found and did (the per-pool metrics are set in [`super::metrics`]).

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;

use super::CDC_GENERATION_ANNOTATION;
use super::buckets::{Bucket, Buckets, Stale, cdc_of};
use super::judgement::{self, Holder, Judgement};
use super::lease_state::{self, SUCCEEDED};
use super::pass::{Executed, Observed};
use super::patch_share::NAMESPACE_PATCH_SHARE_USED;
use super::plan::Plan;
use crate::api::pools::{
    ClusterDeployment, ClusterDeploymentCustomization, ClusterPool, ClusterPoolStatus, FailureDomainStatus,
    InventoryEntryState, InventoryEntryStatus,
};
use crate::bounds::DOCUMENT_TOO_LARGE;
use crate::context::namespace_template::is_dns_label;
use crate::runtime::conditions::{DesiredCondition, set_condition};

type Cdc = ClusterDeploymentCustomization;

/// What the status is built from: what the pass observed, planned and did.
pub(super) struct Report<'a> {
    pub(super) pool: &'a ClusterPool,
    /// What the caches showed; its `previous` status is what the new one starts from.
    pub(super) observed: &'a Observed,
    /// The pool's CDCs as they are now: after the lease repair, with the copies the pass wrote.
    pub(super) cdcs: &'a BTreeMap<String, Arc<Cdc>>,
    pub(super) buckets: &'a Buckets,
    pub(super) plan: &'a Plan,
    pub(super) executed: &'a Executed,
}

impl Report<'_> {
    /// Why the failure domains contradict themselves: as found while placing a new cluster's
    /// machines, else as observed.
    fn contradiction(&self) -> Option<&String> {
        self.executed
            .contradiction
            .as_ref()
            .or(self.observed.contradiction.as_ref())
    }

    /// Why a cluster cannot get its hosts: as found while assigning them, else as planned.
    fn insufficient_hosts(&self) -> Option<&String> {
        self.executed
            .insufficient_hosts
            .as_ref()
            .or(self.plan.insufficient_hosts.as_ref())
    }
}

/// The pool's status after this pass; conditions that change get `now` as their transition time.
pub(super) fn build(report: &Report, now: Time) -> ClusterPoolStatus {
    let (pool, observed) = (report.pool, report.observed);
    let unclaimed: Vec<Bucket> = observed
        .cds
        .iter()
        .filter(|cd| !report.executed.deleted.contains(&cd.name_any()))
        .map(|cd| report.buckets.of(cd))
        .filter(|b| matches!(b, Bucket::Installing | Bucket::Ready | Bucket::Broken))
        .collect();
    let count = |bucket: Bucket| unclaimed.iter().filter(|b| **b == bucket).count() as i32;
    let pool_name = pool.name_any();
    let judged: Vec<Judged> = observed
        .inventory
        .iter()
        .map(|entry| {
            let cdc = report.cdcs.get(entry).map(|c| &**c);
            (entry.clone(), judgement::of(cdc, &pool_name))
        })
        .collect();
    let cd_by_name: BTreeMap<String, Arc<ClusterDeployment>> =
        observed.cds.iter().map(|cd| (cd.name_any(), cd.clone())).collect();
    let mut status = observed.previous.clone();
    status.size = unclaimed.len() as i32;
    status.ready = count(Bucket::Ready);
    status.standby = count(Bucket::Installing);
    status.platform = pool.spec.platform.name().map(String::from);
    status.observed_generation = pool.metadata.generation;
    status.failure_domains = observed.domains.clone();
    status.inventory = entry_statuses(
        &observed.previous,
        &judged,
        report.cdcs,
        &cd_by_name,
        &report.executed.leased,
        report.plan,
    );
    let wanted = conditions(report, &judged);
    // A condition the pool no longer computes goes, so none outlives what it was about (an
    // `InventoryValid` after the inventory was removed, say).
    status
        .conditions
        .retain(|c| !POOL_CONDITIONS.contains(&c.type_.as_str()) || wanted.iter().any(|w| w.type_ == c.type_));
    for condition in wanted {
        set_condition(
            &mut status.conditions,
            DesiredCondition {
                observed_generation: pool.metadata.generation,
                ..condition
            },
            now.clone(),
        );
    }
    status
}

/// The conditions the pool controller computes; any other type on a pool is left alone.
const POOL_CONDITIONS: &[&str] = &[
    "MissingDependencies",
    "InventoryValid",
    "CapacityAvailable",
    "FailureDomainsUnsupported",
    FAILURE_DOMAINS_VALID,
    "AllClustersCurrent",
    "DeletionPossible",
];

/// The condition saying whether the pool's failure domains contradict themselves (§6).
pub(super) const FAILURE_DOMAINS_VALID: &str = "FailureDomainsValid";
/// Its reason when they do, the reason a cluster built from them would be stopped with.
pub(super) const INVALID_MACHINE_SPEC: &str = "InvalidMachineSpec";

/// An inventory entry, each once in spec order, and what the pool makes of it.
type Judged = (String, Judgement);

/// The pool's conditions, in the order they are listed when new.
fn conditions(report: &Report, judged: &[Judged]) -> Vec<DesiredCondition<'static>> {
    let (pool, executed, domains) = (report.pool, report.executed, &report.observed.domains);
    let mut conditions = vec![missing_dependencies(
        &executed.missing_dependencies,
        &pool.namespace().unwrap_or_default(),
    )];
    if pool.spec.inventory.is_some() {
        let listed = report.observed.inventory.len();
        conditions.push(inventory_valid(judged, &executed.syntax_errors, listed));
    }
    conditions.push(capacity_available(report));
    if pool.spec.platform.vsphere.is_some() {
        conditions.push(failure_domains_unsupported(domains));
    }
    if pool.spec.platform.openstack.is_some() && (!domains.is_empty() || report.contradiction().is_some()) {
        conditions.push(failure_domains_valid(report.contradiction()));
    }
    conditions.push(all_clusters_current(&report.plan.stale));
    conditions.push(condition(
        "DeletionPossible",
        true,
        "DeletionPossible",
        "Deleting the pool deletes its unclaimed clusters".into(),
    ));
    conditions
}

fn condition(type_: &'static str, status: bool, reason: &'static str, message: String) -> DesiredCondition<'static> {
    DesiredCondition {
        type_,
        status,
        reason,
        message,
        observed_generation: None,
    }
}

fn missing_dependencies(missing: &[String], ns: &str) -> DesiredCondition<'static> {
    if missing.is_empty() {
        return condition(
            "MissingDependencies",
            false,
            "DependenciesFound",
            "Every Secret the pool refers to exists".into(),
        );
    }
    condition(
        "MissingDependencies",
        true,
        "MissingDependencies",
        format!("Create the missing Secrets in namespace {ns}: {}", missing.join(", ")),
    )
}

/// §4.3.4: every entry the pool cannot use now, by state, with the patch error of BrokenBySyntax
/// ones and who holds Unavailable ones (the merged seed: an unavailable entry makes the inventory
/// invalid), and what to do about each state.
fn inventory_valid(
    judged: &[Judged],
    syntax_errors: &BTreeMap<String, String>,
    listed: usize,
) -> DesiredCondition<'static> {
    let mut problems: BTreeMap<&str, (Vec<String>, &str)> = BTreeMap::new();
    for (entry, judgement) in judged {
        let Some((state, hint)) = trouble(judgement) else {
            continue;
        };
        let detail = match judgement {
            Judgement::BrokenBySyntax => syntax_errors.get(entry).cloned(),
            Judgement::Unavailable(holder) => Some(held_by(holder)),
            _ => None,
        };
        let named = detail.map_or_else(|| entry.clone(), |d| format!("{entry} ({d})"));
        problems
            .entry(state)
            .or_insert_with(|| (Vec::new(), hint))
            .0
            .push(named);
    }
    if problems.is_empty() {
        return condition(
            "InventoryValid",
            true,
            "Valid",
            format!("All {listed} inventory entries are usable"),
        );
    }
    let listing: Vec<String> = problems
        .iter()
        .map(|(k, (v, _))| format!("{k}: {}", v.join(", ")))
        .collect();
    let hints: Vec<&str> = problems.values().map(|(_, hint)| *hint).collect();
    condition(
        "InventoryValid",
        false,
        "Invalid",
        format!(
            "Some inventory entries cannot be used now ({}); {}",
            listing.join("; "),
            hints.join("; ")
        ),
    )
}

/// How `InventoryValid` names an entry the pool cannot use now, and what to do about it; `None`
/// for one it uses. A BrokenByCloud entry is named (as Hive names it) though it still backs a
/// cluster: it is tried again last.
fn trouble(judgement: &Judgement) -> Option<(&'static str, &'static str)> {
    Some(match judgement {
        Judgement::Reserved { .. } | Judgement::Free => return None,
        Judgement::BrokenByCloud => (
            "BrokenByCloud",
            "BrokenByCloud ones are tried again, last, after a backoff",
        ),
        Judgement::BrokenBySyntax => (
            "BrokenBySyntax",
            "fix the patches of BrokenBySyntax ones or remove them from spec.inventory",
        ),
        Judgement::Deleting => (
            "Deleting",
            "Deleting ones are being deleted and will not be used: remove them from spec.inventory",
        ),
        Judgement::Missing => ("Missing", "create Missing ones or remove them from spec.inventory"),
        Judgement::Unavailable(_) => (
            "Unavailable",
            "Unavailable ones are leased by another pool or hold an interrupted lease",
        ),
    })
}

/// Who keeps an Unavailable entry from this pool.
fn held_by(holder: &Holder) -> String {
    match holder {
        Holder::InterruptedLease => {
            "an interrupted lease: Available=False with no clusterDeploymentRef; released after --lease-min-age".into()
        }
        // The name is read from the CDC's status, anyone's to write: shown only when it can be a name.
        Holder::Pool(Some(pool)) if is_dns_label(pool) => format!("leased by ClusterPool {pool}"),
        Holder::Pool(_) => "leased by another pool".into(),
    }
}

/// §6: whether the failure domains contradict themselves, naming the contradiction.
/// The reason of a pool's `CapacityAvailable=False` when its namespace has all the clusters it may.
pub(super) const NAMESPACE_MAX_CLUSTERS: &str = "NamespaceMaxClusters";

fn failure_domains_valid(contradiction: Option<&String>) -> DesiredCondition<'static> {
    match contradiction {
        Some(message) => condition(
            FAILURE_DOMAINS_VALID,
            false,
            INVALID_MACHINE_SPEC,
            format!("The pool creates no clusters while its failure domains contradict themselves: {message}"),
        ),
        None => condition(
            FAILURE_DOMAINS_VALID,
            true,
            "Valid",
            "The failure domains and the control plane's root volume agree".into(),
        ),
    }
}

/// §4.3.5: at maxSize, short of hosts, or short of inventory, in that order.
fn capacity_available(report: &Report) -> DesiredCondition<'static> {
    let (pool, capacity) = (report.pool, &report.plan.capacity);
    if report.contradiction().is_some() {
        return condition(
            "CapacityAvailable",
            false,
            INVALID_MACHINE_SPEC,
            format!(
                "The pool creates no clusters while its failure domains contradict themselves; see {FAILURE_DOMAINS_VALID}"
            ),
        );
    }
    if let Some(message) = &report.executed.too_large {
        return condition("CapacityAvailable", false, DOCUMENT_TOO_LARGE, message.clone());
    }
    if let Some(message) = &report.executed.patch_share_used {
        return condition("CapacityAvailable", false, NAMESPACE_PATCH_SHARE_USED, message.clone());
    }
    if let Some(max) = pool.spec.max_size.filter(|m| capacity.live >= i64::from(*m)) {
        return condition(
            "CapacityAvailable",
            false,
            "MaxCapacity",
            format!("The pool is at its maxSize of {max} clusters, claimed and unclaimed"),
        );
    }
    if let Some(message) = report.insufficient_hosts() {
        return condition("CapacityAvailable", false, "InsufficientHosts", message.clone());
    }
    if capacity.drift < 0 && capacity.namespace_room <= 0 {
        let namespace = pool.namespace().unwrap_or_default();
        return condition(
            "CapacityAvailable",
            false,
            NAMESPACE_MAX_CLUSTERS,
            format!(
                "The pools of namespace {namespace} have as many clusters as one namespace may (--namespace-max-clusters): this pool makes no more until some are claimed and deleted or other pools of the namespace shrink; the tenant's other namespaces are served as before"
            ),
        );
    }
    if pool.spec.inventory.is_some() && capacity.wanted > capacity.backed {
        return condition(
            "CapacityAvailable",
            false,
            "InventoryExhausted",
            format!(
                "The pool needs {} unclaimed clusters (size plus pending claims) but its inventory can back only {}; add ClusterDeploymentCustomizations to spec.inventory or lower spec.size",
                capacity.wanted, capacity.backed
            ),
        );
    }
    condition(
        "CapacityAvailable",
        true,
        "Available",
        "The pool can add clusters".into(),
    )
}

fn failure_domains_unsupported(domains: &BTreeMap<String, FailureDomainStatus>) -> DesiredCondition<'static> {
    if domains.is_empty() {
        return condition(
            "FailureDomainsUnsupported",
            false,
            "NoFailureDomains",
            "The pool defines no failure domains".into(),
        );
    }
    condition(
        "FailureDomainsUnsupported",
        true,
        "FailureDomainsUnsupported",
        "Failure domains are not supported on vSphere and are ignored; remove spec.failureDomains and spec.availabilityZones".into(),
    )
}

/// §4.3.8: every kind of staleness counts.
fn all_clusters_current(stale: &[(Arc<ClusterDeployment>, Stale)]) -> DesiredCondition<'static> {
    if stale.is_empty() {
        return condition(
            "AllClustersCurrent",
            true,
            "ClusterDeploymentsCurrent",
            "Every unclaimed cluster is current".into(),
        );
    }
    let names: Vec<String> = stale.iter().map(|(cd, _)| cd.name_any()).collect();
    condition(
        "AllClustersCurrent",
        false,
        "SomeClusterDeploymentsStale",
        format!(
            "{} unclaimed clusters were built from an older pool or inventory configuration and are replaced one at a time: {}",
            names.len(),
            names.join(", ")
        ),
    )
}

/// The status of a deleted pool still waiting for `clusters`, when it says something new (§4.3.9).
pub(super) fn deletion_pending(pool: &ClusterPool, clusters: &[String], now: Time) -> Option<ClusterPoolStatus> {
    let mut status = pool.status.clone().unwrap_or_default();
    let changed = set_condition(
        &mut status.conditions,
        DesiredCondition {
            type_: "DeletionPossible",
            status: false,
            reason: "ClusterDeploymentsPendingCleanup",
            message: format!(
                "Waiting for these clusters to be deleted (claimed ones go when their claims are deleted): {}",
                clusters.join(", ")
            ),
            observed_generation: pool.metadata.generation,
        },
        now,
    );
    changed.then_some(status)
}

/// The per-entry inventory status of the status-revision seed.
pub(super) fn entry_statuses(
    base: &ClusterPoolStatus,
    judged: &[Judged],
    cdcs: &BTreeMap<String, Arc<Cdc>>,
    cds: &BTreeMap<String, Arc<ClusterDeployment>>,
    leased: &BTreeMap<String, i64>,
    plan: &Plan,
) -> Vec<InventoryEntryStatus> {
    let stale = &plan.stale;
    let old: BTreeMap<String, InventoryEntryStatus> =
        base.inventory.iter().map(|e| (e.name.clone(), e.clone())).collect();
    let built_from = |entry: &str| -> Option<&Arc<ClusterDeployment>> {
        cds.values().find(|cd| cdc_of(cd).as_deref() == Some(entry))
    };
    let mut out = Vec::new();
    for (entry, judgement) in judged {
        let previous = old.get(entry).cloned().unwrap_or_default();
        // The generation a live cluster was built from is the durable record of what was applied.
        let built = built_from(entry)
            .and_then(|cd| cd.annotations().get(CDC_GENERATION_ANNOTATION).cloned())
            .and_then(|g| g.parse::<i64>().ok());
        let mut status = InventoryEntryStatus {
            name: entry.clone(),
            version: leased.get(entry).copied().or(built).or(previous.version),
            status: judgement.state(),
            attempts: previous.attempts + i32::from(plan.broken_entries.contains(entry)),
            ..Default::default()
        };
        if let Some(cdc) = cdcs.get(entry) {
            let stale_edit = stale
                .iter()
                .any(|(s, why)| *why == Stale::EntryEdited && cdc_of(s).as_deref() == Some(entry.as_str()));
            track_generation(&mut status, cdc, judgement, stale_edit);
        }
        out.push(status);
    }
    // Entries removed from the inventory stay listed while a cluster built from them exists.
    for (entry, previous) in old {
        if judged.iter().any(|(listed, _)| *listed == entry) {
            continue;
        }
        if let Some(cd) = built_from(&entry) {
            out.push(InventoryEntryStatus {
                name: entry,
                status: InventoryEntryState::ToBeDeleted,
                cluster_deployment: Some(cd.name_any()),
                ..previous
            });
        }
    }
    out
}

/// What an entry whose CDC exists records of its generations: a success restarts its attempts; a
/// Reserved entry names its cluster and is ToBeUpdated once its CDC was edited since (or an
/// unclaimed cluster built from an older generation of it is stale, `stale_edit`); an entry
/// nobody holds that was edited starts over.
fn track_generation(status: &mut InventoryEntryStatus, cdc: &Cdc, judgement: &Judgement, stale_edit: bool) {
    if lease_state::apply_reason(cdc) == Some(SUCCEEDED) {
        status.attempts = 0;
    }
    let edited = status.version.is_some() && status.version != cdc.metadata.generation;
    match judgement {
        Judgement::Reserved { cluster } => {
            status.cluster_deployment = Some(cluster.clone());
            if edited || stale_edit {
                status.status = InventoryEntryState::ToBeUpdated;
            }
        }
        // The status-revision seed's "Updating Inventory Resource": an entry nobody holds that
        // was edited starts over: its failures no longer count, and its version is the new
        // generation.
        Judgement::Deleting | Judgement::BrokenBySyntax | Judgement::BrokenByCloud | Judgement::Free if edited => {
            status.attempts = 0;
            status.version = cdc.metadata.generation;
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use jiff::Timestamp;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
    use serde_json::{Value, json};

    use super::*;
    use crate::pools::buckets::fixtures::{Cd, cdc, claim, leased, pool, verdict};
    use crate::pools::plan::Capacity;

    const OLD: &str = "2024-01-01T00:00:00Z";

    fn entries(names: &[&str]) -> Value {
        json!(names.iter().map(|n| json!({"name": n})).collect::<Vec<_>>())
    }

    fn empty_plan() -> Plan {
        Plan {
            deletes: Vec::new(),
            add: None,
            broken_entries: BTreeSet::new(),
            stale: Vec::new(),
            capacity: Capacity::default(),
            insufficient_hosts: None,
            wake: None,
        }
    }

    struct Scene {
        pool: ClusterPool,
        previous: ClusterPoolStatus,
        cds: Vec<Arc<ClusterDeployment>>,
        claims: BTreeMap<String, Arc<crate::api::pools::ClusterClaim>>,
        deleted: Vec<String>,
        domains: BTreeMap<String, FailureDomainStatus>,
        cdcs: BTreeMap<String, Arc<Cdc>>,
        /// Why the failure domains contradict themselves, as observed.
        contradiction: Option<String>,
        executed: Executed,
        plan: Plan,
    }

    impl Scene {
        fn new(spec: Value) -> Scene {
            Scene {
                pool: pool("p", spec),
                previous: ClusterPoolStatus::default(),
                cds: Vec::new(),
                claims: BTreeMap::new(),
                deleted: Vec::new(),
                domains: BTreeMap::new(),
                cdcs: BTreeMap::new(),
                contradiction: None,
                executed: Executed::default(),
                plan: empty_plan(),
            }
        }

        fn build(&self) -> ClusterPoolStatus {
            let inventory: Vec<String> = self
                .pool
                .spec
                .inventory
                .iter()
                .flatten()
                .map(|e| e.name.clone())
                .collect();
            let observed = Observed {
                previous: self.previous.clone(),
                cds: self.cds.clone(),
                claims: self.claims.clone(),
                inventory,
                cdcs: self.cdcs.clone(),
                domains: self.domains.clone(),
                contradiction: self.contradiction.clone(),
                ..Observed::default()
            };
            let buckets = Buckets::sort(&self.cds, &self.claims, &BTreeSet::new());
            let executed = Executed {
                deleted: self.deleted.clone(),
                leased: self.executed.leased.clone(),
                syntax_errors: self.executed.syntax_errors.clone(),
                missing_dependencies: self.executed.missing_dependencies.clone(),
                insufficient_hosts: self.executed.insufficient_hosts.clone(),
                contradiction: self.executed.contradiction.clone(),
                ..Executed::default()
            };
            let report = Report {
                pool: &self.pool,
                observed: &observed,
                cdcs: &self.executed.fresh.over(&self.cdcs),
                buckets: &buckets,
                plan: &self.plan,
                executed: &executed,
            };
            build(&report, Time(Timestamp::UNIX_EPOCH))
        }
    }

    fn condition(status: &ClusterPoolStatus, type_: &str) -> (String, String, String) {
        let c = status
            .conditions
            .iter()
            .find(|c| c.type_ == type_)
            .unwrap_or_else(|| panic!("no condition {type_}"));
        (c.status.clone(), c.reason.clone(), c.message.clone())
    }

    fn entry(status: &ClusterPoolStatus, name: &str) -> InventoryEntryStatus {
        status
            .inventory
            .iter()
            .find(|e| e.name == name)
            .cloned()
            .unwrap_or_else(|| panic!("no entry {name}"))
    }

    #[test]
    fn ready_and_installing_unclaimed_clusters_are_counted_apart() {
        let mut scene = Scene::new(json!({"size": 4}));
        scene.cds = vec![
            Cd::new("p-ready", OLD).installed().build(),
            Cd::new("p-installing", OLD).build(),
            Cd::new("p-broken", OLD).stopped("InstallAttemptsLimitReached").build(),
            Cd::new("p-claimed", OLD).installed().claimed_by("c").build(),
            Cd::new("p-excess", OLD).installed().build(),
        ];
        scene.claims.insert("c".into(), claim("c", OLD));
        scene.deleted = vec!["p-excess".into()];
        let status = scene.build();
        assert_eq!((status.size, status.ready, status.standby), (3, 1, 1));
        assert_eq!(status.platform.as_deref(), Some("openstack"));
        assert_eq!(status.observed_generation, Some(1));
    }

    #[test]
    fn the_conditions_of_a_healthy_pool_say_so_in_a_stable_order() {
        let status = Scene::new(json!({"size": 1})).build();
        let types: Vec<&str> = status.conditions.iter().map(|c| c.type_.as_str()).collect();
        assert_eq!(
            types,
            [
                "MissingDependencies",
                "CapacityAvailable",
                "AllClustersCurrent",
                "DeletionPossible"
            ]
        );
        assert!(status.conditions.iter().all(|c| c.observed_generation == Some(1)));
        assert_eq!(condition(&status, "CapacityAvailable").1, "Available");
        assert_eq!(condition(&status, "MissingDependencies").0, "False");
    }

    #[test]
    fn missing_secrets_are_named_with_their_namespace() {
        let mut scene = Scene::new(json!({"size": 1}));
        scene.executed.missing_dependencies = vec!["pull Secret pull".into()];
        assert_eq!(
            condition(&scene.build(), "MissingDependencies"),
            (
                "True".into(),
                "MissingDependencies".into(),
                "Create the missing Secrets in namespace team: pull Secret pull".into()
            )
        );
    }

    #[test]
    fn capacity_says_max_size_first_then_missing_hosts_then_exhausted_inventory() {
        let mut scene = Scene::new(json!({"size": 3, "maxSize": 2, "inventory": entries(&["a"])}));
        scene.plan.capacity = Capacity {
            wanted: 3,
            backed: 1,
            live: 2,
            ..Capacity::default()
        };
        scene.executed.insufficient_hosts = Some("not enough hosts".into());
        let reason = |scene: &Scene| condition(&scene.build(), "CapacityAvailable");
        assert_eq!(
            reason(&scene),
            (
                "False".into(),
                "MaxCapacity".into(),
                "The pool is at its maxSize of 2 clusters, claimed and unclaimed".into()
            )
        );
        scene.plan.capacity.live = 1;
        assert_eq!(reason(&scene).1, "InsufficientHosts");
        assert_eq!(reason(&scene).2, "not enough hosts");
        scene.executed.insufficient_hosts = None;
        assert_eq!(
            reason(&scene).2,
            "The pool needs 3 unclaimed clusters (size plus pending claims) but its inventory can back only 1; add ClusterDeploymentCustomizations to spec.inventory or lower spec.size"
        );
        scene.plan.capacity.backed = 3;
        assert_eq!(reason(&scene).1, "Available");
    }

    #[test]
    fn every_stale_cluster_is_named_and_none_makes_all_current() {
        let mut scene = Scene::new(json!({"size": 2}));
        scene.plan.stale = vec![
            (Cd::new("p-a", OLD).build(), Stale::PoolVersion),
            (Cd::new("p-b", OLD).build(), Stale::EntryRemoved),
        ];
        assert_eq!(
            condition(&scene.build(), "AllClustersCurrent"),
            (
                "False".into(),
                "SomeClusterDeploymentsStale".into(),
                "2 unclaimed clusters were built from an older pool or inventory configuration and are replaced one at a time: p-a, p-b".into()
            )
        );
    }

    #[test]
    fn entries_say_available_reserved_unavailable_missing_and_broken() {
        let mut scene = Scene::new(
            json!({"size": 2, "inventory": entries(&["free", "ours", "theirs", "missing", "syntax", "cloud"])}),
        );
        for (name, status) in [
            ("free", json!({})),
            ("ours", leased("p", "p-1")),
            ("theirs", leased("q", "q-1")),
            ("syntax", verdict("BrokenBySyntax", OLD, 1)),
            ("cloud", verdict("BrokenByCloud", OLD, 1)),
        ] {
            scene.cdcs.insert(name.into(), cdc(name, 1, status));
        }
        scene
            .executed
            .syntax_errors
            .insert("syntax".into(), "bad path /x".into());
        let status = scene.build();
        let states: Vec<(String, InventoryEntryState)> =
            status.inventory.iter().map(|e| (e.name.clone(), e.status)).collect();
        use InventoryEntryState::*;
        assert_eq!(
            states,
            [
                ("free".to_string(), Available),
                ("ours".to_string(), Reserved),
                ("theirs".to_string(), Unavailable),
                ("missing".to_string(), Missing),
                ("syntax".to_string(), BrokenBySyntax),
                ("cloud".to_string(), BrokenByCloud),
            ]
        );
        assert_eq!(entry(&status, "ours").cluster_deployment.as_deref(), Some("p-1"));
        assert_eq!(
            condition(&status, "InventoryValid"),
            (
                "False".into(),
                "Invalid".into(),
                "Some inventory entries cannot be used now (BrokenByCloud: cloud; BrokenBySyntax: syntax (bad path /x); Missing: missing; Unavailable: theirs (leased by ClusterPool q)); BrokenByCloud ones are tried again, last, after a backoff; fix the patches of BrokenBySyntax ones or remove them from spec.inventory; create Missing ones or remove them from spec.inventory; Unavailable ones are leased by another pool or hold an interrupted lease".into()
            )
        );
    }

    /// Hive's case of a CDC deleted while a finalizer holds it (issue 48): the plan never leases
    /// it, so neither its entry nor `InventoryValid` may call it usable.
    #[test]
    fn a_cdc_being_deleted_is_deleting_and_the_inventory_says_it_will_not_be_used() {
        let mut scene = Scene::new(json!({"size": 1, "inventory": entries(&["going", "held"])}));
        let deleting = |status: Value| {
            let mut cdc = Cdc::clone(&cdc("going", 1, status));
            cdc.metadata.deletion_timestamp = Some(Time(Timestamp::UNIX_EPOCH));
            cdc.metadata.finalizers = Some(vec!["example.com/keep".into()]);
            Arc::new(cdc)
        };
        scene.cdcs.insert("going".into(), deleting(json!({})));
        // One this pool holds stays its cluster's until it is released.
        let mut held = Cdc::clone(&deleting(leased("p", "p-1")));
        held.metadata.name = Some("held".into());
        scene.cdcs.insert("held".into(), Arc::new(held));
        let status = scene.build();
        assert_eq!(entry(&status, "going").status, InventoryEntryState::Deleting);
        assert_eq!(entry(&status, "held").status, InventoryEntryState::Reserved);
        assert_eq!(
            condition(&status, "InventoryValid"),
            (
                "False".into(),
                "Invalid".into(),
                "Some inventory entries cannot be used now (Deleting: going); Deleting ones are being deleted and will not be used: remove them from spec.inventory".into()
            )
        );
    }

    #[test]
    fn a_holder_name_that_cannot_be_a_pool_name_is_not_echoed() {
        let long = "x".repeat(300);
        assert_eq!(held_by(&Holder::Pool(Some(long))), "leased by another pool");
        assert_eq!(held_by(&Holder::Pool(Some("q".into()))), "leased by ClusterPool q");
    }

    /// `Available=False` without a `clusterDeploymentRef`, naming pool `p`.
    fn interrupted() -> Value {
        let mut status = leased("p", "");
        status.as_object_mut().expect("a status").remove("clusterDeploymentRef");
        status
    }

    #[test]
    fn an_interrupted_lease_is_unavailable_for_no_cluster_and_the_inventory_says_it() {
        let mut scene = Scene::new(json!({"size": 1, "inventory": entries(&["cut"])}));
        scene.cdcs.insert("cut".into(), cdc("cut", 1, interrupted()));
        let status = scene.build();
        let cut = entry(&status, "cut");
        assert_eq!(
            cut.status,
            InventoryEntryState::Unavailable,
            "never Reserved with no cluster"
        );
        assert_eq!(cut.cluster_deployment, None);
        let (valid, _, message) = condition(&status, "InventoryValid");
        assert_eq!(valid, "False");
        assert!(
            message.contains(
                "Unavailable: cut (an interrupted lease: Available=False with no clusterDeploymentRef; released after --lease-min-age)"
            ),
            "{message}"
        );
    }

    #[test]
    fn inventory_conditions_follow_the_current_spec() {
        let mut scene = Scene::new(json!({"size": 3, "inventory": entries(&["a", "b", "c"])}));
        for name in ["a", "b", "c"] {
            scene.cdcs.insert(name.into(), cdc(name, 1, json!({})));
        }
        scene.plan.capacity = Capacity {
            wanted: 3,
            backed: 3,
            ..Capacity::default()
        };
        let with = scene.build();
        assert_eq!(
            condition(&with, "InventoryValid"),
            (
                "True".into(),
                "Valid".into(),
                "All 3 inventory entries are usable".into()
            )
        );
        // The inventory is removed: its condition goes; capacity is judged without it.
        scene.previous = with;
        scene.pool = pool("p", json!({"size": 3}));
        scene.plan.capacity.backed = 0;
        let without = scene.build();
        assert!(
            without.conditions.iter().all(|c| c.type_ != "InventoryValid"),
            "{:?}",
            without.conditions
        );
        assert_eq!(condition(&without, "CapacityAvailable").1, "Available");
        assert!(without.inventory.is_empty(), "no cluster was built from the entries");
        // Conditions the pool controller does not compute are left alone.
        let mut foreign = scene.previous.clone();
        foreign.conditions.push(Condition {
            type_: "SomeoneElses".into(),
            status: "True".into(),
            reason: "X".into(),
            message: String::new(),
            observed_generation: None,
            last_transition_time: Time(Timestamp::UNIX_EPOCH),
        });
        scene.previous = foreign;
        assert!(scene.build().conditions.iter().any(|c| c.type_ == "SomeoneElses"));
    }

    #[test]
    fn an_unreserved_entry_edited_starts_over_at_its_new_generation() {
        let mut scene = Scene::new(json!({"size": 0, "inventory": entries(&["a"])}));
        scene.previous.inventory = vec![InventoryEntryStatus {
            name: "a".into(),
            version: Some(1),
            status: InventoryEntryState::BrokenByCloud,
            attempts: 2,
            ..Default::default()
        }];
        scene
            .cdcs
            .insert("a".into(), cdc("a", 2, verdict("BrokenByCloud", OLD, 1)));
        let a = entry(&scene.build(), "a");
        assert_eq!(
            (a.status, a.version, a.attempts),
            (InventoryEntryState::Available, Some(2), 0),
            "the seed: Attempts reset, Version the new generation, Available"
        );
        // Reserved entries keep the generation their cluster was built from (ToBeUpdated).
        scene.cdcs.insert("a".into(), cdc("a", 2, leased("p", "p-a")));
        scene.cds = vec![Cd::new("p-a", OLD).built_from("a", 1).build()];
        let a = entry(&scene.build(), "a");
        assert_eq!((a.status, a.version), (InventoryEntryState::ToBeUpdated, Some(1)));
    }

    #[test]
    fn an_openstack_pool_with_failure_domains_says_whether_they_contradict_themselves() {
        let mut scene = Scene::new(json!({"size": 1}));
        assert!(
            scene
                .build()
                .conditions
                .iter()
                .all(|c| c.type_ != "FailureDomainsValid")
        );
        scene.domains.insert("fd-a".into(), FailureDomainStatus::default());
        assert_eq!(condition(&scene.build(), "FailureDomainsValid").0, "True");
        scene.contradiction = Some("failure domain fd-a sets storageAvailabilityZone c".into());
        let status = scene.build();
        let (valid, reason, message) = condition(&status, "FailureDomainsValid");
        assert_eq!((valid.as_str(), reason.as_str()), ("False", "InvalidMachineSpec"));
        assert!(
            message.ends_with("failure domain fd-a sets storageAvailabilityZone c"),
            "{message}"
        );
        assert_eq!(
            condition(&status, "CapacityAvailable").1,
            "InvalidMachineSpec",
            "the pool says it adds nothing"
        );
    }

    #[test]
    fn what_the_execution_found_outranks_what_was_observed_and_planned() {
        let mut scene = Scene::new(json!({"size": 1}));
        scene.domains.insert("fd-a".into(), FailureDomainStatus::default());
        scene.contradiction = Some("observed contradiction".into());
        scene.executed.contradiction = Some("found while placing machines".into());
        let (_, _, message) = condition(&scene.build(), "FailureDomainsValid");
        assert!(message.ends_with("found while placing machines"), "{message}");
        scene.contradiction = None;
        scene.executed.contradiction = None;
        scene.plan.insufficient_hosts = Some("planned: 1 host short".into());
        assert_eq!(
            condition(&scene.build(), "CapacityAvailable").2,
            "planned: 1 host short"
        );
        scene.executed.insufficient_hosts = Some("assigning: other writers took them".into());
        assert_eq!(
            condition(&scene.build(), "CapacityAvailable").2,
            "assigning: other writers took them"
        );
    }

    #[test]
    fn an_entry_reads_the_copy_the_pass_wrote_over_the_cached_one() {
        let mut scene = Scene::new(json!({"size": 1, "inventory": entries(&["a"])}));
        scene.cdcs.insert("a".into(), cdc("a", 1, leased("q", "q-x")));
        assert_eq!(entry(&scene.build(), "a").status, InventoryEntryState::Unavailable);
        let free = json!({"conditions": [{"type": "Available", "status": "True", "reason": "Available",
            "message": "", "lastTransitionTime": OLD}]});
        scene.executed.fresh.record((*cdc("a", 1, free)).clone());
        assert_eq!(entry(&scene.build(), "a").status, InventoryEntryState::Available);
    }

    #[test]
    fn an_edited_entry_is_to_be_updated_and_a_removed_one_to_be_deleted_while_its_cluster_lives() {
        let mut scene = Scene::new(json!({"size": 1, "inventory": entries(&["a"])}));
        scene.cdcs.insert("a".into(), cdc("a", 2, leased("p", "p-a")));
        scene.cds = vec![
            Cd::new("p-a", OLD).installed().built_from("a", 1).build(),
            Cd::new("p-gone", OLD).installed().built_from("gone", 1).build(),
        ];
        scene.previous.inventory = vec![InventoryEntryStatus {
            name: "gone".into(),
            version: Some(1),
            ..Default::default()
        }];
        let status = scene.build();
        assert_eq!(entry(&status, "a").status, InventoryEntryState::ToBeUpdated);
        assert_eq!(
            entry(&status, "a").version,
            Some(1),
            "the generation the live cluster was built from"
        );
        let gone = entry(&status, "gone");
        assert_eq!(gone.status, InventoryEntryState::ToBeDeleted);
        assert_eq!(gone.cluster_deployment.as_deref(), Some("p-gone"));
        scene.cds.pop();
        assert!(
            scene.build().inventory.iter().all(|e| e.name != "gone"),
            "dropped once its cluster is gone"
        );
    }

    #[test]
    fn attempts_grow_when_a_cluster_broke_and_restart_after_a_success_or_an_edit() {
        let mut scene = Scene::new(json!({"size": 1, "inventory": entries(&["a"])}));
        scene.previous.inventory = vec![InventoryEntryStatus {
            name: "a".into(),
            version: Some(1),
            attempts: 2,
            ..Default::default()
        }];
        scene.cdcs.insert("a".into(), cdc("a", 1, leased("p", "p-a")));
        scene.plan.broken_entries.insert("a".into());
        assert_eq!(entry(&scene.build(), "a").attempts, 3);
        scene.cdcs.insert("a".into(), cdc("a", 1, verdict("Succeeded", OLD, 1)));
        assert_eq!(entry(&scene.build(), "a").attempts, 0, "a success resets them");
        scene.plan.broken_entries.clear();
        scene
            .cdcs
            .insert("a".into(), cdc("a", 2, verdict("BrokenByCloud", OLD, 1)));
        assert_eq!(entry(&scene.build(), "a").attempts, 0, "edited since it broke");
    }

    #[test]
    fn a_lease_taken_this_pass_records_the_generation_applied() {
        let mut scene = Scene::new(json!({"size": 1, "inventory": entries(&["a"])}));
        scene.cdcs.insert("a".into(), cdc("a", 4, json!({})));
        scene.executed.leased.insert("a".into(), 4);
        scene
            .executed
            .fresh
            .record((*cdc("a", 4, leased("p", "p-new"))).clone());
        let a = entry(&scene.build(), "a");
        assert_eq!((a.status, a.version), (InventoryEntryState::Reserved, Some(4)));
        assert_eq!(a.cluster_deployment.as_deref(), Some("p-new"));
    }

    #[test]
    fn a_vsphere_pool_with_failure_domains_says_they_are_unsupported() {
        let vsphere = json!({"vsphere": {"vCenter": "vc", "datacenter": "dc", "defaultDatastore": "ds",
                                         "credentialsSecretRef": {"name": "creds"}}});
        let mut scene = Scene::new(json!({"size": 1, "platform": vsphere}));
        assert_eq!(
            condition(&scene.build(), "FailureDomainsUnsupported").1,
            "NoFailureDomains"
        );
        scene.domains.insert("az1".into(), FailureDomainStatus::default());
        assert_eq!(
            condition(&scene.build(), "FailureDomainsUnsupported"),
            (
                "True".into(),
                "FailureDomainsUnsupported".into(),
                "Failure domains are not supported on vSphere and are ignored; remove spec.failureDomains and spec.availabilityZones".into()
            )
        );
    }

    #[test]
    fn a_deleted_pool_says_which_clusters_it_waits_for_once() {
        let mut deleted = pool("p", json!({}));
        let first = deletion_pending(&deleted, &["p-a".into()], Time(Timestamp::UNIX_EPOCH)).expect("changed");
        assert_eq!(
            condition(&first, "DeletionPossible"),
            (
                "False".into(),
                "ClusterDeploymentsPendingCleanup".into(),
                "Waiting for these clusters to be deleted (claimed ones go when their claims are deleted): p-a".into()
            )
        );
        deleted.status = Some(first);
        assert_eq!(
            deletion_pending(&deleted, &["p-a".into()], Time(Timestamp::UNIX_EPOCH)),
            None
        );
    }
}
