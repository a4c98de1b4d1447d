//! `metadata.managedFields` entries: reading, writing, ordering and naming them.

use std::collections::HashMap;

use serde_json::{Map, Value, json};

use super::fieldset::{Element, FieldSet};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Operation {
    Apply,
    Update,
}

impl Operation {
    fn as_str(self) -> &'static str {
        match self {
            Operation::Apply => "Apply",
            Operation::Update => "Update",
        }
    }
}

/// One manager's entry. Entries are told apart by manager, operation and subresource, and
/// Update entries also by API version, as kube-apiserver does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ManagedEntry {
    pub manager: String,
    pub operation: Operation,
    pub api_version: String,
    pub time: Option<String>,
    pub subresource: Option<String>,
    fields: FieldSet,
}

impl ManagedEntry {
    pub(super) fn new(
        manager: &str,
        operation: Operation,
        api_version: String,
        time: Option<String>,
        subresource: Option<&str>,
        fields: FieldSet,
    ) -> ManagedEntry {
        ManagedEntry {
            manager: manager.to_string(),
            operation,
            api_version,
            time,
            subresource: subresource.map(str::to_string),
            fields,
        }
    }

    pub(super) fn fields(&self) -> &FieldSet {
        &self.fields
    }

    pub(super) fn into_fields(self) -> FieldSet {
        self.fields
    }

    /// Takes every path of `paths` from this entry (in place: most paths stay).
    pub(super) fn give_up(&mut self, paths: &FieldSet) {
        self.fields.remove_all(paths);
    }

    /// Adds every path of `paths` to this entry.
    pub(super) fn take(&mut self, paths: FieldSet) {
        self.fields.extend(paths);
    }

    pub(super) fn is_same_writer(&self, other: &ManagedEntry) -> bool {
        self.manager == other.manager
            && self.operation == other.operation
            && self.subresource == other.subresource
            && (self.operation == Operation::Apply || self.api_version == other.api_version)
    }

    fn to_json(&self) -> Value {
        let mut entry = json!({
            "manager": self.manager,
            "operation": self.operation.as_str(),
            "apiVersion": self.api_version,
            "fieldsType": "FieldsV1",
            "fieldsV1": self.fields.to_fields_v1(),
        });
        if let Some(object) = entry.as_object_mut() {
            if let Some(time) = &self.time {
                object.insert("time".to_string(), Value::String(time.clone()));
            }
            if let Some(subresource) = &self.subresource {
                object.insert("subresource".to_string(), Value::String(subresource.clone()));
            }
        }
        entry
    }

    /// Reads an entry; malformed ones are skipped, as kube-apiserver resets what it cannot decode.
    fn from_json(entry: &Value) -> Option<ManagedEntry> {
        let text = |name: &str| entry.get(name).and_then(Value::as_str).map(str::to_string);
        let operation = match entry.get("operation").and_then(Value::as_str)? {
            "Apply" => Operation::Apply,
            "Update" => Operation::Update,
            _ => return None,
        };
        let fields = match entry.get("fieldsV1") {
            Some(fields) => FieldSet::from_fields_v1(fields).ok()?,
            None => FieldSet::new(),
        };
        Some(ManagedEntry {
            manager: text("manager")?,
            operation,
            api_version: text("apiVersion").unwrap_or_default(),
            time: text("time"),
            subresource: text("subresource").filter(|s| !s.is_empty()),
            fields,
        })
    }

    /// The manager as kube-apiserver names it in conflicts: `"m"`, `"m" with subresource
    /// "status"`, `"m" using v1 at 2024-01-01T00:00:00Z`.
    pub(super) fn describe(&self) -> String {
        let mut text = Value::String(self.manager.clone()).to_string();
        if let Some(subresource) = &self.subresource {
            text.push_str(&format!(" with subresource {}", Value::String(subresource.clone())));
        }
        if self.operation == Operation::Update {
            text.push_str(&format!(" using {}", self.api_version));
            if let Some(time) = &self.time {
                text.push_str(&format!(" at {time}"));
            }
        }
        text
    }
}

/// The entries in `metadata.managedFields`; `None` when the object has none at all.
pub(crate) fn read_entries(object: &Value) -> Option<Vec<ManagedEntry>> {
    let entries = object.get("metadata")?.get("managedFields")?.as_array()?;
    if entries.is_empty() {
        return None;
    }
    Some(entries.iter().filter_map(ManagedEntry::from_json).collect())
}

