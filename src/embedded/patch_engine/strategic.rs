//! Strategic merge patch (`application/strategic-merge-patch+json`) for built-in kinds.
//!
//! Like a JSON merge patch, except that lists with a merge key merge item by item, lists of
//! strings marked `patchStrategy: merge` merge as sets, and the `$patch`, `$retainKeys`,
//! `$deleteFromPrimitiveList/<field>` and `$setElementOrder/<field>` directives are obeyed.

use serde_json::{Map, Value};

use super::builtin::{ListStrategy, list_strategy};
use super::schema::PathElem;

const PATCH: &str = "$patch";
const RETAIN_KEYS: &str = "$retainKeys";
const DELETE_FROM_PRIMITIVE_LIST: &str = "$deleteFromPrimitiveList/";
const SET_ELEMENT_ORDER: &str = "$setElementOrder/";

/// Why a strategic merge patch was refused; the server answers 422 (400 for a non-object body).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct StrategicPatchError(pub String);

/// Applies a strategic merge patch to a copy of `target`, an object of the built-in `kind`.
/// Callers check [`super::supports_strategic`] first.
pub fn strategic_merge_patch(kind: &str, target: &Value, patch: &Value) -> Result<Value, StrategicPatchError> {
    let (Some(original), Some(patch)) = (target.as_object(), patch.as_object()) else {
        return Err(StrategicPatchError(
            "a strategic merge patch and its target must be JSON objects".to_string(),
        ));
    };
    let merger = Merger { kind };
    match merger.merge_object(original, patch, &mut Vec::new())? {
        Some(merged) => Ok(merged),
        None => Err(StrategicPatchError(
            "$patch: delete cannot remove the whole object".to_string(),
        )),
    }
}

struct Merger<'a> {
    kind: &'a str,
}

fn is_directive(key: &str) -> bool {
    key == PATCH
        || key == RETAIN_KEYS
        || key.starts_with(DELETE_FROM_PRIMITIVE_LIST)
        || key.starts_with(SET_ELEMENT_ORDER)
}

