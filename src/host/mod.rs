//! Host-side conventions (DESIGN.md §2): how tenant objects are named, labelled and proven ours on the
//! host cluster, and which host objects the orphan sweep may delete.

pub mod apply;
pub mod cluster_identity;
pub mod labels;
pub mod legacy_names;
pub mod names;
pub mod namespace;
pub mod namespace_watch;
pub mod network_policy;
pub mod ownership;
pub mod pod_trouble;
pub mod purge;
pub mod quota;
pub mod quota_share;
pub mod sweep;

pub use labels::Parent;
