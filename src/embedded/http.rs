//! The request pipeline: authenticate, count, route, dispatch to a verb, render a `Status` on error.
//! Every request passes [`handle`]; resource requests then pass `dispatch`, where their verb and
//! target are known: they are counted and pass fault injection there.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::Value;

use super::Shared;
use super::apply;
use super::convert;
use super::discovery::{ResourceInfo, Resources, core_versions, version_info};
use super::field_validation::{self, FieldValidation};
use super::openapi;
use super::patch::{PatchBody, PatchType, check_object_shape};
use super::protobuf;
use super::selectors::{FieldSelector, LabelSelector, supported_fields};
use super::status::{ApiError, json_response};
use super::subresources::{self, ScaleChange};
use super::table::{self, IncludeObject, TableView};
use super::verb::Verb;
use super::verb_options::{DEFAULT_MANAGER, DeleteOptions, ListOptions, Subresource, WriteOptions};
use super::verbs;
use super::watch::{self, WatchOptions};

const APPLY_PATCH: &str = "application/apply-patch+yaml";

/// Largest request body accepted: kube-apiserver's limit, so oversized objects fail here too.
const MAX_BODY: usize = 3 * 1024 * 1024;

pub(super) async fn handle(State(shared): State<Arc<Shared>>, request: Request) -> Response {
    shared.count_request();
    let path = request.uri().path().to_string();
    if matches!(path.as_str(), "/healthz" | "/readyz" | "/livez") {
        return (StatusCode::OK, "ok").into_response();
    }
    if !shared.authorized(request.headers()) {
        return ApiError::unauthorized().into_response();
    }
    match serve(&shared, request).await {
        Ok(response) => response,
        Err(error) => error.into_response(),
    }
}

/// Query parameters (the first value of a repeated one wins, as with Go's `url.Values.Get`).
type Query = HashMap<String, String>;

fn parse_query(request: &Request) -> Query {
    let decode = |s: &str| {
        urlencoding::decode(&s.replace('+', " "))
            .map(|c| c.into_owned())
            .unwrap_or_default()
    };
    let mut query = Query::new();
    let raw = request.uri().query().unwrap_or("");
    for pair in raw.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        query.entry(decode(k)).or_insert_with(|| decode(v));
    }
    query
}

/// A request for a resource, a collection, or a subresource.
struct Target {
    info: ResourceInfo,
    namespace: Option<String>,
    name: Option<String>,
    subresource: Option<String>,
}

async fn serve(shared: &Arc<Shared>, request: Request) -> Result<Response, ApiError> {
    // Segments are percent-decoded one by one, so an encoded '/' cannot split a name.
    let decoded: Vec<String> = request
        .uri()
        .path()
        .split('/')
        .filter(|s| !s.is_empty())
        .map(|s| urlencoding::decode(s).map(|d| d.into_owned()))
        .collect::<Result<_, _>>()
        .map_err(|_| ApiError::bad_request("the request path is not valid UTF-8"))?;
    let segments: Vec<&str> = decoded.iter().map(String::as_str).collect();
    let resources = shared.resources.current();
    let ok = |body: Value| Ok(json_response(StatusCode::OK, &body));
    let only_get = |request: &Request| {
        if request.method() == Method::GET {
            Ok(())
        } else {
            Err(ApiError::method_not_allowed())
        }
    };
    match segments.as_slice() {
        ["version"] => only_get(&request).and_then(|_| ok(version_info())),
        ["openapi", "v3"] => only_get(&request).and_then(|_| ok(openapi::index(&resources))),
        ["openapi", "v3", rest @ ..] => {
            only_get(&request).and_then(|_| ok(discovery(openapi::document_at(&resources, rest))?))
        }
        ["api"] => only_get(&request).and_then(|_| ok(core_versions(&shared.address))),
        ["apis"] => only_get(&request).and_then(|_| ok(resources.api_group_list())),
        ["api", "v1"] => only_get(&request).and_then(|_| ok(discovery(resources.resource_list("", "v1"))?)),
        ["apis", group] => only_get(&request).and_then(|_| ok(discovery(resources.api_group(group))?)),
        ["apis", group, version] => {
            only_get(&request).and_then(|_| ok(discovery(resources.resource_list(group, version))?))
        }
        ["api", "v1", rest @ ..] => {
            let target = resolve(&resources, "", "v1", rest)?;
            dispatch(shared, target, request).await
        }
        ["apis", group, version, rest @ ..] => {
            let target = resolve(&resources, group, version, rest)?;
            dispatch(shared, target, request).await
        }
        _ => Err(ApiError::path_not_found()),
    }
}

