//! Patches and server-side apply on the embedded API server, with kube-rs and as raw HTTP, against
//! kube-apiserver's recorded answers.

use std::sync::Arc;
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{
    Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams, WatchEvent, WatchParams,
};
use kube::runtime::controller::Action;
use kube::runtime::finalizer::{Event, finalizer};
use serde_json::{Value, json};
use stackd::runtime::leader::{LeaderElectionSettings, acquire};
use tokio_util::sync::CancellationToken;

use crate::harness::{self, TestServer, api_error, configmap, resource_version};

fn apply(manager: &str) -> PatchParams {
    PatchParams::apply(manager)
}

fn cm_config(name: &str, data: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": data})
}

fn data_keys(cm: &ConfigMap) -> Vec<String> {
    cm.data.clone().unwrap_or_default().into_keys().collect()
}

#[tokio::test]
async fn kube_runtime_finalizer_adds_the_first_finalizer_to_an_object_that_has_none() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let api = t.configmaps("ns");
    let cm = api
        .create(&PostParams::default(), &configmap("c", json!({})))
        .await
        .unwrap();
    let action = finalizer(
        &api,
        "stackd.dev/test",
        Arc::new(cm),
        |_event: Event<ConfigMap>| async { Ok::<_, std::io::Error>(Action::await_change()) },
    )
    .await
    .unwrap();
    assert_eq!(action, Action::await_change());
    let stored = api.get("c").await.unwrap();
    assert_eq!(stored.metadata.finalizers, Some(vec!["stackd.dev/test".to_string()]));
}

#[tokio::test]
async fn apply_creates_a_missing_object_and_records_the_manager() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let api = t.configmaps("ns");
    let created = api
        .patch("c", &apply("fid"), &Patch::Apply(cm_config("c", json!({"a": "1"}))))
        .await
        .unwrap();
    assert_eq!(data_keys(&created), ["a"]);
    let managers = created.metadata.managed_fields.unwrap_or_default();
    assert_eq!(managers.len(), 1);
    assert_eq!(managers[0].manager.as_deref(), Some("fid"));
    assert_eq!(managers[0].operation.as_deref(), Some("Apply"));
    assert!(created.metadata.uid.is_some());
}

#[tokio::test]
async fn a_second_identical_apply_keeps_the_resource_version() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let api = t.configmaps("ns");
    let config = Patch::Apply(cm_config("c", json!({"a": "1"})));
    let first = api.patch("c", &apply("fid"), &config).await.unwrap();
    let second = api.patch("c", &apply("fid"), &config).await.unwrap();
    assert_eq!(resource_version(&first), resource_version(&second));
    assert_eq!(first.metadata.managed_fields, second.metadata.managed_fields);
}

#[tokio::test]
async fn a_field_dropped_from_an_apply_is_removed() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let api = t.configmaps("ns");
    api.patch(
        "c",
        &apply("fid"),
        &Patch::Apply(cm_config("c", json!({"a": "1", "b": "2"}))),
    )
    .await
    .unwrap();
    let second = api
        .patch("c", &apply("fid"), &Patch::Apply(cm_config("c", json!({"b": "2"}))))
        .await
        .unwrap();
    assert_eq!(data_keys(&second), ["b"]);
}

#[tokio::test]
async fn two_managers_conflict_without_force_and_force_takes_over() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let api = t.configmaps("ns");
    api.patch("c", &apply("first"), &Patch::Apply(cm_config("c", json!({"a": "1"}))))
        .await
        .unwrap();
    let other = Patch::Apply(cm_config("c", json!({"a": "2"})));
    let err = api_error(api.patch("c", &apply("second"), &other).await.unwrap_err());
    assert_eq!((err.code, err.reason.as_str()), (409, "Conflict"));
    assert_eq!(
        err.message,
        "Apply failed with 1 conflict: conflict with \"first\": .data.a"
    );
    let causes = err.details.map(|d| d.causes).unwrap_or_default();
    assert_eq!(causes.len(), 1);
    assert_eq!(causes[0].reason, "FieldManagerConflict");
    assert_eq!(causes[0].field, ".data.a");
    assert_eq!(causes[0].message, "conflict with \"first\"");

    let forced = api.patch("c", &apply("second").force(), &other).await.unwrap();
    assert_eq!(forced.data.unwrap_or_default()["a"], "2");
    let managers: Vec<String> = forced
        .metadata
        .managed_fields
        .unwrap_or_default()
        .into_iter()
        .filter_map(|m| m.manager)
        .collect();
    assert_eq!(managers, ["second"]);
}

