//! All integration tests, as one binary: linking kube dominates build time on small machines.

mod bench;
mod charts;
mod cli;
mod crds;
mod daemon;
mod dev;
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
mod harness;
mod inventory;
mod kubectl;
mod pools;
mod recovery;
mod stacks_install;
mod stacks_stack;
mod sweep;
