//! Patch application. Merge patch and JSON patch now; strategic merge and server-side apply plug in
//! here as further [`PatchType`]s.

use serde_json::Value;

use super::status::ApiError;

/// A patch as sent: its media type and body.
#[derive(Debug, Clone, Copy)]
pub struct PatchBody<'a> {
    pub patch_type: PatchType,
    pub body: &'a [u8],
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PatchType {
    Merge,
    Json,
}

/// Applies a merge or JSON patch to `target` with apiserver semantics.
pub fn apply_patch(target: &mut Value, patch: PatchBody<'_>) -> Result<(), ApiError> {
    let PatchBody {
        patch_type,
        body: patch,
    } = patch;
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
