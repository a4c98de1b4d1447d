//! An outage of the host (issue 47): a restart of its API server, with a fresh watch cache and a
//! kubelet that answers a moment after the API, re-runs no install Job, blames no package, and is
//! told once when it goes and once when it returns.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Event, Namespace};
use kube::Client;
use kube::api::{Api, ListParams, PostParams};
use serde_json::json;
use stackd::api::stacks::StackInstall;
use stackd::embedded::faults::RequestMatch;
use stackd::embedded::samples::{SampleImages, register_sample_runners, slow_down};
use stackd::embedded::{ApiServer, Verb};

use crate::harness::{Daemon, Fleet, install_crds, until};
use crate::pools;

const SOON: Duration = Duration::from_secs(10);
/// The image install Jobs get, which the host's sample runners run.
const STACKD_IMAGE: &str = "stackd:test";
/// Installs in flight when the host restarts (the six).
const INSTALLS: usize = 6;
/// How long the host's API server is away, and how much later its kubelet answers.
const HOST_DOWNTIME: Duration = Duration::from_secs(6);
const KUBELET_LAG: Duration = Duration::from_secs(3);
/// The daemon's log lines one outage may cost, whatever is in flight.
const LINES_PER_OUTAGE: usize = 5;

/// Install Jobs created on the host for tenant `acme` so far.
fn install_jobs_created(host: &ApiServer) -> u64 {
    host.counters()
        .get(Verb::Create, "jobs", Some("tenant-acme-controllers"))
}

async fn create_install(client: &Client, namespace: &str) {
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let ns = serde_json::from_value(json!({"metadata": {"name": namespace}})).expect("namespace");
    namespaces.create(&PostParams::default(), &ns).await.expect("namespace");
    let installs: Api<StackInstall> = Api::namespaced(client.clone(), namespace);
    let install: StackInstall = serde_json::from_value(json!({
        "metadata": {"name": "sample", "namespace": namespace},
        "spec": {"package": "stackd-examples/sample-stack:v0.1.0"},
    }))
    .expect("install");
    installs
        .create(&PostParams::default(), &install)
        .await
        .expect("install");
}

