//! Package contents read from an install Job's log, kept until the install's Stack is current. An
//! install reads its log, applies the CRDs and comes back once they are Established to create the
//! Stack: without this it would list the Job's pods and read the log a second time.
//!
//! The logs are the tenant's (its package), up to 8 MiB each: what is kept is bounded in bytes per
//! install controller, and contents past the bound are simply read again when needed.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::stacks::stream::PackageContents;

/// Log bytes kept at most per install controller (one tenant, one install kind). A package is a
/// few KiB to a few hundred; a tenant making many large ones pending costs it re-reads, not memory.
const MAX_KEPT_BYTES: usize = 1024 * 1024;

/// Per install (by uid): the Job (by uid) whose log was read, its size and what it held.
#[derive(Default)]
pub struct Unpacked {
    entries: Mutex<HashMap<String, Kept>>,
}

struct Kept {
    job_uid: String,
    bytes: usize,
    contents: Arc<PackageContents>,
}

impl Unpacked {
    /// What Job `job_uid` of install `install_uid` held, if it was read already.
    pub fn get(&self, install_uid: &str, job_uid: &str) -> Option<Arc<PackageContents>> {
        let entries = self.entries.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        entries
            .get(install_uid)
            .filter(|kept| kept.job_uid == job_uid)
            .map(|kept| kept.contents.clone())
    }

    /// Keeps what a log of `bytes` held, unless that would pass [`MAX_KEPT_BYTES`].
    pub fn keep(&self, install_uid: &str, job_uid: &str, bytes: usize, contents: Arc<PackageContents>) {
        let mut entries = self.entries.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        entries.remove(install_uid);
        let kept: usize = entries.values().map(|kept| kept.bytes).sum();
        if kept + bytes <= MAX_KEPT_BYTES {
            let job_uid = job_uid.to_string();
            entries.insert(
                install_uid.to_string(),
                Kept {
                    job_uid,
                    bytes,
                    contents,
                },
            );
        }
    }

    /// Drops the install's entry: its Stack is current, it was refused, or it is being uninstalled.
    pub fn forget(&self, install_uid: &str) {
        let mut entries = self.entries.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        entries.remove(install_uid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn contents() -> Arc<PackageContents> {
        Arc::new(PackageContents {
            crds: Vec::new(),
            stack: crate::api::stacks::Stack::new("sample", Default::default()),
        })
    }

    #[test]
    fn contents_are_kept_per_job_within_a_byte_bound() {
        let unpacked = Unpacked::default();
        unpacked.keep("install-1", "job-1", 1000, contents());
        assert!(unpacked.get("install-1", "job-1").is_some());
        assert!(
            unpacked.get("install-1", "job-2").is_none(),
            "another Job's log is read anew"
        );
        unpacked.keep("install-2", "job-3", MAX_KEPT_BYTES, contents());
        assert!(unpacked.get("install-2", "job-3").is_none(), "past the bound: not kept");
        unpacked.forget("install-1");
        unpacked.keep("install-2", "job-3", MAX_KEPT_BYTES, contents());
        assert!(unpacked.get("install-2", "job-3").is_some());
    }
}
