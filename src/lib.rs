//! stackd: one daemon serving stacks and cluster pools to many tenant API servers.
pub mod api;
pub mod bench;
pub mod bounds;
pub mod context;
pub mod daemon;
pub mod dev;
pub mod embedded;
pub mod host;
pub mod inventory;
pub mod package;
pub mod pools;
pub mod runtime;
pub mod stacks;
pub mod tenancy;

// mimalloc, not glibc's malloc: allocation and freeing were a fifth of the daemon's CPU over 50
// installs (every watch event, request and reconcile builds and drops many small values); with it
// the daemon's CPU per install fell by a fifth and its RSS at rest stopped creeping (BENCHMARKS.md,
// issue 32). Declared here so that every binary built on the library has it: the daemon, the bench's
// and the tests' embedded API servers. Built without transparent huge pages, which cost 18 % more
// RSS at 1,000 tenants.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[cfg(test)]
mod module_layers;
