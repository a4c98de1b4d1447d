//! Fault injection and request counters on the embedded API server, as a kube-rs client sees them.

use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Secret};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, WatchParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use serde_json::json;
use stackd::embedded::faults::RequestMatch;
use stackd::embedded::{RestartState, Verb};
use tokio::time::timeout;

use crate::harness::{self, NoDaemon, TestServer, api_error, configmap, until};

const WAIT: Duration = Duration::from_secs(10);

fn create_configmaps() -> RequestMatch {
    RequestMatch::any().verb(Verb::Create).resource("ConfigMap")
}

/// A client without kube's default retry of 429/503/504, so each injected answer is seen as it is.
async fn client_without_retries(t: &TestServer) -> kube::Client {
    let mut config = kube::Config::from_custom_kubeconfig(t.server.kubeconfig(), &Default::default())
        .await
        .unwrap();
    config.default_retry = false;
    kube::Client::try_from(config).unwrap()
}

#[tokio::test]
async fn injected_failures_reach_a_kube_client_with_their_code_and_reason_then_stop() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let api: Api<ConfigMap> = Api::namespaced(client_without_retries(&t).await, "ns");
    for (code, reason) in [
        (409, "Conflict"),
        (500, "InternalError"),
        (503, "ServiceUnavailable"),
        (429, "TooManyRequests"),
    ] {
        t.server
            .faults()
            .fail_next(1, create_configmaps().namespace("ns"), code);
        let name = format!("c{code}");
        let error = api_error(
            api.create(&PostParams::default(), &configmap(&name, json!({})))
                .await
                .unwrap_err(),
        );
        assert_eq!((error.code, error.reason.as_str()), (code, reason));
        api.create(&PostParams::default(), &configmap(&name, json!({})))
            .await
            .expect("only the next request fails");
    }
}

#[tokio::test]
async fn kube_clients_retry_an_injected_503_by_default() {
    let t = harness::start().await;
    t.namespace("ns").await;
    t.server.faults().set_retry_after(0);
    t.server.faults().fail_next(2, create_configmaps(), 503);
    let before = t.server.counters();
    t.configmaps("ns")
        .create(&PostParams::default(), &configmap("a", json!({})))
        .await
        .expect("retried past the injected failures");
    let made = t.server.counters().since(&before);
    assert_eq!(made.get(Verb::Create, "configmaps", Some("ns")), 3);
}

#[tokio::test]
async fn injected_failures_match_verb_resource_and_namespace() {
    let t = harness::start().await;
    t.namespace("ns").await;
    t.namespace("other").await;
    t.server.faults().fail_next(2, create_configmaps().namespace("ns"), 500);
    let secrets: Api<Secret> = Api::namespaced(t.client.clone(), "ns");
    let secret: Secret = serde_json::from_value(json!({"metadata": {"name": "s"}})).unwrap();
    secrets
        .create(&PostParams::default(), &secret)
        .await
        .expect("another kind passes");
    t.configmaps("other")
        .create(&PostParams::default(), &configmap("a", json!({})))
        .await
        .expect("another namespace passes");
    t.configmaps("ns")
        .list(&ListParams::default())
        .await
        .expect("another verb passes");
    for _ in 0..2 {
        let error = t
            .configmaps("ns")
            .create(&PostParams::default(), &configmap("a", json!({})))
            .await
            .unwrap_err();
        assert_eq!(api_error(error).code, 500);
    }
    t.configmaps("ns")
        .create(&PostParams::default(), &configmap("a", json!({})))
        .await
        .unwrap();
}

#[tokio::test]
async fn injected_429_carries_retry_after_and_a_status_body() {
    let t = harness::start().await;
    t.namespace("ns").await;
    t.server.faults().set_retry_after(7);
    t.server
        .faults()
        .fail_next(1, RequestMatch::any().verb(Verb::List).resource("configmaps"), 429);
    let request = http::Request::get("/api/v1/namespaces/ns/configmaps")
        .body(Vec::new())
        .unwrap();
    let client = client_without_retries(&t).await;
    let response = client.send(request.map(Into::into)).await.unwrap();
    assert_eq!(response.status().as_u16(), 429);
    assert_eq!(response.headers()["retry-after"], "7");
    let body = http_body_util::BodyExt::collect(response.into_body())
        .await
        .unwrap()
        .to_bytes();
    let status: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(status["kind"], "Status");
    assert_eq!(status["reason"], "TooManyRequests");
    assert_eq!(status["details"]["retryAfterSeconds"], 7);
}

