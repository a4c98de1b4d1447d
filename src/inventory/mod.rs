//! The bare-metal inventory (DESIGN.md §5): per tenant, the BareMetalAsset controller (labels,
//! credentials, conditions, Events). Pools assign assets (`crate::pools::hosts`).

pub mod asset;
pub mod delivery;

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::tenancy::tenant::{TenantContext, TenantError};

/// Label mirroring `spec.role` ("" for an asset without a role).
pub const ROLE_LABEL: &str = "inventory.stackd.dev/role";
/// Label mirroring `spec.clusterName`; absent while the asset is unassigned.
pub const CLUSTER_LABEL: &str = "inventory.stackd.dev/cluster";

/// Runs the inventory controllers of one tenant until `cancel` fires.
pub async fn run(context: Arc<TenantContext>, cancel: CancellationToken) -> Result<(), TenantError> {
    let mut task = tokio::spawn(asset::run(context, cancel.clone()));
    tokio::select! {
        _ = cancel.cancelled() => {}
        result = &mut task => {
            result.map_err(|e| TenantError::Controller(e.to_string()))?;
            if !cancel.is_cancelled() {
                return Err(TenantError::Controller("the BareMetalAsset controller stopped".into()));
            }
            return Ok(());
        }
    }
    // In-flight reconciles get a moment; a controller waiting on a watch that never becomes ready
    // (the tenant lacks the CRD) must not hold the tenant's shutdown.
    if tokio::time::timeout(SHUTDOWN_GRACE, &mut task).await.is_err() {
        task.abort();
    }
    Ok(())
}

/// How long in-flight reconciles may take to finish once the tenant stops.
const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(2);