/// Writes entries into `metadata.managedFields` in kube-apiserver's order (Apply before Update,
/// then oldest first, then by manager), dropping entries that own nothing and folding old
/// Update entries beyond the tenth.
pub(crate) fn write_entries(object: &mut Value, mut entries: Vec<ManagedEntry>) {
    entries.retain(|entry| !entry.fields().is_empty());
    sort_entries(&mut entries);
    let mut entries = cap_update_entries(entries);
    sort_entries(&mut entries);
    let Some(object) = object.as_object_mut() else {
        return;
    };
    let metadata = object.entry("metadata").or_insert_with(|| Value::Object(Map::new()));
    let Some(metadata) = metadata.as_object_mut() else {
        return;
    };
    if entries.is_empty() {
        metadata.remove("managedFields");
    } else {
        let encoded = entries.iter().map(ManagedEntry::to_json).collect();
        metadata.insert("managedFields".to_string(), Value::Array(encoded));
    }
}

fn sort_entries(entries: &mut [ManagedEntry]) {
    entries.sort_by(|a, b| sort_key(a).cmp(&sort_key(b)));
}

fn sort_key(entry: &ManagedEntry) -> (Operation, Option<&str>, &str, &str, Option<&str>) {
    (
        entry.operation,
        entry.time.as_deref(),
        &entry.manager,
        &entry.api_version,
        entry.subresource.as_deref(),
    )
}

/// kube-apiserver keeps at most this many Update entries.
const MAX_UPDATE_ENTRIES: usize = 10;
/// The entry the oldest Update entries beyond the cap are folded into, one per API version.
const ANCIENT_CHANGES: &str = "ancient-changes";

/// Folds the oldest Update entries into `ancient-changes` until ten remain: the oldest entry of
/// each API version becomes the bucket and takes the fields and time of the next ones.
/// `entries` must be sorted (Apply first, then Update oldest first).
fn cap_update_entries(entries: Vec<ManagedEntry>) -> Vec<ManagedEntry> {
    let updates = entries
        .iter()
        .filter(|entry| entry.operation == Operation::Update)
        .count();
    let mut excess = updates.saturating_sub(MAX_UPDATE_ENTRIES);
    if excess == 0 {
        return entries;
    }
    let mut kept: Vec<ManagedEntry> = Vec::with_capacity(entries.len());
    let mut bucket_of_version: HashMap<String, usize> = HashMap::new();
    for entry in entries {
        if entry.operation == Operation::Apply || excess == 0 {
            kept.push(entry);
            continue;
        }
        match bucket_of_version.get(&entry.api_version).copied() {
            Some(index) => {
                let bucket = &mut kept[index];
                bucket.manager = ANCIENT_CHANGES.to_string();
                bucket.subresource = None;
                bucket.take(entry.fields);
                bucket.time = entry.time;
                excess -= 1;
            }
            None => {
                bucket_of_version.insert(entry.api_version.clone(), kept.len());
                kept.push(entry);
            }
        }
    }
    merge_same_writers(kept)
}

/// Joins entries of one writer (a fresh bucket meeting an older `ancient-changes`).
fn merge_same_writers(entries: Vec<ManagedEntry>) -> Vec<ManagedEntry> {
    let mut merged: Vec<ManagedEntry> = Vec::with_capacity(entries.len());
    for entry in entries {
        match merged.iter_mut().find(|kept| kept.is_same_writer(&entry)) {
            Some(kept) => {
                kept.take(entry.fields);
                kept.time = kept.time.clone().max(entry.time);
            }
            None => merged.push(entry),
        }
    }
    merged
}

/// A copy of `object` without `metadata.managedFields`, for comparing contents.
pub(crate) fn without_managed_fields(object: &Value) -> Value {
    let mut copy = object.clone();
    strip_managed_fields(&mut copy);
    copy
}

/// Removes `metadata.managedFields` from `object` (an owned copy need not be copied again).
pub(crate) fn strip_managed_fields(object: &mut Value) {
    if let Some(metadata) = object.get_mut("metadata").and_then(Value::as_object_mut) {
        metadata.remove("managedFields");
    }
}

