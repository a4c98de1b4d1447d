//! The ClusterPool inventory as the seeds tell it (issue 29): each test is one story of
//! `clusterpool-inventory-merged-design.txt` or `clusterpool-inventory-status-revision.md`, run
//! through the daemon binary against embedded host and tenant servers.

use std::path::Path;
use std::process::{Output, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use stackd::api::pools::{ClusterDeploymentCustomization, InventoryEntryState};
use stackd::embedded::controller_manager::{ImageMatch, JobContext, JobOutcome};
use stackd::embedded::samples::create_cluster;

use crate::harness::{self, Fleet, until, wait_until};
use crate::pools::{
    NS, WITHIN, cdc, cdc_condition, cdc_of, cdcs, claimed_namespace, claims, create_claim, create_pool, daemon, entry,
    events, lease, live, named_cdc, pool, pool_condition, pool_json, pools, ready, setup, writes_when_woken,
};

type Cdc = ClusterDeploymentCustomization;

/// kubectl as tenant `acme`'s user runs it.
async fn kubectl(fleet: &Fleet, args: &[&str]) -> Output {
    tokio::process::Command::new(harness::kubectl())
        .arg("--kubeconfig")
        .arg(fleet.tenant_file("acme"))
        .arg("--cache-dir")
        .arg(fleet.dir.path().join("kubectl-cache"))
        .args(args)
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output()
        .await
        .expect("kubectl runs")
}

async fn kubectl_ok(fleet: &Fleet, args: &[&str]) -> String {
    let output = kubectl(fleet, args).await;
    assert!(
        output.status.success(),
        "kubectl {} failed: {}{}",
        args.join(" "),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// How often `object` was told `reason`: Events of a series count as many times as it says. (Core
/// Events are the same objects seen through the older API, so they are not counted again.)
pub(crate) async fn event_count(tenant: &Client, namespace: &str, object: &str, reason: &str) -> i32 {
    let api: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(tenant.clone(), namespace);
    api.list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(object))
        .filter(|e| e.reason.as_deref() == Some(reason))
        .map(|e| e.series.map_or(1, |s| s.count))
        .sum()
}

/// What a CDC no pool holds reads (§4.3.1): `Available=True` and no refs.
fn reads_free(cdc: &Cdc) -> bool {
    let status = cdc.status.clone().unwrap_or_default();
    let available = cdc_condition(cdc, "Available").is_some_and(|(s, _, _)| s == "True");
    available && status.cluster_deployment_ref.is_none() && status.cluster_pool_ref.is_none()
}

/// The value of column `column` in the row of a `kubectl get` table whose first cell is `name`.
fn table_cell(table: &str, name: &str, column: &str) -> Option<String> {
    let mut lines = table.lines();
    let header = lines.next()?;
    let at = header.find(column)?;
    let row = lines.find(|l| l.split_whitespace().next() == Some(name))?;
    row.get(at..)?.split_whitespace().next().map(String::from)
}

async fn patch_pool(tenant: &Client, name: &str, spec: serde_json::Value) -> i64 {
    let patched = pools(tenant)
        .patch(name, &PatchParams::default(), &Patch::Merge(json!({ "spec": spec })))
        .await
        .expect("patch pool");
    patched.metadata.generation.unwrap_or_default()
}

/// The pool's status once it describes generation `generation`.
async fn pool_at(tenant: &Client, name: &str, generation: i64) -> Option<stackd::api::pools::ClusterPool> {
    let pool = pools(tenant).get(name).await.ok()?;
    let observed = pool.status.as_ref()?.observed_generation?;
    (observed >= generation).then_some(pool)
}

/// An installer that builds clusters and counts the destroy Jobs it runs.
fn counting_installer(fleet: &Fleet, image: &str, destroy_for: Duration) -> Arc<AtomicUsize> {
    let destroys = Arc::new(AtomicUsize::new(0));
    let counter = destroys.clone();
    fleet
        .host()
        .runners()
        .register(ImageMatch::Exact(image.into()), move |ctx: &JobContext| {
            if ctx.args.first().map(String::as_str) == Some("destroy") {
                counter.fetch_add(1, Ordering::SeqCst);
                return JobOutcome::success("destroyed\n").after(destroy_for);
            }
            create_cluster(ctx)
        });
    destroys
}

/// Issue 29 item 1 (DESIGN.md §4.3.1): a CDC of a pool's inventory that no pool holds reads
/// `Available=True`, written once by the CDC lease writer: `kubectl wait` and the printer column
/// see it, a second pass writes nothing, and a CDC no pool lists is left alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cdc_no_pool_holds_reads_available_and_kubectl_waits_for_it() {
    let (fleet, tenant) = setup().await;
    named_cdc(&tenant, "foo").await;
    named_cdc(&tenant, "unlisted").await;
    create_pool(&tenant, pool_json("p", 0, Some(&["foo"]))).await;
    let daemon = daemon(&fleet, &[]);
    kubectl_ok(
        &fleet,
        &[
            "wait",
            "--for=condition=Available",
            "-n",
            NS,
            "cdc/foo",
            "--timeout=20s",
        ],
    )
    .await;
    let table = kubectl_ok(&fleet, &["get", "cdc", "-n", NS]).await;
    assert_eq!(
        table_cell(&table, "foo", "AVAILABLE").as_deref(),
        Some("True"),
        "{table}"
    );
    let foo = cdc(&tenant, "foo").await;
    assert!(reads_free(&foo), "{:?}", foo.status);
    assert!(
        foo.metadata.managed_fields.iter().flatten().any(|m| {
            m.manager.as_deref() == Some("stackd/cdc-lease") && m.subresource.as_deref() == Some("status")
        })
    );
    // Already so: the pool's next passes write nothing.
    writes_when_woken(&fleet, &daemon, &pools(&tenant), "p", &["clusterpool"], &[]).await;
    let (tenant_writes, host_writes) =
        writes_when_woken(&fleet, &daemon, &pools(&tenant), "p", &["clusterpool"], &[]).await;
    assert!(
        tenant_writes.is_empty() && host_writes.is_empty(),
        "tenant writes {tenant_writes:?}, host writes {host_writes:?}"
    );
    assert_eq!(cdc(&tenant, "unlisted").await.status, None, "in nobody's inventory");

    // Leased, it reads False; released after its cluster's destroy, True again.
    patch_pool(&tenant, "p", json!({"size": 1})).await;
    kubectl_ok(
        &fleet,
        &[
            "wait",
            "--for=condition=Available=False",
            "-n",
            NS,
            "cdc/foo",
            "--timeout=20s",
        ],
    )
    .await;
    until("a ready cluster", WITHIN, &daemon, || async {
        ready(&tenant, "p").await == 1
    })
    .await;
    patch_pool(&tenant, "p", json!({"size": 0})).await;
    kubectl_ok(
        &fleet,
        &[
            "wait",
            "--for=condition=Available",
            "-n",
            NS,
            "cdc/foo",
            "--timeout=20s",
        ],
    )
    .await;
    let released = cdc(&tenant, "foo").await;
    assert!(reads_free(&released), "{:?}", released.status);
}

/// Marks `name` as a lease interrupted before its refs were written (or a CDC migrated from Hive,
/// which writes the refs in a later update): `Available=False`, no refs, since now.
async fn interrupt(tenant: &Client, name: &str) {
    let status = json!({"status": {
        "clusterDeploymentRef": null,
        "clusterPoolRef": null,
        "conditions": [{"type": "Available", "status": "False", "reason": "Reserved", "message": "",
                        "lastTransitionTime": jiff::Timestamp::now().to_string()}],
    }});
    cdcs(tenant)
        .patch_status(name, &PatchParams::default(), &Patch::Merge(status))
        .await
        .expect("interrupt the lease");
}

/// Issue 29 item 2 (DESIGN.md §4.3.1): a CDC reading `Available=False` with no
/// `clusterDeploymentRef` is an interrupted lease. Until `--lease-min-age` has passed it backs no
/// cluster, is not called Reserved, and `InventoryValid` names it; then it is released like any
/// orphaned lease, with an Event, and the pool fills from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_lease_backs_nothing_until_it_is_released_after_the_minimum_age() {
    let (fleet, tenant) = setup().await;
    named_cdc(&tenant, "a").await;
    named_cdc(&tenant, "b").await;
    create_pool(&tenant, pool_json("p", 0, Some(&["a", "b"]))).await;
    let min_age = Duration::from_secs(4);
    let daemon = fleet.daemon(&["--lease-min-age", "4s", "--sweep-interval", "1h"]);
    until("both entries read Available", WITHIN, &daemon, || async {
        reads_free(&cdc(&tenant, "a").await) && reads_free(&cdc(&tenant, "b").await)
    })
    .await;
    interrupt(&tenant, "a").await;
    let interrupted_at = Instant::now();
    patch_pool(&tenant, "p", json!({"size": 2})).await;
    until(
        "one cluster, from b, and the interrupted lease named",
        WITHIN,
        &daemon,
        || async {
            let pool = pool(&tenant, "p").await;
            let clusters = crate::pools::cds(&tenant, "p").await;
            let from: Vec<Option<String>> = live(&clusters).iter().map(|cd| cdc_of(cd)).collect();
            let a = entry(&pool, "a");
            let valid = pool_condition(&pool, "InventoryValid");
            let capacity = pool_condition(&pool, "CapacityAvailable");
            from == [Some("b".to_string())]
                && a.is_some_and(|a| a.status == InventoryEntryState::Unavailable && a.cluster_deployment.is_none())
                && valid.is_some_and(|(s, _, m)| s == "False" && m.contains("a (an interrupted lease"))
                && capacity.is_some_and(|(_, r, m)| r == "InventoryExhausted" && m.contains("can back only 1"))
        },
    )
    .await;
    assert!(
        interrupted_at.elapsed() < min_age,
        "seen only after {:?}",
        interrupted_at.elapsed()
    );
    until(
        "a Released event naming the interrupted lease",
        WITHIN,
        &daemon,
        || async {
            events(&tenant, NS, "a")
                .await
                .iter()
                .any(|(r, n)| r == "Released" && n.contains("interrupted lease"))
        },
    )
    .await;
    // Condition times have one-second precision.
    assert!(
        interrupted_at.elapsed() >= min_age - Duration::from_secs(1),
        "released after {:?}",
        interrupted_at.elapsed()
    );
    until("the pool filled from both entries", WITHIN, &daemon, || async {
        let clusters = crate::pools::cds(&tenant, "p").await;
        let mut from: Vec<Option<String>> = live(&clusters).iter().map(|cd| cdc_of(cd)).collect();
        from.sort();
        ready(&tenant, "p").await == 2 && from == [Some("a".to_string()), Some("b".to_string())]
    })
    .await;
    assert!(lease(&cdc(&tenant, "a").await).is_some());
}

