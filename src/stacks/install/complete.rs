//! A completed install Job (DESIGN.md §3.2 steps 4–5): what to do with its package is decided by
//! pure functions from the caches and the package (`plan`, then `after_crds` once the CRDs are
//! written); `run` does the reads and writes they call for.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use kube::api::PostParams;
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;
use kube::{Api, ResourceExt};

use super::job;
use super::object::{Reconciled, Report, event, installer_of};
use super::package::{self, CrdWrites, Outline, PackageError};
use super::{InstallContext, InstallError, InstallKind, SAFETY_NET};
use crate::api::common::HostObjectRef;
use crate::api::stacks::Stack;
use crate::runtime::api_errors::is_conflict;
use crate::stacks::stream::PackageContents;

/// When a reconcile that created or changed CRDs looks again if their events have not brought it
/// back: an API server establishes a CRD within moments.
const ESTABLISH_WAIT: Duration = Duration::from_secs(2);

/// What the install does with its unpacked package before writing anything.
#[derive(Debug)]
enum Plan {
    /// A Stack that is not this install's stands at its name: its CRDs would carry the same Stack
    /// label as ours, so nothing may be written.
    Conflict(Report),
    /// The package cannot be applied here.
    Refuse(PackageError),
    /// Write the package's CRDs, then decide with `after_crds`.
    WriteCrds,
}

fn plan(stack: Option<&Stack>, uid: &str, check: Result<(), PackageError>) -> Plan {
    if let Some(existing) = stack.filter(|s| !package::controlled_by(s, uid)) {
        return Plan::Conflict(stack_conflict(existing));
    }
    match check {
        Err(err) => Plan::Refuse(err),
        Ok(()) => Plan::WriteCrds,
    }
}

/// What the install does once the CRDs are written.
#[derive(Debug, PartialEq)]
enum AfterCrds {
    /// CRDs were just created or redefined: their Established events bring the install back (a
    /// WaitingForCRDs status would be one more write per install, stale at once).
    AwaitEstablished,
    /// A CRD was created by another install between our cache and our create: it does not carry
    /// our label yet, so its events do not wake this install; look again in a moment, unreported
    /// (a WaitingForCRDs status would be stale at once).
    Raced,
    /// Some CRDs are not Established.
    WaitForCrds { names: Vec<String> },
    /// Every CRD is Established: the Stack, created last.
    Stack(StackWrite),
}

#[derive(Debug, PartialEq)]
enum StackWrite {
    Keep,
    Create(Box<Stack>),
    Replace(Box<Stack>),
}

fn after_crds(applied: &CrdWrites, not_established: Vec<String>, stack: Option<&Stack>, desired: Stack) -> AfterCrds {
    if applied.definitions > 0 && !applied.raced {
        return AfterCrds::AwaitEstablished;
    }
    if applied.raced {
        return AfterCrds::Raced;
    }
    if !not_established.is_empty() {
        return AfterCrds::WaitForCrds { names: not_established };
    }
    AfterCrds::Stack(match stack {
        None => StackWrite::Create(Box::new(desired)),
        Some(existing) if stack_matches(existing, &desired) => StackWrite::Keep,
        Some(existing) => {
            let mut replacement = desired;
            replacement.metadata.resource_version = existing.metadata.resource_version.clone();
            replacement.metadata.uid = existing.metadata.uid.clone();
            replacement.metadata.finalizers = existing.metadata.finalizers.clone();
            replacement.status = None;
            StackWrite::Replace(Box::new(replacement))
        }
    })
}

/// Why the package (outlined) cannot be applied on the tenant as it stands, with what to do next;
/// `None` when it can. Judged from the caches and the outline alone: a refused package is not read
/// again to be judged again when the tenant's CRDs change.
pub(super) fn judge<K: InstallKind>(
    install: &K,
    ctx: &InstallContext,
    outline: &Outline,
    job_ref: &HostObjectRef,
) -> Option<Reconciled> {
    let (namespace, name) = (install.namespace().unwrap_or_default(), install.name_any());
    let uid = install.meta().uid.clone().unwrap_or_default();
    let stack = ctx.stacks.get(&ObjectRef::new(&name).within(&namespace));
    let all_crds = ctx.crds.state();
    let existing: BTreeMap<String, _> = all_crds.iter().map(|c| (c.name_any(), c.as_ref())).collect();
    let with_job = |mut report: Report| {
        report.install_job = Some(job_ref.clone());
        Some(report)
    };
    match plan(
        stack.as_deref(),
        &uid,
        package::check_tenant(outline, &existing, &installer_of(install)),
    ) {
        Plan::Conflict(report) => Some((Action::await_change(), with_job(report))),
        Plan::Refuse(err) => Some((
            refused_action(&err),
            with_job(Report::failed(err.reason(), err.to_string())),
        )),
        Plan::WriteCrds => None,
    }
}

