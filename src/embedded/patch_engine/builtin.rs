//! Merge keys of the built-in kinds the embedded server serves, after the `patchStrategy`,
//! `patchMergeKey` and `listType` tags of the Kubernetes API types.
//!
//! Lists not named here are atomic: replaced whole by strategic merge patch and by apply.

use serde_json::Value;

use super::schema::{ListSemantics, ListType, PathElem, object_meta_is_map, object_meta_list_type, render};

/// How a list of a built-in kind merges. The two mechanisms read different tags of the Go
/// types, which mostly agree: strategic merge patch `patchMergeKey`, apply `listMapKey`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ListStrategy {
    /// Objects matched by `patch_key` in strategic merge patch (replaced whole when `None`)
    /// and by `apply_keys` in server-side apply (atomic when empty).
    MergeByKey {
        patch_key: Option<&'static str>,
        apply_keys: &'static [&'static str],
    },
    /// Scalars merged as a set (`patchStrategy: merge` on a list of strings).
    MergeValues,
}

/// Merged by `key` in a strategic merge patch and by `apply_keys` in an apply.
const fn by(key: &'static str, apply_keys: &'static [&'static str]) -> Option<ListStrategy> {
    Some(ListStrategy::MergeByKey {
        patch_key: Some(key),
        apply_keys,
    })
}

/// Whether strategic merge patch is available for a kind; the server answers 415 for the rest
/// (custom resources), as kube-apiserver does.
pub fn supports_strategic(group: &str, kind: &str) -> bool {
    matches!(
        (group, kind),
        (
            "",
            "Pod"
                | "Service"
                | "ConfigMap"
                | "Secret"
                | "ServiceAccount"
                | "Namespace"
                | "Event"
                | "Endpoints"
                | "PersistentVolumeClaim"
                | "ResourceQuota"
                | "LimitRange"
        ) | ("apps", "Deployment" | "ReplicaSet" | "StatefulSet" | "DaemonSet")
            | ("batch", "Job" | "CronJob")
            | (
                "rbac.authorization.k8s.io",
                "Role" | "RoleBinding" | "ClusterRole" | "ClusterRoleBinding"
            )
            | ("coordination.k8s.io", "Lease")
            | ("networking.k8s.io", "NetworkPolicy")
            | ("events.k8s.io", "Event")
            | ("apiextensions.k8s.io", "CustomResourceDefinition")
    )
}

/// Where a kind keeps its pod spec.
fn pod_spec_prefix(kind: &str) -> Option<&'static str> {
    match kind {
        "Pod" => Some("spec."),
        "Deployment" | "ReplicaSet" | "StatefulSet" | "DaemonSet" | "Job" => Some("spec.template.spec."),
        "CronJob" => Some("spec.jobTemplate.spec.template.spec."),
        _ => None,
    }
}

/// Where a workload keeps its pod template (`spec.template.`); a Pod has none.
fn pod_template_prefix(kind: &str) -> Option<&'static str> {
    pod_spec_prefix(kind)
        .and_then(|spec| spec.strip_suffix("spec."))
        .filter(|template| !template.is_empty())
}

/// The merge strategy of the list at `path` of `kind`, `None` for an atomic list.
pub(super) fn list_strategy(kind: &str, path: &[PathElem]) -> Option<ListStrategy> {
    if let Some(meta) = object_meta_list_type(path) {
        return strategy_of(meta);
    }
    let rendered = render(path);
    if let Some(rest) = pod_spec_prefix(kind).and_then(|prefix| rendered.strip_prefix(prefix)) {
        return pod_spec_list(rest);
    }
    if let Some(rest) = pod_template_prefix(kind).and_then(|prefix| rendered.strip_prefix(prefix)) {
        return match rest {
            "metadata.ownerReferences" => by("uid", &["uid"]),
            "metadata.finalizers" => Some(ListStrategy::MergeValues),
            _ => None,
        };
    }
    kind_list(kind, &rendered)
}

