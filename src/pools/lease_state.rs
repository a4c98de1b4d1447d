//! What a ClusterDeploymentCustomization's status says of its lease (DESIGN.md §4.3 items 1, 3),
//! read without a request: who holds it and since when, whether it was interrupted or reads free,
//! the verdict on applying it, and where a free one stands in the leasing order. The writes are in
//! `leases.rs`.

use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

use crate::api::pools::ClusterDeploymentCustomization;

pub(crate) const AVAILABLE: &str = "Available";
pub(crate) const APPLY_SUCCEEDED: &str = "ApplySucceeded";

pub(crate) const SUCCEEDED: &str = "Succeeded";
pub(crate) const INSTALLATION_PENDING: &str = "InstallationPending";
pub(crate) const BROKEN_BY_SYNTAX: &str = "BrokenBySyntax";
pub(crate) const BROKEN_BY_CLOUD: &str = "BrokenByCloud";

type Cdc = ClusterDeploymentCustomization;

fn condition<'a>(cdc: &'a Cdc, type_: &str) -> Option<&'a Condition> {
    cdc.status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == type_))
}

/// Who holds the lease, if anyone: `(pool, cluster deployment)`. A CDC is leased while its
/// `Available` condition is False.
pub(crate) fn lease_holder(cdc: &Cdc) -> Option<(Option<String>, Option<String>)> {
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
pub(crate) fn interrupted(cdc: &Cdc) -> bool {
    matches!(lease_holder(cdc), Some((_, None)))
}

/// True when the CDC reads what a free CDC reads (§4.3.1): `Available=True` and no refs.
pub(crate) fn reads_free(cdc: &Cdc) -> bool {
    let status = cdc.status.as_ref();
    let available = condition(cdc, AVAILABLE).is_some_and(|c| c.status == "True");
    let refs = status.is_some_and(|s| s.cluster_deployment_ref.is_some() || s.cluster_pool_ref.is_some());
    available && !refs
}

/// How long the current lease has been held.
pub(crate) fn lease_age(cdc: &Cdc) -> Option<Duration> {
    let since = condition(cdc, AVAILABLE).filter(|c| c.status == "False")?;
    Some(age(&since.last_transition_time))
}

fn age(time: &Time) -> Duration {
    let elapsed = Timestamp::now().duration_since(time.0);
    Duration::try_from(elapsed).unwrap_or_default()
}

/// The `ApplySucceeded` reason that applies to the CDC's current generation; a BrokenBySyntax
/// verdict on an older generation no longer counts (the user edited the patches).
pub(crate) fn apply_reason(cdc: &Cdc) -> Option<&str> {
    let c = condition(cdc, APPLY_SUCCEEDED)?;
    let current = c.observed_generation.is_none() || c.observed_generation == cdc.metadata.generation;
    if !current && matches!(c.reason.as_str(), BROKEN_BY_SYNTAX | BROKEN_BY_CLOUD) {
        return None;
    }
    Some(c.reason.as_str())
}

/// When the `ApplySucceeded` verdict was reached.
pub(crate) fn apply_since(cdc: &Cdc) -> Option<Duration> {
    condition(cdc, APPLY_SUCCEEDED).map(|c| age(&c.last_transition_time))
}

/// Where a free CDC stands in the order of §4.3.3.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Rank {
    /// Succeeded before: least recently succeeded first (the key is the negated age in seconds).
    PastSuccess(i64),
    /// Never used (or edited since it broke): by name.
    NeverUsed,
    /// Broke on the cloud before: tried last, oldest verdict first.
    Broken(i64),
}

/// The rank of a CDC the pool may lease (judged so by `judgement::of`), or `None` while it is
/// broken by cloud and still inside its backoff.
pub(crate) fn rank(cdc: &Cdc, broken_backoff: impl Fn() -> Duration) -> Option<Rank> {
    let since = apply_since(cdc).unwrap_or_default();
    match apply_reason(cdc) {
        Some(SUCCEEDED) => Some(Rank::PastSuccess(-(since.as_secs() as i64))),
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
    fn a_cdc_broken_by_cloud_ranks_only_after_its_backoff_and_an_edited_one_as_never_used() {
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
