//! The resource table (built-in kinds plus every served CRD version) and the legacy discovery
//! documents built from it.

use std::collections::BTreeMap;
use std::sync::{Arc, LazyLock, Mutex};

use serde_json::{Value, json};

use super::convert;
use super::store::{GroupResource, Store};

/// Where CustomResourceDefinitions are stored.
pub fn crd_resource() -> GroupResource {
    GroupResource::new("apiextensions.k8s.io", "customresourcedefinitions")
}

/// Where a scale subresource finds its numbers (JSON paths like `.spec.replicas`).
#[derive(Debug, Clone, PartialEq)]
pub struct ScalePaths {
    pub spec_replicas: String,
    pub status_replicas: String,
    pub label_selector: Option<String>,
}

/// Everything the request pipeline needs to know about one resource in one version.
#[derive(Debug, Clone)]
pub struct ResourceInfo {
    pub group: String,
    pub version: String,
    pub plural: String,
    pub singular: String,
    pub kind: String,
    pub namespaced: bool,
    pub short_names: Vec<String>,
    pub categories: Vec<String>,
    pub status_subresource: bool,
    pub scale: Option<ScalePaths>,
    pub log_subresource: bool,
    /// Kinds whose `metadata.generation` tracks spec changes.
    pub tracks_generation: bool,
    /// The CRD version's `openAPIV3Schema`, for custom resources.
    pub schema: Option<Arc<Value>>,
}

impl ResourceInfo {
    pub fn storage_key(&self) -> GroupResource {
        convert::storage_key(&self.group, &self.plural)
    }

    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.clone()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    fn verbs(&self) -> Vec<&'static str> {
        let mut verbs = vec!["create", "delete", "get", "list", "patch", "update", "watch"];
        if self.plural != "namespaces" {
            verbs.insert(1, "deletecollection");
        }
        verbs
    }

    fn discovery_entries(&self) -> Vec<Value> {
        let mut main = json!({
            "name": self.plural,
            "singularName": self.singular,
            "namespaced": self.namespaced,
            "kind": self.kind,
            "verbs": self.verbs(),
        });
        if !self.short_names.is_empty() {
            main["shortNames"] = json!(self.short_names);
        }
        if !self.categories.is_empty() {
            main["categories"] = json!(self.categories);
        }
        let mut entries = vec![main];
        let sub = |name: &str, kind: &str, verbs: &[&str]| {
            json!({
                "name": format!("{}/{name}", self.plural),
                "singularName": "",
                "namespaced": self.namespaced,
                "kind": kind,
                "verbs": verbs,
            })
        };
        if self.status_subresource {
            entries.push(sub("status", &self.kind, &["get", "patch", "update"]));
        }
        if self.scale.is_some() {
            let mut scale = sub("scale", "Scale", &["get", "patch", "update"]);
            scale["group"] = json!("autoscaling");
            scale["version"] = json!("v1");
            entries.push(scale);
        }
        if self.log_subresource {
            entries.push(sub("log", &self.kind, &["get"]));
        }
        entries
    }
}

struct Builtin {
    group: &'static str,
    version: &'static str,
    plural: &'static str,
    kind: &'static str,
    namespaced: bool,
    short_names: &'static [&'static str],
    all_category: bool,
    status: bool,
    scale: bool,
    generation: bool,
}

const fn builtin(
    group: &'static str,
    version: &'static str,
    plural: &'static str,
    kind: &'static str,
    namespaced: bool,
    short_names: &'static [&'static str],
) -> Builtin {
    Builtin {
        group,
        version,
        plural,
        kind,
        namespaced,
        short_names,
        all_category: false,
        status: false,
        scale: false,
        generation: false,
    }
}

impl Builtin {
    const fn in_all(mut self) -> Self {
        self.all_category = true;
        self
    }
    const fn with_status(mut self) -> Self {
        self.status = true;
        self
    }
    const fn with_scale(mut self) -> Self {
        self.scale = true;
        self
    }
    const fn with_generation(mut self) -> Self {
        self.generation = true;
        self
    }
}