/// Issue 29 items 3 and 9 ("Deleting The Inventory"): removing `spec.inventory` marks every entry
/// a cluster was built from `ToBeDeleted`, replaces the unclaimed clusters, and drops the entries
/// once their clusters are gone; `InventoryValid` goes with the inventory and `CapacityAvailable`
/// is judged without it. Every CDC ends up free, without the pool's finalizer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_the_inventory_marks_its_entries_to_be_deleted_and_drops_its_condition() {
    let (fleet, tenant) = setup().await;
    let image = "quay.io/example/seed-inventory-installer:1";
    counting_installer(&fleet, image, Duration::from_millis(800));
    for name in ["a", "b", "c"] {
        named_cdc(&tenant, name).await;
    }
    let mut spec = pool_json("p", 2, Some(&["a", "b", "c"]));
    spec["spec"]["installerImage"] = json!(image);
    create_pool(&tenant, spec).await;
    let daemon = daemon(&fleet, &[]);
    until("two ready clusters, the inventory valid", WITHIN, &daemon, || async {
        let pool = pool(&tenant, "p").await;
        ready(&tenant, "p").await == 2
            && pool_condition(&pool, "InventoryValid")
                .is_some_and(|(s, _, m)| s == "True" && m == "All 3 inventory entries are usable")
    })
    .await;
    let generation = patch_pool(&tenant, "p", json!({"inventory": null})).await;
    let saw_to_be_deleted = std::cell::Cell::new(false);
    until("the clusters replaced", 2 * WITHIN, &daemon, || async {
        let Some(pool) = pool_at(&tenant, "p", generation).await else {
            return false;
        };
        assert_eq!(
            pool_condition(&pool, "InventoryValid"),
            None,
            "the condition outlived the inventory"
        );
        let entries = pool.status.clone().unwrap_or_default().inventory;
        assert!(
            entries.iter().all(|e| e.status == InventoryEntryState::ToBeDeleted),
            "{entries:?}"
        );
        saw_to_be_deleted.set(saw_to_be_deleted.get() | !entries.is_empty());
        let clusters = crate::pools::cds(&tenant, "p").await;
        entries.is_empty()
            && live(&clusters).len() == 2
            && live(&clusters).iter().all(|cd| cdc_of(cd).is_none())
            && ready(&tenant, "p").await == 2
    })
    .await;
    assert!(
        saw_to_be_deleted.get(),
        "entries showed ToBeDeleted while their clusters lived"
    );
    until(
        "every CDC free and without the pool's finalizer",
        WITHIN,
        &daemon,
        || async {
            let mut free = true;
            for name in ["a", "b", "c"] {
                let cdc = cdc(&tenant, name).await;
                free &= reads_free(&cdc) && cdc.finalizers().is_empty();
            }
            free
        },
    )
    .await;
    let pool = pool(&tenant, "p").await;
    assert_eq!(
        pool_condition(&pool, "CapacityAvailable").map(|c| c.1).as_deref(),
        Some("Available")
    );
}

