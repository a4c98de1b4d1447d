//! Server-side apply, and the `managedFields` bookkeeping of ordinary writes, after
//! kube-apiserver's field manager (structured-merge-diff v4).

use serde_json::{Map, Value};

use super::fieldset::{Element, FieldPath, FieldSet, path_string};
use super::managed::{
    ManagedEntry, Operation, is_server_metadata, is_unowned, read_entries, strip_managed_fields,
    without_managed_fields, write_entries,
};
use super::schema::ListSemantics;
use super::typed::{self, Comparison};

/// The manager kube-apiserver credits with an object's fields when the first apply meets an
/// object that has no `managedFields`.
const BEFORE_FIRST_APPLY: &str = "before-first-apply";

/// One field another manager owns with a different value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConflictCause {
    /// The field, as `.data.a` or `.spec.containers[name="app"].image`.
    pub field: String,
    /// The other manager as kube-apiserver prints it: `"other"`, or `"edit" using v1 at <time>`.
    pub manager: String,
}

impl ConflictCause {
    /// The `message` of the Status cause (`type: FieldManagerConflict`).
    pub fn message(&self) -> String {
        format!("conflict with {}", self.manager)
    }
}

/// Why an apply was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApplyError {
    /// 409 Conflict, one Status cause per field.
    #[error("{}", conflict_message(.causes))]
    Conflict { causes: Vec<ConflictCause> },
    /// 400 BadRequest: not an object, no apiVersion or kind, `managedFields` set.
    #[error("{0}")]
    BadRequest(String),
    /// 422 Invalid: the configuration breaks its list semantics (duplicate or missing keys).
    #[error("{0}")]
    Invalid(String),
    /// 404: an apply to a subresource needs the object to exist.
    #[error("the object does not exist")]
    NotFound,
}

/// kube-apiserver's wording: one conflict inline, several grouped by manager.
fn conflict_message(causes: &[ConflictCause]) -> String {
    if let [only] = causes {
        return format!(
            "Apply failed with 1 conflict: conflict with {}: {}",
            only.manager, only.field
        );
    }
    let mut managers: Vec<&str> = causes.iter().map(|c| c.manager.as_str()).collect();
    managers.sort();
    managers.dedup();
    let mut lines = Vec::new();
    for manager in managers {
        lines.push(format!("conflicts with {manager}:"));
        for cause in causes.iter().filter(|c| c.manager == manager) {
            lines.push(format!("- {}", cause.field));
        }
    }
    format!("Apply failed with {} conflicts: {}", causes.len(), lines.join("\n"))
}

/// Server-side apply of `applied` by `manager` to `live` (`None` creates the object).
///
/// Returns the new object with `metadata.managedFields`; when nothing changes, that is `live`
/// itself, timestamps included, so the caller keeps its `resourceVersion`. Identity and server
/// metadata (uid, resourceVersion, creationTimestamp, ...) are the caller's to set. For a kind
/// with a status subresource the caller removes `.status` from `applied` before an apply to the
/// main resource, as kube-apiserver ignores it there.
pub fn apply(
    live: Option<&Value>,
    applied: &Value,
    manager: &str,
    force: bool,
    schema: &dyn ListSemantics,
    subresource: Option<&str>,
    now: &str,
) -> Result<Value, ApplyError> {
    let config = applied_config(applied, subresource)?;
    let empty = Value::Object(Map::new());
    // Compared and merged with its managedFields, which the comparison skips and the merge
    // keeps as they were until the new entries replace them.
    let old_contents = match (live, subresource) {
        (Some(live), _) => live,
        (None, None) => &empty,
        (None, Some(_)) => return Err(ApplyError::NotFound),
    };
    let before = entries_before_apply(old_contents, schema, now)?;
    let mut entries = before.clone();
    let applier_entry = ManagedEntry::new(
        manager,
        Operation::Apply,
        text_field(&config, "apiVersion"),
        Some(now.to_string()),
        subresource,
        typed::owned_by_config(&config, schema)
            .map_err(ApplyError::Invalid)?
            .without(is_unowned),
    );
    let (applier, last_applied) = install_applier(&mut entries, applier_entry);

    let mut merged = typed::merge(old_contents, &config, schema).map_err(ApplyError::Invalid)?;
    prune(&mut merged, &last_applied, &entries, schema);
    let comparison = owned_changes(old_contents, &merged, schema)?;
    settle_conflicts(&mut entries, applier, &comparison.changed(), force)?;
    drop_removed(&mut entries, &comparison.removed);

    let contents_changed = merged != *old_contents;
    keep_time_unless_changed(&mut entries[applier], &before, contents_changed);
    if let Some(live) = live
        && !contents_changed
        && same_entries(&entries, &before)
    {
        return Ok(live.clone());
    }
    write_entries(&mut merged, entries);
    Ok(merged)
}

