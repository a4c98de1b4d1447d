//! Writing host objects with the ownership proof of DESIGN.md §2: create with POST; on a name already
//! taken, check whose the object is; update only our own, with its uid and resourceVersion as
//! preconditions; replace one left by a previous incarnation of the parent; never touch a stranger's.

use std::collections::HashMap;
use std::fmt::Debug;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kube::api::{DeleteParams, PostParams, Preconditions, PropagationPolicy};
use kube::{Api, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::labels::Parent;
use super::ownership::{self, Ownership};
use crate::runtime::api_errors::{is_conflict, is_not_found};
use crate::runtime::backoff::Backoff;

/// What a write did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Applied {
    Created,
    Updated,
    /// The object already was as desired: no request was sent.
    Unchanged,
}

impl Applied {
    /// True when a request changed the host.
    pub fn wrote(self) -> bool {
        self != Applied::Unchanged
    }
}

/// How an existing object of ours is brought to the desired state.
#[derive(Clone, Copy, Debug)]
pub enum Update<'a> {
    /// Replace it (PUT with uid and resourceVersion preconditions) when a field stackd sets differs;
    /// a replace the host changed back is held until its backoff has passed, and an object created
    /// moments ago is not created again while the cache has not shown it yet.
    WhenDifferent(&'a HostWrites),
    /// Never update in place (e.g. a Job, whose template is immutable): the caller deletes and
    /// recreates it when it needs a different one.
    Never,
}

#[derive(Debug, thiserror::Error)]
pub enum HostWriteError {
    /// The name is taken by an object stackd must not touch.
    #[error(
        "host {kind} {namespace}/{name} already exists and is not this object's ({reason}); stackd leaves it alone: delete or rename it on the host"
    )]
    Conflict {
        kind: String,
        namespace: String,
        name: String,
        reason: String,
    },
    /// The server answered a replace with other values for fields stackd sets (a mutating webhook,
    /// a policy engine): replacing again would loop.
    #[error(
        "host {kind} {namespace}/{name} was changed back by the host as it was written ({field} differs; a mutating admission webhook or policy?); stackd retries with backoff: exempt stackd's objects in namespace {namespace} from that mutation"
    )]
    Reverted {
        kind: String,
        namespace: String,
        name: String,
        /// The first field stackd sets that the host changed (a path, never a value).
        field: String,
    },
    #[error("host API request failed: {0}")]
    Api(#[from] kube::Error),
}

impl HostWriteError {
    /// The condition reason a parent reports for this error.
    pub fn reason(&self) -> &'static str {
        match self {
            HostWriteError::Conflict { .. } => "HostObjectConflict",
            HostWriteError::Reverted { .. } => "HostObjectReverted",
            HostWriteError::Api(_) => "HostUnavailable",
        }
    }
}

/// Adds the tenant/parent labels and annotations of DESIGN.md §2 to `object`.
pub fn stamp<K: Resource>(object: &mut K, tenant: &str, parent: &Parent) {
    let meta = object.meta_mut();
    meta.labels.get_or_insert_default().extend(parent.labels(tenant));
    meta.annotations.get_or_insert_default().extend(parent.annotations());
}

/// Brings the host object named by `desired` to the desired state. `observed` is the cached copy
/// (from a reflector) when there is one; without it the object is created, and a name already taken
/// is read once to decide whose it is.
pub async fn ensure<K>(
    api: &Api<K>,
    desired: &K,
    observed: Option<&K>,
    tenant: &str,
    parent: &Parent,
    update: Update<'_>,
) -> Result<Applied, HostWriteError>
where
    K: Resource + Clone + Debug + Serialize + DeserializeOwned,
    K::DynamicType: Default,
{
    let key = object_key(desired);
    // Ours, created by an earlier reconcile and not yet reported by its watch (`HostWrites::seen`):
    // the watch event that brings it to the cache brings this parent back, to compare it then.
    if let (Update::WhenDifferent(writes), None) = (update, observed)
        && writes.created_recently(&key)
    {
        return Ok(Applied::Unchanged);
    }
    // Marked before the request, not after: the creation's watch event (`HostWrites::seen`) may
    // be handled before the response is, and a mark made after it would stand for a creation the
    // cache has already shown (and hold back the next creation of a copy deleted meanwhile).
    let creating = match update {
        Update::WhenDifferent(writes) if observed.is_none() => Some(writes),
        _ => None,
    };
    if let Some(writes) = creating {
        writes.remember_created(&key);
    }
    let existing = match ensure_created(api, desired, observed, tenant, parent).await {
        Ok((Applied::Created, _)) => return Ok(Applied::Created),
        Ok((_, existing)) => {
            creating.inspect(|writes| writes.forget_created(&key));
            existing
        }
        Err(err) => {
            creating.inspect(|writes| writes.forget_created(&key));
            return Err(err);
        }
    };
    let Update::WhenDifferent(reverts) = update else {
        return Ok(Applied::Unchanged);
    };
    let Some(field) = changed_field(&existing, desired) else {
        reverts.forget(&key);
        return Ok(Applied::Unchanged);
    };
    let wanted = serde_json::to_value(desired).unwrap_or_default();
    if reverts.holds(&key, &wanted) {
        return Err(reverted(&existing, field));
    }
    let mut replacement = desired.clone();
    replacement.meta_mut().uid = existing.meta().uid.clone();
    replacement.meta_mut().resource_version = existing.meta().resource_version.clone();
    let written = api
        .replace(&desired.name_any(), &PostParams::default(), &replacement)
        .await?;
    if let Some(field) = changed_field(&written, desired) {
        reverts.reverted(&key, wanted);
        return Err(reverted(&written, field));
    }
    reverts.forget(&key);
    Ok(Applied::Updated)
}