/// Issue 29 items 9 and 4: `kubectl scale` to 0 through the scale subresource deletes the clusters
/// through their destroy Jobs and releases every CDC to `Available=True` with no refs; a CDC edited
/// while free starts over (the status-revision seed: Attempts reset, Version the new generation,
/// Available); scaling back refills the pool, from the edited CDC too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scaling_to_zero_and_back_releases_every_cdc_and_refills_the_pool() {
    let (fleet, tenant) = setup().await;
    let image = "quay.io/example/seed-scale-installer:1";
    let destroys = counting_installer(&fleet, image, Duration::ZERO);
    named_cdc(&tenant, "a").await;
    named_cdc(&tenant, "b").await;
    let mut spec = pool_json("p", 2, Some(&["a", "b"]));
    spec["spec"]["installerImage"] = json!(image);
    create_pool(&tenant, spec).await;
    let daemon = daemon(&fleet, &[]);
    until("two ready clusters", WITHIN, &daemon, || async {
        ready(&tenant, "p").await == 2
    })
    .await;

    kubectl_ok(&fleet, &["scale", "-n", NS, "clusterpool/p", "--replicas=0"]).await;
    until("no cluster left, both CDCs free", WITHIN, &daemon, || async {
        let pool = pool(&tenant, "p").await;
        let free = reads_free(&cdc(&tenant, "a").await) && reads_free(&cdc(&tenant, "b").await);
        let entries_free = ["a", "b"]
            .iter()
            .all(|n| entry(&pool, n).is_some_and(|e| e.status == InventoryEntryState::Available));
        crate::pools::cds(&tenant, "p").await.is_empty()
            && free
            && entries_free
            && pool.status.as_ref().is_some_and(|s| s.size == 0)
    })
    .await;
    assert_eq!(pool(&tenant, "p").await.spec.size, 0, "through the scale subresource");
    assert_eq!(destroys.load(Ordering::SeqCst), 2, "one destroy Job per cluster");
    for name in ["a", "b"] {
        assert!(
            events(&tenant, NS, name)
                .await
                .iter()
                .any(|(r, n)| r == "Released" && n.contains("after its deprovision")),
            "{name} released after its cluster's destroy"
        );
        assert_eq!(entry(&pool(&tenant, "p").await, name).unwrap().version, Some(1));
    }

    // Edited while free: the entry starts over at the new generation.
    let edit =
        json!({"spec": {"installConfigPatches": [{"op": "replace", "path": "/metadata/name", "value": "a-v2"}]}});
    let edited = cdcs(&tenant)
        .patch("a", &PatchParams::default(), &Patch::Merge(&edit))
        .await
        .expect("edit a");
    assert_eq!(edited.metadata.generation, Some(2));
    until("entry a at generation 2, Available", WITHIN, &daemon, || async {
        entry(&pool(&tenant, "p").await, "a")
            .is_some_and(|e| e.version == Some(2) && e.status == InventoryEntryState::Available && e.attempts == 0)
    })
    .await;

    kubectl_ok(&fleet, &["scale", "-n", NS, "clusterpool/p", "--replicas=2"]).await;
    until("two ready clusters again", WITHIN, &daemon, || async {
        ready(&tenant, "p").await == 2
    })
    .await;
    let clusters = crate::pools::cds(&tenant, "p").await;
    let from_a = live(&clusters)
        .into_iter()
        .find(|cd| cdc_of(cd).as_deref() == Some("a"))
        .expect("a cluster built from a");
    assert_eq!(
        from_a
            .annotations()
            .get("pools.stackd.dev/customization-generation")
            .map(String::as_str),
        Some("2")
    );
}

