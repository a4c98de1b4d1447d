//! `inventory.stackd.dev/v1alpha1`: BareMetalAsset (DESIGN.md §5), a host inventory that baremetal
//! pools draw hosts from by role.

use k8s_openapi::api::core::v1::ObjectReference;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::common::{Condition, conditions_schema};

/// Anchored pattern for a MAC address such as `00:1B:44:11:3A:B7`.
pub const MAC_ADDRESS_PATTERN: &str = "^[0-9a-fA-F]{2}(:[0-9a-fA-F]{2}){5}$";

/// Desired state of a BareMetalAsset.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "inventory.stackd.dev",
    version = "v1alpha1",
    kind = "BareMetalAsset",
    namespaced,
    derive = "PartialEq",
    status = "BareMetalAssetStatus",
    shortname = "bma",
    category = "stackd",
    doc = "BareMetalAsset is one physical host in the inventory; assigned to a cluster it is delivered there as a BareMetalHost of the same name.",
    printcolumn(name = "Role", type_ = "string", json_path = ".spec.role"),
    printcolumn(name = "Cluster", type_ = "string", json_path = ".spec.clusterName"),
    printcolumn(name = "FailureDomain", type_ = "string", json_path = ".spec.failureDomain"),
    printcolumn(
        name = "Credentials",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"CredentialsFound\")].status",
        priority = 1
    ),
    printcolumn(
        name = "HostCreated",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"HostCreated\")].status"
    ),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
pub struct BareMetalAssetSpec {
    /// How to reach the host's baseboard management controller.
    pub bmc: BmcDetails,
    /// MAC address of the NIC the host boots from, e.g. `00:1B:44:11:3A:B7`.
    #[serde(rename = "bootMACAddress")]
    #[schemars(regex(pattern = MAC_ADDRESS_PATTERN))]
    pub boot_mac_address: String,
    /// Hardware profile name passed on to the BareMetalHost.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hardware_profile: Option<String>,
    /// Role the host may fill: `master`, `worker`, or empty/omitted for either. A host with a role
    /// is never used for the other role.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<AssetRole>,
    /// The ClusterDeployment (its name, which is also its namespace) the host is assigned to; empty
    /// means unassigned. Setting it to "" removes the host from its cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_name: Option<String>,
    /// Failure domain (e.g. rack or zone) the host is in; pools spread control planes over these.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_domain: Option<String>,
}

impl BareMetalAssetSpec {
    /// The assigned cluster, treating "" as unassigned.
    pub fn assigned_cluster(&self) -> Option<&str> {
        self.cluster_name.as_deref().filter(|name| !name.is_empty())
    }
}

/// The baseboard management controller of a host.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BmcDetails {
    /// BMC URL, e.g. `ipmi://192.168.122.1:6233` or `redfish://10.0.0.5/redfish/v1/Systems/1`.
    #[schemars(length(min = 1))]
    pub address: String,
    /// Secret in this namespace with keys `username` and `password`.
    #[schemars(length(min = 1))]
    pub credentials_name: String,
}

/// The role a host may fill; `""` means either.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, JsonSchema)]
pub enum AssetRole {
    #[serde(rename = "master")]
    Master,
    #[serde(rename = "worker")]
    Worker,
    #[default]
    #[serde(rename = "")]
    Unspecified,
}

/// Observed state of a BareMetalAsset.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BareMetalAssetStatus {
    /// `CredentialsFound`, `ClusterDeploymentFound`, `HostProvisioningInProgress`, `HostCreated`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
    /// Objects related to this asset: its credentials Secret and its BareMetalHost.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub related_objects: Vec<ObjectReference>,
}
