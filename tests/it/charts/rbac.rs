//! A small RBAC authorizer over rendered manifests: which requests the roles bound to one subject
//! allow, with the rule matching of Kubernetes' RBAC authorizer (verbs, API groups, resources and
//! subresources, `*`, resourceNames; no non-resource URLs), and the escalation check a write of a
//! role or binding meets.

use std::collections::BTreeSet;
use std::fmt;

use serde_json::Value;
use stackd::embedded::counters::RequestCounts;

const RBAC_GROUP: &str = "rbac.authorization.k8s.io";

/// One request as the authorizer sees it. `name` is known only for requests derived from objects
/// (the request counters do not record names).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct Request {
    pub verb: String,
    pub group: String,
    /// `plural` or `plural/subresource`.
    pub resource: String,
    /// Empty for cluster-scoped and all-namespace requests.
    pub namespace: String,
    pub name: Option<String>,
}

impl fmt::Display for Request {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let group = if self.group.is_empty() { "core" } else { &self.group };
        write!(f, "{} {group}/{}", self.verb, self.resource)?;
        if let Some(name) = &self.name {
            write!(f, " {name:?}")?;
        }
        if self.namespace.is_empty() {
            write!(f, " (cluster)")
        } else {
            write!(f, " in {}", self.namespace)
        }
    }
}

impl Request {
    pub(super) fn new(verb: &str, group: &str, resource: &str, namespace: &str) -> Request {
        Request {
            verb: verb.into(),
            group: group.into(),
            resource: resource.into(),
            namespace: namespace.into(),
            name: None,
        }
    }

    pub(super) fn named(mut self, name: &str) -> Request {
        self.name = Some(name.into());
        self
    }

    /// The requests counted by an embedded server (`plural.group/sub` keys).
    pub(super) fn from_counts(counts: &RequestCounts) -> Vec<Request> {
        counts
            .counts
            .keys()
            .map(|key| {
                let (qualified, sub) = match key.resource.split_once('/') {
                    Some((q, s)) => (q, Some(s)),
                    None => (key.resource.as_str(), None),
                };
                let (plural, group) = qualified.split_once('.').unwrap_or((qualified, ""));
                let resource = sub.map_or(plural.to_string(), |s| format!("{plural}/{s}"));
                Request::new(key.verb.as_str(), group, &resource, &key.namespace)
            })
            .collect()
    }
}

/// A PolicyRule.
#[derive(Clone, Debug, Default)]
pub(super) struct Rule {
    pub api_groups: Vec<String>,
    pub resources: Vec<String>,
    pub verbs: Vec<String>,
    pub resource_names: Vec<String>,
}

fn strings(value: &Value) -> Vec<String> {
    value
        .as_array()
        .map(|items| items.iter().filter_map(|v| v.as_str().map(String::from)).collect())
        .unwrap_or_default()
}

impl Rule {
    fn parse(value: &Value) -> Rule {
        Rule {
            api_groups: strings(&value["apiGroups"]),
            resources: strings(&value["resources"]),
            verbs: strings(&value["verbs"]),
            resource_names: strings(&value["resourceNames"]),
        }
    }

    fn has(list: &[String], item: &str) -> bool {
        list.iter().any(|entry| entry == "*" || entry == item)
    }

    fn matches_resource(&self, resource: &str) -> bool {
        let sub = resource.split_once('/').map(|(_, s)| s);
        self.resources
            .iter()
            .any(|entry| entry == "*" || entry == resource || sub.is_some_and(|s| entry.strip_prefix("*/") == Some(s)))
    }

    /// Whether this rule allows `request` (names: only requests for a listed name).
    pub(super) fn allows(&self, request: &Request) -> bool {
        Rule::has(&self.verbs, &request.verb)
            && Rule::has(&self.api_groups, &request.group)
            && self.matches_resource(&request.resource)
            && (self.resource_names.is_empty()
                || request
                    .name
                    .as_ref()
                    .is_some_and(|name| self.resource_names.contains(name)))
    }

    /// Every (group, resource, verb) this rule names, as requests (named when the rule lists names).
    fn requests(&self, namespace: &str) -> Vec<Request> {
        let mut requests = Vec::new();
        for group in &self.api_groups {
            for resource in &self.resources {
                for verb in &self.verbs {
                    let request = Request::new(verb, group, resource, namespace);
                    if self.resource_names.is_empty() {
                        requests.push(request);
                    } else {
                        requests.extend(self.resource_names.iter().map(|n| request.clone().named(n)));
                    }
                }
            }
        }
        requests
    }
}