/// Issue 29 items 5 and 9: an entry whose CDC does not exist is logged and announced once (not on
/// every pass), shows `Missing`; created later, it is leased.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_entry_is_announced_once_and_leased_once_created() {
    let (fleet, tenant) = setup().await;
    create_pool(&tenant, pool_json("p", 1, Some(&["ghost"]))).await;
    let daemon = daemon(&fleet, &[]);
    until("the Missing entry reported", WITHIN, &daemon, || async {
        let pool = pool(&tenant, "p").await;
        let missing = entry(&pool, "ghost").is_some_and(|e| e.status == InventoryEntryState::Missing);
        let valid = pool_condition(&pool, "InventoryValid")
            .is_some_and(|(s, _, m)| s == "False" && m.contains("Missing: ghost"));
        missing && valid && event_count(&tenant, NS, "p", "InventoryEntryMissing").await >= 1
    })
    .await;
    // More passes, no more telling.
    for _ in 0..2 {
        writes_when_woken(&fleet, &daemon, &pools(&tenant), "p", &["clusterpool"], &[]).await;
    }
    assert_eq!(event_count(&tenant, NS, "p", "InventoryEntryMissing").await, 1);
    let log = daemon.log_text();
    assert_eq!(
        log.matches("an inventory entry's ClusterDeploymentCustomization does not exist")
            .count(),
        1,
        "{log}"
    );
    let (_, note) = events(&tenant, NS, "p")
        .await
        .into_iter()
        .find(|(r, _)| r == "InventoryEntryMissing")
        .expect("the Event");
    assert!(
        note.contains("ClusterDeploymentCustomization team/ghost does not exist"),
        "{note}"
    );

    named_cdc(&tenant, "ghost").await;
    until(
        "the created CDC leased and its cluster ready",
        WITHIN,
        &daemon,
        || async {
            let pool = pool(&tenant, "p").await;
            let clusters = crate::pools::cds(&tenant, "p").await;
            ready(&tenant, "p").await == 1
                && live(&clusters).iter().any(|cd| cdc_of(cd).as_deref() == Some("ghost"))
                && entry(&pool, "ghost").is_some_and(|e| e.status == InventoryEntryState::Reserved)
                && pool_condition(&pool, "InventoryValid").is_some_and(|(s, _, _)| s == "True")
        },
    )
    .await;
}

