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

    /// A readiness its owner declares with [`ReadySignal::ready`]; dropping the signal unready
    /// tells waiters it never will be.
    pub fn signal() -> (ReadySignal, Readiness) {
        let (sender, receiver) = watch::channel(false);
        (ReadySignal(sender), Readiness(receiver))
    }

    /// Ready once every one of `all` is.
    pub fn all(all: Vec<Readiness>) -> Readiness {
        Readiness::after(async move {
            for readiness in all {
                if !readiness.wait().await {
                    return false;
                }
            }
            true
        })
    }

    /// True once the caches are filled; false if they never will be (the controller is stopping).
    pub async fn wait(&self) -> bool {
        let mut receiver = self.0.clone();
        receiver.wait_for(|filled| *filled).await.is_ok()
    }

    /// Whether the caches are filled now, without waiting.
    pub fn is_ready(&self) -> bool {
        *self.0.borrow()
    }
}

/// Declares a [`Readiness`] made by [`Readiness::signal`] ready.
#[derive(Debug)]
pub struct ReadySignal(watch::Sender<bool>);

impl ReadySignal {
    pub fn ready(&self) {
        self.0.send_replace(true);
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
    async fn all_is_ready_once_each_is() {
        let (first, a) = Readiness::signal();
        let (second, b) = Readiness::signal();
        let both = Readiness::all(vec![a, b]);
        first.ready();
        tokio::task::yield_now().await;
        assert!(!both.is_ready());
        second.ready();
        assert!(both.wait().await);
        assert!(both.is_ready());
    }

    #[tokio::test]
    async fn a_dropped_signal_never_becomes_ready() {
        let (signal, readiness) = Readiness::signal();
        drop(signal);
        assert!(!readiness.wait().await);
    }

    #[tokio::test]
    async fn a_cache_that_never_fills_says_so() {
        let readiness = Readiness::after(async { false });
        assert!(!readiness.wait().await);
    }
}