/// The smallest unit of a grant: one verb on one resource of one group, in one role.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct Permission {
    /// `ClusterRole/<name>` or `Role/<namespace>/<name>`.
    pub role: String,
    pub group: String,
    pub resource: String,
    pub verb: String,
}

impl fmt::Display for Permission {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let group = if self.group.is_empty() { "core" } else { &self.group };
        write!(f, "{}: {} {group}/{}", self.role, self.verb, self.resource)
    }
}

/// A role bound to the subject, in a scope.
#[derive(Clone, Debug)]
struct Grant {
    role: String,
    rules: Vec<Rule>,
    /// `None`: cluster-wide (a ClusterRoleBinding).
    namespace: Option<String>,
}

/// A ServiceAccount, User or Group as a binding names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Subject {
    pub kind: String,
    pub name: String,
    pub namespace: Option<String>,
}

impl Subject {
    pub(super) fn service_account(namespace: &str, name: &str) -> Subject {
        Subject {
            kind: "ServiceAccount".into(),
            name: name.into(),
            namespace: Some(namespace.into()),
        }
    }

    fn is_in(&self, binding: &Value) -> bool {
        binding["subjects"].as_array().into_iter().flatten().any(|s| {
            s["kind"] == self.kind.as_str()
                && s["name"] == self.name.as_str()
                && (self.kind != "ServiceAccount" || s["namespace"].as_str() == self.namespace.as_deref())
        })
    }
}

fn kind(object: &Value) -> &str {
    object["kind"].as_str().unwrap_or("")
}

fn name(object: &Value) -> &str {
    object["metadata"]["name"].as_str().unwrap_or("")
}

fn namespace(object: &Value) -> &str {
    object["metadata"]["namespace"].as_str().unwrap_or("")
}

fn role_id(object: &Value) -> String {
    match kind(object) {
        "Role" => format!("Role/{}/{}", namespace(object), name(object)),
        other => format!("{other}/{}", name(object)),
    }
}

/// The role a binding refers to, among `objects`.
fn referenced_role<'a>(objects: &'a [Value], binding: &Value) -> Option<&'a Value> {
    let role_kind = binding["roleRef"]["kind"].as_str()?;
    let role_name = binding["roleRef"]["name"].as_str()?;
    objects.iter().find(|o| {
        kind(o) == role_kind
            && name(o) == role_name
            && (role_kind == "ClusterRole" || namespace(o) == namespace(binding))
    })
}

fn rules_of(role: &Value) -> Vec<Rule> {
    role["rules"]
        .as_array()
        .into_iter()
        .flatten()
        .map(Rule::parse)
        .collect()
}

/// What the roles bound to one subject allow.
#[derive(Clone, Debug)]
pub(super) struct Authorizer {
    grants: Vec<Grant>,
}

impl Authorizer {
    /// From every Role, ClusterRole, RoleBinding and ClusterRoleBinding in `objects`.
    pub(super) fn for_subject(objects: &[Value], subject: &Subject) -> Authorizer {
        let grants = objects
            .iter()
            .filter(|o| matches!(kind(o), "RoleBinding" | "ClusterRoleBinding") && subject.is_in(o))
            .filter_map(|binding| {
                let role = referenced_role(objects, binding)?;
                Some(Grant {
                    role: role_id(role),
                    rules: rules_of(role),
                    namespace: (kind(binding) == "RoleBinding").then(|| namespace(binding).to_string()),
                })
            })
            .collect();
        Authorizer { grants }
    }

