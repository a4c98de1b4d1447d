//! Label and field selectors as the list and watch query parameters spell them.

use std::sync::LazyLock;

use regex::Regex;
use serde_json::Value;

use super::status::ApiError;

#[derive(Debug, Clone, PartialEq)]
enum Operator {
    Equals,
    NotEquals,
    In,
    NotIn,
    Exists,
    DoesNotExist,
}

#[derive(Debug, Clone, PartialEq)]
struct Requirement {
    key: String,
    operator: Operator,
    values: Vec<String>,
}

/// A parsed `labelSelector`; all requirements must hold.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LabelSelector {
    requirements: Vec<Requirement>,
}

static SET_TERM: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^([^\s!=(),]+)\s+(in|notin)\s*\(([^()]*)\)$").unwrap_or_else(|e| panic!("{e}")));
static KEY: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^[A-Za-z0-9]([-A-Za-z0-9_./]*[A-Za-z0-9])?$").unwrap_or_else(|e| panic!("{e}")));

/// Splits on commas that are not inside parentheses (`app in (a,b),tier`).
fn split_terms(selector: &str) -> Vec<String> {
    let mut terms = Vec::new();
    let mut depth = 0i32;
    let mut current = String::new();
    for c in selector.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                terms.push(std::mem::take(&mut current));
                continue;
            }
            _ => {}
        }
        current.push(c);
    }
    terms.push(current);
    terms
        .into_iter()
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty())
        .collect()
}

fn parse_error(term: &str) -> ApiError {
    ApiError::bad_request(format!(
        "unable to parse requirement: invalid label selector term {term:?}"
    ))
}

fn checked_key(key: &str, term: &str) -> Result<String, ApiError> {
    let key = key.trim();
    if KEY.is_match(key) {
        Ok(key.to_string())
    } else {
        Err(parse_error(term))
    }
}

impl LabelSelector {
    pub fn parse(selector: &str) -> Result<LabelSelector, ApiError> {
        let requirements = split_terms(selector)
            .iter()
            .map(|term| Self::parse_term(term))
            .collect::<Result<_, _>>()?;
        Ok(LabelSelector { requirements })
    }

    fn parse_term(term: &str) -> Result<Requirement, ApiError> {
        if let Some(caps) = SET_TERM.captures(term) {
            let operator = if &caps[2] == "in" {
                Operator::In
            } else {
                Operator::NotIn
            };
            let values = caps[3]
                .split(',')
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
                .collect();
            return Ok(Requirement {
                key: caps[1].to_string(),
                operator,
                values,
            });
        }
        if let Some(key) = term.strip_prefix('!') {
            let key = checked_key(key, term)?;
            return Ok(Requirement {
                key,
                operator: Operator::DoesNotExist,
                values: vec![],
            });
        }
        for (token, operator) in [
            ("!=", Operator::NotEquals),
            ("==", Operator::Equals),
            ("=", Operator::Equals),
        ] {
            if let Some((key, value)) = term.split_once(token) {
                let key = checked_key(key, term)?;
                let values = vec![value.trim().to_string()];
                return Ok(Requirement { key, operator, values });
            }
        }
        let key = checked_key(term, term)?;
        Ok(Requirement {
            key,
            operator: Operator::Exists,
            values: vec![],
        })
    }

    pub fn is_empty(&self) -> bool {
        self.requirements.is_empty()
    }

    pub fn matches(&self, object: &Value) -> bool {
        let labels = &object["metadata"]["labels"];
        self.requirements.iter().all(|req| {
            let value = labels.get(&req.key).and_then(Value::as_str);
            match req.operator {
                Operator::Equals => value == Some(req.values[0].as_str()),
                // As in Kubernetes: `!=` and `notin` also match objects without the label.
                Operator::NotEquals => value != Some(req.values[0].as_str()),
                Operator::In => value.is_some_and(|v| req.values.iter().any(|w| w == v)),
                Operator::NotIn => value.is_none_or(|v| req.values.iter().all(|w| w != v)),
                Operator::Exists => value.is_some(),
                Operator::DoesNotExist => value.is_none(),
            }
        })
    }
}

/// A parsed `fieldSelector` (only `=`, `==`, `!=`, joined by commas).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FieldSelector {
    requirements: Vec<(String, bool, String)>,
}

