//! What the BareMetalAsset controller does next (DESIGN.md §5), decided from what it has read:
//! the asset, the cached ClusterDeployments and the credentials Secret. Pure: no client.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::{Resource, ResourceExt};
use serde_json::{Map, Value, json};

use super::reach::FOREIGN_CLUSTER;
use crate::api::inventory::BareMetalAsset;
use crate::api::pools::ClusterDeployment;
use crate::bounds::{DOCUMENT_TOO_LARGE, DocumentLimits};
use crate::inventory::remote_host::{DeliveryError, MACHINE_API_NAMESPACE};
use crate::inventory::{CLUSTER_LABEL, ROLE_LABEL, role_label};

/// Finalizer on an asset delivered to a cluster, until it is removed from there again.
pub(super) const DELIVERY_FINALIZER: &str = "inventory.stackd.dev/delivery";
/// The cluster an asset was delivered to (it may have been unassigned since).
pub(super) const DELIVERED_TO_ANNOTATION: &str = "inventory.stackd.dev/delivered-to";

/// What one reconcile reads before deciding, all of it from the asset and the caches.
pub(crate) struct Snapshot<'a> {
    pub(crate) asset: &'a BareMetalAsset,
    /// The cached ClusterDeployment the asset is assigned to (its namespace has its name), when
    /// the asset may reach it (see `reach`).
    pub(crate) assigned: Option<&'a ClusterDeployment>,
    /// The cached ClusterDeployment the asset was last delivered to, when the asset may reach it.
    pub(crate) delivered: Option<&'a ClusterDeployment>,
    /// Why the assigned cluster, which exists, may not be reached from the asset's namespace.
    pub(crate) assigned_refused: Option<String>,
    /// Why the cluster the delivery record names, which exists, may not be reached.
    pub(crate) delivered_refused: Option<String>,
}

/// The first thing to do for an asset.
#[derive(Debug, PartialEq)]
pub(crate) enum Step<'a> {
    /// It was delivered to a cluster it no longer belongs to, or is being deleted: detach first.
    Detach(Detach<'a>),
    /// Being deleted, and nothing of ours holds it.
    Nothing,
    /// The role and cluster labels differ from the spec: write these (`null` removes a label).
    Label(Map<String, Value>),
    /// Labels are right: check the credentials and the cluster, deliver, report.
    Report,
}

/// The one detach path (§5), for deletion and for unassignment or reassignment alike.
#[derive(Debug, PartialEq)]
pub(crate) enum Detach<'a> {
    /// A finalizer without a record of where the host went: nothing to remove remotely.
    Release,
    /// The cluster is being deleted or gone: its BareMetalHost is not removed there.
    ClusterDestroyed { cluster: String },
    /// Remove the BareMetalHost and its Secret from the installed cluster, then release.
    Remote { cluster: String, cd: &'a ClusterDeployment },
    /// The record names a cluster the asset may not reach (someone wrote it by hand): nothing is
    /// removed there, and the record goes.
    Refused { cluster: String, why: String },
}

/// Whether the asset carries the delivery finalizer.
fn delivery_pending(asset: &BareMetalAsset) -> bool {
    asset.finalizers().iter().any(|f| f == DELIVERY_FINALIZER)
}

pub(crate) fn delivered_to(asset: &BareMetalAsset) -> Option<&str> {
    asset.annotations().get(DELIVERED_TO_ANNOTATION).map(String::as_str)
}

/// Installed and not being deleted: a cluster that can take (or give back) a host.
fn live(cd: &ClusterDeployment) -> bool {
    cd.status.as_ref().is_some_and(|s| s.installed) && cd.metadata.deletion_timestamp.is_none()
}

pub(crate) fn step<'a>(snapshot: &Snapshot<'a>) -> Step<'a> {
    let asset = snapshot.asset;
    let deleting = asset.metadata.deletion_timestamp.is_some();
    if delivery_pending(asset) && (deleting || delivered_to(asset) != asset.spec.assigned_cluster()) {
        return Step::Detach(detach(snapshot));
    }
    if deleting {
        return Step::Nothing;
    }
    let patch = label_patch(asset);
    if !patch.is_empty() {
        return Step::Label(patch);
    }
    Step::Report
}

