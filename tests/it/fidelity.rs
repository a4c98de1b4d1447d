//! Every case of `../shared/fixtures/kube-apiserver-1.24-answers.md` (what a real kube-apiserver v1.24
//! answered), replayed as raw HTTP against the embedded server: same status code, `Status.reason` and
//! result. One test per case (or per pair of cases the fixture records together).

use std::time::Duration;

use futures::StreamExt;
use serde_json::{Value, json};

use crate::harness::{self, NoDaemon, TestServer, until};

const NS: &str = "fidelity";

struct Raw {
    _server: TestServer,
    client: kube::Client,
}

struct Answer {
    code: u16,
    body: Value,
}

impl Answer {
    fn reason(&self) -> &str {
        self.body["reason"].as_str().unwrap_or("")
    }

    fn rv(&self) -> String {
        self.body["metadata"]["resourceVersion"]
            .as_str()
            .unwrap_or("")
            .to_string()
    }

    fn names(&self) -> Vec<String> {
        self.body["items"]
            .as_array()
            .map(|items| {
                items
                    .iter()
                    .filter_map(|i| i["metadata"]["name"].as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default()
    }

    fn data_keys(&self) -> Vec<String> {
        self.body["data"]
            .as_object()
            .map(|d| d.keys().cloned().collect())
            .unwrap_or_default()
    }

    #[track_caller]
    fn expect(&self, code: u16, reason: &str) -> &Answer {
        assert_eq!((self.code, self.reason()), (code, reason), "{}", self.body);
        self
    }
}

impl Raw {
    /// A fresh server with namespace [`NS`]; the client never retries, so every answer is seen.
    async fn start() -> Raw {
        let t = harness::start().await;
        let mut config = kube::Config::from_custom_kubeconfig(t.server.kubeconfig(), &Default::default())
            .await
            .unwrap();
        config.default_retry = false;
        let client = kube::Client::try_from(config).unwrap();
        let raw = Raw { _server: t, client };
        raw.post("/api/v1/namespaces", json!({"metadata": {"name": NS}}))
            .await
            .expect(201, "");
        raw
    }

    async fn call(&self, method: &str, path: &str, content_type: &str, body: Option<Value>) -> Answer {
        let mut request = http::Request::builder().method(method).uri(path);
        if body.is_some() {
            request = request.header("content-type", content_type);
        }
        let bytes = body.map(|b| b.to_string().into_bytes()).unwrap_or_default();
        let request = request.body(bytes).unwrap();
        let response = self.client.send(request.map(Into::into)).await.unwrap();
        let code = response.status().as_u16();
        let body = http_body_util::BodyExt::collect(response.into_body())
            .await
            .unwrap()
            .to_bytes();
        Answer {
            code,
            body: serde_json::from_slice(&body).unwrap_or(Value::Null),
        }
    }

    async fn get(&self, path: &str) -> Answer {
        self.call("GET", path, "", None).await
    }

    async fn post(&self, path: &str, body: Value) -> Answer {
        self.call("POST", path, "application/json", Some(body)).await
    }

    async fn put(&self, path: &str, body: Value) -> Answer {
        self.call("PUT", path, "application/json", Some(body)).await
    }

    async fn patch(&self, path: &str, content_type: &str, body: Value) -> Answer {
        self.call("PATCH", path, content_type, Some(body)).await
    }

    async fn delete(&self, path: &str) -> Answer {
        self.call("DELETE", path, "", None).await
    }

    async fn configmap(&self, name: &str, labels: Value) -> Answer {
        let body = json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "labels": labels}, "data": {"k": "v"}});
        self.post(&cms(), body).await
    }
}

fn cms() -> String {
    format!("/api/v1/namespaces/{NS}/configmaps")
}

fn cm(name: &str) -> String {
    format!("{}/{name}", cms())
}

const MERGE: &str = "application/merge-patch+json";
const JSON_PATCH: &str = "application/json-patch+json";
const APPLY: &str = "application/apply-patch+yaml";
const STRATEGIC: &str = "application/strategic-merge-patch+json";

#[tokio::test]
async fn fixture_create_ns_and_create_ns_again() {
    let raw = Raw::start().await;
    raw.post("/api/v1/namespaces", json!({"metadata": {"name": "fresh"}}))
        .await
        .expect(201, "");
    raw.post("/api/v1/namespaces", json!({"metadata": {"name": "fresh"}}))
        .await
        .expect(409, "AlreadyExists");
}

