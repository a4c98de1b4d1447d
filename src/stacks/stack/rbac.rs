//! The stack's identity and permissions on the tenant (DESIGN.md §3.3 steps 1–2): permission
//! validation, the ServiceAccount, the system ClusterRole and its binding, and the persona roles that
//! aggregate the stack's CRDs into `admin`/`edit`/`view`. Everything here is pure.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, RoleBinding, RoleRef, Subject};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

use kube::ResourceExt;

use super::tenant::TenantIdentity;
use crate::api::stacks::{PermissionScope, Stack, StackDefinition, StackDefinitionSpec, StackSpec};
use crate::context::crd_groups::CrdGroups;
use crate::stacks::rbac_verbs::ALLOWED_VERBS;
use crate::stacks::unpack::split_dependency;
use crate::stacks::{COMPATIBILITY_GROUP, MANAGED_CRD_LABEL, crd_parent_label, reserved_group_owner};

/// Core resources every stack may use: the default rule `stackd unpack` generates.
const DEFAULT_CORE_RESOURCES: [&str; 3] = ["configmaps", "events", "secrets"];

/// Personas a stack's CRDs are aggregated into, with the verbs each gets: admin and edit all a
/// stack's rules may use, view the reading ones.
pub const PERSONAS: [(&str, &[&str]); 3] = [
    ("admin", &ALLOWED_VERBS),
    ("edit", &ALLOWED_VERBS),
    ("view", &["get", "list", "watch"]),
];

/// Allows only rules within the stack's own API: the API groups of its CRDs and of the CRDs it depends
/// on (never stackd's or Kubernetes' groups, and a dependency only in a group another stack's
/// install created, per `tenant_crds`, or one of the platform's groups the host's operators listed),
/// the default core rule's resources, and the verbs of [`ALLOWED_VERBS`]. Returns a message a user
/// can act on, naming each thing refused once.
pub fn validate_permissions(
    spec: &StackSpec,
    tenant_crds: &[Arc<CustomResourceDefinition>],
    platform_groups: &CrdGroups,
) -> Result<(), String> {
    let StackGroups {
        allowed: groups,
        refused_groups,
        refusals: mut refused,
    } = stack_groups(spec, tenant_crds, platform_groups);
    for rule in &spec.permissions.rules {
        if rule.non_resource_urls.as_ref().is_some_and(|urls| !urls.is_empty()) {
            refused.push(format!(
                "non-resource URLs {:?}",
                rule.non_resource_urls.clone().unwrap_or_default()
            ));
        }
        let resources = rule.resources.clone().unwrap_or_default();
        let rule_groups = rule.api_groups.clone().unwrap_or_default();
        if rule_groups.is_empty() && !resources.is_empty() {
            refused.push(format!("resources {resources:?} without an API group"));
        }
        for group in &rule_groups {
            if group.is_empty() {
                let beyond: Vec<&String> = resources
                    .iter()
                    .filter(|r| !DEFAULT_CORE_RESOURCES.contains(&r.as_str()))
                    .collect();
                if !beyond.is_empty() || resources.is_empty() {
                    let named = if resources.is_empty() {
                        vec!["*".to_string()]
                    } else {
                        resources.clone()
                    };
                    refused.push(format!(
                        "core resources {named:?} (only {} are allowed)",
                        DEFAULT_CORE_RESOURCES.join(", ")
                    ));
                }
            } else if !groups.contains(group) && !refused_groups.contains(group) {
                refused.push(format!(
                    "API group {group:?} (only the groups of the stack's own CRDs and dependencies are allowed{})",
                    if groups.is_empty() {
                        String::new()
                    } else {
                        format!(": {}", groups.iter().cloned().collect::<Vec<_>>().join(", "))
                    }
                ));
            }
        }
        let verbs: Vec<&String> = rule
            .verbs
            .iter()
            .filter(|verb| !ALLOWED_VERBS.contains(&verb.as_str()))
            .collect();
        if !verbs.is_empty() {
            refused.push(format!(
                "verbs {verbs:?} (only {} are allowed)",
                ALLOWED_VERBS.join(", ")
            ));
        }
    }
    let mut seen = BTreeSet::new();
    refused.retain(|message| seen.insert(message.clone()));
    if refused.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "the stack requests permissions stackd does not grant: {}; remove them from the package, or run stackd with --insecure-allow-all-apigroups",
            refused.join("; ")
        ))
    }
}

/// The API groups of a stack's CRDs and dependencies, judged.
struct StackGroups {
    /// Groups its rules may name.
    allowed: BTreeSet<String>,
    /// Groups refused (said in `refusals` already: rules in them are not refused a second time).
    refused_groups: BTreeSet<String>,
    refusals: Vec<String>,
}

