//! `/openapi/v3`: the index of group-versions and one OpenAPI 3 document per group-version, built
//! from the resource table on each request, so a CRD change shows at once (and changes the hash
//! kubectl caches by). kubectl uses it for `explain`, and to learn that PATCH takes
//! `fieldValidation` (it then leaves validation to the server). Built-in kinds get permissive
//! schemas; CRD kinds their `openAPIV3Schema`, so `kubectl explain` shows their descriptions.

use serde_json::{Map, Value, json};
use sha2::{Digest, Sha512};

use super::discovery::{ResourceInfo, Resources};

const OBJECT_META: &str = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta";

/// The index: one entry per served group-version.
pub fn index(resources: &Resources) -> Value {
    let mut paths = Map::new();
    for (group, version) in group_versions(resources) {
        let path = gv_path(&group, &version);
        let hash = document(resources, &group, &version).map_or(String::new(), |d| hash(&d));
        paths.insert(
            path.clone(),
            json!({"serverRelativeURL": format!("/openapi/v3/{path}?hash={hash}")}),
        );
    }
    json!({ "paths": paths })
}

fn hash(document: &Value) -> String {
    hex::encode_upper(Sha512::digest(document.to_string().as_bytes()))
}

fn gv_path(group: &str, version: &str) -> String {
    if group.is_empty() {
        format!("api/{version}")
    } else {
        format!("apis/{group}/{version}")
    }
}

fn group_versions(resources: &Resources) -> Vec<(String, String)> {
    let mut seen: Vec<(String, String)> = Vec::new();
    for r in &resources.all {
        let gv = (r.group.clone(), r.version.clone());
        if !seen.contains(&gv) {
            seen.push(gv);
        }
    }
    seen
}

/// The document at `/openapi/v3/<path>`, where path is `api/v1` or `apis/<group>/<version>`.
pub fn document_at(resources: &Resources, path: &[&str]) -> Option<Value> {
    match path {
        ["api", version] => document(resources, "", version),
        ["apis", group, version] => document(resources, group, version),
        _ => None,
    }
}

fn document(resources: &Resources, group: &str, version: &str) -> Option<Value> {
    let served: Vec<&ResourceInfo> = resources
        .all
        .iter()
        .filter(|r| r.group == group && r.version == version)
        .collect();
    if served.is_empty() {
        return None;
    }
    let mut schemas = Map::new();
    schemas.insert(OBJECT_META.to_string(), object_meta());
    let mut paths = Map::new();
    for info in served {
        let name = schema_name(info);
        schemas.insert(name.clone(), kind_schema(info));
        for (path, item) in resource_paths(info, &name) {
            paths.insert(path, item);
        }
    }
    Some(json!({
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes", "version": "v1.24.0"},
        "paths": paths,
        "components": {"schemas": schemas},
    }))
}

/// kube's schema names: `io.k8s.api.core.v1.Pod`, and the reversed group for custom resources.
fn schema_name(info: &ResourceInfo) -> String {
    if info.schema.is_some() {
        let reversed: Vec<&str> = info.group.split('.').rev().collect();
        return format!("{}.{}.{}", reversed.join("."), info.version, info.kind);
    }
    let package = match info.group.as_str() {
        "" => "core".to_string(),
        "apiextensions.k8s.io" => {
            return format!(
                "io.k8s.apiextensions-apiserver.pkg.apis.apiextensions.{}.{}",
                info.version, info.kind
            );
        }
        group => group.split('.').next().unwrap_or(group).to_string(),
    };
    format!("io.k8s.api.{package}.{}.{}", info.version, info.kind)
}

fn gvk(info: &ResourceInfo) -> Value {
    json!([{"group": info.group, "version": info.version, "kind": info.kind}])
}

fn object_meta() -> Value {
    json!({
        "type": "object",
        "description": "ObjectMeta is metadata that all persisted resources must have, which includes all objects users must create.",
        "x-kubernetes-preserve-unknown-fields": true,
        "properties": {
            "name": {"type": "string", "description": "Name must be unique within a namespace."},
            "namespace": {"type": "string", "description": "Namespace defines the space within which each name must be unique."},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}, "description": "Map of string keys and values that can be used to organize and categorize (scope and select) objects."},
            "annotations": {"type": "object", "additionalProperties": {"type": "string"}, "description": "Annotations is an unstructured key value map stored with a resource."}
        }
    })
}

