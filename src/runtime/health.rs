//! Liveness and readiness, with a line of detail per tenant.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

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

/// Shared health state: the admin server reads it, tenants and the daemon write it.
#[derive(Debug, Default)]
pub struct Health {
    ready: AtomicBool,
    tenants: Mutex<BTreeMap<String, TenantHealth>>,
    /// Tenants suspended by the daemon (over their memory budget), with why: shown instead of
    /// their health until they are resumed.
    suspended: Mutex<BTreeMap<String, String>>,
    /// With `--shards`: which slots (and so which tenants) this replica holds, one line each.
    shards: Mutex<Vec<(bool, String)>>,
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
        self.lock().insert(tenant.to_string(), health);
    }

    pub fn remove_tenant(&self, tenant: &str) {
        self.lock().remove(tenant);
        self.resume(tenant);
    }

    /// Marks a tenant suspended for `reason` until [`Health::resume`].
    pub fn suspend(&self, tenant: &str, reason: &str) {
        self.suspensions().insert(tenant.to_string(), reason.to_string());
    }

    pub fn resume(&self, tenant: &str) {
        self.suspensions().remove(tenant);
    }

    pub fn is_suspended(&self, tenant: &str) -> bool {
        self.suspensions().contains_key(tenant)
    }

    fn suspensions(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, String>> {
        self.suspended.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Replaces the shard lines of the detail.
    pub fn set_shards(&self, lines: Vec<(bool, String)>) {
        *self.shards.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = lines;
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
