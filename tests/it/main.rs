//! All integration tests, as one binary: linking kube dominates build time on small machines.

mod cli;
mod crds;
mod embedded_core;
mod embedded_crd;
mod embedded_gc;
mod embedded_patch;
mod embedded_surface;
mod embedded_watch;
mod examples;
mod harness;
mod kubectl;
