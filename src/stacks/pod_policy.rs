//! What a stack's controller pod may ask for on the host (DESIGN.md §3.3 step 4 and §8): an
//! allow-list. Every stack of a tenant shares one host namespace whose Secrets have predictable
//! names (other stacks' token copies, clusters' outputs), so the package's pod may name no Secret or
//! ConfigMap at all: stackd adds the only ones it may use (its token copy, its pull-secret copies)
//! itself, after this check. Nothing may pin it to nodes, raise its priority or reach the node.
//! Checked when a package is installed and again when its Deployment is built.

use k8s_openapi::api::core::v1::{PodTemplateSpec, Toleration};
use serde_json::{Map, Value};

use crate::context::pod_policy::{AllowedToleration, PodPolicy};

impl AllowedToleration {
    /// True when `wanted` tolerates nothing this flag does not: same key, the same value (or any
    /// value when the flag has none), the flag's effect (or any when it names none).
    fn covers(&self, wanted: &Toleration) -> bool {
        let operator = wanted.operator.as_deref().unwrap_or("Equal");
        let value_ok = match (&self.value, operator) {
            (None, _) => true,
            (Some(allowed), "Equal") => wanted.value.as_deref().unwrap_or_default() == allowed,
            (Some(_), _) => false,
        };
        let effect = wanted.effect.as_deref().filter(|e| !e.is_empty());
        let effect_ok = match (&self.effect, effect) {
            (None, _) => true,
            (Some(allowed), Some(effect)) => allowed == effect,
            (Some(_), None) => false,
        };
        wanted.key.as_deref() == Some(self.key.as_str()) && value_ok && effect_ok
    }
}

/// Every reason `template` is refused, one sentence each naming the field (as it is spelled in the
/// package's install.yaml); empty when it is allowed.
pub fn violations(template: &PodTemplateSpec, policy: &PodPolicy) -> Vec<String> {
    let mut found = Found::default();
    let Ok(template) = serde_json::to_value(template) else {
        found.refuse("spec.template", "cannot be read");
        return found.0;
    };
    let Some(template) = template.as_object() else {
        return found.0;
    };
    for (key, value) in present(template) {
        let path = format!("spec.template.{key}");
        match key {
            "metadata" => check_metadata(&path, value, &mut found),
            "spec" => check_pod(&path, value, policy, &mut found),
            _ => found.refuse(&path, NOT_ALLOWED),
        }
    }
    found.0
}

/// The refusal message for a pod spec with `violations`.
pub fn refusal(violations: &[String]) -> String {
    format!(
        "the stack's controller pod is refused because a stack's pod may use only what stackd allows on the shared host: {}; remove these from the package's install.yaml (or run stackd with --insecure-pass-full-deployment)",
        violations.join("; ")
    )
}

const NOT_ALLOWED: &str = "is not a field a stack's pod may set";
const NAMES_HOST_SECRET: &str = "a stack's pod may use only the Secrets stackd makes for it";
const NAMES_HOST_CONFIGMAP: &str =
    "a package cannot create ConfigMaps on the host, so this can only be another stack's or the host's";

#[derive(Default)]
struct Found(Vec<String>);

impl Found {
    fn refuse(&mut self, path: &str, why: &str) {
        self.0.push(format!("{path} {why}"));
    }
}

/// The set fields of an object (null is what serialisation leaves of an unset one).
fn present(map: &Map<String, Value>) -> impl Iterator<Item = (&str, &Value)> {
    map.iter().filter(|(_, v)| !v.is_null()).map(|(k, v)| (k.as_str(), v))
}

fn fields(value: &Value) -> impl Iterator<Item = (&str, &Value)> {
    value.as_object().into_iter().flat_map(present)
}

fn items(value: &Value) -> impl Iterator<Item = (usize, &Value)> {
    value.as_array().into_iter().flatten().enumerate()
}

fn name_of(value: &Value) -> &str {
    value.get("name").and_then(Value::as_str).unwrap_or_default()
}

/// The pod-template annotations a package may set. Annotations reach further than labels: CNI
/// plugins, service meshes and container runtimes read them from the pod (Multus networks, Calico
/// addresses, sidecar injection, CRI-O's `io.kubernetes.cri-o.*`), and legacy seccomp/AppArmor keys
/// set security profiles. Only keys that change nothing on the node pass.
const ALLOWED_TEMPLATE_ANNOTATIONS: &[&str] = &[
    "kubectl.kubernetes.io/default-container",
    "kubectl.kubernetes.io/default-logs-container",
    "kubectl.kubernetes.io/restartedAt",
];

