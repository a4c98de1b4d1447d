//! Server-side apply (`application/apply-patch+yaml`) as a verb: the applied configuration is
//! merged into the live object by the [`patch_engine`](super::patch_engine), then created or
//! written through the verbs.

use serde_json::{Value, json};

use super::discovery::ResourceInfo;
use super::field_manager::{list_semantics, subresource_name};
use super::object_meta::{meta_str, now_timestamp};
use super::patch::check_object_shape;
use super::patch_engine::{self, ApplyError};
use super::served::{Served, presented};
use super::status::ApiError;
use super::store::{Store, Write};
use super::verb_options::{Recording, Subresource, WriteOptions};
use super::verbs;

/// What an apply request asks for.
pub(super) struct ApplyRequest<'a> {
    pub manager: &'a str,
    pub force: bool,
    pub body: &'a [u8],
}

/// Parses an apply body: YAML, of which JSON is a subset.
fn parse_applied(body: &[u8]) -> Result<Value, ApiError> {
    let text = std::str::from_utf8(body).map_err(|e| ApiError::bad_request(format!("error decoding YAML: {e}")))?;
    if let Ok(value) = serde_json::from_str::<Value>(text) {
        return Ok(value);
    }
    serde_saphyr::from_str::<Value>(text).map_err(|e| ApiError::bad_request(format!("error decoding YAML: {e}")))
}

fn apply_error(info: &ResourceInfo, name: &str, error: ApplyError) -> ApiError {
    match error {
        ApplyError::Conflict { causes } => {
            let message = ApplyError::Conflict { causes: causes.clone() }.to_string();
            // kube-apiserver's apply conflicts carry only the causes in their details.
            let mut err = ApiError::new(409, "Conflict", message);
            err.details = json!({
                "causes": causes
                    .iter()
                    .map(|c| json!({"reason": "FieldManagerConflict", "message": c.message(), "field": c.field}))
                    .collect::<Vec<_>>(),
            });
            err
        }
        ApplyError::BadRequest(message) => ApiError::bad_request(message),
        ApplyError::Invalid(message) => {
            let message = format!("{} \"{name}\" is invalid: {message}", info.kind);
            ApiError::new(422, "Invalid", message)
        }
        ApplyError::NotFound => ApiError::not_found(&info.group, &info.plural, name),
    }
}

/// Server-side apply of one object; `Ok((object, true))` when the apply created it.
pub(super) fn server_side_apply<'a>(
    store: &Store,
    info: &'a ResourceInfo,
    namespace: &str,
    name: &str,
    request: &ApplyRequest,
    sub: Subresource,
    options: WriteOptions,
) -> Result<(Served<'a>, bool), ApiError> {
    if request.manager.is_empty() {
        return Err(ApiError::bad_request("fieldManager is required for apply requests"));
    }
    let mut applied = parse_applied(request.body)?;
    check_object_shape(&applied)?;
    if let Some(body_name) = meta_str(&applied, "name")
        && body_name != name
    {
        return Err(ApiError::bad_request(format!(
            "the name of the object ({body_name}) does not match the name on the URL ({name})"
        )));
    }
    if info.namespaced
        && let Some(body_ns) = meta_str(&applied, "namespace")
        && body_ns != namespace
    {
        return Err(ApiError::bad_request(
            "the namespace of the provided object does not match the namespace sent on the request",
        ));
    }
    let api_version = applied["apiVersion"].as_str().unwrap_or("");
    let group = api_version.rsplit_once('/').map_or("", |(g, _)| g);
    if applied["kind"].as_str().is_some_and(|k| k != info.kind) || (!api_version.is_empty() && group != info.group) {
        return Err(ApiError::bad_request(format!(
            "the API version in the data ({api_version}) does not match the expected API version ({})",
            info.api_version()
        )));
    }
    if sub == Subresource::Main
        && info.status_subresource
        && let Some(map) = applied.as_object_mut()
    {
        map.remove("status");
    }
    let semantics = list_semantics(info);
    let now = now_timestamp();
    let merge = |live: Option<&Value>| {
        patch_engine::apply(
            live,
            &applied,
            request.manager,
            request.force,
            semantics.as_ref(),
            subresource_name(sub),
            &now,
        )
        .map_err(|e| apply_error(info, name, e))
    };
    if !store.contains(&info.storage_key(), namespace, name) && sub == Subresource::Main {
        let mut object = merge(None)?;
        object["metadata"]["name"] = json!(name);
        match verbs::create_with(store, info, namespace, object, Recording::AsGiven, &options) {
            Ok(created) => return Ok((created, true)),
            // Created meanwhile: apply to what is there now.
            Err(e) if e.code == 409 && e.reason == "AlreadyExists" => {}
            Err(e) => return Err(e),
        }
    }
    // A resourceVersion in the applied configuration is a precondition, for the status
    // subresource too (whose merge keeps only `.status` of the configuration).
    let expected_version = meta_str(&applied, "resourceVersion").map(str::to_string);
    let updated = verbs::write_existing(store, info, namespace, name, &options, |old| {
        if let Some(expected) = &expected_version
            && meta_str(old, "resourceVersion") != Some(expected.as_str())
        {
            return Err(ApiError::stale(&info.group, &info.plural, name));
        }
        let live = presented(info, old);
        let merged = merge(Some(live.as_ref()))?;
        if merged == *live {
            return Ok(Write::Keep);
        }
        verbs::prepare_update_with(info, old, merged, sub, Recording::AsGiven, options.admission.as_deref())
    })?;
    Ok((updated, false))
}
