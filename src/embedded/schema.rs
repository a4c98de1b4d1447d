//! Custom resources against their CRD version's structural `openAPIV3Schema`: unknown fields are
//! pruned, `null`s of non-nullable fields dropped, `default`s applied, then the value validated. The
//! order is the real apiserver's (prune → default → validate).

use serde_json::{Map, Value, json};

use super::status::{Cause, go_value};

fn preserves_unknown(schema: &Value) -> bool {
    schema["x-kubernetes-preserve-unknown-fields"].as_bool() == Some(true)
}

fn is_int_or_string(schema: &Value) -> bool {
    schema["x-kubernetes-int-or-string"].as_bool() == Some(true)
}

/// Prune, drop nulls and default a whole custom resource. `apiVersion`, `kind` and `metadata` at the
/// root are the server's business and never pruned.
pub fn prune_and_default(schema: &Value, object: &mut Value) {
    outside_type_and_metadata(object, |body| {
        prune_value(schema, body);
        default_value(schema, body);
    });
}

/// Defaults only, as the real server applies them to stored objects on every read (so a default
/// added to a CRD later shows on existing objects).
pub fn apply_defaults(schema: &Value, object: &mut Value) {
    outside_type_and_metadata(object, |body| default_value(schema, body));
}

/// Runs `change` on the object without its root `apiVersion`, `kind` and `metadata`, which are
/// the server's business whatever the schema says.
fn outside_type_and_metadata(object: &mut Value, change: impl FnOnce(&mut Value)) {
    let Some(map) = object.as_object_mut() else {
        return;
    };
    let kept: Vec<(String, Value)> = ["apiVersion", "kind", "metadata"]
        .iter()
        .filter_map(|k| map.remove(*k).map(|v| (k.to_string(), v)))
        .collect();
    change(object);
    if let Some(map) = object.as_object_mut() {
        map.extend(kept);
    }
}

/// Whether [`apply_defaults`] would add anything to `object`: a field with a schema default is
/// missing somewhere. May say so for `apiVersion`, `kind` or `metadata`, which `apply_defaults`
/// leaves alone; callers use the answer only to skip a copy, never to decide content.
pub fn defaults_missing(schema: &Value, value: &Value) -> bool {
    match value {
        Value::Object(map) => {
            let properties = schema["properties"].as_object();
            let missing_here = properties.is_some_and(|properties| {
                properties
                    .iter()
                    .any(|(key, prop)| prop.get("default").is_some() && !map.contains_key(key))
            });
            let missing_below = properties.is_some_and(|properties| {
                map.iter()
                    .any(|(key, child)| properties.get(key).is_some_and(|prop| defaults_missing(prop, child)))
            });
            let additional = schema.get("additionalProperties").filter(|a| a.is_object());
            missing_here
                || missing_below
                || additional.is_some_and(|additional| map.values().any(|child| defaults_missing(additional, child)))
        }
        Value::Array(items) => schema
            .get("items")
            .is_some_and(|item_schema| items.iter().any(|item| defaults_missing(item_schema, item))),
        _ => false,
    }
}

fn prune_value(schema: &Value, value: &mut Value) {
    match value {
        Value::Object(map) => prune_object(schema, map),
        Value::Array(items) => {
            if let Some(item_schema) = schema.get("items") {
                items.iter_mut().for_each(|item| prune_value(item_schema, item));
            }
        }
        _ => {}
    }
}

fn prune_object(schema: &Value, map: &mut Map<String, Value>) {
    let properties = schema["properties"].as_object();
    let additional = schema.get("additionalProperties").filter(|a| a.is_object());
    let preserve = preserves_unknown(schema) || schema["additionalProperties"].as_bool() == Some(true);
    // An embedded object keeps its own type and metadata, whatever its schema lists.
    let embedded = schema["x-kubernetes-embedded-resource"].as_bool() == Some(true);
    map.retain(|key, child| {
        let child_schema = properties.and_then(|p| p.get(key)).or(additional);
        match child_schema {
            Some(s) => !(child.is_null() && s["nullable"].as_bool() != Some(true)),
            None => preserve || (embedded && matches!(key.as_str(), "apiVersion" | "kind" | "metadata")),
        }
    });
    for (key, child) in map.iter_mut() {
        if let Some(s) = properties.and_then(|p| p.get(key)).or(additional) {
            prune_value(s, child);
        }
    }
}

