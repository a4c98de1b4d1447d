//! Install deleted (DESIGN.md §3.4): delete the Stack and wait until it is gone → host Jobs and
//! pull-secret copies → CRDs no installed stack uses any more → finalizer.

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
use super::object::{Report, event, installer_of, own_crd_label, patch_finalizers};
use super::package::controlled_by;
use super::{InstallContext, InstallError, InstallKind, SAFETY_NET};
use crate::api::stacks::Stack;
use crate::host::Parent;
use crate::host::apply;
use crate::stacks::{INSTALL_FINALIZER, crd_is_referenced};

pub(super) async fn run<K: InstallKind>(
    install: &K,
    ctx: &InstallContext,
) -> Result<(Action, Option<Report>), InstallError> {
    if !install.finalizers().iter().any(|f| f == INSTALL_FINALIZER) {
        return Ok((Action::await_change(), None));
    }
    let tenant = &ctx.tenant;
    let namespace = install.namespace().unwrap_or_default();
    let name = install.name_any();
    let uid = install.meta().uid.clone().unwrap_or_default();

    // 1. The Stack first: its own finalizer takes its controller off the host.
    if let Some(stack) = ctx.stacks.get(&ObjectRef::new(&name).within(&namespace))
        && controlled_by(&stack, &uid)
    {
        if stack.metadata.deletion_timestamp.is_none() {
            let stacks: Api<Stack> = Api::namespaced(tenant.client.clone(), &namespace);
            let params = DeleteParams {
                preconditions: Some(Preconditions {
                    uid: stack.metadata.uid.clone(),
                    resource_version: None,
                }),
                ..DeleteParams::default()
            };
            match stacks.delete(&name, &params).await {
                Ok(_) => {
                    event(
                        install,
                        ctx,
                        EventType::Normal,
                        "Uninstalling",
                        format!("deleting Stack {name}"),
                    )
                    .await
                }
                Err(kube::Error::Api(status)) if matches!(status.code, 404 | 409) => {}
                Err(err) => return Err(InstallError::Tenant(err)),
            }
        }
        let report = Report {
            ready: (false, "Deleting", format!("waiting for Stack {name} to be removed")),
            synced: None,
            install_job: None,
            stack_ref: None,
        };
        // The Stack's deletion event wakes this install.
        return Ok((Action::requeue(SAFETY_NET), Some(report)));
    }

    // 2. Host Jobs (their pods go in the background) and the pull-secret copies.
    let parent = Parent::new(K::kind(&()).as_ref(), Some(&namespace), &name, &uid);
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
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: copy.metadata.uid.clone(),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        match secrets.delete(&copy.name_any(), &params).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if matches!(status.code, 404 | 409) => {}
            Err(err) => return Err(InstallError::HostApi(err)),
        }
    }

    // 3. CRDs: drop this stack's label (its Stack controller normally did) unless a Stack that is not
    //    ours stands at our name (it shares the label), then delete the CRDs of this install's package
    //    that no stack uses any more.
    let crds: Api<CustomResourceDefinition> = Api::all(tenant.client.clone());
    let label = own_crd_label(install);
    let installer = installer_of(install);
    let label_is_ours = ctx.stacks.get(&ObjectRef::new(&name).within(&namespace)).is_none();
    let (mut deleted, mut kept) = (Vec::new(), Vec::new());
    for crd in ctx.crds.state() {
        let mut labels = crd.labels().clone();
        let mut resource_version = crd.metadata.resource_version.clone();
        if label_is_ours && labels.contains_key(&label) {
            let patch = json!({"metadata": {"uid": crd.metadata.uid, "labels": {label.as_str(): null}}});
            match crds
                .patch(&crd.name_any(), &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(patched) => {
                    labels = patched.labels().clone();
                    resource_version = patched.metadata.resource_version.clone();
                }
                Err(kube::Error::Api(status)) if matches!(status.code, 404 | 409) => continue,
                Err(err) => return Err(InstallError::Tenant(err)),
            }
        }
        if deletable(&crd, &labels, &installer) {
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
                Ok(_) => deleted.push(crd.name_any()),
                Err(kube::Error::Api(status)) if status.code == 409 => kept.push(crd.name_any()),
                Err(kube::Error::Api(status)) if status.code == 404 => {}
                Err(err) => return Err(InstallError::Tenant(err)),
            }
        }
    }
    if !deleted.is_empty() {
        event(
            install,
            ctx,
            EventType::Normal,
            "CRDsDeleted",
            format!(
                "deleted CustomResourceDefinition(s) no stack uses any more: {}",
                deleted.join(", ")
            ),
        )
        .await;
    }
    if !kept.is_empty() {
        event(
            install,
            ctx,
            EventType::Normal,
            "CRDsKept",
            format!(
                "kept CustomResourceDefinition(s) that changed while this uninstall judged them (another stack may have started using them): {}",
                kept.join(", ")
            ),
        )
        .await;
    }

    // 4. Done: let the install go.
    let remaining: Vec<String> = install
        .finalizers()
        .iter()
        .filter(|f| *f != INSTALL_FINALIZER)
        .cloned()
        .collect();
    patch_finalizers(install, ctx, remaining).await?;
    Ok((Action::await_change(), None))
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
