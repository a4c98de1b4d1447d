//! What a ClusterDeployment's status says about provisioning (DESIGN.md §4.2, §4.3 item 11, §6):
//! each outcome of a reconcile, the status fields and conditions it sets (`Provisioned`,
//! `ProvisionStopped`) and the Event it deserves once written. Pure: no client.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::api::common::LocalObjectReference;
use crate::api::pools::{ClusterDeploymentStatus, MachineFailureDomain};
use crate::bounds::DOCUMENT_TOO_LARGE;
use crate::host::quota_share;
use crate::runtime::conditions::{DesiredCondition, set_condition};

/// What a reconcile found out, to be recorded in the status.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Outcome {
    /// The failure-domain record is missing or was edited (§6): it is restored.
    RecordRestored {
        record: Vec<MachineFailureDomain>,
        /// Someone changed a record that was there (rather than it never having been written).
        edited: bool,
    },
    /// The installer Job of this attempt (0-based) was started or is running.
    Provisioning {
        host_namespace: String,
        job: String,
        attempt: i32,
    },
    /// Inputs the installer needs do not exist.
    MissingInputs(Vec<String>),
    /// The machines cannot be placed as configured (§6 merge rules).
    InvalidMachineSpec(String),
    /// The installer image is not from a registry the host allows (`--allowed-registries`).
    InstallerImageRefused(String),
    /// The installer Job would take the cluster's namespace past its share of the tenant's host
    /// quota (`crate::host::quota_share`); tried again as the namespace's workloads go.
    QuotaShareExceeded(String),
    /// The installer failed its `attempts`-th time of at most `limit`; `timed_out` when its Job
    /// ran past the installer deadline; `ended`: how its pod ended, as the kubelet said.
    InstallFailed {
        attempts: i32,
        limit: i32,
        timed_out: bool,
        ended: Option<String>,
    },
    /// The installer wrote an admin kubeconfig stackd will not use or hand on.
    KubeconfigRefused { secret: String, refusal: String },
    /// The installer's output Secret is not read: a key is too large, or the Secret is not the one
    /// stackd made.
    OutputRefused(String),
    /// The installer's inputs would pass a bound of [`crate::bounds`] (which, and how to fix it).
    InputsTooLarge(String),
    /// A Secret of the admin kubeconfig's name belongs to someone else.
    KubeconfigConflict { secret: String },
    /// The installer Job's pod does not start: what the kubelet says, with what to do.
    InstallerPodWaiting(String),
    /// The host refuses to create the installer Job's pod (e.g. a used-up quota): its words, with
    /// what to do.
    InstallerPodRefused(String),
    /// Installed; the admin kubeconfig is in `secret`.
    Installed { secret: String, infra_id: Option<String> },
}

/// What a failed attempt's message adds when the installer ran out of time.
fn timed_out_note(timed_out: bool) -> &'static str {
    if timed_out {
        ": its Job ran longer than the installer deadline (the daemon's --installer-deadline) and was stopped"
    } else {
        ""
    }
}

/// How the installer's pod ended, as the kubelet said (bounded by `pod_trouble`).
fn ended_note(ended: Option<&str>) -> String {
    ended.map(|ended| format!(": {ended}")).unwrap_or_default()
}

/// An Event to publish once the status carrying it is written.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Note {
    pub(crate) warning: bool,
    pub(crate) reason: &'static str,
    pub(crate) message: String,
}