#[tokio::test]
async fn latency_is_added_to_matching_requests_only() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let api = t.configmaps("ns");
    api.create(&PostParams::default(), &configmap("a", json!({})))
        .await
        .unwrap();
    t.server.faults().add_latency(
        RequestMatch::any().verb(Verb::Get).resource("configmaps"),
        Duration::from_millis(300),
    );
    let started = Instant::now();
    api.get("a").await.unwrap();
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "{:?}",
        started.elapsed()
    );
    let started = Instant::now();
    api.list(&ListParams::default()).await.unwrap();
    assert!(
        started.elapsed() < Duration::from_millis(300),
        "{:?}",
        started.elapsed()
    );
    t.server.faults().clear();
    let started = Instant::now();
    api.get("a").await.unwrap();
    assert!(started.elapsed() < Duration::from_millis(300));
}

/// Answer latency: the write is stored and watched at once, and answered late.
#[tokio::test]
async fn answer_latency_lets_the_watch_event_come_before_the_answer() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let api = t.configmaps("ns");
    let mut events = api.watch(&WatchParams::default(), "0").await.unwrap().boxed();
    t.server
        .faults()
        .add_answer_latency(create_configmaps(), Duration::from_millis(500));
    let started = Instant::now();
    let create = tokio::spawn(async move { api.create(&PostParams::default(), &configmap("a", json!({}))).await });
    let event = timeout(WAIT, events.next())
        .await
        .expect("an event")
        .expect("a watch event");
    let seen_after = started.elapsed();
    assert!(matches!(event, Ok(kube::api::WatchEvent::Added(_))), "{event:?}");
    create.await.unwrap().expect("created");
    assert!(
        seen_after < Duration::from_millis(500),
        "the event waited for the answer: {seen_after:?}"
    );
    assert!(
        started.elapsed() >= Duration::from_millis(500),
        "{:?}",
        started.elapsed()
    );
}

/// A kube-runtime watcher on the namespace's ConfigMaps, past its first InitDone.
async fn started_watcher(
    t: &TestServer,
) -> futures::stream::BoxStream<'static, Result<Event<ConfigMap>, watcher::Error>> {
    let config = watcher::Config::default().disable_bookmarks();
    let mut events = watcher::watcher(t.configmaps("ns"), config).default_backoff().boxed();
    loop {
        if let Ok(Event::InitDone) = timeout(WAIT, events.next()).await.unwrap().unwrap() {
            return events;
        }
    }
}

/// Waits for `name` to be applied; returns whether a relist (Init) happened on the way.
async fn applied(
    events: &mut futures::stream::BoxStream<'static, Result<Event<ConfigMap>, watcher::Error>>,
    name: &str,
) -> bool {
    let mut relisted = false;
    loop {
        match timeout(WAIT, events.next())
            .await
            .expect("the watcher keeps going")
            .unwrap()
        {
            Ok(Event::Init) => relisted = true,
            Ok(Event::Apply(cm) | Event::InitApply(cm)) if cm.metadata.name.as_deref() == Some(name) => {
                return relisted;
            }
            _ => {}
        }
    }
}

#[tokio::test]
async fn dropped_watches_make_the_kube_runtime_watcher_reconnect_without_relisting() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let mut events = started_watcher(&t).await;
    let before = t.server.counters();
    t.server.faults().drop_watches();
    // The dropped watch has ended before the change, so that only a new watch can deliver it.
    until("the watch dropped", WAIT, &NoDaemon, || async {
        t.server.open_watches() == 0
    })
    .await;
    t.configmaps("ns")
        .create(&PostParams::default(), &configmap("after", json!({})))
        .await
        .unwrap();
    assert!(!applied(&mut events, "after").await, "resumed, not relisted");
    let made = t.server.counters().since(&before);
    assert!(made.get(Verb::Watch, "configmaps", Some("ns")) >= 1, "{made:?}");
    assert_eq!(made.get(Verb::List, "configmaps", Some("ns")), 0, "{made:?}");
}

