//! `stackd bench` end to end (issue 11): the CI-sized benchmark's JSON, and the chaos run's
//! invariants on several seeds.

use std::process::Command;

/// The most tenant B's install p50 under tenant A's attacks may be, as a multiple of the same with A
/// idle, in the quick benchmark (see `assert_blast_radius_contained`).
const RATIO_BOUND: f64 = 5.0;

fn stackd(args: &[&str]) -> (bool, String, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_stackd"))
        .args(args)
        .env("STACKD_BENCH_LOG", "warn")
        .output()
        .expect("run stackd bench");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[test]
fn the_quick_benchmark_reports_its_figures_as_json() {
    let dir = tempfile::tempdir().expect("temp dir");
    let saved = dir.path().join("baseline.json");
    let (ok, stdout, stderr) = stackd(&["bench", "--quick", "--json", "--out", saved.to_str().unwrap()]);
    assert!(ok, "stackd bench failed:\n{stderr}");
    let report: serde_json::Value = serde_json::from_str(&stdout).expect("JSON on stdout");
    for key in [
        "marginal_rss_per_tenant_mb",
        "requests_per_install_ratio",
        "double_leases",
    ] {
        assert!(report[key].is_number(), "{key} missing in {report:#}");
    }
    assert_eq!(report["double_leases"], 0);
    let ratio = report["requests_per_install_ratio"].as_f64().unwrap();
    // Nothing installs with fewer requests than the design's minimum; more than 1.3 times it (issue
    // 20's goal) means a reconcile started writing or reading what it should not.
    assert!(
        (1.0..=1.3).contains(&ratio),
        "requests per install ratio {ratio}: {:#}",
        report["stacks"]["requests_per_install_by_resource"]
    );
    let idle = report["tenants"].as_array().expect("tenants");
    assert!(idle.len() >= 2);
    for figures in idle {
        // Idle tenants cost no requests but watch renewals and sweeps: no polling.
        let other = figures["idle_requests_per_minute_per_tenant"]["other"]
            .as_f64()
            .unwrap();
        assert_eq!(other, 0.0, "idle tenants made requests: {figures:#}");
        // Watching them for an outage costs nothing while they are up (issue 47: GOAWAY, no polling).
        let probes = figures["idle_requests_per_minute_per_tenant"]["probes"].as_f64();
        assert_eq!(probes, Some(0.0), "idle tenants were probed: {figures:#}");
        // One shared watch per kind the daemon reads (issue 20): 15 tenant kinds (CRDs, the eight
        // stackd kinds, Namespaces, and the ServiceAccounts, Secrets, ClusterRoles, RoleBindings and
        // ClusterRoleBindings the Stack controller writes); before: 27.
        let watches = figures["watches_per_tenant"].as_f64().unwrap();
        assert!(watches > 0.0 && watches <= 15.0, "watches per tenant: {figures:#}");
    }
    // Host watches (issue 32): per tenant its NetworkPolicy, Jobs, Secrets, Deployments and the
    // Pods those make (issue 52: what the kubelet says of them); per replica the tenants' host
    // namespaces and their RoleBindings (before: 8 per tenant, 0 shared).
    let host_watches = &report["host_watches"];
    let per_tenant = host_watches["per_tenant"].as_f64().unwrap();
    assert!(per_tenant > 0.0 && per_tenant <= 5.0, "{host_watches:#}");
    assert!(host_watches["per_replica"].as_f64().unwrap() <= 2.0, "{host_watches:#}");
    assert!(report["stacks"]["installs"].as_u64().unwrap() > 0);
    // Every install's time is broken down into the daemon's phases and the embedded loops'.
    let breakdown = &report["stacks"]["latency_breakdown"];
    assert_eq!(
        breakdown["complete_timelines"], report["stacks"]["installs"],
        "{breakdown:#}"
    );
    assert_eq!(breakdown["missed_events"], 0, "{breakdown:#}");
    assert!(breakdown["daemon_p50_s"].as_f64().unwrap() > 0.0, "{breakdown:#}");
    assert!(
        breakdown["embedded_loops_p50_s"].as_f64().unwrap() > 0.0,
        "{breakdown:#}"
    );
    assert_eq!(
        breakdown["phases_p50_s"].as_object().map(|p| p.len()),
        Some(8),
        "{breakdown:#}"
    );
    // And the CPU behind it: the daemon's, the servers', and each controller's reconciles.
    let cost = &report["stacks"]["cost"];
    assert!(cost["daemon_cpu_ms_per_install"].as_f64().unwrap() > 0.0, "{cost:#}");
    assert!(cost["servers_cpu_ms_per_install"].as_f64().unwrap() > 0.0, "{cost:#}");
    // The bound CPU puts on the installs (issue 32): both processes' CPU over the cores.
    assert!(cost["cpu_bound_s"].as_f64().unwrap() > 0.0, "{cost:#}");
    for controller in ["StackInstall", "stack"] {
        let reconciles = cost["reconciles_per_install"][controller].as_f64().unwrap_or_default();
        assert!(reconciles >= 1.0, "{controller}: {cost:#}");
    }
    assert_eq!(report["pools"]["double_leases"], 0);
    assert!(report["pools"]["fill_s"].as_f64().unwrap() > 0.0);
    assert!(report["latency_floor"]["rtt_ms_p50"].as_f64().unwrap() > 0.0);
    let recovery = &report["recovery"];
    assert!(
        recovery["up_after_restart_s_max"].as_f64().unwrap() > 0.0,
        "{recovery:#}"
    );
    assert!(recovery["install_after_restart_ratio"].is_number(), "{recovery:#}");
    assert!(
        report["install_alone_floor_multiple"].as_f64().unwrap() > 0.0,
        "one install alone against the floor: {report:#}"
    );
    assert!(recovery["install_after_restart_extra_s"].is_number(), "{recovery:#}");
    assert!(
        recovery["after_restart_breakdown"]["phases_p50_s"]["pickup"].is_number(),
        "where the time after a restart goes: {recovery:#}"
    );
    let shards = &report["shards"];
    assert_eq!(shards["served_twice_by_records"], 0, "{shards:#}");
    assert_eq!(shards["served_twice_by_requests"], 0, "{shards:#}");
    // 13 tenants: 5/4/4 over three replicas, 4/3/3/3 once a fourth joins, which moves only the
    // three or four it takes; a killed replica's tenants alone move.
    assert_eq!(
        shards["tenants_per_replica"],
        serde_json::json!([5, 4, 4]),
        "{shards:#}"
    );
    assert_eq!(
        shards["tenants_per_replica_after_join"],
        serde_json::json!([4, 3, 3, 3]),
        "{shards:#}"
    );
    assert!(
        (3..=4).contains(&shards["moved_on_join"].as_u64().unwrap()),
        "{shards:#}"
    );
    assert_eq!(shards["moved_on_kill"], shards["killed_had"], "{shards:#}");
    let lease = shards["lease_duration_s"].as_f64().unwrap();
    assert!(shards["takeover_s"].as_f64().unwrap() <= lease + 5.0, "{shards:#}");
    assert!(
        shards["lease_writes_per_replica_per_lease_duration"].as_f64().unwrap() < 2.0,
        "{shards:#}"
    );
    // Many idle tenants on one replica (issue 32): up, no requests at rest but renewals and
    // sweeps, and sampled over the window.
    let crowd = &report["crowd"];
    assert!(crowd["tenants"].as_u64().unwrap() >= 2, "{crowd:#}");
    assert!(crowd["startup_s"].as_f64().unwrap() > 0.0, "{crowd:#}");
    assert!(
        crowd["started_s"].as_f64().unwrap() >= crowd["startup_s"].as_f64().unwrap(),
        "{crowd:#}"
    );
    assert!(crowd["marginal_rss_per_tenant_mb"].is_number(), "{crowd:#}");
    assert_eq!(
        crowd["idle_requests_per_minute_per_tenant"]["other"].as_f64(),
        Some(0.0),
        "{crowd:#}"
    );
    // What a start costs each server, per tenant and by request (issue 50): no start asks more of
    // either than it does now (host 32.1 to 32.5, tenant 24 on fresh host namespaces).
    let start = &crowd["start_requests"];
    assert!(
        start["by_request"]["host list jobs.batch"].as_f64().unwrap() >= 1.0,
        "{start:#}"
    );
    assert!(start["host"].as_f64().unwrap() <= 34.0, "{start:#}");
    assert!(start["tenant"].as_f64().unwrap() <= 24.5, "{start:#}");
    assert!(crowd["samples"].as_array().unwrap().len() >= 2, "{crowd:#}");
    assert!(crowd["samples"][0]["sockets"].as_u64().unwrap() > 0, "{crowd:#}");
    assert_blast_radius_contained(&report["blast_radius"]);
    let written: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&saved).expect("--out file")).expect("saved JSON");
    assert_eq!(written, report);
}

