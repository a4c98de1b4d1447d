//! The embedded Kubernetes-compatible API server (DESIGN §7): what `stackd dev` and every
//! integration test run against.
//!
//! - [`store`]: objects (each kept once and shared, copy on write), the resourceVersion counter,
//!   the watch history and the uid and owner indexes; [`served`]: stored objects written out as a
//!   version serves them, without copying them;
//! - [`verbs`]: get/list/create/update/patch/delete with kube-apiserver semantics on that store,
//!   taking [`verb_options`], with [`patch`], [`subresources`] (scale, log) and [`crd`] (CRD
//!   lifecycle); `apply`: server-side apply, on top of the verbs;
//! - [`watch`]: watch streams; `http`: the request pipeline; [`discovery`]: the resource table;
//! - [`validation`] (with `name_rules`), [`kinds`], [`defaults`], [`schema`], [`selectors`]: pure
//!   rules; [`patch_engine`]: merge, JSON, strategic merge patch and server-side apply as pure
//!   functions;
//! - [`field_manager`]: `managedFields` on every write;
//!   [`protobuf`]: the few protobuf bodies kubectl and Helm insist on sending;
//! - [`openapi`], [`field_validation`], [`table`]: what kubectl needs beyond the verbs
//!   (`/openapi/v3`, `fieldValidation`, `as=Table` and metadata-only answers);
//! - [`controllers`]: the in-process loops ([`namespaces`] deletion, `crd_cleanup`, [`gc`]), each
//!   a [`passes::Controller`] looking only at what the store's events name;
//!   [`controller_manager`]: the token, Job and Deployment loops, with the per-image
//!   [`controller_manager::JobRunner`] hooks;
//! - [`faults`], [`counters`]: fault injection and request counters for tests; [`admission`]:
//!   mutating hooks, as a cluster's mutating webhooks.
//!
//! Known differences from kube-apiserver (each is a place a real cluster may behave otherwise):
//! - Answers are JSON only; protobuf request bodies are decoded for a few kinds ([`protobuf`]).
//! - Built-in kinds keep unknown fields unless `fieldValidation` asks otherwise, built-in OpenAPI
//!   schemas are permissive, and built-ins get only the commonly observed defaults ([`defaults`])
//!   and spec checks ([`kinds`]).
//! - `continue` tokens resume after the last key at the current state, not at a snapshot.
//! - Watches resume from the last [`store::HISTORY_WINDOW`] events of the whole server;
//!   bookmarks come every [`watch::BOOKMARK_INTERVAL`] (a minute) and
//!   [`watch::BOOKMARK_BEFORE_TIMEOUT`] before a watch's timeout, the watch cache's schedule, but
//!   always at the whole server's newest version.
//! - No kubelet: pods run only through the Job and Deployment loops; Services get no cluster IP.
//! - NetworkPolicies are stored, defaulted and validated, never enforced: there is no network
//!   between pods to enforce them on.
//!   No `kube-root-ca.crt` ConfigMaps, `default` ServiceAccounts or bootstrap RBAC roles.
//! - CRD schemas are checked for the structural rules generated schemas break (typed fields,
//!   `properties` xor `additionalProperties`), not all of them.
//! - A CRD whose cleanup finalizer is removed by hand takes its objects with it.
//! - CRD versions are served with the `None` conversion strategy only.

pub mod admission;
mod apply;
mod connections;
pub mod controller_manager;
pub mod controllers;
pub mod convert;
pub mod counters;
pub mod crd;
mod crd_cleanup;
pub mod defaults;
pub mod discovery;
pub mod faults;
pub mod field_manager;
pub mod field_validation;
pub mod gc;
mod http;
pub mod kinds;
mod name_rules;
pub mod namespaces;
mod object_meta;
pub mod openapi;
pub mod passes;
pub mod patch;
pub mod patch_engine;
mod pod_quota;
pub mod protobuf;
pub mod samples;
pub mod schema;
pub mod selectors;
pub mod served;
pub mod status;
pub mod store;
pub mod subresources;
pub mod table;
mod tls;
pub mod validation;
mod verb;
pub mod verb_options;
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

use admission::Admission;
use controller_manager::tokens::TokenRegistry;
use counters::{Counters, RequestCounts};
use discovery::ResourceTable;
use faults::Faults;
use store::Store;

