//! The tenant is untrusted (DESIGN.md §8, "References"; issue 16): a pool counts, hands out, repairs
//! and deletes only the ClusterDeployments it created, proved by the namespace it created for each
//! (labelled with the pool, annotated with its uid), never by `spec.clusterPoolRef` or copied
//! labels; and it deletes only namespaces it created. And its blast radius is bounded (§8, issue
//! 28): patch bombs, namespaces holding too many pools, installers running on or relabelling their
//! output. Each attack runs through the daemon binary against embedded host and tenant servers, as
//! a tenant user could perform it.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use stackd::api::inventory::BareMetalAsset;
use stackd::api::pools::{ClusterDeployment, ClusterHost, ClusterPool, HostRole};
use stackd::embedded::controller_manager::{ImageMatch, JobContext, JobOutcome};

use crate::harness::{Fleet, holds_for, until, wait_until};
use crate::pools::{
    INSTALLER, NS, WITHIN, cds, claimed_namespace, claims, create_claim, create_pool, daemon, events, lease, named_cdc,
    pool, pool_json, pool_namespaces, pools, ready, setup,
};

const POOL_NAMESPACE_LABEL: &str = "pools.stackd.dev/clusterpool-namespace";
const POOL_NAME_LABEL: &str = "pools.stackd.dev/clusterpool-name";
const POOL_UID_ANNOTATION: &str = "pools.stackd.dev/clusterpool-uid";

/// A namespace a tenant user may write in (an admin made it), with what a cluster needs to install.
async fn user_namespace(tenant: &Client, name: &str) {
    create_namespace(tenant, json!({"metadata": {"name": name}})).await;
    let secrets: Api<Secret> = Api::namespaced(tenant.clone(), name);
    for secret in [
        json!({"metadata": {"name": "creds"}, "stringData": {"username": "u", "password": "p"}}),
        json!({"metadata": {"name": "pull"}, "stringData": {".dockerconfigjson": "{}"}}),
        json!({"metadata": {"name": "install-config"}, "stringData": {"install-config.yaml": "apiVersion: v1\n"}}),
    ] {
        let secret: Secret = serde_json::from_value(secret).expect("secret");
        secrets.create(&PostParams::default(), &secret).await.expect("secret");
    }
}

async fn create_namespace(tenant: &Client, namespace: Value) -> Namespace {
    let namespace: Namespace = serde_json::from_value(namespace).expect("namespace");
    Api::<Namespace>::all(tenant.clone())
        .create(&PostParams::default(), &namespace)
        .await
        .expect("create namespace")
}

/// A ClusterDeployment made by hand in `namespace`, naming pool `pool` of namespace `team` and
/// carrying the labels a pool puts on its clusters: it installs from the Secrets of
/// [`user_namespace`].
fn hand_made_cluster(namespace: &str, name: &str, pool: &str) -> ClusterDeployment {
    serde_json::from_value(json!({
        "apiVersion": "pools.stackd.dev/v1alpha1", "kind": "ClusterDeployment",
        "metadata": {"name": name, "namespace": namespace,
            "labels": {POOL_NAMESPACE_LABEL: NS, POOL_NAME_LABEL: pool}},
        "spec": {
            "clusterName": name,
            "baseDomain": "example.com",
            "platform": {"vsphere": {"credentialsSecretRef": {"name": "creds"},
                "vCenter": "vc.example.com", "datacenter": "dc1", "defaultDatastore": "ds1"}},
            "pullSecretRef": {"name": "pull"},
            "provisioning": {"installConfigSecretRef": {"name": "install-config"}, "installerImage": INSTALLER},
            "clusterPoolRef": {"namespace": NS, "poolName": pool},
        },
    }))
    .expect("cluster deployment")
}

async fn create_cluster(tenant: &Client, cd: &ClusterDeployment) -> ClusterDeployment {
    Api::<ClusterDeployment>::namespaced(tenant.clone(), &cd.namespace().unwrap())
        .create(&PostParams::default(), cd)
        .await
        .expect("create cluster deployment")
}

pub(crate) async fn cluster(tenant: &Client, namespace: &str, name: &str) -> Option<ClusterDeployment> {
    Api::<ClusterDeployment>::namespaced(tenant.clone(), namespace)
        .get_opt(name)
        .await
        .expect("get cluster deployment")
}

async fn namespace(tenant: &Client, name: &str) -> Option<Namespace> {
    Api::<Namespace>::all(tenant.clone())
        .get_opt(name)
        .await
        .expect("get namespace")
}

/// The clusters `pool` created: each named after a namespace the pool created.
async fn own_clusters(tenant: &Client, pool: &str) -> Vec<ClusterDeployment> {
    let mut out = Vec::new();
    for ns in pool_namespaces(tenant, pool).await {
        if let Some(cd) = cluster(tenant, &ns.name_any(), &ns.name_any()).await {
            out.push(cd);
        }
    }
    out
}

pub(crate) fn installed(cd: &ClusterDeployment) -> bool {
    cd.status.as_ref().is_some_and(|s| s.installed)
}

fn unclaimed_and_ready(pool: &ClusterPool) -> (i32, i32) {
    pool.status.as_ref().map_or((0, 0), |s| (s.size, s.ready))
}

/// True when a `NotPoolMember` warning on `name` in `namespace` names `pool` and says `detail`.
async fn refused_with(tenant: &Client, namespace: &str, name: &str, pool: &str, detail: &str) -> bool {
    events(tenant, namespace, name)
        .await
        .iter()
        .any(|(reason, note)| reason == "NotPoolMember" && note.contains(pool) && note.contains(detail))
}