impl Merger<'_> {
    /// Merges `patch` into `original`; `None` means the object is deleted (`$patch: delete`).
    fn merge_object(
        &self,
        original: &Map<String, Value>,
        patch: &Map<String, Value>,
        path: &mut Vec<PathElem>,
    ) -> Result<Option<Value>, StrategicPatchError> {
        let base = match patch.get(PATCH).map(|directive| directive.as_str()) {
            None | Some(Some("merge")) => original.clone(),
            Some(Some("replace")) => Map::new(),
            Some(Some("delete")) => return Ok(None),
            Some(other) => {
                return Err(StrategicPatchError(format!(
                    "unknown $patch directive {other:?} at {}",
                    super::schema::render(path)
                )));
            }
        };
        let mut merged = base;
        self.delete_from_primitive_lists(&mut merged, patch);
        for (key, value) in patch.iter().filter(|(key, _)| !is_directive(key)) {
            path.push(PathElem::Field(key.clone()));
            let result = self.merge_field(merged.get(key), value, path);
            path.pop();
            match result? {
                Some(value) => merged.insert(key.clone(), value),
                None => merged.remove(key),
            };
        }
        self.set_element_orders(&mut merged, patch, path);
        retain_keys(&mut merged, patch);
        Ok(Some(Value::Object(merged)))
    }

    /// The new value of one field; `None` removes it (a `null` in the patch).
    fn merge_field(
        &self,
        original: Option<&Value>,
        patch: &Value,
        path: &mut Vec<PathElem>,
    ) -> Result<Option<Value>, StrategicPatchError> {
        match patch {
            Value::Null => Ok(None),
            Value::Object(patch) => {
                let empty = Map::new();
                let original = original.and_then(Value::as_object).unwrap_or(&empty);
                self.merge_object(original, patch, path)
            }
            Value::Array(items) => {
                let original = original.and_then(Value::as_array).map(Vec::as_slice).unwrap_or(&[]);
                self.merge_list(original, items, path).map(Some)
            }
            scalar => Ok(Some(scalar.clone())),
        }
    }

    fn merge_list(
        &self,
        original: &[Value],
        patch: &[Value],
        path: &mut Vec<PathElem>,
    ) -> Result<Value, StrategicPatchError> {
        if let Some(replacement) = list_replacement(patch) {
            return self.fresh_items(&replacement, path);
        }
        match list_strategy(self.kind, path) {
            Some(ListStrategy::MergeByKey {
                patch_key: Some(patch_key),
                ..
            }) => self.merge_keyed_list(original, patch, patch_key, path),
            Some(ListStrategy::MergeValues) => Ok(union(original, patch)),
            _ => self.fresh_items(patch, path),
        }
    }

    /// Items that replace a list; objects among them are cleaned of directives and nulls.
    fn fresh_items(&self, items: &[Value], path: &mut Vec<PathElem>) -> Result<Value, StrategicPatchError> {
        path.push(PathElem::Item);
        let mut fresh = Vec::with_capacity(items.len());
        for item in items {
            let cleaned = match item {
                Value::Object(object) => self.merge_object(&Map::new(), object, path),
                other => Ok(Some(other.clone())),
            };
            match cleaned {
                Ok(Some(value)) => fresh.push(value),
                Ok(None) => {}
                Err(error) => {
                    path.pop();
                    return Err(error);
                }
            }
        }
        path.pop();
        Ok(Value::Array(fresh))
    }

    fn merge_keyed_list(
        &self,
        original: &[Value],
        patch: &[Value],
        key: &str,
        path: &mut Vec<PathElem>,
    ) -> Result<Value, StrategicPatchError> {
        let mut merged = original.to_vec();
        path.push(PathElem::Item);
        let result = patch
            .iter()
            .try_for_each(|item| self.merge_keyed_item(&mut merged, item, key, path));
        path.pop();
        result.map(|()| Value::Array(merged))
    }

    fn merge_keyed_item(
        &self,
        merged: &mut Vec<Value>,
        item: &Value,
        key: &str,
        path: &mut Vec<PathElem>,
    ) -> Result<(), StrategicPatchError> {
        let Some(object) = item.as_object() else {
            return Err(StrategicPatchError(format!(
                "{}: list items must be objects with the merge key {key:?}, got {item}",
                super::schema::render(path)
            )));
        };
        let Some(wanted) = object.get(key) else {
            return Err(StrategicPatchError(format!(
                "{}: item {item} does not contain the merge key {key:?}",
                super::schema::render(path)
            )));
        };
        let position = merged.iter().position(|existing| existing.get(key) == Some(wanted));
        let empty = Map::new();
        let existing = position
            .and_then(|index| merged.get(index))
            .and_then(Value::as_object)
            .unwrap_or(&empty);
        let outcome = self.merge_object(existing, object, path)?;
        match (position, outcome) {
            (Some(index), Some(value)) => merged[index] = value,
            (Some(_), None) => merged.retain(|existing| existing.get(key) != Some(wanted)),
            (None, Some(value)) => merged.push(value),
            (None, None) => {}
        }
        Ok(())
    }

    fn delete_from_primitive_lists(&self, merged: &mut Map<String, Value>, patch: &Map<String, Value>) {
        for (directive, doomed) in patch {
            let Some(field) = directive.strip_prefix(DELETE_FROM_PRIMITIVE_LIST) else {
                continue;
            };
            let doomed = doomed.as_array().map(Vec::as_slice).unwrap_or(&[]);
            if let Some(Value::Array(items)) = merged.get_mut(field) {
                items.retain(|item| !doomed.contains(item));
            }
        }
    }

    fn set_element_orders(
        &self,
        merged: &mut Map<String, Value>,
        patch: &Map<String, Value>,
        path: &mut Vec<PathElem>,
    ) {
        for (directive, order) in patch {
            let Some(field) = directive.strip_prefix(SET_ELEMENT_ORDER) else {
                continue;
            };
            path.push(PathElem::Field(field.to_string()));
            let key = match list_strategy(self.kind, path) {
                Some(ListStrategy::MergeByKey { patch_key, .. }) => patch_key,
                _ => None,
            };
            path.pop();
            if let (Some(Value::Array(items)), Some(order)) = (merged.get_mut(field), order.as_array()) {
                reorder(items, order, key);
            }
        }
    }
}

