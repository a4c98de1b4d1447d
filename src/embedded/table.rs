//! Server-side printing: `Accept: application/json;as=Table;v=v1;g=meta.k8s.io` turns a get, list or
//! watch answer into a `meta.k8s.io` Table, as `kubectl get` asks. Custom resources use their CRD
//! version's `additionalPrinterColumns`; built-ins the columns kube-apiserver prints for them.
//! `as=PartialObjectMetadata[List]` (metadata-only clients) is the same kind of transformation.

use serde_json::{Value, json};

use super::discovery::ResourceInfo;
use super::store::{GroupResource, Store};

/// What a client asked the objects to be turned into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    Table,
    /// `PartialObjectMetadata` per object, `PartialObjectMetadataList` for a list.
    Metadata,
}

/// The shape and its `meta.k8s.io` version, if the client's first supported media type asks for one.
pub fn negotiate(accept: &str) -> Option<(Shape, &'static str)> {
    for entry in accept.split(',') {
        let mut parts = entry.split(';').map(str::trim);
        let media = parts.next().unwrap_or("");
        let params: Vec<(&str, &str)> = parts.filter_map(|p| p.split_once('=')).collect();
        let param = |name: &str| params.iter().find(|(k, _)| *k == name).map(|(_, v)| *v);
        if !matches!(media, "application/json" | "application/*" | "*/*" | "application/yaml") {
            continue;
        }
        let version = match param("v") {
            Some("v1") => "meta.k8s.io/v1",
            Some("v1beta1") => "meta.k8s.io/v1beta1",
            _ => "",
        };
        match (param("as"), param("g")) {
            (None, _) => return None,
            (Some("Table"), Some("meta.k8s.io")) if !version.is_empty() => return Some((Shape::Table, version)),
            (Some("PartialObjectMetadata" | "PartialObjectMetadataList"), Some("meta.k8s.io"))
                if !version.is_empty() =>
            {
                return Some((Shape::Metadata, version));
            }
            _ => continue,
        }
    }
    None
}

/// What each row carries along (`includeObject`): kubectl asks for the whole object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IncludeObject {
    None,
    Metadata,
    Object,
}

impl IncludeObject {
    pub fn parse(value: Option<&str>) -> IncludeObject {
        match value {
            Some("None") => IncludeObject::None,
            Some("Object") => IncludeObject::Object,
            _ => IncludeObject::Metadata,
        }
    }
}

struct Column {
    name: String,
    kind: String,
    format: String,
    description: String,
    priority: i64,
    cell: Cell,
}

enum Cell {
    Name,
    Path(String),
    Builtin(fn(&Value) -> Value),
}

fn column(name: &str, kind: &str, cell: Cell) -> Column {
    Column {
        name: name.to_string(),
        kind: kind.to_string(),
        format: if matches!(cell, Cell::Name) {
            "name".into()
        } else {
            String::new()
        },
        description: String::new(),
        priority: 0,
        cell,
    }
}

fn builtin(name: &str, kind: &str, f: fn(&Value) -> Value) -> Column {
    column(name, kind, Cell::Builtin(f))
}

fn age_column() -> Column {
    builtin("Age", "string", |o| json!(age(&o["metadata"]["creationTimestamp"])))
}

fn columns(info: &ResourceInfo, crd_columns: Option<&Value>) -> Vec<Column> {
    let name = || column("Name", "string", Cell::Name);
    if info.schema.is_some() {
        let mut columns = vec![name()];
        match crd_columns.and_then(Value::as_array).filter(|c| !c.is_empty()) {
            Some(defined) => columns.extend(defined.iter().map(|c| Column {
                name: c["name"].as_str().unwrap_or("").to_string(),
                kind: c["type"].as_str().unwrap_or("string").to_string(),
                format: c["format"].as_str().unwrap_or("").to_string(),
                description: c["description"].as_str().unwrap_or("").to_string(),
                priority: c["priority"].as_i64().unwrap_or(0),
                cell: Cell::Path(c["jsonPath"].as_str().unwrap_or("").to_string()),
            })),
            None => columns.push(age_column()),
        }
        return columns;
    }
    let mut columns = vec![name()];
    columns.extend(builtin_columns(&info.group, &info.kind));
    columns
}

