//! Sharding (`stackd run --shards`): the replicas share the tenants, each of R replicas serving
//! ⌊N/R⌋ or ⌈N/R⌉ of the N tenants, and no tenant ever served by two.
//!
//! Replicas coordinate only through objects in `--shard-namespace`. Each keeps a member Lease
//! (`stackd-member-<identity>`): while it renews it in time, it may serve what the shard map gives
//! it. The shard map (the ConfigMap `stackd-shard-map`, see [`assign`]) names each tenant's owner,
//! written with optimistic concurrency: the coordinator (the live replica with the least identity)
//! places new tenants, asks replicas over their share to hand tenants over, and gives away the
//! tenants of a replica whose member Lease it deleted once it had expired; an owner hands a tenant
//! over only after it stopped it. The Leases are kept on a thread of their own with its own
//! runtime and host connection, as the leader lease is (`runtime::leader`): tenant load must not
//! delay a renewal.
//!
//! Timing follows `runtime::leader`: the member Lease is renewed 5/9 of the lease duration after
//! its last renewal, and this replica stops serving at its renew deadline (the duration less a
//! sixth), measured from the moment the renewal was *sent*, so that another replica, which counts
//! the duration from when it *saw* the renewal, can delete the Lease only after the holder's
//! tenants are gone. The [`Board`] is where the lease thread and the daemon meet: a tenant is
//! handed over only once the daemon says it no longer runs it, and the daemon starts a tenant
//! only while the board says it is this replica's, both decided under one lock.

pub mod assign;
mod keeper;
pub mod status;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Notify, oneshot};
use tokio::time::Instant;

/// Label on every Lease of the sharding scheme: `member` (and `slot` on those of stackd before
/// the shard map, which replicas of this version wait out).
pub const LEASE_ROLE_LABEL: &str = "stackd.dev/shard-lease";
/// Annotation on member Leases: `map` for this scheme (stackd before it wrote its slot count,
/// and holds no slot while a live replica announces another).
pub const SHARDS_ANNOTATION: &str = "stackd.dev/shards";
/// The value of [`SHARDS_ANNOTATION`] this scheme writes.
pub const MAP_SCHEME: &str = "map";
/// The ConfigMap holding the shard map.
pub const MAP_NAME: &str = "stackd-shard-map";
/// The key of the map in it.
pub const MAP_KEY: &str = "map.json";

/// Name of a replica's member Lease.
pub fn member_lease_name(identity: &str) -> String {
    format!("stackd-member-{identity}")
}

/// How this replica takes part.
#[derive(Clone, Debug)]
pub struct ShardSettings {
    pub namespace: String,
    /// Unique per daemon process (pod name and a random suffix).
    pub identity: String,
    /// Seconds a Lease stays valid without renewal.
    pub duration_seconds: u64,
    /// How to reach the host: the Leases get a connection of their own.
    pub host: kube::Config,
}

impl ShardSettings {
    pub fn duration(&self) -> Duration {
        Duration::from_secs(self.duration_seconds)
    }

    /// A renewal is due this long after the last one: 1.8 writes per lease duration, and still
    /// over a quarter of the duration (with retries) for a renewal to be stored before the
    /// renew deadline.
    pub fn renew_interval(&self) -> Duration {
        self.duration() * 5 / 9
    }

    /// How long a replica waits for the others' member Leases before it coordinates, so that
    /// replicas started together are placed together instead of one after the other.
    pub fn settle(&self) -> Duration {
        self.duration() / 6
    }

    /// How long after a renewal was sent this replica may still serve.
    pub fn renew_deadline(&self) -> Duration {
        self.duration() - self.duration() / 6
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    #[error("sharding needs a lease duration of at least 3 seconds")]
    Settings,
    #[error("cannot start the shard leases' thread: {0}")]
    Thread(std::io::Error),
    #[error("no client for the shard leases: {0}")]
    Client(String),
}

/// What this replica serves and what it sees of the others.
#[derive(Clone, Debug, Default)]
pub struct Table {
    /// Set by the lease thread: until when this replica may serve (its member Lease's renew
    /// deadline); `None` while it has no Lease it renewed in time.
    pub alive_until: Option<Instant>,
    /// Set by the lease thread: the tenants the shard map gives this replica.
    pub assigned: BTreeSet<String>,
    /// Set by the lease thread: of those, the ones to stop and hand over.
    pub releasing: BTreeSet<String>,
    /// Set by the daemon before it starts a tenant, cleared once it stopped it: a tenant in here
    /// is never handed over.
    pub running: BTreeSet<String>,
    /// Set by the daemon once its sources were first read: every tenant it knows of, which the
    /// coordinator places.
    pub known: Option<BTreeSet<String>>,
    /// Live replicas, this one included.
    pub live: usize,
    /// Tenants this replica knows of that no live replica owns.
    pub unserved: usize,
    /// Why this replica serves nothing although its Lease is renewed, if it does not.
    pub waiting: Option<String>,
}

impl Table {
    /// Whether `tenant` may run here now.
    pub fn may_run(&self, tenant: &str, now: Instant) -> bool {
        self.alive_until.is_some_and(|until| until > now)
            && self.assigned.contains(tenant)
            && !self.releasing.contains(tenant)
    }

