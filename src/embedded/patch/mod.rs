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
