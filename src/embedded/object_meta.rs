//! Reading an object's metadata and stamping times, as every verb and in-process controller does.

use serde_json::Value;

/// Now, as Kubernetes writes timestamps.
pub(super) fn now_timestamp() -> String {
    jiff::Timestamp::now().strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

/// A metadata field's text (`None` when missing or empty).
pub(super) fn meta_str<'a>(object: &'a Value, field: &str) -> Option<&'a str> {
    object["metadata"][field].as_str().filter(|s| !s.is_empty())
}
