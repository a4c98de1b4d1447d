//! Optional leader election on a `coordination.k8s.io` Lease in the host cluster: only the holder
//! runs controllers, and losing the lease stops them (crash-only, the pod restarts).
//!
//! kube-lease-manager renews the lease but only logs a failed renewal: a daemon cut off from the
//! host would go on acting on its tenants (other API servers) after a standby took over. So the
//! holder also keeps a local renew deadline, read from the renewals it sees stored in the Lease:
//! when the deadline passes without one, leadership counts as lost, before others may take it.
//!
//! The lease is kept on a thread of its own, with its own runtime and host connection. Tokio does
//! not preempt tasks: while a new leader starts hundreds of tenants, a renewal due on the shared
//! runtime waits behind their work, and a healthy leader would give up its lease to its own load.

use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use kube::runtime::watcher;
use kube::{Api, Client};
use kube_lease_manager::{LeaseManagerBuilder, LeaseParams};
use tokio::sync::{oneshot, watch};
use tokio_util::sync::CancellationToken;
use tracing::error;

use super::recovery::{WatchBackoff, retry_watch};
use crate::runtime::api_errors::is_not_found;

/// Where and how long the lease is held.
#[derive(Clone, Debug)]
pub struct LeaderElectionSettings {
    pub namespace: String,
    pub lease_name: String,
    /// Unique per daemon process (pod name and a random suffix).
    pub identity: String,
    /// Seconds a lease stays valid without renewal.
    pub duration_seconds: u64,
    /// How to reach the host: the lease gets a connection of its own.
    pub host: kube::Config,
}

impl LeaderElectionSettings {
    /// Renewal starts this long before expiry, so that it is due a third of the duration (rounded
    /// up) after the last one. Renewing only near expiry left a renewal a sixth of the lease to be
    /// stored: on a loaded host a new leader's first renewal, made while its tenants start, took
    /// longer, and a healthy leader gave up. Renewing early gives a renewal half the lease, and a
    /// failed one time to be retried, as client-go's retry period does within its renew deadline.
    fn grace_seconds(&self) -> u64 {
        self.duration_seconds - self.duration_seconds.div_ceil(3)
    }

    /// How long after its last stored renewal the holder still counts itself leader: the lease
    /// duration less a sixth, which leaves that sixth to stop every tenant before a standby may
    /// take the lease.
    pub fn renew_deadline(&self) -> Duration {
        let duration = Duration::from_secs(self.duration_seconds);
        duration - duration / 6
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LeaderError {
    #[error("leader election needs a lease duration of at least 2 seconds, not {0}")]
    Duration(u64),
    #[error("leader election failed: {0}")]
    Lease(String),
    #[error(
        "leader election failed: the namespace {0} of the leader Lease does not exist on the host; create it, or pass --leader-elect-namespace with one that does"
    )]
    NoNamespace(String),
    #[error("cannot start the leader lease's thread: {0}")]
    Thread(std::io::Error),
}

/// A held lease. Dropping it (or [`Leadership::release`]) releases the lease so a standby can
/// take over at once.
pub struct Leadership {
    state: watch::Receiver<bool>,
    /// The latest renewal time of ours stored in the Lease.
    renewed: watch::Receiver<Option<jiff::Timestamp>>,
    renew_deadline: Duration,
    /// Ends when the lease thread has released the lease and stopped.
    stopped: oneshot::Receiver<()>,
}

impl Leadership {
    /// Releases the lease and waits (a few seconds at most) until the host was told, so that a
    /// process exiting next does not leave its standbys waiting out the lease.
    pub async fn release(self) {
        let Leadership {
            state,
            renewed,
            stopped,
            ..
        } = self;
        drop((state, renewed));
        let _ = tokio::time::timeout(Duration::from_secs(5), stopped).await;
    }

    /// Resolves when the lease is lost (or its manager stopped), or when the renew deadline
    /// passes without a renewal stored in the Lease.
    pub async fn lost(&mut self) {
        loop {
            if !*self.state.borrow() {
                return;
            }
            let left = self.time_left();
            if left.is_zero() {
                error!(deadline = ?self.renew_deadline, "the leader lease was not renewed within its renew deadline");
                return;
            }
            tokio::select! {
                changed = self.state.changed() => if changed.is_err() { return },
                changed = self.renewed.changed() => if changed.is_err() { return },
                _ = tokio::time::sleep(left) => {}
            }
        }
    }

    fn time_left(&self) -> Duration {
        let Some(renewed) = *self.renewed.borrow() else {
            return Duration::ZERO;
        };
        let since = jiff::Timestamp::now().duration_since(renewed);
        let since = Duration::try_from(since).unwrap_or(Duration::ZERO);
        self.renew_deadline.saturating_sub(since)
    }
}