/// Issues 28 and 45 at CI size: tenant A's attacks are all refused, the daemon never restarts and
/// stays within the chart's memory limit, neither tenant is suspended for one namespace's objects,
/// and the installs of tenant B and of A's neighbour namespace are not held up by much.
fn assert_blast_radius_contained(blast: &serde_json::Value) {
    assert_eq!(blast["daemon_restarts"], 0, "the daemon restarted: {blast:#}");
    for (attack, outcome) in blast["attacks"].as_object().expect("attacks") {
        let (made, refused) = (&outcome[0], &outcome[1]);
        assert_eq!(refused, made, "{attack}: not every object refused: {blast:#}");
    }
    let peak = blast["daemon_peak_rss_mib"].as_f64().expect("peak RSS");
    assert!(
        peak > 0.0 && peak <= blast["chart_memory_limit_mib"].as_f64().expect("limit"),
        "{blast:#}"
    );
    assert_eq!(blast["tenant_b_suspended"], false, "{blast:#}");
    assert_eq!(
        blast["tenant_a_suspended"], false,
        "a tenant is never suspended for what one of its namespaces holds: {blast:#}"
    );
    assert!(
        blast["attack_writes_during_round"].as_u64().unwrap_or(0) > 0,
        "{blast:#}"
    );
    // Issue 51: what A's objects cost over time, each measured alone.
    let costs = &blast["costs"];
    let growth = costs["crd_growth_of_charged"].as_f64().expect("CRD growth");
    assert!(
        costs["crd_charged_mib"].as_f64().unwrap_or(0.0) > 0.0 && growth <= 2.0,
        "the daemon grew by more than twice what the tenant's CRDs are charged: {costs:#}"
    );
    let edit_cores = costs["edit_cores"].as_f64().expect("edit cores");
    assert!(
        edit_cores <= costs["edit_cores_bound"].as_f64().expect("bound"),
        "one namespace's edited customizations took {edit_cores} cores: {costs:#}"
    );
    let requests = costs["asset_requests_per_s"].as_f64().expect("asset requests");
    assert!(
        requests <= costs["asset_requests_bound_per_s"].as_f64().expect("bound"),
        "assets naming a missing Secret cost {requests} requests a second: {costs:#}"
    );
    // The goal is 2× (full size, release). A few installs' p50 in a debug build on a loaded
    // machine is noisy, so the bound is looser; a daemon that A's attacks stall (a crash loop, a
    // tenant-wide backlog, megabytes of log reads per CRD event) costs B many times more.
    let ratio = blast["install_p50_ratio"].as_f64().expect("ratio");
    assert!(ratio <= RATIO_BOUND, "tenant B's install p50 ratio {ratio}: {blast:#}");
    let neighbour = blast["neighbour_install_p50_ratio"].as_f64().expect("neighbour ratio");
    assert!(
        neighbour <= RATIO_BOUND,
        "tenant A's neighbour namespace's install p50 ratio {neighbour}: {blast:#}"
    );
}

