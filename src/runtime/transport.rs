//! How the daemon's clients reach their API servers: a tenant's over one HTTP/2 connection where the
//! server offers it, the host's over HTTP/1.1 with few idle connections kept.
//!
//! kube 5 builds its client for HTTP/1.1 only, where every open watch holds a connection of its
//! own: a tenant's fifteen watches cost fifteen sockets, TLS sessions and buffers, which was most of
//! what an idle tenant cost the daemon and kept a thousand tenants from fitting a process's
//! open-files limit (BENCHMARKS.md). A real kube-apiserver offers HTTP/2 by ALPN on its TLS port, as
//! client-go uses it: the tenant client offers it too, and then every request and watch of one
//! tenant rides one connection. A server that does not take it (plain `http://`, a proxy that speaks
//! HTTP/1.1) gets HTTP/1.1.
//!
//! The host client stays on HTTP/1.1: one replica holds thousands of host watches (four per
//! tenant), more than a server allows streams on one connection (`--http2-max-streams-per-connection`),
//! and hyper queues a request for a free stream rather than opening a second connection. What it
//! changes from kube's is the idle pool: a renewed watch's request goes out before the ended one's
//! connection is back in the pool, so kube's client (idle connections kept 90 s, any number) held a
//! thousand spare sockets after every round of renewals.
//!
//! A stopping kube-apiserver refuses new connections at once, but keeps the shared connection and
//! the watches on it for up to a minute, so a tenant with nothing in flight would not notice. It
//! does send an HTTP/2 GOAWAY on that connection: the tenant client reads the headers of the frames
//! the server sends and calls [`GoingAway`] on each GOAWAY, for the tenant's probe to ask over a new
//! connection ([`new_connection_client`]). Over HTTP/1.1, which has no GOAWAY, the server closing an
//! idle connection does the same. kube-apiserver also sends GOAWAY to rebalance clients between
//! servers (and a proxy may close idle connections), so it is a reason to ask, never a verdict.
//!
//! The layers are kube's own (`ConfigExt`): the base URI, authentication, extra headers, and its
//! retry of 503s where `default_retry` asks for it (tenant clients turn it off, see
//! `tenancy::tenant::tenant_clients`). Not kept: kube's tracing spans of every request. A kubeconfig
//! that names a proxy keeps kube's own client.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use http::Uri;
use http_body_util::BodyExt;
use hyper::rt::{Read, ReadBuf, ReadBufCursor, Write};
use hyper_rustls::FixedServerNameResolver;
use hyper_timeout::TimeoutConnector;
use hyper_util::client::legacy::connect::{Connect, Connected, Connection, HttpConnector};
use hyper_util::rt::{TokioExecutor, TokioTimer};
use kube::client::retry::RetryPolicy;
use kube::client::{Body, ClientBuilder, ConfigExt, DynBody};
use kube::{Client, Config};
use tower::retry::RetryLayer;
use tower::{BoxError, ServiceBuilder, ServiceExt, util::BoxService};

/// How long a connection may stay silent before it is pinged, and how long the ping may go
/// unanswered before the connection (every watch on it) counts as dead: client-go's HTTP/2
/// health check uses the same figures (ReadIdleTimeout 30 s, PingTimeout 15 s). A half-open
/// connection would otherwise hold all of a tenant's watches until their read timeout.
const PING_AFTER_SILENCE: Duration = Duration::from_secs(30);
const PING_TIMEOUT: Duration = Duration::from_secs(15);

/// What one stream (a watch) may be sent ahead of being read, and what all of a connection's
/// together may. The connection's is far larger than any stream's, so that watches whose events wait
/// to be read (a busy controller behind them) hold back only themselves, never the tenant's other
/// requests; each stream's own window still bounds what it buffers. Go's HTTP/2 transport, which
/// client-go uses, does the same (4 MiB per stream, 1 GiB per connection).
pub const STREAM_WINDOW: u32 = 2 * 1024 * 1024;
const CONNECTION_WINDOW: u32 = 1024 * 1024 * 1024;

