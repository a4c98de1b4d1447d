//! Install deleted (DESIGN.md §3.4): delete the Stack and wait until it is gone → host Jobs and
//! pull-secret copies → CRDs no installed stack uses any more. The finalizer goes when this is done
//! (see `finalized` in the module root).

use std::collections::BTreeMap;

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, Preconditions};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;
use kube::{Api, ResourceExt};
use serde_json::json;

use super::crd_policy::{Installer, MANAGED_CRD_LABEL, PACKAGE_REPOSITORY_ANNOTATION};
use super::object::{Report, event, installer_of, own_crd_label, parent_of};
use super::package::controlled_by;
use super::{InstallContext, InstallError, InstallKind, SAFETY_NET};
use crate::api::stacks::Stack;
use crate::host::apply;
use crate::runtime::api_errors::{is_conflict, is_gone_or_conflict, is_not_found};
use crate::stacks::crd_is_referenced;

/// Where an uninstall stands after one pass.
pub(super) enum Progress {
    /// Everything of the install is gone: the finalizer may go.
    Done,
    /// Something is still on its way out; the install says so and is looked at again.
    Waiting(Action, Report),
}

pub(super) async fn run<K: InstallKind>(install: &K, ctx: &InstallContext) -> Result<Progress, InstallError> {
    let namespace = install.namespace().unwrap_or_default();
    let name = install.name_any();
    let uid = install.meta().uid.clone().unwrap_or_default();
    let stack = ctx.stacks.get(&ObjectRef::new(&name).within(&namespace));

    // 1. The Stack first: its own finalizer takes its controller off the host.
    if let Some(stack) = stack.as_ref().filter(|stack| controlled_by(stack, &uid)) {
        if stack.metadata.deletion_timestamp.is_none() {
            delete_stack(install, ctx, stack).await?;
        }
        let report = Report::waiting("Deleting", format!("waiting for Stack {name} to be removed"));
        // The Stack's deletion event wakes this install.
        return Ok(Progress::Waiting(Action::requeue(SAFETY_NET), report));
    }
    // 2. Host Jobs (their pods go in the background) and the pull-secret copies.
    delete_host_objects(install, ctx).await?;
    // 3. CRDs: drop this stack's label (its Stack controller normally did) unless a Stack that is not
    //    ours stands at our name (it shares the label), then delete the CRDs of this install's package
    //    that no stack uses any more.
    let (crds, label) = (ctx.crds.state(), own_crd_label(install));
    let plan = crd_plan(crds.iter().map(|c| c.as_ref()), &label, stack.is_none());
    let released = release_crds(ctx, &plan, &installer_of(install)).await?;
    announce(install, ctx, &released).await;
    Ok(Progress::Done)
}

async fn delete_stack<K: InstallKind>(install: &K, ctx: &InstallContext, stack: &Stack) -> Result<(), InstallError> {
    let name = stack.name_any();
    let stacks: Api<Stack> = Api::namespaced(ctx.tenant.client.clone(), &stack.namespace().unwrap_or_default());
    match stacks
        .delete(&name, &uid_precondition(stack.metadata.uid.clone()))
        .await
    {
        Ok(_) => {
            event(
                install,
                ctx,
                EventType::Normal,
                "Uninstalling",
                format!("deleting Stack {name}"),
            )
            .await;
            Ok(())
        }
        Err(err) if is_gone_or_conflict(&err) => Ok(()),
        Err(err) => Err(InstallError::Tenant(err)),
    }
}

fn uid_precondition(uid: Option<String>) -> DeleteParams {
    DeleteParams {
        preconditions: Some(Preconditions {
            uid,
            resource_version: None,
        }),
        ..DeleteParams::default()
    }
}

