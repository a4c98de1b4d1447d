//! The `scale` and `log` subresources.

use serde_json::{Value, json};

use super::discovery::ResourceInfo;
use super::object_meta::meta_str;
use super::patch::{PatchBody, apply_patch};
use super::served::present;
use super::status::{ApiError, Cause};
use super::store::Store;
use super::verb_options::{Subresource, WriteOptions};
use super::verbs::{get, prepare_update, write_existing};

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

pub fn get_scale(store: &Store, info: &ResourceInfo, namespace: &str, name: &str) -> Result<Value, ApiError> {
    scale_of(info, &get(store, info, namespace, name)?.into_value())
}

/// Writes a Scale (given directly or as a patch of the current one) into the object's spec.
pub fn write_scale(
    store: &Store,
    info: &ResourceInfo,
    namespace: &str,
    name: &str,
    change: ScaleChange<'_>,
    options: WriteOptions,
) -> Result<Value, ApiError> {
    let paths = info.scale.clone().ok_or_else(ApiError::path_not_found)?;
    let written = write_existing(store, info, namespace, name, &options, |old| {
        let current = present(info, old.clone());
        let scale = match change {
            ScaleChange::Replace(scale) => scale.clone(),
            ScaleChange::Patch(patch) => {
                let mut scale = scale_of(info, &current)?;
                apply_patch(&mut scale, patch)?;
                super::patch::check_object_shape(&scale)?;
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
    scale_of(info, &written.into_value())
}

pub enum ScaleChange<'a> {
    Replace(&'a Value),
    Patch(PatchBody<'a>),
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
    let pod = get(store, info, namespace, name)?.into_value();
    let names = |field: &str| -> Vec<&str> {
        pod["spec"][field]
            .as_array()
            .map(|c| c.iter().filter_map(|c| c["name"].as_str()).collect())
            .unwrap_or_default()
    };
    let containers = names("containers");
    let init_containers = names("initContainers");
    let container = match (container, containers.as_slice()) {
        (Some(c), _) if containers.contains(&c) || init_containers.contains(&c) => c,
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
    let text = store.pod_log(namespace, name, container).unwrap_or_default();
    Ok(match limit_bytes {
        Some(limit) => truncate_bytes(text, limit),
        None => text,
    })
}

/// The first `limit` bytes (kube cuts bytes; here the cut backs off to a character boundary).
pub fn truncate_bytes(mut text: String, limit: usize) -> String {
    if text.len() > limit {
        let mut cut = limit;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
    }
    text
}

/// The last `lines` lines of a log.
pub fn tail_lines(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.split_inclusive('\n').collect();
    all[all.len().saturating_sub(lines)..].concat()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_lines_keeps_the_last_lines_and_limits_cut_on_character_boundaries() {
        assert_eq!(tail_lines("a\nb\nc\n", 2), "b\nc\n");
        assert_eq!(tail_lines("a\nb", 5), "a\nb");
        assert_eq!(tail_lines("a\nb\n", 0), "");
        assert_eq!(truncate_bytes("héllo".to_string(), 2), "h");
    }

    #[test]
    fn selector_objects_render_as_selector_strings() {
        let sel = json!({"matchLabels": {"app": "x"}, "matchExpressions": [{"key": "t", "operator": "In", "values": ["a", "b"]}]});
        assert_eq!(selector_string(&sel), "app=x,t in (a,b)");
    }
}