/// Idle tenant connections kept for the next request where the server speaks HTTP/1.1 only; kept
/// until the server closes them. Over HTTP/2 the one connection is shared and kept as long as it is
/// open: kube's 90 s idle timeout counted from the last new request, so a tenant whose watches ran
/// for minutes without one had a second connection opened at its next renewal.
const TENANT_IDLE_CONNECTIONS: usize = 4;

/// Idle host connections kept for the next request: enough for a burst of reconciles, few enough
/// that the connections of renewed watches do not linger as spares.
const HOST_IDLE_CONNECTIONS: usize = 32;

/// The service a [`ClientBuilder`] starts from: the type of kube's own default.
pub type Service = BoxService<http::Request<Body>, http::Response<Box<DynBody>>, BoxError>;

/// Called whenever the server says it takes no more requests on one of a client's connections: it
/// sends an HTTP/2 GOAWAY (it stops, or sends the client to another server) or closes the connection.
pub type GoingAway = Arc<dyn Fn() + Send + Sync>;

/// A tenant client builder for `config` that offers HTTP/2 (see the module's comment), calling
/// `going_away` on every GOAWAY; layers added to it wrap every request, as with kube's
/// `ClientBuilder::try_from`.
pub fn tenant_client_builder(config: Config, going_away: GoingAway) -> Result<ClientBuilder<Service>, kube::Error> {
    if config.proxy_url.is_some() {
        return ClientBuilder::try_from(config);
    }
    let mut http = hyper_util::client::legacy::Client::builder(TokioExecutor::new());
    http.timer(TokioTimer::new())
        .http2_keep_alive_interval(PING_AFTER_SILENCE)
        .http2_keep_alive_timeout(PING_TIMEOUT)
        .http2_initial_stream_window_size(STREAM_WINDOW)
        .http2_initial_connection_window_size(CONNECTION_WINDOW)
        .pool_idle_timeout(None)
        .pool_max_idle_per_host(TENANT_IDLE_CONNECTIONS);
    let connector = WatchingGoingAway {
        inner: connector(&config, Offer::Http2)?,
        going_away,
    };
    let http = http.build(connector);
    Ok(ClientBuilder::new(
        with_kube_layers(http, &config)?,
        config.default_namespace,
    ))
}

/// A tenant client for `config` that tells no one of a GOAWAY (see [`tenant_client_builder`]).
pub fn tenant_client(config: Config) -> Result<Client, kube::Error> {
    Ok(tenant_client_builder(config, Arc::new(|| {}))?.build())
}

/// A client whose every request opens a connection of its own and closes it after (HTTP/1.1, none
/// kept): what a probe asks through, since a connection the server no longer takes requests on (it
/// sent GOAWAY, or closed it unseen) says nothing of whether the server takes new ones.
pub fn new_connection_client(config: Config) -> Result<Client, kube::Error> {
    if config.proxy_url.is_some() {
        return Client::try_from(config);
    }
    let mut http = hyper_util::client::legacy::Client::builder(TokioExecutor::new());
    http.timer(TokioTimer::new()).pool_max_idle_per_host(0);
    let http = http.build(connector(&config, Offer::Http1)?);
    Ok(ClientBuilder::new(with_kube_layers(http, &config)?, config.default_namespace).build())
}

/// The host client for `config`: HTTP/1.1, at most [`HOST_IDLE_CONNECTIONS`] kept idle.
pub fn host_client(config: Config) -> Result<Client, kube::Error> {
    Ok(host_client_builder(config)?.build())
}

/// A host client builder for `config` (see [`host_client`]); layers added to it wrap every request.
pub fn host_client_builder(config: Config) -> Result<ClientBuilder<Service>, kube::Error> {
    if config.proxy_url.is_some() {
        return ClientBuilder::try_from(config);
    }
    let mut http = hyper_util::client::legacy::Client::builder(TokioExecutor::new());
    http.timer(TokioTimer::new())
        .pool_max_idle_per_host(HOST_IDLE_CONNECTIONS);
    let http = http.build(connector(&config, Offer::Http1)?);
    Ok(ClientBuilder::new(
        with_kube_layers(http, &config)?,
        config.default_namespace,
    ))
}