#[tokio::test]
async fn an_applier_conflicts_with_a_field_an_ordinary_update_changed() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let api = t.configmaps("ns");
    api.patch("c", &apply("applier"), &Patch::Apply(cm_config("c", json!({"a": "1"}))))
        .await
        .unwrap();
    let edit = PatchParams {
        field_manager: Some("editor".into()),
        ..PatchParams::default()
    };
    api.patch("c", &edit, &Patch::Merge(json!({"data": {"a": "edited"}})))
        .await
        .unwrap();
    let err = api_error(
        api.patch("c", &apply("applier"), &Patch::Apply(cm_config("c", json!({"a": "1"}))))
            .await
            .unwrap_err(),
    );
    assert_eq!(err.code, 409);
    assert!(err.message.contains("\"editor\""), "{}", err.message);
}

#[tokio::test]
async fn apply_without_a_field_manager_is_a_bad_request() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let (status, body) = raw(&t, "PATCH", "/api/v1/namespaces/ns/configmaps/c", APPLY, "{}").await;
    assert_eq!((status, body["reason"].as_str()), (400, Some("BadRequest")));
}

#[tokio::test]
async fn a_strategic_merge_of_containers_merges_by_name() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let api: Api<Deployment> = Api::namespaced(t.client.clone(), "ns");
    let deployment: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "d"},
        "spec": {
            "selector": {"matchLabels": {"app": "d"}},
            "template": {"metadata": {"labels": {"app": "d"}}, "spec": {"containers": [
                {"name": "app", "image": "app:1"},
                {"name": "sidecar", "image": "sidecar:1"}
            ]}}
        }
    }))
    .unwrap();
    api.create(&PostParams::default(), &deployment).await.unwrap();
    let patch = json!({"spec": {"template": {"spec": {"containers": [{"name": "app", "image": "app:2"}]}}}});
    let patched = api
        .patch("d", &PatchParams::default(), &Patch::Strategic(patch))
        .await
        .unwrap();
    let images: Vec<(String, Option<String>)> = patched
        .spec
        .and_then(|s| s.template.spec)
        .map(|s| s.containers.into_iter().map(|c| (c.name, c.image)).collect())
        .unwrap_or_default();
    assert_eq!(
        images,
        [
            ("app".to_string(), Some("app:2".to_string())),
            ("sidecar".to_string(), Some("sidecar:1".to_string()))
        ]
    );
}

fn widget_crd() -> CustomResourceDefinition {
    serde_json::from_value(json!({
        "metadata": {"name": "widgets.test.stackd.dev"},
        "spec": {
            "group": "test.stackd.dev",
            "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "versions": [{
                "name": "v1", "served": true, "storage": true,
                "subresources": {"status": {}},
                "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                    "spec": {"type": "object", "properties": {
                        "size": {"type": "integer"},
                        "ports": {"type": "array", "x-kubernetes-list-type": "map",
                            "x-kubernetes-list-map-keys": ["name"],
                            "items": {"type": "object", "required": ["name"], "properties": {
                                "name": {"type": "string"}, "port": {"type": "integer"}}}}
                    }},
                    "status": {"type": "object", "properties": {"ready": {"type": "boolean"}}}
                }}}
            }]
        }
    }))
    .unwrap()
}

async fn widgets(t: &TestServer) -> Api<DynamicObject> {
    let crds: Api<CustomResourceDefinition> = Api::all(t.client.clone());
    crds.create(&PostParams::default(), &widget_crd()).await.unwrap();
    let gvk = GroupVersionKind::gvk("test.stackd.dev", "v1", "Widget");
    Api::namespaced_with(
        t.client.clone(),
        "ns",
        &ApiResource::from_gvk_with_plural(&gvk, "widgets"),
    )
}