fn default_value(schema: &Value, value: &mut Value) {
    match value {
        Value::Object(map) => {
            if let Some(properties) = schema["properties"].as_object() {
                for (key, prop) in properties {
                    if let Some(default) = prop.get("default")
                        && !map.contains_key(key)
                    {
                        map.insert(key.clone(), default.clone());
                    }
                }
                for (key, child) in map.iter_mut() {
                    if let Some(prop) = properties.get(key) {
                        default_value(prop, child);
                    }
                }
            }
            if let Some(additional) = schema.get("additionalProperties").filter(|a| a.is_object()) {
                map.values_mut().for_each(|child| default_value(additional, child));
            }
        }
        Value::Array(items) => {
            if let Some(item_schema) = schema.get("items") {
                items.iter_mut().for_each(|item| default_value(item_schema, item));
            }
        }
        _ => {}
    }
}

/// Where a CRD schema is not structural in the ways a generated schema can go wrong: a field without
/// `type` (unless int-or-string or preserving unknown fields), or both `properties` and
/// `additionalProperties`. `path` is the field path of `schema` in the CRD.
pub fn structural_errors(schema: &Value, path: &str) -> Vec<Cause> {
    let mut causes = Vec::new();
    let untyped = schema["type"].as_str().is_none_or(str::is_empty);
    if untyped && !is_int_or_string(schema) && !preserves_unknown(schema) {
        let detail = "must not be empty for specified object fields";
        causes.push(Cause::required(&format!("{path}.type"), detail));
    }
    if schema.get("properties").is_some() && schema["additionalProperties"].is_object() {
        let message = "Forbidden: additionalProperties and properties are mutual exclusive".to_string();
        causes.push(Cause::other(
            "FieldValueForbidden",
            &format!("{path}.additionalProperties"),
            message,
        ));
    }
    for (name, property) in schema["properties"].as_object().into_iter().flatten() {
        causes.extend(structural_errors(property, &format!("{path}.properties[{name}]")));
    }
    for key in ["items", "additionalProperties"] {
        if let Some(child) = schema.get(key).filter(|c| c.is_object()) {
            causes.extend(structural_errors(child, &format!("{path}.{key}")));
        }
    }
    causes
}

/// All violations of `schema` in `value`, with paths like `spec.replicas` and `spec.items[1]`.
pub fn validate(schema: &Value, value: &Value) -> Vec<Cause> {
    let mut causes = Vec::new();
    let mut root = value.clone();
    if let Some(map) = root.as_object_mut() {
        for k in ["apiVersion", "kind", "metadata"] {
            map.remove(k);
        }
    }
    validate_at(schema, &root, "", &mut causes);
    causes
}

