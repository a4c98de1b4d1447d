//! What the host plays for tenant A's attacks: a second package shipping the sample's CRD, whose
//! installs park in `CRDConflict` once the sample's install created it; a package whose controller
//! asks for nearly all of the tenant's host CPU; and an installer that pads its output Secret and
//! strips stackd's marks from it (it holds a token for that Secret, as every installer does).

use std::path::Path;

use super::super::BenchError;
use super::super::fleet::BENCH_STACKD_IMAGE;
use crate::embedded::ApiServer;
use crate::embedded::controller_manager::ImageMatch;
use crate::embedded::samples::{SampleImages, padding_installer, register_sample_runners};

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

/// Registers [`PADDING_INSTALLER`] ([`padding_installer`]).
pub(super) fn serve_padding_installer(host: &ApiServer) {
    host.runners().register(
        ImageMatch::Exact(PADDING_INSTALLER.into()),
        padding_installer(PADDING_BYTES),
    );
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
