//! The custom resource types stackd serves, one module per API group.
//!
//! Field doc comments become `kubectl explain` text, so they are written for users.

// kube's `printcolumn(...)` arguments repeat `type_ = "string"`, which clippy misreads as a
// duplicated attribute.
#![allow(clippy::duplicated_attributes)]

pub mod common;
pub mod crds;
pub mod inventory;
pub mod pools;
pub mod stacks;
pub mod tenancy;

/// API group of StackInstall, ClusterStackInstall and Stack.
pub const STACKS_GROUP: &str = "stacks.stackd.dev";
/// API group of ClusterPool, ClusterDeploymentCustomization, ClusterDeployment and ClusterClaim.
pub const POOLS_GROUP: &str = "pools.stackd.dev";
/// API group of BareMetalAsset.
pub const INVENTORY_GROUP: &str = "inventory.stackd.dev";
/// API group of Tenant, the one kind stackd serves on the host rather than in the tenants.
pub const TENANCY_GROUP: &str = "tenancy.stackd.dev";
/// The one version every group serves today.
pub const VERSION: &str = "v1alpha1";
