//! The stack's identity and permissions on the tenant (DESIGN.md §3.3 steps 1–2): permission
//! validation, the ServiceAccount, the system ClusterRole and its binding, and the persona roles that
//! aggregate the stack's CRDs into `admin`/`edit`/`view`. Everything here is pure.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, RoleBinding, RoleRef, Subject};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

use super::tenant::TenantIdentity;
use crate::api::stacks::{PermissionScope, Stack};

/// Core resources every stack may use: the default rule `stackd unpack` generates.
const DEFAULT_CORE_RESOURCES: [&str; 3] = ["configmaps", "events", "secrets"];

/// Personas a stack's CRDs are aggregated into, with the verbs each gets.
pub const PERSONAS: [(&str, &[&str]); 3] = [
    (
        "admin",
        &[
            "get",
            "list",
            "watch",
            "create",
            "update",
            "patch",
            "delete",
            "deletecollection",
        ],
    ),
    (
        "edit",
        &[
            "get",
            "list",
            "watch",
            "create",
            "update",
            "patch",
            "delete",
            "deletecollection",
        ],
    ),
    ("view", &["get", "list", "watch"]),
];

/// Refuses rules reaching beyond the stack's own API: any `*.k8s.io` group, the wildcard group, core
/// resources beyond the default rule, and non-resource URLs. Returns a message a user can act on.
pub fn validate_permissions(rules: &[PolicyRule]) -> Result<(), String> {
    let mut refused = Vec::new();
    for rule in rules {
        if rule.non_resource_urls.as_ref().is_some_and(|urls| !urls.is_empty()) {
            refused.push(format!(
                "non-resource URLs {:?}",
                rule.non_resource_urls.clone().unwrap_or_default()
            ));
        }
        for group in rule.api_groups.iter().flatten() {
            if group == "*" || group == "k8s.io" || group.ends_with(".k8s.io") {
                refused.push(format!("API group {group:?}"));
            } else if group.is_empty() {
                let resources = rule.resources.clone().unwrap_or_default();
                let beyond: Vec<&String> = resources
                    .iter()
                    .filter(|r| !DEFAULT_CORE_RESOURCES.contains(&r.as_str()))
                    .collect();
                if !beyond.is_empty() || resources.is_empty() {
                    refused.push(format!(
                        "core resources {:?} (only {} are allowed)",
                        if resources.is_empty() {
                            vec!["*".to_string()]
                        } else {
                            resources.clone()
                        },
                        DEFAULT_CORE_RESOURCES.join(", ")
                    ));
                }
            }
        }
    }
    if refused.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "the stack requests permissions stackd does not grant: {}; remove them from the package, or run stackd with --insecure-allow-all-apigroups",
            refused.join("; ")
        ))
    }
}

/// `stackd:<ns>:<stack>`, the binding's name and the prefix of the roles'.
pub fn binding_name(stack: &TenantIdentity) -> String {
    format!("stackd:{}:{}", stack.namespace, stack.name)
}

pub fn system_role_name(stack: &TenantIdentity) -> String {
    format!("{}:system", binding_name(stack))
}

pub fn persona_role_name(stack: &TenantIdentity, persona: &str) -> String {
    format!("{}:{persona}", binding_name(stack))
}

pub fn service_account(stack: &Stack, identity: &TenantIdentity, owner: &OwnerReference) -> ServiceAccount {
    let mut meta = identity.meta(&identity.name, Some(owner));
    let annotations = stack
        .spec
        .controller
        .service_account
        .as_ref()
        .map(|sa| sa.annotations.clone())
        .unwrap_or_default();
    meta.annotations.get_or_insert_default().extend(annotations);
    ServiceAccount {
        metadata: meta,
        ..Default::default()
    }
}

pub fn system_role(stack: &Stack, identity: &TenantIdentity) -> ClusterRole {
    ClusterRole {
        metadata: identity.meta_cluster(&system_role_name(identity)),
        rules: Some(stack.spec.permissions.rules.clone()),
        ..Default::default()
    }
}

fn subjects(identity: &TenantIdentity) -> Option<Vec<Subject>> {
    Some(vec![Subject {
        kind: "ServiceAccount".into(),
        name: identity.name.clone(),
        namespace: Some(identity.namespace.clone()),
        ..Default::default()
    }])
}

fn role_ref(identity: &TenantIdentity) -> RoleRef {
    RoleRef {
        api_group: "rbac.authorization.k8s.io".into(),
        kind: "ClusterRole".into(),
        name: system_role_name(identity),
    }
}

