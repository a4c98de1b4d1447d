//! ResourceQuota admission of pods, as far as the count goes: a pod its namespace's quota has no
//! room for under `pods` (or `count/pods`) is refused with the API server's words (403 `exceeded
//! quota: …`), whether a client or a controller loop creates it; the loops then report the refusal
//! as kube's do (a ReplicaSet's `ReplicaFailure` condition). Pods that ended (Succeeded, Failed)
//! count no more. Simplification: CPU, memory and the other quota resources are not counted.

use serde_json::Value;

use super::discovery::ResourceInfo;
use super::status::ApiError;
use super::store::{GroupResource, Store};

const COUNTED: [&str; 2] = ["pods", "count/pods"];

/// Refuses the creation of pod `name` in `namespace` when a quota there is used up.
pub(super) fn admit(store: &Store, info: &ResourceInfo, namespace: &str, name: &str) -> Result<(), ApiError> {
    if !(info.group.is_empty() && info.plural == "pods") {
        return Ok(());
    }
    let (quotas, _) = store.list_shared(&GroupResource::new("", "resourcequotas"), Some(namespace));
    let limits: Vec<(&str, &str, u64)> = quotas
        .iter()
        .flat_map(|quota| {
            let quota_name = quota["metadata"]["name"].as_str().unwrap_or("");
            COUNTED
                .iter()
                .filter_map(move |key| Some((quota_name, *key, hard(&quota["spec"]["hard"][key])?)))
        })
        .collect();
    if limits.is_empty() {
        return Ok(());
    }
    let (pods, _) = store.list_shared(&GroupResource::new("", "pods"), Some(namespace));
    let used = pods
        .iter()
        .filter(|pod| !matches!(pod["status"]["phase"].as_str(), Some("Succeeded" | "Failed")))
        .count() as u64;
    match limits.into_iter().find(|(_, _, hard)| used >= *hard) {
        None => Ok(()),
        Some((quota, key, hard)) => {
            let why = format!("exceeded quota: {quota}, requested: {key}=1, used: {key}={used}, limited: {key}={hard}");
            Err(ApiError::forbidden("", "pods", name, &why))
        }
    }
}

/// A count in `spec.hard` (a quantity without a suffix; anything else is not a count).
fn hard(value: &Value) -> Option<u64> {
    match value {
        Value::String(text) => text.parse().ok(),
        other => other.as_u64(),
    }
}
