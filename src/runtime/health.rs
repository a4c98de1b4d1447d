//! Liveness and readiness, with a line of detail per tenant, and what each tenant's run found
//! (its API server's version, its objects by readiness) for its Tenant object's status. Every change
//! of a tenant's state is signalled ([`Health::changes`]): the Tenant status writer waits on it.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::watch;

use crate::api::tenancy::ReadinessCount;

/// What is known about one tenant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TenantHealth {
    Starting,
    Up,
    /// Up, with something the operator should fix (e.g. our CRDs are not installed there).
    Degraded(String),
    Down(String),
    /// Its kubeconfig file is unusable; the message says why.
    Invalid(String),
}

/// What a tenant's runs found besides its health.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TenantFacts {
    /// The API server's `gitVersion`, as it last answered.
    pub server_version: Option<String>,
    /// Its objects by readiness, once its caches filled.
    pub counts: Option<ObjectCounts>,
}

/// A tenant's objects by readiness, from its caches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ObjectCounts {
    /// StackInstalls and ClusterStackInstalls.
    pub installs: ReadinessCount,
    pub stacks: ReadinessCount,
    pub pools: ReadinessCount,
}

/// Shared health state: the admin server reads it, tenants and the daemon write it.
#[derive(Debug, Default)]
pub struct Health {
    ready: AtomicBool,
    tenants: Mutex<BTreeMap<String, TenantHealth>>,
    /// Whether the host API server answers (up or down only); none until the daemon watches it.
    host: Mutex<Option<TenantHealth>>,
    facts: Mutex<BTreeMap<String, TenantFacts>>,
    /// Tenants suspended by the daemon (over their memory budget), with why: shown instead of
    /// their health until they are resumed.
    suspended: Mutex<BTreeMap<String, String>>,
    /// With `--shards`: which slots (and so which tenants) this replica holds, one line each.
    shards: Mutex<Vec<(bool, String)>>,
    /// Bumped whenever a tenant's health or facts change.
    changed: watch::Sender<u64>,
}