/// A user in namespace `evil` points a ClusterDeployment of their own (named after their namespace,
/// with the pool's labels) at team's pool. The pool creates its own cluster anyway, never counts,
/// hands out, scales away or deletes theirs, says why on it, and leaves their namespace alone when
/// the pool itself is deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_from_another_namespace_naming_a_pool_is_never_counted_claimed_or_deleted() {
    let (fleet, tenant) = setup().await;
    user_namespace(&tenant, "evil").await;
    // Older than every pool cluster: the first a claim would get if the pool trusted it.
    let foreign = create_cluster(&tenant, &hand_made_cluster("evil", "evil", "p")).await;
    create_pool(&tenant, pool_json("p", 1, None)).await;
    let daemon = daemon(&fleet, &[]);

    until("the hand-made cluster installed", WITHIN, &daemon, || async {
        cluster(&tenant, "evil", "evil").await.is_some_and(|cd| installed(&cd))
    })
    .await;
    until("the pool's own cluster ready", WITHIN, &daemon, || async {
        let own = own_clusters(&tenant, "p").await;
        own.len() == 1 && own.iter().all(installed) && ready(&tenant, "p").await == 1
    })
    .await;
    until(
        "a NotPoolMember warning on the hand-made cluster",
        WITHIN,
        &daemon,
        || async {
            refused_with(
                &tenant,
                "evil",
                "evil",
                "ClusterPool team/p",
                "namespace evil was not created by that pool",
            )
            .await
        },
    )
    .await;
    assert_eq!(unclaimed_and_ready(&pool(&tenant, "p").await), (1, 1));
    // Installed: the ClusterDeployment controller has nothing left to write on it.
    let settled = cluster(&tenant, "evil", "evil").await.unwrap();
    let version = settled.resource_version();
    assert_eq!(settled.uid(), foreign.uid());

    // A claim gets the pool's own cluster, and the pool refills with its own.
    create_claim(&tenant, "c", "p", None).await;
    until("the claim assigned", WITHIN, &daemon, || async {
        claimed_namespace(&tenant, "c").await.is_some()
    })
    .await;
    let claimed = claimed_namespace(&tenant, "c").await.unwrap();
    assert_ne!(claimed, "evil");
    assert!(
        own_clusters(&tenant, "p")
            .await
            .iter()
            .any(|cd| cd.name_any() == claimed)
    );
    until("the pool refilled with its own cluster", WITHIN, &daemon, || async {
        let own = own_clusters(&tenant, "p").await;
        own.len() == 2 && own.iter().all(installed) && ready(&tenant, "p").await == 1
    })
    .await;
    assert_eq!(unclaimed_and_ready(&pool(&tenant, "p").await), (1, 1));

    // Scaled to zero, the pool deletes its unclaimed cluster, not the hand-made one.
    pools(&tenant)
        .patch(
            "p",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"size": 0}})),
        )
        .await
        .expect("scale");
    until("the pool's unclaimed cluster deleted", WITHIN, &daemon, || async {
        unclaimed_and_ready(&pool(&tenant, "p").await) == (0, 0) && own_clusters(&tenant, "p").await.len() == 1
    })
    .await;
    let after_scale = cluster(&tenant, "evil", "evil").await.expect("still there");
    assert_eq!(after_scale.resource_version(), version, "untouched by the pool");

    // Deleting the claim and the pool deletes the pool's clusters; the hand-made one and its
    // namespace stay, and do not hold up the pool's deletion.
    claims(&tenant)
        .delete("c", &DeleteParams::default())
        .await
        .expect("delete claim");
    pools(&tenant)
        .delete("p", &DeleteParams::default())
        .await
        .expect("delete pool");
    until("the pool and its clusters gone", WITHIN, &daemon, || async {
        pools(&tenant).get_opt("p").await.unwrap().is_none() && own_clusters(&tenant, "p").await.is_empty()
    })
    .await;
    let survivor = cluster(&tenant, "evil", "evil").await.expect("still there");
    assert_eq!(survivor.resource_version(), version);
    assert!(survivor.metadata.deletion_timestamp.is_none());
    assert!(survivor.spec.cluster_pool_ref.unwrap().claim_name.is_none());
    let evil = namespace(&tenant, "evil").await.expect("namespace evil");
    assert!(evil.metadata.deletion_timestamp.is_none());
}

