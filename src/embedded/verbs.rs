//! The API verbs on `serde_json::Value` objects with kube-apiserver semantics. Used by the HTTP
//! layer and, later, by in-process controllers; nothing here knows about HTTP.

use base64::Engine;
use rand::Rng;
use serde_json::{Value, json};

use super::discovery::{ResourceInfo, crd_resources};
use super::schema;
use super::selectors::{FieldSelector, LabelSelector};
use super::status::{ApiError, Cause};
use super::store::{GroupResource, Store, Write};
use super::validation::{apply_builtin_defaults, finalizers, validate_object, validate_update};

/// Which part of an object a write addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Subresource {
    Main,
    Status,
    /// A Namespace's `/finalize`: only `spec.finalizers` changes.
    Finalize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PatchType {
    Merge,
    Json,
}

#[derive(Debug, Clone, Default)]
pub struct ListOptions {
    pub label_selector: LabelSelector,
    pub field_selector: FieldSelector,
    pub limit: Option<usize>,
    pub continue_token: Option<String>,
}

#[derive(Debug, Clone, Default)]
pub struct DeleteOptions {
    pub precondition_uid: Option<String>,
    pub precondition_resource_version: Option<String>,
    pub propagation_policy: Option<String>,
}

pub fn now_timestamp() -> String {
    jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

pub fn new_uid() -> String {
    let mut bytes: [u8; 16] = rand::rng().random();
    bytes[6] = (bytes[6] & 0x0f) | 0x40;
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    let hex = hex::encode(bytes);
    format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

/// The 5-character suffix of `generateName` (Kubernetes' alphabet without vowels and lookalikes).
fn random_suffix() -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let mut rng = rand::rng();
    (0..5)
        .map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char)
        .collect()
}

fn namespace_resource() -> GroupResource {
    GroupResource::new("", "namespaces")
}

fn crd_resource() -> GroupResource {
    GroupResource::new("apiextensions.k8s.io", "customresourcedefinitions")
}

fn is_crd(info: &ResourceInfo) -> bool {
    info.storage_key() == crd_resource()
}

/// The object as served in this version.
fn present(info: &ResourceInfo, mut object: Value) -> Value {
    object["apiVersion"] = json!(info.api_version());
    object["kind"] = json!(info.kind);
    object
}

fn meta_str<'a>(object: &'a Value, field: &str) -> Option<&'a str> {
    object["metadata"][field].as_str().filter(|s| !s.is_empty())
}

pub fn get(
    store: &Store,
    info: &ResourceInfo,
    namespace: &str,
    name: &str,
) -> Result<Value, ApiError> {
    store
        .get(&info.storage_key(), namespace, name)
        .map(|o| present(info, o))
        .ok_or_else(|| ApiError::not_found(&info.group, &info.plural, name))
}

#[derive(serde::Serialize, serde::Deserialize)]
struct ContinueToken {
    rv: u64,
    start: (String, String),
}

pub fn list(
    store: &Store,
    info: &ResourceInfo,
    namespace: Option<&str>,
    options: &ListOptions,
) -> Result<Value, ApiError> {
    let (objects, current_rv) = store.list(&info.storage_key(), namespace);
    let token = options
        .continue_token
        .as_deref()
        .map(decode_continue)
        .transpose()?;
    let list_rv = token.as_ref().map_or(current_rv, |t| t.rv);
    let key = |o: &Value| {
        (
            meta_str(o, "namespace").unwrap_or("").to_string(),
            meta_str(o, "name").unwrap_or("").to_string(),
        )
    };
    let mut matching = objects.into_iter().filter(|o| {
        options.label_selector.matches(o)
            && options.field_selector.matches(o)
            && token.as_ref().is_none_or(|t| key(o) > t.start)
    });
    let limit = options.limit.filter(|l| *l > 0).unwrap_or(usize::MAX);
    let items: Vec<Value> = matching
        .by_ref()
        .take(limit)
        .map(|o| present(info, o))
        .collect();
    let remaining = matching.count();
    let mut metadata = json!({"resourceVersion": list_rv.to_string()});
    if remaining > 0
        && let Some(last) = items.last()
    {
        let token = ContinueToken {
            rv: list_rv,
            start: key(last),
        };
        metadata["continue"] = json!(encode_continue(&token));
        metadata["remainingItemCount"] = json!(remaining);
    }
    Ok(json!({
        "kind": format!("{}List", info.kind),
        "apiVersion": info.api_version(),
        "metadata": metadata,
        "items": items,
    }))
}

