//! Races that could lose work or data (issue 17), each driven deterministically: a host partition
//! of the leader, a tenant whose stop outlasts its grace, an uninstall judging a stale CRD cache.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, ObjectMeta, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use serde_json::json;
use stackd::api::pools::ClusterDeployment;
use stackd::api::stacks::StackInstall;
use stackd::bench::partition::{Partition, upstream_of};
use stackd::embedded::faults::RequestMatch;
use stackd::embedded::{ApiServer, ServerOptions, Verb};
use stackd::host::Parent;
use stackd::stacks::crd_parent_label;

use super::pools;
use super::stacks_install::{
    STACKD_TEST_IMAGE, StackFleet, WIDGETS, condition, create_install, create_namespace, events_of,
};
use crate::harness::{Daemon, Fleet, NoDaemon, holds_for, until, wait_until};

const SOON: Duration = Duration::from_secs(10);

/// Polls `check` until it is true; the time it first was.
async fn when(what: &str, within: Duration, check: impl Fn() -> bool) -> Instant {
    wait_until(what, within, &NoDaemon, || async { check().then(Instant::now) }).await
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
    // The hung Job creation leaves no trace once its controller is gone: nothing to wait for but
    // its latency (and a second) to run out, in which a controller of the stopped tenant still
    // running would go on to write the install's status on the first server.
    holds_for(
        "the first server not called after its tenant stopped",
        Duration::from_secs(4),
        &daemon,
        || async { first.counters().since(&stopped).total() == 0 },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_deleted_while_the_daemon_restarts_still_gets_its_destroy_job() {
    let (fleet, tenant) = pools::setup().await;
    for name in ["a", "b"] {
        pools::named_cdc(&tenant, name).await;
    }
    pools::create_pool(&tenant, pools::pool_json("p", 1, Some(&["a", "b"]))).await;
    let first = pools::daemon(&fleet, &[]);
    until("one ready cluster", pools::WITHIN, &first, || async {
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
    until("the cluster deleted", pools::WITHIN, &second, || async {
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
    crate::harness::install_crds(&other.client().await).await;
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
    // Up means started: the host namespace records the tenant's cluster.
    let host_namespaces: Api<Namespace> = Api::all(fleet.host_client.clone());
    let recorded = host_namespaces
        .get("tenant-acme-controllers")
        .await
        .expect("host namespace");
    assert!(recorded.annotations().contains_key("stackd.dev/tenant-cluster-uid"));
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
    // A stopped tenant is not swept, so there is no sweep to wait for: over several sweep
    // intervals, a sweep of the other cluster would find no parent for the Secret.
    holds_for(
        "the host objects of the first cluster kept",
        Duration::from_secs(3),
        &daemon,
        || async { host_secrets.get_opt("team-a.kept-state").await.expect("get").is_some() },
    )
    .await;
}

const SAMPLE_PACKAGE: &str = "examples/sample-stack:v1";
/// Long enough for an install Job, its CRDs and its Stack's Deployment on the embedded servers.
const INSTALLED: Duration = Duration::from_secs(30);

fn widgets(tenant: &Client, namespace: &str) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("samples.example.org", "v1alpha1", "Widget");
    Api::namespaced_with(
        tenant.clone(),
        namespace,
        &ApiResource::from_gvk_with_plural(&gvk, "widgets"),
    )
}

/// A user's Widget in `namespace`: what a CRD taken by mistake would take with it.
async fn create_widget(tenant: &Client, namespace: &str, name: &str) {
    create_namespace(tenant, namespace).await;
    let widget: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "samples.example.org/v1alpha1",
        "kind": "Widget",
        "metadata": {"name": name},
        "spec": {"size": 1},
    }))
    .expect("widget");
    widgets(tenant, namespace)
        .create(&PostParams::default(), &widget)
        .await
        .expect("create widget");
}

async fn wait_ready(tenant: &Client, namespace: &str, daemon: &Daemon) {
    let installs: Api<StackInstall> = Api::namespaced(tenant.clone(), namespace);
    let what = format!("{namespace}/sample Ready=True");
    wait_until(&what, INSTALLED, daemon, || {
        let installs = installs.clone();
        async move {
            let install = installs.get_opt("sample").await.ok()??;
            (condition(&install, "Ready")?.0 == "True").then_some(())
        }
    })
    .await;
}

async fn uninstall(tenant: &Client, namespace: &str) {
    Api::<StackInstall>::namespaced(tenant.clone(), namespace)
        .delete("sample", &DeleteParams::default())
        .await
        .expect("delete install");
}

async fn wait_uninstalled(tenant: &Client, namespace: &str, daemon: &Daemon) {
    let installs: Api<StackInstall> = Api::namespaced(tenant.clone(), namespace);
    let what = format!("{namespace}/sample's uninstall");
    wait_until(&what, INSTALLED, daemon, || {
        let installs = installs.clone();
        async move { installs.get_opt("sample").await.ok()?.is_none().then_some(()) }
    })
    .await;
}

/// The Widget CRD once its parent labels (those of the Stacks using it) pass `check`.
async fn wait_crd_labels(
    tenant: &Client,
    what: &str,
    daemon: &Daemon,
    check: impl Fn(&BTreeMap<String, String>) -> bool,
) -> CustomResourceDefinition {
    let crds: Api<CustomResourceDefinition> = Api::all(tenant.clone());
    let check = &check;
    wait_until(what, INSTALLED, daemon, || {
        let crds = crds.clone();
        async move {
            let crd = crds.get_opt(WIDGETS).await.ok()??;
            check(crd.labels()).then_some(crd)
        }
    })
    .await
}

/// What a user sees left of the Widget CRD and the Widgets in `namespace`; panics naming the loss.
async fn assert_widgets_kept(tenant: &Client, namespace: &str, daemon: &Daemon) -> CustomResourceDefinition {
    let crd = Api::<CustomResourceDefinition>::all(tenant.clone())
        .get_opt(WIDGETS)
        .await
        .expect("get crd");
    let Some(crd) = crd else {
        panic!("the CRD another install uses was deleted:\n{}", daemon.log_text());
    };
    assert!(
        crd.metadata.deletion_timestamp.is_none(),
        "the shared CRD is terminating"
    );
    let kept = widgets(tenant, namespace)
        .list(&ListParams::default())
        .await
        .expect("list widgets");
    assert_eq!(kept.items.len(), 1, "the Widgets in {namespace}");
    crd
}

/// No CRDsDeleted Event tells the owner of `namespace/sample` that it took the CRD.
async fn assert_no_crd_deleted_event(tenant: &Client, namespace: &str) {
    let events = events_of(tenant, namespace, "sample").await;
    assert!(!events.iter().any(|(reason, _)| reason == "CRDsDeleted"), "{events:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uninstalling_one_of_two_installs_of_a_package_leaves_the_shared_crd_and_the_others_widgets() {
    let fleet = StackFleet::start(&["acme"]).await;
    let tenant = fleet.tenant("acme");
    let daemon = fleet.daemon(&[]);
    for namespace in ["team-a", "team-b"] {
        create_install(&tenant, namespace, "sample", json!({"package": SAMPLE_PACKAGE})).await;
    }
    for namespace in ["team-a", "team-b"] {
        wait_ready(&tenant, namespace, &daemon).await;
    }
    create_widget(&tenant, "team-b", "kept").await;
    let (label_a, label_b) = (
        crd_parent_label("team-a", "sample"),
        crd_parent_label("team-b", "sample"),
    );
    wait_crd_labels(&tenant, "both Stacks' labels on the CRD", &daemon, |labels| {
        labels.contains_key(&label_a) && labels.contains_key(&label_b)
    })
    .await;

    uninstall(&tenant, "team-a").await;
    wait_uninstalled(&tenant, "team-a", &daemon).await;
    let crd = assert_widgets_kept(&tenant, "team-b", &daemon).await;
    assert!(crd.labels().contains_key(&label_b), "{:?}", crd.labels());
    assert!(!crd.labels().contains_key(&label_a), "{:?}", crd.labels());
    assert_no_crd_deleted_event(&tenant, "team-a").await;
    let other = Api::<StackInstall>::namespaced(tenant.clone(), "team-b")
        .get("sample")
        .await
        .expect("team-b's install");
    assert_eq!(
        condition(&other, "Ready").map(|(status, ..)| status).as_deref(),
        Some("True"),
        "{:?}",
        other.status
    );
}

/// The race of issue 17: the uninstall judges "no stack uses this CRD" from its cache while another
/// install has just put its Stack's label on the CRD. The daemon's CRD watches are paused, so its
/// caches show the CRD as it was after the first Stack dropped its label and before the second
/// install added its own; the uninstall's delete must fail on the CRD's resourceVersion.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uninstall_judging_a_stale_crd_cache_leaves_the_crd_a_new_install_just_took() {
    let fleet = StackFleet::start(&["acme"]).await;
    let tenant = fleet.tenant("acme");
    let tenant_server = &fleet.tenants["acme"].0;
    let daemon = fleet.daemon(&["--backoff-base", "50ms"]);
    create_install(&tenant, "team-a", "sample", json!({"package": SAMPLE_PACKAGE})).await;
    wait_ready(&tenant, "team-a", &daemon).await;
    create_widget(&tenant, "team-b", "kept").await;
    let (label_a, label_b) = (
        crd_parent_label("team-a", "sample"),
        crd_parent_label("team-b", "sample"),
    );

    // team-a's uninstall is held after its Stack is gone and before its CRD step: its host list of
    // pull-secret copies fails until the test lets it through.
    let host_secret_lists = RequestMatch::any()
        .verb(Verb::List)
        .resource("secrets")
        .namespace("tenant-acme-controllers");
    fleet._host.faults().fail_next(usize::MAX, host_secret_lists, 500);
    uninstall(&tenant, "team-a").await;
    wait_crd_labels(&tenant, "team-a's Stack to drop its label", &daemon, |labels| {
        !labels.contains_key(&label_a)
    })
    .await;

    // From here on the daemon's CRD caches stay where they are, and team-b's install takes the CRD.
    let paused = tenant_server
        .faults()
        .pause_watches(RequestMatch::any().resource("customresourcedefinitions"));
    create_install(&tenant, "team-b", "sample", json!({"package": SAMPLE_PACKAGE})).await;
    // team-b's CRD update carried the resourceVersion of the daemon's CRD cache: that cache has seen
    // the CRD without any Stack's label, and this label does not reach it while paused.
    wait_crd_labels(&tenant, "team-b's label on the CRD", &daemon, |labels| {
        labels.contains_key(&label_b)
    })
    .await;

    fleet._host.faults().clear();
    wait_uninstalled(&tenant, "team-a", &daemon).await;
    let crd = assert_widgets_kept(&tenant, "team-b", &daemon).await;
    assert!(crd.labels().contains_key(&label_b), "{:?}", crd.labels());
    assert_no_crd_deleted_event(&tenant, "team-a").await;
    // The refused delete is told to the install's owner.
    let events = events_of(&tenant, "team-a", "sample").await;
    assert!(
        events
            .iter()
            .any(|(reason, message)| reason == "CRDsKept" && message.contains(&crd.name_any())),
        "{events:?}"
    );

    paused.resume();
    wait_ready(&tenant, "team-b", &daemon).await;
    let crd = assert_widgets_kept(&tenant, "team-b", &daemon).await;
    assert!(crd.labels().contains_key(&label_b), "{:?}", crd.labels());
}

/// A parent reconciled again before the cache shows the object its last reconcile created does
/// not create it again: that would be a 409 and a GET for nothing (issue 20). Once the cache shows
/// it, it is compared and updated as usual.
#[tokio::test]
async fn a_host_object_created_moments_ago_is_not_created_again_before_the_cache_shows_it() {
    use k8s_openapi::api::core::v1::ConfigMap;
    use stackd::host::apply::{self, Applied, HostWrites, Update, stamp};
    use stackd::runtime::backoff::Backoff;

    let t = super::harness::start().await;
    t.namespace("host-ns").await;
    let api: Api<ConfigMap> = Api::namespaced(t.client.clone(), "host-ns");
    let parent = Parent::new("Stack", Some("team"), "s", "uid-1");
    let mut desired: ConfigMap =
        serde_json::from_value(json!({"metadata": {"name": "c", "namespace": "host-ns"}, "data": {"k": "v"}})).unwrap();
    stamp(&mut desired, "acme", &parent);
    let writes = HostWrites::new(Backoff::new(Duration::from_secs(1), Duration::from_secs(1)));
    let update = Update::WhenDifferent(&writes);
    let first = apply::ensure(&api, &desired, None, "acme", &parent, update)
        .await
        .unwrap();
    assert_eq!(first, Applied::Created);
    let before = t.server.counters();
    // The cache has not shown the creation yet: no request at all.
    let again = apply::ensure(&api, &desired, None, "acme", &parent, update)
        .await
        .unwrap();
    assert_eq!(again, Applied::Unchanged);
    let requests: u64 = t.server.counters().since(&before).counts.values().sum();
    assert_eq!(requests, 0, "requests before the cache caught up");
    // Its watch event (`seen`), then its deletion: created again.
    writes.seen(&api.get("c").await.unwrap());
    api.delete("c", &DeleteParams::default()).await.unwrap();
    let recreated = apply::ensure(&api, &desired, None, "acme", &parent, update)
        .await
        .unwrap();
    assert_eq!(recreated, Applied::Created);
    // Once the cache shows it and it differs: replaced as usual.
    let cached = api.get("c").await.unwrap();
    let mut changed = desired.clone();
    changed.data = Some([("k".to_string(), "w".to_string())].into());
    let applied = apply::ensure(&api, &changed, Some(&cached), "acme", &parent, update)
        .await
        .unwrap();
    assert_eq!(applied, Applied::Updated);
    assert_eq!(api.get("c").await.unwrap().data, changed.data);
}
