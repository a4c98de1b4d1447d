//! Whether an install may make anything on the host at all (DESIGN.md §8), decided before its Job:
//! its package must come from a registry the host allows (`--allowed-registries`); a StackInstall and
//! a ClusterStackInstall of one namespace and name would install one Stack, so the first holds the
//! name; and its namespace may hold only so many installs (`--namespace-max-installs`), so that one
//! namespace cannot fill the quota and Job slots every namespace of the tenant shares.
//!
//! The installs of a namespace, StackInstalls and ClusterStackInstalls alike, are ranked by creation
//! (then uid): the newest past the bound are refused. One that has started (it has an install Job or a
//! Stack) keeps its place, so a later install never stops an earlier one; one being deleted frees its
//! place, and its deletion wakes the refused ones. One admitted holds its place from that moment
//! ([`Admitted`]), not from when the cache shows it started: installs made within one second tie on
//! creation time and are then ranked by uid, which is not the order they arrive in, so without it
//! two judged close together could both take the last place.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use kube::ResourceExt;
use kube::runtime::reflector::{ObjectRef, Store};

use super::object::Report;
use super::{InstallContext, InstallKind};
use crate::api::stacks::{ClusterStackInstall, StackInstall, StackInstallStatus};

/// The `Ready` reason of an install refused for its namespace's bound.
pub(super) const TOO_MANY_INSTALLS: &str = "TooManyInstalls";
/// The `Ready` reason of an install whose name (its Stack's, its host objects') the other kind holds.
const NAME_TAKEN: &str = "HostObjectConflict";

/// Why the install may make nothing on the host, if it may not. An install not refused is admitted:
/// it holds its place (its name, a place under the bound) from now on.
pub(super) fn refusal<K: InstallKind>(install: &K, ctx: &InstallContext, package: &str) -> Option<Report> {
    let registries = &ctx.tenant.shared.settings.allowed_registries;
    let namespace = install.namespace().unwrap_or_default();
    let uid = install.uid().unwrap_or_default();
    if let Some(message) = registries.refusal("the package image", package) {
        // Edited to a package it may not install: what it was admitted for no longer holds.
        ctx.admitted.forget(&namespace, &uid);
        return Some(Report::failed("RegistryNotAllowed", message));
    }
    let mut admitted = ctx.admitted.lock();
    let places = admitted.entry(namespace.clone()).or_default();
    // An admitted install the cache shows started, or that is going, needs no record.
    if !places.is_empty() {
        let mut waiting_now = waiting(&ctx.stack_installs, &namespace);
        waiting_now.extend(waiting(&ctx.cluster_stack_installs, &namespace));
        places.retain(|uid| waiting_now.contains(uid));
    }
    // The reconcile's copy may predate the echo of its own status write, which the cache shows and
    // for which the ledger has just forgotten it: both are asked (the cache, read after the
    // ledger's pruning, can only show more started, never less).
    let shown_started = started(install.install_status()) || started_in_cache(install, ctx);
    let others = Others {
        stack_installs: &ctx.stack_installs,
        cluster_stack_installs: &ctx.cluster_stack_installs,
        admitted: places,
        judged_started: shown_started,
    };
    let refused = others
        .holding_the_name(install, ctx)
        .or_else(|| others.past_the_bound(install, ctx));
    tracing::debug!(
        kind = %K::kind(&()),
        namespace,
        name = install.name_any(),
        refused = refused.as_ref().map(|report| report.ready.1),
        admitted = ?places,
        "install judged"
    );
    if refused.is_none() && !shown_started {
        places.insert(uid);
    }
    if places.is_empty() {
        admitted.remove(&namespace);
    }
    refused
}

/// The installs this replica admitted and whose start its cache does not show yet, by namespace
/// (uids): they hold their places. Shared by the StackInstall and ClusterStackInstall controllers
/// of a tenant, whose installs share the bound.
#[derive(Default)]
pub(crate) struct Admitted {
    by_namespace: Mutex<HashMap<String, HashSet<String>>>,
}