    /// Whether this replica serves `tenant` now: it may, and the daemon runs it.
    pub fn serves(&self, tenant: &str, now: Instant) -> bool {
        self.may_run(tenant, now) && self.running.contains(tenant)
    }
}

/// Shared between the lease thread and the daemon.
#[derive(Default)]
pub struct Board {
    table: Mutex<Table>,
    /// The lease thread changed the table.
    pub to_daemon: Notify,
    /// The daemon stopped a tenant, or its tenants changed.
    pub to_keeper: Notify,
}

impl Board {
    pub fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn snapshot(&self) -> Table {
        self.lock().clone()
    }
}

/// The running lease thread.
pub struct Shards {
    pub board: Arc<Board>,
    pub settings: ShardSettings,
    shutdown: Option<oneshot::Sender<()>>,
    stopped: oneshot::Receiver<()>,
    /// The lease thread has ended (`stopped` resolved).
    ended: bool,
}

impl Shards {
    /// Starts the lease thread: it registers this replica and serves what the map gives it.
    pub fn start(settings: ShardSettings) -> Result<Shards, ShardError> {
        if settings.duration_seconds < 3 {
            return Err(ShardError::Settings);
        }
        let board = Arc::new(Board::default());
        let (shutdown_tx, shutdown) = oneshot::channel();
        let (stopped_tx, stopped) = oneshot::channel();
        let thread_board = board.clone();
        let thread_settings = settings.clone();
        std::thread::Builder::new()
            .name("shard-leases".to_string())
            .spawn(move || {
                keeper::run_thread(thread_settings, thread_board, shutdown);
                let _ = stopped_tx.send(());
            })
            .map_err(ShardError::Thread)?;
        Ok(Shards {
            board,
            settings,
            shutdown: Some(shutdown_tx),
            stopped,
            ended: false,
        })
    }

    /// Resolves if the lease thread ends on its own (it could not start its runtime or host
    /// client): this replica can then serve nothing, and should exit rather than idle.
    pub async fn ended(&mut self) {
        if !self.ended {
            let _ = (&mut self.stopped).await;
            self.ended = true;
        }
    }

    /// Hands over every tenant the daemon no longer runs and deletes the member Lease, and waits
    /// (a few seconds at most) until the host was told, so that the others take over at once.
    pub async fn release(mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        if !self.ended {
            let _ = tokio::time::timeout(Duration::from_secs(5), &mut self.stopped).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(duration_seconds: u64) -> ShardSettings {
        ShardSettings {
            namespace: "stackd-system".to_string(),
            identity: "a".to_string(),
            duration_seconds,
            host: kube::Config::new("https://127.0.0.1:6443".parse().expect("a URL")),
        }
    }

    #[test]
    fn a_member_lease_is_written_under_twice_a_lease_duration_with_time_left_to_retry_and_to_stop() {
        for duration in 3..=120 {
            let settings = settings(duration);
            let lease = settings.duration();
            let writes = lease.as_secs_f64() / settings.renew_interval().as_secs_f64();
            assert!(
                writes < 2.0,
                "a {duration} s lease is written {writes} times per duration"
            );
            let to_store = settings.renew_deadline() - settings.renew_interval();
            assert!(
                to_store >= lease / 4,
                "a {duration} s lease leaves a renewal only {to_store:?}"
            );
            let to_stop = lease - settings.renew_deadline();
            assert!(
                to_stop >= lease / 6,
                "a {duration} s lease leaves only {to_stop:?} to stop tenants"
            );
            assert!(settings.settle() < settings.renew_interval());
        }
    }

    #[test]
    fn a_tenant_may_run_only_while_assigned_not_handed_over_and_before_the_deadline() {
        let now = Instant::now();
        let mut table = Table {
            alive_until: Some(now + Duration::from_secs(1)),
            assigned: BTreeSet::from(["a".to_string(), "b".to_string()]),
            releasing: BTreeSet::from(["b".to_string()]),
            ..Table::default()
        };
        assert!(table.may_run("a", now));
        assert!(!table.may_run("b", now), "being handed over");
        assert!(!table.may_run("c", now), "not assigned");
        assert!(!table.serves("a", now), "not running yet");
        table.running.insert("a".to_string());
        assert!(table.serves("a", now));
        assert!(!table.may_run("a", now + Duration::from_secs(1)), "past the deadline");
        table.alive_until = None;
        assert!(!table.may_run("a", now));
    }
}