fn discovery(document: Option<Value>) -> Result<Value, ApiError> {
    document.ok_or_else(ApiError::path_not_found)
}

fn resolve(resources: &Resources, group: &str, version: &str, rest: &[&str]) -> Result<Target, ApiError> {
    let find = |plural: &str| {
        resources
            .find(group, version, plural)
            .ok_or_else(ApiError::path_not_found)
    };
    let owned = |s: &&str| s.to_string();
    let target = match rest {
        // namespaces/<ns>/status and /finalize are the Namespace's own subresources.
        ["namespaces", ns, sub @ ("status" | "finalize")] if group.is_empty() => Target {
            info: find("namespaces")?,
            namespace: None,
            name: Some(ns.to_string()),
            subresource: Some(sub.to_string()),
        },
        ["namespaces", ns, plural, tail @ ..] => {
            let info = find(plural)?;
            if !info.namespaced {
                return Err(ApiError::path_not_found());
            }
            Target {
                info,
                namespace: Some(ns.to_string()),
                name: tail.first().map(owned),
                subresource: tail.get(1).map(owned),
            }
            .limited(tail.len())?
        }
        [plural, tail @ ..] => {
            let info = find(plural)?;
            if info.namespaced && !tail.is_empty() {
                return Err(ApiError::path_not_found());
            }
            Target {
                info,
                namespace: None,
                name: tail.first().map(owned),
                subresource: tail.get(1).map(owned),
            }
            .limited(tail.len())?
        }
        [] => return Err(ApiError::path_not_found()),
    };
    Ok(target)
}

impl Target {
    fn limited(self, tail: usize) -> Result<Target, ApiError> {
        if tail > 2 {
            Err(ApiError::path_not_found())
        } else {
            Ok(self)
        }
    }

    fn namespace(&self) -> &str {
        self.namespace.as_deref().unwrap_or("")
    }

    /// The subresource as a write target; unknown ones are 404 as on the real server.
    fn write_part(&self) -> Result<Subresource, ApiError> {
        match self.subresource.as_deref() {
            None => Ok(Subresource::Main),
            Some("status") if self.info.status_subresource => Ok(Subresource::Status),
            Some("finalize") if self.info.plural == "namespaces" && self.info.group.is_empty() => {
                Ok(Subresource::Finalize)
            }
            _ => Err(ApiError::path_not_found()),
        }
    }
}

/// The verb of a request with `method`, on one object (`named`) or a collection.
fn verb_of(method: &Method, named: bool, query: &Query) -> Result<Verb, ApiError> {
    Ok(match (method, named) {
        (&Method::GET, false) if is_watch(query) => Verb::Watch,
        (&Method::GET, false) => Verb::List,
        (&Method::POST, false) => Verb::Create,
        (&Method::DELETE, false) => Verb::DeleteCollection,
        (&Method::GET, true) => Verb::Get,
        (&Method::PUT, true) => Verb::Update,
        (&Method::PATCH, true) => Verb::Patch,
        (&Method::DELETE, true) => Verb::Delete,
        _ => return Err(ApiError::method_not_allowed()),
    })
}

/// A fully read resource request.
struct ApiRequest {
    verb: Verb,
    target: Target,
    query: Query,
    write: WriteOptions,
    /// The media type without parameters.
    content_type: String,
    /// The `Accept` header, for Table output.
    accept: String,
    body: bytes::Bytes,
}