const BUILTINS: &[Builtin] = &[
    builtin("", "v1", "namespaces", "Namespace", false, &["ns"]).with_status(),
    builtin("", "v1", "configmaps", "ConfigMap", true, &["cm"]),
    builtin("", "v1", "secrets", "Secret", true, &[]),
    builtin("", "v1", "serviceaccounts", "ServiceAccount", true, &["sa"]),
    builtin("", "v1", "resourcequotas", "ResourceQuota", true, &["quota"]).with_status(),
    builtin("", "v1", "limitranges", "LimitRange", true, &["limits"]),
    builtin("", "v1", "services", "Service", true, &["svc"])
        .in_all()
        .with_status(),
    builtin("", "v1", "pods", "Pod", true, &["po"]).in_all().with_status(),
    builtin("", "v1", "events", "Event", true, &["ev"]),
    builtin("events.k8s.io", "v1", "events", "Event", true, &["ev"]),
    builtin("batch", "v1", "jobs", "Job", true, &[])
        .in_all()
        .with_status()
        .with_generation(),
    builtin("apps", "v1", "deployments", "Deployment", true, &["deploy"])
        .in_all()
        .with_status()
        .with_scale()
        .with_generation(),
    builtin("apps", "v1", "replicasets", "ReplicaSet", true, &["rs"])
        .in_all()
        .with_status()
        .with_scale()
        .with_generation(),
    builtin("rbac.authorization.k8s.io", "v1", "roles", "Role", true, &[]),
    builtin(
        "rbac.authorization.k8s.io",
        "v1",
        "rolebindings",
        "RoleBinding",
        true,
        &[],
    ),
    builtin(
        "rbac.authorization.k8s.io",
        "v1",
        "clusterroles",
        "ClusterRole",
        false,
        &[],
    ),
    builtin(
        "rbac.authorization.k8s.io",
        "v1",
        "clusterrolebindings",
        "ClusterRoleBinding",
        false,
        &[],
    ),
    builtin(
        "apiextensions.k8s.io",
        "v1",
        "customresourcedefinitions",
        "CustomResourceDefinition",
        false,
        &["crd", "crds"],
    )
    .with_status()
    .with_generation(),
    builtin("coordination.k8s.io", "v1", "leases", "Lease", true, &[]),
    builtin(
        "networking.k8s.io",
        "v1",
        "networkpolicies",
        "NetworkPolicy",
        true,
        &["netpol"],
    )
    .with_generation(),
];

fn builtin_info(b: &Builtin) -> ResourceInfo {
    let scale = b.scale.then(|| ScalePaths {
        spec_replicas: ".spec.replicas".into(),
        status_replicas: ".status.replicas".into(),
        label_selector: None,
    });
    ResourceInfo {
        group: b.group.into(),
        version: b.version.into(),
        plural: b.plural.into(),
        singular: b.kind.to_lowercase(),
        kind: b.kind.into(),
        namespaced: b.namespaced,
        short_names: b.short_names.iter().map(|s| s.to_string()).collect(),
        categories: if b.all_category { vec!["all".into()] } else { vec![] },
        status_subresource: b.status,
        scale,
        log_subresource: b.plural == "pods",
        tracks_generation: b.generation,
        schema: None,
    }
}

fn strings(value: &Value) -> Vec<String> {
    value
        .as_array()
        .map(|a| a.iter().filter_map(|s| s.as_str().map(String::from)).collect())
        .unwrap_or_default()
}

