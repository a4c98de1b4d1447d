//! Whether a tenant's API server answers, told once per change.
//!
//! Every request to the tenant passes [`ReachabilityLayer`]: one that cannot reach the server
//! (refused, reset, timed out) starts the tenant's probe at once. A stopping kube-apiserver refuses
//! new connections at once but keeps its open watches for up to a minute, so a watch failing is
//! not enough: a reconcile's request, a watch reconnecting or a status write tells first, and for a
//! tenant with nothing in flight the GOAWAY the server sends on the shared HTTP/2 connection
//! (`runtime::transport`), which costs no request. The probe asks over a new connection each time
//! (the shared one may be one the server no longer takes requests on) and alone decides down and
//! up; each change is told once (a log line, `stackd_tenant_up` and its cause, `/readyz?verbose`),
//! with a reminder while it lasts, and failures of single requests meanwhile are debug. When the
//! server answers again, [`Reachability::back`] wakes everything waiting for it: the tenant's
//! watches skip the rest of their retry delay, and reconciles that failed while it was down run
//! again at once.
//!
//! The host is watched the same way ([`Reachability::for_host`], one for the daemon): its state is
//! `stackd_host_up`, a `host` line of `/readyz?verbose` and a line in the log per change.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::FutureExt;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Client;
use kube::api::{Api, ListParams};
use rand::RngExt;
use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::cause::{Cause, CauseKind, diagnose};
use super::health::{Health, TenantHealth};
use super::metrics::Metrics;

/// The longest wait between two attempts to reach a server that is down (probes and watch retries).
pub const RECOVERY_INTERVAL: Duration = Duration::from_secs(4);

/// The wait before the next `/version` probe of a server that is down: jittered so that many
/// tenants (or many assets of one cluster) do not probe in step.
pub fn probe_delay() -> Duration {
    RECOVERY_INTERVAL.mul_f64(rand::rng().random_range(0.5..=1.0))
}

/// After a probe found the server answering, the next waits at least this long: a request that
/// fails on its own (one broken connection) costs a probe a second at most, not one per failure.
const PROBE_GAP_WHILE_UP: Duration = Duration::from_secs(1);
/// While a tenant stays down, it is told again this often.
pub const REMINDER_INTERVAL: Duration = Duration::from_secs(300);

/// One tenant's (or the host's) reachability: its state, its probe's wake-ups, and the signal of
/// its return.
pub struct Reachability {
    tenant: String,
    subject: Subject,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    state: Mutex<State>,
    /// A request could not reach the server.
    suspected: Notify,
    /// Something answered while the tenant counted as down.
    answered: Notify,
    /// Counts the tenant's returns after an outage.
    back: watch::Sender<u64>,
}

/// Whose API server a [`Reachability`] watches: what tells of its state depends on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Subject {
    Tenant,
    Host,
}

#[derive(Default)]
struct State {
    outage: Option<Outage>,
    /// A request failed to reach the server and no probe has answered since.
    suspected: bool,
    /// What the tenant is while it answers (up, or degraded), once its CRDs are known.
    serving: Option<TenantHealth>,
    /// Every controller of the run has filled its caches: until then the tenant is not shown up.
    started: bool,
}

impl State {
    /// What the tenant shows while it answers: degraded at once, up only once it has started.
    fn serving_shown(&self) -> Option<TenantHealth> {
        match &self.serving {
            Some(TenantHealth::Up) if !self.started => None,
            serving => serving.clone(),
        }
    }
}

struct Outage {
    cause: Cause,
    since: Instant,
    /// When it was last written to the log.
    told: Instant,
}

impl Reachability {
    pub fn new(tenant: &str, metrics: Arc<Metrics>, health: Arc<Health>) -> Arc<Reachability> {
        Arc::new(Reachability {
            tenant: tenant.to_string(),
            subject: Subject::Tenant,
            metrics,
            health,
            state: Mutex::default(),
            suspected: Notify::new(),
            answered: Notify::new(),
            back: watch::Sender::new(0),
        })
    }

