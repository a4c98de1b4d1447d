//! JSON patch (RFC 6902), as `application/json-patch+json`, with kube-apiserver's reading of `test`.

use json_patch::{PatchOperation, TestOperation};
use serde_json::Value;

/// Why a JSON patch could not be applied; the server answers 422 Invalid with this message
/// (or 400 for a body that is not a list of operations).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JsonPatchError {
    #[error("the body is not a JSON patch: {0}")]
    Malformed(String),
    #[error("{0}")]
    Failed(String),
}

/// Applies the operations in `patch` (a JSON array) to a copy of `target`, all or nothing.
///
/// kube-apiserver (through evanphx/json-patch) treats a `test` of a key missing from an existing
/// object as comparing equal to `null`; kube-runtime's finalizer helper relies on that to add the
/// first finalizer, so it is handled here rather than by the json-patch crate, which fails it.
pub fn json_patch(target: &Value, patch: &Value) -> Result<Value, JsonPatchError> {
    let operations: Vec<PatchOperation> =
        serde_json::from_value(patch.clone()).map_err(|error| JsonPatchError::Malformed(error.to_string()))?;
    let mut document = target.clone();
    for (index, operation) in operations.iter().enumerate() {
        match operation {
            PatchOperation::Test(test) => run_test(&document, test, index)?,
            other => json_patch::patch_unsafe(&mut document, std::slice::from_ref(other)).map_err(|error| {
                JsonPatchError::Failed(format!(
                    "operation {index} ({}) failed at path '{}': {}",
                    operation_name(other),
                    other.path(),
                    error.kind
                ))
            })?,
        }
    }
    Ok(document)
}

fn run_test(document: &Value, test: &TestOperation, index: usize) -> Result<(), JsonPatchError> {
    let path = test.path.as_str();
    let passes = match document.pointer(path) {
        Some(found) => *found == test.value,
        None => test.value.is_null() && parent_exists(document, test),
    };
    if passes {
        Ok(())
    } else {
        Err(JsonPatchError::Failed(format!(
            "operation {index} (test) failed: the value at path '{path}' is not {}",
            test.value
        )))
    }
}

/// evanphx/json-patch only excuses a missing final key; a missing parent is still an error.
fn parent_exists(document: &Value, test: &TestOperation) -> bool {
    match test.path.parent() {
        Some(parent) => document.pointer(parent.as_str()).is_some(),
        None => true,
    }
}

fn operation_name(operation: &PatchOperation) -> &'static str {
    match operation {
        PatchOperation::Add(_) => "add",
        PatchOperation::Remove(_) => "remove",
        PatchOperation::Replace(_) => "replace",
        PatchOperation::Move(_) => "move",
        PatchOperation::Copy(_) => "copy",
        PatchOperation::Test(_) => "test",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Fixture `json-patch-test-missing-is-null` of kube-apiserver-1.24-answers.md.
    #[test]
    fn json_patch_test_of_missing_path_equals_null() {
        let live = json!({"metadata": {"name": "a"}});
        let patch = json!([
            {"op": "test", "path": "/metadata/finalizers", "value": null},
            {"op": "add", "path": "/metadata/finalizers", "value": ["stackd.dev/cleanup"]}
        ]);
        let patched = json_patch(&live, &patch);
        assert_eq!(
            patched,
            Ok(json!({"metadata": {"name": "a", "finalizers": ["stackd.dev/cleanup"]}}))
        );
    }

    /// Fixture `json-patch-test-fails` of kube-apiserver-1.24-answers.md.
    #[test]
    fn failing_json_patch_is_an_error() {
        let live = json!({"data": {"k": "v2"}});
        let patch = json!([{"op": "test", "path": "/data/k", "value": "nope"}]);
        assert!(matches!(json_patch(&live, &patch), Err(JsonPatchError::Failed(_))));
    }

    #[test]
    fn test_of_missing_path_against_a_value_fails() {
        let live = json!({"metadata": {}});
        let patch = json!([{"op": "test", "path": "/metadata/finalizers", "value": ["x"]}]);
        assert!(json_patch(&live, &patch).is_err());
    }

    #[test]
    fn test_under_a_missing_parent_fails_even_for_null() {
        let live = json!({});
        let patch = json!([{"op": "test", "path": "/metadata/finalizers", "value": null}]);
        assert!(json_patch(&live, &patch).is_err());
    }

    #[test]
    fn removing_a_missing_path_is_an_error() {
        let live = json!({"data": {}});
        let patch = json!([{"op": "remove", "path": "/data/gone"}]);
        assert!(matches!(json_patch(&live, &patch), Err(JsonPatchError::Failed(_))));
    }

    #[test]
    fn body_that_is_not_an_operation_list_is_malformed() {
        let patch = json!({"op": "add"});
        assert!(matches!(
            json_patch(&json!({}), &patch),
            Err(JsonPatchError::Malformed(_))
        ));
    }

    #[test]
    fn a_failed_patch_leaves_the_target_untouched() {
        let live = json!({"data": {"k": "v"}});
        let patch = json!([
            {"op": "add", "path": "/data/m", "value": "n"},
            {"op": "test", "path": "/data/k", "value": "other"}
        ]);
        assert!(json_patch(&live, &patch).is_err());
        assert_eq!(live, json!({"data": {"k": "v"}}));
    }
}
