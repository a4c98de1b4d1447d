//! What kubectl relies on beyond the verbs: `/openapi/v3`, `fieldValidation`, Table output.

use kube::api::PostParams;
use serde_json::{Value, json};

use crate::harness::{self, TestServer};

struct Answer {
    code: u16,
    warnings: Vec<String>,
    body: Value,
}

async fn request(t: &TestServer, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Answer {
    let mut builder = http::Request::builder().method(method).uri(path);
    for (name, value) in headers {
        builder = builder.header(*name, *value);
    }
    let request = builder.body(body.as_bytes().to_vec()).unwrap();
    let response = t.client.send(request.map(Into::into)).await.unwrap();
    let code = response.status().as_u16();
    let warnings = response
        .headers()
        .get_all("warning")
        .iter()
        .filter_map(|v| v.to_str().ok().map(String::from))
        .collect();
    let bytes = http_body_util::BodyExt::collect(response.into_body())
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    Answer {
        code,
        warnings,
        body: serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    }
}

const JSON: (&str, &str) = ("content-type", "application/json");

#[tokio::test]
async fn openapi_v3_index_lists_group_versions_and_changes_hash_with_crds() {
    let t = harness::start().await;
    let before = request(&t, "GET", "/openapi/v3", &[], "").await;
    assert_eq!(before.code, 200);
    assert!(before.body["paths"]["api/v1"]["serverRelativeURL"].is_string());
    let apps = before.body["paths"]["apis/apps/v1"]["serverRelativeURL"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(apps.starts_with("/openapi/v3/apis/apps/v1?hash="), "{apps}");
    assert!(before.body["paths"]["apis/pools.stackd.dev/v1alpha1"].is_null());

    harness::install_crds(&t.client).await;
    let after = request(&t, "GET", "/openapi/v3", &[], "").await;
    let pools = after.body["paths"]["apis/pools.stackd.dev/v1alpha1"]["serverRelativeURL"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(pools.contains("?hash="), "{}", after.body);
    let document = request(&t, "GET", &pools, &[], "").await;
    let schemas = &document.body["components"]["schemas"];
    let pool = &schemas["dev.stackd.pools.v1alpha1.ClusterPool"];
    assert_eq!(
        pool["x-kubernetes-group-version-kind"],
        json!([{"group": "pools.stackd.dev", "version": "v1alpha1", "kind": "ClusterPool"}])
    );
    assert!(pool["properties"]["spec"]["properties"]["size"]["description"].is_string());
    let patch =
        &document.body["paths"]["/apis/pools.stackd.dev/v1alpha1/namespaces/{namespace}/clusterpools/{name}"]["patch"];
    assert_eq!(patch["x-kubernetes-group-version-kind"]["kind"], "ClusterPool");
    let core = request(&t, "GET", "/openapi/v3/api/v1", &[], "").await;
    assert_eq!(
        core.body["components"]["schemas"]["io.k8s.api.core.v1.ConfigMap"]["x-kubernetes-group-version-kind"][0]["kind"],
        "ConfigMap"
    );
    assert_eq!(request(&t, "GET", "/openapi/v2", &[], "").await.code, 404);
}

#[tokio::test]
async fn field_validation_strict_refuses_warn_warns_and_ignore_prunes() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let body = |name: &str| {
        json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": {"a": "1"}, "spec": {"x": 1}})
            .to_string()
    };
    let path = "/api/v1/namespaces/ns/configmaps";
    let strict = request(
        &t,
        "POST",
        &format!("{path}?fieldValidation=Strict"),
        &[JSON],
        &body("s"),
    )
    .await;
    assert_eq!(strict.code, 400);
    assert_eq!(strict.body["message"], "strict decoding error: unknown field \"spec\"");

    let warn = request(&t, "POST", &format!("{path}?fieldValidation=Warn"), &[JSON], &body("w")).await;
    assert_eq!(warn.code, 201);
    assert_eq!(warn.warnings, ["299 - \"unknown field \\\"spec\\\"\""]);
    assert!(warn.body["spec"].is_null());

    let ignore = request(
        &t,
        "POST",
        &format!("{path}?fieldValidation=Ignore"),
        &[JSON],
        &body("i"),
    )
    .await;
    assert_eq!(ignore.code, 201);
    assert!(ignore.warnings.is_empty());
    assert!(ignore.body["spec"].is_null());
}

#[tokio::test]
async fn field_validation_checks_custom_resources_against_their_schema() {
    let t = harness::start().await;
    t.namespace("ns").await;
    harness::install_crds(&t.client).await;
    let cdc = json!({
        "apiVersion": "pools.stackd.dev/v1alpha1", "kind": "ClusterDeploymentCustomization",
        "metadata": {"name": "c"},
        "spec": {"installConfigPatches": [{"op": "add", "path": "/a", "value": "x", "bogus": 1}]}
    });
    let path = "/apis/pools.stackd.dev/v1alpha1/namespaces/ns/clusterdeploymentcustomizations";
    let strict = request(
        &t,
        "POST",
        &format!("{path}?fieldValidation=Strict"),
        &[JSON],
        &cdc.to_string(),
    )
    .await;
    assert_eq!(strict.code, 400, "{}", strict.body);
    assert!(
        strict.body["message"]
            .as_str()
            .unwrap_or_default()
            .contains("unknown field \"spec.installConfigPatches[0].bogus\""),
        "{}",
        strict.body
    );
    let warn = request(
        &t,
        "POST",
        &format!("{path}?fieldValidation=Warn"),
        &[JSON],
        &cdc.to_string(),
    )
    .await;
    assert_eq!(warn.code, 201, "{}", warn.body);
    assert_eq!(warn.warnings.len(), 1);
    assert!(warn.body["spec"]["installConfigPatches"][0]["bogus"].is_null());
}

const TABLE: (&str, &str) = (
    "accept",
    "application/json;as=Table;v=v1;g=meta.k8s.io,application/json;as=Table;v=v1beta1;g=meta.k8s.io,application/json",
);

#[tokio::test]
async fn table_output_uses_printer_columns_and_conditions() {
    let t = harness::start().await;
    t.namespace("ns").await;
    harness::install_crds(&t.client).await;
    let stack = json!({
        "apiVersion": "stacks.stackd.dev/v1alpha1", "kind": "StackInstall",
        "metadata": {"name": "s"}, "spec": {"package": "pkg"}
    });
    let path = "/apis/stacks.stackd.dev/v1alpha1/namespaces/ns/stackinstalls";
    let created = request(&t, "POST", path, &[JSON], &stack.to_string()).await;
    assert_eq!(created.code, 201, "{}", created.body);
    let status = json!({"status": {"conditions": [
        {"type": "Ready", "status": "True", "reason": "Installed", "message": "ok", "lastTransitionTime": "2026-01-01T00:00:00Z"}
    ]}});
    let patched = request(
        &t,
        "PATCH",
        &format!("{path}/s/status"),
        &[("content-type", "application/merge-patch+json")],
        &status.to_string(),
    )
    .await;
    assert_eq!(patched.code, 200, "{}", patched.body);

    let table = request(&t, "GET", path, &[TABLE], "").await;
    assert_eq!(
        (table.body["kind"].as_str(), table.body["apiVersion"].as_str()),
        (Some("Table"), Some("meta.k8s.io/v1"))
    );
    let names: Vec<&str> = table.body["columnDefinitions"]
        .as_array()
        .map(|c| c.iter().filter_map(|c| c["name"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(names, ["Name", "Ready", "Package", "Age"]);
    let cells = &table.body["rows"][0]["cells"];
    assert_eq!(
        &cells.as_array().map(|c| c[..3].to_vec()).unwrap_or_default(),
        &[json!("s"), json!("True"), json!("pkg")]
    );
    assert_eq!(table.body["rows"][0]["object"]["kind"], "PartialObjectMetadata");

    let with_object = request(&t, "GET", &format!("{path}/s?includeObject=Object"), &[TABLE], "").await;
    assert_eq!(with_object.body["rows"][0]["object"]["kind"], "StackInstall");
    let plain = request(&t, "GET", &format!("{path}/s"), &[("accept", "application/json")], "").await;
    assert_eq!(plain.body["kind"], "StackInstall");
}

#[tokio::test]
async fn built_in_tables_show_job_and_deployment_columns() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let columns = |body: &Value| -> Vec<String> {
        body["columnDefinitions"]
            .as_array()
            .map(|c| c.iter().filter_map(|c| c["name"].as_str().map(String::from)).collect())
            .unwrap_or_default()
    };
    let jobs = request(&t, "GET", "/apis/batch/v1/namespaces/ns/jobs", &[TABLE], "").await;
    assert_eq!(columns(&jobs.body), ["Name", "Completions", "Duration", "Age"]);
    let deployments = request(&t, "GET", "/apis/apps/v1/namespaces/ns/deployments", &[TABLE], "").await;
    assert_eq!(
        columns(&deployments.body),
        ["Name", "Ready", "Up-to-date", "Available", "Age"]
    );
    let pods = request(&t, "GET", "/api/v1/namespaces/ns/pods", &[TABLE], "").await;
    assert_eq!(columns(&pods.body), ["Name", "Ready", "Status", "Restarts", "Age"]);
}

#[tokio::test]
async fn metadata_only_lists_answer_partial_object_metadata() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let api = t.configmaps("ns");
    api.create(&PostParams::default(), &harness::configmap("c", json!({"app": "x"})))
        .await
        .unwrap();
    let listed = api.list_metadata(&Default::default()).await.unwrap();
    assert_eq!(listed.items.len(), 1);
    assert_eq!(listed.items[0].metadata.name.as_deref(), Some("c"));
    let raw = request(
        &t,
        "GET",
        "/api/v1/namespaces/ns/configmaps",
        &[(
            "accept",
            "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1",
        )],
        "",
    )
    .await;
    assert_eq!(raw.body["kind"], "PartialObjectMetadataList");
    assert_eq!(raw.body["items"][0]["kind"], "PartialObjectMetadata");
    assert!(raw.body["items"][0]["data"].is_null());
}

/// `networking.k8s.io/v1` NetworkPolicies: discovered, defaulted, validated (422 with the field's
/// path), shown as kubectl shows them; stored, never enforced.
#[tokio::test]
async fn network_policies_are_discovered_defaulted_validated_and_tabled() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let discovery = request(&t, "GET", "/apis/networking.k8s.io/v1", &[], "").await;
    let resources = discovery.body["resources"].as_array().cloned().unwrap_or_default();
    let policies = resources
        .iter()
        .find(|r| r["name"] == "networkpolicies")
        .expect("networkpolicies discovered");
    assert_eq!(policies["kind"], "NetworkPolicy");
    assert_eq!(policies["namespaced"], true);
    assert_eq!(policies["shortNames"], json!(["netpol"]));

    let path = "/apis/networking.k8s.io/v1/namespaces/ns/networkpolicies";
    let policy = json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": "isolate"},
        "spec": {"podSelector": {"matchLabels": {"app": "x"}}, "ingress": [{"from": [{"podSelector": {}}], "ports": [{"port": 8080}]}]},
    });
    let created = request(&t, "POST", path, &[JSON], &policy.to_string()).await;
    assert_eq!(created.code, 201, "{}", created.body);
    assert_eq!(created.body["spec"]["policyTypes"], json!(["Ingress"]));
    assert_eq!(created.body["spec"]["ingress"][0]["ports"][0]["protocol"], "TCP");

    let bad = json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": "bad"},
        "spec": {"podSelector": {}, "policyTypes": ["Sideways"], "ingress": [{"from": [{}]}]},
    });
    let refused = request(&t, "POST", path, &[JSON], &bad.to_string()).await;
    assert_eq!(refused.code, 422, "{}", refused.body);
    let fields: Vec<&str> = refused.body["details"]["causes"]
        .as_array()
        .map(|c| c.iter().filter_map(|c| c["field"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(fields, ["spec.ingress[0].from[0]", "spec.policyTypes[0]"]);

    let table = request(&t, "GET", path, &[TABLE], "").await;
    let names: Vec<&str> = table.body["columnDefinitions"]
        .as_array()
        .map(|c| c.iter().filter_map(|c| c["name"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(names, ["Name", "Pod-Selector", "Age"]);
    assert_eq!(table.body["rows"][0]["cells"][1], "app=x");
}