/// The domain-qualified labels a stack's pod may carry: the recommended ones, which describe the
/// application and select nothing on the host.
const ALLOWED_QUALIFIED_LABELS: &[&str] = &[
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
    "app.kubernetes.io/component",
    "app.kubernetes.io/part-of",
];
/// The prefix of the labels Crossplane's package tooling puts on every controller pod it builds
/// (`core.crossplane.io/name` in the pod template and the selector): Crossplane's own, which no
/// host plugin selects by.
const CROSSPLANE_PACKAGE_LABEL_PREFIX: &str = "core.crossplane.io/";
const LABEL_NOT_ALLOWED: &str = "is not allowed: domain-qualified labels are what the host's service meshes (sidecar.istio.io/inject, istio.io/rev), network policies and stackd select pods by; a stack's pod may carry labels without a domain prefix, app.kubernetes.io/{name,instance,version,component,part-of} and Crossplane's core.crossplane.io/*";

/// Whether a package may put label `key` on its pod: an allow-list, since any domain may be one a
/// host plugin selects pods by (a mesh's injection label, a policy engine's): keys without a domain
/// prefix, and of the domain-qualified ones only [`ALLOWED_QUALIFIED_LABELS`] and Crossplane's
/// package labels.
fn allowed_template_label(key: &str) -> bool {
    !key.contains('/')
        || ALLOWED_QUALIFIED_LABELS.contains(&key)
        || key
            .strip_prefix(CROSSPLANE_PACKAGE_LABEL_PREFIX)
            .is_some_and(|name| !name.is_empty() && !name.contains('/'))
}

fn check_metadata(path: &str, metadata: &Value, found: &mut Found) {
    for (key, value) in fields(metadata) {
        let path = format!("{path}.{key}");
        match key {
            // stackd sets the pod's name and namespace itself.
            "name" | "namespace" => {}
            "labels" => {
                for (label, _) in fields(value) {
                    if !allowed_template_label(label) {
                        found.refuse(&format!("{path}[{label}]"), LABEL_NOT_ALLOWED);
                    }
                }
            }
            "annotations" => {
                // The key only: a value may be anything the package author put there.
                for (annotation, _) in fields(value) {
                    if !ALLOWED_TEMPLATE_ANNOTATIONS.contains(&annotation) {
                        found.refuse(
                            &format!("{path}[{annotation}]"),
                            &format!(
                                "is not allowed: annotations on a stack's pod are read by the host's network, mesh and runtime plugins; only {} are",
                                ALLOWED_TEMPLATE_ANNOTATIONS.join(", ")
                            ),
                        );
                    }
                }
            }
            _ => found.refuse(&path, NOT_ALLOWED),
        }
    }
}

fn check_pod(path: &str, pod: &Value, policy: &PodPolicy, found: &mut Found) {
    for (key, value) in fields(pod) {
        let path = format!("{path}.{key}");
        match key {
            "containers" | "initContainers" => {
                for (i, container) in items(value) {
                    check_container(&format!("{path}[{i}]"), container, found);
                }
            }
            "volumes" => {
                for (i, volume) in items(value) {
                    check_volume(&format!("{path}[{i}]"), volume, found);
                }
            }
            "securityContext" => check_pod_security(&path, value, found),
            "nodeSelector" => check_node_selector(&path, value, policy, found),
            "tolerations" => check_tolerations(&path, value, policy, found),
            "automountServiceAccountToken" if value == &Value::Bool(true) => {
                found.refuse(&path, "is true: it would mount a host service-account token")
            }
            "terminationGracePeriodSeconds" => check_grace_period(&path, value, found),
            "automountServiceAccountToken"
            | "restartPolicy"
            | "dnsPolicy"
            | "dnsConfig"
            | "hostname"
            | "subdomain"
            | "setHostnameAsFQDN"
            | "hostAliases"
            | "enableServiceLinks"
            | "readinessGates"
            | "shareProcessNamespace" => {}
            _ => found.refuse(&path, refused_pod_field(key)),
        }
    }
}

/// Why a pod field off the allow-list is refused, for the ones a package is likely to try.
fn refused_pod_field(key: &str) -> &'static str {
    match key {
        "hostNetwork" | "hostPID" | "hostIPC" | "hostUsers" => "is not allowed: it shares the node's namespaces",
        "nodeName" | "affinity" | "topologySpreadConstraints" | "schedulerName" | "schedulingGates" => {
            "is not allowed: stack pods are not placed on chosen nodes"
        }
        "priorityClassName" | "priority" | "preemptionPolicy" => {
            "is not allowed: a stack's pod may not preempt other tenants' pods"
        }
        "runtimeClassName" | "overhead" => "is not allowed: it selects a runtime handler of the node",
        "serviceAccountName" | "serviceAccount" => {
            "is not allowed: it names a host ServiceAccount; stackd gives the pod the stack's tenant token"
        }
        "imagePullSecrets" => {
            "is not allowed: it names host Secrets; stackd adds the pull secrets it copied for the install"
        }
        "ephemeralContainers" => "is not allowed: debugging containers are added by the host's administrators",
        "resourceClaims" => "is not allowed: it claims host devices",
        _ => NOT_ALLOWED,
    }
}