/// Fields nobody owns: identity and server-set metadata.
pub(crate) fn is_unowned(path: &[Element]) -> bool {
    match path {
        [Element::Field(top)] => matches!(top.as_str(), "apiVersion" | "kind" | "metadata"),
        _ => is_server_metadata(path),
    }
}

/// A server-set metadata field, or anything in one (`metadata.managedFields` above all): nobody
/// owns what it holds, so comparing versions need not look inside.
pub(crate) fn is_server_metadata(path: &[Element]) -> bool {
    const SERVER_METADATA: [&str; 9] = [
        "name",
        "namespace",
        "uid",
        "resourceVersion",
        "generation",
        "creationTimestamp",
        "managedFields",
        "selfLink",
        "clusterName",
    ];
    match path {
        [Element::Field(top), Element::Field(field), ..] if top == "metadata" => {
            SERVER_METADATA.contains(&field.as_str())
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(manager: &str, operation: Operation, time: &str) -> ManagedEntry {
        let mut fields = FieldSet::new();
        fields.insert(vec![Element::Field("data".into())]);
        ManagedEntry::new(manager, operation, "v1".into(), Some(time.into()), None, fields)
    }

    #[test]
    fn entries_are_written_apply_first_then_oldest_first() {
        let mut object = json!({"metadata": {"name": "a"}});
        write_entries(
            &mut object,
            vec![
                entry("u", Operation::Update, "2024-01-01T00:00:00Z"),
                entry("b", Operation::Apply, "2024-01-02T00:00:00Z"),
                entry("a", Operation::Apply, "2024-01-03T00:00:00Z"),
            ],
        );
        let managers: Vec<&str> = object["metadata"]["managedFields"]
            .as_array()
            .map(|entries| entries.iter().filter_map(|e| e["manager"].as_str()).collect())
            .unwrap_or_default();
        assert_eq!(managers, vec!["b", "a", "u"]);
    }

    #[test]
    fn update_entries_beyond_ten_are_folded_into_ancient_changes() {
        let entries: Vec<ManagedEntry> = (0..12)
            .map(|i| {
                entry(
                    &format!("writer-{i:02}"),
                    Operation::Update,
                    &format!("2024-01-01T00:00:{i:02}Z"),
                )
            })
            .collect();
        let mut object = json!({});
        write_entries(&mut object, entries);
        let managers: Vec<&str> = object["metadata"]["managedFields"]
            .as_array()
            .map(|entries| entries.iter().filter_map(|e| e["manager"].as_str()).collect())
            .unwrap_or_default();
        assert_eq!(managers.len(), 10);
        assert_eq!(managers[..2], ["ancient-changes", "writer-03"]);
        let ancient = read_entries(&object)
            .unwrap_or_default()
            .into_iter()
            .find(|e| e.manager == "ancient-changes")
            .map(|e| e.time);
        assert_eq!(ancient, Some(Some("2024-01-01T00:00:02Z".to_string())));
    }

    #[test]
    fn entries_round_trip_through_json() {
        let mut object = json!({});
        let original = entry("m", Operation::Update, "2024-01-01T00:00:00Z");
        write_entries(&mut object, vec![original.clone()]);
        assert_eq!(read_entries(&object), Some(vec![original]));
    }

    #[test]
    fn update_managers_are_described_with_version_and_time() {
        let update = entry("kubectl-edit", Operation::Update, "2024-01-01T00:00:00Z");
        assert_eq!(update.describe(), r#""kubectl-edit" using v1 at 2024-01-01T00:00:00Z"#);
        let mut apply = entry("fid", Operation::Apply, "2024-01-01T00:00:00Z");
        apply.subresource = Some("status".into());
        assert_eq!(apply.describe(), r#""fid" with subresource "status""#);
    }

    #[test]
    fn identity_metadata_is_never_owned() {
        let path = |parts: &[&str]| -> Vec<Element> { parts.iter().map(|p| Element::Field(p.to_string())).collect() };
        assert!(is_unowned(&path(&["metadata", "name"])));
        assert!(is_unowned(&path(&["metadata"])));
        assert!(!is_unowned(&path(&["metadata", "labels", "app"])));
        assert!(!is_unowned(&path(&["data", "name"])));
    }
}
