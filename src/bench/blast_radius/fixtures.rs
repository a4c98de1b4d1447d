//! What the host plays for tenant A's attacks: a second package shipping the sample's CRD, whose
//! installs park in `CRDConflict` once the sample's install created it; a package whose controller
//! asks for nearly all of the tenant's host CPU; and an installer that pads its output Secret and
//! strips stackd's marks from it (it holds a token for that Secret, as every installer does).

use std::path::Path;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

use super::super::BenchError;
use super::super::fleet::BENCH_STACKD_IMAGE;
use crate::embedded::ApiServer;
use crate::embedded::controller_manager::{ImageMatch, JobContext, JobOutcome};
use crate::embedded::samples::{SampleImages, create_cluster, register_sample_runners};

/// The package whose only CRD is the sample's: its installs conflict with the sample's.
pub(super) const SQUATTER_PACKAGE: &str = "stackd-examples/squatter-stack:v0.1.0";
/// The sample in a CRD group of its own, whose controller requests 7900m of CPU: nearly the whole
/// host quota of its tenant (`requests.cpu=8`).
pub(super) const GREEDY_PACKAGE: &str = "stackd-examples/greedy-stack:v0.1.0";
/// The installer that pads its output Secret past the cache's cap and removes stackd's
/// tenant-namespace annotation from it.
pub(super) const PADDING_INSTALLER: &str = "quay.io/example/padding-installer:1";
/// What it pads the output with: over `--max-cached-object-bytes` (512 KiB) as JSON.
const PADDING_BYTES: usize = 600_000;

/// Serves the example packages and `squatter-stack` (a copy of `sample-stack` under another name)
/// from `dir`; registered after the fleet's runners, so these win.
pub(super) fn serve_packages(host: &ApiServer, dir: &Path) -> Result<(), BenchError> {
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples").join("packages");
    for (from, to) in [
        ("sample-stack", "sample-stack"),
        ("cluster-stack", "cluster-stack"),
        ("sample-stack", "squatter-stack"),
    ] {
        copy_dir(&examples.join(from), &dir.join(to))?;
    }
    greedy_package(&examples.join("sample-stack"), &dir.join("greedy-stack"))?;
    let mut images = SampleImages::new(BENCH_STACKD_IMAGE);
    images.packages_dir = dir.to_path_buf();
    register_sample_runners(&host.runners(), &images);
    Ok(())
}

/// The sample with its CRD in `greedy.example.org` and its controller asking for 7900m of CPU.
fn greedy_package(sample: &Path, to: &Path) -> Result<(), BenchError> {
    copy_dir(sample, to)?;
    let registry = to.join(".registry");
    let rewrite = |file: &Path, from: &str, into: &str| -> Result<(), BenchError> {
        let text = std::fs::read_to_string(file)?;
        if !text.contains(from) {
            return Err(BenchError::Io(std::io::Error::other(format!(
                "{} no longer holds {from:?}: the sample package changed shape",
                file.display()
            ))));
        }
        std::fs::write(file, text.replace(from, into))?;
        Ok(())
    };
    rewrite(&registry.join("install.yaml"), "cpu: 10m", "cpu: 7900m")?;
    rewrite(
        &registry.join("resources/widget.crd.yaml"),
        "samples.example.org",
        "greedy.example.org",
    )
}

/// Registers [`PADDING_INSTALLER`]: it installs as the sample installer does, then pads its
/// output Secret with `host`, the rights its token gives it.
pub(super) fn serve_padding_installer(host: &ApiServer, client: Client) {
    host.runners()
        .register(ImageMatch::Exact(PADDING_INSTALLER.into()), move |ctx: &JobContext| {
            if ctx.args.iter().any(|a| a == "destroy") {
                return JobOutcome::success("destroyed\n");
            }
            let outcome = create_cluster(ctx);
            let (Some(namespace), Some(name)) = (ctx.env("STACKD_OUTPUT_NAMESPACE"), ctx.env("STACKD_OUTPUT_SECRET"))
            else {
                return JobOutcome::failure(1, "no output Secret named\n");
            };
            let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
            let pad = json!({
                "metadata": {"annotations": {"stackd.dev/tenant-namespace": null}},
                "data": {"pad": ByteString(vec![b'x'; PADDING_BYTES])},
            });
            // Runners run on a blocking thread of the server's runtime.
            let padded = tokio::runtime::Handle::current().block_on(secrets.patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(&pad),
            ));
            match padded {
                Ok(_) => outcome,
                Err(e) => JobOutcome::failure(1, format!("{e}\n")),
            }
        });
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
