//! The one way a controller writes a tenant object's status: server-side apply to the status
//! subresource, with the controller's own field manager and `force` (the controller owns the status
//! it computes). The applied status is the whole status the controller wants: a field it no longer
//! sends is removed by the server, so nothing is ever cleared by writing `null`.
//!
//! Optimistic concurrency (a lease, an assignment) is asked for by passing the `resourceVersion` the
//! decision was made on: the server then answers 409 Conflict when the object changed meanwhile.
//!
//! Objects whose status an older stackd wrote with merge patches or updates carry `Update` entries
//! for the status subresource in `managedFields`; they co-own every status field, so a field the
//! applier stops sending would stay forever. The status writer takes their fields over into its own
//! `Apply` entry, in one JSON patch of `metadata.managedFields` guarded by the object's
//! `resourceVersion` (what client-go's `csaupgrade` does): before its apply when the object it was
//! given shows such an entry, else after it, when the answer does (the caches keep no
//! `managedFields`), and then applies again. stackd is the only status writer of its kinds, so every
//! such entry is a legacy stackd write. Objects without one cost no extra request.

use std::fmt::Debug;

use crate::runtime::api_errors::{answer_message, is_unprocessable};
use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{FieldsV1, ManagedFieldsEntry, ObjectMeta, Time};
use kube::api::{Patch, PatchParams};
use kube::core::Status;
use kube::{Api, Resource};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value, json};

const STATUS: &str = "status";
const APPLY: &str = "Apply";
const UPDATE: &str = "Update";

/// Applies `status` as the whole status `field_manager` wants on `cached`, the object as the caller
/// last saw it, and returns the object written (its `resourceVersion` is what the write produced).
/// With `resource_version`, the write is made only if the object is still at that version (409
/// Conflict otherwise). Its legacy status `Update` entries, if any, are taken over first, so one
/// apply removes what the status no longer has (a `resource_version` equal to the cached one then
/// guards the apply with the version the takeover produced).
pub async fn apply_status<K>(
    api: &Api<K>,
    cached: &K,
    field_manager: &str,
    status: &impl Serialize,
    resource_version: Option<&str>,
) -> Result<K, kube::Error>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug,
{
    let name = cached.meta().name.clone().unwrap_or_default();
    let mut version = resource_version.map(str::to_string);
    if let Some(taken) = take_over(api, cached, field_manager).await?
        && resource_version.is_some()
        && resource_version == cached.meta().resource_version.as_deref()
    {
        version.clone_from(&taken.meta().resource_version);
    }
    let written = apply_whole_status(api, &name, field_manager, status, version.as_deref()).await?;
    // The caches keep no `managedFields` (runtime::raw_object): a legacy entry the cached copy did
    // not show is in the answer. Taken over then, and applied again, so that what the status no
    // longer has goes now rather than never.
    match take_over(api, &written, field_manager).await? {
        None => Ok(written),
        Some(taken) => {
            let version = resource_version.and(taken.meta().resource_version.as_deref());
            apply_whole_status(api, &name, field_manager, status, version).await
        }
    }
}

/// Applies `status` as the whole status `field_manager` owns (`resource_version`, when given, as a
/// precondition). Called alone — without [`apply_status`]'s take-over — it is for a kind no earlier
/// stackd wrote with merge patches or updates: the writer then needs no right on the object itself,
/// only on its status subresource, and another manager's `Update` of the status keeps the fields it
/// co-owns.
pub async fn apply_whole_status<K>(
    api: &Api<K>,
    name: &str,
    field_manager: &str,
    status: &impl Serialize,
    resource_version: Option<&str>,
) -> Result<K, kube::Error>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug,
{
    let body = apply_body::<K>(name, status, resource_version)?;
    let params = PatchParams::apply(field_manager).force();
    api.patch_status(name, &params, &Patch::Apply(body)).await
}

/// Moves the fields of `object`'s legacy status `Update` entries to `field_manager`'s status
/// `Apply` entry. `Ok(None)` when there is nothing to take over (no request sent); a 409 Conflict
/// when the object changed since `object` was read.
async fn take_over<K>(api: &Api<K>, object: &K, field_manager: &str) -> Result<Option<K>, kube::Error>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug,
{
    let meta = object.meta();
    let now = Time(Timestamp::now());
    let Some(entries) = taken_over(meta, field_manager, &K::api_version(&()), now) else {
        return Ok(None);
    };
    let name = meta.name.clone().unwrap_or_default();
    let operations = json!([
        {"op": "test", "path": "/metadata/resourceVersion", "value": meta.resource_version},
        {"op": "replace", "path": "/metadata/managedFields", "value": entries},
    ]);
    let patch: json_patch::Patch = serde_json::from_value(operations).map_err(kube::Error::SerdeError)?;
    let params = PatchParams {
        field_manager: Some(field_manager.to_string()),
        ..PatchParams::default()
    };
    match api.patch(&name, &params, &Patch::Json::<()>(patch)).await {
        Ok(taken) => Ok(Some(taken)),
        // A failed `test`: the object changed since it was read, which callers know as a conflict.
        Err(err) if is_unprocessable(&err) => {
            let message = format!(
                "{name} changed while its status field managers were being taken over: {}",
                answer_message(&err)
            );
            Err(kube::Error::Api(
                Status::failure(&message, "Conflict").with_code(409).boxed(),
            ))
        }
        Err(err) => Err(err),
    }
}

