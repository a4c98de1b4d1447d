//! Leasing ClusterDeploymentCustomizations (DESIGN.md §4.3 items 1, 3, 6): every CDC status write
//! goes through [`write_status`], a server-side apply of the whole status carrying the cached
//! `resourceVersion`, so of two writers racing for one CDC exactly one wins and the other gets 409.
//! Every controller writing CDC status (pool, deployment) uses the one field manager
//! [`FIELD_MANAGER`]: the status has a single owner, so a field one controller sets (the lease)
//! is removed when another stops sending it (the release).

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::Api;

use super::lease_state::{
    APPLY_SUCCEEDED, AVAILABLE, INSTALLATION_PENDING, SUCCEEDED, interrupted, lease_holder, reads_free,
};
use crate::api::common::LocalObjectReference;
use crate::api::pools::{ClusterDeploymentCustomization, ClusterDeploymentCustomizationStatus};
use crate::runtime::conditions::{DesiredCondition, set_condition};
use crate::runtime::status_writer::apply_status;

/// The field manager of every CDC status write, whichever controller makes it.
pub(crate) const FIELD_MANAGER: &str = "stackd/cdc-lease";

type Cdc = ClusterDeploymentCustomization;

/// The one writer of CDC status: applies `change` to a copy of the cached status and writes it with
/// the cached resourceVersion as a precondition. `Ok(None)` when `change` changed nothing (no
/// request sent).
pub(crate) async fn write_status(
    api: &Api<Cdc>,
    cached: &Cdc,
    change: impl FnOnce(&mut ClusterDeploymentCustomizationStatus, Time) -> bool,
) -> Result<Option<Cdc>, kube::Error> {
    let mut status = cached.status.clone().unwrap_or_default();
    if !change(&mut status, Time(Timestamp::now())) {
        return Ok(None);
    }
    let version = cached.metadata.resource_version.as_deref();
    apply_status(api, cached, FIELD_MANAGER, &status, version)
        .await
        .map(Some)
}

fn apply(
    status: &mut ClusterDeploymentCustomizationStatus,
    ok: bool,
    reason: &str,
    message: String,
    generation: Option<i64>,
    now: Time,
) -> bool {
    set_condition(
        &mut status.conditions,
        DesiredCondition {
            type_: APPLY_SUCCEEDED,
            status: ok,
            reason,
            message,
            observed_generation: generation,
        },
        now,
    )
}

/// Leases `cdc` for the ClusterDeployment `cd` (not created yet) of `pool`. The write persists the
/// intended CD name, the pool and the configuration applied, all at once. `Ok(None)` when the copy
/// given is already leased or deleting: a newer cached copy must never be leased over.
pub(crate) async fn lease(api: &Api<Cdc>, cdc: &Cdc, cd: &str, pool: &str) -> Result<Option<Cdc>, kube::Error> {
    if lease_holder(cdc).is_some() || cdc.metadata.deletion_timestamp.is_some() {
        return Ok(None);
    }
    let generation = cdc.metadata.generation;
    let applied = serde_json::to_string(&cdc.spec).unwrap_or_default();
    let written = write_status(api, cdc, |status, now| {
        set_condition(
            &mut status.conditions,
            DesiredCondition {
                type_: AVAILABLE,
                status: false,
                reason: "Reserved",
                message: format!("Leased by ClusterDeployment {cd} of ClusterPool {pool}"),
                observed_generation: generation,
            },
            now.clone(),
        );
        status.cluster_deployment_ref = Some(LocalObjectReference { name: cd.into() });
        status.cluster_pool_ref = Some(LocalObjectReference { name: pool.into() });
        status.last_applied_configuration = Some(applied);
        apply(
            status,
            false,
            INSTALLATION_PENDING,
            format!("Patches applied; cluster {cd} is installing"),
            generation,
            now,
        );
        true
    })
    .await?;
    Ok(written)
}

/// Releases the lease, but only if it is still held by `cd` of `pool` (§4.3.6); a lease held by
/// anyone else is left alone. Returns whether it released.
pub(crate) async fn release(api: &Api<Cdc>, cdc: &Cdc, cd: &str, pool: &str) -> Result<bool, kube::Error> {
    match lease_holder(cdc) {
        Some((Some(p), Some(c))) if p == pool && c == cd => {}
        _ => return Ok(false),
    }
    let generation = cdc.metadata.generation;
    let written = write_status(api, cdc, |status, now| {
        let message = format!("Released by ClusterDeployment {cd} of ClusterPool {pool}");
        set_available(status, message, generation, now);
        true
    })
    .await?;
    Ok(written.is_some())
}

/// Writes what a CDC no pool holds reads, `Available=True` without refs, on a CDC that holds no
/// lease but does not read so yet (new, or written by hand or by Hive). `Ok(None)` when it already
/// reads so, or holds a lease (no request sent).
pub(crate) async fn mark_available(api: &Api<Cdc>, cdc: &Cdc) -> Result<Option<Cdc>, kube::Error> {
    if lease_holder(cdc).is_some() || reads_free(cdc) {
        return Ok(None);
    }
    let generation = cdc.metadata.generation;
    write_status(api, cdc, |status, now| {
        set_available(status, "No pool holds a lease on it".into(), generation, now);
        true
    })
    .await
}

/// Releases an interrupted lease (see [`interrupted`]); `Ok(None)` when the copy given holds none.
pub(crate) async fn release_interrupted(api: &Api<Cdc>, cdc: &Cdc) -> Result<Option<Cdc>, kube::Error> {
    if !interrupted(cdc) {
        return Ok(None);
    }
    let generation = cdc.metadata.generation;
    write_status(api, cdc, |status, now| {
        let message = "Released an interrupted lease: Available was False with no clusterDeploymentRef".into();
        set_available(status, message, generation, now);
        true
    })
    .await
}

/// The free state: `Available=True`, no refs.
fn set_available(
    status: &mut ClusterDeploymentCustomizationStatus,
    message: String,
    generation: Option<i64>,
    now: Time,
) {
    set_condition(
        &mut status.conditions,
        DesiredCondition {
            type_: AVAILABLE,
            status: true,
            reason: "Available",
            message,
            observed_generation: generation,
        },
        now,
    );
    status.cluster_deployment_ref = None;
    status.cluster_pool_ref = None;
}

/// Records the outcome of applying the CDC: Succeeded, BrokenBySyntax (with the error) or
/// BrokenByCloud. Returns the written object, if anything changed.
pub(crate) async fn set_apply_result(
    api: &Api<Cdc>,
    cdc: &Cdc,
    reason: &str,
    message: String,
) -> Result<Option<Cdc>, kube::Error> {
    let generation = cdc.metadata.generation;
    let ok = reason == SUCCEEDED;
    write_status(api, cdc, |status, now| {
        apply(status, ok, reason, message, generation, now)
    })
    .await
}