#[tokio::test]
async fn restart_keeping_state_lets_the_watcher_resume() {
    let t = harness::start().await;
    t.namespace("ns").await;
    t.configmaps("ns")
        .create(&PostParams::default(), &configmap("before", json!({})))
        .await
        .unwrap();
    let mut events = started_watcher(&t).await;
    let url = t.server.url();
    let lists_before = t.server.counters().get(Verb::List, "configmaps", Some("ns"));
    t.server.restart(RestartState::Keep).await.unwrap();
    assert_eq!(t.server.url(), url, "same address");
    assert!(t.configmaps("ns").get("before").await.is_ok(), "state kept");
    t.configmaps("ns")
        .create(&PostParams::default(), &configmap("after", json!({})))
        .await
        .unwrap();
    assert!(!applied(&mut events, "after").await, "resumed from its resourceVersion");
    assert_eq!(
        t.server.counters().get(Verb::List, "configmaps", Some("ns")),
        lists_before
    );
}

#[tokio::test]
async fn restart_losing_state_makes_the_watcher_relist_after_a_410() {
    let t = harness::start().await;
    t.namespace("ns").await;
    for i in 0..5 {
        t.configmaps("ns")
            .create(&PostParams::default(), &configmap(&format!("old{i}"), json!({})))
            .await
            .unwrap();
    }
    let old_version = t
        .configmaps("ns")
        .list(&ListParams::default())
        .await
        .unwrap()
        .metadata
        .resource_version;
    let mut events = started_watcher(&t).await;
    t.server.restart(RestartState::Lose).await.unwrap();
    let namespaces: Api<Namespace> = Api::all(t.client.clone());
    assert!(namespaces.get_opt("ns").await.unwrap().is_none(), "state lost");

    let raw: Api<ConfigMap> = Api::all(t.client.clone());
    let mut stale = raw
        .watch(&WatchParams::default(), old_version.as_deref().unwrap_or("1"))
        .await
        .unwrap()
        .boxed();
    match timeout(WAIT, stale.next()).await.unwrap() {
        Some(Err(kube::Error::Api(status))) => assert_eq!(status.code, 410),
        Some(Ok(kube::api::WatchEvent::Error(status))) => assert_eq!(status.code, 410),
        other => panic!("expected a 410 for a version from before the restart, got {other:?}"),
    }

    t.namespace("ns").await;
    t.configmaps("ns")
        .create(&PostParams::default(), &configmap("fresh", json!({})))
        .await
        .unwrap();
    assert!(applied(&mut events, "fresh").await, "relisted after the 410");
}

#[tokio::test]
async fn counters_match_the_requests_made() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let api = t.configmaps("ns");
    let before = t.server.counters();
    api.create(&PostParams::default(), &configmap("a", json!({})))
        .await
        .unwrap();
    api.create(&PostParams::default(), &configmap("b", json!({})))
        .await
        .unwrap();
    api.get("a").await.unwrap();
    api.list(&ListParams::default()).await.unwrap();
    api.patch("a", &PatchParams::default(), &Patch::Merge(json!({"data": {"x": "y"}})))
        .await
        .unwrap();
    api.delete("b", &DeleteParams::default()).await.unwrap();
    let all: Api<ConfigMap> = Api::all(t.client.clone());
    all.list(&ListParams::default()).await.unwrap();
    let mut stream = all
        .watch(&WatchParams::default().timeout(1), "0")
        .await
        .unwrap()
        .boxed();
    while timeout(WAIT, stream.next()).await.unwrap().is_some() {}
    let made = t.server.counters().since(&before);
    let count = |verb, namespace| made.get(verb, "configmaps", namespace);
    assert_eq!(count(Verb::Create, Some("ns")), 2);
    assert_eq!(count(Verb::Get, Some("ns")), 1);
    assert_eq!(count(Verb::List, Some("ns")), 1);
    assert_eq!(count(Verb::List, Some("")), 1, "the cluster-wide list");
    assert_eq!(count(Verb::List, None), 2);
    assert_eq!(count(Verb::Patch, Some("ns")), 1);
    assert_eq!(count(Verb::Delete, Some("ns")), 1);
    assert_eq!(count(Verb::Watch, None), 1, "a watch counts once, when opened");
    assert_eq!(made.total(), 8, "{made:?}");
}