impl FieldSelector {
    /// Parses and checks every field against what the resource supports; unsupported fields are a
    /// 400, as on the real server.
    pub fn parse(selector: &str, supported: &[&str]) -> Result<FieldSelector, ApiError> {
        let mut requirements = Vec::new();
        for term in split_terms(selector) {
            let (field, equal, value) = if let Some((f, v)) = term.split_once("!=") {
                (f, false, v)
            } else if let Some((f, v)) = term.split_once("==") {
                (f, true, v)
            } else if let Some((f, v)) = term.split_once('=') {
                (f, true, v)
            } else {
                return Err(ApiError::bad_request(format!(
                    "invalid selector: '{selector}'; can't understand '{term}'"
                )));
            };
            let field = field.trim();
            let known = field == "metadata.name" || field == "metadata.namespace";
            if !known && !supported.contains(&field) {
                return Err(ApiError::bad_request(format!("field label not supported: {field}")));
            }
            requirements.push((field.to_string(), equal, value.trim().to_string()));
        }
        Ok(FieldSelector { requirements })
    }

    pub fn is_empty(&self) -> bool {
        self.requirements.is_empty()
    }

    /// The same selector with fields renamed (to their names in storage).
    pub fn renamed(mut self, rename: impl Fn(&str) -> String) -> FieldSelector {
        for (field, _, _) in &mut self.requirements {
            *field = rename(field);
        }
        self
    }

    pub fn matches(&self, object: &Value) -> bool {
        self.requirements.iter().all(|(field, equal, want)| {
            let actual = field_value(object, field);
            (actual == *want) == *equal
        })
    }
}

/// A dotted field rendered as the string a field selector compares with (missing = "").
fn field_value(object: &Value, field: &str) -> String {
    let value = field.split('.').fold(object, |v, part| &v[part]);
    match value {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

/// Field selectors each resource supports beyond `metadata.name`/`metadata.namespace`.
pub fn supported_fields(group: &str, resource: &str) -> &'static [&'static str] {
    match (group, resource) {
        ("", "events") => &[
            "involvedObject.kind",
            "involvedObject.namespace",
            "involvedObject.name",
            "involvedObject.uid",
            "involvedObject.apiVersion",
            "involvedObject.resourceVersion",
            "involvedObject.fieldPath",
            "reason",
            "reportingComponent",
            "source",
            "type",
        ],
        ("events.k8s.io", "events") => &[
            "regarding.kind",
            "regarding.namespace",
            "regarding.name",
            "regarding.uid",
            "reason",
            "type",
        ],
        ("", "pods") => &[
            "spec.nodeName",
            "spec.restartPolicy",
            "spec.schedulerName",
            "spec.serviceAccountName",
            "status.phase",
            "status.podIP",
            "status.nominatedNodeName",
        ],
        ("", "secrets") => &["type"],
        ("", "namespaces") => &["status.phase"],
        ("batch", "jobs") => &["status.successful"],
        _ => &[],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn labelled(labels: Value) -> Value {
        json!({"metadata": {"labels": labels}})
    }

    #[test]
    fn set_based_selector_with_negated_existence_matches_like_the_fixture() {
        let sel = LabelSelector::parse("app in (x,y),!tier").unwrap();
        assert!(!sel.matches(&labelled(json!({"app": "x", "tier": "a"}))));
        assert!(sel.matches(&labelled(json!({"app": "y"}))));
        assert!(!sel.matches(&labelled(json!({"app": "z", "tier": "b"}))));
    }

    #[test]
    fn not_equals_matches_objects_without_the_label() {
        let sel = LabelSelector::parse("app!=x").unwrap();
        assert!(sel.matches(&labelled(json!({"app": "y"}))));
        assert!(sel.matches(&labelled(json!({}))));
        assert!(!sel.matches(&labelled(json!({"app": "x"}))));
    }

    #[test]
    fn equality_existence_and_notin_combine_with_and() {
        let sel = LabelSelector::parse("a==1, b, c notin (x, y)").unwrap();
        assert!(sel.matches(&labelled(json!({"a": "1", "b": ""}))));
        assert!(!sel.matches(&labelled(json!({"a": "1", "b": "", "c": "x"}))));
        assert!(!sel.matches(&labelled(json!({"a": "1"}))));
    }

    #[test]
    fn malformed_label_selector_is_a_bad_request() {
        assert_eq!(LabelSelector::parse("a in (").unwrap_err().code, 400);
    }

    #[test]
    fn unsupported_field_selector_is_a_bad_request() {
        let err = FieldSelector::parse("spec.foo=1", &[]).unwrap_err();
        assert_eq!(err.code, 400);
        assert_eq!(err.message, "field label not supported: spec.foo");
    }

    #[test]
    fn event_field_selector_matches_involved_object() {
        let sel = FieldSelector::parse(
            "involvedObject.kind=Pod,involvedObject.name!=b",
            supported_fields("", "events"),
        )
        .unwrap();
        assert!(sel.matches(&json!({"involvedObject": {"kind": "Pod", "name": "a"}})));
        assert!(!sel.matches(&json!({"involvedObject": {"kind": "Pod", "name": "b"}})));
    }
}