/// Applies the package of a completed Job (read from `contents`, judged by [`judge`]) and reports;
/// `Ok(None)` when the install must wait for its CRDs without a status of its own.
pub(super) async fn run<K: InstallKind>(
    install: &K,
    ctx: &InstallContext,
    contents: Arc<PackageContents>,
    job_ref: HostObjectRef,
    package: &str,
) -> Result<Reconciled, InstallError> {
    let tenant = &ctx.tenant;
    let (namespace, name) = (install.namespace().unwrap_or_default(), install.name_any());
    let stack = ctx.stacks.get(&ObjectRef::new(&name).within(&namespace));
    let all_crds = ctx.crds.state();
    let existing: BTreeMap<String, _> = all_crds.iter().map(|c| (c.name_any(), c.as_ref())).collect();
    let installer = installer_of(install);
    let settings = &tenant.shared.settings;
    let with_job = |mut report: Report| {
        report.install_job = Some(job_ref.clone());
        Some(report)
    };
    let applied = package::apply_crds(&Api::all(tenant.client.clone()), &contents, &existing, &installer)
        .await
        .map_err(InstallError::Tenant)?;
    if applied.writes > 0 {
        let mut note = format!("applied {} CustomResourceDefinition(s) of {package}", applied.writes);
        let converted = package::converted_files(&contents);
        if !converted.is_empty() {
            note.push_str(&format!(
                "; converted from apiextensions.k8s.io/v1beta1 to v1: {}",
                converted.join(", ")
            ));
        }
        event(install, ctx, EventType::Normal, "CRDsApplied", note).await;
    }
    let waiting = package::not_established(&contents, &existing);
    let desired = package::desired_stack(&contents, install, install.install(), package);
    match after_crds(&applied, waiting, stack.as_deref(), desired) {
        AfterCrds::AwaitEstablished => Ok((Action::requeue(ESTABLISH_WAIT), None)),
        AfterCrds::Raced => Ok((Action::requeue(settings.backoff.base), None)),
        AfterCrds::WaitForCrds { names } => {
            let report = Report::waiting(
                "WaitingForCRDs",
                format!(
                    "waiting for CustomResourceDefinition(s) {} to be Established",
                    names.join(", ")
                ),
            );
            // Each CRD carries our label now, so its Established update wakes this install.
            Ok((Action::requeue(SAFETY_NET), with_job(report)))
        }
        AfterCrds::Stack(write) => {
            write_stack(install, ctx, write, package).await?;
            Ok((
                Action::requeue(SAFETY_NET),
                Some(applied_report(None, Some(job_ref), package, &name)),
            ))
        }
    }
}

async fn write_stack<K: InstallKind>(
    install: &K,
    ctx: &InstallContext,
    write: StackWrite,
    package: &str,
) -> Result<(), InstallError> {
    let name = install.name_any();
    let stacks: Api<Stack> = Api::namespaced(ctx.tenant.client.clone(), &install.namespace().unwrap_or_default());
    let (reason, note) = match write {
        StackWrite::Keep => return Ok(()),
        StackWrite::Replace(replacement) => {
            stacks
                .replace(&name, &PostParams::default(), &replacement)
                .await
                .map_err(InstallError::Tenant)?;
            ("StackUpdated", format!("updated Stack {name} to {package}"))
        }
        StackWrite::Create(desired) => match stacks.create(&PostParams::default(), &desired).await {
            Ok(_) => ("StackCreated", format!("created Stack {name} from {package}")),
            Err(err) if is_conflict(&err) => return Ok(()),
            Err(err) => return Err(InstallError::Tenant(err)),
        },
    };
    event(install, ctx, EventType::Normal, reason, note).await;
    Ok(())
}

/// The report of an applied package: the Stack's readiness when it is current, else that it is on
/// its way.
pub(super) fn applied_report(
    current: Option<&Stack>,
    job_ref: Option<HostObjectRef>,
    package: &str,
    name: &str,
) -> Report {
    let mut report = match current {
        Some(stack) => stack_readiness(stack),
        None => stack_on_its_way(name),
    };
    report.synced = Some((
        true,
        "PackageApplied",
        format!("{package} is applied: its CRDs and Stack {name}"),
    ));
    report.install_job = job_ref;
    report.stack_ref = Some(name.to_string());
    report
}

fn refused_action(err: &PackageError) -> Action {
    if err.retry_later() {
        // CRD events wake an install refused for a CRD (see `installs_using`); this is the safety net.
        Action::requeue(SAFETY_NET)
    } else {
        // Nothing but a new package (an edit of the install, which is an event) changes the outcome.
        Action::await_change()
    }
}