    /// The host's reachability, shown answering until a request to it fails.
    pub fn for_host(metrics: Arc<Metrics>, health: Arc<Health>) -> Arc<Reachability> {
        metrics.set_host_up(None);
        health.set_host(TenantHealth::Up);
        Arc::new(Reachability {
            tenant: "host".to_string(),
            subject: Subject::Host,
            metrics,
            health,
            state: Mutex::default(),
            suspected: Notify::new(),
            answered: Notify::new(),
            back: watch::Sender::new(0),
        })
    }

    /// The layer every request of the tenant's client passes.
    pub fn layer(self: &Arc<Self>) -> ReachabilityLayer {
        ReachabilityLayer(self.clone())
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A request could not reach the server (or a watch of it failed, or it sent GOAWAY): probe it now.
    pub fn suspect(&self) {
        self.lock().suspected = true;
        self.suspected.notify_one();
    }

    /// The server answered a request: if the tenant counts as down, probe it now.
    fn heard_from(&self) {
        if self.lock().outage.is_some() {
            self.answered.notify_one();
        }
    }

    /// Whether the probe found the server not answering (and has not found it answering since).
    pub fn is_down(&self) -> bool {
        self.lock().outage.is_some()
    }

    /// Down, or a request failed to reach it and the probe has not spoken yet: a failure to
    /// reach the server now is the probe's to tell.
    pub fn in_doubt(&self) -> bool {
        let state = self.lock();
        state.outage.is_some() || state.suspected
    }

    /// Changes each time the server answers again after an outage.
    pub fn back(&self) -> watch::Receiver<u64> {
        self.back.subscribe()
    }

    /// A new run of the tenant starts: what it serves is not known until its caches fill again.
    pub fn restarting(&self) {
        let mut state = self.lock();
        state.serving = None;
        state.started = false;
    }

    /// What the tenant is while its server answers (up, or degraded saying why); shown unless
    /// it is down, and up only once the run has started ([`Self::set_started`]).
    pub fn set_serving(&self, health: TenantHealth) {
        let mut state = self.lock();
        state.serving = Some(health);
        if state.outage.is_some() {
            return;
        }
        // Published under the state's lock: a report of an outage cannot slip in between.
        self.metrics.set_tenant_up(&self.tenant);
        self.show_serving(&state);
    }

    /// Every controller of the run has filled its caches: the tenant may be shown up.
    pub fn set_started(&self) {
        let mut state = self.lock();
        state.started = true;
        if state.outage.is_none() {
            self.show_serving(&state);
        }
    }

    fn show_serving(&self, state: &State) {
        let Some(health) = state.serving_shown() else {
            return;
        };
        if self.health.tenant(&self.tenant) != Some(health.clone()) {
            info!(tenant = %self.tenant, ?health, "tenant state");
            self.health.set_tenant(&self.tenant, health);
        }
    }

    /// Reports the tenant down for `cause` (metric, readiness detail). The log hears of it when it
    /// goes down or its kind of trouble changes, and every [`REMINDER_INTERVAL`] while it lasts.
    pub fn report_down(&self, cause: Cause) {
        let now = Instant::now();
        let mut state = self.lock();
        state.suspected = false;
        if self.subject == Subject::Host {
            return self.report_host_down(&mut state, cause, now);
        }
        self.metrics.set_tenant_down(&self.tenant, cause.kind.label());
        self.health
            .set_tenant(&self.tenant, TenantHealth::Down(cause.message.clone()));
        let tenant = &self.tenant;
        match record_outage(&mut state.outage, &cause, now) {
            Some((News::Down, _)) => {
                warn!(%tenant, %cause, "tenant API server unavailable; serving it again as soon as it answers")
            }
            Some((News::OtherCause, down_for)) => {
                warn!(%tenant, %cause, down_for, "tenant API server still unavailable, now for another reason")
            }
            Some((News::Reminder, down_for)) => warn!(%tenant, %cause, down_for, "tenant API server still unavailable"),
            None => {}
        }
    }

    /// [`Self::report_down`] of the host.
    fn report_host_down(&self, state: &mut State, cause: Cause, now: Instant) {
        self.metrics.set_host_up(Some(cause.kind.label()));
        self.health.set_host(TenantHealth::Down(cause.message.clone()));
        match record_outage(&mut state.outage, &cause, now) {
            Some((News::Down, _)) => {
                warn!(%cause, "host API server unavailable; host work resumes as soon as it answers")
            }
            Some((_, down_for)) => warn!(%cause, down_for, "host API server still unavailable"),
            None => {}
        }
    }

    /// The probe found the server answering: tells the return once and wakes whatever waits for it.
    pub(crate) fn report_answering(&self) {
        let mut state = self.lock();
        state.suspected = false;
        let Some(outage) = state.outage.take() else {
            return;
        };
        if self.subject == Subject::Host {
            info!(
                down_for = seconds(outage.since.elapsed()),
                "host API server answers again"
            );
            self.metrics.set_host_up(None);
            self.health.set_host(TenantHealth::Up);
            drop(state);
            self.back.send_modify(|returns| *returns = returns.wrapping_add(1));
            return;
        }
        info!(tenant = %self.tenant, down_for = seconds(outage.since.elapsed()), "tenant API server answers again");
        self.metrics.set_tenant_up(&self.tenant);
        let health = state.serving_shown().unwrap_or(TenantHealth::Starting);
        self.health.set_tenant(&self.tenant, health);
        drop(state);
        self.back.send_modify(|returns| *returns = returns.wrapping_add(1));
    }

    /// Asks the server once and reports what it found; true when it answered.
    async fn check(&self, client: &Client) -> bool {
        let answered = match probe(client).await {
            Ok(()) => {
                self.report_answering();
                true
            }
            // Any answer of the host's but a 5xx is one: the daemon need not be allowed to list
            // its CRDs.
            Err(cause) if self.subject == Subject::Host && !cause.kind.is_outage() && !cause.kind.is_unreachable() => {
                self.report_answering();
                true
            }
            Err(cause) => {
                self.report_down(cause);
                false
            }
        };
        // Requests that failed before it are answered by it: no news.
        let _ = self.suspected.notified().now_or_never();
        let _ = self.answered.notified().now_or_never();
        answered
    }

    /// Probes the server whenever a request failed to reach it, and while it is down every few
    /// seconds (at once when something answered), until `cancel`.
    pub async fn run_probes(&self, client: &Client, cancel: &CancellationToken) {
        loop {
            let down = self.is_down();
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = self.suspected.notified(), if !down => {}
                _ = self.answered.notified(), if down => {}
                _ = tokio::time::sleep(probe_delay()), if down => {}
            }
            let answered = tokio::select! {
                _ = cancel.cancelled() => return,
                answered = self.check(client) => answered,
            };
            if answered {
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(PROBE_GAP_WHILE_UP) => {}
                }
            }
        }
    }

    /// Returns once the server answers a probe, asking every few seconds (or at once when
    /// something answered): for a tenant whose run ended because its server did not answer.
    pub async fn until_answering(&self, client: &Client) {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(probe_delay()) => {}
                _ = self.answered.notified() => {}
            }
            if self.check(client).await {
                return;
            }
        }
    }
}

