//! One test per rule of DESIGN.md §4.3 that the pool's plan decides.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use kube::ResourceExt;
use serde_json::{Value, json};

use super::*;
use crate::api::pools::{ClusterClaim, InventoryEntryStatus};
use crate::pools::buckets::fixtures::{Cd, VERSION, cdc, claim, leased, pool, verdict};

const OLD: &str = "2024-01-01T00:00:00Z";
const MID: &str = "2024-02-01T00:00:00Z";
const NEW: &str = "2024-03-01T00:00:00Z";

/// The world a plan is made in; each test changes what its rule is about.
struct World {
    pool: ClusterPool,
    cds: Vec<Arc<ClusterDeployment>>,
    claims: BTreeMap<String, Arc<ClusterClaim>>,
    cdcs: BTreeMap<String, Arc<Cdc>>,
    expected_created: BTreeSet<String>,
    /// Clusters this controller deleted that the cache still shows live.
    deleted_by_us: BTreeSet<String>,
    previous: ClusterPoolStatus,
    assets: Vec<Arc<BareMetalAsset>>,
    pending_claims: i64,
    contradiction: bool,
    namespace_room: i64,
}

impl World {
    fn new(spec: Value) -> World {
        World {
            pool: pool("p", spec),
            cds: Vec::new(),
            claims: BTreeMap::new(),
            cdcs: BTreeMap::new(),
            expected_created: BTreeSet::new(),
            deleted_by_us: BTreeSet::new(),
            previous: ClusterPoolStatus::default(),
            assets: Vec::new(),
            pending_claims: 0,
            contradiction: false,
            namespace_room: i64::MAX,
        }
    }

    fn cds(mut self, cds: impl IntoIterator<Item = Cd>) -> World {
        self.cds = cds.into_iter().map(Cd::build).collect();
        self
    }

    fn cdc(mut self, name: &str, status: Value) -> World {
        self.cdcs.insert(name.into(), cdc(name, 1, status));
        self
    }

    fn inventory(&self) -> Vec<String> {
        let mut seen = BTreeSet::new();
        self.pool
            .spec
            .inventory
            .iter()
            .flatten()
            .map(|e| e.name.clone())
            .filter(|n| seen.insert(n.clone()))
            .collect()
    }

    fn buckets(&self) -> Buckets {
        Buckets::sort(&self.cds, &self.claims, &self.deleted_by_us)
    }

    fn plan_with(&self, progress: &Progress) -> Plan {
        let inventory = self.inventory();
        let fresh = Fresh::default();
        let inputs = Inputs {
            pool: &self.pool,
            version: VERSION,
            inventory: &inventory,
            cds: &self.cds,
            expected_created: &self.expected_created,
            cdcs: &self.cdcs,
            fresh: &fresh,
            previous: &self.previous,
            backoff: Backoff::new(Duration::from_secs(10), Duration::from_secs(3600)),
            assets: &self.assets,
            pending_claims: self.pending_claims,
            contradiction: self.contradiction,
            namespace_room: self.namespace_room,
        };
        plan(&inputs, &self.buckets(), progress)
    }

    fn plan(&self) -> Plan {
        self.plan_with(&Progress::default())
    }
}

fn deleted(plan: &Plan) -> Vec<(String, Why)> {
    plan.deletes.iter().map(|d| (d.cd.name_any(), d.why.clone())).collect()
}

fn added(plan: &Plan) -> i64 {
    plan.add.as_ref().map_or(0, |a| a.count)
}

fn entries(names: &[&str]) -> Value {
    json!(names.iter().map(|n| json!({"name": n})).collect::<Vec<_>>())
}

const BROKEN: &str = "InstallAttemptsLimitReached";

// §4.3.5 Capacity.

#[test]
fn an_empty_pool_adds_size_clusters() {
    let plan = World::new(json!({"size": 3})).plan();
    assert_eq!(added(&plan), 3);
    assert!(plan.deletes.is_empty());
    assert_eq!(plan.capacity.drift, -3);
}

