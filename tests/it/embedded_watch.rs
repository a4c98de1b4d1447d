//! Watches on the embedded API server, including what kube-runtime's watcher and Controller rely on.

use std::sync::Arc;
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::{Api, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher::{self, Event};
use serde_json::json;
use stackd::embedded::discovery::Resources;
use stackd::embedded::{served, verbs};
use tokio::time::timeout;

use crate::harness::{self, NoDaemon, configmap, eventually, holds_for, resource_version, until};

const WAIT: Duration = Duration::from_secs(5);
/// How long an idle watcher is watched for requests.
const IDLE: Duration = Duration::from_secs(5);

fn summary(event: &WatchEvent<ConfigMap>) -> (String, String) {
    match event {
        WatchEvent::Added(c) => ("ADDED".into(), c.metadata.name.clone().unwrap_or_default()),
        WatchEvent::Modified(c) => ("MODIFIED".into(), c.metadata.name.clone().unwrap_or_default()),
        WatchEvent::Deleted(c) => ("DELETED".into(), c.metadata.name.clone().unwrap_or_default()),
        WatchEvent::Bookmark(_) => ("BOOKMARK".into(), String::new()),
        WatchEvent::Error(e) => ("ERROR".into(), e.reason.clone()),
    }
}

#[tokio::test]
async fn watch_resumed_from_a_resource_version_sees_only_later_events() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let api = t.configmaps("ns");
    api.create(&PostParams::default(), &configmap("before", json!({})))
        .await
        .unwrap();
    let marker = api
        .create(&PostParams::default(), &configmap("marker", json!({})))
        .await
        .unwrap();
    api.create(&PostParams::default(), &configmap("after", json!({})))
        .await
        .unwrap();
    let params = WatchParams::default().disable_bookmarks().timeout(2);
    let stream = api.watch(&params, &resource_version(&marker)).await.unwrap();
    let events: Vec<(String, String)> = stream.map_ok(|e| summary(&e)).try_collect().await.unwrap();
    assert_eq!(events, vec![("ADDED".to_string(), "after".to_string())]);
}

#[tokio::test]
async fn noop_writes_produce_no_watch_event() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let api = t.configmaps("ns");
    let created = api
        .create(&PostParams::default(), &configmap("c", json!({})))
        .await
        .unwrap();
    api.replace("c", &PostParams::default(), &created).await.unwrap();
    api.patch("c", &PatchParams::default(), &Patch::Merge(json!({"data": {"k": "v"}})))
        .await
        .unwrap();
    api.patch("c", &PatchParams::default(), &Patch::Merge(json!({"data": {"k": "w"}})))
        .await
        .unwrap();
    let params = WatchParams::default().disable_bookmarks().timeout(1);
    let stream = api.watch(&params, &resource_version(&created)).await.unwrap();
    let events: Vec<(String, String)> = stream.map_ok(|e| summary(&e)).try_collect().await.unwrap();
    assert_eq!(events, vec![("MODIFIED".to_string(), "c".to_string())]);
}

#[tokio::test]
async fn object_leaving_a_label_selector_arrives_as_deleted_and_reentering_as_added() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let api = t.configmaps("ns");
    let start = api
        .create(&PostParams::default(), &configmap("other", json!({})))
        .await
        .unwrap();
    api.create(&PostParams::default(), &configmap("c", json!({"sel": "1"})))
        .await
        .unwrap();
    let mut versions = Vec::new();
    for value in ["2", "1"] {
        let relabel = Patch::Merge(json!({"metadata": {"labels": {"sel": value}}}));
        let patched = api.patch("c", &PatchParams::default(), &relabel).await.unwrap();
        versions.push(resource_version(&patched));
    }
    let params = WatchParams::default().disable_bookmarks().labels("sel=1").timeout(1);
    let stream = api.watch(&params, &resource_version(&start)).await.unwrap();
    let events: Vec<WatchEvent<ConfigMap>> = stream.try_collect().await.unwrap();
    let kinds: Vec<String> = events.iter().map(|e| summary(e).0).collect();
    assert_eq!(kinds, vec!["ADDED", "DELETED", "ADDED"]);
    // As kube-apiserver's watch cache sends it: the object as it was while selected, at the
    // resourceVersion of the change that took it out.
    let WatchEvent::Deleted(left) = &events[1] else {
        unreachable!()
    };
    let labels = left.metadata.labels.clone().unwrap_or_default();
    assert_eq!(labels.get("sel").map(String::as_str), Some("1"), "{left:?}");
    assert_eq!(left.metadata.resource_version.as_ref(), Some(&versions[0]));
}