#[test]
fn chaos_keeps_its_invariants_on_several_seeds() {
    let logs = tempfile::tempdir().expect("temp dir");
    let kept = logs.path().to_str().expect("a UTF-8 path");
    for seed in ["1", "2", "3"] {
        let args = [
            "bench",
            "--chaos",
            "--quick",
            "--json",
            "--seed",
            seed,
            "--keep-logs",
            kept,
        ];
        let (ok, stdout, stderr) = stackd(&args);
        let report: serde_json::Value =
            serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("seed {seed}: no JSON ({e}):\n{stdout}\n{stderr}"));
        if !ok {
            // The daemons' logs outlive a failure (the temp dir would go with the panic).
            let kept = logs.keep();
            panic!(
                "seed {seed}: invariants failed (daemon logs kept in {}): {report:#}\n{stderr}",
                kept.display()
            );
        }
        assert_eq!(report["passed"], true);
        assert_eq!(report["orphans"].as_array().map(Vec::len), Some(0), "{report:#}");
        assert_eq!(report["stuck"].as_array().map(Vec::len), Some(0), "{report:#}");
        assert_eq!(report["double_leases"], 0);
        assert_eq!(report["pool_filled"], true, "{report:#}");
        assert_eq!(report["metal_pool_filled"], true, "{report:#}");
        assert_eq!(report["double_assignments"], 0, "{report:#}");
        for invariant in [
            "cluster_deletions_unfinished",
            "clusters_gone_without_destroy",
            "tenants_served_twice",
            "live_objects_swept",
            "shared_crds_deleted",
            "install_jobs_made_twice",
        ] {
            assert_eq!(
                report[invariant].as_array().map(Vec::len),
                Some(0),
                "{invariant}: {report:#}"
            );
        }
        // The faults behind issue 17's races come in every run.
        for fault in [
            "daemon_restart_then_cluster_deleted",
            "leader_partitioned",
            "parents_burst",
            "concurrent_uninstalls",
            "host_restart",
        ] {
            assert!(
                report["faults"][fault].as_u64().unwrap_or(0) > 0,
                "seed {seed}: no {fault}: {}",
                report["faults"]
            );
        }
        assert!(stderr.contains("chaos: +"), "seed {seed}: no fault timeline:\n{stderr}");
    }
    let daemon_logs = std::fs::read_dir(logs.path())
        .expect("the kept logs")
        .filter_map(Result::ok)
        .filter(|entry| entry.file_name().to_string_lossy().starts_with("daemon-"))
        .count();
    assert!(daemon_logs >= 3, "--keep-logs kept {daemon_logs} daemon logs");
}
