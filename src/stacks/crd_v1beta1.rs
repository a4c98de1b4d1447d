//! `apiextensions.k8s.io/v1beta1` CustomResourceDefinitions, as every Crossplane v0.x package ships
//! them, converted to `v1` with the mapping kube-apiserver itself applied while it served both
//! (v1beta1 was removed in Kubernetes 1.22):
//!
//! - the top-level `version`, `validation`, `subresources` and `additionalPrinterColumns` move into
//!   every entry of `versions` (one is made from `version` when there is no list);
//! - printer columns' `JSONPath` becomes `jsonPath`;
//! - an empty or missing `scope` is `Namespaced`;
//! - `preserveUnknownFields`, true when absent, becomes `x-kubernetes-preserve-unknown-fields: true`
//!   at the root of every version's schema (v1 allows only `false`), and a version without a schema
//!   gets one that keeps everything;
//! - a schema node with `properties` or `additionalProperties` but no `type` is an `object`, one
//!   with `items` an `array` (v1 schemas must be structural);
//! - a webhook conversion's `webhookClientConfig` and `conversionReviewVersions` move under
//!   `conversion.webhook`; the file's `status` is dropped.
//!
//! Pure: unpack calls it on each parsed document before the CRD is decoded.

use serde_json::{Map, Value, json};

pub const V1BETA1: &str = "apiextensions.k8s.io/v1beta1";
pub const V1: &str = "apiextensions.k8s.io/v1";
/// The deepest schema converted; real ones nest fewer than twenty levels, and the walk recurses.
const MAX_SCHEMA_DEPTH: usize = 64;

/// What cannot be converted, with the field to change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConversionError {
    #[error("spec.versions[{index}] has no name")]
    UnnamedVersion { index: usize },
    #[error("spec.version and spec.versions are both missing: name at least one version")]
    NoVersion,
    #[error("spec.version {version:?} is not the first of spec.versions, as v1beta1 requires")]
    VersionMismatch { version: String },
    #[error("{field} is set both at the top of spec and in spec.versions[{index}]: v1beta1 allows one or the other")]
    BothLevels { field: &'static str, index: usize },
    #[error("{path} nests deeper than {MAX_SCHEMA_DEPTH} levels")]
    TooDeep { path: String },
    #[error("spec is not a mapping")]
    NoSpec,
}