/// Issue 29 item 9 ("Adding An Entry to the Inventory"): with `size` above what the inventory
/// backs, a new entry grows the pool; once the pool is at `maxSize` a new entry changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adding_an_entry_grows_the_pool_until_it_is_at_max_size() {
    let (fleet, tenant) = setup().await;
    for name in ["a", "b", "c"] {
        named_cdc(&tenant, name).await;
    }
    let mut spec = pool_json("p", 3, Some(&["a"]));
    spec["spec"]["maxSize"] = json!(2);
    create_pool(&tenant, spec).await;
    let daemon = daemon(&fleet, &[]);
    until("one cluster, the inventory exhausted", WITHIN, &daemon, || async {
        let capacity = pool_condition(&pool(&tenant, "p").await, "CapacityAvailable");
        ready(&tenant, "p").await == 1 && capacity.is_some_and(|(_, r, _)| r == "InventoryExhausted")
    })
    .await;
    let entries = |names: &[&str]| json!(names.iter().map(|n| json!({"name": n})).collect::<Vec<_>>());
    patch_pool(&tenant, "p", json!({"inventory": entries(&["a", "b"])})).await;
    until("the new entry grew the pool", WITHIN, &daemon, || async {
        ready(&tenant, "p").await == 2 && live(&crate::pools::cds(&tenant, "p").await).len() == 2
    })
    .await;
    let generation = patch_pool(&tenant, "p", json!({"inventory": entries(&["a", "b", "c"])})).await;
    // The pass that saw `c` decided its additions before it wrote this status.
    wait_until("the pool at maxSize with c free", WITHIN, &daemon, || async {
        let pool = pool_at(&tenant, "p", generation).await?;
        let free = entry(&pool, "c").is_some_and(|e| e.status == InventoryEntryState::Available);
        let capacity = pool_condition(&pool, "CapacityAvailable")?;
        (free && capacity.1 == "MaxCapacity").then_some(())
    })
    .await;
    writes_when_woken(&fleet, &daemon, &pools(&tenant), "p", &["clusterpool"], &[]).await;
    assert_eq!(live(&crate::pools::cds(&tenant, "p").await).len(), 2);
    assert_eq!(lease(&cdc(&tenant, "c").await), None);
}