fn count(value: &Value) -> usize {
    value.as_object().map_or(0, |m| m.len())
}

fn builtin_columns(group: &str, kind: &str) -> Vec<Column> {
    if matches!((group, kind), ("" | "events.k8s.io", "Event")) {
        return event_columns();
    }
    let mut columns = match group {
        "" => core_columns(kind),
        "apps" | "batch" => workload_columns(group, kind),
        _ => other_columns(group, kind),
    };
    columns.push(age_column());
    columns
}

/// Columns of the core group's kinds (Events apart).
fn core_columns(kind: &str) -> Vec<Column> {
    match ("", kind) {
        ("", "Pod") => vec![
            builtin("Ready", "string", |o| {
                let total = o["spec"]["containers"].as_array().map_or(0, Vec::len);
                let statuses = o["status"]["containerStatuses"].as_array();
                let ready = statuses.map_or(0, |s| s.iter().filter(|c| c["ready"] == json!(true)).count());
                json!(format!("{ready}/{total}"))
            }),
            builtin("Status", "string", |o| {
                if o["metadata"]["deletionTimestamp"].is_string() {
                    return json!("Terminating");
                }
                json!(o["status"]["phase"].as_str().unwrap_or("Pending"))
            }),
            builtin("Restarts", "string", |o| {
                let statuses = o["status"]["containerStatuses"].as_array();
                let restarts: i64 = statuses.map_or(0, |s| s.iter().filter_map(|c| c["restartCount"].as_i64()).sum());
                json!(restarts.to_string())
            }),
        ],
        ("", "ConfigMap") => vec![builtin("Data", "integer", |o| {
            json!(count(&o["data"]) + count(&o["binaryData"]))
        })],
        ("", "Secret") => vec![
            builtin("Type", "string", |o| json!(o["type"].as_str().unwrap_or("Opaque"))),
            builtin("Data", "integer", |o| json!(count(&o["data"]))),
        ],
        ("", "Namespace") => vec![builtin("Status", "string", |o| {
            json!(o["status"]["phase"].as_str().unwrap_or("Active"))
        })],
        ("", "ServiceAccount") => vec![builtin("Secrets", "integer", |o| {
            json!(o["secrets"].as_array().map_or(0, Vec::len))
        })],
        ("", "Service") => vec![
            builtin("Type", "string", |o| {
                json!(o["spec"]["type"].as_str().unwrap_or("ClusterIP"))
            }),
            builtin("Cluster-IP", "string", |o| {
                json!(o["spec"]["clusterIP"].as_str().unwrap_or("<none>"))
            }),
            builtin("Ports", "string", |o| {
                let ports: Vec<String> = o["spec"]["ports"]
                    .as_array()
                    .map(|p| {
                        p.iter()
                            .map(|p| format!("{}/{}", p["port"], p["protocol"].as_str().unwrap_or("TCP")))
                            .collect()
                    })
                    .unwrap_or_default();
                json!(if ports.is_empty() {
                    "<none>".to_string()
                } else {
                    ports.join(",")
                })
            }),
        ],
        _ => vec![],
    }
}