fn detach<'a>(snapshot: &Snapshot<'a>) -> Detach<'a> {
    let Some(cluster) = delivered_to(snapshot.asset) else {
        return Detach::Release;
    };
    let cluster = cluster.to_string();
    if let Some(why) = &snapshot.delivered_refused {
        return Detach::Refused {
            cluster,
            why: why.clone(),
        };
    }
    match snapshot.delivered.filter(|cd| live(cd)) {
        Some(cd) => Detach::Remote { cluster, cd },
        None => Detach::ClusterDestroyed { cluster },
    }
}

/// The labels the asset's spec asks for; `None` values are removed.
fn wanted_labels(asset: &BareMetalAsset) -> BTreeMap<String, Option<String>> {
    BTreeMap::from([
        (ROLE_LABEL.to_string(), Some(role_label(asset.spec.role).to_string())),
        (
            CLUSTER_LABEL.to_string(),
            asset.spec.assigned_cluster().map(String::from),
        ),
    ])
}

/// The labels that differ from what the spec asks for.
fn label_patch(asset: &BareMetalAsset) -> Map<String, Value> {
    let current = asset.labels();
    wanted_labels(asset)
        .into_iter()
        .filter(|(k, v)| current.get(k) != v.as_ref())
        .map(|(k, v)| (k, v.map_or(Value::Null, Value::String)))
        .collect()
}

/// A condition's verdict: status, reason, message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Verdict {
    pub(crate) ok: bool,
    pub(crate) reason: &'static str,
    pub(crate) message: String,
}

/// `CredentialsFound`: the Secret exists with keys `username` and `password`, within the bound of
/// a Secret stackd reads to render (it is inlined in install configs, copied to clusters).
pub(crate) fn credentials(secret: Option<&Secret>, name: &str, namespace: &str, limits: &DocumentLimits) -> Verdict {
    let Some(secret) = secret else {
        return Verdict {
            ok: false,
            reason: "SecretNotFound",
            message: format!(
                "Secret {name} in namespace {namespace} does not exist; create it with keys username and password"
            ),
        };
    };
    if let Err(refused) = limits.render_secret(namespace, secret) {
        return Verdict {
            ok: false,
            reason: DOCUMENT_TOO_LARGE,
            message: refused.to_string(),
        };
    }
    let missing: Vec<&str> = ["username", "password"]
        .into_iter()
        .filter(|k| !secret.data.as_ref().is_some_and(|d| d.contains_key(*k)))
        .collect();
    if missing.is_empty() {
        Verdict {
            ok: true,
            reason: "SecretFound",
            message: format!("Secret {name} in namespace {namespace} has the BMC credentials"),
        }
    } else {
        Verdict {
            ok: false,
            reason: "SecretInvalid",
            message: format!(
                "Secret {name} in namespace {namespace} lacks the keys {}; add them",
                missing.join(", ")
            ),
        }
    }
}

