//! Telling users about the objects a shared cache leaves out: one log line and one Warning Event on
//! the object (or, for a host object, on the tenant object it was made for), naming what is wrong
//! and how to fix it, never quoting the object's content.

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::core::error_boundary::InvalidObject;
use kube::runtime::events::{EventType, Recorder};
use tracing::warn;

use super::refusals::Refusal;
use crate::runtime::events::{event, log_unpublished};
use crate::runtime::memory_budget::{ByteSize, NamespaceOverage};

/// The reason of the Event on an object left out for its namespace's memory share.
pub const NAMESPACE_OVER_BUDGET: &str = "NamespaceOverBudget";

/// The tenant object a host object was made for, and the tenant namespace whose work it belongs
/// to; told from the host object's name and stackd's labels and annotations (`crate::host`).
#[derive(Clone, Debug, PartialEq)]
pub struct HostParent {
    pub reference: ObjectReference,
    pub namespace: String,
}

/// Finds the tenant parent of a host object.
pub type HostParentOf = fn(&ObjectMeta) -> Option<HostParent>;

/// Where a cache reports what it leaves out.
#[derive(Clone, Default)]
pub struct Reporter {
    /// The tenant's recorder; none in tests.
    pub recorder: Option<Recorder>,
    /// Set for caches of host objects: their Events go to the tenant parent.
    pub host_parent: Option<HostParentOf>,
}

impl Reporter {
    /// The tenant namespace whose work a refused object holds up: a tenant object's own ("" for a
    /// cluster-scoped one: all of them), a host object's tenant parent's.
    pub fn holds(&self, metadata: &ObjectMeta) -> String {
        match self.host_parent {
            None => metadata.namespace.clone().unwrap_or_default(),
            Some(parent_of) => parent_of(metadata).map(|parent| parent.namespace).unwrap_or_default(),
        }
    }

    /// Logs a malformed object and tells its owner with a Warning Event on it (tenant objects only:
    /// a malformed host object has no reader among the tenant's users).
    pub fn invalid(&self, kind: &str, api_version: &str, invalid: InvalidObject) {
        let metadata = invalid.metadata;
        warn!(
            kind = %kind,
            namespace = metadata.namespace.as_deref().unwrap_or_default(),
            name = metadata.name.as_deref().unwrap_or_default(),
            error = %invalid.error,
            "ignoring an object that does not match its schema; fix or delete it"
        );
        if self.host_parent.is_some() {
            return;
        }
        let reference = reference_to(kind, api_version, metadata);
        let note = format!(
            "stackd cannot read this object and ignores it until it is fixed: {}",
            invalid.error
        );
        self.publish("InvalidObject", note, reference);
    }

    /// Logs an object over the size cap and tells its owner with a Warning Event.
    pub fn too_large(&self, refusal: &Refusal, api_version: &str, metadata: ObjectMeta, cap: u64) {
        let (size, cap) = (ByteSize(refusal.json_bytes), ByteSize(cap));
        warn!(
            kind = %refusal.kind,
            namespace = refusal.namespace.as_deref().unwrap_or_default(),
            name = %refusal.name,
            bytes = refusal.json_bytes,
            "ignoring an object over --max-cached-object-bytes ({cap}); make it smaller or delete it"
        );
        let waits = match refusal.holds.as_str() {
            "" => "stackd holds off its work that reads such objects".to_string(),
            namespace => format!("stackd holds off its work in namespace {namespace} that reads such objects"),
        };
        let (reference, note) = match self.host_parent {
            None => (
                reference_to(&refusal.kind, api_version, metadata),
                format!(
                    "This {} is {size} of JSON, over the {cap} stackd reads (--max-cached-object-bytes): stackd ignores it, and {waits}, until it is made smaller or deleted. Keep bulky data out of it (a deletion that waits for a stackd finalizer finishes once the object is small enough to read).",
                    refusal.kind
                ),
            ),
            Some(parent_of) => {
                let Some(parent) = parent_of(&metadata) else {
                    return;
                };
                let note = format!(
                    "The host {} that stackd made for this object is {size} of JSON, over the {cap} stackd reads (--max-cached-object-bytes): {waits} until it is smaller. Whatever wrote into it (an installer) must write less.",
                    refusal.describe()
                );
                (parent.reference, note)
            }
        };
        self.publish("ObjectTooLarge", note, reference);
    }

    /// Logs an object left out for its namespace's memory share and tells its owner with a Warning
    /// Event (on the tenant parent of a host object).
    pub fn over_budget(&self, refusal: &Refusal, api_version: &str, metadata: ObjectMeta, overage: &NamespaceOverage) {
        warn!(
            kind = %refusal.kind,
            namespace = refusal.namespace.as_deref().unwrap_or_default(),
            name = %refusal.name,
            tenant_namespace = %overage.namespace,
            "ignoring an object its namespace has no memory share left for ({}); delete or shrink that namespace's objects",
            overage.flag
        );
        let namespace = &overage.namespace;
        let held = format!(
            "stackd ignores it and holds off its work in namespace {namespace} that reads such objects, until that namespace's objects are deleted or made smaller; the tenant's other namespaces are served as before"
        );
        let (reference, note) = match self.host_parent {
            None => (
                reference_to(&refusal.kind, api_version, metadata),
                format!("This {} is not read: {overage}. {held}.", refusal.kind),
            ),
            Some(parent_of) => {
                let Some(parent) = parent_of(&metadata) else {
                    return;
                };
                let note = format!(
                    "The host {} that stackd made for this object is not read: {overage}. {held}.",
                    refusal.describe()
                );
                (parent.reference, note)
            }
        };
        self.publish(NAMESPACE_OVER_BUDGET, note, reference);
    }

    fn publish(&self, reason: &str, note: String, reference: ObjectReference) {
        let Some(recorder) = self.recorder.clone() else {
            return;
        };
        let event = event(EventType::Warning, reason, "Read", note);
        tokio::spawn(async move {
            if let Err(err) = recorder.publish(&event, &reference).await {
                log_unpublished(&err);
            }
        });
    }
}

fn reference_to(kind: &str, api_version: &str, metadata: ObjectMeta) -> ObjectReference {
    ObjectReference {
        api_version: Some(api_version.to_string()),
        kind: Some(kind.to_string()),
        namespace: metadata.namespace,
        name: metadata.name,
        uid: metadata.uid,
        ..Default::default()
    }
}
