//! The BareMetalAsset status (DESIGN.md §5) built from the controller's verdicts: conditions
//! `CredentialsFound`, `ClusterDeploymentFound`, `HostCreated`, `HostProvisioningInProgress`,
//! `relatedObjects`, and the Events their transitions deserve. Pure: no client.

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;

use super::plan::{HostReport, Verdict};
use super::reach::FOREIGN_CLUSTER;
use crate::api::inventory::{BareMetalAsset, BareMetalAssetStatus};
use crate::inventory::remote_host::MACHINE_API_NAMESPACE;
use crate::runtime::conditions::{DesiredCondition, set_condition};

/// What the reconcile found out.
pub(crate) struct Report {
    pub(crate) credentials: Verdict,
    /// The credentials Secret exists (it is then a related object).
    pub(crate) secret_exists: bool,
    pub(crate) cluster: Verdict,
    /// `None` when there is no cluster to deliver to: the host conditions go.
    pub(crate) host: Option<HostReport>,
}

/// An Event to publish once the status carrying it is written.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Note {
    pub(crate) warning: bool,
    pub(crate) reason: &'static str,
    pub(crate) message: String,
}

/// The status the asset should have, and the Events of what changed.
pub(crate) fn build(asset: &BareMetalAsset, report: Report, now: Time) -> (BareMetalAssetStatus, Vec<Note>) {
    let mut status = asset.status.clone().unwrap_or_default();
    let mut notes = Vec::new();
    let generation = asset.metadata.generation;
    let condition = |type_, verdict: &Verdict, status| DesiredCondition {
        type_,
        status,
        reason: verdict.reason,
        message: verdict.message.clone(),
        observed_generation: generation,
    };
    let credentials = &report.credentials;
    if set_condition(
        &mut status.conditions,
        condition("CredentialsFound", credentials, credentials.ok),
        now.clone(),
    ) {
        notes.push(Note {
            warning: !credentials.ok,
            reason: if credentials.ok {
                "CredentialsFound"
            } else {
                "CredentialsNotFound"
            },
            message: credentials.message.clone(),
        });
    }
    if report.secret_exists {
        relate_secret(&mut status, asset);
    }
    let cluster = &report.cluster;
    let cluster_changed = set_condition(
        &mut status.conditions,
        condition("ClusterDeploymentFound", cluster, cluster.ok),
        now.clone(),
    );
    // A cluster out of the asset's reach is a refusal the user must hear of.
    if cluster_changed && cluster.reason == FOREIGN_CLUSTER {
        notes.push(Note {
            warning: true,
            reason: FOREIGN_CLUSTER,
            message: cluster.message.clone(),
        });
    }
    match report.host {
        Some(host) => report_host(&mut status, &mut notes, asset, &host, now),
        None => {
            status
                .conditions
                .retain(|c| c.type_ != "HostCreated" && c.type_ != "HostProvisioningInProgress");
            status
                .related_objects
                .retain(|r| r.kind.as_deref() != Some("BareMetalHost"));
        }
    }
    (status, notes)
}

/// `HostCreated` and `HostProvisioningInProgress`; a transition on an installed cluster is an Event.
fn report_host(
    status: &mut BareMetalAssetStatus,
    notes: &mut Vec<Note>,
    asset: &BareMetalAsset,
    host: &HostReport,
    now: Time,
) {
    let verdict = &host.verdict;
    let condition = |type_, status| DesiredCondition {
        type_,
        status,
        reason: verdict.reason,
        message: verdict.message.clone(),
        observed_generation: asset.metadata.generation,
    };
    let changed = set_condition(
        &mut status.conditions,
        condition("HostCreated", verdict.ok),
        now.clone(),
    );
    let in_progress = !verdict.ok && host.cluster_installed;
    set_condition(
        &mut status.conditions,
        condition("HostProvisioningInProgress", in_progress),
        now,
    );
    if changed && host.cluster_installed {
        notes.push(Note {
            warning: !verdict.ok,
            reason: verdict.reason,
            message: verdict.message.clone(),
        });
    }
    if verdict.ok {
        relate_host(status, asset);
    }
}

/// The credentials Secret replaces any Secret related before (the asset may name another one now).
fn relate_secret(status: &mut BareMetalAssetStatus, asset: &BareMetalAsset) {
    let reference = ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Secret".into()),
        name: Some(asset.spec.bmc.credentials_name.clone()),
        namespace: Some(asset.namespace().unwrap_or_default()),
        ..Default::default()
    };
    if !status.related_objects.contains(&reference) {
        status.related_objects.retain(|r| r.kind.as_deref() != Some("Secret"));
        status.related_objects.push(reference);
    }
}

