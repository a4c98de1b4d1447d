//! Spec validation of the built-in kinds, limited to the rules a controller writing them can get
//! wrong (pod templates, selectors, config keys, RBAC references), with kube-apiserver's field paths.

use std::sync::LazyLock;

use regex::Regex;
use serde_json::{Value, json};

use super::discovery::ResourceInfo;
use super::name_rules::{is_dns1123_label, validate_labels};
use super::status::{ApiError, Cause, go_value};

pub mod network_policy;

static CONFIG_KEY: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^[-._a-zA-Z0-9]+$").unwrap_or_else(|e| panic!("{e}")));
const CONFIG_KEY_MSG: &str = "a valid config key must consist of alphanumeric characters, '-', '_' or '.' (e.g. 'key.name',  or 'KEY_NAME',  or 'key-name', regex used for validation is '[-._a-zA-Z0-9]+')";
/// ConfigMaps and Secrets are limited to 1 MiB of data.
const MAX_CONFIG_BYTES: usize = 1024 * 1024;
const RBAC_GROUP: &str = "rbac.authorization.k8s.io";

pub fn validate_spec(info: &ResourceInfo, object: &Value) -> Vec<Cause> {
    match (info.group.as_str(), info.plural.as_str()) {
        ("", "pods") => validate_pod_spec("spec", &object["spec"]),
        ("", "configmaps") => validate_config_data(object, &["data", "binaryData"], &["binaryData"]),
        ("", "secrets") => validate_config_data(object, &["data"], &["data"]),
        ("batch", "jobs") => validate_job(object),
        ("apps", "deployments" | "replicasets") => validate_replicated(object),
        (RBAC_GROUP, "roles" | "clusterroles") => validate_rules(object),
        (RBAC_GROUP, "rolebindings") => validate_binding(object, &["Role", "ClusterRole"], true),
        (RBAC_GROUP, "clusterrolebindings") => validate_binding(object, &["ClusterRole"], false),
        ("networking.k8s.io", "networkpolicies") => network_policy::validate(object),
        ("events.k8s.io", "events") => validate_event_note(object),
        _ => Vec::new(),
    }
}

/// Fields the real server decodes as bytes: invalid base64 there is a 400 before any validation.
pub fn check_decodable(info: &ResourceInfo, object: &Value) -> Result<(), ApiError> {
    use base64::Engine;
    let fields: &[&str] = match (info.group.as_str(), info.plural.as_str()) {
        ("", "secrets") => &["data"],
        ("", "configmaps") => &["binaryData"],
        _ => return Ok(()),
    };
    for field in fields {
        for (key, value) in object[*field].as_object().into_iter().flatten() {
            let text = value.as_str().unwrap_or_default();
            if base64::engine::general_purpose::STANDARD.decode(text).is_err() {
                return Err(ApiError::bad_request(format!(
                    "{} in version \"{}\" cannot be handled as a {}: illegal base64 data in {field}[{key}]",
                    info.kind, info.version, info.kind
                )));
            }
        }
    }
    Ok(())
}

fn items(value: &Value) -> &[Value] {
    value.as_array().map(Vec::as_slice).unwrap_or_default()
}

fn not_supported(field: &str, value: &Value, supported: &[&str]) -> Cause {
    let listed: Vec<String> = supported.iter().map(|s| format!("{s:?}")).collect();
    let message = format!(
        "Unsupported value: {}: supported values: {}",
        go_value(value),
        listed.join(", ")
    );
    Cause::other("FieldValueNotSupported", field, message)
}

fn validate_containers(field: &str, containers: &Value, names: &mut Vec<String>) -> Vec<Cause> {
    let mut causes = Vec::new();
    for (i, container) in items(containers).iter().enumerate() {
        let at = format!("{field}[{i}]");
        match container["name"].as_str().filter(|n| !n.is_empty()) {
            None => causes.push(Cause::required(&format!("{at}.name"), "")),
            Some(name) if !is_dns1123_label(name) => {
                causes.push(Cause::invalid(&format!("{at}.name"), &container["name"], "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character"));
            }
            Some(name) if names.iter().any(|n| n == name) => {
                let message = format!("Duplicate value: {name:?}");
                causes.push(Cause::other("FieldValueDuplicate", &format!("{at}.name"), message));
            }
            Some(name) => names.push(name.to_string()),
        }
        if container["image"].as_str().is_none_or(|i| i.trim().is_empty()) {
            causes.push(Cause::required(&format!("{at}.image"), ""));
        }
    }
    causes
}