fn strategy_of(list_type: ListType) -> Option<ListStrategy> {
    match list_type {
        ListType::Map(keys) if keys == ["uid"] => by("uid", &["uid"]),
        ListType::Set => Some(ListStrategy::MergeValues),
        _ => None,
    }
}

fn pod_spec_list(rest: &str) -> Option<ListStrategy> {
    match rest {
        "containers" | "initContainers" | "ephemeralContainers" => by("name", &["name"]),
        "volumes" | "imagePullSecrets" => by("name", &["name"]),
        "hostAliases" => by("ip", &["ip"]),
        "topologySpreadConstraints" => by("topologyKey", &["topologyKey", "whenUnsatisfiable"]),
        _ => container_list(rest),
    }
}

fn container_list(rest: &str) -> Option<ListStrategy> {
    let field = ["containers[].", "initContainers[].", "ephemeralContainers[]."]
        .iter()
        .find_map(|prefix| rest.strip_prefix(prefix))?;
    match field {
        "env" => by("name", &["name"]),
        "ports" => by("containerPort", &["containerPort", "protocol"]),
        "volumeMounts" => by("mountPath", &["mountPath"]),
        "volumeDevices" => by("devicePath", &["devicePath"]),
        _ => None,
    }
}

fn kind_list(kind: &str, rendered: &str) -> Option<ListStrategy> {
    match (kind, rendered) {
        ("Service", "spec.ports") => by("port", &["port", "protocol"]),
        ("ServiceAccount", "secrets") => by("name", &["name"]),
        (
            "Pod" | "Deployment" | "ReplicaSet" | "StatefulSet" | "DaemonSet" | "Namespace" | "Service",
            "status.conditions",
        ) => by("type", &["type"]),
        // `patchStrategy: merge` but `listType: atomic`.
        ("Job", "status.conditions") => by("type", &[]),
        // `listType: map` without a patch strategy.
        ("CustomResourceDefinition", "status.conditions") => Some(ListStrategy::MergeByKey {
            patch_key: None,
            apply_keys: &["type"],
        }),
        _ => None,
    }
}

/// Maps the Kubernetes types mark `+mapType=atomic` / `+structType=atomic`.
fn map_is_atomic(kind: &str, path: &[PathElem]) -> bool {
    let rendered = render(path);
    if let Some(rest) = pod_spec_prefix(kind).and_then(|prefix| rendered.strip_prefix(prefix)) {
        // Label selectors of affinity terms and spread constraints are atomic structs too.
        return rest == "nodeSelector" || rest.ends_with(".labelSelector") || rest.ends_with(".namespaceSelector");
    }
    matches!(
        (kind, rendered.as_str()),
        (
            "Deployment" | "ReplicaSet" | "StatefulSet" | "DaemonSet" | "Job",
            "spec.selector"
        ) | ("Service", "spec.selector")
    )
}

/// Maps (as opposed to structs) of the built-in kinds; only their keys' ownership depends on it.
fn is_map(kind: &str, path: &[PathElem]) -> bool {
    if let Some(meta) = object_meta_is_map(path) {
        return meta;
    }
    let Some(PathElem::Field(last)) = path.last() else {
        return false;
    };
    let rendered = render(path);
    match last.as_str() {
        "labels" | "annotations" => rendered.ends_with("metadata.labels") || rendered.ends_with("metadata.annotations"),
        "data" | "binaryData" | "stringData" => path.len() == 1,
        "nodeSelector" | "matchLabels" | "limits" | "requests" => true,
        "selector" => kind == "Service",
        _ => false,
    }
}

/// List semantics of a built-in kind for server-side apply, from the table above.
#[derive(Debug, Clone)]
pub struct BuiltinSchema {
    kind: String,
}

impl BuiltinSchema {
    pub fn for_kind(kind: &str) -> Self {
        BuiltinSchema { kind: kind.to_string() }
    }
}