impl Outcome {
    fn message(&self) -> String {
        match self {
            Outcome::RecordRestored { .. } => {
                "status.failureDomains was edited; it is recorded once when the cluster is created and was restored"
                    .into()
            }
            Outcome::Provisioning {
                host_namespace,
                job,
                attempt,
            } => format!(
                "Installer Job {host_namespace}/{job} is running (attempt {})",
                attempt + 1
            ),
            Outcome::MissingInputs(missing) => format!(
                "Cannot start the installer: missing {}; create them in the cluster's namespace",
                missing.join(", ")
            ),
            Outcome::InvalidMachineSpec(detail) => format!("The machine configuration is invalid: {detail}"),
            Outcome::InstallerImageRefused(refusal)
            | Outcome::InputsTooLarge(refusal)
            | Outcome::QuotaShareExceeded(refusal) => format!("Cannot start the installer: {refusal}"),
            Outcome::InstallFailed {
                attempts,
                limit,
                timed_out,
                ended,
            } if attempts >= limit => format!(
                "The installer failed {attempts} times (installAttemptsLimit {limit}){}{}; the cluster is broken and its pool replaces it",
                timed_out_note(*timed_out),
                ended_note(ended.as_deref())
            ),
            Outcome::InstallFailed {
                attempts,
                limit,
                timed_out,
                ended,
            } => format!(
                "The installer failed (attempt {attempts} of {limit}){}{}; retrying",
                timed_out_note(*timed_out),
                ended_note(ended.as_deref())
            ),
            Outcome::KubeconfigRefused { secret, refusal } => format!(
                "The installer's admin kubeconfig was refused and not copied to Secret {secret}: {refusal}. \
                 The installer image must write a kubeconfig with inline credentials only"
            ),
            Outcome::OutputRefused(refusal) => format!(
                "The installer's output was refused: {refusal}. Nothing of it was used; the installer image must write \
                 keys kubeconfig and metadata.json of the usual size into the output Secret stackd made, and leave \
                 that Secret otherwise as it is"
            ),
            Outcome::KubeconfigConflict { secret } => format!(
                "Secret {secret} already exists and was not created by stackd for this ClusterDeployment, so the admin \
                 kubeconfig was not copied and the Secret is left untouched; delete or rename it and stackd copies the \
                 admin kubeconfig there"
            ),
            Outcome::Installed { secret, .. } => format!("Installed; the admin kubeconfig is in Secret {secret}"),
            Outcome::InstallerPodWaiting(said) | Outcome::InstallerPodRefused(said) => said.clone(),
        }
    }

    /// `(Provisioned reason, ProvisionStopped reason)`; `None` where the condition is left as it is.
    fn reasons(&self) -> (Option<&'static str>, Option<&'static str>) {
        match self {
            Outcome::RecordRestored { .. } => (None, None),
            Outcome::Provisioning { .. } => (Some("Provisioning"), None),
            Outcome::MissingInputs(_) => (Some("MissingInputs"), None),
            Outcome::InvalidMachineSpec(_) => (Some("InvalidMachineSpec"), Some("InvalidMachineSpec")),
            Outcome::InstallerImageRefused(_) => (Some("RegistryNotAllowed"), Some("RegistryNotAllowed")),
            Outcome::InputsTooLarge(_) => (Some(DOCUMENT_TOO_LARGE), Some(DOCUMENT_TOO_LARGE)),
            Outcome::QuotaShareExceeded(_) => (Some(quota_share::REASON), None),
            Outcome::InstallFailed { attempts, limit, .. } if attempts >= limit => {
                (Some("ProvisionFailed"), Some("InstallAttemptsLimitReached"))
            }
            Outcome::InstallFailed { .. } => (Some("InstallFailed"), None),
            Outcome::KubeconfigRefused { .. } => (Some("AdminKubeconfigRefused"), Some("AdminKubeconfigRefused")),
            Outcome::OutputRefused(_) => (Some("InstallerOutputRefused"), Some("InstallerOutputRefused")),
            Outcome::KubeconfigConflict { .. } => (Some("AdminKubeconfigConflict"), None),
            Outcome::Installed { .. } => (Some("Provisioned"), None),
            Outcome::InstallerPodWaiting(_) => (Some("InstallerPodWaiting"), None),
            Outcome::InstallerPodRefused(_) => (Some("InstallerPodRefused"), None),
        }
    }