type Connector = TimeoutConnector<hyper_rustls::HttpsConnector<HttpConnector>>;

/// kube's layers over `http`.
fn with_kube_layers<C>(
    http: hyper_util::client::legacy::Client<C, Body>,
    config: &Config,
) -> Result<Service, kube::Error>
where
    C: Connect + Clone + Send + Sync + 'static,
{
    let retry = config
        .default_retry
        .then(|| RetryLayer::new(RetryPolicy::server_retry()));
    Ok(ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(retry)
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_err(BoxError::from)
        .service(http)
        .map_response(|answer| answer.map(|body| Box::new(body.map_err(BoxError::from)) as Box<DynBody>))
        .boxed())
}

/// The protocols offered by ALPN.
enum Offer {
    Http1,
    /// `h2` before `http/1.1`.
    Http2,
}

/// kube's TLS connector, offering `protocols`, within kube's connect, read and write timeouts.
fn connector(config: &Config, protocols: Offer) -> Result<Connector, kube::Error> {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    // HTTP/2 writes a request's frames (and window updates) in pieces: without TCP_NODELAY, Nagle's
    // algorithm holds the later ones for the peer's delayed ACK, tens of milliseconds each. Go,
    // hence client-go and kube-apiserver, sets it on every connection.
    http.set_nodelay(true);
    let builder = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(config.rustls_client_config()?)
        .https_or_http();
    let builder = match &config.tls_server_name {
        Some(name) => {
            let name = name
                .clone()
                .try_into()
                .map_err(|e| kube::Error::RustlsTls(kube::client::RustlsTlsError::InvalidServerName(e)))?;
            builder.with_server_name_resolver(FixedServerNameResolver::new(name))
        }
        None => builder,
    };
    let https = match protocols {
        Offer::Http1 => builder.enable_http1().wrap_connector(http),
        Offer::Http2 => builder.enable_all_versions().wrap_connector(http),
    };
    let mut connector = TimeoutConnector::new(https);
    connector.set_connect_timeout(config.connect_timeout);
    connector.set_read_timeout(config.read_timeout);
    connector.set_write_timeout(config.write_timeout);
    connector.set_reset_reader_on_write(config.reset_reader_on_write);
    Ok(connector)
}

/// A connector whose connections call `going_away` on every GOAWAY the server sends, and when it
/// closes one.
#[derive(Clone)]
struct WatchingGoingAway<C> {
    inner: C,
    going_away: GoingAway,
}

impl<C> tower::Service<Uri> for WatchingGoingAway<C>
where
    C: tower::Service<Uri>,
    C::Response: Connection,
    C::Future: Send + 'static,
{
    type Response = GoingAwayWatched<C::Response>;
    type Error = C::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, C::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), C::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, destination: Uri) -> Self::Future {
        let connecting = self.inner.call(destination);
        let going_away = self.going_away.clone();
        Box::pin(async move {
            let io = connecting.await?;
            // HTTP/1.1 has no GOAWAY: its frames are not followed.
            let frames = io.connected().is_negotiated_h2().then(FrameHeaders::default);
            Ok(GoingAwayWatched {
                io,
                frames,
                going_away,
                closed: false,
            })
        })
    }
}

/// A connection whose incoming bytes are looked at on their way to hyper: for a GOAWAY frame
/// (HTTP/2), or for the server closing it (either protocol).
struct GoingAwayWatched<T> {
    io: T,
    frames: Option<FrameHeaders>,
    going_away: GoingAway,
    /// The server closed it, and `going_away` was told.
    closed: bool,
}

/// What one read of a watched connection takes at most: a TLS record's plaintext.
const READ_CHUNK: usize = 16 * 1024;

