//! The tenant is untrusted (DESIGN.md §8, "References" and "Blast radius"; issue 28), bare-metal
//! inventory: a BareMetalAsset reaches only clusters its own namespace's pools created (or a
//! ClusterDeployment in its own namespace), whatever its `clusterName` or a forged delivery record
//! say; and a managed cluster that stalls holds no controller slot while it is waited on. Each
//! attack runs through the daemon binary against embedded host, tenant and managed-cluster
//! servers, as a tenant user could perform it.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use stackd::api::inventory::BareMetalAsset;
use stackd::embedded::Verb;

use crate::harness::{holds_for, until, wait_until};
use crate::inventory::{
    METAL_IMAGE, NS, WITHIN, asset_condition, assets, baremetal_pool, bmh, cds, cluster_installer, create_pool,
    events_say, lab_asset, managed_cluster, metal_installer, remote_secret, setup,
};

/// A namespace of the attacker's, with a BMC credentials Secret of theirs.
async fn attacker_namespace(tenant: &Client, name: &str) {
    let namespace: Namespace = serde_json::from_value(json!({"metadata": {"name": name}})).expect("ns");
    Api::<Namespace>::all(tenant.clone())
        .create(&PostParams::default(), &namespace)
        .await
        .expect("namespace");
    let secret: Secret = serde_json::from_value(json!({"metadata": {"name": "bmc-evil"},
        "stringData": {"username": "evil", "password": "evil"}}))
    .expect("secret");
    Api::<Secret>::namespaced(tenant.clone(), name)
        .create(&PostParams::default(), &secret)
        .await
        .expect("secret");
}

/// An asset in `namespace` with the attacker's BMC address, and `metadata` merged in.
async fn attacker_asset(tenant: &Client, namespace: &str, name: &str, spec: Value, metadata: Value) {
    let mut asset = json!({
        "apiVersion": "inventory.stackd.dev/v1alpha1", "kind": "BareMetalAsset",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"bmc": {"address": "redfish://attacker.example/evil", "credentialsName": "bmc-evil"},
            "bootMACAddress": "00:1B:44:11:3A:EE"},
    });
    for (k, v) in spec.as_object().cloned().unwrap_or_default() {
        asset["spec"][k] = v;
    }
    for (k, v) in metadata.as_object().cloned().unwrap_or_default() {
        asset["metadata"][k] = v;
    }
    let asset: BareMetalAsset = serde_json::from_value(asset).expect("asset");
    Api::<BareMetalAsset>::namespaced(tenant.clone(), namespace)
        .create(&PostParams::default(), &asset)
        .await
        .expect("create asset");
}

fn in_namespace(tenant: &Client, namespace: &str) -> Api<BareMetalAsset> {
    Api::namespaced(tenant.clone(), namespace)
}