/// Issue 29 item 9 ("Removing An Entry from the Inventory", a claimed cluster): the entry stays
/// `ToBeDeleted` while its claimed cluster lives and the CDC stays leased; once the claim and its
/// cluster are gone the entry leaves the status, the CDC is free and the pool's finalizer leaves it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_the_entry_of_a_claimed_cluster_drops_it_once_that_cluster_is_gone() {
    let (fleet, tenant) = setup().await;
    named_cdc(&tenant, "a").await;
    named_cdc(&tenant, "b").await;
    create_pool(&tenant, pool_json("p", 1, Some(&["a", "b"]))).await;
    let daemon = daemon(&fleet, &[]);
    until("a ready cluster", WITHIN, &daemon, || async {
        ready(&tenant, "p").await == 1
    })
    .await;
    create_claim(&tenant, "mine", "p", None).await;
    let claimed = wait_until("the claim assigned and the pool refilled", WITHIN, &daemon, || async {
        let claimed = claimed_namespace(&tenant, "mine").await?;
        let clusters = crate::pools::cds(&tenant, "p").await;
        let installed = live(&clusters)
            .iter()
            .filter(|cd| cd.status.as_ref().is_some_and(|s| s.installed))
            .count();
        (installed == 2 && ready(&tenant, "p").await == 1).then_some(claimed)
    })
    .await;
    let clusters = crate::pools::cds(&tenant, "p").await;
    let claimed_entry = clusters
        .iter()
        .find(|cd| cd.name_any() == claimed)
        .and_then(cdc_of)
        .expect("built from an entry");
    let other = if claimed_entry == "a" { "b" } else { "a" };
    patch_pool(&tenant, "p", json!({"inventory": [{"name": other}]})).await;
    until("the claimed cluster's entry ToBeDeleted", WITHIN, &daemon, || async {
        entry(&pool(&tenant, "p").await, &claimed_entry).is_some_and(|e| {
            e.status == InventoryEntryState::ToBeDeleted && e.cluster_deployment.as_deref() == Some(claimed.as_str())
        })
    })
    .await;
    let held = cdc(&tenant, &claimed_entry).await;
    assert_eq!(lease(&held).as_deref(), Some(claimed.as_str()));
    assert_eq!(held.finalizers(), ["pools.stackd.dev/p"]);

    claims(&tenant)
        .delete("mine", &DeleteParams::default())
        .await
        .expect("delete claim");
    until(
        "the entry gone with its cluster, the CDC free",
        WITHIN,
        &daemon,
        || async {
            let clusters = crate::pools::cds(&tenant, "p").await;
            let cdc = cdc(&tenant, &claimed_entry).await;
            clusters.iter().all(|cd| cd.name_any() != claimed)
                && entry(&pool(&tenant, "p").await, &claimed_entry).is_none()
                && reads_free(&cdc)
                && cdc.finalizers().is_empty()
        },
    )
    .await;
    assert_eq!(ready(&tenant, "p").await, 1, "the other entry's cluster stays");
}