/// Our renewal times as stored in the Lease, from a watch of that one Lease: only a renewal the
/// server stored extends the deadline, whatever the lease manager believes.
async fn watch_renewals(
    api: Api<Lease>,
    settings: LeaderElectionSettings,
    renewed: watch::Sender<Option<jiff::Timestamp>>,
) {
    let config = watcher::Config::default().fields(&format!("metadata.name={}", settings.lease_name));
    let mut events = retry_watch(watcher::watcher(api, config).boxed(), None, WatchBackoff::default());
    loop {
        let event = tokio::select! {
            _ = renewed.closed() => return,
            event = events.next() => match event {
                Some(event) => event,
                None => return,
            },
        };
        let lease = match event {
            Ok(watcher::Event::Apply(lease) | watcher::Event::InitApply(lease)) => lease,
            _ => continue,
        };
        let spec = lease.spec.unwrap_or_default();
        if spec.holder_identity.as_deref() != Some(settings.identity.as_str()) {
            continue;
        }
        if let Some(time) = spec.renew_time.or(spec.acquire_time) {
            renewed.send_if_modified(|latest| {
                let newer = latest.is_none_or(|at| at < time.0);
                if newer {
                    *latest = Some(time.0);
                }
                newer
            });
        }
    }
}

/// Waits until this process holds the lease; `Ok(None)` if `cancel` fires first.
pub async fn acquire(
    settings: &LeaderElectionSettings,
    cancel: &CancellationToken,
) -> Result<Option<Leadership>, LeaderError> {
    if settings.duration_seconds < 2 {
        return Err(LeaderError::Duration(settings.duration_seconds));
    }
    let (started_tx, started) = oneshot::channel();
    let (stopped_tx, stopped) = oneshot::channel();
    let thread_settings = settings.clone();
    std::thread::Builder::new()
        .name("leader-lease".to_string())
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(runtime) => runtime,
                Err(err) => {
                    let _ = started_tx.send(Err(LeaderError::Lease(format!("no runtime for the lease: {err}"))));
                    return;
                }
            };
            runtime.block_on(keep_lease(thread_settings, started_tx));
            let _ = stopped_tx.send(());
        })
        .map_err(LeaderError::Thread)?;
    let (mut state, mut renewed) = started
        .await
        .map_err(|_| LeaderError::Lease("the lease thread stopped".to_string()))??;
    loop {
        if *state.borrow_and_update() {
            // The deadline runs from the acquisition as the server stored it.
            let stored = tokio::time::timeout(settings.renew_deadline(), renewed.wait_for(Option::is_some))
                .await
                .is_ok_and(|seen| seen.is_ok());
            if !stored {
                return Err(LeaderError::Lease(
                    "the acquired lease was not seen stored on the host within its renew deadline".to_string(),
                ));
            }
            return Ok(Some(Leadership {
                state,
                renewed,
                renew_deadline: settings.renew_deadline(),
                stopped,
            }));
        }
        tokio::select! {
            _ = cancel.cancelled() => return Ok(None),
            changed = state.changed() => {
                if changed.is_err() {
                    return Err(LeaderError::Lease("the lease manager stopped".to_string()));
                }
            }
        }
    }
}

type LeaseChannels = (watch::Receiver<bool>, watch::Receiver<Option<jiff::Timestamp>>);

/// On the lease thread: contends for the lease and renews it, and watches the renewals stored,
/// until the receivers of both are dropped; then releases the lease.
async fn keep_lease(settings: LeaderElectionSettings, started: oneshot::Sender<Result<LeaseChannels, LeaderError>>) {
    let client = match Client::try_from(settings.host.clone()) {
        Ok(client) => client,
        Err(err) => {
            let _ = started.send(Err(LeaderError::Lease(format!("no client for the lease: {err}"))));
            return;
        }
    };
    let manager = LeaseManagerBuilder::new(client.clone(), &settings.lease_name)
        .with_namespace(&settings.namespace)
        .with_parameters(LeaseParams::new(
            &settings.identity,
            settings.duration_seconds,
            settings.grace_seconds(),
        ))
        .build()
        .await;
    let manager = match manager {
        Ok(manager) => manager,
        // The manager creates the Lease when it is missing: a 404 then says the namespace is.
        Err(kube_lease_manager::LeaseManagerError::KubeError(err)) if is_not_found(&err) => {
            let _ = started.send(Err(LeaderError::NoNamespace(settings.namespace.clone())));
            return;
        }
        Err(err) => {
            let _ = started.send(Err(LeaderError::Lease(err.to_string())));
            return;
        }
    };
    let (renewed_tx, renewed) = watch::channel(None);
    let api = Api::namespaced(client, &settings.namespace);
    let renewals = tokio::spawn(watch_renewals(api, settings, renewed_tx));
    let (state, manager_task) = manager.watch().await;
    if started.send(Ok((state, renewed))).is_err() {
        renewals.abort();
    }
    // The manager releases the lease once its receiver is gone.
    let _ = manager_task.await;
    let _ = renewals.await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(duration_seconds: u64) -> LeaderElectionSettings {
        LeaderElectionSettings {
            namespace: "stackd-system".to_string(),
            lease_name: "stackd-leader".to_string(),
            identity: "a".to_string(),
            duration_seconds,
            host: kube::Config::new("https://127.0.0.1:6443".parse().expect("a URL")),
        }
    }

    #[test]
    fn a_renewal_is_due_early_enough_to_be_retried_before_the_renew_deadline() {
        for duration in 2..=120 {
            let settings = settings(duration);
            let grace = settings.grace_seconds();
            assert!(
                grace > 0 && grace < duration,
                "kube-lease-manager needs 0 < grace < duration"
            );
            let due = Duration::from_secs(duration - grace);
            let window = settings.renew_deadline() - due;
            let lease = Duration::from_secs(duration);
            assert!(
                window >= lease / 3,
                "a {duration} s lease leaves a renewal only {window:?}"
            );
        }
    }
}