/// A `{"$patch": "replace"}` element makes the rest of the patch list replace the list.
fn list_replacement(patch: &[Value]) -> Option<Vec<Value>> {
    let is_replace = |item: &Value| {
        item.get(PATCH).and_then(Value::as_str) == Some("replace")
            && item.as_object().is_some_and(|object| object.len() == 1)
    };
    patch
        .iter()
        .any(is_replace)
        .then(|| patch.iter().filter(|item| !is_replace(item)).cloned().collect())
}

fn union(original: &[Value], patch: &[Value]) -> Value {
    let mut merged = original.to_vec();
    for item in patch {
        if !merged.contains(item) {
            merged.push(item.clone());
        }
    }
    Value::Array(merged)
}

/// Puts the items named in `order` into that order, using the slots they already occupy, so
/// items the patch did not mention keep their places (close to kube's interleaving).
fn reorder(items: &mut [Value], order: &[Value], key: Option<&str>) {
    let identity = |item: &Value| -> Value {
        match key {
            Some(key) => item.get(key).cloned().unwrap_or(Value::Null),
            None => item.clone(),
        }
    };
    let rank = |item: &Value| order.iter().position(|wanted| identity(wanted) == identity(item));
    let slots: Vec<usize> = (0..items.len()).filter(|&i| rank(&items[i]).is_some()).collect();
    let mut ordered: Vec<Value> = slots.iter().map(|&i| items[i].clone()).collect();
    ordered.sort_by_key(|item| rank(item));
    for (slot, item) in slots.into_iter().zip(ordered) {
        items[slot] = item;
    }
}