#[tokio::test]
async fn watch_without_resource_version_starts_with_current_objects_and_bookmarks_arrive() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let api = t.configmaps("ns");
    api.create(&PostParams::default(), &configmap("c", json!({})))
        .await
        .unwrap();
    let params = WatchParams::default().timeout(3);
    let events: Vec<(String, String)> = api
        .watch(&params, "0")
        .await
        .unwrap()
        .map_ok(|e| summary(&e))
        .try_collect()
        .await
        .unwrap();
    assert_eq!(events[0], ("ADDED".to_string(), "c".to_string()));
    assert!(events.iter().any(|(kind, _)| kind == "BOOKMARK"), "{events:?}");
}

/// As from kube-apiserver's watch cache: one bookmark 2 s before the watch's timeout (and one a
/// minute), not a stream of them; a replica's thousands of idle watches each get a few an hour.
#[tokio::test]
async fn an_idle_watch_gets_one_bookmark_before_its_timeout() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let params = WatchParams::default().timeout(6);
    let started = std::time::Instant::now();
    let events: Vec<(String, String, f64)> = t
        .configmaps("ns")
        .watch(&params, "0")
        .await
        .unwrap()
        .map_ok(|e| {
            let (kind, name) = summary(&e);
            (kind, name, started.elapsed().as_secs_f64())
        })
        .try_collect()
        .await
        .unwrap();
    let bookmarks: Vec<f64> = events
        .iter()
        .filter(|(kind, _, _)| kind == "BOOKMARK")
        .map(|(_, _, at)| *at)
        .collect();
    assert_eq!(bookmarks.len(), 1, "{events:?}");
    assert!((3.5..6.0).contains(&bookmarks[0]), "{events:?}");
}

/// Writes many configmaps in-process so a watch on secrets falls out of the history window.
fn flood_configmaps(t: &harness::TestServer, count: usize) {
    let store = t.server.store();
    let info = Resources::current(&store).find("", "v1", "configmaps").unwrap();
    for i in 0..count {
        let cm = json!({"metadata": {"name": format!("flood-{i}")}});
        verbs::create(&store, &info, "ns", cm, Default::default()).unwrap();
    }
}

#[tokio::test]
async fn too_old_resource_version_gets_an_in_stream_410() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let secrets: Api<Secret> = Api::namespaced(t.client.clone(), "ns");
    let old = secrets
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "s"}})).unwrap(),
        )
        .await
        .unwrap();
    flood_configmaps(&t, stackd::embedded::store::HISTORY_WINDOW + 10);
    let mut stream = secrets
        .watch(&WatchParams::default(), &resource_version(&old))
        .await
        .unwrap()
        .boxed();
    match timeout(WAIT, stream.next()).await.unwrap() {
        Some(Ok(WatchEvent::Error(status))) => {
            assert_eq!((status.code, status.reason.as_str()), (410, "Expired"))
        }
        other => panic!("expected an in-stream 410, got {other:?}"),
    }
    assert!(
        timeout(WAIT, stream.next()).await.unwrap().is_none(),
        "the stream ends after the 410"
    );
}

#[tokio::test]
async fn kube_runtime_watcher_relists_after_a_410_and_recovers() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let secrets: Api<Secret> = Api::namespaced(t.client.clone(), "ns");
    let secret = |name: &str| -> Secret { serde_json::from_value(json!({"metadata": {"name": name}})).unwrap() };
    secrets.create(&PostParams::default(), &secret("first")).await.unwrap();
    // Short server-side timeouts make the watcher re-watch from its last (now too old) version.
    let config = watcher::Config::default().disable_bookmarks().timeout(1);
    let mut events = watcher::watcher(secrets.clone(), config).boxed();
    let mut inits = 0;
    while inits < 1 {
        if let Event::InitDone = timeout(WAIT, events.next()).await.unwrap().unwrap().unwrap() {
            inits += 1;
        }
    }
    flood_configmaps(&t, stackd::embedded::store::HISTORY_WINDOW + 10);
    let mut relisted = Vec::new();
    loop {
        match timeout(WAIT, events.next())
            .await
            .expect("watcher keeps going")
            .unwrap()
        {
            Ok(Event::InitApply(s)) => relisted.push(s.metadata.name.unwrap()),
            Ok(Event::InitDone) => break,
            Ok(Event::Apply(_)) | Ok(Event::Delete(_)) => panic!("no secret changed"),
            Ok(Event::Init) | Err(_) => {}
        }
    }
    assert_eq!(relisted, vec!["first"]);
    secrets.create(&PostParams::default(), &secret("second")).await.unwrap();
    loop {
        if let Ok(Event::Apply(s)) = timeout(WAIT, events.next()).await.unwrap().unwrap() {
            assert_eq!(s.metadata.name.as_deref(), Some("second"));
            break;
        }
    }
}

