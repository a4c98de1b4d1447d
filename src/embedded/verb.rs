//! The Kubernetes verb of a resource request: the HTTP layer finds it, fault injection and the
//! per-verb counters match on it.

/// The Kubernetes verb of a resource request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verb {
    Get,
    List,
    Watch,
    Create,
    Update,
    Patch,
    Delete,
    DeleteCollection,
}