/// The API groups of the stack's CRDs and dependencies, and what is refused among them: a stack never
/// claims a group of stackd's or Kubernetes', and depends only on groups stacks installed or the
/// platform's groups the host allows (`--platform-dependency-groups`).
fn stack_groups(
    spec: &StackSpec,
    tenant_crds: &[Arc<CustomResourceDefinition>],
    platform_groups: &CrdGroups,
) -> StackGroups {
    let owned = spec
        .customresourcedefinitions
        .iter()
        .map(|reference| reference.api_version.split('/').next().unwrap_or_default().to_string());
    let depended = spec
        .metadata
        .depends_on
        .iter()
        .filter_map(|dependency| dependency.crd.as_deref().and_then(split_dependency))
        .map(|(_, group)| group.to_string());
    let mut judged = StackGroups {
        allowed: BTreeSet::new(),
        refused_groups: BTreeSet::new(),
        refusals: Vec::new(),
    };
    let owned: BTreeSet<String> = owned.collect();
    for group in owned.iter().cloned().chain(depended.collect::<BTreeSet<_>>()) {
        if judged.allowed.contains(&group) || judged.refused_groups.contains(&group) {
            continue;
        }
        let refusal = if let Some(owner) = reserved_group_owner(&group) {
            Some(format!("CRDs in API group {group:?}, which belongs to {owner}"))
        } else if owned.contains(&group) || platform_groups.allows(&group) || installed_by_stacks(&group, tenant_crds) {
            None
        } else {
            Some(format!(
                "a dependency on API group {group:?}, which is neither on the host's list of platform groups (--platform-dependency-groups) nor installed by a stack: install the stack that provides it first, or ask the host's operators to list it"
            ))
        };
        match refusal {
            Some(refusal) => {
                judged.refusals.push(refusal);
                judged.refused_groups.insert(group);
            }
            None => {
                judged.allowed.insert(group);
            }
        }
    }
    judged
}

/// True when `group` has CRDs on the tenant and stackd created every one of them for a stack: a
/// dependency on anyone else's API (a third party's CRDs, a group Kubernetes serves) would hand the
/// stack full access to it.
fn installed_by_stacks(group: &str, tenant_crds: &[Arc<CustomResourceDefinition>]) -> bool {
    let mut in_group = tenant_crds.iter().filter(|crd| crd.spec.group == group).peekable();
    in_group.peek().is_some() && in_group.all(|crd| crd.labels().contains_key(MANAGED_CRD_LABEL))
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
    // The install's annotations (e.g. a cloud identity to assume), under stackd's own: a user's key
    // never replaces the annotation that marks the account as this stack's.
    let mut annotations: BTreeMap<String, String> = stack
        .spec
        .controller
        .service_account
        .as_ref()
        .map(|sa| sa.annotations.clone())
        .unwrap_or_default();
    annotations.extend(meta.annotations.take().unwrap_or_default());
    meta.annotations = Some(annotations);
    ServiceAccount {
        metadata: meta,
        ..Default::default()
    }
}

/// The stack's rules; a templating stack's controller may also read its own StackDefinition (and
/// no other), as Crossplane granted it.
pub fn system_role(stack: &Stack, identity: &TenantIdentity) -> ClusterRole {
    let mut rules = stack.spec.permissions.rules.clone();
    if stack.spec.behavior.is_some() {
        rules.push(PolicyRule {
            api_groups: Some(vec![COMPATIBILITY_GROUP.into()]),
            resources: Some(vec!["stackdefinitions".into()]),
            resource_names: Some(vec![identity.name.clone()]),
            verbs: ["get", "list", "watch"].map(String::from).to_vec(),
            ..Default::default()
        });
    }
    ClusterRole {
        metadata: identity.meta_cluster(&system_role_name(identity)),
        rules: Some(rules),
        ..Default::default()
    }
}

