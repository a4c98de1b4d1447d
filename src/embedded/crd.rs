//! What kube-apiserver's apiextensions controllers do for CustomResourceDefinitions: checks, the
//! `Established` status, and the cleanup finalizer that holds a deleted CRD until its objects are
//! gone ([`crd_cleanup`](super::crd_cleanup) deletes them).

use std::sync::Arc;

use serde_json::{Value, json};

use super::discovery::{ResourceInfo, crd_resource, crd_resources};
use super::object_meta::{meta_str, now_timestamp};
use super::schema;
use super::status::{ApiError, Cause};
use super::store::{Store, Write};

/// Holds a deleted CRD until its custom resources are gone.
pub const CLEANUP_FINALIZER: &str = "customresourcecleanup.apiextensions.k8s.io";

pub fn is_crd(info: &ResourceInfo) -> bool {
    info.storage_key() == crd_resource()
}

pub fn validate_crd(crd: &Value) -> Vec<Cause> {
    let spec = &crd["spec"];
    let expected = format!(
        "{}.{}",
        spec["names"]["plural"].as_str().unwrap_or(""),
        spec["group"].as_str().unwrap_or("")
    );
    let name = meta_str(crd, "name").unwrap_or("");
    let mut causes = Vec::new();
    if name != expected {
        causes.push(Cause::invalid(
            "metadata.name",
            &json!(name),
            "must be spec.names.plural+\".\"+spec.group",
        ));
    }
    let versions = spec["versions"].as_array().map(Vec::as_slice).unwrap_or_default();
    if versions.iter().filter(|v| v["storage"].as_bool() == Some(true)).count() != 1 {
        causes.push(Cause::invalid(
            "spec.versions",
            &json!(versions.len()),
            "must have exactly one version marked as storage version",
        ));
    }
    for (i, version) in versions.iter().enumerate() {
        let path = format!("spec.versions[{i}].schema.openAPIV3Schema");
        match version["schema"].get("openAPIV3Schema") {
            Some(schema) => causes.extend(schema::structural_errors(schema, &path)),
            None => causes.push(Cause::required(&path, "schemas are required")),
        }
    }
    causes
}

/// What a real server's CRD controllers write to status within milliseconds of a create.
pub fn establish_crd(crd: &mut Value) {
    let now = now_timestamp();
    let condition = |type_: &str, reason: &str, message: &str| json!({"type": type_, "status": "True", "lastTransitionTime": now, "reason": reason, "message": message});
    let storage: Vec<Value> = crd["spec"]["versions"]
        .as_array()
        .map(|vs| {
            vs.iter()
                .filter(|v| v["storage"].as_bool() == Some(true))
                .map(|v| v["name"].clone())
                .collect()
        })
        .unwrap_or_default();
    let mut accepted = crd["spec"]["names"].clone();
    if !accepted.is_object() {
        accepted = json!({});
    }
    if accepted["listKind"].is_null() {
        accepted["listKind"] = json!(format!("{}List", accepted["kind"].as_str().unwrap_or("")));
    }
    if accepted["singular"].is_null() {
        accepted["singular"] = json!(accepted["kind"].as_str().unwrap_or("").to_lowercase());
    }
    crd["status"] = json!({
        "acceptedNames": accepted,
        "conditions": [
            condition("NamesAccepted", "NoConflicts", "no conflicts found"),
            condition("Established", "InitialNamesAccepted", "the initial names have been accepted"),
        ],
        "storedVersions": storage,
    });
}

/// A changed CRD gets fresh accepted names; `storedVersions` only ever grows.
pub fn reestablish_crd(old: &Value, new: &mut Value) {
    establish_crd(new);
    let mut stored: Vec<Value> = old["status"]["storedVersions"].as_array().cloned().unwrap_or_default();
    for version in new["status"]["storedVersions"].as_array().cloned().unwrap_or_default() {
        if !stored.contains(&version) {
            stored.push(version);
        }
    }
    new["status"]["storedVersions"] = json!(stored);
}

/// A deleted CRD takes its custom resources with it.
pub fn remove_custom_resources(store: &Store, crd: &Value) {
    let Some(info) = crd_resources(crd).into_iter().next() else {
        return;
    };
    let key = info.storage_key();
    for object in store.list_shared(&key, None).0 {
        let ns = meta_str(&object, "namespace").unwrap_or("").to_string();
        let name = meta_str(&object, "name").unwrap_or("").to_string();
        // Already gone is fine: someone else removed it meanwhile.
        let _ = store.write(&key, &ns, &name, |current| {
            Ok(Write::Remove(current.cloned().unwrap_or_default()))
        });
    }
}

/// The CRD serving `info`, when it is a custom resource.
fn definition_of(store: &Store, info: &ResourceInfo) -> Option<Arc<Value>> {
    info.schema.as_ref()?;
    store.get_shared(&crd_resource(), "", &format!("{}.{}", info.plural, info.group))
}

/// A terminating CRD accepts no new objects (everything else still works, so finalizers can run).
pub fn check_accepts_creates(store: &Store, info: &ResourceInfo) -> Result<(), ApiError> {
    let terminating = definition_of(store, info).is_some_and(|crd| crd["metadata"]["deletionTimestamp"].is_string());
    if terminating {
        return Err(ApiError::new(
            405,
            "MethodNotAllowed",
            "create not allowed while custom resource definition is terminating",
        ));
    }
    Ok(())
}