/// A user of namespace `evil` names the cluster of namespace `team`'s pool in an asset of theirs
/// (their BMC address), and forges a delivery record (annotation and finalizer) on an asset named
/// like the victim's host. Nothing is created on, or removed from, the victim's managed cluster;
/// both assets say why; the victim's own assets still deliver.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_asset_of_another_namespace_neither_delivers_to_nor_detaches_from_a_victims_cluster() {
    let (fleet, tenant) = setup().await;
    let (managed, remote) = managed_cluster().await;
    metal_installer(&fleet, &managed);
    lab_asset(&tenant, "m1", Some("master"), None).await;
    let mut metal = baremetal_pool("metal", 1, 1, 0);
    metal["spec"]["installerImage"] = json!(METAL_IMAGE);
    create_pool(&tenant, metal).await;
    let daemon = crate::inventory::daemon(&fleet);
    until("the victim's host delivered", WITHIN, &daemon, || async {
        bmh(&remote, "m1").await.is_some() && remote_secret(&remote, "m1").await.is_some()
    })
    .await;
    let victim = cds(&tenant, "metal").await.remove(0).name_any();
    let host = bmh(&remote, "m1").await.unwrap();

    attacker_namespace(&tenant, "evil").await;
    attacker_asset(&tenant, "evil", "intruder", json!({"clusterName": victim}), json!({})).await;
    let forged = json!({"annotations": {"inventory.stackd.dev/delivered-to": victim},
        "finalizers": ["inventory.stackd.dev/delivery"]});
    attacker_asset(&tenant, "evil", "m1", json!({}), forged).await;

    let refusal = "which no ClusterPool of namespace evil created".to_string();
    until(
        "the intruder told why nothing is delivered",
        WITHIN,
        &daemon,
        || async {
            let intruder = in_namespace(&tenant, "evil").get("intruder").await.unwrap();
            asset_condition(&intruder, "ClusterDeploymentFound")
                .is_some_and(|(s, r, m)| s == "False" && r == "ForeignCluster" && m.contains(&refusal))
        },
    )
    .await;
    until("a ForeignCluster Event on the intruder", WITHIN, &daemon, || async {
        events_say(&tenant, "evil", "intruder", "ForeignCluster", &refusal).await
    })
    .await;
    until("the forged record dropped, saying why", WITHIN, &daemon, || async {
        let forged = in_namespace(&tenant, "evil").get("m1").await.unwrap();
        forged.finalizers().is_empty() && events_say(&tenant, "evil", "m1", "DeliveryRecordRefused", &refusal).await
    })
    .await;
    assert!(
        bmh(&remote, "intruder").await.is_none(),
        "the attacker's host reached the victim"
    );
    assert!(remote_secret(&remote, "intruder").await.is_none());
    let still = bmh(&remote, "m1").await.expect("the victim's host was removed");
    assert_eq!(still.metadata.uid, host.metadata.uid);
    assert!(
        remote_secret(&remote, "m1").await.is_some(),
        "the victim's BMC Secret was removed"
    );

    // The victim's own assets still deliver: one assigned by hand to its pool's cluster.
    lab_asset(&tenant, "h1", Some("worker"), None).await;
    assets(&tenant)
        .patch(
            "h1",
            &Default::default(),
            &kube::api::Patch::Merge(json!({"spec": {"clusterName": victim}})),
        )
        .await
        .expect("assign h1");
    until("the victim's own asset delivered", WITHIN, &daemon, || async {
        let h1 = assets(&tenant).get("h1").await.unwrap();
        bmh(&remote, "h1").await.is_some() && asset_condition(&h1, "HostCreated").is_some_and(|(s, _, _)| s == "True")
    })
    .await;
    let m1 = assets(&tenant).get("m1").await.unwrap();
    assert_eq!(
        asset_condition(&m1, "HostCreated").map(|c| c.0).as_deref(),
        Some("True")
    );
    assert!(bmh(&remote, "intruder").await.is_none());
}

const STALLING_IMAGE: &str = "quay.io/example/stalling-installer:4.14";

/// A server that accepts connections and never answers; counts the connections.
async fn stalling_server() -> (String, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("address");
    let accepted = Arc::new(AtomicUsize::new(0));
    let counted = accepted.clone();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            counted.fetch_add(1, Ordering::SeqCst);
            held.push(socket);
        }
    });
    let kubeconfig = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: stalled\n  cluster:\n    server: http://{address}\n\
         contexts:\n- name: admin\n  context:\n    cluster: stalled\n    user: admin\ncurrent-context: admin\n\
         users:\n- name: admin\n  user:\n    token: t\n"
    );
    (kubeconfig, accepted)
}

/// A baremetal pool of one control-plane host selected by `site`, installed by `image`.
fn pool_of_site(name: &str, site: &str, image: &str) -> Value {
    let mut pool = baremetal_pool(name, 1, 1, 0);
    pool["spec"]["installerImage"] = json!(image);
    pool["spec"]["hostSelector"] = json!({"matchLabels": {"site": site}});
    pool
}

