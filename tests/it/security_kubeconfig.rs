//! The tenant is untrusted (DESIGN.md §8, issue 16): kubeconfigs a tenant can write never make the
//! daemon run a command, read a file, use a proxy or impersonate; a Secret stackd did not create is
//! never overwritten; secrets never show up in errors; `/readyz?verbose` detail stays on loopback.
//! Each attack is performed through the daemon binary against embedded servers.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Event, Namespace, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use stackd::api::inventory::BareMetalAsset;
use stackd::api::pools::ClusterDeployment;
use stackd::embedded::controller_manager::{ImageMatch, JobContext, JobOutcome};

use crate::harness::{Fleet, http_get_at, until, wait_until};

const NS: &str = "team";
const WITHIN: Duration = Duration::from_secs(20);
/// A credential planted in malformed kubeconfigs: it must never be echoed anywhere.
const PLANTED_TOKEN: &str = "planted-t0ken-4f9c2e";

/// A TCP listener the test owns, counting every connection it is offered.
struct Witness {
    address: SocketAddr,
    connections: Arc<AtomicUsize>,
}

impl Witness {
    async fn start() -> Witness {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind witness");
        let address = listener.local_addr().expect("witness address");
        let connections = Arc::new(AtomicUsize::new(0));
        let counter = connections.clone();
        tokio::spawn(async move {
            while listener.accept().await.is_ok() {
                counter.fetch_add(1, Ordering::SeqCst);
            }
        });
        Witness { address, connections }
    }

    fn url(&self, scheme: &str) -> String {
        format!("{scheme}://{}", self.address)
    }

    fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }
}

/// A host and tenant `acme` with the stackd CRDs and namespace `team`.
async fn setup() -> (Fleet, Client) {
    let fleet = Fleet::start(&["acme"]).await;
    let tenant = fleet.tenants[0].1.as_ref().expect("tenant server").client().await;
    crate::harness::install_crds(&tenant).await;
    namespace(&tenant, NS).await;
    (fleet, tenant)
}

async fn namespace(tenant: &Client, name: &str) {
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name}})).expect("namespace");
    Api::<Namespace>::all(tenant.clone())
        .create(&PostParams::default(), &ns)
        .await
        .expect("create namespace");
}

async fn create_secret(tenant: &Client, namespace: &str, secret: Value) -> Secret {
    let secret: Secret = serde_json::from_value(secret).expect("secret");
    Api::<Secret>::namespaced(tenant.clone(), namespace)
        .create(&PostParams::default(), &secret)
        .await
        .expect("create secret")
}

/// A kubeconfig (as JSON, which is YAML) with one cluster at `server` and one user.
fn kubeconfig(server: &str, cluster_extra: Value, user: Value) -> String {
    let mut cluster = json!({"server": server});
    for (key, value) in cluster_extra.as_object().cloned().unwrap_or_default() {
        cluster[key] = value;
    }
    json!({
        "apiVersion": "v1", "kind": "Config", "current-context": "admin",
        "clusters": [{"name": "managed", "cluster": cluster}],
        "users": [{"name": "admin", "user": user}],
        "contexts": [{"name": "admin", "context": {"cluster": "managed", "user": "admin"}}],
    })
    .to_string()
}

/// A kubeconfig that breaks off inside the planted token's quoted string.
fn malformed_kubeconfig(server: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\ncurrent-context: admin\nclusters:\n- name: managed\n  cluster:\n    server: {server}\n\
         users:\n- name: admin\n  user:\n    token: \"{PLANTED_TOKEN}\n  - ]: [\n"
    )
}