/// A legacy write of the status: an `Update` (merge patch, JSON patch, PUT) of the subresource.
fn is_legacy_status_entry(entry: &ManagedFieldsEntry) -> bool {
    entry.subresource.as_deref() == Some(STATUS) && entry.operation.as_deref() == Some(UPDATE)
}

fn is_status_applier(entry: &ManagedFieldsEntry, field_manager: &str) -> bool {
    entry.manager.as_deref() == Some(field_manager)
        && entry.operation.as_deref() == Some(APPLY)
        && entry.subresource.as_deref() == Some(STATUS)
}

/// The `managedFields` of `meta` with every legacy status entry's fields moved into
/// `field_manager`'s status `Apply` entry (created when missing) and the legacy entries removed;
/// every other entry is kept as it is. `None` when there is no legacy status entry.
fn taken_over(meta: &ObjectMeta, field_manager: &str, api_version: &str, now: Time) -> Option<Vec<ManagedFieldsEntry>> {
    let entries = meta.managed_fields.as_deref()?;
    if !entries.iter().any(is_legacy_status_entry) {
        return None;
    }
    let mut fields = Value::Object(Map::new());
    let mut kept = Vec::with_capacity(entries.len());
    for entry in entries {
        if is_legacy_status_entry(entry) {
            fields = fields_union(&fields, &fields_of(entry));
        } else {
            kept.push(entry.clone());
        }
    }
    match kept.iter_mut().find(|entry| is_status_applier(entry, field_manager)) {
        Some(applier) => {
            applier.fields_v1 = Some(FieldsV1(fields_union(&fields_of(applier), &fields)));
            applier.fields_type = Some("FieldsV1".to_string());
            applier.time = Some(now);
        }
        None => kept.push(ManagedFieldsEntry {
            api_version: Some(api_version.to_string()),
            fields_type: Some("FieldsV1".to_string()),
            fields_v1: Some(FieldsV1(fields)),
            manager: Some(field_manager.to_string()),
            operation: Some(APPLY.to_string()),
            subresource: Some(STATUS.to_string()),
            time: Some(now),
        }),
    }
    Some(kept)
}

fn fields_of(entry: &ManagedFieldsEntry) -> Value {
    entry
        .fields_v1
        .as_ref()
        .map_or_else(|| Value::Object(Map::new()), |fields| fields.0.clone())
}

/// The union of two `FieldsV1` sets (the root of one: a map from child to node, `{}` being the
/// empty set).
fn fields_union(a: &Value, b: &Value) -> Value {
    Value::Object(children_union(a.as_object(), b.as_object()))
}

fn children_union(a: Option<&Map<String, Value>>, b: Option<&Map<String, Value>>) -> Map<String, Value> {
    let mut union = Map::new();
    for (key, node) in a.into_iter().chain(b).flatten().filter(|(key, _)| *key != ".") {
        let merged = match union.get(key) {
            Some(seen) => node_union(seen, node),
            None => node.clone(),
        };
        union.insert(key.clone(), merged);
    }
    union
}

/// The union of two nodes below the root. Each node maps a child (`f:name`, `k:{..}`, `v:..`,
/// `i:..`) to its own node; an empty node means "this field, no children", a non-empty one owns
/// the field itself only when it has the `"."` key. So a field one set owns as a leaf and the
/// other only through children becomes `{".": {}, <children>}`: a plain object merge would drop
/// the field itself.
fn node_union(a: &Value, b: &Value) -> Value {
    let owns_itself = |node: &Value| node.as_object().is_none_or(|n| n.is_empty() || n.contains_key("."));
    let mut union = children_union(a.as_object(), b.as_object());
    if !union.is_empty() && (owns_itself(a) || owns_itself(b)) {
        union.insert(".".to_string(), Value::Object(Map::new()));
    }
    Value::Object(union)
}