/// A templating stack's StackDefinition, named and owned by the Stack: what its controller reads
/// at its start (the behavior, and the scope that limits it to the Stack's namespace).
pub fn stack_definition(stack: &Stack, identity: &TenantIdentity, owner: &OwnerReference) -> Option<StackDefinition> {
    let behavior = stack.spec.behavior.clone()?;
    let spec = StackDefinitionSpec {
        behavior,
        permission_scope: stack.spec.permission_scope,
        title: stack.spec.title.clone(),
        version: stack.spec.version.clone(),
    };
    Some(StackDefinition {
        metadata: identity.meta(&identity.name, Some(owner)),
        spec,
    })
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

/// The persona ClusterRoles for the stack's CRDs, or the CRDs not installed for it yet (by
/// `group/kind`). Only CRDs its install labelled for it count: aggregating any other CRD into
/// `admin`/`edit`/`view` would hand every user of those roles someone else's API.
pub fn persona_roles(
    stack: &Stack,
    identity: &TenantIdentity,
    crds: &[Arc<CustomResourceDefinition>],
) -> Result<Vec<ClusterRole>, Vec<String>> {
    let mut resources: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut missing = Vec::new();
    let label = crd_parent_label(&identity.namespace, &identity.name);
    for reference in &stack.spec.customresourcedefinitions {
        let group = reference.api_version.split('/').next().unwrap_or_default();
        let found = crds.iter().find(|crd| {
            crd.spec.group == group && crd.spec.names.kind == reference.kind && crd.labels().contains_key(&label)
        });
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

    fn rule(groups: &[&str], resources: &[&str], verbs: &[&str]) -> PolicyRule {
        PolicyRule {
            api_groups: Some(groups.iter().map(|g| g.to_string()).collect()),
            resources: Some(resources.iter().map(|r| r.to_string()).collect()),
            verbs: verbs.iter().map(|v| v.to_string()).collect(),
            ..Default::default()
        }
    }

    fn spec(rules: Vec<PolicyRule>) -> StackSpec {
        serde_json::from_value(serde_json::json!({
            "customresourcedefinitions": [{"apiVersion": "samples.example.org/v1alpha1", "kind": "Widget"}],
            "dependsOn": [{"crd": "gadgets.gadgets.example.org/v1"}],
            "permissions": {"rules": rules},
        }))
        .expect("spec")
    }

    fn tenant_crd(plural: &str, group: &str, managed: bool) -> Arc<CustomResourceDefinition> {
        let labels = if managed {
            serde_json::json!({MANAGED_CRD_LABEL: "true"})
        } else {
            serde_json::json!({})
        };
        Arc::new(
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": format!("{plural}.{group}"), "labels": labels},
                "spec": {
                    "group": group,
                    "names": {"kind": "Thing", "plural": plural},
                    "scope": "Namespaced",
                    "versions": [{"name": "v1", "served": true, "storage": true}],
                }
            }))
            .expect("crd"),
        )
    }

    /// The tenant's CRDs: the dependency's, which another stack's install created.
    fn tenant_crds() -> Vec<Arc<CustomResourceDefinition>> {
        vec![tenant_crd("gadgets", "gadgets.example.org", true)]
    }

    fn no_platform_groups() -> CrdGroups {
        "".parse().expect("an empty list")
    }

    fn depending_on(crd: &str) -> StackSpec {
        let (plural, group) = split_dependency(crd).expect("dependency");
        let mut spec = spec(vec![rule(&[group], &[plural], &ALLOWED_VERBS)]);
        spec.metadata.depends_on[0].crd = Some(crd.into());
        spec
    }

    #[test]
    fn a_dependency_on_a_platform_group_is_allowed_whoever_made_its_crds() {
        let platform = CrdGroups::platform_types();
        let mut tenant = tenant_crds();
        tenant.push(tenant_crd("mysqlinstances", "database.crossplane.io", false));
        let claims = depending_on("*.database.crossplane.io/v1alpha1");
        assert_eq!(validate_permissions(&claims, &tenant, &platform), Ok(()));
        // core.crossplane.io has no CRD at all in Crossplane v0.8, and is listed all the same.
        assert_eq!(
            validate_permissions(&depending_on("*.core.crossplane.io/v1alpha1"), &[], &platform),
            Ok(())
        );
        let refused = validate_permissions(&claims, &tenant, &no_platform_groups()).expect_err("not listed");
        assert!(refused.contains("--platform-dependency-groups"), "{refused}");
        // The platform list never opens stackd's or Kubernetes' groups.
        let everything: CrdGroups = "*".parse().expect("any group");
        let message = validate_permissions(&depending_on("deployments.apps/v1"), &[], &everything).expect_err("apps");
        assert!(message.contains("belongs to Kubernetes"), "{message}");
    }

    #[test]
    fn each_refused_dependency_group_is_named_once() {
        let mut spec = depending_on("mysqlinstances.database.crossplane.io/v1alpha1");
        let mut second = spec.metadata.depends_on[0].clone();
        second.crd = Some("postgresqlinstances.database.crossplane.io/v1alpha1".into());
        spec.metadata.depends_on.push(second);
        spec.permissions
            .rules
            .push(rule(&["database.crossplane.io"], &["postgresqlinstances"], &["get"]));
        let message = validate_permissions(&spec, &[], &no_platform_groups()).expect_err("refused");
        assert_eq!(message.matches("database.crossplane.io").count(), 1, "{message}");
    }

    #[test]
    fn a_dependency_grants_only_a_group_whose_crds_stacks_installed() {
        assert_eq!(
            validate_permissions(
                &depending_on("gadgets.gadgets.example.org/v1"),
                &tenant_crds(),
                &no_platform_groups()
            ),
            Ok(())
        );
        let not_yet = validate_permissions(
            &depending_on("gadgets.gadgets.example.org/v1"),
            &[],
            &no_platform_groups(),
        )
        .expect_err("refused");
        assert!(
            not_yet.contains("\"gadgets.example.org\", which is neither on the host's list of platform groups"),
            "{not_yet}"
        );
        let mut tenant = tenant_crds();
        tenant.push(tenant_crd("policyexceptions", "kyverno.io", false));
        let third_party = validate_permissions(
            &depending_on("policyexceptions.kyverno.io/v2"),
            &tenant,
            &no_platform_groups(),
        )
        .expect_err("refused");
        assert!(third_party.contains("\"kyverno.io\""), "{third_party}");
        // A third party's CRD next to a stack's in one group: the group is not the stacks' alone.
        tenant.push(tenant_crd("intruders", "gadgets.example.org", false));
        assert!(
            validate_permissions(
                &depending_on("gadgets.gadgets.example.org/v1"),
                &tenant,
                &no_platform_groups()
            )
            .is_err()
        );
        for builtin in ["deployments.apps/v1", "jobs.batch/v1", "poddisruptionbudgets.policy/v1"] {
            let message =
                validate_permissions(&depending_on(builtin), &tenant_crds(), &no_platform_groups()).expect_err(builtin);
            assert!(message.contains("belongs to Kubernetes"), "{builtin}: {message}");
        }
    }

    #[test]
    fn the_generated_rules_are_allowed() {
        let rules = vec![
            rule(&["", ""], &["configmaps", "events", "secrets"], &ALLOWED_VERBS),
            rule(&["samples.example.org"], &["widgets", "widgets/status"], &ALLOWED_VERBS),
            rule(&["gadgets.example.org"], &["gadgets"], &["get", "list", "watch"]),
        ];
        assert_eq!(
            validate_permissions(&spec(rules), &tenant_crds(), &no_platform_groups()),
            Ok(())
        );
    }

    #[test]
    fn groups_beyond_the_stacks_own_wildcards_and_urls_are_refused_with_the_opt_out_named() {
        for bad in [
            rule(&["apps"], &["deployments"], &["get"]),
            rule(&["rbac.authorization.k8s.io"], &["clusterroles"], &["get"]),
            rule(&["other.example.org"], &["things"], &["get"]),
            rule(&["*"], &["*"], &["get"]),
            rule(&[""], &["pods"], &["get"]),
            rule(&[""], &[], &["get"]),
            rule(&[], &["widgets"], &["get"]),
        ] {
            let message = validate_permissions(&spec(vec![bad.clone()]), &tenant_crds(), &no_platform_groups())
                .expect_err("refused");
            assert!(message.contains("--insecure-allow-all-apigroups"), "{bad:?}: {message}");
        }
        let urls = PolicyRule {
            non_resource_urls: Some(vec!["/metrics".into()]),
            verbs: vec!["get".into()],
            ..Default::default()
        };
        let message =
            validate_permissions(&spec(vec![urls]), &tenant_crds(), &no_platform_groups()).expect_err("refused");
        assert!(message.contains("/metrics"));
    }

    #[test]
    fn verbs_beyond_reading_and_writing_are_refused_even_on_allowed_resources() {
        for verb in ["*", "escalate", "bind", "impersonate", "approve"] {
            for resources in [&["secrets"][..], &["widgets"][..]] {
                let group = if resources == ["secrets"] {
                    ""
                } else {
                    "samples.example.org"
                };
                let message = validate_permissions(
                    &spec(vec![rule(&[group], resources, &["get", verb])]),
                    &tenant_crds(),
                    &no_platform_groups(),
                )
                .expect_err("refused");
                assert!(message.contains(&format!("verbs [\"{verb}\"]")), "{message}");
            }
        }
    }

    #[test]
    fn a_stack_claiming_stackds_or_kubernetes_groups_is_refused() {
        let mut claims = spec(vec![rule(
            &["stacks.stackd.dev"],
            &["clusterstackinstalls"],
            &["create"],
        )]);
        claims.customresourcedefinitions[0].api_version = "stacks.stackd.dev/v1alpha1".into();
        let message = validate_permissions(&claims, &tenant_crds(), &no_platform_groups()).expect_err("refused");
        assert!(message.contains("belongs to stackd"), "{message}");
        let mut depends = spec(vec![]);
        depends.metadata.depends_on[0].crd = Some("roles.rbac.authorization.k8s.io/v1".into());
        let message = validate_permissions(&depends, &tenant_crds(), &no_platform_groups()).expect_err("refused");
        assert!(message.contains("belongs to Kubernetes"), "{message}");
    }
}
