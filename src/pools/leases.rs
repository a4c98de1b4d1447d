//! Leasing ClusterDeploymentCustomizations (DESIGN.md §4.3 items 1, 3, 6): every CDC status write
//! goes through [`write_status`], a server-side apply of the whole status carrying the cached
//! `resourceVersion`, so of two writers racing for one CDC exactly one wins and the other gets 409.
//! Every controller writing CDC status (pool, deployment) uses the one field manager
//! [`FIELD_MANAGER`]: the status has a single owner, so a field one controller sets (the lease)
//! is removed when another stops sending it (the release).

use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::Api;

use crate::api::common::LocalObjectReference;
use crate::api::pools::{ClusterDeploymentCustomization, ClusterDeploymentCustomizationStatus};
use crate::runtime::conditions::{DesiredCondition, set_condition};
use crate::runtime::status_writer::apply_status;

pub const AVAILABLE: &str = "Available";
pub const APPLY_SUCCEEDED: &str = "ApplySucceeded";

pub const SUCCEEDED: &str = "Succeeded";
pub const INSTALLATION_PENDING: &str = "InstallationPending";
pub const BROKEN_BY_SYNTAX: &str = "BrokenBySyntax";
pub const BROKEN_BY_CLOUD: &str = "BrokenByCloud";

/// The field manager of every CDC status write, whichever controller makes it.
pub const FIELD_MANAGER: &str = "stackd/cdc-lease";

type Cdc = ClusterDeploymentCustomization;

/// The one writer of CDC status: applies `change` to a copy of the cached status and writes it with
/// the cached resourceVersion as a precondition. `Ok(None)` when `change` changed nothing (no
/// request sent).
pub async fn write_status(
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

fn condition<'a>(cdc: &'a Cdc, type_: &str) -> Option<&'a Condition> {
    cdc.status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == type_))
}

/// Who holds the lease, if anyone: `(pool, cluster deployment)`. A CDC is leased while its
/// `Available` condition is False.
pub fn lease_holder(cdc: &Cdc) -> Option<(Option<String>, Option<String>)> {
    let reserved = condition(cdc, AVAILABLE).is_some_and(|c| c.status == "False");
    reserved.then(|| {
        let status = cdc.status.as_ref();
        (
            status.and_then(|s| s.cluster_pool_ref.as_ref()).map(|r| r.name.clone()),
            status
                .and_then(|s| s.cluster_deployment_ref.as_ref())
                .map(|r| r.name.clone()),
        )
    })
}

/// True when the CDC reads `Available=False` without a `clusterDeploymentRef`: a lease interrupted
/// before its refs were written (Hive writes them in a later update), or one edited by hand. stackd
/// writes the refs with the lease, so it never leaves one behind; one found is repaired like an
/// orphaned lease after `--lease-min-age` (§4.3.1), and meanwhile backs no cluster.
pub fn interrupted(cdc: &Cdc) -> bool {
    matches!(lease_holder(cdc), Some((_, None)))
}

/// True when the CDC reads what a free CDC reads (§4.3.1): `Available=True` and no refs.
pub fn reads_free(cdc: &Cdc) -> bool {
    let status = cdc.status.as_ref();
    let available = condition(cdc, AVAILABLE).is_some_and(|c| c.status == "True");
    let refs = status.is_some_and(|s| s.cluster_deployment_ref.is_some() || s.cluster_pool_ref.is_some());
    available && !refs
}

/// How long the current lease has been held.
pub fn lease_age(cdc: &Cdc) -> Option<Duration> {
    let since = condition(cdc, AVAILABLE).filter(|c| c.status == "False")?;
    Some(age(&since.last_transition_time))
}

fn age(time: &Time) -> Duration {
    let elapsed = Timestamp::now().duration_since(time.0);
    Duration::try_from(elapsed).unwrap_or_default()
}

/// The `ApplySucceeded` reason that applies to the CDC's current generation; a BrokenBySyntax
/// verdict on an older generation no longer counts (the user edited the patches).
pub fn apply_reason(cdc: &Cdc) -> Option<&str> {
    let c = condition(cdc, APPLY_SUCCEEDED)?;
    let current = c.observed_generation.is_none() || c.observed_generation == cdc.metadata.generation;
    if !current && matches!(c.reason.as_str(), BROKEN_BY_SYNTAX | BROKEN_BY_CLOUD) {
        return None;
    }
    Some(c.reason.as_str())
}

