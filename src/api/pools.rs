//! `pools.stackd.dev/v1alpha1`: ClusterPool, ClusterDeploymentCustomization, ClusterDeployment and
//! ClusterClaim (DESIGN.md §4.1, failure domains §6).
//!
//! Semantics follow OpenShift Hive's ClusterPool with its inventory as shipped; field names follow
//! Hive where it has them (`clusterPoolRef.clusterDeploymentCustomization`, `installAttemptsLimit`).

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use schemars::{Schema, SchemaGenerator, json_schema};

use super::common::{Condition, DURATION_PATTERN, LocalObjectReference, any_json_schema, conditions_schema};

// ---------------------------------------------------------------------------------------------
// Bounds (DESIGN.md §8, "Blast radius"): every list a controller iterates has a maximum in the
// schema, checked by the controllers too (objects written before the schema had it, or to a server
// that does not validate, get a clear refusal rather than unbounded work).

/// Entries of a pool's `inventory`. Each is looked up, ranked and reported in the pool's status on
/// every pass (about 200 bytes of status each); Hive has no bound, and inventories in use hold tens
/// of entries, one per DNS name or VIP set the pool may use.
pub const MAX_INVENTORY_ENTRIES: usize = 500;
/// Patches of one ClusterDeploymentCustomization. A customization sets one cluster's name, VIPs and
/// networks: a handful of patches; each costs a bounded measurement of the install config.
pub const MAX_INSTALL_CONFIG_PATCHES: usize = 100;
/// Failure domains of a pool (`failureDomains`, `availabilityZones`,
/// `controlPlaneAvailabilityZones`): racks or zones, each weighed for every machine placed.
pub const MAX_FAILURE_DOMAINS: usize = 64;
/// Ports of a failure domain or of the control plane, copied into each machine's record.
pub const MAX_PORTS: usize = 16;
/// Virtual IPs of each kind (`apiVIPs`, `ingressVIPs`): one per IP family.
pub const MAX_VIPS: usize = 8;
/// Control-plane machines of a cluster: OpenShift runs 1, 3, 4 or 5, and etcd is not run with more
/// than 7 members. Each machine is placed and recorded one by one.
pub const MAX_CONTROL_PLANE_REPLICAS: i32 = 7;
/// Hosts of one bare-metal cluster (`spec.hosts`, and the machine records of `status.failureDomains`):
/// every host is a BareMetalAsset the pool assigns, releases and delivers one by one.
pub const MAX_CLUSTER_HOSTS: usize = 500;

/// Labels on the namespace a pool creates for each of its clusters (named after the cluster): the
/// pool's namespace and name. With [`POOL_UID_ANNOTATION`] they prove which pool created a
/// cluster: a namespaced `edit` user can neither create a namespace nor change its metadata.
pub const POOL_NAMESPACE_LABEL: &str = "pools.stackd.dev/clusterpool-namespace";
pub const POOL_NAME_LABEL: &str = "pools.stackd.dev/clusterpool-name";
/// Annotation on a pool cluster's namespace, set when the pool creates it: the pool's uid.
pub const POOL_UID_ANNOTATION: &str = "pools.stackd.dev/clusterpool-uid";

/// A set of zone names, bounded like the failure domains they become.
fn zones_schema(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "array",
        "items": { "type": "string" },
        "maxItems": MAX_FAILURE_DOMAINS,
        "x-kubernetes-list-type": "set",
    })
}

// ---------------------------------------------------------------------------------------------
// ClusterPool

