//! Tenants: their two sources (the kubeconfig directory and Tenant objects on the host, merged by
//! `sources`), the status of Tenant objects, the supervisor, and each tenant's task tree (host
//! namespace, quota, CRD monitor, orphan sweep, its objects by readiness, and the controllers of
//! `stacks`, `pools` and `inventory`).

mod budget;
pub mod directory;
mod host_namespace;
pub mod objects;
pub mod quota;
pub mod sharded;
pub mod sources;
mod summary;
pub mod supervisor;
pub mod tenant;