fn relate_host(status: &mut BareMetalAssetStatus, asset: &BareMetalAsset) {
    let reference = ObjectReference {
        api_version: Some("metal3.io/v1alpha1".into()),
        kind: Some("BareMetalHost".into()),
        name: Some(asset.name_any()),
        namespace: Some(MACHINE_API_NAMESPACE.into()),
        ..Default::default()
    };
    if !status.related_objects.contains(&reference) {
        status.related_objects.push(reference);
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;

    use super::*;
    use crate::api::inventory::{BareMetalAssetSpec, BmcDetails};

    fn time(seconds: i64) -> Time {
        Time(jiff::Timestamp::from_second(seconds).unwrap_or_default())
    }

    fn asset() -> BareMetalAsset {
        let mut a = BareMetalAsset::new(
            "host-1",
            BareMetalAssetSpec {
                bmc: BmcDetails {
                    address: "ipmi://10.0.0.1".into(),
                    credentials_name: "host-1-bmc".into(),
                },
                boot_mac_address: "00:00:00:00:00:01".into(),
                cluster_name: Some("c1".into()),
                ..Default::default()
            },
        );
        a.metadata.namespace = Some("lab".into());
        a.metadata.generation = Some(3);
        a
    }

    fn verdict(ok: bool, reason: &'static str) -> Verdict {
        Verdict {
            ok,
            reason,
            message: format!("{reason} happened"),
        }
    }

    fn report(credentials: bool, host: Option<HostReport>) -> Report {
        Report {
            credentials: if credentials {
                verdict(true, "SecretFound")
            } else {
                verdict(false, "SecretNotFound")
            },
            secret_exists: credentials,
            cluster: verdict(true, "ClusterDeploymentFound"),
            host,
        }
    }

    fn host(ok: bool, reason: &'static str, cluster_installed: bool) -> Option<HostReport> {
        Some(HostReport {
            verdict: verdict(ok, reason),
            cluster_installed,
        })
    }

    fn condition<'a>(status: &'a BareMetalAssetStatus, type_: &str) -> Option<&'a Condition> {
        status.conditions.iter().find(|c| c.type_ == type_)
    }

    fn kinds(status: &BareMetalAssetStatus) -> Vec<&str> {
        status
            .related_objects
            .iter()
            .filter_map(|r| r.kind.as_deref())
            .collect()
    }

    #[test]
    fn a_missing_secret_sets_credentials_found_false_with_a_warning() {
        let (status, notes) = build(&asset(), report(false, None), time(1));
        let found = condition(&status, "CredentialsFound").unwrap();
        assert_eq!(
            (found.status.as_str(), found.reason.as_str()),
            ("False", "SecretNotFound")
        );
        assert_eq!(found.observed_generation, Some(3));
        assert_eq!(
            notes,
            vec![Note {
                warning: true,
                reason: "CredentialsNotFound",
                message: "SecretNotFound happened".into()
            }]
        );
        assert!(kinds(&status).is_empty(), "no Secret to relate");
    }

    #[test]
    fn found_credentials_relate_the_secret_and_announce_it_once() {
        let mut a = asset();
        let (status, notes) = build(&a, report(true, None), time(1));
        assert_eq!(notes[0].reason, "CredentialsFound");
        assert!(!notes[0].warning);
        let secret = &status.related_objects[0];
        assert_eq!(
            (secret.name.as_deref(), secret.namespace.as_deref()),
            (Some("host-1-bmc"), Some("lab"))
        );
        a.status = Some(status.clone());
        let (again, notes) = build(&a, report(true, None), time(2));
        assert_eq!(again, status, "an unchanged asset keeps its status");
        assert!(notes.is_empty(), "no Event without a transition");
    }

    #[test]
    fn a_renamed_secret_replaces_the_related_one() {
        let mut a = asset();
        let (status, _) = build(&a, report(true, None), time(1));
        a.status = Some(status);
        a.spec.bmc.credentials_name = "other".into();
        let (status, _) = build(&a, report(true, None), time(2));
        assert_eq!(kinds(&status), vec!["Secret"]);
        assert_eq!(status.related_objects[0].name.as_deref(), Some("other"));
    }

    #[test]
    fn waiting_for_the_cluster_is_not_progress_and_makes_no_event() {
        let (status, notes) = build(&asset(), report(true, host(false, "WaitingForCluster", false)), time(1));
        let created = condition(&status, "HostCreated").unwrap();
        assert_eq!(
            (created.status.as_str(), created.reason.as_str()),
            ("False", "WaitingForCluster")
        );
        let progress = condition(&status, "HostProvisioningInProgress").unwrap();
        assert_eq!(progress.status, "False");
        assert!(notes.iter().all(|n| n.reason != "WaitingForCluster"));
    }

    #[test]
    fn a_failed_delivery_to_an_installed_cluster_is_in_progress_with_a_warning() {
        let (status, notes) = build(&asset(), report(true, host(false, "DeliveryFailed", true)), time(1));
        assert_eq!(condition(&status, "HostProvisioningInProgress").unwrap().status, "True");
        assert!(notes.contains(&Note {
            warning: true,
            reason: "DeliveryFailed",
            message: "DeliveryFailed happened".into()
        }));
        assert_eq!(kinds(&status), vec!["Secret"], "no host to relate");
    }

    #[test]
    fn a_delivered_host_is_created_related_and_announced() {
        let (status, notes) = build(&asset(), report(true, host(true, "HostCreated", true)), time(1));
        assert_eq!(condition(&status, "HostCreated").unwrap().status, "True");
        assert_eq!(
            condition(&status, "HostProvisioningInProgress").unwrap().status,
            "False"
        );
        assert!(notes.iter().any(|n| n.reason == "HostCreated" && !n.warning));
        let host = status
            .related_objects
            .iter()
            .find(|r| r.kind.as_deref() == Some("BareMetalHost"))
            .unwrap();
        assert_eq!(
            (
                host.name.as_deref(),
                host.namespace.as_deref(),
                host.api_version.as_deref()
            ),
            (
                Some("host-1"),
                Some("openshift-machine-api"),
                Some("metal3.io/v1alpha1")
            )
        );
    }

    #[test]
    fn without_a_cluster_the_host_conditions_and_reference_go() {
        let mut a = asset();
        let (status, _) = build(&a, report(true, host(true, "HostCreated", true)), time(1));
        a.status = Some(status);
        let (status, notes) = build(&a, report(true, None), time(2));
        assert!(condition(&status, "HostCreated").is_none());
        assert!(condition(&status, "HostProvisioningInProgress").is_none());
        assert_eq!(kinds(&status), vec!["Secret"]);
        assert!(notes.is_empty());
    }
}