#[test]
fn clusters_being_created_count_before_the_cache_shows_them() {
    let mut world = World::new(json!({"size": 3}));
    world.expected_created = BTreeSet::from(["p-new".to_string()]);
    let plan = world.plan();
    assert_eq!(added(&plan), 2);
    assert_eq!(plan.capacity.installing, 1);
}

#[test]
fn a_namespace_with_all_its_clusters_adds_none_and_one_with_room_adds_what_fits() {
    let mut world = World::new(json!({"size": 3}));
    world.namespace_room = 2;
    assert_eq!(added(&world.plan()), 2);
    world.expected_created = BTreeSet::from(["p-new".to_string()]);
    assert_eq!(added(&world.plan()), 1, "a cluster being created takes room");
    world.namespace_room = 0;
    let plan = world.plan();
    assert_eq!(added(&plan), 0);
    assert!(plan.capacity.namespace_room <= 0);
}

#[test]
fn max_concurrent_counts_installing_and_deleting_clusters() {
    let world = World::new(json!({"size": 5, "maxConcurrent": 3})).cds([
        Cd::new("p-installing", OLD),
        Cd::new("p-deleting", OLD).installed().deleting(),
    ]);
    let plan = world.plan();
    assert_eq!(added(&plan), 1, "3 at once, 2 of them busy");
    assert_eq!(plan.capacity.room, 1);
}

#[test]
fn max_size_counts_claimed_clusters_too() {
    let mut world =
        World::new(json!({"size": 3, "maxSize": 2})).cds([Cd::new("p-claimed", OLD).installed().claimed_by("c")]);
    world.claims.insert("c".into(), claim("c", OLD));
    let plan = world.plan();
    assert_eq!(added(&plan), 1, "one claimed + one new reach maxSize 2");
    assert_eq!(plan.capacity.live, 1);
}

#[test]
fn an_inventory_caps_the_target_at_its_free_entries() {
    let world = World::new(json!({"size": 3, "inventory": entries(&["a", "b"])}))
        .cdc("a", json!({}))
        .cdc("b", json!({}));
    let plan = world.plan();
    assert_eq!(added(&plan), 2);
    assert_eq!(plan.capacity.target, 2);
    assert_eq!(plan.capacity.wanted, 3);
    assert_eq!(plan.capacity.backed, 2, "InventoryExhausted: 3 wanted, 2 backed");
}

#[test]
fn an_entry_held_by_a_claimed_cluster_backs_no_unclaimed_one() {
    let mut world = World::new(json!({"size": 2, "inventory": entries(&["a", "b"])}))
        .cdc("a", leased("p", "p-claimed"))
        .cdc("b", json!({}))
        .cds([Cd::new("p-claimed", OLD).installed().claimed_by("c").built_from("a", 1)]);
    world.claims.insert("c".into(), claim("c", OLD));
    let plan = world.plan();
    assert_eq!(plan.capacity.target, 1);
    assert_eq!(plan.capacity.backed, 1);
    assert_eq!(
        plan.add,
        Some(Add {
            count: 1,
            leases: vec!["b".into()]
        })
    );
}

#[test]
fn pending_claims_grow_the_pool() {
    let mut world = World::new(json!({"size": 1})).cds([Cd::new("p-ready", OLD).installed()]);
    world.pending_claims = 2;
    let plan = world.plan();
    assert_eq!(plan.capacity.wanted, 3);
    assert_eq!(added(&plan), 2);
}