impl<T: Read + Unpin> Read for GoingAwayWatched<T> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, mut buf: ReadBufCursor<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        // Read through a chunk of our own to see the bytes (hyper's cursor shows none).
        let mut chunk = [0u8; READ_CHUNK];
        let wanted = buf.remaining().min(READ_CHUNK);
        let mut read = ReadBuf::new(&mut chunk[..wanted]);
        ready!(Pin::new(&mut this.io).poll_read(cx, read.unfilled()))?;
        let bytes = read.filled();
        let going_away = match &mut this.frames {
            Some(frames) => frames.saw_going_away(bytes),
            None => false,
        };
        // A stopping server closes the idle connections of an HTTP/1.1 client, which has no GOAWAY.
        let closed = bytes.is_empty() && wanted > 0 && !std::mem::replace(&mut this.closed, true);
        if going_away || closed {
            (this.going_away)();
        }
        buf.put_slice(bytes);
        Poll::Ready(Ok(()))
    }
}

impl<T: Write + Unpin> Write for GoingAwayWatched<T> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }
}

impl<T: Connection> Connection for GoingAwayWatched<T> {
    fn connected(&self) -> Connected {
        self.io.connected()
    }
}

/// The HTTP/2 frame type GOAWAY (RFC 9113 §6.8).
const GOAWAY: u8 = 0x7;
/// A frame header's length: 24 bits of payload length, the type, flags and the stream id.
const FRAME_HEADER: usize = 9;

/// Follows the frame headers of what a server sends on an HTTP/2 connection (after TLS, from its
/// first byte: a server sends no preface but its SETTINGS frame), skipping the payloads.
#[derive(Default)]
struct FrameHeaders {
    header: [u8; FRAME_HEADER],
    /// Bytes of the current header seen so far.
    header_seen: usize,
    /// Payload bytes of the current frame still to come.
    payload_left: usize,
}

impl FrameHeaders {
    /// Takes the next bytes of the connection; true when a GOAWAY frame began in them.
    fn saw_going_away(&mut self, mut bytes: &[u8]) -> bool {
        let mut going_away = false;
        while !bytes.is_empty() {
            if self.payload_left > 0 {
                let skipped = self.payload_left.min(bytes.len());
                self.payload_left -= skipped;
                bytes = &bytes[skipped..];
                continue;
            }
            let taken = (FRAME_HEADER - self.header_seen).min(bytes.len());
            self.header[self.header_seen..self.header_seen + taken].copy_from_slice(&bytes[..taken]);
            self.header_seen += taken;
            bytes = &bytes[taken..];
            if self.header_seen == FRAME_HEADER {
                let [a, b, c, kind, ..] = self.header;
                self.payload_left = usize::from(a) << 16 | usize::from(b) << 8 | usize::from(c);
                going_away |= kind == GOAWAY;
                self.header_seen = 0;
            }
        }
        going_away
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A frame of `kind` with `payload`, as a server writes it.
    fn frame(kind: u8, payload: &[u8]) -> Vec<u8> {
        let length = payload.len().to_be_bytes();
        let mut bytes = length[length.len() - 3..].to_vec();
        bytes.extend([kind, 0, 0, 0, 0, 0]);
        bytes.extend(payload);
        bytes
    }

    #[test]
    fn a_goaway_is_seen_wherever_the_reads_split_the_frames() {
        let settings = frame(0x4, &[0, 3, 0, 0, 0, 100]);
        // A DATA frame whose payload looks like a GOAWAY header: payloads are skipped, not read.
        let data = frame(0x0, &frame(GOAWAY, &[0; 8]));
        let goaway = frame(GOAWAY, &[0x7f, 0xff, 0xff, 0xff, 0, 0, 0, 0]);
        let stream: Vec<u8> = [settings.clone(), data.clone(), goaway.clone()].concat();
        for chunk in [1, 2, 5, 9, 10, stream.len()] {
            let mut frames = FrameHeaders::default();
            let seen: Vec<bool> = stream.chunks(chunk).map(|bytes| frames.saw_going_away(bytes)).collect();
            assert_eq!(seen.iter().filter(|seen| **seen).count(), 1, "reads of {chunk} bytes");
            let goaway_starts = settings.len() + data.len();
            let last_read = goaway_starts + FRAME_HEADER - 1;
            assert!(
                seen[last_read / chunk],
                "told on the read completing its header ({chunk} bytes)"
            );
        }
        let mut frames = FrameHeaders::default();
        assert!(!frames.saw_going_away(&[settings, data].concat()));
    }
}
