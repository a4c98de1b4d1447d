//! The admin server: `/metrics`, `/healthz`, `/readyz` (with `?verbose` detail per tenant).
//!
//! `stackd run` binds it to loopback unless `--metrics-addr` says otherwise. Where it must listen
//! on the pod IP (the chart: kubelet probes `/healthz` and `/readyz`, Prometheus scrapes
//! `/metrics`), the `?verbose` detail (tenant names, why each is down) is still answered only to
//! loopback peers (`kubectl port-forward` arrives on loopback too); others get the plain answer.

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

/// Binds the admin server and serves it until `cancel` fires; returns the bound address.
pub async fn serve(
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    cancel: CancellationToken,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let app = Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .with_state(AdminState { metrics, health });
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
}
