//! The orphan sweep against embedded host and tenant servers (DESIGN.md §2 "Orphan sweep").

use std::time::Duration;

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Secret};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ApiResource, ObjectMeta, PostParams};
use kube::{Client, CustomResourceExt, Resource};
use stackd::api::stacks::{InstallSpec, StackInstall, StackInstallSpec};
use stackd::embedded::faults::RequestMatch;
use stackd::embedded::{ApiServer, ServerOptions, Verb};
use stackd::host::Parent;
use stackd::host::sweep::run::sweep_once;

use crate::harness::{NoDaemon, until};

/// How long a sweep's step, or host Secrets' aging, may take.
const SWEPT_WITHIN: Duration = Duration::from_secs(10);

const HOST_NS: &str = "tenant-acme-controllers";

async fn servers(install_crd: bool) -> (ApiServer, ApiServer, Client, Client) {
    let host = ApiServer::start(ServerOptions {
        name: "host".into(),
        ..Default::default()
    })
    .await
    .expect("host");
    let tenant = ApiServer::start(ServerOptions {
        name: "acme".into(),
        ..Default::default()
    })
    .await
    .expect("tenant");
    let (host_client, tenant_client) = (host.client().await, tenant.client().await);
    let ns: Namespace = serde_json::from_value(serde_json::json!({"metadata": {"name": HOST_NS}})).expect("ns");
    Api::<Namespace>::all(host_client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .expect("host ns");
    if install_crd {
        let crds: Api<CustomResourceDefinition> = Api::all(tenant_client.clone());
        crds.create(&PostParams::default(), &StackInstall::crd())
            .await
            .expect("crd");
        let tenant_ns: Namespace =
            serde_json::from_value(serde_json::json!({"metadata": {"name": "team-a"}})).expect("ns");
        let _ = Api::<Namespace>::all(tenant_client.clone())
            .create(&PostParams::default(), &tenant_ns)
            .await;
    }
    (host, tenant, host_client, tenant_client)
}

/// A host Secret labelled as belonging to `parent` of `tenant`.
async fn host_secret(host: &Client, name: &str, tenant: &str, parent: &Parent) {
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: Some(parent.labels(tenant)),
            annotations: Some(parent.annotations()),
            ..Default::default()
        },
        ..Default::default()
    };
    Api::<Secret>::namespaced(host.clone(), HOST_NS)
        .create(&PostParams::default(), &secret)
        .await
        .expect("secret");
}

async fn exists(host: &Client, name: &str) -> bool {
    Api::<Secret>::namespaced(host.clone(), HOST_NS)
        .get_opt(name)
        .await
        .expect("get")
        .is_some()
}

/// Waits until the host Secrets made so far are older than the next sweep's lists: their creation
/// timestamps (whole seconds) plus the second the sweep allows for are past.
async fn older_than_a_sweep(host: &Client) {
    let secrets = Api::<Secret>::namespaced(host.clone(), HOST_NS)
        .list(&Default::default())
        .await
        .expect("list");
    let newest = secrets
        .items
        .iter()
        .filter_map(|s| s.metadata.creation_timestamp.as_ref())
        .map(|created| created.0)
        .max()
        .expect("host Secrets to age");
    let aged = newest + jiff::SignedDuration::from_secs(1);
    until(
        "the host Secrets older than a sweep",
        SWEPT_WITHIN,
        &NoDaemon,
        || async { jiff::Timestamp::now() > aged },
    )
    .await;
}

fn kinds() -> (Vec<ApiResource>, Vec<ApiResource>) {
    (
        vec![ApiResource::erase::<StackInstall>(&())],
        vec![
            ApiResource::erase::<Secret>(&()),
            ApiResource::erase::<Job>(&()),
            ApiResource::erase::<ConfigMap>(&()),
        ],
    )
}

#[tokio::test]
async fn sweep_deletes_host_objects_whose_parent_is_gone_and_keeps_the_rest() {
    let (_host, tenant_server, host, tenant) = servers(true).await;
    let installs: Api<StackInstall> = Api::namespaced(tenant.clone(), "team-a");
    let spec = StackInstallSpec {
        install: InstallSpec {
            package: "p:1".into(),
            ..Default::default()
        },
    };
    let live = installs
        .create(&PostParams::default(), &StackInstall::new("live", spec))
        .await
        .expect("install");
    let live = Parent::new(
        "StackInstall",
        Some("team-a"),
        "live",
        live.meta().uid.as_deref().unwrap_or_default(),
    );
    let gone = Parent::new("StackInstall", Some("team-a"), "gone", "uid-of-a-deleted-install");
    let (parents, hosts) = kinds();
    // Host objects made while the sweep lists the tenant (their parent may be new since) wait for
    // the next sweep: the tenant's list is held back while they are made.
    tenant_server.faults().add_latency(
        RequestMatch::any().verb(Verb::List).resource("stackinstalls"),
        Duration::from_millis(1500),
    );
    let sweep = tokio::spawn({
        let (host, tenant, parents, hosts) = (host.clone(), tenant.clone(), parents.clone(), hosts.clone());
        async move { sweep_once(&host, &tenant, "acme", HOST_NS, &parents, &hosts).await }
    });
    // The list has reached the tenant (counted before its latency): the sweep's lists have begun.
    until("the sweep to list the tenant", SWEPT_WITHIN, &NoDaemon, || async {
        tenant_server.counters().get(Verb::List, "stackinstalls", None) > 0
    })
    .await;
    host_secret(&host, "live-token", "acme", &live).await;
    host_secret(&host, "gone-token", "acme", &gone).await;
    host_secret(&host, "other-tenant", "globex", &gone).await;
    let report = sweep.await.expect("sweep task").expect("sweep");
    assert!(
        report.deleted.is_empty(),
        "objects younger than the sweep's lists wait for the next one"
    );
    tenant_server.faults().clear();
    older_than_a_sweep(&host).await;
    let report = sweep_once(&host, &tenant, "acme", HOST_NS, &parents, &hosts)
        .await
        .expect("sweep");
    assert_eq!(report.deleted, ["Secret/gone-token"]);
    assert!(exists(&host, "live-token").await);
    assert!(
        exists(&host, "other-tenant").await,
        "another tenant's objects are never touched"
    );
    assert!(!exists(&host, "gone-token").await);
    let again = sweep_once(&host, &tenant, "acme", HOST_NS, &parents, &hosts)
        .await
        .expect("sweep");
    assert!(again.deleted.is_empty(), "a second sweep finds nothing");
}