/// What a tenant's controllers wrote to the host that their caches must not be trusted on yet.
///
/// Replaces the host changed back as they were written, per host object: the same replace is held
/// until its own backoff has passed, whatever starts the next reconcile. A host that changes the
/// object while changing stackd's fields back (a stamp, a re-injected sidecar) sends a watch event
/// for every replace, which would otherwise start the next replace at once, in a loop.
///
/// Objects created moments ago: a reconcile woken by another event before the cache has shown
/// the creation would otherwise create it again (a 409 and a GET, wasted).
#[derive(Debug)]
pub struct HostWrites {
    backoff: Backoff,
    held: Mutex<HashMap<String, Revert>>,
    created: Mutex<HashMap<String, Instant>>,
}

/// How long a creation stands for the object while the cache has not shown it: a cache catches up
/// in moments; one that never shows it (it relisted past a deletion) is trusted again after this.
const CREATED_STANDS_FOR: Duration = Duration::from_secs(10);

#[derive(Debug)]
struct Revert {
    /// The desired object the host changed back: a different one is tried at once.
    desired: Value,
    failures: u32,
    retry_at: Instant,
}

impl HostWrites {
    pub fn new(backoff: Backoff) -> Self {
        HostWrites {
            backoff,
            held: Mutex::new(HashMap::new()),
            created: Mutex::new(HashMap::new()),
        }
    }

    /// Records that `object` is being created (for writers that use [`ensure_created`]): call it
    /// before the request, since the creation's watch event may be handled before its response,
    /// and [`HostWrites::not_created`] if the request created nothing.
    pub fn creating<K: Resource>(&self, object: &K)
    where
        K::DynamicType: Default,
    {
        self.remember_created(&object_key(object));
    }

    /// Forgets a creation marked by [`HostWrites::creating`] that did not happen.
    pub fn not_created<K: Resource>(&self, object: &K)
    where
        K::DynamicType: Default,
    {
        self.forget_created(&object_key(object));
    }

    /// Records that the cache has shown `object` (a watch event of it, its deletion included):
    /// its creation is no longer pending.
    pub fn seen<K: Resource>(&self, object: &K)
    where
        K::DynamicType: Default,
    {
        self.forget_created(&object_key(object));
    }

    /// True when the `K` named `name` in `namespace` was created moments ago (by [`ensure`] or a
    /// writer that said so with [`HostWrites::created`]) and the cache has not shown it yet (the
    /// controller's watch of that kind calls [`HostWrites::seen`] on every event).
    pub fn was_created<K: Resource>(&self, namespace: &str, name: &str) -> bool
    where
        K::DynamicType: Default,
    {
        let kind = K::kind(&K::DynamicType::default()).into_owned();
        self.created_recently(&format!("{kind}/{namespace}/{name}"))
    }

    fn remember_created(&self, key: &str) {
        let mut created = self.created.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        created.retain(|_, at| at.elapsed() < CREATED_STANDS_FOR);
        created.insert(key.to_string(), Instant::now());
    }

    fn created_recently(&self, key: &str) -> bool {
        let created = self.created.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        created.get(key).is_some_and(|at| at.elapsed() < CREATED_STANDS_FOR)
    }

    fn forget_created(&self, key: &str) {
        let mut created = self.created.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        created.remove(key);
    }