/// Records an ordinary write (create, update, patch) by `manager` in `metadata.managedFields`
/// of `new`, which is returned. `old` is `None` for a create.
///
/// The writer takes every field it adds or changes, from whoever owned it; fields it removes
/// leave every manager. A `managedFields` the client sent that differs from the stored one
/// replaces it (`[{}]` clears it), as on kube-apiserver. A write that changes nothing leaves
/// `managedFields` as it was.
pub fn record_update(
    old: Option<&Value>,
    mut new: Value,
    manager: &str,
    subresource: Option<&str>,
    schema: &dyn ListSemantics,
    now: &str,
) -> Value {
    let empty = Value::Object(Map::new());
    let old = old.unwrap_or(&empty);
    let mut entries = entries_for_update(old, &new);
    let api_version = text_field(&new, "apiVersion");
    strip_managed_fields(&mut new);
    let Ok(comparison) = owned_changes(old, &new, schema) else {
        // The stored object breaks its own list semantics (duplicate keys): ownership cannot
        // be tracked, so it is left as it was rather than failing the write.
        write_entries(&mut new, entries);
        return new;
    };
    let changed = comparison.changed();
    for entry in &mut entries {
        entry.give_up(&changed);
    }
    drop_removed(&mut entries, &comparison.removed);
    credit_updater(&mut entries, manager, &api_version, subresource, changed, now);
    write_entries(&mut new, entries);
    new
}

fn credit_updater(
    entries: &mut Vec<ManagedEntry>,
    manager: &str,
    api_version: &str,
    subresource: Option<&str>,
    changed: FieldSet,
    now: &str,
) {
    if changed.is_empty() {
        return;
    }
    let updater = ManagedEntry::new(
        manager,
        Operation::Update,
        api_version.to_string(),
        Some(now.to_string()),
        subresource,
        changed,
    );
    match entries.iter_mut().find(|entry| entry.is_same_writer(&updater)) {
        Some(entry) => {
            entry.time = updater.time.clone();
            entry.take(updater.into_fields());
        }
        None => entries.push(updater),
    }
}

/// The managers of the stored object, unless the client sent a different list to replace it.
fn entries_for_update(old: &Value, new: &Value) -> Vec<ManagedEntry> {
    let sent = new.get("metadata").and_then(|m| m.get("managedFields"));
    let stored = old.get("metadata").and_then(|m| m.get("managedFields"));
    let replaced = matches!(sent, Some(Value::Array(list)) if !list.is_empty()) && sent != stored;
    let source = if replaced { new } else { old };
    read_entries(source).unwrap_or_default()
}

/// The applied configuration as merged: nulls dropped (applying `null` sets nothing) and only
/// `.status` kept for the status subresource.
fn applied_config(applied: &Value, subresource: Option<&str>) -> Result<Value, ApplyError> {
    let Some(object) = applied.as_object() else {
        return Err(ApplyError::BadRequest(
            "an apply patch must be a JSON object".to_string(),
        ));
    };
    for required in ["apiVersion", "kind"] {
        if object.get(required).and_then(Value::as_str).is_none_or(str::is_empty) {
            return Err(ApplyError::BadRequest(format!(
                "Object '{required}' is missing in the apply patch"
            )));
        }
    }
    let sent_managed_fields = object
        .get("metadata")
        .and_then(|metadata| metadata.get("managedFields"))
        .and_then(Value::as_array)
        .is_some_and(|entries| !entries.is_empty());
    if sent_managed_fields {
        return Err(ApplyError::BadRequest("metadata.managedFields must be nil".to_string()));
    }
    let config = without_managed_fields(&without_nulls(applied));
    match subresource {
        None => Ok(config),
        Some("status") => Ok(status_only(&config)),
        Some(other) => Err(ApplyError::BadRequest(format!(
            "apply to the {other} subresource is not supported"
        ))),
    }
}

fn status_only(config: &Value) -> Value {
    let mut kept = Map::new();
    for field in ["apiVersion", "kind", "status"] {
        if let Some(value) = config.get(field) {
            kept.insert(field.to_string(), value.clone());
        }
    }
    Value::Object(kept)
}

fn without_nulls(value: &Value) -> Value {
    match value {
        Value::Object(fields) => Value::Object(
            fields
                .iter()
                .filter(|(_, value)| !value.is_null())
                .map(|(name, value)| (name.clone(), without_nulls(value)))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(without_nulls).collect()),
        scalar => scalar.clone(),
    }
}

