//! The benchmark's world: embedded host and tenant servers in this process, and the daemon as a
//! separate child process (so its memory is its own), configured through real kubeconfig files.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, PostParams};
use serde::{Deserialize, Serialize};
use tokio::process::{Child, Command};

use super::BenchError;
use crate::embedded::counters::RequestCounts;
use crate::embedded::samples::{SampleImages, register_sample_runners};
use crate::embedded::{ApiServer, ServerOptions};

/// The stackd image install Jobs get in a benchmark.
pub const BENCH_STACKD_IMAGE: &str = "stackd:bench";

pub struct Fleet {
    pub host: ApiServer,
    pub tenants: Vec<(String, ApiServer)>,
    dir: tempfile::TempDir,
    /// Where daemon logs go when they must outlive the fleet (`--keep-logs`).
    log_dir: Option<PathBuf>,
}

/// How the bench's tenant API servers are spoken to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum TenantTransport {
    /// https offering HTTP/2, as a real tenant's kube-apiserver: every watch and request of a
    /// tenant on one connection.
    #[default]
    Http2,
    /// https, HTTP/1.1 only: a connection per watch.
    Http1,
    /// Plain http (HTTP/1.1): no TLS at all, which no real tenant serves; a baseline.
    Plain,
}

impl TenantTransport {
    fn options(self, name: String) -> ServerOptions {
        ServerOptions {
            name,
            tls: self != TenantTransport::Plain,
            http2: self == TenantTransport::Http2,
            ..Default::default()
        }
    }
}

/// Tenant API servers [`Fleet::start`] starts at once.
const TENANTS_STARTED_AT_ONCE: usize = 4;

/// A tenant API server serving stackd's CRDs, its kubeconfig written into `tenants_dir`. By
/// default it serves https and offers HTTP/2, as a real tenant's kube-apiserver does, so the
/// daemon's client of it is the one it has in production: every watch and request on one connection.
async fn start_tenant(
    name: String,
    tenants_dir: &Path,
    transport: TenantTransport,
) -> Result<(String, ApiServer), BenchError> {
    let server = ApiServer::start(transport.options(name.clone())).await?;
    let crds: Api<CustomResourceDefinition> = Api::all(server.client().await);
    for crd in crate::api::crds::all() {
        crds.create(&PostParams::default(), &crd).await?;
    }
    std::fs::write(tenants_dir.join(format!("{name}.yaml")), server.kubeconfig_yaml())?;
    Ok((name, server))
}

impl Fleet {
    pub async fn start(tenants: usize) -> Result<Fleet, BenchError> {
        Fleet::start_with(tenants, TenantTransport::default()).await
    }

    /// [`Fleet::start`] with tenants spoken to over `transport`.
    pub async fn start_with(tenants: usize, transport: TenantTransport) -> Result<Fleet, BenchError> {
        let host = ApiServer::start(ServerOptions {
            name: "host".into(),
            ..Default::default()
        })
        .await?;
        register_sample_runners(&host.runners(), &SampleImages::new(BENCH_STACKD_IMAGE));
        let dir = tempfile::tempdir()?;
        std::fs::create_dir(dir.path().join("tenants"))?;
        std::fs::write(dir.path().join("host.yaml"), host.kubeconfig_yaml())?;
        // Started a few at once: a crowd's start-up is mostly the servers' CRD set-up, which one at a
        // time leaves a core idle while each request makes its round trip.
        let tenants_dir = dir.path().join("tenants");
        let tenants = futures::stream::iter(0..tenants)
            .map(|index| start_tenant(format!("t{index:03}"), &tenants_dir, transport))
            .buffered(TENANTS_STARTED_AT_ONCE)
            .try_collect()
            .await?;
        Ok(Fleet {
            host,
            tenants,
            dir,
            log_dir: None,
        })
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Writes the logs of daemons started from now on into `dir` instead of the fleet's temp dir.
    pub fn keep_logs(&mut self, dir: &Path) -> Result<(), BenchError> {
        std::fs::create_dir_all(dir)?;
        self.log_dir = Some(dir.to_path_buf());
        Ok(())
    }

    /// Starts `stackd run` against this fleet.
    pub fn daemon(&self, extra: &[&str]) -> Result<DaemonProcess, BenchError> {
        DaemonProcess::spawn(self.dir.path(), self.log_dir(), extra, &[])
    }

    /// Where daemon logs go.
    pub fn log_dir(&self) -> &Path {
        self.log_dir.as_deref().unwrap_or(self.dir.path())
    }

    /// Requests every server has seen so far, host first.
    pub fn counters(&self) -> Vec<RequestCounts> {
        std::iter::once(self.host.counters())
            .chain(self.tenants.iter().map(|(_, s)| s.counters()))
            .collect()
    }

    pub async fn shutdown(self) {
        for (_, server) in self.tenants {
            server.shutdown().await;
        }
        self.host.shutdown().await;
    }
}

/// A `stackd run` child process; killed when dropped.
pub struct DaemonProcess {
    pub child: Child,
    pub admin: SocketAddr,
    pub log: PathBuf,
}

/// The daemons' `RUST_LOG`: `STACKD_BENCH_LOG`, else warnings only.
pub fn log_filter() -> String {
    std::env::var("STACKD_BENCH_LOG").unwrap_or_else(|_| "warn".into())
}

impl DaemonProcess {
    /// `stackd run` with `dir/host.yaml` and `dir/tenants`, `extra` flags and `env` (which wins over
    /// the default `RUST_LOG`).
    pub fn spawn(
        dir: &Path,
        log_dir: &Path,
        extra: &[&str],
        env: &[(&str, String)],
    ) -> Result<DaemonProcess, BenchError> {
        DaemonProcess::spawn_capped(dir, log_dir, extra, env, None)
    }

