//! Protobuf request bodies for the few kinds client-go's typed clients write with them: Helm keeps
//! its releases in Secrets (and deletes them with protobuf DeleteOptions), and
//! `kubectl create namespace|configmap|secret|serviceaccount|role|rolebinding|...` use typed clients,
//! which send `application/vnd.kubernetes.protobuf` and do not fall back to JSON. The body becomes
//! the JSON object it stands for; answers stay JSON (those clients accept it). Other kinds are 415.
//!
//! Wire format: `k8s\0`, then a `runtime.Unknown` {1: typeMeta {1: apiVersion, 2: kind}, 2: raw},
//! `raw` being the object's message with the field numbers of k8s.io/api's generated.proto.

use base64::Engine;
use serde_json::{Map, Value, json};

use super::status::ApiError;

const MAGIC: &[u8] = b"k8s\0";

/// One field of a protobuf message.
enum Field<'a> {
    Varint(u64),
    Bytes(&'a [u8]),
    Fixed,
}

fn varint(input: &[u8], at: &mut usize) -> Option<u64> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *input.get(*at)?;
        *at += 1;
        value |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Some(value);
        }
    }
    None
}

/// The fields of a message as (number, value), or `None` if it is malformed.
fn fields(input: &[u8]) -> Option<Vec<(u64, Field<'_>)>> {
    let mut at = 0;
    let mut out = Vec::new();
    while at < input.len() {
        let key = varint(input, &mut at)?;
        let field = match key & 7 {
            0 => Field::Varint(varint(input, &mut at)?),
            1 => {
                at = at.checked_add(8).filter(|end| *end <= input.len())?;
                Field::Fixed
            }
            2 => {
                let len = usize::try_from(varint(input, &mut at)?).ok()?;
                let end = at.checked_add(len).filter(|end| *end <= input.len())?;
                let bytes = &input[at..end];
                at = end;
                Field::Bytes(bytes)
            }
            5 => {
                at = at.checked_add(4).filter(|end| *end <= input.len())?;
                Field::Fixed
            }
            _ => return None,
        };
        out.push((key >> 3, field));
    }
    Some(out)
}

fn text(bytes: &[u8]) -> Option<String> {
    String::from_utf8(bytes.to_vec()).ok()
}

/// A `map<string, string>` (or bytes, base64-encoded as JSON has them) entry.
fn map_entry(bytes: &[u8], base64_value: bool) -> Option<(String, Value)> {
    let mut key = String::new();
    let mut value = Value::String(String::new());
    for (number, field) in fields(bytes)? {
        match (number, field) {
            (1, Field::Bytes(b)) => key = text(b)?,
            (2, Field::Bytes(b)) if base64_value => {
                value = json!(base64::engine::general_purpose::STANDARD.encode(b));
            }
            (2, Field::Bytes(b)) => value = json!(text(b)?),
            _ => {}
        }
    }
    Some((key, value))
}

fn insert_entry(object: &mut Map<String, Value>, name: &str, entry: (String, Value)) {
    if let Some(map) = object
        .entry(name)
        .or_insert_with(|| Value::Object(Map::new()))
        .as_object_mut()
    {
        map.insert(entry.0, entry.1);
    }
}

fn push(object: &mut Map<String, Value>, name: &str, item: Value) {
    if let Some(list) = object.entry(name).or_insert_with(|| json!([])).as_array_mut() {
        list.push(item);
    }
}

/// `metav1.Time`: seconds since the epoch, as RFC 3339.
fn time(bytes: &[u8]) -> Option<Value> {
    let mut seconds = 0i64;
    for (number, field) in fields(bytes)? {
        if let (1, Field::Varint(v)) = (number, field) {
            seconds = v as i64;
        }
    }
    if seconds == 0 {
        return Some(Value::Null);
    }
    let timestamp = jiff::Timestamp::from_second(seconds).ok()?;
    Some(json!(timestamp.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()))
}

fn owner_reference(bytes: &[u8]) -> Option<Value> {
    let mut owner = Map::new();
    for (number, field) in fields(bytes)? {
        let name = match number {
            1 => "kind",
            3 => "name",
            4 => "uid",
            5 => "apiVersion",
            6 => "controller",
            7 => "blockOwnerDeletion",
            _ => continue,
        };
        match field {
            Field::Bytes(b) => owner.insert(name.into(), json!(text(b)?)),
            Field::Varint(v) => owner.insert(name.into(), json!(v != 0)),
            Field::Fixed => None,
        };
    }
    Some(Value::Object(owner))
}