fn stack_matches(existing: &Stack, desired: &Stack) -> bool {
    let labels = existing.labels();
    existing.spec == desired.spec
        && existing.annotations().get(job::PACKAGE_ANNOTATION) == desired.annotations().get(job::PACKAGE_ANNOTATION)
        && desired.labels().iter().all(|(k, v)| labels.get(k) == Some(v))
}

fn stack_conflict(existing: &Stack) -> Report {
    let (namespace, name) = (existing.namespace().unwrap_or_default(), existing.name_any());
    let owner = existing
        .owner_references()
        .iter()
        .find(|o| o.controller == Some(true))
        .map(|o| format!(" (it belongs to the {} {namespace}/{})", o.kind, o.name))
        .unwrap_or_default();
    Report::failed(
        "StackConflict",
        format!(
            "a Stack named {name} already exists in namespace {namespace} and is not this install's{owner}; delete it or install under another name"
        ),
    )
}

/// The Stack's `Ready` reasons that only say which step it waits for: the install says that the
/// Stack is on its way, once, instead of a status write for each step (the Stack shows them).
const STACK_PROGRESS_REASONS: &[&str] = &["WaitingForCrds", "WaitingForToken", "DeploymentUnavailable"];

fn stack_readiness(stack: &Stack) -> Report {
    let ready = stack
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Ready"));
    match ready {
        Some(c) if c.status == "True" => Report {
            ready: (true, "Available", format!("Stack {} is ready", stack.name_any())),
            ..Report::waiting("", String::new())
        },
        Some(c) if !STACK_PROGRESS_REASONS.contains(&c.reason.as_str()) => Report::waiting(
            "WaitingForStack",
            format!("Stack {} is not ready: {}", stack.name_any(), c.message),
        ),
        _ => stack_on_its_way(&stack.name_any()),
    }
}

fn stack_on_its_way(name: &str) -> Report {
    Report::waiting(
        "WaitingForStack",
        format!("Stack {name} is not ready yet (its status says which step it is at)"),
    )
}

#[cfg(test)]
mod tests {

    use super::*;
    use crate::api::stacks::{StackInstall, StackSpec};

    const UID: &str = "install-uid";

    fn install() -> StackInstall {
        let mut install = StackInstall::new("db", Default::default());
        install.metadata.namespace = Some("team".into());
        install.metadata.uid = Some(UID.into());
        install
    }

    fn stack_of(owner: Option<&StackInstall>, title: &str) -> Stack {
        let mut stack = Stack::new(
            "db",
            StackSpec {
                title: Some(title.into()),
                ..StackSpec::default()
            },
        );
        stack.metadata.namespace = Some("team".into());
        stack.metadata.owner_references = owner.map(|o| vec![package::owner_reference(o)]);
        stack
    }

    fn written(definitions: usize, raced: bool) -> CrdWrites {
        CrdWrites {
            writes: definitions,
            raced,
            definitions,
        }
    }

    #[test]
    fn another_s_stack_at_the_install_s_name_is_a_conflict_before_any_check() {
        let stranger = stack_of(None, "db");
        let refusal = Err(PackageError::CrdTerminating("widgets.example.org".into()));
        let Plan::Conflict(report) = plan(Some(&stranger), UID, refusal) else {
            panic!("expected a conflict");
        };
        assert_eq!(report.ready.1, "StackConflict");
        assert!(report.ready.2.contains("is not this install's"), "{}", report.ready.2);
    }

    #[test]
    fn a_refused_package_writes_nothing() {
        let refusal = Err(PackageError::CrdTerminating("widgets.example.org".into()));
        assert!(matches!(plan(None, UID, refusal), Plan::Refuse(_)));
        let ours = stack_of(Some(&install()), "db");
        let refusal = Err(PackageError::CrdTerminating("widgets.example.org".into()));
        assert!(matches!(plan(Some(&ours), UID, refusal), Plan::Refuse(_)));
    }

    #[test]
    fn a_refusal_for_a_terminating_crd_looks_again_and_a_wrong_package_waits_for_an_edit() {
        let terminating = PackageError::CrdTerminating("widgets.example.org".into());
        assert_eq!(refused_action(&terminating), Action::requeue(SAFETY_NET));
        let wrong_scope = PackageError::WrongScope {
            found: "Cluster",
            expected: "Namespaced",
            kind: "StackInstall".into(),
            other: "ClusterStackInstall",
        };
        assert_eq!(refused_action(&wrong_scope), Action::await_change());
    }

    #[test]
    fn an_accepted_package_writes_its_crds_first() {
        assert!(matches!(plan(None, UID, Ok(())), Plan::WriteCrds));
        let ours = stack_of(Some(&install()), "old");
        assert!(matches!(plan(Some(&ours), UID, Ok(())), Plan::WriteCrds));
    }

