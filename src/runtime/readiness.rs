//! Waiting for reflector caches to be filled, from any number of tasks at once.
//!
//! `Store::wait_until_ready` keeps only the last waiter's waker (a oneshot receiver behind a
//! mutex), so reconciles that wait on it concurrently can sleep forever. One task awaits the stores
//! instead and publishes the result on a watch channel, which wakes every waiter.

use std::future::Future;

use tokio::sync::watch;

/// Resolves for every waiter once the caches it was made from are filled.
#[derive(Clone, Debug)]
pub struct Readiness(watch::Receiver<bool>);

impl Readiness {
    /// `filled` resolves true once every cache has completed its first list (false: never will).
    pub fn after(filled: impl Future<Output = bool> + Send + 'static) -> Readiness {
        let (sender, receiver) = watch::channel(false);
        tokio::spawn(async move {
            if filled.await {
                let _ = sender.send(true);
            }
        });
        Readiness(receiver)
    }

    /// True once the caches are filled; false if they never will be (the controller is stopping).
    pub async fn wait(&self) -> bool {
        let mut receiver = self.0.clone();
        receiver.wait_for(|filled| *filled).await.is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn every_waiter_wakes() {
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let readiness = Readiness::after(async move { rx.await.is_ok() });
        let waiters: Vec<_> = (0..8)
            .map(|_| {
                let readiness = readiness.clone();
                tokio::spawn(async move { readiness.wait().await })
            })
            .collect();
        tokio::task::yield_now().await;
        tx.send(()).unwrap();
        for waiter in waiters {
            assert!(waiter.await.unwrap());
        }
    }

    #[tokio::test]
    async fn a_cache_that_never_fills_says_so() {
        let readiness = Readiness::after(async { false });
        assert!(!readiness.wait().await);
    }
}
