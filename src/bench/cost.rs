//! Where the CPU of a measured interval goes: the daemon's CPU seconds, the bench process's (the
//! embedded API servers and their controller-manager loops run there), how busy that kept the
//! machine's cores, and each controller's reconciles and time inside them (its API round trips and
//! its own work; the rest of a phase is watch delivery and queue wait).

use std::collections::BTreeMap;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::fleet::DaemonProcess;

/// Per install over the interval.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct CostFigures {
    pub daemon_cpu_ms_per_install: f64,
    /// The bench process: embedded API servers, their loops, and the bench's own watches.
    pub servers_cpu_ms_per_install: f64,
    /// CPU seconds of both over wall seconds × cores: near 1, installs wait for a core.
    pub cores_busy_fraction: f64,
    pub cores: usize,
    /// Both processes' CPU seconds over the interval divided by the cores: no schedule finishes
    /// every install sooner, and the median install near half of it at best.
    #[serde(default)]
    pub cpu_bound_s: f64,
    /// Per controller: reconciles per install.
    pub reconciles_per_install: BTreeMap<String, f64>,
    /// Per controller: milliseconds inside reconciles per install.
    pub reconcile_ms_per_install: BTreeMap<String, f64>,
}

/// The counters at one moment.
pub(super) struct Snapshot {
    at: Instant,
    daemon_cpu_s: f64,
    own_cpu_s: f64,
    /// Per controller: (reconciles, seconds inside them), summed over tenants.
    reconciles: BTreeMap<String, (f64, f64)>,
}

impl Snapshot {
    pub(super) async fn take(daemon: &DaemonProcess) -> Snapshot {
        let metrics = daemon.metrics().await;
        Snapshot {
            at: Instant::now(),
            daemon_cpu_s: daemon.child.id().map_or(0.0, |pid| cpu_seconds(&pid.to_string())),
            own_cpu_s: cpu_seconds("self"),
            reconciles: reconcile_totals(&metrics),
        }
    }

    /// What happened since `before`, per install of `installs`.
    pub(super) fn since(&self, before: &Snapshot, installs: usize) -> CostFigures {
        let per_install = |value: f64| value / installs.max(1) as f64;
        let (daemon, own) = (
            self.daemon_cpu_s - before.daemon_cpu_s,
            self.own_cpu_s - before.own_cpu_s,
        );
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let wall = self.at.duration_since(before.at).as_secs_f64().max(1e-6);
        let (mut reconciles, mut reconcile_ms) = (BTreeMap::new(), BTreeMap::new());
        for (controller, (count, seconds)) in &self.reconciles {
            let (count_before, seconds_before) = before.reconciles.get(controller).copied().unwrap_or_default();
            reconciles.insert(controller.clone(), per_install(count - count_before));
            reconcile_ms.insert(controller.clone(), per_install((seconds - seconds_before) * 1000.0));
        }
        CostFigures {
            daemon_cpu_ms_per_install: per_install(daemon * 1000.0),
            servers_cpu_ms_per_install: per_install(own * 1000.0),
            cores_busy_fraction: (daemon + own) / (wall * cores as f64),
            cores,
            cpu_bound_s: (daemon + own) / cores as f64,
            reconciles_per_install: reconciles,
            reconcile_ms_per_install: reconcile_ms,
        }
    }
}

/// User and system CPU seconds of a process (`self` or a pid), from `/proc/<pid>/stat`; 0 where
/// there is no procfs.
pub(super) fn cpu_seconds(pid: &str) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // The command name may hold spaces: fields are counted after its closing parenthesis, where
    // utime and stime are the 12th and 13th (fields 14 and 15 of proc(5)).
    let after_name = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let ticks: f64 = after_name
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|field| field.parse::<f64>().ok())
        .sum();
    // procfs reports in USER_HZ, 100 on Linux whatever the kernel's tick rate.
    ticks / 100.0
}

/// `stackd_reconcile_duration_seconds_{count,sum}` summed over tenants, per controller.
fn reconcile_totals(metrics: &str) -> BTreeMap<String, (f64, f64)> {
    let mut totals: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    for line in metrics.lines() {
        let (is_count, rest) = if let Some(rest) = line.strip_prefix("stackd_reconcile_duration_seconds_count{") {
            (true, rest)
        } else if let Some(rest) = line.strip_prefix("stackd_reconcile_duration_seconds_sum{") {
            (false, rest)
        } else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let controller = labels
            .split(',')
            .find_map(|label| label.strip_prefix("controller=\""))
            .map(|name| name.trim_end_matches('"'));
        let (Some(controller), Ok(value)) = (controller, value.trim().parse::<f64>()) else {
            continue;
        };
        let entry = totals.entry(controller.to_string()).or_default();
        if is_count {
            entry.0 += value;
        } else {
            entry.1 += value;
        }
    }
    totals
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reconcile_totals_sum_each_controller_over_tenants() {
        let metrics = "\
stackd_reconcile_duration_seconds_sum{tenant=\"a\",controller=\"stack\"} 1.5
stackd_reconcile_duration_seconds_count{tenant=\"a\",controller=\"stack\"} 3
stackd_reconcile_duration_seconds_sum{tenant=\"b\",controller=\"stack\"} 0.5
stackd_reconcile_duration_seconds_count{tenant=\"b\",controller=\"stack\"} 1
stackd_reconcile_duration_seconds_bucket{tenant=\"b\",controller=\"stack\",le=\"0.1\"} 1
stackd_reconcile_duration_seconds_count{tenant=\"b\",controller=\"install\"} 2
";
        let totals = reconcile_totals(metrics);
        assert_eq!(totals["stack"], (4.0, 2.0));
        assert_eq!(totals["install"], (2.0, 0.0));
    }

    #[test]
    fn this_process_has_used_some_cpu() {
        let spin: u64 = (0..2_000_000u64).fold(0, |acc, n| acc.wrapping_add(n * n));
        assert!(spin > 0);
        assert!(cpu_seconds("self") > 0.0);
        assert_eq!(cpu_seconds("no-such-process"), 0.0);
    }
}