fn kind_schema(info: &ResourceInfo) -> Value {
    let mut schema = match &info.schema {
        Some(crd_schema) => {
            let mut schema = (**crd_schema).clone();
            if !schema.is_object() {
                schema = json!({"type": "object"});
            }
            let properties = &mut schema["properties"];
            if !properties.is_object() {
                *properties = json!({});
            }
            properties["apiVersion"] = json!({"type": "string", "description": "APIVersion defines the versioned schema of this representation of an object."});
            properties["kind"] = json!({"type": "string", "description": "Kind is a string value representing the REST resource this object represents."});
            properties["metadata"] = json!({
                "description": "Standard object's metadata.",
                "allOf": [{"$ref": format!("#/components/schemas/{OBJECT_META}")}],
            });
            schema
        }
        None => json!({
            "type": "object",
            "description": format!("{} is served by stackd's embedded API server; its fields are not described here.", info.kind),
            "x-kubernetes-preserve-unknown-fields": true,
            "properties": {
                "apiVersion": {"type": "string"},
                "kind": {"type": "string"},
                "metadata": {"allOf": [{"$ref": format!("#/components/schemas/{OBJECT_META}")}]},
            },
        }),
    };
    schema["x-kubernetes-group-version-kind"] = gvk(info);
    schema
}

fn query_parameter(name: &str, kind: &str) -> Value {
    json!({"name": name, "in": "query", "schema": {"type": kind}, "uniqueItems": true})
}

fn resource_paths(info: &ResourceInfo, schema_name: &str) -> Vec<(String, Value)> {
    let base = format!("/{}", gv_path(&info.group, &info.version));
    let collection = if info.namespaced {
        format!("{base}/namespaces/{{namespace}}/{}", info.plural)
    } else {
        format!("{base}/{}", info.plural)
    };
    let reference = json!({"$ref": format!("#/components/schemas/{schema_name}")});
    let body = |types: &[&str]| {
        let content: Map<String, Value> = types
            .iter()
            .map(|t| (t.to_string(), json!({"schema": reference.clone()})))
            .collect();
        json!({"content": content, "required": true})
    };
    let response =
        json!({"200": {"description": "OK", "content": {"application/json": {"schema": reference.clone()}}}});
    let write_parameters = json!([
        query_parameter("dryRun", "string"),
        query_parameter("fieldManager", "string"),
        query_parameter("fieldValidation", "string"),
    ]);
    let mut patch_parameters = write_parameters.clone();
    if let Some(list) = patch_parameters.as_array_mut() {
        list.push(query_parameter("force", "boolean"));
    }
    let operation = |action: &str, verb: &str, extra: Value| {
        let mut op = json!({
            "operationId": format!("{verb}{}", info.kind),
            "x-kubernetes-action": action,
            "x-kubernetes-group-version-kind": {"group": info.group, "version": info.version, "kind": info.kind},
            "responses": response.clone(),
        });
        if let (Some(op), Some(extra)) = (op.as_object_mut(), extra.as_object()) {
            op.extend(extra.clone());
        }
        op
    };
    let item = json!({
        "get": operation("get", "read", json!({})),
        "put": operation("put", "replace", json!({"parameters": write_parameters, "requestBody": body(&["*/*"])})),
        "patch": operation("patch", "patch", json!({
            "parameters": patch_parameters,
            // No strategic merge here: kubectl then builds client-side apply patches from its
            // own types for built-ins and merge patches for custom resources.
            "requestBody": body(&[
                "application/json-patch+json",
                "application/merge-patch+json",
                "application/apply-patch+yaml",
            ]),
        })),
        "delete": operation("delete", "delete", json!({})),
    });
    let list = json!({
        "get": operation("list", "list", json!({})),
        "post": operation("post", "create", json!({"parameters": write_parameters, "requestBody": body(&["*/*"])})),
    });
    let mut paths = vec![(format!("{collection}/{{name}}"), item), (collection, list)];
    if info.status_subresource {
        let status = json!({
            "get": operation("get", "read", json!({})),
            "patch": operation("patch", "patch", json!({
                "parameters": patch_parameters,
                "requestBody": body(&["application/json-patch+json", "application/merge-patch+json", "application/apply-patch+yaml"]),
            })),
        });
        paths.push((format!("{}/{{name}}/status", paths[1].0), status));
    }
    paths
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn custom_resource_schema_names_reverse_the_group() {
        let info = ResourceInfo {
            group: "pools.stackd.dev".into(),
            version: "v1alpha1".into(),
            plural: "clusterpools".into(),
            singular: "clusterpool".into(),
            kind: "ClusterPool".into(),
            namespaced: true,
            short_names: vec![],
            categories: vec![],
            status_subresource: true,
            scale: None,
            log_subresource: false,
            tracks_generation: true,
            schema: Some(std::sync::Arc::new(json!({"type": "object"}))),
        };
        assert_eq!(schema_name(&info), "dev.stackd.pools.v1alpha1.ClusterPool");
        let paths = resource_paths(&info, "x");
        assert!(
            paths
                .iter()
                .any(|(p, _)| p == "/apis/pools.stackd.dev/v1alpha1/namespaces/{namespace}/clusterpools/{name}/status")
        );
    }
}