fn child_path(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

fn display_path(path: &str) -> &str {
    if path.is_empty() { "<root>" } else { path }
}

fn type_matches(schema: &Value, value: &Value) -> bool {
    if is_int_or_string(schema) {
        return value.is_i64() || value.is_u64() || value.is_string();
    }
    match schema["type"].as_str() {
        Some("object") => value.is_object(),
        Some("array") => value.is_array(),
        Some("string") => value.is_string(),
        Some("integer") => value.is_i64() || value.is_u64(),
        Some("number") => value.is_number(),
        Some("boolean") => value.is_boolean(),
        _ => true,
    }
}

fn json_type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_f64() => "number",
        Value::Number(_) => "integer",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

fn validate_at(schema: &Value, value: &Value, path: &str, causes: &mut Vec<Cause>) {
    if value.is_null() {
        if schema["nullable"].as_bool() != Some(true) && schema.get("type").is_some() {
            causes.push(type_error(schema, value, path));
        }
        return;
    }
    if !type_matches(schema, value) {
        causes.push(type_error(schema, value, path));
        return;
    }
    validate_constraints(schema, value, path, causes);
    validate_combinators(schema, value, path, causes);
    match value {
        Value::Object(map) => validate_object(schema, map, path, causes),
        Value::Array(items) => validate_array(schema, items, path, causes),
        _ => {}
    }
}

fn type_error(schema: &Value, value: &Value, path: &str) -> Cause {
    let expected = if is_int_or_string(schema) {
        "integer or string"
    } else {
        schema["type"].as_str().unwrap_or("")
    };
    Cause::other(
        "FieldValueTypeInvalid",
        path,
        format!(
            "Invalid value: \"{}\": {} in body must be of type {expected}: \"{}\"",
            json_type_name(value),
            display_path(path),
            json_type_name(value)
        ),
    )
}

fn validate_constraints(schema: &Value, value: &Value, path: &str, causes: &mut Vec<Cause>) {
    let shown = display_path(path);
    if let Some(allowed) = schema["enum"].as_array()
        && !allowed.contains(value)
    {
        let list: Vec<String> = allowed.iter().map(go_value).collect();
        causes.push(Cause::other(
            "FieldValueNotSupported",
            path,
            format!(
                "Unsupported value: {}: supported values: {}",
                go_value(value),
                list.join(", ")
            ),
        ));
    }
    if let Some(s) = value.as_str() {
        validate_string(schema, s, value, path, causes);
    }
    if let Some(n) = value.as_f64() {
        if let Some(min) = schema["minimum"].as_f64() {
            let exclusive = schema["exclusiveMinimum"].as_bool() == Some(true);
            if n < min || (exclusive && n == min) {
                let op = if exclusive {
                    "greater than"
                } else {
                    "greater than or equal to"
                };
                causes.push(Cause::invalid(
                    path,
                    value,
                    &format!("{shown} in body should be {op} {}", schema["minimum"]),
                ));
            }
        }
        if let Some(max) = schema["maximum"].as_f64() {
            let exclusive = schema["exclusiveMaximum"].as_bool() == Some(true);
            if n > max || (exclusive && n == max) {
                let op = if exclusive {
                    "less than"
                } else {
                    "less than or equal to"
                };
                causes.push(Cause::invalid(
                    path,
                    value,
                    &format!("{shown} in body should be {op} {}", schema["maximum"]),
                ));
            }
        }
    }
}

fn validate_string(schema: &Value, s: &str, value: &Value, path: &str, causes: &mut Vec<Cause>) {
    let shown = display_path(path);
    let length = s.chars().count() as u64;
    if let Some(max) = schema["maxLength"].as_u64()
        && length > max
    {
        causes.push(Cause::other(
            "FieldValueTooLong",
            path,
            format!("Too long: may not be longer than {max}"),
        ));
    }
    if let Some(min) = schema["minLength"].as_u64()
        && length < min
    {
        causes.push(Cause::invalid(
            path,
            value,
            &format!("{shown} in body should be at least {min} chars long"),
        ));
    }
    if let Some(format) = schema["format"].as_str()
        && !format_matches(format, s)
    {
        let detail = format!("{shown} in body must be of type {format}: {}", go_value(value));
        causes.push(Cause::invalid(path, value, &detail));
    }
    if let Some(pattern) = schema["pattern"].as_str() {
        match regex::Regex::new(pattern) {
            Ok(re) if re.is_match(s) => {}
            _ => causes.push(Cause::invalid(
                path,
                value,
                &format!("{shown} in body should match '{pattern}'"),
            )),
        }
    }
}

/// The string formats kube-apiserver checks that Rust-generated schemas use; others pass.
fn format_matches(format: &str, s: &str) -> bool {
    use base64::Engine;
    match format {
        "date-time" => s.parse::<jiff::Timestamp>().is_ok(),
        "date" => s.parse::<jiff::civil::Date>().is_ok(),
        "byte" => base64::engine::general_purpose::STANDARD.decode(s).is_ok(),
        "uuid" => s.len() == 36 && s.chars().all(|c| c.is_ascii_hexdigit() || c == '-'),
        _ => true,
    }
}

/// `anyOf`/`oneOf`/`allOf` as value validations (structural schemas keep types outside them).
fn validate_combinators(schema: &Value, value: &Value, path: &str, causes: &mut Vec<Cause>) {
    let passes = |sub: &Value| {
        let mut inner = Vec::new();
        validate_at(sub, value, path, &mut inner);
        inner.is_empty()
    };
    if let Some(all) = schema["allOf"].as_array() {
        for sub in all {
            validate_at(sub, value, path, causes);
        }
    }
    if let Some(any) = schema["anyOf"].as_array()
        && !any.iter().any(passes)
    {
        let mut first = Vec::new();
        if let Some(sub) = any.first() {
            validate_at(sub, value, path, &mut first);
        }
        causes.extend(first);
    }
    if let Some(one) = schema["oneOf"].as_array() {
        let matching = one.iter().filter(|s| passes(s)).count();
        if matching != 1 {
            let detail = format!(
                "{} in body must validate one and only one schema (oneOf)",
                display_path(path)
            );
            causes.push(Cause::invalid(path, value, &detail));
        }
    }
}

fn validate_object(schema: &Value, map: &Map<String, Value>, path: &str, causes: &mut Vec<Cause>) {
    if let Some(required) = schema["required"].as_array() {
        for key in required.iter().filter_map(Value::as_str) {
            if !map.contains_key(key) {
                causes.push(Cause::required(&child_path(path, key), ""));
            }
        }
    }
    let properties = schema["properties"].as_object();
    let additional = schema.get("additionalProperties").filter(|a| a.is_object());
    for (key, child) in map {
        if let Some(child_schema) = properties.and_then(|p| p.get(key)).or(additional) {
            validate_at(child_schema, child, &child_path(path, key), causes);
        }
    }
}

fn validate_array(schema: &Value, items: &[Value], path: &str, causes: &mut Vec<Cause>) {
    let shown = display_path(path);
    let count = items.len() as u64;
    if let Some(min) = schema["minItems"].as_u64()
        && count < min
    {
        causes.push(Cause::invalid(
            path,
            &json!(items),
            &format!("{shown} in body should have at least {min} items"),
        ));
    }
    if let Some(max) = schema["maxItems"].as_u64()
        && count > max
    {
        causes.push(Cause::other(
            "FieldValueTooMany",
            path,
            format!("Too many: {count}: must have at most {max} items"),
        ));
    }
    if let Some(item_schema) = schema.get("items") {
        for (i, item) in items.iter().enumerate() {
            validate_at(item_schema, item, &format!("{path}[{i}]"), causes);
        }
    }
    validate_list_type(schema, items, path, causes);
}

/// `x-kubernetes-list-type: map|set` uniqueness.
fn validate_list_type(schema: &Value, items: &[Value], path: &str, causes: &mut Vec<Cause>) {
    let keys: Vec<&str> = schema["x-kubernetes-list-map-keys"]
        .as_array()
        .map(|k| k.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let identity = |item: &Value| -> Value {
        match schema["x-kubernetes-list-type"].as_str() {
            Some("map") => json!(keys.iter().map(|k| item[*k].clone()).collect::<Vec<_>>()),
            _ => item.clone(),
        }
    };
    if !matches!(schema["x-kubernetes-list-type"].as_str(), Some("map") | Some("set")) {
        return;
    }
    let mut seen: Vec<Value> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let id = identity(item);
        if seen.contains(&id) {
            let shown = if keys.len() == 1 { id[0].clone() } else { id.clone() };
            causes.push(Cause::other(
                "FieldValueDuplicate",
                &format!("{path}[{i}]"),
                format!("Duplicate value: {}", go_value(&shown)),
            ));
        } else {
            seen.push(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schema() -> Value {
        json!({"type": "object", "properties": {
            "spec": {"type": "object", "required": ["size"], "properties": {
                "size": {"type": "integer", "minimum": 1},
                "mode": {"type": "string", "enum": ["a", "b"], "default": "a"},
                "mac": {"type": "string", "pattern": "^[0-9a-f]{2}$"},
                "note": {"type": "string", "nullable": true},
                "port": {"x-kubernetes-int-or-string": true},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": true},
                "items": {"type": "array", "minItems": 1, "x-kubernetes-list-type": "map",
                          "x-kubernetes-list-map-keys": ["name"],
                          "items": {"type": "object", "properties": {"name": {"type": "string"}}}}
            }}
        }})
    }

    #[test]
    fn unknown_fields_are_pruned_but_preserved_subtrees_kept() {
        let mut obj = json!({"metadata": {"name": "x"}, "spec": {"size": 1, "bogus": 1, "free": {"any": 1}}, "top": 2});
        prune_and_default(&schema(), &mut obj);
        assert_eq!(
            obj,
            json!({"metadata": {"name": "x"}, "spec": {"size": 1, "mode": "a", "free": {"any": 1}}})
        );
    }

    #[test]
    fn nulls_of_non_nullable_fields_are_dropped_and_nullable_kept() {
        let mut obj = json!({"spec": {"size": 1, "mode": null, "note": null}});
        prune_and_default(&schema(), &mut obj);
        assert_eq!(obj["spec"]["mode"], "a");
        assert!(obj["spec"].as_object().unwrap().contains_key("note"));
    }

    #[test]
    fn enum_pattern_minimum_and_type_violations_are_reported() {
        let obj = json!({"spec": {"size": 0, "mode": "c", "mac": "zz", "port": 1.5}});
        let causes = validate(&schema(), &obj);
        let fields: Vec<(&str, &str)> = causes.iter().map(|c| (c.field.as_str(), c.reason)).collect();
        assert_eq!(
            fields,
            vec![
                ("spec.mac", "FieldValueInvalid"),
                ("spec.mode", "FieldValueNotSupported"),
                ("spec.port", "FieldValueTypeInvalid"),
                ("spec.size", "FieldValueInvalid"),
            ]
        );
    }

    #[test]
    fn integer_fields_refuse_fractions_and_strings() {
        let causes = validate(&schema(), &json!({"spec": {"size": "1"}}));
        assert_eq!(causes[0].field, "spec.size");
        assert_eq!(causes[0].reason, "FieldValueTypeInvalid");
    }

    #[test]
    fn missing_required_and_duplicate_map_keys_are_reported() {
        let obj = json!({"spec": {"items": [{"name": "a"}, {"name": "a"}]}});
        let causes = validate(&schema(), &obj);
        assert_eq!(causes[0].reason, "FieldValueRequired");
        assert_eq!(causes[0].field, "spec.size");
        assert_eq!(causes[1].reason, "FieldValueDuplicate");
        assert_eq!(causes[1].field, "spec.items[1]");
    }

    #[test]
    fn embedded_resources_keep_their_type_and_metadata() {
        let s = json!({"type": "object", "properties": {"template": {"type": "object",
            "x-kubernetes-embedded-resource": true, "properties": {"spec": {"type": "object"}}}}});
        let mut obj =
            json!({"template": {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {}, "junk": 1}});
        prune_and_default(&s, &mut obj);
        assert_eq!(
            obj["template"],
            json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {}})
        );
    }

    #[test]
    fn date_time_and_byte_formats_are_checked() {
        let s = json!({"type": "object", "properties": {
            "at": {"type": "string", "format": "date-time"},
            "raw": {"type": "string", "format": "byte"}}});
        assert!(validate(&s, &json!({"at": "2026-01-01T00:00:00Z", "raw": "YQ=="})).is_empty());
        assert_eq!(validate(&s, &json!({"at": "yesterday", "raw": "!!"})).len(), 2);
    }

    #[test]
    fn untyped_fields_make_a_schema_non_structural() {
        let s = json!({"type": "object", "properties": {"spec": {"properties": {"a": {"type": "string"}}},
            "free": {"x-kubernetes-preserve-unknown-fields": true}, "port": {"x-kubernetes-int-or-string": true}}});
        let causes = structural_errors(&s, "schema");
        assert_eq!(causes.len(), 1);
        assert_eq!(causes[0].field, "schema.properties[spec].type");
    }

    #[test]
    fn additional_properties_maps_are_validated_per_value() {
        let causes = validate(&schema(), &json!({"spec": {"size": 1, "labels": {"a": 1}}}));
        assert_eq!(causes[0].field, "spec.labels.a");
    }

    #[test]
    fn any_of_enum_from_schemars_accepts_listed_values_only() {
        let s = json!({"type": "object", "properties": {"role": {"type": "string", "nullable": true,
            "anyOf": [{"enum": ["master", "worker"]}, {"enum": [null]}]}}});
        assert!(validate(&s, &json!({"role": "master"})).is_empty());
        assert!(validate(&s, &json!({"role": null})).is_empty());
        assert!(!validate(&s, &json!({"role": "x"})).is_empty());
    }
}