#[test]
fn excess_clusters_go_installing_first_then_ready_newest_first_within_max_concurrent() {
    let world = World::new(json!({"size": 1, "maxConcurrent": 3})).cds([
        Cd::new("p-ready-old", OLD).installed(),
        Cd::new("p-ready-new", NEW).installed(),
        Cd::new("p-installing-old", OLD),
        Cd::new("p-installing-new", MID),
    ]);
    // Two installing clusters leave room for one deletion.
    let plan = world.plan();
    assert_eq!(deleted(&plan), [("p-installing-new".to_string(), Why::Excess)]);
    let roomy = World::new(json!({"size": 1})).cds([
        Cd::new("p-ready-old", OLD).installed(),
        Cd::new("p-ready-new", NEW).installed(),
        Cd::new("p-installing-old", OLD),
        Cd::new("p-installing-new", MID),
    ]);
    let names: Vec<String> = deleted(&roomy.plan()).into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["p-installing-new", "p-installing-old", "p-ready-new"]);
}

#[test]
fn a_steady_pool_does_nothing() {
    let world = World::new(json!({"size": 2})).cds([Cd::new("p-a", OLD).installed(), Cd::new("p-b", OLD).installed()]);
    let plan = world.plan();
    assert!(plan.deletes.is_empty());
    assert_eq!(plan.add, None);
    assert_eq!(plan.capacity.drift, 0);
}

// §4.3.7 Broken by cloud, §4.3.10 deleted claims.

#[test]
fn released_clusters_go_before_broken_ones_oldest_first_within_max_concurrent() {
    let world = World::new(json!({"size": 0, "maxConcurrent": 2})).cds([
        Cd::new("p-broken", OLD).stopped(BROKEN),
        Cd::new("p-released-new", NEW).installed().claimed_by("gone"),
        Cd::new("p-released-old", MID).installed().claimed_by("gone"),
    ]);
    let plan = world.plan();
    assert_eq!(
        deleted(&plan),
        [
            ("p-released-old".to_string(), Why::ClaimDeleted),
            ("p-released-new".to_string(), Why::ClaimDeleted),
        ]
    );
}

#[test]
fn broken_clusters_are_deleted_before_excess_ones_and_their_cdc_marked() {
    let world = World::new(json!({"size": 1, "inventory": entries(&["a", "b", "c"])}))
        .cdc("a", leased("p", "p-broken"))
        .cdc("b", leased("p", "p-ready"))
        .cdc("c", leased("p", "p-ready2"))
        .cds([
            Cd::new("p-broken", OLD).stopped(BROKEN).built_from("a", 1),
            Cd::new("p-ready", OLD).installed().built_from("b", 1),
            Cd::new("p-ready2", NEW).installed().built_from("c", 1),
        ]);
    let plan = world.plan();
    assert_eq!(
        deleted(&plan),
        [
            ("p-broken".to_string(), Why::Broken { mark: Some("a".into()) }),
            ("p-ready2".to_string(), Why::Excess),
        ]
    );
    assert_eq!(plan.broken_entries, BTreeSet::from(["a".to_string()]));
}

#[test]
fn a_broken_cluster_marks_only_a_cdc_leased_for_it() {
    let world = World::new(json!({"size": 1, "inventory": entries(&["a"])}))
        .cdc("a", leased("p", "p-other"))
        .cds([Cd::new("p-broken", OLD).stopped(BROKEN).built_from("a", 1)]);
    let plan = world.plan();
    assert_eq!(deleted(&plan), [("p-broken".to_string(), Why::Broken { mark: None })]);
    assert_eq!(
        plan.broken_entries,
        BTreeSet::from(["a".to_string()]),
        "its attempts still grow"
    );
}

#[test]
fn broken_clusters_are_replaced_even_when_the_inventory_cannot_back_size() {
    let world = World::new(json!({"size": 3, "inventory": entries(&["a", "b"])}))
        .cdc("a", leased("p", "p-broken"))
        .cdc("b", verdict("Succeeded", OLD, 1))
        .cds([Cd::new("p-broken", OLD).stopped(BROKEN).built_from("a", 1)]);
    let plan = world.plan();
    assert_eq!(deleted(&plan).len(), 1);
    assert_eq!(
        plan.add,
        Some(Add {
            count: 1,
            leases: vec!["b".into()]
        }),
        "the broken cluster's entry waits; the other replaces it"
    );
    assert!(plan.capacity.wanted > plan.capacity.backed);
}