/// The owner reference making the asset the Secret's controller, when nobody owns the Secret yet
/// (a Secret shared or owned elsewhere is left alone).
pub(crate) fn secret_owner(asset: &BareMetalAsset, secret: &Secret) -> Option<OwnerReference> {
    if !secret.owner_references().is_empty() {
        return None;
    }
    Some(OwnerReference {
        api_version: BareMetalAsset::api_version(&()).into_owned(),
        kind: BareMetalAsset::kind(&()).into_owned(),
        name: asset.name_any(),
        uid: asset.metadata.uid.clone().unwrap_or_default(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    })
}

/// `ClusterDeploymentFound`: whether the assigned cluster exists (and may be reached).
pub(crate) fn cluster_found(snapshot: &Snapshot<'_>) -> Verdict {
    if let Some(why) = &snapshot.assigned_refused {
        return Verdict {
            ok: false,
            reason: FOREIGN_CLUSTER,
            message: format!("{why}; nothing is delivered there"),
        };
    }
    match (snapshot.asset.spec.assigned_cluster(), snapshot.assigned) {
        (None, _) => Verdict {
            ok: false,
            reason: "NoneSpecified",
            message: "The asset is not assigned to a cluster".to_string(),
        },
        (Some(cluster), Some(_)) => Verdict {
            ok: true,
            reason: "ClusterDeploymentFound",
            message: format!("ClusterDeployment {cluster} exists"),
        },
        (Some(cluster), None) => Verdict {
            ok: false,
            reason: "ClusterDeploymentNotFound",
            message: format!("ClusterDeployment {cluster} (in namespace {cluster}) does not exist"),
        },
    }
}

/// What `HostCreated` and `HostProvisioningInProgress` say about delivery.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct HostReport {
    pub(crate) verdict: Verdict,
    /// The cluster is installed: the host is (being) delivered there, so a failure is progress
    /// that a user sees as an Event.
    pub(crate) cluster_installed: bool,
}

/// Delivery to the assigned cluster.
#[derive(Debug, PartialEq)]
pub(crate) enum Delivery<'a> {
    /// Not assigned, or the ClusterDeployment is not there: no host to speak of.
    NoCluster,
    /// Nothing can be delivered yet, for this reason.
    Held(HostReport),
    /// Record where the host goes, finalizer first so it is always removed from there again; the
    /// write's watch event brings the asset back to deliver.
    Record(Value),
    /// Create or update the host on the cluster.
    Deliver {
        cluster: &'a str,
        cd: &'a ClusterDeployment,
    },
}

pub(crate) fn delivery<'a>(snapshot: &Snapshot<'a>, credentials_found: bool) -> Delivery<'a> {
    let asset = snapshot.asset;
    let (Some(cluster), Some(cd)) = (asset.spec.assigned_cluster(), snapshot.assigned) else {
        return Delivery::NoCluster;
    };
    let held = |ok, reason, message| {
        Delivery::Held(HostReport {
            verdict: Verdict { ok, reason, message },
            cluster_installed: live(cd),
        })
    };
    if !live(cd) {
        held(
            false,
            "WaitingForCluster",
            format!("Cluster {cluster} is not installed yet"),
        )
    } else if !credentials_found {
        held(false, "CredentialsNotFound", "The BMC credentials are missing".into())
    } else if delivered_to(asset) != Some(cluster) || !delivery_pending(asset) {
        Delivery::Record(record_delivery_patch(asset, cluster))
    } else {
        Delivery::Deliver { cluster, cd }
    }
}

/// The merge patch recording a delivery to `cluster`, with the resourceVersion as precondition.
fn record_delivery_patch(asset: &BareMetalAsset, cluster: &str) -> Value {
    let mut finalizers = asset.finalizers().to_vec();
    if !delivery_pending(asset) {
        finalizers.push(DELIVERY_FINALIZER.into());
    }
    json!({"metadata": {
        "finalizers": finalizers,
        "annotations": {DELIVERED_TO_ANNOTATION: cluster},
        "resourceVersion": asset.metadata.resource_version,
    }})
}

/// The merge patch ending a detach: the finalizer and the delivery record go.
pub(crate) fn release_patch(asset: &BareMetalAsset) -> Value {
    let finalizers: Vec<&String> = asset.finalizers().iter().filter(|f| *f != DELIVERY_FINALIZER).collect();
    json!({"metadata": {
        "finalizers": finalizers,
        "annotations": {DELIVERED_TO_ANNOTATION: null},
        "resourceVersion": asset.metadata.resource_version,
    }})
}

/// The merge patch of [`Step::Label`], with the resourceVersion: a pool assigning the asset
/// meanwhile wins.
pub(crate) fn labels_patch(asset: &BareMetalAsset, labels: &Map<String, Value>) -> Value {
    json!({"metadata": {
        "labels": labels,
        "resourceVersion": asset.metadata.resource_version,
    }})
}

