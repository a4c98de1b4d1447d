//! What a stack's controller pod may ask for (DESIGN.md §3.3): nothing that reaches beyond its own
//! host namespace. Checked when a package is installed and again when its Deployment is built.

use k8s_openapi::api::core::v1::{Container, PodSpec};

/// Every reason `spec` is refused, as sentences naming the offending field; empty when it is allowed.
pub fn violations(spec: &PodSpec) -> Vec<String> {
    let mut found = Vec::new();
    for (flag, field) in [
        (spec.host_network, "hostNetwork"),
        (spec.host_pid, "hostPID"),
        (spec.host_ipc, "hostIPC"),
    ] {
        if flag == Some(true) {
            found.push(format!("spec.{field} is true"));
        }
    }
    for volume in spec.volumes.iter().flatten() {
        if volume.host_path.is_some() {
            found.push(format!("volume {:?} is a hostPath", volume.name));
        }
        let projects_token = volume
            .projected
            .as_ref()
            .and_then(|p| p.sources.as_ref())
            .is_some_and(|sources| sources.iter().any(|s| s.service_account_token.is_some()));
        if projects_token {
            found.push(format!("volume {:?} projects a host serviceAccountToken", volume.name));
        }
    }
    let containers = spec.init_containers.iter().flatten().chain(&spec.containers);
    for container in containers {
        found.extend(container_violations(container));
    }
    found
}

fn container_violations(container: &Container) -> Vec<String> {
    let mut found: Vec<String> = container
        .ports
        .iter()
        .flatten()
        .filter_map(|p| p.host_port)
        .map(|port| format!("container {:?} binds host port {port}", container.name))
        .collect();
    let Some(security) = &container.security_context else {
        return found;
    };
    if security.privileged == Some(true) {
        found.push(format!("container {:?} is privileged", container.name));
    }
    let added = security
        .capabilities
        .as_ref()
        .and_then(|c| c.add.as_ref())
        .filter(|add| !add.is_empty());
    if let Some(added) = added {
        found.push(format!(
            "container {:?} adds capabilities {}",
            container.name,
            added.join(", ")
        ));
    }
    found
}

/// The refusal message for a pod spec with `violations`.
pub fn refusal(violations: &[String]) -> String {
    format!(
        "the stack's controller pod spec is refused because it could reach beyond its namespace: {}; remove these from the package's install.yaml (or run stackd with --insecure-pass-full-deployment)",
        violations.join("; ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec(value: serde_json::Value) -> PodSpec {
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn a_plain_pod_is_allowed() {
        assert!(violations(&spec(json!({"containers": [{"name": "c", "image": "i"}]}))).is_empty());
    }

    #[test]
    fn host_access_is_refused() {
        let found = violations(&spec(json!({
            "hostNetwork": true,
            "volumes": [{"name": "root", "hostPath": {"path": "/"}},
                        {"name": "tok", "projected": {"sources": [{"serviceAccountToken": {"path": "t"}}]}}],
            "initContainers": [{"name": "i", "securityContext": {"privileged": true}}],
            "containers": [{"name": "c", "securityContext": {"capabilities": {"add": ["NET_ADMIN"]}},
                            "ports": [{"containerPort": 80, "hostPort": 80}]}]
        })));
        assert_eq!(found.len(), 6, "{found:?}");
        assert!(found.iter().any(|f| f.contains("hostPath")));
        assert!(found.iter().any(|f| f.contains("NET_ADMIN")));
    }
}
