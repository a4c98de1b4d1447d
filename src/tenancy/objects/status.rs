//! The status of Tenant objects, written by the replica serving each tenant: unsharded, the one
//! daemon (the leader); with `--shards`, the replica the shard map gives the tenant to alone. It says what
//! `/readyz?verbose` says of the tenant (`Ready`: Up, Degraded or Down with the root cause), which
//! replica serves it or why none does (`Served`), its host namespace, its API server's version and
//! its objects by readiness (from the tenant's caches, no extra request to it). Written by
//! server-side apply to `/status` when something changed and only then, with an Event on the Tenant
//! at every transition of a condition. A transition is written at once; other changes (counts the
//! tenant's users drive, a message) at most once per [`DETAIL_INTERVAL`] per Tenant.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Api, Client, Resource, ResourceExt};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::{Registration, TenantObjects};
use crate::api::tenancy::{Tenant, TenantStatus};
use crate::context::namespace_template::NamespaceTemplate;
use crate::runtime::cause::diagnose;
use crate::runtime::conditions::{DesiredCondition, set_condition};
use crate::runtime::deadline::sleep_until;
use crate::runtime::events::{event, log_unpublished};
use crate::runtime::health::{Health, TenantFacts, TenantHealth};
use crate::runtime::metrics::{ErrorLabels, Metrics};
use crate::runtime::reachability::Reachability;
use crate::runtime::shards::Board;
use crate::runtime::status_writer::apply_whole_status;
use crate::runtime::written::Written;

/// The field manager of Tenant status writes.
pub const FIELD_MANAGER: &str = "stackd/tenant";
/// The controller label of the writer's passes in the reconcile metrics.
pub const CONTROLLER: &str = "tenant-object";
/// A pass now and then even when nothing signalled: a safety net, as for every controller.
const SAFETY_PASS: Duration = Duration::from_secs(60);
/// After a failed write, the pass is made again this soon; the wait doubles with each pass that
/// fails again (a write the host refuses until an admin acts), up to [`SAFETY_PASS`].
const RETRY: Duration = Duration::from_secs(2);
/// A change that is no transition (counts, the server's version, a condition's message) is written
/// at most this often per Tenant: tenant users drive the counts, and the host pays for each write.
const DETAIL_INTERVAL: Duration = Duration::from_secs(10);

/// Which Tenants this replica writes the status of.
#[derive(Clone)]
pub enum Serving {
    /// Every Tenant: the one daemon, or the leader.
    All,
    /// The Tenants the shard map gives this replica and it runs.
    Shards { board: Arc<Board> },
}

impl Serving {
    /// Whether this replica serves the tenant.
    fn serves(&self, tenant: &str) -> bool {
        match self {
            Serving::All => true,
            Serving::Shards { board } => board.lock().serves(tenant, Instant::now()),
        }
    }
}

/// What the status is made of, besides the Tenant itself.
#[derive(Clone, Debug, PartialEq)]
pub struct Inputs {
    pub registration: Registration,
    /// The file of the tenants directory that defines this name too.
    pub conflict: Option<String>,
    pub health: Option<TenantHealth>,
    /// Why the daemon suspended the tenant (over its memory budget), while it is.
    pub suspension: Option<String>,
    pub facts: TenantFacts,
    pub host_namespace: Option<String>,
    /// This replica's identity.
    pub replica: String,
}

impl Inputs {
    /// Nothing new to say yet: its Secret is not read (never written: it takes a moment), or its
    /// server not reached, since this replica began serving it. A Tenant with a status keeps it
    /// meanwhile (a restarted daemon does not flash every Tenant through Starting); a new one is
    /// told it is starting.
    fn is_undecided(&self) -> bool {
        self.conflict.is_none()
            && self.suspension.is_none()
            && match self.registration {
                Registration::Pending => true,
                Registration::Accepted { .. } => matches!(self.health, None | Some(TenantHealth::Starting)),
                Registration::Suspended | Registration::Refused(_) => false,
            }
    }
}

struct Said {
    status: bool,
    reason: String,
    message: String,
}

impl Said {
    fn new(status: bool, reason: &str, message: impl Into<String>) -> Said {
        Said {
            status,
            reason: reason.to_string(),
            message: message.into(),
        }
    }
}