#[tokio::test]
async fn fixture_label_value_64() {
    let raw = Raw::start().await;
    raw.configmap("c", json!({"l": "v".repeat(64)}))
        .await
        .expect(422, "Invalid");
}

#[tokio::test]
async fn fixture_bad_name() {
    let raw = Raw::start().await;
    raw.configmap("Bad_Name", json!({})).await.expect(422, "Invalid");
}

#[tokio::test]
async fn fixture_name_254_and_name_253() {
    let raw = Raw::start().await;
    raw.configmap(&"n".repeat(254), json!({})).await.expect(422, "Invalid");
    raw.configmap(&"n".repeat(253), json!({})).await.expect(201, "");
}

#[tokio::test]
async fn fixture_get_missing() {
    let raw = Raw::start().await;
    raw.get(&cm("missing")).await.expect(404, "NotFound");
}

#[tokio::test]
async fn fixture_create_in_missing_ns() {
    let raw = Raw::start().await;
    let body = json!({"metadata": {"name": "c"}, "data": {"k": "v"}});
    raw.post("/api/v1/namespaces/nowhere/configmaps", body)
        .await
        .expect(404, "NotFound");
}

#[tokio::test]
async fn fixture_update_stale_rv() {
    let raw = Raw::start().await;
    let created = raw.configmap("c", json!({})).await;
    let mut changed = created.body.clone();
    changed["data"]["k"] = json!("v2");
    raw.put(&cm("c"), changed).await.expect(200, "");
    let mut stale = created.body.clone();
    stale["data"]["k"] = json!("v3");
    raw.put(&cm("c"), stale).await.expect(409, "Conflict");
}

#[tokio::test]
async fn fixture_merge_patch() {
    let raw = Raw::start().await;
    raw.configmap("c", json!({})).await;
    let answer = raw.patch(&cm("c"), MERGE, json!({"data": {"m": "n"}})).await;
    answer.expect(200, "");
    assert_eq!(answer.data_keys(), ["k", "m"]);
}

#[tokio::test]
async fn fixture_json_patch_test_fails() {
    let raw = Raw::start().await;
    raw.configmap("c", json!({})).await;
    raw.patch(&cm("c"), MERGE, json!({"data": {"k": "v2"}}))
        .await
        .expect(200, "");
    let test = json!([{"op": "test", "path": "/data/k", "value": "nope"}]);
    raw.patch(&cm("c"), JSON_PATCH, test).await.expect(422, "Invalid");
}

#[tokio::test]
async fn fixture_json_patch_test_missing_is_null() {
    let raw = Raw::start().await;
    raw.configmap("c", json!({})).await;
    let patch = json!([
        {"op": "test", "path": "/metadata/finalizers", "value": null},
        {"op": "add", "path": "/metadata/finalizers", "value": ["fidelity.dev/hold"]},
    ]);
    let answer = raw.patch(&cm("c"), JSON_PATCH, patch).await;
    answer.expect(200, "");
    assert_eq!(answer.body["metadata"]["finalizers"], json!(["fidelity.dev/hold"]));
}

#[tokio::test]
async fn fixture_merge_patch_missing() {
    let raw = Raw::start().await;
    raw.patch(&cm("missing"), MERGE, json!({"data": {"m": "n"}}))
        .await
        .expect(404, "NotFound");
}

fn applied(data: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "applied"}, "data": data})
}

fn apply_path(manager: &str, force: bool) -> String {
    format!("{}?fieldManager={manager}&force={force}", cm("applied"))
}

#[tokio::test]
async fn fixture_apply_create_and_apply_update_drops_unowned() {
    let raw = Raw::start().await;
    raw.patch(&apply_path("fid", false), APPLY, applied(json!({"a": "1"})))
        .await
        .expect(201, "");
    let answer = raw
        .patch(&apply_path("fid", false), APPLY, applied(json!({"b": "2"})))
        .await;
    answer.expect(200, "");
    assert_eq!(answer.data_keys(), ["b"]);
}

#[tokio::test]
async fn fixture_noop_patch_and_noop_update() {
    let raw = Raw::start().await;
    let created = raw.configmap("c", json!({})).await;
    let rv = created.rv();
    let patched = raw.patch(&cm("c"), MERGE, json!({"data": {"k": "v"}})).await;
    patched.expect(200, "");
    assert_eq!(patched.rv(), rv);
    let updated = raw.put(&cm("c"), created.body.clone()).await;
    updated.expect(200, "");
    assert_eq!(updated.rv(), rv);
}

