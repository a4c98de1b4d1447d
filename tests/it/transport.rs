//! How the daemon reaches its API servers (`runtime::transport`). A tenant whose API server offers
//! HTTP/2 (kube-apiserver does, by ALPN on its TLS port) is served over one connection: every watch
//! and request of the daemon rides it. One that speaks HTTP/1.1 only gets a connection per watch and
//! is served the same. The host client keeps few idle connections. A stopping server's GOAWAY on
//! the shared connection is seen (issue 47).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures::TryStreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::api::{Api, ListParams, WatchEvent, WatchParams};
use stackd::embedded::discovery::Resources;
use stackd::embedded::faults::RequestMatch;
use stackd::embedded::samples::{SampleImages, register_sample_runners};
use stackd::embedded::{ApiServer, ServerOptions, Verb, verbs};
use stackd::runtime::transport;

use crate::harness::{Daemon, Fleet, NoDaemon, holds_for, install_crds, until};
use crate::recovery::install_ready_s;

const SOON: Duration = Duration::from_secs(10);
/// The image install Jobs get, which the host's sample runners run.
const STACKD_IMAGE: &str = "stackd:test";
/// Fewer watches than an idle tenant's caches hold open: enough to tell one connection per watch
/// from one for all.
const SOME_WATCHES: u64 = 10;

async fn tls_tenant(fleet: &mut Fleet, http2: bool) -> &ApiServer {
    let options = ServerOptions {
        name: "acme".into(),
        tls: true,
        http2,
        ..Default::default()
    };
    fleet.add_tenant_with(options).await;
    let acme = fleet.tenant_server("acme");
    install_crds(&acme.client().await).await;
    // The set-up client's connections close with it.
    until("the set-up's connections closed", SOON, &NoDaemon, || async {
        acme.open_connections() == 0
    })
    .await;
    acme
}

