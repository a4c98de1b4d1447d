//! The `fieldValidation` query parameter of writes: `Strict` refuses a body with fields the kind
//! does not have (400, naming the first), `Warn` answers with a `Warning: 299` header per field,
//! `Ignore` (and no parameter) drops them silently. Custom resources are checked against their
//! CRD schema; built-in kinds at the top level and in `metadata`, the structure known here.

use serde_json::Value;

use super::discovery::ResourceInfo;
use super::status::ApiError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FieldValidation {
    Ignore,
    Warn,
    Strict,
}

impl FieldValidation {
    pub fn parse(value: Option<&str>) -> Result<FieldValidation, ApiError> {
        match value {
            None | Some("") | Some("Ignore") => Ok(FieldValidation::Ignore),
            Some("Warn") => Ok(FieldValidation::Warn),
            Some("Strict") => Ok(FieldValidation::Strict),
            Some(other) => Err(ApiError::bad_request(format!(
                "fieldValidation must be one of \"Ignore\", \"Warn\", or \"Strict\", not \"{other}\""
            ))),
        }
    }

    /// The warnings to send for `body` (a whole object, or a merge / strategic merge / apply
    /// patch, which mirror it), or the Strict refusal.
    pub fn check(self, info: &ResourceInfo, body: &Value) -> Result<Vec<String>, ApiError> {
        if self == FieldValidation::Ignore {
            return Ok(Vec::new());
        }
        let unknown = unknown_fields(info, body);
        match (self, unknown.is_empty()) {
            (FieldValidation::Strict, false) => {
                let listed: Vec<String> = unknown.iter().map(|f| format!("unknown field \"{f}\"")).collect();
                Err(ApiError::bad_request(format!(
                    "strict decoding error: {}",
                    listed.join(", ")
                )))
            }
            _ => Ok(unknown
                .iter()
                .map(|f| warning(&format!("unknown field \"{f}\"")))
                .collect()),
        }
    }
}

impl FieldValidation {
    /// [`check`](Self::check) on a request body: JSON, or YAML for an apply. A body that does not
    /// parse is left to the verb to refuse.
    pub fn check_body(self, info: &ResourceInfo, yaml: bool, body: &[u8]) -> Result<Vec<String>, ApiError> {
        if self == FieldValidation::Ignore {
            return Ok(Vec::new());
        }
        let text = String::from_utf8_lossy(body);
        let parsed: Value = if yaml {
            serde_json::from_str(&text)
                .or_else(|_| serde_saphyr::from_str(&text))
                .unwrap_or(Value::Null)
        } else {
            serde_json::from_str(&text).unwrap_or(Value::Null)
        };
        self.check(info, &parsed)
    }
}

/// A `Warning` header value: `299 - "<text>"` with the text quoted as Go's `%q` does.
fn warning(text: &str) -> String {
    format!("299 - {}", Value::String(text.to_string()))
}

const OBJECT_META_FIELDS: &[&str] = &[
    "name",
    "generateName",
    "namespace",
    "selfLink",
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "labels",
    "annotations",
    "ownerReferences",
    "finalizers",
    "managedFields",
    "clusterName",
];

/// Top-level fields of the built-in kinds served here (`None`: not known, not checked).
fn builtin_fields(group: &str, kind: &str) -> Option<&'static [&'static str]> {
    Some(match (group, kind) {
        ("", "ConfigMap") => &["data", "binaryData", "immutable"],
        ("", "Secret") => &["data", "stringData", "type", "immutable"],
        ("", "ServiceAccount") => &["secrets", "imagePullSecrets", "automountServiceAccountToken"],
        ("", "Event") => &[
            "involvedObject",
            "reason",
            "message",
            "source",
            "firstTimestamp",
            "lastTimestamp",
            "count",
            "type",
            "eventTime",
            "series",
            "action",
            "related",
            "reportingComponent",
            "reportingInstance",
        ],
        ("events.k8s.io", "Event") => &[
            "eventTime",
            "series",
            "reportingController",
            "reportingInstance",
            "action",
            "reason",
            "regarding",
            "related",
            "note",
            "type",
            "deprecatedSource",
            "deprecatedFirstTimestamp",
            "deprecatedLastTimestamp",
            "deprecatedCount",
        ],
        ("rbac.authorization.k8s.io", "Role") => &["rules"],
        ("rbac.authorization.k8s.io", "ClusterRole") => &["rules", "aggregationRule"],
        ("rbac.authorization.k8s.io", "RoleBinding" | "ClusterRoleBinding") => &["subjects", "roleRef"],
        ("", "LimitRange") => &["spec"],
        ("", "Namespace" | "Service" | "Pod" | "ResourceQuota")
        | ("networking.k8s.io", "NetworkPolicy")
        | ("apps", "Deployment" | "ReplicaSet")
        | ("batch", "Job")
        | ("coordination.k8s.io", "Lease")
        | ("apiextensions.k8s.io", "CustomResourceDefinition") => &["spec", "status"],
        _ => return None,
    })
}

