//! The host-aware stack manager seed's mapping table (issue 29 item 9): one package installed under
//! the seed's names in two tenants maps to `tenant-<n>-controllers/<namespace>.<name>` on the host,
//! and deleting it in one tenant leaves the other tenant's (and the same tenant's other install's)
//! host objects untouched.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, DeleteParams, ListParams};
use kube::{Client, Resource, ResourceExt};
use serde_json::json;
use stackd::api::stacks::StackInstall;

use crate::harness::wait_until;
use crate::stacks_install::{StackFleet, create_install, wait_for_reason};

/// The seed's table: `Namespace / Name` on a tenant instance.
const SEED_NAMES: [(&str, &str); 2] = [("crossplane-system", "provider-gcp"), ("dev", "stack-wordpress")];

fn host_namespace(tenant: &str) -> String {
    format!("tenant-{tenant}-controllers")
}

/// Identity and version of every host object of `tenant` with a parent label, by `kind/name`.
async fn host_objects(host: &Client, tenant: &str) -> BTreeMap<String, (String, String)> {
    let ns = host_namespace(tenant);
    let params = ListParams::default().labels("stackd.dev/parent-kind");
    let mut out = BTreeMap::new();
    let mut add = |kind: &str, meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta| {
        let name = meta.name.clone().unwrap_or_default();
        let identity = (
            meta.uid.clone().unwrap_or_default(),
            meta.resource_version.clone().unwrap_or_default(),
        );
        out.insert(format!("{kind}/{name}"), identity);
    };
    for job in Api::<Job>::namespaced(host.clone(), &ns)
        .list(&params)
        .await
        .expect("jobs")
    {
        add("Job", job.meta());
    }
    for secret in Api::<Secret>::namespaced(host.clone(), &ns)
        .list(&params)
        .await
        .expect("secrets")
    {
        add("Secret", secret.meta());
    }
    for deployment in Api::<Deployment>::namespaced(host.clone(), &ns)
        .list(&params)
        .await
        .expect("deployments")
    {
        add("Deployment", deployment.meta());
    }
    out
}

#[tokio::test(flavor = "multi_thread")]
async fn one_package_in_two_tenants_maps_to_the_seeds_names_and_one_uninstall_touches_only_its_own() {
    let fleet = StackFleet::start(&["1", "2"]).await;
    let daemon = fleet.daemon(&[]);
    for tenant in ["1", "2"] {
        for (namespace, name) in SEED_NAMES {
            let package = json!({"package": "examples/sample-stack:v1"});
            create_install(&fleet.tenant(tenant), namespace, name, package).await;
        }
    }
    for tenant in ["1", "2"] {
        for (namespace, name) in SEED_NAMES {
            let (status, _, message) =
                wait_for_reason(&fleet.tenant(tenant), namespace, name, &daemon, "Available").await;
            assert_eq!(status, "True", "{tenant}: {namespace}/{name}: {message}");
        }
    }
    // The seed's table, row by row: `<namespace>.<name>` in `tenant-<n>-controllers`.
    for tenant in ["1", "2"] {
        let ns = host_namespace(tenant);
        for (namespace, name) in SEED_NAMES {
            let mapped = format!("{namespace}.{name}");
            let deployment = Api::<Deployment>::namespaced(fleet.host_client.clone(), &ns)
                .get(&mapped)
                .await
                .unwrap_or_else(|e| panic!("{ns}/{mapped}: {e}"));
            let labels = deployment.labels();
            assert_eq!(labels["stackd.dev/tenant"], tenant);
            assert_eq!(labels["stackd.dev/parent-namespace"], namespace);
            assert_eq!(labels["stackd.dev/parent-name"], name);
            // The install Job is removed once the package is applied; its status keeps the name.
            let install = Api::<StackInstall>::namespaced(fleet.tenant(tenant), namespace)
                .get(name)
                .await
                .expect("install");
            let job = install.status.and_then(|s| s.install_job).expect("installJob");
            assert_eq!((job.namespace, job.name), (ns.clone(), format!("{mapped}-install")));
            fleet
                .host_secrets(tenant)
                .get(&format!("{mapped}-token"))
                .await
                .unwrap_or_else(|e| panic!("{ns}/{mapped}-token: {e}"));
        }
    }
    // Completed install Jobs go after Available: wait for that, so the snapshots below hold still.
    wait_until(
        "the completed install Jobs removed",
        Duration::from_secs(20),
        &daemon,
        || {
            let host = fleet.host_client.clone();
            async move {
                for tenant in ["1", "2"] {
                    let jobs = Api::<Job>::namespaced(host.clone(), &host_namespace(tenant));
                    let params = ListParams::default().labels("stackd.dev/parent-kind");
                    if !jobs.list(&params).await.ok()?.items.is_empty() {
                        return None;
                    }
                }
                Some(())
            }
        },
    )
    .await;
    let before_other = host_objects(&fleet.host_client, "2").await;
    let before_same: BTreeMap<String, (String, String)> = host_objects(&fleet.host_client, "1")
        .await
        .into_iter()
        .filter(|(key, _)| key.contains("dev.stack-wordpress"))
        .collect();
    assert!(!before_same.is_empty());

    Api::<StackInstall>::namespaced(fleet.tenant("1"), "crossplane-system")
        .delete("provider-gcp", &DeleteParams::default())
        .await
        .expect("uninstall");
    let installs = Api::<StackInstall>::namespaced(fleet.tenant("1"), "crossplane-system");
    wait_until(
        "tenant 1's provider-gcp gone, on the tenant and the host",
        Duration::from_secs(20),
        &daemon,
        || {
            let installs = installs.clone();
            let host = fleet.host_client.clone();
            async move {
                let gone = installs.get_opt("provider-gcp").await.ok()?.is_none();
                let left = host_objects(&host, "1").await;
                let host_gone = left.keys().all(|key| !key.contains("crossplane-system.provider-gcp"));
                (gone && host_gone).then_some(())
            }
        },
    )
    .await;
    assert_eq!(
        host_objects(&fleet.host_client, "2").await,
        before_other,
        "the other tenant's host objects were touched"
    );
    let after_same: BTreeMap<String, (String, String)> = host_objects(&fleet.host_client, "1")
        .await
        .into_iter()
        .filter(|(key, _)| key.contains("dev.stack-wordpress"))
        .collect();
    assert_eq!(after_same, before_same, "the same tenant's other install was touched");
    let (status, _, message) = wait_for_reason(
        &fleet.tenant("2"),
        "crossplane-system",
        "provider-gcp",
        &daemon,
        "Available",
    )
    .await;
    assert_eq!(status, "True", "{message}");
}