/// A one-item list of the tenant's CRDs: what the daemon watches anyway. (`/version` may answer
/// while the API does not.) `client` opens a new connection for it
/// ([`super::transport::new_connection_client`]).
async fn probe(client: &Client) -> Result<(), Cause> {
    let ask = || async {
        let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
        match crds.list_metadata(&ListParams::default().limit(1)).await {
            Ok(_) => Ok(()),
            Err(err) => Err(diagnose(&err)),
        }
    };
    match ask().await {
        // A connection that broke under the request (the server stopping while it was asked)
        // says nothing of the server now: asked again, on a new connection, it says what is.
        Err(cause) if cause.kind == CauseKind::Reset => ask().await,
        answer => answer,
    }
}

/// Whole seconds, for log lines.
/// What an outage's latest cause is news of, for the log.
enum News {
    Down,
    OtherCause,
    Reminder,
}

/// Records `cause` as the outage's (starting one if there is none): what of it the log should hear,
/// with how long the outage has lasted in seconds. It hears of a new outage, of a new kind of
/// trouble, and of one that lasts, every [`REMINDER_INTERVAL`].
fn record_outage(outage: &mut Option<Outage>, cause: &Cause, now: Instant) -> Option<(News, u64)> {
    let Some(outage) = outage else {
        *outage = Some(Outage {
            cause: cause.clone(),
            since: now,
            told: now,
        });
        return Some((News::Down, 0));
    };
    let down_for = seconds(now - outage.since);
    let news = if outage.cause.kind != cause.kind {
        Some(News::OtherCause)
    } else if now - outage.told >= REMINDER_INTERVAL {
        Some(News::Reminder)
    } else {
        None
    };
    if news.is_some() {
        outage.told = now;
    }
    outage.cause = cause.clone();
    news.map(|news| (news, down_for))
}

