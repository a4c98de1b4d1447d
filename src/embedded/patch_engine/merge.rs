//! JSON merge patch (RFC 7386), as `application/merge-patch+json`.

use serde_json::Value;

/// Returns `target` with `patch` merged in: objects merge key by key, `null` deletes a key, and any
/// other value (arrays included) replaces what was there.
pub fn merge_patch(target: &Value, patch: &Value) -> Value {
    let mut merged = target.clone();
    json_patch::merge(&mut merged, patch);
    merged
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Fixture `merge-patch` of kube-apiserver-1.24-answers.md.
    #[test]
    fn merge_patch_adds_a_data_key() {
        let live = json!({"data": {"k": "v"}});
        let merged = merge_patch(&live, &json!({"data": {"m": "n"}}));
        assert_eq!(merged, json!({"data": {"k": "v", "m": "n"}}));
    }

    /// Fixture `remove-finalizer` of kube-apiserver-1.24-answers.md.
    #[test]
    fn null_in_merge_patch_removes_finalizers() {
        let live = json!({"metadata": {"name": "a", "finalizers": ["x"]}});
        let merged = merge_patch(&live, &json!({"metadata": {"finalizers": null}}));
        assert_eq!(merged, json!({"metadata": {"name": "a"}}));
    }

    #[test]
    fn merge_patch_replaces_lists_whole() {
        let live = json!({"spec": {"items": [1, 2, 3]}});
        let merged = merge_patch(&live, &json!({"spec": {"items": [4]}}));
        assert_eq!(merged, json!({"spec": {"items": [4]}}));
    }
}