/// The host conditions while `cluster`, which stopped answering `failures` times in a row, is
/// left alone for a while (a delay that doubles with every failure, for all its assets).
pub(crate) fn not_answering(cluster: &str, failures: u32) -> HostReport {
    HostReport {
        verdict: Verdict {
            ok: false,
            reason: "ClusterNotAnswering",
            message: format!(
                "Cluster {cluster} did not answer {failures} time(s) in a row (each request may take --managed-cluster-timeout); stackd tries it again after a delay that grows with every failure"
            ),
        },
        cluster_installed: true,
    }
}

/// What the host conditions say while `cluster` is left alone after failing to answer: the asset's
/// own last failed delivery there when it has one (so the status keeps that cause instead of
/// flapping between it and this at every retry, with an Event each time), else that the cluster is
/// not answering.
pub(crate) fn backing_off(asset: &BareMetalAsset, cluster: &str, failures: u32) -> HostReport {
    let last = asset
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == "HostCreated"));
    match last {
        Some(last)
            if last.status == "False"
                && last.reason == "DeliveryFailed"
                && last
                    .message
                    .starts_with(&format!("Cannot deliver to cluster {cluster}: ")) =>
        {
            HostReport {
                verdict: Verdict {
                    ok: false,
                    reason: "DeliveryFailed",
                    message: last.message.clone(),
                },
                cluster_installed: true,
            }
        }
        _ => not_answering(cluster, failures),
    }
}