/// The attacks one can write into a kubeconfig, with the field stackd must name when refusing.
fn attacks(witness: &Witness, proxy: &Witness, dir: &Path) -> Vec<(&'static str, String, &'static str)> {
    let server = witness.url("http");
    let marker = |name: &str| dir.join(name).display().to_string();
    let credential =
        r#"{"apiVersion":"client.authentication.k8s.io/v1beta1","kind":"ExecCredential","status":{"token":"x"}}"#;
    vec![
        (
            "exec",
            kubeconfig(
                &server,
                json!({}),
                json!({"exec": {"apiVersion": "client.authentication.k8s.io/v1beta1", "command": "/bin/sh",
                    "args": ["-c", format!("touch {}; echo '{credential}'", marker("exec-ran"))]}}),
            ),
            "users[0].user.exec",
        ),
        (
            "auth-provider",
            kubeconfig(
                &server,
                json!({}),
                json!({"auth-provider": {"name": "gcp",
                    "config": {"cmd-path": "/usr/bin/touch", "cmd-args": marker("auth-provider-ran")}}}),
            ),
            "users[0].user.auth-provider",
        ),
        (
            "token-file",
            kubeconfig(&server, json!({}), json!({"tokenFile": marker("daemon-token")})),
            "users[0].user.tokenFile",
        ),
        (
            "client-cert-file",
            kubeconfig(
                &server,
                json!({}),
                json!({"client-certificate": marker("daemon.crt"), "client-key": marker("daemon.key")}),
            ),
            "users[0].user.client-certificate",
        ),
        (
            "proxy",
            kubeconfig(&server, json!({"proxy-url": proxy.url("http")}), json!({"token": "t"})),
            "clusters[0].cluster.proxy-url",
        ),
        (
            "impersonation",
            kubeconfig(
                &server,
                json!({}),
                json!({"token": "t", "as": "system:admin", "as-groups": ["system:masters"]}),
            ),
            "users[0].user.as",
        ),
    ]
}

/// Files the daemon would read if it followed a kubeconfig's paths.
fn plant_daemon_files(dir: &Path) {
    for name in ["daemon-token", "daemon.crt", "daemon.key"] {
        std::fs::write(dir.join(name), "not for tenants\n").expect("planted file");
    }
}

/// The files in `dir` other than the planted ones: anything here was made by a command the
/// daemon should never have run.
fn markers(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .expect("marker dir")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !["daemon-token", "daemon.crt", "daemon.key"].contains(&n.as_str()))
        .collect()
}

fn condition(conditions: &[Condition], type_: &str) -> Option<(String, String, String)> {
    conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
}

async fn events(tenant: &Client, namespace: &str, object: &str) -> Vec<(String, String)> {
    let api: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(tenant.clone(), namespace);
    let core: Api<Event> = Api::namespaced(tenant.clone(), namespace);
    let mut out: Vec<(String, String)> = api
        .list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(object))
        .map(|e| (e.reason.unwrap_or_default(), e.note.unwrap_or_default()))
        .collect();
    out.extend(
        core.list(&ListParams::default())
            .await
            .map(|l| l.items)
            .unwrap_or_default()
            .into_iter()
            .filter(|e| e.involved_object.name.as_deref() == Some(object))
            .map(|e| (e.reason.unwrap_or_default(), e.message.unwrap_or_default())),
    );
    out
}

/// An installed ClusterDeployment `name` (in namespace `name`, made as a pool of namespace `team`
/// makes it, so that team's assets may reach it) whose admin kubeconfig Secret holds `kubeconfig`,
/// and an asset of team's assigned to it with its BMC Secret.
async fn installed_cluster_with_asset(tenant: &Client, name: &str, kubeconfig: &str) {
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name,
        "labels": {"pools.stackd.dev/clusterpool-namespace": NS, "pools.stackd.dev/clusterpool-name": "p"},
        "annotations": {"pools.stackd.dev/clusterpool-uid": "uid-of-pool-p"}}}))
    .expect("namespace");
    Api::<Namespace>::all(tenant.clone())
        .create(&PostParams::default(), &ns)
        .await
        .expect("create namespace");
    create_secret(
        tenant,
        name,
        json!({"metadata": {"name": format!("{name}-admin-kubeconfig")}, "stringData": {"kubeconfig": kubeconfig}}),
    )
    .await;
    let cd: ClusterDeployment = serde_json::from_value(json!({
        "apiVersion": "pools.stackd.dev/v1alpha1", "kind": "ClusterDeployment",
        "metadata": {"name": name, "namespace": name},
        "spec": {"clusterName": name, "baseDomain": "example.com",
            "platform": {"baremetal": {"credentialsSecretRef": {"name": "creds"}}}},
    }))
    .expect("cluster deployment");
    let cds: Api<ClusterDeployment> = Api::namespaced(tenant.clone(), name);
    cds.create(&PostParams::default(), &cd).await.expect("create cd");
    cds.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"installed": true,
            "adminKubeconfigSecretRef": {"name": format!("{name}-admin-kubeconfig")}}})),
    )
    .await
    .expect("installed status");
    create_secret(
        tenant,
        NS,
        json!({"metadata": {"name": format!("bmc-{name}")}, "stringData": {"username": "admin", "password": "s3cret"}}),
    )
    .await;
    let asset: BareMetalAsset = serde_json::from_value(json!({
        "apiVersion": "inventory.stackd.dev/v1alpha1", "kind": "BareMetalAsset",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"bmc": {"address": format!("ipmi://10.0.0.1/{name}"), "credentialsName": format!("bmc-{name}")},
            "bootMACAddress": "00:1B:44:11:3A:B7", "role": "worker", "clusterName": name},
    }))
    .expect("asset");
    Api::<BareMetalAsset>::namespaced(tenant.clone(), NS)
        .create(&PostParams::default(), &asset)
        .await
        .expect("create asset");
}