/// Issue 29 item 8: the design documents' shapes (`inventory.ClusterDeploymentCustomizations`,
/// `path: metadata/name`) are refused with the field and what it must be, and `kubectl explain`
/// shows what to write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_seeds_shapes_are_refused_and_explain_says_what_to_write() {
    let (fleet, tenant) = setup().await;
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": "my-project"}})).expect("ns");
    Api::<Namespace>::all(tenant.clone())
        .create(&PostParams::default(), &ns)
        .await
        .expect("namespace");
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/invalid");
    let refused = |output: Output| {
        assert!(
            !output.status.success(),
            "accepted: {}",
            String::from_utf8_lossy(&output.stdout)
        );
        String::from_utf8_lossy(&output.stderr).into_owned()
    };
    let pool = examples.join("clusterpool-seed-inventory.yaml");
    let pool = pool.to_str().expect("utf-8");
    // kubectl asks for strict field validation: the mapping's key is named as unknown.
    let err = refused(kubectl(&fleet, &["apply", "-f", pool]).await);
    assert!(
        err.contains("unknown field \"spec.inventory.ClusterDeploymentCustomizations\""),
        "{err}"
    );
    // Without it (a 1.24 server does no field validation), the schema says what the field must be.
    let err = refused(kubectl(&fleet, &["create", "--validate=false", "-f", pool]).await);
    assert!(
        err.contains("spec.inventory: Invalid value") && err.contains("must be of type array"),
        "{err}"
    );
    let cdc = examples.join("cdc-seed-verbatim.yaml");
    let err = refused(kubectl(&fleet, &["apply", "-f", cdc.to_str().expect("utf-8")]).await);
    assert!(
        err.contains("spec.installConfigPatches[0].path") && err.contains("should match '^/'"),
        "{err}"
    );
    // kubectl wraps descriptions at its own width: compare words, not lines.
    let explain = |field: &'static str| {
        let fleet = &fleet;
        async move {
            let text = kubectl_ok(fleet, &["explain", field]).await;
            text.split_whitespace().collect::<Vec<_>>().join(" ")
        }
    };
    let explained = explain("clusterpool.spec.inventory").await;
    for text in [
        "inventory: - name: foo-cluster-deployment-customization - name: bar-cluster-deployment-customization",
        "not the design document's `inventory: {ClusterDeploymentCustomizations: [...]}`",
    ] {
        assert!(explained.contains(text), "{text} in\n{explained}");
    }
    let explained = explain("cdc.spec.installConfigPatches").await;
    for text in [
        "installConfigPatches: - op: replace path: /metadata/name value: foo",
        "`path: metadata/name` is refused",
    ] {
        assert!(explained.contains(text), "{text} in\n{explained}");
    }
    let explained = explain("cdc.spec.installConfigPatches.path").await;
    assert!(
        explained.contains("write `/metadata/name`, not `metadata/name`"),
        "{explained}"
    );
}
