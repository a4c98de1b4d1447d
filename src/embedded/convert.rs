//! Versions that share storage with another resource. events.k8s.io/v1 Events are stored as core/v1
//! Events, as on the real server, so an Event written through either API is read through both
//! (kube-runtime's recorder writes events.k8s.io; `kubectl describe` reads core).

use std::collections::BTreeMap;

use serde_json::{Map, Value};

use super::store::GroupResource;

/// events.k8s.io/v1 field name → core/v1 field name.
const EVENT_FIELDS: &[(&str, &str)] = &[
    ("regarding", "involvedObject"),
    ("note", "message"),
    ("deprecatedSource", "source"),
    ("deprecatedFirstTimestamp", "firstTimestamp"),
    ("deprecatedLastTimestamp", "lastTimestamp"),
    ("deprecatedCount", "count"),
    ("reportingController", "reportingComponent"),
];

fn is_events_api(group: &str, plural: &str) -> bool {
    (group, plural) == ("events.k8s.io", "events")
}

/// Whether this resource's objects read as they are stored (no fields renamed).
pub fn reads_as_stored(group: &str, plural: &str) -> bool {
    !is_events_api(group, plural)
}

/// Where a resource's objects are kept.
pub fn storage_key(group: &str, plural: &str) -> GroupResource {
    if is_events_api(group, plural) {
        GroupResource::new("", "events")
    } else {
        GroupResource::new(group, plural)
    }
}

fn rename(object: &mut Map<String, Value>, from: &str, to: &str) {
    if let Some(value) = object.remove(from) {
        object.insert(to.to_string(), value);
    }
}

/// A request-version object in its stored form.
pub fn to_storage(group: &str, plural: &str, mut object: Value) -> Value {
    if is_events_api(group, plural)
        && let Some(map) = object.as_object_mut()
    {
        EVENT_FIELDS.iter().for_each(|(ours, core)| rename(map, ours, core));
    }
    object
}

/// A stored object in a version's form (apiVersion and kind are the caller's to set).
pub fn from_storage(group: &str, plural: &str, mut object: Value) -> Value {
    if is_events_api(group, plural)
        && let Some(map) = object.as_object_mut()
    {
        EVENT_FIELDS.iter().for_each(|(ours, core)| rename(map, core, ours));
    }
    object
}

/// [`from_storage`] on the top-level fields of a stored object, held by reference (what a served
/// object is written out from, without copying it).
pub fn fields_from_storage<'a>(group: &str, plural: &str, fields: &mut BTreeMap<&'a str, &'a Value>) {
    if !is_events_api(group, plural) {
        return;
    }
    for (ours, core) in EVENT_FIELDS {
        if let Some(value) = fields.remove(core) {
            fields.insert(ours, value);
        }
    }
}

/// A field-selector field of this version, named as in storage (`regarding.name` → `involvedObject.name`).
pub fn field_to_storage(group: &str, plural: &str, field: &str) -> String {
    if !is_events_api(group, plural) {
        return field.to_string();
    }
    let (head, rest) = field.split_once('.').map_or((field, None), |(h, r)| (h, Some(r)));
    let head = EVENT_FIELDS
        .iter()
        .find(|(ours, _)| *ours == head)
        .map_or(head, |(_, core)| core);
    match rest {
        Some(rest) => format!("{head}.{rest}"),
        None => head.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn events_api_events_round_trip_through_core_storage() {
        let event = json!({"regarding": {"name": "p"}, "note": "hi", "reason": "R"});
        let stored = to_storage("events.k8s.io", "events", event.clone());
        assert_eq!(
            stored,
            json!({"involvedObject": {"name": "p"}, "message": "hi", "reason": "R"})
        );
        assert_eq!(from_storage("events.k8s.io", "events", stored), event);
    }

    #[test]
    fn events_api_field_selectors_use_core_field_names() {
        assert_eq!(
            field_to_storage("events.k8s.io", "events", "regarding.name"),
            "involvedObject.name"
        );
        assert_eq!(
            field_to_storage("", "events", "involvedObject.name"),
            "involvedObject.name"
        );
    }
}