#[tokio::test]
async fn idle_watcher_issues_no_requests_beyond_its_open_watch() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let mut events = watcher::watcher(t.configmaps("ns"), watcher::Config::default()).boxed();
    while !matches!(
        timeout(WAIT, events.next()).await.unwrap().unwrap().unwrap(),
        Event::InitDone
    ) {}
    let drive = tokio::spawn(async move { while events.next().await.is_some() {} });
    // The watch request itself arrived before counting.
    until("the watch to open", WAIT, &NoDaemon, || async {
        t.server.open_watches() > 0
    })
    .await;
    let before = t.server.request_count();
    // Nothing to wait for: the point is that five idle seconds bring no request.
    holds_for("an idle watcher only holds its watch open", IDLE, &NoDaemon, || async {
        t.server.request_count() == before
    })
    .await;
    drive.abort();
}

#[derive(Debug, thiserror::Error)]
#[error(transparent)]
struct ReconcileError(#[from] kube::Error);

async fn mark_seen(cm: Arc<ConfigMap>, api: Arc<Api<ConfigMap>>) -> Result<Action, ReconcileError> {
    let name = cm.metadata.name.clone().unwrap_or_default();
    let seen = Patch::Merge(json!({"metadata": {"annotations": {"test.stackd.dev/seen": "yes"}}}));
    api.patch(&name, &PatchParams::default(), &seen).await?;
    Ok(Action::await_change())
}

#[tokio::test]
async fn kube_runtime_controller_reconciles_against_the_embedded_server() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let api = t.configmaps("ns");
    let controller = Controller::new(api.clone(), watcher::Config::default())
        .run(
            mark_seen,
            |_, _, _| Action::requeue(Duration::from_secs(1)),
            Arc::new(api.clone()),
        )
        .for_each(|_| async {});
    let running = tokio::spawn(controller);
    api.create(&PostParams::default(), &configmap("c", json!({})))
        .await
        .unwrap();
    eventually("configmap reconciled", || async {
        let cm = api.get("c").await.unwrap();
        cm.metadata
            .annotations
            .is_some_and(|a| a.contains_key("test.stackd.dev/seen"))
    })
    .await;
    running.abort();
}

#[tokio::test]
async fn shutdown_closes_open_watches() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let mut stream = t
        .configmaps("ns")
        .watch(&WatchParams::default(), "0")
        .await
        .unwrap()
        .boxed();
    let harness::TestServer { server, .. } = t;
    timeout(WAIT, server.shutdown()).await.unwrap();
    let ended = timeout(WAIT, async { while let Some(Ok(_)) = stream.next().await {} }).await;
    assert!(ended.is_ok(), "watch stream ends when the server shuts down");
}

#[tokio::test]
async fn kube_runtime_recorder_publishes_and_updates_a_series() {
    use k8s_openapi::api::core::v1::Event as CoreEvent;
    use kube::Resource;
    use kube::api::ListParams;
    use kube::runtime::events::{Event as RecordedEvent, EventType, Recorder, Reporter};
    let t = harness::start().await;
    t.namespace("ns").await;
    let cm = t
        .configmaps("ns")
        .create(&PostParams::default(), &configmap("c", json!({})))
        .await
        .unwrap();
    let reporter = Reporter {
        controller: "stackd".into(),
        instance: Some("test".into()),
    };
    let recorder = Recorder::new(t.client.clone(), reporter);
    let event = RecordedEvent {
        type_: EventType::Normal,
        reason: "Reconciled".into(),
        note: Some("all good".into()),
        action: "Reconcile".into(),
        secondary: None,
    };
    let reference = cm.object_ref(&());
    recorder.publish(&event, &reference).await.unwrap();
    recorder.publish(&event, &reference).await.unwrap();
    let core: Api<CoreEvent> = Api::namespaced(t.client.clone(), "ns");
    let listed = core
        .list(&ListParams::default().fields("involvedObject.name=c"))
        .await
        .unwrap();
    assert_eq!(listed.items.len(), 1, "the repeat joins a series");
    assert_eq!(listed.items[0].reason.as_deref(), Some("Reconciled"));
    assert_eq!(listed.items[0].series.as_ref().and_then(|s| s.count), Some(2));
}

