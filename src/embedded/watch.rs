//! Watch streams: replay from a resourceVersion (or a synthetic ADDED snapshot), then live events,
//! filtered by namespace and selectors, with bookmarks, timeouts and the in-stream 410.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde_json::{Value, json};
use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;

use super::discovery::ResourceInfo;
use super::faults::WatchGate;
use super::selectors::{FieldSelector, LabelSelector};
use super::served::{Served, WatchLine};
use super::status::ApiError;
use super::store::{EventType, Store, StoreEvent, Subscription};

/// How often a watch with `allowWatchBookmarks` gets a BOOKMARK when nothing else is owed it, as
/// from kube-apiserver's watch cache ("roughly every minute"); besides, one comes
/// [`BOOKMARK_BEFORE_TIMEOUT`] before the watch's timeout, so that its client resumes from there.
pub const BOOKMARK_INTERVAL: Duration = Duration::from_secs(60);
pub const BOOKMARK_BEFORE_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Debug, Clone, Default)]
pub struct WatchOptions {
    pub namespace: Option<String>,
    pub label_selector: LabelSelector,
    pub field_selector: FieldSelector,
    /// `None` (absent, "" or "0"): start with ADDED for every current object.
    pub resource_version: Option<u64>,
    pub bookmarks: bool,
    pub timeout: Option<Duration>,
}

/// One watch connection: what it shows and where it stands.
struct Watcher {
    info: ResourceInfo,
    options: WatchOptions,
    sink: mpsc::Sender<Result<Bytes, Infallible>>,
    /// The newest store version this watcher has seen (bookmarks report it).
    seen: u64,
}

/// The response body of a watch: one JSON event per line until timeout, shutdown or disconnect.
/// `gate` holds events back while a test pauses this watch ([`super::faults::Faults::pause_watches`]).
pub(crate) fn stream(
    store: Arc<Store>,
    info: ResourceInfo,
    options: WatchOptions,
    gate: WatchGate,
    shutdown: CancellationToken,
) -> ReceiverStream<Result<Bytes, Infallible>> {
    let (sink, body) = mpsc::channel(64);
    let subscription = match options.resource_version {
        None => Ok(store.subscribe_with_snapshot(&info.storage_key(), options.namespace.as_deref())),
        Some(since) => store.subscribe_since(since).map_err(|floor| (since, floor)),
    };
    let watcher = Watcher {
        info,
        options,
        sink,
        seen: 0,
    };
    tokio::spawn(async move {
        match subscription {
            Ok(subscription) => watcher.run(subscription, gate, shutdown).await,
            Err((since, floor)) => {
                let message = format!("too old resource version: {since} ({floor})");
                watcher.send_error(&ApiError::expired(message)).await;
            }
        }
    });
    ReceiverStream::new(body)
}

/// What a watch owes its client and has not sent yet.
enum Owed {
    /// An object of the initial snapshot, current as of the subscription's resourceVersion.
    Snapshot {
        object: Arc<Value>,
        resource_version: u64,
    },
    Event(Arc<StoreEvent>),
}

impl Owed {
    fn resource_version(&self) -> u64 {
        match self {
            Owed::Snapshot { resource_version, .. } => *resource_version,
            Owed::Event(event) => event.resource_version,
        }
    }
}