#[test]
fn a_cluster_stopped_on_its_machine_spec_gives_its_entry_back_and_is_replaced_only_without_a_contradiction() {
    let stopped = || {
        Cd::new("p-invalid", OLD)
            .stopped("InvalidMachineSpec")
            .built_from("a", 1)
    };
    let mut world = World::new(json!({"size": 1, "inventory": entries(&["a", "b"])}))
        .cdc("a", leased("p", "p-invalid"))
        .cdc("b", json!({}))
        .cds([stopped()]);
    world.contradiction = true;
    let plan = world.plan();
    assert_eq!(deleted(&plan), [("p-invalid".to_string(), Why::InvalidMachineSpec)]);
    assert!(
        plan.broken_entries.is_empty(),
        "not the entry's fault: no attempt counted"
    );
    assert_eq!(plan.add, None, "no cluster while the contradiction stands");
    world.contradiction = false;
    let plan = world.plan();
    assert_eq!(deleted(&plan), [("p-invalid".to_string(), Why::InvalidMachineSpec)]);
    assert_eq!(added(&plan), 1, "replaced once the configuration is consistent");
    let (reason, warning, note) = Why::InvalidMachineSpec.event("p-invalid");
    assert_eq!((reason, warning), ("ClusterDeleted", true));
    assert!(note.contains("InvalidMachineSpec"), "{note}");
}

#[test]
fn a_pool_whose_failure_domains_contradict_themselves_adds_nothing() {
    let mut world = World::new(json!({"size": 2}));
    world.contradiction = true;
    let plan = world.plan();
    assert_eq!(plan.add, None);
    assert_eq!(plan.capacity.drift, -2, "the pool still knows what it misses");
}

#[test]
fn an_interrupted_lease_backs_no_cluster_even_when_it_names_this_pool() {
    let interrupted = |pool: Option<&str>| {
        let mut status = leased(pool.unwrap_or_default(), "");
        let refs = status.as_object_mut().expect("a status");
        refs.remove("clusterDeploymentRef");
        if pool.is_none() {
            refs.remove("clusterPoolRef");
        }
        status
    };
    let world = World::new(json!({"size": 3, "inventory": entries(&["a", "b", "c"])}))
        .cdc("a", interrupted(None))
        .cdc("b", interrupted(Some("p")))
        .cdc("c", json!({}));
    let plan = world.plan();
    assert_eq!(
        plan.add,
        Some(Add {
            count: 1,
            leases: vec!["c".into()]
        })
    );
    assert_eq!((plan.capacity.backed, plan.capacity.target), (1, 1));
}

#[test]
fn a_broken_cluster_whose_mark_lost_a_race_stays_and_the_next_is_deleted() {
    let world = World::new(json!({"size": 2, "inventory": entries(&["a", "b", "c"])}))
        .cdc("a", leased("p", "p-broken-old"))
        .cdc("b", leased("p", "p-broken-new"))
        .cdc("c", json!({}))
        .cds([
            Cd::new("p-broken-old", OLD).stopped(BROKEN).built_from("a", 1),
            Cd::new("p-broken-new", NEW).stopped(BROKEN).built_from("b", 1),
        ]);
    let progress = Progress {
        kept: BTreeSet::from(["p-broken-old".to_string()]),
        ..Default::default()
    };
    let plan = world.plan_with(&progress);
    let names: Vec<String> = deleted(&plan).into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["p-broken-new"]);
    assert_eq!(
        plan.capacity.drift, -1,
        "the kept one still counts; one replaces the other"
    );
}

