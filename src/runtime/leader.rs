//! Optional leader election on a `coordination.k8s.io` Lease in the host cluster: only the holder
//! runs controllers, and losing the lease stops them (crash-only, the pod restarts).

use kube::Client;
use kube_lease_manager::{LeaseManagerBuilder, LeaseParams};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

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
    /// Renewal starts this long before expiry: a third of the duration, at least one second.
    fn grace_seconds(&self) -> u64 {
        (self.duration_seconds / 3).max(1)
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
}

impl Leadership {
    /// Resolves when the lease is lost (or its manager stopped).
    pub async fn lost(&mut self) {
        while *self.state.borrow() {
            if self.state.changed().await.is_err() {
                return;
            }
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
    let manager = LeaseManagerBuilder::new(client, &settings.lease_name)
        .with_namespace(&settings.namespace)
        .with_parameters(LeaseParams::new(
            &settings.identity,
            settings.duration_seconds,
            settings.grace_seconds(),
        ))
        .build()
        .await
        .map_err(|e| LeaderError::Lease(e.to_string()))?;
    let (mut state, _task) = manager.watch().await;
    loop {
        if *state.borrow_and_update() {
            return Ok(Some(Leadership { state }));
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