fn text_field(object: &Value, name: &str) -> String {
    object.get(name).and_then(Value::as_str).unwrap_or_default().to_string()
}

/// The stored managers; an existing object without any gets one `before-first-apply` Update
/// manager owning everything, so the first apply conflicts with what was there.
fn entries_before_apply(live: &Value, schema: &dyn ListSemantics, now: &str) -> Result<Vec<ManagedEntry>, ApplyError> {
    if let Some(entries) = read_entries(live) {
        return Ok(entries);
    }
    let fields = typed::all_paths(&without_managed_fields(live), schema)
        .map_err(ApplyError::Invalid)?
        .without(is_unowned);
    if fields.is_empty() {
        return Ok(Vec::new());
    }
    Ok(vec![ManagedEntry::new(
        BEFORE_FIRST_APPLY,
        Operation::Update,
        text_field(live, "apiVersion"),
        Some(now.to_string()),
        None,
        fields,
    )])
}

/// Puts the applier's new entry in place of its previous one; returns its index and the fields
/// its previous apply owned.
fn install_applier(entries: &mut Vec<ManagedEntry>, applier: ManagedEntry) -> (usize, FieldSet) {
    match entries.iter().position(|entry| entry.is_same_writer(&applier)) {
        Some(index) => {
            let last = std::mem::replace(&mut entries[index], applier);
            (index, last.into_fields())
        }
        None => {
            entries.push(applier);
            (entries.len() - 1, FieldSet::new())
        }
    }
}

/// Removes what the applier owned last time, no longer applies, and nobody else owns; then the
/// objects and lists that removal left empty, unless someone owns them.
fn prune(merged: &mut Value, last_applied: &FieldSet, entries: &[ManagedEntry], schema: &dyn ListSemantics) {
    let mut owned_now = FieldSet::new();
    for entry in entries {
        owned_now.extend(entry.fields().clone());
    }
    let unowned: FieldSet = last_applied
        .iter()
        .filter(|path| !owned_now.touches(path) && !is_key_field(path))
        .cloned()
        .collect();
    // Removing an item removes its fields; removing them one by one first would break its key.
    let doomed: Vec<&FieldPath> = unowned
        .iter()
        .filter(|path| !(1..path.len()).any(|depth| unowned.contains(&path[..depth])))
        .collect();
    for path in &doomed {
        typed::remove(merged, path, schema);
    }
    for path in &doomed {
        remove_emptied_parents(merged, path, &owned_now, schema);
    }
}

/// A key field of a list item (`name` of a container) goes only with its item.
fn is_key_field(path: &[Element]) -> bool {
    match path {
        [.., Element::Key(key), Element::Field(field)] => {
            serde_json::from_str::<Value>(key).is_ok_and(|key| key.get(field).is_some())
        }
        _ => false,
    }
}

fn remove_emptied_parents(merged: &mut Value, path: &[Element], owned_now: &FieldSet, schema: &dyn ListSemantics) {
    for depth in (1..path.len()).rev() {
        let parent = &path[..depth];
        let emptied = typed::get(merged, parent, schema).is_some_and(is_empty_container);
        if owned_now.touches(parent) || !emptied {
            return;
        }
        typed::remove(merged, parent, schema);
    }
}

fn is_empty_container(value: &Value) -> bool {
    match value {
        Value::Object(fields) => fields.is_empty(),
        Value::Array(items) => items.is_empty(),
        _ => false,
    }
}

/// Changes between two versions, restricted to fields that can be owned.
fn owned_changes(old: &Value, new: &Value, schema: &dyn ListSemantics) -> Result<Comparison, ApplyError> {
    let comparison = typed::compare(old, new, schema, is_server_metadata).map_err(ApplyError::Invalid)?;
    Ok(Comparison {
        added: comparison.added.without(is_unowned),
        removed: comparison.removed.without(is_unowned),
        modified: comparison.modified.without(is_unowned),
    })
}

/// Fields the apply changes that other managers own are conflicts: refused without `force`,
/// taken from them with it. Fields it sets to the value they already have are shared.
fn settle_conflicts(
    entries: &mut [ManagedEntry],
    applier: usize,
    changed: &FieldSet,
    force: bool,
) -> Result<(), ApplyError> {
    let others = || entries.iter().enumerate().filter(|(i, _)| *i != applier);
    let causes: Vec<ConflictCause> = others()
        .flat_map(|(_, entry)| {
            entry
                .fields()
                .intersection(changed)
                .iter()
                .map(|path| ConflictCause {
                    field: path_string(path),
                    manager: entry.describe(),
                })
                .collect::<Vec<_>>()
        })
        .collect();
    if causes.is_empty() {
        return Ok(());
    }
    if !force {
        return Err(ApplyError::Conflict { causes });
    }
    for (index, entry) in entries.iter_mut().enumerate() {
        if index != applier {
            entry.give_up(changed);
        }
    }
    Ok(())
}