fn encode_continue(token: &ContinueToken) -> String {
    let raw = serde_json::to_vec(token).unwrap_or_default();
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(raw)
}

fn decode_continue(token: &str) -> Result<ContinueToken, ApiError> {
    let bad = || {
        ApiError::bad_request("continue key is not valid: incorrect encoded start resourceVersion")
    };
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(token)
        .map_err(|_| bad())?;
    serde_json::from_slice(&raw).map_err(|_| bad())
}

/// Checks `kind`/`apiVersion` in a request body against the URL.
fn check_type(info: &ResourceInfo, body: &Value) -> Result<(), ApiError> {
    if !body.is_object() {
        return Err(ApiError::bad_request(
            "the body of the request must be a JSON object",
        ));
    }
    let kind = body["kind"].as_str().unwrap_or(&info.kind);
    let api_version = body["apiVersion"]
        .as_str()
        .map(String::from)
        .unwrap_or_else(|| info.api_version());
    let same_group = api_version.rsplit_once('/').map_or("", |(g, _)| g) == info.group;
    if kind != info.kind || !same_group {
        return Err(ApiError::bad_request(format!(
            "the API version in the data ({api_version}) does not match the expected API version ({})",
            info.api_version()
        )));
    }
    Ok(())
}

fn check_namespace(info: &ResourceInfo, body: &mut Value, namespace: &str) -> Result<(), ApiError> {
    if !info.namespaced {
        if let Some(meta) = body["metadata"].as_object_mut() {
            meta.remove("namespace");
        }
        return Ok(());
    }
    match meta_str(body, "namespace") {
        Some(ns) if ns != namespace => Err(ApiError::bad_request(
            "the namespace of the provided object does not match the namespace sent on the request",
        )),
        _ => {
            body["metadata"]["namespace"] = json!(namespace);
            Ok(())
        }
    }
}

/// Creates need an existing namespace that is not terminating.
fn check_namespace_accepts(
    store: &Store,
    info: &ResourceInfo,
    namespace: &str,
    name: &str,
) -> Result<(), ApiError> {
    if !info.namespaced {
        return Ok(());
    }
    let Some(ns) = store.get(&namespace_resource(), "", namespace) else {
        return Err(ApiError::not_found("", "namespaces", namespace));
    };
    if ns["metadata"]["deletionTimestamp"].is_string() {
        let why = format!(
            "unable to create new content in namespace {namespace} because it is being terminated"
        );
        return Err(ApiError::forbidden(&info.group, &info.plural, name, &why));
    }
    Ok(())
}

/// Defaulting, pruning and validation shared by create and update.
fn admit(info: &ResourceInfo, object: &mut Value, uid: &str) -> Result<(), ApiError> {
    apply_builtin_defaults(info, object, uid);
    let mut causes = Vec::new();
    if let Some(schema) = &info.schema {
        schema::prune_and_default(schema, object);
        causes.extend(schema::validate(schema, object));
    }
    causes.extend(validate_object(info, object));
    if is_crd(info) {
        causes.extend(validate_crd(object));
    }
    if causes.is_empty() {
        Ok(())
    } else {
        let name = meta_str(object, "name").unwrap_or("");
        Err(ApiError::invalid(&info.group, &info.kind, name, causes))
    }
}

