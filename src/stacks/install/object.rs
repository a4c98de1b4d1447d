//! The install object itself, as `reconcile` and `uninstall` both use it: who it is (its installer
//! and its Stack's CRD label), its identity as a host parent, its Events, and what a reconcile reports for its status.

use kube::ResourceExt;
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;

use super::crd_policy::{Installer, repository_of};
use super::job;
use super::{InstallContext, InstallKind};
use crate::api::common::HostObjectRef;
use crate::host::Parent;
use crate::runtime::events;
use crate::stacks::crd_parent_label;

/// What one reconcile of an install comes to: when to look at it again, and the report for its
/// status (none: the status stays as it is).
pub(super) type Reconciled = (Action, Option<Report>);

/// What a reconcile found, to be written to the install's status (only when it changed).
#[derive(Debug, PartialEq)]
pub(super) struct Report {
    pub ready: (bool, &'static str, String),
    pub synced: Option<(bool, &'static str, String)>,
    pub install_job: Option<HostObjectRef>,
    pub stack_ref: Option<String>,
}

impl Report {
    pub(super) fn waiting(reason: &'static str, message: String) -> Report {
        Report {
            ready: (false, reason, message),
            synced: None,
            install_job: None,
            stack_ref: None,
        }
    }

    pub(super) fn failed(reason: &'static str, message: String) -> Report {
        Report {
            synced: Some((false, reason, message.clone())),
            ..Report::waiting(reason, message)
        }
    }
}

/// Who the install is, and which package's CRDs it may write.
pub(super) fn installer_of<K: InstallKind>(install: &K) -> Installer {
    Installer {
        kind: K::kind(&()).into_owned(),
        namespace: install.namespace().unwrap_or_default(),
        name: install.name_any(),
        repository: repository_of(&job::package_image(install.install())),
    }
}

/// The install as the parent of its host objects.
pub(super) fn parent_of<K: InstallKind>(install: &K) -> Parent {
    Parent::new(
        K::kind(&()).as_ref(),
        install.namespace().as_deref(),
        &install.name_any(),
        install.meta().uid.as_deref().unwrap_or_default(),
    )
}

/// Publishes an Event on the install; a failure to publish is logged, never fatal.
pub(super) async fn event<K: InstallKind>(
    install: &K,
    ctx: &InstallContext,
    type_: EventType,
    reason: &str,
    note: String,
) {
    let event = events::event(type_, reason, "Install", note);
    if let Err(err) = ctx.tenant.recorder.publish(&event, &install.object_ref(&())).await {
        events::log_unpublished(&err);
    }
}

/// The CRD label of this install's Stack.
pub(super) fn own_crd_label<K: InstallKind>(install: &K) -> String {
    crd_parent_label(&install.namespace().unwrap_or_default(), &install.name_any())
}
