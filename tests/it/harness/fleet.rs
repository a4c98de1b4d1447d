//! The daemon binary against embedded host and tenant API servers: a fleet of servers with their
//! kubeconfigs in a temp dir, and daemon processes with their logs and metrics.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::rbac::v1::RoleBinding;
use kube::api::Api;
use stackd::embedded::{ApiServer, ServerOptions};

/// One host, some tenants, their kubeconfigs in a temp dir, and daemon processes.
pub(crate) struct Fleet {
    /// Kept so the host server lives as long as the fleet.
    _host: ApiServer,
    pub(crate) host_client: kube::Client,
    pub(crate) tenants: Vec<(String, Option<ApiServer>)>,
    pub(crate) dir: tempfile::TempDir,
}

impl Fleet {
    pub(crate) async fn start(tenants: &[&str]) -> Fleet {
        let host = ApiServer::start(ServerOptions {
            name: "host".into(),
            ..Default::default()
        })
        .await
        .expect("host");
        let host_client = host.client().await;
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::create_dir(dir.path().join("tenants")).expect("tenants dir");
        std::fs::write(dir.path().join("host.yaml"), host.kubeconfig_yaml()).expect("host kubeconfig");
        let mut fleet = Fleet {
            _host: host,
            host_client,
            tenants: Vec::new(),
            dir,
        };
        for name in tenants {
            fleet.add_tenant(name).await;
        }
        fleet
    }

    pub(crate) async fn add_tenant(&mut self, name: &str) {
        let kubeconfig = self.add_tenant_server(name).await;
        std::fs::write(self.tenant_file(name), kubeconfig).expect("tenant kubeconfig");
    }

    /// A tenant API server with no file in the tenants directory (for a Tenant object to name):
    /// its kubeconfig.
    pub(crate) async fn add_tenant_server(&mut self, name: &str) -> String {
        self.add_tenant_server_with(ServerOptions {
            name: name.into(),
            ..Default::default()
        })
        .await
    }

    /// A tenant whose API server runs with `options` (named by them), with its kubeconfig file.
    pub(crate) async fn add_tenant_with(&mut self, options: ServerOptions) {
        let name = options.name.clone();
        let kubeconfig = self.add_tenant_server_with(options).await;
        std::fs::write(self.tenant_file(&name), kubeconfig).expect("tenant kubeconfig");
    }

    /// A tenant API server running with `options` (named by them), with no file in the tenants
    /// directory: its kubeconfig.
    pub(crate) async fn add_tenant_server_with(&mut self, options: ServerOptions) -> String {
        let name = options.name.clone();
        let server = ApiServer::start(options).await.expect("tenant");
        let kubeconfig = server.kubeconfig_yaml();
        self.tenants.push((name, Some(server)));
        kubeconfig
    }

    /// A tenant's API server, while it runs.
    pub(crate) fn tenant_server(&self, name: &str) -> &ApiServer {
        self.tenants
            .iter()
            .find(|(n, _)| n == name)
            .and_then(|(_, server)| server.as_ref())
            .expect("a running tenant server")
    }

    pub(crate) fn tenant_file(&self, name: &str) -> PathBuf {
        self.dir.path().join("tenants").join(format!("{name}.yaml"))
    }

    pub(crate) async fn stop_tenant_server(&mut self, name: &str) {
        let slot = self.tenants.iter_mut().find(|(n, _)| n == name).expect("known tenant");
        if let Some(server) = slot.1.take() {
            server.shutdown().await;
        }
    }

    /// The host API server, e.g. to script its Job runners.
    pub(crate) fn host(&self) -> &ApiServer {
        &self._host
    }

    /// The host namespace the leader Lease lives in (`--leader-elect-namespace`'s default).
    pub(crate) async fn leader_election_namespace(&self) {
        let system: Namespace =
            serde_json::from_value(serde_json::json!({"metadata": {"name": "stackd-system"}})).expect("ns");
        self.namespaces()
            .create(&Default::default(), &system)
            .await
            .expect("create stackd-system");
    }

    pub(crate) fn daemon(&self, extra: &[&str]) -> Daemon {
        Daemon::spawn(self.dir.path(), extra)
    }

