//! Sets of field paths, and their `FieldsV1` encoding in `metadata.managedFields`.
//!
//! A path names one field (`f:data`, `f:a`), one item of an associative list by its keys
//! (`k:{"name":"app"}`), one item of a set by its value (`v:"x"`) or a list position (`i:3`).
//! In the encoding every path is a nested key; `{}` marks a path that is itself in the set and
//! has nothing under it, and `".": {}` marks one that is in the set and has children too.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Map, Value};

/// One step of a field path. Keys and values hold canonical JSON (object keys sorted, which
/// `serde_json` maps guarantee), so equal items compare equal as strings.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(super) enum Element {
    Field(String),
    Key(String),
    Value(String),
    Index(usize),
}

pub(super) type FieldPath = Vec<Element>;

/// A set of field paths, such as the fields one manager owns.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct FieldSet {
    paths: BTreeSet<FieldPath>,
}

impl FieldSet {
    pub(super) fn new() -> Self {
        FieldSet::default()
    }

    pub(super) fn insert(&mut self, path: FieldPath) {
        self.paths.insert(path);
    }

    pub(super) fn contains(&self, path: &[Element]) -> bool {
        self.paths.contains(path)
    }

    pub(super) fn is_empty(&self) -> bool {
        self.paths.is_empty()
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = &FieldPath> {
        self.paths.iter()
    }

    pub(super) fn union(&self, other: &FieldSet) -> FieldSet {
        FieldSet {
            paths: self.paths.union(&other.paths).cloned().collect(),
        }
    }

    /// Adds every path of `other`, without copying this set.
    pub(super) fn extend(&mut self, other: FieldSet) {
        self.paths.extend(other.paths);
    }

    /// Removes every path of `other`, without copying the rest.
    pub(super) fn remove_all(&mut self, other: &FieldSet) {
        if other.paths.len() < self.paths.len() {
            for path in &other.paths {
                self.paths.remove(path);
            }
        } else {
            self.paths.retain(|path| !other.paths.contains(path));
        }
    }

    pub(super) fn intersection(&self, other: &FieldSet) -> FieldSet {
        FieldSet {
            paths: self.paths.intersection(&other.paths).cloned().collect(),
        }
    }

    /// Whether some path of the set lies strictly under `prefix`.
    pub(super) fn has_strict_descendant(&self, prefix: &[Element]) -> bool {
        self.paths
            .range::<[Element], _>((std::ops::Bound::Excluded(prefix), std::ops::Bound::Unbounded))
            .take_while(|path| path.starts_with(prefix))
            .any(|path| path.len() > prefix.len())
    }

    /// Whether `prefix` or some path under it is in the set.
    pub(super) fn touches(&self, prefix: &[Element]) -> bool {
        self.contains(prefix) || self.has_strict_descendant(prefix)
    }

    /// The set without the paths for which `drop` is true.
    pub(super) fn without(mut self, drop: impl Fn(&[Element]) -> bool) -> FieldSet {
        self.paths.retain(|path| !drop(path));
        self
    }

    /// The `fieldsV1` object for this set.
    pub(super) fn to_fields_v1(&self) -> Value {
        let mut root = Node::default();
        for path in &self.paths {
            root.insert(path);
        }
        root.encode()
    }

    /// Reads a `fieldsV1` object.
    pub(super) fn from_fields_v1(fields: &Value) -> Result<FieldSet, String> {
        let mut set = FieldSet::new();
        decode_into(fields, &mut Vec::new(), &mut set)?;
        Ok(set)
    }
}

impl FromIterator<FieldPath> for FieldSet {
    fn from_iter<I: IntoIterator<Item = FieldPath>>(iter: I) -> Self {
        FieldSet {
            paths: iter.into_iter().collect(),
        }
    }
}

#[derive(Default)]
struct Node {
    member: bool,
    children: BTreeMap<String, Node>,
}

impl Node {
    fn insert(&mut self, path: &[Element]) {
        let mut node = self;
        for element in path {
            node = node.children.entry(encode_element(element)).or_default();
        }
        node.member = true;
    }