/// The install's host Jobs and pull-secret copies: every one carrying its labels.
async fn delete_host_objects<K: InstallKind>(install: &K, ctx: &InstallContext) -> Result<(), InstallError> {
    let tenant = &ctx.tenant;
    let parent = parent_of(install);
    let jobs: Api<Job> = Api::namespaced(tenant.host.clone(), &tenant.host_namespace);
    let cached: Vec<Job> = ctx.jobs.state().iter().map(|j| j.as_ref().clone()).collect();
    apply::delete_all(&jobs, &cached, &tenant.name, &parent)
        .await
        .map_err(InstallError::HostApi)?;
    let secrets: Api<Secret> = Api::namespaced(tenant.host.clone(), &tenant.host_namespace);
    let copies = secrets
        .list_metadata(&ListParams::default().labels(&parent.selector(&tenant.name)))
        .await
        .map_err(InstallError::HostApi)?;
    for copy in &copies.items {
        match secrets
            .delete(&copy.name_any(), &uid_precondition(copy.metadata.uid.clone()))
            .await
        {
            Ok(_) => {}
            Err(err) if is_gone_or_conflict(&err) => {}
            Err(err) => return Err(InstallError::HostApi(err)),
        }
    }
    Ok(())
}

/// One tenant CRD the uninstall looks at.
#[derive(Debug, PartialEq)]
struct CrdStep<'a> {
    crd: &'a CustomResourceDefinition,
    /// Drop this stack's parent label (`Some(label)`) before judging whether the CRD goes.
    unlabel: Option<&'a str>,
}

/// The CRDs to look at: all of them, and on those carrying `label`, whether to drop it (only when
/// the label is ours: a Stack not ours at our name shares it).
fn crd_plan<'a>(
    crds: impl Iterator<Item = &'a CustomResourceDefinition>,
    label: &'a str,
    label_is_ours: bool,
) -> Vec<CrdStep<'a>> {
    crds.map(|crd| CrdStep {
        crd,
        unlabel: (label_is_ours && crd.labels().contains_key(label)).then_some(label),
    })
    .collect()
}

/// The CRDs deleted, and those kept because they changed while judged.
#[derive(Default)]
struct Released {
    deleted: Vec<String>,
    kept: Vec<String>,
}

async fn release_crds(
    ctx: &InstallContext,
    plan: &[CrdStep<'_>],
    installer: &Installer,
) -> Result<Released, InstallError> {
    let crds: Api<CustomResourceDefinition> = Api::all(ctx.tenant.client.clone());
    let mut released = Released::default();
    for step in plan {
        let crd = step.crd;
        let mut labels = crd.labels().clone();
        let mut resource_version = crd.metadata.resource_version.clone();
        if let Some(label) = step.unlabel {
            let patch = json!({"metadata": {"uid": crd.metadata.uid, "labels": {label: null}}});
            match crds
                .patch(&crd.name_any(), &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(patched) => {
                    labels = patched.labels().clone();
                    resource_version = patched.metadata.resource_version.clone();
                }
                Err(err) if is_gone_or_conflict(&err) => continue,
                Err(err) => return Err(InstallError::Tenant(err)),
            }
        }
        if !deletable(crd, &labels, installer) {
            continue;
        }
        // The labels were judged at this resourceVersion: a stack that started using the CRD since
        // (a new parent label) makes the delete fail instead of taking its CRD.
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: crd.metadata.uid.clone(),
                resource_version,
            }),
            ..DeleteParams::default()
        };
        match crds.delete(&crd.name_any(), &params).await {
            Ok(_) => released.deleted.push(crd.name_any()),
            Err(err) if is_conflict(&err) => released.kept.push(crd.name_any()),
            Err(err) if is_not_found(&err) => {}
            Err(err) => return Err(InstallError::Tenant(err)),
        }
    }
    Ok(released)
}