#[tokio::test]
async fn fixture_noop_apply() {
    let raw = Raw::start().await;
    let first = raw
        .patch(&apply_path("fid", false), APPLY, applied(json!({"a": "1"})))
        .await;
    let again = raw
        .patch(&apply_path("fid", false), APPLY, applied(json!({"a": "1"})))
        .await;
    again.expect(200, "");
    assert_eq!(again.rv(), first.rv());
}

#[tokio::test]
async fn fixture_apply_conflict() {
    let raw = Raw::start().await;
    raw.patch(&apply_path("fid", false), APPLY, applied(json!({"a": "1"})))
        .await
        .expect(201, "");
    raw.patch(&apply_path("other", false), APPLY, applied(json!({"a": "2"})))
        .await
        .expect(409, "Conflict");
}

#[tokio::test]
async fn fixture_strategic_merge_builtin() {
    let raw = Raw::start().await;
    raw.configmap("c", json!({})).await;
    let answer = raw.patch(&cm("c"), STRATEGIC, json!({"data": {"s": "t"}})).await;
    answer.expect(200, "");
    assert_eq!(answer.data_keys(), ["k", "s"]);
}

async fn selector_fixture() -> Raw {
    let raw = Raw::start().await;
    raw.configmap("c1", json!({"app": "x", "tier": "a"}))
        .await
        .expect(201, "");
    raw.configmap("c2", json!({"app": "y"})).await.expect(201, "");
    raw.configmap("c3", json!({"app": "z", "tier": "b"}))
        .await
        .expect(201, "");
    raw
}

#[tokio::test]
async fn fixture_list_selector() {
    let raw = selector_fixture().await;
    let answer = raw
        .get(&format!(
            "{}?labelSelector={}",
            cms(),
            urlencoding::encode("app in (x,y),!tier")
        ))
        .await;
    answer.expect(200, "");
    assert_eq!(answer.names(), ["c2"]);
}

#[tokio::test]
async fn fixture_list_selector_neq() {
    let raw = selector_fixture().await;
    let answer = raw
        .get(&format!("{}?labelSelector={}", cms(), urlencoding::encode("app!=x")))
        .await;
    answer.expect(200, "");
    assert_eq!(answer.names(), ["c2", "c3"]);
}

#[tokio::test]
async fn fixture_list_field_selector() {
    let raw = selector_fixture().await;
    let answer = raw
        .get(&format!(
            "{}?fieldSelector={}",
            cms(),
            urlencoding::encode("metadata.name=c2")
        ))
        .await;
    answer.expect(200, "");
    assert_eq!(answer.names(), ["c2"]);
}

#[tokio::test]
async fn fixture_generate_name() {
    let raw = Raw::start().await;
    let answer = raw.post(&cms(), json!({"metadata": {"generateName": "gen-"}})).await;
    answer.expect(201, "");
    let name = answer.body["metadata"]["name"].as_str().unwrap();
    assert!(name.starts_with("gen-") && name.len() > 4, "{name}");
}

#[tokio::test]
async fn fixture_delete_finalized_and_remove_finalizer() {
    let raw = Raw::start().await;
    let body = json!({"metadata": {"name": "held", "finalizers": ["fidelity.dev/hold"]}});
    raw.post(&cms(), body).await.expect(201, "");
    let deleted = raw.delete(&cm("held")).await;
    deleted.expect(200, "");
    assert!(
        deleted.body["metadata"]["deletionTimestamp"].is_string(),
        "{}",
        deleted.body
    );
    raw.get(&cm("held")).await.expect(200, "");
    raw.patch(&cm("held"), MERGE, json!({"metadata": {"finalizers": null}}))
        .await
        .expect(200, "");
    raw.get(&cm("held")).await.expect(404, "NotFound");
}

#[tokio::test]
async fn fixture_deletecollection() {
    let raw = selector_fixture().await;
    raw.delete(&format!("{}?labelSelector=app", cms()))
        .await
        .expect(200, "");
    let after = raw.get(&cms()).await;
    after.expect(200, "");
    assert!(after.names().is_empty(), "{:?}", after.names());
}