    /// True when replacing `key` with `desired` waits: the host changed this very replace back and
    /// its backoff has not passed.
    fn holds(&self, key: &str, desired: &Value) -> bool {
        let held = self.held.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        held.get(key)
            .is_some_and(|revert| revert.desired == *desired && Instant::now() < revert.retry_at)
    }

    /// Records that the host changed the replace of `key` with `desired` back.
    fn reverted(&self, key: &str, desired: Value) {
        let mut held = self.held.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let failures = match held.get(key) {
            Some(revert) if revert.desired == desired => revert.failures.saturating_add(1),
            _ => 1,
        };
        let retry_at = Instant::now() + self.backoff.delay(failures);
        held.insert(
            key.to_string(),
            Revert {
                desired,
                failures,
                retry_at,
            },
        );
    }

    /// Forgets `key` once the host holds what stackd wants.
    fn forget(&self, key: &str) {
        self.held
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .remove(key);
    }
}

/// `Kind/namespace/name` of a host object.
fn object_key<K: Resource>(object: &K) -> String
where
    K::DynamicType: Default,
{
    let kind = K::kind(&K::DynamicType::default()).into_owned();
    format!(
        "{kind}/{}/{}",
        object.namespace().unwrap_or_default(),
        object.name_any()
    )
}

fn reverted<K: Resource>(written: &K, field: String) -> HostWriteError
where
    K::DynamicType: Default,
{
    HostWriteError::Reverted {
        kind: K::kind(&K::DynamicType::default()).into_owned(),
        namespace: written.namespace().unwrap_or_default(),
        name: written.name_any(),
        field,
    }
}

/// Makes sure an object of ours stands at `desired`'s name and returns it as it is on the host:
/// created now, or found and proven ours (never updated). Callers that need its uid, e.g. to own
/// other objects by it, use this directly.
pub async fn ensure_created<K>(
    api: &Api<K>,
    desired: &K,
    observed: Option<&K>,
    tenant: &str,
    parent: &Parent,
) -> Result<(Applied, K), HostWriteError>
where
    K: Resource + Clone + Debug + Serialize + DeserializeOwned,
    K::DynamicType: Default,
{
    let existing = match observed {
        Some(observed) => observed.clone(),
        None => match api.create(&PostParams::default(), desired).await {
            Ok(created) => return Ok((Applied::Created, created)),
            Err(err) if is_conflict(&err) => api.get(&desired.name_any()).await?,
            Err(err) => return Err(err.into()),
        },
    };
    match ownership::check(existing.labels(), existing.annotations(), tenant, parent) {
        Ownership::Foreign { reason } => Err(conflict::<K>(&existing, reason)),
        Ownership::PreviousIncarnation { .. } => {
            // Left by a deleted parent of the same name: remove it (only that very object) and start
            // anew; if the old one is still finalizing, the create fails and the next event retries.
            delete(api, &existing).await?;
            Ok((Applied::Created, api.create(&PostParams::default(), desired).await?))
        }
        Ownership::Ours => Ok((Applied::Unchanged, existing)),
    }
}