async fn dispatch(shared: &Arc<Shared>, target: Target, request: Request) -> Result<Response, ApiError> {
    let query = parse_query(&request);
    let verb = verb_of(request.method(), target.name.is_some(), &query)?;
    shared.counters.record(counted(verb, &target));
    if let Some(injected) = shared.faults.intercept(verb, &target.info, target.namespace()).await {
        return Ok(injected);
    }
    let write = write_options(&query)?;
    let content_type = request
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .unwrap_or("")
        .trim()
        .to_string();
    let accept = header_text(&request, header::ACCEPT);
    let user_agent = header_text(&request, header::USER_AGENT);
    let field_manager = query.get("fieldManager").cloned().unwrap_or_else(|| {
        let product = user_agent.split('/').next().unwrap_or("");
        if product.is_empty() {
            DEFAULT_MANAGER.to_string()
        } else {
            product.to_string()
        }
    });
    let body = axum::body::to_bytes(request.into_body(), MAX_BODY).await.map_err(|_| {
        let message = format!("Request entity too large: limit is {MAX_BODY}");
        ApiError::new(413, "RequestEntityTooLarge", message)
    })?;
    let write = WriteOptions {
        field_manager: Some(field_manager.clone()),
        admission: Some(shared.admission.clone()),
        ..write
    };
    let mut request = ApiRequest {
        verb,
        target,
        write,
        query,
        content_type,
        accept,
        body,
    };
    decode_binary_body(&mut request)?;
    let warnings = field_warnings(&request)?;
    let mut response = match request.target.name.clone() {
        None => collection(shared, &request),
        Some(name) => object(shared, &request, &name),
    }?;
    let target = &request.target;
    shared.faults.delay_answer(verb, &target.info, target.namespace()).await;
    for warning in warnings {
        if let Ok(value) = header::HeaderValue::from_str(&warning) {
            response.headers_mut().append(header::WARNING, value);
        }
    }
    Ok(response)
}

/// Protobuf bodies of the kinds [`protobuf`] decodes become JSON; others are 415.
fn decode_binary_body(request: &mut ApiRequest) -> Result<(), ApiError> {
    let with_body = matches!(
        request.verb,
        Verb::Create | Verb::Update | Verb::Delete | Verb::DeleteCollection
    );
    if with_body && let Some(json) = protobuf::json_body(&request.content_type, &request.body)? {
        request.body = json.into();
        request.content_type = "application/json".to_string();
    }
    Ok(())
}

/// `fieldValidation` of a create, update or (non-JSON) patch: the warnings to answer with.
fn field_warnings(request: &ApiRequest) -> Result<Vec<String>, ApiError> {
    let validation = FieldValidation::parse(request.query.get("fieldValidation").map(String::as_str))?;
    let writes_object = matches!(request.verb, Verb::Create | Verb::Update | Verb::Patch)
        && matches!(request.target.subresource.as_deref(), None | Some("status"))
        && request.content_type != "application/json-patch+json";
    if !writes_object {
        return Ok(Vec::new());
    }
    validation.check_body(&request.target.info, request.content_type == APPLY_PATCH, &request.body)
}

fn header_text(request: &Request, name: header::HeaderName) -> String {
    request
        .headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string()
}

fn counted(verb: Verb, target: &Target) -> crate::embedded::counters::RequestKey {
    let mut resource = super::status::qualified(&target.info.group, &target.info.plural);
    if let Some(sub) = &target.subresource {
        resource = format!("{resource}/{sub}");
    }
    crate::embedded::counters::RequestKey {
        verb,
        resource,
        namespace: target.namespace().to_string(),
    }
}

fn ok(body: impl serde::Serialize) -> Result<Response, ApiError> {
    Ok(json_response(StatusCode::OK, &body))
}