    /// Sets the outcome in `status`; returns whether the status must be written.
    pub(crate) fn record(&self, status: &mut ClusterDeploymentStatus, generation: Option<i64>, now: Time) -> bool {
        let changed_fields = self.record_fields(status);
        let message = self.message();
        let (provisioned, stopped) = self.reasons();
        let mut changed = false;
        let conditions = [("Provisioned", provisioned), ("ProvisionStopped", stopped)];
        for (type_, reason) in conditions {
            let Some(reason) = reason else { continue };
            changed |= set_condition(
                &mut status.conditions,
                DesiredCondition {
                    type_,
                    status: type_ == "ProvisionStopped" || matches!(self, Outcome::Installed { .. }),
                    reason,
                    message: message.clone(),
                    observed_generation: generation,
                },
                now.clone(),
            );
        }
        changed_fields || changed
    }

    /// Sets the status fields (not conditions) of the outcome. True for outcomes written whether
    /// or not anything changed: a failed attempt must be counted once (a conflict means a newer copy
    /// brings it back), and a record, a stop or an installation is written once and then settles.
    fn record_fields(&self, status: &mut ClusterDeploymentStatus) -> bool {
        match self {
            Outcome::RecordRestored { record, .. } => {
                status.failure_domains = record.clone();
                true
            }
            Outcome::InstallFailed { attempts, .. } => {
                status.install_restarts = *attempts;
                true
            }
            Outcome::InvalidMachineSpec(_) => true,
            Outcome::Installed { secret, infra_id } => {
                status.installed = true;
                status.infra_id = infra_id.clone();
                status.admin_kubeconfig_secret_ref = Some(LocalObjectReference { name: secret.clone() });
                true
            }
            Outcome::Provisioning { .. }
            | Outcome::InstallerImageRefused(_)
            | Outcome::InputsTooLarge(_)
            | Outcome::QuotaShareExceeded(_)
            | Outcome::MissingInputs(_)
            | Outcome::KubeconfigRefused { .. }
            | Outcome::OutputRefused(_)
            | Outcome::KubeconfigConflict { .. }
            | Outcome::InstallerPodWaiting(_)
            | Outcome::InstallerPodRefused(_) => false,
        }
    }

