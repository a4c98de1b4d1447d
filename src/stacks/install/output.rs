//! The install Job's output (DESIGN.md §3.2 step 4): its pod, found by the Job's `controller-uid`
//! label and proven by its controller reference to the Job; its log, read once per Job; and what
//! the log came to, verified, parsed and checked off the async workers (up to 8 MiB of the tenant's
//! YAML), then kept in [`super::unpacked::Reads`] until the Job changes. A read the host or the
//! node's kubelet did not answer is no verdict on the package: it is not kept, and the Job stays.

use std::sync::Arc;

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{ListParams, LogParams};
use kube::{Api, ResourceExt};

use super::job;
use super::package::{self, Outline, PackageRules};
use super::unpacked::Read;
use super::{InstallContext, InstallKind};
use crate::host::pod_trouble::made_by_job;
use crate::runtime::cause::{Cause, CauseKind, diagnose};
use crate::stacks::install::crd_policy::CrdRules;
use crate::stacks::stream::{self, LOG_LIMIT_BYTES, StreamError};
use crate::stacks::unpack;

/// How much of a failed Job's log is read for its last lines.
const FAILURE_LOG_BYTES: i64 = 16 * 1024;
/// The most of a failed Job's last lines a condition message carries: room for every problem
/// `stackd unpack` lists (its Event carries the first 1,024 bytes).
const FAILURE_DETAIL_CHARS: usize = 4096;
/// The last lines of a failed Job's log that are read: `stackd unpack`'s list of problems, its
/// heading and its count of the problems past the list.
const FAILURE_LOG_LINES: usize = unpack::MAX_PROBLEMS + 2;

/// `Ready=False` reason of an install whose Job's pods cannot be listed: the host API server does
/// not answer.
pub(super) const HOST_UNREACHABLE: &str = "HostUnreachable";
/// `Ready=False` reason of an install whose Job's log cannot be read: the host API server answers,
/// but the kubelet of the pod's node does not.
pub(super) const KUBELET_UNREACHABLE: &str = "KubeletUnreachable";

/// A read of the Job's output that the host or the node did not answer: the Job is kept and the
/// read tried again.
#[derive(Debug)]
pub(super) struct Unanswered {
    /// [`HOST_UNREACHABLE`] or [`KUBELET_UNREACHABLE`].
    pub reason: &'static str,
    pub message: String,
    pub error: kube::Error,
}

/// Why the Job's log was not read.
enum Unread {
    /// Not the package's doing, and not for long: see [`Unanswered`].
    Unanswered(Unanswered),
    /// The pod is gone, or its log cannot be had: the Job is made again.
    Unreadable(String),
}

/// What the completed Job `job` of `install` came to: read once per Job, then kept.
pub(super) async fn package_read<K: InstallKind>(
    install: &K,
    ctx: &InstallContext,
    job: &Job,
) -> Result<Read, Unanswered> {
    let (install_uid, job_uid) = (install.uid().unwrap_or_default(), job.uid().unwrap_or_default());
    if let Some(read) = ctx.unpacked.get(&install_uid, &job_uid) {
        return Ok(read);
    }
    let (read, bytes) = read_package::<K>(ctx, job).await?;
    ctx.unpacked.keep(&install_uid, &job_uid, bytes, read.clone());
    Ok(read)
}

/// The last lines of the failed Job `job`'s log: read once per Job, then kept.
pub(super) async fn failure_detail<K: InstallKind>(install: &K, ctx: &InstallContext, job: &Job) -> String {
    let (install_uid, job_uid) = (install.uid().unwrap_or_default(), job.uid().unwrap_or_default());
    if let Some(Read::JobFailed(detail)) = ctx.unpacked.get(&install_uid, &job_uid) {
        return detail;
    }
    let params = LogParams {
        container: Some(job::UNPACK_CONTAINER.into()),
        tail_lines: Some(FAILURE_LOG_LINES as i64),
        limit_bytes: Some(FAILURE_LOG_BYTES),
        ..LogParams::default()
    };
    let log = match unpack_log(ctx, job, &params).await {
        Ok(log) => log,
        // Read again at the next look: the host or the node may answer by then.
        Err(Unread::Unanswered(unanswered)) => return unanswered.message,
        Err(Unread::Unreadable(_)) => String::new(),
    };
    let detail: String = last_lines(&log, FAILURE_LOG_LINES)
        .chars()
        .take(FAILURE_DETAIL_CHARS)
        .collect();
    ctx.unpacked
        .keep(&install_uid, &job_uid, 0, Read::JobFailed(detail.clone()));
    detail
}