async fn asset_host_created(tenant: &Client, name: &str) -> Option<(String, String, String)> {
    let asset = Api::<BareMetalAsset>::namespaced(tenant.clone(), NS)
        .get(name)
        .await
        .ok()?;
    condition(&asset.status.unwrap_or_default().conditions, "HostCreated")
}

/// An edited admin-kubeconfig Secret with `exec`, `auth-provider`, a token or certificate file, a
/// proxy or impersonation: the daemon runs nothing, reads nothing, connects nowhere, and the
/// asset says which field was refused (condition and Event).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_kubeconfigs_that_run_code_read_files_or_proxy_are_refused_by_delivery() {
    let (fleet, tenant) = setup().await;
    let (witness, proxy) = (Witness::start().await, Witness::start().await);
    let dir = tempfile::tempdir().expect("marker dir");
    plant_daemon_files(dir.path());
    let attacks = attacks(&witness, &proxy, dir.path());
    for (name, kubeconfig, _) in &attacks {
        installed_cluster_with_asset(&tenant, name, kubeconfig).await;
    }
    let daemon = fleet.daemon(&["--sweep-interval", "1h"]);

    for (name, _, field) in &attacks {
        until(&format!("asset {name} names {field}"), WITHIN, &daemon, || async {
            asset_host_created(&tenant, name)
                .await
                .is_some_and(|(s, r, m)| s == "False" && r == "AdminKubeconfigRefused" && m.contains(field))
        })
        .await;
        until(
            &format!("an Event on {name} names {field}"),
            WITHIN,
            &daemon,
            || async {
                events(&tenant, NS, name)
                    .await
                    .iter()
                    .any(|(r, note)| r == "AdminKubeconfigRefused" && note.contains(field))
            },
        )
        .await;
    }
    assert_eq!(markers(dir.path()), Vec::<String>::new(), "a command ran in the daemon");
    assert_eq!(witness.connections(), 0, "the daemon connected to the tenant's server");
    assert_eq!(proxy.connections(), 0, "the daemon connected to the tenant's proxy");
}

/// A malformed admin kubeconfig holding a token: the asset, its Events and the daemon's log say
/// where the YAML breaks, never the token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_admin_kubeconfig_never_shows_its_token() {
    let (fleet, tenant) = setup().await;
    let witness = Witness::start().await;
    installed_cluster_with_asset(&tenant, "broken", &malformed_kubeconfig(&witness.url("http"))).await;
    let daemon = fleet.daemon(&["--sweep-interval", "1h"]);
    until(
        "the asset says where the kubeconfig breaks",
        WITHIN,
        &daemon,
        || async {
            asset_host_created(&tenant, "broken")
                .await
                .is_some_and(|(s, r, m)| s == "False" && r == "AdminKubeconfigRefused" && m.contains("line"))
        },
    )
    .await;
    until("an Event says so", WITHIN, &daemon, || async {
        events(&tenant, NS, "broken")
            .await
            .iter()
            .any(|(r, _)| r == "AdminKubeconfigRefused")
    })
    .await;
    let asset = Api::<BareMetalAsset>::namespaced(tenant.clone(), NS)
        .get("broken")
        .await
        .unwrap();
    let shown = [
        serde_json::to_string(&asset.status).unwrap(),
        format!("{:?}", events(&tenant, NS, "broken").await),
        daemon.log_text(),
    ];
    for text in shown {
        assert!(!text.contains(PLANTED_TOKEN), "the token leaked:\n{text}");
    }
    assert_eq!(witness.connections(), 0);
}

