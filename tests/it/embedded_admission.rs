//! Mutating admission on the embedded API server: hooks behave as a cluster's mutating webhooks.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::apps::v1::Deployment;
use kube::api::{Api, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use serde_json::{Value, json};

use crate::harness::{self, configmap, resource_version};

fn deployment(image: &str) -> Deployment {
    serde_json::from_value(json!({
        "metadata": {"name": "d"},
        "spec": {
            "selector": {"matchLabels": {"app": "d"}},
            "template": {
                "metadata": {"labels": {"app": "d"}},
                "spec": {"containers": [{"name": "main", "image": image}]}
            }
        }
    }))
    .unwrap()
}

fn container_names(deployment: &Deployment) -> Vec<String> {
    let spec = deployment.spec.as_ref().and_then(|s| s.template.spec.as_ref());
    spec.map(|s| s.containers.iter().map(|c| c.name.clone()).collect())
        .unwrap_or_default()
}

fn image_of(deployment: &Deployment, container: &str) -> Option<String> {
    let spec = deployment.spec.as_ref()?.template.spec.as_ref()?;
    spec.containers.iter().find(|c| c.name == container)?.image.clone()
}

/// A mesh injector: adds a `proxy` container once, and counts its calls.
fn inject_proxy(calls: Arc<AtomicUsize>) -> impl Fn(&mut Value) + Send + Sync + 'static {
    move |deployment: &mut Value| {
        calls.fetch_add(1, Ordering::SeqCst);
        let containers = &mut deployment["spec"]["template"]["spec"]["containers"];
        if let Some(list) = containers.as_array_mut()
            && !list.iter().any(|c| c["name"] == "proxy")
        {
            list.push(json!({"name": "proxy", "image": "mesh/proxy:1"}));
        }
    }
}

#[tokio::test]
async fn a_hook_mutates_creates_updates_and_patches_of_its_resource_and_their_watch_events() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let calls = Arc::new(AtomicUsize::new(0));
    t.server
        .admission()
        .mutate("apps", "deployments", inject_proxy(calls.clone()));
    let api: Api<Deployment> = Api::namespaced(t.client.clone(), "ns");
    let params = WatchParams::default().disable_bookmarks();
    let mut events = api.watch(&params, "0").await.unwrap().boxed();

    let created = api.create(&PostParams::default(), &deployment("app:1")).await.unwrap();
    assert_eq!(
        container_names(&created),
        ["main", "proxy"],
        "the answer carries the mutation"
    );
    let stored = api.get("d").await.unwrap();
    assert_eq!(
        container_names(&stored),
        ["main", "proxy"],
        "the stored object carries it"
    );
    let Some(WatchEvent::Added(added)) = events.try_next().await.unwrap() else {
        panic!("expected ADDED");
    };
    assert_eq!(container_names(&added), ["main", "proxy"], "the watch event carries it");

    // A replace without the sidecar gets it back; so does a patch. (No resourceVersion: the
    // Deployment loop writes the status meanwhile.)
    let replaced = api
        .replace("d", &PostParams::default(), &deployment("app:2"))
        .await
        .unwrap();
    assert_eq!(container_names(&replaced), ["main", "proxy"]);
    assert_eq!(image_of(&replaced, "main").as_deref(), Some("app:2"));
    let modified = loop {
        // Skip the Deployment loop's status writes.
        match events.try_next().await.unwrap() {
            Some(WatchEvent::Modified(d)) if image_of(&d, "main").as_deref() == Some("app:2") => break d,
            Some(WatchEvent::Modified(_)) => {}
            other => panic!("expected MODIFIED, got {other:?}"),
        }
    };
    assert_eq!(container_names(&modified), ["main", "proxy"]);
    let remove_proxy = json!([{"op": "remove", "path": "/spec/template/spec/containers/1"}]);
    let patched = api
        .patch(
            "d",
            &PatchParams::default(),
            &Patch::<Value>::Json(serde_json::from_value(remove_proxy).unwrap()),
        )
        .await
        .unwrap();
    assert_eq!(container_names(&patched), ["main", "proxy"]);
    assert_eq!(
        calls.load(Ordering::SeqCst),
        3,
        "create, update and patch each passed the hook"
    );

    // Status writes and other resources do not pass it.
    let status = json!({"status": {"observedGeneration": 7}});
    api.patch_status("d", &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();
    t.configmaps("ns")
        .create(&PostParams::default(), &configmap("c", json!({})))
        .await
        .unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 3);

    // Once the hook is gone, writes are stored as sent.
    t.server.admission().clear();
    let replaced = api
        .replace("d", &PostParams::default(), &deployment("app:2"))
        .await
        .unwrap();
    assert_eq!(container_names(&replaced), ["main"]);
}

#[tokio::test]
async fn a_replace_a_hook_changes_back_is_a_no_op_without_a_watch_event() {
    let t = harness::start().await;
    t.namespace("ns").await;
    // A policy that pins one key of every ConfigMap.
    t.server.admission().mutate("", "configmaps", |config_map: &mut Value| {
        config_map["data"]["k"] = json!("pinned");
    });
    let api = t.configmaps("ns");
    let created = api
        .create(&PostParams::default(), &configmap("c", json!({})))
        .await
        .unwrap();
    assert_eq!(
        created.data.as_ref().and_then(|d| d.get("k")).map(String::as_str),
        Some("pinned")
    );

    let params = WatchParams::default().disable_bookmarks();
    let mut events = api.watch(&params, &resource_version(&created)).await.unwrap().boxed();
    let mut replacement = configmap("c", json!({}));
    replacement.metadata.resource_version = Some(resource_version(&created));
    replacement.data = Some([("k".to_string(), "mine".to_string())].into());
    let answer = api.replace("c", &PostParams::default(), &replacement).await.unwrap();
    assert_eq!(answer.data, created.data, "the hook changed the value back");
    assert_eq!(
        resource_version(&answer),
        resource_version(&created),
        "nothing was written"
    );
    // The next event is a later real write's, so the no-op made none.
    let label = json!({"metadata": {"labels": {"marker": "1"}}});
    let marked = api
        .patch("c", &PatchParams::default(), &Patch::Merge(&label))
        .await
        .unwrap();
    let Some(WatchEvent::Modified(next)) = events.try_next().await.unwrap() else {
        panic!("expected MODIFIED");
    };
    assert_eq!(resource_version(&next), resource_version(&marked));
}