pub use controller_manager::{ImageMatch, JobContext, JobOutcome, JobRunner, Runners};
pub use verb::Verb;

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
    /// Whether the TLS port offers HTTP/2 by ALPN beside HTTP/1.1, as kube-apiserver's does; off, it
    /// is a server (or a proxy before it) that speaks HTTP/1.1 only. Plain `http://` serves both to
    /// a client that asks, HTTP/2 by prior knowledge only.
    pub http2: bool,
    /// Bearer token every request must carry (health endpoints excepted).
    pub token: Option<String>,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            name: "embedded".to_string(),
            tls: false,
            http2: true,
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
    counters: Counters,
    /// Watch connections open right now.
    open_watches: Arc<AtomicU64>,
    /// Connections open right now (TCP, TLS or not).
    open_connections: Arc<AtomicU64>,
    /// Bytes read from and written to connections so far.
    traffic: Arc<connections::Traffic>,
    faults: Faults,
    admission: Arc<Admission>,
    /// Tokens of filled service-account token Secrets, also accepted as bearer tokens.
    service_account_tokens: Arc<TokenRegistry>,
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
        let presented = presented.and_then(|v| v.strip_prefix("Bearer "));
        presented == Some(token.as_str()) || presented.is_some_and(|t| self.service_account_tokens.contains(t))
    }
}

pub struct ApiServer {
    options: ServerOptions,
    shared: Arc<Shared>,
    url: String,
    ca_pem: Option<String>,
    tasks: Vec<JoinHandle<()>>,
    runners: Arc<Runners>,
    serving: tokio::sync::Mutex<Serving>,
}

/// Whether [`ApiServer::restart`] keeps the stored objects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RestartState {
    /// Objects and the watch history survive: resumed watches go on where they were.
    Keep,
    /// Objects survive but the watch history does not, as with kube-apiserver, whose watch cache
    /// starts empty after a restart: resuming a watch from an older resourceVersion gets 410 Expired.
    FreshWatchCache,
    /// Empty store, resourceVersions start over (clients resuming from an old one get 410).
    Lose,
}

/// The HTTP listener task and what stops it alone (for restarts).
struct Serving {
    address: SocketAddr,
    tls: Option<Arc<rustls::ServerConfig>>,
    stop: CancellationToken,
    task: JoinHandle<()>,
    /// The address, bound but not listening, while stopped: connections are refused, and no other
    /// server of the process (another test's) can take the port before this one serves again.
    held: Option<tokio::net::TcpSocket>,
}

impl Serving {
    fn start(
        listener: TcpListener,
        shared: &Arc<Shared>,
        tls: Option<Arc<rustls::ServerConfig>>,
    ) -> Result<Serving, Error> {
        let address = listener.local_addr()?;
        let router = axum::Router::new().fallback(http::handle).with_state(shared.clone());
        let stop = shared.shutdown.child_token();
        let (open, traffic) = (shared.open_connections.clone(), shared.traffic.clone());
        let task = match tls.clone() {
            Some(config) => {
                let acceptor = tokio_rustls::TlsAcceptor::from(config);
                let inner = tls::TlsListener::new(listener, acceptor, stop.clone())?;
                let graceful = inner.closed().cancelled_owned();
                let listener = connections::Counted { inner, open, traffic };
                let serve = axum::serve(listener, router).with_graceful_shutdown(graceful);
                tokio::spawn(async move { log_exit(serve.await) })
            }
            None => {
                let inner = connections::ClosingListener::new(listener, stop.clone())?;
                let graceful = inner.closed().cancelled_owned();
                let listener = connections::Counted { inner, open, traffic };
                let serve = axum::serve(listener, router).with_graceful_shutdown(graceful);
                tokio::spawn(async move { log_exit(serve.await) })
            }
        };
        Ok(Serving {
            address,
            tls,
            stop,
            task,
            held: None,
        })
    }
}

