//! Stored objects as one version serves them, written out straight from the shared stored value:
//! the version's `apiVersion` and `kind`, events.k8s.io's field names, CRD schema defaults. A get,
//! a list or a watch event copies no object to answer; an object still missing a schema default
//! (its CRD gained one since it was written) is copied and defaulted, as [`present`] does.
//!
//! The bytes are those of [`present`]'s value: `serde_json` writes a `Value`'s fields in
//! key order, and so do these.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;

use serde::ser::{Serialize, SerializeMap, Serializer};
use serde_json::{Value, json};

use super::convert;
use super::discovery::ResourceInfo;
use super::schema;

/// A stored object as served in this version.
pub fn present(info: &ResourceInfo, object: Value) -> Value {
    let mut object = stamp(info, convert::from_storage(&info.group, &info.plural, object));
    if let Some(schema) = &info.schema {
        schema::apply_defaults(schema, &mut object);
    }
    object
}

/// Sets this version's `apiVersion` and `kind` on an object already in its form.
pub(super) fn stamp(info: &ResourceInfo, mut object: Value) -> Value {
    object["apiVersion"] = json!(info.api_version());
    object["kind"] = json!(info.kind);
    object
}

/// One stored object as `info`'s version serves it.
#[derive(Clone)]
pub struct Served<'a> {
    info: &'a ResourceInfo,
    object: Arc<Value>,
}

impl<'a> Served<'a> {
    pub fn new(info: &'a ResourceInfo, object: Arc<Value>) -> Served<'a> {
        Served { info, object }
    }

    /// The object as stored (the storage version's field names, `apiVersion` as written).
    pub fn stored(&self) -> &Value {
        &self.object
    }

    /// A copy in the served form, for callers that change or inspect it as served.
    pub fn into_value(self) -> Value {
        present(self.info, Arc::unwrap_or_clone(self.object))
    }

    /// Whether the served form differs from the stored one beyond top-level renames.
    fn needs_copy(&self) -> bool {
        !self.object.is_object()
            || self
                .info
                .schema
                .as_ref()
                .is_some_and(|schema| schema::defaults_missing(schema, &self.object))
    }
}

impl Serialize for Served<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let Some(map) = self.object.as_object().filter(|_| !self.needs_copy()) else {
            return self.clone().into_value().serialize(serializer);
        };
        let (api_version, kind) = (json!(self.info.api_version()), json!(self.info.kind));
        let mut fields: BTreeMap<&str, &Value> = map.iter().map(|(key, value)| (key.as_str(), value)).collect();
        convert::fields_from_storage(&self.info.group, &self.info.plural, &mut fields);
        fields.insert("apiVersion", &api_version);
        fields.insert("kind", &kind);
        serializer.collect_map(fields)
    }
}

/// `stored` as `info`'s version serves it: the stored value itself when it is already in that form
/// (the common case: written in this version, nothing to rename or default), else a copy.
pub fn presented<'v>(info: &ResourceInfo, stored: &'v Value) -> Cow<'v, Value> {
    let already = stored.is_object()
        && stored["apiVersion"].as_str() == Some(info.api_version().as_str())
        && stored["kind"].as_str() == Some(info.kind.as_str())
        && convert::reads_as_stored(&info.group, &info.plural)
        && !info
            .schema
            .as_ref()
            .is_some_and(|schema| schema::defaults_missing(schema, stored));
    if already {
        Cow::Borrowed(stored)
    } else {
        Cow::Owned(present(info, stored.clone()))
    }
}

/// A list answer: `<Kind>List` of the served items, with the list's metadata.
pub struct ServedList<'a> {
    info: &'a ResourceInfo,
    metadata: Value,
    items: Vec<Arc<Value>>,
}

impl<'a> ServedList<'a> {
    pub fn new(info: &'a ResourceInfo, metadata: Value, items: Vec<Arc<Value>>) -> ServedList<'a> {
        ServedList { info, metadata, items }
    }

    /// The items as stored.
    pub fn stored_items(&self) -> &[Arc<Value>] {
        &self.items
    }

    /// A copy in the served form (for a Table view of the list).
    pub fn into_value(self) -> Value {
        let info = self.info;
        let items: Vec<Value> = self
            .items
            .into_iter()
            .map(|item| Served::new(info, item).into_value())
            .collect();
        json!({
            "kind": format!("{}List", info.kind),
            "apiVersion": info.api_version(),
            "metadata": self.metadata,
            "items": items,
        })
    }
}

/// The items of a list, each served.
struct Items<'a>(&'a ServedList<'a>);

impl Serialize for Items<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let info = self.0.info;
        serializer.collect_seq(self.0.items.iter().map(|item| Served::new(info, item.clone())))
    }
}

impl Serialize for ServedList<'_> {
    /// Fields in key order, as a `Value` of the same list writes them.
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(4))?;
        map.serialize_entry("apiVersion", &self.info.api_version())?;
        map.serialize_entry("items", &Items(self))?;
        map.serialize_entry("kind", &format!("{}List", self.info.kind))?;
        map.serialize_entry("metadata", &self.metadata)?;
        map.end()
    }
}

/// One watch event line, `type` first as kube-apiserver writes it (a client may then decode the
/// object as it streams by instead of buffering it to find the type).
#[derive(serde::Serialize)]
pub struct WatchLine<'a> {
    #[serde(rename = "type")]
    pub event_type: &'a str,
    pub object: Served<'a>,
}

#[cfg(test)]
mod tests;