fn collection(shared: &Arc<Shared>, request: &ApiRequest) -> Result<Response, ApiError> {
    let (store, target) = (&shared.store, &request.target);
    let namespace = target.namespace.as_deref();
    match request.verb {
        Verb::Watch => watch_response(shared, target, &request.query, table_view(shared, request)),
        Verb::List => {
            let options = list_options(&target.info, &request.query)?;
            let list = verbs::list(store, &target.info, namespace, &options)?;
            match table_view(shared, request) {
                Some(view) => ok(view.list(&list.into_value())),
                None => ok(list),
            }
        }
        Verb::Create => {
            let mut body = parse_object(request)?;
            field_validation::prune_builtin(&target.info, &mut body);
            let created = verbs::create(store, &target.info, target.namespace(), body, request.write.clone())?;
            Ok(json_response(StatusCode::CREATED, &created))
        }
        Verb::DeleteCollection => {
            let options = list_options(&target.info, &request.query)?;
            let delete = delete_options(request)?;
            ok(verbs::delete_collection(
                store,
                &target.info,
                namespace,
                &options,
                &delete,
            )?)
        }
        _ => Err(ApiError::method_not_allowed()),
    }
}

fn object(shared: &Arc<Shared>, request: &ApiRequest, name: &str) -> Result<Response, ApiError> {
    let (store, target) = (&shared.store, &request.target);
    let (info, ns) = (&target.info, target.namespace());
    match (request.verb, target.subresource.as_deref()) {
        (Verb::Get, Some("log")) if info.log_subresource => pod_log(shared, target, name, &request.query),
        (_, Some("scale")) => scale(shared, request, name),
        (Verb::Get, None | Some("status")) => {
            target.write_part()?;
            let object = verbs::get(store, info, ns, name)?;
            match table_view(shared, request) {
                Some(view) => ok(view.object(&object.into_value())),
                None => ok(object),
            }
        }
        (Verb::Update, _) => {
            let part = target.write_part()?;
            let mut body = parse_object(request)?;
            field_validation::prune_builtin(info, &mut body);
            ok(verbs::update(store, info, ns, name, body, part, request.write.clone())?)
        }
        (Verb::Patch, _) if request.content_type == APPLY_PATCH => {
            let part = target.write_part()?;
            let apply = apply::ApplyRequest {
                manager: request.query.get("fieldManager").map_or("", String::as_str),
                force: request.query.get("force").is_some_and(|f| f == "true" || f == "1"),
                body: &request.body,
            };
            let (object, created) =
                apply::server_side_apply(store, info, ns, name, &apply, part, request.write.clone())?;
            let code = if created { StatusCode::CREATED } else { StatusCode::OK };
            Ok(json_response(code, &object))
        }
        (Verb::Patch, _) => {
            let part = target.write_part()?;
            let patch = patch_body(request)?;
            ok(verbs::patch(store, info, ns, name, patch, part, request.write.clone())?)
        }
        (Verb::Delete, None) => {
            let options = delete_options(request)?;
            ok(verbs::delete(store, info, ns, name, &options)?)
        }
        _ => Err(ApiError::method_not_allowed()),
    }
}

fn scale(shared: &Arc<Shared>, request: &ApiRequest, name: &str) -> Result<Response, ApiError> {
    let (store, target) = (&shared.store, &request.target);
    let (info, ns) = (&target.info, target.namespace());
    match request.verb {
        Verb::Get => ok(subresources::get_scale(store, info, ns, name)?),
        Verb::Update | Verb::Patch => {
            let replacement;
            let change = if request.verb == Verb::Update {
                replacement = body_json(request)?;
                ScaleChange::Replace(&replacement)
            } else {
                ScaleChange::Patch(patch_body(request)?)
            };
            ok(subresources::write_scale(
                store,
                info,
                ns,
                name,
                change,
                request.write.clone(),
            )?)
        }
        _ => Err(ApiError::method_not_allowed()),
    }
}

