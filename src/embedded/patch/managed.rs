//! `metadata.managedFields` entries: reading, writing, ordering and naming them.

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
    pub fields: FieldSet,
}

impl ManagedEntry {
    pub fn is_same_writer(&self, other: &ManagedEntry) -> bool {
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
                object.insert(
                    "subresource".to_string(),
                    Value::String(subresource.clone()),
                );
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
    pub fn describe(&self) -> String {
        let mut text = Value::String(self.manager.clone()).to_string();
        if let Some(subresource) = &self.subresource {
            text.push_str(&format!(
                " with subresource {}",
                Value::String(subresource.clone())
            ));
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
/// then oldest first, then by manager), dropping entries that own nothing.
pub(crate) fn write_entries(object: &mut Value, mut entries: Vec<ManagedEntry>) {
    entries.retain(|entry| !entry.fields.is_empty());
    entries.sort_by(|a, b| {
        (
            a.operation,
            &a.time,
            &a.manager,
            &a.api_version,
            &a.subresource,
        )
            .cmp(&(
                b.operation,
                &b.time,
                &b.manager,
                &b.api_version,
                &b.subresource,
            ))
    });
    let Some(object) = object.as_object_mut() else {
        return;
    };
    let metadata = object
        .entry("metadata")
        .or_insert_with(|| Value::Object(Map::new()));
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

/// A copy of `object` without `metadata.managedFields`, for comparing contents.
pub(crate) fn without_managed_fields(object: &Value) -> Value {
    let mut copy = object.clone();
    if let Some(metadata) = copy.get_mut("metadata").and_then(Value::as_object_mut) {
        metadata.remove("managedFields");
    }
    copy
}

/// Fields nobody owns: identity and server-set metadata.
pub(crate) fn is_unowned(path: &[Element]) -> bool {
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
        [Element::Field(top)] => matches!(top.as_str(), "apiVersion" | "kind" | "metadata"),
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
        ManagedEntry {
            manager: manager.into(),
            operation,
            api_version: "v1".into(),
            time: Some(time.into()),
            subresource: None,
            fields,
        }
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
            .map(|entries| {
                entries
                    .iter()
                    .filter_map(|e| e["manager"].as_str())
                    .collect()
            })
            .unwrap_or_default();
        assert_eq!(managers, vec!["b", "a", "u"]);
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
        assert_eq!(
            update.describe(),
            r#""kubectl-edit" using v1 at 2024-01-01T00:00:00Z"#
        );
        let mut apply = entry("fid", Operation::Apply, "2024-01-01T00:00:00Z");
        apply.subresource = Some("status".into());
        assert_eq!(apply.describe(), r#""fid" with subresource "status""#);
    }

    #[test]
    fn identity_metadata_is_never_owned() {
        let path = |parts: &[&str]| -> Vec<Element> {
            parts
                .iter()
                .map(|p| Element::Field(p.to_string()))
                .collect()
        };
        assert!(is_unowned(&path(&["metadata", "name"])));
        assert!(is_unowned(&path(&["metadata"])));
        assert!(!is_unowned(&path(&["metadata", "labels", "app"])));
        assert!(!is_unowned(&path(&["data", "name"])));
    }
}