    #[test]
    fn crds_just_written_are_awaited_through_their_events_without_a_status() {
        let desired = stack_of(Some(&install()), "db");
        let after = after_crds(&written(1, false), vec!["widgets.example.org".into()], None, desired);
        assert_eq!(after, AfterCrds::AwaitEstablished);
    }

    #[test]
    fn crds_not_established_keep_the_stack_waiting() {
        let desired = stack_of(Some(&install()), "db");
        let after = after_crds(&written(0, false), vec!["widgets.example.org".into()], None, desired);
        assert_eq!(
            after,
            AfterCrds::WaitForCrds {
                names: vec!["widgets.example.org".into()],
            }
        );
    }

    #[test]
    fn a_crd_created_by_another_meanwhile_is_looked_at_again_in_a_moment() {
        let desired = stack_of(Some(&install()), "db");
        let after = after_crds(&written(1, true), vec![], None, desired);
        assert_eq!(after, AfterCrds::Raced);
    }

    #[test]
    fn established_crds_let_the_stack_be_created_last() {
        let desired = stack_of(Some(&install()), "db");
        let after = after_crds(&written(0, false), vec![], None, desired.clone());
        assert_eq!(after, AfterCrds::Stack(StackWrite::Create(Box::new(desired))));
    }

    #[test]
    fn a_stack_of_another_package_is_replaced_keeping_its_identity_and_finalizers() {
        let mut existing = stack_of(Some(&install()), "old");
        existing.metadata.resource_version = Some("41".into());
        existing.metadata.uid = Some("stack-uid".into());
        existing.metadata.finalizers = Some(vec!["stacks.stackd.dev/stack".into()]);
        let desired = stack_of(Some(&install()), "new");
        let AfterCrds::Stack(StackWrite::Replace(replacement)) =
            after_crds(&written(0, false), vec![], Some(&existing), desired)
        else {
            panic!("expected a replacement");
        };
        assert_eq!(replacement.spec.title.as_deref(), Some("new"));
        assert_eq!(replacement.metadata.resource_version.as_deref(), Some("41"));
        assert_eq!(replacement.metadata.uid.as_deref(), Some("stack-uid"));
        assert_eq!(existing.metadata.finalizers, replacement.metadata.finalizers);
    }

    #[test]
    fn a_matching_stack_is_left_alone() {
        let existing = stack_of(Some(&install()), "db");
        let desired = existing.clone();
        let after = after_crds(&written(0, false), vec![], Some(&existing), desired);
        assert_eq!(after, AfterCrds::Stack(StackWrite::Keep));
    }

    #[test]
    fn an_applied_package_reports_the_stack_s_readiness_or_that_it_is_on_its_way() {
        let job = HostObjectRef {
            namespace: "host".into(),
            name: "db-install".into(),
        };
        let mut stack = stack_of(Some(&install()), "db");
        let on_its_way = applied_report(Some(&stack), Some(job.clone()), "pkg:1", "db");
        assert_eq!((on_its_way.ready.0, on_its_way.ready.1), (false, "WaitingForStack"));
        assert_eq!(on_its_way.synced.as_ref().map(|s| s.1), Some("PackageApplied"));
        assert_eq!(on_its_way.stack_ref.as_deref(), Some("db"));
        stack.status = Some(crate::api::stacks::StackStatus {
            conditions: vec![k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
                type_: "Ready".into(),
                status: "True".into(),
                reason: "Available".into(),
                message: String::new(),
                last_transition_time: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(jiff::Timestamp::UNIX_EPOCH),
                observed_generation: None,
            }],
            ..Default::default()
        });
        let ready = applied_report(Some(&stack), Some(job), "pkg:1", "db");
        assert_eq!((ready.ready.0, ready.ready.1), (true, "Available"));
    }

    #[test]
    fn what_the_kubelet_says_of_the_stack_s_controller_pod_is_in_the_install_s_status() {
        let mut stack = stack_of(Some(&install()), "db");
        stack.status = Some(crate::api::stacks::StackStatus {
            conditions: vec![k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
                type_: "Ready".into(),
                status: "False".into(),
                reason: "ControllerCrashLooping".into(),
                message: "the container keeps exiting (pod p container c: CrashLoopBackOff (last exit code 2))".into(),
                last_transition_time: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(jiff::Timestamp::UNIX_EPOCH),
                observed_generation: None,
            }],
            ..Default::default()
        });
        let report = stack_readiness(&stack);
        assert_eq!(report.ready.1, "WaitingForStack");
        assert!(
            report.ready.2.contains("CrashLoopBackOff (last exit code 2)"),
            "{}",
            report.ready.2
        );
    }
}
