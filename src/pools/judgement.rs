//! What a pool makes of one of its inventory entries (DESIGN.md §4.3 items 1, 3, 4, 5): one
//! judgement, read by the plan (which entries back a cluster, which may be leased), by the entry's
//! status and by `InventoryValid`, so that no two of them can disagree about an entry.

use super::lease_state::{self, BROKEN_BY_CLOUD, BROKEN_BY_SYNTAX};
use crate::api::pools::{ClusterDeploymentCustomization, InventoryEntryState};

type Cdc = ClusterDeploymentCustomization;

/// What an inventory entry is to the pool listing it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Judgement {
    /// Its CDC does not exist.
    Missing,
    /// Its CDC is being deleted (a finalizer still holds it) and this pool does not hold its
    /// lease: it is never leased again.
    Deleting,
    /// Someone else keeps it from the pool.
    Unavailable(Holder),
    /// Leased by this pool for `cluster`.
    Reserved { cluster: String },
    /// Its patches do not apply (at its current generation).
    BrokenBySyntax,
    /// A cluster built from it failed to install: leased again, last, after a backoff.
    BrokenByCloud,
    /// Nobody holds it: the pool may lease it.
    Free,
}

/// Who keeps an Unavailable entry from the pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Holder {
    /// `Available=False` with no `clusterDeploymentRef` (§4.3.1): it backs no cluster until it is
    /// released after `--lease-min-age`.
    InterruptedLease,
    /// Another pool, by the name the CDC's status gives (anyone's to write), if any.
    Pool(Option<String>),
}

/// The judgement of pool `pool` on the entry whose CDC is `cdc` (`None`: there is none).
pub(super) fn of(cdc: Option<&Cdc>, pool: &str) -> Judgement {
    let Some(cdc) = cdc else {
        return Judgement::Missing;
    };
    match lease_state::lease_holder(cdc) {
        // Reserved for no cluster is not Reserved, even by this pool: it backs nothing until it
        // is repaired.
        Some((_, None)) => Judgement::Unavailable(Holder::InterruptedLease),
        Some((Some(holder), Some(cluster))) if holder == pool => Judgement::Reserved { cluster },
        Some((holder, Some(_))) => Judgement::Unavailable(Holder::Pool(holder)),
        // A CDC this pool holds is deleted only after its release (the pool's finalizer holds
        // it); one nobody holds is never leased again.
        None if cdc.metadata.deletion_timestamp.is_some() => Judgement::Deleting,
        None => match lease_state::apply_reason(cdc) {
            Some(BROKEN_BY_SYNTAX) => Judgement::BrokenBySyntax,
            Some(BROKEN_BY_CLOUD) => Judgement::BrokenByCloud,
            _ => Judgement::Free,
        },
    }
}

impl Judgement {
    /// Whether the entry backs one of the pool's unclaimed clusters, now or once a backoff ends
    /// (§4.3.5): what `CapacityAvailable` counts.
    pub(super) fn backs_a_cluster(&self) -> bool {
        matches!(
            self,
            Judgement::Reserved { .. } | Judgement::BrokenByCloud | Judgement::Free
        )
    }

    /// Whether the pool may lease the entry, once a BrokenByCloud one's backoff ends.
    pub(super) fn leasable(&self) -> bool {
        matches!(self, Judgement::BrokenByCloud | Judgement::Free)
    }

    /// The entry's state in the pool's status. (A Reserved entry whose CDC was edited since its
    /// cluster was built shows `ToBeUpdated` instead: the status decides that.)
    pub(super) fn state(&self) -> InventoryEntryState {
        match self {
            Judgement::Missing => InventoryEntryState::Missing,
            Judgement::Deleting => InventoryEntryState::Deleting,
            Judgement::Unavailable(_) => InventoryEntryState::Unavailable,
            Judgement::Reserved { .. } => InventoryEntryState::Reserved,
            Judgement::BrokenBySyntax => InventoryEntryState::BrokenBySyntax,
            Judgement::BrokenByCloud => InventoryEntryState::BrokenByCloud,
            Judgement::Free => InventoryEntryState::Available,
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;
    use crate::pools::buckets::fixtures::{cdc, leased, verdict};

    const OLD: &str = "2024-01-01T00:00:00Z";

    fn deleting(status: Value) -> Cdc {
        let mut cdc = Cdc::clone(&cdc("a", 1, status));
        cdc.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            jiff::Timestamp::UNIX_EPOCH,
        ));
        cdc.metadata.finalizers = Some(vec!["example.com/keep".into()]);
        cdc
    }

    /// `Available=False` without a `clusterDeploymentRef`, naming pool `p`.
    fn interrupted() -> Value {
        let mut status = leased("p", "");
        status.as_object_mut().expect("a status").remove("clusterDeploymentRef");
        status
    }

    #[test]
    fn a_cdc_being_deleted_that_nobody_holds_backs_nothing_and_is_never_leased() {
        let judged = of(Some(&deleting(json!({}))), "p");
        assert_eq!(judged, Judgement::Deleting);
        assert_eq!(judged.state(), InventoryEntryState::Deleting);
        assert!(!judged.backs_a_cluster() && !judged.leasable());
        // However broken it was, it is going.
        assert_eq!(
            of(Some(&deleting(verdict("BrokenByCloud", OLD, 1))), "p"),
            Judgement::Deleting
        );
    }

    #[test]
    fn a_cdc_being_deleted_keeps_backing_the_cluster_of_the_pool_holding_it() {
        let held = deleting(leased("p", "p-1"));
        let judged = of(Some(&held), "p");
        assert_eq!(judged, Judgement::Reserved { cluster: "p-1".into() });
        assert!(judged.backs_a_cluster() && !judged.leasable());
        assert_eq!(
            of(Some(&held), "q"),
            Judgement::Unavailable(Holder::Pool(Some("p".into())))
        );
    }

    #[test]
    fn a_lease_counts_as_this_pools_only_when_it_names_this_pool_and_a_cluster() {
        assert_eq!(
            of(Some(&*cdc("a", 1, interrupted())), "p"),
            Judgement::Unavailable(Holder::InterruptedLease),
            "never Reserved with no cluster"
        );
        let mut no_pool = leased("p", "p-1");
        no_pool.as_object_mut().expect("a status").remove("clusterPoolRef");
        let judged = of(Some(&*cdc("a", 1, no_pool)), "p");
        assert_eq!(judged, Judgement::Unavailable(Holder::Pool(None)));
        assert!(
            !judged.backs_a_cluster(),
            "the plan never counted it; the status called it Reserved"
        );
    }

    #[test]
    fn free_broken_and_missing_entries_are_judged_by_their_verdict() {
        let judge = |status: Value| of(Some(&*cdc("a", 1, status)), "p");
        assert_eq!(judge(json!({})), Judgement::Free);
        assert_eq!(judge(verdict("Succeeded", OLD, 1)), Judgement::Free);
        assert_eq!(judge(verdict("BrokenBySyntax", OLD, 1)), Judgement::BrokenBySyntax);
        assert_eq!(
            judge(verdict("BrokenBySyntax", OLD, 0)),
            Judgement::Free,
            "edited since it broke"
        );
        let cloud = judge(verdict("BrokenByCloud", OLD, 1));
        assert_eq!(cloud, Judgement::BrokenByCloud);
        assert!(cloud.backs_a_cluster() && cloud.leasable());
        assert_eq!(of(None, "p"), Judgement::Missing);
        assert!(!Judgement::BrokenBySyntax.backs_a_cluster() && !Judgement::Missing.backs_a_cluster());
    }
}
