//! The latency floor: one API round trip to an embedded server, measured in the same run, so that
//! install times can be reported as multiples of it instead of machine-dependent seconds.

use std::time::Instant;

use k8s_openapi::api::core::v1::Namespace;
use kube::Api;
use serde::{Deserialize, Serialize};

use super::BenchError;
use crate::embedded::{ApiServer, ServerOptions};

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LatencyFloor {
    pub rtt_ms_p50: f64,
    pub rtt_ms_p99: f64,
    pub samples: usize,
}

/// Times `samples` sequential GETs of a namespace.
pub(super) async fn measure(samples: usize) -> Result<LatencyFloor, BenchError> {
    let server = ApiServer::start(ServerOptions {
        name: "latency".into(),
        ..Default::default()
    })
    .await?;
    let namespaces: Api<Namespace> = Api::all(server.client().await);
    namespaces.get("default").await?;
    let mut times = Vec::with_capacity(samples);
    for _ in 0..samples {
        let started = Instant::now();
        namespaces.get("default").await?;
        times.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    server.shutdown().await;
    Ok(LatencyFloor {
        rtt_ms_p50: percentile(&mut times, 0.50),
        rtt_ms_p99: percentile(&mut times, 0.99),
        samples,
    })
}

/// The `q` quantile (nearest rank) of `values`.
pub(super) fn percentile(values: &mut [f64], q: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    let rank = ((q * values.len() as f64).ceil() as usize).clamp(1, values.len());
    values[rank - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let mut values = vec![5.0, 1.0, 3.0, 2.0, 4.0];
        assert_eq!(percentile(&mut values, 0.5), 3.0);
        assert_eq!(percentile(&mut values, 0.99), 5.0);
        assert_eq!(percentile(&mut [], 0.5), 0.0);
    }
}