/// When the `ApplySucceeded` verdict was reached.
pub fn apply_since(cdc: &Cdc) -> Option<Duration> {
    condition(cdc, APPLY_SUCCEEDED).map(|c| age(&c.last_transition_time))
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
pub async fn lease(api: &Api<Cdc>, cdc: &Cdc, cd: &str, pool: &str) -> Result<Option<Cdc>, kube::Error> {
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
pub async fn release(api: &Api<Cdc>, cdc: &Cdc, cd: &str, pool: &str) -> Result<bool, kube::Error> {
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
pub async fn mark_available(api: &Api<Cdc>, cdc: &Cdc) -> Result<Option<Cdc>, kube::Error> {
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
pub async fn release_interrupted(api: &Api<Cdc>, cdc: &Cdc) -> Result<Option<Cdc>, kube::Error> {
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
pub async fn set_apply_result(
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

/// Where a free CDC stands in the order of §4.3.3.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Rank {
    /// Succeeded before: least recently succeeded first (the key is the negated age in seconds).
    PastSuccess(i64),
    /// Never used (or edited since it broke): by name.
    NeverUsed,
    /// Broke on the cloud before: tried last, oldest verdict first.
    Broken(i64),
}

/// The rank of a CDC that may be leased now, or `None` if it may not: deleting, leased, broken by
/// syntax at this generation, or broken by cloud and still inside its backoff.
pub fn rank(cdc: &Cdc, broken_backoff: impl Fn() -> Duration) -> Option<Rank> {
    if cdc.metadata.deletion_timestamp.is_some() || lease_holder(cdc).is_some() {
        return None;
    }
    let since = apply_since(cdc).unwrap_or_default();
    match apply_reason(cdc) {
        Some(SUCCEEDED) => Some(Rank::PastSuccess(-(since.as_secs() as i64))),
        Some(BROKEN_BY_SYNTAX) => None,
        Some(BROKEN_BY_CLOUD) => (since >= broken_backoff()).then_some(Rank::Broken(-(since.as_secs() as i64))),
        _ => Some(Rank::NeverUsed),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::ResourceExt;
    use serde_json::json;

    fn cdc(name: &str, conditions: serde_json::Value) -> Cdc {
        serde_json::from_value(json!({
            "apiVersion": "pools.stackd.dev/v1alpha1", "kind": "ClusterDeploymentCustomization",
            "metadata": {"name": name, "namespace": "ns", "generation": 2},
            "spec": {"installConfigPatches": []},
            "status": {"conditions": conditions},
        }))
        .unwrap()
    }

    fn cond(type_: &str, status: &str, reason: &str, at: &str, generation: i64) -> serde_json::Value {
        json!({"type": type_, "status": status, "reason": reason, "message": "", "lastTransitionTime": at, "observedGeneration": generation})
    }

    #[test]
    fn selection_prefers_least_recent_success_then_new_then_broken() {
        let old = cdc(
            "z-old",
            json!([cond(APPLY_SUCCEEDED, "True", SUCCEEDED, "2020-01-01T00:00:00Z", 2)]),
        );
        let recent = cdc(
            "a-recent",
            json!([cond(APPLY_SUCCEEDED, "True", SUCCEEDED, "2024-01-01T00:00:00Z", 2)]),
        );
        let new = cdc("m-new", json!([]));
        let broken = cdc(
            "b-broken",
            json!([cond(
                APPLY_SUCCEEDED,
                "False",
                BROKEN_BY_CLOUD,
                "2020-01-01T00:00:00Z",
                2
            )]),
        );
        let no_backoff = || Duration::ZERO;
        let mut ranked: Vec<(Rank, String)> = [&recent, &broken, &new, &old]
            .iter()
            .map(|c| (rank(c, no_backoff).unwrap(), c.name_any()))
            .collect();
        ranked.sort();
        let names: Vec<&str> = ranked.iter().map(|(_, n)| n.as_str()).collect();
        assert_eq!(names, ["z-old", "a-recent", "m-new", "b-broken"]);
    }

    #[test]
    fn leased_syntax_broken_and_backing_off_cdcs_are_not_leasable() {
        let leased = cdc(
            "l",
            json!([cond(AVAILABLE, "False", "Reserved", "2020-01-01T00:00:00Z", 2)]),
        );
        assert_eq!(rank(&leased, || Duration::ZERO), None);
        let syntax = cdc(
            "s",
            json!([cond(
                APPLY_SUCCEEDED,
                "False",
                BROKEN_BY_SYNTAX,
                "2020-01-01T00:00:00Z",
                2
            )]),
        );
        assert_eq!(rank(&syntax, || Duration::ZERO), None);
        let edited = cdc(
            "e",
            json!([cond(
                APPLY_SUCCEEDED,
                "False",
                BROKEN_BY_SYNTAX,
                "2020-01-01T00:00:00Z",
                1
            )]),
        );
        assert_eq!(
            rank(&edited, || Duration::ZERO),
            Some(Rank::NeverUsed),
            "edited since it broke"
        );
        let now = Timestamp::now().to_string();
        let cloud = cdc("c", json!([cond(APPLY_SUCCEEDED, "False", BROKEN_BY_CLOUD, &now, 2)]));
        assert_eq!(rank(&cloud, || Duration::from_secs(60)), None, "inside its backoff");
    }

    #[test]
    fn a_lease_naming_no_cluster_is_interrupted_and_only_available_true_without_refs_reads_free() {
        let at = "2020-01-01T00:00:00Z";
        let with_status = |status: serde_json::Value| {
            let mut c = cdc("x", json!([]));
            c.status = serde_json::from_value(status).unwrap();
            c
        };
        let reserved = json!([cond(AVAILABLE, "False", "Reserved", at, 2)]);
        let cut = with_status(json!({"conditions": reserved, "clusterPoolRef": {"name": "p"}}));
        assert!(interrupted(&cut) && !reads_free(&cut));
        let held = with_status(json!({"conditions": reserved, "clusterDeploymentRef": {"name": "p-1"}}));
        assert!(!interrupted(&held));
        let free = with_status(json!({"conditions": [cond(AVAILABLE, "True", "Available", at, 2)]}));
        assert!(reads_free(&free) && !interrupted(&free));
        let dirty = with_status(
            json!({"conditions": [cond(AVAILABLE, "True", "Available", at, 2)], "clusterDeploymentRef": {"name": "c"}}),
        );
        assert!(!reads_free(&dirty), "refs left behind by hand or by Hive");
        assert!(!reads_free(&cdc("new", json!([]))), "no condition yet");
    }
}
