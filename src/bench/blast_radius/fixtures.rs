//! What the host plays for tenant A's attacks: a second package shipping the sample's CRD (the
//! install that parks in `CRDConflict`), and a managed cluster that accepts connections and never
//! answers, which an installer image hands out as its clusters' admin kubeconfig.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio_util::task::AbortOnDropHandle;

use super::super::BenchError;
use super::super::fleet::BENCH_STACKD_IMAGE;
use crate::embedded::ApiServer;
use crate::embedded::controller_manager::{ImageMatch, JobContext, JobOutcome};
use crate::embedded::samples::{SampleImages, register_sample_runners};

/// The package whose only CRD is the sample's: its installs conflict with the sample's.
pub const SQUATTER_PACKAGE: &str = "stackd-examples/squatter-stack:v0.1.0";
/// The installer image whose clusters' admin kubeconfig names the stalling server.
pub const STALLING_INSTALLER: &str = "quay.io/example/stalling-installer:4.14";

/// Serves the example packages and `squatter-stack` (a copy of `sample-stack` under another name)
/// from `dir`; registered after the fleet's runners, so these win.
pub fn serve_packages(host: &ApiServer, dir: &Path) -> Result<(), BenchError> {
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples").join("packages");
    for (from, to) in [
        ("sample-stack", "sample-stack"),
        ("cluster-stack", "cluster-stack"),
        ("sample-stack", "squatter-stack"),
    ] {
        copy_dir(&examples.join(from), &dir.join(to))?;
    }
    let mut images = SampleImages::new(BENCH_STACKD_IMAGE);
    images.packages_dir = dir.to_path_buf();
    register_sample_runners(&host.runners(), &images);
    Ok(())
}

fn copy_dir(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_dir(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), target)?;
        }
    }
    Ok(())
}

/// A server that accepts connections and never answers; it lives as long as this value.
pub struct StallingCluster {
    pub kubeconfig: String,
    accepted: Arc<AtomicUsize>,
    _serve: AbortOnDropHandle<()>,
}

impl StallingCluster {
    pub async fn start() -> Result<StallingCluster, BenchError> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let address = listener.local_addr()?;
        let accepted = Arc::new(AtomicUsize::new(0));
        let counted = accepted.clone();
        let serve = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((socket, _)) = listener.accept().await {
                counted.fetch_add(1, Ordering::SeqCst);
                held.push(socket);
            }
        });
        let kubeconfig = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: stalled\n  cluster:\n    server: http://{address}\n\
             contexts:\n- name: admin\n  context:\n    cluster: stalled\n    user: admin\ncurrent-context: admin\n\
             users:\n- name: admin\n  user:\n    token: t\n"
        );
        Ok(StallingCluster {
            kubeconfig,
            accepted,
            _serve: AbortOnDropHandle::new(serve),
        })
    }

    /// Connections the daemon opened to it.
    pub fn connections(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }

    /// Makes [`STALLING_INSTALLER`] install clusters whose admin kubeconfig names this server.
    pub fn register_installer(&self, host: &ApiServer) {
        let kubeconfig = self.kubeconfig.clone();
        host.runners()
            .register(ImageMatch::Exact(STALLING_INSTALLER.into()), move |ctx: &JobContext| {
                if ctx.args.iter().any(|a| a == "destroy") {
                    return JobOutcome::success("destroyed\n");
                }
                let (Some(namespace), Some(secret)) =
                    (ctx.env("STACKD_OUTPUT_NAMESPACE"), ctx.env("STACKD_OUTPUT_SECRET"))
                else {
                    return JobOutcome::failure(1, "no output secret\n");
                };
                let data = std::collections::BTreeMap::from([
                    ("kubeconfig".to_string(), kubeconfig.clone()),
                    ("metadata.json".to_string(), r#"{"infraID":"stalled-x1"}"#.to_string()),
                ]);
                match ctx.write_secret_data(namespace, secret, &data) {
                    Ok(_) => JobOutcome::success("Install complete!\n"),
                    Err(e) => JobOutcome::failure(1, format!("{}\n", e.message)),
                }
            });
    }
}