/// Converts a v1beta1 CRD document to v1 in place of `document`.
pub fn convert(mut document: Value) -> Result<Value, ConversionError> {
    let Some(spec) = document.get_mut("spec").and_then(Value::as_object_mut) else {
        return Err(ConversionError::NoSpec);
    };
    let top_version = spec.remove("version").and_then(|v| v.as_str().map(str::to_string));
    let top_schema = spec
        .remove("validation")
        .and_then(|mut validation| validation.get_mut("openAPIV3Schema").map(Value::take));
    let top_subresources = spec.remove("subresources").filter(|v| !v.is_null());
    let top_columns = spec.remove("additionalPrinterColumns").filter(|v| !v.is_null());
    // v1beta1 defaults preserveUnknownFields to true: unknown fields were kept unless it said false.
    let preserve_unknown = spec
        .remove("preserveUnknownFields")
        .is_none_or(|preserve| preserve != Value::Bool(false));
    if spec.get("scope").and_then(Value::as_str).is_none_or(str::is_empty) {
        spec.insert("scope".into(), json!("Namespaced"));
    }
    let mut versions = match spec.remove("versions") {
        Some(Value::Array(versions)) if !versions.is_empty() => versions,
        _ => match &top_version {
            Some(name) => vec![json!({"name": name, "served": true, "storage": true})],
            None => return Err(ConversionError::NoVersion),
        },
    };
    if let Some(version) = &top_version
        && versions[0]["name"].as_str() != Some(version)
    {
        return Err(ConversionError::VersionMismatch {
            version: version.clone(),
        });
    }
    for (index, version) in versions.iter_mut().enumerate() {
        let Some(entry) = version.as_object_mut() else {
            return Err(ConversionError::UnnamedVersion { index });
        };
        if entry.get("name").and_then(Value::as_str).is_none_or(str::is_empty) {
            return Err(ConversionError::UnnamedVersion { index });
        }
        move_into(
            entry,
            "schema",
            top_schema.as_ref().map(|s| json!({"openAPIV3Schema": s})),
            index,
        )?;
        move_into(entry, "subresources", top_subresources.clone(), index)?;
        move_into(entry, "additionalPrinterColumns", top_columns.clone(), index)?;
        if let Some(columns) = entry.get_mut("additionalPrinterColumns").and_then(Value::as_array_mut) {
            for column in columns.iter_mut().filter_map(Value::as_object_mut) {
                if let Some(path) = column.remove("JSONPath") {
                    column.insert("jsonPath".into(), path);
                }
            }
        }
        let schema = entry
            .entry("schema")
            .or_insert_with(|| json!({}))
            .as_object_mut()
            .map(|schema| schema.entry("openAPIV3Schema").or_insert_with(|| json!({})));
        if let Some(root) = schema {
            structural(root, "openAPIV3Schema", 0)?;
            let root_is_open = root.as_object().is_some_and(|r| r.len() <= 1);
            if let Some(root) = root.as_object_mut() {
                root.insert("type".into(), json!("object"));
                if preserve_unknown || root_is_open {
                    root.insert("x-kubernetes-preserve-unknown-fields".into(), json!(true));
                }
            }
        }
    }
    spec.insert("versions".into(), Value::Array(versions));
    convert_webhook(spec);
    if let Some(object) = document.as_object_mut() {
        object.insert("apiVersion".into(), json!(V1));
        object.remove("status");
    }
    Ok(document)
}

/// Puts the top-level `value` of `field` into a version entry, which must not have its own.
fn move_into(
    entry: &mut Map<String, Value>,
    field: &'static str,
    value: Option<Value>,
    index: usize,
) -> Result<(), ConversionError> {
    let Some(value) = value else { return Ok(()) };
    if entry.get(field).is_some_and(|own| !own.is_null()) {
        return Err(ConversionError::BothLevels { field, index });
    }
    entry.insert(field.into(), value);
    Ok(())
}

/// Gives every schema node the `type` its other keywords imply.
fn structural(node: &mut Value, path: &str, depth: usize) -> Result<(), ConversionError> {
    if depth > MAX_SCHEMA_DEPTH {
        return Err(ConversionError::TooDeep { path: path.into() });
    }
    let Some(schema) = node.as_object_mut() else {
        return Ok(());
    };
    if !schema.contains_key("type") && !schema.contains_key("x-kubernetes-int-or-string") {
        if schema.contains_key("properties") || schema.contains_key("additionalProperties") {
            schema.insert("type".into(), json!("object"));
        } else if schema.contains_key("items") {
            schema.insert("type".into(), json!("array"));
        }
    }
    if let Some(properties) = schema.get_mut("properties").and_then(Value::as_object_mut) {
        for (name, property) in properties.iter_mut() {
            structural(property, &format!("{path}.properties.{name}"), depth + 1)?;
        }
    }
    for key in ["items", "additionalProperties", "not"] {
        if let Some(child) = schema.get_mut(key) {
            structural(child, &format!("{path}.{key}"), depth + 1)?;
        }
    }
    for key in ["allOf", "anyOf", "oneOf"] {
        for (i, child) in schema
            .get_mut(key)
            .and_then(Value::as_array_mut)
            .into_iter()
            .flatten()
            .enumerate()
        {
            structural(child, &format!("{path}.{key}[{i}]"), depth + 1)?;
        }
    }
    Ok(())
}

