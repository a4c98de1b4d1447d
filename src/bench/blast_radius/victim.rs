//! Tenant B's work, timed: installs of the sample stack, each in a namespace of its own, created at
//! once, and a vSphere pool filled from its inventory, both started together.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use futures::StreamExt;
use kube::api::Api;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use serde::{Deserialize, Serialize};

use super::super::BenchError;
use super::super::latency::percentile;
use crate::api::pools::ClusterPool;
use crate::api::stacks::StackInstall;
use crate::runtime::conditions::is_true;

/// How long one round of B's work may take before the bench gives up.
const WITHIN: Duration = Duration::from_secs(180);

/// One round of B's work.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct VictimTimes {
    pub installs: usize,
    /// Seconds from creation until Ready, p50 and slowest.
    pub install_p50_s: f64,
    pub install_max_s: f64,
    pub pool_size: usize,
    /// Seconds from the pool's creation until it reports every cluster ready.
    pub pool_fill_s: f64,
}

/// Runs one round: `installs` installs in namespaces `{round}-N` and a pool of `pool_size` in
/// `{round}-pool`.
pub(super) async fn run(
    tenant: &Client,
    round: &str,
    installs: usize,
    pool_size: usize,
) -> Result<VictimTimes, BenchError> {
    let started = Instant::now();
    let waiting = tokio::spawn(installs_ready(tenant.clone(), format!("{round}-"), installs, started));
    for index in 0..installs {
        super::super::stacks::create(tenant, &format!("{round}-{index}")).await?;
    }
    let pool_namespace = format!("{round}-pool");
    let names: Vec<String> = (0..pool_size).map(|i| format!("{round}-c{i}")).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let pool_started = Instant::now();
    crate::pools::sample::install_pool(tenant, &pool_namespace, "pool", pool_size as i32, &refs).await?;
    let pool_fill_s = pool_filled(tenant, &pool_namespace, pool_size, pool_started).await?;
    let mut times = match tokio::time::timeout(WITHIN, waiting).await {
        Ok(Ok(times)) if times.len() == installs => times,
        _ => {
            return Err(BenchError::Timeout(format!(
                "tenant B's {installs} installs ({round}) not Ready within {WITHIN:?}"
            )));
        }
    };
    Ok(VictimTimes {
        installs,
        install_p50_s: percentile(&mut times, 0.5),
        install_max_s: times.iter().copied().fold(0.0, f64::max),
        pool_size,
        pool_fill_s,
    })
}

/// Seconds from `started` until each of `count` installs in namespaces starting with `prefix` was
/// first seen Ready.
async fn installs_ready(client: Client, prefix: String, count: usize, started: Instant) -> Vec<f64> {
    let mut ready = BTreeMap::new();
    let mut events = watcher(Api::<StackInstall>::all(client), watcher::Config::default())
        .default_backoff()
        .applied_objects()
        .boxed();
    while ready.len() < count {
        let Some(event) = events.next().await else { break };
        let Ok(install) = event else { continue };
        let namespace = install.namespace().unwrap_or_default();
        let is_ready = install.status.as_ref().is_some_and(|s| is_true(&s.conditions, "Ready"));
        if is_ready && namespace.starts_with(&prefix) {
            let key = format!("{namespace}/{}", install.name_any());
            ready.entry(key).or_insert_with(|| started.elapsed().as_secs_f64());
        }
    }
    ready.into_values().collect()
}

/// Seconds from `started` until the pool reports `size` clusters ready.
async fn pool_filled(tenant: &Client, namespace: &str, size: usize, started: Instant) -> Result<f64, BenchError> {
    let pools: Api<ClusterPool> = Api::namespaced(tenant.clone(), namespace);
    loop {
        let ready = pools.get("pool").await?.status.map_or(0, |s| s.ready);
        if ready as usize >= size {
            return Ok(started.elapsed().as_secs_f64());
        }
        if started.elapsed() > WITHIN {
            return Err(BenchError::Timeout(format!(
                "tenant B's pool {namespace}/pool filled {ready} of {size} within {WITHIN:?}"
            )));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