/// The served versions of one CRD object, as resource infos.
pub fn crd_resources(crd: &Value) -> Vec<ResourceInfo> {
    let spec = &crd["spec"];
    let names = &spec["names"];
    let (Some(group), Some(plural), Some(kind)) =
        (spec["group"].as_str(), names["plural"].as_str(), names["kind"].as_str())
    else {
        return Vec::new();
    };
    let versions = spec["versions"].as_array().cloned().unwrap_or_default();
    versions
        .iter()
        .filter(|v| v["served"].as_bool().unwrap_or(false))
        .filter_map(|v| {
            let subresources = &v["subresources"];
            let scale = subresources.get("scale").map(|s| ScalePaths {
                spec_replicas: s["specReplicasPath"].as_str().unwrap_or(".spec.replicas").into(),
                status_replicas: s["statusReplicasPath"].as_str().unwrap_or(".status.replicas").into(),
                label_selector: s["labelSelectorPath"].as_str().map(String::from),
            });
            let schema = v["schema"].get("openAPIV3Schema").cloned().map(Arc::new);
            Some(ResourceInfo {
                group: group.into(),
                version: v["name"].as_str()?.into(),
                plural: plural.into(),
                singular: names["singular"]
                    .as_str()
                    .map_or_else(|| kind.to_lowercase(), String::from),
                kind: kind.into(),
                namespaced: spec["scope"].as_str() != Some("Cluster"),
                short_names: strings(&names["shortNames"]),
                categories: strings(&names["categories"]),
                status_subresource: subresources.get("status").is_some(),
                scale,
                log_subresource: false,
                tracks_generation: true,
                schema,
            })
        })
        .collect()
}

static VERSION: LazyLock<regex::Regex> =
    LazyLock::new(|| regex::Regex::new(r"^v(\d+)(?:(alpha|beta)(\d+))?$").unwrap_or_else(|e| panic!("{e}")));

/// Kubernetes version priority: GA > beta > alpha, higher numbers first, others last by name.
fn version_priority(version: &str) -> (u8, u32, u32, String) {
    let Some(caps) = VERSION.captures(version) else {
        return (0, 0, 0, version.to_string());
    };
    let major: u32 = caps[1].parse().unwrap_or(0);
    let minor: u32 = caps.get(3).and_then(|m| m.as_str().parse().ok()).unwrap_or(0);
    let stage = match caps.get(2).map(|m| m.as_str()) {
        None => 3,
        Some("beta") => 2,
        _ => 1,
    };
    (stage, major, minor, String::new())
}

/// The resource table of one server, rebuilt only when a CRD's definition changes (CRDs can be
/// large, and every request needs the table): a label or status update of a CRD, which every
/// install sharing it makes, keeps the table.
pub struct ResourceTable {
    store: Arc<Store>,
    cached: Mutex<Option<Built>>,
}

/// A table, the CRD change it was last checked at, and the definitions it was built from.
struct Built {
    checked_at: u64,
    definitions: Vec<(String, i64)>,
    resources: Arc<Resources>,
}

impl ResourceTable {
    pub fn new(store: Arc<Store>) -> ResourceTable {
        ResourceTable {
            store,
            cached: Mutex::new(None),
        }
    }

    pub fn current(&self) -> Arc<Resources> {
        let version = self.store.last_change(&crd_resource());
        let mut cached = self.cached.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(built) = cached.as_mut() {
            if built.checked_at == version {
                return built.resources.clone();
            }
            // A CRD's generation moves with its spec, which is all the table is built from.
            if self.definitions() == built.definitions {
                built.checked_at = version;
                return built.resources.clone();
            }
        }
        let definitions = self.definitions();
        let resources = Arc::new(Resources::current(&self.store));
        *cached = Some(Built {
            checked_at: version,
            definitions,
            resources: resources.clone(),
        });
        resources
    }

    /// Each CRD's uid and generation.
    fn definitions(&self) -> Vec<(String, i64)> {
        self.store.project(&crd_resource(), |crd| {
            let meta = &crd["metadata"];
            let uid = meta["uid"].as_str().unwrap_or_default().to_string();
            (uid, meta["generation"].as_i64().unwrap_or_default())
        })
    }
}

/// The resource table of one server at one moment.
pub struct Resources {
    pub all: Vec<ResourceInfo>,
}

