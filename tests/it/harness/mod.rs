//! What the integration tests share: embedded API servers (here), a fleet of them with daemon
//! processes (`fleet`), waiting for what a user would see (`wait`), and for the daemon to have
//! acted on a change and stopped (`settle`).

mod fleet;
mod settle;
mod tools;
mod wait;

pub(crate) use fleet::{Daemon, Fleet, dead_address, http_get_at};
pub(crate) use settle::{Reconciles, quiet, settled};
pub(crate) use tools::{kubectl, tool};
pub(crate) use wait::{Explain, LastSeen, NoDaemon, holds_for, until, wait_until};

use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, PostParams};
use kube::{Client, Resource};
use serde_json::json;
use stackd::embedded::{ApiServer, ServerOptions};

/// stackd's CRDs, created on the API server `client` talks to (a tenant's, so that it is up rather
/// than degraded).
pub(crate) async fn install_crds(client: &Client) {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for crd in stackd::api::crds::all() {
        crds.create(&PostParams::default(), &crd)
            .await
            .expect("stackd CRD created");
    }
}

pub(crate) struct TestServer {
    pub server: ApiServer,
    pub client: Client,
}

pub(crate) async fn start() -> TestServer {
    start_with(ServerOptions::default()).await
}

pub(crate) async fn start_with(options: ServerOptions) -> TestServer {
    let server = ApiServer::start(options).await.expect("embedded server starts");
    let client = server.client().await;
    TestServer { server, client }
}

impl TestServer {
    pub(crate) async fn namespace(&self, name: &str) {
        let api: Api<Namespace> = Api::all(self.client.clone());
        let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name}})).unwrap();
        api.create(&PostParams::default(), &ns)
            .await
            .expect("namespace created");
    }

    pub(crate) fn configmaps(&self, namespace: &str) -> Api<ConfigMap> {
        Api::namespaced(self.client.clone(), namespace)
    }
}

pub(crate) fn configmap(name: &str, labels: serde_json::Value) -> ConfigMap {
    serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}, "data": {"k": "v"}})).unwrap()
}

pub(crate) fn resource_version<K: Resource>(object: &K) -> String {
    object.meta().resource_version.clone().unwrap_or_default()
}

/// Polls `check` until it holds or a few seconds pass.
pub(crate) async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    for _ in 0..100 {
        if check().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("timed out waiting for {what}");
}

pub(crate) fn api_error(err: kube::Error) -> Box<kube::core::Status> {
    match err {
        kube::Error::Api(status) => status,
        other => panic!("expected an API error, got {other}"),
    }
}
