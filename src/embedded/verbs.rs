//! The API verbs on `serde_json::Value` objects with kube-apiserver semantics. Used by the HTTP
//! layer and, later, by in-process controllers; nothing here knows about HTTP.

use base64::Engine;
use rand::RngExt;
use serde_json::{Value, json};

use super::admission::Admission;
use super::convert;
use super::crd::{
    CLEANUP_FINALIZER, check_accepts_creates, establish_crd, is_crd, reestablish_crd, remove_custom_resources,
    validate_crd,
};
use super::defaults::apply_builtin_defaults;
use super::discovery::ResourceInfo;
use super::field_manager;
use super::kinds;
use super::object_meta::{meta_str, now_timestamp};
use super::patch::{PatchBody, apply_patch, check_object_shape, check_patch_type};
use super::schema;
use super::served::{Served, ServedList, present, presented, stamp};
use super::status::{ApiError, Cause};
use super::store::{GroupResource, Store, Write};
use super::validation::{finalizers, validate_object, validate_update};
use super::verb_options::{DEFAULT_MANAGER, DeleteOptions, ListOptions, Recording, Subresource, WriteOptions};

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

/// A request-version object as stored.
fn stored(info: &ResourceInfo, object: Value) -> Value {
    convert::to_storage(&info.group, &info.plural, object)
}

pub fn get<'a>(store: &Store, info: &'a ResourceInfo, namespace: &str, name: &str) -> Result<Served<'a>, ApiError> {
    store
        .get_shared(&info.storage_key(), namespace, name)
        .map(|o| Served::new(info, o))
        .ok_or_else(|| ApiError::not_found(&info.group, &info.plural, name))
}

#[derive(serde::Serialize, serde::Deserialize)]
struct ContinueToken {
    rv: u64,
    start: (String, String),
}

pub fn list<'a>(
    store: &Store,
    info: &'a ResourceInfo,
    namespace: Option<&str>,
    options: &ListOptions,
) -> Result<ServedList<'a>, ApiError> {
    let (objects, current_rv) = store.list_shared(&info.storage_key(), namespace);
    let token = options.continue_token.as_deref().map(decode_continue).transpose()?;
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
    let items: Vec<_> = matching.by_ref().take(limit).collect();
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
    Ok(ServedList::new(info, metadata, items))
}

fn encode_continue(token: &ContinueToken) -> String {
    let raw = serde_json::to_vec(token).unwrap_or_default();
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(raw)
}

fn decode_continue(token: &str) -> Result<ContinueToken, ApiError> {
    let bad = || ApiError::bad_request("continue key is not valid: incorrect encoded start resourceVersion");
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(token)
        .map_err(|_| bad())?;
    serde_json::from_slice(&raw).map_err(|_| bad())
}

/// Checks `kind`/`apiVersion` in a request body against the URL.
fn check_type(info: &ResourceInfo, body: &Value) -> Result<(), ApiError> {
    check_object_shape(body)?;
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
fn check_namespace_accepts(store: &Store, info: &ResourceInfo, namespace: &str, name: &str) -> Result<(), ApiError> {
    if !info.namespaced {
        return Ok(());
    }
    let Some(ns) = store.get_shared(&namespace_resource(), "", namespace) else {
        return Err(ApiError::not_found("", "namespaces", namespace));
    };
    if ns["metadata"]["deletionTimestamp"].is_string() {
        let why = format!("unable to create new content in namespace {namespace} because it is being terminated");
        return Err(ApiError::forbidden(&info.group, &info.plural, name, &why));
    }
    Ok(())
}

/// Defaulting, mutating admission, pruning and validation shared by create and update.
fn admit(info: &ResourceInfo, object: &mut Value, uid: &str, admission: Option<&Admission>) -> Result<(), ApiError> {
    apply_builtin_defaults(info, object, uid);
    if admission.is_some_and(|admission| admission.run(info, object)) {
        // kube-apiserver decodes a webhook's answer again, which defaults what it added.
        apply_builtin_defaults(info, object, uid);
    }
    kinds::check_decodable(info, object)?;
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

pub fn create<'a>(
    store: &Store,
    info: &'a ResourceInfo,
    namespace: &str,
    body: Value,
    options: WriteOptions,
) -> Result<Served<'a>, ApiError> {
    create_with(store, info, namespace, body, options.recording(), &options)
}