/// `Served`: which replica serves the tenant, or why none does.
fn served(name: &str, inputs: &Inputs) -> Said {
    if let Some(file) = &inputs.conflict {
        return Said::new(
            false,
            "NameConflict",
            format!(
                "tenant {name} is also defined by {file} in the tenants directory (--tenants-dir); a name in both is refused, and this Tenant is not served while the file exists: delete one"
            ),
        );
    }
    match &inputs.registration {
        Registration::Pending => Said::new(
            false,
            "Pending",
            "waiting for the Secrets of its namespace to be listed",
        ),
        Registration::Suspended => Said::new(
            false,
            "Suspended",
            "spec.suspend is true: the tenant's controllers are stopped and its host objects kept",
        ),
        Registration::Refused(refusal) => Said::new(false, refusal.reason, refusal.message.clone()),
        Registration::Accepted { kept } => {
            let by = format!("served by replica {}", inputs.replica);
            match kept {
                None => Said::new(true, "Served", by),
                Some(refusal) => Said::new(
                    true,
                    "ServedWithPreviousKubeconfig",
                    format!("{by}, on its previous kubeconfig: {}", refusal.message),
                ),
            }
        }
    }
}

/// `Ready`: what `/readyz?verbose` says of a served tenant; for one not served, why not.
fn ready(served: &Said, health: Option<&TenantHealth>, suspension: Option<&str>) -> Said {
    if !served.status {
        return Said::new(false, &served.reason, format!("not served: {}", served.message));
    }
    if let Some(why) = suspension {
        return Said::new(false, "OverMemoryBudget", format!("suspended by the daemon: {why}"));
    }
    match health {
        None | Some(TenantHealth::Starting) => Said::new(
            false,
            "Starting",
            "connecting to the tenant API server and starting its controllers",
        ),
        Some(TenantHealth::Up) => Said::new(
            true,
            "Up",
            "the tenant API server answers, serves stackd's CRDs, and every controller has started",
        ),
        Some(TenantHealth::Degraded(why)) => Said::new(true, "Degraded", why.clone()),
        Some(TenantHealth::Down(why)) => {
            Said::new(false, "Down", format!("the tenant API server does not answer: {why}"))
        }
        Some(TenantHealth::Invalid(why)) => Said::new(false, "Invalid", why.clone()),
    }
}

/// The status `tenant` should have, from `current` (its conditions' transition times kept).
pub fn desired(tenant: &Tenant, current: &TenantStatus, inputs: &Inputs, now: Time) -> TenantStatus {
    let name = tenant.name_any();
    let generation = tenant.meta().generation;
    let served = served(&name, inputs);
    let ready = ready(&served, inputs.health.as_ref(), inputs.suspension.as_deref());
    let mut status = current.clone();
    for (type_, said) in [("Ready", &ready), ("Served", &served)] {
        let condition = DesiredCondition {
            type_,
            status: said.status,
            reason: &said.reason,
            message: said.message.clone(),
            observed_generation: generation,
        };
        set_condition(&mut status.conditions, condition, now.clone());
    }
    status.observed_generation = generation;
    status.host_namespace.clone_from(&inputs.host_namespace);
    let facts = served.status.then_some(&inputs.facts);
    status.served_by = served.status.then(|| inputs.replica.clone());
    status.server_version = facts.and_then(|f| f.server_version.clone());
    let counts = facts.and_then(|f| f.counts);
    status.installs = counts.map(|c| c.installs);
    status.stacks = counts.map(|c| c.stacks);
    status.pools = counts.map(|c| c.pools);
    status
}

/// The Events of going from `before` to `after`: one per condition whose status or reason changed.
pub fn transitions(before: &TenantStatus, after: &TenantStatus) -> Vec<Event> {
    after
        .conditions
        .iter()
        .filter(|condition| {
            !before.conditions.iter().any(|old| {
                old.type_ == condition.type_ && old.status == condition.status && old.reason == condition.reason
            })
        })
        .map(|condition| {
            let type_ = if condition.status == "True" {
                EventType::Normal
            } else {
                EventType::Warning
            };
            let note = format!("{}: {}", condition.type_, condition.message);
            event(type_, &condition.reason, &condition.type_, note)
        })
        .collect()
}

/// Writes the status of the Tenants this replica serves.
pub struct StatusWriter {
    pub host: Client,
    /// Whose probe tells a failure to reach the host (none: each Tenant's failed write is told).
    pub host_reachability: Option<Arc<Reachability>>,
    pub view: Arc<TenantObjects>,
    pub health: Arc<Health>,
    pub metrics: Arc<Metrics>,
    pub template: NamespaceTemplate,
    pub replica: String,
    pub serving: Serving,
}

