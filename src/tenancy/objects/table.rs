//! `stackd status`: the Tenant objects on the host as a table, from the status their serving
//! replicas write (the columns of `kubectl get tenants`, and why each tenant not ready is not).

use std::fmt::Write;

use kube::api::ListParams;
use kube::{Api, Client, ResourceExt};

use crate::api::tenancy::Tenant;

/// The Tenants on the host, by name; `None` when the host does not serve the Tenant kind.
pub async fn read(host: Client) -> Result<Option<Vec<Tenant>>, kube::Error> {
    let api: Api<Tenant> = Api::all(host);
    match api.list(&ListParams::default()).await {
        Ok(list) => {
            let mut tenants = list.items;
            tenants.sort_by_key(|tenant| tenant.name_any());
            Ok(Some(tenants))
        }
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(None),
        Err(err) => Err(err),
    }
}

/// The table: one line per Tenant, then why each one that is not ready is not.
pub fn render(tenants: &[Tenant]) -> String {
    let rows: Vec<[String; 6]> = tenants.iter().map(row).collect();
    let header = ["NAME", "READY", "REASON", "REPLICA", "NAMESPACE", "VERSION"].map(str::to_string);
    let widths: Vec<usize> = (0..6)
        .map(|column| {
            std::iter::once(&header)
                .chain(&rows)
                .map(|row| row[column].len())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for row in std::iter::once(&header).chain(&rows) {
        let cells: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(cell, width)| format!("{cell:<width$}"))
            .collect();
        let _ = writeln!(out, "{}", cells.join("   ").trim_end());
    }
    for tenant in tenants {
        let ready = tenant
            .status
            .as_ref()
            .and_then(|status| status.conditions.iter().find(|c| c.type_ == "Ready"));
        match ready {
            Some(ready) if ready.status == "True" => {}
            Some(ready) => {
                let _ = writeln!(out, "{}: {}", tenant.name_any(), ready.message);
            }
            None => {
                let _ = writeln!(out, "{}: no status yet (no replica serves it)", tenant.name_any());
            }
        }
    }
    out
}

fn row(tenant: &Tenant) -> [String; 6] {
    let status = tenant.status.clone().unwrap_or_default();
    let ready = status.conditions.iter().find(|c| c.type_ == "Ready");
    let or_dash = |value: Option<String>| value.filter(|v| !v.is_empty()).unwrap_or_else(|| "-".to_string());
    [
        tenant.name_any(),
        or_dash(ready.map(|c| c.status.clone())),
        or_dash(ready.map(|c| c.reason.clone())),
        or_dash(status.served_by.clone()),
        or_dash(status.host_namespace.clone()),
        or_dash(status.server_version.clone()),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::common::Condition;
    use crate::api::tenancy::{TenantSpec, TenantStatus};

    fn tenant(name: &str, ready: &str, reason: &str, message: &str) -> Tenant {
        let mut tenant = Tenant::new(name, TenantSpec::default());
        tenant.status = Some(TenantStatus {
            conditions: vec![Condition {
                type_: "Ready".into(),
                status: ready.into(),
                reason: reason.into(),
                message: message.into(),
                last_transition_time: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(jiff::Timestamp::UNIX_EPOCH),
                observed_generation: None,
            }],
            served_by: (ready == "True").then(|| "stackd-0-7".to_string()),
            host_namespace: Some(format!("tenant-{name}-controllers")),
            server_version: Some("v1.30.2".into()),
            ..Default::default()
        });
        tenant
    }

    #[test]
    fn each_tenant_is_a_row_and_each_not_ready_one_says_why() {
        let text = render(&[
            tenant("acme", "True", "Up", "answers"),
            tenant("globex", "False", "Down", "connection refused"),
        ]);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with("NAME     READY   REASON"), "{text}");
        assert!(lines[1].contains("acme") && lines[1].contains("stackd-0-7"), "{text}");
        assert!(lines[2].contains("globex") && lines[2].contains(" - "), "{text}");
        assert_eq!(lines[3], "globex: connection refused");
        assert_eq!(lines.len(), 4);
    }
}
