//! `managedFields` on every write, and how a kind's lists and maps merge: the glue between the
//! verbs (and [`server_side_apply`](super::apply::server_side_apply)) and the pure
//! [`patch_engine`](super::patch_engine).

use std::sync::Arc;

use serde_json::Value;

use super::discovery::ResourceInfo;
use super::object_meta::now_timestamp;
use super::patch_engine::{self, BuiltinSchema, CrdSchema, ListSemantics};
use super::verb_options::Subresource;

/// How lists and maps of this kind merge: the CRD version's schema, or the built-in table.
pub fn list_semantics(info: &ResourceInfo) -> Box<dyn ListSemantics> {
    match &info.schema {
        Some(schema) => Box::new(CrdSchema::new(Arc::clone(schema))),
        None => Box::new(BuiltinSchema::for_kind(&info.kind)),
    }
}

pub(super) fn subresource_name(sub: Subresource) -> Option<&'static str> {
    match sub {
        Subresource::Main => None,
        Subresource::Status => Some("status"),
        Subresource::Finalize => Some("finalize"),
    }
}

/// Credits `manager` with what an ordinary write (create, update, non-apply patch) changes.
pub fn record(info: &ResourceInfo, old: Option<&Value>, new: Value, manager: &str, sub: Subresource) -> Value {
    let semantics = list_semantics(info);
    patch_engine::record_update(
        old,
        new,
        manager,
        subresource_name(sub),
        semantics.as_ref(),
        &now_timestamp(),
    )
}
