//! The install config of one cluster (DESIGN.md §4.2): the pool's template with `metadata.name`,
//! `baseDomain` and the platform fields set, the CDC's RFC 6902 patches applied in order, rendered as
//! YAML that YAML 1.1 readers (openshift-install) read back exactly: every scalar a 1.1 parser could
//! take for a bool, null or number is quoted.

use serde_json::{Map, Value, json};

use crate::api::pools::{ClusterPoolSpec, MAX_INSTALL_CONFIG_PATCHES, PatchEntity, PatchOp, Platform};
use crate::bounds::{self, INSTALL_CONFIG};
use crate::runtime::parse_error::LocatedParseError;

/// The template could not be read. It holds passwords and pull secrets, so the message says
/// where, never what.
#[derive(Debug, thiserror::Error)]
#[error("the install-config template is not a YAML mapping: {0}")]
pub(crate) struct TemplateError(String);

/// Parses the template's `install-config.yaml` (empty means "no template"). The template is
/// tenant-written: the parse is held to a budget (aliases may not expand it far past the size of a
/// Secret), and the result to the install config's bounds, so every patch starts within them.
pub(crate) fn parse_template(text: &str) -> Result<Map<String, Value>, TemplateError> {
    if text.trim().is_empty() {
        return Ok(Map::new());
    }
    let options = serde_saphyr::options! {
        budget: serde_saphyr::budget! {
            max_depth: bounds::MAX_CONFIG_DEPTH,
            max_total_scalar_bytes: 2 * bounds::MAX_CONFIG_BYTES,
            max_recorded_anchor_bytes: 2 * bounds::MAX_CONFIG_BYTES,
        },
    };
    let value: Value = serde_saphyr::from_str_with_options(text, options)
        .map_err(|e| TemplateError(LocatedParseError::yaml(&e).to_string()))?;
    bounds::measure(&value, INSTALL_CONFIG).map_err(|e| TemplateError(format!("{e}")))?;
    match value {
        Value::Object(mapping) => Ok(mapping),
        Value::Null => Ok(Map::new()),
        other => Err(TemplateError(format!("found {}", kind(&other)))),
    }
}

fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "a mapping",
    }
}

/// The generated install config of cluster `name` before any CDC patch.
pub(crate) fn generate(template: &Map<String, Value>, pool: &ClusterPoolSpec, name: &str) -> Value {
    let mut object = template.clone();
    object.entry("apiVersion").or_insert_with(|| json!("v1"));
    mapping_at(&mut object, "metadata").insert("name".into(), json!(name));
    object.insert("baseDomain".into(), json!(pool.base_domain));
    if let Some(replicas) = pool.control_plane.as_ref().and_then(|c| c.replicas) {
        object.insert("controlPlane".into(), json!({"name": "master", "replicas": replicas}));
    }
    if let Some(replicas) = pool.compute.as_ref().and_then(|c| c.replicas) {
        object.insert("compute".into(), json!([{"name": "worker", "replicas": replicas}]));
    }
    let platform = mapping_at(&mut object, "platform");
    let (key, fields) = platform_fields(&pool.platform);
    if let Some(key) = key {
        let target = mapping_at(platform, key);
        for (field, value) in fields {
            target.insert(field.into(), value);
        }
    }
    Value::Object(object)
}

/// The mapping under `key`, put there empty when the key is missing or holds anything else.
#[allow(clippy::expect_used, reason = "the entry is made a mapping on the line before")]
pub(crate) fn mapping_at<'a>(object: &'a mut Map<String, Value>, key: &str) -> &'a mut Map<String, Value> {
    let entry = object.entry(key).or_insert_with(|| Value::Object(Map::new()));
    if !entry.is_object() {
        *entry = Value::Object(Map::new());
    }
    entry.as_object_mut().expect("made a mapping above")
}

