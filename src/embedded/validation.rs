//! Object metadata validation with Kubernetes' per-kind limits, and the defaults built-in kinds get
//! on the real server that clients here rely on.

use std::sync::LazyLock;

use regex::Regex;
use serde_json::{Value, json};

use super::discovery::ResourceInfo;
use super::status::Cause;

const DNS1123_SUBDOMAIN_MSG: &str = "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')";
const DNS1123_LABEL_MSG: &str = "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')";
const QUALIFIED_NAME_MSG: &str = "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')";
const LABEL_VALUE_MSG: &str = "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')";
const TOTAL_ANNOTATION_BYTES: usize = 256 * 1024;

fn regex(pattern: &str) -> Regex {
    Regex::new(pattern).unwrap_or_else(|e| panic!("static regex {pattern}: {e}"))
}

static DNS1123_SUBDOMAIN: LazyLock<Regex> =
    LazyLock::new(|| regex(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"));
static DNS1123_LABEL: LazyLock<Regex> = LazyLock::new(|| regex(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"));
static QUALIFIED_NAME: LazyLock<Regex> = LazyLock::new(|| regex(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$"));

pub fn is_dns1123_subdomain(s: &str) -> bool {
    s.len() <= 253 && DNS1123_SUBDOMAIN.is_match(s)
}

pub fn is_dns1123_label(s: &str) -> bool {
    s.len() <= 63 && DNS1123_LABEL.is_match(s)
}

/// Name rules per kind: which check, and the maximum length.
enum NameRule {
    Subdomain,
    Label,
    PathSegment,
}

fn name_rule(info: &ResourceInfo) -> NameRule {
    match (info.group.as_str(), info.plural.as_str()) {
        ("", "namespaces") | ("", "services") => NameRule::Label,
        ("rbac.authorization.k8s.io", _) => NameRule::PathSegment,
        _ => NameRule::Subdomain,
    }
}

fn validate_name(info: &ResourceInfo, name: &str) -> Vec<Cause> {
    let field = "metadata.name";
    let value = json!(name);
    match name_rule(info) {
        NameRule::Subdomain => {
            let mut causes = Vec::new();
            if name.len() > 253 {
                causes.push(Cause::invalid(field, &value, "must be no more than 253 characters"));
            }
            if !DNS1123_SUBDOMAIN.is_match(name) {
                causes.push(Cause::invalid(field, &value, DNS1123_SUBDOMAIN_MSG));
            }
            causes
        }
        NameRule::Label => {
            let mut causes = Vec::new();
            if name.len() > 63 {
                causes.push(Cause::invalid(field, &value, "must be no more than 63 characters"));
            }
            if !DNS1123_LABEL.is_match(name) {
                causes.push(Cause::invalid(field, &value, DNS1123_LABEL_MSG));
            }
            causes
        }
        NameRule::PathSegment => {
            if name == "." || name == ".." {
                return vec![Cause::invalid(field, &value, &format!("may not be '{name}'"))];
            }
            ["/", "%"]
                .iter()
                .filter(|bad| name.contains(**bad))
                .map(|bad| Cause::invalid(field, &value, &format!("may not contain '{bad}'")))
                .collect()
        }
    }
}

/// A label or annotation key: optional DNS-subdomain prefix and `/`, then a qualified name.
fn validate_key(field: &str, key: &str) -> Vec<Cause> {
    let value = json!(key);
    let (prefix, name) = match key.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    let mut causes = Vec::new();
    if let Some(prefix) = prefix
        && !is_dns1123_subdomain(prefix)
    {
        causes.push(Cause::invalid(
            field,
            &value,
            &format!("prefix part {DNS1123_SUBDOMAIN_MSG}"),
        ));
    }
    if name.is_empty() || name.len() > 63 || !QUALIFIED_NAME.is_match(name) {
        let detail = if name.len() > 63 {
            "name part must be no more than 63 characters".to_string()
        } else {
            QUALIFIED_NAME_MSG.to_string()
        };
        causes.push(Cause::invalid(field, &value, &detail));
    }
    causes
}

pub fn validate_labels(field: &str, labels: &Value) -> Vec<Cause> {
    let Some(labels) = labels.as_object() else {
        return Vec::new();
    };
    let mut causes = Vec::new();
    for (key, value) in labels {
        causes.extend(validate_key(field, key));
        let text = value.as_str().unwrap_or_default();
        if text.len() > 63 {
            causes.push(Cause::invalid(field, value, "must be no more than 63 characters"));
        }
        if !text.is_empty() && !QUALIFIED_NAME.is_match(text) {
            causes.push(Cause::invalid(field, value, LABEL_VALUE_MSG));
        }
    }
    causes
}

fn validate_annotations(annotations: &Value) -> Vec<Cause> {
    let Some(annotations) = annotations.as_object() else {
        return Vec::new();
    };
    let mut causes = Vec::new();
    let mut total = 0;
    for (key, value) in annotations {
        causes.extend(validate_key("metadata.annotations", key));
        total += key.len() + value.as_str().map_or(0, str::len);
    }
    if total > TOTAL_ANNOTATION_BYTES {
        causes.push(Cause::too_long("metadata.annotations", TOTAL_ANNOTATION_BYTES));
    }
    causes
}

/// Metadata checks shared by every kind (the verbs add the per-kind rules of [`super::kinds`]).
pub fn validate_object(info: &ResourceInfo, object: &Value) -> Vec<Cause> {
    let metadata = &object["metadata"];
    let mut causes = Vec::new();
    match metadata["name"].as_str() {
        Some(name) if !name.is_empty() => causes.extend(validate_name(info, name)),
        _ => causes.push(Cause::required("metadata.name", "name or generateName is required")),
    }
    causes.extend(validate_labels("metadata.labels", &metadata["labels"]));
    causes.extend(validate_annotations(&metadata["annotations"]));
    causes
}

/// Rules that compare an update with the stored object.
pub fn validate_update(info: &ResourceInfo, old: &Value, new: &Value) -> Vec<Cause> {
    let mut causes = validate_finalizers_on_deleting(old, new);
    let immutable: &[&str] = match (info.group.as_str(), info.plural.as_str()) {
        ("batch", "jobs") => &["spec.selector", "spec.template", "spec.completions"],
        ("apps", "deployments") | ("apps", "replicasets") => &["spec.selector"],
        ("rbac.authorization.k8s.io", "rolebindings" | "clusterrolebindings") => &["roleRef"],
        ("", "secrets") => &["type"],
        _ => &[],
    };
    for path in immutable {
        let before = path.split('.').fold(old, |v, k| &v[k]);
        let after = path.split('.').fold(new, |v, k| &v[k]);
        if before != after {
            let detail = if *path == "roleRef" {
                "cannot change roleRef"
            } else {
                "field is immutable"
            };
            causes.push(Cause::invalid(path, after, detail));
        }
    }
    if matches!(
        (info.group.as_str(), info.plural.as_str()),
        ("", "secrets" | "configmaps")
    ) {
        causes.extend(validate_immutable_data(old, new));
    }
    causes
}

/// ConfigMaps and Secrets marked `immutable: true` keep their data and the flag.
fn validate_immutable_data(old: &Value, new: &Value) -> Vec<Cause> {
    if old["immutable"].as_bool() != Some(true) {
        return Vec::new();
    }
    let mut causes = Vec::new();
    for field in ["data", "binaryData"] {
        if old[field] != new[field] {
            let message = "Forbidden: field is immutable when `immutable` is set".to_string();
            causes.push(Cause::other("FieldValueForbidden", field, message));
        }
    }
    if new["immutable"].as_bool() != Some(true) {
        let message = "Forbidden: field is immutable when `immutable` is set".to_string();
        causes.push(Cause::other("FieldValueForbidden", "immutable", message));
    }
    causes
}

/// The deleting-object rule: finalizers may only be removed once deletion started.
fn validate_finalizers_on_deleting(old: &Value, new: &Value) -> Vec<Cause> {
    if old["metadata"]["deletionTimestamp"].is_null() {
        return Vec::new();
    }
    let old_set = finalizers(old);
    let added: Vec<String> = finalizers(new).into_iter().filter(|f| !old_set.contains(f)).collect();
    if added.is_empty() {
        return Vec::new();
    }
    vec![Cause::other(
        "FieldValueForbidden",
        "metadata.finalizers",
        format!(
            "Forbidden: no new finalizers can be added if the object is being deleted, found new finalizers {added:?}"
        ),
    )]
}

pub fn finalizers(object: &Value) -> Vec<String> {
    object["metadata"]["finalizers"]
        .as_array()
        .map(|a| a.iter().filter_map(|f| f.as_str().map(String::from)).collect())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::embedded::discovery::Resources;
    use crate::embedded::store::Store;

    fn info(group: &str, plural: &str) -> ResourceInfo {
        Resources::current(&Store::new()).find(group, "v1", plural).unwrap()
    }

    #[test]
    fn configmap_names_are_dns_subdomains_up_to_253() {
        let cm = info("", "configmaps");
        assert!(validate_object(&cm, &json!({"metadata": {"name": "a".repeat(253)}})).is_empty());
        assert!(!validate_object(&cm, &json!({"metadata": {"name": "a".repeat(254)}})).is_empty());
        assert!(!validate_object(&cm, &json!({"metadata": {"name": "Bad_Name"}})).is_empty());
    }

    #[test]
    fn rbac_names_may_contain_colons() {
        let role = info("rbac.authorization.k8s.io", "clusterroles");
        assert!(validate_object(&role, &json!({"metadata": {"name": "stackd:ns:x:system"}})).is_empty());
        assert!(!validate_object(&role, &json!({"metadata": {"name": "a/b"}})).is_empty());
    }

    #[test]
    fn label_values_are_limited_to_63_characters() {
        assert!(validate_labels("l", &json!({"k": "v".repeat(63)})).is_empty());
        assert_eq!(
            validate_labels("l", &json!({"k": "v".repeat(64)}))[0].reason,
            "FieldValueInvalid"
        );
        assert!(validate_labels("l", &json!({"example.com/k": ""})).is_empty());
        assert!(!validate_labels("l", &json!({"Bad_Prefix/k": "v"})).is_empty());
    }

    #[test]
    fn finalizers_cannot_be_added_to_a_deleting_object() {
        let old = json!({"metadata": {"deletionTimestamp": "t", "finalizers": ["a"]}});
        let new = json!({"metadata": {"deletionTimestamp": "t", "finalizers": ["a", "b"]}});
        assert_eq!(validate_finalizers_on_deleting(&old, &new).len(), 1);
    }

    #[test]
    fn annotations_are_limited_to_256_kib_in_total() {
        let cm = info("", "configmaps");
        let half = "x".repeat(130 * 1024);
        let big = json!({"metadata": {"name": "c", "annotations": {"a": half, "b": half}}});
        let causes = validate_object(&cm, &big);
        assert_eq!(
            (causes[0].field.as_str(), causes[0].reason),
            ("metadata.annotations", "FieldValueTooLong")
        );
    }

    #[test]
    fn role_binding_role_ref_cannot_change() {
        let binding = info("rbac.authorization.k8s.io", "rolebindings");
        let old = json!({"roleRef": {"kind": "ClusterRole", "name": "a"}});
        let new = json!({"roleRef": {"kind": "ClusterRole", "name": "b"}});
        assert_eq!(validate_update(&binding, &old, &new)[0].field, "roleRef");
    }

    #[test]
    fn immutable_configmap_data_cannot_change() {
        let cm = info("", "configmaps");
        let old = json!({"immutable": true, "data": {"k": "v"}});
        assert!(validate_update(&cm, &old, &old).is_empty());
        assert_eq!(
            validate_update(&cm, &old, &json!({"immutable": true, "data": {}})).len(),
            1
        );
    }
}