/// Desired state of a ClusterPool.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "pools.stackd.dev",
    version = "v1alpha1",
    kind = "ClusterPool",
    namespaced,
    derive = "PartialEq",
    status = "ClusterPoolStatus",
    shortname = "cp",
    category = "stackd",
    scale(spec_replicas_path = ".spec.size", status_replicas_path = ".status.size"),
    doc = "ClusterPool keeps a number of ready, unclaimed clusters; with an inventory each cluster is built from one ClusterDeploymentCustomization.",
    printcolumn(name = "Size", type_ = "integer", json_path = ".spec.size"),
    printcolumn(name = "Standby", type_ = "integer", json_path = ".status.standby"),
    printcolumn(name = "Ready", type_ = "integer", json_path = ".status.ready"),
    printcolumn(name = "Platform", type_ = "string", json_path = ".status.platform", priority = 1),
    printcolumn(name = "BaseDomain", type_ = "string", json_path = ".spec.baseDomain"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
pub struct ClusterPoolSpec {
    /// Number of unclaimed clusters to keep, installing or ready.
    #[schemars(range(min = 0))]
    pub size: i32,
    /// Upper bound on unclaimed plus claimed clusters. Unset means no bound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub max_size: Option<i32>,
    /// Upper bound on clusters installing or being deleted at once. Unset means no bound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub max_concurrent: Option<i32>,
    /// DNS domain the clusters' names are joined to, e.g. `pools.example.com`.
    #[schemars(length(min = 1))]
    pub base_domain: String,
    /// Where clusters are installed: exactly one of `vsphere`, `openstack` or `baremetal`.
    pub platform: Platform,
    /// Secret in this namespace with the image pull secret (key `.dockerconfigjson`) given to the installer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pull_secret_ref: Option<LocalObjectReference>,
    /// Secret in this namespace whose key `install-config.yaml` is the template every cluster's install
    /// config starts from. stackd sets `metadata.name`, `baseDomain` and the platform fields on it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub install_config_secret_template_ref: Option<LocalObjectReference>,
    /// Image of the installer the install and destroy Jobs run.
    #[schemars(length(min = 1))]
    pub installer_image: String,
    /// Failed installs of one cluster before it is declared broken and replaced. Default 3.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub install_attempts_limit: Option<i32>,
    /// Labels added to every ClusterDeployment of the pool.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Annotations added to every ClusterDeployment of the pool.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    /// How long a claim may keep its cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim_lifetime: Option<ClaimLifetime>,
    /// ClusterDeploymentCustomizations in this namespace to build clusters from: a list of entries
    /// naming them, as Hive ships it. Each cluster leases one entry; the pool never has more
    /// clusters than it can lease entries. At least one entry (leave the field out for a pool
    /// without an inventory). Write
    ///
    /// ```yaml
    /// inventory:
    /// - name: foo-cluster-deployment-customization
    /// - name: bar-cluster-deployment-customization
    /// ```
    ///
    /// not the design document's `inventory: {ClusterDeploymentCustomizations: [...]}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = MAX_INVENTORY_ENTRIES),
        extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"])
    )]
    pub inventory: Option<Vec<InventoryEntry>>,
    /// Failure domains defined explicitly. They add to the zones discovered from `availabilityZones`
    /// and from the pool's BareMetalAssets, and override a discovered zone of the same name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        length(max = MAX_FAILURE_DOMAINS),
        extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"])
    )]
    pub failure_domains: Vec<FailureDomainDefinition>,
    /// Availability zones clusters may use; each becomes a discovered failure domain.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "zones_schema")]
    pub availability_zones: Vec<String>,
    /// When not empty, only these discovered zones may hold control-plane machines (this overrides
    /// `controlPlaneOmitAvailabilityZone`). Explicit failure domains are not affected.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "zones_schema")]
    pub control_plane_availability_zones: Vec<String>,
    /// When true, discovered zones hold no control-plane machines unless listed in
    /// `controlPlaneAvailabilityZones`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_plane_omit_availability_zone: Option<bool>,
    /// Control-plane machines of every cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_plane: Option<ControlPlaneMachines>,
    /// Compute (worker) machines of every cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute: Option<ComputeMachines>,
    /// Selects the BareMetalAssets (in this namespace) a `baremetal` pool may use as hosts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_selector: Option<LabelSelector>,
}

