//! The bare-metal inventory (DESIGN.md §5): per tenant, the BareMetalAsset controller (labels,
//! credentials, conditions, Events). Pools assign assets (`crate::pools::hosts`).

pub mod asset;
pub mod delivery;

use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use crate::context::tenant::{TenantContext, TenantError};

/// Label mirroring `spec.role` ("" for an asset without a role).
pub const ROLE_LABEL: &str = "inventory.stackd.dev/role";
/// Label mirroring `spec.clusterName`; absent while the asset is unassigned.
pub const CLUSTER_LABEL: &str = "inventory.stackd.dev/cluster";

/// Runs the inventory controllers of one tenant until `cancel` fires.
pub async fn run(context: Arc<TenantContext>, cancel: CancellationToken) -> Result<(), TenantError> {
    // The controller stops by itself on `cancel` (runtime::shutdown); stopping before that is a
    // failure of the tenant.
    // Aborted with this task: a detached controller would go on beside a restarted tenant.
    AbortOnDropHandle::new(tokio::spawn(asset::run(context, cancel.clone())))
        .await
        .map_err(|e| TenantError::Controller(e.to_string()))?;
    if !cancel.is_cancelled() {
        return Err(TenantError::Controller("the BareMetalAsset controller stopped".into()));
    }
    Ok(())
}