/// The install-config fields of the pool's platform (credentials never go here).
fn platform_fields(platform: &Platform) -> (Option<&'static str>, Vec<(&'static str, Value)>) {
    let mut fields = Vec::new();
    let mut put = |field: &'static str, value: Option<Value>| {
        if let Some(value) = value {
            fields.push((field, value));
        }
    };
    if let Some(v) = &platform.vsphere {
        put("vCenter", Some(json!(v.v_center)));
        put("datacenter", Some(json!(v.datacenter)));
        put("defaultDatastore", Some(json!(v.default_datastore)));
        put("cluster", v.cluster.as_ref().map(|c| json!(c)));
        put("folder", v.folder.as_ref().map(|c| json!(c)));
        put("network", v.network.as_ref().map(|c| json!(c)));
        return (Some("vsphere"), fields);
    }
    if let Some(o) = &platform.openstack {
        put("cloud", Some(json!(o.cloud)));
        put("externalNetwork", o.external_network.as_ref().map(|c| json!(c)));
        put("computeFlavor", o.compute_flavor.as_ref().map(|c| json!(c)));
        put("trunkSupport", o.trunk_support.map(|c| json!(c)));
        return (Some("openstack"), fields);
    }
    if let Some(b) = &platform.baremetal {
        if !b.api_vips.is_empty() {
            put("apiVIPs", Some(json!(b.api_vips)));
        }
        if !b.ingress_vips.is_empty() {
            put("ingressVIPs", Some(json!(b.ingress_vips)));
        }
        return (Some("baremetal"), fields);
    }
    (None, fields)
}

/// Applies `patches` in order. The error names the failing patch (1-based) and how to fix it.
#[cfg(test)]
pub(crate) fn apply_patches(config: &mut Value, patches: &[PatchEntity]) -> Result<(), String> {
    apply_patches_counted(config, patches, &mut 0)
}

/// Applies `patches` in order, adding to `work` the bytes measured after each one (what the
/// application cost, charged to the namespace's share). The error names the failing patch
/// (1-based) and how to fix it.
///
/// The patches are tenant-written, and a few of them can double the document again and again
/// (`copy` of a value into itself) or nest it deeper one level at a time (`move`): after every
/// patch the document is measured against the install config's bounds, before the next one can
/// grow it further. One patch at most doubles the document, so it never gets far past them.
pub(crate) fn apply_patches_counted(config: &mut Value, patches: &[PatchEntity], work: &mut u64) -> Result<(), String> {
    count_patches(patches)?;
    for (index, entity) in patches.iter().enumerate() {
        let number = index + 1;
        let op = to_operation(entity).map_err(|e| format!("patch {number}: {e}"))?;
        json_patch::patch(config, &[op]).map_err(|e| format!("patch {number} ({}): {e}", describe(entity)))?;
        let measured = bounds::measure(config, INSTALL_CONFIG)
            .map_err(|e| format!("patch {number} ({}) is refused: {e}", describe(entity)))?;
        // A value costs its bytes and its node: a list of small numbers is few bytes but as many
        // values to copy and walk, each the size of a `Value`.
        let nodes = measured.nodes.saturating_mul(std::mem::size_of::<Value>());
        *work = work.saturating_add(measured.bytes.saturating_add(nodes) as u64);
    }
    Ok(())
}

/// Refuses more patches than stackd applies (a customization written before the schema had its
/// `maxItems`), before anything is copied for them.
pub(crate) fn count_patches(patches: &[PatchEntity]) -> Result<(), String> {
    if patches.len() > MAX_INSTALL_CONFIG_PATCHES {
        return Err(format!(
            "{} installConfigPatches are more than the {MAX_INSTALL_CONFIG_PATCHES} stackd applies; merge or remove some",
            patches.len()
        ));
    }
    Ok(())
}

fn describe(entity: &PatchEntity) -> String {
    format!(
        "{} {}",
        serde_json::to_value(entity.op)
            .ok()
            .and_then(|v| v.as_str().map(String::from))
            .unwrap_or_default(),
        entity.path
    )
}

