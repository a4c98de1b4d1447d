//! A tenant's reconcile permits, shared fairly between its namespaces (DESIGN.md §8: "slots are
//! shared fairly between a tenant's namespaces").
//!
//! Waiters queue per namespace, and a permit given back goes to the namespace whose turn it is
//! (round robin over the namespaces with waiters), not to the longest waiter: a namespace with a
//! backlog of hundreds of objects gets one permit in turn with every other namespace waiting,
//! instead of making them wait behind all of its objects.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

#[derive(Default)]
struct Queues {
    free: usize,
    waiters: HashMap<String, VecDeque<oneshot::Sender<()>>>,
    /// Namespaces with waiters, in turn order.
    turns: VecDeque<String>,
}

/// The permits; see the module documentation.
pub struct FairPermits {
    queues: Mutex<Queues>,
}

impl FairPermits {
    pub fn new(permits: usize) -> Arc<FairPermits> {
        Arc::new(FairPermits {
            queues: Mutex::new(Queues {
                free: permits.max(1),
                ..Queues::default()
            }),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queues> {
        self.queues.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits for a permit for work on an object of `namespace` ("" for cluster-scoped work).
    pub async fn acquire(self: &Arc<Self>, namespace: &str) -> FairPermit {
        let receiver = {
            let mut queues = self.lock();
            if queues.free > 0 && queues.turns.is_empty() {
                queues.free -= 1;
                return FairPermit { permits: self.clone() };
            }
            let (sender, receiver) = oneshot::channel();
            let queue = queues.waiters.entry(namespace.to_string()).or_default();
            queue.push_back(sender);
            if queue.len() == 1 {
                queues.turns.push_back(namespace.to_string());
            }
            Waiting {
                receiver: Some(receiver),
                permits: self.clone(),
            }
        };
        receiver.granted().await
    }

    /// Available permits now (none while anyone waits).
    pub fn available(&self) -> usize {
        self.lock().free
    }

    /// Hands a permit given back to the next waiter in turn, or keeps it free.
    fn release(&self) {
        let mut queues = self.lock();
        while let Some(namespace) = queues.turns.pop_front() {
            let Some(queue) = queues.waiters.get_mut(&namespace) else {
                continue;
            };
            let next = queue.pop_front();
            if queue.is_empty() {
                queues.waiters.remove(&namespace);
            } else {
                queues.turns.push_back(namespace);
            }
            // A waiter that gave up (its reconcile was cancelled) is skipped.
            if let Some(next) = next
                && next.send(()).is_ok()
            {
                return;
            }
        }
        queues.free += 1;
    }
}

/// A waiter's place in a queue.
struct Waiting {
    receiver: Option<oneshot::Receiver<()>>,
    permits: Arc<FairPermits>,
}

impl Waiting {
    async fn granted(mut self) -> FairPermit {
        if let Some(receiver) = self.receiver.as_mut() {
            // The sender is only dropped when it was skipped, and then never: a waiter is sent
            // to or left in its queue.
            let _ = receiver.await;
        }
        self.receiver = None;
        FairPermit {
            permits: self.permits.clone(),
        }
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        // Given up while waiting: a permit sent meanwhile must not be lost.
        if let Some(mut receiver) = self.receiver.take() {
            receiver.close();
            if receiver.try_recv().is_ok() {
                self.permits.release();
            }
        }
    }
}

/// One permit, given back when dropped.
pub struct FairPermit {
    permits: Arc<FairPermits>,
}

impl Drop for FairPermit {
    fn drop(&mut self) {
        self.permits.release();
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    async fn granted_order(permits: &Arc<FairPermits>, waiters: &[&str]) -> Vec<String> {
        let held = permits.acquire("x").await;
        let (order, mut receiver) = tokio::sync::mpsc::unbounded_channel();
        let mut tasks = Vec::new();
        for (i, namespace) in waiters.iter().enumerate() {
            let (permits, order, namespace) = (permits.clone(), order.clone(), namespace.to_string());
            tasks.push(tokio::spawn(async move {
                let _permit = permits.acquire(&namespace).await;
                order.send(format!("{namespace}{i}")).unwrap();
            }));
            // Queued in this order.
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        drop(held);
        let mut seen = Vec::new();
        for _ in waiters {
            seen.push(receiver.recv().await.unwrap());
        }
        seen
    }

    #[tokio::test]
    async fn a_backlog_in_one_namespace_takes_turns_with_the_others() {
        let permits = FairPermits::new(1);
        let order = granted_order(&permits, &["a", "a", "a", "a", "b", "c"]).await;
        assert_eq!(order, ["a0", "b4", "c5", "a1", "a2", "a3"]);
        assert_eq!(permits.available(), 1);
    }

    #[tokio::test]
    async fn a_waiter_that_gives_up_loses_no_permit() {
        let permits = FairPermits::new(1);
        let held = permits.acquire("a").await;
        let waiting = tokio::spawn({
            let permits = permits.clone();
            async move {
                let _never = permits.acquire("b").await;
            }
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        waiting.abort();
        let _ = waiting.await;
        drop(held);
        assert_eq!(permits.available(), 1);
        let _again = tokio::time::timeout(Duration::from_secs(1), permits.acquire("c"))
            .await
            .expect("the permit was given back");
    }
}