fn apply_body<K: Resource<DynamicType = ()>>(
    name: &str,
    status: &impl Serialize,
    resource_version: Option<&str>,
) -> Result<serde_json::Value, kube::Error> {
    let mut metadata = json!({"name": name});
    if let Some(version) = resource_version {
        metadata["resourceVersion"] = json!(version);
    }
    Ok(json!({
        "apiVersion": K::api_version(&()),
        "kind": K::kind(&()),
        "metadata": metadata,
        "status": serde_json::to_value(status).map_err(kube::Error::SerdeError)?,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;

    #[test]
    fn the_body_names_the_object_and_carries_a_version_only_when_asked() {
        let status = json!({"ready": 1});
        let plain = apply_body::<ConfigMap>("c", &status, None).unwrap();
        assert_eq!(
            plain,
            json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "status": {"ready": 1}})
        );
        let guarded = apply_body::<ConfigMap>("c", &status, Some("42")).unwrap();
        assert_eq!(guarded["metadata"]["resourceVersion"], "42");
    }

    #[test]
    fn fields_union_keeps_every_field_of_both_sets() {
        let old = json!({"f:status": {".": {}, "f:clusterDeploymentRef": {".": {}, "f:name": {}}, "f:conditions": {}}});
        let new = json!({"f:status": {"f:conditions": {"k:{\"type\":\"Available\"}": {".": {}, "f:status": {}}}}});
        assert_eq!(
            fields_union(&old, &new),
            json!({"f:status": {
                ".": {},
                "f:clusterDeploymentRef": {".": {}, "f:name": {}},
                "f:conditions": {".": {}, "k:{\"type\":\"Available\"}": {".": {}, "f:status": {}}},
            }})
        );
    }

    #[test]
    fn fields_union_with_the_empty_set_is_the_other_set() {
        let set = json!({"f:status": {"f:phase": {}}});
        assert_eq!(fields_union(&json!({}), &set), set);
        assert_eq!(fields_union(&set, &json!({})), set);
        assert_eq!(fields_union(&json!({}), &json!({})), json!({}));
    }

    #[test]
    fn a_field_owned_only_through_children_on_both_sides_stays_unowned_itself() {
        let a = json!({"f:status": {"f:a": {}}});
        let b = json!({"f:status": {"f:b": {}}});
        assert_eq!(fields_union(&a, &b), json!({"f:status": {"f:a": {}, "f:b": {}}}));
    }

    fn entry(manager: &str, operation: &str, subresource: Option<&str>, fields: Value) -> ManagedFieldsEntry {
        ManagedFieldsEntry {
            api_version: Some("v1".to_string()),
            fields_type: Some("FieldsV1".to_string()),
            fields_v1: Some(FieldsV1(fields)),
            manager: Some(manager.to_string()),
            operation: Some(operation.to_string()),
            subresource: subresource.map(str::to_string),
            time: None,
        }
    }

    fn meta(entries: Vec<ManagedFieldsEntry>) -> ObjectMeta {
        ObjectMeta {
            managed_fields: Some(entries),
            ..ObjectMeta::default()
        }
    }

    fn now() -> Time {
        Time(Timestamp::from_second(1_700_000_000).unwrap_or_default())
    }

    #[test]
    fn nothing_is_taken_over_without_a_legacy_status_entry() {
        let steady = meta(vec![
            entry(
                "stackd/pool",
                "Apply",
                Some("status"),
                json!({"f:status": {"f:ready": {}}}),
            ),
            entry("kubectl", "Update", None, json!({"f:spec": {"f:size": {}}})),
        ]);
        assert_eq!(taken_over(&steady, "stackd/pool", "v1", now()), None);
        assert_eq!(taken_over(&ObjectMeta::default(), "stackd/pool", "v1", now()), None);
    }

    #[test]
    fn legacy_status_entries_become_the_appliers_and_other_entries_stay() {
        let spec = entry("kubectl", "Update", None, json!({"f:spec": {"f:size": {}}}));
        let other_apply = entry(
            "stackd/claim",
            "Apply",
            None,
            json!({"f:metadata": {"f:finalizers": {}}}),
        );
        let object = meta(vec![
            spec.clone(),
            entry("", "Update", Some("status"), json!({"f:status": {"f:lease": {}}})),
            other_apply.clone(),
            entry("old", "Update", Some("status"), json!({"f:status": {"f:phase": {}}})),
        ]);
        let entries = taken_over(&object, "stackd/cdc-lease", "example.dev/v1", now()).unwrap();
        assert_eq!(entries.len(), 3);
        assert_eq!(entries[0], spec);
        assert_eq!(entries[1], other_apply);
        let applier = &entries[2];
        assert_eq!(applier.manager.as_deref(), Some("stackd/cdc-lease"));
        assert_eq!(applier.operation.as_deref(), Some("Apply"));
        assert_eq!(applier.subresource.as_deref(), Some("status"));
        assert_eq!(applier.api_version.as_deref(), Some("example.dev/v1"));
        assert_eq!(applier.time, Some(now()));
        assert_eq!(
            applier.fields_v1,
            Some(FieldsV1(json!({"f:status": {"f:lease": {}, "f:phase": {}}})))
        );
    }

    #[test]
    fn an_existing_status_applier_gains_the_legacy_fields() {
        let object = meta(vec![
            entry(
                "stackd/pool",
                "Apply",
                Some("status"),
                json!({"f:status": {"f:ready": {}}}),
            ),
            entry("stackd/pool", "Apply", None, json!({"f:metadata": {"f:labels": {}}})),
            entry("", "Update", Some("status"), json!({"f:status": {"f:size": {}}})),
        ]);
        let entries = taken_over(&object, "stackd/pool", "v1", now()).unwrap();
        assert_eq!(entries.len(), 2);
        assert_eq!(
            entries[0].fields_v1,
            Some(FieldsV1(json!({"f:status": {"f:ready": {}, "f:size": {}}})))
        );
        assert_eq!(entries[0].time, Some(now()));
        assert_eq!(entries[1], object.managed_fields.as_ref().unwrap()[1]);
    }
}
