//! What each install Job's output came to, per install, until the Job changes: an install reads its
//! Job's log once (a list of the Job's pods and up to 8 MiB of log) and parses it once, however often
//! it is reconciled before its Stack is current. Without this, an install refused for a CRD
//! another install holds would read and parse its log again on every wake, and a tenant could park
//! many such installs to multiply each CRD write into megabytes of log reads.
//!
//! The logs are the tenant's (its package): what is kept is bounded. A package's contents are kept
//! within a byte bound per install controller (contents past it are read again when they are about
//! to be applied); everything else kept is small: a refusal's message, or an outline of the
//! package's CRDs (bounded by `--max-package-crds`), which is all a refusal for a tenant CRD needs
//! to be judged again.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::package::Outline;
use crate::stacks::stream::PackageContents;

use crate::bounds::MAX_KEPT_PACKAGE_BYTES as MAX_KEPT_BYTES;

/// What reading one install Job's output came to.
#[derive(Clone, Debug)]
pub(super) enum Read {
    /// The Job failed: the last lines of its log.
    JobFailed(String),
    /// The output could not be read or verified: why (the Job is retried).
    Unreadable(String),
    /// Verified, and refused for what the package is: nothing the tenant holds changes that.
    Refused { reason: &'static str, message: String },
    /// Verified and acceptable as a package: its CRDs, outlined, and its contents unless they
    /// were past the byte bound.
    Verified {
        outline: Arc<Outline>,
        contents: Option<Arc<PackageContents>>,
    },
}

/// Per install (by uid): the Job (by uid) whose output was read, and what it came to.
#[derive(Default)]
pub(super) struct Reads {
    entries: Mutex<HashMap<String, Kept>>,
}

struct Kept {
    job_uid: String,
    /// Log bytes held as contents (0 when none are).
    bytes: usize,
    read: Read,
}

impl Reads {
    /// What Job `job_uid` of install `install_uid` came to, if its output was read already.
    pub(super) fn get(&self, install_uid: &str, job_uid: &str) -> Option<Read> {
        let entries = self.entries.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        entries
            .get(install_uid)
            .filter(|kept| kept.job_uid == job_uid)
            .map(|kept| kept.read.clone())
    }

    /// Keeps what Job `job_uid`'s output (a log of `bytes`) came to; verified contents only while
    /// the bound allows.
    pub(super) fn keep(&self, install_uid: &str, job_uid: &str, bytes: usize, read: Read) {
        let mut entries = self.entries.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        entries.remove(install_uid);
        let held: usize = entries.values().map(|kept| kept.bytes).sum();
        let (read, bytes) = match read {
            Read::Verified { outline, contents } if contents.is_some() && held + bytes > MAX_KEPT_BYTES => (
                Read::Verified {
                    outline,
                    contents: None,
                },
                0,
            ),
            Read::Verified { outline, contents } => {
                let bytes = if contents.is_some() { bytes } else { 0 };
                (Read::Verified { outline, contents }, bytes)
            }
            other => (other, 0),
        };
        let job_uid = job_uid.to_string();
        entries.insert(install_uid.to_string(), Kept { job_uid, bytes, read });
    }

    /// Drops the install's entry: its package is applied, or it is being uninstalled.
    pub(super) fn forget(&self, install_uid: &str) {
        let mut entries = self.entries.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        entries.remove(install_uid);
    }

    /// True when the package read for install `install_uid` has a CRD named `name` or in `group`.
    pub(super) fn concerns(&self, install_uid: &str, name: &str, group: &str) -> bool {
        let entries = self.entries.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        entries.get(install_uid).is_some_and(|kept| match &kept.read {
            Read::Verified { outline, .. } => outline.concerns(name, group),
            _ => false,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn verified() -> Read {
        Read::Verified {
            outline: Arc::new(Outline::default()),
            contents: Some(Arc::new(PackageContents {
                crds: Vec::new(),
                stack: crate::api::stacks::Stack::new("sample", Default::default()),
            })),
        }
    }

    fn has_contents(reads: &Reads, install: &str, job: &str) -> bool {
        matches!(reads.get(install, job), Some(Read::Verified { contents: Some(_), .. }))
    }

    #[test]
    fn what_a_job_came_to_is_kept_per_job_and_contents_within_a_byte_bound() {
        let reads = Reads::default();
        reads.keep("install-1", "job-1", 1000, verified());
        assert!(has_contents(&reads, "install-1", "job-1"));
        assert!(
            reads.get("install-1", "job-2").is_none(),
            "another Job's log is read anew"
        );
        reads.keep("install-2", "job-3", MAX_KEPT_BYTES, verified());
        assert!(
            matches!(
                reads.get("install-2", "job-3"),
                Some(Read::Verified { contents: None, .. })
            ),
            "past the bound: the outline only"
        );
        reads.forget("install-1");
        reads.keep("install-2", "job-3", MAX_KEPT_BYTES, verified());
        assert!(has_contents(&reads, "install-2", "job-3"));
        let refused = Read::Refused {
            reason: "PodSpecRefused",
            message: "no".into(),
        };
        reads.keep("install-3", "job-4", MAX_KEPT_BYTES, refused);
        assert!(matches!(reads.get("install-3", "job-4"), Some(Read::Refused { .. })));
        assert!(has_contents(&reads, "install-2", "job-3"), "a refusal holds no bytes");
    }
}
