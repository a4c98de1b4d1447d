use std::time::Duration;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::ResourceExt;
use kube::api::ObjectMeta;

use super::refusals::Cause;
use super::*;
use crate::runtime::memory_budget::{ByteSize, MemoryBudget};

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

type RawFeed = mpsc::UnboundedSender<Result<Event<Incoming<ConfigMap>>, watcher::Error>>;

/// A cache fed raw objects, with a size cap of `cap` bytes and `budget`.
fn raw_cache(
    cap: u64,
    budget: Option<Arc<MemoryBudget>>,
) -> (RawFeed, SharedCache<ConfigMap>, tokio::task::JoinHandle<()>) {
    let (feed, events) = mpsc::unbounded_channel();
    let parts = CacheParts {
        limits: CacheLimits {
            max_object_bytes: cap,
            budget,
        },
        reporter: Reporter::default(),
        client: None,
    };
    let (cache, driver) = start(
        "test".into(),
        parts,
        tokio_stream::wrappers::UnboundedReceiverStream::new(events),
    );
    (feed, cache, driver)
}

fn raw(value: serde_json::Value) -> Incoming<ConfigMap> {
    Incoming::Raw(Box::new(
        RawObject::from_json(&serde_json::to_vec(&value).unwrap()).unwrap(),
    ))
}

fn sized(name: &str, version: &str, bytes: usize) -> Incoming<ConfigMap> {
    raw(serde_json::json!({
        "metadata": {"name": name, "namespace": "ns", "uid": format!("uid-{name}"), "resourceVersion": version},
        "data": {"k": "x".repeat(bytes)},
    }))
}

fn raw_list(feed: &RawFeed, objects: Vec<Incoming<ConfigMap>>) {
    feed.send(Ok(Event::Init)).unwrap();
    for object in objects {
        feed.send(Ok(Event::InitApply(object))).unwrap();
    }
    feed.send(Ok(Event::InitDone)).unwrap();
}

#[tokio::test]
async fn a_malformed_object_is_left_out_and_a_malformed_update_keeps_the_last_readable_copy() {
    let (feed, cache, _driver) = raw_cache(1 << 20, None);
    let mut changes = cache.changes();
    let bad = raw(serde_json::json!({"metadata": {"name": "bad", "namespace": "ns"}, "data": 7}));
    raw_list(&feed, vec![bad, sized("good", "1", 1)]);
    assert_eq!(next_touched(&mut changes, 1).await, ["good"]);
    let broken = raw(serde_json::json!({"metadata": {"name": "good", "namespace": "ns"}, "data": 7}));
    feed.send(Ok(Event::Apply(broken))).unwrap();
    feed.send(Ok(Event::Apply(sized("other", "2", 1)))).unwrap();
    assert_eq!(next_touched(&mut changes, 1).await, ["other"]);
    assert_eq!(cache.store().state().len(), 2, "the last readable copy stays");
    assert!(cache.refusals().is_empty(), "malformed is not too large");
}

#[tokio::test]
async fn a_malformed_object_deleted_takes_its_last_readable_copy_with_it() {
    let (feed, cache, _driver) = raw_cache(1 << 20, None);
    let mut changes = cache.changes();
    raw_list(&feed, vec![sized("a", "1", 1)]);
    next_touched(&mut changes, 1).await;
    let deleted = raw(serde_json::json!({"metadata": {"name": "a", "namespace": "ns"}, "data": 7}));
    feed.send(Ok(Event::Delete(deleted))).unwrap();
    assert_eq!(next_touched(&mut changes, 1).await, ["a"]);
    assert!(cache.store().is_empty());
}

#[tokio::test]
async fn an_object_over_the_cap_is_refused_and_its_stale_copy_goes_until_it_is_small_again() {
    let (feed, cache, _driver) = raw_cache(4096, None);
    let mut changes = cache.changes();
    raw_list(&feed, vec![sized("big", "1", 10_000), sized("small", "1", 10)]);
    assert_eq!(next_touched(&mut changes, 1).await, ["small"]);
    let refusals = cache.refusals();
    assert!(refusals.contains(Some("ns"), "big"));
    let held = refusals.holding("ns").expect("the namespace is held up");
    assert_eq!(held.kind, "ConfigMap");
    assert!(held.json_bytes > 10_000, "{held:?}");
    assert!(refusals.holding("other").is_none());
    // A cached object that grows over the cap leaves the cache: its readers hear of it.
    feed.send(Ok(Event::Apply(sized("small", "2", 10_000)))).unwrap();
    assert_eq!(next_touched(&mut changes, 1).await, ["small"]);
    assert!(cache.store().is_empty());
    assert!(refusals.contains(Some("ns"), "small"));
    // Made small again, it is cached and forgotten as refused.
    feed.send(Ok(Event::Apply(sized("small", "3", 10)))).unwrap();
    assert_eq!(next_touched(&mut changes, 1).await, ["small"]);
    assert!(!refusals.contains(Some("ns"), "small"));
    // Deleted while refused, it is forgotten too.
    feed.send(Ok(Event::Delete(sized("big", "4", 10_000)))).unwrap();
    feed.send(Ok(Event::Apply(sized("marker", "5", 1)))).unwrap();
    assert_eq!(next_touched(&mut changes, 1).await, ["marker"]);
    assert!(refusals.is_empty());
}