fn validate_crd(crd: &Value) -> Vec<Cause> {
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
    let versions = spec["versions"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default();
    if versions
        .iter()
        .filter(|v| v["storage"].as_bool() == Some(true))
        .count()
        != 1
    {
        causes.push(Cause::invalid(
            "spec.versions",
            &json!(versions.len()),
            "must have exactly one version marked as storage version",
        ));
    }
    causes
}

/// What a real server's CRD controllers write to status within milliseconds of a create.
fn establish_crd(crd: &mut Value) {
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
fn reestablish_crd(old: &Value, new: &mut Value) {
    establish_crd(new);
    let mut stored: Vec<Value> = old["status"]["storedVersions"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    for version in new["status"]["storedVersions"]
        .as_array()
        .cloned()
        .unwrap_or_default()
    {
        if !stored.contains(&version) {
            stored.push(version);
        }
    }
    new["status"]["storedVersions"] = json!(stored);
}

pub fn create(
    store: &Store,
    info: &ResourceInfo,
    namespace: &str,
    mut body: Value,
) -> Result<Value, ApiError> {
    check_type(info, &body)?;
    check_namespace(info, &mut body, namespace)?;
    if meta_str(&body, "name").is_none()
        && let Some(prefix) = meta_str(&body, "generateName")
    {
        body["metadata"]["name"] = json!(format!("{prefix}{}", random_suffix()));
    }
    let name = meta_str(&body, "name").unwrap_or("").to_string();
    check_namespace_accepts(store, info, namespace, &name)?;
    let uid = new_uid();
    let mut object = present(info, body);
    if let Some(meta) = object["metadata"].as_object_mut() {
        for server_owned in [
            "resourceVersion",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "generation",
            "selfLink",
        ] {
            meta.remove(server_owned);
        }
        meta.insert("uid".into(), json!(uid));
        meta.insert("creationTimestamp".into(), json!(now_timestamp()));
        if info.tracks_generation {
            meta.insert("generation".into(), json!(1));
        }
    }
    if info.status_subresource
        && let Some(map) = object.as_object_mut()
    {
        map.remove("status");
    }
    admit(info, &mut object, &uid)?;
    if is_crd(info) {
        establish_crd(&mut object);
    }
    let (created, _) = store.write(
        &info.storage_key(),
        namespace,
        &name,
        |current| match current {
            Some(_) => Err(ApiError::already_exists(&info.group, &info.plural, &name)),
            None => Ok(Write::Put(object)),
        },
    )?;
    Ok(present(info, created))
}

/// Everything outside `metadata` (and `status` when it has its own endpoint): what `generation` tracks.
fn spec_part(info: &ResourceInfo, object: &Value) -> Value {
    let mut part = object.clone();
    if let Some(map) = part.as_object_mut() {
        for key in ["metadata", "apiVersion", "kind"] {
            map.remove(key);
        }
        if info.status_subresource {
            map.remove("status");
        }
    }
    part
}

/// Equal apart from the fields the server bumps on every write.
fn same_content(a: &Value, b: &Value) -> bool {
    let strip = |v: &Value| {
        let mut v = v.clone();
        if let Some(meta) = v["metadata"].as_object_mut() {
            meta.remove("resourceVersion");
            meta.remove("managedFields");
        }
        v
    };
    strip(a) == strip(b)
}

/// Turns a requested new state into the write to make, with kube-apiserver's update rules.
fn prepare_update(
    info: &ResourceInfo,
    old: &Value,
    requested: Value,
    sub: Subresource,
) -> Result<Write, ApiError> {
    let name = meta_str(old, "name").unwrap_or("").to_string();
    if let Some(rv) = meta_str(&requested, "resourceVersion")
        && Some(rv) != meta_str(old, "resourceVersion")
    {
        return Err(ApiError::stale(&info.group, &info.plural, &name));
    }
    // A uid in the body is a precondition: the object must not have been replaced meanwhile.
    let old_uid = meta_str(old, "uid").unwrap_or("");
    if let Some(uid) = meta_str(&requested, "uid")
        && uid != old_uid
    {
        let why = format!(
            "Precondition failed: UID in precondition: {uid}, UID in object meta: {old_uid}"
        );
        return Err(ApiError::conflict(&info.group, &info.plural, &name, &why));
    }
    let old = present(info, old.clone());
    let mut new = match sub {
        // Only status moves through /status; everything else stays as stored.
        Subresource::Status => {
            let mut new = old.clone();
            new["status"] = requested["status"].clone();
            new
        }
        Subresource::Main => {
            let mut new = present(info, requested);
            if info.status_subresource {
                new["status"] = old["status"].clone();
            }
            new
        }
        Subresource::Finalize => {
            let mut new = old.clone();
            new["spec"]["finalizers"] = requested["spec"]["finalizers"].clone();
            new
        }
    };
    if let Some(map) = new.as_object_mut()
        && map.get("status").is_some_and(Value::is_null)
    {
        map.remove("status");
    }
    keep_server_metadata(&old, &mut new);
    let uid = meta_str(&old, "uid").unwrap_or("").to_string();
    admit(info, &mut new, &uid)?;
    let causes = validate_update(info, &old, &new);
    if !causes.is_empty() {
        return Err(ApiError::invalid(&info.group, &info.kind, &name, causes));
    }
    if info.tracks_generation && spec_part(info, &old) != spec_part(info, &new) {
        let generation = old["metadata"]["generation"].as_i64().unwrap_or(0);
        new["metadata"]["generation"] = json!(generation + 1);
        if is_crd(info) {
            reestablish_crd(&old, &mut new);
        }
    }
    if same_content(&old, &new) {
        return Ok(Write::Unchanged(old));
    }
    if is_deleting(&new) && !holds_deletion(info, &new) {
        return Ok(Write::Remove(new));
    }
    Ok(Write::Put(new))
}

/// Metadata only the server writes.
fn keep_server_metadata(old: &Value, new: &mut Value) {
    if !new["metadata"].is_object() {
        new["metadata"] = json!({});
    }
    for field in [
        "name",
        "namespace",
        "uid",
        "creationTimestamp",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
        "generation",
        "resourceVersion",
    ] {
        match old["metadata"].get(field) {
            Some(value) => new["metadata"][field] = value.clone(),
            None => {
                if let Some(meta) = new["metadata"].as_object_mut() {
                    meta.remove(field);
                }
            }
        }
    }
}

fn is_deleting(object: &Value) -> bool {
    object["metadata"]["deletionTimestamp"].is_string()
}

/// Finalizers that keep a deleting object stored (namespaces also wait for `spec.finalizers`).
fn holds_deletion(info: &ResourceInfo, object: &Value) -> bool {
    let spec_finalizers = info.storage_key() == namespace_resource()
        && object["spec"]["finalizers"]
            .as_array()
            .is_some_and(|f| !f.is_empty());
    !finalizers(object).is_empty() || spec_finalizers
}

pub fn update(
    store: &Store,
    info: &ResourceInfo,
    namespace: &str,
    name: &str,
    mut body: Value,
    sub: Subresource,
) -> Result<Value, ApiError> {
    check_type(info, &body)?;
    check_namespace(info, &mut body, namespace)?;
    if meta_str(&body, "name").is_some_and(|n| n != name) {
        let body_name = meta_str(&body, "name").unwrap_or("");
        return Err(ApiError::bad_request(format!(
            "the name of the object ({body_name}) does not match the name on the URL ({name})"
        )));
    }
    write_existing(store, info, namespace, name, |old| {
        prepare_update(info, old, body, sub)
    })
}

/// A write to an object that must exist, with post-removal cleanup.
fn write_existing<F>(
    store: &Store,
    info: &ResourceInfo,
    namespace: &str,
    name: &str,
    decide: F,
) -> Result<Value, ApiError>
where
    F: FnOnce(&Value) -> Result<Write, ApiError>,
{
    let mut removed = false;
    let (object, _) = store.write(&info.storage_key(), namespace, name, |current| {
        let current =
            current.ok_or_else(|| ApiError::not_found(&info.group, &info.plural, name))?;
        let write = decide(current)?;
        removed = matches!(write, Write::Remove(_));
        Ok(write)
    })?;
    if removed {
        after_removal(store, info, &object);
    }
    Ok(present(info, object))
}

/// Cleanup a real server does asynchronously when an object is finally gone.
fn after_removal(store: &Store, info: &ResourceInfo, object: &Value) {
    if is_crd(info) {
        remove_custom_resources(store, object);
    }
}

/// A deleted CRD takes its custom resources with it.
fn remove_custom_resources(store: &Store, crd: &Value) {
    let Some(info) = crd_resources(crd).into_iter().next() else {
        return;
    };
    let key = info.storage_key();
    for object in store.list(&key, None).0 {
        let ns = meta_str(&object, "namespace").unwrap_or("").to_string();
        let name = meta_str(&object, "name").unwrap_or("").to_string();
        // Already gone is fine: someone else removed it meanwhile.
        let _ = store.write(&key, &ns, &name, |current| {
            Ok(Write::Remove(current.cloned().unwrap_or_default()))
        });
    }
}

/// Applies a merge or JSON patch to `target` with apiserver semantics.
pub fn apply_patch(
    target: &mut Value,
    patch_type: PatchType,
    patch: &[u8],
) -> Result<(), ApiError> {
    match patch_type {
        PatchType::Merge => {
            let patch: Value = serde_json::from_slice(patch)
                .map_err(|e| ApiError::bad_request(format!("error decoding patch: {e}")))?;
            json_patch::merge(target, &patch);
            Ok(())
        }
        PatchType::Json => {
            let patch: json_patch::Patch = serde_json::from_slice(patch)
                .map_err(|e| ApiError::bad_request(format!("error decoding patch: {e}")))?;
            for operation in &patch.0 {
                apply_json_operation(target, operation)?;
            }
            Ok(())
        }
    }
}

/// One JSON-patch operation; `test` of a missing path compares against null, as Go's library does.
fn apply_json_operation(
    target: &mut Value,
    operation: &json_patch::PatchOperation,
) -> Result<(), ApiError> {
    let invalid = |message: String| ApiError::new(422, "Invalid", message);
    if let json_patch::PatchOperation::Test(test) = operation {
        let actual = target
            .pointer(test.path.as_str())
            .cloned()
            .unwrap_or(Value::Null);
        if actual != test.value {
            return Err(invalid(format!(
                "the server rejected our request due to an error in our request: testing value {} failed",
                test.path
            )));
        }
        return Ok(());
    }
    json_patch::patch(target, std::slice::from_ref(operation)).map_err(|e| {
        invalid(format!(
            "the server rejected our request due to an error in our request: {e}"
        ))
    })
}

pub fn patch(
    store: &Store,
    info: &ResourceInfo,
    namespace: &str,
    name: &str,
    patch_type: PatchType,
    patch: &[u8],
    sub: Subresource,
) -> Result<Value, ApiError> {
    write_existing(store, info, namespace, name, |old| {
        let mut target = present(info, old.clone());
        apply_patch(&mut target, patch_type, patch)?;
        prepare_update(info, old, target, sub)
    })
}

pub fn delete(
    store: &Store,
    info: &ResourceInfo,
    namespace: &str,
    name: &str,
    options: &DeleteOptions,
) -> Result<Value, ApiError> {
    let gc_finalizer = propagation_finalizer(info, options.propagation_policy.as_deref())?;
    write_existing(store, info, namespace, name, |current| {
        check_preconditions(info, current, options)?;
        if is_deleting(current) {
            return Ok(Write::Unchanged(current.clone()));
        }
        let mut deleting = current.clone();
        deleting["metadata"]["deletionTimestamp"] = json!(now_timestamp());
        deleting["metadata"]["deletionGracePeriodSeconds"] = json!(0);
        if let Some(gc_finalizer) = gc_finalizer {
            add_finalizer(&mut deleting, gc_finalizer);
        }
        if info.storage_key() == namespace_resource() {
            deleting["status"]["phase"] = json!("Terminating");
        }
        if holds_deletion(info, &deleting) {
            Ok(Write::Put(deleting))
        } else {
            Ok(Write::Remove(current.clone()))
        }
    })
}

/// Finalizer the garbage collector handles for Orphan and Foreground deletions.
pub const ORPHAN_FINALIZER: &str = "orphan";
pub const FOREGROUND_FINALIZER: &str = "foregroundDeletion";

/// The finalizer a deletion's propagation policy asks for. batch/v1 Jobs orphan by default, as on
/// the real server; everything else here deletes dependents in the background.
fn propagation_finalizer(
    info: &ResourceInfo,
    policy: Option<&str>,
) -> Result<Option<&'static str>, ApiError> {
    let default = if (info.group.as_str(), info.plural.as_str()) == ("batch", "jobs") {
        "Orphan"
    } else {
        "Background"
    };
    match policy.unwrap_or(default) {
        "Orphan" => Ok(Some(ORPHAN_FINALIZER)),
        "Foreground" => Ok(Some(FOREGROUND_FINALIZER)),
        "Background" => Ok(None),
        other => {
            let message = format!(
                "Unsupported value: \"{other}\": supported values: \"Foreground\", \"Background\", \"Orphan\""
            );
            let causes = vec![Cause::other(
                "FieldValueNotSupported",
                "propagationPolicy",
                message,
            )];
            Err(ApiError::invalid(
                "meta.k8s.io",
                "DeleteOptions",
                "",
                causes,
            ))
        }
    }
}

fn add_finalizer(object: &mut Value, finalizer: &str) {
    let mut list = finalizers(object);
    if !list.iter().any(|f| f == finalizer) {
        list.push(finalizer.to_string());
        object["metadata"]["finalizers"] = json!(list);
    }
}

/// Removes one finalizer; a deleting object with none left is removed, as after an update.
pub fn remove_finalizer(
    store: &Store,
    info: &ResourceInfo,
    namespace: &str,
    name: &str,
    finalizer: &str,
) -> Result<Value, ApiError> {
    write_existing(store, info, namespace, name, |current| {
        let mut new = current.clone();
        let kept: Vec<String> = finalizers(current)
            .into_iter()
            .filter(|f| f != finalizer)
            .collect();
        if kept.is_empty() {
            if let Some(meta) = new["metadata"].as_object_mut() {
                meta.remove("finalizers");
            }
        } else {
            new["metadata"]["finalizers"] = json!(kept);
        }
        prepare_update(info, current, new, Subresource::Main)
    })
}

fn check_preconditions(
    info: &ResourceInfo,
    current: &Value,
    options: &DeleteOptions,
) -> Result<(), ApiError> {
    let name = meta_str(current, "name").unwrap_or("");
    let checks = [
        ("UID", "uid", &options.precondition_uid),
        (
            "ResourceVersion",
            "resourceVersion",
            &options.precondition_resource_version,
        ),
    ];
    for (label, field, wanted) in checks {
        let actual = meta_str(current, field).unwrap_or("");
        if let Some(wanted) = wanted
            && wanted != actual
        {
            let why = format!(
                "Precondition failed: {label} in precondition: {wanted}, {label} in object meta: {actual}"
            );
            return Err(ApiError::conflict(&info.group, &info.plural, name, &why));
        }
    }
    Ok(())
}

pub fn delete_collection(
    store: &Store,
    info: &ResourceInfo,
    namespace: Option<&str>,
    options: &ListOptions,
    delete_options: &DeleteOptions,
) -> Result<Value, ApiError> {
    let listing = ListOptions {
        limit: None,
        continue_token: None,
        ..options.clone()
    };
    let listed = list(store, info, namespace, &listing)?;
    let mut deleted = Vec::new();
    for object in listed["items"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
    {
        let ns = meta_str(object, "namespace").unwrap_or("");
        let name = meta_str(object, "name").unwrap_or("");
        match delete(store, info, ns, name, delete_options) {
            Ok(object) => deleted.push(object),
            // Deleted concurrently: nothing left to do for it.
            Err(e) if e.code == 404 => {}
            Err(e) => return Err(e),
        }
    }
    Ok(json!({
        "kind": format!("{}List", info.kind),
        "apiVersion": info.api_version(),
        "metadata": {"resourceVersion": store.resource_version().to_string()},
        "items": deleted,
    }))
}

fn path_segments(path: &str) -> Vec<&str> {
    path.split('.').filter(|s| !s.is_empty()).collect()
}

fn value_at<'a>(object: &'a Value, path: &str) -> &'a Value {
    path_segments(path).iter().fold(object, |v, key| &v[*key])
}

fn set_at(object: &mut Value, path: &str, value: Value) {
    let mut current = object;
    for key in path_segments(path) {
        if !current.is_object() {
            *current = json!({});
        }
        current = &mut current[key];
    }
    *current = value;
}

/// The autoscaling/v1 Scale view of an object.
fn scale_of(info: &ResourceInfo, object: &Value) -> Result<Value, ApiError> {
    let paths = info.scale.as_ref().ok_or_else(ApiError::path_not_found)?;
    let metadata = &object["metadata"];
    let selector = match &paths.label_selector {
        Some(path) => value_at(object, path).clone(),
        None => json!(selector_string(&object["spec"]["selector"])),
    };
    let mut scale = json!({
        "kind": "Scale",
        "apiVersion": "autoscaling/v1",
        "metadata": {
            "name": metadata["name"], "namespace": metadata["namespace"], "uid": metadata["uid"],
            "resourceVersion": metadata["resourceVersion"], "creationTimestamp": metadata["creationTimestamp"],
        },
        "spec": {"replicas": value_at(object, &paths.spec_replicas).as_i64().unwrap_or(0)},
        "status": {"replicas": value_at(object, &paths.status_replicas).as_i64().unwrap_or(0)},
    });
    if selector.is_string() && selector != json!("") {
        scale["status"]["selector"] = selector;
    }
    Ok(scale)
}

/// A LabelSelector object as the `a=b,c in (d)` string Scale reports.
fn selector_string(selector: &Value) -> String {
    let mut terms: Vec<String> = selector["matchLabels"]
        .as_object()
        .map(|m| {
            m.iter()
                .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or("")))
                .collect()
        })
        .unwrap_or_default();
    for expr in selector["matchExpressions"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
    {
        let key = expr["key"].as_str().unwrap_or("");
        let values: Vec<&str> = expr["values"]
            .as_array()
            .map(|v| v.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        terms.push(match expr["operator"].as_str() {
            Some("In") => format!("{key} in ({})", values.join(",")),
            Some("NotIn") => format!("{key} notin ({})", values.join(",")),
            Some("DoesNotExist") => format!("!{key}"),
            _ => key.to_string(),
        });
    }
    terms.join(",")
}

pub fn get_scale(
    store: &Store,
    info: &ResourceInfo,
    namespace: &str,
    name: &str,
) -> Result<Value, ApiError> {
    scale_of(info, &get(store, info, namespace, name)?)
}

/// Writes a Scale (given directly or as a patch of the current one) into the object's spec.
pub fn write_scale(
    store: &Store,
    info: &ResourceInfo,
    namespace: &str,
    name: &str,
    change: ScaleChange<'_>,
) -> Result<Value, ApiError> {
    let paths = info.scale.clone().ok_or_else(ApiError::path_not_found)?;
    let written = write_existing(store, info, namespace, name, |old| {
        let current = present(info, old.clone());
        let scale = match change {
            ScaleChange::Replace(scale) => scale.clone(),
            ScaleChange::Patch(patch_type, patch) => {
                let mut scale = scale_of(info, &current)?;
                apply_patch(&mut scale, patch_type, patch)?;
                scale
            }
        };
        let Some(replicas) = scale["spec"]["replicas"].as_i64() else {
            let causes = vec![Cause::invalid(
                "spec.replicas",
                &scale["spec"]["replicas"],
                "must be an integer",
            )];
            return Err(ApiError::invalid("autoscaling", "Scale", name, causes));
        };
        if replicas < 0 {
            let causes = vec![Cause::invalid(
                "spec.replicas",
                &json!(replicas),
                "must be greater than or equal to 0",
            )];
            return Err(ApiError::invalid("autoscaling", "Scale", name, causes));
        }
        let mut new = current;
        set_at(&mut new, &paths.spec_replicas, json!(replicas));
        match meta_str(&scale, "resourceVersion") {
            Some(rv) => new["metadata"]["resourceVersion"] = json!(rv),
            None => {
                if let Some(meta) = new["metadata"].as_object_mut() {
                    meta.remove("resourceVersion");
                }
            }
        }
        prepare_update(info, old, new, Subresource::Main)
    })?;
    scale_of(info, &written)
}

pub enum ScaleChange<'a> {
    Replace(&'a Value),
    Patch(PatchType, &'a [u8]),
}

/// Text of a pod's container log, honouring `container` and `limitBytes`.
pub fn pod_log(
    store: &Store,
    info: &ResourceInfo,
    namespace: &str,
    name: &str,
    container: Option<&str>,
    limit_bytes: Option<usize>,
) -> Result<String, ApiError> {
    let pod = get(store, info, namespace, name)?;
    let containers: Vec<&str> = pod["spec"]["containers"]
        .as_array()
        .map(|c| c.iter().filter_map(|c| c["name"].as_str()).collect())
        .unwrap_or_default();
    let container = match (container, containers.as_slice()) {
        (Some(c), _) if containers.contains(&c) => c,
        (Some(c), _) => {
            return Err(ApiError::bad_request(format!(
                "container {c} is not valid for pod {name}"
            )));
        }
        (None, [only]) => only,
        (None, all) => {
            return Err(ApiError::bad_request(format!(
                "a container name must be specified for pod {name}, choose one of: [{}]",
                all.join(" ")
            )));
        }
    };
    let mut text = store
        .pod_log(namespace, name, container)
        .unwrap_or_default();
    if let Some(limit) = limit_bytes
        && text.len() > limit
    {
        let mut cut = limit;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_patch_test_of_a_missing_path_compares_with_null() {
        let mut target = json!({"metadata": {}});
        let patch = br#"[{"op":"test","path":"/metadata/finalizers","value":null},{"op":"add","path":"/metadata/finalizers","value":["x"]}]"#;
        apply_patch(&mut target, PatchType::Json, patch).unwrap();
        assert_eq!(target["metadata"]["finalizers"], json!(["x"]));
    }

    #[test]
    fn failing_json_patch_test_is_invalid() {
        let mut target = json!({"data": {"k": "v2"}});
        let patch = br#"[{"op":"test","path":"/data/k","value":"nope"}]"#;
        assert_eq!(
            apply_patch(&mut target, PatchType::Json, patch)
                .unwrap_err()
                .code,
            422
        );
    }

    #[test]
    fn uids_look_like_uuid_v4() {
        let uid = new_uid();
        assert_eq!(uid.len(), 36);
        assert_eq!(&uid[14..15], "4");
    }

    #[test]
    fn selector_objects_render_as_selector_strings() {
        let sel = json!({"matchLabels": {"app": "x"}, "matchExpressions": [{"key": "t", "operator": "In", "values": ["a", "b"]}]});
        assert_eq!(selector_string(&sel), "app=x,t in (a,b)");
    }
}
