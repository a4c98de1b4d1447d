//! Fairness inside a tenant and between tenants (DESIGN.md §8 "Blast radius"; issue 28): a tenant's
//! reconcile permits are shared between its namespaces, so a namespace with a backlog of hundreds of
//! slow objects does not hold up an object in another namespace of the same tenant, nor in another
//! tenant. Through the daemon binary against embedded servers; the backlog is made slow by latency
//! on every request in its namespace, as a slow or overloaded API server would add.

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Namespace;
use kube::Client;
use kube::api::{Api, ListParams, PostParams};
use serde_json::json;
use stackd::api::pools::ClusterClaim;
use stackd::embedded::faults::RequestMatch;

use crate::harness::{Daemon, Fleet, wait_until};

const BACKLOG: usize = 200;
/// Added to every request in the backlog's namespace: a claim's reconcile there makes two (its
/// status and an Event), so the backlog takes about BACKLOG × 2 × LATENCY / 4 permits = 25 s.
const LATENCY: Duration = Duration::from_millis(250);
/// How soon an object elsewhere must be reconciled: far below the backlog's time.
const BOUND: Duration = Duration::from_secs(5);

async fn with_crds(client: &Client, namespaces: &[&str]) {
    crate::harness::install_crds(client).await;
    for name in namespaces {
        let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name}})).expect("ns");
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .expect("namespace");
    }
}

/// A claim of a pool that does not exist: its reconcile reports that (a status write, an Event).
async fn claim(client: &Client, namespace: &str, name: &str) {
    let claim: ClusterClaim = serde_json::from_value(json!({
        "apiVersion": "pools.stackd.dev/v1alpha1", "kind": "ClusterClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"clusterPoolName": "missing"},
    }))
    .expect("claim");
    Api::<ClusterClaim>::namespaced(client.clone(), namespace)
        .create(&PostParams::default(), &claim)
        .await
        .expect("create claim");
}

fn reported(claim: &ClusterClaim) -> bool {
    claim
        .status
        .as_ref()
        .is_some_and(|s| s.conditions.iter().any(|c| c.reason == "ClusterPoolNotFound"))
}

async fn reported_in(client: &Client, namespace: &str) -> usize {
    Api::<ClusterClaim>::namespaced(client.clone(), namespace)
        .list(&ListParams::default())
        .await
        .expect("list claims")
        .items
        .iter()
        .filter(|c| reported(c))
        .count()
}

/// How long until the claim `namespace/name` is reconciled.
async fn time_to_reconcile(client: &Client, daemon: &Daemon, namespace: &str, name: &str) -> Duration {
    let started = Instant::now();
    claim(client, namespace, name).await;
    let api = Api::<ClusterClaim>::namespaced(client.clone(), namespace);
    let what = format!("claim {namespace}/{name} reconciled");
    wait_until(&what, Duration::from_secs(60), daemon, || async {
        let found = api.get_opt(name).await.ok().flatten()?;
        reported(&found).then(|| started.elapsed())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_in_one_namespace_holds_up_neither_another_namespace_nor_another_tenant() {
    let fleet = Fleet::start(&["acme", "globex"]).await;
    let acme_server = fleet.tenants[0].1.as_ref().expect("acme");
    let acme = acme_server.client().await;
    let globex = fleet.tenants[1].1.as_ref().expect("globex").client().await;
    with_crds(&acme, &["team-a", "team-b"]).await;
    with_crds(&globex, &["team"]).await;
    for i in 0..BACKLOG {
        claim(&acme, "team-a", &format!("backlog-{i}")).await;
    }
    acme_server
        .faults()
        .add_latency(RequestMatch::any().namespace("team-a"), LATENCY);
    let daemon = fleet.daemon(&[]);
    wait_until("the backlog under way", Duration::from_secs(60), &daemon, || async {
        (reported_in(&acme, "team-a").await > 0).then_some(())
    })
    .await;

    let other_namespace = time_to_reconcile(&acme, &daemon, "team-b", "urgent").await;
    let other_tenant = time_to_reconcile(&globex, &daemon, "team", "urgent").await;
    let backlog_done = reported_in(&acme, "team-a").await;
    eprintln!(
        "backlog of {BACKLOG} at {backlog_done} done; another namespace reconciled in {other_namespace:?}, another tenant in {other_tenant:?}"
    );
    assert!(
        backlog_done < BACKLOG / 2,
        "the backlog went too fast to hold anything up ({backlog_done} of {BACKLOG} done)"
    );
    assert!(other_namespace < BOUND, "another namespace waited {other_namespace:?}");
    assert!(other_tenant < BOUND, "another tenant waited {other_tenant:?}");
}
