//! The scaffold's shape for a controller of one thing per tenant that may not exist yet (the host
//! namespace, the quota): kube's `Controller` reconciles only objects it has cached, so it could
//! never create a missing one. Same contract as [`super::Scaffold`]: every cache filled before the
//! first reconcile, then the tenant's permit, panics contained, the same metrics, backoff on
//! failure (a failed write announces no event, so the retry is scheduled here) and a stop on cancel.

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use futures::stream::{BoxStream, SelectAll};
use futures::{Stream, StreamExt};
use kube::Resource;
use kube::runtime::reflector::Store;
use kube::runtime::watcher;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, warn};

use super::{Permit, ReconcileError, Tenant, observe, reconcile_span, servers};
use crate::runtime::cache::is_filled;
use crate::runtime::deadline::sleep_until;
use crate::runtime::panics;
use crate::runtime::retry;

/// A per-tenant singleton controller, being put together.
pub struct Singleton<T> {
    name: String,
    /// What it reconciles, for its log lines.
    object: String,
    tenant: Arc<T>,
    triggers: SelectAll<BoxStream<'static, Result<(), watcher::Error>>>,
    caches: Vec<Box<dyn Fn() -> bool + Send + Sync>>,
}

impl<T: Tenant> Singleton<T> {
    /// A controller named `name` (its `controller` metric label and backoff key).
    pub fn new(name: impl Into<String>, tenant: Arc<T>) -> Self {
        let name = name.into();
        Singleton {
            object: name.clone(),
            name,
            tenant,
            triggers: SelectAll::new(),
            caches: Vec::new(),
        }
    }

    /// Names what it reconciles (the `object` of its log lines; its name until then).
    pub fn object(mut self, object: impl Into<String>) -> Self {
        self.object = object.into();
        self
    }

    /// Reconciles on every event of the watch that fills `cache`. The first (empty) list counts: a
    /// namespace without the object must hear of it to create it.
    pub fn watches<K>(
        mut self,
        cache: Store<K>,
        events: impl Stream<Item = Result<(), watcher::Error>> + Send + 'static,
    ) -> Self
    where
        K: Resource + Clone + Send + Sync + 'static,
        K::DynamicType: Clone + Eq + std::hash::Hash + Send + Sync,
    {
        // Checked as events arrive (not awaited): the event that fills a cache is the one that
        // must find it filled.
        self.caches.push(Box::new(move || is_filled(&cache)));
        self.triggers.push(events.boxed());
        self
    }

    /// Reconciles on every item of `events` — a cache shared with other tenants, a timer — once
    /// `ready` says what the reconcile reads is there. Unlike a watch's first list, nothing here
    /// announces a start: `events` should yield once at once.
    pub fn triggered_by(
        mut self,
        ready: impl Fn() -> bool + Send + Sync + 'static,
        events: impl Stream<Item = Result<(), watcher::Error>> + Send + 'static,
    ) -> Self {
        self.caches.push(Box::new(ready));
        self.triggers.push(events.boxed());
        self
    }

    /// Runs `reconcile` after watch events until `cancel`; an error retries after the tenant's
    /// backoff.
    pub async fn run<F, Fut, E>(mut self, mut reconcile: F, cancel: &CancellationToken)
    where
        F: FnMut(Permit) -> Fut,
        Fut: Future<Output = Result<(), E>>,
        E: ReconcileError,
    {
        let mut retry: Option<tokio::time::Instant> = None;
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = sleep_until(retry), if retry.is_some() => {}
                event = self.triggers.next() => match event {
                    // Every watch retries on its own backoff; none ends while the tenant runs.
                    None => return,
                    Some(Err(err)) => {
                        if retry::is_quiet_watch_failure(&err, &servers(self.tenant.as_ref())) {
                            debug!(tenant = %self.tenant.name(), controller = %self.name, error = %err, "watch failed; retrying");
                        } else {
                            warn!(tenant = %self.tenant.name(), controller = %self.name, error = %err, "watch failed; retrying");
                        }
                        continue;
                    }
                    Some(Ok(())) => {}
                },
            }
            if !self.caches.iter().all(|filled| filled()) {
                continue;
            }
            let span = reconcile_span(self.tenant.name(), &self.name, &self.object);
            let held = self.tenant.permits().acquire("").instrument(span.clone()).await;
            let started = Instant::now();
            let result = panics::contain(reconcile(Permit { _held: held }))
                .instrument(span)
                .await;
            observe(self.tenant.as_ref(), &self.name, started, result.as_ref().err());
            retry = match result {
                Ok(()) => {
                    self.tenant.object_backoff().succeeded(&self.name);
                    None
                }
                Err(err) => {
                    let logged = (self.tenant.name(), self.name.as_str(), self.name.as_str());
                    // Nothing to hold: a singleton retries on its own, within a probe's interval
                    // while a server is in doubt.
                    let servers = servers(self.tenant.as_ref());
                    let backoff = self.tenant.object_backoff();
                    let delay = retry::after_tenant_failure(backoff, &self.name, logged, &err, (&servers, || false));
                    Some(tokio::time::Instant::now() + delay)
                }
            };
        }
    }
}