/// Someone who may edit a pool cluster points its reference at another pool. The other pool neither
/// adopts it (no count, no claim, no deletion as excess) nor hides it: it says why on the cluster.
/// Its own pool stops counting it and builds a replacement, but keeps its namespace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn editing_a_clusters_pool_reference_does_not_move_it_to_another_pool() {
    let (fleet, tenant) = setup().await;
    create_pool(&tenant, pool_json("p", 1, None)).await;
    create_pool(&tenant, pool_json("q", 0, None)).await;
    let daemon = daemon(&fleet, &[]);
    until("p's cluster ready", WITHIN, &daemon, || async {
        ready(&tenant, "p").await == 1
    })
    .await;
    let edited = own_clusters(&tenant, "p").await.remove(0).name_any();
    // Old enough that p would reap its namespace if it thought it empty.
    until(
        "the cluster's namespace older than the minimum lease age",
        WITHIN,
        &daemon,
        || async {
            let ns = namespace(&tenant, &edited).await.unwrap();
            let created = ns.metadata.creation_timestamp.unwrap().0;
            jiff::Timestamp::now().duration_since(created) >= jiff::SignedDuration::from_secs(3)
        },
    )
    .await;

    let written = Api::<ClusterDeployment>::namespaced(tenant.clone(), &edited)
        .patch(
            &edited,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"clusterPoolRef": {"poolName": "q"}}})),
        )
        .await
        .expect("edit the reference");
    let version = written.resource_version();

    until(
        "a NotPoolMember warning from q on the edited cluster",
        WITHIN,
        &daemon,
        || async {
            refused_with(
                &tenant,
                &edited,
                &edited,
                "ClusterPool team/q",
                "was not created by that pool",
            )
            .await
        },
    )
    .await;
    until(
        "p replaced it with a ready cluster of its own",
        WITHIN,
        &daemon,
        || async {
            let own = own_clusters(&tenant, "p").await;
            let others: Vec<_> = own.iter().filter(|cd| cd.name_any() != edited).collect();
            others.len() == 1 && installed(others[0]) && ready(&tenant, "p").await == 1
        },
    )
    .await;
    assert_eq!(
        unclaimed_and_ready(&pool(&tenant, "q").await),
        (0, 0),
        "q counts nothing"
    );

    // A claim on q gets a cluster q builds, not the edited one.
    create_claim(&tenant, "cq", "q", None).await;
    until("q's claim assigned", WITHIN, &daemon, || async {
        claimed_namespace(&tenant, "cq").await.is_some()
    })
    .await;
    let claimed = claimed_namespace(&tenant, "cq").await.unwrap();
    assert_ne!(claimed, edited);
    assert!(
        own_clusters(&tenant, "q")
            .await
            .iter()
            .any(|cd| cd.name_any() == claimed)
    );

    let after = cluster(&tenant, &edited, &edited).await.expect("not deleted");
    assert_eq!(after.resource_version(), version, "untouched by either pool");
    assert!(after.metadata.deletion_timestamp.is_none());
    let ns = namespace(&tenant, &edited).await.expect("its namespace");
    assert!(
        ns.metadata.deletion_timestamp.is_none(),
        "never reaped while it holds a cluster"
    );
}

/// A user copies a pool cluster (name, labels, annotations with the pool's uid, spec with its
/// clusterPoolRef and customization, plus a host of the real cluster's) into their own namespace.
/// The pool does not count it or act on it, and deleting the copy releases neither the real
/// cluster's customization nor its host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_of_a_pool_cluster_with_forged_markers_is_ignored_and_its_deletion_releases_nothing() {
    let (fleet, tenant) = setup().await;
    named_cdc(&tenant, "a").await;
    named_cdc(&tenant, "b").await;
    create_pool(&tenant, pool_json("p", 1, Some(&["a", "b"]))).await;
    let daemon = daemon(&fleet, &[]);
    until("p's cluster ready", WITHIN, &daemon, || async {
        ready(&tenant, "p").await == 1
    })
    .await;
    let real = own_clusters(&tenant, "p").await.remove(0);
    let real_name = real.name_any();
    let entry = real
        .spec
        .cluster_pool_ref
        .as_ref()
        .and_then(|r| r.cluster_deployment_customization.clone())
        .expect("built from a customization")
        .name;
    assert_eq!(
        lease(&crate::pools::cdc(&tenant, &entry).await).as_deref(),
        Some(real_name.as_str())
    );
    assert!(real.annotations().contains_key(POOL_UID_ANNOTATION));

    // A bare-metal host of team's assigned to the real cluster (the copy lists it among its hosts).
    let asset: BareMetalAsset = serde_json::from_value(json!({
        "apiVersion": "inventory.stackd.dev/v1alpha1", "kind": "BareMetalAsset",
        "metadata": {"name": "host-1", "namespace": NS},
        "spec": {"bmc": {"address": "ipmi://10.0.0.1/host-1", "credentialsName": "bmc-host-1"},
            "bootMACAddress": "00:1B:44:11:3A:B7", "role": "master", "clusterName": real_name},
    }))
    .expect("asset");
    let assets: Api<BareMetalAsset> = Api::namespaced(tenant.clone(), NS);
    assets
        .create(&PostParams::default(), &asset)
        .await
        .expect("create asset");

    user_namespace(&tenant, "evil").await;
    let mut copy = real.clone();
    copy.metadata = kube::api::ObjectMeta {
        name: real.metadata.name.clone(),
        namespace: Some("evil".into()),
        labels: real.metadata.labels.clone(),
        annotations: real.metadata.annotations.clone(),
        ..Default::default()
    };
    copy.status = None;
    copy.spec.hosts = vec![ClusterHost {
        name: "host-1".into(),
        role: HostRole::Master,
        failure_domain: None,
    }];
    create_cluster(&tenant, &copy).await;
    until("a NotPoolMember warning on the copy", WITHIN, &daemon, || async {
        refused_with(
            &tenant,
            "evil",
            &real_name,
            "ClusterPool team/p",
            "this one is in namespace evil",
        )
        .await
    })
    .await;
    // The copy's inputs are not in namespace evil: it stops there, and is written no more.
    until("the copy stopped on its missing inputs", WITHIN, &daemon, || async {
        cluster(&tenant, "evil", &real_name).await.is_some_and(|cd| {
            cd.status.as_ref().is_some_and(|s| {
                s.conditions
                    .iter()
                    .any(|c| c.type_ == "Provisioned" && c.reason == "MissingInputs")
            })
        })
    })
    .await;
    let version = cluster(&tenant, "evil", &real_name).await.unwrap().resource_version();

    // Grown by one, the pool counts exactly its own two clusters.
    pools(&tenant)
        .patch(
            "p",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"size": 2}})),
        )
        .await
        .expect("scale");
    until("p has two ready clusters of its own", WITHIN, &daemon, || async {
        own_clusters(&tenant, "p")
            .await
            .iter()
            .filter(|cd| installed(cd))
            .count()
            == 2
            && ready(&tenant, "p").await == 2
    })
    .await;
    assert_eq!(unclaimed_and_ready(&pool(&tenant, "p").await), (2, 2));
    let copy_now = cluster(&tenant, "evil", &real_name).await.expect("not deleted");
    assert_eq!(copy_now.resource_version(), version, "untouched by the pool");

    // The user deletes the copy: the real cluster keeps its customization.
    Api::<ClusterDeployment>::namespaced(tenant.clone(), "evil")
        .delete(&real_name, &DeleteParams::default())
        .await
        .expect("delete the copy");
    until("the copy gone", WITHIN, &daemon, || async {
        cluster(&tenant, "evil", &real_name).await.is_none()
    })
    .await;
    let refusal =
        format!("Released no ClusterDeploymentCustomization {entry} or bare-metal hosts of ClusterPool team/p");
    let released_nothing = events(&tenant, "evil", &real_name)
        .await
        .into_iter()
        .any(|(reason, note)| reason == "ReleaseRefused" && note.contains(&refusal));
    assert!(released_nothing, "{:?}", events(&tenant, "evil", &real_name).await);
    assert_eq!(
        lease(&crate::pools::cdc(&tenant, &entry).await).as_deref(),
        Some(real_name.as_str()),
        "still leased by the real cluster"
    );
    let host = assets.get("host-1").await.expect("asset");
    assert_eq!(
        host.spec.cluster_name.as_deref(),
        Some(real_name.as_str()),
        "still assigned"
    );
    let real_now = cluster(&tenant, &real_name, &real_name)
        .await
        .expect("the real cluster");
    assert!(real_now.metadata.deletion_timestamp.is_none());
}