/// Columns of Deployments, ReplicaSets and Jobs.
fn workload_columns(group: &str, kind: &str) -> Vec<Column> {
    match (group, kind) {
        ("apps", "Deployment") => vec![
            builtin("Ready", "string", |o| {
                let ready = o["status"]["readyReplicas"].as_i64().unwrap_or(0);
                let wanted = o["spec"]["replicas"].as_i64().unwrap_or(1);
                json!(format!("{ready}/{wanted}"))
            }),
            builtin("Up-to-date", "integer", |o| {
                json!(o["status"]["updatedReplicas"].as_i64().unwrap_or(0))
            }),
            builtin("Available", "integer", |o| {
                json!(o["status"]["availableReplicas"].as_i64().unwrap_or(0))
            }),
        ],
        ("apps", "ReplicaSet") => vec![
            builtin("Desired", "integer", |o| {
                json!(o["spec"]["replicas"].as_i64().unwrap_or(1))
            }),
            builtin("Current", "integer", |o| {
                json!(o["status"]["replicas"].as_i64().unwrap_or(0))
            }),
            builtin("Ready", "integer", |o| {
                json!(o["status"]["readyReplicas"].as_i64().unwrap_or(0))
            }),
        ],
        ("batch", "Job") => vec![
            builtin("Completions", "string", |o| {
                let succeeded = o["status"]["succeeded"].as_i64().unwrap_or(0);
                let wanted = o["spec"]["completions"].as_i64().unwrap_or(1);
                json!(format!("{succeeded}/{wanted}"))
            }),
            builtin("Duration", "string", |o| {
                let start = timestamp(&o["status"]["startTime"]);
                let end = timestamp(&o["status"]["completionTime"]).unwrap_or_else(jiff::Timestamp::now);
                json!(start.map_or(String::new(), |s| human_duration((end - s).get_seconds())))
            }),
        ],
        _ => vec![],
    }
}

/// Columns of Leases, role bindings and network policies.
fn other_columns(group: &str, kind: &str) -> Vec<Column> {
    match (group, kind) {
        ("networking.k8s.io", "NetworkPolicy") => vec![builtin("Pod-Selector", "string", |o| {
            json!(format_selector(&o["spec"]["podSelector"]))
        })],
        ("coordination.k8s.io", "Lease") => vec![builtin("Holder", "string", |o| {
            json!(o["spec"]["holderIdentity"].as_str().unwrap_or(""))
        })],
        ("rbac.authorization.k8s.io", "RoleBinding" | "ClusterRoleBinding") => vec![builtin("Role", "string", |o| {
            json!(format!(
                "{}/{}",
                o["roleRef"]["kind"].as_str().unwrap_or(""),
                o["roleRef"]["name"].as_str().unwrap_or("")
            ))
        })],
        _ => vec![],
    }
}

