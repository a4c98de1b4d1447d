//! The credentials Secrets assets wait on. Tenant Secrets are not watched (there are too many), so
//! a Secret an asset cannot use yet (missing, lacking keys, too large) or has delivered (its
//! credentials are propagated when it changes) is looked at again here, by metadata: one lookup per
//! Secret per interval however many assets name it, and at most `--namespace-secret-lookups` per
//! namespace per interval, least lately looked at first. When one changes, every asset naming it
//! is woken. Counted in `stackd_secret_lookups_total{tenant}`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, ResourceExt};
use tokio::sync::mpsc::UnboundedSender;
use tokio_util::sync::CancellationToken;

use crate::api::inventory::BareMetalAsset;
use crate::context::tenant::TenantContext;
use crate::runtime::metrics::Metrics;

/// The Secret lookups one namespace's assets may cause per interval by default
/// (`--namespace-secret-lookups`), whatever they name: a namespace naming more Secrets has each
/// looked at less often.
pub(crate) const LOOKUPS_PER_NAMESPACE: usize = 10;

/// A Secret by namespace and name.
type SecretKey = (String, String);

#[derive(Debug)]
struct Entry {
    /// The resourceVersion last seen; `None` while the Secret does not exist.
    version: Option<String>,
    /// The round it was last looked at, to take the least lately looked at first.
    looked_at: u64,
}

/// The Secrets assets wait on, shared by the controller's reconciles and its lookup task.
#[derive(Debug, Default)]
pub(crate) struct AwaitedSecrets {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    entries: BTreeMap<SecretKey, Entry>,
    round: u64,
}

impl AwaitedSecrets {
    /// Whether `name` is known not to exist (the lookup task says when it appears): no need to ask.
    pub(crate) fn known_missing(&self, namespace: &str, name: &str) -> bool {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let key = (namespace.to_string(), name.to_string());
        state.entries.get(&key).is_some_and(|e| e.version.is_none())
    }

    /// An asset waits for Secret `name`, as it was just read at `version` (`None`: missing), to change.
    pub(crate) fn await_change(&self, namespace: &str, name: &str, version: Option<String>) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let looked_at = state.round;
        let key = (namespace.to_string(), name.to_string());
        state.entries.insert(key, Entry { version, looked_at });
    }

    /// How many Secrets are awaited (for tests).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).entries.len()
    }

    /// Starts a round: forgets the Secrets no asset names any more, and picks those to look at now
    /// (at most `per_namespace` per namespace, least lately looked at first).
    fn next_round(&self, named: &BTreeSet<SecretKey>, per_namespace: usize) -> Vec<(SecretKey, Option<String>)> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.round += 1;
        let round = state.round;
        state.entries.retain(|key, _| named.contains(key));
        let mut by_namespace: BTreeMap<&str, Vec<(&SecretKey, &Entry)>> = BTreeMap::new();
        for (key, entry) in &state.entries {
            by_namespace.entry(key.0.as_str()).or_default().push((key, entry));
        }
        let mut picked = Vec::new();
        for entries in by_namespace.values_mut() {
            entries.sort_by_key(|(_, entry)| entry.looked_at);
            let taken = entries.iter().take(per_namespace.max(1));
            picked.extend(taken.map(|(key, entry)| ((*key).clone(), entry.version.clone())));
        }
        for (key, _) in &picked {
            if let Some(entry) = state.entries.get_mut(key) {
                entry.looked_at = round;
            }
        }
        picked
    }

    /// The Secret changed from what it was awaited at: no longer awaited (its assets are woken and
    /// read it again), unless an asset awaited a newer state meanwhile.
    fn changed(&self, key: &SecretKey, seen: &Option<String>) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if state.entries.get(key).is_some_and(|e| &e.version == seen) {
            state.entries.remove(key);
        }
    }

    /// Looks at the awaited Secrets every `interval` until `cancel` fires, waking the assets of
    /// each one that changed.
    pub(crate) async fn run(self: Arc<Self>, lookups: Lookups, interval: Duration, cancel: CancellationToken) {
        let mut ticks = tokio::time::interval(interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = ticks.tick() => {}
            }
            let named = lookups
                .assets
                .state()
                .iter()
                .filter_map(|a| credentials_key(a))
                .collect();
            let per_namespace = lookups.tenant.shared.settings.namespace_secret_lookups;
            for (key, awaited) in self.next_round(&named, per_namespace) {
                let Ok(seen) = lookups.version(&key).await else {
                    // The tenant does not answer (reachability tells it): try again next round.
                    break;
                };
                if seen != awaited {
                    self.changed(&key, &awaited);
                    lookups.wake_assets_naming(&key);
                }
            }
        }
    }
}

