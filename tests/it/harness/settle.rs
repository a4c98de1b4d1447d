//! Waiting until the daemon has acted on a change and stopped, so that a test may then check that
//! nothing (more) happened: the reconciles after the change have finished and the API servers saw
//! no write for a moment. This replaces "sleep, then check": the daemon provably had its chance.
//! It reads the daemon's reconcile counters (`stackd_reconcile_duration_seconds_count`, per tenant
//! and controller) and the embedded servers' request counters; a test that changes one object of a
//! controller takes the mark just before the change.

use std::time::{Duration, Instant};

use stackd::embedded::counters::RequestCounts;
use stackd::embedded::{ApiServer, Verb};

use super::Daemon;

/// How long the servers must see no write, and the controllers finish no reconcile, to count as
/// settled. Follow-up writes of a reconcile come within milliseconds of it on an idle machine.
const QUIET: Duration = Duration::from_millis(400);

/// How long the reconciles after a change, and then the quiet, may take.
const SETTLE_WITHIN: Duration = Duration::from_secs(30);

const POLL: Duration = Duration::from_millis(50);

/// How many reconciles some controllers had finished at one moment: taken before a change, so that
/// [`settled`] can tell that each ran after it.
pub(crate) struct Reconciles {
    counts: Vec<(String, String, u64)>,
}

impl Daemon {
    /// The reconciles `controllers` (tenant, controller) have finished so far.
    pub(crate) fn reconciles(&self, controllers: &[(&str, &str)]) -> Reconciles {
        let counts = controllers
            .iter()
            .map(|(tenant, controller)| {
                let done = self.reconciles_done(tenant, controller);
                (tenant.to_string(), controller.to_string(), done)
            })
            .collect();
        Reconciles { counts }
    }

    fn reconciles_since(&self, mark: &Reconciles) -> Vec<u64> {
        mark.counts
            .iter()
            .map(|(tenant, controller, before)| self.reconciles_done(tenant, controller).saturating_sub(*before))
            .collect()
    }
}

/// Waits until every controller of `since` finished a reconcile after `since` was taken, then
/// until `servers` saw no write (leader and shard Leases aside: they are renewed on a clock) and
/// those controllers finished no reconcile for [`QUIET`]. Fails with the daemon's log otherwise.
pub(crate) async fn settled(daemon: &Daemon, since: &Reconciles, servers: &[&ApiServer]) {
    let deadline = Instant::now() + SETTLE_WITHIN;
    while daemon.reconciles_since(since).contains(&0) {
        assert!(
            Instant::now() < deadline,
            "no reconcile after the change of {:?} within {SETTLE_WITHIN:?}; daemon log:\n{}",
            since.counts,
            daemon.log_text()
        );
        tokio::time::sleep(POLL).await;
    }
    quiet_by(daemon, since, servers, deadline).await;
}

/// Waits until `servers` saw no write and the controllers of `since` finished no reconcile for
/// [`QUIET`], without first requiring a reconcile: for a change the daemon has visibly acted on
/// already, whose last writes (Events, say) may still be under way.
pub(crate) async fn quiet(daemon: &Daemon, since: &Reconciles, servers: &[&ApiServer]) {
    quiet_by(daemon, since, servers, Instant::now() + SETTLE_WITHIN).await;
}

async fn quiet_by(daemon: &Daemon, since: &Reconciles, servers: &[&ApiServer], deadline: Instant) {
    let mut window = Window::open(daemon, since, servers);
    loop {
        tokio::time::sleep(POLL).await;
        let (writes, reconciled) = window.changes(daemon, since, servers);
        if !writes.is_empty() || reconciled {
            assert!(
                Instant::now() < deadline,
                "the daemon never settled within {SETTLE_WITHIN:?}: still writing {writes:?}; daemon log:\n{}",
                daemon.log_text()
            );
            window = Window::open(daemon, since, servers);
        } else if window.opened.elapsed() >= QUIET {
            return;
        }
    }
}

/// The counters at the start of a quiet window.
struct Window {
    opened: Instant,
    requests: Vec<RequestCounts>,
    reconciles: Vec<u64>,
}

impl Window {
    fn open(daemon: &Daemon, since: &Reconciles, servers: &[&ApiServer]) -> Window {
        Window {
            opened: Instant::now(),
            requests: servers.iter().map(|s| s.counters()).collect(),
            reconciles: daemon.reconciles_since(since),
        }
    }

    /// The writes since the window opened, and whether a reconcile finished.
    fn changes(&self, daemon: &Daemon, since: &Reconciles, servers: &[&ApiServer]) -> (Vec<String>, bool) {
        let writes = servers
            .iter()
            .zip(&self.requests)
            .flat_map(|(server, before)| writes(&server.counters().since(before)))
            .collect();
        (writes, daemon.reconciles_since(since) != self.reconciles)
    }
}

/// The writes among `counts`, as "verb resource in namespace xN", Leases left out.
fn writes(counts: &RequestCounts) -> Vec<String> {
    counts
        .counts
        .iter()
        .filter(|(key, n)| {
            **n > 0
                && key.resource.split('.').next() != Some("leases")
                && matches!(
                    key.verb,
                    Verb::Create | Verb::Update | Verb::Patch | Verb::Delete | Verb::DeleteCollection
                )
        })
        .map(|(key, n)| format!("{} {} in {:?} x{n}", key.verb.as_str(), key.resource, key.namespace))
        .collect()
}
