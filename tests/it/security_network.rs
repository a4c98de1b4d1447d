//! The host network (DESIGN.md §8 "Blast radius"; issue 28): code a tenant chose runs in its host
//! namespace (stack controllers, init containers, installers), so each tenant host namespace gets a
//! NetworkPolicy `stackd-tenant-isolation` admitting ingress only from pods of the same namespace
//! (and of `--monitoring-namespace`), kept as it should be when deleted or edited. The embedded
//! server stores policies without enforcing them: these tests check the policy, a real cluster's
//! network plugin enforces it.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;

use crate::harness::{Daemon, Fleet, wait_until};

const HOST_NS: &str = "tenant-acme-controllers";
const POLICY: &str = "stackd-tenant-isolation";
const SOON: Duration = Duration::from_secs(20);

fn policies(fleet: &Fleet, namespace: &str) -> Api<NetworkPolicy> {
    Api::namespaced(fleet.host_client.clone(), namespace)
}

/// The namespaces (by the `kubernetes.io/metadata.name` label) and pods a policy admits, or
/// `None` when it admits more than that (a rule without peers admits everyone).
fn admitted(policy: &NetworkPolicy) -> Option<Vec<String>> {
    let spec = policy.spec.as_ref()?;
    let everything = LabelSelector::default();
    let selects_all = |s: &Option<LabelSelector>| {
        s.as_ref()
            .is_some_and(|s| s.match_labels.clone().unwrap_or_default().is_empty() && s.match_expressions.is_none())
    };
    if !selects_all(&spec.pod_selector) || spec.policy_types.as_deref() != Some(&["Ingress".to_string()][..]) {
        return None;
    }
    let mut admitted = Vec::new();
    for rule in spec.ingress.as_ref()? {
        if rule.ports.is_some() {
            return None;
        }
        for peer in rule.from.as_ref()? {
            match (&peer.pod_selector, &peer.namespace_selector, &peer.ip_block) {
                (Some(pods), None, None) if *pods == everything => admitted.push("own namespace".to_string()),
                (None, Some(namespaces), None) => {
                    let labels: BTreeMap<String, String> = namespaces.match_labels.clone()?;
                    admitted.push(labels.get("kubernetes.io/metadata.name")?.clone());
                }
                _ => return None,
            }
        }
    }
    Some(admitted)
}

async fn isolated_as(fleet: &Fleet, daemon: &Daemon, wanted: &[&str]) -> NetworkPolicy {
    let api = policies(fleet, HOST_NS);
    let what = format!("the isolation policy admitting {wanted:?}");
    wait_until(&what, SOON, daemon, || {
        let api = api.clone();
        async move {
            let policy = api.get_opt(POLICY).await.ok()??;
            (admitted(&policy)? == wanted).then_some(policy)
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_tenant_namespace_admits_ingress_only_from_itself_and_monitoring_and_is_kept_so() {
    let fleet = Fleet::start(&["acme"]).await;
    let daemon = fleet.daemon(&["--monitoring-namespace", "monitoring"]);
    let policy = isolated_as(&fleet, &daemon, &["own namespace", "monitoring"]).await;
    assert_eq!(policy.labels()["app.kubernetes.io/managed-by"], "stackd");
    assert_eq!(policy.labels()["stackd.dev/tenant"], "acme");
    assert!(
        !policy.labels().contains_key("stackd.dev/parent-kind"),
        "the orphan sweep must never judge it"
    );

    // Opened up on the host (every namespace admitted): put back.
    let opened = json!({"spec": {"ingress": [{"from": [{"namespaceSelector": {}}]}]}});
    policies(&fleet, HOST_NS)
        .patch(POLICY, &PatchParams::default(), &Patch::Merge(&opened))
        .await
        .expect("open the policy");
    let restored = isolated_as(&fleet, &daemon, &["own namespace", "monitoring"]).await;
    assert_eq!(restored.metadata.uid, policy.metadata.uid, "restored in place");

    // Deleted: made again.
    policies(&fleet, HOST_NS)
        .delete(POLICY, &DeleteParams::default())
        .await
        .expect("delete the policy");
    let again = isolated_as(&fleet, &daemon, &["own namespace", "monitoring"]).await;
    assert_ne!(again.metadata.uid, policy.metadata.uid, "a new one");

    // Without --monitoring-namespace: the namespace alone.
    drop(daemon);
    let daemon = fleet.daemon(&[]);
    isolated_as(&fleet, &daemon, &["own namespace"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_network_policy_at_stackds_name_that_is_not_stackds_is_never_touched() {
    let fleet = Fleet::start(&["acme"]).await;
    let namespace: Namespace = serde_json::from_value(json!({"metadata": {"name": HOST_NS}})).expect("ns");
    Api::<Namespace>::all(fleet.host_client.clone())
        .create(&PostParams::default(), &namespace)
        .await
        .expect("host namespace");
    let theirs: NetworkPolicy = serde_json::from_value(json!({
        "metadata": {"name": POLICY},
        "spec": {"podSelector": {}, "ingress": [{}]},
    }))
    .expect("policy");
    let theirs = policies(&fleet, HOST_NS)
        .create(&PostParams::default(), &theirs)
        .await
        .expect("their policy");
    let daemon = fleet.daemon(&[]);
    wait_until("the conflict reported", SOON, &daemon, || {
        let log = daemon.log_text();
        async move {
            log.contains(
                "NetworkPolicy tenant-acme-controllers/stackd-tenant-isolation exists but was not created by stackd",
            )
            .then_some(())
        }
    })
    .await;
    let after = policies(&fleet, HOST_NS).get(POLICY).await.expect("still there");
    assert_eq!(
        after.metadata.resource_version, theirs.metadata.resource_version,
        "never written"
    );
}