fn widget(spec: Value) -> Value {
    json!({"apiVersion": "test.stackd.dev/v1", "kind": "Widget", "metadata": {"name": "w"}, "spec": spec})
}

#[tokio::test]
async fn strategic_merge_on_a_custom_resource_is_an_unsupported_media_type() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let api = widgets(&t).await;
    api.patch("w", &apply("fid"), &Patch::Apply(widget(json!({"size": 1}))))
        .await
        .unwrap();
    let err = api_error(
        api.patch(
            "w",
            &PatchParams::default(),
            &Patch::Strategic(json!({"spec": {"size": 2}})),
        )
        .await
        .unwrap_err(),
    );
    assert_eq!((err.code, err.reason.as_str()), (415, "UnsupportedMediaType"));
}

#[tokio::test]
async fn apply_merges_a_custom_resource_list_map_by_its_keys() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let api = widgets(&t).await;
    let ports = |p: Value| Patch::Apply(widget(json!({"ports": p})));
    api.patch("w", &apply("a"), &ports(json!([{"name": "http", "port": 80}])))
        .await
        .unwrap();
    let both = api
        .patch("w", &apply("b"), &ports(json!([{"name": "https", "port": 443}])))
        .await
        .unwrap();
    let names: Vec<&str> = both.data["spec"]["ports"]
        .as_array()
        .map(|p| p.iter().filter_map(|p| p["name"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(names, ["http", "https"]);
}

#[tokio::test]
async fn apply_to_status_changes_only_the_status() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let api = widgets(&t).await;
    api.patch("w", &apply("fid"), &Patch::Apply(widget(json!({"size": 1}))))
        .await
        .unwrap();
    let mut status = widget(json!({"size": 5}));
    status["status"] = json!({"ready": true});
    let updated = api
        .patch_status("w", &apply("status-writer"), &Patch::Apply(status))
        .await
        .unwrap();
    assert_eq!(updated.data["status"]["ready"], json!(true));
    assert_eq!(updated.data["spec"]["size"], json!(1));
    let entry = updated.metadata.managed_fields.unwrap_or_default();
    assert!(
        entry
            .iter()
            .any(|m| m.manager.as_deref() == Some("status-writer") && m.subresource.as_deref() == Some("status"))
    );
    // Status sent to the main resource is ignored for kinds with a status subresource.
    let mut main = widget(json!({"size": 1}));
    main["status"] = json!({"ready": false});
    let after = api.patch("w", &apply("fid"), &Patch::Apply(main)).await.unwrap();
    assert_eq!(after.data["status"]["ready"], json!(true));
}

/// A lease written by server-side apply (DESIGN.md §4.3.1) relies on this: kube-apiserver treats a
/// `resourceVersion` in an apply to the status subresource as a precondition.
#[tokio::test]
async fn apply_to_status_with_a_stale_resource_version_is_a_conflict() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let api = widgets(&t).await;
    let created = api
        .patch("w", &apply("fid"), &Patch::Apply(widget(json!({"size": 1}))))
        .await
        .unwrap();
    let status_at = |version: &str, ready: bool| {
        let mut body = widget(json!({}));
        body["metadata"]["resourceVersion"] = json!(version);
        body["status"] = json!({"ready": ready});
        Patch::Apply(body)
    };
    let seen = resource_version(&created);
    let leased = api
        .patch_status("w", &apply("leaser").force(), &status_at(&seen, true))
        .await
        .unwrap();
    assert_eq!(leased.data["status"]["ready"], json!(true));
    assert_ne!(resource_version(&leased), seen);

    let err = api_error(
        api.patch_status("w", &apply("leaser").force(), &status_at(&seen, false))
            .await
            .unwrap_err(),
    );
    assert_eq!((err.code, err.reason.as_str()), (409, "Conflict"));
    let unchanged = api
        .patch_status("w", &apply("leaser").force(), &status_at(&seen, true))
        .await;
    assert!(
        unchanged.is_err(),
        "a stale version is refused even when nothing would change"
    );
    assert_eq!(api.get("w").await.unwrap().data["status"]["ready"], json!(true));

    let mut cleared = widget(json!({}));
    cleared["metadata"]["resourceVersion"] = json!(resource_version(&leased));
    cleared["status"] = json!({});
    let released = api
        .patch_status("w", &apply("leaser").force(), &Patch::Apply(cleared))
        .await
        .unwrap();
    assert_eq!(
        released.data["status"].get("ready"),
        None,
        "a field the manager stops sending is removed"
    );
}

