//! What a tenant's controllers are given: the tenant context and its errors, the daemon's settings
//! and what every tenant shares, how host pods reach the tenant, and Events on tenant objects. It
//! sits between the host conventions (`host`) and the controllers (`stacks`, `pools`, `inventory`),
//! which `tenancy` starts; none of them is imported here.

pub mod crd_groups;
pub mod endpoint;
pub mod events;
pub mod namespace_template;
pub mod pod_policy;
pub mod registries;
pub mod shared;
pub mod stack_limits;
pub mod tenant;
