//! `dryRun=All`: the write runs against a scratch store holding copies of what it can touch (the
//! resource's objects in scope and their namespace), so the answer is the one the real write would
//! get, and nothing is stored, watched or collected. `kubectl diff` and `--dry-run=server` use it.
//!
//! The scratch store numbers its copies afresh, so resourceVersion preconditions are checked here
//! against the real objects first and then dropped from the request; the answer carries the real
//! resourceVersion (none for a create), as kube-apiserver's dry runs do.

use axum::body::Body;
use axum::http::header;
use axum::response::Response;
use serde_json::Value;

use super::discovery::ResourceInfo;
use super::status::{ApiError, json_response};
use super::store::{GroupResource, Store, Write};

/// Largest answer re-read to restore its resourceVersion.
const MAX_ANSWER: usize = 64 * 1024 * 1024;

/// Whether the `dryRun` parameter asks for a dry run of this request (only `All` exists).
pub fn requested(parameter: Option<&str>, writes: bool) -> Result<bool, ApiError> {
    match parameter {
        None | Some("") => Ok(false),
        Some("All") => Ok(writes),
        Some(other) => Err(ApiError::bad_request(format!(
            "Unsupported value: \"{other}\": supported values: \"All\""
        ))),
    }
}

/// A dry run under way.
pub struct DryRun {
    /// The real object the write addresses, if it exists.
    current: Option<Value>,
}

/// Starts a dry run of a write to `name` (none for a collection): the request body to use and
/// the scratch store to write to.
pub fn prepare(
    store: &Store,
    info: &ResourceInfo,
    namespace: Option<&str>,
    name: Option<&str>,
    body: &[u8],
) -> Result<(DryRun, Vec<u8>, Store), ApiError> {
    let current = name.and_then(|name| store.get(&info.storage_key(), namespace.unwrap_or(""), name));
    let body = check_and_strip_precondition(body, current.as_ref(), info, name.unwrap_or(""))?;
    Ok((DryRun { current }, body, scratch(store, info, namespace)))
}

impl DryRun {
    /// The write's answer with the real resourceVersion.
    pub async fn answer(&self, response: Response) -> Result<Response, ApiError> {
        let (parts, body) = response.into_parts();
        let bytes = axum::body::to_bytes(body, MAX_ANSWER)
            .await
            .map_err(|e| ApiError::internal(e.to_string()))?;
        let Ok(answer) = serde_json::from_slice::<Value>(&bytes) else {
            return Ok(Response::from_parts(parts, Body::from(bytes)));
        };
        let answer = restore_resource_version(answer, self.current.as_ref());
        let mut response = json_response(parts.status, &answer);
        *response.headers_mut() = parts.headers;
        response.headers_mut().remove(header::CONTENT_LENGTH);
        Ok(response)
    }
}

/// A scratch copy of the objects a write to `info` in `namespace` can read or change.
fn scratch(store: &Store, info: &ResourceInfo, namespace: Option<&str>) -> Store {
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
fn check_and_strip_precondition(
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
fn restore_resource_version(mut answer: Value, current: Option<&Value>) -> Value {
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
