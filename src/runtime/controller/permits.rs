//! A tenant's reconcile permits, shared fairly between its namespaces (DESIGN.md §8: "slots are
//! shared fairly between a tenant's namespaces").
//!
//! Waiters queue per namespace, and a permit given back goes to the namespace with waiters whose
//! reconciles held permits the least lately (their work, decaying with a half-life of
//! [`WORK_HALF_LIFE`]), in turn order among equals, not to the longest waiter: a namespace with a
//! backlog of hundreds of objects gets one permit in turn with every other namespace waiting,
//! instead of making them wait behind all of its objects, and one whose reconciles are slow (a
//! large template rendered, a slow webhook) gets fewer of them than one whose reconciles are quick,
//! so that each namespace gets an equal share of the tenant's reconcile time while others wait.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::Instant;

/// How fast a namespace's past work stops counting against it.
const WORK_HALF_LIFE: Duration = Duration::from_secs(30);
/// Recent work that differs by less than this counts as equal: turn order decides.
const WORK_QUANTUM: f64 = 0.05;
/// Work records kept before the negligible ones are dropped.
const WORK_RECORDS_KEPT: usize = 256;

/// A namespace's recent reconcile time, in seconds as of `at`.
#[derive(Clone, Copy)]
struct Work {
    seconds: f64,
    at: Instant,
}

impl Work {
    fn now(self, now: Instant) -> f64 {
        let halvings = now.saturating_duration_since(self.at).as_secs_f64() / WORK_HALF_LIFE.as_secs_f64();
        self.seconds * 0.5f64.powf(halvings)
    }
}

#[derive(Default)]
struct Queues {
    free: usize,
    waiters: HashMap<String, VecDeque<oneshot::Sender<()>>>,
    /// Namespaces with waiters, in turn order.
    turns: VecDeque<String>,
    /// Recent work of the namespaces that held permits.
    work: HashMap<String, Work>,
}

impl Queues {
    fn add_work(&mut self, namespace: &str, held: Duration, now: Instant) {
        if self.work.len() >= WORK_RECORDS_KEPT {
            self.work.retain(|_, work| work.now(now) > 0.001);
        }
        let before = self.work.get(namespace).map_or(0.0, |work| work.now(now));
        let seconds = before + held.as_secs_f64();
        self.work.insert(namespace.to_string(), Work { seconds, at: now });
    }

    /// The place in `turns` of the namespace whose turn it is: the least recent work, the first
    /// in turn among equals (within [`WORK_QUANTUM`]).
    fn next_turn(&self, now: Instant) -> Option<usize> {
        let work = |namespace: &String| self.work.get(namespace).map_or(0.0, |work| work.now(now));
        let mut best: Option<(usize, f64)> = None;
        for (place, namespace) in self.turns.iter().enumerate() {
            let work = work(namespace);
            if best.is_none_or(|(_, least)| work < least - WORK_QUANTUM) {
                best = Some((place, work));
            }
        }
        best.map(|(place, _)| place)
    }
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
                return FairPermit::new(self.clone(), namespace);
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
                namespace: namespace.to_string(),
            }
        };
        receiver.granted().await
    }

    /// Available permits now (none while anyone waits).
    pub fn available(&self) -> usize {
        self.lock().free
    }

    /// Hands a permit given back to the next waiter in turn, or keeps it free; `used` is the
    /// namespace that held it and for how long.
    fn release(&self, used: Option<(&str, Duration)>) {
        let mut queues = self.lock();
        let now = Instant::now();
        if let Some((namespace, held)) = used {
            queues.add_work(namespace, held, now);
        }
        while let Some(namespace) = queues.next_turn(now).and_then(|place| queues.turns.remove(place)) {
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
    namespace: String,
}

impl Waiting {
    async fn granted(mut self) -> FairPermit {
        if let Some(receiver) = self.receiver.as_mut() {
            // The sender is only dropped when it was skipped, and then never: a waiter is sent
            // to or left in its queue.
            let _ = receiver.await;
        }
        self.receiver = None;
        FairPermit::new(self.permits.clone(), &self.namespace)
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        // Given up while waiting: a permit sent meanwhile must not be lost.
        if let Some(mut receiver) = self.receiver.take() {
            receiver.close();
            if receiver.try_recv().is_ok() {
                self.permits.release(None);
            }
        }
    }
}

/// One permit, given back when dropped; the time it was held counts as its namespace's work.
pub struct FairPermit {
    permits: Arc<FairPermits>,
    namespace: String,
    since: Instant,
}

impl FairPermit {
    fn new(permits: Arc<FairPermits>, namespace: &str) -> FairPermit {
        FairPermit {
            permits,
            namespace: namespace.to_string(),
            since: Instant::now(),
        }
    }
}

impl Drop for FairPermit {
    fn drop(&mut self) {
        self.permits.release(Some((&self.namespace, self.since.elapsed())));
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
    async fn a_namespace_whose_reconciles_took_long_waits_behind_one_whose_were_quick() {
        let permits = FairPermits::new(1);
        let slow = permits.acquire("slow").await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        drop(slow);
        drop(permits.acquire("quick").await);
        // "slow" queues first, yet "quick" goes first: it worked less lately.
        let order = granted_order(&permits, &["slow", "quick", "slow", "quick"]).await;
        assert_eq!(order, ["quick1", "quick3", "slow0", "slow2"]);
    }

    #[test]
    fn past_work_stops_counting() {
        let mut queues = Queues::default();
        let then = Instant::now();
        queues.add_work("slow", Duration::from_secs(10), then);
        queues.add_work("quick", Duration::from_millis(10), then);
        queues.turns = ["slow".to_string(), "quick".to_string()].into();
        assert_eq!(queues.next_turn(then), Some(1));
        // Ten half-lives later both count for next to nothing: turn order decides.
        assert_eq!(queues.next_turn(then + WORK_HALF_LIFE * 10), Some(0));
        for record in 0..WORK_RECORDS_KEPT * 2 {
            queues.add_work(
                &record.to_string(),
                Duration::from_millis(1),
                then + WORK_HALF_LIFE * 100,
            );
        }
        assert!(
            queues.work.len() <= WORK_RECORDS_KEPT * 2,
            "negligible records are dropped"
        );
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