fn seconds(duration: Duration) -> u64 {
    duration.as_secs()
}

/// Reports each request's outcome to the tenant's [`Reachability`].
#[derive(Clone)]
pub struct ReachabilityLayer(Arc<Reachability>);

impl<S> tower::Layer<S> for ReachabilityLayer {
    type Service = Reporting<S>;

    fn layer(&self, inner: S) -> Reporting<S> {
        Reporting {
            inner,
            reachability: self.0.clone(),
        }
    }
}

/// A service whose requests' outcomes reach a [`Reachability`]: an error (no answer) starts the
/// probe; an answer other than 5xx while the tenant counts as down probes it at once.
#[derive(Clone)]
pub struct Reporting<S> {
    inner: S,
    reachability: Arc<Reachability>,
}

impl<S, Request, Body> tower::Service<Request> for Reporting<S>
where
    S: tower::Service<Request, Response = http::Response<Body>, Error = tower::BoxError>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = tower::BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<http::Response<Body>, tower::BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), tower::BoxError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        let call = self.inner.call(request);
        let reachability = self.reachability.clone();
        Box::pin(async move {
            let result = call.await;
            match &result {
                Ok(response) if !response.status().is_server_error() => reachability.heard_from(),
                // A 5xx is an answer: the CRD monitor's failing watch starts the probe if it lasts.
                Ok(_) => {}
                Err(_) => reachability.suspect(),
            }
            result
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::cause::CauseKind;

    #[test]
    fn probes_are_jittered_within_the_interval() {
        for _ in 0..100 {
            let delay = probe_delay();
            assert!(delay >= RECOVERY_INTERVAL / 2 && delay <= RECOVERY_INTERVAL);
        }
    }

    fn refused() -> Cause {
        Cause {
            kind: CauseKind::Refused,
            message: "connection refused".to_string(),
        }
    }

    fn reachability() -> (Arc<Reachability>, Arc<Metrics>, Arc<Health>) {
        let (metrics, health) = (Arc::new(Metrics::new()), Arc::new(Health::default()));
        (
            Reachability::new("acme", metrics.clone(), health.clone()),
            metrics,
            health,
        )
    }

    #[test]
    fn an_outage_is_shown_at_once_and_the_serving_state_only_after_it() {
        let (reachability, metrics, health) = reachability();
        reachability.set_serving(TenantHealth::Up);
        reachability.set_started();
        assert_eq!(health.tenant("acme"), Some(TenantHealth::Up));
        reachability.report_down(refused());
        assert!(metrics.encode().contains("stackd_tenant_up{tenant=\"acme\"} 0"));
        // A watch kept open by a stopping server still delivers: that is no return.
        reachability.set_serving(TenantHealth::Degraded("no CRDs".into()));
        assert_eq!(
            health.tenant("acme"),
            Some(TenantHealth::Down("connection refused".into()))
        );
        let back = reachability.back();
        reachability.report_answering();
        assert!(back.has_changed().unwrap_or(false), "the return is signalled");
        assert_eq!(health.tenant("acme"), Some(TenantHealth::Degraded("no CRDs".into())));
        assert!(metrics.encode().contains("stackd_tenant_up{tenant=\"acme\"} 1"));
        assert!(!reachability.in_doubt());
    }

    #[test]
    fn the_host_is_told_down_and_back_by_its_own_metric_and_readiness_line() {
        let (metrics, health) = (Arc::new(Metrics::new()), Arc::new(Health::default()));
        let host = Reachability::for_host(metrics.clone(), health.clone());
        assert!(metrics.encode().contains("stackd_host_up 1"));
        assert!(health.detail().contains("[+]host ok"));
        let back = host.back();
        host.report_down(refused());
        host.report_down(refused());
        let text = metrics.encode();
        assert!(text.contains("stackd_host_up 0"), "{text}");
        assert!(text.contains("stackd_host_down_cause{cause=\"refused\"} 1"), "{text}");
        assert!(!text.contains("stackd_tenant_up"), "the host is no tenant: {text}");
        assert!(health.detail().contains("[-]host down: connection refused"));
        assert!(host.is_down());
        host.report_answering();
        assert!(back.has_changed().unwrap_or(false), "the return is signalled");
        let text = metrics.encode();
        assert!(
            text.contains("stackd_host_up 1") && !text.contains("stackd_host_down_cause{"),
            "{text}"
        );
        assert!(health.detail().contains("[+]host ok"));
    }

    #[test]
    fn a_suspicion_is_doubt_until_the_probe_speaks() {
        let (reachability, _, _) = reachability();
        reachability.suspect();
        assert!(reachability.in_doubt() && !reachability.is_down());
        reachability.report_answering();
        assert!(!reachability.in_doubt());
    }

    #[test]
    fn a_tenant_is_shown_up_only_once_started_and_degraded_at_once() {
        let (reachability, metrics, health) = reachability();
        health.set_tenant("acme", TenantHealth::Starting);
        reachability.set_serving(TenantHealth::Up);
        assert_eq!(health.tenant("acme"), Some(TenantHealth::Starting));
        assert!(
            metrics.encode().contains("stackd_tenant_up{tenant=\"acme\"} 1"),
            "it answers"
        );
        reachability.set_serving(TenantHealth::Degraded("no CRDs".into()));
        assert_eq!(health.tenant("acme"), Some(TenantHealth::Degraded("no CRDs".into())));
        reachability.set_serving(TenantHealth::Up);
        reachability.set_started();
        assert_eq!(health.tenant("acme"), Some(TenantHealth::Up));
        // A new run is not shown starting again (no flapping), nor up on its own CRDs alone.
        reachability.restarting();
        reachability.set_serving(TenantHealth::Degraded("no CRDs".into()));
        reachability.set_serving(TenantHealth::Up);
        assert_eq!(health.tenant("acme"), Some(TenantHealth::Degraded("no CRDs".into())));
        reachability.set_started();
        assert_eq!(health.tenant("acme"), Some(TenantHealth::Up));
    }

    #[test]
    fn a_return_without_known_caches_shows_the_tenant_starting() {
        let (reachability, _, health) = reachability();
        reachability.set_serving(TenantHealth::Up);
        reachability.report_down(refused());
        reachability.restarting();
        reachability.report_answering();
        assert_eq!(health.tenant("acme"), Some(TenantHealth::Starting));
    }
}
