//! Network isolation on a shared host (DESIGN.md §8): every tenant's host namespace gets a
//! NetworkPolicy admitting ingress to its pods only from pods of the same namespace (and, with
//! `--monitoring-namespace`, from that namespace's pods, to scrape them), so that code a tenant
//! chose (stack controllers, init containers, installers) cannot reach another tenant's pods. It is
//! written with the ownership proof of DESIGN.md §2 and put back when edited or deleted, like the
//! quota. Egress is left open: stack controllers must reach their tenant's API server and
//! installers their infrastructure.

use std::collections::BTreeMap;

use k8s_openapi::api::networking::v1::{NetworkPolicy, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicySpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::Client;
use kube::api::Api;
use kube::runtime::reflector::{ObjectRef, Store};

use super::apply::Applied;
use super::quota::{QuotaError, ensure, metadata};

/// Name of the NetworkPolicy in every tenant's host namespace.
pub const NETWORK_POLICY_NAME: &str = "stackd-tenant-isolation";
/// The label every namespace carries with its own name (Kubernetes 1.21 and newer).
const NAMESPACE_NAME_LABEL: &str = "kubernetes.io/metadata.name";

/// The tenant's NetworkPolicy: every pod of the namespace admits ingress from the namespace's own
/// pods and, given one, from the pods of the monitoring namespace.
pub fn desired_policy(tenant: &str, namespace: &str, monitoring_namespace: Option<&str>) -> NetworkPolicy {
    let mut from = vec![NetworkPolicyPeer {
        pod_selector: Some(LabelSelector::default()),
        ..NetworkPolicyPeer::default()
    }];
    if let Some(monitoring) = monitoring_namespace {
        from.push(NetworkPolicyPeer {
            namespace_selector: Some(LabelSelector {
                match_labels: Some(BTreeMap::from([(
                    NAMESPACE_NAME_LABEL.to_string(),
                    monitoring.to_string(),
                )])),
                ..LabelSelector::default()
            }),
            ..NetworkPolicyPeer::default()
        });
    }
    NetworkPolicy {
        metadata: metadata(NETWORK_POLICY_NAME, namespace, tenant),
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(LabelSelector::default()),
            policy_types: Some(vec!["Ingress".to_string()]),
            ingress: Some(vec![NetworkPolicyIngressRule {
                from: Some(from),
                ports: None,
            }]),
            egress: None,
        }),
    }
}

/// Equal when they select, admit and restrict the same (an empty selector may come back without
/// its empty maps).
fn same_policy(existing: &NetworkPolicy, desired: &NetworkPolicy) -> bool {
    let normal = |policy: &NetworkPolicy| {
        let mut spec = policy.spec.clone().unwrap_or_default();
        let empty = |selector: &mut Option<LabelSelector>| {
            if let Some(s) = selector {
                if s.match_labels.as_ref().is_some_and(BTreeMap::is_empty) {
                    s.match_labels = None;
                }
                if s.match_expressions.as_ref().is_some_and(Vec::is_empty) {
                    s.match_expressions = None;
                }
            }
        };
        empty(&mut spec.pod_selector);
        for rule in spec.ingress.iter_mut().flatten() {
            for peer in rule.from.iter_mut().flatten() {
                empty(&mut peer.pod_selector);
                empty(&mut peer.namespace_selector);
            }
        }
        spec
    };
    normal(existing) == normal(desired)
}

/// Creates the tenant's NetworkPolicy or puts our edited copy back (`policies`: the watch cache).
pub async fn ensure_policy(
    host: &Client,
    tenant: &str,
    namespace: &str,
    monitoring_namespace: Option<&str>,
    policies: &Store<NetworkPolicy>,
) -> Result<Applied, QuotaError> {
    let desired = desired_policy(tenant, namespace, monitoring_namespace);
    let observed = policies.get(&ObjectRef::new(NETWORK_POLICY_NAME).within(namespace));
    let api = Api::namespaced(host.clone(), namespace);
    ensure(&api, &desired, observed.as_deref(), tenant, same_policy).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_policy_admits_the_namespace_itself_and_the_monitoring_namespace_only() {
        let policy = desired_policy("acme", "tenant-acme-controllers", Some("monitoring"));
        let spec = policy.spec.clone().unwrap();
        assert_eq!(
            spec.pod_selector,
            Some(LabelSelector::default()),
            "every pod of the namespace"
        );
        assert_eq!(spec.policy_types, Some(vec!["Ingress".to_string()]));
        let from = spec.ingress.unwrap()[0].from.clone().unwrap();
        assert_eq!(from.len(), 2);
        assert_eq!(from[0].pod_selector, Some(LabelSelector::default()));
        assert!(from[0].namespace_selector.is_none(), "same namespace only");
        let labels = from[1].namespace_selector.clone().unwrap().match_labels.unwrap();
        assert_eq!(labels[NAMESPACE_NAME_LABEL], "monitoring");
        assert_eq!(policy.metadata.labels.unwrap()["stackd.dev/tenant"], "acme");
        let alone = desired_policy("acme", "ns", None).spec.unwrap().ingress.unwrap()[0]
            .from
            .clone()
            .unwrap();
        assert_eq!(alone.len(), 1);
    }

    #[test]
    fn a_policy_read_back_is_the_same_and_an_opened_one_is_not() {
        let desired = desired_policy("acme", "ns", None);
        let mut read_back = desired.clone();
        read_back.spec.as_mut().unwrap().pod_selector = Some(LabelSelector {
            match_labels: Some(BTreeMap::new()),
            ..LabelSelector::default()
        });
        assert!(same_policy(&read_back, &desired));
        let mut opened = desired.clone();
        opened.spec.as_mut().unwrap().ingress.as_mut().unwrap()[0].from = None;
        assert!(!same_policy(&opened, &desired), "an empty `from` admits everyone");
        let mut dropped = desired.clone();
        dropped.spec.as_mut().unwrap().policy_types = Some(vec!["Egress".into()]);
        assert!(!same_policy(&dropped, &desired));
    }
}