impl Admitted {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, HashSet<String>>> {
        self.by_namespace
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Forgets an install being deleted: its place is free.
    pub(super) fn forget(&self, namespace: &str, uid: &str) {
        let mut admitted = self.lock();
        if let Some(places) = admitted.get_mut(namespace) {
            places.remove(uid);
            if places.is_empty() {
                admitted.remove(namespace);
            }
        }
    }
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

/// The caches of both install kinds, and the installs of the namespace judged admitted.
struct Others<'a> {
    stack_installs: &'a Store<StackInstall>,
    cluster_stack_installs: &'a Store<ClusterStackInstall>,
    admitted: &'a HashSet<String>,
    /// Whether the install judged is shown started, by its copy or by the cache.
    judged_started: bool,
}

impl Others<'_> {
    /// The refusal of `install` when the install of the other kind at its namespace and name holds
    /// the name: it started and this one did not, or neither did and it is older.
    fn holding_the_name<K: InstallKind>(&self, install: &K, ctx: &InstallContext) -> Option<Report> {
        let (namespace, name) = (install.namespace().unwrap_or_default(), install.name_any());
        let (kind, other_uid, other_started, other_rank) = standing(K::Other::cache(ctx), &namespace, &name)?;
        let other_started = other_started || self.admitted.contains(&other_uid);
        let own_started = self.holds_place(install);
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

    /// The refusal of `install` when its namespace holds `--namespace-max-installs` installs
    /// before it.
    fn past_the_bound<K: InstallKind>(&self, install: &K, ctx: &InstallContext) -> Option<Report> {
        let max = ctx.tenant.shared.settings.stack_limits.namespace_max_installs;
        if max == 0 || self.holds_place(install) {
            return None;
        }
        let namespace = install.namespace().unwrap_or_default();
        let own = rank(install);
        let ahead = count_ahead(self.stack_installs, &namespace, &own, self.admitted)
            + count_ahead(self.cluster_stack_installs, &namespace, &own, self.admitted);
        (ahead >= max).then(|| {
            Report::failed(
                TOO_MANY_INSTALLS,
                format!(
                    "namespace {namespace} already has {ahead} StackInstalls and ClusterStackInstalls, the most one namespace may have (--namespace-max-installs {max}); this install creates nothing until one of them is deleted, or the host's operators raise the bound"
                ),
            )
        })
    }

    /// Started, as the cache shows, or admitted by this replica since.
    fn holds_place<K: InstallKind>(&self, install: &K) -> bool {
        self.judged_started || self.admitted.contains(&install.uid().unwrap_or_default())
    }
}

/// Whether the cache's copy of `install` (the same uid) shows it started.
fn started_in_cache<K: InstallKind>(install: &K, ctx: &InstallContext) -> bool {
    let (namespace, name) = (install.namespace().unwrap_or_default(), install.name_any());
    let uid = install.uid();
    K::cache(ctx)
        .get(&ObjectRef::new(&name).within(&namespace))
        .is_some_and(|cached| cached.uid() == uid && started(cached.install_status()))
}

/// The uids of the installs of `namespace` that are cached, not being deleted and not shown started.
fn waiting<K: InstallKind>(installs: &Store<K>, namespace: &str) -> HashSet<String> {
    installs
        .state()
        .iter()
        .filter(|install| install.namespace().as_deref() == Some(namespace))
        .filter(|install| install.meta().deletion_timestamp.is_none() && !started(install.install_status()))
        .filter_map(|install| install.uid())
        .collect()
}

/// The install of kind `K` at `namespace`/`name`, unless it is being deleted: its kind, uid,
/// whether the cache shows it started, its rank.
fn standing<K: InstallKind>(installs: &Store<K>, namespace: &str, name: &str) -> Option<(String, String, bool, Rank)> {
    let install = installs.get(&ObjectRef::new(name).within(namespace))?;
    (install.meta().deletion_timestamp.is_none()).then(|| {
        (
            K::kind(&()).into_owned(),
            install.uid().unwrap_or_default(),
            started(install.install_status()),
            rank(install.as_ref()),
        )
    })
}

fn count_ahead<K: InstallKind>(installs: &Store<K>, namespace: &str, own: &Rank, admitted: &HashSet<String>) -> usize {
    installs
        .state()
        .iter()
        .filter(|install| install.namespace().as_deref() == Some(namespace))
        .filter(|install| install.meta().deletion_timestamp.is_none())
        .filter(|install| rank(install.as_ref()) != *own)
        .filter(|install| {
            rank(install.as_ref()) < *own
                || started(install.install_status())
                || admitted.contains(&install.uid().unwrap_or_default())
        })
        .count()
}
