//! A tenant's start: complete once each of its controllers has filled the caches it reads. Until
//! then the tenant is not shown up (`/readyz?verbose`, its Tenant's `Ready`): whoever sees it up may
//! count on its watches being open and its host namespace in place.

use std::collections::BTreeMap;

use tokio::sync::watch;

use super::readiness::Readiness;

/// The controllers of one run of a tenant, as they start.
#[derive(Debug)]
pub struct Startup {
    /// The caches each controller started so far reads, by the controller's name.
    started: watch::Sender<BTreeMap<String, Readiness>>,
    complete: watch::Sender<bool>,
}

impl Default for Startup {
    fn default() -> Self {
        Startup {
            started: watch::Sender::new(BTreeMap::new()),
            complete: watch::Sender::new(false),
        }
    }
}

impl Startup {
    /// A controller named `name` started; `caches` are those it reads.
    pub fn controller_started(&self, name: &str, caches: Readiness) {
        self.started.send_modify(|started| {
            started.insert(name.to_string(), caches);
        });
    }

    /// Resolves true, and marks the start complete, once every controller of `expected` has
    /// started and its caches are filled; false if one of them never will be (it is stopping).
    pub async fn complete(&self, expected: &[&str]) -> bool {
        let mut started = self.started.subscribe();
        let caches: Vec<Readiness> = {
            let Ok(all) = started
                .wait_for(|started| expected.iter().all(|name| started.contains_key(*name)))
                .await
            else {
                return false;
            };
            expected.iter().map(|name| all[*name].clone()).collect()
        };
        for readiness in caches {
            if !readiness.wait().await {
                return false;
            }
        }
        self.complete.send_replace(true);
        true
    }

    /// Resolves once the start is complete.
    pub async fn completed(&self) {
        let _ = self.complete.subscribe().wait_for(|complete| *complete).await;
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use futures::FutureExt;

    use super::*;

    #[tokio::test]
    async fn complete_once_every_expected_controller_started_and_filled_its_caches() {
        let startup = Startup::default();
        let (pools_filled, pools) = Readiness::signal();
        let (stacks_filled, stacks) = Readiness::signal();
        let complete = startup.complete(&["pools", "stacks"]);
        tokio::pin!(complete);
        startup.controller_started("pools", pools);
        pools_filled.ready();
        assert!(
            (&mut complete).now_or_never().is_none(),
            "complete before stacks started"
        );
        startup.controller_started("stacks", stacks);
        assert!(
            (&mut complete).now_or_never().is_none(),
            "complete before stacks' caches filled"
        );
        assert!(startup.completed().now_or_never().is_none());
        stacks_filled.ready();
        assert!(tokio::time::timeout(Duration::from_secs(5), complete).await.unwrap());
        assert!(startup.completed().now_or_never().is_some());
    }

    #[tokio::test]
    async fn not_complete_when_a_controllers_caches_never_fill() {
        let startup = Startup::default();
        let (never, caches) = Readiness::signal();
        startup.controller_started("pools", caches);
        drop(never);
        assert!(!startup.complete(&["pools"]).await);
        assert!(startup.completed().now_or_never().is_none());
    }
}
