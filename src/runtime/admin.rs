//! The admin server: `/metrics`, `/healthz`, `/readyz` (with `?verbose` detail per tenant).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::{Query, State};
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

async fn readyz(State(state): State<AdminState>, Query(query): Query<HealthQuery>) -> impl IntoResponse {
    let code = if state.health.is_ready() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = match query.verbose {
        Some(_) => state.health.detail(),
        None if code == StatusCode::OK => "ok".to_string(),
        None => "not ready".to_string(),
    };
    (code, body)
}