    fn encode(&self) -> Value {
        let mut object = Map::new();
        if self.member && !self.children.is_empty() {
            object.insert(".".to_string(), Value::Object(Map::new()));
        }
        for (key, child) in &self.children {
            object.insert(key.clone(), child.encode());
        }
        Value::Object(object)
    }
}

fn encode_element(element: &Element) -> String {
    match element {
        Element::Field(name) => format!("f:{name}"),
        Element::Key(key) => format!("k:{key}"),
        Element::Value(value) => format!("v:{value}"),
        Element::Index(index) => format!("i:{index}"),
    }
}

fn decode_element(text: &str) -> Result<Element, String> {
    let invalid = || format!("invalid fieldsV1 key {text:?}");
    let (kind, rest) = text.split_once(':').ok_or_else(invalid)?;
    match kind {
        "f" => Ok(Element::Field(rest.to_string())),
        "k" => canonical_json(rest).map(Element::Key).ok_or_else(invalid),
        "v" => canonical_json(rest).map(Element::Value).ok_or_else(invalid),
        "i" => rest.parse().map(Element::Index).map_err(|_| invalid()),
        _ => Err(invalid()),
    }
}

/// Re-serializes JSON text so that keys are sorted and spacing is gone.
fn canonical_json(text: &str) -> Option<String> {
    serde_json::from_str::<Value>(text).ok().map(|value| value.to_string())
}

fn decode_into(fields: &Value, path: &mut FieldPath, set: &mut FieldSet) -> Result<(), String> {
    let Some(object) = fields.as_object() else {
        return Err(format!("fieldsV1 entries must be objects, got {fields}"));
    };
    if object.is_empty() && !path.is_empty() {
        set.insert(path.clone());
    }
    for (key, child) in object {
        if key == "." {
            if !path.is_empty() {
                set.insert(path.clone());
            }
            continue;
        }
        path.push(decode_element(key)?);
        let decoded = decode_into(child, path, set);
        path.pop();
        decoded?;
    }
    Ok(())
}

/// Renders a path the way kube-apiserver names conflicting fields: `.spec.containers[name="app"].image`,
/// `.metadata.finalizers[="x"]`.
pub(super) fn path_string(path: &[Element]) -> String {
    let mut text = String::new();
    for element in path {
        match element {
            Element::Field(name) => {
                text.push('.');
                text.push_str(name);
            }
            Element::Key(key) => text.push_str(&format!("[{}]", key_text(key))),
            Element::Value(value) => text.push_str(&format!("[={value}]")),
            Element::Index(index) => text.push_str(&format!("[{index}]")),
        }
    }
    text
}

fn key_text(key: &str) -> String {
    match serde_json::from_str::<Value>(key) {
        Ok(Value::Object(fields)) => fields
            .iter()
            .map(|(name, value)| format!("{name}={value}"))
            .collect::<Vec<_>>()
            .join(","),
        _ => key.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn field(name: &str) -> Element {
        Element::Field(name.to_string())
    }

    fn sample() -> FieldSet {
        [
            vec![field("data"), field("a")],
            vec![field("metadata"), field("labels")],
            vec![field("metadata"), field("labels"), field("app")],
            vec![
                field("spec"),
                field("containers"),
                Element::Key(r#"{"name":"app"}"#.into()),
            ],
            vec![
                field("spec"),
                field("containers"),
                Element::Key(r#"{"name":"app"}"#.into()),
                field("image"),
            ],
            vec![field("metadata"), field("finalizers"), Element::Value(r#""x""#.into())],
        ]
        .into_iter()
        .collect()
    }

    #[test]
    fn fields_v1_marks_owned_parents_with_a_dot() {
        assert_eq!(
            sample().to_fields_v1(),
            json!({
                "f:data": {"f:a": {}},
                "f:metadata": {
                    "f:finalizers": {"v:\"x\"": {}},
                    "f:labels": {".": {}, "f:app": {}}
                },
                "f:spec": {"f:containers": {"k:{\"name\":\"app\"}": {".": {}, "f:image": {}}}}
            })
        );
    }

    #[test]
    fn fields_v1_round_trips() {
        let encoded = sample().to_fields_v1();
        assert_eq!(FieldSet::from_fields_v1(&encoded), Ok(sample()));
    }

    #[test]
    fn decoding_canonicalizes_key_spacing() {
        let decoded = FieldSet::from_fields_v1(&json!({"f:ports": {
            "k:{\"protocol\": \"TCP\", \"containerPort\": 80}": {}
        }}));
        let expected: FieldSet = [vec![
            field("ports"),
            Element::Key(r#"{"containerPort":80,"protocol":"TCP"}"#.into()),
        ]]
        .into_iter()
        .collect();
        assert_eq!(decoded, Ok(expected));
    }

    #[test]
    fn unknown_fields_v1_prefix_is_an_error() {
        assert!(FieldSet::from_fields_v1(&json!({"x:y": {}})).is_err());
    }

    #[test]
    fn paths_render_like_kube_apiserver() {
        let image = vec![
            field("spec"),
            field("containers"),
            Element::Key(r#"{"containerPort":80,"protocol":"TCP"}"#.into()),
            field("image"),
        ];
        assert_eq!(
            path_string(&image),
            r#".spec.containers[containerPort=80,protocol="TCP"].image"#
        );
        assert_eq!(
            path_string(&[field("metadata"), field("finalizers"), Element::Value(r#""x""#.into())]),
            r#".metadata.finalizers[="x"]"#
        );
    }

    #[test]
    fn strict_descendants_are_found_by_prefix() {
        let set = sample();
        assert!(set.has_strict_descendant(&[field("metadata")]));
        assert!(!set.has_strict_descendant(&[field("data"), field("a")]));
        assert!(set.touches(&[field("data"), field("a")]));
        assert!(!set.touches(&[field("status")]));
    }
}