fn check_node_selector(path: &str, selector: &Value, policy: &PodPolicy, found: &mut Found) {
    for (key, value) in fields(selector) {
        let value = value.as_str().unwrap_or_default();
        if policy.node_selector.get(key).map(String::as_str) != Some(value) {
            found.refuse(
                &format!("{path}[{key}]"),
                &format!(
                    "is not allowed: stack pods may select nodes only by {}",
                    allowed_labels(policy)
                ),
            );
        }
    }
}

fn allowed_labels(policy: &PodPolicy) -> String {
    if policy.node_selector.is_empty() {
        return "the labels of stackd's --stack-node-selector flag, which is not set".into();
    }
    let labels: Vec<String> = policy.node_selector.iter().map(|(k, v)| format!("{k}={v}")).collect();
    format!("{} (--stack-node-selector)", labels.join(", "))
}

fn check_tolerations(path: &str, tolerations: &Value, policy: &PodPolicy, found: &mut Found) {
    for (i, raw) in items(tolerations) {
        let wanted: Option<Toleration> = serde_json::from_value(raw.clone()).ok();
        if wanted.is_some_and(|t| policy.tolerations.iter().any(|a| a.covers(&t))) {
            continue;
        }
        let allowed = if policy.tolerations.is_empty() {
            "the taints of stackd's --stack-toleration flag, which is not set".to_string()
        } else {
            let list: Vec<String> = policy.tolerations.iter().map(ToString::to_string).collect();
            format!("{} (--stack-toleration)", list.join(", "))
        };
        found.refuse(
            &format!("{path}[{i}]"),
            &format!("is not allowed: stack pods may tolerate only {allowed}"),
        );
    }
}

/// The `restricted` Pod Security level, pod half.
fn check_pod_security(path: &str, context: &Value, found: &mut Found) {
    for (key, value) in fields(context) {
        let path = format!("{path}.{key}");
        match key {
            "runAsNonRoot" | "runAsUser" | "seccompProfile" | "appArmorProfile" => {
                check_identity_or_profile(&path, key, value, found)
            }
            "runAsGroup" | "fsGroup" | "fsGroupChangePolicy" | "supplementalGroups" | "supplementalGroupsPolicy" => {}
            "sysctls" => found.refuse(&path, "is not allowed: sysctls change the node's kernel settings"),
            _ => found.refuse(
                &path,
                "is not allowed by the restricted Pod Security level stackd enforces",
            ),
        }
    }
}

/// Fields pod and container security contexts share.
fn check_identity_or_profile(path: &str, key: &str, value: &Value, found: &mut Found) {
    match key {
        "runAsNonRoot" if value == &Value::Bool(false) => {
            found.refuse(path, "is false: stack pods run as a non-root user")
        }
        "runAsUser" if value.as_i64() == Some(0) => {
            found.refuse(path, "is 0 (root): stack pods run as a non-root user")
        }
        // A Localhost seccomp profile is replaced by RuntimeDefault when the Deployment is built.
        "seccompProfile" => {
            let kind = value.get("type").and_then(Value::as_str).unwrap_or_default();
            if !matches!(kind, "RuntimeDefault" | "Localhost") {
                found.refuse(
                    &format!("{path}.type"),
                    &format!("is {kind:?}: only RuntimeDefault or Localhost profiles are allowed"),
                );
            }
        }
        // AppArmor is not forced like seccomp (a node without AppArmor rejects any profile), so a
        // Localhost profile, one of whatever the node has loaded, is refused here instead.
        "appArmorProfile" => {
            let kind = value.get("type").and_then(Value::as_str).unwrap_or_default();
            if kind != "RuntimeDefault" {
                found.refuse(
                    &format!("{path}.type"),
                    &format!("is {kind:?}: only the RuntimeDefault AppArmor profile is allowed"),
                );
            }
        }
        _ => {}
    }
}

