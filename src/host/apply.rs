//! Writing host objects with the ownership proof of DESIGN.md §2: create with POST; on a name already
//! taken, check whose the object is; update only our own, with its uid and resourceVersion as
//! preconditions; replace one left by a previous incarnation of the parent; never touch a stranger's.

use std::fmt::Debug;

use kube::api::{DeleteParams, PostParams, Preconditions, PropagationPolicy};
use kube::{Api, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::labels::Parent;
use super::ownership::{self, Ownership};

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
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Update {
    /// Replace it (PUT with uid and resourceVersion preconditions) when a field stackd sets differs.
    WhenDifferent,
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
        "host {kind} {namespace}/{name} was changed back by the host as it was written (a mutating admission webhook or policy?); stackd retries with backoff: exempt stackd's objects in namespace {namespace} from that mutation"
    )]
    Reverted {
        kind: String,
        namespace: String,
        name: String,
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
    update: Update,
) -> Result<Applied, HostWriteError>
where
    K: Resource + Clone + Debug + Serialize + DeserializeOwned,
    K::DynamicType: Default,
{
    let existing = match ensure_created(api, desired, observed, tenant, parent).await? {
        (Applied::Created, _) => return Ok(Applied::Created),
        (_, existing) => existing,
    };
    if update == Update::Never || contains(&existing, desired) {
        return Ok(Applied::Unchanged);
    }
    let mut replacement = desired.clone();
    replacement.meta_mut().uid = existing.meta().uid.clone();
    replacement.meta_mut().resource_version = existing.meta().resource_version.clone();
    let written = api
        .replace(&desired.name_any(), &PostParams::default(), &replacement)
        .await?;
    if !contains(&written, desired) {
        return Err(HostWriteError::Reverted {
            kind: K::kind(&K::DynamicType::default()).into_owned(),
            namespace: written.namespace().unwrap_or_default(),
            name: written.name_any(),
        });
    }
    Ok(Applied::Updated)
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
            Err(kube::Error::Api(status)) if status.code == 409 => api.get(&desired.name_any()).await?,
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
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
        // A uid mismatch means the object was replaced by someone else meanwhile: not ours to delete.
        Err(kube::Error::Api(status)) if status.code == 409 => Ok(()),
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
    let (Ok(mut existing), Ok(mut desired)) = (serde_json::to_value(existing), serde_json::to_value(desired)) else {
        return false;
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
    subset(&desired, &existing)
}

fn subset(desired: &Value, existing: &Value) -> bool {
    match (desired, existing) {
        (Value::Object(want), Value::Object(have)) => want.iter().all(|(key, value)| match have.get(key) {
            Some(found) => subset(value, found),
            // An empty map or list we set is the same as the field left out.
            None => is_empty(value),
        }),
        (Value::Array(want), Value::Array(have)) if want.iter().all(|w| item_name(w).is_some()) => want
            .iter()
            .all(|w| have.iter().any(|h| item_name(h) == item_name(w) && subset(w, h))),
        (Value::Array(want), Value::Array(have)) => {
            want.len() == have.len() && want.iter().zip(have).all(|(w, h)| subset(w, h))
        }
        (want, Value::Null) => is_empty(want),
        (want, have) => want == have,
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