impl Watcher {
    async fn run(mut self, subscription: Subscription, mut gate: WatchGate, shutdown: CancellationToken) {
        let Subscription {
            backlog,
            snapshot,
            mut live,
            resource_version,
        } = subscription;
        self.seen = resource_version;
        // Oldest first, and only the oldest may go out: a paused watch keeps its order.
        let mut owed: VecDeque<Owed> = snapshot
            .into_iter()
            .map(|object| Owed::Snapshot {
                object,
                resource_version,
            })
            .chain(backlog.into_iter().map(Owed::Event))
            .collect();
        let mut received = resource_version;
        let deadline = self.options.timeout.map(|t| tokio::time::Instant::now() + t);
        let mut bookmark = next_bookmark(deadline);
        loop {
            if !self.pay(&mut owed, &mut gate).await {
                return;
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = sleep_until(deadline) => return,
                _ = gate.changed() => {}
                _ = sleep_until(bookmark), if self.options.bookmarks && bookmark.is_some() => {
                    bookmark = next_bookmark(deadline);
                    // A bookmark past held events would tell the client it has seen them.
                    if owed.is_empty() && gate.held_after().is_none() && !self.send_bookmark().await {
                        return;
                    }
                }
                event = live.recv() => match event {
                    Ok(event) if event.resource_version <= received => {}
                    Ok(event) => {
                        received = event.resource_version;
                        self.owe(&mut owed, event);
                    }
                    Err(broadcast::error::RecvError::Lagged(_)) => {
                        // Events were lost for this slow watcher: make it relist rather than lie.
                        let message = format!("too old resource version: {} (watch fell behind)", self.seen);
                        self.send_error(&ApiError::expired(message)).await;
                        return;
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                },
            }
        }
    }

    /// Queues a live event; another resource's only moves the bookmark on when nothing is owed.
    fn owe(&mut self, owed: &mut VecDeque<Owed>, event: Arc<StoreEvent>) {
        if event.resource == self.info.storage_key() {
            owed.push_back(Owed::Event(event));
        } else if owed.is_empty() {
            self.seen = event.resource_version;
        }
    }

    /// Sends what is owed, oldest first, up to the first event a pause holds back; false when the
    /// client is gone.
    async fn pay(&mut self, owed: &mut VecDeque<Owed>, gate: &mut WatchGate) -> bool {
        loop {
            let held_after = gate.held_after();
            let due = owed
                .front()
                .is_some_and(|next| held_after.is_none_or(|after| next.resource_version() <= after));
            if !due {
                return true;
            }
            let sent = match owed.pop_front() {
                Some(Owed::Snapshot { object, .. }) => {
                    !self.matches(&object) || self.send(EventType::Added.as_str(), object).await
                }
                Some(Owed::Event(event)) => self.deliver(&event).await,
                None => true,
            };
            if !sent {
                return false;
            }
        }
    }

    fn matches(&self, object: &Value) -> bool {
        let namespace = object["metadata"]["namespace"].as_str().unwrap_or("");
        self.options.namespace.as_deref().is_none_or(|ns| ns == namespace)
            && self.options.label_selector.matches(object)
            && self.options.field_selector.matches(object)
    }

    /// Sends the event as this watcher sees it; false when the client is gone.
    async fn deliver(&mut self, event: &StoreEvent) -> bool {
        self.seen = event.resource_version;
        if event.resource != self.info.storage_key() {
            return true;
        }
        let now = self.matches(&event.object);
        let before = event.previous.as_ref().is_some_and(|p| self.matches(p));
        let shown = match (event.event_type, before, now) {
            (EventType::Added, _, true) => EventType::Added,
            (EventType::Deleted, _, true) => EventType::Deleted,
            (EventType::Modified, true, true) => EventType::Modified,
            // Entering or leaving the selection looks like creation or deletion to this watcher.
            (EventType::Modified, false, true) => EventType::Added,
            // kube-apiserver's watch cache sends the object as it was while selected, at the
            // event's resourceVersion: what the watcher last saw of it, not the new content.
            (EventType::Modified, true, false) => {
                let Some(previous) = event.previous.as_deref() else {
                    return true;
                };
                let mut left = previous.clone();
                left["metadata"]["resourceVersion"] = Value::from(event.resource_version.to_string());
                return self.send(EventType::Deleted.as_str(), Arc::new(left)).await;
            }
            _ => return true,
        };
        self.send(shown.as_str(), event.object.clone()).await
    }

    /// Sends one event, written out from the shared stored object.
    async fn send(&self, event_type: &str, object: Arc<Value>) -> bool {
        let line = WatchLine {
            event_type,
            object: Served::new(&self.info, object),
        };
        self.send_text(serde_json::to_string(&line).unwrap_or_default()).await
    }

    async fn send_bookmark(&self) -> bool {
        let object = json!({
            "kind": self.info.kind,
            "apiVersion": self.info.api_version(),
            "metadata": {"resourceVersion": self.seen.to_string()},
        });
        self.send_line("BOOKMARK", &object).await
    }

    async fn send_error(&self, error: &ApiError) {
        self.send_line("ERROR", &error.to_status()).await;
    }

    /// One event line, `type` first as kube-apiserver writes it (a client may then decode the
    /// object as it streams by instead of buffering it to find the type).
    async fn send_line(&self, event_type: &str, object: &Value) -> bool {
        let text = format!("{{\"type\":{},\"object\":{object}}}", Value::from(event_type));
        self.send_text(text).await
    }

    async fn send_text(&self, mut text: String) -> bool {
        text.push('\n');
        self.sink.send(Ok(Bytes::from(text))).await.is_ok()
    }
}

/// When the next bookmark is due: a [`BOOKMARK_INTERVAL`] from now, or [`BOOKMARK_BEFORE_TIMEOUT`]
/// before the watch's `deadline` if that comes first; none once that moment has passed.
fn next_bookmark(deadline: Option<tokio::time::Instant>) -> Option<tokio::time::Instant> {
    let now = tokio::time::Instant::now();
    let periodic = now + BOOKMARK_INTERVAL;
    let Some(deadline) = deadline else {
        return Some(periodic);
    };
    let before_timeout = deadline.checked_sub(BOOKMARK_BEFORE_TIMEOUT)?;
    (before_timeout > now).then_some(periodic.min(before_timeout))
}

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}
