//! An object of a watch or list, read as compact JSON and measured before it is decoded into its type.
//!
//! kube's client decodes every list page and watch event with serde_json; decoding straight into a
//! typed object gives no chance to refuse one that is too big before it costs its full size in
//! memory (a `serde_json::Value` costs 32 bytes per array element, 40 with what a growing vector
//! over-allocates: 1.3 MiB of small numbers is some 26 MiB decoded). [`RawObject`] instead copies the object as compact JSON (about its size on
//! the wire, transiently) while counting what decoding it would build, and keeps its metadata; the
//! shared caches then decide on the size before the typed decode (`runtime::informers`).
//!
//! It works whatever order the fields come in: kube decodes a watch event whose `object` precedes
//! its `type` from serde's buffered content, where a `RawValue` could not be taken.
//!
//! `metadata.managedFields` is left out on the way (as client-go informers' managed-fields
//! transform does): no controller reads it from a cache, and on a real API server it is often a
//! third of an object's JSON, decoded and kept for every cached object and every watch event. The
//! status writer, which does need it, reads it from the answer to its own write.
//!
//! A CustomResourceDefinition loses its per-version `schema` and kubectl's last-applied copy too:
//! they are most of its size (a typed schema decodes to many times its JSON), and no controller
//! reads them from the cache (specs are compared by `crate::api::crds::SPEC_HASH_ANNOTATION`). So
//! what the CRD cache keeps is measured, and charged, as it is kept, and a package's schemas are
//! never decoded by a watch at all.

use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;
use std::ops::Range;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Resource;
use serde::Deserialize;
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

/// What decoding an object would cost in memory, estimated from its JSON: every value is a node
/// (an enum of 32 bytes in a `serde_json::Value`, a field or a vector slot in a typed object, plus
/// what vectors over-allocate as they grow), plus the bytes of its strings and keys.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Footprint {
    pub nodes: u64,
    pub string_bytes: u64,
}

/// Bytes one decoded JSON node is taken to cost (see [`Footprint`]). Measured: 20 cached
/// ClusterDeploymentCustomizations holding 4 million small numbers in all grew the daemon's RSS by
/// 153 MiB, 40 bytes a number (issue 28).
pub const BYTES_PER_NODE: u64 = 40;

impl Footprint {
    /// The estimated bytes the decoded object holds.
    pub fn bytes(&self) -> u64 {
        self.nodes
            .saturating_mul(BYTES_PER_NODE)
            .saturating_add(self.string_bytes)
    }
}

/// One object as compact JSON with its metadata, not yet decoded into `K`.
pub struct RawObject<K> {
    pub metadata: ObjectMeta,
    /// The object as compact JSON.
    pub json: Vec<u8>,
    pub footprint: Footprint,
    kind: PhantomData<fn() -> K>,
}

impl<K> RawObject<K> {
    /// Reads `json` (tests, and objects read by other means than a watch).
    pub fn from_json(json: &[u8]) -> serde_json::Result<RawObject<K>>
    where
        K: Resource<DynamicType = ()>,
    {
        serde_json::from_slice(json)
    }

    /// Decodes the object into its type.
    pub fn decode(&self) -> serde_json::Result<K>
    where
        K: serde::de::DeserializeOwned,
    {
        serde_json::from_slice(&self.json)
    }
}

impl<K> Clone for RawObject<K> {
    fn clone(&self) -> Self {
        RawObject {
            metadata: self.metadata.clone(),
            json: self.json.clone(),
            footprint: self.footprint,
            kind: PhantomData,
        }
    }
}

impl<K> fmt::Debug for RawObject<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the body: it may be a Secret.
        f.debug_struct("RawObject")
            .field("namespace", &self.metadata.namespace)
            .field("name", &self.metadata.name)
            .field("json_bytes", &self.json.len())
            .finish()
    }
}

impl<K: Resource> Resource for RawObject<K> {
    type DynamicType = K::DynamicType;
    type Scope = K::Scope;