    /// [`DaemonProcess::spawn`], with the address space capped at `address_space` bytes (`ulimit
    /// -v`) when given: an unbounded allocation then aborts the daemon as a pod's memory limit
    /// would, instead of taking the shared machine's memory.
    pub fn spawn_capped(
        dir: &Path,
        log_dir: &Path,
        extra: &[&str],
        env: &[(&str, String)],
        address_space: Option<u64>,
    ) -> Result<DaemonProcess, BenchError> {
        let admin = free_port()?;
        let log = log_dir.join(format!("daemon-{}.log", admin.port()));
        let exe = std::env::current_exe()?;
        let mut command = match address_space {
            None => Command::new(exe),
            Some(bytes) => {
                // `exec` keeps the pid: /proc/<pid> is the daemon's, not the shell's.
                let mut shell = Command::new("sh");
                let script = format!("ulimit -v {} && exec \"$0\" \"$@\"", bytes / 1024);
                shell.args(["-c", &script]).arg(exe);
                shell
            }
        };
        let child = command
            .args(["run", "--host-kubeconfig"])
            .arg(dir.join("host.yaml"))
            .arg("--tenants-dir")
            .arg(dir.join("tenants"))
            .args(["--metrics-addr", &admin.to_string()])
            .args(["--stackd-image", BENCH_STACKD_IMAGE, "--allow-insecure-tenant-endpoint"])
            .args(["--backoff-base", "100ms", "--debounce", "50ms"])
            .args(extra)
            .env("RUST_LOG", log_filter())
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?)
            .kill_on_drop(true)
            .spawn()?;
        Ok(DaemonProcess { child, admin, log })
    }

    /// Resident memory of the daemon, in MiB.
    pub fn rss_mib(&self) -> Option<f64> {
        self.status_mib("VmRSS:")
    }

    /// The most resident memory the daemon has had so far (`VmHWM`), in MiB.
    pub fn peak_rss_mib(&self) -> Option<f64> {
        self.status_mib("VmHWM:")
    }

    /// A `kB` field of `/proc/<pid>/status`, in MiB.
    fn status_mib(&self, field: &str) -> Option<f64> {
        let pid = self.child.id()?;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let line = status.lines().find(|l| l.starts_with(field))?;
        let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib / 1024.0)
    }

    /// The daemon's `/metrics` text.
    pub async fn metrics(&self) -> String {
        let url = format!("http://{}/metrics", self.admin);
        http_get(&url).await.unwrap_or_default()
    }

    /// Waits until `count` tenants answer and serve stackd's CRDs (`stackd_tenant_up` 1): the
    /// crowd's `startup_s`, measured so since issue 32.
    pub async fn wait_tenants_answering(&self, count: usize, within: Duration) -> Result<Duration, BenchError> {
        let answering = |line: &str| line.starts_with("stackd_tenant_up{") && line.ends_with(" 1");
        self.wait_for_lines("/metrics", answering, count, within, "answering")
            .await
    }

    /// Waits until `count` tenants are up: started, every controller's caches filled
    /// (`[+]tenant … ok` on `/readyz?verbose`, which loopback clients are shown).
    pub async fn wait_tenants_up(&self, count: usize, within: Duration) -> Result<Duration, BenchError> {
        let up = |line: &str| line.starts_with("[+]tenant ") && line.ends_with(" ok");
        self.wait_for_lines("/readyz?verbose", up, count, within, "up").await
    }

    /// Waits until `count` lines of the admin server's answer at `path` are `wanted`.
    async fn wait_for_lines(
        &self,
        path: &str,
        wanted: impl Fn(&str) -> bool,
        count: usize,
        within: Duration,
        what: &str,
    ) -> Result<Duration, BenchError> {
        let started = Instant::now();
        let url = format!("http://{}{path}", self.admin);
        loop {
            let answer = http_get(&url).await.unwrap_or_default();
            let found = answer.lines().filter(|line| wanted(line)).count();
            if found >= count {
                return Ok(started.elapsed());
            }
            if started.elapsed() > within {
                return Err(BenchError::Timeout(format!(
                    "{found} of {count} tenants {what} after {within:?}; daemon log {}",
                    self.log.display()
                )));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub async fn kill(mut self) {
        let _ = self.child.kill().await;
    }
}

fn free_port() -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    listener.local_addr()
}

/// A plain HTTP/1.0 GET on loopback (the admin endpoint speaks plain HTTP).
pub(super) async fn http_get(url: &str) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let rest = url.strip_prefix("http://")?;
    let (address, path) = rest.split_once('/').map(|(a, p)| (a, format!("/{p}")))?;
    let mut stream = tokio::time::timeout(Duration::from_secs(2), tokio::net::TcpStream::connect(address))
        .await
        .ok()?
        .ok()?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").as_bytes())
        .await
        .ok()?;
    let mut body = String::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_string(&mut body))
        .await
        .ok()?
        .ok()?;
    Some(body)
}
