//! The patch engine of the embedded API server: pure functions on `serde_json::Value`.
//!
//! - [`merge_patch`]: JSON merge patch (RFC 7386);
//! - [`json_patch`]: JSON patch (RFC 6902) with kube-apiserver's `test` semantics;
//! - [`strategic_merge_patch`]: strategic merge patch for built-in kinds;
//! - `apply` / `record_update`: server-side apply and `managedFields` bookkeeping.

mod json;
mod merge;

pub use json::{JsonPatchError, json_patch};
pub use merge::merge_patch;
mod builtin;
mod schema;

pub use builtin::{BuiltinSchema, ListStrategy, list_strategy, supports_strategic};
pub use schema::{CrdSchema, ListSemantics, ListType, PathElem};
mod strategic;

pub use strategic::{StrategicPatchError, strategic_merge_patch};
mod fieldset;

pub use fieldset::{Element, FieldPath, FieldSet, path_string};
mod apply;
mod managed;
mod typed;

pub use apply::{ApplyError, ConflictCause, apply, record_update};