impl ListSemantics for BuiltinSchema {
    fn list_type(&self, path: &[PathElem]) -> ListType {
        match list_strategy(&self.kind, path) {
            Some(ListStrategy::MergeByKey { apply_keys, .. }) if !apply_keys.is_empty() => {
                ListType::Map(apply_keys.iter().map(|key| key.to_string()).collect())
            }
            Some(ListStrategy::MergeValues) => ListType::Set,
            _ => ListType::Atomic,
        }
    }

    fn map_is_atomic(&self, path: &[PathElem]) -> bool {
        map_is_atomic(&self.kind, path)
    }

    fn is_map(&self, path: &[PathElem]) -> bool {
        is_map(&self.kind, path)
    }

    /// The API server defaults a port's protocol to TCP, so an applied port without one is the
    /// same list item as the stored port with `protocol: TCP`.
    fn key_default(&self, _list: &[PathElem], key: &str) -> Option<Value> {
        (key == "protocol").then(|| Value::String("TCP".to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::embedded::patch_engine::schema::path;

    #[test]
    fn pod_template_containers_merge_by_name_in_every_workload() {
        for (kind, containers) in [
            ("Pod", "spec.containers"),
            ("Deployment", "spec.template.spec.containers"),
            ("Job", "spec.template.spec.initContainers"),
        ] {
            assert_eq!(list_strategy(kind, &path(containers)), by("name", &["name"]), "{kind}");
        }
    }

    #[test]
    fn container_ports_apply_by_port_and_protocol() {
        let schema = BuiltinSchema::for_kind("Deployment");
        assert_eq!(
            schema.list_type(&path("spec.template.spec.containers[].ports")),
            ListType::Map(vec!["containerPort".into(), "protocol".into()])
        );
    }

    #[test]
    fn tolerations_and_rbac_rules_are_atomic() {
        assert_eq!(list_strategy("Pod", &path("spec.tolerations")), None);
        assert_eq!(list_strategy("ClusterRole", &path("rules")), None);
    }

    #[test]
    fn status_conditions_merge_by_type() {
        for kind in ["Pod", "Deployment", "ReplicaSet", "Namespace", "Service"] {
            assert_eq!(
                list_strategy(kind, &path("status.conditions")),
                by("type", &["type"]),
                "{kind}"
            );
        }
    }

    #[test]
    fn patch_and_apply_can_disagree_on_conditions() {
        let job = BuiltinSchema::for_kind("Job");
        assert_eq!(job.list_type(&path("status.conditions")), ListType::Atomic);
        let crd = BuiltinSchema::for_kind("CustomResourceDefinition");
        assert_eq!(
            crd.list_type(&path("status.conditions")),
            ListType::Map(vec!["type".into()])
        );
        assert_eq!(
            list_strategy("CustomResourceDefinition", &path("status.conditions")),
            Some(ListStrategy::MergeByKey {
                patch_key: None,
                apply_keys: &["type"]
            })
        );
    }

    #[test]
    fn finalizers_are_a_set_for_every_kind() {
        let schema = BuiltinSchema::for_kind("ConfigMap");
        assert_eq!(schema.list_type(&path("metadata.finalizers")), ListType::Set);
    }

    #[test]
    fn workload_selectors_are_atomic_maps() {
        let schema = BuiltinSchema::for_kind("Deployment");
        assert!(schema.map_is_atomic(&path("spec.selector")));
        assert!(!schema.map_is_atomic(&path("spec.template.metadata.labels")));
        assert!(schema.map_is_atomic(&path("spec.template.spec.topologySpreadConstraints[].labelSelector")));
    }

    #[test]
    fn config_map_data_is_a_map() {
        assert!(BuiltinSchema::for_kind("ConfigMap").is_map(&path("data")));
        assert!(!BuiltinSchema::for_kind("Pod").is_map(&path("spec")));
    }

    #[test]
    fn custom_resources_have_no_strategic_merge() {
        assert!(supports_strategic("", "ConfigMap"));
        assert!(supports_strategic("apps", "Deployment"));
        assert!(!supports_strategic("stacks.stackd.dev", "Stack"));
    }
}