impl Resources {
    /// Builds the table from the built-in kinds and the stored CRDs.
    pub fn current(store: &Store) -> Resources {
        let mut all: Vec<ResourceInfo> = BUILTINS.iter().map(builtin_info).collect();
        for crd in store.list_shared(&crd_resource(), None).0 {
            all.extend(crd_resources(&crd));
        }
        Resources { all }
    }

    pub fn find(&self, group: &str, version: &str, plural: &str) -> Option<ResourceInfo> {
        self.all
            .iter()
            .find(|r| r.group == group && r.version == version && r.plural == plural)
            .cloned()
    }

    /// Versions of a group, preferred first.
    fn group_versions(&self, group: &str) -> Vec<String> {
        let mut versions: Vec<String> = Vec::new();
        for r in self.all.iter().filter(|r| r.group == group) {
            if !versions.contains(&r.version) {
                versions.push(r.version.clone());
            }
        }
        versions.sort_by_key(|v| std::cmp::Reverse(version_priority(v)));
        versions
    }

    pub fn api_group(&self, group: &str) -> Option<Value> {
        let versions = self.group_versions(group);
        let preferred = versions.first()?;
        let entry = |v: &String| json!({"groupVersion": format!("{group}/{v}"), "version": v});
        Some(json!({
            "kind": "APIGroup",
            "apiVersion": "v1",
            "name": group,
            "versions": versions.iter().map(entry).collect::<Vec<_>>(),
            "preferredVersion": entry(preferred),
        }))
    }

    pub fn api_group_list(&self) -> Value {
        let mut groups: BTreeMap<&str, ()> = BTreeMap::new();
        for r in self.all.iter().filter(|r| !r.group.is_empty()) {
            groups.insert(&r.group, ());
        }
        let groups: Vec<Value> = groups.keys().filter_map(|g| self.api_group(g)).collect();
        json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
    }

    pub fn resource_list(&self, group: &str, version: &str) -> Option<Value> {
        let entries: Vec<Value> = self
            .all
            .iter()
            .filter(|r| r.group == group && r.version == version)
            .flat_map(ResourceInfo::discovery_entries)
            .collect();
        if entries.is_empty() {
            return None;
        }
        let group_version = if group.is_empty() {
            version.to_string()
        } else {
            format!("{group}/{version}")
        };
        Some(json!({
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": group_version,
            "resources": entries,
        }))
    }
}

pub fn core_versions(address: &str) -> Value {
    json!({
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": address}],
    })
}

pub fn version_info() -> Value {
    json!({
        "major": "1",
        "minor": "24",
        "gitVersion": "v1.24.0-stackd",
        "gitCommit": "0000000000000000000000000000000000000000",
        "gitTreeState": "clean",
        "buildDate": "2022-05-03T13:36:49Z",
        "goVersion": "go1.18.1",
        "compiler": "gc",
        "platform": "linux/amd64",
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ga_versions_are_preferred_over_beta_and_alpha() {
        let mut versions = vec!["v1alpha1", "v2beta1", "v1", "v1beta2", "foo"];
        versions.sort_by_key(|v| std::cmp::Reverse(version_priority(v)));
        assert_eq!(versions, vec!["v1", "v2beta1", "v1beta2", "v1alpha1", "foo"]);
    }

    #[test]
    fn crd_versions_carry_subresources_and_schema() {
        let crd = json!({"spec": {
        "group": "x.dev", "scope": "Namespaced",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget", "shortNames": ["wd"]},
        "versions": [
            {"name": "v1", "served": true, "storage": true, "schema": {"openAPIV3Schema": {"type": "object"}},
             "subresources": {"status": {}, "scale": {"specReplicasPath": ".spec.size", "statusReplicasPath": ".status.size"}}},
            {"name": "v0", "served": false, "storage": false}
        ]}});
        let infos = crd_resources(&crd);
        assert_eq!(infos.len(), 1);
        assert!(infos[0].status_subresource);
        assert_eq!(infos[0].scale.as_ref().unwrap().spec_replicas, ".spec.size");
        assert_eq!(infos[0].short_names, vec!["wd"]);
    }
}