#[tokio::test]
async fn restart_over_tls_serves_the_same_certificate_and_token() {
    let t = harness::start_with(stackd::embedded::ServerOptions {
        tls: true,
        token: Some("secret-token".into()),
        ..Default::default()
    })
    .await;
    t.namespace("ns").await;
    t.server.restart(RestartState::Keep).await.unwrap();
    t.configmaps("ns")
        .create(&PostParams::default(), &configmap("after", json!({})))
        .await
        .expect("the old client trusts the restarted server");
}

/// The next watcher event within `within`, if any.
async fn next_event(
    events: &mut futures::stream::BoxStream<'static, Result<Event<ConfigMap>, watcher::Error>>,
    within: Duration,
) -> Option<Event<ConfigMap>> {
    match timeout(within, events.next()).await {
        Ok(Some(Ok(event))) => Some(event),
        Ok(other) => panic!("the watcher ended or failed: {other:?}"),
        Err(_) => None,
    }
}

#[tokio::test]
async fn paused_watches_deliver_nothing_until_resumed_then_everything_in_order() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let api = t.configmaps("ns");
    let mut events = started_watcher(&t).await;
    let paused = t
        .server
        .faults()
        .pause_watches(RequestMatch::any().resource("configmaps"));
    let mut written = Vec::new();
    for name in ["a", "b"] {
        let created = api
            .create(&PostParams::default(), &configmap(name, json!({})))
            .await
            .unwrap();
        written.push(("apply", name, created.resource_version()));
    }
    let patched = api
        .patch("a", &PatchParams::default(), &Patch::Merge(json!({"data": {"x": "y"}})))
        .await
        .unwrap();
    written.push(("apply", "a", patched.resource_version()));
    // A watch that ends while paused resumes into the same pause.
    t.server.faults().drop_watches();
    let deleted = api.delete("b", &DeleteParams::default()).await.unwrap();
    let deleted_at = deleted.left().and_then(|cm| cm.resource_version());
    assert!(deleted_at.is_some(), "the delete answered the removed ConfigMap");
    written.push(("delete", "b", deleted_at));

    // Another resource's watch is not paused.
    let secrets: Api<Secret> = Api::namespaced(t.client.clone(), "ns");
    let mut secret_events = watcher::watcher(secrets.clone(), watcher::Config::default())
        .applied_objects()
        .boxed();
    let secret: Secret = serde_json::from_value(json!({"metadata": {"name": "s"}})).unwrap();
    secrets.create(&PostParams::default(), &secret).await.unwrap();
    let seen = timeout(WAIT, secret_events.next()).await.unwrap().unwrap().unwrap();
    assert_eq!(seen.name_any(), "s");

    let mut while_paused = Vec::new();
    while let Some(event) = next_event(&mut events, Duration::from_millis(500)).await {
        while_paused.push(event);
    }
    assert!(
        while_paused.iter().all(|e| matches!(e, Event::Init | Event::InitDone)),
        "delivered while paused: {while_paused:?}"
    );

    paused.resume();
    let mut delivered = Vec::new();
    while delivered.len() < written.len() {
        match next_event(&mut events, WAIT)
            .await
            .expect("the held events after resuming")
        {
            Event::Apply(cm) => delivered.push(("apply", cm.name_any(), cm.resource_version())),
            Event::Delete(cm) => delivered.push(("delete", cm.name_any(), cm.resource_version())),
            other => panic!("a relist instead of the held events: {other:?}"),
        }
    }
    let written: Vec<_> = written
        .into_iter()
        .map(|(what, name, version)| (what, name.to_string(), version))
        .collect();
    assert_eq!(delivered, written);
}

