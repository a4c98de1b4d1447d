//! What the host plays for tenant A's attacks: a second package shipping the sample's CRD, whose
//! installs park in `CRDConflict` once the sample's install created it.

use std::path::Path;

use super::super::BenchError;
use super::super::fleet::BENCH_STACKD_IMAGE;
use crate::embedded::ApiServer;
use crate::embedded::samples::{SampleImages, register_sample_runners};

/// The package whose only CRD is the sample's: its installs conflict with the sample's.
pub(super) const SQUATTER_PACKAGE: &str = "stackd-examples/squatter-stack:v0.1.0";

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