/// Namespaces labelled like the pool's but not created by it (no uid, or an earlier pool's uid)
/// are never reaped, while an empty one the pool created is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_reaps_only_the_empty_namespaces_it_created() {
    let (fleet, tenant) = setup().await;
    let created = create_pool(&tenant, pool_json("p", 0, None)).await;
    let labels = json!({POOL_NAMESPACE_LABEL: NS, POOL_NAME_LABEL: "p"});
    create_namespace(&tenant, json!({"metadata": {"name": "p-lookalike", "labels": labels}})).await;
    create_namespace(
        &tenant,
        json!({"metadata": {"name": "p-earlier", "labels": labels,
            "annotations": {POOL_UID_ANNOTATION: "uid-of-an-earlier-pool-p"}}}),
    )
    .await;
    // As the pool made it for a cluster whose creation then failed.
    create_namespace(
        &tenant,
        json!({"metadata": {"name": "p-empty", "labels": labels,
            "annotations": {POOL_UID_ANNOTATION: created.uid().unwrap()}}}),
    )
    .await;
    let daemon = daemon(&fleet, &[]);
    // p-empty is the youngest: the pass that reaps it found the other two old enough as well.
    until("the pool's empty namespace reaped", WITHIN, &daemon, || async {
        namespace(&tenant, "p-empty")
            .await
            .is_none_or(|ns| ns.metadata.deletion_timestamp.is_some())
    })
    .await;
    for name in ["p-lookalike", "p-earlier"] {
        let ns = namespace(&tenant, name).await.expect("not deleted");
        assert!(ns.metadata.deletion_timestamp.is_none(), "{name} is being deleted");
    }
}

// ---------------------------------------------------------------------------------------------
// Blast radius (issue 28): the worst object one `edit` user writes costs bounded work, fails only
// its own object and never takes the daemon, another pool or another namespace down with it.

/// The address space the daemon is capped at in the patch-bomb test, as a pod's memory limit
/// would: an unbounded allocation aborts it (and spares the machine running the tests).
const DAEMON_ADDRESS_SPACE: u64 = 3 << 30;
/// The chart's memory limit: the daemon's peak stays well under it through the attack.
const CHART_MEMORY_LIMIT: u64 = 512 << 20;

fn condition_of(cdc: &stackd::api::pools::ClusterDeploymentCustomization) -> Option<(String, String, String)> {
    crate::pools::cdc_condition(cdc, "ApplySucceeded")
}

/// `add /b` then copies of `/b` into itself: 2 KiB doubled thirty times.
fn patch_bomb() -> Value {
    let mut patches = vec![json!({"op": "add", "path": "/b", "value": ["x".repeat(2048)]})];
    patches.extend((0..30).map(|_| json!({"op": "copy", "from": "/b", "path": "/b/-"})));
    Value::Array(patches)
}

/// `/a` nested 30 levels, spare mappings, then pairs of moves that nest `/a` one level deeper each.
fn deep_nesting() -> Value {
    let mut nested = json!({});
    for _ in 0..30 {
        nested = json!({ "a": nested });
    }
    let mut patches = vec![
        json!({"op": "add", "path": "/a", "value": nested}),
        json!({"op": "add", "path": "/s", "value": vec![json!({}); 45]}),
    ];
    for _ in 0..45 {
        patches.push(json!({"op": "move", "from": "/a", "path": "/s/0/a"}));
        patches.push(json!({"op": "move", "from": "/s/0", "path": "/a"}));
    }
    Value::Array(patches)
}