#[tokio::test]
async fn sweep_deletes_nothing_when_the_tenant_cannot_be_listed() {
    let (_host, tenant_server, host, tenant) = servers(true).await;
    let gone = Parent::new("StackInstall", Some("team-a"), "gone", "uid-gone");
    host_secret(&host, "gone-token", "acme", &gone).await;
    tenant_server.shutdown().await;
    let (parents, hosts) = kinds();
    let failed = sweep_once(&host, &tenant, "acme", HOST_NS, &parents, &hosts).await;
    assert!(failed.is_err(), "an unreachable tenant ends the sweep: {failed:?}");
    assert!(
        exists(&host, "gone-token").await,
        "an unreachable tenant never causes deletions"
    );
}

#[tokio::test]
async fn sweep_skips_kinds_the_tenant_does_not_serve() {
    let (_host, _tenant, host, tenant) = servers(false).await;
    let gone = Parent::new("StackInstall", Some("team-a"), "gone", "uid-gone");
    host_secret(&host, "gone-token", "acme", &gone).await;
    let (parents, hosts) = kinds();
    let report = sweep_once(&host, &tenant, "acme", HOST_NS, &parents, &hosts)
        .await
        .expect("sweep");
    assert_eq!(report.unlisted_kinds, ["StackInstall"]);
    assert!(exists(&host, "gone-token").await);
}

#[tokio::test]
async fn sweep_never_deletes_objects_without_a_parent_label_or_the_namespace() {
    let (_host, _tenant, host, tenant) = servers(true).await;
    let gone = Parent::new("StackInstall", Some("team-a"), "gone", "uid-gone");
    let mut labels = gone.labels("acme");
    labels.remove("stackd.dev/parent-kind");
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some("unparented".into()),
            labels: Some(labels),
            ..Default::default()
        },
        ..Default::default()
    };
    Api::<Secret>::namespaced(host.clone(), HOST_NS)
        .create(&PostParams::default(), &secret)
        .await
        .expect("secret");
    let (parents, hosts) = kinds();
    sweep_once(&host, &tenant, "acme", HOST_NS, &parents, &hosts)
        .await
        .expect("sweep");
    assert!(exists(&host, "unparented").await);
    assert!(
        Api::<Namespace>::all(host.clone())
            .get_opt(HOST_NS)
            .await
            .expect("get")
            .is_some()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parent_created_during_a_sweep_keeps_its_host_objects() {
    let (host_server, _tenant, host, tenant) = servers(true).await;
    let gone = Parent::new("StackInstall", Some("team-a"), "gone", "uid-gone");
    host_secret(&host, "gone-token", "acme", &gone).await;
    older_than_a_sweep(&host).await;
    // The sweep's list of host Secrets is slow: it answers after the tenant lists, and after a
    // parent and its host Secret were created in between (a pool creating a ClusterDeployment).
    host_server.faults().add_latency(
        RequestMatch::any().verb(Verb::List).resource("secrets"),
        Duration::from_secs(2),
    );
    let (parents, hosts) = kinds();
    let counted = host_server.counters();
    let sweep = tokio::spawn({
        let (host, tenant) = (host.clone(), tenant.clone());
        async move { sweep_once(&host, &tenant, "acme", HOST_NS, &parents, &hosts).await }
    });
    until("the sweep to list host Secrets", SWEPT_WITHIN, &NoDaemon, || async {
        host_server
            .counters()
            .since(&counted)
            .get(Verb::List, "secrets", Some(HOST_NS))
            > 0
    })
    .await;
    let spec = StackInstallSpec {
        install: InstallSpec {
            package: "p:1".into(),
            ..Default::default()
        },
    };
    let created = Api::<StackInstall>::namespaced(tenant.clone(), "team-a")
        .create(&PostParams::default(), &StackInstall::new("mid-sweep", spec))
        .await
        .expect("install");
    let mid_sweep = Parent::new(
        "StackInstall",
        Some("team-a"),
        "mid-sweep",
        created.meta().uid.as_deref().unwrap_or_default(),
    );
    host_secret(&host, "mid-sweep-token", "acme", &mid_sweep).await;
    let report = sweep.await.expect("sweep task").expect("sweep");
    assert_eq!(report.deleted, ["Secret/gone-token"], "only the old orphan goes");
    assert!(
        exists(&host, "mid-sweep-token").await,
        "the host Secret of a parent created mid-sweep was deleted"
    );
}