/// The JSON body of a create, update or delete. Protobuf (what kubectl's imperative commands send
/// for built-ins) gets a 415: DESIGN leaves protobuf out.
fn body_json(request: &ApiRequest) -> Result<Value, ApiError> {
    if !matches!(request.content_type.as_str(), "" | "application/json" | "*/*") {
        return Err(ApiError::unsupported_media_type(format!(
            "the body of the request was in an unknown format ({}) - accepted media types include: application/json",
            request.content_type
        )));
    }
    parse_json(&request.body)
}

fn parse_json(body: &[u8]) -> Result<Value, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::bad_request(format!("the request body is not valid JSON: {e}")))
}

fn patch_body(request: &ApiRequest) -> Result<PatchBody<'_>, ApiError> {
    let patch_type = patch_type(&request.content_type)?;
    Ok(PatchBody {
        patch_type,
        body: &request.body,
    })
}

/// `dryRun=All` runs a write's checks without storing; no other value exists.
fn write_options(query: &Query) -> Result<WriteOptions, ApiError> {
    match query.get("dryRun").map(String::as_str) {
        None | Some("") => Ok(WriteOptions::default()),
        Some("All") => Ok(WriteOptions {
            dry_run: true,
            ..WriteOptions::default()
        }),
        Some(other) => Err(ApiError::bad_request(format!(
            "Invalid dryRun value: {other:?}: supported values: \"All\""
        ))),
    }
}

/// A create or update body: a JSON object (protobuf bodies were decoded before) with an object
/// `metadata` whose labels, annotations and lists have their types.
fn parse_object(request: &ApiRequest) -> Result<Value, ApiError> {
    let object = body_json(request)?;
    check_object_shape(&object)?;
    Ok(object)
}

fn patch_type(content_type: &str) -> Result<PatchType, ApiError> {
    match content_type {
        "application/merge-patch+json" => Ok(PatchType::Merge),
        "application/json-patch+json" => Ok(PatchType::Json),
        "application/strategic-merge-patch+json" => Ok(PatchType::Strategic),
        other => Err(ApiError::unsupported_media_type(format!(
            "the body of the request was in an unknown format ({other}) - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml, application/strategic-merge-patch+json"
        ))),
    }
}

fn is_watch(query: &Query) -> bool {
    matches!(query.get("watch").map(String::as_str), Some("true" | "1"))
}

fn selectors(info: &ResourceInfo, query: &Query) -> Result<(LabelSelector, FieldSelector), ApiError> {
    let labels = LabelSelector::parse(query.get("labelSelector").map_or("", String::as_str))?;
    let fields = FieldSelector::parse(
        query.get("fieldSelector").map_or("", String::as_str),
        supported_fields(&info.group, &info.plural),
    )?
    .renamed(|field| convert::field_to_storage(&info.group, &info.plural, field));
    Ok((labels, fields))
}

fn list_options(info: &ResourceInfo, query: &Query) -> Result<ListOptions, ApiError> {
    let (label_selector, field_selector) = selectors(info, query)?;
    let limit = match query.get("limit") {
        Some(l) => Some(
            l.parse()
                .map_err(|_| ApiError::bad_request(format!("invalid limit: {l}")))?,
        ),
        None => None,
    };
    let continue_token = query.get("continue").filter(|c| !c.is_empty()).cloned();
    Ok(ListOptions {
        label_selector,
        field_selector,
        limit,
        continue_token,
    })
}

fn delete_options(request: &ApiRequest) -> Result<DeleteOptions, ApiError> {
    let query = &request.query;
    let body: Value = if request.body.is_empty() {
        Value::Null
    } else {
        body_json(request)?
    };
    let text = |v: &Value| v.as_str().map(String::from);
    // DeleteOptions may also carry dryRun in the body, as a list.
    let dry_run_in_body = body["dryRun"].as_array().is_some_and(|d| d.iter().any(|v| v == "All"));
    let write = WriteOptions {
        dry_run: request.write.dry_run || dry_run_in_body,
        ..request.write.clone()
    };
    Ok(DeleteOptions {
        write,
        precondition_uid: text(&body["preconditions"]["uid"]),
        precondition_resource_version: text(&body["preconditions"]["resourceVersion"]),
        propagation_policy: text(&body["propagationPolicy"]).or_else(|| query.get("propagationPolicy").cloned()),
    })
}

