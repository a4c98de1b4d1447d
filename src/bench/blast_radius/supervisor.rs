//! The daemon as a pod would run it: a child process started again whenever it exits (as the
//! kubelet restarts a container), each exit counted with how it ended, and its peak resident memory
//! (`VmHWM`) sampled while it lives, the figure a memory limit is judged by.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Mutex;
use tokio_util::task::AbortOnDropHandle;

use super::super::BenchError;
use super::super::fleet::DaemonProcess;

/// How often the process is looked at: an exit is seen (and the daemon started again) within this.
const SAMPLE_EVERY: Duration = Duration::from_millis(100);

/// How to start the daemon again.
#[derive(Clone)]
struct Launch {
    dir: PathBuf,
    log_dir: PathBuf,
    args: Vec<String>,
    address_space: Option<u64>,
}

impl Launch {
    fn spawn(&self) -> Result<DaemonProcess, BenchError> {
        let args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        DaemonProcess::spawn_capped(&self.dir, &self.log_dir, &args, &[], self.address_space)
    }
}

struct State {
    daemon: DaemonProcess,
    /// How each earlier process ended, with its log.
    exits: Vec<String>,
    peak_rss_mib: f64,
}

/// A `stackd run` child process that is started again when it exits.
pub(super) struct Supervised {
    state: Arc<Mutex<State>>,
    _watch: AbortOnDropHandle<()>,
}

impl Supervised {
    /// Starts `stackd run` with `args` against the fleet in `dir`, its address space capped at
    /// `address_space` bytes when given.
    pub(super) fn start(
        dir: &Path,
        log_dir: &Path,
        args: &[&str],
        address_space: Option<u64>,
    ) -> Result<Self, BenchError> {
        let launch = Launch {
            dir: dir.to_path_buf(),
            log_dir: log_dir.to_path_buf(),
            args: args.iter().map(|a| a.to_string()).collect(),
            address_space,
        };
        let state = Arc::new(Mutex::new(State {
            daemon: launch.spawn()?,
            exits: Vec::new(),
            peak_rss_mib: 0.0,
        }));
        let watched = state.clone();
        let watch = tokio::spawn(async move {
            loop {
                tokio::time::sleep(SAMPLE_EVERY).await;
                look_at(&watched, &launch).await;
            }
        });
        Ok(Supervised {
            state,
            _watch: AbortOnDropHandle::new(watch),
        })
    }

    /// Waits until `count` tenants report up on whichever process runs (a restart is let happen).
    pub(super) async fn wait_tenants_up(&self, count: usize, within: Duration) -> Result<(), BenchError> {
        let started = std::time::Instant::now();
        loop {
            let metrics = self.metrics().await;
            let up = metrics
                .lines()
                .filter(|l| l.starts_with("stackd_tenant_up{") && l.ends_with(" 1"))
                .count();
            if up >= count {
                return Ok(());
            }
            if started.elapsed() > within {
                return Err(BenchError::Timeout(format!(
                    "{up} of {count} tenants up after {within:?}; daemon log {}",
                    self.log().await.display()
                )));
            }
            tokio::time::sleep(SAMPLE_EVERY).await;
        }
    }

    /// The current process's `/metrics` text (the lock is not held while it is fetched).
    pub(super) async fn metrics(&self) -> String {
        let admin = self.state.lock().await.daemon.admin;
        super::super::fleet::http_get(&format!("http://{admin}/metrics"))
            .await
            .unwrap_or_default()
    }

    /// The current process's CPU seconds (user and system) and resident memory in MiB.
    pub(super) async fn usage(&self) -> (f64, f64) {
        let state = self.state.lock().await;
        let pid = state.daemon.child.id().map(|p| p.to_string()).unwrap_or_default();
        (
            super::super::cost::cpu_seconds(&pid),
            state.daemon.rss_mib().unwrap_or(0.0),
        )
    }

    /// The current process's log.
    pub(super) async fn log(&self) -> PathBuf {
        self.state.lock().await.daemon.log.clone()
    }

    /// Stops the daemon; returns how every earlier process ended and the peak resident memory of
    /// all of them, in MiB.
    pub(super) async fn stop(self) -> (Vec<String>, f64) {
        // The watch first, and waited for: between a kill and its abort it would take the kill for
        // a crash and start a process nobody stops.
        let Supervised { state, _watch: watch } = self;
        watch.abort();
        let _ = watch.await;
        let mut state = state.lock().await;
        sample_peak(&mut state);
        let _ = state.daemon.child.kill().await;
        (std::mem::take(&mut state.exits), state.peak_rss_mib)
    }
}

/// One look: the peak memory so far, and a new process if the current one exited.
async fn look_at(state: &Mutex<State>, launch: &Launch) {
    let mut state = state.lock().await;
    sample_peak(&mut state);
    let Ok(Some(status)) = state.daemon.child.try_wait() else {
        return;
    };
    let ended = describe(status);
    let log = state.daemon.log.display().to_string();
    eprintln!("bench:   the daemon {ended}; starting it again (its log: {log})");
    state.exits.push(format!("{ended} (log {log})"));
    match launch.spawn() {
        Ok(daemon) => state.daemon = daemon,
        // Counted again on the next look, as a crash loop would be.
        Err(err) => eprintln!("bench:   cannot start the daemon again: {err}"),
    }
}

fn sample_peak(state: &mut State) {
    if let Some(peak) = state.daemon.peak_rss_mib() {
        state.peak_rss_mib = state.peak_rss_mib.max(peak);
    }
}

/// "exited with code 1", "was killed by signal 6 (SIGABRT)".
fn describe(status: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with code {code}"),
        (None, Some(6)) => "was killed by signal 6 (SIGABRT: an allocation failed or a panic aborted)".into(),
        (None, Some(9)) => "was killed by signal 9 (SIGKILL)".into(),
        (None, Some(signal)) => format!("was killed by signal {signal}"),
        (None, None) => "ended".into(),
    }
}