    fn kind(dt: &Self::DynamicType) -> Cow<'_, str> {
        K::kind(dt)
    }
    fn group(dt: &Self::DynamicType) -> Cow<'_, str> {
        K::group(dt)
    }
    fn version(dt: &Self::DynamicType) -> Cow<'_, str> {
        K::version(dt)
    }
    fn plural(dt: &Self::DynamicType) -> Cow<'_, str> {
        K::plural(dt)
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

impl<'de, K: Resource<DynamicType = ()>> Deserialize<'de> for RawObject<K> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let mut json = Vec::new();
        let mut footprint = Footprint::default();
        let mut metadata_span = None;
        let crd = K::group(&()) == "apiextensions.k8s.io" && K::kind(&()) == "CustomResourceDefinition";
        Transcode {
            out: &mut json,
            footprint: &mut footprint,
            at: Position::Object,
            metadata_span: &mut metadata_span,
            crd,
        }
        .deserialize(deserializer)?;
        if json.first() != Some(&b'{') {
            return Err(de::Error::invalid_type(
                de::Unexpected::Other("a JSON value other than an object"),
                &"an object",
            ));
        }
        // Read from its own span of the copy: the rest of the object is not scanned again.
        let metadata = match metadata_span {
            Some(span) => serde_json::from_slice(&json[span]).map_err(de::Error::custom)?,
            None => ObjectMeta::default(),
        };
        Ok(RawObject {
            metadata,
            json,
            footprint,
            kind: PhantomData,
        })
    }
}

/// Writes the value it is given to `out` as compact JSON, counting it into `footprint`.
struct Transcode<'a> {
    out: &'a mut Vec<u8>,
    footprint: &'a mut Footprint,
    at: Position,
    /// Where the object's `metadata` was written in `out`.
    metadata_span: &'a mut Option<Range<usize>>,
    /// The object is a CRD: its schemas and last-applied copy are left out.
    crd: bool,
}

/// Where in the object a value is: its `metadata` loses its `managedFields`; a CRD's versions lose
/// their `schema`, its annotations kubectl's last-applied copy.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Position {
    Object,
    Metadata,
    Annotations,
    Spec,
    Versions,
    Version,
    Within,
}

/// What a CRD's cached copy leaves out of its annotations.
const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

impl Position {
    /// Where the value of `key` in a mapping at this position is (`None`: left out).
    fn of(self, key: &str, crd: bool) -> Option<Position> {
        match (self, key) {
            (Position::Metadata, "managedFields") => None,
            (Position::Object, "metadata") => Some(Position::Metadata),
            (Position::Metadata, "annotations") if crd => Some(Position::Annotations),
            (Position::Annotations, LAST_APPLIED) => None,
            (Position::Object, "spec") if crd => Some(Position::Spec),
            (Position::Spec, "versions") => Some(Position::Versions),
            (Position::Version, "schema") => None,
            _ => Some(Position::Within),
        }
    }
}

impl Transcode<'_> {
    fn at(&mut self, at: Position) -> Transcode<'_> {
        Transcode {
            out: self.out,
            footprint: self.footprint,
            at,
            metadata_span: self.metadata_span,
            crd: self.crd,
        }
    }

    fn string(&mut self, value: &str) {
        self.footprint.string_bytes += value.len() as u64;
        // Writing a str into a Vec cannot fail.
        let _ = serde_json::to_writer(&mut *self.out, value);
    }

    fn number(&mut self, number: impl Into<serde_json::Number>) {
        self.footprint.nodes += 1;
        self.out.extend_from_slice(number.into().to_string().as_bytes());
    }
}