/// Paths (`spec.x`, `metadata.bogus`) of the fields in `body` that `info`'s kind does not have.
pub fn unknown_fields(info: &ResourceInfo, body: &Value) -> Vec<String> {
    let Some(map) = body.as_object() else {
        return Vec::new();
    };
    let mut unknown = Vec::new();
    if let Some(meta) = map.get("metadata").and_then(Value::as_object) {
        for key in meta.keys().filter(|k| !OBJECT_META_FIELDS.contains(&k.as_str())) {
            unknown.push(format!("metadata.{key}"));
        }
    }
    let envelope = |k: &str| matches!(k, "apiVersion" | "kind" | "metadata") || k.starts_with('$');
    match &info.schema {
        Some(schema) => {
            for (key, value) in map.iter().filter(|(k, _)| !envelope(k)) {
                match schema["properties"].get(key) {
                    Some(child) => walk(child, value, key, &mut unknown),
                    None if preserves(schema) => {}
                    None => unknown.push(key.clone()),
                }
            }
        }
        None => {
            if let Some(known) = builtin_fields(&info.group, &info.kind) {
                for key in map.keys().filter(|k| !envelope(k) && !known.contains(&k.as_str())) {
                    unknown.push(key.clone());
                }
            }
        }
    }
    unknown
}

fn preserves(schema: &Value) -> bool {
    schema["x-kubernetes-preserve-unknown-fields"].as_bool() == Some(true)
}

fn walk(schema: &Value, value: &Value, path: &str, unknown: &mut Vec<String>) {
    if preserves(schema) && schema.get("properties").is_none() {
        return;
    }
    match value {
        Value::Object(map) => {
            let additional = schema.get("additionalProperties").filter(|a| a.is_object());
            let open = preserves(schema) || schema["additionalProperties"].as_bool() == Some(true);
            let embedded = schema["x-kubernetes-embedded-resource"].as_bool() == Some(true);
            for (key, child) in map {
                // Strategic merge directives are not fields.
                if key.starts_with('$') {
                    continue;
                }
                let child_path = format!("{path}.{key}");
                match schema["properties"].get(key).or(additional) {
                    Some(child_schema) => walk(child_schema, child, &child_path, unknown),
                    None if open || (embedded && matches!(key.as_str(), "apiVersion" | "kind" | "metadata")) => {}
                    None => unknown.push(child_path),
                }
            }
        }
        Value::Array(items) => {
            if let Some(item_schema) = schema.get("items") {
                for (i, item) in items.iter().enumerate() {
                    walk(item_schema, item, &format!("{path}[{i}]"), unknown);
                }
            }
        }
        _ => {}
    }
}

/// Drops the unknown top-level fields of a built-in kind, as decoding into its Go type does.
/// Custom resources are pruned by their schema during admission.
pub fn prune_builtin(info: &ResourceInfo, body: &mut Value) {
    if info.schema.is_some() {
        return;
    }
    let Some(known) = builtin_fields(&info.group, &info.kind) else {
        return;
    };
    if let Some(map) = body.as_object_mut() {
        map.retain(|k, _| matches!(k.as_str(), "apiVersion" | "kind" | "metadata") || known.contains(&k.as_str()));
    }
    if let Some(meta) = body["metadata"].as_object_mut() {
        meta.retain(|k, _| OBJECT_META_FIELDS.contains(&k.as_str()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::sync::Arc;

    fn info(schema: Option<Value>) -> ResourceInfo {
        ResourceInfo {
            group: if schema.is_some() {
                "test.dev".into()
            } else {
                String::new()
            },
            version: "v1".into(),
            plural: "configmaps".into(),
            singular: "configmap".into(),
            kind: "ConfigMap".into(),
            namespaced: true,
            short_names: vec![],
            categories: vec![],
            status_subresource: false,
            scale: None,
            log_subresource: false,
            tracks_generation: false,
            schema: schema.map(Arc::new),
        }
    }

    #[test]
    fn unknown_custom_resource_fields_are_named_by_path() {
        let schema = json!({"type": "object", "properties": {"spec": {"type": "object", "properties": {
            "items": {"type": "array", "items": {"type": "object", "properties": {"name": {"type": "string"}}}},
            "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}
        }}}});
        let body = json!({"apiVersion": "test.dev/v1", "kind": "X", "metadata": {"name": "a"},
            "spec": {"x": 1, "items": [{"name": "a", "bogus": 2}], "free": {"anything": 3}}, "top": 4});
        let mut unknown = unknown_fields(&info(Some(schema)), &body);
        unknown.sort();
        assert_eq!(unknown, ["spec.items[0].bogus", "spec.x", "top"]);
    }

    #[test]
    fn strict_names_the_field_and_warn_quotes_it() {
        let body = json!({"metadata": {"name": "a"}, "data": {}, "spec": {"x": 1}});
        let err = FieldValidation::Strict.check(&info(None), &body).unwrap_err();
        assert_eq!(err.message, "strict decoding error: unknown field \"spec\"");
        let warnings = FieldValidation::Warn.check(&info(None), &body).unwrap();
        assert_eq!(warnings, ["299 - \"unknown field \\\"spec\\\"\""]);
    }
}
