//! Sharding (`stackd run --shards N`): tenants map to N slots by a stable hash of their name, each
//! slot is a `coordination.k8s.io` Lease `stackd-shard-<i>` on the host, and a replica runs a
//! tenant only while it holds the tenant's slot.
//!
//! Replicas coordinate only through Leases: each keeps a member Lease (`stackd-member-<identity>`)
//! so that the others can count the live replicas, and holds at most its fair share of slot Leases
//! (`ceil(N / live)`), taking free or expired ones and giving up its least preferred extras when a
//! replica joins. The Leases are kept on a thread of their own with its own runtime and host
//! connection, as the leader lease is (`runtime::leader`): tenant load must not delay a renewal.
//!
//! Timing follows `runtime::leader`, with fewer writes: a held slot is renewed 5/9 of the lease
//! duration after its last renewal (under 2 writes per slot per lease duration, which matters with
//! dozens of slots), and counts as lost at a local renew deadline (the duration less a sixth),
//! measured from the moment the renewal was *sent*, so that another replica, which counts the
//! duration from when it *saw* the renewal, can take the slot only after the holder's tenants are
//! gone. The [`Board`] is where the lease thread and the daemon meet: a slot is released only once
//! the daemon says it runs none of the slot's tenants, and the daemon starts a slot's tenants only
//! while the board says the slot is held, both decided under one lock.

pub mod assign;
mod keeper;
pub mod status;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Notify, oneshot};
use tokio::time::Instant;

pub use assign::slot_of;

/// Label on every Lease of the sharding scheme: `member` or `slot`.
pub const LEASE_ROLE_LABEL: &str = "stackd.dev/shard-lease";
/// Annotation on member Leases: the replica's `--shards`.
pub const SHARDS_ANNOTATION: &str = "stackd.dev/shards";

/// Name of slot `slot`'s Lease.
pub fn slot_lease_name(slot: u32) -> String {
    format!("stackd-shard-{slot}")
}

/// Name of a replica's member Lease.
pub fn member_lease_name(identity: &str) -> String {
    format!("stackd-member-{identity}")
}

/// How this replica takes part.
#[derive(Clone, Debug)]
pub struct ShardSettings {
    /// The slot count (`--shards`); every replica must use the same.
    pub shards: u32,
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

    /// How long a new replica waits for the others' member Leases before taking slots, so that
    /// replicas started together do not each take everything and give most of it back.
    pub fn settle(&self) -> Duration {
        self.duration() / 6
    }

    /// How long after a renewal was sent the slot still counts as held.
    pub fn renew_deadline(&self) -> Duration {
        self.duration() - self.duration() / 6
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    #[error("sharding needs --shards of at least 1 and a lease duration of at least 3 seconds")]
    Settings,
    #[error("cannot start the shard leases' thread: {0}")]
    Thread(std::io::Error),
    #[error("no client for the shard leases: {0}")]
    Client(String),
}

/// What the lease thread knows of a slot it holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotLease {
    /// Held until `deadline` unless renewed.
    Held { deadline: Instant },
    /// Held, and to be given up once the daemon runs none of its tenants.
    Releasing { deadline: Instant },
    /// Not renewed in time: the daemon must stop its tenants at once.
    Lost,
}

impl SlotLease {
    /// Whether the slot's tenants may run now.
    pub fn may_serve(&self, now: Instant) -> bool {
        match self {
            SlotLease::Held { deadline } | SlotLease::Releasing { deadline } => *deadline > now,
            SlotLease::Lost => false,
        }
    }

    pub fn deadline(&self) -> Option<Instant> {
        match self {
            SlotLease::Held { deadline } | SlotLease::Releasing { deadline } => Some(*deadline),
            SlotLease::Lost => None,
        }
    }
}

/// One slot on the board.
#[derive(Clone, Copy, Debug)]
pub struct Slot {
    pub lease: SlotLease,
    /// Set by the daemon before it starts any of the slot's tenants, cleared once none runs.
    pub serving: bool,
}

/// The slots this replica holds or is giving up, and what it sees of the others.
#[derive(Clone, Debug, Default)]
pub struct Table {
    pub slots: BTreeMap<u32, Slot>,
    /// Live replicas, this one included.
    pub live: usize,
    /// This replica's fair share.
    pub cap: usize,
}

/// Shared between the lease thread and the daemon.
#[derive(Default)]
pub struct Board {
    table: Mutex<Table>,
    /// The lease thread changed the table.
    pub to_daemon: Notify,
    /// The daemon stopped serving a slot.
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
    /// Starts the lease thread: it registers this replica and takes slots as they come free.
    pub fn start(settings: ShardSettings) -> Result<Shards, ShardError> {
        if settings.shards == 0 || settings.duration_seconds < 3 {
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
    /// client): this replica can then hold no slot, and should exit rather than idle.
    pub async fn ended(&mut self) {
        if !self.ended {
            let _ = (&mut self.stopped).await;
            self.ended = true;
        }
    }

    /// Releases every slot the daemon no longer serves and the member Lease, and waits (a few
    /// seconds at most) until the host was told, so that the others take over at once.
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
            shards: 32,
            namespace: "stackd-system".to_string(),
            identity: "a".to_string(),
            duration_seconds,
            host: kube::Config::new("https://127.0.0.1:6443".parse().expect("a URL")),
        }
    }

    #[test]
    fn a_slot_is_written_under_twice_a_lease_duration_with_time_left_to_retry_and_to_stop() {
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
    fn a_slot_may_be_served_only_while_held_and_before_its_deadline() {
        let now = Instant::now();
        let later = now + Duration::from_secs(1);
        assert!(SlotLease::Held { deadline: later }.may_serve(now));
        assert!(SlotLease::Releasing { deadline: later }.may_serve(now));
        assert!(!SlotLease::Held { deadline: now }.may_serve(now));
        assert!(!SlotLease::Lost.may_serve(now));
        assert_eq!(SlotLease::Lost.deadline(), None);
    }
}