pub fn validate_pod_spec(field: &str, spec: &Value) -> Vec<Cause> {
    let mut causes = Vec::new();
    if items(&spec["containers"]).is_empty() {
        causes.push(Cause::required(&format!("{field}.containers"), ""));
    }
    let mut names = Vec::new();
    causes.extend(validate_containers(
        &format!("{field}.initContainers"),
        &spec["initContainers"],
        &mut names,
    ));
    causes.extend(validate_containers(
        &format!("{field}.containers"),
        &spec["containers"],
        &mut names,
    ));
    let policy = &spec["restartPolicy"];
    if !policy.is_null() && !matches!(policy.as_str(), Some("Always" | "OnFailure" | "Never")) {
        causes.push(not_supported(
            &format!("{field}.restartPolicy"),
            policy,
            &["Always", "OnFailure", "Never"],
        ));
    }
    causes
}

fn validate_template(object: &Value) -> Vec<Cause> {
    let template = &object["spec"]["template"];
    let mut causes = validate_labels("spec.template.labels", &template["metadata"]["labels"]);
    causes.extend(validate_pod_spec("spec.template.spec", &template["spec"]));
    causes
}

/// Jobs need `restartPolicy` Never or OnFailure (a pod template defaults to Always).
fn validate_job(job: &Value) -> Vec<Cause> {
    let mut causes = validate_template(job);
    let policy = &job["spec"]["template"]["spec"]["restartPolicy"];
    if !matches!(policy.as_str(), Some("OnFailure" | "Never")) {
        let shown = if policy.is_null() {
            json!("Always")
        } else {
            policy.clone()
        };
        causes.push(not_supported(
            "spec.template.spec.restartPolicy",
            &shown,
            &["OnFailure", "Never"],
        ));
    }
    causes
}

/// Deployments and ReplicaSets: pods that restart `Always`, and a selector that selects their own
/// pod template.
fn validate_replicated(object: &Value) -> Vec<Cause> {
    let mut causes = validate_template(object);
    let policy = &object["spec"]["template"]["spec"]["restartPolicy"];
    if !policy.is_null() && policy.as_str() != Some("Always") {
        causes.push(not_supported("spec.template.spec.restartPolicy", policy, &["Always"]));
    }
    let selector = &object["spec"]["selector"];
    let match_labels = selector["matchLabels"].as_object();
    let has_expressions = !items(&selector["matchExpressions"]).is_empty();
    if match_labels.is_none_or(|m| m.is_empty()) && !has_expressions {
        causes.push(Cause::required("spec.selector", ""));
        return causes;
    }
    let labels = &object["spec"]["template"]["metadata"]["labels"];
    let selected = match_labels.is_none_or(|m| m.iter().all(|(k, v)| labels.get(k) == Some(v)));
    if !selected {
        causes.push(Cause::invalid(
            "spec.template.metadata.labels",
            labels,
            "`selector` does not match template `labels`",
        ));
    }
    causes
}

/// Keys and total size of the data `fields` of a ConfigMap or Secret; those in `base64` are counted
/// as the bytes they decode to, as kube-apiserver counts them (it holds them decoded).
fn validate_config_data(object: &Value, fields: &[&str], base64: &[&str]) -> Vec<Cause> {
    let mut causes = Vec::new();
    let mut total = 0;
    for field in fields {
        for (key, value) in object[*field].as_object().into_iter().flatten() {
            if !CONFIG_KEY.is_match(key) || key == "." || key == ".." {
                causes.push(Cause::invalid(&format!("{field}[{key}]"), &json!(key), CONFIG_KEY_MSG));
            }
            let text = value.as_str().unwrap_or_default();
            total += if base64.contains(field) {
                base64_decoded_len(text)
            } else {
                text.len()
            };
        }
    }
    if total > MAX_CONFIG_BYTES {
        causes.push(Cause::too_long(fields[0], MAX_CONFIG_BYTES));
    }
    causes
}

/// The bytes base64 `text` decodes to (its padding not counted).
fn base64_decoded_len(text: &str) -> usize {
    let padding = text.bytes().rev().take_while(|b| *b == b'=').count().min(2);
    (text.len() / 4 * 3 + (text.len() % 4) * 3 / 4).saturating_sub(padding)
}

/// events.k8s.io/v1 refuses a `note` over 1 KiB, on create and update alike (core/v1 Events keep
/// their legacy, unlimited `message`).
fn validate_event_note(event: &Value) -> Vec<Cause> {
    const MAX_NOTE_BYTES: usize = 1024;
    match event["note"].as_str() {
        Some(note) if note.len() > MAX_NOTE_BYTES => vec![Cause::too_long("note", MAX_NOTE_BYTES)],
        _ => Vec::new(),
    }
}

fn validate_rules(role: &Value) -> Vec<Cause> {
    items(&role["rules"])
        .iter()
        .enumerate()
        .filter(|(_, rule)| items(&rule["verbs"]).is_empty())
        .map(|(i, _)| Cause::required(&format!("rules[{i}].verbs"), "verbs must contain at least one value"))
        .collect()
}

