//! Fault injection for tests: fail the next N requests matching verb/resource/namespace with a status
//! code (and a proper `Status` body), add latency to matching requests, drop every open watch, pause
//! the delivery of watch events (a watch cache that fell behind), take the node's kubelet away (pod
//! logs answered as kube-apiserver answers them when it cannot dial the kubelet).
//! Restarting the server (keeping or losing its state) is [`super::ApiServer::restart`]; stopping
//! it as kube-apiserver does on SIGTERM (new connections refused at once, open watches kept for a
//! while) is [`super::ApiServer::stop_gracefully`]; a host restart, API and kubelet, is
//! [`super::ApiServer::restart_host`].

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::HeaderValue;
use axum::response::{IntoResponse, Response};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::discovery::ResourceInfo;
use super::status::ApiError;
use super::store::Store;
use super::verb::Verb;

/// Which requests a fault applies to; every field left `None` matches anything.
#[derive(Debug, Clone, Default)]
pub struct RequestMatch {
    pub verb: Option<Verb>,
    /// The resource's plural (`configmaps`), kind (`ConfigMap`) or `plural.group`, case-insensitive.
    pub resource: Option<String>,
    pub namespace: Option<String>,
}

impl RequestMatch {
    pub fn any() -> RequestMatch {
        RequestMatch::default()
    }

    pub fn verb(mut self, verb: Verb) -> RequestMatch {
        self.verb = Some(verb);
        self
    }

    pub fn resource(mut self, resource: &str) -> RequestMatch {
        self.resource = Some(resource.to_string());
        self
    }

    pub fn namespace(mut self, namespace: &str) -> RequestMatch {
        self.namespace = Some(namespace.to_string());
        self
    }

    fn matches(&self, verb: Verb, info: &ResourceInfo, namespace: &str) -> bool {
        let resource_matches = |wanted: &str| {
            let qualified = format!("{}.{}", info.plural, info.group);
            [info.plural.as_str(), info.kind.as_str(), qualified.as_str()]
                .iter()
                .any(|name| name.eq_ignore_ascii_case(wanted))
        };
        self.verb.is_none_or(|v| v == verb)
            && self.resource.as_deref().is_none_or(resource_matches)
            && self.namespace.as_deref().is_none_or(|ns| ns == namespace)
    }
}

struct Failure {
    matching: RequestMatch,
    remaining: usize,
    code: u16,
}

struct Latency {
    matching: RequestMatch,
    delay: Duration,
}

/// Matching watches hold back every event written after `after` while this lasts.
struct Pause {
    id: u64,
    matching: RequestMatch,
    after: u64,
}