/// A create recording `managedFields` as `recording` says.
pub(super) fn create_with<'a>(
    store: &Store,
    info: &'a ResourceInfo,
    namespace: &str,
    mut body: Value,
    recording: Recording<'_>,
    options: &WriteOptions,
) -> Result<Served<'a>, ApiError> {
    check_type(info, &body)?;
    check_namespace(info, &mut body, namespace)?;
    if meta_str(&body, "name").is_none()
        && let Some(prefix) = meta_str(&body, "generateName")
    {
        body["metadata"]["name"] = json!(format!("{prefix}{}", random_suffix()));
    }
    let name = meta_str(&body, "name").unwrap_or("").to_string();
    check_namespace_accepts(store, info, namespace, &name)?;
    check_accepts_creates(store, info)?;
    super::pod_quota::admit(store, info, namespace, &name)?;
    let uid = new_uid();
    let mut object = new_object(info, body, &uid);
    admit(info, &mut object, &uid, options.admission.as_deref())?;
    if let Recording::Manager(manager) = recording {
        object = field_manager::record(info, None, object, manager, Subresource::Main);
    }
    if is_crd(info) {
        establish_crd(&mut object);
        add_finalizer(&mut object, CLEANUP_FINALIZER);
    }
    let key = info.storage_key();
    let decide = |current: Option<&Value>| match current {
        Some(_) => Err(ApiError::already_exists(&info.group, &info.plural, &name)),
        None => Ok(Write::Put(stored(info, object))),
    };
    let (created, _) = if options.dry_run {
        store.preview(&key, namespace, &name, decide)?
    } else {
        store.write(&key, namespace, &name, decide)?
    };
    Ok(Served::new(info, created))
}

/// A create's body with the server-owned metadata set and any status dropped (status is written
/// through its own endpoint).
fn new_object(info: &ResourceInfo, body: Value, uid: &str) -> Value {
    let mut object = stamp(info, body);
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
    object
}

/// Whether what `generation` tracks differs: everything outside `metadata`, `apiVersion` and
/// `kind` (and `status` when it has its own endpoint).
fn spec_changed(info: &ResourceInfo, a: &Value, b: &Value) -> bool {
    let untracked =
        |key: &str| matches!(key, "metadata" | "apiVersion" | "kind") || (info.status_subresource && key == "status");
    !equal_except(a, b, untracked)
}

/// Equal apart from the fields the server bumps on every write.
fn same_content(a: &Value, b: &Value) -> bool {
    equal_except(&a["metadata"], &b["metadata"], |key| key == "resourceVersion")
        && equal_except(a, b, |key| key == "metadata")
}

/// Equal apart from the top-level fields `skipped` names (compared in place, without copies).
fn equal_except(a: &Value, b: &Value, skipped: impl Fn(&str) -> bool) -> bool {
    match (a.as_object(), b.as_object()) {
        (Some(a), Some(b)) => {
            let kept_a = a.iter().filter(|(key, _)| !skipped(key));
            kept_a.eq(b.iter().filter(|(key, _)| !skipped(key)))
        }
        _ => a == b,
    }
}

/// Turns a requested new state into the write to make, with kube-apiserver's update rules.
pub(super) fn prepare_update(
    info: &ResourceInfo,
    old: &Value,
    requested: Value,
    sub: Subresource,
) -> Result<Write, ApiError> {
    prepare_update_with(info, old, requested, sub, Recording::Manager(DEFAULT_MANAGER), None)
}

