//! All integration tests, as one binary (linking kube once).

mod embedded_core;
mod embedded_crd;
mod embedded_derive;
mod embedded_gc;
mod embedded_watch;
mod harness;
