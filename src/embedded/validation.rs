//! Object validation with Kubernetes' per-kind limits: metadata (by the
//! [`name_rules`](super::name_rules)), each kind's own rules, and what an update may not change.

use serde_json::Value;

use super::discovery::ResourceInfo;
use super::kinds;
use super::name_rules::{validate_annotations, validate_labels, validate_name};
use super::status::Cause;

/// Metadata checks shared by every kind, plus per-kind rules.
pub fn validate_object(info: &ResourceInfo, object: &Value) -> Vec<Cause> {
    let metadata = &object["metadata"];
    let mut causes = Vec::new();
    match metadata["name"].as_str() {
        Some(name) if !name.is_empty() => causes.extend(validate_name(info, name)),
        _ => causes.push(Cause::required("metadata.name", "name or generateName is required")),
    }
    causes.extend(validate_labels("metadata.labels", &metadata["labels"]));
    causes.extend(validate_annotations(&metadata["annotations"]));
    causes.extend(kinds::validate_spec(info, object));
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
    use serde_json::json;

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