/// [`prepare_update`] recording `managedFields` as `recording` says, passing `admission` when it
/// writes the object itself (not a subresource).
pub(super) fn prepare_update_with(
    info: &ResourceInfo,
    old: &Value,
    requested: Value,
    sub: Subresource,
    recording: Recording<'_>,
    admission: Option<&Admission>,
) -> Result<Write, ApiError> {
    let applied_fields = requested["metadata"].get("managedFields").cloned();
    let name = meta_str(old, "name").unwrap_or("").to_string();
    check_update_preconditions(info, old, &requested, &name)?;
    let old = presented(info, old);
    let mut new = requested_state(info, &old, requested, sub);
    keep_server_metadata(&old, &mut new);
    let uid = meta_str(&old, "uid").unwrap_or("").to_string();
    admit(info, &mut new, &uid, admission.filter(|_| sub == Subresource::Main))?;
    let causes = validate_update(info, &old, &new);
    if !causes.is_empty() {
        return Err(ApiError::invalid(&info.group, &info.kind, &name, causes));
    }
    if info.tracks_generation && spec_changed(info, &old, &new) {
        let generation = old["metadata"]["generation"].as_i64().unwrap_or(0);
        new["metadata"]["generation"] = json!(generation + 1);
        if is_crd(info) {
            reestablish_crd(&old, &mut new);
        }
    }
    match (recording, applied_fields) {
        (Recording::Manager(manager), _) => new = field_manager::record(info, Some(old.as_ref()), new, manager, sub),
        (Recording::AsGiven, Some(fields)) => new["metadata"]["managedFields"] = fields,
        (Recording::AsGiven, None) => {}
    }
    if same_content(&old, &new) {
        return Ok(Write::Keep);
    }
    if is_deleting(&new) && !holds_deletion(info, &new) {
        return Ok(Write::Remove(stored(info, new)));
    }
    Ok(Write::Put(stored(info, new)))
}

/// A resourceVersion or uid in the body must match the stored object.
fn check_update_preconditions(info: &ResourceInfo, old: &Value, requested: &Value, name: &str) -> Result<(), ApiError> {
    if let Some(rv) = meta_str(requested, "resourceVersion")
        && Some(rv) != meta_str(old, "resourceVersion")
    {
        return Err(ApiError::stale(&info.group, &info.plural, name));
    }
    // A uid in the body guards against writing to an object deleted and recreated meanwhile.
    let old_uid = meta_str(old, "uid").unwrap_or("");
    if let Some(uid) = meta_str(requested, "uid")
        && uid != old_uid
    {
        let why = format!("Precondition failed: UID in precondition: {uid}, UID in object meta: {old_uid}");
        return Err(ApiError::conflict(&info.group, &info.plural, name, &why));
    }
    Ok(())
}

/// The object a write asks for, before server metadata and defaults: each endpoint changes only
/// its own part.
fn requested_state(info: &ResourceInfo, old: &Value, requested: Value, sub: Subresource) -> Value {
    let mut new = match sub {
        Subresource::Status => {
            let mut new = old.clone();
            new["status"] = requested["status"].clone();
            new
        }
        Subresource::Main => {
            let mut new = stamp(info, requested);
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
    new
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
        && object["spec"]["finalizers"].as_array().is_some_and(|f| !f.is_empty());
    !finalizers(object).is_empty() || spec_finalizers
}

pub fn update<'a>(
    store: &Store,
    info: &'a ResourceInfo,
    namespace: &str,
    name: &str,
    mut body: Value,
    sub: Subresource,
    options: WriteOptions,
) -> Result<Served<'a>, ApiError> {
    check_type(info, &body)?;
    check_namespace(info, &mut body, namespace)?;
    if meta_str(&body, "name").is_some_and(|n| n != name) {
        let body_name = meta_str(&body, "name").unwrap_or("");
        return Err(ApiError::bad_request(format!(
            "the name of the object ({body_name}) does not match the name on the URL ({name})"
        )));
    }
    write_existing(store, info, namespace, name, &options, |old| {
        prepare_update_with(info, old, body, sub, options.recording(), options.admission.as_deref())
    })
}