    fn in_scope<'a>(&'a self, request: &'a Request) -> impl Iterator<Item = &'a Grant> + 'a {
        self.grants.iter().filter(move |g| {
            g.namespace
                .as_deref()
                .is_none_or(|ns| !request.namespace.is_empty() && ns == request.namespace)
        })
    }

    pub(super) fn allows(&self, request: &Request) -> bool {
        self.in_scope(request)
            .any(|g| g.rules.iter().any(|r| r.allows(request)))
    }

    /// The permissions through which `request` is allowed (empty when it is denied).
    pub(super) fn used_by(&self, request: &Request) -> BTreeSet<Permission> {
        let mut used = BTreeSet::new();
        for grant in self.in_scope(request) {
            for rule in grant.rules.iter().filter(|r| r.allows(request)) {
                // Record the rule's own entries, so a `*` rule shows as `*`.
                let pick = |list: &[String], item: &str| {
                    if list.iter().any(|e| e == item) {
                        item.to_string()
                    } else {
                        "*".to_string()
                    }
                };
                let resource = if rule.resources.iter().any(|e| e == &request.resource) {
                    request.resource.clone()
                } else {
                    rule.resources
                        .iter()
                        .find(|e| e.starts_with('*'))
                        .cloned()
                        .unwrap_or_default()
                };
                used.insert(Permission {
                    role: grant.role.clone(),
                    group: pick(&rule.api_groups, &request.group),
                    resource,
                    verb: pick(&rule.verbs, &request.verb),
                });
            }
        }
        used
    }
}

/// Every permission the named roles grant.
pub(super) fn permissions(objects: &[Value], roles: &[String]) -> BTreeSet<Permission> {
    let mut all = BTreeSet::new();
    for role in objects.iter().filter(|o| roles.contains(&role_id(o))) {
        for rule in rules_of(role) {
            for group in &rule.api_groups {
                for resource in &rule.resources {
                    for verb in &rule.verbs {
                        all.insert(Permission {
                            role: role_id(role),
                            group: group.clone(),
                            resource: resource.clone(),
                            verb: verb.clone(),
                        });
                    }
                }
            }
        }
    }
    all
}

/// The roles bound to `subject` in `objects`, as `ClusterRole/<name>` or `Role/<ns>/<name>`.
pub(super) fn bound_roles(objects: &[Value], subject: &Subject) -> Vec<String> {
    let mut roles: Vec<String> = Authorizer::for_subject(objects, subject)
        .grants
        .into_iter()
        .map(|g| g.role)
        .collect();
    roles.sort();
    roles.dedup();
    roles
}

