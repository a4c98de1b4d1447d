//! The verbs a stack's RBAC rules may name: one list for `stackd unpack`, which generates the rules,
//! and the stack controller, which checks and grants them.

/// The verbs a stack's rules may use: reading and writing objects. Everything else — `*`, `escalate`,
/// `bind`, `impersonate`, `approve`, ... — would reach beyond the objects themselves.
pub const ALLOWED_VERBS: [&str; 8] = [
    "get",
    "list",
    "watch",
    "create",
    "update",
    "patch",
    "delete",
    "deletecollection",
];
