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
//! The layers are kube's own (`ConfigExt`): the base URI, authentication, extra headers, and its
//! retry of 503s where `default_retry` asks for it (tenant clients turn it off, see
//! `tenancy::tenant::tenant_client`). Not kept: kube's tracing spans of every request. A kubeconfig
//! that names a proxy keeps kube's own client.

use std::time::Duration;

use http_body_util::BodyExt;
use hyper_rustls::FixedServerNameResolver;
use hyper_timeout::TimeoutConnector;
use hyper_util::client::legacy::connect::HttpConnector;
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
const STREAM_WINDOW: u32 = 2 * 1024 * 1024;
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

/// A tenant client builder for `config` that offers HTTP/2 (see the module's comment); layers added
/// to it wrap every request, as with kube's `ClientBuilder::try_from`.
pub fn tenant_client_builder(config: Config) -> Result<ClientBuilder<Service>, kube::Error> {
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
    let http = http.build(connector(&config, Offer::Http2)?);
    Ok(ClientBuilder::new(
        with_kube_layers(http, &config)?,
        config.default_namespace,
    ))
}

/// A tenant client for `config` (see [`tenant_client_builder`]).
pub fn tenant_client(config: Config) -> Result<Client, kube::Error> {
    Ok(tenant_client_builder(config)?.build())
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
fn with_kube_layers(
    http: hyper_util::client::legacy::Client<Connector, Body>,
    config: &Config,
) -> Result<Service, kube::Error> {
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