impl StatusWriter {
    /// Passes over the Tenants whenever a tenant's state or a Tenant changes, until `cancel`.
    pub async fn run(self, cancel: CancellationToken) {
        let recorder = Recorder::new(
            self.host.clone(),
            Reporter {
                controller: "stackd".into(),
                instance: Some(self.replica.clone()),
            },
        );
        let written = Written::<TenantStatus>::default();
        let (mut health, mut objects) = (self.health.changes(), self.view.changes());
        let mut retry_in = RETRY;
        let mut writes = TenantWrites::default();
        // The first pass is made at once: the Tenants and their health may have settled before
        // this writer subscribed (the leader starts it after the Tenant source), and no change
        // would come to ask for it.
        loop {
            health.borrow_and_update();
            objects.borrow_and_update();
            // A replica that may no longer act (its lease is running out) stops mid-pass.
            let pass = tokio::select! {
                _ = cancel.cancelled() => return,
                pass = self.pass(&written, &recorder, &mut writes) => pass,
            };
            let mut retry_at = None;
            if pass.failed {
                retry_at = Some(Instant::now() + retry_in);
                retry_in = (retry_in * 2).min(SAFETY_PASS);
            } else {
                retry_in = RETRY;
            }
            let retry_at = retry_at.into_iter().chain(pass.deferred).min();
            let safety = tokio::time::sleep(SAFETY_PASS);
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = health.changed() => {}
                _ = objects.changed() => {}
                _ = sleep_until(retry_at) => {}
                _ = safety => {}
            }
        }
    }

    /// One look at every Tenant this replica serves.
    async fn pass(&self, written: &Written<TenantStatus>, recorder: &Recorder, writes: &mut TenantWrites) -> Pass {
        let api: Api<Tenant> = Api::all(self.host.clone());
        let (mut failed, mut deferred) = (false, None);
        let (mut present, mut names) = (BTreeSet::new(), BTreeSet::new());
        for tenant in self.view.store().state() {
            let name = tenant.name_any();
            let uid = tenant.uid().unwrap_or_default();
            present.insert(uid.clone());
            names.insert(name.clone());
            if !self.serving.serves(&name) {
                continue;
            }
            let started = Instant::now();
            let labels = Metrics::controller(&name, CONTROLLER);
            let cached = tenant.status.clone().unwrap_or_default();
            let current = written.current(&uid, tenant.resource_version().as_deref(), cached);
            let inputs = self.inputs(&name);
            let status = desired(&tenant, &current, &inputs, Time(Timestamp::now()));
            let pending = inputs.registration == Registration::Pending && inputs.conflict.is_none();
            let holds = pending || (inputs.is_undecided() && tenant.status.is_some());
            let changed = status != current && !holds;
            let due = changed.then(|| writes.held_until(&name, &current, &status)).flatten();
            if due.is_some() {
                deferred = deferred.into_iter().chain(due).min();
            } else if changed {
                // Tenant is a kind no earlier stackd wrote: nothing to take over, and the chart
                // grants the daemon only the status subresource of Tenants.
                match apply_whole_status(&api, &name, FIELD_MANAGER, &status, None).await {
                    Ok(stored) => {
                        writes.wrote(&name);
                        written.record(&uid, stored.resource_version(), status.clone());
                        self.publish(recorder, &tenant, &current, &status).await;
                    }
                    Err(err) => {
                        failed = true;
                        let cause = diagnose(&err);
                        self.count_failure(&name, &cause);
                        let host_away = cause.kind.is_outage()
                            && self.host_reachability.as_ref().is_some_and(|host| host.in_doubt());
                        if host_away {
                            debug!(tenant = %name, %cause, "the Tenant's status waits for the host");
                        } else {
                            writes.failed(&name, &cause.message);
                        }
                    }
                }
            }
            self.metrics.reconciles.get_or_create(&labels).inc();
            self.metrics
                .reconcile_duration
                .get_or_create(&labels)
                .observe(started.elapsed().as_secs_f64());
        }
        written.retain(|uid| present.contains(uid));
        writes.retain(|name| names.contains(name));
        Pass { failed, deferred }
    }

    fn count_failure(&self, tenant: &str, cause: &crate::runtime::cause::Cause) {
        let labels = Metrics::controller(tenant, CONTROLLER);
        self.metrics.reconcile_errors.get_or_create(&labels).inc();
        let by_kind = ErrorLabels {
            tenant: tenant.to_string(),
            controller: CONTROLLER.to_string(),
            kind: cause.kind.label().to_string(),
        };
        self.metrics.reconcile_errors_by_kind.get_or_create(&by_kind).inc();
    }

    fn inputs(&self, name: &str) -> Inputs {
        Inputs {
            registration: self.view.registration(name),
            conflict: self.view.conflict(name),
            health: self.health.tenant(name),
            suspension: self.health.suspension(name),
            facts: self.health.tenant_facts(name),
            host_namespace: self.template.namespace_for(name).ok(),
            replica: self.replica.clone(),
        }
    }

    async fn publish(&self, recorder: &Recorder, tenant: &Tenant, before: &TenantStatus, after: &TenantStatus) {
        let reference = tenant.object_ref(&());
        for event in transitions(before, after) {
            if let Err(err) = recorder.publish(&event, &reference).await {
                log_unpublished(&err);
            }
        }
    }
}