fn to_operation(entity: &PatchEntity) -> Result<json_patch::PatchOperation, String> {
    let pointer = |field: &str, value: &str| -> Result<(), String> {
        if value.starts_with('/') || value.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "{field} {value:?} is not a JSON pointer: it must start with '/' (write \"/{value}\")"
            ))
        }
    };
    pointer("path", &entity.path)?;
    let mut op = json!({"path": entity.path});
    let name = match entity.op {
        PatchOp::Add => "add",
        PatchOp::Remove => "remove",
        PatchOp::Replace => "replace",
        PatchOp::Move => "move",
        PatchOp::Copy => "copy",
        PatchOp::Test => "test",
    };
    op["op"] = json!(name);
    match entity.op {
        PatchOp::Add | PatchOp::Replace | PatchOp::Test => match &entity.value {
            Some(value) => op["value"] = value.clone(),
            None => return Err(format!("{name} {} needs a `value`; add one", entity.path)),
        },
        PatchOp::Move | PatchOp::Copy => match &entity.from {
            Some(from) => {
                pointer("from", from)?;
                op["from"] = json!(from);
            }
            None => return Err(format!("{name} {} needs a `from` pointer; add one", entity.path)),
        },
        PatchOp::Remove => {}
    }
    serde_json::from_value(op).map_err(|e| format!("{name} {}: {e}", entity.path))
}

/// Block-style YAML equivalent to the JSON value; strings a YAML 1.1 reader could take for
/// anything but a string are double-quoted. `None` when it would be longer than `max_bytes`: the
/// indentation of a deeply nested list makes YAML many times longer than its JSON, so the writing
/// stops soon after the bound (by at most one scalar and its indentation).
pub(crate) fn to_yaml(value: &Value, max_bytes: usize) -> Option<String> {
    let mut out = Yaml {
        text: String::new(),
        max_bytes,
    };
    match value {
        Value::Object(map) if !map.is_empty() => write_map(&mut out, map, 0),
        Value::Array(list) if !list.is_empty() => write_list(&mut out, list, 0),
        scalar => {
            out.push_str(&scalar_text(scalar));
            out.push('\n');
        }
    }
    (out.text.len() <= max_bytes).then_some(out.text)
}

/// YAML being written, and its bound.
struct Yaml {
    text: String,
    max_bytes: usize,
}

impl Yaml {
    fn full(&self) -> bool {
        self.text.len() > self.max_bytes
    }

    fn push_str(&mut self, text: &str) {
        self.text.push_str(text);
    }

    fn push(&mut self, c: char) {
        self.text.push(c);
    }

    fn trim_start(&self) -> &str {
        self.text.trim_start()
    }
}

fn write_map(out: &mut Yaml, map: &Map<String, Value>, indent: usize) {
    for (key, value) in map {
        if out.full() {
            return;
        }
        out.push_str(&" ".repeat(indent));
        out.push_str(&string_text(key));
        out.push(':');
        write_child(out, value, indent);
    }
}

fn write_list(out: &mut Yaml, list: &[Value], indent: usize) {
    for item in list {
        if out.full() {
            return;
        }
        out.push_str(&" ".repeat(indent));
        out.push('-');
        match item {
            Value::Object(map) if !map.is_empty() => {
                // The first key goes on the dash's line; the rest align with it.
                let mut nested = Yaml {
                    text: String::new(),
                    max_bytes: out.max_bytes.saturating_sub(out.text.len()),
                };
                write_map(&mut nested, map, indent + 2);
                out.push(' ');
                out.push_str(nested.trim_start());
            }
            _ => write_child(out, item, indent),
        }
    }
}

fn write_child(out: &mut Yaml, value: &Value, indent: usize) {
    match value {
        Value::Object(map) if !map.is_empty() => {
            out.push('\n');
            write_map(out, map, indent + 2);
        }
        Value::Array(list) if !list.is_empty() => {
            out.push('\n');
            write_list(out, list, indent + 2);
        }
        scalar => {
            out.push(' ');
            out.push_str(&scalar_text(scalar));
            out.push('\n');
        }
    }
}

fn scalar_text(value: &Value) -> String {
    match value {
        Value::Null => "null".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => string_text(s),
        Value::Array(_) => "[]".into(),
        Value::Object(_) => "{}".into(),
    }
}

/// Words YAML 1.1 resolves to booleans or null when unquoted.
const YAML11_WORDS: &[&str] = &["y", "yes", "n", "no", "true", "false", "on", "off", "null", "~"];

