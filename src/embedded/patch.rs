//! Patch application: merge patch, JSON patch and strategic merge patch. Server-side apply is
//! [`apply::server_side_apply`](super::apply::server_side_apply).

use serde_json::Value;

use super::discovery::ResourceInfo;
use super::patch_engine::{strategic_merge_patch, supports_strategic};
use super::status::ApiError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PatchType {
    Merge,
    Json,
    /// Built-in kinds only; `apply_patch` reads the kind from the target.
    Strategic,
}

/// A patch as sent: its media type and body.
#[derive(Debug, Clone, Copy)]
pub struct PatchBody<'a> {
    pub patch_type: PatchType,
    pub body: &'a [u8],
}

/// Custom resources have no strategic merge keys: kube-apiserver answers 415 for them.
pub fn check_patch_type(info: &ResourceInfo, patch_type: PatchType) -> Result<(), ApiError> {
    if patch_type == PatchType::Strategic && (info.schema.is_some() || !supports_strategic(&info.group, &info.kind)) {
        return Err(ApiError::unsupported_media_type(
            "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml",
        ));
    }
    Ok(())
}

/// An object body must be a JSON object whose `metadata`, if any, is an object too: what decoding
/// into a Go type guarantees kube-apiserver, and what the verbs index into.
pub fn check_object_shape(object: &Value) -> Result<(), ApiError> {
    let Some(map) = object.as_object() else {
        return Err(ApiError::bad_request("the object must be a JSON object"));
    };
    let meta = match map.get("metadata") {
        None | Some(Value::Null) => return Ok(()),
        Some(Value::Object(meta)) => meta,
        Some(_) => return Err(ApiError::bad_request("metadata must be an object")),
    };
    let string_map = |v: &Value| v.is_null() || v.as_object().is_some_and(|m| m.values().all(Value::is_string));
    let list = |v: &Value| v.is_null() || v.is_array();
    for (field, fits) in [
        ("labels", string_map(&meta.get("labels").cloned().unwrap_or_default())),
        (
            "annotations",
            string_map(&meta.get("annotations").cloned().unwrap_or_default()),
        ),
        ("finalizers", list(&meta.get("finalizers").cloned().unwrap_or_default())),
        (
            "ownerReferences",
            list(&meta.get("ownerReferences").cloned().unwrap_or_default()),
        ),
        (
            "managedFields",
            list(&meta.get("managedFields").cloned().unwrap_or_default()),
        ),
    ] {
        if !fits {
            return Err(ApiError::bad_request(format!("metadata.{field} has the wrong type")));
        }
    }
    Ok(())
}

/// Applies a merge, JSON or strategic merge patch to `target` with apiserver semantics.
pub fn apply_patch(target: &mut Value, patch: PatchBody<'_>) -> Result<(), ApiError> {
    let PatchBody {
        patch_type,
        body: patch,
    } = patch;
    apply_patch_unchecked(target, patch_type, patch)?;
    check_object_shape(target)
}

fn apply_patch_unchecked(target: &mut Value, patch_type: PatchType, patch: &[u8]) -> Result<(), ApiError> {
    match patch_type {
        PatchType::Merge => {
            let patch: Value = serde_json::from_slice(patch)
                .map_err(|e| ApiError::bad_request(format!("error decoding patch: {e}")))?;
            json_patch::merge(target, &patch);
            Ok(())
        }
        PatchType::Json => {
            let patch: json_patch::Patch = serde_json::from_slice(patch)
                .map_err(|e| ApiError::bad_request(format!("error decoding patch: {e}")))?;
            for operation in &patch.0 {
                apply_json_operation(target, operation)?;
            }
            Ok(())
        }
        PatchType::Strategic => {
            let patch: Value = serde_json::from_slice(patch)
                .map_err(|e| ApiError::bad_request(format!("error decoding patch: {e}")))?;
            let kind = target["kind"].as_str().unwrap_or("").to_string();
            *target = strategic_merge_patch(&kind, target, &patch)
                .map_err(|e| ApiError::new(422, "Invalid", format!("error applying strategic merge patch: {e}")))?;
            Ok(())
        }
    }
}

/// One JSON-patch operation; `test` of a missing path compares against null, as Go's library does.
fn apply_json_operation(target: &mut Value, operation: &json_patch::PatchOperation) -> Result<(), ApiError> {
    let invalid = |message: String| ApiError::new(422, "Invalid", message);
    if let json_patch::PatchOperation::Test(test) = operation {
        let actual = target.pointer(test.path.as_str()).cloned().unwrap_or(Value::Null);
        if actual != test.value {
            return Err(invalid(format!(
                "the server rejected our request due to an error in our request: testing value {} failed",
                test.path
            )));
        }
        return Ok(());
    }
    json_patch::patch(target, std::slice::from_ref(operation)).map_err(|e| {
        invalid(format!(
            "the server rejected our request due to an error in our request: {e}"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn json_patch_test_of_a_missing_path_compares_with_null() {
        let mut target = json!({"metadata": {}});
        let patch = br#"[{"op":"test","path":"/metadata/finalizers","value":null},{"op":"add","path":"/metadata/finalizers","value":["x"]}]"#;
        apply_patch(
            &mut target,
            PatchBody {
                patch_type: PatchType::Json,
                body: patch,
            },
        )
        .unwrap();
        assert_eq!(target["metadata"]["finalizers"], json!(["x"]));
    }

    #[test]
    fn failing_json_patch_test_is_invalid() {
        let mut target = json!({"data": {"k": "v2"}});
        let patch = br#"[{"op":"test","path":"/data/k","value":"nope"}]"#;
        assert_eq!(
            apply_patch(
                &mut target,
                PatchBody {
                    patch_type: PatchType::Json,
                    body: patch
                }
            )
            .unwrap_err()
            .code,
            422
        );
    }
}
