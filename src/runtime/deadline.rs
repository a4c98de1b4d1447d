//! Waiting for a deadline that may not be set, as one branch of a `select!`.

use tokio::time::Instant;

/// Sleeps until `deadline`; with none, never wakes (the branch never fires).
pub async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}