/// What a pass came to.
struct Pass {
    /// A write failed: the next pass is a retry.
    failed: bool,
    /// A change held back by [`DETAIL_INTERVAL`] may be written then.
    deferred: Option<Instant>,
}

/// Per Tenant: when its status was last written, and the cause last logged while its writes fail
/// (a warning when the cause is new, not at every retry).
#[derive(Default)]
struct TenantWrites {
    last_written: BTreeMap<String, Instant>,
    failing: BTreeMap<String, String>,
}

impl TenantWrites {
    /// When a change from `current` to `status` that is no transition may be written, if not now.
    fn held_until(&self, tenant: &str, current: &TenantStatus, status: &TenantStatus) -> Option<Instant> {
        let due = *self.last_written.get(tenant)? + DETAIL_INTERVAL;
        (due > Instant::now() && transitions(current, status).is_empty()).then_some(due)
    }

    fn failed(&mut self, tenant: &str, cause: &str) {
        if self.failing.get(tenant).is_some_and(|logged| logged == cause) {
            debug!(tenant, cause, "the Tenant's status still cannot be written");
            return;
        }
        warn!(
            tenant,
            cause, "cannot write the Tenant's status; retrying, ever more slowly"
        );
        self.failing.insert(tenant.to_string(), cause.to_string());
    }

    fn wrote(&mut self, tenant: &str) {
        self.last_written.insert(tenant.to_string(), Instant::now());
        if self.failing.remove(tenant).is_some() {
            info!(tenant, "the Tenant's status is written again");
        }
    }

    fn retain(&mut self, keep: impl Fn(&str) -> bool) {
        self.last_written.retain(|tenant, _| keep(tenant));
        self.failing.retain(|tenant, _| keep(tenant));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::tenancy::{KubeconfigSecretRef, ReadinessCount, TenantSpec};
    use crate::runtime::health::ObjectCounts;
    use crate::tenancy::objects::kubeconfig::Refusal;

    fn tenant() -> Tenant {
        let mut tenant = Tenant::new(
            "acme",
            TenantSpec {
                kubeconfig_secret_ref: KubeconfigSecretRef {
                    namespace: "stackd-system".into(),
                    name: "vc-acme".into(),
                    key: "config".into(),
                },
                ..Default::default()
            },
        );
        tenant.metadata.generation = Some(3);
        tenant
    }

    fn inputs(registration: Registration, health: Option<TenantHealth>) -> Inputs {
        Inputs {
            registration,
            conflict: None,
            health,
            suspension: None,
            facts: TenantFacts {
                server_version: Some("v1.30.2".into()),
                counts: Some(ObjectCounts {
                    installs: ReadinessCount { ready: 2, not_ready: 1 },
                    ..Default::default()
                }),
            },
            host_namespace: Some("tenant-acme-controllers".into()),
            replica: "stackd-0-42".into(),
        }
    }

    fn time(seconds: i64) -> Time {
        Time(Timestamp::from_second(seconds).unwrap_or_default())
    }

    fn condition<'a>(status: &'a TenantStatus, type_: &str) -> (&'a str, &'a str, &'a str) {
        let c = status.conditions.iter().find(|c| c.type_ == type_).expect("condition");
        (c.status.as_str(), c.reason.as_str(), c.message.as_str())
    }

    #[test]
    fn a_served_tenant_that_answers_is_ready_with_its_replica_version_and_counts() {
        let accepted = Registration::Accepted { kept: None };
        let status = desired(
            &tenant(),
            &TenantStatus::default(),
            &inputs(accepted, Some(TenantHealth::Up)),
            time(1),
        );
        assert_eq!(condition(&status, "Ready").0, "True");
        assert_eq!(condition(&status, "Ready").1, "Up");
        assert_eq!(condition(&status, "Served").2, "served by replica stackd-0-42");
        assert_eq!(status.served_by.as_deref(), Some("stackd-0-42"));
        assert_eq!(status.server_version.as_deref(), Some("v1.30.2"));
        assert_eq!(status.installs, Some(ReadinessCount { ready: 2, not_ready: 1 }));
        assert_eq!(status.observed_generation, Some(3));
    }

