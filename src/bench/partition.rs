//! A TCP proxy in front of an API server: cutting it refuses new connections and ends open ones, as
//! a network partition would. It also records when its client sent anything, so that a benchmark
//! giving each daemon its own proxies can tell which daemon talked to a server when (the span of
//! it, and each moment, for checks that a tenant moved from one daemon to another cleanly).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// From the first to the last moment a proxy's client sent bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    pub first: Instant,
    pub last: Instant,
}

impl Span {
    pub fn overlaps(&self, other: &Span) -> bool {
        self.first <= other.last && other.first <= self.last
    }
}

pub struct Partition {
    addr: SocketAddr,
    upstream: SocketAddr,
    cut: CancellationToken,
    /// While true, connections are ended and new ones dropped, until [`Partition::heal`].
    paused: watch::Sender<bool>,
    sent: Arc<Mutex<Sent>>,
}

/// What the client sent, and when.
#[derive(Default)]
struct Sent {
    span: Option<Span>,
    /// Each read of client bytes, oldest first; the oldest half goes past [`MAX_SENDS`].
    times: Vec<Instant>,
}

const MAX_SENDS: usize = 100_000;

impl Partition {
    /// Listens on a free loopback port and relays every connection to `upstream`.
    pub async fn start(upstream: SocketAddr) -> std::io::Result<Partition> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let cut = CancellationToken::new();
        let (paused, paused_rx) = watch::channel(false);
        let sent = Arc::new(Mutex::new(Sent::default()));
        tokio::spawn(accept(listener, upstream, cut.clone(), paused_rx, sent.clone()));
        Ok(Partition {
            addr,
            upstream,
            cut,
            paused,
            sent,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// A copy of `kubeconfig` whose server is this proxy; `None` when it does not name the upstream.
    pub fn kubeconfig(&self, kubeconfig: &str) -> Option<String> {
        let upstream = self.upstream.to_string();
        kubeconfig
            .contains(&upstream)
            .then(|| kubeconfig.replace(&upstream, &self.addr.to_string()))
    }

    /// Refuses new connections and ends the open ones, for good.
    pub fn cut(&self) {
        self.cut.cancel();
    }

    /// Ends the open connections and drops new ones until [`Partition::heal`]: a partition that
    /// ends.
    pub fn pause(&self) {
        self.paused.send_replace(true);
    }

    /// Relays again after [`Partition::pause`].
    pub fn heal(&self) {
        self.paused.send_replace(false);
    }

    pub fn is_cut(&self) -> bool {
        self.cut.is_cancelled()
    }

    /// When the client sent bytes through this proxy, if it ever did.
    pub fn sent(&self) -> Option<Span> {
        lock(&self.sent).span
    }

    /// Every moment the client sent bytes (the latest [`MAX_SENDS`] at least), oldest first.
    pub fn sent_times(&self) -> Vec<Instant> {
        lock(&self.sent).times.clone()
    }

    /// The first moment after `after` that the client sent bytes.
    pub fn first_sent_after(&self, after: Instant) -> Option<Instant> {
        lock(&self.sent).times.iter().copied().find(|t| *t > after)
    }
}

impl Drop for Partition {
    fn drop(&mut self) {
        self.cut.cancel();
    }
}

/// The loopback address of an API server URL (`http://127.0.0.1:PORT`).
pub fn upstream_of(url: &str) -> Option<SocketAddr> {
    url.trim_start_matches("http://")
        .trim_start_matches("https://")
        .trim_end_matches('/')
        .parse()
        .ok()
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

async fn accept(
    listener: TcpListener,
    upstream: SocketAddr,
    cut: CancellationToken,
    paused: watch::Receiver<bool>,
    sent: Arc<Mutex<Sent>>,
) {
    loop {
        let client = tokio::select! {
            _ = cut.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok((client, _)) => client,
                Err(_) => continue,
            },
        };
        if *paused.borrow() {
            continue;
        }
        let connection = cut.clone();
        let mut paused = paused.clone();
        let sent = sent.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = connection.cancelled() => {}
                _ = paused.wait_for(|paused| *paused) => {}
                _ = relay(client, upstream, &sent) => {}
            }
        });
    }
}

fn note(sent: &Mutex<Sent>) {
    let now = Instant::now();
    let mut sent = lock(sent);
    sent.span = Some(
        sent.span
            .map_or(Span { first: now, last: now }, |s| Span { last: now, ..s }),
    );
    if sent.times.len() >= MAX_SENDS {
        sent.times.drain(..MAX_SENDS / 2);
    }
    sent.times.push(now);
}

/// Copies both ways until either side closes, noting each time the client sends.
async fn relay(client: TcpStream, upstream: SocketAddr, sent: &Mutex<Sent>) {
    let Ok(server) = TcpStream::connect(upstream).await else {
        return;
    };
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let upward = async {
        let mut buffer = vec![0u8; 16 * 1024];
        loop {
            let read = match client_read.read(&mut buffer).await {
                Ok(0) | Err(_) => break,
                Ok(read) => read,
            };
            note(sent);
            if server_write.write_all(&buffer[..read]).await.is_err() {
                break;
            }
        }
        let _ = server_write.shutdown().await;
    };
    let downward = async {
        let _ = tokio::io::copy(&mut server_read, &mut client_write).await;
        let _ = client_write.shutdown().await;
    };
    tokio::join!(upward, downward);
}