async fn announce<K: InstallKind>(install: &K, ctx: &InstallContext, released: &Released) {
    if !released.deleted.is_empty() {
        let note = format!(
            "deleted CustomResourceDefinition(s) no stack uses any more: {}",
            released.deleted.join(", ")
        );
        event(install, ctx, EventType::Normal, "CRDsDeleted", note).await;
    }
    if !released.kept.is_empty() {
        let note = format!(
            "kept CustomResourceDefinition(s) that changed while this uninstall judged them (another stack may have started using them): {}",
            released.kept.join(", ")
        );
        event(install, ctx, EventType::Normal, "CRDsKept", note).await;
    }
}

/// A CRD goes with this install when stackd created it for this install's package (or before CRDs
/// recorded their package) and no stack uses it any more.
fn deletable(crd: &CustomResourceDefinition, labels: &BTreeMap<String, String>, installer: &Installer) -> bool {
    let created_here = match crd.annotations().get(PACKAGE_REPOSITORY_ANNOTATION) {
        Some(repository) => *repository == installer.repository,
        None => true,
    };
    labels.contains_key(MANAGED_CRD_LABEL)
        && created_here
        && !crd_is_referenced(labels)
        && crd.metadata.deletion_timestamp.is_none()
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use kube::api::ObjectMeta;

    use super::*;
    use crate::stacks::crd_parent_label;

    fn installer(repository: &str) -> Installer {
        Installer {
            kind: "StackInstall".into(),
            namespace: "team-a".into(),
            name: "sample".into(),
            repository: repository.into(),
        }
    }

    fn crd(labels: &[&str], repository: Option<&str>) -> CustomResourceDefinition {
        CustomResourceDefinition {
            metadata: ObjectMeta {
                name: Some("widgets.example.org".into()),
                labels: Some(labels.iter().map(|l| (l.to_string(), "true".to_string())).collect()),
                annotations: repository
                    .map(|r| BTreeMap::from([(PACKAGE_REPOSITORY_ANNOTATION.to_string(), r.to_string())])),
                ..ObjectMeta::default()
            },
            ..CustomResourceDefinition::default()
        }
    }

    #[test]
    fn the_install_s_own_label_is_dropped_unless_another_s_stack_shares_it() {
        let ours = crd_parent_label("team-a", "sample");
        let labelled = crd(&[MANAGED_CRD_LABEL, &ours], None);
        let unlabelled = crd(&[MANAGED_CRD_LABEL], None);
        let plan = crd_plan([&labelled, &unlabelled].into_iter(), &ours, true);
        assert_eq!(
            plan.iter().map(|step| step.unlabel).collect::<Vec<_>>(),
            [Some(ours.as_str()), None]
        );
        let plan = crd_plan([&labelled].into_iter(), &ours, false);
        assert_eq!(plan[0].unlabel, None, "a Stack not ours stands at our name");
    }

    #[test]
    fn a_crd_goes_only_when_stackd_made_it_for_this_package_and_no_stack_uses_it() {
        let package = installer("registry.example.org/sample");
        let unused = crd(&[MANAGED_CRD_LABEL], Some("registry.example.org/sample"));
        assert!(deletable(&unused, unused.labels(), &package));
        let from_before_packages_were_recorded = crd(&[MANAGED_CRD_LABEL], None);
        let labels = from_before_packages_were_recorded.labels();
        assert!(deletable(&from_before_packages_were_recorded, labels, &package));
        let another_package = crd(&[MANAGED_CRD_LABEL], Some("registry.example.org/other"));
        assert!(!deletable(&another_package, another_package.labels(), &package));
        let users = crd(&[MANAGED_CRD_LABEL, &crd_parent_label("team-b", "other")], None);
        assert!(!deletable(&users, users.labels(), &package));
        let not_stackd_s = crd(&[], None);
        assert!(!deletable(&not_stackd_s, not_stackd_s.labels(), &package));
        let mut going = crd(&[MANAGED_CRD_LABEL], None);
        going.metadata.deletion_timestamp = Some(Time(jiff::Timestamp::UNIX_EPOCH));
        assert!(!deletable(&going, going.labels(), &package));
    }
}
