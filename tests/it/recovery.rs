//! Recovery after faults (issues 15, 30): a tenant back from an outage is served again within
//! seconds of answering, whatever backoff it had built up, and work created right then is as fast as
//! on a settled tenant; an outage is seen within seconds even while old watches stay open, and told
//! once; a restart with a fresh watch cache (410 on resumed watches) is no outage; trouble is named
//! by its root cause. An idle tenant's graceful stop is seen within seconds too, at no request while
//! it is up (issue 47).

use std::time::{Duration, Instant};

use kube::Client;
use kube::api::{Api, PostParams};
use serde_json::json;
use stackd::api::stacks::StackInstall;
use stackd::embedded::discovery::Resources;
use stackd::embedded::faults::RequestMatch;
use stackd::embedded::samples::{SampleImages, register_sample_runners};
use stackd::embedded::{ApiServer, RestartState, ServerOptions, Verb, verbs};

use crate::harness::{Daemon, Fleet, NoDaemon, holds_for, install_crds, until, wait_until};
use crate::tenant_objects::{
    HostKubectl, SECRETS_NAMESPACE, condition, install_tenant_crd, registration, wait_condition,
};
use stackd::embedded::counters::RequestCounts;

/// The promise: up again within 5 s of the server answering.
const BACK_WITHIN: Duration = Duration::from_secs(5);
const SOON: Duration = Duration::from_secs(10);
/// Issue 30: reported down within 10 s of the server refusing new connections.
const DOWN_WITHIN: Duration = Duration::from_secs(10);
/// The image install Jobs get, which the host's sample runners run.
const STACKD_IMAGE: &str = "stackd:test";

/// Writes a namespace and a StackInstall into `server`'s store in-process, as a client whose
/// connection was already open would: the watches a stopping server keeps open deliver it.
fn write_install(server: &ApiServer, namespace: &str) {
    let store = server.store();
    let resources = Resources::current(&store);
    let namespaces = resources.find("", "v1", "namespaces").expect("namespaces");
    let installs = resources
        .find("stacks.stackd.dev", "v1alpha1", "stackinstalls")
        .expect("the StackInstall CRD");
    verbs::create(
        &store,
        &namespaces,
        "",
        json!({"metadata": {"name": namespace}}),
        Default::default(),
    )
    .expect("namespace");
    let install = json!({
        "apiVersion": "stacks.stackd.dev/v1alpha1",
        "kind": "StackInstall",
        "metadata": {"name": "sample", "namespace": namespace},
        "spec": {"package": "stackd-examples/sample-stack:v0.1.0"},
    });
    verbs::create(&store, &installs, namespace, install, Default::default()).expect("install");
}