/// Deletes exactly the object observed (uid precondition), in the background so a Job's pods or a
/// Deployment's ReplicaSets go with it. An object already gone is not an error.
pub async fn delete<K>(api: &Api<K>, observed: &K) -> Result<(), kube::Error>
where
    K: Resource + Clone + Debug + DeserializeOwned,
{
    let params = DeleteParams {
        propagation_policy: Some(PropagationPolicy::Background),
        preconditions: Some(Preconditions {
            uid: observed.meta().uid.clone(),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    match api.delete(&observed.name_any(), &params).await {
        Ok(_) => Ok(()),
        Err(err) if is_not_found(&err) => Ok(()),
        // A uid mismatch means the object was replaced by someone else meanwhile: not ours to delete.
        Err(err) if is_conflict(&err) => Ok(()),
        Err(err) => Err(err),
    }
}

/// Deletes every object in `observed` that carries this tenant's and this parent's labels.
pub async fn delete_all<K>(api: &Api<K>, observed: &[K], tenant: &str, parent: &Parent) -> Result<usize, kube::Error>
where
    K: Resource + Clone + Debug + DeserializeOwned,
{
    let wanted = parent.labels(tenant);
    let mut deleted = 0;
    for object in observed {
        let labels = object.labels();
        let matches = wanted.iter().all(|(k, v)| labels.get(k) == Some(v));
        if matches && object.meta().deletion_timestamp.is_none() {
            delete(api, object).await?;
            deleted += 1;
        }
    }
    Ok(deleted)
}

fn conflict<K: Resource>(existing: &K, reason: String) -> HostWriteError
where
    K::DynamicType: Default,
{
    HostWriteError::Conflict {
        kind: K::kind(&K::DynamicType::default()).into_owned(),
        namespace: existing.namespace().unwrap_or_default(),
        name: existing.name_any(),
        reason,
    }
}

/// True when every field `desired` sets has the same value in `existing`. Fields the server defaults
/// (or other controllers and webhooks add) are ignored: lists of named items (containers, env,
/// volumes, ports) are matched by name, so an added sidecar or variable is not drift, while other
/// lists (args, command) must be equal in length.
pub fn contains<K: Serialize>(existing: &K, desired: &K) -> bool {
    changed_field(existing, desired).is_none()
}

/// The first field `desired` sets that `existing` lacks or holds otherwise, as a path such as
/// `spec.template.spec.containers[controller].image` (names of named list items, indexes of
/// others); `None` when [`contains`] holds. Never a value: the object may be a Secret.
pub fn changed_field<K: Serialize>(existing: &K, desired: &K) -> Option<String> {
    let (Ok(mut existing), Ok(mut desired)) = (serde_json::to_value(existing), serde_json::to_value(desired)) else {
        return Some("the object".into());
    };
    for value in [&mut existing, &mut desired] {
        if let Some(meta) = value.get_mut("metadata").and_then(Value::as_object_mut) {
            for key in [
                "uid",
                "resourceVersion",
                "creationTimestamp",
                "generation",
                "managedFields",
            ] {
                meta.remove(key);
            }
        }
        if let Some(object) = value.as_object_mut() {
            object.remove("status");
        }
    }
    difference(&desired, &existing)
}

#[cfg(test)]
fn subset(desired: &Value, existing: &Value) -> bool {
    difference(desired, existing).is_none()
}

/// Where `existing` first fails to hold what `desired` sets ("" for the value itself).
fn difference(desired: &Value, existing: &Value) -> Option<String> {
    match (desired, existing) {
        (Value::Object(want), Value::Object(have)) => want.iter().find_map(|(key, value)| match have.get(key) {
            Some(found) => difference(value, found).map(|inner| nested(key, inner)),
            // An empty map or list we set is the same as the field left out.
            None if is_empty(value) => None,
            None => Some(key.clone()),
        }),
        (Value::Array(want), Value::Array(have)) if want.iter().all(|w| item_name(w).is_some()) => {
            want.iter().find_map(|w| named_item_difference(w, have))
        }
        (Value::Array(want), Value::Array(have)) if want.len() != have.len() => Some(String::new()),
        (Value::Array(want), Value::Array(have)) => want
            .iter()
            .zip(have)
            .enumerate()
            .find_map(|(index, (w, h))| difference(w, h).map(|inner| nested(&format!("[{index}]"), inner))),
        (want, Value::Null) if is_empty(want) => None,
        (want, have) if want == have => None,
        _ => Some(String::new()),
    }
}

/// How the items of `have` named like `want` fail to hold it (none of them does), if they do.
fn named_item_difference(want: &Value, have: &[Value]) -> Option<String> {
    let name = item_name(want)?;
    let label = format!("[{name}]");
    let mut same_name = have.iter().filter(|h| item_name(h) == Some(name)).peekable();
    if same_name.peek().is_none() {
        return Some(label);
    }
    let mut first = None;
    for item in same_name {
        match difference(want, item) {
            None => return None,
            Some(inner) => {
                first.get_or_insert(inner);
            }
        }
    }
    first.map(|inner| nested(&label, inner))
}

/// `prefix` followed by the path `inner` below it.
fn nested(prefix: &str, inner: String) -> String {
    if inner.is_empty() {
        prefix.to_string()
    } else if inner.starts_with('[') || prefix.is_empty() {
        format!("{prefix}{inner}")
    } else {
        format!("{prefix}.{inner}")
    }
}

/// The `name` of a list item that has one (a container, an env var, a volume, a port).
fn item_name(item: &Value) -> Option<&str> {
    item.get("name").and_then(Value::as_str)
}

fn is_empty(value: &Value) -> bool {
    match value {
        Value::Null => true,
        Value::Object(map) => map.is_empty(),
        Value::Array(list) => list.is_empty(),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    use k8s_openapi::api::core::v1::ConfigMap;
    use serde_json::json;

    fn config_map(value: Value) -> ConfigMap {
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn server_added_fields_are_not_drift() {
        let desired = config_map(json!({"metadata": {"name": "a", "labels": {"x": "1"}}, "data": {"k": "v"}}));
        let existing = config_map(json!({
            "metadata": {"name": "a", "uid": "u", "resourceVersion": "7", "labels": {"x": "1", "added": "y"}},
            "data": {"k": "v"}
        }));
        assert!(contains(&existing, &desired));
    }

    #[test]
    fn a_changed_or_missing_field_is_drift() {
        let desired = config_map(json!({"metadata": {"name": "a"}, "data": {"k": "v"}}));
        assert!(!contains(
            &config_map(json!({"metadata": {"name": "a"}, "data": {"k": "w"}})),
            &desired
        ));
        assert!(!contains(&config_map(json!({"metadata": {"name": "a"}})), &desired));
    }

    #[test]
    fn list_length_counts_for_unnamed_items() {
        assert!(!subset(&json!([{"a": 1}]), &json!([{"a": 1}, {"b": 2}])));
        assert!(subset(&json!([{"a": 1}]), &json!([{"a": 1, "b": 2}])));
        assert!(!subset(&json!(["--flag"]), &json!(["--flag", "--injected"])));
    }

    #[test]
    fn a_sidecar_or_variable_added_by_a_webhook_is_not_drift() {
        let desired =
            json!({"containers": [{"name": "controller", "image": "a", "env": [{"name": "X", "value": "1"}]}]});
        let mutated = json!({"containers": [
            {"name": "proxy", "image": "mesh"},
            {"name": "controller", "image": "a", "env": [{"name": "INJECTED", "value": "y"}, {"name": "X", "value": "1"}]}
        ]});
        assert!(subset(&desired, &mutated));
    }

    #[test]
    fn a_named_item_changed_or_gone_is_drift() {
        let desired = json!({"containers": [{"name": "controller", "image": "a"}]});
        assert!(!subset(
            &desired,
            &json!({"containers": [{"name": "controller", "image": "b"}]})
        ));
        assert!(!subset(
            &desired,
            &json!({"containers": [{"name": "other", "image": "a"}]})
        ));
    }

    #[test]
    fn the_changed_field_is_named_by_its_path() {
        let desired = json!({"spec": {"template": {"spec": {
            "containers": [{"name": "controller", "image": "a", "args": ["--x"]}]
        }}}});
        let changed_image = json!({"spec": {"template": {"spec": {
            "containers": [{"name": "proxy"}, {"name": "controller", "image": "mirror/a", "args": ["--x"]}]
        }}}});
        assert_eq!(
            difference(&desired, &changed_image).as_deref(),
            Some("spec.template.spec.containers[controller].image")
        );
        let changed_args = json!({"spec": {"template": {"spec": {
            "containers": [{"name": "controller", "image": "a", "args": ["--y"]}]
        }}}});
        assert_eq!(
            difference(&desired, &changed_args).as_deref(),
            Some("spec.template.spec.containers[controller].args[0]")
        );
        let gone = json!({"spec": {"template": {"spec": {"containers": [{"name": "proxy"}]}}}});
        assert_eq!(
            difference(&desired, &gone).as_deref(),
            Some("spec.template.spec.containers[controller]")
        );
    }

    #[test]
    fn a_reverted_replace_is_held_until_its_backoff_passes_unless_the_desired_state_changes() {
        let reverts = HostWrites::new(Backoff::new(Duration::from_secs(3600), Duration::from_secs(3600)));
        let desired = json!({"spec": {"image": "a"}});
        assert!(!reverts.holds("Deployment/ns/d", &desired));
        reverts.reverted("Deployment/ns/d", desired.clone());
        assert!(reverts.holds("Deployment/ns/d", &desired));
        assert!(!reverts.holds("Deployment/ns/d", &json!({"spec": {"image": "b"}})));
        assert!(!reverts.holds("Deployment/ns/other", &desired));
        reverts.forget("Deployment/ns/d");
        assert!(!reverts.holds("Deployment/ns/d", &desired));

        let immediate = HostWrites::new(Backoff::new(Duration::ZERO, Duration::ZERO));
        immediate.reverted("Deployment/ns/d", desired.clone());
        assert!(
            !immediate.holds("Deployment/ns/d", &desired),
            "a passed backoff holds nothing"
        );
    }

    #[test]
    fn empty_collections_equal_absent() {
        assert!(subset(&json!({"a": {}, "b": []}), &json!({})));
        assert!(!subset(&json!({"a": {"k": 1}}), &json!({})));
    }

    #[test]
    fn stamp_adds_identity() {
        let mut cm = ConfigMap::default();
        let parent = Parent::new("Stack", Some("ns"), "s", "u1");
        stamp(&mut cm, "acme", &parent);
        assert_eq!(
            ownership::check(cm.labels(), cm.annotations(), "acme", &parent),
            Ownership::Ours
        );
    }
}