#[tokio::test]
async fn leader_election_acquires_a_lease_on_the_embedded_server() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let settings = LeaderElectionSettings {
        namespace: "ns".into(),
        lease_name: "leader".into(),
        identity: "me".into(),
        duration_seconds: 3,
        host: t.server.config().await,
    };
    let cancel = CancellationToken::new();
    let leadership = tokio::time::timeout(Duration::from_secs(10), acquire(&settings, &cancel))
        .await
        .expect("the lease is acquired in time")
        .unwrap();
    assert!(leadership.is_some());
    let leases: Api<Lease> = Api::namespaced(t.client.clone(), "ns");
    let lease = leases.get("leader").await.unwrap();
    assert_eq!(lease.spec.and_then(|s| s.holder_identity).as_deref(), Some("me"));
}

const APPLY: &str = "application/apply-patch+yaml";

/// One raw HTTP request through the kube client's connection; returns the code and JSON body.
async fn raw(t: &TestServer, method: &str, path: &str, content_type: &str, body: &str) -> (u16, Value) {
    let request = http::Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", content_type)
        .body(body.as_bytes().to_vec())
        .unwrap();
    let response = t.client.send(request.map(Into::into)).await.unwrap();
    let status = response.status().as_u16();
    let bytes = http_body_util::BodyExt::collect(response.into_body())
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    (status, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}

#[tokio::test]
async fn fixture_apply_cases_answer_as_kube_apiserver_1_24() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let url = "/api/v1/namespaces/ns/configmaps/c?fieldManager=fid";
    let yaml = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: c\ndata:\n  a: x\n";
    let (code, created) = raw(&t, "PATCH", url, APPLY, yaml).await;
    assert_eq!(code, 201, "apply-create: {created}");

    let yaml_b = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: c\ndata:\n  b: bee\n";
    let (code, updated) = raw(&t, "PATCH", url, APPLY, yaml_b).await;
    assert_eq!(code, 200, "apply-update-drops-unowned");
    assert_eq!(updated["data"], json!({"b": "bee"}));

    let (code, again) = raw(&t, "PATCH", url, APPLY, yaml_b).await;
    assert_eq!(code, 200, "noop-apply");
    assert_eq!(
        again["metadata"]["resourceVersion"],
        updated["metadata"]["resourceVersion"]
    );

    let other = "/api/v1/namespaces/ns/configmaps/c?fieldManager=other&force=false";
    let conflicting = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: c\ndata:\n  b: zed\n";
    let (code, status) = raw(&t, "PATCH", other, APPLY, conflicting).await;
    assert_eq!(
        (code, status["reason"].as_str()),
        (409, Some("Conflict")),
        "apply-conflict"
    );
    assert_eq!(status["details"]["causes"][0]["field"], ".data.b");

    let strategic = "application/strategic-merge-patch+json";
    let (code, patched) = raw(
        &t,
        "PATCH",
        "/api/v1/namespaces/ns/configmaps/c",
        strategic,
        r#"{"data":{"s":"1"}}"#,
    )
    .await;
    assert_eq!(code, 200, "strategic-merge-builtin: {patched}");
    assert_eq!(patched["data"], json!({"b": "bee", "s": "1"}));

    let (code, noop) = raw(
        &t,
        "PATCH",
        "/api/v1/namespaces/ns/configmaps/c",
        strategic,
        r#"{"data":{"s":"1"}}"#,
    )
    .await;
    assert_eq!(code, 200, "noop-patch");
    assert_eq!(
        noop["metadata"]["resourceVersion"],
        patched["metadata"]["resourceVersion"]
    );
}