/// The daemon's log lines from the `from`th on, up to the first containing `until_line`.
fn lines_until(log: &str, from: usize, until_line: &str) -> Vec<String> {
    let mut lines = Vec::new();
    for line in log.lines().skip(from) {
        lines.push(line.to_string());
        if line.contains(until_line) {
            break;
        }
    }
    lines
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_down_at_start_is_served_within_seconds_of_answering_though_its_backoff_is_long() {
    let fleet = Fleet::start(&["acme"]).await;
    let acme = fleet.tenant_server("acme");
    // The server is down when the daemon starts; a 40 s backoff base makes the first restart delay
    // longer than 30 s, so only the probe can bring the tenant back in time.
    let outage = acme.restart_after(RestartState::FreshWatchCache, Duration::from_secs(6));
    let observe = async {
        let address = acme
            .url()
            .split("://")
            .nth(1)
            .expect("a URL")
            .trim_end_matches('/')
            .to_string();
        until("the tenant server down", SOON, &NoDaemon, || async {
            tokio::net::TcpStream::connect(&address).await.is_err()
        })
        .await;
        let daemon = fleet.daemon(&["--backoff-base", "40s"]);
        let ready = daemon.wait_for("/readyz?verbose", "[-]tenant acme down", SOON).await;
        assert!(
            ready.contains("connection refused"),
            "the root cause is named:\n{ready}"
        );
        daemon
            .wait_for(
                "/metrics",
                "stackd_tenant_down_cause{tenant=\"acme\",cause=\"refused\"} 1",
                SOON,
            )
            .await;
        daemon
    };
    let (restarted, daemon) = tokio::join!(outage, observe);
    restarted.expect("the tenant server serves again");
    let answered = Instant::now();
    let metrics = daemon
        .wait_for("/metrics", "stackd_tenant_up{tenant=\"acme\"} 1", BACK_WITHIN)
        .await;
    assert!(!metrics.contains("stackd_tenant_down_cause{"), "{metrics}");
    fleet
        .wait_for_namespace("acme", BACK_WITHIN.saturating_sub(answered.elapsed()))
        .await;
    let log = daemon.log_text();
    assert!(log.contains("serving it again as soon as it answers"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_restarting_with_a_fresh_watch_cache_is_watched_again_within_seconds() {
    let fleet = Fleet::start(&["acme"]).await;
    let acme = fleet.tenant_server("acme");
    let daemon = fleet.daemon(&[]);
    // Without stackd's CRDs the tenant is degraded; installing them flips it to ok through the watch.
    daemon.wait_for("/readyz?verbose", "tenant acme degraded", SOON).await;
    acme.restart_after(RestartState::FreshWatchCache, Duration::from_secs(8))
        .await
        .expect("restart");
    let answered = Instant::now();
    install_crds(&acme.client().await).await;
    daemon
        .wait_for("/readyz?verbose", "[+]tenant acme ok", BACK_WITHIN)
        .await;
    assert!(answered.elapsed() <= BACK_WITHIN);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_watch_is_not_reported_as_an_outage() {
    let fleet = Fleet::start(&["acme"]).await;
    let acme = fleet.tenant_server("acme");
    let daemon = fleet.daemon(&[]);
    daemon.wait_for("/readyz?verbose", "tenant acme degraded", SOON).await;
    // What a restarted kube-apiserver's fresh watch cache does to resumed watches, without the
    // refused connections of the restart itself.
    acme.store().forget_history();
    acme.faults().drop_watches();
    install_crds(&acme.client().await).await;
    daemon
        .wait_for("/readyz?verbose", "[+]tenant acme ok", BACK_WITHIN)
        .await;
    let metrics = daemon.http_get("/metrics").unwrap_or_default();
    assert!(
        !metrics.contains("stackd_tenant_restarts_total{tenant=\"acme\"}"),
        "the tenant was restarted for a 410:\n{metrics}"
    );
    let log = daemon.log_text();
    assert!(
        !log.contains("tenant API server unavailable"),
        "a 410 was reported as unreachable:\n{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untrusted_tenant_certificate_is_named_in_readiness() {
    let fleet = Fleet::start(&[]).await;
    let tenant = ApiServer::start(ServerOptions {
        name: "acme".into(),
        tls: true,
        ..Default::default()
    })
    .await
    .expect("tenant");
    let stranger = ApiServer::start(ServerOptions {
        name: "stranger".into(),
        tls: true,
        ..Default::default()
    })
    .await
    .expect("another server");
    // acme's address with the CA of another server: its certificate cannot be verified.
    let mut kubeconfig = tenant.kubeconfig();
    kubeconfig.clusters[0]
        .cluster
        .as_mut()
        .expect("cluster")
        .certificate_authority_data = stranger.kubeconfig().clusters[0]
        .cluster
        .as_ref()
        .and_then(|c| c.certificate_authority_data.clone());
    let yaml = serde_saphyr::to_string(&kubeconfig).expect("kubeconfig YAML");
    std::fs::write(fleet.tenant_file("acme"), yaml).expect("write kubeconfig");
    let daemon = fleet.daemon(&[]);
    let ready = daemon
        .wait_for("/readyz?verbose", "certificate-authority-data", SOON)
        .await;
    let line = ready.lines().find(|l| l.contains("tenant acme")).unwrap_or_default();
    assert!(line.starts_with("[-]tenant acme down"), "{ready}");
    assert!(line.contains("not trusted") && line.contains("UnknownIssuer"), "{line}");
    let metrics = daemon.http_get("/metrics").unwrap_or_default();
    assert!(metrics.contains("stackd_tenant_up{tenant=\"acme\"} 0"), "{metrics}");
    assert!(
        metrics.contains("stackd_tenant_down_cause{tenant=\"acme\",cause=\"certificate\"} 1"),
        "{metrics}"
    );
    // A certificate never fixes itself: the tenant backs off instead of being probed.
    let log = daemon.log_text();
    assert!(log.contains("tenant failed; restarting it"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_watches_wait_for_access_in_a_new_host_namespace() {
    let fleet = Fleet::start(&["acme"]).await;
    // As on a real cluster before the daemon's RoleBinding takes effect: reads in the new host
    // namespace are refused for a moment.
    let refused = RequestMatch::any()
        .verb(Verb::List)
        .resource("secrets")
        .namespace("tenant-acme-controllers");
    fleet.host().faults().fail_next(3, refused, 403);
    let daemon = fleet.daemon(&[]);
    fleet.wait_for_namespace("acme", SOON).await;
    daemon.wait_for("/readyz?verbose", "tenant acme degraded", SOON).await;
    // The injected answer's words, not its code: "403" also turns up in the log's timestamps.
    let log = daemon.log_text();
    assert!(
        !log.to_lowercase().contains("forbidden"),
        "a controller met the 403 of a fresh RoleBinding:\n{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_is_reported_down_within_seconds_of_a_graceful_stop_though_its_watches_stay_open() {
    reported_down_within_seconds_of_a_graceful_stop(Fleet::start(&["acme"]).await).await;
}

/// The same over HTTP/2, where every watch and request rides one connection: the stopping server's
/// GOAWAY lets the watches on it go on while each new request needs a new connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_served_over_one_http2_connection_is_reported_down_within_seconds_of_a_graceful_stop() {
    let mut fleet = Fleet::start(&[]).await;
    let options = ServerOptions {
        name: "acme".into(),
        tls: true,
        ..Default::default()
    };
    fleet.add_tenant_with(options).await;
    reported_down_within_seconds_of_a_graceful_stop(fleet).await;
}

async fn reported_down_within_seconds_of_a_graceful_stop(fleet: Fleet) {
    let acme = fleet.tenant_server("acme");
    install_crds(&acme.client().await).await;
    let daemon = fleet.daemon(&[]);
    // Up means started: every controller has listed, and its watch follows its list.
    daemon.wait_for("/readyz?verbose", "[+]tenant acme ok", SOON).await;
    // As kube-apiserver on SIGTERM: new connections refused, open watches kept for a minute.
    acme.stop_gracefully(Duration::from_secs(60)).await;
    let stopped = Instant::now();
    // Someone whose connection was open writes an install: the kept watches deliver it, and every
    // request the daemon makes for it is refused.
    write_install(acme, "team-a");
    let metrics = daemon
        .wait_for(
            "/metrics",
            "stackd_tenant_up{tenant=\"acme\"} 0",
            DOWN_WITHIN.saturating_sub(stopped.elapsed()),
        )
        .await;
    assert!(
        acme.open_watches() > 0,
        "the stopping server's watches were closed {:?} after it stopped; log:\n{}",
        stopped.elapsed(),
        daemon.log_text()
    );
    assert!(
        metrics.contains("stackd_tenant_down_cause{tenant=\"acme\",cause=\"refused\"} 1"),
        "{metrics}"
    );
    let ready = daemon.http_get("/readyz?verbose").unwrap_or_default();
    assert!(ready.contains("[-]tenant acme down: connection refused"), "{ready}");
    let log = daemon.log_text();
    let told: Vec<&str> = log
        .lines()
        .filter(|line| line.contains("tenant API server unavailable"))
        .collect();
    assert_eq!(told.len(), 1, "told once, with the root cause:\n{log}");
    assert!(
        told[0].contains("WARN") && told[0].contains("Connection refused"),
        "{told:?}"
    );
    acme.serve_again().await.expect("serves again");
    daemon
        .wait_for("/metrics", "stackd_tenant_up{tenant=\"acme\"} 1", BACK_WITHIN)
        .await;
}

/// A fleet with one tenant `acme` served over TLS, and over HTTP/2 as kube-apiserver serves if
/// `http2` (else HTTP/1.1, as through a proxy that speaks no other), registered by a Tenant object,
/// with stackd's CRDs and no stackd object (nothing in flight, ever); and a daemon serving it, Ready.
async fn idle_tenant(http2: bool) -> (Fleet, Daemon) {
    let mut fleet = Fleet::start(&[]).await;
    let options = ServerOptions {
        name: "acme".into(),
        tls: true,
        http2,
        ..Default::default()
    };
    let kubeconfig = fleet.add_tenant_server_with(options).await;
    install_crds(&fleet.tenant_server("acme").client().await).await;
    let kubectl = HostKubectl::new(&fleet);
    install_tenant_crd(&kubectl).await;
    kubectl
        .apply(&registration(
            "acme",
            SECRETS_NAMESPACE,
            "vc-acme",
            "config",
            &kubeconfig,
        ))
        .await;
    let daemon = fleet.daemon(&[]);
    wait_condition(&fleet, &daemon, "acme", "Ready", "True", "Up").await;
    (fleet, daemon)
}

/// Issue 47: a tenant that asks nothing is seen down within 10 s of a graceful stop that keeps its
/// watches a minute (its Tenant, readiness and metric say so, told once), and up when it returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_tenant_is_seen_down_within_seconds_of_a_graceful_stop_and_up_when_it_returns() {
    let (fleet, daemon) = idle_tenant(true).await;
    seen_down_within_seconds_of_a_graceful_stop_and_up_again(fleet, daemon).await;
}

/// The same over HTTP/1.1, which has no GOAWAY: the stopping server closes the idle connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_tenant_served_over_http1_is_seen_down_within_seconds_of_a_graceful_stop() {
    let (fleet, daemon) = idle_tenant(false).await;
    seen_down_within_seconds_of_a_graceful_stop_and_up_again(fleet, daemon).await;
}

async fn seen_down_within_seconds_of_a_graceful_stop_and_up_again(fleet: Fleet, daemon: Daemon) {
    let acme = fleet.tenant_server("acme");
    let before = daemon.log_text().lines().count();
    acme.stop_gracefully(Duration::from_secs(60)).await;
    let stopped = Instant::now();
    let message = wait_until("Tenant acme Ready=False Down", DOWN_WITHIN, &daemon, || async {
        condition(&fleet, "acme", "Ready")
            .await
            .filter(|(status, reason, _)| status == "False" && reason == "Down")
            .map(|(_, _, message)| message)
    })
    .await;
    assert!(message.contains("connection refused"), "{message}");
    let left = DOWN_WITHIN.saturating_sub(stopped.elapsed());
    daemon.wait_for("/readyz?verbose", "[-]tenant acme down", left).await;
    let left = DOWN_WITHIN.saturating_sub(stopped.elapsed());
    daemon
        .wait_for("/metrics", "stackd_tenant_up{tenant=\"acme\"} 0", left)
        .await;
    assert!(
        acme.open_watches() > 0,
        "the stopping server's watches were closed {:?} after it stopped",
        stopped.elapsed()
    );
    let log = daemon.log_text();
    let told = log
        .lines()
        .skip(before)
        .filter(|line| line.contains("tenant API server unavailable"))
        .count();
    assert_eq!(told, 1, "told once:\n{log}");
    acme.serve_again().await.expect("serves again");
    daemon
        .wait_for("/metrics", "stackd_tenant_up{tenant=\"acme\"} 1", BACK_WITHIN)
        .await;
    wait_condition(&fleet, &daemon, "acme", "Ready", "True", "Up").await;
    daemon
        .wait_for("/readyz?verbose", "[+]tenant acme ok", BACK_WITHIN)
        .await;
}

/// Issue 47: watching an idle tenant for an outage costs it at most one request per 10 s while it
/// is up (the GOAWAY of a stopping server costs none; watches, renewed every few minutes, aside).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watching_an_idle_tenant_for_outages_costs_at_most_one_request_per_ten_seconds() {
    const WINDOW: Duration = Duration::from_secs(30);
    let (fleet, daemon) = idle_tenant(true).await;
    let acme = fleet.tenant_server("acme");
    // Its start's last requests (the first sweep, say) are no cost of watching it: the window opens
    // once the server has been asked nothing for 2 s.
    let (mut last, mut quiet_since) = (acme.counters(), Instant::now());
    until("the tenant's start-up requests over", SOON, &daemon, || {
        let now = acme.counters();
        if requests_besides_watches(&now.since(&last)) > 0 {
            quiet_since = Instant::now();
        }
        last = now;
        let quiet = quiet_since.elapsed() >= Duration::from_secs(2);
        async move { quiet }
    })
    .await;
    let before = acme.counters();
    let started = Instant::now();
    holds_for("at most one request per 10 s", WINDOW, &daemon, || async {
        requests_besides_watches(&acme.counters().since(&before)) <= 1 + started.elapsed().as_secs() / 10
    })
    .await;
    let metrics = daemon.http_get("/metrics").unwrap_or_default();
    assert!(metrics.contains("stackd_tenant_up{tenant=\"acme\"} 1"), "{metrics}");
}

fn requests_besides_watches(counts: &RequestCounts) -> u64 {
    counts
        .counts
        .iter()
        .filter(|(key, _)| key.verb != Verb::Watch)
        .map(|(_, count)| count)
        .sum()
}

/// Issue 30: while a tenant is down, one line when it goes, one when it is back; nothing from
/// kube's own client; every failing request of its controllers meanwhile is debug.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thirty_second_outage_of_a_tenant_is_told_in_a_few_lines() {
    const OUTAGE: Duration = Duration::from_secs(30);
    let fleet = Fleet::start(&["acme"]).await;
    let acme = fleet.tenant_server("acme");
    install_crds(&acme.client().await).await;
    let daemon = fleet.daemon(&[]);
    daemon.wait_for("/readyz?verbose", "[+]tenant acme ok", SOON).await;
    let before = daemon.log_text().lines().count();
    // Open watches go on for 10 s, then end and reconnect in vain.
    acme.stop_gracefully(Duration::from_secs(10)).await;
    let stopped = Instant::now();
    write_install(acme, "team-a");
    daemon
        .wait_for("/metrics", "stackd_tenant_up{tenant=\"acme\"} 0", DOWN_WITHIN)
        .await;
    until(
        "reconciles failing against the stopped server",
        OUTAGE,
        &daemon,
        || async { daemon.controller_metric("stackd_reconcile_errors_total", "acme", "StackInstall") >= 3 },
    )
    .await;
    until("the kept watches to end", OUTAGE, &daemon, || async {
        acme.open_watches() == 0
    })
    .await;
    // The outage lasts its 30 s whatever happened in it (the scenario's length); all along, the
    // tenant is never reported up.
    let rest = OUTAGE.saturating_sub(stopped.elapsed());
    holds_for("acme not up during the outage", rest, &daemon, || async {
        let metrics = daemon.http_get("/metrics").unwrap_or_default();
        !metrics.contains("stackd_tenant_up{tenant=\"acme\"} 1")
    })
    .await;
    acme.serve_again().await.expect("serves again");
    daemon
        .wait_for("/metrics", "stackd_tenant_up{tenant=\"acme\"} 1", BACK_WITHIN)
        .await;
    let log = daemon.log_text();
    let told = lines_until(&log, before, "tenant API server answers again");
    assert!(
        told.last()
            .is_some_and(|line| line.contains("tenant API server answers again")),
        "the return is told:\n{log}"
    );
    assert!(
        told.len() <= 5,
        "{} lines for one outage:\n{}",
        told.len(),
        told.join("\n")
    );
    assert!(!log.contains("kube_client"), "kube's client logged:\n{log}");
}

/// Issue 30: the probe's success wakes the tenant's watches, so an install created the moment a
/// restarted server answers is Ready about as soon as one on a settled tenant (measured here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_install_right_after_a_tenant_restart_is_ready_about_as_soon_as_on_a_settled_tenant() {
    let fleet = Fleet::start(&["acme"]).await;
    register_sample_runners(&fleet.host().runners(), &SampleImages::new(STACKD_IMAGE));
    let acme = fleet.tenant_server("acme");
    install_crds(&acme.client().await).await;
    let daemon = fleet.daemon(&["--stackd-image", STACKD_IMAGE, "--allow-insecure-tenant-endpoint"]);
    daemon.wait_for("/readyz?verbose", "[+]tenant acme ok", SOON).await;
    let settled = install_ready_s(&acme.client().await, "settled", &daemon).await;
    acme.restart_after(RestartState::FreshWatchCache, Duration::from_secs(2))
        .await
        .expect("restart");
    let after_restart = install_ready_s(&acme.client().await, "after-restart", &daemon).await;
    // The goal is 1 s more. After a restart every cache relists and every object is reconciled
    // again, which takes longer on a loaded machine: the settled install's time more is allowed
    // for it. (Before issue 30 the watches waited out their backoff: 2 to 4 s more.)
    let allowed = 1.0 + 2.0 * settled;
    assert!(
        after_restart <= allowed,
        "Ready {after_restart:.2} s after a restart, {settled:.2} s on the settled tenant:\n{}",
        daemon.log_text()
    );
}

/// Creates a namespace and the sample install in it; the seconds until the install is Ready.
pub(crate) async fn install_ready_s(client: &Client, namespace: &str, daemon: &crate::harness::Daemon) -> f64 {
    let started = Instant::now();
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
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
    until("the install Ready", Duration::from_secs(30), daemon, || async {
        let install = installs.get_opt("sample").await.ok().flatten();
        install
            .and_then(|i| i.status)
            .is_some_and(|s| s.conditions.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
    })
    .await;
    started.elapsed().as_secs_f64()
}

/// Issue 30: a tenant answering 503 to everything has `stackd_tenant_up` and a cause (kube's client
/// used to retry each such request for minutes, so nothing was ever reported).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_answering_503_to_everything_is_reported_down_with_its_cause() {
    let fleet = Fleet::start(&["acme"]).await;
    let acme = fleet.tenant_server("acme");
    acme.faults().fail_next(usize::MAX, RequestMatch::any(), 503);
    let daemon = fleet.daemon(&[]);
    let metrics = daemon
        .wait_for(
            "/metrics",
            "stackd_tenant_down_cause{tenant=\"acme\",cause=\"server_busy\"} 1",
            SOON,
        )
        .await;
    assert!(metrics.contains("stackd_tenant_up{tenant=\"acme\"} 0"), "{metrics}");
    let ready = daemon.http_get("/readyz?verbose").unwrap_or_default();
    assert!(ready.contains("[-]tenant acme down: 503 ServiceUnavailable"), "{ready}");
    acme.faults().clear();
    daemon
        .wait_for("/readyz?verbose", "tenant acme degraded", BACK_WITHIN + SOON)
        .await;
}
