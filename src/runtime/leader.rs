//! Optional leader election on a `coordination.k8s.io` Lease in the host cluster: only the holder
//! runs controllers, and losing the lease stops them (crash-only, the pod restarts).
//!
//! kube-lease-manager renews the lease but only logs a failed renewal: a daemon cut off from the
//! host would go on acting on its tenants (other API servers) after a standby took over. So the
//! holder also keeps a local renew deadline, read from the renewals it sees stored in the Lease:
//! when the deadline passes without one, leadership counts as lost, before others may take it.

use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use kube_lease_manager::{LeaseManagerBuilder, LeaseParams};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;
use tracing::error;

use super::recovery::WatchBackoff;

/// Where and how long the lease is held.
#[derive(Clone, Debug)]
pub struct LeaderElectionSettings {
    pub namespace: String,
    pub lease_name: String,
    /// Unique per daemon process (pod name and a random suffix).
    pub identity: String,
    /// Seconds a lease stays valid without renewal.
    pub duration_seconds: u64,
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
}

/// A held lease. Dropping it releases the lease so a standby can take over at once.
pub struct Leadership {
    state: watch::Receiver<bool>,
    /// The latest renewal time of ours stored in the Lease.
    renewed: watch::Receiver<Option<jiff::Timestamp>>,
    renew_deadline: Duration,
    _renewals: AbortOnDropHandle<()>,
}

impl Leadership {
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
    let mut events = std::pin::pin!(watcher::watcher(api, config).backoff(WatchBackoff::default()));
    while let Some(event) = events.next().await {
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
    client: Client,
    settings: &LeaderElectionSettings,
    cancel: &CancellationToken,
) -> Result<Option<Leadership>, LeaderError> {
    if settings.duration_seconds < 2 {
        return Err(LeaderError::Duration(settings.duration_seconds));
    }
    let manager = LeaseManagerBuilder::new(client.clone(), &settings.lease_name)
        .with_namespace(&settings.namespace)
        .with_parameters(LeaseParams::new(
            &settings.identity,
            settings.duration_seconds,
            settings.grace_seconds(),
        ))
        .build()
        .await
        .map_err(|e| LeaderError::Lease(e.to_string()))?;
    let (renewed_tx, mut renewed) = watch::channel(None);
    let api = Api::namespaced(client, &settings.namespace);
    let renewals = AbortOnDropHandle::new(tokio::spawn(watch_renewals(api, settings.clone(), renewed_tx)));
    let (mut state, _task) = manager.watch().await;
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
                _renewals: renewals,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(duration_seconds: u64) -> LeaderElectionSettings {
        LeaderElectionSettings {
            namespace: "stackd-system".to_string(),
            lease_name: "stackd-leader".to_string(),
            identity: "a".to_string(),
            duration_seconds,
        }
    }

    #[test]
    fn a_renewal_is_due_early_enough_to_be_retried_before_the_renew_deadline() {
        for duration in 2..=120 {
            let settings = settings(duration);
            let grace = settings.grace_seconds();
            assert!(grace > 0 && grace < duration, "kube-lease-manager needs 0 < grace < duration");
            let due = Duration::from_secs(duration - grace);
            let window = settings.renew_deadline() - due;
            let lease = Duration::from_secs(duration);
            assert!(window >= lease / 3, "a {duration} s lease leaves a renewal only {window:?}");
        }
    }
}