impl ApiServer {
    /// Starts serving on `127.0.0.1` at a free port.
    pub async fn start(options: ServerOptions) -> Result<ApiServer, Error> {
        let listener = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await?;
        let address = listener.local_addr()?.to_string();
        let store = Arc::new(Store::new());
        let shutdown = CancellationToken::new();
        let shared = Arc::new(Shared {
            resources: Arc::new(ResourceTable::new(store.clone())),
            faults: Faults::new(&shutdown, store.clone()),
            store,
            token: options.token.clone(),
            address: address.clone(),
            admission: Arc::default(),
            shutdown,
            requests: AtomicU64::new(0),
            counters: Counters::default(),
            open_watches: Arc::default(),
            open_connections: Arc::default(),
            traffic: Arc::default(),
            service_account_tokens: Arc::default(),
        });
        let (tls_config, url, ca_pem) = if options.tls {
            let cert = tls::generate(&options.name, options.http2).map_err(Error::Certificate)?;
            (Some(cert.config), format!("https://{address}"), Some(cert.ca_pem))
        } else {
            (None, format!("http://{address}"), None)
        };
        bootstrap(&shared);
        let serving = Serving::start(listener, &shared, tls_config)?;
        let controllers = tokio::spawn(controllers::run(
            shared.store.clone(),
            shared.resources.clone(),
            shared.shutdown.clone(),
        ));
        let runners = Arc::new(Runners::default());
        let (store, resources, stop) = (&shared.store, &shared.resources, &shared.shutdown);
        let token_loop = tokio::spawn(controller_manager::tokens::run(
            store.clone(),
            resources.clone(),
            shared.service_account_tokens.clone(),
            ca_pem.clone(),
            stop.clone(),
        ));
        let job_loop = tokio::spawn(controller_manager::jobs::run(
            store.clone(),
            resources.clone(),
            runners.clone(),
            stop.clone(),
        ));
        let deployment_loop = tokio::spawn(controller_manager::deployments::run(
            store.clone(),
            resources.clone(),
            runners.clone(),
            stop.clone(),
        ));
        Ok(ApiServer {
            options,
            shared,
            url,
            ca_pem,
            tasks: vec![controllers, token_loop, job_loop, deployment_loop],
            runners,
            serving: tokio::sync::Mutex::new(serving),
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

    /// Resource requests so far, per verb, resource and namespace.
    pub fn counters(&self) -> RequestCounts {
        self.shared.counters.snapshot()
    }

    /// Watch connections open right now (a benchmark's "watches per tenant").
    pub fn open_watches(&self) -> u64 {
        self.shared.open_watches.load(Ordering::Relaxed)
    }

    /// Connections clients hold open to the server now.
    pub fn open_connections(&self) -> u64 {
        self.shared.open_connections.load(Ordering::Relaxed)
    }

    /// Bytes the server has read from its connections so far (over TLS: decrypted): a request
    /// sent in part is seen on its way once this grows.
    pub fn bytes_received(&self) -> u64 {
        self.shared.traffic.received.load(Ordering::Relaxed)
    }

    /// Bytes the server has written to its connections so far (over TLS: before encryption), all
    /// HTTP/2 framing included: what flow control let through.
    pub fn bytes_sent(&self) -> u64 {
        self.shared.traffic.sent.load(Ordering::Relaxed)
    }

    /// Fault injection on this server.
    pub fn faults(&self) -> &Faults {
        &self.shared.faults
    }

    /// Mutating admission on this server (hooks run on creates and updates over HTTP).
    pub fn admission(&self) -> &Admission {
        &self.shared.admission
    }

    /// The per-image Job runners and Deployment readiness rules.
    pub fn runners(&self) -> Arc<Runners> {
        self.runners.clone()
    }

    /// Stops serving (open watches and connections end), optionally empties the store, and serves
    /// again on the same address. The in-process loops keep running throughout.
    pub async fn restart(&self, state: RestartState) -> Result<(), Error> {
        self.restart_after(state, Duration::ZERO).await
    }

    /// [`ApiServer::restart`] with `downtime` between stopping and serving again, during which
    /// connections to the address are refused, as while a real API server restarts.
    pub async fn restart_after(&self, state: RestartState, downtime: Duration) -> Result<(), Error> {
        let mut serving = self.serving.lock().await;
        self.shared.faults.drop_watches();
        serving.stop.cancel();
        let task = std::mem::replace(&mut serving.task, tokio::spawn(async {}));
        if tokio::time::timeout(Duration::from_secs(5), task).await.is_err() {
            tracing::warn!("the embedded API server did not stop within 5s; rebinding anyway");
        }
        let held = hold_address(serving.address).await?;
        match state {
            RestartState::Keep => {}
            RestartState::FreshWatchCache => self.shared.store.forget_history(),
            RestartState::Lose => self.shared.store.reset(),
        }
        tokio::time::sleep(downtime).await;
        let listener = held.listen(LISTEN_BACKLOG).map_err(Error::Bind)?;
        *serving = Serving::start(listener, &self.shared, serving.tls.clone())?;
        Ok(())
    }

    /// Restarts the host as a control-plane restart or a node reboot looks to its clients: the API
    /// stops (watches end, new connections are refused) for `downtime` and comes back with a fresh
    /// watch cache (resumed watches get 410), and the node's kubelet (pod logs) answers again only
    /// `kubelet_lag` after the API does. Returns once the API serves; the in-process loops (Jobs
    /// running to completion) keep running throughout.
    pub async fn restart_host(&self, downtime: Duration, kubelet_lag: Duration) -> Result<(), Error> {
        self.shared.faults.set_kubelet_up(false);
        let restarted = self.restart_after(RestartState::FreshWatchCache, downtime).await;
        let shared = self.shared.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = tokio::time::sleep(kubelet_lag) => shared.faults.set_kubelet_up(true),
                _ = shared.shutdown.cancelled() => {}
            }
        });
        restarted
    }