fn check_container(path: &str, container: &Value, found: &mut Found) {
    for (key, value) in fields(container) {
        let path = format!("{path}.{key}");
        match key {
            "env" => {
                for (i, var) in items(value) {
                    check_env(&format!("{path}[{i}]"), var, found);
                }
            }
            "envFrom" => {
                for (i, source) in items(value) {
                    check_env_from(&format!("{path}[{i}]"), source, found);
                }
            }
            "ports" => {
                for (i, port) in items(value) {
                    for (field, _) in fields(port) {
                        if matches!(field, "hostPort" | "hostIP") {
                            found.refuse(
                                &format!("{path}[{i}].{field}"),
                                "is not allowed: it binds a port of the node",
                            );
                        }
                    }
                }
            }
            "volumeMounts" => {
                for (i, mount) in items(value) {
                    let propagation = mount.get("mountPropagation").and_then(Value::as_str);
                    if propagation.is_some_and(|p| p != "None") {
                        found.refuse(
                            &format!("{path}[{i}].mountPropagation"),
                            "is not allowed: mounts may not propagate to or from the node",
                        );
                    }
                }
            }
            "livenessProbe" | "readinessProbe" | "startupProbe" => {
                check_handler_hosts(&path, value, found);
                if let Some(grace) = value.get("terminationGracePeriodSeconds").filter(|g| !g.is_null()) {
                    check_grace_period(&format!("{path}.terminationGracePeriodSeconds"), grace, found);
                }
            }
            "resources" => check_resources(&path, value, found),
            "lifecycle" => {
                for (hook, handler) in fields(value) {
                    check_handler_hosts(&format!("{path}.{hook}"), handler, found);
                }
            }
            "securityContext" => check_container_security(&path, value, found),
            "volumeDevices" => found.refuse(&path, "is not allowed: stack pods use no block devices"),
            // imagePullPolicy is accepted and overridden: stackd pulls every stack image `Always`.
            "name"
            | "image"
            | "imagePullPolicy"
            | "command"
            | "args"
            | "workingDir"
            | "resizePolicy"
            | "restartPolicy"
            | "terminationMessagePath"
            | "terminationMessagePolicy"
            | "stdin"
            | "stdinOnce"
            | "tty" => {}
            _ => found.refuse(&path, NOT_ALLOWED),
        }
    }
}

/// The longest `terminationGracePeriodSeconds` a stack's pod may ask for. A deleted pod keeps its
/// quota (and its node resources) until it is gone, and an uninstall or `tenant purge` waits for
/// it: an unbounded period would keep an "uninstalled" stack running for years. Five minutes is ten
/// times Kubernetes' default, enough for a controller to hand over its leader lease and finish its
/// work in flight. Refused rather than clamped: a package that relies on a longer shutdown should
/// hear so when it is installed, not be cut short on the host.
pub const MAX_TERMINATION_GRACE_SECONDS: i64 = 300;

fn check_grace_period(path: &str, value: &Value, found: &mut Found) {
    match value.as_i64() {
        Some(seconds) if (0..=MAX_TERMINATION_GRACE_SECONDS).contains(&seconds) => {}
        _ => found.refuse(
            path,
            &format!(
                "is not between 0 and {MAX_TERMINATION_GRACE_SECONDS} seconds: a stopping stack pod holds the tenant's quota and holds up its uninstall for that long; ask for at most {MAX_TERMINATION_GRACE_SECONDS}"
            ),
        ),
    }
}

/// The compute resources a stack's container may request or be limited to: those the tenant's
/// ResourceQuota and LimitRange bound (`--tenant-quota`). Extended resources (`nvidia.com/gpu`),
/// hugepages and anything else would be granted outside the quota, from whatever the node has.
const ALLOWED_RESOURCES: &[&str] = &["cpu", "memory", "ephemeral-storage"];

fn check_resources(path: &str, resources: &Value, found: &mut Found) {
    for (key, value) in fields(resources) {
        let path = format!("{path}.{key}");
        match key {
            "requests" | "limits" => {
                for (resource, _) in fields(value) {
                    if !ALLOWED_RESOURCES.contains(&resource) {
                        found.refuse(
                            &format!("{path}[{resource}]"),
                            &format!(
                                "is not allowed: a stack's pod may ask for {} only, which the tenant's quota bounds",
                                ALLOWED_RESOURCES.join(", ")
                            ),
                        );
                    }
                }
            }
            "claims" => found.refuse(&path, "is not allowed: it claims host devices"),
            _ => found.refuse(&path, NOT_ALLOWED),
        }
    }
}

fn check_env(path: &str, var: &Value, found: &mut Found) {
    for (source, reference) in var.get("valueFrom").into_iter().flat_map(fields) {
        let path = format!("{path}.valueFrom.{source}");
        match source {
            "fieldRef" | "resourceFieldRef" => {}
            "secretKeyRef" => found.refuse(
                &path,
                &format!("reads host Secret {:?}: {NAMES_HOST_SECRET}", name_of(reference)),
            ),
            "configMapKeyRef" => found.refuse(
                &path,
                &format!("reads host ConfigMap {:?}: {NAMES_HOST_CONFIGMAP}", name_of(reference)),
            ),
            _ => found.refuse(&path, NOT_ALLOWED),
        }
    }
}