/// A 2 KB customization doubling the install config thirty times, and one nesting it deeper with
/// every pair of moves, are refused with the bound they pass (BrokenBySyntax, the pool's
/// InventoryValid, Events); the daemon keeps serving within its memory, the same pool fills from
/// its other entry and another pool of the namespace fills too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_patch_bomb_and_a_deep_nesting_are_refused_and_the_daemon_keeps_serving() {
    let (fleet, tenant) = setup().await;
    // More patches than stackd applies never get in.
    let many: Vec<Value> = (0..101)
        .map(|_| json!({"op": "add", "path": "/x", "value": 1}))
        .collect();
    let cdc: stackd::api::pools::ClusterDeploymentCustomization = serde_json::from_value(json!({
        "apiVersion": "pools.stackd.dev/v1alpha1", "kind": "ClusterDeploymentCustomization",
        "metadata": {"name": "many", "namespace": NS}, "spec": {"installConfigPatches": many},
    }))
    .expect("cdc");
    let refused = Api::<stackd::api::pools::ClusterDeploymentCustomization>::namespaced(tenant.clone(), NS)
        .create(&PostParams::default(), &cdc)
        .await
        .expect_err("101 patches refused by the schema");
    assert!(refused.to_string().contains("must have at most 100 items"), "{refused}");
    crate::pools::create_cdc(&tenant, "bomb", patch_bomb()).await;
    crate::pools::create_cdc(&tenant, "deep", deep_nesting()).await;
    named_cdc(&tenant, "good").await;
    create_pool(&tenant, pool_json("p", 1, Some(&["bomb", "deep", "good"]))).await;
    create_pool(&tenant, pool_json("q", 1, None)).await;
    let mut daemon = fleet.daemon_with_address_space(
        &["--lease-min-age", "2s", "--sweep-interval", "1h"],
        DAEMON_ADDRESS_SPACE,
    );

    for (name, bound) in [
        ("bomb", "larger than 1 MiB serialized"),
        ("deep", "deeper than 64 levels"),
    ] {
        until(&format!("{name} refused naming its bound"), WITHIN, &daemon, || async {
            condition_of(&crate::pools::cdc(&tenant, name).await)
                .is_some_and(|(s, r, m)| s == "False" && r == "BrokenBySyntax" && m.contains(bound))
        })
        .await;
        until(
            &format!("a BrokenBySyntax Event on {name}"),
            WITHIN,
            &daemon,
            || async {
                events(&tenant, NS, name)
                    .await
                    .iter()
                    .any(|(r, n)| r == "BrokenBySyntax" && n.contains(bound))
            },
        )
        .await;
    }
    until("both pools ready", WITHIN, &daemon, || async {
        ready(&tenant, "p").await == 1 && ready(&tenant, "q").await == 1
    })
    .await;
    let (status, _, message) = crate::pools::pool_condition(&pool(&tenant, "p").await, "InventoryValid").unwrap();
    assert_eq!(status, "False");
    assert!(message.contains("bomb") && message.contains("deep"), "{message}");
    let built_from: Vec<Option<String>> = own_clusters(&tenant, "p")
        .await
        .iter()
        .map(crate::pools::cdc_of)
        .collect();
    assert_eq!(built_from, [Some("good".to_string())]);
    for name in ["bomb", "deep"] {
        assert_eq!(
            lease(&crate::pools::cdc(&tenant, name).await),
            None,
            "{name} is not leased"
        );
    }

    assert!(daemon.is_running(), "the daemon died:\n{}", daemon.log_text());
    daemon
        .wait_for("/metrics", "stackd_tenant_up{tenant=\"acme\"} 1", WITHIN)
        .await;
    let peak = daemon.peak_resident_bytes().expect("the daemon's memory");
    assert!(peak < CHART_MEMORY_LIMIT, "peak resident memory {} MiB", peak >> 20);
}

/// With `--namespace-max-pools 2`, the newest pool of a namespace holding three is refused
/// (`CapacityAvailable=False`, TooManyPools, an Event) and creates nothing, while the older two and
/// the pools of another namespace fill; once an older pool is deleted, it fills.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pools_past_the_namespace_limit_are_refused_and_create_nothing() {
    let (fleet, tenant) = setup().await;
    pool_namespace(&tenant, "other").await;
    for name in ["a", "b", "c"] {
        create_pool(&tenant, pool_json(name, 1, None)).await;
    }
    for name in ["x", "y"] {
        let mut other = pool_json(name, 1, None);
        other["metadata"]["namespace"] = json!("other");
        create_pool_in(&tenant, "other", other).await;
    }
    let daemon = daemon(&fleet, &["--namespace-max-pools", "2"]);
    until("the newest pool refused", WITHIN, &daemon, || async {
        crate::pools::pool_condition(&pool(&tenant, "c").await, "CapacityAvailable").is_some_and(|(s, r, m)| {
            s == "False" && r == "TooManyPools" && m.contains("at most 2 per namespace (--namespace-max-pools)")
        })
    })
    .await;
    until("a TooManyPools Event on it", WITHIN, &daemon, || async {
        events(&tenant, NS, "c").await.iter().any(|(r, _)| r == "TooManyPools")
    })
    .await;
    until(
        "the older pools and another namespace's ready",
        WITHIN,
        &daemon,
        || async {
            ready(&tenant, "a").await == 1 && ready(&tenant, "b").await == 1 && other_ready(&tenant, &["x", "y"]).await
        },
    )
    .await;
    // Judged after one more pass over the refused pool, not a guessed pause.
    crate::pools::writes_when_woken(&fleet, &daemon, &pools(&tenant), "c", &["clusterpool"], &[]).await;
    assert!(cds(&tenant, "c").await.is_empty(), "the refused pool created a cluster");
    assert!(
        pool_namespaces(&tenant, "c").await.is_empty(),
        "the refused pool created a namespace"
    );

    pools(&tenant)
        .delete("a", &DeleteParams::default())
        .await
        .expect("delete a");
    until(
        "the refused pool fills once an older one goes",
        WITHIN,
        &daemon,
        || async { ready(&tenant, "c").await == 1 },
    )
    .await;
}

