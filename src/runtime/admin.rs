//! The admin server: `/metrics`, `/healthz`, `/readyz` (with `?verbose` detail per tenant).
//!
//! `stackd run` binds it to loopback unless `--metrics-addr` says otherwise. With `--health-addr`
//! the probes get a listener of their own and the metrics address answers `/metrics` alone, so a
//! Service in front of it (the chart's) exposes nothing else. Where a listener must be on the pod
//! IP (kubelet probes, Prometheus scrapes), the `?verbose` detail (tenant names, why each is down)
//! is still answered only to loopback peers (`kubectl port-forward` arrives on loopback too);
//! others get the plain answer.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use axum::Router;
use axum::extract::{ConnectInfo, Query, State};
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use tokio_util::sync::CancellationToken;

use super::health::Health;
use super::metrics::Metrics;

#[derive(Clone)]
struct AdminState {
    metrics: Arc<Metrics>,
    health: Arc<Health>,
}

#[derive(serde::Deserialize)]
struct HealthQuery {
    verbose: Option<String>,
}

/// What one admin listener answers; any other path is a 404.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoints {
    /// `/metrics`, `/healthz` and `/readyz`.
    All,
    /// `/metrics` only: what a Service may expose.
    Metrics,
    /// `/healthz` and `/readyz` only: what the kubelet probes.
    Health,
}

impl Endpoints {
    fn router(self) -> Router<AdminState> {
        let router = Router::new();
        let router = match self {
            Endpoints::All | Endpoints::Metrics => router.route("/metrics", get(metrics_handler)),
            Endpoints::Health => router,
        };
        match self {
            Endpoints::All | Endpoints::Health => router
                .route("/healthz", get(|| async { "ok" }))
                .route("/readyz", get(readyz)),
            Endpoints::Metrics => router,
        }
    }
}

/// Binds one admin listener answering `endpoints` and serves it until `cancel` fires; returns the
/// bound address.
pub async fn serve(
    addr: SocketAddr,
    endpoints: Endpoints,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    cancel: CancellationToken,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let app = endpoints.router().with_state(AdminState { metrics, health });
    let task = tokio::spawn(async move {
        let shutdown = async move { cancel.cancelled().await };
        let app = app.into_make_service_with_connect_info::<SocketAddr>();
        if let Err(err) = axum::serve(listener, app).with_graceful_shutdown(shutdown).await {
            tracing::error!(error = %err, "admin server failed");
        }
    });
    Ok((bound, task))
}

async fn metrics_handler(State(state): State<AdminState>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.encode(),
    )
}

/// Whether a client at `peer` may read the per-tenant detail: only one on the daemon's own host
/// or pod.
fn may_see_detail(peer: IpAddr) -> bool {
    peer.to_canonical().is_loopback()
}

async fn readyz(
    State(state): State<AdminState>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    Query(query): Query<HealthQuery>,
) -> impl IntoResponse {
    let code = if state.health.is_ready() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let plain = if code == StatusCode::OK { "ok" } else { "not ready" };
    let body = match query.verbose {
        Some(_) if may_see_detail(peer.ip()) => state.health.detail(),
        Some(_) => format!("{plain}\n(the per-tenant detail is served to loopback clients only)\n"),
        None => plain.to_string(),
    };
    (code, body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::health::TenantHealth;

    async fn readyz_body(peer: &str, verbose: bool) -> String {
        let health = Arc::new(Health::default());
        health.set_ready(true);
        health.set_tenant(
            "acme",
            TenantHealth::Down("connection refused by api.acme.internal".into()),
        );
        let state = AdminState {
            metrics: Arc::new(Metrics::new()),
            health,
        };
        let peer: SocketAddr = peer.parse().unwrap();
        let query = HealthQuery {
            verbose: verbose.then(String::new),
        };
        let response = readyz(State(state), ConnectInfo(peer), Query(query))
            .await
            .into_response();
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap();
        String::from_utf8(bytes.to_vec()).unwrap()
    }

    #[tokio::test]
    async fn verbose_readiness_detail_is_for_loopback_peers_only() {
        for peer in ["127.0.0.1:5000", "[::1]:5000", "[::ffff:127.0.0.1]:5000"] {
            let body = readyz_body(peer, true).await;
            assert!(body.contains("[-]tenant acme down"), "{peer}: {body}");
        }
        for peer in [
            "10.1.2.3:5000",
            "192.0.2.7:5000",
            "[fd00::7]:5000",
            "[::ffff:10.0.0.1]:5000",
        ] {
            let body = readyz_body(peer, true).await;
            assert!(!body.contains("acme"), "{peer}: {body}");
            assert!(body.starts_with("ok\n"), "{peer}: {body}");
        }
        assert_eq!(readyz_body("10.1.2.3:5000", false).await, "ok");
    }

    async fn status_line(addr: SocketAddr, path: &str) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let request = format!("GET {path} HTTP/1.0\r\nHost: stackd\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).await.unwrap();
        response.lines().next().unwrap_or_default().to_string()
    }

    #[tokio::test]
    async fn each_listener_answers_only_its_endpoints() {
        let cancel = CancellationToken::new();
        let paths = ["/metrics", "/healthz", "/readyz"];
        for (endpoints, answered) in [
            (Endpoints::All, [true, true, true]),
            (Endpoints::Metrics, [true, false, false]),
            (Endpoints::Health, [false, true, true]),
        ] {
            let health = Arc::new(Health::default());
            health.set_ready(true);
            let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
            let (addr, _task) = serve(loopback, endpoints, Arc::new(Metrics::new()), health, cancel.clone())
                .await
                .unwrap();
            for (path, answered) in paths.into_iter().zip(answered) {
                let status = status_line(addr, path).await;
                let expected = if answered { " 200 " } else { " 404 " };
                assert!(status.contains(expected), "{endpoints:?} {path}: {status}");
            }
        }
        cancel.cancel();
    }
}
