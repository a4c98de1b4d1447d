//! A panic in one reconcile fails that object only: it becomes the reconcile's error (logged,
//! retried with the object's backoff), never a tenant restart that would stop every other object
//! and controller of the tenant with it.

use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;

use futures::FutureExt;

/// A reconcile that panicked, with the panic's message.
#[derive(Debug, thiserror::Error)]
#[error("the reconcile panicked (a stackd bug; please report it): {0}")]
pub struct ReconcilePanic(pub String);

/// Runs `reconcile`, turning a panic in it into its error.
pub async fn contain<T, E>(reconcile: impl Future<Output = Result<T, E>>) -> Result<T, E>
where
    E: From<ReconcilePanic>,
{
    match AssertUnwindSafe(reconcile).catch_unwind().await {
        Ok(result) => result,
        Err(payload) => Err(ReconcilePanic(message(payload)).into()),
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
    async fn a_panicking_reconcile_returns_an_error_naming_the_panic() {
        let result: Result<(), Failed> = contain(async { panic!("index out of bounds") }).await;
        let Err(Failed(message)) = result else {
            panic!("the panic was not contained");
        };
        assert!(message.contains("index out of bounds"), "{message}");
    }

    #[tokio::test]
    async fn a_reconcile_that_returns_is_passed_through() {
        let result: Result<u8, Failed> = contain(async { Ok(7) }).await;
        assert_eq!(result.unwrap(), 7);
    }
}