const ATTACKER_INSTALLER: &str = "quay.io/attacker/installer:1";

/// A ClusterDeployment `name` (namespace `name`) with its installer inputs, provisioned by `image`.
async fn provisioned_cluster(tenant: &Client, name: &str, image: &str) -> ClusterDeployment {
    namespace(tenant, name).await;
    for secret in [
        json!({"metadata": {"name": "install-config"}, "stringData": {"install-config.yaml": "apiVersion: v1\n"}}),
        json!({"metadata": {"name": "creds"}, "stringData": {"clouds.yaml": "clouds: {}"}}),
        json!({"metadata": {"name": "pull"}, "stringData": {".dockerconfigjson": "{}"}}),
    ] {
        create_secret(tenant, name, secret).await;
    }
    let cd: ClusterDeployment = serde_json::from_value(json!({
        "apiVersion": "pools.stackd.dev/v1alpha1", "kind": "ClusterDeployment",
        "metadata": {"name": name, "namespace": name},
        "spec": {"clusterName": name, "baseDomain": "example.com",
            "platform": {"openstack": {"credentialsSecretRef": {"name": "creds"}, "cloud": "mycloud"}},
            "pullSecretRef": {"name": "pull"},
            "provisioning": {"installConfigSecretRef": {"name": "install-config"}, "installerImage": image}},
    }))
    .expect("cluster deployment");
    Api::<ClusterDeployment>::namespaced(tenant.clone(), name)
        .create(&PostParams::default(), &cd)
        .await
        .expect("create cd")
}

/// Scripts `image` to write, for each cluster name, the given kubeconfig as its output.
fn register_installer(fleet: &Fleet, image: &str, outputs: BTreeMap<String, String>) {
    fleet
        .host()
        .runners()
        .register(ImageMatch::Exact(image.into()), move |ctx: &JobContext| {
            if ctx.args.iter().any(|a| a == "destroy") {
                return JobOutcome::success("destroyed\n");
            }
            let (Some(ns), Some(secret), Some(cluster)) = (
                ctx.env("STACKD_OUTPUT_NAMESPACE"),
                ctx.env("STACKD_OUTPUT_SECRET"),
                ctx.env("STACKD_CLUSTER_NAME"),
            ) else {
                return JobOutcome::failure(1, "no output secret\n");
            };
            let Some(kubeconfig) = outputs.get(cluster) else {
                return JobOutcome::failure(1, "unknown cluster\n");
            };
            let data = BTreeMap::from([
                ("kubeconfig".to_string(), kubeconfig.clone()),
                (
                    "metadata.json".to_string(),
                    json!({"infraID": format!("{cluster}-x1")}).to_string(),
                ),
            ]);
            match ctx.write_secret_data(ns, secret, &data) {
                Ok(_) => JobOutcome::success("Install complete!\n"),
                Err(e) => JobOutcome::failure(1, format!("{}\n", e.message)),
            }
        });
}

async fn cd_conditions(tenant: &Client, name: &str) -> Vec<Condition> {
    Api::<ClusterDeployment>::namespaced(tenant.clone(), name)
        .get(name)
        .await
        .ok()
        .and_then(|cd| cd.status)
        .map(|s| s.conditions)
        .unwrap_or_default()
}

async fn admin_secret(tenant: &Client, name: &str) -> Option<Secret> {
    Api::<Secret>::namespaced(tenant.clone(), name)
        .get_opt(&format!("{name}-admin-kubeconfig"))
        .await
        .expect("get admin secret")
}