#[test]
fn an_entry_counts_one_attempt_per_broken_cluster_even_when_its_mark_lost_a_race() {
    let world = World::new(json!({"size": 2, "inventory": entries(&["a", "b"])}))
        .cdc("a", leased("p", "p-broken-old"))
        .cdc("b", leased("p", "p-broken-new"))
        .cds([
            Cd::new("p-broken-old", OLD).stopped(BROKEN).built_from("a", 1),
            Cd::new("p-broken-new", NEW).stopped(BROKEN).built_from("b", 1),
        ]);
    let first = world.plan();
    assert_eq!(first.broken_entries.len(), 2);
    // The old one's mark lost its race: it stays, and is counted in the pass that deletes it.
    let mut progress = Progress::default();
    progress.record(&first, &[], "p-broken-old".into());
    assert_eq!(
        world.plan_with(&progress).broken_entries,
        BTreeSet::from(["b".to_string()])
    );
    // The new one's mark lost its race after the old one was deleted: only the old entry counts.
    let mut progress = Progress::default();
    progress.record(&first, &["p-broken-old".into()], "p-broken-new".into());
    assert_eq!(progress.removed, 1);
    assert_eq!(progress.broken_entries, BTreeSet::from(["a".to_string()]));
    let mut after = world;
    after.deleted_by_us = BTreeSet::from(["p-broken-old".to_string()]);
    let last = after.plan_with(&progress);
    assert!(last.deletes.is_empty());
    assert_eq!(last.broken_entries, BTreeSet::from(["a".to_string()]));
}

// §4.3.8 Pool version.

#[test]
fn only_the_oldest_stale_cluster_is_replaced_while_the_pool_is_steady() {
    let world = World::new(json!({"size": 2})).cds([
        Cd::new("p-new", NEW).installed().version("old"),
        Cd::new("p-old", OLD).installed().version("old"),
    ]);
    let plan = world.plan();
    assert_eq!(deleted(&plan), [("p-old".to_string(), Why::Stale(Stale::PoolVersion))]);
    assert_eq!(plan.stale.len(), 2, "AllClustersCurrent names both");
}

#[test]
fn no_stale_cluster_is_replaced_while_one_installs_drift_is_not_zero_or_another_was_deleted() {
    let installing = World::new(json!({"size": 2})).cds([
        Cd::new("p-stale", OLD).installed().version("old"),
        Cd::new("p-installing", NEW),
    ]);
    assert!(installing.plan().deletes.is_empty());
    let short = World::new(json!({"size": 2})).cds([Cd::new("p-stale", OLD).installed().version("old")]);
    assert_eq!(short.plan().deletes.len(), 0);
    assert_eq!(added(&short.plan()), 1);
    let with_broken = World::new(json!({"size": 1})).cds([
        Cd::new("p-stale", OLD).installed().version("old"),
        Cd::new("p-broken", OLD).stopped(BROKEN),
    ]);
    let names: Vec<String> = deleted(&with_broken.plan()).into_iter().map(|(n, _)| n).collect();
    assert_eq!(
        names,
        ["p-broken"],
        "no stale replacement in the pass that deleted a broken one"
    );
    let after_removal = World::new(json!({"size": 1})).cds([Cd::new("p-stale", OLD).installed().version("old")]);
    let progress = Progress {
        removed: 1,
        ..Default::default()
    };
    assert!(after_removal.plan_with(&progress).deletes.is_empty());
}

#[test]
fn a_removed_or_edited_entry_makes_only_its_unclaimed_cluster_stale() {
    let mut world = World::new(json!({"size": 2, "inventory": entries(&["a", "b"])}))
        .cdc("a", leased("p", "p-a"))
        .cdc("b", leased("p", "p-b"))
        .cdc("gone", leased("p", "p-gone"))
        .cds([
            Cd::new("p-a", OLD).installed().built_from("a", 0),
            Cd::new("p-b", OLD).installed().built_from("b", 1),
            Cd::new("p-gone", OLD).installed().built_from("gone", 1).claimed_by("c"),
        ]);
    world.claims.insert("c".into(), claim("c", OLD));
    let plan = world.plan();
    let stale: Vec<(String, Stale)> = plan.stale.iter().map(|(cd, s)| (cd.name_any(), *s)).collect();
    assert_eq!(
        stale,
        [("p-a".to_string(), Stale::EntryEdited)],
        "the claimed cluster is untouched"
    );
    assert_eq!(deleted(&plan), [("p-a".to_string(), Why::Stale(Stale::EntryEdited))]);
}