/// A write to an object that must exist, with post-removal cleanup.
pub(super) fn write_existing<'a, F>(
    store: &Store,
    info: &'a ResourceInfo,
    namespace: &str,
    name: &str,
    options: &WriteOptions,
    decide: F,
) -> Result<Served<'a>, ApiError>
where
    F: FnOnce(&Value) -> Result<Write, ApiError>,
{
    let mut removed = false;
    let existing = |current: Option<&Value>| {
        let current = current.ok_or_else(|| ApiError::not_found(&info.group, &info.plural, name))?;
        let write = decide(current)?;
        removed = matches!(write, Write::Remove(_));
        Ok(write)
    };
    let key = info.storage_key();
    let (object, _) = if options.dry_run {
        store.preview(&key, namespace, name, existing)?
    } else {
        store.write(&key, namespace, name, existing)?
    };
    if removed && !options.dry_run {
        after_removal(store, info, &object);
    }
    Ok(Served::new(info, object))
}

/// Cleanup a real server does asynchronously when an object is finally gone.
fn after_removal(store: &Store, info: &ResourceInfo, object: &Value) {
    if is_crd(info) {
        remove_custom_resources(store, object);
    }
}

pub fn patch<'a>(
    store: &Store,
    info: &'a ResourceInfo,
    namespace: &str,
    name: &str,
    patch: PatchBody<'_>,
    sub: Subresource,
    options: WriteOptions,
) -> Result<Served<'a>, ApiError> {
    check_patch_type(info, patch.patch_type)?;
    write_existing(store, info, namespace, name, &options, |old| {
        let mut target = present(info, old.clone());
        apply_patch(&mut target, patch)?;
        check_object_shape(&target)?;
        prepare_update_with(
            info,
            old,
            target,
            sub,
            options.recording(),
            options.admission.as_deref(),
        )
    })
}

pub fn delete<'a>(
    store: &Store,
    info: &'a ResourceInfo,
    namespace: &str,
    name: &str,
    options: &DeleteOptions,
) -> Result<Served<'a>, ApiError> {
    let gc_finalizer = propagation_finalizer(info, options.propagation_policy.as_deref())?;
    write_existing(store, info, namespace, name, &options.write, |current| {
        check_preconditions(info, current, options)?;
        if is_deleting(current) {
            return Ok(Write::Keep);
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
fn propagation_finalizer(info: &ResourceInfo, policy: Option<&str>) -> Result<Option<&'static str>, ApiError> {
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
            let message =
                format!("Unsupported value: \"{other}\": supported values: \"Foreground\", \"Background\", \"Orphan\"");
            let causes = vec![Cause::other("FieldValueNotSupported", "propagationPolicy", message)];
            Err(ApiError::invalid("meta.k8s.io", "DeleteOptions", "", causes))
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
pub fn remove_finalizer<'a>(
    store: &Store,
    info: &'a ResourceInfo,
    namespace: &str,
    name: &str,
    finalizer: &str,
) -> Result<Served<'a>, ApiError> {
    write_existing(store, info, namespace, name, &WriteOptions::default(), |current| {
        let mut new = current.clone();
        let kept: Vec<String> = finalizers(current).into_iter().filter(|f| f != finalizer).collect();
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

fn check_preconditions(info: &ResourceInfo, current: &Value, options: &DeleteOptions) -> Result<(), ApiError> {
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
            let why =
                format!("Precondition failed: {label} in precondition: {wanted}, {label} in object meta: {actual}");
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
    for object in listed.stored_items() {
        let ns = meta_str(object, "namespace").unwrap_or("");
        let name = meta_str(object, "name").unwrap_or("");
        match delete(store, info, ns, name, delete_options) {
            Ok(object) => deleted.push(object.into_value()),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uids_look_like_uuid_v4() {
        let uid = new_uid();
        assert_eq!(uid.len(), 36);
        assert_eq!(&uid[14..15], "4");
    }
}