/// `metav1.ObjectMeta`, without `managedFields` (an update that omits them keeps the stored ones).
fn object_meta(bytes: &[u8]) -> Option<Value> {
    let mut meta = Map::new();
    for (number, field) in fields(bytes)? {
        match (number, field) {
            (1..=6, Field::Bytes(b)) => {
                let name = [
                    "name",
                    "generateName",
                    "namespace",
                    "selfLink",
                    "uid",
                    "resourceVersion",
                ][usize::try_from(number - 1).ok()?];
                let value = text(b)?;
                if !value.is_empty() {
                    meta.insert(name.into(), json!(value));
                }
            }
            (7, Field::Varint(v)) => {
                meta.insert("generation".into(), json!(v as i64));
            }
            (8, Field::Bytes(b)) => {
                meta.insert("creationTimestamp".into(), time(b)?);
            }
            (9, Field::Bytes(b)) => {
                meta.insert("deletionTimestamp".into(), time(b)?);
            }
            (10, Field::Varint(v)) => {
                meta.insert("deletionGracePeriodSeconds".into(), json!(v as i64));
            }
            (11, Field::Bytes(b)) => insert_entry(&mut meta, "labels", map_entry(b, false)?),
            (12, Field::Bytes(b)) => insert_entry(&mut meta, "annotations", map_entry(b, false)?),
            (13, Field::Bytes(b)) => push(&mut meta, "ownerReferences", owner_reference(b)?),
            (14, Field::Bytes(b)) => push(&mut meta, "finalizers", json!(text(b)?)),
            _ => {}
        }
    }
    meta.retain(|_, v| !v.is_null());
    Some(Value::Object(meta))
}

fn secret(bytes: &[u8], object: &mut Map<String, Value>) -> Option<()> {
    for (number, field) in fields(bytes)? {
        match (number, field) {
            (1, Field::Bytes(b)) => {
                object.insert("metadata".into(), object_meta(b)?);
            }
            (2, Field::Bytes(b)) => insert_entry(object, "data", map_entry(b, true)?),
            (3, Field::Bytes(b)) => {
                let kind = text(b)?;
                if !kind.is_empty() {
                    object.insert("type".into(), json!(kind));
                }
            }
            (4, Field::Bytes(b)) => insert_entry(object, "stringData", map_entry(b, false)?),
            (5, Field::Varint(v)) => {
                object.insert("immutable".into(), json!(v != 0));
            }
            _ => {}
        }
    }
    Some(())
}

fn config_map(bytes: &[u8], object: &mut Map<String, Value>) -> Option<()> {
    for (number, field) in fields(bytes)? {
        match (number, field) {
            (1, Field::Bytes(b)) => {
                object.insert("metadata".into(), object_meta(b)?);
            }
            (2, Field::Bytes(b)) => insert_entry(object, "data", map_entry(b, false)?),
            (3, Field::Bytes(b)) => insert_entry(object, "binaryData", map_entry(b, true)?),
            (4, Field::Varint(v)) => {
                object.insert("immutable".into(), json!(v != 0));
            }
            _ => {}
        }
    }
    Some(())
}

fn namespace(bytes: &[u8], object: &mut Map<String, Value>) -> Option<()> {
    for (number, field) in fields(bytes)? {
        match (number, field) {
            (1, Field::Bytes(b)) => {
                object.insert("metadata".into(), object_meta(b)?);
            }
            (2, Field::Bytes(spec)) => {
                let mut finalizers = Vec::new();
                for (n, f) in fields(spec)? {
                    if let (1, Field::Bytes(b)) = (n, f) {
                        finalizers.push(json!(text(b)?));
                    }
                }
                if !finalizers.is_empty() {
                    object.insert("spec".into(), json!({ "finalizers": finalizers }));
                }
            }
            _ => {}
        }
    }
    Some(())
}

/// How one field of a message maps to JSON, for the plain messages below.
enum Shape {
    Text,
    Texts,
    Flag,
    Message(&'static [(u64, &'static str, Shape)]),
    Messages(&'static [(u64, &'static str, Shape)]),
}