/// Where clusters are installed. Set exactly one field.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("minProperties" = 1, "maxProperties" = 1))]
pub struct Platform {
    /// VMware vSphere.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vsphere: Option<VSpherePlatform>,
    /// OpenStack.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub openstack: Option<OpenStackPlatform>,
    /// Bare-metal hosts from the BareMetalAsset inventory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baremetal: Option<BareMetalPlatform>,
}

impl Platform {
    /// The name of the platform that is set, if exactly one is.
    pub fn name(&self) -> Option<&'static str> {
        match (&self.vsphere, &self.openstack, &self.baremetal) {
            (Some(_), None, None) => Some("vsphere"),
            (None, Some(_), None) => Some("openstack"),
            (None, None, Some(_)) => Some("baremetal"),
            _ => None,
        }
    }
}

/// vSphere settings written into the install config.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VSpherePlatform {
    /// Secret in the pool's namespace with keys `username` and `password` for vCenter.
    pub credentials_secret_ref: LocalObjectReference,
    /// Secret with the vCenter CA bundle (key `.cacert`), if vCenter's certificate is not publicly trusted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub certificates_secret_ref: Option<LocalObjectReference>,
    /// vCenter host name.
    #[serde(rename = "vCenter")]
    #[schemars(length(min = 1))]
    pub v_center: String,
    /// Datacenter clusters are installed in.
    #[schemars(length(min = 1))]
    pub datacenter: String,
    /// Default datastore for virtual machine disks.
    #[schemars(length(min = 1))]
    pub default_datastore: String,
    /// vSphere cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster: Option<String>,
    /// Folder the virtual machines go in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub folder: Option<String>,
    /// Network the virtual machines attach to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<String>,
}

/// OpenStack settings written into the install config.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct OpenStackPlatform {
    /// Secret in the pool's namespace with key `clouds.yaml`.
    pub credentials_secret_ref: LocalObjectReference,
    /// Entry of `clouds.yaml` to use.
    #[schemars(length(min = 1))]
    pub cloud: String,
    /// Network with external connectivity for floating IPs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external_network: Option<String>,
    /// Flavor of compute machines.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_flavor: Option<String>,
    /// Whether the cloud supports trunk ports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trunk_support: Option<bool>,
}

/// Bare-metal settings written into the install config; hosts come from BareMetalAssets.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BareMetalPlatform {
    /// Secret in the pool's namespace the installer uses to reach the provisioning host
    /// (e.g. key `ssh-privatekey`).
    pub credentials_secret_ref: LocalObjectReference,
    /// Virtual IPs of the API server.
    #[serde(default, skip_serializing_if = "Vec::is_empty", rename = "apiVIPs")]
    #[schemars(length(max = MAX_VIPS))]
    pub api_vips: Vec<String>,
    /// Virtual IPs of the ingress routers.
    #[serde(default, skip_serializing_if = "Vec::is_empty", rename = "ingressVIPs")]
    #[schemars(length(max = MAX_VIPS))]
    pub ingress_vips: Vec<String>,
    /// How the provisioning network is run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provisioning_network: Option<ProvisioningNetwork>,
}

/// How the bare-metal provisioning network is run.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum ProvisioningNetwork {
    Managed,
    Unmanaged,
    Disabled,
}

/// Claim lifetimes, as Go durations (e.g. `8h`, `90m`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClaimLifetime {
    /// Lifetime of a claim that sets none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = DURATION_PATTERN), length(max = 32))]
    pub default: Option<String>,
    /// Longest lifetime any claim gets, whatever it asks for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = DURATION_PATTERN), length(max = 32))]
    pub maximum: Option<String>,
}

/// One entry of a pool's inventory, e.g. `{name: foo-cluster-deployment-customization}`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct InventoryEntry {
    /// Kind of the inventory object; only ClusterDeploymentCustomization exists today.
    #[serde(default)]
    pub kind: InventoryKind,
    /// Name of the ClusterDeploymentCustomization in the pool's namespace.
    #[schemars(length(min = 1))]
    pub name: String,
}