/// A label selector as kubectl prints it (`app=x,tier in (a,b),!gone`), `<none>` when empty.
fn format_selector(selector: &Value) -> String {
    let mut parts: Vec<String> = selector["matchLabels"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(key, value)| format!("{key}={}", value.as_str().unwrap_or_default()))
        .collect();
    for expression in selector["matchExpressions"].as_array().into_iter().flatten() {
        let key = expression["key"].as_str().unwrap_or_default();
        let values: Vec<&str> = expression["values"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        parts.push(match expression["operator"].as_str().unwrap_or_default() {
            "In" => format!("{key} in ({})", values.join(",")),
            "NotIn" => format!("{key} notin ({})", values.join(",")),
            "Exists" => key.to_string(),
            _ => format!("!{key}"),
        });
    }
    if parts.is_empty() {
        "<none>".into()
    } else {
        parts.join(",")
    }
}

/// An Event's columns: kubectl shows no age column for them, but when it was last seen.
fn event_columns() -> Vec<Column> {
    vec![
        builtin("Last Seen", "string", |o| {
            let seen = [
                &o["lastTimestamp"],
                &o["eventTime"],
                &o["metadata"]["creationTimestamp"],
            ]
            .into_iter()
            .find(|t| t.is_string())
            .cloned()
            .unwrap_or(Value::Null);
            json!(age(&seen))
        }),
        builtin("Type", "string", |o| json!(o["type"].as_str().unwrap_or(""))),
        builtin("Reason", "string", |o| json!(o["reason"].as_str().unwrap_or(""))),
        builtin("Object", "string", |o| {
            let object = if o["regarding"].is_object() {
                &o["regarding"]
            } else {
                &o["involvedObject"]
            };
            let kind = object["kind"].as_str().unwrap_or("").to_lowercase();
            json!(format!("{kind}/{}", object["name"].as_str().unwrap_or("")))
        }),
        builtin("Message", "string", |o| {
            json!(o["message"].as_str().or(o["note"].as_str()).unwrap_or(""))
        }),
    ]
}

fn timestamp(value: &Value) -> Option<jiff::Timestamp> {
    value.as_str().and_then(|s| s.parse().ok())
}

/// How long ago a timestamp was, as kubectl shows it (`<unknown>` when unset).
fn age(value: &Value) -> String {
    match timestamp(value) {
        Some(t) => human_duration((jiff::Timestamp::now() - t).get_seconds()),
        None => "<unknown>".to_string(),
    }
}

/// apimachinery's `duration.HumanDuration`.
pub fn human_duration(seconds: i64) -> String {
    if seconds < -1 {
        return "<invalid>".into();
    }
    let seconds = seconds.max(0);
    let (minutes, hours, days) = (seconds / 60, seconds / 3600, seconds / 86400);
    let years = days / 365;
    if seconds < 120 {
        format!("{seconds}s")
    } else if minutes < 10 {
        match seconds % 60 {
            0 => format!("{minutes}m"),
            s => format!("{minutes}m{s}s"),
        }
    } else if minutes < 180 {
        format!("{minutes}m")
    } else if hours < 8 {
        match minutes % 60 {
            0 => format!("{hours}h"),
            m => format!("{hours}h{m}m"),
        }
    } else if hours < 48 {
        format!("{hours}h")
    } else if hours < 192 {
        match hours % 24 {
            0 => format!("{days}d"),
            h => format!("{days}d{h}h"),
        }
    } else if days < 365 * 2 {
        format!("{days}d")
    } else if days < 365 * 8 {
        match days % 365 {
            0 => format!("{years}y"),
            d => format!("{years}y{d}d"),
        }
    } else {
        format!("{years}y")
    }
}

fn cell(column: &Column, object: &Value) -> Value {
    match &column.cell {
        Cell::Name => object["metadata"]["name"].clone(),
        Cell::Builtin(f) => f(object),
        Cell::Path(path) => match json_path(object, path) {
            None => Value::Null,
            Some(value) => match column.kind.as_str() {
                "date" => json!(age(&value)),
                "string" => match value {
                    Value::String(s) => json!(s),
                    other => json!(other.to_string()),
                },
                _ => value,
            },
        },
    }
}

/// The first result of a printer-column JSONPath: `.a.b`, `[0]`, `[*]`, `['key']` and
/// `[?(@.field=="value")]` filters, which is what printer columns use.
pub fn json_path(root: &Value, path: &str) -> Option<Value> {
    let path = path.trim().trim_start_matches('{').trim_end_matches('}');
    let path = path.strip_prefix('$').unwrap_or(path);
    let mut current = vec![root.clone()];
    let mut rest = path;
    while !rest.is_empty() {
        if let Some(after) = rest.strip_prefix('.') {
            let end = after.find(['.', '[']).unwrap_or(after.len());
            let field = &after[..end];
            rest = &after[end..];
            if field.is_empty() {
                continue;
            }
            current = current.iter().filter_map(|v| v.get(field).cloned()).collect();
        } else if let Some(after) = rest.strip_prefix('[') {
            let end = after.find(']')?;
            // A filter may contain `]` only inside quotes; printer columns do not.
            let selector = &after[..end];
            rest = &after[end + 1..];
            current = select(current, selector)?;
        } else {
            return None;
        }
    }
    current.into_iter().next()
}

fn select(values: Vec<Value>, selector: &str) -> Option<Vec<Value>> {
    let selector = selector.trim();
    if selector == "*" {
        return Some(
            values
                .into_iter()
                .flat_map(|v| match v {
                    Value::Array(items) => items,
                    Value::Object(map) => map.into_iter().map(|(_, v)| v).collect(),
                    _ => vec![],
                })
                .collect(),
        );
    }
    if let Some(filter) = selector.strip_prefix("?(").and_then(|f| f.strip_suffix(')')) {
        let (left, right) = filter.split_once("==")?;
        let field = left.trim().strip_prefix("@.")?;
        let wanted = right.trim().trim_matches(|c| c == '"' || c == '\'');
        return Some(
            values
                .into_iter()
                .flat_map(|v| v.as_array().cloned().unwrap_or_default())
                .filter(|item| {
                    let actual = item.pointer(&format!("/{}", field.replace('.', "/")));
                    match actual {
                        Some(Value::String(s)) => s == wanted,
                        Some(other) => serde_json::from_str::<Value>(wanted).ok().as_ref() == Some(other),
                        None => false,
                    }
                })
                .collect(),
        );
    }
    if let Some(key) = selector
        .strip_prefix('\'')
        .and_then(|k| k.strip_suffix('\''))
        .or_else(|| selector.strip_prefix('"').and_then(|k| k.strip_suffix('"')))
    {
        return Some(values.iter().filter_map(|v| v.get(key).cloned()).collect());
    }
    let index: i64 = selector.parse().ok()?;
    Some(
        values
            .iter()
            .filter_map(|v| {
                let items = v.as_array()?;
                let at = if index < 0 { items.len() as i64 + index } else { index };
                usize::try_from(at).ok().and_then(|i| items.get(i)).cloned()
            })
            .collect(),
    )
}

fn row(columns: &[Column], object: &Value, include: IncludeObject) -> Value {
    let cells: Vec<Value> = columns.iter().map(|c| cell(c, object)).collect();
    let mut row = json!({ "cells": cells });
    match include {
        IncludeObject::None => {}
        IncludeObject::Object => row["object"] = object.clone(),
        IncludeObject::Metadata => {
            let mut metadata = object["metadata"].clone();
            if let Some(meta) = metadata.as_object_mut() {
                meta.remove("managedFields");
            }
            row["object"] = json!({
                "kind": "PartialObjectMetadata",
                "apiVersion": "meta.k8s.io/v1",
                "metadata": metadata,
            });
        }
    }
    row
}

/// The `additionalPrinterColumns` of the CRD version serving `info`.
fn crd_printer_columns(store: &Store, info: &ResourceInfo) -> Option<Value> {
    let crd = store.get_shared(
        &GroupResource::new("apiextensions.k8s.io", "customresourcedefinitions"),
        "",
        &format!("{}.{}", info.plural, info.group),
    )?;
    let versions = crd["spec"]["versions"].as_array()?;
    let version = versions
        .iter()
        .find(|v| v["name"].as_str() == Some(info.version.as_str()))?;
    version.get("additionalPrinterColumns").cloned()
}

/// How `info` prints as `shape` of `api_version`.
pub fn view(
    store: &Store,
    info: &ResourceInfo,
    (shape, api_version): (Shape, &'static str),
    include: IncludeObject,
) -> TableView {
    let crd_columns = if info.schema.is_some() && shape == Shape::Table {
        crd_printer_columns(store, info)
    } else {
        None
    };
    let mut view = TableView::new(info, crd_columns.as_ref(), api_version, include);
    view.shape = shape;
    view
}

fn partial_metadata(object: &Value, api_version: &str) -> Value {
    json!({"kind": "PartialObjectMetadata", "apiVersion": api_version, "metadata": object["metadata"]})
}

/// How one resource prints.
pub struct TableView {
    shape: Shape,
    api_version: &'static str,
    columns: Vec<Column>,
    include: IncludeObject,
}

impl TableView {
    /// `crd_columns` is the served CRD version's `additionalPrinterColumns`.
    pub fn new(
        info: &ResourceInfo,
        crd_columns: Option<&Value>,
        api_version: &'static str,
        include: IncludeObject,
    ) -> TableView {
        TableView {
            shape: Shape::Table,
            api_version,
            columns: columns(info, crd_columns),
            include,
        }
    }

    fn definitions(&self) -> Vec<Value> {
        self.columns
            .iter()
            .map(|c| {
                json!({
                    "name": c.name,
                    "type": c.kind,
                    "format": c.format,
                    "description": c.description,
                    "priority": c.priority,
                })
            })
            .collect()
    }

    /// A Table of one object (a get, or one watch event).
    pub fn object(&self, object: &Value) -> Value {
        if self.shape == Shape::Metadata {
            return partial_metadata(object, self.api_version);
        }
        json!({
            "kind": "Table",
            "apiVersion": self.api_version,
            "metadata": {"resourceVersion": object["metadata"]["resourceVersion"]},
            "columnDefinitions": self.definitions(),
            "rows": [row(&self.columns, object, self.include)],
        })
    }

    /// A Table of a list answer, keeping its list metadata (resourceVersion, continue).
    pub fn list(&self, list: &Value) -> Value {
        if self.shape == Shape::Metadata {
            let items: Vec<Value> = list["items"]
                .as_array()
                .map(|items| items.iter().map(|o| partial_metadata(o, self.api_version)).collect())
                .unwrap_or_default();
            return json!({
                "kind": "PartialObjectMetadataList",
                "apiVersion": self.api_version,
                "metadata": list["metadata"],
                "items": items,
            });
        }
        let rows: Vec<Value> = list["items"]
            .as_array()
            .map(|items| items.iter().map(|o| row(&self.columns, o, self.include)).collect())
            .unwrap_or_default();
        json!({
            "kind": "Table",
            "apiVersion": self.api_version,
            "metadata": list["metadata"],
            "columnDefinitions": self.definitions(),
            "rows": rows,
        })
    }

    /// One watch event line with its object as a Table (errors and bookmarks pass unchanged).
    pub fn watch_event(&self, line: &[u8]) -> Vec<u8> {
        let Ok(mut event) = serde_json::from_slice::<Value>(line) else {
            return line.to_vec();
        };
        if matches!(event["type"].as_str(), Some("ADDED" | "MODIFIED" | "DELETED")) {
            event["object"] = self.object(&event["object"]);
        }
        let mut out = event.to_string().into_bytes();
        out.push(b'\n');
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_supported_accepted_type_wins() {
        let kubectl = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json;as=Table;v=v1beta1;g=meta.k8s.io,application/json";
        assert_eq!(negotiate(kubectl), Some((Shape::Table, "meta.k8s.io/v1")));
        let metadata = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1";
        assert_eq!(negotiate(metadata), Some((Shape::Metadata, "meta.k8s.io/v1")));
        assert_eq!(negotiate("application/json"), None);
        assert_eq!(
            negotiate("application/json, application/json;as=Table;v=v1;g=meta.k8s.io"),
            None
        );
        assert_eq!(
            negotiate("application/json;as=Table;v=v9;g=meta.k8s.io,application/json"),
            None
        );
    }

    #[test]
    fn json_path_filters_conditions_by_type() {
        let object = json!({"status": {"conditions": [
            {"type": "Progressing", "status": "False"},
            {"type": "Ready", "status": "True"}
        ]}, "spec": {"items": [1, 2]}});
        let ready = json_path(&object, ".status.conditions[?(@.type==\"Ready\")].status");
        assert_eq!(ready, Some(json!("True")));
        assert_eq!(json_path(&object, ".spec.items[1]"), Some(json!(2)));
        assert_eq!(json_path(&object, ".spec.missing"), None);
    }

    #[test]
    fn selectors_print_like_kubectl() {
        assert_eq!(format_selector(&json!({})), "<none>");
        let selector = json!({"matchLabels": {"app": "x"}, "matchExpressions": [
            {"key": "tier", "operator": "In", "values": ["a", "b"]},
            {"key": "gone", "operator": "DoesNotExist"},
        ]});
        assert_eq!(format_selector(&selector), "app=x,tier in (a,b),!gone");
    }

    #[test]
    fn human_durations_read_like_kubectl() {
        assert_eq!(human_duration(5), "5s");
        assert_eq!(human_duration(150), "2m30s");
        assert_eq!(human_duration(3 * 3600 + 120), "3h2m");
        assert_eq!(human_duration(3 * 86400), "3d");
    }
}