fn check_env_from(path: &str, source: &Value, found: &mut Found) {
    for (kind, reference) in fields(source) {
        let path = format!("{path}.{kind}");
        match kind {
            "prefix" => {}
            "secretRef" => found.refuse(
                &path,
                &format!("reads host Secret {:?}: {NAMES_HOST_SECRET}", name_of(reference)),
            ),
            "configMapRef" => found.refuse(
                &path,
                &format!("reads host ConfigMap {:?}: {NAMES_HOST_CONFIGMAP}", name_of(reference)),
            ),
            _ => found.refuse(&path, NOT_ALLOWED),
        }
    }
}

/// Probes and lifecycle hooks run from the kubelet: a `host` there aims the node at any address.
fn check_handler_hosts(path: &str, handler: &Value, found: &mut Found) {
    for kind in ["httpGet", "tcpSocket"] {
        let host = handler.get(kind).and_then(|h| h.get("host"));
        if host.is_some_and(|h| !h.is_null()) {
            found.refuse(
                &format!("{path}.{kind}.host"),
                "is not allowed: the kubelet would connect from the node to another host",
            );
        }
    }
}

/// The `restricted` Pod Security level, container half.
fn check_container_security(path: &str, context: &Value, found: &mut Found) {
    for (key, value) in fields(context) {
        let path = format!("{path}.{key}");
        match key {
            "privileged" if value == &Value::Bool(true) => {
                found.refuse(&path, "is true: stack pods are never privileged")
            }
            "allowPrivilegeEscalation" if value == &Value::Bool(true) => {
                found.refuse(&path, "is true: stack pods may not gain privileges")
            }
            "capabilities" => {
                let added: Vec<&str> = value
                    .get("add")
                    .into_iter()
                    .flat_map(items)
                    .filter_map(|(_, c)| c.as_str())
                    .collect();
                if !added.is_empty() {
                    found.refuse(
                        &format!("{path}.add"),
                        &format!("adds capabilities {}: stack pods drop them all", added.join(", ")),
                    );
                }
            }
            "procMount" if value.as_str() != Some("Default") => {
                found.refuse(&path, "is not allowed: only the Default proc mount is")
            }
            "runAsNonRoot" | "runAsUser" | "seccompProfile" | "appArmorProfile" => {
                check_identity_or_profile(&path, key, value, found)
            }
            "privileged" | "allowPrivilegeEscalation" | "procMount" | "runAsGroup" | "readOnlyRootFilesystem" => {}
            _ => found.refuse(
                &path,
                "is not allowed by the restricted Pod Security level stackd enforces",
            ),
        }
    }
}

fn check_volume(path: &str, volume: &Value, found: &mut Found) {
    for (kind, source) in fields(volume) {
        let path = format!("{path}.{kind}");
        match kind {
            "name" | "emptyDir" | "downwardAPI" => {}
            "projected" => {
                for (i, projection) in source.get("sources").into_iter().flat_map(items) {
                    for (kind, source) in fields(projection) {
                        check_projection(&format!("{path}.sources[{i}].{kind}"), kind, source, found);
                    }
                }
            }
            "secret" => found.refuse(
                &path,
                &format!(
                    "mounts host Secret {:?}: {NAMES_HOST_SECRET}",
                    source.get("secretName").and_then(Value::as_str).unwrap_or_default()
                ),
            ),
            "configMap" => found.refuse(
                &path,
                &format!("mounts host ConfigMap {:?}: {NAMES_HOST_CONFIGMAP}", name_of(source)),
            ),
            "hostPath" => found.refuse(&path, "is not allowed: it mounts the node's filesystem"),
            _ => found.refuse(
                &path,
                "is not allowed: a stack's pod may use emptyDir, downwardAPI and projected downwardAPI volumes only",
            ),
        }
    }
}