/// A namespace a user may write in, with the Secrets `pool_json` names.
async fn pool_namespace(tenant: &Client, name: &str) {
    create_namespace(tenant, json!({"metadata": {"name": name}})).await;
    let secrets: Api<Secret> = Api::namespaced(tenant.clone(), name);
    for secret in [
        json!({"metadata": {"name": "creds"}, "stringData": {"username": "u", "password": "p"}}),
        json!({"metadata": {"name": "pull"}, "stringData": {".dockerconfigjson": "{}"}}),
        json!({"metadata": {"name": "template"}, "stringData": {"install-config.yaml": "apiVersion: v1\n"}}),
    ] {
        let secret: Secret = serde_json::from_value(secret).expect("secret");
        secrets.create(&PostParams::default(), &secret).await.expect("secret");
    }
}

async fn create_pool_in(tenant: &Client, namespace: &str, pool: Value) {
    let pool: ClusterPool = serde_json::from_value(pool).expect("pool");
    Api::<ClusterPool>::namespaced(tenant.clone(), namespace)
        .create(&PostParams::default(), &pool)
        .await
        .expect("create pool");
}

async fn other_ready(tenant: &Client, names: &[&str]) -> bool {
    let api = Api::<ClusterPool>::namespaced(tenant.clone(), "other");
    for name in names {
        let ready = api.get(name).await.ok().and_then(|p| p.status).map_or(0, |s| s.ready);
        if ready != 1 {
            return false;
        }
    }
    true
}

pub(crate) const HOST_NAMESPACE: &str = "tenant-acme-controllers";

/// A pool of one cluster whose installer runs `image`.
pub(crate) fn installer_pool(name: &str, image: &str) -> Value {
    let mut pool = pool_json(name, 1, None);
    pool["spec"]["installerImage"] = json!(image);
    pool
}

/// The name of the first cluster of `pool`, once there is one.
pub(crate) async fn first_cluster(tenant: &Client, pool: &str, daemon: &crate::harness::Daemon) -> String {
    let cd = wait_until("the pool's cluster", WITHIN, daemon, || async {
        own_clusters(tenant, pool).await.into_iter().next()
    })
    .await;
    cd.name_any()
}
const SLOW_INSTALLER: &str = "quay.io/example/slow-installer:1";

/// With `--installer-deadline 2s`, an installer that runs on is stopped by Kubernetes at the Job's
/// `activeDeadlineSeconds` and counted as a failed install attempt that says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_installer_past_its_deadline_is_stopped_and_counted_as_a_failed_attempt() {
    let (fleet, tenant) = setup().await;
    fleet
        .host()
        .runners()
        .register(ImageMatch::Exact(SLOW_INSTALLER.into()), |_: &JobContext| {
            JobOutcome::success("still installing\n").after(Duration::from_secs(600))
        });
    let mut slow = installer_pool("slow", SLOW_INSTALLER);
    // Attempts end every 2 s: a low limit would have the pool replace the cluster within seconds,
    // racing the checks below of the cluster's attempts.
    slow["spec"]["installAttemptsLimit"] = json!(100);
    create_pool(&tenant, slow).await;
    let daemon = daemon(&fleet, &["--installer-deadline", "2s"]);
    let name = first_cluster(&tenant, "slow", &daemon).await;
    let jobs: Api<Job> = Api::namespaced(fleet.host_client.clone(), HOST_NAMESPACE);
    let first = format!("{name}.{name}-install-0");
    let job = wait_until("the first installer Job", WITHIN, &daemon, || async {
        jobs.get_opt(&first).await.ok().flatten()
    })
    .await;
    assert_eq!(job.spec.as_ref().and_then(|s| s.active_deadline_seconds), Some(2));

    until("the attempt counted as failed, saying why", WITHIN, &daemon, || async {
        cluster(&tenant, &name, &name).await.is_some_and(|cd| {
            let status = cd.status.unwrap_or_default();
            status.install_restarts >= 1
                && status.conditions.iter().any(|c| {
                    c.type_ == "Provisioned"
                        && c.reason == "InstallFailed"
                        && c.message.contains("ran longer than the installer deadline")
                })
        })
    })
    .await;
    until("an InstallFailed Event on the cluster", WITHIN, &daemon, || async {
        events(&tenant, &name, &name)
            .await
            .iter()
            .any(|(r, n)| r == "InstallFailed" && n.contains("installer deadline"))
    })
    .await;
    // An ended attempt's Job goes when the next one starts (every 2 s here): look for whichever
    // later attempt is running, not for one by name.
    let attempt = format!("{name}.{name}-install-");
    let retried = wait_until("a later attempt's Job", WITHIN, &daemon, || async {
        let listed = jobs.list(&Default::default()).await.ok()?;
        listed
            .items
            .into_iter()
            .find(|job| job.name_any().starts_with(&attempt) && job.name_any() != first)
    })
    .await;
    assert_eq!(retried.spec.and_then(|s| s.active_deadline_seconds), Some(2));
}

