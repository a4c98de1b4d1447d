use std::time::Duration;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::ResourceExt;
use kube::api::ObjectMeta;

use super::*;

fn map(name: &str) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            namespace: Some("ns".to_string()),
            ..Default::default()
        },
        ..Default::default()
    }
}

type Feed = super::Feed<ConfigMap>;

fn fed_cache() -> (Feed, SharedCache<ConfigMap>, tokio::task::JoinHandle<()>) {
    fed()
}

fn list(feed: &Feed, names: &[&str]) {
    feed.send(Ok(Event::Init)).unwrap();
    for name in names {
        feed.send(Ok(Event::InitApply(map(name)))).unwrap();
    }
    feed.send(Ok(Event::InitDone)).unwrap();
}

/// The next `n` touched objects' names, in order.
async fn next_touched(changes: &mut BoxStream<'static, Change<ConfigMap>>, n: usize) -> Vec<String> {
    let mut names = Vec::new();
    while names.len() < n {
        let change = tokio::time::timeout(Duration::from_secs(5), changes.next())
            .await
            .expect("a change in time")
            .expect("the stream goes on");
        if let Change::Touched(object) = change {
            names.push(object.name_any());
        }
    }
    names
}

#[tokio::test]
async fn a_deletion_reaches_every_subscriber() {
    let (feed, cache, _driver) = fed_cache();
    let mut first = cache.changes();
    let mut second = cache.changes();
    list(&feed, &["a"]);
    feed.send(Ok(Event::Delete(map("a")))).unwrap();
    for subscriber in [&mut first, &mut second] {
        assert_eq!(next_touched(subscriber, 2).await, ["a", "a"]);
    }
    assert!(cache.store().is_empty());
    assert!(cache.readiness().is_ready());
}

#[tokio::test]
async fn a_late_subscriber_first_gets_what_is_cached() {
    let (feed, cache, _driver) = fed_cache();
    let mut early = cache.changes();
    list(&feed, &["a", "b"]);
    next_touched(&mut early, 2).await;
    let mut late = cache.changes();
    let mut replayed = next_touched(&mut late, 2).await;
    replayed.sort();
    assert_eq!(replayed, ["a", "b"]);
    assert!(matches!(late.next().await, Some(Change::Synced)));
    feed.send(Ok(Event::Apply(map("c")))).unwrap();
    assert_eq!(next_touched(&mut late, 1).await, ["c"]);
}

#[tokio::test]
async fn an_object_missing_from_a_relist_counts_as_deleted() {
    let (feed, cache, _driver) = fed_cache();
    let mut changes = cache.changes();
    list(&feed, &["a", "b"]);
    next_touched(&mut changes, 2).await;
    list(&feed, &["a"]);
    let mut touched = next_touched(&mut changes, 2).await;
    touched.sort();
    assert_eq!(touched, ["a", "b"]);
    assert_eq!(cache.store().state().len(), 1);
}

#[tokio::test]
async fn a_slow_subscriber_holds_the_watch_back_instead_of_losing_changes() {
    let (feed, cache, _driver) = fed_cache();
    let mut slow = cache.changes();
    list(&feed, &[]);
    let total = SUBSCRIBER_BUFFER + 10;
    for i in 0..total {
        feed.send(Ok(Event::Apply(map(&format!("m{i}"))))).unwrap();
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(
        cache.store().state().len() < total,
        "the watch waited for the subscriber"
    );
    assert_eq!(next_touched(&mut slow, total).await.len(), total);
}

fn guarded(value: serde_json::Value) -> DeserializeGuard<ConfigMap> {
    serde_json::from_value(value).unwrap()
}

#[tokio::test]
async fn a_malformed_object_is_left_out() {
    let cached = Writer::<ConfigMap>::default().as_reader();
    let bad = guarded(serde_json::json!({"metadata": {"name": "bad"}, "data": 7}));
    assert!(valid_only(Event::Apply(bad), None, &cached).is_none());
    let good = guarded(serde_json::json!({"metadata": {"name": "good"}}));
    assert!(matches!(
        valid_only(Event::Apply(good), None, &cached),
        Some(Event::Apply(_))
    ));
}

#[tokio::test]
async fn a_malformed_object_deleted_takes_its_last_readable_copy_with_it() {
    let mut writer = Writer::<ConfigMap>::default();
    writer.apply_watcher_event(&Event::Apply(map("a")));
    let cached = writer.as_reader();
    let deleted = guarded(serde_json::json!({"metadata": {"name": "a", "namespace": "ns"}, "data": 7}));
    let Some(Event::Delete(gone)) = valid_only(Event::Delete(deleted), None, &cached) else {
        panic!("the deletion was lost");
    };
    assert_eq!(gone.name_any(), "a");
    let never_seen = guarded(serde_json::json!({"metadata": {"name": "b", "namespace": "ns"}, "data": 7}));
    assert!(valid_only(Event::Delete(never_seen), None, &cached).is_none());
}

#[tokio::test]
async fn controllers_asking_for_one_kind_share_one_watch() {
    let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
    let client = Client::try_from(config).unwrap();
    let informers = Informers::new(client.clone(), client, "tenant-a-controllers", "stackd.dev/tenant=a");
    let first = informers.tenant_guarded::<crate::api::stacks::Stack>();
    let second = informers.tenant_guarded::<crate::api::stacks::Stack>();
    assert!(Arc::ptr_eq(&first.subscribers, &second.subscribers));
    informers.host::<k8s_openapi::api::core::v1::Secret>();
    informers.host::<k8s_openapi::api::core::v1::Secret>();
    informers.tenant::<k8s_openapi::api::core::v1::Secret>("app.kubernetes.io/managed-by=stackd");
    informers.tenant_crds();
    assert_eq!(informers.watches(), (3, 1));
    informers.stop();
    assert_eq!(informers.watches(), (0, 0));
}