/// The installer image is the tenant's choice: an output kubeconfig that runs a command, reads a
/// file, uses a proxy or impersonates (or one that does not parse, holding a token) is not copied
/// to the tenant; the ClusterDeployment stops, naming the field or the line, and nothing runs,
/// is read or connects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn installer_output_kubeconfigs_that_run_code_read_files_or_proxy_are_not_copied_to_the_tenant() {
    let (fleet, tenant) = setup().await;
    let (witness, proxy) = (Witness::start().await, Witness::start().await);
    let dir = tempfile::tempdir().expect("marker dir");
    plant_daemon_files(dir.path());
    let mut outputs: Vec<(String, String, &str)> = attacks(&witness, &proxy, dir.path())
        .into_iter()
        .map(|(name, kubeconfig, field)| (format!("inst-{name}"), kubeconfig, field))
        .collect();
    outputs.push((
        "inst-malformed".into(),
        malformed_kubeconfig(&witness.url("http")),
        "line",
    ));
    register_installer(
        &fleet,
        ATTACKER_INSTALLER,
        outputs
            .iter()
            .map(|(name, kubeconfig, _)| (name.clone(), kubeconfig.clone()))
            .collect(),
    );
    for (name, _, _) in &outputs {
        provisioned_cluster(&tenant, name, ATTACKER_INSTALLER).await;
    }
    let daemon = fleet.daemon(&["--sweep-interval", "1h"]);

    for (name, _, detail) in &outputs {
        let name = name.as_str();
        until(&format!("{name} stops naming {detail}"), WITHIN, &daemon, || async {
            condition(&cd_conditions(&tenant, name).await, "ProvisionStopped")
                .is_some_and(|(s, r, m)| s == "True" && r == "AdminKubeconfigRefused" && m.contains(detail))
        })
        .await;
        until(
            &format!("an Event on {name} names {detail}"),
            WITHIN,
            &daemon,
            || async {
                events(&tenant, name, name)
                    .await
                    .iter()
                    .any(|(r, note)| r == "AdminKubeconfigRefused" && note.contains(detail))
            },
        )
        .await;
        assert!(
            admin_secret(&tenant, name).await.is_none(),
            "{name}: the kubeconfig was copied"
        );
        let cd = Api::<ClusterDeployment>::namespaced(tenant.clone(), name)
            .get(name)
            .await
            .unwrap();
        let status = cd.status.clone().unwrap_or_default();
        assert!(
            !status.installed && status.admin_kubeconfig_secret_ref.is_none(),
            "{status:?}"
        );
        let shown = [
            serde_json::to_string(&cd.status).unwrap(),
            format!("{:?}", events(&tenant, name, name).await),
        ];
        for text in shown {
            assert!(!text.contains(PLANTED_TOKEN), "the token leaked:\n{text}");
        }
    }
    assert!(
        !daemon.log_text().contains(PLANTED_TOKEN),
        "the token leaked into the log"
    );
    assert_eq!(markers(dir.path()), Vec::<String>::new(), "a command ran in the daemon");
    assert_eq!(
        witness.connections(),
        0,
        "the daemon connected to the installer's server"
    );
    assert_eq!(proxy.connections(), 0, "the daemon connected to the installer's proxy");
}

/// Text a host-internal service answers with: it must never reach the tenant or the log.
const INTERNAL_TEXT: &str = "internal-answer-93b1d7";

/// How a server that is no Kubernetes API server answers every request.
#[derive(Clone, Copy, Debug)]
enum Answer {
    /// An HTML error page, as a web service or a metadata endpoint gives.
    HtmlNotFound,
    /// 200 with JSON that is no Kubernetes object.
    NotAnObject,
    /// Takes the request and never answers.
    Stall,
    /// An error whose body never ends.
    EndlessError,
}