const POLICY_RULE: &[(u64, &str, Shape)] = &[
    (1, "verbs", Shape::Texts),
    (2, "apiGroups", Shape::Texts),
    (3, "resources", Shape::Texts),
    (4, "resourceNames", Shape::Texts),
    (5, "nonResourceURLs", Shape::Texts),
];
const SUBJECT: &[(u64, &str, Shape)] = &[
    (1, "kind", Shape::Text),
    (2, "apiGroup", Shape::Text),
    (3, "name", Shape::Text),
    (4, "namespace", Shape::Text),
];
const ROLE_REF: &[(u64, &str, Shape)] = &[
    (1, "apiGroup", Shape::Text),
    (2, "kind", Shape::Text),
    (3, "name", Shape::Text),
];
const OBJECT_REFERENCE: &[(u64, &str, Shape)] = &[
    (1, "kind", Shape::Text),
    (2, "namespace", Shape::Text),
    (3, "name", Shape::Text),
    (4, "uid", Shape::Text),
    (5, "apiVersion", Shape::Text),
];
const LOCAL_OBJECT_REFERENCE: &[(u64, &str, Shape)] = &[(1, "name", Shape::Text)];
const ROLE: &[(u64, &str, Shape)] = &[(2, "rules", Shape::Messages(POLICY_RULE))];
const ROLE_BINDING: &[(u64, &str, Shape)] = &[
    (2, "subjects", Shape::Messages(SUBJECT)),
    (3, "roleRef", Shape::Message(ROLE_REF)),
];
const SERVICE_ACCOUNT: &[(u64, &str, Shape)] = &[
    (2, "secrets", Shape::Messages(OBJECT_REFERENCE)),
    (3, "imagePullSecrets", Shape::Messages(LOCAL_OBJECT_REFERENCE)),
    (4, "automountServiceAccountToken", Shape::Flag),
];

/// An object whose `metadata` is field 1 and whose other fields `table` describes.
fn with_metadata(bytes: &[u8], table: &[(u64, &str, Shape)], object: &mut Map<String, Value>) -> Option<()> {
    for (number, field) in fields(bytes)? {
        if let (1, Field::Bytes(b)) = (number, field) {
            object.insert("metadata".into(), object_meta(b)?);
        }
    }
    plain(bytes, table, object)
}

/// A message whose fields `table` describes; empty strings are left out, as JSON's `omitempty`
/// does.
fn plain(bytes: &[u8], table: &[(u64, &str, Shape)], object: &mut Map<String, Value>) -> Option<()> {
    for (number, field) in fields(bytes)? {
        let Some((_, name, shape)) = table.iter().find(|(n, _, _)| *n == number) else {
            continue;
        };
        match (shape, field) {
            (Shape::Text, Field::Bytes(b)) => {
                let value = text(b)?;
                if !value.is_empty() {
                    object.insert(name.to_string(), json!(value));
                }
            }
            (Shape::Texts, Field::Bytes(b)) => push(object, name, json!(text(b)?)),
            (Shape::Flag, Field::Varint(v)) => {
                object.insert(name.to_string(), json!(v != 0));
            }
            (Shape::Message(inner), Field::Bytes(b)) => {
                let mut child = Map::new();
                plain(b, inner, &mut child)?;
                object.insert(name.to_string(), Value::Object(child));
            }
            (Shape::Messages(inner), Field::Bytes(b)) => {
                let mut child = Map::new();
                plain(b, inner, &mut child)?;
                push(object, name, Value::Object(child));
            }
            _ => {}
        }
    }
    Some(())
}

/// `metav1.DeleteOptions`, which typed clients send with their deletes.
fn delete_options(bytes: &[u8], object: &mut Map<String, Value>) -> Option<()> {
    for (number, field) in fields(bytes)? {
        match (number, field) {
            (1, Field::Varint(v)) => {
                object.insert("gracePeriodSeconds".into(), json!(v as i64));
            }
            (2, Field::Bytes(b)) => {
                let mut preconditions = Map::new();
                for (n, f) in fields(b)? {
                    match (n, f) {
                        (1, Field::Bytes(uid)) => preconditions.insert("uid".into(), json!(text(uid)?)),
                        (2, Field::Bytes(rv)) => preconditions.insert("resourceVersion".into(), json!(text(rv)?)),
                        _ => None,
                    };
                }
                object.insert("preconditions".into(), Value::Object(preconditions));
            }
            (3, Field::Varint(v)) => {
                object.insert("orphanDependents".into(), json!(v != 0));
            }
            (4, Field::Bytes(b)) => {
                object.insert("propagationPolicy".into(), json!(text(b)?));
            }
            (5, Field::Bytes(b)) => push(object, "dryRun", json!(text(b)?)),
            _ => {}
        }
    }
    Some(())
}

/// Why a protobuf body cannot be taken.
#[derive(Debug, PartialEq, Eq)]
pub enum ProtobufError {
    /// Not one of the kinds decoded here.
    Unsupported(String),
    Malformed,
}