fn validate_binding(binding: &Value, kinds: &[&str], namespaced: bool) -> Vec<Cause> {
    let role_ref = &binding["roleRef"];
    let mut causes = Vec::new();
    if role_ref["apiGroup"].as_str() != Some(RBAC_GROUP) {
        causes.push(not_supported("roleRef.apiGroup", &role_ref["apiGroup"], &[RBAC_GROUP]));
    }
    if !role_ref["kind"].as_str().is_some_and(|k| kinds.contains(&k)) {
        causes.push(not_supported("roleRef.kind", &role_ref["kind"], kinds));
    }
    if role_ref["name"].as_str().is_none_or(str::is_empty) {
        causes.push(Cause::required("roleRef.name", ""));
    }
    for (i, subject) in items(&binding["subjects"]).iter().enumerate() {
        let kind = subject["kind"].as_str().unwrap_or("");
        if !["ServiceAccount", "User", "Group"].contains(&kind) {
            causes.push(not_supported(
                &format!("subjects[{i}].kind"),
                &subject["kind"],
                &["ServiceAccount", "User", "Group"],
            ));
        }
        if subject["name"].as_str().is_none_or(str::is_empty) {
            causes.push(Cause::required(&format!("subjects[{i}].name"), ""));
        }
        let namespace_missing = subject["namespace"].as_str().is_none_or(str::is_empty);
        if kind == "ServiceAccount" && !namespaced && namespace_missing {
            causes.push(Cause::required(&format!("subjects[{i}].namespace"), ""));
        }
    }
    causes
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(policy: Value) -> Value {
        json!({"spec": {"template": {"spec": {"restartPolicy": policy, "containers": [{"name": "c", "image": "i"}]}}}})
    }

    #[test]
    fn jobs_need_restart_policy_never_or_on_failure() {
        assert!(validate_job(&job(json!("Never"))).is_empty());
        assert_eq!(
            validate_job(&job(Value::Null))[0].field,
            "spec.template.spec.restartPolicy"
        );
        assert_eq!(validate_job(&job(json!("Always")))[0].reason, "FieldValueNotSupported");
    }

    #[test]
    fn pod_specs_need_named_containers_with_images() {
        let causes = validate_pod_spec(
            "spec",
            &json!({"containers": [{"name": "a"}, {"name": "a", "image": "i"}]}),
        );
        let fields: Vec<&str> = causes.iter().map(|c| c.field.as_str()).collect();
        assert_eq!(fields, vec!["spec.containers[0].image", "spec.containers[1].name"]);
        assert_eq!(validate_pod_spec("spec", &json!({}))[0].field, "spec.containers");
    }

    #[test]
    fn deployment_selector_must_select_its_template() {
        let deploy = |labels: Value| {
            json!({"spec": {"selector": {"matchLabels": {"app": "a"}}, "template": {
                "metadata": {"labels": labels}, "spec": {"containers": [{"name": "c", "image": "i"}]}}}})
        };
        assert!(validate_replicated(&deploy(json!({"app": "a", "x": "y"}))).is_empty());
        assert_eq!(
            validate_replicated(&deploy(json!({"app": "b"})))[0].field,
            "spec.template.metadata.labels"
        );
    }

    #[test]
    fn config_keys_are_checked() {
        let causes = validate_config_data(&json!({"data": {"ok.key": "", "bad key": ""}}), &["data"], &["data"]);
        // A Secret of 1,000,000 bytes is 1,333,336 characters of base64, and within the limit.
        let encoded = "YWFh".repeat(333_333) + "YQ==";
        assert_eq!(base64_decoded_len(&encoded), 1_000_000);
        assert!(validate_config_data(&json!({"data": {"password": encoded}}), &["data"], &["data"]).is_empty());
        assert_eq!(causes.len(), 1);
        assert_eq!(causes[0].field, "data[bad key]");
    }

    #[test]
    fn cluster_role_bindings_reference_cluster_roles_and_namespaced_service_accounts() {
        let binding = json!({"roleRef": {"apiGroup": RBAC_GROUP, "kind": "Role", "name": "r"},
            "subjects": [{"kind": "ServiceAccount", "name": "sa"}]});
        let fields: Vec<String> = validate_binding(&binding, &["ClusterRole"], false)
            .into_iter()
            .map(|c| c.field)
            .collect();
        assert_eq!(fields, vec!["roleRef.kind", "subjects[0].namespace"]);
        assert!(validate_binding(&binding, &["Role", "ClusterRole"], true).is_empty());
    }

    #[test]
    fn secret_data_must_be_base64() {
        let secrets = crate::embedded::discovery::Resources::current(&crate::embedded::store::Store::new())
            .find("", "v1", "secrets")
            .unwrap();
        assert!(check_decodable(&secrets, &json!({"data": {"a": "YQ=="}})).is_ok());
        assert_eq!(
            check_decodable(&secrets, &json!({"data": {"a": "not base64!"}}))
                .unwrap_err()
                .code,
            400
        );
    }

    #[test]
    fn rules_need_verbs() {
        let role = json!({"rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": []}]});
        assert_eq!(validate_rules(&role)[0].field, "rules[0].verbs");
    }
}