/// A loopback server answering as `answer` says; counts the bytes it sent.
async fn foreign_server(answer: Answer) -> (SocketAddr, Arc<AtomicUsize>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("address");
    let sent = Arc::new(AtomicUsize::new(0));
    let counter = sent.clone();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let counter = counter.clone();
            tokio::spawn(async move {
                let mut request = Vec::new();
                let mut buffer = [0u8; 4096];
                while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                    match socket.read(&mut buffer).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => request.extend_from_slice(&buffer[..n]),
                    }
                }
                let whole = |status: &str, kind: &str, body: String| {
                    format!(
                        "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    )
                };
                let reply = match answer {
                    Answer::HtmlNotFound => whole(
                        "404 Not Found",
                        "text/html",
                        format!("<html><body>{INTERNAL_TEXT}</body></html>"),
                    ),
                    Answer::NotAnObject => whole(
                        "200 OK",
                        "application/json",
                        json!({"apiVersion": "v1", "kind": "Secret", "data": INTERNAL_TEXT}).to_string(),
                    ),
                    // Holds the connection open and never answers.
                    Answer::Stall => std::future::pending().await,
                    Answer::EndlessError => {
                        "HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n".into()
                    }
                };
                if socket.write_all(reply.as_bytes()).await.is_err() {
                    return;
                }
                if let Answer::EndlessError = answer {
                    let chunk = format!("{:x}\r\n{}\r\n", 64 * INTERNAL_TEXT.len(), INTERNAL_TEXT.repeat(64));
                    while socket.write_all(chunk.as_bytes()).await.is_ok() {
                        counter.fetch_add(chunk.len(), Ordering::SeqCst);
                    }
                }
            });
        }
    });
    (address, sent)
}

/// The address in an admin kubeconfig is the tenant's: pointed at a service that is no Kubernetes
/// API server (an HTML page, a JSON document, a server that never answers or answers without end),
/// delivery fails with the asset saying so, without any of the answer, within the daemon's bound,
/// and without reading an endless answer to its end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_managed_cluster_address_that_is_no_api_server_reads_nothing_back_and_holds_nothing() {
    let (fleet, tenant) = setup().await;
    let mut servers = Vec::new();
    for (name, answer) in [
        ("html", Answer::HtmlNotFound),
        ("json", Answer::NotAnObject),
        ("stall", Answer::Stall),
        ("endless", Answer::EndlessError),
    ] {
        let (address, sent) = foreign_server(answer).await;
        let kubeconfig = kubeconfig(&format!("http://{address}"), json!({}), json!({"token": "t"}));
        installed_cluster_with_asset(&tenant, name, &kubeconfig).await;
        servers.push((name, sent));
    }
    let daemon = fleet.daemon(&["--sweep-interval", "1h", "--managed-cluster-timeout", "1s"]);

    for (name, detail) in [
        ("html", "HTTP 404 without a Kubernetes Status"),
        ("json", "not the Kubernetes object asked for"),
        ("stall", "timed out"),
        ("endless", "managed cluster request failed"),
    ] {
        until(
            &format!("asset {name} says delivery failed: {detail}"),
            WITHIN,
            &daemon,
            || async {
                asset_host_created(&tenant, name)
                    .await
                    .is_some_and(|(s, r, m)| s == "False" && r == "DeliveryFailed" && m.contains(detail))
            },
        )
        .await;
    }
    let (_, endless_sent) = servers.iter().find(|(name, _)| *name == "endless").expect("endless");
    assert!(
        endless_sent.load(Ordering::SeqCst) < 64 * 1024 * 1024,
        "the daemon kept reading an endless answer: {} bytes",
        endless_sent.load(Ordering::SeqCst)
    );
    let mut shown = vec![daemon.log_text()];
    for (name, _) in &servers {
        let asset = Api::<BareMetalAsset>::namespaced(tenant.clone(), NS)
            .get(name)
            .await
            .unwrap();
        shown.push(serde_json::to_string(&asset.status).unwrap());
        shown.push(format!("{:?}", events(&tenant, NS, name).await));
    }
    for text in shown {
        assert!(
            !text.contains(INTERNAL_TEXT),
            "the foreign server's answer was read back:\n{text}"
        );
    }
}

const HONEST_INSTALLER: &str = "quay.io/example/installer:4.14";

