//! The patch engine of the embedded API server: pure functions on `serde_json::Value`, no I/O.
//!
//! What the HTTP layer calls, by request:
//! - `application/merge-patch+json` → [`merge_patch`];
//! - `application/json-patch+json` → [`json_patch()`] (400 for [`JsonPatchError::Malformed`],
//!   422 Invalid for [`JsonPatchError::Failed`]);
//! - `application/strategic-merge-patch+json` → 415 unless [`supports_strategic`], else
//!   [`strategic_merge_patch`];
//! - `application/apply-patch+yaml` (parsed to JSON) → [`apply`] with the kind's
//!   [`ListSemantics`]: [`BuiltinSchema::for_kind`] or [`CrdSchema::new`] on the served
//!   version's `openAPIV3Schema`; [`ApplyError`] maps to 409 / 400 / 422 / 404;
//! - every other write (create, update, the patches above) → [`record_update`] on the object
//!   about to be stored, so appliers meet the fields other writers changed as conflicts.
//!
//! An apply or update that changes nothing returns the stored object unchanged, so the caller
//! can compare and keep its `resourceVersion`.
//!
//! Known differences from kube-apiserver 1.24 (structured-merge-diff v4):
//! - the built-in schemas are a hand-written table of merge keys and atomic maps, not the
//!   OpenAPI models: lists it does not name are atomic, objects are structs unless listed;
//! - no conversion of field sets between API versions (each entry keeps the version it had);
//! - after pruning, any object or list left empty (and owned by nobody) is removed, map values
//!   included; structured-merge-diff removes struct fields that way, and keeps empty map values;
//! - the status stanza of an apply to the main resource is not dropped here: the caller removes
//!   it for kinds with a status subresource, as kube-apiserver's reset fields do;
//! - strategic merge patch: `$setElementOrder` reorders the named items within the slots they
//!   occupy; errors are one [`StrategicPatchError`] where kube answers 400, 422 or 500.

mod apply;
mod builtin;
mod fieldset;
mod json;
mod managed;
mod merge;
mod schema;
mod strategic;
mod typed;

pub use apply::{ApplyError, ConflictCause, apply, record_update};
pub use builtin::{BuiltinSchema, supports_strategic};
pub use json::{JsonPatchError, json_patch};
pub use merge::merge_patch;
pub use schema::{CrdSchema, ListSemantics, ListType, PathElem};
pub use strategic::{StrategicPatchError, strategic_merge_patch};
