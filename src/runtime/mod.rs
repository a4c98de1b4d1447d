//! What every controller shares: metrics, health, the admin server, backoff, leader election.

pub mod admin;
pub mod api_errors;
pub mod backoff;
pub mod cache;
pub mod cause;
pub mod conditions;
pub mod health;
pub mod leader;
pub mod metrics;
pub mod panics;
pub mod parse_error;
pub mod readiness;
pub mod recovery;
pub mod retry;
pub mod shards;
pub mod shutdown;
pub mod untrusted_kubeconfig;