    /// Stops as kube-apiserver does on SIGTERM: the listener closes at once (new connections are
    /// refused; idle kept-alive ones are closed, so every new request needs one), then HTTP/2
    /// connections are sent GOAWAY (no new requests on them, those open go on), while the watches
    /// open now go on delivering for `keep_watches` (its shutdown timeout, up to 60 s) and then
    /// end. So does a watch that a connection busy at the stop asks for after it: the deadline is
    /// the server's, not each request's. [`ApiServer::serve_again`] serves again on the same address.
    pub async fn stop_gracefully(&self, keep_watches: Duration) {
        let mut serving = self.serving.lock().await;
        let open_watches = self.shared.faults.watch_token();
        serving.stop.cancel();
        // The old listener's task ends once its last watch does; it holds no address.
        drop(std::mem::replace(&mut serving.task, tokio::spawn(async {})));
        // Refused, and kept for this server, until it serves again (bound again then if not now).
        serving.held = hold_address(serving.address).await.ok();
        tokio::spawn(async move {
            tokio::select! {
                _ = tokio::time::sleep(keep_watches) => open_watches.cancel(),
                _ = open_watches.cancelled() => {}
            }
        });
    }

    /// Serves again on the same address after [`ApiServer::stop_gracefully`] (open watches it kept
    /// go on until their time is up); does nothing while serving.
    pub async fn serve_again(&self) -> Result<(), Error> {
        let mut serving = self.serving.lock().await;
        if !serving.stop.is_cancelled() {
            return Ok(());
        }
        let held = match serving.held.take() {
            Some(held) => held,
            None => hold_address(serving.address).await?,
        };
        let listener = held.listen(LISTEN_BACKLOG).map_err(Error::Bind)?;
        // The watches kept from the stop go on until its deadline; new ones are the new server's.
        drop(self.shared.faults.detach_watches());
        *serving = Serving::start(listener, &self.shared, serving.tls.clone())?;
        Ok(())
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
        kube::Client::try_from(self.config().await)
            .unwrap_or_else(|e| panic!("building a client for the embedded server: {e}"))
    }

    /// A kube client configuration for this server.
    pub async fn config(&self) -> kube::Config {
        let options = kube::config::KubeConfigOptions::default();
        kube::Config::from_custom_kubeconfig(self.kubeconfig(), &options)
            .await
            .unwrap_or_else(|e| panic!("the embedded server's own kubeconfig is unusable: {e}"))
    }

    /// Stops serving: open watches end, connections close.
    pub async fn shutdown(mut self) {
        self.shared.shutdown.cancel();
        let serving = std::mem::replace(&mut self.serving.get_mut().task, tokio::spawn(async {}));
        for task in std::mem::take(&mut self.tasks).into_iter().chain([serving]) {
            // A connection that refuses to close must not hang the caller forever.
            let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        }
    }
}

/// The listen backlog of a server serving again (tokio's `TcpListener::bind` uses the same).
const LISTEN_BACKLOG: u32 = 1024;

/// Binds the address a stopped server used again, without listening (see [`Serving::held`]),
/// retrying briefly while the stopped listener lets go of it; with `SO_REUSEADDR`, as `TcpListener::bind` sets it, for the connections the stop
/// left in TIME_WAIT.
async fn hold_address(address: SocketAddr) -> Result<tokio::net::TcpSocket, Error> {
    let bound = || -> std::io::Result<tokio::net::TcpSocket> {
        let socket = match address {
            SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
            SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
        };
        socket.set_reuseaddr(true)?;
        socket.bind(address)?;
        Ok(socket)
    };
    let mut attempts = 0;
    loop {
        match bound() {
            Ok(socket) => return Ok(socket),
            Err(e) if attempts < 50 => {
                attempts += 1;
                tracing::debug!(error = %e, "rebinding the embedded API server");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => return Err(Error::Bind(e)),
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
        let _ = verbs::create(&shared.store, &namespaces, "", namespace, Default::default());
    }
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