/// The faults armed on one server.
pub struct Faults {
    failures: Mutex<Vec<Failure>>,
    latencies: Mutex<Vec<Latency>>,
    /// Served at once, answered late: the write is stored and its watch events sent first.
    answer_latencies: Mutex<Vec<Latency>>,
    /// Cancelled (and replaced) to end every open watch.
    watches: Mutex<CancellationToken>,
    parent: CancellationToken,
    /// `Retry-After` seconds sent with injected 429s.
    retry_after: Mutex<u64>,
    /// Shared with every open watch, so a pause or resume reaches them at once.
    pauses: Arc<watch::Sender<Vec<Pause>>>,
    next_pause: AtomicU64,
    /// The resourceVersion a pause starts after.
    store: Arc<Store>,
    /// The node's kubelet does not answer: pod logs cannot be read.
    kubelet_down: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Faults {
    pub(crate) fn new(shutdown: &CancellationToken, store: Arc<Store>) -> Faults {
        Faults {
            failures: Mutex::default(),
            latencies: Mutex::default(),
            answer_latencies: Mutex::default(),
            watches: Mutex::new(shutdown.child_token()),
            parent: shutdown.clone(),
            retry_after: Mutex::new(1),
            pauses: Arc::new(watch::Sender::new(Vec::new())),
            next_pause: AtomicU64::new(0),
            store,
            kubelet_down: AtomicBool::new(false),
        }
    }

    /// The next `count` requests matching `matching` fail with `code` (409, 429, 500, 503, or any
    /// other 4xx/5xx) and a `Status` body; a 429 carries `Retry-After`.
    pub fn fail_next(&self, count: usize, matching: RequestMatch, code: u16) {
        lock(&self.failures).push(Failure {
            matching,
            remaining: count,
            code,
        });
    }

    /// Seconds sent in `Retry-After` with injected 429s (default 1).
    pub fn set_retry_after(&self, seconds: u64) {
        *lock(&self.retry_after) = seconds;
    }

    /// Every matching request waits `delay` before it is served.
    pub fn add_latency(&self, matching: RequestMatch, delay: Duration) {
        lock(&self.latencies).push(Latency { matching, delay });
    }

    /// Every matching request is served at once but answered `delay` later: its watch events
    /// reach watchers before its writer hears back (as a busy client may find on a real server).
    pub fn add_answer_latency(&self, matching: RequestMatch, delay: Duration) {
        lock(&self.answer_latencies).push(Latency { matching, delay });
    }

    /// Disarms every failure and latency.
    pub fn clear(&self) {
        lock(&self.failures).clear();
        lock(&self.latencies).clear();
        lock(&self.answer_latencies).clear();
    }

    /// The node's kubelet stops answering (`up` false) or answers again: while it is down, pod log
    /// requests get what kube-apiserver answers when it cannot dial the kubelet (500, the dial
    /// error), while the rest of the API serves.
    pub fn set_kubelet_up(&self, up: bool) {
        self.kubelet_down.store(!up, Ordering::SeqCst);
    }

    /// The answer to a pod log request while the kubelet is down.
    pub(crate) fn kubelet_refusal(&self, namespace: &str, pod: &str) -> Option<Response> {
        if !self.kubelet_down.load(Ordering::SeqCst) {
            return None;
        }
        // kube-apiserver passes the dial error on as a Status without a reason.
        let message = format!(
            "Get \"https://127.0.0.1:10250/containerLogs/{namespace}/{pod}\": dial tcp 127.0.0.1:10250: connect: connection refused"
        );
        Some(ApiError::new(500, "", message).into_response())
    }

    /// Ends every open watch stream (new watches are unaffected).
    pub fn drop_watches(&self) {
        let mut current = lock(&self.watches);
        current.cancel();
        *current = self.parent.child_token();
    }

    /// Hands over what ends the watches open now, and gives watches opened from now on another:
    /// the open ones end only when the returned token is cancelled.
    pub(crate) fn detach_watches(&self) -> CancellationToken {
        let mut current = lock(&self.watches);
        std::mem::replace(&mut *current, self.parent.child_token())
    }

    /// What ends the watches opened now.
    pub(crate) fn watch_token(&self) -> CancellationToken {
        lock(&self.watches).clone()
    }

    /// Watches matching `matching` (open now or opened later) deliver nothing written from now on
    /// until the returned guard is dropped: then they deliver what they held, in order and with its
    /// resourceVersions, as a watch cache that fell behind and caught up would. Events written before
    /// the pause still arrive, and lists and gets keep answering the current state. A watch that ends
    /// while paused (timeout, [`Faults::drop_watches`]) loses nothing: its client resumes from the
    /// last resourceVersion it saw, and the new watch holds the rest. `matching` is matched as a
    /// watch request: a verb other than [`Verb::Watch`] pauses nothing.
    pub fn pause_watches(&self, matching: RequestMatch) -> PausedWatches {
        let id = self.next_pause.fetch_add(1, Ordering::Relaxed);
        let after = self.store.resource_version();
        self.pauses
            .send_modify(|pauses| pauses.push(Pause { id, matching, after }));
        PausedWatches {
            pauses: self.pauses.clone(),
            id,
        }
    }

    /// What a watch of `info` in `namespace` ("" for all) consults before it delivers an event.
    /// Sleeps for the sum of the `latencies` matching the request; a stopping server does not
    /// wait out the latency of the requests in flight.
    async fn wait_out(&self, latencies: &Mutex<Vec<Latency>>, verb: Verb, info: &ResourceInfo, namespace: &str) {
        let delay: Duration = lock(latencies)
            .iter()
            .filter(|l| l.matching.matches(verb, info, namespace))
            .map(|l| l.delay)
            .sum();
        if !delay.is_zero() {
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = self.parent.cancelled() => {}
            }
        }
    }