/// Kinds an inventory entry can name.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum InventoryKind {
    #[default]
    ClusterDeploymentCustomization,
}

/// A failure domain defined on the pool (CAPO's definition).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FailureDomainDefinition {
    /// Name of the failure domain.
    #[schemars(length(min = 1))]
    pub name: String,
    /// Which machines may be placed here: `All` (default; control-plane machines are spread over such
    /// domains) or `NoControlPlane`.
    #[serde(default)]
    pub machine_placement: MachinePlacement,
    /// Compute availability zone of machines in this domain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_availability_zone: Option<String>,
    /// Storage availability zone of root volumes in this domain. Ignored for machines without a root
    /// volume; an error together with an explicit `controlPlane.rootVolume.availabilityZone`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage_availability_zone: Option<String>,
    /// Ports of machines in this domain; they come before the pool's `controlPlane.ports`. The
    /// install config gets them as openshift-install's `failureDomains[].portTargets` (a port
    /// tagged `control_plane` replaces the machine's primary network), which openshift-install
    /// takes only with `featureSet: TechPreviewNoUpgrade`: stackd sets it when the install-config
    /// template sets none (such clusters cannot be upgraded), and a template with another feature
    /// set makes the pool create no clusters.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_PORTS))]
    pub ports: Vec<PortOpts>,
}

/// Which machines a failure domain accepts.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum MachinePlacement {
    #[default]
    All,
    NoControlPlane,
}

/// A network port of a machine.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PortOpts {
    /// Network of the port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<ResourceFilter>,
    /// Description of the port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// Fixed IPs of the port.
    #[serde(default, skip_serializing_if = "Vec::is_empty", rename = "fixedIPs")]
    pub fixed_ips: Vec<FixedIp>,
    /// Tags set on the port.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<String>,
    /// Security groups of the port, by name or ID.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub security_groups: Vec<String>,
}

/// A fixed IP of a port.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FixedIp {
    /// Subnet the address comes from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subnet: Option<ResourceFilter>,
    /// A specific address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip_address: Option<String>,
}

/// Selects a cloud resource by name or ID.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ResourceFilter {
    /// Name of the resource.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// ID of the resource.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
}

/// Control-plane machines of each cluster.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ControlPlaneMachines {
    /// Number of control-plane machines. Default 3, at most 7.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = MAX_CONTROL_PLANE_REPLICAS))]
    pub replicas: Option<i32>,
    /// Root volume of control-plane machines (OpenStack).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub root_volume: Option<RootVolume>,
    /// Ports of every control-plane machine, after its failure domain's ports (rendered as the
    /// domain's are).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_PORTS))]
    pub ports: Vec<PortOpts>,
}

/// A machine's root volume.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RootVolume {
    /// Size in GiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub size: Option<i32>,
    /// Volume type.
    #[serde(default, skip_serializing_if = "Option::is_none", rename = "type")]
    pub volume_type: Option<String>,
    /// Storage availability zone. Must not be set when a failure domain control-plane machines
    /// go to sets a storage zone (the pool then creates no clusters and says so). Unset, a root
    /// volume goes to its domain's storage zone, else to its machine's compute zone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub availability_zone: Option<String>,
}

/// Compute machines of each cluster.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ComputeMachines {
    /// Number of compute machines. Default 3 (0 on bare metal unless assets are available).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub replicas: Option<i32>,
}