    #[test]
    fn a_tenant_down_says_the_root_cause_and_an_unchanged_one_is_the_same_status() {
        let down = inputs(
            Registration::Accepted { kept: None },
            Some(TenantHealth::Down("connection refused".into())),
        );
        let status = desired(&tenant(), &TenantStatus::default(), &down, time(1));
        assert_eq!(
            condition(&status, "Ready"),
            (
                "False",
                "Down",
                "the tenant API server does not answer: connection refused"
            )
        );
        let again = desired(&tenant(), &status, &down, time(2));
        assert_eq!(again, status, "nothing changed: nothing to write");
        assert!(transitions(&status, &again).is_empty());
        let events = transitions(&TenantStatus::default(), &status);
        let reasons: Vec<&str> = events.iter().map(|e| e.reason.as_str()).collect();
        assert_eq!(reasons, ["Down", "Served"]);
    }

    #[test]
    fn a_tenant_not_served_says_why_in_both_conditions_and_shows_no_replica() {
        let refused = Registration::Refused(Refusal::new(
            "SecretNamespaceNotAllowed",
            "Secret kube-system/x is elsewhere",
        ));
        let status = desired(&tenant(), &TenantStatus::default(), &inputs(refused, None), time(1));
        assert_eq!(condition(&status, "Served").1, "SecretNamespaceNotAllowed");
        assert_eq!(condition(&status, "Ready").1, "SecretNamespaceNotAllowed");
        assert!(condition(&status, "Ready").2.starts_with("not served: "));
        assert_eq!(status.served_by, None);
        assert_eq!(status.server_version, None);
        assert_eq!(status.host_namespace.as_deref(), Some("tenant-acme-controllers"));
        let mut conflict = inputs(Registration::Accepted { kept: None }, Some(TenantHealth::Up));
        conflict.conflict = Some("file /tenants/acme.yaml".into());
        let status = desired(&tenant(), &TenantStatus::default(), &conflict, time(1));
        assert_eq!(condition(&status, "Served").1, "NameConflict");
        assert!(condition(&status, "Served").2.contains("/tenants/acme.yaml"));
    }

    #[test]
    fn a_tenant_not_yet_read_or_reached_is_undecided_unless_refused_or_in_conflict() {
        let accepted = || Registration::Accepted { kept: None };
        assert!(inputs(Registration::Pending, None).is_undecided());
        assert!(inputs(accepted(), Some(TenantHealth::Starting)).is_undecided());
        assert!(!inputs(accepted(), Some(TenantHealth::Up)).is_undecided());
        assert!(!inputs(Registration::Suspended, None).is_undecided());
        let mut conflict = inputs(accepted(), None);
        conflict.conflict = Some("file /tenants/acme.yaml".into());
        assert!(!conflict.is_undecided());
    }

    #[test]
    fn a_tenant_suspended_over_its_memory_budget_is_not_ready_and_says_why() {
        let mut over = inputs(Registration::Accepted { kept: None }, Some(TenantHealth::Up));
        over.suspension = Some("cached 9 MiB, over its budget of 8 MiB".into());
        let status = desired(&tenant(), &TenantStatus::default(), &over, time(1));
        let (state, reason, message) = condition(&status, "Ready");
        assert_eq!((state, reason), ("False", "OverMemoryBudget"));
        assert!(message.contains("over its budget of 8 MiB"), "{message}");
        assert_eq!(condition(&status, "Served").0, "True");
        assert!(!over.is_undecided());
    }

    #[test]
    fn a_served_tenant_names_its_replica_and_a_kept_kubeconfig_is_told() {
        let kept = Registration::Accepted {
            kept: Some(Refusal::new("InvalidKubeconfig", "Secret x: line 3")),
        };
        let served = inputs(kept, Some(TenantHealth::Up));
        let status = desired(&tenant(), &TenantStatus::default(), &served, time(1));
        let (state, reason, message) = condition(&status, "Served");
        assert_eq!((state, reason), ("True", "ServedWithPreviousKubeconfig"));
        assert!(
            message.contains(&format!("served by replica {}", served.replica)) && message.contains("line 3"),
            "{message}"
        );
    }
}