/// v1beta1's `conversion.{webhookClientConfig, conversionReviewVersions}` are v1's
/// `conversion.webhook.{clientConfig, conversionReviewVersions}`.
fn convert_webhook(spec: &mut Map<String, Value>) {
    let Some(conversion) = spec.get_mut("conversion").and_then(Value::as_object_mut) else {
        return;
    };
    let client = conversion.remove("webhookClientConfig");
    let reviews = conversion.remove("conversionReviewVersions");
    if conversion.get("strategy").and_then(Value::as_str) == Some("Webhook") {
        conversion.insert(
            "webhook".into(),
            json!({
                "clientConfig": client.unwrap_or_else(|| json!({})),
                // v1beta1's default.
                "conversionReviewVersions": reviews.unwrap_or_else(|| json!(["v1beta1"])),
            }),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;

    /// The shape of Crossplane v0.x packages' CRDs (kubebuilder v2 output of 2019–2020).
    fn crossplane_style() -> Value {
        json!({
            "apiVersion": V1BETA1,
            "kind": "CustomResourceDefinition",
            "metadata": {"creationTimestamp": null, "name": "cloudsqlinstances.database.gcp.example.org"},
            "spec": {
                "additionalPrinterColumns": [
                    {"JSONPath": ".status.bindingPhase", "name": "STATUS", "type": "string"},
                    {"JSONPath": ".metadata.creationTimestamp", "name": "AGE", "type": "date"},
                ],
                "group": "database.gcp.example.org",
                "names": {"kind": "CloudSQLInstance", "listKind": "CloudSQLInstanceList",
                          "plural": "cloudsqlinstances", "singular": "cloudsqlinstance"},
                "scope": "",
                "subresources": {"status": {}},
                "validation": {"openAPIV3Schema": {
                    "description": "A CloudSQLInstance is a managed resource.",
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "spec": {"properties": {
                            "tier": {"type": "string"},
                            "labels": {"additionalProperties": {"type": "string"}},
                            "zones": {"items": {"type": "string"}},
                        }, "required": ["tier"]},
                    },
                }},
                "version": "v1beta1",
                "versions": [{"name": "v1beta1", "served": true, "storage": true}],
            },
            "status": {"acceptedNames": {"kind": "", "plural": ""}, "conditions": [], "storedVersions": []},
        })
    }

    #[test]
    fn a_crossplane_crd_becomes_the_v1_crd_the_api_server_served() {
        let converted = convert(crossplane_style()).expect("converts");
        assert_eq!(converted["apiVersion"], V1);
        assert!(converted.get("status").is_none());
        let spec = &converted["spec"];
        assert_eq!(spec["scope"], "Namespaced", "an empty scope is Namespaced");
        for gone in [
            "version",
            "validation",
            "subresources",
            "additionalPrinterColumns",
            "preserveUnknownFields",
        ] {
            assert!(spec.get(gone).is_none(), "{gone} is top-level in v1beta1 only");
        }
        let version = &spec["versions"][0];
        assert_eq!(version["subresources"], json!({"status": {}}));
        assert_eq!(
            version["additionalPrinterColumns"][0]["jsonPath"],
            ".status.bindingPhase"
        );
        assert!(version["additionalPrinterColumns"][0].get("JSONPath").is_none());
        let root = &version["schema"]["openAPIV3Schema"];
        assert_eq!(root["type"], "object");
        assert_eq!(
            root["x-kubernetes-preserve-unknown-fields"], true,
            "preserveUnknownFields was absent"
        );
        let spec_schema = &root["properties"]["spec"];
        assert_eq!(spec_schema["type"], "object", "properties imply an object");
        assert_eq!(spec_schema["properties"]["labels"]["type"], "object");
        assert_eq!(
            spec_schema["properties"]["zones"]["type"], "array",
            "items imply an array"
        );
        assert_eq!(spec_schema["required"], json!(["tier"]));
        let typed: CustomResourceDefinition = serde_json::from_value(converted).expect("a v1 CRD");
        assert_eq!(typed.spec.versions.len(), 1);
    }

    #[test]
    fn a_crd_with_only_a_top_level_version_gets_a_versions_list() {
        let mut document = crossplane_style();
        document["spec"].as_object_mut().unwrap().remove("versions");
        let converted = convert(document).expect("converts");
        let versions = converted["spec"]["versions"].as_array().expect("versions");
        assert_eq!(versions.len(), 1);
        assert_eq!(
            (&versions[0]["name"], &versions[0]["served"], &versions[0]["storage"]),
            (&json!("v1beta1"), &json!(true), &json!(true))
        );
        assert_eq!(versions[0]["subresources"], json!({"status": {}}));
    }

    #[test]
    fn top_level_fields_go_into_every_version_and_preserve_false_is_kept_strict() {
        let mut document = crossplane_style();
        document["spec"]["versions"] = json!([
            {"name": "v1beta1", "served": true, "storage": true},
            {"name": "v1alpha1", "served": true, "storage": false},
        ]);
        document["spec"]["preserveUnknownFields"] = json!(false);
        let converted = convert(document).expect("converts");
        for version in converted["spec"]["versions"].as_array().unwrap() {
            let root = &version["schema"]["openAPIV3Schema"];
            assert_eq!(root["properties"]["spec"]["properties"]["tier"]["type"], "string");
            assert!(root.get("x-kubernetes-preserve-unknown-fields").is_none(), "{root}");
            assert_eq!(version["subresources"], json!({"status": {}}));
        }
    }

    #[test]
    fn a_crd_without_a_schema_keeps_every_field() {
        let converted = convert(json!({"apiVersion": V1BETA1, "kind": "CustomResourceDefinition",
            "metadata": {"name": "things.example.org"},
            "spec": {"group": "example.org", "version": "v1alpha1", "preserveUnknownFields": false,
                "names": {"kind": "Thing", "plural": "things"}}}))
        .expect("converts");
        assert_eq!(
            converted["spec"]["versions"][0]["schema"]["openAPIV3Schema"],
            json!({"type": "object", "x-kubernetes-preserve-unknown-fields": true})
        );
    }

    #[test]
    fn what_cannot_be_converted_names_its_field() {
        let mut both = crossplane_style();
        both["spec"]["versions"][0]["subresources"] = json!({"status": {}});
        assert_eq!(
            convert(both),
            Err(ConversionError::BothLevels {
                field: "subresources",
                index: 0
            })
        );
        let mut mismatch = crossplane_style();
        mismatch["spec"]["version"] = json!("v2");
        assert!(matches!(
            convert(mismatch),
            Err(ConversionError::VersionMismatch { .. })
        ));
        let mut none = crossplane_style();
        let spec = none["spec"].as_object_mut().unwrap();
        spec.remove("version");
        spec.remove("versions");
        assert_eq!(convert(none), Err(ConversionError::NoVersion));
        let mut deep = json!({"type": "string"});
        for _ in 0..100 {
            deep = json!({"properties": {"a": deep}});
        }
        let mut too_deep = crossplane_style();
        too_deep["spec"]["validation"]["openAPIV3Schema"] = deep;
        assert!(matches!(convert(too_deep), Err(ConversionError::TooDeep { .. })));
    }

    #[test]
    fn a_webhook_conversion_moves_under_webhook() {
        let mut document = crossplane_style();
        document["spec"]["conversion"] = json!({"strategy": "Webhook",
            "webhookClientConfig": {"url": "https://example.org/convert"}});
        let converted = convert(document).expect("converts");
        assert_eq!(
            converted["spec"]["conversion"],
            json!({"strategy": "Webhook", "webhook": {"clientConfig": {"url": "https://example.org/convert"},
                "conversionReviewVersions": ["v1beta1"]}})
        );
    }
}