#[tokio::test]
async fn fixture_create_token_secret() {
    let raw = Raw::start().await;
    raw.post(
        &format!("/api/v1/namespaces/{NS}/serviceaccounts"),
        json!({"metadata": {"name": "robot"}}),
    )
    .await
    .expect(201, "");
    let secret = json!({
        "metadata": {"name": "robot-token", "annotations": {"kubernetes.io/service-account.name": "robot"}},
        "type": "kubernetes.io/service-account-token",
    });
    let secrets = format!("/api/v1/namespaces/{NS}/secrets");
    raw.post(&secrets, secret).await.expect(201, "");
    until("the token Secret filled", Duration::from_secs(1), &NoDaemon, || async {
        let answer = raw.get(&format!("{secrets}/robot-token")).await;
        answer.expect(200, "");
        ["token", "ca.crt", "namespace"]
            .iter()
            .all(|k| answer.data_keys().iter().any(|have| have == k))
    })
    .await;
}

fn job(name: &str) -> Value {
    json!({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name}, "spec": {"template": {"spec": {
        "restartPolicy": "Never", "containers": [{"name": "c", "image": "busybox"}],
    }}}})
}

#[tokio::test]
async fn fixture_job_name_63_and_job_name_64() {
    let raw = Raw::start().await;
    let jobs = format!("/apis/batch/v1/namespaces/{NS}/jobs");
    let created = raw.post(&jobs, job(&"j".repeat(63))).await;
    created.expect(201, "");
    let labels = &created.body["spec"]["template"]["metadata"]["labels"];
    assert!(
        labels["controller-uid"].is_string() && labels["job-name"].is_string(),
        "{labels}"
    );
    raw.post(&jobs, job(&"j".repeat(64))).await.expect(422, "Invalid");
}

#[tokio::test]
async fn fixture_watch_selector_enter_leave() {
    let raw = Raw::start().await;
    let path = format!("{}?watch=true&labelSelector=sel%3D1&timeoutSeconds=2", cms());
    let request = http::Request::get(path).body(Vec::new()).unwrap();
    let response = raw.client.send(request.map(Into::into)).await.unwrap();
    assert_eq!(response.status().as_u16(), 200);
    let writes = async {
        raw.configmap("w", json!({"sel": "1"})).await.expect(201, "");
        for sel in ["2", "1"] {
            raw.patch(&cm("w"), MERGE, json!({"metadata": {"labels": {"sel": sel}}}))
                .await
                .expect(200, "");
        }
    };
    let read = async {
        let mut body = http_body_util::BodyStream::new(response.into_body());
        let mut text = Vec::new();
        while let Some(frame) = body.next().await {
            if let Ok(data) = frame.unwrap().into_data() {
                text.extend_from_slice(&data);
            }
        }
        text
    };
    let ((), text) = tokio::join!(writes, read);
    let events: Vec<String> = String::from_utf8(text)
        .unwrap()
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .map(|event| event["type"].as_str().unwrap_or("").to_string())
        .collect();
    assert_eq!(events, ["ADDED", "DELETED", "ADDED"]);
}

/// kube-apiserver's events.k8s.io/v1 validation: `note` is at most 1,024 bytes (a longer condition
/// message sent as an Event's note was refused there and never published).
#[tokio::test]
async fn an_event_note_over_1024_bytes_is_invalid_as_on_kube_apiserver() {
    let raw = Raw::start().await;
    let events = format!("/apis/events.k8s.io/v1/namespaces/{NS}/events");
    let event = |name: &str, note: String| {
        json!({"apiVersion": "events.k8s.io/v1", "kind": "Event", "metadata": {"name": name},
            "eventTime": "2026-12-07T12:00:00.000000Z", "reportingController": "stackd.dev/test",
            "reportingInstance": "stackd", "action": "Check", "reason": "Check", "type": "Normal",
            "regarding": {"kind": "ConfigMap", "namespace": NS, "name": "c"}, "note": note})
    };
    let refused = raw.post(&events, event("long", "é".repeat(513))).await;
    refused.expect(422, "Invalid");
    assert_eq!(
        refused.body["details"]["causes"][0]["field"], "note",
        "{}",
        refused.body
    );
    assert_eq!(
        refused.body["details"]["causes"][0]["message"],
        "Too long: must have at most 1024 bytes"
    );
    assert_eq!(raw.post(&events, event("fits", "é".repeat(512))).await.code, 201);
    // The legacy core/v1 message has no such limit.
    let core = json!({"apiVersion": "v1", "kind": "Event", "metadata": {"name": "legacy"},
        "involvedObject": {"kind": "ConfigMap", "namespace": NS, "name": "c"},
        "reason": "Check", "message": "x".repeat(2000), "type": "Normal"});
    assert_eq!(
        raw.post(&format!("/api/v1/namespaces/{NS}/events"), core).await.code,
        201
    );
}
