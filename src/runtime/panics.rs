//! A panic in one reconcile fails that object only: it becomes the reconcile's error (logged,
//! retried with the object's backoff), never a tenant restart that would stop every other object
//! and controller of the tenant with it.

use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;

use futures::FutureExt;
use tracing::error;

/// A reconcile that panicked. Its text may reach conditions and Events, so it carries no panic
/// message (which can quote what the reconcile was reading); the daemon log has that.
#[derive(Debug, thiserror::Error)]
#[error("the reconcile panicked (a stackd bug; the daemon log has the details, please report it)")]
pub struct ReconcilePanic;

/// Runs `reconcile`, turning a panic in it into its error.
pub async fn contain<T, E>(reconcile: impl Future<Output = Result<T, E>>) -> Result<T, E>
where
    E: From<ReconcilePanic>,
{
    match AssertUnwindSafe(reconcile).catch_unwind().await {
        Ok(result) => result,
        Err(payload) => {
            error!(panic = %message(payload), "a reconcile panicked; that object is retried with backoff");
            Err(ReconcilePanic.into())
        }
    }
}

/// The text a panic was raised with.
pub fn message(payload: Box<dyn Any + Send>) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Failed(String);

    impl From<ReconcilePanic> for Failed {
        fn from(panic: ReconcilePanic) -> Self {
            Failed(panic.to_string())
        }
    }

    #[tokio::test]
    async fn a_panicking_reconcile_returns_an_error_without_the_panic_text() {
        let result: Result<(), Failed> = contain(async { panic!("token s3cr3t in a message") }).await;
        let Err(Failed(message)) = result else {
            panic!("the panic was not contained");
        };
        assert!(message.contains("panicked"), "{message}");
        assert!(!message.contains("s3cr3t"), "{message}");
    }

    #[tokio::test]
    async fn a_reconcile_that_returns_is_passed_through() {
        let result: Result<u8, Failed> = contain(async { Ok(7) }).await;
        assert_eq!(result.unwrap(), 7);
    }
}
