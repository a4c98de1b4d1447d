//! stackd: one daemon serving stacks and cluster pools to many tenant API servers.
pub mod api;
pub mod bench;
pub mod context;
pub mod daemon;
pub mod dev;
pub mod embedded;
pub mod host;
pub mod inventory;
pub mod pools;
pub mod runtime;
pub mod stacks;
pub mod tenancy;

#[cfg(test)]
mod module_layers;
