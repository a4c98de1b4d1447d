//! No install Job is made twice for one package (issue 47): a Job is made again only when its pod
//! failed or is gone, or its package changed, and the chaos's packages never fail, its pods never
//! go and its installs never change package. Observed at the host's unpack runner, wrapped so that
//! each Job it runs is recorded under its install Job's name and package: two Jobs (uids) for one
//! of them is a Job made twice. A host restart, a kubelet that answers late or an injected 500
//! must not be taken for a broken package.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use crate::bench::fleet::BENCH_STACKD_IMAGE;
use crate::embedded::ApiServer;
use crate::embedded::controller_manager::{ImageMatch, JobContext, JobOutcome, JobRunner};
use crate::stacks::install::job::{PACKAGE_ANNOTATION, UNPACK_CONTAINER};

/// `host namespace/install Job name` and its package → the uids of the Jobs run for it.
type Runs = BTreeMap<(String, String), BTreeSet<String>>;

#[derive(Clone, Default)]
pub(super) struct InstallJobLedger {
    runs: Arc<Mutex<Runs>>,
}

impl InstallJobLedger {
    /// Wraps the unpack runner registered on `host` (the sample one).
    pub(super) fn install(host: &ApiServer) -> Option<InstallJobLedger> {
        let runners = host.runners();
        let inner = runners.runner_for(BENCH_STACKD_IMAGE)?;
        let ledger = InstallJobLedger::default();
        let recording = Recording {
            inner,
            ledger: ledger.clone(),
        };
        runners.register(ImageMatch::Exact(BENCH_STACKD_IMAGE.to_string()), recording);
        Some(ledger)
    }

    /// Each install Job made more than once for one package, with how often.
    pub(super) fn made_twice(&self) -> Vec<String> {
        let runs = self.runs.lock().unwrap_or_else(|p| p.into_inner());
        runs.iter()
            .filter(|(_, uids)| uids.len() > 1)
            .map(|((job, package), uids)| format!("install Job {job} made {} times for {package}", uids.len()))
            .collect()
    }
}

struct Recording {
    inner: Arc<dyn JobRunner>,
    ledger: InstallJobLedger,
}

impl JobRunner for Recording {
    fn run(&self, ctx: &JobContext) -> JobOutcome {
        let metadata = &ctx.job["metadata"];
        let (name, uid) = (metadata["name"].as_str(), metadata["uid"].as_str());
        let package = metadata["annotations"][PACKAGE_ANNOTATION].as_str();
        if let (true, Some(name), Some(uid), Some(package)) = (ctx.container == UNPACK_CONTAINER, name, uid, package) {
            let job = format!("{}/{name}", ctx.namespace);
            let mut runs = self.ledger.runs.lock().unwrap_or_else(|p| p.into_inner());
            runs.entry((job, package.to_string()))
                .or_default()
                .insert(uid.to_string());
        }
        self.inner.run(ctx)
    }
}