/// A Secret named `<cd>-admin-kubeconfig` that stackd did not create for that ClusterDeployment
/// (a stranger's, or one forging stackd's label without its uid) is never overwritten: the
/// ClusterDeployment says `AdminKubeconfigConflict`. Once the stranger's Secret is gone, stackd
/// creates its own, marked as made for that ClusterDeployment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_kubeconfig_secret_stackd_did_not_create_is_never_overwritten() {
    let (fleet, tenant) = setup().await;
    let witness = Witness::start().await;
    let good = kubeconfig(&witness.url("https"), json!({}), json!({"token": "admin-token"}));
    register_installer(
        &fleet,
        HONEST_INSTALLER,
        BTreeMap::from([("own-x".to_string(), good.clone()), ("own-y".to_string(), good.clone())]),
    );
    let mut strangers = BTreeMap::new();
    for (name, labels) in [
        ("own-x", json!({"app": "mine"})),
        (
            "own-y",
            json!({"app.kubernetes.io/managed-by": "stackd", "pools.stackd.dev/cluster-deployment": "own-y"}),
        ),
    ] {
        provisioned_cluster(&tenant, name, HONEST_INSTALLER).await;
        let secret = create_secret(
            &tenant,
            name,
            json!({"metadata": {"name": format!("{name}-admin-kubeconfig"), "labels": labels},
                "stringData": {"kubeconfig": "my own kubeconfig"}}),
        )
        .await;
        strangers.insert(name, secret);
    }
    let daemon = fleet.daemon(&["--sweep-interval", "1h"]);
    for name in ["own-x", "own-y"] {
        until(
            &format!("{name} says its admin kubeconfig Secret is not stackd's"),
            WITHIN,
            &daemon,
            || async {
                condition(&cd_conditions(&tenant, name).await, "Provisioned").is_some_and(|(s, r, m)| {
                    s == "False" && r == "AdminKubeconfigConflict" && m.contains(&format!("{name}-admin-kubeconfig"))
                })
            },
        )
        .await;
        until(&format!("an Event on {name} says so"), WITHIN, &daemon, || async {
            events(&tenant, name, name)
                .await
                .iter()
                .any(|(r, _)| r == "AdminKubeconfigConflict")
        })
        .await;
        let now = admin_secret(&tenant, name).await.expect("the stranger's Secret stays");
        let before = &strangers[name];
        assert_eq!(
            now.metadata.resource_version, before.metadata.resource_version,
            "{name} was written"
        );
        assert_eq!(now.data.unwrap()["kubeconfig"].0, b"my own kubeconfig");
    }

    // Rechecking a Secret in conflict reads it and writes nothing (issue 18 part 5).
    let own_y = Api::<ClusterDeployment>::namespaced(tenant.clone(), "own-y");
    let controllers = ["clusterdeployment"];
    crate::pools::writes_when_woken(&fleet, &daemon, &own_y, "own-y", &controllers, &[]).await;
    let (tenant_writes, host_writes) =
        crate::pools::writes_when_woken(&fleet, &daemon, &own_y, "own-y", &controllers, &[]).await;
    assert!(
        tenant_writes.is_empty() && host_writes.is_empty(),
        "tenant writes {tenant_writes:?}, host writes {host_writes:?}"
    );

    // The stranger's Secret goes: stackd copies the admin kubeconfig into a Secret of its own.
    Api::<Secret>::namespaced(tenant.clone(), "own-x")
        .delete("own-x-admin-kubeconfig", &Default::default())
        .await
        .unwrap();
    until("own-x is installed", WITHIN, &daemon, || async {
        Api::<ClusterDeployment>::namespaced(tenant.clone(), "own-x")
            .get("own-x")
            .await
            .is_ok_and(|cd| cd.status.is_some_and(|s| s.installed))
    })
    .await;
    let cd = Api::<ClusterDeployment>::namespaced(tenant.clone(), "own-x")
        .get("own-x")
        .await
        .unwrap();
    let secret = admin_secret(&tenant, "own-x").await.expect("stackd's admin kubeconfig");
    assert_eq!(secret.data.clone().unwrap()["kubeconfig"].0, good.as_bytes());
    assert_eq!(
        secret.labels().get("app.kubernetes.io/managed-by").map(String::as_str),
        Some("stackd")
    );
    assert_eq!(
        secret
            .labels()
            .get("pools.stackd.dev/cluster-deployment")
            .map(String::as_str),
        Some("own-x")
    );
    assert_eq!(
        secret.annotations().get("pools.stackd.dev/cluster-deployment-uid"),
        cd.metadata.uid.as_ref()
    );
    assert_eq!(witness.connections(), 0, "nothing delivers to own-x");
}

