//! All integration tests, as one binary: linking kube dominates build time on small machines.

mod cli;
mod crds;
mod examples;