impl<'de> DeserializeSeed<'de> for Transcode<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Transcode<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, value: bool) -> Result<(), E> {
        self.footprint.nodes += 1;
        self.out.extend_from_slice(if value { b"true" } else { b"false" });
        Ok(())
    }

    fn visit_i64<E>(mut self, value: i64) -> Result<(), E> {
        self.number(value);
        Ok(())
    }

    fn visit_u64<E>(mut self, value: u64) -> Result<(), E> {
        self.number(value);
        Ok(())
    }

    fn visit_f64<E: de::Error>(mut self, value: f64) -> Result<(), E> {
        let number = serde_json::Number::from_f64(value).ok_or_else(|| E::custom("a number JSON cannot hold"))?;
        self.number(number);
        Ok(())
    }

    fn visit_str<E>(mut self, value: &str) -> Result<(), E> {
        self.footprint.nodes += 1;
        self.string(value);
        Ok(())
    }

    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        self.footprint.nodes += 1;
        self.out.extend_from_slice(b"null");
        Ok(())
    }

    fn visit_none<E: de::Error>(self) -> Result<(), E> {
        self.visit_unit()
    }

    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }

    fn visit_newtype_struct<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }

    fn visit_seq<A: SeqAccess<'de>>(mut self, mut seq: A) -> Result<(), A::Error> {
        self.footprint.nodes += 1;
        self.out.push(b'[');
        let mut first = true;
        loop {
            let mark = self.out.len();
            if !first {
                self.out.push(b',');
            }
            let at = match self.at {
                Position::Versions => Position::Version,
                _ => Position::Within,
            };
            if seq.next_element_seed(self.at(at))?.is_none() {
                self.out.truncate(mark);
                break;
            }
            first = false;
        }
        self.out.push(b']');
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(mut self, mut map: A) -> Result<(), A::Error> {
        self.footprint.nodes += 1;
        self.out.push(b'{');
        let mut first = true;
        while let Some(key) = map.next_key::<Cow<'de, str>>()? {
            let Some(at) = self.at.of(&key, self.crd) else {
                map.next_value::<de::IgnoredAny>()?;
                continue;
            };
            if !first {
                self.out.push(b',');
            }
            first = false;
            self.string(&key);
            self.out.push(b':');
            let start = self.out.len();
            map.next_value_seed(self.at(at))?;
            if at == Position::Metadata {
                *self.metadata_span = Some(start..self.out.len());
            }
        }
        self.out.push(b'}');
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::core::WatchEvent;
    use serde_json::json;

    use super::*;

    #[test]
    fn an_object_reads_as_its_compact_json_with_its_metadata() {
        let text = br#"{ "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "a", "namespace": "ns", "resourceVersion": "7"},
            "data": {"k": "v \"quoted\" \u00e9", "n": "1"}, "x": [1, -2, 2.5, true, null] }"#;
        let raw = RawObject::<ConfigMap>::from_json(text).unwrap();
        assert_eq!(raw.metadata.name.as_deref(), Some("a"));
        assert_eq!(raw.metadata.resource_version.as_deref(), Some("7"));
        let reread: serde_json::Value = serde_json::from_slice(&raw.json).unwrap();
        let original: serde_json::Value = serde_json::from_slice(text).unwrap();
        assert_eq!(reread, original);
        assert!(raw.json.len() < text.len(), "compact");
        let decoded = raw.decode().unwrap();
        assert_eq!(decoded.data.unwrap()["k"], "v \"quoted\" é");
    }

    #[test]
    fn an_object_loses_its_managed_fields_and_nothing_else() {
        let entry = json!({"manager": "kubectl", "operation": "Update", "fieldsType": "FieldsV1",
            "fieldsV1": {"f:data": {"f:k": {}}}});
        let text = json!({"metadata": {"name": "a", "managedFields": [entry], "labels": {"l": "v"}},
            "data": {"managedFields": "kept"}, "spec": {"metadata": {"managedFields": [1]}}});
        let raw = RawObject::<ConfigMap>::from_json(&serde_json::to_vec(&text).unwrap()).unwrap();
        assert_eq!(raw.metadata.managed_fields, None);
        let reread: serde_json::Value = serde_json::from_slice(&raw.json).unwrap();
        let mut expected = text.clone();
        expected["metadata"].as_object_mut().unwrap().remove("managedFields");
        assert_eq!(reread, expected);
        let only = json!({"metadata": {"managedFields": [entry]}});
        let raw = RawObject::<ConfigMap>::from_json(&serde_json::to_vec(&only).unwrap()).unwrap();
        assert_eq!(raw.json, br#"{"metadata":{}}"#);
    }

    #[test]
    fn a_crd_is_kept_and_measured_without_its_schemas_and_last_applied_copy() {
        use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
        let text = include_str!("../../crds/pools.stackd.dev_clusterpools.yaml");
        let mut crd: serde_json::Value = serde_saphyr::from_str(text).unwrap();
        crd["metadata"]["annotations"] = json!({LAST_APPLIED: text, "kept": "yes"});
        let full = serde_json::to_vec(&crd).unwrap();
        let raw = RawObject::<CustomResourceDefinition>::from_json(&full).unwrap();
        let kept = raw.decode().unwrap();
        assert!(!kept.spec.versions.is_empty());
        assert!(
            kept.spec.versions.iter().all(|v| v.schema.is_none()),
            "no schema is kept"
        );
        let annotations = kept.metadata.annotations.clone().unwrap_or_default();
        assert_eq!(annotations.keys().collect::<Vec<_>>(), ["kept"]);
        assert_eq!(raw.metadata.annotations, kept.metadata.annotations);
        assert_eq!(kept.spec.names.kind, "ClusterPool");
        // Charged what is kept, not what came: within a small factor of the kept copy's JSON.
        let kept_json = serde_json::to_vec(&kept).unwrap().len() as u64;
        let charged = raw.footprint.bytes();
        assert!(
            charged >= kept_json && charged < 10 * kept_json,
            "{charged} for {kept_json}"
        );
        assert!(raw.json.len() * 20 < full.len(), "{} of {}", raw.json.len(), full.len());
        // Another kind keeps fields of those names.
        let other = RawObject::<ConfigMap>::from_json(&full).unwrap();
        assert_eq!(other.json.len(), full.len());
    }

    #[test]
    fn arrays_of_small_numbers_count_a_node_each() {
        let numbers: Vec<u32> = (0..10_000).map(|i| i % 10).collect();
        let body = json!({"metadata": {"name": "big"}, "spec": {"value": numbers}});
        let raw = RawObject::<ConfigMap>::from_json(&serde_json::to_vec(&body).unwrap()).unwrap();
        assert!(raw.footprint.nodes > 10_000, "{:?}", raw.footprint);
        // Two bytes of JSON per number, 32 decoded: the estimate is far above the JSON's size.
        assert!(
            raw.footprint.bytes() > 10 * raw.json.len() as u64,
            "{:?}",
            raw.footprint
        );
    }

    #[test]
    fn a_watch_event_reads_whichever_field_comes_first() {
        let object = json!({"metadata": {"name": "a", "resourceVersion": "3"}, "data": {"k": "v"}});
        for line in [
            format!(r#"{{"type":"ADDED","object":{object}}}"#),
            format!(r#"{{"object":{object},"type":"ADDED"}}"#),
        ] {
            let event: WatchEvent<RawObject<ConfigMap>> = serde_json::from_str(&line).unwrap();
            let WatchEvent::Added(raw) = event else {
                panic!("an added event: {line}");
            };
            assert_eq!(raw.metadata.resource_version.as_deref(), Some("3"));
            assert_eq!(raw.decode().unwrap().data.unwrap()["k"], "v");
        }
    }

    #[test]
    fn a_body_that_is_not_an_object_reads_as_its_json_and_fails_to_decode() {
        let raw = RawObject::<ConfigMap>::from_json(br#"{"metadata": {"name": "a"}, "data": 5}"#).unwrap();
        assert!(raw.decode().is_err());
        assert!(RawObject::<ConfigMap>::from_json(b"[1]").is_err());
    }
}