/// Observed state of a ClusterPool.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClusterPoolStatus {
    /// Unclaimed clusters, installing or ready.
    #[serde(default)]
    pub size: i32,
    /// Unclaimed clusters still installing.
    #[serde(default)]
    pub standby: i32,
    /// Unclaimed clusters installed and ready to be claimed.
    #[serde(default)]
    pub ready: i32,
    /// The platform in use, for display.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub platform: Option<String>,
    /// `InventoryValid` (with an inventory), `CapacityAvailable`, `AllClustersCurrent`,
    /// `MissingDependencies`, `DeletionPossible`, `FailureDomainsValid` (OpenStack pools with
    /// failure domains), `FailureDomainsUnsupported` (vSphere pools).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
    /// One entry per inventory entry: what the pool knows about it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        length(max = MAX_INVENTORY_ENTRIES),
        extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"])
    )]
    pub inventory: Vec<InventoryEntryStatus>,
    /// Failure domains in effect, by name.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub failure_domains: BTreeMap<String, FailureDomainStatus>,
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// What the pool knows about one inventory entry.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct InventoryEntryStatus {
    /// Name of the ClusterDeploymentCustomization.
    pub name: String,
    /// The ClusterDeploymentCustomization's `metadata.generation` last applied to a cluster;
    /// the new generation once it is edited while no cluster holds it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<i64>,
    /// State of the entry.
    pub status: InventoryEntryState,
    /// Failed installs since the entry's last success or edit.
    #[serde(default)]
    pub attempts: i32,
    /// The ClusterDeployment built from this entry, while it exists.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_deployment: Option<String>,
}

/// State of an inventory entry.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, JsonSchema)]
pub enum InventoryEntryState {
    /// Free to be leased.
    #[default]
    Available,
    /// Leased by one of this pool's clusters.
    Reserved,
    /// Its patches do not apply to the install config.
    BrokenBySyntax,
    /// Clusters built from it failed to install; retried after a backoff.
    BrokenByCloud,
    /// The ClusterDeploymentCustomization does not exist.
    Missing,
    /// The ClusterDeploymentCustomization is being deleted (a finalizer still holds it): no
    /// cluster is built from it again.
    Deleting,
    /// Leased by another pool, or holding an interrupted lease (`Available=False` without a
    /// `clusterDeploymentRef`) until it is released after `--lease-min-age`.
    Unavailable,
    /// Removed from the inventory; its cluster is replaced.
    ToBeDeleted,
    /// Its patches changed while leased; its unclaimed cluster is replaced.
    ToBeUpdated,
}

/// A failure domain in effect for a pool.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FailureDomainStatus {
    /// Whether control-plane machines may be placed here.
    pub control_plane: bool,
    /// `AvailabilityZone` (discovered) or `Cluster` (defined in the pool's `failureDomains`).
    #[serde(rename = "type")]
    pub domain_type: FailureDomainType,
}

/// Where a failure domain came from.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum FailureDomainType {
    #[default]
    AvailabilityZone,
    Cluster,
}

// ---------------------------------------------------------------------------------------------
// ClusterDeploymentCustomization

/// Desired state of a ClusterDeploymentCustomization.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "pools.stackd.dev",
    version = "v1alpha1",
    kind = "ClusterDeploymentCustomization",
    namespaced,
    derive = "PartialEq",
    status = "ClusterDeploymentCustomizationStatus",
    shortname = "cdc",
    category = "stackd",
    doc = "ClusterDeploymentCustomization holds RFC 6902 patches applied to the install config of the one cluster that leases it.",
    printcolumn(
        name = "Available",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Available\")].status"
    ),
    printcolumn(
        name = "Applied",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"ApplySucceeded\")].reason"
    ),
    printcolumn(
        name = "ClusterDeployment",
        type_ = "string",
        json_path = ".status.clusterDeploymentRef.name"
    ),
    printcolumn(
        name = "Pool",
        type_ = "string",
        json_path = ".status.clusterPoolRef.name",
        priority = 1
    ),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
pub struct ClusterDeploymentCustomizationSpec {
    /// RFC 6902 patches applied in order to the install config generated by the pool: at most
    /// 100, and the config they produce may not grow past 1 MiB (as JSON) or nest deeper than 64
    /// levels. Paths are JSON pointers starting with `/`; to name a cluster `foo`, write
    ///
    /// ```yaml
    /// installConfigPatches:
    /// - op: replace
    ///   path: /metadata/name
    ///   value: foo
    /// ```
    ///
    /// (the design document's `path: metadata/name` is refused).
    #[serde(default)]
    #[schemars(length(max = MAX_INSTALL_CONFIG_PATCHES))]
    pub install_config_patches: Vec<PatchEntity>,
}