#[tokio::test]
async fn all_namespaces_watch_sees_every_namespace() {
    let t = harness::start().await;
    t.namespace("a").await;
    t.namespace("b").await;
    let all: Api<ConfigMap> = Api::all(t.client.clone());
    let start = t
        .configmaps("a")
        .create(&PostParams::default(), &configmap("first", json!({})))
        .await
        .unwrap();
    t.configmaps("b")
        .create(&PostParams::default(), &configmap("second", json!({})))
        .await
        .unwrap();
    let params = WatchParams::default().disable_bookmarks().timeout(1);
    let stream = all.watch(&params, &resource_version(&start)).await.unwrap();
    let events: Vec<(String, String)> = stream.map_ok(|e| summary(&e)).try_collect().await.unwrap();
    assert_eq!(events, vec![("ADDED".to_string(), "second".to_string())]);
}

/// The body of one raw request through the kube client's connection.
async fn raw_body(t: &harness::TestServer, method: &str, path: &str, body: &str) -> String {
    let request = http::Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json")
        .body(body.as_bytes().to_vec())
        .unwrap();
    let response = t.client.send(request.map(Into::into)).await.unwrap();
    assert!(response.status().is_success(), "{method} {path}: {}", response.status());
    let bytes = http_body_util::BodyExt::collect(response.into_body())
        .await
        .map(|b| b.to_bytes())
        .unwrap();
    String::from_utf8(bytes.to_vec()).unwrap()
}

/// Objects are stored once and shared: a get and a watch event are written out from the stored
/// value, and must carry the bytes the server sent when it answered with a presented copy.
#[tokio::test]
async fn a_get_and_a_watch_event_carry_the_bytes_of_the_presented_copy() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let since = t.server.store().resource_version();
    let cases = [
        (
            "/api/v1/namespaces/ns/configmaps",
            ("", "v1", "configmaps"),
            json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "labels": {"a": "b"}},
                   "data": {"text": "é \" \\ \n", "z": "last"}}),
        ),
        (
            "/api/v1/namespaces/ns/secrets",
            ("", "v1", "secrets"),
            json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}, "stringData": {"k": "v"}}),
        ),
        (
            "/apis/events.k8s.io/v1/namespaces/ns/events",
            ("events.k8s.io", "v1", "events"),
            json!({"apiVersion": "events.k8s.io/v1", "kind": "Event", "metadata": {"name": "e"},
                   "eventTime": "2026-01-01T00:00:00.000000Z", "action": "Pull", "reason": "Pulled",
                   "reportingController": "kubelet", "reportingInstance": "node-1", "type": "Normal",
                   "note": "pulled the image", "regarding": {"kind": "Pod", "name": "p", "namespace": "ns"}}),
        ),
    ];
    let resources = Resources::current(&t.server.store());
    for (collection, (group, version, plural), body) in cases {
        let name = body["metadata"]["name"].as_str().unwrap();
        raw_body(&t, "POST", collection, &body.to_string()).await;
        let got = raw_body(&t, "GET", &format!("{collection}/{name}"), "").await;
        let info = resources.find(group, version, plural).unwrap();
        let stored = t.server.store().get(&info.storage_key(), "ns", name).unwrap();
        assert_eq!(
            got,
            served::present(&info, stored).to_string(),
            "GET {collection}/{name}"
        );
        let watch = format!("{collection}?watch=1&resourceVersion={since}&timeoutSeconds=1");
        let lines = raw_body(&t, "GET", &watch, "").await;
        let added = lines
            .lines()
            .find(|line| line.contains(&format!(r#""name":"{name}""#)))
            .unwrap();
        assert_eq!(
            added,
            format!(r#"{{"type":"ADDED","object":{got}}}"#),
            "watch {collection}"
        );
    }
}