    pub(crate) fn watch_gate(&self, info: &ResourceInfo, namespace: &str) -> WatchGate {
        WatchGate {
            pauses: self.pauses.subscribe(),
            info: info.clone(),
            namespace: namespace.to_string(),
        }
    }

    /// Waits out the answer latency of a request already served.
    pub(crate) async fn delay_answer(&self, verb: Verb, info: &ResourceInfo, namespace: &str) {
        self.wait_out(&self.answer_latencies, verb, info, namespace).await;
    }

    /// Applies latency, then answers the injected failure if one matches.
    pub(crate) async fn intercept(&self, verb: Verb, info: &ResourceInfo, namespace: &str) -> Option<Response> {
        self.wait_out(&self.latencies, verb, info, namespace).await;
        let code = {
            let mut failures = lock(&self.failures);
            let hit = failures
                .iter_mut()
                .find(|f| f.remaining > 0 && f.matching.matches(verb, info, namespace))?;
            hit.remaining -= 1;
            let code = hit.code;
            failures.retain(|f| f.remaining > 0);
            code
        };
        let retry_after = *lock(&self.retry_after);
        Some(injected(code, retry_after, info))
    }
}

/// A pause of watch deliveries, from [`Faults::pause_watches`]; the watches resume when it is dropped.
#[must_use = "the watches resume as soon as the pause is dropped"]
pub struct PausedWatches {
    pauses: Arc<watch::Sender<Vec<Pause>>>,
    id: u64,
}

impl PausedWatches {
    /// Lets the paused watches deliver what they held, then go on live.
    pub fn resume(self) {}
}

impl Drop for PausedWatches {
    fn drop(&mut self) {
        let id = self.id;
        self.pauses.send_modify(|pauses| pauses.retain(|p| p.id != id));
    }
}

/// The pauses as one watch sees them.
pub(crate) struct WatchGate {
    pauses: watch::Receiver<Vec<Pause>>,
    info: ResourceInfo,
    namespace: String,
}

impl WatchGate {
    /// The resourceVersion after which this watch must hold events back, while a pause matches it.
    pub(crate) fn held_after(&mut self) -> Option<u64> {
        self.pauses
            .borrow_and_update()
            .iter()
            .filter(|p| p.matching.matches(Verb::Watch, &self.info, &self.namespace))
            .map(|p| p.after)
            .min()
    }

    /// Returns when a pause begins or ends.
    pub(crate) async fn changed(&mut self) {
        if self.pauses.changed().await.is_err() {
            // The server is gone with its faults: nothing will change any more.
            std::future::pending::<()>().await;
        }
    }
}

fn injected(code: u16, retry_after: u64, info: &ResourceInfo) -> Response {
    let qualified = super::status::qualified(&info.group, &info.plural);
    let (reason, message) = match code {
        409 => (
            "Conflict",
            format!("Operation cannot be fulfilled on {qualified}: injected conflict"),
        ),
        429 => (
            "TooManyRequests",
            "Too many requests, please try again later.".to_string(),
        ),
        500 => ("InternalError", "Internal error occurred: injected fault".to_string()),
        503 => (
            "ServiceUnavailable",
            "the server is currently unable to handle the request".to_string(),
        ),
        504 => (
            "Timeout",
            "the server was unable to return a response in the time allotted".to_string(),
        ),
        404 => (
            "NotFound",
            "the server could not find the requested resource".to_string(),
        ),
        403 => ("Forbidden", "injected: forbidden".to_string()),
        400 => ("BadRequest", "injected: bad request".to_string()),
        _ => ("", format!("injected fault {code}")),
    };
    let mut error = ApiError::new(code, reason, message);
    if code == 429 {
        error.details = serde_json::json!({"retryAfterSeconds": retry_after});
    }
    let mut response = error.into_response();
    if (code == 429 || code == 503)
        && let Ok(value) = HeaderValue::from_str(&retry_after.to_string())
    {
        response.headers_mut().insert(axum::http::header::RETRY_AFTER, value);
    }
    response
}
