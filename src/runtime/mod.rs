//! What every controller shares: the controller scaffold, the tenant's shared caches, metrics, health,
//! the admin server, backoff, leader election.

pub mod admin;
pub mod api_errors;
pub mod backoff;
pub mod cache;
pub mod cause;
pub mod conditions;
pub mod controller;
pub mod deadline;
pub mod events;
pub mod finalizer;
pub mod health;
pub mod informers;
pub mod leader;
pub mod memory_budget;
pub mod metrics;
pub mod panics;
pub mod parse_error;
pub mod raw_object;
pub mod reachability;
pub mod readiness;
pub mod recovery;
pub mod retry;
pub mod shards;
pub mod shutdown;
pub mod startup;
pub mod status_writer;
pub mod text_bounds;
pub mod transport;
pub mod untrusted_kubeconfig;
pub mod untrusted_server;
pub mod written;
