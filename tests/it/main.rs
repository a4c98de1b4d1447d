//! All integration tests, as one binary: linking kube dominates build time on small machines.

// clippy's in-tests allowance covers only `#[test]` fns and `#[cfg(test)]` modules, not the helpers
// of a test crate; a panic anywhere here is a test failure, which is what a test wants.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod bench;
mod charts;
mod cli;
mod crds;
mod daemon;
mod dev;
mod drift;
mod embedded_admission;
mod embedded_core;
mod embedded_crd;
mod embedded_derive;
mod embedded_faults;
mod embedded_gc;
mod embedded_loops;
mod embedded_patch;
mod embedded_samples;
mod embedded_surface;
mod embedded_watch;
mod examples;
mod fidelity;
mod finalizer;
mod harness;
mod host_outage;
mod inventory;
mod kubectl;
mod logs;
mod pod_troubles;
mod pools;
mod pools_seeds;
mod races;
mod recovery;
mod security_blast_radius;
mod security_fairness;
mod security_inventory;
mod security_kubeconfig;
mod security_memory;
mod security_names;
mod security_namespaces;
mod security_network;
mod security_pods;
mod security_pools;
mod security_stacks;
mod security_tenant_objects;
mod shards;
mod stacks_crossplane;
mod stacks_install;
mod stacks_pull_secrets;
mod stacks_seed_mapping;
mod stacks_stack;
mod sweep;
mod tenant_objects;
mod transport;