/// Fields that left the object leave every manager.
fn drop_removed(entries: &mut [ManagedEntry], removed: &FieldSet) {
    for entry in entries {
        entry.give_up(removed);
    }
}

/// kube-apiserver stamps the applier's entry only when the object changed or the entry is new.
fn keep_time_unless_changed(applier: &mut ManagedEntry, before: &[ManagedEntry], changed: bool) {
    if changed {
        return;
    }
    if let Some(previous) = before.iter().find(|entry| entry.is_same_writer(applier)) {
        applier.time = previous.time.clone();
    }
}

/// Whether the entries, once empty ones are dropped, are what the object had.
fn same_entries(entries: &[ManagedEntry], before: &[ManagedEntry]) -> bool {
    let kept: Vec<&ManagedEntry> = entries.iter().filter(|e| !e.fields().is_empty()).collect();
    kept.len() == before.len() && kept.iter().all(|entry| before.contains(entry))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::embedded::patch_engine::builtin::BuiltinSchema;
    use crate::embedded::patch_engine::schema::CrdSchema;
    use serde_json::json;
    use std::sync::Arc;

    const T1: &str = "2024-01-01T00:00:01Z";
    const T2: &str = "2024-01-01T00:00:02Z";
    const T3: &str = "2024-01-01T00:00:03Z";

    fn config_map(data: Value) -> Value {
        json!({"apiVersion": "v1", "kind": "ConfigMap",
               "metadata": {"name": "c", "namespace": "ns"}, "data": data})
    }

    fn config_maps() -> BuiltinSchema {
        BuiltinSchema::for_kind("ConfigMap")
    }

    fn applied(live: Option<&Value>, config: &Value, manager: &str, force: bool, now: &str) -> Value {
        match apply(live, config, manager, force, &config_maps(), None, now) {
            Ok(object) => object,
            Err(error) => panic!("apply by {manager} failed: {error}"),
        }
    }

    fn entry<'v>(object: &'v Value, manager: &str) -> Option<&'v Value> {
        object["metadata"]["managedFields"]
            .as_array()?
            .iter()
            .find(|entry| entry["manager"] == manager)
    }

    fn fields_of(object: &Value, manager: &str) -> Value {
        entry(object, manager)
            .map(|e| e["fieldsV1"].clone())
            .unwrap_or(Value::Null)
    }

    /// Fixture `apply-create` of kube-apiserver-1.24-answers.md.
    #[test]
    fn apply_create_builds_the_object_and_records_the_manager() {
        let created = applied(None, &config_map(json!({"a": "1"})), "fid", false, T1);
        assert_eq!(created["data"], json!({"a": "1"}));
        assert_eq!(created["metadata"]["name"], json!("c"));
        assert_eq!(
            created["metadata"]["managedFields"],
            json!([{"manager": "fid", "operation": "Apply", "apiVersion": "v1", "time": T1,
                    "fieldsType": "FieldsV1", "fieldsV1": {"f:data": {"f:a": {}}}}])
        );
    }

    /// Fixture `noop-apply` of kube-apiserver-1.24-answers.md.
    #[test]
    fn second_identical_apply_is_a_noop() {
        let config = config_map(json!({"a": "1"}));
        let first = applied(None, &config, "fid", false, T1);
        let second = applied(Some(&first), &config, "fid", false, T2);
        assert_eq!(second, first);
    }

    /// Fixture `apply-update-drops-unowned` of kube-apiserver-1.24-answers.md.
    #[test]
    fn field_dropped_from_apply_is_removed() {
        let first = applied(None, &config_map(json!({"a": "1"})), "fid", false, T1);
        let second = applied(Some(&first), &config_map(json!({"b": "2"})), "fid", false, T2);
        assert_eq!(second["data"], json!({"b": "2"}));
        assert_eq!(fields_of(&second, "fid"), json!({"f:data": {"f:b": {}}}));
        assert_eq!(entry(&second, "fid").map(|e| &e["time"]), Some(&json!(T2)));
    }

    #[test]
    fn dropping_every_field_of_a_map_removes_the_map() {
        let mut config = config_map(json!({"a": "1"}));
        config["metadata"]["labels"] = json!({"app": "x"});
        let first = applied(None, &config, "fid", false, T1);
        let second = applied(Some(&first), &config_map(json!({"a": "1"})), "fid", false, T2);
        assert_eq!(second["metadata"].get("labels"), None);
        assert_eq!(second["metadata"]["name"], json!("c"));
    }

    #[test]
    fn field_dropped_but_owned_by_another_manager_stays() {
        let first = applied(None, &config_map(json!({"a": "1", "b": "2"})), "fid", false, T1);
        let shared = applied(Some(&first), &config_map(json!({"b": "2"})), "other", false, T2);
        let dropped = applied(Some(&shared), &config_map(json!({"a": "1"})), "fid", false, T3);
        assert_eq!(dropped["data"], json!({"a": "1", "b": "2"}));
        assert_eq!(fields_of(&dropped, "fid"), json!({"f:data": {"f:a": {}}}));
        assert_eq!(fields_of(&dropped, "other"), json!({"f:data": {"f:b": {}}}));
    }

    /// Fixture `apply-conflict` of kube-apiserver-1.24-answers.md.
    #[test]
    fn two_managers_conflict_without_force() {
        let first = applied(None, &config_map(json!({"a": "1"})), "first", false, T1);
        let result = apply(
            Some(&first),
            &config_map(json!({"a": "2"})),
            "second",
            false,
            &config_maps(),
            None,
            T2,
        );
        let expected = ApplyError::Conflict {
            causes: vec![ConflictCause {
                field: ".data.a".to_string(),
                manager: r#""first""#.to_string(),
            }],
        };
        assert_eq!(result, Err(expected.clone()));
        assert_eq!(
            expected.to_string(),
            r#"Apply failed with 1 conflict: conflict with "first": .data.a"#
        );
    }

    #[test]
    fn force_takes_ownership() {
        let first = applied(None, &config_map(json!({"a": "1", "b": "1"})), "first", false, T1);
        let forced = applied(Some(&first), &config_map(json!({"a": "2"})), "second", true, T2);
        assert_eq!(forced["data"], json!({"a": "2", "b": "1"}));
        assert_eq!(fields_of(&forced, "first"), json!({"f:data": {"f:b": {}}}));
        assert_eq!(fields_of(&forced, "second"), json!({"f:data": {"f:a": {}}}));
    }

    #[test]
    fn same_value_is_shared_not_conflicting() {
        let first = applied(None, &config_map(json!({"a": "1"})), "first", false, T1);
        let shared = applied(Some(&first), &config_map(json!({"a": "1"})), "second", false, T2);
        assert_eq!(shared["data"], json!({"a": "1"}));
        assert_eq!(fields_of(&shared, "first"), json!({"f:data": {"f:a": {}}}));
        assert_eq!(fields_of(&shared, "second"), json!({"f:data": {"f:a": {}}}));
    }

    #[test]
    fn several_conflicts_are_grouped_by_manager() {
        let first = applied(None, &config_map(json!({"a": "1", "b": "1"})), "first", false, T1);
        let result = apply(
            Some(&first),
            &config_map(json!({"a": "2", "b": "2"})),
            "second",
            false,
            &config_maps(),
            None,
            T2,
        );
        let message = result.err().map(|error| error.to_string());
        assert_eq!(
            message.as_deref(),
            Some("Apply failed with 2 conflicts: conflicts with \"first\":\n- .data.a\n- .data.b")
        );
    }

    fn deployment(containers: Value) -> Value {
        json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"},
               "spec": {"template": {"spec": {"containers": containers}}}})
    }

    fn apply_deployment(live: Option<&Value>, config: &Value, manager: &str, now: &str) -> Value {
        let schema = BuiltinSchema::for_kind("Deployment");
        match apply(live, config, manager, false, &schema, None, now) {
            Ok(object) => object,
            Err(error) => panic!("apply by {manager} failed: {error}"),
        }
    }

    #[test]
    fn map_list_merges_by_key() {
        let app = json!([{"name": "app", "image": "app:1"}]);
        let sidecar = json!([{"name": "sidecar", "image": "proxy:1"}]);
        let first = apply_deployment(None, &deployment(app.clone()), "app-team", T1);
        let both = apply_deployment(Some(&first), &deployment(sidecar), "mesh", T2);
        let containers = &both["spec"]["template"]["spec"]["containers"];
        assert_eq!(
            containers,
            &json!([{"name": "app", "image": "app:1"}, {"name": "sidecar", "image": "proxy:1"}])
        );
        assert_eq!(
            fields_of(&both, "mesh"),
            json!({"f:spec": {"f:template": {"f:spec": {"f:containers": {
                "k:{\"name\":\"sidecar\"}": {".": {}, "f:image": {}, "f:name": {}}
            }}}}})
        );
        let without_app = apply_deployment(Some(&both), &deployment(json!([])), "app-team", T3);
        assert_eq!(
            without_app["spec"]["template"]["spec"]["containers"],
            json!([{"name": "sidecar", "image": "proxy:1"}])
        );
    }

    #[test]
    fn item_dropped_from_apply_stays_while_another_manager_owns_a_field_in_it() {
        let app = json!([{"name": "app", "image": "app:1"}]);
        let first = apply_deployment(None, &deployment(app), "app-team", T1);
        let env = json!([{"name": "app", "env": [{"name": "MESH", "value": "1"}]}]);
        let injected = apply_deployment(Some(&first), &deployment(env), "mesh", T2);
        let dropped = apply_deployment(Some(&injected), &deployment(json!([])), "app-team", T3);
        assert_eq!(
            dropped["spec"]["template"]["spec"]["containers"],
            json!([{"name": "app", "env": [{"name": "MESH", "value": "1"}]}])
        );
    }

    fn widget_schema() -> CrdSchema {
        CrdSchema::new(Arc::new(json!({"type": "object", "properties": {"spec": {
            "type": "object",
            "properties": {
                "args": {"type": "array", "items": {"type": "string"}},
                "tags": {"type": "array", "x-kubernetes-list-type": "set",
                         "items": {"type": "string"}},
                "selector": {"type": "object", "x-kubernetes-map-type": "atomic",
                             "additionalProperties": {"type": "string"}},
                "zones": {"type": "object", "additionalProperties": {
                    "type": "object", "properties": {"hosts": {"type": "string"}}}}
            }
        }}})))
    }

    fn widget(spec: Value) -> Value {
        json!({"apiVersion": "example.dev/v1", "kind": "Widget",
               "metadata": {"name": "w"}, "spec": spec})
    }

    fn apply_widget(live: Option<&Value>, spec: Value, manager: &str, force: bool) -> Result<Value, ApplyError> {
        apply(live, &widget(spec), manager, force, &widget_schema(), None, T1)
    }

    #[test]
    fn atomic_list_is_replaced() {
        let first = apply_widget(None, json!({"args": ["a", "b"]}), "first", false);
        let Ok(first) = first else {
            panic!("first apply failed: {first:?}")
        };
        let conflict = apply_widget(Some(&first), json!({"args": ["c"]}), "second", false);
        assert!(matches!(
            conflict,
            Err(ApplyError::Conflict { ref causes }) if causes[0].field == ".spec.args"
        ));
        let forced = apply_widget(Some(&first), json!({"args": ["c"]}), "second", true);
        assert_eq!(forced.map(|w| w["spec"]["args"].clone()), Ok(json!(["c"])));
    }

    #[test]
    fn set_list_merges_by_value() {
        let first = apply_widget(None, json!({"tags": ["a"]}), "first", false);
        let Ok(first) = first else {
            panic!("first apply failed: {first:?}")
        };
        let second = apply_widget(Some(&first), json!({"tags": ["b"]}), "second", false);
        let Ok(second) = second else {
            panic!("second apply failed: {second:?}")
        };
        assert_eq!(second["spec"]["tags"], json!(["a", "b"]));
        assert_eq!(
            fields_of(&second, "second"),
            json!({"f:spec": {"f:tags": {"v:\"b\"": {}}}})
        );
    }

    #[test]
    fn atomic_map_is_replaced_and_owned_whole() {
        let first = apply_widget(None, json!({"selector": {"a": "1", "b": "2"}}), "m", false);
        let Ok(first) = first else {
            panic!("first apply failed: {first:?}")
        };
        let second = apply_widget(Some(&first), json!({"selector": {"c": "3"}}), "m", false);
        let Ok(second) = second else {
            panic!("second apply failed: {second:?}")
        };
        assert_eq!(second["spec"]["selector"], json!({"c": "3"}));
        assert_eq!(fields_of(&second, "m"), json!({"f:spec": {"f:selector": {}}}));
    }

    #[test]
    fn map_keys_are_owned_themselves_and_go_whole() {
        let zones = json!({"zones": {"eu": {"hosts": "a"}, "us": {"hosts": "b"}}});
        let first = apply_widget(None, zones, "m", false);
        let Ok(first) = first else {
            panic!("first apply failed: {first:?}")
        };
        assert_eq!(
            fields_of(&first, "m"),
            json!({"f:spec": {"f:zones": {
                "f:eu": {".": {}, "f:hosts": {}}, "f:us": {".": {}, "f:hosts": {}}
            }}})
        );
        let second = apply_widget(Some(&first), json!({"zones": {"us": {"hosts": "b"}}}), "m", false);
        assert_eq!(
            second.map(|w| w["spec"].clone()),
            Ok(json!({"zones": {"us": {"hosts": "b"}}}))
        );
    }

    #[test]
    fn an_empty_struct_is_owned_by_nobody() {
        let created = apply_widget(None, json!({}), "m", false);
        assert_eq!(created.map(|w| w["metadata"].get("managedFields").cloned()), Ok(None));
    }

    #[test]
    fn apply_to_status_touches_only_status() {
        let live = applied(None, &widget(json!({"args": ["a"]})), "owner", false, T1);
        let mut config = widget(json!({"args": ["changed"]}));
        config["status"] = json!({"phase": "Ready"});
        let result = apply(
            Some(&live),
            &config,
            "status-writer",
            false,
            &widget_schema(),
            Some("status"),
            T2,
        );
        let Ok(updated) = result else {
            panic!("status apply failed: {result:?}")
        };
        assert_eq!(updated["spec"], json!({"args": ["a"]}));
        assert_eq!(updated["status"], json!({"phase": "Ready"}));
        let status_entry = entry(&updated, "status-writer").cloned().unwrap_or_default();
        assert_eq!(status_entry["subresource"], json!("status"));
        assert_eq!(status_entry["fieldsV1"], json!({"f:status": {"f:phase": {}}}));
    }

    #[test]
    fn conditions_applied_to_status_by_two_controllers_merge_by_type() {
        let schema = BuiltinSchema::for_kind("Pod");
        let pod = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
                         "spec": {"containers": [{"name": "app", "image": "app:1"}]}});
        let condition = |kind: &str| -> Value {
            json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
                   "status": {"conditions": [{"type": kind, "status": "True"}]}})
        };
        let status = Some("status");
        let steps = apply(None, &pod, "creator", false, &schema, None, T1)
            .and_then(|p| apply(Some(&p), &condition("Ready"), "kubelet", false, &schema, status, T2))
            .and_then(|p| {
                apply(
                    Some(&p),
                    &condition("Scheduled"),
                    "scheduler",
                    false,
                    &schema,
                    status,
                    T3,
                )
            });
        let Ok(updated) = steps else {
            panic!("applies failed: {steps:?}")
        };
        assert_eq!(
            updated["status"]["conditions"],
            json!([{"type": "Ready", "status": "True"}, {"type": "Scheduled", "status": "True"}])
        );
        assert_eq!(updated["spec"]["containers"][0]["image"], json!("app:1"));
    }

    #[test]
    fn apply_to_status_of_a_missing_object_is_not_found() {
        let config = widget(json!({}));
        let result = apply(None, &config, "m", false, &widget_schema(), Some("status"), T1);
        assert_eq!(result, Err(ApplyError::NotFound));
    }

    #[test]
    fn apply_without_kind_is_a_bad_request() {
        let result = apply(None, &json!({"apiVersion": "v1"}), "m", false, &config_maps(), None, T1);
        assert!(matches!(result, Err(ApplyError::BadRequest(_))));
    }

    #[test]
    fn apply_with_managed_fields_is_a_bad_request() {
        let mut config = config_map(json!({"a": "1"}));
        config["metadata"]["managedFields"] = json!([{"manager": "x"}]);
        let result = apply(None, &config, "m", false, &config_maps(), None, T1);
        assert!(matches!(result, Err(ApplyError::BadRequest(_))));
    }

    #[test]
    fn update_then_apply_conflicts() {
        let created = record_update(
            None,
            config_map(json!({"a": "1"})),
            "kubectl-create",
            None,
            &config_maps(),
            T1,
        );
        assert_eq!(
            fields_of(&created, "kubectl-create"),
            json!({"f:data": {".": {}, "f:a": {}}})
        );
        let result = apply(
            Some(&created),
            &config_map(json!({"a": "2"})),
            "fid",
            false,
            &config_maps(),
            None,
            T2,
        );
        let expected_manager = format!(r#""kubectl-create" using v1 at {T1}"#);
        assert_eq!(
            result,
            Err(ApplyError::Conflict {
                causes: vec![ConflictCause {
                    field: ".data.a".into(),
                    manager: expected_manager
                }]
            })
        );
    }

    #[test]
    fn update_takes_fields_from_an_applier() {
        let first = applied(None, &config_map(json!({"a": "1", "b": "1"})), "fid", false, T1);
        let mut edited = first.clone();
        edited["data"]["a"] = json!("9");
        let updated = record_update(Some(&first), edited, "kubectl-edit", None, &config_maps(), T2);
        assert_eq!(fields_of(&updated, "fid"), json!({"f:data": {"f:b": {}}}));
        assert_eq!(fields_of(&updated, "kubectl-edit"), json!({"f:data": {"f:a": {}}}));
        let reapplied = apply(
            Some(&updated),
            &config_map(json!({"a": "1", "b": "1"})),
            "fid",
            false,
            &config_maps(),
            None,
            T3,
        );
        assert!(matches!(reapplied, Err(ApplyError::Conflict { .. })));
    }

    #[test]
    fn update_that_changes_nothing_keeps_managed_fields() {
        let first = applied(None, &config_map(json!({"a": "1"})), "fid", false, T1);
        let same = record_update(Some(&first), first.clone(), "kubectl-edit", None, &config_maps(), T2);
        assert_eq!(same, first);
        let mut without = first.clone();
        if let Some(metadata) = without["metadata"].as_object_mut() {
            metadata.remove("managedFields");
        }
        let kept = record_update(Some(&first), without, "kubectl-edit", None, &config_maps(), T2);
        assert_eq!(kept, first);
    }

    #[test]
    fn removed_fields_leave_every_manager() {
        let first = applied(None, &config_map(json!({"a": "1", "b": "1"})), "fid", false, T1);
        let mut edited = first.clone();
        if let Some(data) = edited["data"].as_object_mut() {
            data.remove("a");
        }
        let updated = record_update(Some(&first), edited, "kubectl-edit", None, &config_maps(), T2);
        assert_eq!(fields_of(&updated, "fid"), json!({"f:data": {"f:b": {}}}));
        assert_eq!(entry(&updated, "kubectl-edit"), None);
    }

    #[test]
    fn client_can_clear_managed_fields_with_one_empty_entry() {
        let first = applied(None, &config_map(json!({"a": "1"})), "fid", false, T1);
        let mut cleared = first.clone();
        cleared["metadata"]["managedFields"] = json!([{}]);
        let updated = record_update(Some(&first), cleared, "kubectl-edit", None, &config_maps(), T2);
        assert_eq!(updated["metadata"].get("managedFields"), None);
    }

    #[test]
    fn first_apply_to_an_untracked_object_conflicts_with_before_first_apply() {
        let untracked = config_map(json!({"a": "1"}));
        let result = apply(
            Some(&untracked),
            &config_map(json!({"a": "2"})),
            "fid",
            false,
            &config_maps(),
            None,
            T1,
        );
        assert!(matches!(
            result,
            Err(ApplyError::Conflict { ref causes }) if causes[0].manager.starts_with("\"before-first-apply\"")
        ));
    }

    #[test]
    fn duplicate_keys_in_a_part_the_write_leaves_alone_do_not_stop_tracking() {
        // Stored before validation refused them (or written by an older server).
        let containers = json!([{"name": "app", "image": "a"}, {"name": "app", "image": "b"}]);
        let stored = deployment(containers);
        let mut labelled = stored.clone();
        labelled["metadata"]["labels"] = json!({"tier": "web"});
        let schema = BuiltinSchema::for_kind("Deployment");
        let updated = record_update(Some(&stored), labelled, "kubectl-label", None, &schema, T1);
        assert_eq!(
            fields_of(&updated, "kubectl-label"),
            json!({"f:metadata": {"f:labels": {".": {}, "f:tier": {}}}})
        );
    }

    #[test]
    fn duplicate_keys_in_the_applied_config_are_invalid() {
        let containers = json!([{"name": "app", "image": "a"}, {"name": "app", "image": "b"}]);
        let schema = BuiltinSchema::for_kind("Deployment");
        let result = apply(None, &deployment(containers), "m", false, &schema, None, T1);
        assert!(matches!(result, Err(ApplyError::Invalid(ref message)) if message.contains("duplicate")));
    }

    #[test]
    fn objects_in_a_set_are_invalid() {
        let result = apply_widget(None, json!({"tags": [{"a": 1}]}), "m", false);
        assert!(matches!(result, Err(ApplyError::Invalid(_))));
    }

    #[test]
    fn null_in_an_applied_config_sets_nothing() {
        let created = applied(None, &config_map(json!({"a": "1", "b": null})), "fid", false, T1);
        assert_eq!(created["data"], json!({"a": "1"}));
    }

    #[test]
    fn finalizers_applied_by_two_managers_are_a_union() {
        let mut first_config = config_map(json!({}));
        first_config["metadata"]["finalizers"] = json!(["a.dev/x"]);
        let mut second_config = config_map(json!({}));
        second_config["metadata"]["finalizers"] = json!(["b.dev/y"]);
        let first = applied(None, &first_config, "first", false, T1);
        let second = applied(Some(&first), &second_config, "second", false, T2);
        assert_eq!(second["metadata"]["finalizers"], json!(["a.dev/x", "b.dev/y"]));
    }
}
