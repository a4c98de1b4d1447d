//! stackd: one daemon serving stacks and cluster pools to many tenant API servers.
pub mod api;
pub mod embedded;
