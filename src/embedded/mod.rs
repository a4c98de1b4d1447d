//! The embedded Kubernetes-compatible API server (DESIGN §7): what `stackd dev` and every
//! integration test run against.
//!
//! - [`store`]: objects, the resourceVersion counter and the watch history;
//! - [`verbs`]: get/list/create/update/patch/delete with kube-apiserver semantics on that store,
//!   with [`patch`], [`subresources`] (scale, log) and [`crd`] (CRD lifecycle);
//! - [`watch`]: watch streams; `http`: the request pipeline; [`discovery`]: the resource table;
//! - [`validation`], [`kinds`], [`defaults`], [`schema`], [`selectors`]: pure rules;
//! - [`controllers`]: the in-process loops ([`namespaces`] deletion, [`crd`] cleanup, [`gc`]).
//!
//! Known differences from kube-apiserver (each is a place a real cluster may behave otherwise):
//! - JSON only: protobuf bodies get 415; strategic merge patch and server-side
//!   apply get 415 (coming); no Table output, `/openapi`, or `fieldValidation` yet.
//! - Built-in kinds keep unknown fields (the real server drops them when decoding into Go types)
//!   and get only the commonly observed defaults ([`defaults`]) and spec checks ([`kinds`]).
//! - `continue` tokens resume after the last key at the current state, not at a snapshot.
//! - Watches resume from the last [`store::HISTORY_WINDOW`] events of the whole server;
//!   bookmarks come every [`watch::BOOKMARK_INTERVAL`].
//! - No kubelet: pods are deleted at once; Services get no cluster IP. No `kube-root-ca.crt`
//!   ConfigMaps, `default` ServiceAccounts or bootstrap RBAC roles (later controller loops).
//! - CRD schemas are checked for the structural rules generated schemas break (typed fields,
//!   `properties` xor `additionalProperties`), not all of them.
//! - The garbage collector ignores `blockOwnerDeletion` (foreground deletion waits for every
//!   dependent). A CRD whose cleanup finalizer is removed by hand takes its objects with it.
//! - CRD versions are served with the `None` conversion strategy only.

pub mod controllers;
pub mod convert;
pub mod crd;
pub mod defaults;
pub mod discovery;
pub mod gc;
mod http;
pub mod kinds;
pub mod namespaces;
pub mod patch;
pub mod schema;
pub mod selectors;
pub mod status;
pub mod store;
pub mod subresources;
mod tls;
pub mod validation;
pub mod verbs;
pub mod watch;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::http::HeaderMap;
use kube::config::{
    AuthInfo, Cluster, Context, Kubeconfig, NamedAuthInfo, NamedCluster, NamedContext,
};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use discovery::ResourceTable;
use store::Store;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("binding the embedded API server: {0}")]
    Bind(#[from] std::io::Error),
    #[error("generating the embedded API server's certificate: {0}")]
    Certificate(String),
}

#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// Names the cluster, context and user in the kubeconfig.
    pub name: String,
    pub tls: bool,
    /// Bearer token every request must carry (health endpoints excepted).
    pub token: Option<String>,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            name: "embedded".to_string(),
            tls: false,
            token: None,
        }
    }
}

/// State every request handler and in-process loop shares.
pub(crate) struct Shared {
    store: Arc<Store>,
    resources: Arc<ResourceTable>,
    token: Option<String>,
    /// `host:port`, reported in `/api` discovery.
    address: String,
    shutdown: CancellationToken,
    requests: AtomicU64,
}

impl Shared {
    fn count_request(&self) {
        self.requests.fetch_add(1, Ordering::Relaxed);
    }

    fn authorized(&self, headers: &HeaderMap) -> bool {
        let Some(token) = &self.token else {
            return true;
        };
        let presented = headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        presented.and_then(|v| v.strip_prefix("Bearer ")) == Some(token.as_str())
    }
}

pub struct ApiServer {
    options: ServerOptions,
    shared: Arc<Shared>,
    url: String,
    ca_pem: Option<String>,
    tasks: Vec<JoinHandle<()>>,
}

impl ApiServer {
    /// Starts serving on `127.0.0.1` at a free port.
    pub async fn start(options: ServerOptions) -> Result<ApiServer, Error> {
        let listener = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await?;
        let address = listener.local_addr()?.to_string();
        let store = Arc::new(Store::new());
        let shared = Arc::new(Shared {
            resources: Arc::new(ResourceTable::new(store.clone())),
            store,
            token: options.token.clone(),
            address: address.clone(),
            shutdown: CancellationToken::new(),
            requests: AtomicU64::new(0),
        });
        bootstrap(&shared);
        let (server, url, ca_pem) = serve(listener, &options, shared.clone())?;
        let controllers = tokio::spawn(controllers::run(
            shared.store.clone(),
            shared.resources.clone(),
            shared.shutdown.clone(),
        ));
        Ok(ApiServer {
            options,
            shared,
            url,
            ca_pem,
            tasks: vec![server, controllers],
        })
    }

    pub fn url(&self) -> String {
        self.url.clone()
    }

    /// The store, for in-process controllers and test setup.
    pub fn store(&self) -> Arc<Store> {
        self.shared.store.clone()
    }