/// The Secret (namespace and name) an asset takes its credentials from.
fn credentials_key(asset: &BareMetalAsset) -> Option<SecretKey> {
    Some((asset.namespace()?, asset.spec.bmc.credentials_name.clone()))
}

/// What the lookup task reads and whom it wakes.
pub(crate) struct Lookups {
    pub(crate) tenant: Arc<TenantContext>,
    pub(crate) assets: Store<BareMetalAsset>,
    pub(crate) wake: UnboundedSender<ObjectRef<BareMetalAsset>>,
}

impl Lookups {
    /// The Secret's resourceVersion (`None`: missing), read by metadata only.
    async fn version(&self, (namespace, name): &SecretKey) -> Result<Option<String>, kube::Error> {
        let metrics = &self.tenant.shared.metrics;
        metrics
            .secret_lookups
            .get_or_create(&Metrics::tenant(&self.tenant.name))
            .inc();
        let secrets = Api::<Secret>::namespaced(self.tenant.client.clone(), namespace);
        let meta = secrets.get_metadata_opt(name).await?;
        Ok(meta.and_then(|m| m.metadata.resource_version))
    }

    fn wake_assets_naming(&self, key: &SecretKey) {
        for asset in self.assets.state() {
            if credentials_key(&asset).as_ref() == Some(key) {
                // The controller is gone when this fails: nothing to wake.
                let _ = self.wake.send(ObjectRef::from_obj(&*asset));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(namespace: &str, name: &str) -> SecretKey {
        (namespace.to_string(), name.to_string())
    }

    #[test]
    fn a_namespace_naming_many_secrets_gets_its_lookups_per_round_in_turn() {
        let awaited = AwaitedSecrets::default();
        let mut named = BTreeSet::new();
        for i in 0..25 {
            awaited.await_change("attacker", &format!("s{i}"), None);
            named.insert(key("attacker", &format!("s{i}")));
        }
        awaited.await_change("other", "bmc", None);
        named.insert(key("other", "bmc"));
        let mut seen = BTreeSet::new();
        for _ in 0..3 {
            let picked = awaited.next_round(&named, LOOKUPS_PER_NAMESPACE);
            let attacker: Vec<_> = picked.iter().filter(|(k, _)| k.0 == "attacker").collect();
            assert!(attacker.len() <= LOOKUPS_PER_NAMESPACE);
            assert!(
                picked.iter().any(|(k, _)| k.0 == "other"),
                "another namespace is looked at every round"
            );
            seen.extend(attacker.into_iter().map(|(k, _)| k.clone()));
        }
        assert_eq!(seen.len(), 25, "every Secret is looked at in turn");
    }

    #[test]
    fn secrets_no_asset_names_are_forgotten_and_a_change_ends_the_wait() {
        let awaited = AwaitedSecrets::default();
        awaited.await_change("team", "gone", None);
        awaited.await_change("team", "bmc", None);
        assert!(awaited.known_missing("team", "bmc"));
        let picked = awaited.next_round(&BTreeSet::from([key("team", "bmc")]), LOOKUPS_PER_NAMESPACE);
        assert_eq!(picked, vec![(key("team", "bmc"), None)]);
        assert_eq!(awaited.len(), 1);
        awaited.changed(&key("team", "bmc"), &None);
        assert!(!awaited.known_missing("team", "bmc"));
        assert_eq!(awaited.len(), 0);
    }
}