/// The checks Kubernetes makes when `subject` writes the roles and bindings in `written`, as
/// requests: writing a role that grants more than the writer holds needs `escalate` on it;
/// writing a binding needs `bind` on its role unless the writer already holds every permission of
/// that role in the binding's scope (judged without the binding itself). `objects` is everything
/// RBAC the server holds.
pub(super) fn escalation_checks(objects: &[Value], written: &[Value], subject: &Subject) -> Vec<Request> {
    let mut checks = Vec::new();
    for object in written {
        let scope = match kind(object) {
            "Role" | "RoleBinding" => namespace(object),
            _ => "",
        };
        match kind(object) {
            "Role" | "ClusterRole" => {
                let holder = Authorizer::for_subject(objects, subject);
                let granted: Vec<Request> = rules_of(object).iter().flat_map(|rule| rule.requests(scope)).collect();
                let exceeds = granted.iter().any(|request| !holder.allows(request));
                if !exceeds {
                    // Kubernetes checks that the writer holds every permission the role grants:
                    // holding them is what lets the write through, so each counts as used.
                    checks.extend(granted);
                } else {
                    let resource = if kind(object) == "Role" {
                        "roles"
                    } else {
                        "clusterroles"
                    };
                    checks.push(Request::new("escalate", RBAC_GROUP, resource, scope).named(name(object)));
                }
            }
            "RoleBinding" | "ClusterRoleBinding" => {
                let others: Vec<Value> = objects
                    .iter()
                    .filter(|o| !(kind(o) == kind(object) && name(o) == name(object) && namespace(o) == scope))
                    .cloned()
                    .collect();
                let holder = Authorizer::for_subject(&others, subject);
                let role = referenced_role(objects, object);
                let granted: Vec<Request> = role
                    .map(|role| rules_of(role).iter().flat_map(|rule| rule.requests(scope)).collect())
                    .unwrap_or_default();
                let holds_all = role.is_some() && granted.iter().all(|request| holder.allows(request));
                if holds_all {
                    checks.extend(granted);
                } else {
                    let resource = if object["roleRef"]["kind"] == "Role" {
                        "roles"
                    } else {
                        "clusterroles"
                    };
                    let role_name = object["roleRef"]["name"].as_str().unwrap_or("");
                    checks.push(Request::new("bind", RBAC_GROUP, resource, scope).named(role_name));
                }
            }
            _ => {}
        }
    }
    checks
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn objects() -> Vec<Value> {
        vec![
            json!({"kind": "ClusterRole", "metadata": {"name": "cluster"}, "rules": [
                {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "create"]},
                {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["clusterroles"], "verbs": ["bind"], "resourceNames": ["ns-role"]},
            ]}),
            json!({"kind": "ClusterRole", "metadata": {"name": "ns-role"}, "rules": [
                {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["*"]},
                {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
            ]}),
            json!({"kind": "ClusterRoleBinding", "metadata": {"name": "cluster"},
                "roleRef": {"kind": "ClusterRole", "name": "cluster"},
                "subjects": [{"kind": "ServiceAccount", "name": "d", "namespace": "sys"}]}),
            json!({"kind": "RoleBinding", "metadata": {"name": "b", "namespace": "t1"},
                "roleRef": {"kind": "ClusterRole", "name": "ns-role"},
                "subjects": [{"kind": "ServiceAccount", "name": "d", "namespace": "sys"}]}),
        ]
    }

    fn daemon() -> Subject {
        Subject::service_account("sys", "d")
    }

    #[test]
    fn a_role_binding_grants_only_in_its_namespace() {
        let authz = Authorizer::for_subject(&objects(), &daemon());
        assert!(authz.allows(&Request::new("delete", "batch", "jobs", "t1")));
        assert!(!authz.allows(&Request::new("delete", "batch", "jobs", "t2")));
        assert!(!authz.allows(&Request::new("list", "batch", "jobs", "")));
        assert!(authz.allows(&Request::new("list", "", "namespaces", "")));
    }

    #[test]
    fn subresources_and_names_must_match_exactly() {
        let authz = Authorizer::for_subject(&objects(), &daemon());
        assert!(authz.allows(&Request::new("get", "", "pods/log", "t1")));
        assert!(!authz.allows(&Request::new("get", "", "pods", "t1")));
        let bind = Request::new("bind", RBAC_GROUP, "clusterroles", "t1");
        assert!(!authz.allows(&bind), "a name-restricted rule needs a name");
        assert!(authz.allows(&bind.clone().named("ns-role")));
        assert!(!authz.allows(&bind.named("cluster-admin")));
    }

    #[test]
    fn another_subject_gets_nothing() {
        let authz = Authorizer::for_subject(&objects(), &Subject::service_account("sys", "other"));
        assert!(!authz.allows(&Request::new("list", "", "namespaces", "")));
    }

    #[test]
    fn a_binding_needs_bind_unless_the_writer_holds_the_role() {
        let objects = objects();
        let binding = objects[3].clone();
        let checks = escalation_checks(&objects, &[binding], &daemon());
        assert_eq!(
            checks,
            vec![Request::new("bind", RBAC_GROUP, "clusterroles", "t1").named("ns-role")]
        );
        let mut more = objects.clone();
        more.push(
            json!({"kind": "Role", "metadata": {"name": "jobs", "namespace": "t1"}, "rules": [
            {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["get"]}]}),
        );
        more.push(
            json!({"kind": "RoleBinding", "metadata": {"name": "jobs", "namespace": "t1"},
            "roleRef": {"kind": "Role", "name": "jobs"}, "subjects": [{"kind": "User", "name": "u"}]}),
        );
        // Writing a role and binding within what the writer holds needs neither escalate nor
        // bind; the permissions it holds are what Kubernetes checks instead.
        let checks = escalation_checks(&more, &more[4..], &daemon());
        assert!(
            checks.iter().all(|c| c.verb != "bind" && c.verb != "escalate"),
            "{checks:?}"
        );
        assert!(
            checks.contains(&Request::new("get", "batch", "jobs", "t1")),
            "{checks:?}"
        );
    }

    #[test]
    fn permissions_and_their_use_are_per_verb() {
        let objects = objects();
        let roles = bound_roles(&objects, &daemon());
        assert_eq!(roles, vec!["ClusterRole/cluster", "ClusterRole/ns-role"]);
        let all = permissions(&objects, &roles);
        assert_eq!(all.len(), 5);
        let authz = Authorizer::for_subject(&objects, &daemon());
        let used = authz.used_by(&Request::new("create", "batch", "jobs", "t1"));
        assert_eq!(used.iter().map(|p| p.verb.as_str()).collect::<Vec<_>>(), ["*"]);
    }
}
