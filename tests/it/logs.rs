//! What the daemon's log lines carry (issue 33 item 4): a line logged inside a reconcile names its
//! tenant, controller and object, from the span the scaffold (or the singleton) opens around it.

use crate::harness::{Daemon, wait_until};
use crate::pools::{NS, WITHIN, create_pool, daemon, pool_json, setup};

/// The first line of the daemon's log that contains `needle`, once there is one, without its
/// colours.
async fn line_with(daemon: &Daemon, needle: &str) -> String {
    wait_until(needle, WITHIN, daemon, || async {
        let log = without_colours(&daemon.log_text());
        log.lines().find(|line| line.contains(needle)).map(str::to_string)
    })
    .await
}

/// `text` without ANSI escape sequences (`ESC [ ... m`).
fn without_colours(text: &str) -> String {
    let mut plain = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            chars.by_ref().find(|c| *c == 'm');
        } else {
            plain.push(c);
        }
    }
    plain
}

fn assert_names(line: &str, tenant: &str, controller: &str, object: &str) {
    for field in [
        format!("tenant={tenant}"),
        format!("controller={controller}"),
        format!("object={object}"),
    ] {
        assert!(line.contains(&field), "{field} missing from: {line}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_line_logged_inside_a_reconcile_names_its_tenant_controller_and_object() {
    let (fleet, tenant) = setup().await;
    // The pool's inventory names a CDC that does not exist: its reconcile logs a warning.
    create_pool(&tenant, pool_json("p", 1, Some(&["ghost"]))).await;
    let daemon = daemon(&fleet, &[]);
    let pool_line = line_with(
        &daemon,
        "an inventory entry's ClusterDeploymentCustomization does not exist",
    )
    .await;
    assert_names(&pool_line, "acme", "clusterpool", &format!("{NS}/p"));
    // A singleton's line: the host namespace is created at the tenant's start.
    let namespace_line = line_with(&daemon, "host namespace reconciled").await;
    assert_names(&namespace_line, "acme", "host-namespace", "tenant-acme-controllers");
}