// §4.3.3 Selection.

#[test]
fn entries_are_leased_past_successes_least_recent_first_then_new_by_name_then_broken() {
    let world = World::new(json!({"size": 5, "inventory": entries(&["z-new", "recent", "broken", "a-new", "old"])}))
        .cdc("recent", verdict("Succeeded", MID, 1))
        .cdc("old", verdict("Succeeded", OLD, 1))
        .cdc("z-new", json!({}))
        .cdc("a-new", json!({}))
        .cdc("broken", verdict("BrokenByCloud", OLD, 1));
    let plan = world.plan();
    assert_eq!(
        plan.add.map(|a| a.leases),
        Some(["old", "recent", "a-new", "z-new", "broken"].map(String::from).to_vec())
    );
}

#[test]
fn a_broken_entry_waits_a_backoff_growing_with_its_attempts() {
    let backoff = Backoff::new(Duration::from_secs(10), Duration::from_secs(3600));
    assert_eq!(entry_backoff(backoff, 0), Duration::from_secs(10));
    assert_eq!(entry_backoff(backoff, 3), Duration::from_secs(80));
    assert_eq!(entry_backoff(backoff, 40), Duration::from_secs(3600));
    let just_now = jiff::Timestamp::now().to_string();
    let mut world =
        World::new(json!({"size": 1, "inventory": entries(&["a"])})).cdc("a", verdict("BrokenByCloud", &just_now, 1));
    world.previous.inventory = vec![InventoryEntryStatus {
        name: "a".into(),
        attempts: 2,
        ..Default::default()
    }];
    let plan = world.plan();
    assert_eq!(plan.add.map(|a| a.leases), Some(vec![]), "inside its backoff");
    let wake = plan.wake.expect("the pool looks again when the backoff ends");
    assert!(
        wake > Duration::from_secs(30) && wake <= Duration::from_secs(40),
        "{wake:?}"
    );
    assert_eq!(plan.capacity.backed, 1, "it still backs the pool");
}

#[test]
fn deleting_syntax_broken_and_other_pools_entries_are_never_leased() {
    let mut deleting = (*cdc("deleting", 1, json!({}))).clone();
    deleting.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        jiff::Timestamp::UNIX_EPOCH,
    ));
    let mut world = World::new(json!({"size": 4, "inventory": entries(&["deleting", "syntax", "theirs", "ok"])}))
        .cdc("syntax", verdict("BrokenBySyntax", OLD, 1))
        .cdc("theirs", leased("q", "q-1"))
        .cdc("ok", json!({}));
    world.cdcs.insert("deleting".into(), Arc::new(deleting));
    let plan = world.plan();
    assert_eq!(plan.add.map(|a| a.leases), Some(vec!["ok".to_string()]));
    assert_eq!(plan.capacity.backed, 1, "none of the others backs the pool");
}

#[test]
fn a_missing_entry_backs_nothing() {
    let world = World::new(json!({"size": 2, "inventory": entries(&["a", "missing"])})).cdc("a", json!({}));
    let plan = world.plan();
    assert_eq!(plan.capacity.target, 1);
    assert_eq!(added(&plan), 1);
}

// §5 Assignment by pools: capacity counts free assets.