/// As kube-apiserver on SIGTERM: new connections are refused at once, while an open watch goes on
/// delivering until its time is up; then the server serves again on the same address.
#[tokio::test]
async fn a_graceful_stop_refuses_new_connections_and_keeps_open_watches_for_a_while() {
    use stackd::embedded::discovery::Resources;
    use stackd::embedded::verbs;
    const KEPT: Duration = Duration::from_secs(2);
    let t = harness::start().await;
    t.namespace("ns").await;
    let mut events = started_watcher(&t).await;
    // Something delivered through the watch: its connection is open.
    t.configmaps("ns")
        .create(&PostParams::default(), &configmap("before", json!({})))
        .await
        .unwrap();
    assert!(!applied(&mut events, "before").await);
    t.server.stop_gracefully(KEPT).await;
    let stopped = Instant::now();
    let fresh = client_without_retries(&t).await;
    let err = Api::<ConfigMap>::namespaced(fresh, "ns")
        .get("any")
        .await
        .expect_err("a new connection is refused");
    let cause = stackd::runtime::cause::diagnose(&err);
    assert_eq!(cause.kind, stackd::runtime::cause::CauseKind::Refused, "{cause}");
    // A write by someone already connected (in-process here) reaches the open watch.
    let store = t.server.store();
    let info = Resources::current(&store).find("", "v1", "configmaps").unwrap();
    let during = json!({"metadata": {"name": "during"}});
    verbs::create(&store, &info, "ns", during, Default::default()).unwrap();
    assert!(!applied(&mut events, "during").await, "delivered by the open watch");
    assert!(t.server.open_watches() >= 1);
    until("the kept watch to end", WAIT, &NoDaemon, || async {
        t.server.open_watches() == 0
    })
    .await;
    assert!(stopped.elapsed() >= KEPT - Duration::from_millis(100), "ended early");
    t.server.serve_again().await.unwrap();
    t.configmaps("ns")
        .create(&PostParams::default(), &configmap("after", json!({})))
        .await
        .unwrap();
    assert!(!applied(&mut events, "after").await, "resumed on the same address");
}

/// A watch that a connection busy at a graceful stop asks for after it (its request was on its way)
/// ends at the stop's deadline with the others: the deadline is the server's, as kube-apiserver's
/// shutdown timeout is, not each request's.
#[tokio::test]
async fn a_watch_asked_for_on_a_busy_connection_after_a_graceful_stop_ends_at_its_deadline() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const KEPT: Duration = Duration::from_secs(2);
    let t = harness::start().await;
    t.namespace("ns").await;
    let address = t.server.url().trim_start_matches("http://").to_string();
    let mut connection = tokio::net::TcpStream::connect(&address).await.unwrap();
    // Half of the request's head is sent before the stop, the rest after it: the connection is
    // busy once the server has read some of it.
    let received = t.server.bytes_received();
    let head = "GET /api/v1/namespaces/ns/configmaps?watch=true HTTP/1.1\r\nHost: stackd\r\n";
    connection.write_all(head.as_bytes()).await.unwrap();
    until("the server to read the first half", WAIT, &NoDaemon, || async {
        t.server.bytes_received() > received
    })
    .await;
    t.server.stop_gracefully(KEPT).await;
    let stopped = Instant::now();
    connection.write_all(b"Accept: application/json\r\n\r\n").await.unwrap();
    let mut answer = [0u8; 512];
    let read = timeout(WAIT, connection.read(&mut answer))
        .await
        .expect("an answer")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer[..read]).to_string();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert_eq!(t.server.open_watches(), 1, "the watch is served");
    until("the watch to end", WAIT, &NoDaemon, || async {
        t.server.open_watches() == 0
    })
    .await;
    let ended = stopped.elapsed();
    assert!(
        ended >= KEPT - Duration::from_millis(100) && ended < KEPT * 3,
        "ended after {ended:?}"
    );
}