async fn is_ready(client: &Client, namespace: &str) -> bool {
    let installs: Api<StackInstall> = Api::namespaced(client.clone(), namespace);
    let install = installs.get_opt("sample").await.ok().flatten();
    install
        .and_then(|i| i.status)
        .is_some_and(|s| s.conditions.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The daemon's log lines from the `from`th on, but for the Stack controller's line per change of
/// a Stack's readiness (each install's progress, outage or not).
fn lines_since(daemon: &Daemon, from: usize) -> Vec<String> {
    daemon
        .log_text()
        .lines()
        .skip(from)
        .filter(|line| !line.contains("stackd::stacks::stack::status"))
        .map(str::to_string)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_restart_mid_install_runs_each_install_job_once_and_is_told_in_a_few_lines() {
    // The host restarts while some install pods still run and others have just finished.
    host_restart_mid_install(Duration::from_millis(1500)).await;
}

/// The same when every install pod has just finished: the daemon is reading their logs (and its
/// probe may be on a connection the stop breaks) as the host goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_restart_as_install_jobs_finish_is_told_by_its_root_cause_in_a_few_lines() {
    host_restart_mid_install(Duration::ZERO).await;
}

/// Installs whose pods take `slow` each, the host restarting once their Jobs exist.
async fn host_restart_mid_install(slow: Duration) {
    let fleet = Fleet::start(&["acme"]).await;
    let host = fleet.host();
    register_sample_runners(&host.runners(), &SampleImages::new(STACKD_IMAGE));
    if !slow.is_zero() {
        assert!(slow_down(&host.runners(), STACKD_IMAGE, slow));
    }
    let acme = fleet.tenant_server("acme").client().await;
    install_crds(&acme).await;
    // Sweeps (host and tenant lists) and quota checks fall within the outage, as on a loaded
    // machine the sweep at the tenant's start does.
    let daemon = fleet.daemon(&[
        "--stackd-image",
        STACKD_IMAGE,
        "--allow-insecure-tenant-endpoint",
        "--sweep-interval",
        "1s",
    ]);
    daemon.wait_for("/readyz?verbose", "[+]tenant acme ok", SOON).await;
    daemon.wait_for("/readyz?verbose", "[+]host ok", SOON).await;
    let before = daemon.log_text().lines().count();
    let namespaces: Vec<String> = (0..INSTALLS).map(|i| format!("team-{i}")).collect();
    for namespace in &namespaces {
        create_install(&acme, namespace).await;
    }
    until("every install Job created", SOON, &daemon, || async {
        install_jobs_created(host) >= INSTALLS as u64
    })
    .await;
    let restart = host.restart_host(HOST_DOWNTIME, KUBELET_LAG);
    let observe = async {
        let ready = daemon.wait_for("/readyz?verbose", "[-]host down", SOON).await;
        assert!(
            ready.contains("connection refused"),
            "the root cause is named:\n{ready}"
        );
        daemon.wait_for("/metrics", "stackd_host_up 0", SOON).await;
    };
    let (restarted, ()) = tokio::join!(restart, observe);
    restarted.expect("the host serves again");
    daemon.wait_for("/metrics", "stackd_host_up 1", SOON).await;
    until("every install Ready", Duration::from_secs(60), &daemon, || async {
        for namespace in &namespaces {
            if !is_ready(&acme, namespace).await {
                return false;
            }
        }
        true
    })
    .await;
    assert_eq!(
        install_jobs_created(host),
        INSTALLS as u64,
        "an install Job was made again:\n{}",
        daemon.log_text()
    );
    let events: Vec<Event> = Api::<Event>::all(acme.clone())
        .list(&ListParams::default())
        .await
        .expect("events")
        .items;
    let with_reason = |reasons: &[&str]| -> Vec<String> {
        events
            .iter()
            .filter(|event| reasons.contains(&event.reason.as_deref().unwrap_or_default()))
            .map(|event| event.message.clone().unwrap_or_default())
            .collect()
    };
    let blamed = with_reason(&["InvalidPackage"]);
    assert!(blamed.is_empty(), "packages were blamed for the host: {blamed:?}");
    // The outage met installs whose output was still to be read: they said what did not answer.
    let waited = with_reason(&["HostUnreachable", "KubeletUnreachable"]);
    assert!(!waited.is_empty(), "no install waited for the host or its kubelet");
    eprintln!("installs waited: {waited:#?}");
    let told = lines_since(&daemon, before);
    assert!(
        told.iter().any(|line| line.contains("host API server answers again")),
        "the return is told:\n{}",
        told.join("\n")
    );
    eprintln!("told:\n{}", told.join("\n"));
    assert!(
        told.len() <= LINES_PER_OUTAGE,
        "{} lines for one outage:\n{}",
        told.len(),
        told.join("\n")
    );
}

/// The Job's pods cannot be listed (the host answers 500; kube's client retries 503s itself): the
/// install says so, keeps its Job and reads again, and is Ready with that one Job; no package is
/// blamed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_install_whose_job_pods_cannot_be_listed_keeps_its_job_and_reads_again() {
    let fleet = Fleet::start(&["acme"]).await;
    let host = fleet.host();
    register_sample_runners(&host.runners(), &SampleImages::new(STACKD_IMAGE));
    let acme = fleet.tenant_server("acme").client().await;
    install_crds(&acme).await;
    let daemon = fleet.daemon(&["--stackd-image", STACKD_IMAGE, "--allow-insecure-tenant-endpoint"]);
    daemon.wait_for("/readyz?verbose", "[+]tenant acme ok", SOON).await;
    let pods = RequestMatch::any()
        .verb(Verb::List)
        .resource("pods")
        .namespace("tenant-acme-controllers");
    host.faults().fail_next(3, pods, 500);
    create_install(&acme, "team-a").await;
    until("the install Ready", Duration::from_secs(60), &daemon, || async {
        is_ready(&acme, "team-a").await
    })
    .await;
    assert_eq!(install_jobs_created(host), 1, "{}", daemon.log_text());
    let reasons: Vec<String> = Api::<Event>::namespaced(acme.clone(), "team-a")
        .list(&ListParams::default())
        .await
        .expect("events")
        .items
        .into_iter()
        .filter_map(|event| event.reason)
        .collect();
    assert!(reasons.iter().any(|r| r == "HostUnreachable"), "{reasons:?}");
    assert!(!reasons.iter().any(|r| r == "InvalidPackage"), "{reasons:?}");
}

/// The pool installer's output is read from a Secret the installer writes: a host restart while
/// installers run or have just finished makes no installer Job twice, and the pool fills.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_restart_mid_pool_install_runs_each_installer_once() {
    let (fleet, tenant) = pools::setup().await;
    let host = fleet.host();
    // The host restarts while the installers run or have just finished.
    assert!(slow_down(
        &host.runners(),
        pools::INSTALLER,
        Duration::from_millis(1500)
    ));
    pools::create_pool(&tenant, pools::pool_json("vsphere", 2, None)).await;
    let daemon = pools::daemon(&fleet, &[]);
    until("both installer Jobs created", pools::WITHIN, &daemon, || async {
        install_jobs_created(host) >= 2
    })
    .await;
    let before = installer_jobs(&fleet).await;
    host.restart_host(HOST_DOWNTIME, KUBELET_LAG)
        .await
        .expect("the host serves again");
    until("two ready clusters", Duration::from_secs(60), &daemon, || async {
        pools::ready(&tenant, "vsphere").await == 2
    })
    .await;
    // A create the host answered while the daemon's cache had not shown the Job yet (its event lost
    // with the connection) is refused as existing: the same two Jobs ran, none was made again.
    assert_eq!(
        installer_jobs(&fleet).await,
        before,
        "an installer Job was made again:\n{}",
        daemon.log_text()
    );
    assert_eq!(before.len(), 2);
}

/// The installer Jobs on the host, as (name, uid).
async fn installer_jobs(fleet: &Fleet) -> Vec<(String, String)> {
    let jobs: Api<k8s_openapi::api::batch::v1::Job> =
        Api::namespaced(fleet.host().client().await, "tenant-acme-controllers");
    let mut found: Vec<(String, String)> = jobs
        .list(&ListParams::default())
        .await
        .expect("host jobs")
        .items
        .into_iter()
        .filter(|job| job.metadata.name.as_deref().is_some_and(|n| n.contains("-install-")))
        .map(|job| {
            (
                job.metadata.name.unwrap_or_default(),
                job.metadata.uid.unwrap_or_default(),
            )
        })
        .collect();
    found.sort();
    found
}