/// The binding for a Namespaced stack: its rules apply in the Stack's namespace only.
pub fn role_binding(identity: &TenantIdentity, owner: &OwnerReference) -> RoleBinding {
    RoleBinding {
        metadata: identity.meta(&binding_name(identity), Some(owner)),
        role_ref: role_ref(identity),
        subjects: subjects(identity),
    }
}

/// The binding for a Cluster stack. Cluster-scoped, so it cannot be owned by the namespaced Stack:
/// uninstall deletes it explicitly.
pub fn cluster_role_binding(identity: &TenantIdentity) -> ClusterRoleBinding {
    ClusterRoleBinding {
        metadata: identity.meta_cluster(&binding_name(identity)),
        role_ref: role_ref(identity),
        subjects: subjects(identity),
    }
}

/// Whether the stack's binding is a RoleBinding or a ClusterRoleBinding.
pub fn binds_cluster_wide(stack: &Stack) -> bool {
    stack.spec.permission_scope == PermissionScope::Cluster
}

/// The persona ClusterRoles for the stack's CRDs, or the CRDs not served yet (by `group/kind`).
pub fn persona_roles(
    stack: &Stack,
    identity: &TenantIdentity,
    crds: &[std::sync::Arc<CustomResourceDefinition>],
) -> Result<Vec<ClusterRole>, Vec<String>> {
    let mut resources: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut missing = Vec::new();
    for reference in &stack.spec.customresourcedefinitions {
        let group = reference.api_version.split('/').next().unwrap_or_default();
        let found = crds
            .iter()
            .find(|crd| crd.spec.group == group && crd.spec.names.kind == reference.kind);
        match found {
            Some(crd) => resources
                .entry(group.to_string())
                .or_default()
                .push(crd.spec.names.plural.clone()),
            None => missing.push(format!("{}.{group}", reference.kind)),
        }
    }
    if !missing.is_empty() {
        return Err(missing);
    }
    let rules: Vec<(String, Vec<String>)> = resources.into_iter().collect();
    Ok(PERSONAS
        .iter()
        .map(|(persona, verbs)| {
            let mut metadata = identity.meta_cluster(&persona_role_name(identity, persona));
            metadata.labels.get_or_insert_default().insert(
                format!("rbac.authorization.k8s.io/aggregate-to-{persona}"),
                "true".into(),
            );
            ClusterRole {
                metadata,
                rules: Some(
                    rules
                        .iter()
                        .map(|(group, plurals)| PolicyRule {
                            api_groups: Some(vec![group.clone()]),
                            resources: Some(plurals.clone()),
                            verbs: verbs.iter().map(|v| v.to_string()).collect(),
                            ..Default::default()
                        })
                        .collect(),
                ),
                ..Default::default()
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(groups: &[&str], resources: &[&str]) -> PolicyRule {
        PolicyRule {
            api_groups: Some(groups.iter().map(|g| g.to_string()).collect()),
            resources: Some(resources.iter().map(|r| r.to_string()).collect()),
            verbs: vec!["*".into()],
            ..Default::default()
        }
    }

    #[test]
    fn the_generated_rules_are_allowed() {
        let rules = [
            rule(&["", ""], &["configmaps", "events", "secrets"]),
            rule(&["samples.example.org"], &["widgets", "widgets/status"]),
        ];
        assert_eq!(validate_permissions(&rules), Ok(()));
    }

    #[test]
    fn core_groups_wildcards_and_urls_are_refused_with_the_opt_out_named() {
        for bad in [
            rule(&["apps"], &["deployments"]),
            rule(&["rbac.authorization.k8s.io"], &["clusterroles"]),
            rule(&["*"], &["*"]),
            rule(&[""], &["pods"]),
            rule(&[""], &[]),
        ] {
            let is_apps = bad.api_groups.as_deref() == Some(&["apps".to_string()][..]);
            let result = validate_permissions(&[bad]);
            if is_apps {
                // `apps` is not a *.k8s.io group: Crossplane allowed it too.
                assert!(result.is_ok());
            } else {
                let message = result.expect_err("refused");
                assert!(message.contains("--insecure-allow-all-apigroups"), "{message}");
            }
        }
        let urls = PolicyRule {
            non_resource_urls: Some(vec!["/metrics".into()]),
            verbs: vec!["get".into()],
            ..Default::default()
        };
        assert!(validate_permissions(&[urls]).expect_err("refused").contains("/metrics"));
    }
}