#[tokio::test]
async fn noop_apply_patch_and_update_emit_no_watch_event() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let api = t.configmaps("ns");
    let config = Patch::Apply(cm_config("c", json!({"a": "1"})));
    let applied = api.patch("c", &apply("fid"), &config).await.unwrap();
    let params = WatchParams::default().disable_bookmarks().timeout(2);
    let watch = api.watch(&params, &resource_version(&applied)).await.unwrap();

    api.patch("c", &apply("fid"), &config).await.unwrap();
    api.patch(
        "c",
        &PatchParams::default(),
        &Patch::Strategic(json!({"data": {"a": "1"}})),
    )
    .await
    .unwrap();
    api.patch("c", &PatchParams::default(), &Patch::Merge(json!({"data": {"a": "1"}})))
        .await
        .unwrap();
    let current = api.get("c").await.unwrap();
    let unchanged = api.replace("c", &PostParams::default(), &current).await.unwrap();
    assert_eq!(resource_version(&unchanged), resource_version(&applied));
    api.patch("c", &apply("fid"), &Patch::Apply(cm_config("c", json!({"a": "2"}))))
        .await
        .unwrap();

    let events: Vec<String> = watch
        .map_ok(|event| match event {
            WatchEvent::Modified(cm) => format!("MODIFIED {}", cm.data.unwrap_or_default()["a"]),
            other => format!("{other:?}"),
        })
        .take(1)
        .try_collect()
        .await
        .unwrap();
    assert_eq!(events, ["MODIFIED 2"]);
}

#[tokio::test]
async fn protobuf_bodies_of_other_kinds_are_unsupported_media_types() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let (code, status) = raw(
        &t,
        "POST",
        "/api/v1/namespaces/ns/configmaps",
        "application/vnd.kubernetes.protobuf",
        "k8s\u{0}",
    )
    .await;
    assert_eq!((code, status["reason"].as_str()), (415, Some("UnsupportedMediaType")));
}

#[tokio::test]
async fn dry_runs_answer_like_the_write_but_store_and_announce_nothing() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let api = t.configmaps("ns");
    let created = api
        .create(&PostParams::default(), &configmap("c", json!({})))
        .await
        .unwrap();
    let watch = api
        .watch(&WatchParams::default().disable_bookmarks(), &resource_version(&created))
        .await
        .unwrap();

    let body = cm_config("d", json!({"a": "1"})).to_string();
    let (code, answer) = raw(
        &t,
        "POST",
        "/api/v1/namespaces/ns/configmaps?dryRun=All",
        "application/json",
        &body,
    )
    .await;
    assert_eq!(code, 201, "{answer}");
    assert_eq!(answer["data"]["a"], "1");
    assert!(answer["metadata"]["uid"].is_string());
    assert!(api.get_opt("d").await.unwrap().is_none());

    let object = "/api/v1/namespaces/ns/configmaps/c";
    let (code, answer) = raw(
        &t,
        "PATCH",
        &format!("{object}?dryRun=All"),
        "application/merge-patch+json",
        r#"{"data":{"k":"dry"}}"#,
    )
    .await;
    assert_eq!((code, answer["data"]["k"].as_str()), (200, Some("dry")));
    assert_eq!(answer["metadata"]["resourceVersion"], json!(resource_version(&created)));
    let stale = json!({"metadata": {"resourceVersion": "1"}, "data": {"k": "x"}}).to_string();
    let (code, _) = raw(
        &t,
        "PATCH",
        &format!("{object}?dryRun=All"),
        "application/merge-patch+json",
        &stale,
    )
    .await;
    assert_eq!(code, 409);
    let (code, _) = raw(&t, "DELETE", &format!("{object}?dryRun=All"), "application/json", "").await;
    assert_eq!(code, 200);
    let apply_url = format!("{object}?dryRun=All&fieldManager=m&force=true");
    let (code, answer) = raw(
        &t,
        "PATCH",
        &apply_url,
        APPLY,
        &cm_config("c", json!({"k": "applied"})).to_string(),
    )
    .await;
    assert_eq!((code, answer["data"]["k"].as_str()), (200, Some("applied")));

    let stored = api.get("c").await.unwrap();
    assert_eq!(stored.data.clone().unwrap_or_default()["k"], "v");
    assert_eq!(resource_version(&stored), resource_version(&created));
    api.patch(
        "c",
        &PatchParams::default(),
        &Patch::Merge(json!({"data": {"k": "real"}})),
    )
    .await
    .unwrap();
    let first: Vec<String> = watch
        .map_ok(|event| match event {
            WatchEvent::Modified(cm) => format!("MODIFIED {}", cm.data.unwrap_or_default()["k"]),
            other => format!("{other:?}"),
        })
        .take(1)
        .try_collect()
        .await
        .unwrap();
    assert_eq!(first, ["MODIFIED real"]);
}