/// Reads, verifies and checks the completed Job's output (see [`package_read`]); the log's size.
pub(super) async fn read_package<K: InstallKind>(ctx: &InstallContext, job: &Job) -> Result<(Read, usize), Unanswered> {
    let params = LogParams {
        container: Some(job::UNPACK_CONTAINER.into()),
        limit_bytes: Some(LOG_LIMIT_BYTES),
        ..LogParams::default()
    };
    let log = match unpack_log(ctx, job, &params).await {
        Ok(log) => log,
        Err(Unread::Unanswered(unanswered)) => return Err(unanswered),
        Err(Unread::Unreadable(message)) => return Ok((Read::Unreadable(message), 0)),
    };
    let bytes = log.len();
    let settings = &ctx.tenant.shared.settings;
    let job_name = job.name_any();
    let (kind, groups, pod_policy, registries) = (
        K::kind(&()).into_owned(),
        settings.stack_crd_groups.clone(),
        settings.stack_pod_policy.clone(),
        settings.allowed_registries.clone(),
    );
    let stackd_image = ctx.stackd_image.clone();
    let (pass_full_deployment, allow_conversion_webhooks, max_crds) = (
        settings.insecure_pass_full_deployment,
        settings.insecure_allow_conversion_webhooks,
        settings.stack_limits.max_package_crds,
    );
    let scope = K::SCOPE;
    let judged = tokio::task::spawn_blocking(move || {
        let contents = match stream::decode(&log, max_crds) {
            Ok(contents) => contents,
            Err(err @ StreamError::TooManyCrds { .. }) => {
                return Read::Refused {
                    reason: "TooManyCRDs",
                    message: err.to_string(),
                };
            }
            Err(err) => return Read::Unreadable(format!("install Job {job_name} output refused: {err}")),
        };
        let rules = PackageRules {
            scope,
            kind: &kind,
            pass_full_deployment,
            crd_rules: CrdRules {
                groups: &groups,
                allow_conversion_webhooks,
            },
            pod_policy: &pod_policy,
            registries: &registries,
            stackd_image: &stackd_image,
        };
        match package::check_package(&contents, &rules) {
            Err(err) => Read::Refused {
                reason: err.reason(),
                message: err.to_string(),
            },
            Ok(()) => Read::Verified {
                outline: Arc::new(Outline::of(&contents)),
                contents: Some(Arc::new(contents)),
            },
        }
    })
    .await;
    Ok(match judged {
        Ok(read) => (read, bytes),
        Err(err) => (
            Read::Unreadable(format!("the install output could not be read: {err}")),
            0,
        ),
    })
}

