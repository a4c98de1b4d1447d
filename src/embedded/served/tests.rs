//! Served bytes against the copies they replace: [`present`]'s value, written out by
//! `serde_json`, as every get, list and watch event was answered before objects were shared.

use std::sync::Arc;

use serde_json::{Value, json};

use super::*;
use crate::embedded::discovery::{Resources, crd_resources};
use crate::embedded::store::Store;

fn builtin(group: &str, version: &str, plural: &str) -> ResourceInfo {
    let resources = Resources::current(&Store::new());
    resources
        .find(group, version, plural)
        .unwrap_or_else(|| panic!("{group}/{version} {plural} is built in"))
}

/// A CRD whose `spec.size` defaults to 3.
fn widgets() -> ResourceInfo {
    let crd = json!({
        "metadata": {"name": "widgets.test.stackd.dev"},
        "spec": {
            "group": "test.stackd.dev", "scope": "Namespaced",
            "names": {"plural": "widgets", "kind": "Widget"},
            "versions": [{"name": "v1", "served": true, "storage": true, "schema": {"openAPIV3Schema": {
                "type": "object",
                "properties": {"spec": {"type": "object", "properties": {
                    "size": {"type": "integer", "default": 3},
                    "colour": {"type": "string"},
                }}},
            }}}],
        },
    });
    crd_resources(&crd).remove(0)
}

/// What a get or a create answered before: the presented copy, written out.
fn copied(info: &ResourceInfo, stored: &Value) -> String {
    present(info, stored.clone()).to_string()
}

fn served(info: &ResourceInfo, stored: &Value) -> String {
    serde_json::to_string(&Served::new(info, Arc::new(stored.clone()))).unwrap()
}

fn pod() -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "p", "namespace": "ns", "uid": "u", "resourceVersion": "7",
                     "labels": {"job-name": "j", "a\"b": "x"}},
        "spec": {"containers": [{"name": "c", "image": "busybox", "args": ["é", "\n"]}]},
        "status": {"phase": "Running"},
    })
}

#[test]
fn a_served_builtin_is_the_copy_byte_for_byte() {
    let info = builtin("", "v1", "pods");
    assert_eq!(served(&info, &pod()), copied(&info, &pod()));
}

#[test]
fn a_served_object_gains_its_versions_type_fields_where_it_lacks_them() {
    let info = builtin("", "v1", "configmaps");
    let stored = json!({"metadata": {"name": "c", "namespace": "ns"}, "data": {"k": "v"}, "zeta": 1});
    assert_eq!(served(&info, &stored), copied(&info, &stored));
    assert!(served(&info, &stored).starts_with(r#"{"apiVersion":"v1","data""#));
}

#[test]
fn an_event_served_as_events_k8s_io_is_renamed_as_the_copy_was() {
    let info = builtin("events.k8s.io", "v1", "events");
    let stored = json!({
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"name": "e", "namespace": "ns"},
        "involvedObject": {"kind": "Pod", "name": "p"}, "message": "pulled", "reason": "Pulled",
        "source": {"component": "kubelet"}, "count": 2,
    });
    assert_eq!(served(&info, &stored), copied(&info, &stored));
    assert!(served(&info, &stored).contains(r#""regarding":{"kind":"Pod""#));
}

#[test]
fn a_custom_resource_is_served_with_its_schema_defaults_whether_stored_with_them_or_not() {
    let info = widgets();
    let defaulted = json!({"apiVersion": "test.stackd.dev/v1", "kind": "Widget",
        "metadata": {"name": "w", "namespace": "ns"}, "spec": {"size": 5, "colour": "red"}});
    let missing = json!({"apiVersion": "test.stackd.dev/v1", "kind": "Widget",
        "metadata": {"name": "w", "namespace": "ns"}, "spec": {"colour": "red"}});
    for stored in [defaulted, missing] {
        assert_eq!(served(&info, &stored), copied(&info, &stored));
    }
    let missing = json!({"metadata": {"name": "w"}, "spec": {}});
    assert!(served(&info, &missing).contains(r#""spec":{"size":3}"#));
}

#[test]
fn a_served_list_is_the_copied_list_byte_for_byte() {
    let info = builtin("", "v1", "pods");
    let items = vec![Arc::new(pod()), Arc::new(json!({"metadata": {"name": "q"}}))];
    let metadata = json!({"resourceVersion": "9", "continue": "abc", "remainingItemCount": 1});
    let list = ServedList::new(&info, metadata, items);
    let text = serde_json::to_string(&list).unwrap();
    assert_eq!(text, list.into_value().to_string());
    let empty = ServedList::new(&info, json!({"resourceVersion": "9"}), Vec::new());
    assert_eq!(serde_json::to_string(&empty).unwrap(), empty.into_value().to_string());
}

#[test]
fn a_watch_line_is_the_copied_event_byte_for_byte() {
    let info = builtin("", "v1", "pods");
    let line = WatchLine {
        event_type: "MODIFIED",
        object: Served::new(&info, Arc::new(pod())),
    };
    // `type` first, as kube-apiserver writes it.
    let copied = format!("{{\"type\":\"MODIFIED\",\"object\":{}}}", present(&info, pod()));
    assert_eq!(serde_json::to_string(&line).unwrap(), copied);
}