#[tokio::test]
async fn malformed_patches_and_bodies_get_answers_not_crashes() {
    let t = harness::start().await;
    t.namespace("ns").await;
    t.configmaps("ns")
        .create(&PostParams::default(), &configmap("c", json!({})))
        .await
        .unwrap();
    let object = "/api/v1/namespaces/ns/configmaps/c";
    let cases = [
        ("PATCH", object, "application/merge-patch+json", r#""scalar""#),
        ("PATCH", object, "application/merge-patch+json", r#"{"metadata":"x"}"#),
        (
            "PATCH",
            object,
            "application/json-patch+json",
            r#"[{"op":"replace","path":"","value":[1]}]"#,
        ),
        ("PATCH", object, "application/strategic-merge-patch+json", "[]"),
        (
            "PATCH",
            object,
            "application/strategic-merge-patch+json",
            r#"{"metadata":7}"#,
        ),
        (
            "PATCH",
            &format!("{object}?fieldManager=m"),
            APPLY,
            "apiVersion: v1\nkind: ConfigMap\nmetadata: x\n",
        ),
        (
            "PATCH",
            "/api/v1/namespaces/ns/configmaps/d?fieldManager=m",
            APPLY,
            "apiVersion: v1\nkind: ConfigMap\nmetadata: [1]\n",
        ),
        (
            "PATCH",
            &format!("{object}?fieldManager=m"),
            APPLY,
            "- just\n- a list\n",
        ),
        (
            "POST",
            "/api/v1/namespaces/ns/configmaps",
            "application/json",
            r#"{"metadata":"x"}"#,
        ),
        ("PUT", object, "application/json", r#"{"metadata":[],"data":{}}"#),
        (
            "POST",
            "/api/v1/namespaces/ns/configmaps",
            "application/json",
            r#"{"metadata":{"name":"l","labels":"x"}}"#,
        ),
    ];
    for (method, path, content_type, body) in cases {
        let (code, status) = raw(&t, method, path, content_type, body).await;
        assert!((400..500).contains(&code), "{method} {path} {body}: {code} {status}");
        assert_eq!(status["kind"], "Status", "{method} {path} {body}");
    }
    // Wrongly typed specs are the validation's business; here they must only get an answer.
    let typed = [
        ("/api/v1/namespaces/ns/pods", r#"{"metadata":{"name":"p"},"spec":"x"}"#),
        (
            "/apis/apps/v1/namespaces/ns/deployments",
            r#"{"metadata":{"name":"d"},"spec":[]}"#,
        ),
        (
            "/apis/batch/v1/namespaces/ns/jobs",
            r#"{"metadata":{"name":"j"},"spec":{"template":"x"}}"#,
        ),
        (
            "/api/v1/namespaces/ns/secrets",
            r#"{"metadata":{"name":"s"},"data":[1]}"#,
        ),
    ];
    for (path, body) in typed {
        let (code, answer) = raw(&t, "POST", path, "application/json", body).await;
        assert!(code < 500 && answer.is_object(), "POST {path} {body}: {code} {answer}");
    }
    assert!(t.configmaps("ns").get("c").await.is_ok());
}

#[tokio::test]
async fn a_released_lease_is_taken_by_the_next_contender_at_once() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let manager = |identity: &str| {
        kube_lease_manager::LeaseManagerBuilder::new(t.client.clone(), "leader")
            .with_namespace("ns")
            .with_parameters(kube_lease_manager::LeaseParams::new(identity, 30, 10))
            .build()
    };
    let first = manager("first").await.unwrap();
    assert!(
        first.changed().await.unwrap(),
        "the first contender takes the free lease"
    );
    first.release().await.unwrap();
    // The release drops the first holder's fields (a strategic merge of nulls), so the next
    // contender's server-side apply without force meets no conflict; with a 30 s lease, only
    // that lets it in within seconds.
    let second = manager("second").await.unwrap();
    let taken = tokio::time::timeout(Duration::from_secs(5), second.changed()).await;
    assert!(
        matches!(taken, Ok(Ok(true))),
        "the released lease is taken at once: {taken:?}"
    );
    let leases: Api<Lease> = Api::namespaced(t.client.clone(), "ns");
    let lease = leases.get("leader").await.unwrap();
    let spec = lease.spec.unwrap_or_default();
    assert_eq!(spec.holder_identity.as_deref(), Some("second"));
    assert_eq!(spec.lease_transitions, Some(2));
}

fn status_updates(object: &DynamicObject) -> usize {
    let entries = object.metadata.managed_fields.as_deref().unwrap_or_default();
    entries
        .iter()
        .filter(|m| m.subresource.as_deref() == Some("status") && m.operation.as_deref() == Some("Update"))
        .count()
}

/// What client-go's csaupgrade and stackd's status writer rely on: as on kube-apiserver, a JSON
/// patch of `metadata.managedFields` on the main resource, guarded by a `test` of the
/// resourceVersion, replaces the entries (an old status updater's fields become the applier's,
/// so its next apply removes what it no longer sends); a stale version fails the test; an empty
/// list leaves the entries as they are.
#[tokio::test]
async fn a_json_patch_of_managed_fields_hands_an_updaters_fields_to_an_applier() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let api = widgets(&t).await;
    api.patch("w", &apply("fid"), &Patch::Apply(widget(json!({"size": 1}))))
        .await
        .unwrap();
    let legacy = api
        .patch_status(
            "w",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"ready": true}})),
        )
        .await
        .unwrap();
    assert_eq!(status_updates(&legacy), 1);
    let mut entries = legacy.metadata.managed_fields.clone().unwrap_or_default();
    for entry in &mut entries {
        if entry.subresource.as_deref() == Some("status") {
            entry.manager = Some("writer".to_string());
            entry.operation = Some("Apply".to_string());
        }
    }
    let rewrite = |version: String, entries: Value| {
        serde_json::from_value::<json_patch::Patch>(json!([
            {"op": "test", "path": "/metadata/resourceVersion", "value": version},
            {"op": "replace", "path": "/metadata/managedFields", "value": entries},
        ]))
        .unwrap()
    };

    let empty = api
        .patch(
            "w",
            &PatchParams::default(),
            &Patch::Json::<()>(rewrite(resource_version(&legacy), json!([]))),
        )
        .await
        .unwrap();
    assert_eq!(empty.metadata.managed_fields, legacy.metadata.managed_fields);

    let taken = api
        .patch(
            "w",
            &PatchParams::default(),
            &Patch::Json::<()>(rewrite(resource_version(&legacy), json!(entries))),
        )
        .await
        .unwrap();
    assert_eq!(status_updates(&taken), 0);
    assert_ne!(resource_version(&taken), resource_version(&legacy));
    assert_eq!(taken.data["status"]["ready"], json!(true));
    assert!(taken.metadata.managed_fields.iter().flatten().any(|m| {
        m.manager.as_deref() == Some("writer")
            && m.operation.as_deref() == Some("Apply")
            && m.subresource.as_deref() == Some("status")
    }));

    let stale = api_error(
        api.patch(
            "w",
            &PatchParams::default(),
            &Patch::Json::<()>(rewrite(resource_version(&legacy), json!(entries))),
        )
        .await
        .unwrap_err(),
    );
    assert_eq!(stale.code, 422);

    let mut without_ready = widget(json!({"size": 1}));
    without_ready["status"] = json!({});
    let applied = api
        .patch_status("w", &apply("writer").force(), &Patch::Apply(without_ready))
        .await
        .unwrap();
    assert_eq!(applied.data["status"].get("ready"), None, "{:?}", applied.data);
}
