//! The bare-metal inventory (DESIGN.md §5): per tenant, the BareMetalAsset controller (labels,
//! credentials, conditions, Events). Pools assign assets (`crate::pools::hosts`).

mod asset;
mod delivery;
mod remote_host;

pub(crate) use asset::{LOOKUPS_PER_NAMESPACE, credentials_recheck};

use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use crate::api::inventory::AssetRole;
use crate::context::tenant::{TenantContext, TenantError};

/// Label mirroring `spec.role` ("" for an asset without a role).
pub(crate) const ROLE_LABEL: &str = "inventory.stackd.dev/role";
/// Label mirroring `spec.clusterName`; absent while the asset is unassigned.
pub(crate) const CLUSTER_LABEL: &str = "inventory.stackd.dev/cluster";

/// The [`ROLE_LABEL`] value of a role; "" for an asset that may fill either.
pub(crate) fn role_label(role: Option<AssetRole>) -> &'static str {
    match role.unwrap_or_default() {
        AssetRole::Master => "master",
        AssetRole::Worker => "worker",
        AssetRole::Unspecified => "",
    }
}

/// The controllers [`run`] starts.
pub(crate) const CONTROLLERS: [&str; 1] = [asset::CONTROLLER];

/// Runs the inventory controllers of one tenant until `cancel` fires.
pub(crate) async fn run(context: Arc<TenantContext>, cancel: CancellationToken) -> Result<(), TenantError> {
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