/// What a delivery attempt means for the host conditions. `Ok(false)`: a stale host was removed.
pub(crate) fn delivered(result: &Result<bool, DeliveryError>, asset: &str, cluster: &str) -> HostReport {
    let verdict = match result {
        Ok(true) => Verdict {
            ok: true,
            reason: "HostCreated",
            message: format!(
                "BareMetalHost {asset} and its Secret are on cluster {cluster} in namespace {MACHINE_API_NAMESPACE}"
            ),
        },
        Ok(false) => Verdict {
            ok: false,
            reason: "HostReplacing",
            message: format!("BareMetalHost {asset} is being replaced on cluster {cluster}"),
        },
        Err(err) => Verdict {
            ok: false,
            reason: err.reason(),
            message: format!("Cannot deliver to cluster {cluster}: {err}"),
        },
    };
    HostReport {
        verdict,
        cluster_installed: true,
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::ByteString;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    use super::*;
    use crate::api::inventory::{AssetRole, BareMetalAssetSpec, BmcDetails};
    use crate::api::pools::ClusterDeploymentStatus;
    use crate::runtime::untrusted_kubeconfig::config_from_untrusted;

    fn asset(role: Option<AssetRole>, cluster: Option<&str>) -> BareMetalAsset {
        let mut a = BareMetalAsset::new(
            "host-1",
            BareMetalAssetSpec {
                bmc: BmcDetails {
                    address: "ipmi://10.0.0.1".into(),
                    credentials_name: "host-1-bmc".into(),
                },
                boot_mac_address: "00:00:00:00:00:01".into(),
                role,
                cluster_name: cluster.map(String::from),
                ..Default::default()
            },
        );
        a.metadata.namespace = Some("lab".into());
        a.metadata.resource_version = Some("7".into());
        a.metadata.uid = Some("asset-uid".into());
        a
    }

    /// An asset with its labels already matching the spec.
    fn labelled(role: Option<AssetRole>, cluster: Option<&str>) -> BareMetalAsset {
        let mut a = asset(role, cluster);
        let labels = a.labels_mut();
        labels.insert(ROLE_LABEL.into(), role_label(role).into());
        if let Some(cluster) = cluster.filter(|c| !c.is_empty()) {
            labels.insert(CLUSTER_LABEL.into(), cluster.into());
        }
        a
    }

    fn delivered_to_cluster(mut a: BareMetalAsset, cluster: &str) -> BareMetalAsset {
        a.finalizers_mut().push(DELIVERY_FINALIZER.into());
        a.annotations_mut()
            .insert(DELIVERED_TO_ANNOTATION.into(), cluster.into());
        a
    }

    fn deleting(mut a: BareMetalAsset) -> BareMetalAsset {
        a.metadata.deletion_timestamp = Some(Time(jiff::Timestamp::UNIX_EPOCH));
        a
    }

    fn cd(name: &str, installed: bool) -> ClusterDeployment {
        let mut cd: ClusterDeployment = serde_json::from_value(json!({
            "apiVersion": "pools.stackd.dev/v1alpha1", "kind": "ClusterDeployment",
            "metadata": {"name": name, "namespace": name},
            "spec": {"clusterName": name, "baseDomain": "example.com", "platform": {}},
        }))
        .unwrap();
        cd.status = Some(ClusterDeploymentStatus {
            installed,
            ..Default::default()
        });
        cd
    }

    fn snapshot<'a>(
        asset: &'a BareMetalAsset,
        assigned: Option<&'a ClusterDeployment>,
        delivered: Option<&'a ClusterDeployment>,
    ) -> Snapshot<'a> {
        Snapshot {
            asset,
            assigned,
            delivered,
            assigned_refused: None,
            delivered_refused: None,
        }
    }

    fn secret(keys: &[&str]) -> Secret {
        Secret {
            data: Some(
                keys.iter()
                    .map(|k| (k.to_string(), ByteString(b"x".to_vec())))
                    .collect(),
            ),
            ..Default::default()
        }
    }

    #[test]
    fn role_labels_mirror_the_role_and_an_empty_role_is_an_empty_label() {
        assert_eq!(role_label(Some(AssetRole::Master)), "master");
        assert_eq!(role_label(Some(AssetRole::Worker)), "worker");
        assert_eq!(role_label(Some(AssetRole::Unspecified)), "");
        assert_eq!(role_label(None), "");
        let a = asset(Some(AssetRole::Worker), Some("c1"));
        let Step::Label(patch) = step(&snapshot(&a, None, None)) else {
            panic!("labels first");
        };
        assert_eq!(patch[ROLE_LABEL], json!("worker"));
        assert_eq!(patch[CLUSTER_LABEL], json!("c1"));
        let written = labels_patch(&a, &patch);
        assert_eq!(written["metadata"]["resourceVersion"], json!("7"));
    }

    #[test]
    fn the_cluster_label_is_removed_when_the_asset_is_unassigned() {
        let mut a = labelled(Some(AssetRole::Master), None);
        a.labels_mut().insert(CLUSTER_LABEL.into(), "old".into());
        let Step::Label(patch) = step(&snapshot(&a, None, None)) else {
            panic!("labels first");
        };
        assert_eq!(patch, Map::from_iter([(CLUSTER_LABEL.to_string(), Value::Null)]));
        let empty_name = labelled(None, Some(""));
        assert_eq!(step(&snapshot(&empty_name, None, None)), Step::Report);
    }

    #[test]
    fn right_labels_lead_to_the_report() {
        let a = labelled(Some(AssetRole::Master), Some("c1"));
        assert_eq!(step(&snapshot(&a, None, None)), Step::Report);
    }

    #[test]
    fn a_deleted_asset_without_our_finalizer_is_left_alone() {
        let a = deleting(asset(Some(AssetRole::Master), Some("c1")));
        assert_eq!(step(&snapshot(&a, None, None)), Step::Nothing);
    }

    #[test]
    fn unassigning_a_delivered_asset_detaches_it_from_the_installed_cluster() {
        let installed = cd("c1", true);
        let a = delivered_to_cluster(labelled(None, None), "c1");
        let step = step(&snapshot(&a, None, Some(&installed)));
        assert_eq!(
            step,
            Step::Detach(Detach::Remote {
                cluster: "c1".into(),
                cd: &installed
            })
        );
    }

    #[test]
    fn reassigning_or_deleting_a_delivered_asset_detaches_it_too() {
        let installed = cd("c1", true);
        let moved = delivered_to_cluster(labelled(None, Some("c2")), "c1");
        assert!(matches!(
            step(&snapshot(&moved, None, Some(&installed))),
            Step::Detach(Detach::Remote { .. })
        ));
        let gone = deleting(delivered_to_cluster(labelled(None, Some("c1")), "c1"));
        assert!(matches!(
            step(&snapshot(&gone, Some(&installed), Some(&installed))),
            Step::Detach(Detach::Remote { .. })
        ));
    }

    #[test]
    fn detaching_from_a_cluster_being_deleted_or_gone_skips_the_remote_removal() {
        let a = delivered_to_cluster(labelled(None, None), "c1");
        let destroyed = Step::Detach(Detach::ClusterDestroyed { cluster: "c1".into() });
        assert_eq!(step(&snapshot(&a, None, None)), destroyed);
        let mut being_deleted = cd("c1", true);
        being_deleted.metadata.deletion_timestamp = Some(Time(jiff::Timestamp::UNIX_EPOCH));
        assert_eq!(step(&snapshot(&a, None, Some(&being_deleted))), destroyed);
        let never_installed = cd("c1", false);
        assert_eq!(step(&snapshot(&a, None, Some(&never_installed))), destroyed);
    }

    #[test]
    fn a_record_naming_a_cluster_out_of_reach_is_dropped_without_touching_the_cluster() {
        let a = delivered_to_cluster(labelled(None, None), "v1");
        let mut forged = snapshot(&a, None, None);
        forged.delivered_refused = Some("ClusterDeployment v1 is in namespace v1".into());
        let Step::Detach(Detach::Refused { cluster, why }) = step(&forged) else {
            panic!("refused");
        };
        assert_eq!(
            (cluster.as_str(), why.as_str()),
            ("v1", "ClusterDeployment v1 is in namespace v1")
        );
    }

    #[test]
    fn an_assigned_cluster_out_of_reach_is_reported_and_gets_nothing() {
        let a = labelled(None, Some("v1"));
        let mut foreign = snapshot(&a, None, None);
        foreign.assigned_refused = Some("ClusterDeployment v1 is in namespace v1".into());
        let verdict = cluster_found(&foreign);
        assert_eq!((verdict.ok, verdict.reason), (false, "ForeignCluster"));
        assert!(verdict.message.ends_with("; nothing is delivered there"));
        assert_eq!(delivery(&foreign, true), Delivery::NoCluster);
    }

    #[test]
    fn a_finalizer_without_a_delivery_record_is_just_released() {
        let mut a = labelled(None, Some("c1"));
        a.finalizers_mut().push(DELIVERY_FINALIZER.into());
        assert_eq!(step(&snapshot(&a, None, None)), Step::Detach(Detach::Release));
        let gone = deleting(a.clone());
        assert_eq!(step(&snapshot(&gone, None, None)), Step::Detach(Detach::Release));
        let patch = release_patch(&a);
        assert_eq!(patch["metadata"]["finalizers"], json!([]));
        assert_eq!(patch["metadata"]["annotations"][DELIVERED_TO_ANNOTATION], Value::Null);
        assert_eq!(patch["metadata"]["resourceVersion"], json!("7"));
    }

    #[test]
    fn releasing_keeps_other_finalizers() {
        let mut a = delivered_to_cluster(labelled(None, None), "c1");
        a.finalizers_mut().insert(0, "example.com/keep".into());
        assert_eq!(release_patch(&a)["metadata"]["finalizers"], json!(["example.com/keep"]));
    }

    #[test]
    fn an_asset_still_delivered_where_it_is_assigned_is_not_detached() {
        let installed = cd("c1", true);
        let a = delivered_to_cluster(labelled(None, Some("c1")), "c1");
        assert_eq!(step(&snapshot(&a, Some(&installed), Some(&installed))), Step::Report);
    }

    #[test]
    fn a_missing_secret_says_which_and_how_to_fix_it() {
        let verdict = credentials(None, "host-1-bmc", "lab", &DocumentLimits::default());
        assert_eq!((verdict.ok, verdict.reason), (false, "SecretNotFound"));
        assert_eq!(
            verdict.message,
            "Secret host-1-bmc in namespace lab does not exist; create it with keys username and password"
        );
    }

    #[test]
    fn a_secret_without_username_or_password_is_invalid_and_names_the_missing_keys() {
        let verdict = credentials(
            Some(&secret(&["username"])),
            "host-1-bmc",
            "lab",
            &DocumentLimits::default(),
        );
        assert_eq!((verdict.ok, verdict.reason), (false, "SecretInvalid"));
        assert_eq!(
            verdict.message,
            "Secret host-1-bmc in namespace lab lacks the keys password; add them"
        );
        let empty = credentials(Some(&secret(&[])), "host-1-bmc", "lab", &DocumentLimits::default());
        assert!(empty.message.contains("lacks the keys username, password"));
    }

    #[test]
    fn a_secret_with_both_keys_is_found() {
        let verdict = credentials(
            Some(&secret(&["username", "password", "extra"])),
            "host-1-bmc",
            "lab",
            &DocumentLimits::default(),
        );
        assert_eq!((verdict.ok, verdict.reason), (true, "SecretFound"));
    }

    #[test]
    fn the_asset_owns_only_a_secret_nobody_owns() {
        let a = asset(None, None);
        let owner = secret_owner(&a, &secret(&[])).expect("unowned Secret is taken");
        assert_eq!(
            (owner.kind.as_str(), owner.name.as_str(), owner.uid.as_str()),
            ("BareMetalAsset", "host-1", "asset-uid")
        );
        assert_eq!((owner.controller, owner.block_owner_deletion), (Some(true), Some(true)));
        let mut shared = secret(&[]);
        shared.metadata.owner_references = Some(vec![OwnerReference {
            kind: "ConfigMap".into(),
            name: "someone".into(),
            ..Default::default()
        }]);
        assert_eq!(secret_owner(&a, &shared), None);
    }

    #[test]
    fn cluster_deployment_found_follows_the_assignment_and_the_cache() {
        let unassigned = labelled(None, None);
        assert_eq!(
            cluster_found(&snapshot(&unassigned, None, None)).reason,
            "NoneSpecified"
        );
        let a = labelled(None, Some("c1"));
        let missing = cluster_found(&snapshot(&a, None, None));
        assert_eq!(
            (missing.ok, missing.reason, missing.message.as_str()),
            (
                false,
                "ClusterDeploymentNotFound",
                "ClusterDeployment c1 (in namespace c1) does not exist"
            )
        );
        let present = cd("c1", false);
        assert!(cluster_found(&snapshot(&a, Some(&present), None)).ok);
    }

    #[test]
    fn nothing_is_delivered_before_the_cluster_is_installed() {
        let installing = cd("c1", false);
        let a = labelled(None, Some("c1"));
        let Delivery::Held(report) = delivery(&snapshot(&a, Some(&installing), None), true) else {
            panic!("held");
        };
        assert_eq!(report.verdict.reason, "WaitingForCluster");
        assert!(!report.cluster_installed);
    }

    #[test]
    fn missing_credentials_hold_delivery_to_an_installed_cluster() {
        let installed = cd("c1", true);
        let a = labelled(None, Some("c1"));
        let Delivery::Held(report) = delivery(&snapshot(&a, Some(&installed), None), false) else {
            panic!("held");
        };
        assert_eq!(
            (report.verdict.ok, report.verdict.reason),
            (false, "CredentialsNotFound")
        );
        assert!(report.cluster_installed);
    }

    #[test]
    fn delivery_is_recorded_with_the_finalizer_before_anything_goes_to_the_cluster() {
        let installed = cd("c1", true);
        let mut a = labelled(None, Some("c1"));
        a.finalizers_mut().push("example.com/keep".into());
        let Delivery::Record(patch) = delivery(&snapshot(&a, Some(&installed), None), true) else {
            panic!("record first");
        };
        assert_eq!(
            patch["metadata"]["finalizers"],
            json!(["example.com/keep", DELIVERY_FINALIZER])
        );
        assert_eq!(patch["metadata"]["annotations"][DELIVERED_TO_ANNOTATION], json!("c1"));
        assert_eq!(patch["metadata"]["resourceVersion"], json!("7"));
    }

    #[test]
    fn a_recorded_asset_is_delivered() {
        let installed = cd("c1", true);
        let a = delivered_to_cluster(labelled(None, Some("c1")), "c1");
        assert_eq!(
            delivery(&snapshot(&a, Some(&installed), Some(&installed)), true),
            Delivery::Deliver {
                cluster: "c1",
                cd: &installed
            }
        );
    }

    #[test]
    fn no_cluster_means_no_host_to_report() {
        let unassigned = labelled(None, None);
        assert_eq!(delivery(&snapshot(&unassigned, None, None), true), Delivery::NoCluster);
        let absent = labelled(None, Some("c1"));
        assert_eq!(delivery(&snapshot(&absent, None, None), true), Delivery::NoCluster);
    }

    #[test]
    fn delivery_results_become_host_conditions() {
        let created = delivered(&Ok(true), "host-1", "c1");
        assert_eq!((created.verdict.ok, created.verdict.reason), (true, "HostCreated"));
        assert_eq!(
            created.verdict.message,
            "BareMetalHost host-1 and its Secret are on cluster c1 in namespace openshift-machine-api"
        );
        let replacing = delivered(&Ok(false), "host-1", "c1");
        assert_eq!(replacing.verdict.reason, "HostReplacing");
        let failed = delivered(
            &Err(DeliveryError::Kubeconfig("c1".into(), "not recorded yet".into())),
            "host-1",
            "c1",
        );
        assert_eq!((failed.verdict.ok, failed.verdict.reason), (false, "DeliveryFailed"));
        assert!(failed.verdict.message.starts_with("Cannot deliver to cluster c1: "));
    }

    #[test]
    fn a_cluster_backing_off_keeps_the_assets_own_last_failure_there_and_says_not_answering_otherwise() {
        let mut failed_there = asset(None, Some("c1"));
        let last = delivered(
            &Err(DeliveryError::TimedOut(std::time::Duration::from_secs(1))),
            "host-1",
            "c1",
        )
        .verdict;
        let condition = k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
            type_: "HostCreated".into(),
            status: "False".into(),
            reason: last.reason.into(),
            message: last.message.clone(),
            last_transition_time: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(jiff::Timestamp::UNIX_EPOCH),
            observed_generation: None,
        };
        failed_there.status = Some(crate::api::inventory::BareMetalAssetStatus {
            conditions: vec![condition],
            ..Default::default()
        });
        let kept = backing_off(&failed_there, "c1", 3).verdict;
        assert_eq!((kept.reason, kept.message), ("DeliveryFailed", last.message));
        assert_eq!(
            backing_off(&failed_there, "c2", 3).verdict.reason,
            "ClusterNotAnswering"
        );
        let never_tried = asset(None, Some("c1"));
        assert_eq!(backing_off(&never_tried, "c1", 3).verdict.reason, "ClusterNotAnswering");
    }

    #[test]
    fn a_refused_admin_kubeconfig_is_named_as_such() {
        let Err(reason) = config_from_untrusted(
            "apiVersion: v1\nkind: Config\nclusters: [{name: c, cluster: {server: 'https://x'}}]\n\
             users: [{name: u, user: {exec: {command: sh, apiVersion: client.authentication.k8s.io/v1}}}]\n\
             contexts: [{name: c, context: {cluster: c, user: u}}]\ncurrent-context: c\n",
        ) else {
            panic!("exec is refused");
        };
        let refused = DeliveryError::KubeconfigRefused {
            cluster: "c1".into(),
            secret: "c1-admin-kubeconfig".into(),
            reason,
        };
        assert_eq!(
            delivered(&Err(refused), "host-1", "c1").verdict.reason,
            "AdminKubeconfigRefused"
        );
    }
}
