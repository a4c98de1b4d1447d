//! Races that could lose work or data (issue 17), each driven deterministically: a host partition
//! of the leader, a tenant whose stop outlasts its grace.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ObjectMeta, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::json;
use stackd::api::pools::ClusterDeployment;
use stackd::bench::partition::{Partition, upstream_of};
use stackd::embedded::faults::RequestMatch;
use stackd::embedded::{ApiServer, ServerOptions, Verb};
use stackd::host::Parent;

use super::daemon::{Daemon, Fleet};
use super::pools;
use super::stacks_install::{STACKD_TEST_IMAGE, StackFleet, create_install};

const SOON: Duration = Duration::from_secs(10);

/// Polls `check` until it is true; the time it first was.
async fn when(what: &str, within: Duration, check: impl Fn() -> bool) -> Instant {
    let deadline = Instant::now() + within;
    loop {
        if check() {
            return Instant::now();
        }
        assert!(Instant::now() < deadline, "{what} did not happen within {within:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_cut_off_from_the_host_stops_before_a_standby_takes_over() {
    let fleet = Fleet::start(&["acme"]).await;
    fleet.leader_election_namespace().await;
    let upstream = upstream_of(&fleet.host().url()).expect("a loopback address in the host URL");
    let partition = Partition::start(upstream).await.expect("start the proxy");
    let proxied: PathBuf = fleet.dir.path().join("host-through-proxy.yaml");
    let host_kubeconfig = std::fs::read_to_string(fleet.dir.path().join("host.yaml")).expect("host kubeconfig");
    std::fs::write(
        &proxied,
        partition
            .kubeconfig(&host_kubeconfig)
            .expect("the kubeconfig names the host"),
    )
    .expect("proxied kubeconfig");

    let args = ["--leader-elect", "--leader-elect-lease-duration", "6"];
    let leader = Daemon::spawn_with_host(fleet.dir.path(), &proxied, &args);
    when("the first daemon's acquisition", SOON, || {
        leader.log_text().contains("acquired the leader lease")
    })
    .await;
    fleet.wait_for_namespace("acme", SOON).await;
    let standby = fleet.daemon(&args);
    when("the standby's wait", SOON, || {
        standby.log_text().contains("waiting for the leader lease")
    })
    .await;

    // The leader's host requests now fail while its tenants still answer: it must stop acting on
    // them before its lease can run out for the standby.
    partition.cut();
    let (stopped, took_over) = tokio::join!(
        when("the leader's stop", Duration::from_secs(20), || {
            leader.log_text().contains("lost the leader lease")
        }),
        when("the standby's takeover", Duration::from_secs(20), || {
            standby.log_text().contains("acquired the leader lease")
        }),
    );
    assert!(
        stopped < took_over,
        "the standby took over {:?} before the cut-off leader stopped:\nleader:\n{}",
        stopped - took_over,
        leader.log_text()
    );
    assert!(
        leader.log_text().contains("not renewed within its renew deadline"),
        "{}",
        leader.log_text()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_whose_stop_outlasts_its_grace_leaves_none_of_its_controllers_running() {
    let fleet = StackFleet::start(&["acme"]).await;
    let (first, _) = &fleet.tenants["acme"];
    let second = ApiServer::start(ServerOptions {
        name: "acme-moved".into(),
        ..Default::default()
    })
    .await
    .expect("second tenant server");
    // The install's reconcile hangs in its host Job creation, past the stop grace.
    fleet._host.faults().add_latency(
        RequestMatch::any().verb(Verb::Create).resource("jobs"),
        Duration::from_secs(3),
    );
    let daemon = Daemon::spawn(
        fleet.dir.path(),
        &[
            "--stackd-image",
            STACKD_TEST_IMAGE,
            "--allow-insecure-tenant-endpoint",
            "--tenant-stop-grace",
            "300ms",
        ],
    );
    daemon.wait_for("/readyz?verbose", "[+]tenant acme ok", SOON).await;
    let before = fleet._host.counters();
    create_install(
        &fleet.tenant("acme"),
        "team-a",
        "sample",
        json!({"package": "examples/sample-stack:v1"}),
    )
    .await;
    when("the install Job's creation", SOON, || {
        fleet
            ._host
            .counters()
            .since(&before)
            .get(Verb::Create, "jobs", Some("tenant-acme-controllers"))
            > 0
    })
    .await;

    // The tenant moves to another server while that reconcile is in flight.
    std::fs::write(
        fleet.dir.path().join("tenants").join("acme.yaml"),
        second.kubeconfig_yaml(),
    )
    .expect("re-point the tenant");
    when("the stop to run out of grace", SOON, || {
        daemon.log_text().contains("tenant did not stop in time; aborting it")
    })
    .await;
    let stopped = first.counters();
    // Long enough for the hung Job creation to return: a controller of the stopped tenant still
    // running would go on to write the install's status on the first server.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let after = first.counters().since(&stopped);
    assert_eq!(
        after.total(),
        0,
        "the first server was still called after its tenant stopped: {after:?}\n{}",
        daemon.log_text()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_deleted_while_the_daemon_restarts_still_gets_its_destroy_job() {
    let (fleet, tenant) = pools::setup().await;
    for name in ["a", "b"] {
        pools::named_cdc(&tenant, name).await;
    }
    pools::create_pool(&tenant, pools::pool_json("p", 1, Some(&["a", "b"]))).await;
    let first = pools::daemon(&fleet, &[]);
    pools::until("one ready cluster", &first, pools::WITHIN, || async {
        pools::ready(&tenant, "p").await == 1
    })
    .await;
    drop(first);
    let cluster = pools::live(&pools::cds(&tenant, "p").await)[0].name_any();

    // The cluster is deleted while no daemon runs, and the next daemon's host lists are slow: its
    // first reconcile of the deletion comes before its host caches have listed the installer's output.
    fleet.host().faults().add_latency(
        RequestMatch::any().verb(Verb::List).resource("secrets"),
        Duration::from_secs(3),
    );
    fleet.host().faults().add_latency(
        RequestMatch::any().verb(Verb::List).resource("jobs"),
        Duration::from_secs(3),
    );
    Api::<ClusterDeployment>::namespaced(tenant.clone(), &cluster)
        .delete(&cluster, &DeleteParams::default())
        .await
        .expect("delete the cluster");
    // The destroy Job may come and go between two looks: watch for it.
    let destroy = format!("{cluster}.{cluster}-destroy");
    let jobs: Api<Job> = Api::namespaced(fleet.host_client.clone(), "tenant-acme-controllers");
    let (seen_tx, seen) = tokio::sync::watch::channel(false);
    let named = watcher::Config::default().fields(&format!("metadata.name={destroy}"));
    let watching = tokio::spawn(watcher(jobs, named).applied_objects().for_each(move |job| {
        if job.is_ok() {
            let _ = seen_tx.send(true);
        }
        std::future::ready(())
    }));
    let second = pools::daemon(&fleet, &[]);
    let clusters: Api<ClusterDeployment> = Api::namespaced(tenant.clone(), &cluster);
    pools::until("the cluster deleted", &second, pools::WITHIN, || async {
        clusters.get_opt(&cluster).await.unwrap().is_none()
    })
    .await;
    watching.abort();
    assert!(
        *seen.borrow(),
        "the deleted cluster was let go without its destroy Job:\n{}",
        second.log_text()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_file_pointed_at_another_cluster_stops_the_tenant_instead_of_sweeping_it() {
    let fleet = StackFleet::start(&["acme"]).await;
    let other = ApiServer::start(ServerOptions {
        name: "other-cluster".into(),
        ..Default::default()
    })
    .await
    .expect("another cluster");
    let crds: Api<CustomResourceDefinition> = Api::all(other.client().await);
    for crd in stackd::api::crds::all() {
        crds.create(&PostParams::default(), &crd).await.expect("stackd crd");
    }
    let daemon = Daemon::spawn(
        fleet.dir.path(),
        &[
            "--stackd-image",
            STACKD_TEST_IMAGE,
            "--allow-insecure-tenant-endpoint",
            "--sweep-interval",
            "1s",
        ],
    );
    daemon.wait_for("/readyz?verbose", "[+]tenant acme ok", SOON).await;
    let host_namespaces: Api<Namespace> = Api::all(fleet.host_client.clone());
    let recorded = host_namespaces
        .get("tenant-acme-controllers")
        .await
        .expect("host namespace");
    assert!(
        recorded.annotations().contains_key("stackd.dev/tenant-cluster-uid"),
        "{:?}",
        recorded.annotations()
    );
    // A host object of a parent that lives on the first cluster only.
    let install = create_install(
        &fleet.tenant("acme"),
        "team-a",
        "kept",
        json!({"package": "examples/sample-stack:v1"}),
    )
    .await;
    let parent = Parent::new(
        "StackInstall",
        Some("team-a"),
        "kept",
        install.uid().as_deref().unwrap_or_default(),
    );
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some("team-a.kept-state".into()),
            labels: Some(parent.labels("acme")),
            annotations: Some(parent.annotations()),
            ..Default::default()
        },
        ..Default::default()
    };
    let host_secrets: Api<Secret> = Api::namespaced(fleet.host_client.clone(), "tenant-acme-controllers");
    host_secrets
        .create(&PostParams::default(), &secret)
        .await
        .expect("host secret");

    std::fs::write(
        fleet.dir.path().join("tenants").join("acme.yaml"),
        other.kubeconfig_yaml(),
    )
    .expect("re-point the tenant");
    let ready = daemon
        .wait_for("/readyz?verbose", "now points at another cluster", SOON)
        .await;
    assert!(ready.contains("stackd.dev/tenant-cluster-uid"), "{ready}");
    // Several sweep intervals: a sweep of the other cluster would find no parent for the Secret.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        host_secrets.get_opt("team-a.kept-state").await.expect("get").is_some(),
        "the host objects of the first cluster were swept:\n{}",
        daemon.log_text()
    );
}