/// A daemon serving the TLS tenant "acme" (the host runs the sample images), once its watches are open.
async fn daemon_with_tls_tenant(http2: bool) -> (Fleet, Daemon) {
    let mut fleet = Fleet::start(&[]).await;
    register_sample_runners(&fleet.host().runners(), &SampleImages::new(STACKD_IMAGE));
    tls_tenant(&mut fleet, http2).await;
    let daemon = fleet.daemon(&["--stackd-image", STACKD_IMAGE]);
    daemon.wait_for("/readyz?verbose", "[+]tenant acme ok", SOON).await;
    let acme = fleet.tenant_server("acme");
    until("the daemon's watches open", SOON, &daemon, || async {
        acme.open_watches() >= SOME_WATCHES
    })
    .await;
    (fleet, daemon)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_offering_http2_gets_every_watch_and_request_over_one_connection() {
    let (fleet, daemon) = daemon_with_tls_tenant(true).await;
    let acme = fleet.tenant_server("acme");
    // Requests made before the first connection had agreed on HTTP/2 may each have opened one;
    // those close once it has.
    until("one connection", SOON, &daemon, || async {
        acme.open_connections() == 1
    })
    .await;
    holds_for("one connection", Duration::from_secs(2), &daemon, || async {
        acme.open_connections() == 1
    })
    .await;
    // Writes, patches, status updates and the watch events they cause all go over it.
    let client = acme.client().await;
    install_ready_s(&client, "team-a", &daemon).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_speaking_only_http1_gets_a_connection_per_watch_and_is_served_the_same() {
    let (fleet, daemon) = daemon_with_tls_tenant(false).await;
    let acme = fleet.tenant_server("acme");
    let (watches, connections) = (acme.open_watches(), acme.open_connections());
    assert!(
        connections >= watches,
        "{connections} connections for {watches} watches"
    );
    let client = acme.client().await;
    install_ready_s(&client, "team-a", &daemon).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kubeconfigs_token_and_certificate_authority_hold_over_http2() {
    let acme = ApiServer::start(ServerOptions {
        name: "acme".into(),
        tls: true,
        token: Some("s3cret".into()),
        ..Default::default()
    })
    .await
    .expect("server");
    let client = transport::tenant_client(acme.config().await).expect("client");
    let namespaces: Api<Namespace> = Api::all(client.clone());
    // The first request opens the connection and agrees on HTTP/2 (requests made at once before
    // that may each open one, as the daemon's first test here allows for); then three watches and
    // a list at once, all on that connection.
    namespaces
        .list(&ListParams::default())
        .await
        .expect("a first list with the token");
    let watches: Vec<_> = (0..3)
        .map(|_| {
            let namespaces = namespaces.clone();
            tokio::spawn(async move { namespaces.watch(&WatchParams::default(), "0").await.map(|_| ()) })
        })
        .collect();
    for watch in watches {
        watch.await.expect("joined").expect("a watch");
    }
    namespaces
        .list(&ListParams::default())
        .await
        .expect("a list with the token");
    assert_eq!(acme.open_connections(), 1);

    let mut wrong = acme.kubeconfig();
    wrong.auth_infos[0].auth_info.as_mut().expect("user").token = Some("nope".to_string().into());
    let config = kube::Config::from_custom_kubeconfig(wrong, &Default::default())
        .await
        .expect("config");
    let refused = Api::<Namespace>::all(transport::tenant_client(config).expect("client"))
        .list(&ListParams::default())
        .await
        .expect_err("a wrong token");
    assert!(
        matches!(&refused, kube::Error::Api(status) if status.code == 401),
        "{refused:?}"
    );

    let stranger = ApiServer::start(ServerOptions {
        tls: true,
        ..Default::default()
    })
    .await
    .expect("another server");
    let mut untrusted = acme.config().await;
    untrusted.root_cert = stranger.config().await.root_cert;
    let failed = Api::<Namespace>::all(transport::tenant_client(untrusted).expect("client"))
        .list(&ListParams::default())
        .await
        .expect_err("a certificate of another authority");
    assert!(!matches!(failed, kube::Error::Api(_)), "{failed:?}");
}

/// HTTP/2 flow control: what a stream may hold unread is bounded by its own window, and the
/// connection's must be larger than all of them together, or a few watches whose events wait to be
/// read (a busy controller behind them) would stop every other request of the tenant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watches_left_unread_do_not_hold_up_the_other_requests_on_their_connection() {
    const UNREAD_WATCHES: usize = 4;
    const BIG_OBJECTS: usize = 8;
    let acme = ApiServer::start(ServerOptions {
        name: "acme".into(),
        tls: true,
        ..Default::default()
    })
    .await
    .expect("server");
    let client = transport::tenant_client(acme.config().await).expect("client");
    let configmaps: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    let mut unread = Vec::new();
    for _ in 0..UNREAD_WATCHES {
        unread.push(configmaps.watch(&WatchParams::default(), "0").await.expect("a watch"));
    }
    // Written in-process, so that all the server sends from here on goes to the watches: each is
    // sent all of it, far more than its window.
    let sent = acme.bytes_sent();
    let store = acme.store();
    let info = Resources::current(&store)
        .find("", "v1", "configmaps")
        .expect("configmaps");
    for index in 0..BIG_OBJECTS {
        let big = serde_json::json!({
            "metadata": {"name": format!("big-{index}")},
            "data": {"blob": "x".repeat(900 * 1024)},
        });
        verbs::create(&store, &info, "default", big, Default::default()).expect("create");
    }
    // A connection window smaller than the watches' together stops the server short of this.
    let windows = UNREAD_WATCHES as u64 * u64::from(transport::STREAM_WINDOW);
    until(
        "the server to send what the watches' windows allow",
        SOON,
        &NoDaemon,
        || async { acme.bytes_sent() - sent >= windows },
    )
    .await;
    let listed = tokio::time::timeout(SOON, configmaps.list_metadata(&ListParams::default())).await;
    let listed = listed.expect("the list answered while watches on its connection are left unread");
    assert_eq!(listed.expect("a list").items.len(), BIG_OBJECTS);
    drop(unread);
}

/// The host client keeps few connections idle: a replica's thousands of host watches are renewed
/// every few minutes, each renewal's request going out before the ended watch's connection is back,
/// and kube's own client kept every such spare for 90 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_host_client_keeps_few_connections_idle_after_a_burst() {
    const BURST: usize = 100;
    let host = ApiServer::start(ServerOptions::default()).await.expect("server");
    // Each list answered late: the burst's requests are all open at once, a connection each.
    host.faults()
        .add_answer_latency(RequestMatch::any().verb(Verb::List), Duration::from_millis(500));
    let namespaces: Api<Namespace> = Api::all(transport::host_client(host.config().await).expect("client"));
    let burst: Vec<_> = (0..BURST)
        .map(|_| {
            let namespaces = namespaces.clone();
            tokio::spawn(async move { namespaces.list(&ListParams::default()).await.map(|_| ()) })
        })
        .collect();
    for request in burst {
        request.await.expect("joined").expect("a list");
    }
    until("the spare connections closed", SOON, &NoDaemon, || async {
        host.open_connections() <= 32
    })
    .await;
    namespaces
        .list(&ListParams::default())
        .await
        .expect("a list on a kept connection");
}

/// What seeing an idle tenant's stop rests on (issue 47), as kube-apiserver behaves on SIGTERM: a
/// gracefully stopping server sends GOAWAY on the shared HTTP/2 connection (the client calls its
/// `GoingAway`), refuses new connections at once, and the watches open on it go on delivering.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gracefully_stopping_server_says_goaway_refuses_new_connections_and_keeps_its_watches() {
    let acme = ApiServer::start(ServerOptions {
        name: "acme".into(),
        tls: true,
        ..Default::default()
    })
    .await
    .expect("server");
    let going_away = Arc::new(AtomicUsize::new(0));
    let told = going_away.clone();
    let client = transport::tenant_client_builder(
        acme.config().await,
        Arc::new(move || {
            told.fetch_add(1, Ordering::Relaxed);
        }),
    )
    .expect("client")
    .build();
    let configmaps: Api<ConfigMap> = Api::namespaced(client, "default");
    let listed = configmaps.list(&ListParams::default()).await.expect("a first list");
    let version = listed.metadata.resource_version.unwrap_or_default();
    let events = configmaps
        .watch(&WatchParams::default(), &version)
        .await
        .expect("a watch");
    let mut events = Box::pin(events);
    assert_eq!(going_away.load(Ordering::Relaxed), 0, "no GOAWAY while it serves");

    acme.stop_gracefully(Duration::from_secs(60)).await;
    until("a GOAWAY on the connection", SOON, &NoDaemon, || async {
        going_away.load(Ordering::Relaxed) > 0
    })
    .await;
    let refused = configmaps
        .list(&ListParams::default())
        .await
        .expect_err("a new request after the stop");
    assert!(format!("{refused:?}").contains("ConnectionRefused"), "{refused:?}");
    // Written by someone whose connection was open: the kept watch delivers it.
    let store = acme.store();
    let resources = Resources::current(&store);
    let configmap_resource = resources.find("", "v1", "configmaps").expect("configmaps");
    let configmap = serde_json::json!({"metadata": {"name": "late", "namespace": "default"}});
    verbs::create(&store, &configmap_resource, "default", configmap, Default::default()).expect("create");
    let event = tokio::time::timeout(SOON, events.try_next())
        .await
        .expect("the kept watch delivers within 10 s")
        .expect("a watch event");
    assert!(
        matches!(&event, Some(WatchEvent::Added(added)) if added.metadata.name.as_deref() == Some("late")),
        "{event:?}"
    );
}
