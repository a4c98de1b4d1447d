//! How lists and maps of an object merge: the knowledge server-side apply needs beyond the JSON.
//!
//! Paths here are schema paths: a field name per object level and [`PathElem::Item`] for "an
//! element of this list", so `spec.containers[].env` is
//! `[Field("spec"), Field("containers"), Item, Field("env")]`.

use std::sync::Arc;

use serde_json::Value;

/// One step of a schema path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathElem {
    Field(String),
    Item,
}

/// How server-side apply merges and owns a list (`x-kubernetes-list-type`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListType {
    /// Replaced whole and owned as one field.
    Atomic,
    /// A list of scalars merged by value.
    Set,
    /// A list of objects merged by the values of these key fields.
    Map(Vec<String>),
}

/// The list and map semantics of one kind.
pub trait ListSemantics {
    /// How the list at `path` merges.
    fn list_type(&self, path: &[PathElem]) -> ListType;
    /// Whether the object at `path` is replaced whole (`x-kubernetes-map-type: atomic`).
    fn map_is_atomic(&self, path: &[PathElem]) -> bool;
    /// Whether the object at `path` is a map (`additionalProperties`, labels, data) rather than
    /// a struct with named fields: server-side apply owns a map's keys themselves.
    fn is_map(&self, _path: &[PathElem]) -> bool {
        false
    }
    /// The value a missing list-map key field of an item of the list at `list` stands for
    /// (`protocol` of a container port is `TCP` when left out).
    fn key_default(&self, _list: &[PathElem], _key: &str) -> Option<Value> {
        None
    }
}

/// Renders a schema path as `spec.containers[].env`, the form the built-in table is written in.
pub(crate) fn render(path: &[PathElem]) -> String {
    let mut rendered = String::new();
    for elem in path {
        match elem {
            PathElem::Field(name) => {
                if !rendered.is_empty() {
                    rendered.push('.');
                }
                rendered.push_str(name);
            }
            PathElem::Item => rendered.push_str("[]"),
        }
    }
    rendered
}

/// Lists of `metadata` that every kind shares, custom resources included.
pub(crate) fn object_meta_list_type(path: &[PathElem]) -> Option<ListType> {
    match path {
        [PathElem::Field(meta), PathElem::Field(list)] if meta == "metadata" => match list.as_str() {
            "ownerReferences" => Some(ListType::Map(vec!["uid".to_string()])),
            "finalizers" => Some(ListType::Set),
            _ => None,
        },
        _ => None,
    }
}

/// Whether an object under `metadata` is a map: labels and annotations are, the rest of
/// ObjectMeta is structs; `None` for paths outside `metadata`.
pub(crate) fn object_meta_is_map(path: &[PathElem]) -> Option<bool> {
    match path {
        [] => Some(false),
        [PathElem::Field(meta), rest @ ..] if meta == "metadata" => Some(matches!(
            rest,
            [PathElem::Field(map)] if map == "labels" || map == "annotations"
        )),
        _ => None,
    }
}

/// List semantics read from a CRD version's `openAPIV3Schema`.
#[derive(Debug, Clone)]
pub struct CrdSchema {
    /// Shared with the served resource: it is read on every write, never copied.
    root: Arc<Value>,
}

impl CrdSchema {
    pub fn new(open_api_v3_schema: Arc<Value>) -> Self {
        CrdSchema {
            root: open_api_v3_schema,
        }
    }

    /// The schema node at `path`, or `None` where the schema says nothing (preserved unknown
    /// fields), which server-side apply treats as granular maps and atomic lists.
    fn node(&self, path: &[PathElem]) -> Option<&Value> {
        let mut node: &Value = &self.root;
        for elem in path {
            node = match elem {
                PathElem::Field(name) => field_schema(node, name)?,
                PathElem::Item => node.get("items").filter(|items| items.is_object())?,
            };
        }
        Some(node)
    }
}

fn field_schema<'a>(node: &'a Value, name: &str) -> Option<&'a Value> {
    if let Some(property) = node.get("properties").and_then(|p| p.get(name)) {
        return Some(property);
    }
    node.get("additionalProperties")
        .filter(|additional| additional.is_object())
}

impl ListSemantics for CrdSchema {
    fn list_type(&self, path: &[PathElem]) -> ListType {
        if let Some(meta) = object_meta_list_type(path) {
            return meta;
        }
        let Some(node) = self.node(path) else {
            return ListType::Atomic;
        };
        match node.get("x-kubernetes-list-type").and_then(Value::as_str) {
            Some("set") => ListType::Set,
            Some("map") => ListType::Map(map_keys(node)),
            _ => ListType::Atomic,
        }
    }

