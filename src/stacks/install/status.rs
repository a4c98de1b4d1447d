//! The install's status: one writer (server-side apply as the install controller's field manager),
//! written only when a reconcile's report changes it, with an Event for each change of `Ready`.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::runtime::events::EventType;
use kube::{Api, ResourceExt};

use super::object::{Report, event};
use super::pod_wait::{INSTALL_POD_REFUSED, INSTALL_POD_WAITING};
use super::{FAILURE_REASONS, FIELD_MANAGER, InstallContext, InstallError, InstallKind};
use crate::api::common::LocalObjectReference;
use crate::api::stacks::StackInstallStatus;
use crate::runtime::api_errors::is_not_found;
use crate::runtime::conditions::{DesiredCondition, set_condition};
use crate::runtime::status_writer::apply_status;

/// Writes the status when the report changes it, with an Event for each change of `Ready` (a
/// Warning for a failure or a pod that does not start).
pub(super) async fn publish<K: InstallKind>(
    install: &K,
    ctx: &InstallContext,
    report: Report,
) -> Result<(), InstallError> {
    let uid = install.uid().unwrap_or_default();
    let cached = install.install_status().cloned().unwrap_or_default();
    let old = ctx.written.current(&uid, install.resource_version().as_deref(), cached);
    let now = Time(jiff::Timestamp::now());
    let (status, changed) = next_status(&old, report, install.meta().generation, now);
    if status == old {
        return Ok(());
    }
    let api: Api<K> = Api::namespaced(ctx.tenant.client.clone(), &install.namespace().unwrap_or_default());
    let body = serde_json::to_value(&status).map_err(|e| InstallError::Tenant(kube::Error::SerdeError(e)))?;
    match apply_status(&api, install, FIELD_MANAGER, &body, None).await {
        Ok(stored) => ctx.written.record(&uid, stored.resource_version(), status),
        Err(err) if is_not_found(&err) => return Ok(()),
        Err(err) => return Err(InstallError::Tenant(err)),
    }
    for (reason, message) in changed {
        tracing::debug!(reason, message, "install Ready changed");
        let type_ = if FAILURE_REASONS.contains(&reason) || [INSTALL_POD_WAITING, INSTALL_POD_REFUSED].contains(&reason)
        {
            EventType::Warning
        } else {
            EventType::Normal
        };
        event(install, ctx, type_, reason, message).await;
    }
    Ok(())
}

/// The status `report` makes of `old`, and the `Ready` (reason, message) when that condition changed
/// status or reason.
fn next_status(
    old: &StackInstallStatus,
    report: Report,
    generation: Option<i64>,
    now: Time,
) -> (StackInstallStatus, Vec<(&'static str, String)>) {
    let mut status = old.clone();
    let mut changed = Vec::new();
    let mut conditions = vec![("Ready", report.ready)];
    conditions.extend(report.synced.map(|synced| ("Synced", synced)));
    for (type_, (ok, reason, message)) in conditions {
        let before = status
            .conditions
            .iter()
            .find(|c| c.type_ == type_)
            .map(|c| (c.status == "True", c.reason.clone()));
        let desired = DesiredCondition {
            type_,
            status: ok,
            reason,
            message: message.clone(),
            observed_generation: generation,
        };
        if set_condition(&mut status.conditions, desired, now.clone())
            && before != Some((ok, reason.to_string()))
            && type_ == "Ready"
        {
            changed.push((reason, message));
        }
    }
    if report.install_job.is_some() {
        status.install_job = report.install_job;
    }
    if let Some(stack) = report.stack_ref {
        status.stack_ref = Some(LocalObjectReference { name: stack });
    }
    status.observed_generation = generation;
    (status, changed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(seconds: i64) -> Time {
        Time(jiff::Timestamp::from_second(seconds).unwrap_or_default())
    }

    #[test]
    fn a_new_ready_reason_is_announced_once() {
        let running = Report::waiting("InstallJobRunning", "unpacking".into());
        let (first, changed) = next_status(&StackInstallStatus::default(), running, Some(1), at(1));
        assert_eq!(changed, vec![("InstallJobRunning", "unpacking".to_string())]);
        let again = Report::waiting("InstallJobRunning", "unpacking".into());
        let (second, changed) = next_status(&first, again, Some(1), at(2));
        assert_eq!((second, changed), (first, vec![]));
    }

    #[test]
    fn a_new_message_under_the_same_reason_is_written_without_an_event() {
        let failed = Report::failed("InstallJobFailed", "retrying in 4s".into());
        let (first, _) = next_status(&StackInstallStatus::default(), failed, Some(1), at(1));
        let later = Report::failed("InstallJobFailed", "retrying in 2s".into());
        let (second, changed) = next_status(&first, later, Some(1), at(2));
        assert!(changed.is_empty());
        assert_ne!(second, first);
        let synced = second.conditions.iter().find(|c| c.type_ == "Synced");
        assert_eq!(synced.map(|c| c.status.as_str()), Some("False"));
    }
}