/// One RFC 6902 JSON patch operation.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PatchEntity {
    /// The operation: add, remove, replace, move, copy or test.
    pub op: PatchOp,
    /// JSON pointer to the target, starting with `/`: write `/metadata/name`, not `metadata/name`
    /// (e.g. `{op: replace, path: /metadata/name, value: foo}`).
    #[schemars(regex(pattern = r"^/"))]
    pub path: String,
    /// JSON pointer to the source of a move or copy, starting with `/`: write `/metadata/name`,
    /// not `metadata/name`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^/"))]
    pub from: Option<String>,
    /// The value for add, replace and test: any JSON value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_json_schema")]
    pub value: Option<serde_json::Value>,
}

/// RFC 6902 operations.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum PatchOp {
    #[default]
    Add,
    Remove,
    Replace,
    Move,
    Copy,
    Test,
}

/// Observed state of a ClusterDeploymentCustomization.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClusterDeploymentCustomizationStatus {
    /// The ClusterDeployment holding the lease (its namespace has the same name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_deployment_ref: Option<LocalObjectReference>,
    /// The ClusterPool holding the lease.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_pool_ref: Option<LocalObjectReference>,
    /// JSON of the spec applied by the lease holder.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_applied_configuration: Option<String>,
    /// `Available` (True while no pool holds it, once a pool lists it; False with reason Reserved
    /// while leased, so `kubectl wait --for=condition=Available` waits for it to be free) and
    /// `ApplySucceeded` (Succeeded, InstallationPending, BrokenBySyntax or BrokenByCloud).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
}

// ---------------------------------------------------------------------------------------------
// ClusterDeployment

/// Desired state of a ClusterDeployment.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "pools.stackd.dev",
    version = "v1alpha1",
    kind = "ClusterDeployment",
    namespaced,
    derive = "PartialEq",
    status = "ClusterDeploymentStatus",
    shortname = "cd",
    category = "stackd",
    doc = "ClusterDeployment is one cluster, provisioned by an installer Job on the host cluster.",
    printcolumn(name = "Pool", type_ = "string", json_path = ".spec.clusterPoolRef.poolName"),
    printcolumn(name = "Claim", type_ = "string", json_path = ".spec.clusterPoolRef.claimName"),
    printcolumn(name = "Installed", type_ = "boolean", json_path = ".status.installed"),
    printcolumn(
        name = "Provisioned",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Provisioned\")].reason"
    ),
    printcolumn(name = "InfraID", type_ = "string", json_path = ".status.infraID", priority = 1),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
pub struct ClusterDeploymentSpec {
    /// Name of the cluster, the first label of its DNS names.
    #[schemars(length(min = 1))]
    pub cluster_name: String,
    /// DNS domain of the cluster.
    #[schemars(length(min = 1))]
    pub base_domain: String,
    /// Where the cluster is installed.
    pub platform: Platform,
    /// Secret in this namespace with the image pull secret.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pull_secret_ref: Option<LocalObjectReference>,
    /// How to install the cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provisioning: Option<Provisioning>,
    /// Failed installs before the cluster stops retrying. Default 3.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub install_attempts_limit: Option<i32>,
    /// The pool this cluster belongs to; set by the pool and immutable once set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_pool_ref: Option<ClusterPoolReference>,
    /// Bare-metal hosts of the cluster, assigned from BareMetalAssets.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        length(max = MAX_CLUSTER_HOSTS),
        extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"])
    )]
    pub hosts: Vec<ClusterHost>,
}

