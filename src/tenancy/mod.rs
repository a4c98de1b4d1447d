//! Tenants: the kubeconfig directory, the supervisor, and each tenant's task tree (host namespace, quota,
//! CRD monitor, orphan sweep, and the controllers of `stacks`, `pools` and `inventory`).

mod budget;
pub mod directory;
mod host_namespace;
pub mod quota;
pub mod sharded;
pub mod supervisor;
pub mod tenant;