#[test]
fn a_baremetal_pool_adds_only_as_many_clusters_as_its_free_hosts_back() {
    let mut world = World::new(json!({"size": 3,
        "platform": {"baremetal": {"credentialsSecretRef": {"name": "creds"}}},
        "controlPlane": {"replicas": 1}, "compute": {"replicas": 1}}));
    world.assets = ["m1", "w1", "any"]
        .iter()
        .map(|n| {
            let role = match *n {
                "m1" => json!("master"),
                "w1" => json!("worker"),
                _ => Value::Null,
            };
            Arc::new(
                serde_json::from_value(json!({
                    "apiVersion": "inventory.stackd.dev/v1alpha1", "kind": "BareMetalAsset",
                    "metadata": {"name": n, "namespace": "team"},
                    "spec": {"bmc": {"address": "ipmi://x", "credentialsName": "c"},
                             "bootMACAddress": "00:00:00:00:00:01", "role": role},
                }))
                .expect("a valid asset"),
            )
        })
        .collect();
    let plan = world.plan();
    assert_eq!(added(&plan), 1);
    let why = plan.insufficient_hosts.expect("says why");
    assert!(
        why.starts_with("The pool needs 3 more clusters; its free BareMetalAssets back 1"),
        "{why}"
    );
}

// §4.3.9 Pool deletion.

#[test]
fn a_deleted_pool_deletes_its_unclaimed_clusters_within_max_concurrent() {
    let mut world = World::new(json!({"size": 3, "maxConcurrent": 2})).cds([
        Cd::new("p-installing", OLD),
        Cd::new("p-ready-1", OLD).installed(),
        Cd::new("p-ready-2", OLD).installed(),
        Cd::new("p-claimed", OLD).installed().claimed_by("c"),
        Cd::new("p-released", OLD).installed().claimed_by("gone"),
        Cd::new("p-deleting", OLD).deleting(),
    ]);
    world.claims.insert("c".into(), claim("c", OLD));
    let deletes = deletions_of_deleted_pool(&world.pool, &world.cds, &world.buckets());
    let names: Vec<String> = deletes.iter().map(|cd| cd.name_any()).collect();
    // Busy: one installing and one deleting leave no room, but an installing cluster is always
    // deleted (it frees its installing slot as it takes a deleting one).
    assert_eq!(names, ["p-installing"]);
    let unlimited = World::new(json!({"size": 3})).cds([
        Cd::new("p-ready", OLD).installed(),
        Cd::new("p-claimed", OLD).installed().claimed_by("c"),
        Cd::new("p-released", OLD).installed().claimed_by("gone"),
        Cd::new("p-broken", OLD).stopped(BROKEN),
    ]);
    let mut unlimited = unlimited;
    unlimited.claims.insert("c".into(), claim("c", OLD));
    let deletes = deletions_of_deleted_pool(&unlimited.pool, &unlimited.cds, &unlimited.buckets());
    let names: Vec<String> = deletes.iter().map(|cd| cd.name_any()).collect();
    assert_eq!(
        names,
        ["p-ready", "p-released", "p-broken"],
        "claimed ones wait for their claims"
    );
}

// Events name what was deleted and why.

#[test]
fn each_deletion_reason_has_its_event() {
    assert_eq!(
        Why::ClaimDeleted.event("p-1"),
        (
            "ClusterDeleted",
            false,
            "Deleted ClusterDeployment p-1: its claim was deleted".into()
        )
    );
    assert_eq!(
        Why::Broken { mark: None }.event("p-1"),
        (
            "ClusterDeleted",
            true,
            "Deleted ClusterDeployment p-1: its install failed installAttemptsLimit times".into()
        )
    );
    assert_eq!(
        Why::Excess.event("p-1").2,
        "Deleted ClusterDeployment p-1: the pool has more clusters than it needs"
    );
    assert_eq!(
        Why::Stale(Stale::EntryRemoved).event("p-1"),
        (
            "StaleClusterReplaced",
            false,
            "Deleted ClusterDeployment p-1: its inventory entry was removed; a current one replaces it".into()
        )
    );
}