fn retain_keys(merged: &mut Map<String, Value>, patch: &Map<String, Value>) {
    if let Some(Value::Array(keep)) = patch.get(RETAIN_KEYS) {
        merged.retain(|key, _| keep.iter().any(|kept| kept.as_str() == Some(key)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn deployment() -> Value {
        json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "web", "finalizers": ["a"]},
            "spec": {"template": {"spec": {
                "containers": [
                    {"name": "app", "image": "app:1",
                     "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]},
                    {"name": "sidecar", "image": "proxy:1"}
                ],
                "tolerations": [{"key": "x"}, {"key": "y"}]
            }}}
        })
    }

    fn patched(patch: Value) -> Value {
        match strategic_merge_patch("Deployment", &deployment(), &patch) {
            Ok(value) => value,
            Err(error) => panic!("patch failed: {error}"),
        }
    }

    fn containers(object: &Value) -> &Value {
        &object["spec"]["template"]["spec"]["containers"]
    }

    #[test]
    fn strategic_merge_of_containers_merges_by_name() {
        let result = patched(json!({"spec": {"template": {"spec": {"containers": [
            {"name": "sidecar", "image": "proxy:2"},
            {"name": "new", "image": "new:1"}
        ]}}}}));
        assert_eq!(
            containers(&result),
            &json!([
                {"name": "app", "image": "app:1",
                 "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]},
                {"name": "sidecar", "image": "proxy:2"},
                {"name": "new", "image": "new:1"}
            ])
        );
    }

    #[test]
    fn env_inside_a_container_merges_by_name() {
        let result = patched(json!({"spec": {"template": {"spec": {"containers": [
            {"name": "app", "env": [{"name": "B", "value": "3"}, {"name": "C", "value": "4"}]}
        ]}}}}));
        assert_eq!(
            containers(&result)[0]["env"],
            json!([
                {"name": "A", "value": "1"}, {"name": "B", "value": "3"}, {"name": "C", "value": "4"}
            ])
        );
    }

    #[test]
    fn strategic_delete_directive_removes_item() {
        let result = patched(json!({"spec": {"template": {"spec": {"containers": [
            {"name": "sidecar", "$patch": "delete"}
        ]}}}}));
        assert_eq!(containers(&result).as_array().map(Vec::len), Some(1));
        assert_eq!(containers(&result)[0]["name"], json!("app"));
    }

    #[test]
    fn replace_directive_in_a_list_replaces_it() {
        let result = patched(json!({"spec": {"template": {"spec": {"containers": [
            {"$patch": "replace"}, {"name": "only", "image": "only:1"}
        ]}}}}));
        assert_eq!(containers(&result), &json!([{"name": "only", "image": "only:1"}]));
    }

    #[test]
    fn replace_directive_in_a_map_replaces_it() {
        let result = patched(json!({"spec": {"template": {"spec": {
            "$patch": "replace", "containers": [{"name": "x", "image": "x:1"}]
        }}}}));
        assert_eq!(
            result["spec"]["template"]["spec"],
            json!({"containers": [{"name": "x", "image": "x:1"}]})
        );
    }

    #[test]
    fn lists_without_merge_key_are_replaced() {
        let result = patched(json!({"spec": {"template": {"spec": {
            "tolerations": [{"key": "z"}]
        }}}}));
        assert_eq!(result["spec"]["template"]["spec"]["tolerations"], json!([{"key": "z"}]));
    }

    #[test]
    fn null_deletes_a_key() {
        let result = patched(json!({"spec": {"template": {"spec": {"containers": [
            {"name": "app", "env": null}
        ]}}}}));
        assert_eq!(containers(&result)[0], json!({"name": "app", "image": "app:1"}));
    }

    #[test]
    fn finalizers_merge_as_a_set_and_delete_from_primitive_list() {
        let added = patched(json!({"metadata": {"finalizers": ["b", "a"]}}));
        assert_eq!(added["metadata"]["finalizers"], json!(["a", "b"]));
        let removed = patched(json!({"metadata": {"$deleteFromPrimitiveList/finalizers": ["a"]}}));
        assert_eq!(removed["metadata"]["finalizers"], json!([]));
    }

    #[test]
    fn retain_keys_drops_unlisted_fields() {
        let result = patched(json!({"spec": {"template": {"spec": {"containers": [
            {"name": "app", "$retainKeys": ["name", "image"], "image": "app:2"}
        ]}}}}));
        assert_eq!(containers(&result)[0], json!({"name": "app", "image": "app:2"}));
    }

    #[test]
    fn set_element_order_reorders_merged_items() {
        let result = patched(json!({"spec": {"template": {"spec": {
            "$setElementOrder/containers": [{"name": "sidecar"}, {"name": "app"}]
        }}}}));
        assert_eq!(containers(&result)[0]["name"], json!("sidecar"));
        assert_eq!(containers(&result)[1]["name"], json!("app"));
    }

    #[test]
    fn item_without_merge_key_is_an_error() {
        let patch = json!({"spec": {"template": {"spec": {"containers": [{"image": "x"}]}}}});
        assert!(strategic_merge_patch("Deployment", &deployment(), &patch).is_err());
    }

    #[test]
    fn new_items_are_cleaned_of_directives_and_nulls() {
        let result = patched(json!({"spec": {"template": {"spec": {"containers": [
            {"name": "new", "image": "n:1", "args": null, "$patch": "merge"}
        ]}}}}));
        assert_eq!(containers(&result)[2], json!({"name": "new", "image": "n:1"}));
    }

    /// Fixture `strategic-merge-builtin` of kube-apiserver-1.24-answers.md.
    #[test]
    fn strategic_merge_of_a_config_map_adds_data() {
        let live = json!({"kind": "ConfigMap", "data": {"k": "v"}});
        let result = strategic_merge_patch("ConfigMap", &live, &json!({"data": {"m": "n"}}));
        assert_eq!(result, Ok(json!({"kind": "ConfigMap", "data": {"k": "v", "m": "n"}})));
    }

    #[test]
    fn service_ports_merge_by_port() {
        let live = json!({"spec": {"ports": [{"port": 80, "name": "http"}, {"port": 443}]}});
        let patch = json!({"spec": {"ports": [{"port": 80, "name": "web"}]}});
        let result = strategic_merge_patch("Service", &live, &patch);
        assert_eq!(
            result,
            Ok(json!({"spec": {"ports": [{"port": 80, "name": "web"}, {"port": 443}]}}))
        );
    }
}
