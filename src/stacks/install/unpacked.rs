//! Package contents read from an install Job's log, kept until the install's Stack is current. An
//! install reads its log, applies the CRDs and comes back once they are Established to create the
//! Stack: without this it would list the Job's pods and read the log a second time.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::stacks::stream::PackageContents;

/// Per install (by uid): the Job (by uid) whose log was read, and what it held.
#[derive(Default)]
pub struct Unpacked {
    entries: Mutex<HashMap<String, (String, Arc<PackageContents>)>>,
}

impl Unpacked {
    /// What Job `job_uid` of install `install_uid` held, if it was read already.
    pub fn get(&self, install_uid: &str, job_uid: &str) -> Option<Arc<PackageContents>> {
        let entries = self.entries.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        entries
            .get(install_uid)
            .filter(|(job, _)| job == job_uid)
            .map(|(_, contents)| contents.clone())
    }

    pub fn keep(&self, install_uid: &str, job_uid: &str, contents: Arc<PackageContents>) {
        let mut entries = self.entries.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        entries.insert(install_uid.to_string(), (job_uid.to_string(), contents));
    }

    /// Drops the install's entry: its Stack is current, or it is being uninstalled.
    pub fn forget(&self, install_uid: &str) {
        let mut entries = self.entries.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        entries.remove(install_uid);
    }
}