/// A string written plain only when it cannot be read as anything else: it starts with a letter,
/// uses a conservative character set, and is not a YAML 1.1 bool/null word. Everything else
/// (numbers such as `1e3`, `0x1F`, `1_000`, times such as `1:30`, leading symbols) is quoted.
fn string_text(s: &str) -> String {
    let plain = s.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
        && !YAML11_WORDS.contains(&s.to_ascii_lowercase().as_str())
        && !s.contains(':');
    if plain {
        s.to_string()
    } else {
        Value::from(s).to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::pools::{ClusterPoolSpec, VSpherePlatform};

    fn pool() -> ClusterPoolSpec {
        ClusterPoolSpec {
            base_domain: "example.com".into(),
            installer_image: "quay.io/example/installer:4.14".into(),
            platform: Platform {
                vsphere: Some(VSpherePlatform {
                    v_center: "vc.example.com".into(),
                    datacenter: "dc1".into(),
                    default_datastore: "ds1".into(),
                    ..Default::default()
                }),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn patch(op: PatchOp, path: &str, value: Option<Value>) -> PatchEntity {
        PatchEntity {
            op,
            path: path.into(),
            from: None,
            value,
        }
    }

    #[test]
    fn name_base_domain_and_platform_are_injected_into_the_template() {
        let template =
            parse_template("metadata:\n  name: ignored\nplatform:\n  vsphere:\n    apiVIP: 10.0.0.1\n").unwrap();
        let config = generate(&template, &pool(), "pool-abcde");
        assert_eq!(config["metadata"]["name"], "pool-abcde");
        assert_eq!(config["baseDomain"], "example.com");
        assert_eq!(config["platform"]["vsphere"]["vCenter"], "vc.example.com");
        assert_eq!(
            config["platform"]["vsphere"]["apiVIP"], "10.0.0.1",
            "template fields stay"
        );
    }

    #[test]
    fn a_malformed_template_names_the_line_and_never_the_password() {
        let text = "platform:\n  vsphere:\n    password: \"hunter2-vsphere\n  pullSecret: '{\"auths\": 1}'\n";
        let err = parse_template(text).unwrap_err().to_string();
        assert!(!err.contains("hunter2"), "{err}");
        assert!(err.contains("line"), "{err}");
    }

    #[test]
    fn patches_apply_in_order() {
        let mut config = generate(&Map::new(), &pool(), "pool-abcde");
        apply_patches(
            &mut config,
            &[
                patch(PatchOp::Replace, "/metadata/name", Some(json!("foo"))),
                patch(
                    PatchOp::Add,
                    "/networking",
                    Some(json!({"machineNetwork": [{"cidr": "10.0.0.0/24"}]})),
                ),
                patch(PatchOp::Test, "/metadata/name", Some(json!("foo"))),
            ],
        )
        .unwrap();
        assert_eq!(config["metadata"]["name"], "foo");
        assert_eq!(config["networking"]["machineNetwork"][0]["cidr"], "10.0.0.0/24");
    }

    #[test]
    fn broken_patches_say_how_to_fix_them() {
        let mut config = generate(&Map::new(), &pool(), "x");
        let err = apply_patches(&mut config, &[patch(PatchOp::Add, "metadata/name", Some(json!("foo")))]).unwrap_err();
        assert!(err.contains("write \"/metadata/name\""), "{err}");
        let err = apply_patches(&mut config, &[patch(PatchOp::Replace, "/metadata/name", None)]).unwrap_err();
        assert!(err.contains("needs a `value`"), "{err}");
        let err = apply_patches(&mut config, &[patch(PatchOp::Replace, "/broken/path", Some(json!(1)))]).unwrap_err();
        assert!(err.starts_with("patch 1 (replace /broken/path)"), "{err}");
        let mut mv = patch(PatchOp::Move, "/a", None);
        let err = apply_patches(&mut config, &[mv.clone()]).unwrap_err();
        assert!(err.contains("needs a `from`"), "{err}");
        mv.from = Some("metadata".into());
        assert!(
            apply_patches(&mut config, &[mv])
                .unwrap_err()
                .contains("must start with '/'")
        );
    }

    fn moved(from: &str, path: &str) -> PatchEntity {
        PatchEntity {
            op: PatchOp::Move,
            path: path.into(),
            from: Some(from.into()),
            value: None,
        }
    }

    #[test]
    fn a_patch_that_doubles_the_config_again_and_again_is_refused_at_the_size_bound() {
        let mut config = generate(&Map::new(), &pool(), "x");
        let mut bomb = vec![patch(PatchOp::Add, "/b", Some(json!(["x".repeat(2048)])))];
        bomb.extend((0..30).map(|_| PatchEntity {
            op: PatchOp::Copy,
            path: "/b/-".into(),
            from: Some("/b".into()),
            value: None,
        }));
        let err = apply_patches(&mut config, &bomb).unwrap_err();
        // 2 KiB doubled: past 1 MiB at the ninth copy.
        assert!(err.starts_with("patch 10 (copy /b/-) is refused"), "{err}");
        assert!(err.contains("larger than 1 MiB serialized"), "{err}");
    }

    #[test]
    fn moves_nesting_the_config_deeper_are_refused_at_the_depth_bound() {
        let mut config = generate(&Map::new(), &pool(), "x");
        // /a nested 30 levels and spare mappings, then pairs of moves: each nests /a one level
        // deeper in a spare.
        let mut nested = json!({});
        for _ in 0..30 {
            nested = json!({ "a": nested });
        }
        let mut patches = vec![
            patch(PatchOp::Add, "/a", Some(nested)),
            patch(PatchOp::Add, "/s", Some(json!(vec![json!({}); 49]))),
        ];
        for _ in 0..49 {
            patches.push(moved("/a", "/s/0/a"));
            patches.push(moved("/s/0", "/a"));
        }
        let err = apply_patches(&mut config, &patches[..MAX_INSTALL_CONFIG_PATCHES]).unwrap_err();
        assert!(err.contains("nest lists and mappings deeper than 64 levels"), "{err}");
        assert!(err.contains("(move /s/0/a)") || err.contains("(move /a)"), "{err}");
    }

    #[test]
    fn more_patches_than_stackd_applies_are_refused_before_any_is_applied() {
        let mut config = json!({"untouched": true});
        let many = vec![patch(PatchOp::Add, "/x", Some(json!(1))); MAX_INSTALL_CONFIG_PATCHES + 1];
        let err = apply_patches(&mut config, &many).unwrap_err();
        assert!(err.contains("101 installConfigPatches are more than the 100"), "{err}");
        assert_eq!(config, json!({"untouched": true}));
    }

    #[test]
    fn yaml_many_times_longer_than_its_json_stops_soon_after_the_bound() {
        // 100 KiB of JSON at depth 60: each item written on a line indented 120 spaces.
        let mut deep = Value::Array(vec![json!(1); 50_000]);
        for _ in 0..60 {
            deep = json!({ "a": deep });
        }
        assert!(serde_json::to_string(&deep).unwrap().len() < 200_000);
        assert_eq!(to_yaml(&deep, 1 << 20), None);
        let small = json!({"a": [1, {"b": "on"}]});
        assert_eq!(to_yaml(&small, 1 << 20), to_yaml(&small, usize::MAX));
        assert_eq!(to_yaml(&small, 5), None);
    }

    #[test]
    fn a_template_past_the_bounds_is_refused() {
        let deep = format!("a: {}1{}\n", "[".repeat(70), "]".repeat(70));
        assert!(parse_template(&deep).is_err());
        let big = format!("a: {}\n", "x".repeat(bounds::MAX_CONFIG_BYTES + 1));
        let err = parse_template(&big).unwrap_err().to_string();
        assert!(err.contains("1 MiB"), "{err}");
    }

    #[test]
    fn ambiguous_scalars_stay_strings_for_yaml_1_1_readers() {
        let value = json!({
            "on": "on", "no": "no", "y": "Y", "n": "1e3", "hex": "0x1F", "time": "1:30", "num": 1e3,
            "plain": "vc.example.com", "empty": "", "null": null, "bool": true,
            "list": [{"a": "off", "b": [1, "2"]}, "yes"],
        });
        let yaml = to_yaml(&value, usize::MAX).unwrap();
        for quoted in [
            "\"on\": \"on\"",
            "\"no\": \"no\"",
            "\"y\": \"Y\"",
            "\"n\": \"1e3\"",
            "\"0x1F\"",
            "\"1:30\"",
            "empty: \"\"",
            "- \"yes\"",
        ] {
            assert!(yaml.contains(quoted), "{quoted} in\n{yaml}");
        }
        assert!(yaml.contains("plain: vc.example.com"), "{yaml}");
        let back: Value = serde_saphyr::from_str(&yaml).unwrap();
        assert_eq!(back, value, "{yaml}");
    }
}
