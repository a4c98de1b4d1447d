//! What a verb is asked to do beyond its object: the part it writes, list selectors and pages,
//! dry runs and field managers, delete preconditions. The verbs, server-side apply and the
//! `managedFields` bookkeeping all take these, so they sit below all three.

use std::sync::Arc;

use super::admission::Admission;
use super::selectors::{FieldSelector, LabelSelector};

/// The manager credited with writes that name none (in-process controllers, test setup).
pub const DEFAULT_MANAGER: &str = "stackd-embedded";

/// Which part of an object a write addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Subresource {
    Main,
    Status,
    /// A Namespace's `/finalize`: only `spec.finalizers` changes.
    Finalize,
}

/// What a list asks for: selectors and a page.
#[derive(Debug, Clone, Default)]
pub struct ListOptions {
    pub label_selector: LabelSelector,
    pub field_selector: FieldSelector,
    pub limit: Option<usize>,
    pub continue_token: Option<String>,
}

/// Options every write takes.
#[derive(Debug, Clone, Default)]
pub struct WriteOptions {
    /// Run every check and return the result, but store nothing (`dryRun=All`).
    pub dry_run: bool,
    /// Who `managedFields` credit with the write; `None` credits [`DEFAULT_MANAGER`].
    pub field_manager: Option<String>,
    /// The mutating hooks a write over HTTP passes; `None` for the in-process loops.
    pub admission: Option<Arc<Admission>>,
}

impl WriteOptions {
    pub(super) fn recording(&self) -> Recording<'_> {
        Recording::Manager(self.field_manager.as_deref().unwrap_or(DEFAULT_MANAGER))
    }
}

/// How a write treats `managedFields`.
#[derive(Debug, Clone, Copy)]
pub(super) enum Recording<'a> {
    /// Credit the changed fields to this manager.
    Manager(&'a str),
    /// Keep the `managedFields` the caller computed (a server-side apply).
    AsGiven,
}

/// What a delete asks for: preconditions and how dependents go.
#[derive(Debug, Clone, Default)]
pub struct DeleteOptions {
    pub write: WriteOptions,
    pub precondition_uid: Option<String>,
    pub precondition_resource_version: Option<String>,
    pub propagation_policy: Option<String>,
}
