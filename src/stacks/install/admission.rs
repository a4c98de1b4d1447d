//! Whether an install may make anything on the host at all (DESIGN.md §8), decided before its Job:
//! its package must come from a registry the host allows (`--allowed-registries`); a StackInstall and
//! a ClusterStackInstall of one namespace and name would install one Stack, so the first holds the
//! name; and its namespace may hold only so many installs (`--namespace-max-installs`), so that one
//! namespace cannot fill the quota and Job slots every namespace of the tenant shares.
//!
//! The installs of a namespace, StackInstalls and ClusterStackInstalls alike, are ranked by creation
//! (then uid): the newest past the bound are refused. One that has started (it has an install Job or a
//! Stack) keeps its place, so a later install never stops an earlier one; one being deleted frees its
//! place, and its deletion wakes the refused ones.

use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Resource, ResourceExt};

use super::object::Report;
use super::{InstallContext, InstallKind};
use crate::api::stacks::{ClusterStackInstall, StackInstall, StackInstallStatus};

/// The `Ready` reason of an install refused for its namespace's bound.
pub(super) const TOO_MANY_INSTALLS: &str = "TooManyInstalls";
/// The `Ready` reason of an install whose name (its Stack's, its host objects') the other kind holds.
const NAME_TAKEN: &str = "HostObjectConflict";

/// Why the install may make nothing on the host, if it may not.
pub(super) fn refusal<K: InstallKind>(install: &K, ctx: &InstallContext, package: &str) -> Option<Report> {
    let registries = &ctx.tenant.shared.settings.allowed_registries;
    if let Some(message) = registries.refusal("the package image", package) {
        return Some(Report::failed("RegistryNotAllowed", message));
    }
    let others = Others {
        stack_installs: &ctx.stack_installs,
        cluster_stack_installs: &ctx.cluster_stack_installs,
    };
    if let Some(report) = others.holding_the_name(install, ctx) {
        return Some(report);
    }
    let max = ctx.tenant.shared.settings.stack_limits.namespace_max_installs;
    let namespace = install.namespace().unwrap_or_default();
    if max == 0 || started(install.install_status()) {
        return None;
    }
    let ahead = others.ahead_of(&namespace, &rank(install));
    (ahead >= max).then(|| {
        Report::failed(
            TOO_MANY_INSTALLS,
            format!(
                "namespace {namespace} already has {ahead} StackInstalls and ClusterStackInstalls, the most one namespace may have (--namespace-max-installs {max}); this install creates nothing until one of them is deleted, or the host's operators raise the bound"
            ),
        )
    })
}

/// The installs of a namespace whose refusal for the bound a change of `changed` may lift: its
/// deletion (begun, or done: gone from the cache) frees a place.
pub(super) fn refused_in_namespace_of<K, O>(installs: &Store<K>, others: &Store<O>, changed: &O) -> Vec<ObjectRef<K>>
where
    K: InstallKind,
    O: InstallKind,
{
    let gone = others.get(&ObjectRef::from_obj(changed)).is_none();
    if changed.meta().deletion_timestamp.is_none() && !gone {
        return Vec::new();
    }
    let namespace = changed.namespace();
    installs
        .state()
        .iter()
        .filter(|install| install.namespace() == namespace && refused(install.install_status()))
        .map(|install| ObjectRef::from_obj(install.as_ref()))
        .collect()
}

/// Refused for the namespace's bound, or for a name another install holds (whose going frees it).
fn refused(status: Option<&StackInstallStatus>) -> bool {
    status.is_some_and(|status| {
        status.conditions.iter().any(|c| {
            c.type_ == "Ready" && c.status == "False" && [TOO_MANY_INSTALLS, NAME_TAKEN].contains(&c.reason.as_str())
        })
    })
}

/// An install that has made something already: an install Job or a Stack.
fn started(status: Option<&StackInstallStatus>) -> bool {
    status.is_some_and(|status| status.install_job.is_some() || status.stack_ref.is_some())
}

/// The order installs of a namespace are admitted in: creation time, then uid.
type Rank = (Option<jiff::Timestamp>, String);

fn rank<K: InstallKind>(install: &K) -> Rank {
    (
        install.meta().creation_timestamp.as_ref().map(|t| t.0),
        install.uid().unwrap_or_default(),
    )
}

/// The caches of both install kinds.
struct Others<'a> {
    stack_installs: &'a Store<StackInstall>,
    cluster_stack_installs: &'a Store<ClusterStackInstall>,
}

impl Others<'_> {
    /// The refusal of `install` when the install of the other kind at its namespace and name holds
    /// the name: it started and this one did not, or neither did and it is older.
    fn holding_the_name<K: InstallKind>(&self, install: &K, ctx: &InstallContext) -> Option<Report> {
        let (namespace, name) = (install.namespace().unwrap_or_default(), install.name_any());
        let other = if K::kind(&()) == StackInstall::kind(&()) {
            standing(self.cluster_stack_installs, &namespace, &name)
        } else {
            standing(self.stack_installs, &namespace, &name)
        };
        let (kind, other_started, other_rank) = other?;
        let own_started = started(install.install_status());
        let holds = (other_started && !own_started) || (other_started == own_started && other_rank < rank(install));
        holds.then(|| {
            let job = super::job::job_name(&namespace, &name);
            Report::failed(
                NAME_TAKEN,
                format!(
                    "the {kind} {namespace}/{name} already installs a stack named {name} here; a StackInstall and a ClusterStackInstall of the same name in one namespace would share one Stack (and the install Job {}/{job}): delete one of them or install under another name",
                    ctx.tenant.host_namespace
                ),
            )
        })
    }

    /// The installs of `namespace`, not being deleted, that hold a place before one of rank `rank`:
    /// older ones, and started ones whatever their age.
    fn ahead_of(&self, namespace: &str, rank: &Rank) -> usize {
        count_ahead(self.stack_installs, namespace, rank) + count_ahead(self.cluster_stack_installs, namespace, rank)
    }
}

/// The install of kind `K` at `namespace`/`name`, unless it is being deleted: its kind, whether it
/// started, its rank.
fn standing<K: InstallKind>(installs: &Store<K>, namespace: &str, name: &str) -> Option<(String, bool, Rank)> {
    let install = installs.get(&ObjectRef::new(name).within(namespace))?;
    (install.meta().deletion_timestamp.is_none()).then(|| {
        (
            K::kind(&()).into_owned(),
            started(install.install_status()),
            rank(install.as_ref()),
        )
    })
}

fn count_ahead<K: InstallKind>(installs: &Store<K>, namespace: &str, own: &Rank) -> usize {
    installs
        .state()
        .iter()
        .filter(|install| install.namespace().as_deref() == Some(namespace))
        .filter(|install| install.meta().deletion_timestamp.is_none())
        .filter(|install| rank(install.as_ref()) != *own)
        .filter(|install| rank(install.as_ref()) < *own || started(install.install_status()))
        .count()
}