    /// The resource table (built-ins plus served CRD versions) as of now.
    pub fn resources(&self) -> Arc<discovery::Resources> {
        self.shared.resources.current()
    }

    /// Makes `GET .../pods/<pod>/log?container=<container>` return `text`.
    pub fn set_pod_log(&self, namespace: &str, pod: &str, container: &str, text: &str) {
        self.shared
            .store
            .set_pod_log(namespace, pod, container, text);
    }

    /// HTTP requests received so far (every path, including health and refused ones).
    pub fn request_count(&self) -> u64 {
        self.shared.requests.load(Ordering::Relaxed)
    }

    pub fn kubeconfig(&self) -> Kubeconfig {
        let name = self.options.name.clone();
        let ca_data = self.ca_pem.as_ref().map(|pem| {
            use base64::Engine;
            base64::engine::general_purpose::STANDARD.encode(pem)
        });
        let cluster = Cluster {
            server: Some(self.url.clone()),
            certificate_authority_data: ca_data,
            ..Cluster::default()
        };
        let auth_info = AuthInfo {
            token: self.options.token.clone().map(Into::into),
            ..AuthInfo::default()
        };
        let context = Context {
            cluster: name.clone(),
            user: Some(name.clone()),
            ..Context::default()
        };
        Kubeconfig {
            clusters: vec![NamedCluster {
                name: name.clone(),
                cluster: Some(cluster),
                ..NamedCluster::default()
            }],
            auth_infos: vec![NamedAuthInfo {
                name: name.clone(),
                auth_info: Some(auth_info),
                ..NamedAuthInfo::default()
            }],
            contexts: vec![NamedContext {
                name: name.clone(),
                context: Some(context),
                ..NamedContext::default()
            }],
            current_context: Some(name),
            kind: Some("Config".into()),
            api_version: Some("v1".into()),
            ..Kubeconfig::default()
        }
    }

    pub fn kubeconfig_yaml(&self) -> String {
        // Serialising plain strings and maps cannot fail.
        serde_saphyr::to_string(&self.kubeconfig()).unwrap_or_default()
    }

    /// A kube client for this server.
    pub async fn client(&self) -> kube::Client {
        let options = kube::config::KubeConfigOptions::default();
        let config = kube::Config::from_custom_kubeconfig(self.kubeconfig(), &options)
            .await
            .unwrap_or_else(|e| panic!("the embedded server's own kubeconfig is unusable: {e}"));
        kube::Client::try_from(config)
            .unwrap_or_else(|e| panic!("building a client for the embedded server: {e}"))
    }

    /// Stops serving: open watches end, connections close.
    pub async fn shutdown(mut self) {
        self.shared.shutdown.cancel();
        for task in std::mem::take(&mut self.tasks) {
            // A connection that refuses to close must not hang the caller forever.
            let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        }
    }
}

/// The namespaces every cluster starts with.
const SYSTEM_NAMESPACES: &[&str] = &["default", "kube-system", "kube-public", "kube-node-lease"];

/// Creates what a fresh cluster already has.
fn bootstrap(shared: &Shared) {
    let resources = shared.resources.current();
    let Some(namespaces) = resources.find("", "v1", "namespaces") else {
        return;
    };
    for name in SYSTEM_NAMESPACES {
        let namespace = serde_json::json!({"metadata": {"name": name}});
        // A fresh store holds nothing, so this cannot conflict.
        let _ = verbs::create(
            &shared.store,
            &namespaces,
            "",
            namespace,
            Default::default(),
        );
    }
}

/// Serves the API on `listener` (TLS when asked) until the shutdown token fires. Returns the task,
/// the server URL and, with TLS, the CA certificate (PEM).
fn serve(
    listener: TcpListener,
    options: &ServerOptions,
    shared: Arc<Shared>,
) -> Result<(JoinHandle<()>, String, Option<String>), Error> {
    let address = shared.address.clone();
    let stop = shared.shutdown.clone();
    let router = axum::Router::new()
        .fallback(http::handle)
        .with_state(shared);
    if !options.tls {
        let serve = axum::serve(listener, router).with_graceful_shutdown(stop.cancelled_owned());
        let task = tokio::spawn(async move { log_exit(serve.await) });
        return Ok((task, format!("http://{address}"), None));
    }
    let cert = tls::generate(&options.name).map_err(Error::Certificate)?;
    let acceptor = tokio_rustls::TlsAcceptor::from(cert.config);
    let listener = tls::TlsListener { listener, acceptor };
    let serve = axum::serve(listener, router).with_graceful_shutdown(stop.cancelled_owned());
    let task = tokio::spawn(async move { log_exit(serve.await) });
    Ok((task, format!("https://{address}"), Some(cert.ca_pem)))
}

/// A dropped server stops too (without waiting for its connections to close).
impl Drop for ApiServer {
    fn drop(&mut self) {
        self.shared.shutdown.cancel();
    }
}

fn log_exit(result: std::io::Result<()>) {
    if let Err(e) = result {
        tracing::error!(error = %e, "embedded API server stopped");
    }
}