    fn map_is_atomic(&self, path: &[PathElem]) -> bool {
        self.node(path)
            .and_then(|node| node.get("x-kubernetes-map-type"))
            .and_then(Value::as_str)
            == Some("atomic")
    }

    /// Objects without `properties` (`additionalProperties`, preserved unknown fields) are maps,
    /// as structured-merge-diff deduces; `metadata` follows ObjectMeta.
    fn is_map(&self, path: &[PathElem]) -> bool {
        if let Some(meta) = object_meta_is_map(path) {
            return meta;
        }
        self.node(path).is_none_or(|node| node.get("properties").is_none())
    }

    fn key_default(&self, list: &[PathElem], key: &str) -> Option<Value> {
        let item = self.node(list)?.get("items")?;
        item.get("properties")?.get(key)?.get("default").cloned()
    }
}

fn map_keys(node: &Value) -> Vec<String> {
    node.get("x-kubernetes-list-map-keys")
        .and_then(Value::as_array)
        .map(|keys| keys.iter().filter_map(Value::as_str).map(str::to_string).collect())
        .unwrap_or_default()
}

/// Builds a schema path from dotted text (`spec.containers[].env`), for tests and tables.
#[cfg(test)]
pub(crate) fn path(text: &str) -> Vec<PathElem> {
    let mut elems = Vec::new();
    for part in text.split('.').filter(|part| !part.is_empty()) {
        let name = part.trim_end_matches("[]");
        elems.push(PathElem::Field(name.to_string()));
        for _ in 0..(part.len() - name.len()) / 2 {
            elems.push(PathElem::Item);
        }
    }
    elems
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn widget_schema() -> CrdSchema {
        CrdSchema::new(Arc::new(json!({
            "type": "object",
            "properties": {
                "spec": {
                    "type": "object",
                    "properties": {
                        "ports": {
                            "type": "array",
                            "x-kubernetes-list-type": "map",
                            "x-kubernetes-list-map-keys": ["port", "protocol"],
                            "items": {"type": "object", "properties": {
                                "port": {"type": "integer"},
                                "protocol": {"type": "string", "default": "TCP"}
                            }}
                        },
                        "tags": {"type": "array", "x-kubernetes-list-type": "set",
                                 "items": {"type": "string"}},
                        "args": {"type": "array", "items": {"type": "string"}},
                        "selector": {"type": "object", "x-kubernetes-map-type": "atomic",
                                     "additionalProperties": {"type": "string"}},
                        "byZone": {"type": "object", "additionalProperties": {
                            "type": "object", "properties": {"hosts": {
                                "type": "array", "x-kubernetes-list-type": "set",
                                "items": {"type": "string"}}}}}
                    }
                }
            }
        })))
    }

    #[test]
    fn crd_schema_reads_list_types() {
        let schema = widget_schema();
        assert_eq!(
            schema.list_type(&path("spec.ports")),
            ListType::Map(vec!["port".into(), "protocol".into()])
        );
        assert_eq!(schema.list_type(&path("spec.tags")), ListType::Set);
        assert_eq!(schema.list_type(&path("spec.args")), ListType::Atomic);
        assert_eq!(schema.list_type(&path("spec.unknown")), ListType::Atomic);
    }

    #[test]
    fn crd_schema_walks_additional_properties() {
        let schema = widget_schema();
        assert_eq!(schema.list_type(&path("spec.byZone.eu-1.hosts")), ListType::Set);
    }

    #[test]
    fn crd_schema_reads_atomic_maps_and_key_defaults() {
        let schema = widget_schema();
        assert!(schema.map_is_atomic(&path("spec.selector")));
        assert!(!schema.map_is_atomic(&path("spec")));
        assert_eq!(schema.key_default(&path("spec.ports"), "protocol"), Some(json!("TCP")));
    }

    #[test]
    fn objects_without_properties_are_maps() {
        let schema = widget_schema();
        assert!(schema.is_map(&path("spec.byZone")));
        assert!(schema.is_map(&path("metadata.labels")));
        assert!(!schema.is_map(&path("spec")));
        assert!(!schema.is_map(&path("metadata")));
        assert!(!schema.is_map(&[]));
    }

    #[test]
    fn custom_resources_share_object_meta_lists() {
        let schema = widget_schema();
        assert_eq!(schema.list_type(&path("metadata.finalizers")), ListType::Set);
        assert_eq!(
            schema.list_type(&path("metadata.ownerReferences")),
            ListType::Map(vec!["uid".into()])
        );
    }

    #[test]
    fn paths_render_with_item_markers() {
        assert_eq!(render(&path("spec.containers[].env")), "spec.containers[].env");
    }
}