impl Health {
    /// Ready means the daemon is serving (not starting, not shutting down). One tenant's trouble does
    /// not make the daemon unready: it is reported in the detail.
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::SeqCst);
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }

    pub fn set_tenant(&self, tenant: &str, health: TenantHealth) {
        let previous = self.lock().insert(tenant.to_string(), health.clone());
        if previous != Some(health) {
            self.signal();
        }
    }

    /// Whether the host API server answers: shown in the detail, not in any Tenant's status.
    pub fn set_host(&self, health: TenantHealth) {
        *self.host.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(health);
    }

    /// Forgets a tenant no longer served here, its facts included.
    pub fn remove_tenant(&self, tenant: &str) {
        let removed = self.lock().remove(tenant).is_some();
        let forgotten = self.facts().remove(tenant).is_some();
        let resumed = self.suspensions().remove(tenant).is_some();
        if removed || forgotten || resumed {
            self.signal();
        }
    }

    /// Marks a tenant suspended for `reason` until [`Health::resume`].
    pub fn suspend(&self, tenant: &str, reason: &str) {
        let previous = self.suspensions().insert(tenant.to_string(), reason.to_string());
        if previous.as_deref() != Some(reason) {
            self.signal();
        }
    }

    pub fn resume(&self, tenant: &str) {
        if self.suspensions().remove(tenant).is_some() {
            self.signal();
        }
    }

    pub fn is_suspended(&self, tenant: &str) -> bool {
        self.suspensions().contains_key(tenant)
    }

    /// Why the daemon suspended the tenant, while it is.
    pub fn suspension(&self, tenant: &str) -> Option<String> {
        self.suspensions().get(tenant).cloned()
    }

    fn suspensions(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, String>> {
        self.suspended.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Records the tenant API server's version.
    pub fn set_server_version(&self, tenant: &str, version: &str) {
        self.update_facts(tenant, |facts| facts.server_version = Some(version.to_string()));
    }

    /// Records the tenant's objects by readiness.
    pub fn set_counts(&self, tenant: &str, counts: ObjectCounts) {
        self.update_facts(tenant, |facts| facts.counts = Some(counts));
    }

    pub fn tenant_facts(&self, tenant: &str) -> TenantFacts {
        self.facts().get(tenant).cloned().unwrap_or_default()
    }

    /// Changes whenever a tenant's health or facts change.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    fn update_facts(&self, tenant: &str, update: impl FnOnce(&mut TenantFacts)) {
        let changed = {
            let mut facts = self.facts();
            let entry = facts.entry(tenant.to_string()).or_default();
            let before = entry.clone();
            update(entry);
            *entry != before
        };
        if changed {
            self.signal();
        }
    }

    fn signal(&self) {
        self.changed.send_modify(|version| *version = version.wrapping_add(1));
    }

    fn facts(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, TenantFacts>> {
        self.facts.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Replaces the shard lines of the detail. A change is signalled: which slots this replica holds
    /// decides which Tenants' status it writes, and a refused tenant in a slot just taken changes
    /// nothing else.
    pub fn set_shards(&self, lines: Vec<(bool, String)>) {
        let changed = {
            let mut shards = self.shards.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            let changed = *shards != lines;
            *shards = lines;
            changed
        };
        if changed {
            self.signal();
        }
    }

    pub fn tenant(&self, tenant: &str) -> Option<TenantHealth> {
        self.lock().get(tenant).cloned()
    }

    /// `[+]`/`[-]` lines in the style of kube-apiserver's `?verbose` health output.
    pub fn detail(&self) -> String {
        let mut out = format!(
            "[{}]daemon {}\n",
            mark(self.is_ready()),
            if self.is_ready() { "ok" } else { "not ready" }
        );
        let host = self
            .host
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone();
        match host {
            Some(TenantHealth::Down(why)) => out.push_str(&format!("[-]host down: {why}\n")),
            Some(_) => out.push_str("[+]host ok\n"),
            None => {}
        }
        let suspended = self.suspensions().clone();
        for (tenant, health) in self.lock().iter() {
            if let Some(why) = suspended.get(tenant) {
                out.push_str(&format!("[-]tenant {tenant} suspended: {why}\n"));
                continue;
            }
            let (ok, text) = match health {
                TenantHealth::Starting => (false, "starting".to_string()),
                TenantHealth::Up => (true, "ok".to_string()),
                TenantHealth::Degraded(why) => (true, format!("degraded: {why}")),
                TenantHealth::Down(why) => (false, format!("down: {why}")),
                TenantHealth::Invalid(why) => (false, format!("invalid: {why}")),
            };
            out.push_str(&format!("[{}]tenant {tenant} {text}\n", mark(ok)));
        }
        for (ok, line) in self
            .shards
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .iter()
        {
            out.push_str(&format!("[{}]{line}\n", mark(*ok)));
        }
        out
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, TenantHealth>> {
        self.tenants.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

fn mark(ok: bool) -> char {
    if ok { '+' } else { '-' }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_of_a_tenant_is_signalled_and_a_repeat_is_not() {
        let health = Health::default();
        let mut changes = health.changes();
        health.set_tenant("a", TenantHealth::Up);
        assert!(changes.has_changed().unwrap_or(false));
        changes.borrow_and_update();
        health.set_tenant("a", TenantHealth::Up);
        health.set_server_version("a", "v1.30.0");
        assert!(changes.has_changed().unwrap_or(false), "a new version is news");
        changes.borrow_and_update();
        health.set_server_version("a", "v1.30.0");
        assert!(!changes.has_changed().unwrap_or(true), "the same state twice is not");
        health.remove_tenant("a");
        assert!(changes.has_changed().unwrap_or(false));
        assert_eq!(health.tenant_facts("a"), TenantFacts::default());
    }

    #[test]
    fn a_change_of_the_slots_held_is_signalled_and_a_repeat_is_not() {
        let health = Health::default();
        let mut changes = health.changes();
        health.set_shards(vec![(true, "shard 0 held: tenants a".into())]);
        assert!(changes.has_changed().unwrap_or(false));
        changes.borrow_and_update();
        health.set_shards(vec![(true, "shard 0 held: tenants a".into())]);
        assert!(!changes.has_changed().unwrap_or(true));
    }

    #[test]
    fn a_suspended_tenant_shows_why_until_it_is_resumed() {
        let health = Health::default();
        health.set_tenant("a", TenantHealth::Up);
        health.suspend("a", "over its memory budget");
        health.set_tenant("a", TenantHealth::Up);
        assert!(
            health
                .detail()
                .contains("[-]tenant a suspended: over its memory budget\n")
        );
        health.resume("a");
        assert!(health.detail().contains("[+]tenant a ok\n"));
    }

    #[test]
    fn detail_says_whether_the_host_answers_once_it_is_watched() {
        let health = Health::default();
        health.set_ready(true);
        assert!(!health.detail().contains("host"), "not watched: no line");
        health.set_host(TenantHealth::Down("connection refused".into()));
        assert_eq!(health.detail(), "[+]daemon ok\n[-]host down: connection refused\n");
        health.set_host(TenantHealth::Up);
        assert_eq!(health.detail(), "[+]daemon ok\n[+]host ok\n");
    }

    #[test]
    fn detail_lists_each_tenant() {
        let health = Health::default();
        health.set_ready(true);
        health.set_tenant("a", TenantHealth::Up);
        health.set_tenant("b", TenantHealth::Down("connection refused".into()));
        assert_eq!(
            health.detail(),
            "[+]daemon ok\n[+]tenant a ok\n[-]tenant b down: connection refused\n"
        );
    }
}