fn check_projection(path: &str, kind: &str, source: &Value, found: &mut Found) {
    match kind {
        "downwardAPI" => {}
        "secret" => found.refuse(
            path,
            &format!("projects host Secret {:?}: {NAMES_HOST_SECRET}", name_of(source)),
        ),
        "configMap" => found.refuse(
            path,
            &format!("projects host ConfigMap {:?}: {NAMES_HOST_CONFIGMAP}", name_of(source)),
        ),
        "serviceAccountToken" => found.refuse(
            path,
            "projects a host service-account token: stackd mounts the stack's tenant token",
        ),
        _ => found.refuse(
            path,
            "is not allowed: projected volumes may hold downwardAPI sources only",
        ),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use serde_json::json;

    fn template(pod: Value) -> PodTemplateSpec {
        serde_json::from_value(json!({"metadata": {"labels": {"app": "c"}}, "spec": pod})).unwrap()
    }

    fn refused(pod: Value) -> Vec<String> {
        violations(&template(pod), &PodPolicy::default())
    }

    fn container(extra: Value) -> Value {
        let mut c = json!({"name": "c", "image": "example/c:1"});
        c.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        c
    }

    fn one_refusal(pod: Value, field: &str) -> String {
        let found = refused(pod);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].starts_with(field), "{found:?} does not start with {field}");
        found[0].clone()
    }

    #[test]
    fn pod_labels_pass_only_without_a_domain_or_as_recommended_app_labels() {
        let labelled = |labels: Value| -> Vec<String> {
            let template: PodTemplateSpec = serde_json::from_value(json!({
                "metadata": {"labels": labels},
                "spec": {"containers": [container(json!({}))]},
            }))
            .unwrap();
            violations(&template, &PodPolicy::default())
        };
        let own = json!({"app": "c", "tier": "x", "app.kubernetes.io/name": "c", "app.kubernetes.io/part-of": "p",
            "core.crossplane.io/name": "stack-gcp"});
        assert_eq!(labelled(own), Vec::<String>::new());
        for key in [
            "stackd.dev/tenant",
            "stacks.stackd.dev/parent-name",
            "app.kubernetes.io/managed-by",
            "node-role.kubernetes.io/control-plane",
            "x.k8s.io/anything",
            "sidecar.istio.io/inject",
            "istio.io/rev",
            "example.org/tier",
            "x.core.crossplane.io/name",
            "crossplane.io/name",
        ] {
            let found = labelled(json!({ key: "v" }));
            assert_eq!(found.len(), 1, "{key}: {found:?}");
            assert!(found[0].contains(&format!("labels[{key}]")), "{found:?}");
        }
    }

    #[test]
    fn resources_beyond_cpu_memory_and_ephemeral_storage_are_refused_by_name() {
        let found = refused(json!({"containers": [container(json!({"resources": {
            "requests": {"cpu": "1", "memory": "1Gi", "ephemeral-storage": "1Gi", "nvidia.com/gpu": "1"},
            "limits": {"hugepages-2Mi": "1Gi", "memory": "2Gi"},
            "claims": [{"name": "gpu"}],
        }}))]}));
        assert_eq!(found.len(), 3, "{found:?}");
        assert!(
            found[0].starts_with("spec.template.spec.containers[0].resources.claims"),
            "{found:?}"
        );
        assert!(
            found[1].starts_with("spec.template.spec.containers[0].resources.limits[hugepages-2Mi]"),
            "{found:?}"
        );
        assert!(
            found[2].starts_with("spec.template.spec.containers[0].resources.requests[nvidia.com/gpu]"),
            "{found:?}"
        );
        assert!(found[2].contains("cpu, memory, ephemeral-storage"), "{found:?}");
    }

    #[test]
    fn a_grace_period_over_five_minutes_is_refused() {
        let pod =
            |seconds: i64| json!({"terminationGracePeriodSeconds": seconds, "containers": [container(json!({}))]});
        assert_eq!(refused(pod(MAX_TERMINATION_GRACE_SECONDS)), Vec::<String>::new());
        let message = one_refusal(pod(31_536_000), "spec.template.spec.terminationGracePeriodSeconds");
        assert!(message.contains("300"), "{message}");
        one_refusal(pod(-1), "spec.template.spec.terminationGracePeriodSeconds");
        let probe = json!({"containers": [container(json!({
            "livenessProbe": {"exec": {"command": ["true"]}, "terminationGracePeriodSeconds": 86_400},
        }))]});
        one_refusal(
            probe,
            "spec.template.spec.containers[0].livenessProbe.terminationGracePeriodSeconds",
        );
    }

    #[test]
    fn an_ordinary_controller_pod_is_allowed() {
        let pod = json!({
            "terminationGracePeriodSeconds": 10,
            "automountServiceAccountToken": false,
            "securityContext": {"runAsNonRoot": true, "runAsUser": 1000, "fsGroup": 2000,
                                "seccompProfile": {"type": "RuntimeDefault"}},
            "volumes": [{"name": "scratch", "emptyDir": {"sizeLimit": "1Gi"}},
                        {"name": "info", "downwardAPI": {"items": [{"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]}},
                        {"name": "both", "projected": {"sources": [{"downwardAPI": {"items": []}}]}}],
            "initContainers": [container(json!({"args": ["migrate"]}))],
            "containers": [container(json!({
                "imagePullPolicy": "IfNotPresent",
                "env": [{"name": "A", "value": "b"},
                        {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
                "ports": [{"name": "metrics", "containerPort": 8080}],
                "resources": {"requests": {"cpu": "10m"}, "limits": {"memory": "64Mi"}},
                "volumeMounts": [{"name": "scratch", "mountPath": "/tmp"}],
                "livenessProbe": {"httpGet": {"path": "/healthz", "port": 8080}},
                "lifecycle": {"preStop": {"exec": {"command": ["sleep", "1"]}}},
                "securityContext": {"allowPrivilegeEscalation": false, "readOnlyRootFilesystem": true,
                                    "capabilities": {"drop": ["ALL"]}, "runAsNonRoot": true},
            }))],
        });
        assert_eq!(refused(pod), Vec::<String>::new());
    }

    #[test]
    fn every_way_to_name_a_host_secret_is_refused() {
        let c = |extra| json!({"containers": [container(extra)]});
        let message = one_refusal(
            json!({"containers": [container(json!({}))],
                   "volumes": [{"name": "t", "secret": {"secretName": "team-b.other-token"}}]}),
            "spec.template.spec.volumes[0].secret",
        );
        assert!(message.contains("team-b.other-token"), "{message}");
        one_refusal(
            c(
                json!({"env": [{"name": "K", "valueFrom": {"secretKeyRef": {"name": "team-a.cd-output", "key": "kubeconfig"}}}]}),
            ),
            "spec.template.spec.containers[0].env[0].valueFrom.secretKeyRef",
        );
        one_refusal(
            c(json!({"envFrom": [{"secretRef": {"name": "team-a.cd-output"}}]})),
            "spec.template.spec.containers[0].envFrom[0].secretRef",
        );
        one_refusal(
            json!({"containers": [container(json!({}))],
                   "volumes": [{"name": "p", "projected": {"sources": [{"downwardAPI": {}}, {"secret": {"name": "x"}}]}}]}),
            "spec.template.spec.volumes[0].projected.sources[1].secret",
        );
        one_refusal(
            json!({"containers": [container(json!({}))], "imagePullSecrets": [{"name": "team-b.s-pull-0-abc"}]}),
            "spec.template.spec.imagePullSecrets",
        );
    }

    #[test]
    fn config_maps_are_refused_like_secrets() {
        let found = refused(json!({
            "volumes": [{"name": "c", "configMap": {"name": "kube-root-ca.crt"}}],
            "containers": [container(json!({
                "env": [{"name": "K", "valueFrom": {"configMapKeyRef": {"name": "x", "key": "k"}}}],
                "envFrom": [{"configMapRef": {"name": "x"}}],
            }))],
        }));
        assert_eq!(found.len(), 3, "{found:?}");
        assert!(found.iter().all(|f| f.contains("ConfigMap")), "{found:?}");
    }

    #[test]
    fn scheduling_fields_are_refused_without_flags() {
        for (field, value) in [
            ("nodeName", json!("node-1")),
            ("nodeSelector", json!({"pool": "gpu"})),
            ("tolerations", json!([{"key": "dedicated", "operator": "Exists"}])),
            ("affinity", json!({"nodeAffinity": {}})),
            ("priorityClassName", json!("system-node-critical")),
            ("runtimeClassName", json!("kata")),
            ("hostNetwork", json!(true)),
            ("hostPID", json!(true)),
            ("hostIPC", json!(true)),
            ("serviceAccountName", json!("default")),
            ("shareProcessNamespace", json!(true)),
        ] {
            let mut pod = json!({"containers": [container(json!({}))]});
            pod[field] = value;
            let found = refused(pod);
            if field == "shareProcessNamespace" {
                assert!(found.is_empty(), "{found:?}");
                continue;
            }
            assert_eq!(found.len(), 1, "{field}: {found:?}");
            assert!(found[0].contains(field), "{found:?}");
        }
    }

    #[test]
    fn the_flags_allow_exactly_their_node_labels_and_taints() {
        let policy = PodPolicy {
            node_selector: BTreeMap::from([("pool".to_string(), "stacks".to_string())]),
            tolerations: vec!["dedicated=stacks:NoSchedule".parse().unwrap(), "spot".parse().unwrap()],
        };
        let allowed = template(json!({
            "containers": [container(json!({}))],
            "nodeSelector": {"pool": "stacks"},
            "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "stacks", "effect": "NoSchedule"},
                            {"key": "spot", "operator": "Exists"},
                            {"key": "spot", "value": "yes", "effect": "NoExecute"}],
        }));
        assert_eq!(violations(&allowed, &policy), Vec::<String>::new());
        let broader = template(json!({
            "containers": [container(json!({}))],
            "nodeSelector": {"pool": "gpu"},
            "tolerations": [{"key": "dedicated", "operator": "Exists"},
                            {"key": "dedicated", "value": "stacks"},
                            {"operator": "Exists"}],
        }));
        let found = violations(&broader, &policy);
        assert_eq!(found.len(), 4, "{found:?}");
        assert!(found[0].contains("pool=stacks"), "{found:?}");
    }

    #[test]
    fn the_restricted_pod_security_level_is_enforced() {
        let found = refused(json!({
            "securityContext": {"runAsUser": 0, "sysctls": [{"name": "kernel.x", "value": "1"}],
                                "seccompProfile": {"type": "Unconfined"}},
            "initContainers": [container(json!({"securityContext": {"privileged": true}}))],
            "containers": [container(json!({
                "securityContext": {"capabilities": {"add": ["NET_ADMIN"]}, "allowPrivilegeEscalation": true,
                                    "runAsNonRoot": false, "seLinuxOptions": {"type": "spc_t"}},
                "ports": [{"containerPort": 80, "hostPort": 80}],
                "volumeMounts": [{"name": "v", "mountPath": "/m", "mountPropagation": "Bidirectional"}],
                "readinessProbe": {"httpGet": {"host": "169.254.169.254", "path": "/", "port": 80}},
            }))],
            "volumes": [{"name": "root", "hostPath": {"path": "/"}},
                        {"name": "tok", "projected": {"sources": [{"serviceAccountToken": {"path": "t"}}]}},
                        {"name": "nfs", "nfs": {"server": "s", "path": "/"}}],
        }));
        for needle in [
            "securityContext.runAsUser",
            "securityContext.sysctls",
            "seccompProfile.type",
            "initContainers[0].securityContext.privileged",
            "NET_ADMIN",
            "allowPrivilegeEscalation",
            "runAsNonRoot",
            "seLinuxOptions",
            "hostPort",
            "mountPropagation",
            "httpGet.host",
            "hostPath",
            "serviceAccountToken",
            "volumes[2].nfs",
        ] {
            assert!(found.iter().any(|f| f.contains(needle)), "{needle} not in {found:?}");
        }
        assert_eq!(found.len(), 14, "{found:?}");
    }

    #[test]
    fn template_metadata_may_carry_labels_and_allow_listed_annotations_only() {
        let template: PodTemplateSpec = serde_json::from_value(json!({
            "metadata": {"labels": {"a": "b"}, "finalizers": ["x"],
                         "annotations": {"kubectl.kubernetes.io/default-container": "c",
                                         "container.apparmor.security.beta.kubernetes.io/c": "unconfined"}},
            "spec": {"containers": [container(json!({}))]},
        }))
        .unwrap();
        let found = violations(&template, &PodPolicy::default());
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(found[0].contains("apparmor"), "{found:?}");
        assert!(found[1].contains("finalizers"), "{found:?}");
    }

    #[test]
    fn annotations_host_plugins_read_are_refused_by_key_never_echoing_the_value() {
        let secret_value = "s3cr3t-network-config";
        let annotations = [
            "k8s.v1.cni.cncf.io/networks",
            "cni.projectcalico.org/ipAddrs",
            "sidecar.istio.io/inject",
            "io.kubernetes.cri-o.Devices",
            "prometheus.io/scrape",
            "no-domain",
        ];
        let keyed: Map<String, Value> = annotations
            .iter()
            .map(|k| (k.to_string(), json!(secret_value)))
            .collect();
        let template: PodTemplateSpec = serde_json::from_value(json!({
            "metadata": {"annotations": keyed},
            "spec": {"containers": [container(json!({}))]},
        }))
        .unwrap();
        let found = violations(&template, &PodPolicy::default());
        assert_eq!(found.len(), annotations.len(), "{found:?}");
        for key in annotations {
            assert!(
                found
                    .iter()
                    .any(|f| f.starts_with(&format!("spec.template.metadata.annotations[{key}]"))),
                "{key}: {found:?}"
            );
        }
        assert!(found.iter().all(|f| !f.contains(secret_value)), "{found:?}");
    }

    #[test]
    fn a_localhost_apparmor_profile_is_refused_and_runtime_default_allowed() {
        let localhost = json!({"type": "Localhost", "localhostProfile": "node-unconfined"});
        one_refusal(
            json!({"securityContext": {"appArmorProfile": localhost},
                   "containers": [container(json!({}))]}),
            "spec.template.spec.securityContext.appArmorProfile.type",
        );
        let message = one_refusal(
            json!({"containers": [container(json!({"securityContext": {"appArmorProfile": localhost}}))]}),
            "spec.template.spec.containers[0].securityContext.appArmorProfile.type",
        );
        assert!(message.contains("RuntimeDefault"), "{message}");
        let runtime_default = json!({"type": "RuntimeDefault"});
        assert_eq!(
            refused(json!({"securityContext": {"appArmorProfile": runtime_default},
                           "containers": [container(json!({"securityContext": {"appArmorProfile": runtime_default}}))]})),
            Vec::<String>::new()
        );
    }

    #[test]
    fn the_refusal_names_every_violation_and_the_way_out() {
        let message = refusal(&["a".into(), "b".into()]);
        assert!(message.contains("a; b"), "{message}");
        assert!(message.contains("--insecure-pass-full-deployment"), "{message}");
    }
}