fn sized_in(namespace: Option<&str>, name: &str, version: &str, bytes: usize) -> Incoming<ConfigMap> {
    raw(serde_json::json!({
        "metadata": {"name": name, "namespace": namespace, "uid": format!("uid-{name}"), "resourceVersion": version},
        "data": {"k": "x".repeat(bytes)},
    }))
}

#[tokio::test]
async fn a_namespace_over_its_share_has_its_own_objects_refused_and_the_watch_goes_on() {
    let budget = MemoryBudget::new(ByteSize(100_000), ByteSize(20_000), 100, None);
    let (feed, cache, driver) = raw_cache(1 << 20, Some(budget.clone()));
    let mut changes = cache.changes();
    raw_list(&feed, vec![sized("a", "1", 5_000)]);
    next_touched(&mut changes, 1).await;
    let held = budget.used();
    assert!(held > 5_000, "{held}");
    feed.send(Ok(Event::Delete(sized("a", "2", 5_000)))).unwrap();
    next_touched(&mut changes, 1).await;
    assert_eq!(budget.used(), 0, "a deletion gives its bytes back");
    for i in 0..5 {
        feed.send(Ok(Event::Apply(sized(&format!("m{i}"), "3", 5_000))))
            .unwrap();
    }
    feed.send(Ok(Event::Apply(sized_in(Some("other"), "o", "3", 5_000))))
        .unwrap();
    feed.send(Ok(Event::Apply(sized_in(Some("other"), "marker", "3", 1))))
        .unwrap();
    let touched = next_touched(&mut changes, 5).await;
    assert!(touched.contains(&"o".to_string()), "{touched:?}");
    let refusals = cache.refusals();
    let refused = refusals.holding("ns").expect("namespace ns is held");
    assert!(
        matches!(refused.cause, Cause::OverBudget { ref overage, .. } if overage.flag == "--namespace-memory-budget"),
        "{refused:?}"
    );
    assert!(refusals.holding("other").is_none(), "another namespace is served");
    assert!(!budget.is_exceeded(), "the tenant is not suspended");
    assert!(!driver.is_finished());
}

#[tokio::test]
async fn what_no_namespace_owns_taking_the_tenant_over_its_budget_stops_the_watch() {
    let budget = MemoryBudget::new(ByteSize(20_000), ByteSize(5_000), 100, None);
    let (feed, _cache, driver) = raw_cache(1 << 20, Some(budget.clone()));
    for i in 0..5 {
        let _ = feed.send(Ok(Event::Apply(sized_in(None, &format!("m{i}"), "3", 5_000))));
    }
    let overage = tokio::time::timeout(Duration::from_secs(5), budget.exceeded())
        .await
        .expect("the budget went over");
    assert_eq!(overage.kind, "ConfigMap");
    tokio::time::timeout(Duration::from_secs(5), driver)
        .await
        .expect("the watch stopped")
        .unwrap();
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

#[test]
fn watches_of_tenants_started_together_time_out_at_different_moments() {
    let tenants = (0..50).map(|i| format!("tenant-t{i:03}-controllers"));
    let timeouts: std::collections::BTreeSet<u32> = tenants
        .flat_map(|namespace| ["host apps/v1/deployments", "tenant crds"].map(|key| watch_timeout(&namespace, key)))
        .collect();
    assert!(timeouts.iter().all(|t| (200..=290).contains(t)), "{timeouts:?}");
    assert!(
        timeouts.len() > 40,
        "100 watches renew at only {} moments",
        timeouts.len()
    );
    assert_eq!(watch_timeout("a", "tenant crds"), watch_timeout("a", "tenant crds"));
}