/// A local address other than loopback that this machine can be reached at, if it has one.
fn non_loopback_address() -> Option<IpAddr> {
    let socket = std::net::UdpSocket::bind("0.0.0.0:0").ok()?;
    // No packet is sent: connecting a UDP socket only picks the route and its source address.
    socket.connect("203.0.113.1:9").ok()?;
    let ip = socket.local_addr().ok()?.ip();
    (!ip.is_loopback() && !ip.is_unspecified()).then_some(ip)
}

/// `stackd run` binds its admin server to loopback by default; bound to every address (as in the
/// chart), `/metrics` and plain `/readyz` answer everyone but the per-tenant detail of
/// `/readyz?verbose` goes to loopback clients only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verbose_readiness_is_served_with_detail_to_loopback_clients_only() {
    let help = Command::new(env!("CARGO_BIN_EXE_stackd"))
        .args(["run", "--help"])
        .output()
        .expect("stackd run --help");
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("[default: 127.0.0.1:8080]"), "{help}");

    let Some(outside) = non_loopback_address() else {
        eprintln!("no non-loopback address on this machine; the handler's unit test covers the decision");
        return;
    };
    let fleet = Fleet::start(&["acme"]).await;
    let daemon = fleet.daemon(&["--metrics-addr", "0.0.0.0:0"]);
    let port = wait_until("the admin listener", WITHIN, &daemon, || async {
        daemon.admin_addrs().first().map(SocketAddr::port)
    })
    .await;
    let loopback = SocketAddr::from(([127, 0, 0, 1], port));
    until("the readiness detail on loopback", WITHIN, &daemon, || async {
        http_get_at(loopback, "/readyz?verbose")
            .unwrap_or_default()
            .contains("[+]tenant acme")
    })
    .await;
    let remote = SocketAddr::new(outside, port);
    let verbose = http_get_at(remote, "/readyz?verbose").expect("readyz from outside");
    assert!(
        verbose.starts_with("HTTP/1.0 200") || verbose.starts_with("HTTP/1.1 200"),
        "{verbose}"
    );
    assert!(!verbose.contains("acme"), "detail served to {outside}:\n{verbose}");
    assert!(verbose.contains("loopback clients only"), "{verbose}");
    let metrics = http_get_at(remote, "/metrics").expect("metrics from outside");
    assert!(metrics.contains("stackd_tenant_up"), "{metrics}");
    let healthz = http_get_at(remote, "/healthz").expect("healthz from outside");
    assert!(healthz.ends_with("ok"), "{healthz}");
}

fn status_of(response: &str) -> &str {
    response.lines().next().unwrap_or_default()
}

/// With `--health-addr` (as the chart runs it) the metrics listener, the one a Service exposes,
/// answers `/metrics` alone; the probes and the readiness detail are on the other listener only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_listener_answers_only_metrics_when_health_has_its_own() {
    let fleet = Fleet::start(&["acme"]).await;
    let daemon = fleet.daemon(&["--metrics-addr", "127.0.0.1:0", "--health-addr", "127.0.0.1:0"]);
    let (metrics_addr, health_addr) = wait_until("both admin listeners", WITHIN, &daemon, || async {
        match daemon.admin_addrs()[..] {
            [metrics, health] => Some((metrics, health)),
            _ => None,
        }
    })
    .await;
    until(
        "the readiness detail on the health listener",
        WITHIN,
        &daemon,
        || async {
            http_get_at(health_addr, "/readyz?verbose")
                .unwrap_or_default()
                .contains("[+]tenant acme")
        },
    )
    .await;
    let metrics = http_get_at(metrics_addr, "/metrics").expect("metrics");
    assert!(status_of(&metrics).contains(" 200 "), "{metrics}");
    assert!(metrics.contains("stackd_tenant_up"), "{metrics}");
    for path in ["/readyz?verbose", "/readyz", "/healthz"] {
        let response = http_get_at(metrics_addr, path).expect("metrics listener");
        assert!(
            status_of(&response).contains(" 404 "),
            "{path} on the metrics listener: {response}"
        );
        assert!(!response.contains("acme"), "{response}");
    }
    let healthz = http_get_at(health_addr, "/healthz").expect("healthz");
    assert!(healthz.ends_with("ok"), "{healthz}");
    let not_metrics = http_get_at(health_addr, "/metrics").expect("health listener");
    assert!(status_of(&not_metrics).contains(" 404 "), "{not_metrics}");
}
