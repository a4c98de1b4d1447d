//! Schema pieces shared by every API group.

use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Serialize};

pub use k8s_openapi::api::core::v1::LocalObjectReference;
pub use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;

/// Go duration syntax as `metav1.Duration` accepts it, e.g. `90m`, `1h30m`, `8h`.
pub const DURATION_PATTERN: &str = r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$";

/// A reference to an object stackd created in the tenant's namespace on the host cluster.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HostObjectRef {
    /// Namespace on the host cluster (the tenant's host namespace).
    pub namespace: String,
    /// Name of the object on the host cluster.
    pub name: String,
}

/// Schema for `status.conditions`: a list of `metav1.Condition` keyed by `type`.
pub fn conditions_schema(generator: &mut SchemaGenerator) -> Schema {
    let item = generator.subschema_for::<Condition>();
    json_schema!({
        "type": "array",
        "description": "Conditions describe the latest observations of the object's state; each `type` appears once.",
        "items": item,
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["type"],
    })
}

/// Schema for a value of any JSON type, kept as written (`x-kubernetes-preserve-unknown-fields`).
pub fn any_json_schema(_: &mut SchemaGenerator) -> Schema {
    json_schema!({ "x-kubernetes-preserve-unknown-fields": true })
}

/// Schema for an object whose fields are validated by the controller, not by the API server.
pub fn free_form_object_schema(_: &mut SchemaGenerator) -> Schema {
    json_schema!({ "type": "object", "x-kubernetes-preserve-unknown-fields": true })
}

/// Schema for a list of strings treated as a set.
pub fn string_set_schema(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "array",
        "items": { "type": "string" },
        "x-kubernetes-list-type": "set",
    })
}
