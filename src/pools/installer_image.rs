//! Where a pool's installer comes from (`--allowed-registries`, DESIGN.md §8): a pool whose
//! `installerImage` is not from a registry the host allows gets no clusters at all, and says so
//! (`CapacityAvailable=False`, reason `RegistryNotAllowed`, with an Event). The installer Job runs in
//! the tenant's host namespace, pulled with whatever credentials the node has. (A ClusterDeployment
//! made by hand is checked again where its installer Job would be made.)

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::runtime::controller::Action;
use kube::{Api, ResourceExt};

use super::pass::FIELD_MANAGER;
use crate::api::pools::ClusterPool;
use crate::context::events::publish;
use crate::context::tenant::TenantContext;
use crate::runtime::conditions::{DesiredCondition, set_condition};
use crate::runtime::status_writer::apply_status;

/// The `CapacityAvailable` reason of a pool refused for its installer image.
const REASON: &str = "RegistryNotAllowed";

/// Refuses the pool when its installer image is not allowed: writes the condition (once) and says
/// to wait for an edit. `None` when the image is allowed.
pub(super) async fn refuse_if_not_allowed(
    pool: &ClusterPool,
    tenant: &TenantContext,
) -> Option<Result<Action, kube::Error>> {
    let registries = &tenant.shared.settings.allowed_registries;
    let message = registries.refusal("the pool's installerImage", &pool.spec.installer_image)?;
    let mut status = pool.status.clone().unwrap_or_default();
    let changed = set_condition(
        &mut status.conditions,
        DesiredCondition {
            type_: "CapacityAvailable",
            status: false,
            reason: REASON,
            message: message.clone(),
            observed_generation: pool.metadata.generation,
        },
        Time(Timestamp::now()),
    );
    if changed {
        let pools = Api::<ClusterPool>::namespaced(tenant.client.clone(), &pool.namespace().unwrap_or_default());
        if let Err(err) = apply_status(&pools, pool, FIELD_MANAGER, &status, None).await {
            return Some(Err(err));
        }
        publish(tenant, pool, true, REASON, message).await;
    }
    Some(Ok(Action::await_change()))
}