    /// The Event once the outcome is written; `None` when it deserves none.
    pub(crate) fn note(&self) -> Option<Note> {
        let warning = |reason| {
            Some(Note {
                warning: true,
                reason,
                message: self.message(),
            })
        };
        match self {
            Outcome::RecordRestored { edited: true, .. } => warning("FailureDomainsRestored"),
            Outcome::RecordRestored { edited: false, .. } | Outcome::Provisioning { .. } => None,
            Outcome::MissingInputs(_) => warning("MissingInputs"),
            Outcome::InvalidMachineSpec(_) => warning("InvalidMachineSpec"),
            Outcome::InstallerImageRefused(_) => warning("RegistryNotAllowed"),
            Outcome::InputsTooLarge(_) => warning(DOCUMENT_TOO_LARGE),
            Outcome::QuotaShareExceeded(_) => warning(quota_share::REASON),
            Outcome::InstallFailed { attempts, limit, .. } if attempts >= limit => warning("ProvisionStopped"),
            Outcome::InstallFailed { .. } => warning("InstallFailed"),
            Outcome::KubeconfigRefused { .. } => warning("AdminKubeconfigRefused"),
            Outcome::OutputRefused(_) => warning("InstallerOutputRefused"),
            Outcome::KubeconfigConflict { .. } => warning("AdminKubeconfigConflict"),
            Outcome::InstallerPodWaiting(_) => warning("InstallerPodWaiting"),
            Outcome::InstallerPodRefused(_) => warning("InstallerPodRefused"),
            Outcome::Installed { secret, .. } => Some(Note {
                warning: false,
                reason: "Installed",
                message: format!("Cluster installed; admin kubeconfig in Secret {secret}"),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;

    use super::*;

    fn time(seconds: i64) -> Time {
        Time(jiff::Timestamp::from_second(seconds).unwrap_or_default())
    }

    fn condition<'a>(status: &'a ClusterDeploymentStatus, type_: &str) -> Option<&'a Condition> {
        status.conditions.iter().find(|c| c.type_ == type_)
    }

    fn says(status: &ClusterDeploymentStatus, type_: &str) -> Option<(String, String)> {
        condition(status, type_).map(|c| (c.status.clone(), c.reason.clone()))
    }

    fn pair(status: &str, reason: &str) -> Option<(String, String)> {
        Some((status.into(), reason.into()))
    }

    fn recorded(outcome: &Outcome) -> (ClusterDeploymentStatus, bool) {
        let mut status = ClusterDeploymentStatus::default();
        let write = outcome.record(&mut status, Some(2), time(1));
        (status, write)
    }

    #[test]
    fn a_running_installer_says_provisioning_with_its_job_and_attempt() {
        let outcome = Outcome::Provisioning {
            host_namespace: "host".into(),
            job: "c1-install-0".into(),
            attempt: 0,
        };
        let (status, write) = recorded(&outcome);
        assert!(write);
        let provisioned = condition(&status, "Provisioned").unwrap();
        assert_eq!(
            (provisioned.status.as_str(), provisioned.reason.as_str()),
            ("False", "Provisioning")
        );
        assert_eq!(
            provisioned.message,
            "Installer Job host/c1-install-0 is running (attempt 1)"
        );
        assert_eq!(provisioned.observed_generation, Some(2));
        assert_eq!(outcome.note(), None, "InstallStarted comes from the Job's creation");
        let mut again = status.clone();
        assert!(
            !outcome.record(&mut again, Some(2), time(2)),
            "no write when nothing changed"
        );
    }

    #[test]
    fn missing_inputs_stop_provisioning_naming_them_until_they_exist() {
        let outcome = Outcome::MissingInputs(vec!["pull secret Secret ns/pull".into(), "spec.provisioning".into()]);
        let (status, write) = recorded(&outcome);
        assert!(write);
        assert_eq!(says(&status, "Provisioned"), pair("False", "MissingInputs"));
        assert_eq!(says(&status, "ProvisionStopped"), None, "not stopped for good");
        let note = outcome.note().unwrap();
        assert!(note.warning);
        assert_eq!(
            note.message,
            "Cannot start the installer: missing pull secret Secret ns/pull, spec.provisioning; create them in the cluster's namespace"
        );
    }

    #[test]
    fn an_installer_over_its_namespace_share_of_the_quota_waits_with_a_warning() {
        let outcome = Outcome::QuotaShareExceeded("the installer Job h/j requests 1 of cpu".into());
        let (status, write) = recorded(&outcome);
        assert!(write);
        assert_eq!(
            says(&status, "Provisioned"),
            pair("False", "NamespaceQuotaShareExceeded")
        );
        assert_eq!(
            says(&status, "ProvisionStopped"),
            None,
            "tried again as the namespace's workloads go"
        );
        let note = outcome.note().unwrap();
        assert!(note.warning);
        assert_eq!(note.reason, "NamespaceQuotaShareExceeded");
    }

    #[test]
    fn an_invalid_machine_spec_stops_provisioning_for_good() {
        let outcome = Outcome::InvalidMachineSpec("zone x and rootVolume".into());
        let (status, _) = recorded(&outcome);
        assert_eq!(says(&status, "Provisioned"), pair("False", "InvalidMachineSpec"));
        assert_eq!(says(&status, "ProvisionStopped"), pair("True", "InvalidMachineSpec"));
        assert_eq!(outcome.note().unwrap().reason, "InvalidMachineSpec");
    }

    #[test]
    fn a_failed_install_below_the_limit_is_counted_and_retried() {
        let outcome = Outcome::InstallFailed {
            attempts: 1,
            limit: 3,
            timed_out: false,
            ended: None,
        };
        let (status, write) = recorded(&outcome);
        assert!(write);
        assert_eq!(status.install_restarts, 1);
        assert_eq!(says(&status, "Provisioned"), pair("False", "InstallFailed"));
        assert_eq!(says(&status, "ProvisionStopped"), None);
        let note = outcome.note().unwrap();
        assert_eq!(
            (note.reason, note.message.as_str()),
            ("InstallFailed", "The installer failed (attempt 1 of 3); retrying")
        );
    }

    #[test]
    fn a_failed_install_at_the_limit_stops_and_marks_the_cluster_broken() {
        let outcome = Outcome::InstallFailed {
            attempts: 3,
            limit: 3,
            timed_out: true,
            ended: None,
        };
        let (status, _) = recorded(&outcome);
        assert!(
            outcome
                .note()
                .unwrap()
                .message
                .contains("ran longer than the installer deadline"),
            "{:?}",
            outcome.note()
        );
        assert_eq!(status.install_restarts, 3);
        assert_eq!(says(&status, "Provisioned"), pair("False", "ProvisionFailed"));
        assert_eq!(
            says(&status, "ProvisionStopped"),
            pair("True", "InstallAttemptsLimitReached")
        );
        assert_eq!(outcome.note().unwrap().reason, "ProvisionStopped");
    }

    #[test]
    fn a_refused_admin_kubeconfig_stops_provisioning_and_names_the_refusal() {
        let outcome = Outcome::KubeconfigRefused {
            secret: "c1-admin-kubeconfig".into(),
            refusal: "users[0].user.exec is not allowed".into(),
        };
        let (status, write) = recorded(&outcome);
        assert!(write);
        assert_eq!(says(&status, "Provisioned"), pair("False", "AdminKubeconfigRefused"));
        assert_eq!(
            says(&status, "ProvisionStopped"),
            pair("True", "AdminKubeconfigRefused")
        );
        assert!(
            condition(&status, "ProvisionStopped")
                .unwrap()
                .message
                .contains("users[0].user.exec")
        );
        assert!(!status.installed);
    }

    #[test]
    fn a_foreign_admin_kubeconfig_secret_is_a_conflict_not_a_stop() {
        let outcome = Outcome::KubeconfigConflict {
            secret: "c1-admin-kubeconfig".into(),
        };
        let (status, _) = recorded(&outcome);
        assert_eq!(says(&status, "Provisioned"), pair("False", "AdminKubeconfigConflict"));
        assert_eq!(says(&status, "ProvisionStopped"), None);
        assert!(!status.installed);
        assert!(outcome.note().unwrap().message.contains("left untouched"));
    }

    #[test]
    fn a_successful_install_records_the_admin_kubeconfig_and_infra_id() {
        let outcome = Outcome::Installed {
            secret: "c1-admin-kubeconfig".into(),
            infra_id: Some("c1-xyz".into()),
        };
        let (status, _) = recorded(&outcome);
        assert!(status.installed);
        assert_eq!(status.infra_id.as_deref(), Some("c1-xyz"));
        assert_eq!(
            status.admin_kubeconfig_secret_ref.as_ref().map(|r| r.name.as_str()),
            Some("c1-admin-kubeconfig")
        );
        assert_eq!(says(&status, "Provisioned"), pair("True", "Provisioned"));
        let note = outcome.note().unwrap();
        assert_eq!(
            (note.warning, note.reason, note.message.as_str()),
            (
                false,
                "Installed",
                "Cluster installed; admin kubeconfig in Secret c1-admin-kubeconfig"
            )
        );
    }

    #[test]
    fn a_restored_record_warns_only_when_it_was_edited() {
        let record = vec![MachineFailureDomain {
            machine: "master-0".into(),
            name: "az1".into(),
            ..Default::default()
        }];
        let first = Outcome::RecordRestored {
            record: record.clone(),
            edited: false,
        };
        let (status, write) = recorded(&first);
        assert!(write);
        assert_eq!(status.failure_domains, record);
        assert!(status.conditions.is_empty());
        assert_eq!(first.note(), None);
        let edited = Outcome::RecordRestored { record, edited: true };
        assert_eq!(edited.note().unwrap().reason, "FailureDomainsRestored");
    }
}