/// Install inputs of a cluster.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Provisioning {
    /// Secret in this namespace with the rendered `install-config.yaml`.
    pub install_config_secret_ref: LocalObjectReference,
    /// Image of the installer.
    #[schemars(length(min = 1))]
    pub installer_image: String,
}

/// Links a ClusterDeployment to its pool and claim.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClusterPoolReference {
    /// Namespace of the pool.
    pub namespace: String,
    /// Name of the pool.
    pub pool_name: String,
    /// Name of the claim holding this cluster, once claimed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim_name: Option<String>,
    /// When the cluster was claimed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claimed_timestamp: Option<Time>,
    /// The ClusterDeploymentCustomization (in the pool's namespace) this cluster was built from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_deployment_customization: Option<LocalObjectReference>,
}

/// A bare-metal host of a cluster.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClusterHost {
    /// Name of the BareMetalAsset (and of the BareMetalHost on the cluster).
    pub name: String,
    /// Role of the host in the cluster.
    pub role: HostRole,
    /// Failure domain the host is in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_domain: Option<String>,
}

/// Role of a machine in a cluster.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum HostRole {
    #[default]
    Master,
    Worker,
}

/// Observed state of a ClusterDeployment.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClusterDeploymentStatus {
    /// True once the installer succeeded.
    #[serde(default)]
    pub installed: bool,
    /// Failed installs so far.
    #[serde(default)]
    pub install_restarts: i32,
    /// Secret in this namespace with the cluster's admin kubeconfig (key `kubeconfig`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admin_kubeconfig_secret_ref: Option<LocalObjectReference>,
    /// Infrastructure ID the installer reported.
    #[serde(default, skip_serializing_if = "Option::is_none", rename = "infraID")]
    pub infra_id: Option<String>,
    /// Failure domain of each machine, recorded once when the cluster is created and never changed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        length(max = MAX_CLUSTER_HOSTS),
        extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["machine"])
    )]
    pub failure_domains: Vec<MachineFailureDomain>,
    /// `Provisioned`, `ProvisionStopped` and others.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
}

/// The failure domain a machine was placed in.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MachineFailureDomain {
    /// Machine name, e.g. `master-0`.
    pub machine: String,
    /// Role of the machine.
    pub role: HostRole,
    /// Name of the failure domain.
    pub name: String,
    /// Compute availability zone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_availability_zone: Option<String>,
    /// Storage availability zone of the root volume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage_availability_zone: Option<String>,
    /// Ports of the machine: the domain's first, then the pool's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 2 * MAX_PORTS))]
    pub ports: Vec<PortOpts>,
}

// ---------------------------------------------------------------------------------------------
// ClusterClaim

/// Desired state of a ClusterClaim.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "pools.stackd.dev",
    version = "v1alpha1",
    kind = "ClusterClaim",
    namespaced,
    derive = "PartialEq",
    status = "ClusterClaimStatus",
    category = "stackd",
    doc = "ClusterClaim takes one ready cluster from a ClusterPool in the same namespace.",
    printcolumn(name = "Pool", type_ = "string", json_path = ".spec.clusterPoolName"),
    printcolumn(
        name = "Pending",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Pending\")].reason"
    ),
    printcolumn(name = "ClusterNamespace", type_ = "string", json_path = ".status.namespace"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
pub struct ClusterClaimSpec {
    /// The ClusterPool in this namespace to claim from.
    #[schemars(length(min = 1))]
    pub cluster_pool_name: String,
    /// How long to keep the cluster (a Go duration such as `8h`), capped by the pool's
    /// `claimLifetime.maximum`. The claim and its cluster are deleted afterwards.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = DURATION_PATTERN), length(max = 32))]
    pub lifetime: Option<String>,
}

/// Observed state of a ClusterClaim.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClusterClaimStatus {
    /// Namespace of the ClusterDeployment assigned to this claim.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// The lifetime in effect, after the pool's default and maximum.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lifetime: Option<String>,
    /// `Pending` is True until a cluster is assigned and ready.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
}
