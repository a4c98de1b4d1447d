//! Recovery after faults (issue 15): a tenant back from an outage is served again within seconds of
//! answering, whatever backoff it had built up; a restart with a fresh watch cache (410 on resumed
//! watches) is no outage; trouble is named by its root cause.

use std::time::{Duration, Instant};

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, PostParams};
use stackd::embedded::faults::RequestMatch;
use stackd::embedded::{ApiServer, RestartState, ServerOptions, Verb};

use crate::harness::Fleet;

/// The promise: up again within 5 s of the server answering.
const BACK_WITHIN: Duration = Duration::from_secs(5);
const SOON: Duration = Duration::from_secs(10);

fn server<'a>(fleet: &'a Fleet, tenant: &str) -> &'a ApiServer {
    fleet
        .tenants
        .iter()
        .find(|(name, _)| name == tenant)
        .and_then(|(_, server)| server.as_ref())
        .expect("a running tenant server")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_down_at_start_is_served_within_seconds_of_answering_though_its_backoff_is_long() {
    let fleet = Fleet::start(&["acme"]).await;
    let acme = server(&fleet, "acme");
    // The server is down when the daemon starts; a 40 s backoff base makes the first restart delay
    // longer than 30 s, so only the probe can bring the tenant back in time.
    let outage = acme.restart_after(RestartState::FreshWatchCache, Duration::from_secs(6));
    let observe = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
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
    assert!(log.contains("restarting the tenant once it does"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_restarting_with_a_fresh_watch_cache_is_watched_again_within_seconds() {
    let fleet = Fleet::start(&["acme"]).await;
    let acme = server(&fleet, "acme");
    let daemon = fleet.daemon(&[]);
    // Without stackd's CRDs the tenant is degraded; installing them flips it to ok through the watch.
    daemon.wait_for("/readyz?verbose", "tenant acme degraded", SOON).await;
    acme.restart_after(RestartState::FreshWatchCache, Duration::from_secs(8))
        .await
        .expect("restart");
    let answered = Instant::now();
    let crds: Api<CustomResourceDefinition> = Api::all(acme.client().await);
    for crd in stackd::api::crds::all() {
        crds.create(&PostParams::default(), &crd).await.expect("create CRD");
    }
    daemon
        .wait_for("/readyz?verbose", "[+]tenant acme ok", BACK_WITHIN)
        .await;
    assert!(answered.elapsed() <= BACK_WITHIN);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_watch_is_not_reported_as_an_outage() {
    let fleet = Fleet::start(&["acme"]).await;
    let acme = server(&fleet, "acme");
    let daemon = fleet.daemon(&[]);
    daemon.wait_for("/readyz?verbose", "tenant acme degraded", SOON).await;
    // What a restarted kube-apiserver's fresh watch cache does to resumed watches, without the
    // refused connections of the restart itself.
    acme.store().forget_history();
    acme.faults().drop_watches();
    let crds: Api<CustomResourceDefinition> = Api::all(acme.client().await);
    for crd in stackd::api::crds::all() {
        crds.create(&PostParams::default(), &crd).await.expect("create CRD");
    }
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
