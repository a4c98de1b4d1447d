//! Tenants: their names, their host namespaces, and how host pods reach their API servers.

pub mod cluster_identity;
pub mod directory;
pub mod endpoint;
pub mod namespace;
pub mod supervisor;
pub mod tenant;
pub mod untrusted_kubeconfig;
