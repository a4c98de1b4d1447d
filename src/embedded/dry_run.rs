//! `dryRun=All`: the write runs against a scratch store holding copies of what it can touch (the
//! resource's objects in scope and their namespace), so the answer is the one the real write would
//! get, and nothing is stored, watched or collected. `kubectl diff` and `--dry-run=server` use it.
//!
//! The scratch store numbers its copies afresh, so resourceVersion preconditions are checked here
//! against the real objects first and then dropped from the request; the answer carries the real
//! resourceVersion (none for a create), as kube-apiserver's dry runs do.

use serde_json::Value;

use super::discovery::ResourceInfo;
use super::status::ApiError;
use super::store::{GroupResource, Store, Write};

/// A dry run under way.
pub struct DryRun {
    /// The real object the write addresses, if it exists.
    pub current: Option<Value>,
}

/// A scratch copy of the objects a write to `info` in `namespace` can read or change.
pub fn scratch(store: &Store, info: &ResourceInfo, namespace: Option<&str>) -> Store {
    let copy = Store::new();
    let put = |resource: &GroupResource, object: Value| {
        let ns = object["metadata"]["namespace"].as_str().unwrap_or("").to_string();
        let name = object["metadata"]["name"].as_str().unwrap_or("").to_string();
        // Writing a fresh store cannot conflict.
        let _ = copy.write(resource, &ns, &name, |_| Ok(Write::Put(object)));
    };
    let namespaces = GroupResource::new("", "namespaces");
    if let Some(ns) = namespace
        && let Some(object) = store.get(&namespaces, "", ns)
    {
        put(&namespaces, object);
    }
    let resource = info.storage_key();
    for object in store.list(&resource, namespace).0 {
        put(&resource, object);
    }
    copy
}

/// Checks a `metadata.resourceVersion` (or `preconditions.resourceVersion` of DeleteOptions) in a
/// JSON body against the real object, then removes it so the scratch copy does not refuse it.
pub fn check_and_strip_precondition(
    body: &[u8],
    current: Option<&Value>,
    info: &ResourceInfo,
    name: &str,
) -> Result<Vec<u8>, ApiError> {
    let Ok(mut value) = serde_json::from_slice::<Value>(body) else {
        // Not JSON (YAML apply, empty delete): nothing to strip; the verb reports parse errors.
        return Ok(body.to_vec());
    };
    let current_rv = current.and_then(|c| c["metadata"]["resourceVersion"].as_str());
    let mut stripped = false;
    for (parent, field) in [("metadata", "resourceVersion"), ("preconditions", "resourceVersion")] {
        let Some(map) = value.get_mut(parent).and_then(Value::as_object_mut) else {
            continue;
        };
        if let Some(rv) = map.get(field).and_then(Value::as_str).filter(|rv| !rv.is_empty()) {
            if Some(rv) != current_rv {
                return Err(ApiError::stale(&info.group, &info.plural, name));
            }
            map.remove(field);
            stripped = true;
        }
    }
    if !stripped {
        return Ok(body.to_vec());
    }
    Ok(value.to_string().into_bytes())
}

/// The answer of a dry run with the real object's resourceVersion (none for a would-be create).
pub fn restore_resource_version(mut answer: Value, current: Option<&Value>) -> Value {
    if answer["kind"] == "Status" || answer["items"].is_array() {
        return answer;
    }
    if let Some(meta) = answer.get_mut("metadata").and_then(Value::as_object_mut) {
        match current.and_then(|c| c["metadata"].get("resourceVersion")) {
            Some(rv) => {
                meta.insert("resourceVersion".into(), rv.clone());
            }
            None => {
                meta.remove("resourceVersion");
            }
        }
    }
    answer
}
