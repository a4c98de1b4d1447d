//! The syntax of object names, label and annotation keys and values, as kube-apiserver's
//! apimachinery checks them, with its messages. Every kind's validation uses these.

use std::sync::LazyLock;

use regex::Regex;
use serde_json::{Value, json};

use super::discovery::ResourceInfo;
use super::status::Cause;

const DNS1123_SUBDOMAIN_MSG: &str = "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')";
const DNS1123_LABEL_MSG: &str = "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')";
const QUALIFIED_NAME_MSG: &str = "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')";
const LABEL_VALUE_MSG: &str = "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')";
const TOTAL_ANNOTATION_BYTES: usize = 256 * 1024;

fn regex(pattern: &str) -> Regex {
    Regex::new(pattern).unwrap_or_else(|e| panic!("static regex {pattern}: {e}"))
}

static DNS1123_SUBDOMAIN: LazyLock<Regex> =
    LazyLock::new(|| regex(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"));
static DNS1123_LABEL: LazyLock<Regex> = LazyLock::new(|| regex(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"));
static QUALIFIED_NAME: LazyLock<Regex> = LazyLock::new(|| regex(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$"));

pub(super) fn is_dns1123_subdomain(s: &str) -> bool {
    s.len() <= 253 && DNS1123_SUBDOMAIN.is_match(s)
}

pub(super) fn is_dns1123_label(s: &str) -> bool {
    s.len() <= 63 && DNS1123_LABEL.is_match(s)
}

/// Name rules per kind: which check, and the maximum length.
enum NameRule {
    Subdomain,
    Label,
    PathSegment,
}

fn name_rule(info: &ResourceInfo) -> NameRule {
    match (info.group.as_str(), info.plural.as_str()) {
        ("", "namespaces") | ("", "services") => NameRule::Label,
        ("rbac.authorization.k8s.io", _) => NameRule::PathSegment,
        _ => NameRule::Subdomain,
    }
}

pub(super) fn validate_name(info: &ResourceInfo, name: &str) -> Vec<Cause> {
    let field = "metadata.name";
    let value = json!(name);
    match name_rule(info) {
        NameRule::Subdomain => {
            let mut causes = Vec::new();
            if name.len() > 253 {
                causes.push(Cause::invalid(field, &value, "must be no more than 253 characters"));
            }
            if !DNS1123_SUBDOMAIN.is_match(name) {
                causes.push(Cause::invalid(field, &value, DNS1123_SUBDOMAIN_MSG));
            }
            causes
        }
        NameRule::Label => {
            let mut causes = Vec::new();
            if name.len() > 63 {
                causes.push(Cause::invalid(field, &value, "must be no more than 63 characters"));
            }
            if !DNS1123_LABEL.is_match(name) {
                causes.push(Cause::invalid(field, &value, DNS1123_LABEL_MSG));
            }
            causes
        }
        NameRule::PathSegment => {
            if name == "." || name == ".." {
                return vec![Cause::invalid(field, &value, &format!("may not be '{name}'"))];
            }
            ["/", "%"]
                .iter()
                .filter(|bad| name.contains(**bad))
                .map(|bad| Cause::invalid(field, &value, &format!("may not contain '{bad}'")))
                .collect()
        }
    }
}

/// A label or annotation key: optional DNS-subdomain prefix and `/`, then a qualified name.
fn validate_key(field: &str, key: &str) -> Vec<Cause> {
    let value = json!(key);
    let (prefix, name) = match key.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    let mut causes = Vec::new();
    if let Some(prefix) = prefix
        && !is_dns1123_subdomain(prefix)
    {
        causes.push(Cause::invalid(
            field,
            &value,
            &format!("prefix part {DNS1123_SUBDOMAIN_MSG}"),
        ));
    }
    if name.is_empty() || name.len() > 63 || !QUALIFIED_NAME.is_match(name) {
        let detail = if name.len() > 63 {
            "name part must be no more than 63 characters".to_string()
        } else {
            QUALIFIED_NAME_MSG.to_string()
        };
        causes.push(Cause::invalid(field, &value, &detail));
    }
    causes
}

pub(super) fn validate_labels(field: &str, labels: &Value) -> Vec<Cause> {
    let Some(labels) = labels.as_object() else {
        return Vec::new();
    };
    let mut causes = Vec::new();
    for (key, value) in labels {
        causes.extend(validate_key(field, key));
        let text = value.as_str().unwrap_or_default();
        if text.len() > 63 {
            causes.push(Cause::invalid(field, value, "must be no more than 63 characters"));
        }
        if !text.is_empty() && !QUALIFIED_NAME.is_match(text) {
            causes.push(Cause::invalid(field, value, LABEL_VALUE_MSG));
        }
    }
    causes
}

pub(super) fn validate_annotations(annotations: &Value) -> Vec<Cause> {
    let Some(annotations) = annotations.as_object() else {
        return Vec::new();
    };
    let mut causes = Vec::new();
    let mut total = 0;
    for (key, value) in annotations {
        causes.extend(validate_key("metadata.annotations", key));
        total += key.len() + value.as_str().map_or(0, str::len);
    }
    if total > TOTAL_ANNOTATION_BYTES {
        causes.push(Cause::too_long("metadata.annotations", TOTAL_ANNOTATION_BYTES));
    }
    causes
}
