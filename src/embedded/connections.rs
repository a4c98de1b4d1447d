//! Connections open to the server right now, counted as they are accepted and closed: how a test
//! sees whether a client multiplexes its requests over one connection or opens one per watch. And
//! the bytes read from and written to them: how a test sees that a request is on its way, or that
//! what flow control allows was sent, without waiting on time.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use axum::serve::Listener;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// `inner`, with every connection it accepts counted in `open` until it closes.
pub(super) struct Counted<L> {
    pub inner: L,
    pub open: Arc<AtomicU64>,
    pub traffic: Arc<Traffic>,
}

/// Bytes read from and written to the server's connections so far (TLS: as plain text).
#[derive(Debug, Default)]
pub(super) struct Traffic {
    pub received: AtomicU64,
    pub sent: AtomicU64,
}

impl<L> Listener for Counted<L>
where
    L: Listener,
    L::Io: Unpin,
{
    type Io = CountedIo<L::Io>;
    type Addr = L::Addr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        let (io, address) = self.inner.accept().await;
        self.open.fetch_add(1, Ordering::Relaxed);
        let (open, traffic) = (self.open.clone(), self.traffic.clone());
        (CountedIo { io, open, traffic }, address)
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

/// An accepted connection, uncounted when dropped (closed by either side).
pub(super) struct CountedIo<I> {
    io: I,
    open: Arc<AtomicU64>,
    traffic: Arc<Traffic>,
}

impl<I> CountedIo<I> {
    fn sent(&self, written: &Poll<io::Result<usize>>) {
        if let Poll::Ready(Ok(bytes)) = written {
            self.traffic.sent.fetch_add(*bytes as u64, Ordering::Relaxed);
        }
    }
}

impl<I> Drop for CountedIo<I> {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::Relaxed);
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for CountedIo<I> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let read = Pin::new(&mut self.io).poll_read(cx, buf);
        let bytes = buf.filled().len().saturating_sub(before);
        self.traffic.received.fetch_add(bytes as u64, Ordering::Relaxed);
        read
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for CountedIo<I> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let written = Pin::new(&mut self.io).poll_write(cx, buf);
        self.sent(&written);
        written
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let written = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.sent(&written);
        written
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// A plain TCP listener that, when `stop` fires, closes its socket before it tells the server to
/// stop ([`ClosingListener::closed`]): a stopping server sends its connections GOAWAY only once new
/// connections are refused, as Go's servers do, so a client that asks again at once is refused
/// rather than let into the backlog and cut off.
pub(super) struct ClosingListener {
    inner: Option<tokio::net::TcpListener>,
    stop: tokio_util::sync::CancellationToken,
    closed: tokio_util::sync::CancellationToken,
    address: std::net::SocketAddr,
}

impl ClosingListener {
    pub(super) fn new(
        inner: tokio::net::TcpListener,
        stop: tokio_util::sync::CancellationToken,
    ) -> io::Result<ClosingListener> {
        Ok(ClosingListener {
            address: inner.local_addr()?,
            inner: Some(inner),
            stop,
            closed: tokio_util::sync::CancellationToken::new(),
        })
    }

    /// Cancelled once the socket is closed.
    pub(super) fn closed(&self) -> tokio_util::sync::CancellationToken {
        self.closed.clone()
    }
}

impl Listener for ClosingListener {
    type Io = tokio::net::TcpStream;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let Some(listener) = &self.inner else {
                return std::future::pending().await;
            };
            let accepted = tokio::select! {
                _ = self.stop.cancelled() => {
                    self.inner = None;
                    self.closed.cancel();
                    continue;
                }
                accepted = listener.accept() => accepted,
            };
            match accepted {
                Ok((stream, address)) => {
                    // As Go's servers (kube-apiserver's) do on every connection.
                    let _ = stream.set_nodelay(true);
                    return (stream, address);
                }
                // Transient accept errors (e.g. out of descriptors): back off briefly and retry.
                Err(_) => tokio::time::sleep(std::time::Duration::from_millis(10)).await,
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        Ok(self.address)
    }
}