/// The JSON object a protobuf request body stands for.
pub fn decode(body: &[u8]) -> Result<Value, ProtobufError> {
    let envelope = body.strip_prefix(MAGIC).ok_or(ProtobufError::Malformed)?;
    let (mut api_version, mut kind, mut raw) = (String::new(), String::new(), &[][..]);
    for (number, field) in fields(envelope).ok_or(ProtobufError::Malformed)? {
        match (number, field) {
            (1, Field::Bytes(type_meta)) => {
                for (n, f) in fields(type_meta).ok_or(ProtobufError::Malformed)? {
                    match (n, f) {
                        (1, Field::Bytes(b)) => api_version = text(b).ok_or(ProtobufError::Malformed)?,
                        (2, Field::Bytes(b)) => kind = text(b).ok_or(ProtobufError::Malformed)?,
                        _ => {}
                    }
                }
            }
            (2, Field::Bytes(b)) => raw = b,
            _ => {}
        }
    }
    let mut object = Map::new();
    object.insert("apiVersion".into(), json!(api_version));
    object.insert("kind".into(), json!(kind));
    let decoded = match (api_version.as_str(), kind.as_str()) {
        ("v1", "Secret") => secret(raw, &mut object),
        ("v1", "ConfigMap") => config_map(raw, &mut object),
        ("v1", "Namespace") => namespace(raw, &mut object),
        ("v1", "ServiceAccount") => with_metadata(raw, SERVICE_ACCOUNT, &mut object),
        ("rbac.authorization.k8s.io/v1", "Role" | "ClusterRole") => with_metadata(raw, ROLE, &mut object),
        ("rbac.authorization.k8s.io/v1", "RoleBinding" | "ClusterRoleBinding") => {
            with_metadata(raw, ROLE_BINDING, &mut object)
        }
        (_, "DeleteOptions") => delete_options(raw, &mut object),
        _ => return Err(ProtobufError::Unsupported(format!("{api_version} {kind}"))),
    };
    decoded.ok_or(ProtobufError::Malformed)?;
    Ok(Value::Object(object))
}

/// The JSON for a protobuf request body (`None` when the body is not binary); other protobuf
/// kinds and CBOR are 415, as kube-apiserver answers for a media type it does not serve.
pub fn json_body(content_type: &str, body: &[u8]) -> Result<Option<Vec<u8>>, ApiError> {
    let unsupported = |what: &str| {
        ApiError::unsupported_media_type(format!(
            "the body of the request was in an unknown format ({what}) - accepted media types include: application/json"
        ))
    };
    match content_type {
        _ if body.is_empty() => Ok(None),
        "application/cbor" => Err(unsupported(content_type)),
        "application/vnd.kubernetes.protobuf" => match decode(body) {
            Ok(object) => Ok(Some(object.to_string().into_bytes())),
            Err(ProtobufError::Unsupported(kind)) => Err(unsupported(&format!("protobuf {kind}"))),
            Err(ProtobufError::Malformed) => Err(ApiError::bad_request("the protobuf request body is malformed")),
        },
        _ => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes_field(number: u64, bytes: &[u8]) -> Vec<u8> {
        let mut out = vec![((number << 3) | 2) as u8, bytes.len() as u8];
        out.extend_from_slice(bytes);
        out
    }

    fn entry(key: &str, value: &[u8]) -> Vec<u8> {
        [bytes_field(1, key.as_bytes()), bytes_field(2, value)].concat()
    }

    #[test]
    fn a_helm_release_secret_decodes_to_its_json() {
        let meta = [
            bytes_field(1, b"sh.helm.release.v1.x.v1"),
            bytes_field(3, b"default"),
            bytes_field(6, b""),
            bytes_field(8, b""),
            bytes_field(11, &entry("owner", b"helm")),
        ]
        .concat();
        let secret = [
            bytes_field(1, &meta),
            bytes_field(2, &entry("release", b"\x01\x02")),
            bytes_field(3, b"helm.sh/release.v1"),
        ]
        .concat();
        let type_meta = [bytes_field(1, b"v1"), bytes_field(2, b"Secret")].concat();
        let body = [MAGIC.to_vec(), bytes_field(1, &type_meta), bytes_field(2, &secret)].concat();
        assert_eq!(
            decode(&body).unwrap(),
            json!({
                "apiVersion": "v1", "kind": "Secret",
                "metadata": {"name": "sh.helm.release.v1.x.v1", "namespace": "default", "labels": {"owner": "helm"}},
                "data": {"release": "AQI="},
                "type": "helm.sh/release.v1",
            })
        );
    }

    #[test]
    fn other_kinds_and_garbage_are_refused() {
        let type_meta = [bytes_field(1, b"v1"), bytes_field(2, b"Pod")].concat();
        let body = [MAGIC.to_vec(), bytes_field(1, &type_meta)].concat();
        assert_eq!(decode(&body), Err(ProtobufError::Unsupported("v1 Pod".into())));
        assert_eq!(decode(b"k8s\0\xff\xff"), Err(ProtobufError::Malformed));
        assert_eq!(decode(b"{}"), Err(ProtobufError::Malformed));
    }
}