/// The log of the Job's `unpack` container with `params`, from the pod the Job made.
async fn unpack_log(ctx: &InstallContext, job: &Job, params: &LogParams) -> Result<String, Unread> {
    let tenant = &ctx.tenant;
    let pods: Api<Pod> = Api::namespaced(tenant.host.clone(), &tenant.host_namespace);
    let uid = job.metadata.uid.clone().unwrap_or_default();
    let job_name = job.name_any();
    let list = match pods
        .list(&ListParams::default().labels(&format!("controller-uid={uid}")))
        .await
    {
        Ok(list) => list,
        Err(error) => {
            let cause = diagnose(&error);
            if !cause.kind.is_outage() {
                return Err(Unread::Unreadable(format!(
                    "cannot list the install Job's pods: {error}"
                )));
            }
            return Err(Unread::Unanswered(Unanswered {
                reason: HOST_UNREACHABLE,
                message: format!(
                    "cannot list the pods of install Job {job_name}: the host API server does not answer, or cannot serve it now ({cause}); the Job is kept and its output read when it answers"
                ),
                error,
            }));
        }
    };
    // The label alone proves nothing: whoever may create pods in the host namespace (an installer, a
    // stack's controller) can label one with this Job's uid. The Job's controller reference names
    // the pods its controller made.
    let mut candidates: Vec<&Pod> = list.items.iter().filter(|pod| made_by_job(pod, &uid)).collect();
    // The succeeded pod when there is one, else the newest.
    candidates.sort_by_key(|p| {
        let succeeded = p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Succeeded");
        (succeeded, p.metadata.creation_timestamp.clone().map(|t| t.0))
    });
    let Some(pod) = candidates.last() else {
        return Err(Unread::Unreadable(format!(
            "the pod of install Job {job_name} is gone, so its output cannot be read; the Job will be retried"
        )));
    };
    let pod_name = pod.name_any();
    pods.logs(&pod_name, params).await.map_err(|error| {
        let cause = diagnose(&error);
        match unanswered_by(&cause) {
            Some(HOST_UNREACHABLE) => Unread::Unanswered(Unanswered {
                reason: HOST_UNREACHABLE,
                message: format!(
                    "cannot read the log of install pod {pod_name}: the host API server does not answer ({cause}); the Job is kept and its output read when it answers"
                ),
                error,
            }),
            Some(reason) => {
                let node = pod.spec.as_ref().and_then(|spec| spec.node_name.as_deref());
                let node = node.map(|node| format!("node {node}")).unwrap_or_else(|| "its node".into());
                Unread::Unanswered(Unanswered {
                    reason,
                    message: format!(
                        "cannot read the log of install pod {pod_name}: the kubelet of {node} does not answer the host API server ({cause}); the Job is kept and its output read when it answers"
                    ),
                    error,
                })
            }
            None => Unread::Unreadable(format!("cannot read the log of install pod {pod_name}: {error}")),
        }
    })
}

/// Who did not answer a log request that failed for `cause`, if it was no answer: the host API
/// server itself (no connection, or it broke), or the kubelet behind it (the server answered that
/// it could not serve the log: kube-apiserver passes a kubelet's dial error on as a 5xx).
fn unanswered_by(cause: &Cause) -> Option<&'static str> {
    match cause.kind {
        CauseKind::ServerBusy => Some(KUBELET_UNREACHABLE),
        kind if kind.is_outage() => Some(HOST_UNREACHABLE),
        _ => None,
    }
}

fn last_lines(log: &str, count: usize) -> String {
    let lines: Vec<&str> = log.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    lines[lines.len().saturating_sub(count)..].join(" | ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cause(kind: CauseKind) -> Cause {
        Cause {
            kind,
            message: String::new(),
        }
    }

    #[test]
    fn a_log_the_host_or_its_kubelet_does_not_answer_is_no_verdict_on_the_package() {
        // kube-apiserver answers 500 with the dial error when the kubelet does not answer.
        assert_eq!(unanswered_by(&cause(CauseKind::ServerBusy)), Some(KUBELET_UNREACHABLE));
        for host_away in [CauseKind::Refused, CauseKind::Reset, CauseKind::Timeout, CauseKind::Dns] {
            assert_eq!(
                unanswered_by(&cause(host_away)),
                Some(HOST_UNREACHABLE),
                "{host_away:?}"
            );
        }
        // A pod gone (404) or a log refused: the Job is made again, as before.
        for answered in [CauseKind::Other, CauseKind::Forbidden, CauseKind::Certificate] {
            assert_eq!(unanswered_by(&cause(answered)), None, "{answered:?}");
        }
    }
}