const SLY_INSTALLER: &str = "quay.io/example/sly-installer:1";

/// The installer [`SLY_INSTALLER`] plays: it installs like the sample installer, then strips the
/// labels and annotations of its output Secret with its own token's rights (out of the cache's,
/// the sweep's and cleanup's sight). Returns how many destroy Jobs it ran.
fn sly_installer(fleet: &Fleet) -> Arc<AtomicUsize> {
    let destroyed = Arc::new(AtomicUsize::new(0));
    let counted = destroyed.clone();
    let host = fleet.host_client.clone();
    fleet
        .host()
        .runners()
        .register(ImageMatch::Exact(SLY_INSTALLER.into()), move |ctx: &JobContext| {
            if ctx.args.iter().any(|a| a == "destroy") {
                counted.fetch_add(1, Ordering::SeqCst);
                return JobOutcome::success("destroyed\n");
            }
            let outcome = stackd::embedded::samples::create_cluster(ctx);
            let (Some(ns), Some(name)) = (ctx.env("STACKD_OUTPUT_NAMESPACE"), ctx.env("STACKD_OUTPUT_SECRET")) else {
                return JobOutcome::failure(1, "no output secret\n");
            };
            let secrets: Api<Secret> = Api::namespaced(host.clone(), ns);
            let strip = json!({"metadata": {"labels": null, "annotations": null}});
            let stripped = tokio::runtime::Handle::current().block_on(secrets.patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(&strip),
            ));
            match stripped {
                Ok(_) => outcome,
                Err(e) => JobOutcome::failure(1, format!("{e}\n")),
            }
        });
    destroyed
}

/// An installer that strips its output Secret's labels: stackd proves the Secret is the one it made
/// (by uid), puts its labels back (an Event on the cluster says so) and only then reads it; when
/// the cluster goes, the destroy Job gets the installer's state and the Secret is deleted by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_installer_relabelling_its_output_is_restored_before_it_is_read_and_cleaned_up() {
    let (fleet, tenant) = setup().await;
    let destroyed = sly_installer(&fleet);
    create_pool(&tenant, installer_pool("sly", SLY_INSTALLER)).await;
    let daemon = daemon(&fleet, &[]);
    let cd = wait_until("the cluster installed", WITHIN, &daemon, || async {
        own_clusters(&tenant, "sly").await.into_iter().find(installed)
    })
    .await;
    let name = cd.name_any();
    let host_secrets: Api<Secret> = Api::namespaced(fleet.host_client.clone(), HOST_NAMESPACE);
    let output_name = format!("{name}.{name}-output");
    let output = host_secrets.get(&output_name).await.expect("the output Secret");
    let labels = output.labels();
    assert_eq!(
        labels.get("app.kubernetes.io/managed-by").map(String::as_str),
        Some("stackd")
    );
    assert_eq!(
        labels.get("stackd.dev/parent-name").map(String::as_str),
        Some(name.as_str())
    );
    // Read only once restored: the restore's Event came before the installation's.
    let seen = event_versions(&tenant, &name).await;
    let restored = seen
        .iter()
        .find(|(r, _)| r == "InstallerOutputRestored")
        .map(|(_, v)| *v);
    let installed_at = seen.iter().find(|(r, _)| r == "Installed").map(|(_, v)| *v);
    assert!(
        restored.is_some() && restored < installed_at,
        "{seen:?}\n{}",
        daemon.log_text()
    );

    // The installer strips the labels again; the cluster goes: destroyed with the installer's
    // state, and the Secret deleted by its name.
    let strip = json!({"metadata": {"labels": null}});
    host_secrets
        .patch(&output_name, &PatchParams::default(), &Patch::Merge(&strip))
        .await
        .expect("strip");
    pools(&tenant)
        .patch(
            "sly",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"size": 0}})),
        )
        .await
        .expect("scale");
    until("the cluster and its output Secret gone", WITHIN, &daemon, || async {
        cluster(&tenant, &name, &name).await.is_none() && host_secrets.get_opt(&output_name).await.unwrap().is_none()
    })
    .await;
    assert_eq!(destroyed.load(Ordering::SeqCst), 1, "the destroy Job ran once");
}

const SILENT_INSTALLER: &str = "quay.io/example/silent-installer:1";

/// An installer image (the tenant's choice) that succeeds without writing its output leaves the
/// cluster waiting for it, and the wait costs the host no read: the output is read from the server
/// only once it is complete, and until then from the cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_installer_that_writes_no_output_costs_the_host_no_reads_while_its_cluster_waits() {
    let (fleet, tenant) = setup().await;
    fleet
        .host()
        .runners()
        .register(ImageMatch::Exact(SILENT_INSTALLER.into()), |_: &JobContext| {
            JobOutcome::success("done, wrote nothing\n")
        });
    create_pool(&tenant, installer_pool("silent", SILENT_INSTALLER)).await;
    let daemon = daemon(&fleet, &[]);
    let name = first_cluster(&tenant, "silent", &daemon).await;
    let jobs: Api<Job> = Api::namespaced(fleet.host_client.clone(), HOST_NAMESPACE);
    let job = format!("{name}.{name}-install-0");
    until("the installer Job succeeded", WITHIN, &daemon, || async {
        let job = jobs.get_opt(&job).await.ok().flatten();
        job.and_then(|j| j.status?.succeeded).unwrap_or(0) > 0
    })
    .await;
    // Its cluster retries every 5 s: two retries and more, and not one host read of a Secret.
    let secret_reads = || {
        fleet
            .host()
            .counters()
            .get(stackd::embedded::Verb::Get, "secrets", Some(HOST_NAMESPACE))
    };
    let before = secret_reads();
    holds_for(
        "no host Secret read, the cluster not installed",
        Duration::from_secs(12),
        &daemon,
        || async {
            let installed = cluster(&tenant, &name, &name)
                .await
                .is_some_and(|cd| cd.status.is_some_and(|s| s.installed));
            secret_reads() == before && !installed
        },
    )
    .await;
}