/// The Table (or metadata-only view) a request asks for with its `Accept` header, if any.
fn table_view(shared: &Shared, request: &ApiRequest) -> Option<TableView> {
    let shape = table::negotiate(&request.accept)?;
    let include = IncludeObject::parse(request.query.get("includeObject").map(String::as_str));
    Some(table::view(&shared.store, &request.target.info, shape, include))
}

fn watch_response(
    shared: &Arc<Shared>,
    target: &Target,
    query: &Query,
    table: Option<TableView>,
) -> Result<Response, ApiError> {
    if query.contains_key("sendInitialEvents") {
        return Err(ApiError::bad_request(
            "sendInitialEvents is not supported by this server (Kubernetes 1.24)",
        ));
    }
    let (label_selector, field_selector) = selectors(&target.info, query)?;
    let resource_version = match query.get("resourceVersion").map(String::as_str) {
        None | Some("") | Some("0") => None,
        Some(rv) => Some(
            rv.parse()
                .map_err(|_| ApiError::bad_request(format!("invalid resource version: {rv}")))?,
        ),
    };
    let timeout = query
        .get("timeoutSeconds")
        .and_then(|t| t.parse().ok())
        .map(Duration::from_secs);
    let options = WatchOptions {
        namespace: target.namespace.clone(),
        label_selector,
        field_selector,
        resource_version,
        bookmarks: query
            .get("allowWatchBookmarks")
            .is_some_and(|b| b == "true" || b == "1"),
        timeout,
    };
    let events = watch::stream(
        shared.store.clone(),
        target.info.clone(),
        options,
        shared.faults.watch_gate(&target.info, target.namespace()),
        shared.faults.watch_token(),
    );
    // Counted while the response body lives: it ends with the watch or the connection.
    let open = OpenWatch::new(shared.open_watches.clone());
    let events = tokio_stream::StreamExt::map(events, move |chunk| {
        let _open = &open;
        chunk
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/json")
        .body(match table {
            None => Body::from_stream(events),
            Some(view) => Body::from_stream(tokio_stream::StreamExt::map(events, move |chunk| {
                chunk.map(|line| bytes::Bytes::from(view.watch_event(&line)))
            })),
        })
        .map_err(|e| ApiError::internal(e.to_string()))
}

fn pod_log(shared: &Arc<Shared>, target: &Target, name: &str, query: &Query) -> Result<Response, ApiError> {
    if let Some(refused) = shared.faults.kubelet_refusal(target.namespace(), name) {
        return Ok(refused);
    }
    let limit = match query.get("limitBytes") {
        Some(l) => Some(
            l.parse()
                .map_err(|_| ApiError::bad_request(format!("invalid limitBytes: {l}")))?,
        ),
        None => None,
    };
    let container = query.get("container").map(String::as_str);
    let mut text = subresources::pod_log(&shared.store, &target.info, target.namespace(), name, container, None)?;
    if let Some(tail) = query.get("tailLines") {
        let tail: usize = tail
            .parse()
            .map_err(|_| ApiError::bad_request(format!("invalid tailLines: {tail}")))?;
        text = subresources::tail_lines(&text, tail);
    }
    if let Some(limit) = limit {
        text = subresources::truncate_bytes(text, limit);
    }
    Ok((StatusCode::OK, [(header::CONTENT_TYPE, "text/plain")], text).into_response())
}

/// One open watch, counted until dropped.
struct OpenWatch(Arc<std::sync::atomic::AtomicU64>);

impl OpenWatch {
    fn new(counter: Arc<std::sync::atomic::AtomicU64>) -> OpenWatch {
        counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        OpenWatch(counter)
    }
}

impl Drop for OpenWatch {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}