    /// A daemon whose address space is capped at `bytes` (`ulimit -v`), so that an unbounded
    /// allocation aborts it as it would a pod under a memory limit, instead of taking the machine's
    /// memory.
    pub(crate) fn daemon_with_address_space(&self, extra: &[&str], bytes: u64) -> Daemon {
        let dir = self.dir.path();
        Daemon::spawn_as(dir, &dir.join("host.yaml"), extra, Some(bytes))
    }

    pub(crate) fn namespaces(&self) -> Api<Namespace> {
        Api::all(self.host_client.clone())
    }

    pub(crate) async fn namespace(&self, tenant: &str) -> Option<Namespace> {
        self.namespaces()
            .get_opt(&format!("tenant-{tenant}-controllers"))
            .await
            .expect("get namespace")
    }

    pub(crate) async fn binding(&self, tenant: &str) -> Option<RoleBinding> {
        let api: Api<RoleBinding> = Api::namespaced(self.host_client.clone(), &format!("tenant-{tenant}-controllers"));
        api.get_opt("stackd-tenant-namespace").await.expect("get binding")
    }

    pub(crate) async fn wait_for_namespace(&self, tenant: &str, within: Duration) -> Namespace {
        let deadline = Instant::now() + within;
        loop {
            if let Some(ns) = self.namespace(tenant).await
                && ns.metadata.deletion_timestamp.is_none()
                && self.binding(tenant).await.is_some()
            {
                return ns;
            }
            assert!(
                Instant::now() < deadline,
                "host namespace of {tenant} did not appear within {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// A `stackd run` child process, killed when dropped.
pub(crate) struct Daemon {
    child: Child,
    /// The admin address, read from the log once the daemon has bound it (it binds port 0: a port
    /// picked free beforehand may be taken by another test's process before the daemon binds it).
    admin: OnceLock<SocketAddr>,
    log: PathBuf,
}

/// The addresses in the daemon's "admin server listening" lines, in the order it bound them (the
/// metrics listener first, then `--health-addr`'s), from its plain text log (the harness sets
/// `NO_COLOR`) or its JSON log.
fn admin_addrs_in(log: &str) -> Vec<SocketAddr> {
    log.lines()
        .filter(|line| line.contains("admin server listening"))
        .filter_map(|line| {
            let after = &line[line.find("admin_addr")? + "admin_addr".len()..];
            let start = after.find(|c: char| c.is_ascii_digit())?;
            let addr: String = after[start..]
                .chars()
                .take_while(|c| c.is_ascii_digit() || *c == '.' || *c == ':')
                .collect();
            addr.parse().ok()
        })
        .collect()
}

impl Daemon {
    /// `stackd run` with `dir/host.yaml` and `dir/tenants`, fast timing flags and `extra`.
    pub(crate) fn spawn(dir: &Path, extra: &[&str]) -> Daemon {
        Daemon::spawn_with_host(dir, &dir.join("host.yaml"), extra)
    }

    /// Like [`Daemon::spawn`], with another host kubeconfig (e.g. one through a proxy).
    pub(crate) fn spawn_with_host(dir: &Path, host_kubeconfig: &Path, extra: &[&str]) -> Daemon {
        Daemon::spawn_as(dir, host_kubeconfig, extra, None)
    }

    /// `stackd run`, its address space capped at `address_space` bytes when given (the shell sets
    /// the limit and becomes the daemon: the child's pid is the daemon's).
    fn spawn_as(dir: &Path, host_kubeconfig: &Path, extra: &[&str], address_space: Option<u64>) -> Daemon {
        static SPAWNED: AtomicUsize = AtomicUsize::new(0);
        let log = dir.join(format!("daemon-{}.log", SPAWNED.fetch_add(1, Ordering::Relaxed)));
        let log_file = std::fs::File::create(&log).expect("log file");
        let mut command = match address_space {
            None => Command::new(env!("CARGO_BIN_EXE_stackd")),
            Some(bytes) => {
                let mut shell = Command::new("sh");
                let script = format!("ulimit -v {} && exec \"$0\" \"$@\"", bytes / 1024);
                shell.args(["-c", &script, env!("CARGO_BIN_EXE_stackd")]);
                shell
            }
        };
        let child = command
            .args(["run", "--host-kubeconfig"])
            .arg(host_kubeconfig)
            .arg("--tenants-dir")
            .arg(dir.join("tenants"))
            .args(if extra.contains(&"--metrics-addr") {
                &[][..]
            } else {
                &["--metrics-addr", "127.0.0.1:0"][..]
            })
            .args(if extra.contains(&"--backoff-base") {
                &[][..]
            } else {
                &["--backoff-base", "100ms"][..]
            })
            .args(["--debounce", "50ms", "--rescan-interval", "2s"])
            .args(extra)
            .env("NO_COLOR", "1")
            .env(
                "RUST_LOG",
                std::env::var("STACKD_TEST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .expect("spawn stackd run");
        Daemon {
            child,
            admin: OnceLock::new(),
            log,
        }
    }

    /// The addresses the daemon's admin listeners bound, in the order it bound them (none before it
    /// has). Give `--metrics-addr` (and `--health-addr`) with port 0 to choose the interface.
    pub(crate) fn admin_addrs(&self) -> Vec<SocketAddr> {
        admin_addrs_in(&self.log_text())
    }

    pub(crate) fn http_get(&self, path: &str) -> Option<String> {
        let admin = match self.admin.get() {
            Some(admin) => *admin,
            None => {
                let found = *self.admin_addrs().first()?;
                *self.admin.get_or_init(|| found)
            }
        };
        http_get_at(admin, path)
    }

    /// How many reconciles of `controller` for `tenant` have finished (the duration histogram's
    /// count), to wait for a reconcile instead of sleeping.
    pub(crate) fn reconciles_done(&self, tenant: &str, controller: &str) -> u64 {
        self.controller_metric("stackd_reconcile_duration_seconds_count", tenant, controller)
    }

    /// A per-controller series of `/metrics` (0 while it has none).
    pub(crate) fn controller_metric(&self, name: &str, tenant: &str, controller: &str) -> u64 {
        let needle = format!("{name}{{tenant=\"{tenant}\",controller=\"{controller}\"}} ");
        self.http_get("/metrics")
            .unwrap_or_default()
            .lines()
            .find_map(|line| line.strip_prefix(&needle).and_then(|n| n.trim().parse().ok()))
            .unwrap_or(0)
    }

    /// Waits until `/readyz?verbose` (or `/metrics`) contains `needle`.
    pub(crate) async fn wait_for(&self, path: &str, needle: &str, within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            let body = self.http_get(path).unwrap_or_default();
            if body.contains(needle) {
                return body;
            }
            assert!(
                Instant::now() < deadline,
                "{path} never showed {needle:?}; last:\n{body}\nlog:\n{}",
                self.log_text()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The process's resident memory in KiB (0 where unknown).
    pub(crate) fn rss_kib(&self) -> u64 {
        self.rss_bytes() / 1024
    }

    /// The daemon's resident memory now, from `/proc` (Linux).
    pub(crate) fn rss_bytes(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap_or_default();
        status
            .lines()
            .find_map(|line| line.strip_prefix("VmRSS:"))
            .and_then(|kib| kib.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or(0, |kib| kib * 1024)
    }

    pub(crate) fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// True while the process has not exited.
    pub(crate) fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// The most memory the process has held resident so far (`VmHWM`, Linux), in bytes.
    pub(crate) fn peak_resident_bytes(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).ok()?;
        let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib * 1024)
    }

    /// `kill -9`.
    pub(crate) fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub(crate) fn terminate(&self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
    }

    /// Waits for the process to exit; `None` if it is still running after `within`.
    pub(crate) async fn wait_exit(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        None
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An address nobody listens on while it is held: its port is bound, so no other test's server can
/// take it (a port merely found free can be, by a test running beside this one), but not listening,
/// so every connection to it is refused.
pub(crate) struct DeadAddress {
    _held: tokio::net::TcpSocket,
    pub(crate) address: SocketAddr,
}

pub(crate) fn dead_address() -> DeadAddress {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.bind("127.0.0.1:0".parse().expect("address")).expect("bind");
    let address = socket.local_addr().expect("addr");
    DeadAddress { _held: socket, address }
}

/// The whole response (status line and headers included) to a GET of `path` at `address`, or None
/// when nothing answers in time.
pub(crate) fn http_get_at(address: SocketAddr, path: &str) -> Option<String> {
    let mut stream = TcpStream::connect_timeout(&address, Duration::from_secs(1)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    Some(response)
}
