//! Owner references and deletion propagation on the embedded API server.

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, PostParams, PropagationPolicy};
use serde_json::json;

use crate::harness::{self, TestServer, api_error, configmap, eventually};

/// A ConfigMap owned by `owner` (any object in the same namespace).
async fn dependent(t: &TestServer, name: &str, owner_kind: &str, owner_name: &str, owner_uid: &str) {
    let cm: ConfigMap = serde_json::from_value(json!({"metadata": {"name": name, "ownerReferences": [{
        "apiVersion": "v1", "kind": owner_kind, "name": owner_name, "uid": owner_uid, "blockOwnerDeletion": true
    }]}}))
    .unwrap();
    t.configmaps("ns").create(&PostParams::default(), &cm).await.unwrap();
}

async fn owner(t: &TestServer) -> String {
    let owner = t
        .configmaps("ns")
        .create(&PostParams::default(), &configmap("owner", json!({})))
        .await
        .unwrap();
    owner.metadata.uid.unwrap()
}

#[tokio::test]
async fn deleting_an_owner_deletes_its_dependents_in_the_background() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let uid = owner(&t).await;
    dependent(&t, "child", "ConfigMap", "owner", &uid).await;
    let api = t.configmaps("ns");
    api.delete("owner", &DeleteParams::background()).await.unwrap();
    assert_eq!(
        api_error(api.get("owner").await.unwrap_err()).code,
        404,
        "the owner goes at once"
    );
    eventually("dependent collected", || async {
        api.get_opt("child").await.unwrap().is_none()
    })
    .await;
}

#[tokio::test]
async fn foreground_deletion_removes_dependents_before_the_owner() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let uid = owner(&t).await;
    dependent(&t, "child", "ConfigMap", "owner", &uid).await;
    let api = t.configmaps("ns");
    let mut held = configmap("held", json!({}));
    held.metadata.finalizers = Some(vec!["x.dev/hold".into()]);
    held.metadata.owner_references = Some(vec![
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": uid, "blockOwnerDeletion": true
        }))
        .unwrap(),
    ]);
    api.create(&PostParams::default(), &held).await.unwrap();
    api.delete("owner", &DeleteParams::foreground()).await.unwrap();
    eventually("unheld dependent collected", || async {
        api.get_opt("child").await.unwrap().is_none()
    })
    .await;
    let owner = api.get("owner").await.unwrap();
    assert!(
        owner
            .metadata
            .finalizers
            .unwrap()
            .contains(&"foregroundDeletion".to_string())
    );
    api.patch(
        "held",
        &Default::default(),
        &kube::api::Patch::Merge(json!({"metadata": {"finalizers": null}})),
    )
    .await
    .unwrap();
    eventually("owner gone after its dependents", || async {
        api.get_opt("owner").await.unwrap().is_none()
    })
    .await;
}

#[tokio::test]
async fn jobs_orphan_their_dependents_by_default_as_batch_v1_does() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let jobs: Api<Job> = Api::namespaced(t.client.clone(), "ns");
    let job: Job = serde_json::from_value(json!({"metadata": {"name": "j"}, "spec": {"template": {"spec": {
        "restartPolicy": "Never", "containers": [{"name": "c", "image": "i"}]}}}}))
    .unwrap();
    let uid = jobs
        .create(&PostParams::default(), &job)
        .await
        .unwrap()
        .metadata
        .uid
        .unwrap();
    dependent(&t, "pod-like", "Job", "j", &uid).await;
    jobs.delete("j", &DeleteParams::default()).await.unwrap();
    eventually("job gone", || async { jobs.get_opt("j").await.unwrap().is_none() }).await;
    let orphan = t.configmaps("ns").get("pod-like").await.unwrap();
    assert_eq!(
        orphan.metadata.owner_references, None,
        "the reference to the deleted Job is dropped"
    );
}

#[tokio::test]
async fn unknown_propagation_policy_is_invalid() {
    let t = harness::start().await;
    t.namespace("ns").await;
    owner(&t).await;
    let params = DeleteParams {
        propagation_policy: Some(PropagationPolicy::Orphan),
        ..DeleteParams::default()
    };
    t.configmaps("ns").delete("owner", &params).await.unwrap();
    let raw = http::Request::delete("/api/v1/namespaces/ns/configmaps/owner")
        .header("content-type", "application/json")
        .body(serde_json::to_vec(&json!({"propagationPolicy": "Sideways"})).unwrap())
        .unwrap();
    let err = api_error(t.client.request_text(raw).await.unwrap_err());
    assert_eq!((err.code, err.reason.as_str()), (422, "Invalid"));
}

#[tokio::test]
async fn foreground_deletion_waits_only_for_dependents_that_block_owner_deletion() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let uid = owner(&t).await;
    let api = t.configmaps("ns");
    let mut loose = configmap("loose", json!({}));
    loose.metadata.finalizers = Some(vec!["x.dev/hold".into()]);
    loose.metadata.owner_references = Some(vec![
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": uid, "blockOwnerDeletion": false
        }))
        .unwrap(),
    ]);
    api.create(&PostParams::default(), &loose).await.unwrap();
    api.delete("owner", &DeleteParams::foreground()).await.unwrap();
    eventually("owner gone though a non-blocking dependent remains", || async {
        api.get_opt("owner").await.unwrap().is_none()
    })
    .await;
    let loose = api.get("loose").await.unwrap();
    assert!(
        loose.metadata.deletion_timestamp.is_some(),
        "the dependent is being deleted too"
    );
}