/// One reconcile slot per controller, and an asset whose cluster accepts connections and never
/// answers (each request may wait 30 s): while its delivery waits, another cluster of the same
/// tenant is installed and its asset delivered within seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_managed_cluster_holds_no_slot_while_other_assets_deliver() {
    let (fleet, tenant) = setup().await;
    let (managed, remote) = managed_cluster().await;
    metal_installer(&fleet, &managed);
    let (stalling, accepted) = stalling_server().await;
    cluster_installer(&fleet, STALLING_IMAGE, stalling);
    lab_asset(&tenant, "s1", Some("master"), None).await;
    assets(&tenant)
        .patch(
            "s1",
            &Default::default(),
            &kube::api::Patch::Merge(json!({"metadata": {"labels": {"site": "stalled"}}})),
        )
        .await
        .expect("label s1");
    create_pool(&tenant, pool_of_site("stuck", "stalled", STALLING_IMAGE)).await;
    let daemon = fleet.daemon(&[
        "--lease-min-age",
        "2s",
        "--sweep-interval",
        "1h",
        "--max-concurrent-reconciles",
        "1",
        "--managed-cluster-timeout",
        "30s",
    ]);
    until("the stalled cluster's delivery under way", WITHIN, &daemon, || async {
        accepted.load(Ordering::SeqCst) > 0
    })
    .await;

    // Far less than one stalled request (30 s), let alone one delivery (up to 6 of them).
    let quick = Duration::from_secs(12);
    lab_asset(&tenant, "m1", Some("master"), None).await;
    create_pool(&tenant, pool_of_site("metal", "lab", METAL_IMAGE)).await;
    wait_until("the other pool's cluster installed", quick, &daemon, || async {
        cds(&tenant, "metal")
            .await
            .into_iter()
            .find(|cd| cd.status.as_ref().is_some_and(|s| s.installed))
    })
    .await;
    until("the other asset delivered", quick, &daemon, || async {
        let m1 = assets(&tenant).get("m1").await.unwrap();
        bmh(&remote, "m1").await.is_some() && asset_condition(&m1, "HostCreated").is_some_and(|(s, _, _)| s == "True")
    })
    .await;
    assert!(bmh(&remote, "s1").await.is_none());
}

/// Issue 51: a missing credentials Secret is looked at again once per interval, however many
/// assets name it (tenant Secrets are not watched: 3,000 assets each asking every 10 s made 295
/// GETs a second), the lookups are counted per tenant, and once the Secret is made every asset
/// naming it is woken and finds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_assets_naming_one_missing_secret_cost_one_lookup_per_interval() {
    const ASSETS: usize = 200;
    let (fleet, tenant) = setup().await;
    for i in 0..ASSETS {
        let bmc = json!({"address": format!("ipmi://10.0.0.1/h{i}"), "credentialsName": "bmc-shared"});
        crate::inventory::create_asset(&tenant, &format!("h{i}"), json!({"bmc": bmc})).await;
    }
    let daemon = crate::inventory::daemon(&fleet);
    let all_say = |reason: &'static str| {
        let tenant = tenant.clone();
        async move {
            let listed = assets(&tenant).list(&Default::default()).await.expect("assets");
            let saying = listed
                .items
                .iter()
                .filter(|a| asset_condition(a, "CredentialsFound").is_some_and(|(_, r, _)| r == reason));
            saying.count() == ASSETS
        }
    };
    until("every asset says its Secret is missing", WITHIN, &daemon, || {
        all_say("SecretNotFound")
    })
    .await;

    // A rate is measured over time: three recheck intervals (`--backoff-base` 100ms × 10).
    let server = fleet.tenant_server("acme");
    let before = server.counters();
    let gets = || server.counters().since(&before).get(Verb::Get, "secrets", Some(NS));
    holds_for(
        &format!("at most 6 Secret GETs in 3 intervals for one missing Secret named by {ASSETS} assets"),
        Duration::from_secs(3),
        &daemon,
        || async { gets() <= 6 },
    )
    .await;
    let lookups = daemon
        .wait_for("/metrics", "stackd_secret_lookups_total{tenant=\"acme\"}", WITHIN)
        .await;
    assert!(
        lookups.contains("stackd_secret_lookups_total{tenant=\"acme\"}"),
        "{lookups}"
    );

    crate::inventory::bmc_secret(&tenant, "shared").await;
    until("every asset finds the Secret once it is made", WITHIN, &daemon, || {
        all_say("SecretFound")
    })
    .await;
}