/// `(reason, resourceVersion)` of the Events on cluster `name`, in the order they were written (the
/// embedded server's resourceVersions count up).
async fn event_versions(tenant: &Client, name: &str) -> Vec<(String, u64)> {
    let api: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(tenant.clone(), name);
    let mut seen: Vec<(String, u64)> = api
        .list(&Default::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .map(|e| {
            let version = e.metadata.resource_version.unwrap_or_default().parse().unwrap_or(0);
            (e.reason.unwrap_or_default(), version)
        })
        .collect();
    seen.sort_by_key(|(_, v)| *v);
    seen
}

/// 100 patches that add a 400 KiB subtree and copy it and drop the copy 49 times, then fail their
/// last `test` (the customization stays unleased, so every edit would be applied in full again).
fn heavy_patches(edit: &str) -> Value {
    let big: Vec<String> = (0..40).map(|i| format!("{i}{}", "x".repeat(10 * 1024))).collect();
    let mut patches = vec![json!({"op": "add", "path": "/big", "value": big})];
    for _ in 0..49 {
        patches.push(json!({"op": "copy", "from": "/big", "path": "/c"}));
        patches.push(json!({"op": "remove", "path": "/c"}));
    }
    patches.push(json!({"op": "test", "path": "/metadata/name", "value": edit}));
    Value::Array(patches)
}

/// The generation the CDC's `ApplySucceeded=False/BrokenBySyntax` was reached at, if it is so.
async fn broken_at(tenant: &Client, name: &str) -> Option<i64> {
    let cdc = crate::pools::cdc(tenant, name).await;
    let conditions = cdc.status.map(|s| s.conditions).unwrap_or_default();
    let broken = conditions
        .iter()
        .find(|c| c.type_ == "ApplySucceeded" && c.reason == "BrokenBySyntax")?;
    broken.observed_generation
}

/// Issue 51: every bound on size holds for one application of a customization's patches, but each
/// edit paid for a full one again (8 such CDCs edited 4 times a second took 1.2 cores). A namespace
/// past its share of the work of applying patches waits, its pool saying so
/// (`CapacityAvailable=False`/NamespacePatchShareUsed and an Event); the edit is applied once the
/// share is back, and another namespace's pool fills from its inventory meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_editing_heavy_customizations_waits_for_its_patch_share_and_others_do_not() {
    let (fleet, tenant) = setup().await;
    crate::pools::create_cdc(&tenant, "heavy", heavy_patches("first")).await;
    create_pool(&tenant, pool_json("p", 1, Some(&["heavy"]))).await;
    pool_namespace(&tenant, "other").await;
    let daemon = daemon(&fleet, &[]);
    until("the heavy customization refused", WITHIN, &daemon, || async {
        broken_at(&tenant, "heavy").await == Some(1)
    })
    .await;

    let edit = json!({"spec": {"installConfigPatches": heavy_patches("second")}});
    crate::pools::cdcs(&tenant)
        .patch("heavy", &PatchParams::default(), &Patch::Merge(&edit))
        .await
        .expect("edit heavy");
    until("the pool waits for its namespace's share", WITHIN, &daemon, || async {
        crate::pools::pool_condition(&pool(&tenant, "p").await, "CapacityAvailable").is_some_and(|(s, r, m)| {
            s == "False" && r == "NamespacePatchShareUsed" && m.contains("Namespace team used its share")
        })
    })
    .await;
    until("an Event says so", WITHIN, &daemon, || async {
        events(&tenant, NS, "p")
            .await
            .iter()
            .any(|(r, _)| r == "NamespacePatchShareUsed")
    })
    .await;

    let mut victim = pool_json("v", 1, Some(&["light"]));
    victim["metadata"]["namespace"] = json!("other");
    let light: stackd::api::pools::ClusterDeploymentCustomization = serde_json::from_value(json!({
        "apiVersion": "pools.stackd.dev/v1alpha1", "kind": "ClusterDeploymentCustomization",
        "metadata": {"name": "light", "namespace": "other"},
        "spec": {"installConfigPatches": [{"op": "replace", "path": "/metadata/name", "value": "light"}]},
    }))
    .expect("cdc");
    Api::<stackd::api::pools::ClusterDeploymentCustomization>::namespaced(tenant.clone(), "other")
        .create(&PostParams::default(), &light)
        .await
        .expect("light");
    create_pool_in(&tenant, "other", victim).await;
    until(
        "another namespace's pool fills from its inventory",
        WITHIN,
        &daemon,
        || other_ready(&tenant, &["v"]),
    )
    .await;
    until(
        "the edit is applied once the share is back",
        WITHIN,
        &daemon,
        || async { broken_at(&tenant, "heavy").await == Some(2) },
    )
    .await;
}
