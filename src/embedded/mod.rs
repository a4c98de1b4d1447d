//! The embedded Kubernetes-compatible API server (DESIGN §7): what `stackd dev` and every
//! integration test run against.
//!
//! - [`store`]: objects, the resourceVersion counter and the watch history;
//! - [`verbs`]: get/list/create/update/patch/delete with kube-apiserver semantics on that store,
//!   with [`patch`], [`subresources`] (scale, log) and [`crd`] (CRD lifecycle);
//! - [`watch`]: watch streams; [`http`]: the request pipeline; [`discovery`]: the resource table;
//! - [`validation`], [`schema`], [`selectors`]: pure rules; [`patch_engine`]: merge, JSON, strategic
//!   merge patch and server-side apply as pure functions;
//! - [`field_manager`]: `managedFields` on every write and server-side apply;
//! - [`openapi`], [`field_validation`], [`table`]: what kubectl needs beyond the verbs
//!   (`/openapi/v3`, `fieldValidation`, `as=Table` and metadata-only answers);
//! - [`namespaces`], [`gc`]: the namespace deletion and garbage collection loops.

pub mod crd;
pub mod discovery;
pub mod dry_run;
pub mod field_manager;
pub mod field_validation;
pub mod gc;
mod http;
pub mod namespaces;
pub mod openapi;
pub mod patch;
pub mod patch_engine;
pub mod protobuf;
pub mod schema;
pub mod selectors;
pub mod status;
pub mod store;
pub mod subresources;
pub mod table;
mod tls;
pub mod validation;
pub mod verbs;
pub mod watch;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::http::HeaderMap;
use kube::config::{AuthInfo, Cluster, Context, Kubeconfig, NamedAuthInfo, NamedCluster, NamedContext};
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
        let router = axum::Router::new().fallback(http::handle).with_state(shared.clone());
        let stop = shared.shutdown.clone();
        let (server, url, ca_pem) = if options.tls {
            let cert = tls::generate(&options.name).map_err(Error::Certificate)?;
            let listener = tls::TlsListener {
                listener,
                acceptor: tokio_rustls::TlsAcceptor::from(cert.config),
            };
            let serve = axum::serve(listener, router).with_graceful_shutdown(stop.cancelled_owned());
            (
                tokio::spawn(async move { log_exit(serve.await) }),
                format!("https://{address}"),
                Some(cert.ca_pem),
            )
        } else {
            let serve = axum::serve(listener, router).with_graceful_shutdown(stop.cancelled_owned());
            (
                tokio::spawn(async move { log_exit(serve.await) }),
                format!("http://{address}"),
                None,
            )
        };
        let namespace_loop = tokio::spawn(namespaces::run(
            shared.store.clone(),
            shared.resources.clone(),
            shared.shutdown.clone(),
        ));
        let gc_loop = tokio::spawn(gc::run(
            shared.store.clone(),
            shared.resources.clone(),
            shared.shutdown.clone(),
        ));
        Ok(ApiServer {
            options,
            shared,
            url,
            ca_pem,
            tasks: vec![server, namespace_loop, gc_loop],
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
        self.shared.store.set_pod_log(namespace, pod, container, text);
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
        kube::Client::try_from(config).unwrap_or_else(|e| panic!("building a client for the embedded server: {e}"))
    }

    /// Stops serving: open watches end, connections close.
    pub async fn shutdown(self) {
        self.shared.shutdown.cancel();
        for task in self.tasks {
            // A connection that refuses to close must not hang the caller forever.
            let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        }
    }
}

fn log_exit(result: std::io::Result<()>) {
    if let Err(e) = result {
        tracing::error!(error = %e, "embedded API server stopped");
    }
}
