//! Every install of the sample stack in a tenant shares its CRD (DESIGN.md §3.4): the CRD, and the
//! Widgets made from it, must stay as long as one of those installs lives, whatever the others do.
//!
//! Observed by polling each tenant: installs, then the CRD and the witness Widgets, then installs
//! again. An install (same uid) not being deleted at both ends of one look and at both ends of the
//! next existed, undeleted, throughout (deletion cannot be undone, a uid never comes back); if it was
//! Ready in the first look, its stack used the CRD then. When the CRD seen in the first look (or a
//! Widget) is gone or replaced in the second, it was deleted while that install lived.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ListParams, PostParams};
use kube::core::{ApiResource, DynamicObject, GroupVersionKind};
use kube::{Client, ResourceExt};
use serde_json::json;

use super::Clients;
use crate::api::stacks::StackInstall;

const CRD: &str = "widgets.samples.example.org";
const WITNESS: &str = "chaos-witness";
const WITNESS_LABEL: &str = "chaos.stackd.dev/witness";

/// One look at a tenant.
#[derive(Clone, Debug, Default)]
struct Look {
    /// Uids of installs not being deleted at both ends of the look.
    undeleted: BTreeSet<String>,
    /// Those of them Ready at both ends.
    ready: BTreeSet<String>,
    crd_uid: Option<String>,
    /// Witness Widgets, `namespace/name` → uid.
    widgets: BTreeMap<String, String>,
}

#[derive(Default)]
pub(super) struct SharedCrdWatch {
    last: BTreeMap<String, Look>,
}

impl SharedCrdWatch {
    /// What was deleted under a live install since the last look; makes a witness Widget beside
    /// every live install that has none.
    pub(super) async fn check(&mut self, clients: &Clients) -> Vec<String> {
        let mut found = Vec::new();
        for (tenant, client) in &clients.tenants {
            let Some((look, namespaces)) = look(client).await else {
                continue;
            };
            if let Some(last) = self.last.get(tenant) {
                found.extend(deleted_under_live_installs(tenant, last, &look));
            }
            if look.crd_uid.is_some() {
                make_witnesses(client, &namespaces, &look).await;
            }
            self.last.insert(tenant.clone(), look);
        }
        found
    }
}

fn deleted_under_live_installs(tenant: &str, last: &Look, now: &Look) -> Vec<String> {
    let living: Vec<&String> = last.ready.intersection(&now.undeleted).collect();
    let Some(install) = living.first() else {
        return Vec::new();
    };
    let mut found = Vec::new();
    if let Some(uid) = &last.crd_uid
        && now.crd_uid.as_ref() != Some(uid)
    {
        found.push(format!(
            "{tenant}: CustomResourceDefinition {CRD} (uid {uid}) was deleted while StackInstall uid {install} (and {} other(s)) lived",
            living.len() - 1
        ));
    }
    for (widget, uid) in &last.widgets {
        if now.widgets.get(widget) != Some(uid) {
            found.push(format!(
                "{tenant}: Widget {widget} (uid {uid}) was deleted while StackInstall uid {install} lived"
            ));
        }
    }
    found
}

/// A look at a tenant, and the namespaces of its Ready installs; `None` when a request failed.
async fn look(client: &Client) -> Option<(Look, BTreeSet<String>)> {
    let before = undeleted_installs(client).await?;
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let crd_uid = crds
        .get_opt(CRD)
        .await
        .ok()?
        .filter(|crd| crd.metadata.deletion_timestamp.is_none())
        .and_then(|crd| crd.uid());
    let widgets = match crd_uid {
        Some(_) => {
            let params = ListParams::default().labels(WITNESS_LABEL);
            let list = Api::<DynamicObject>::all_with(client.clone(), &widget_resource())
                .list_metadata(&params)
                .await
                .ok()?;
            list.items
                .into_iter()
                .filter_map(|w| Some((format!("{}/{}", w.namespace()?, w.name_any()), w.uid()?)))
                .collect()
        }
        None => BTreeMap::new(),
    };
    let after = undeleted_installs(client).await?;
    let both: Vec<(&String, &Install)> = after.iter().filter(|(uid, _)| before.contains_key(*uid)).collect();
    let ready: Vec<(&String, &Install)> = both
        .iter()
        .copied()
        .filter(|(uid, install)| install.ready && before[*uid].ready)
        .collect();
    let look = Look {
        undeleted: both.iter().map(|(uid, _)| (*uid).clone()).collect(),
        ready: ready.iter().map(|(uid, _)| (*uid).clone()).collect(),
        crd_uid,
        widgets,
    };
    let namespaces = ready.iter().map(|(_, install)| install.namespace.clone()).collect();
    Some((look, namespaces))
}

struct Install {
    namespace: String,
    ready: bool,
}

/// Installs not being deleted, by uid.
async fn undeleted_installs(client: &Client) -> Option<BTreeMap<String, Install>> {
    let installs = Api::<StackInstall>::all(client.clone())
        .list(&ListParams::default())
        .await
        .ok()?;
    Some(
        installs
            .items
            .into_iter()
            .filter(|i| i.metadata.deletion_timestamp.is_none())
            .filter_map(|i| {
                let ready = i
                    .status
                    .as_ref()
                    .is_some_and(|s| s.conditions.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
                let install = Install {
                    namespace: i.namespace()?,
                    ready,
                };
                Some((i.uid()?, install))
            })
            .collect(),
    )
}

/// A Widget in each namespace with a live install and no witness yet (errors are retried next look).
async fn make_witnesses(client: &Client, namespaces: &BTreeSet<String>, look: &Look) {
    for namespace in namespaces {
        if look.widgets.contains_key(&format!("{namespace}/{WITNESS}")) {
            continue;
        }
        let widget: DynamicObject = match serde_json::from_value(json!({
            "apiVersion": "samples.example.org/v1alpha1", "kind": "Widget",
            "metadata": {"name": WITNESS, "namespace": namespace, "labels": {WITNESS_LABEL: "true"}},
            "spec": {"size": 1, "color": "blue"},
        })) {
            Ok(widget) => widget,
            Err(_) => continue,
        };
        let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), namespace, &widget_resource());
        let _ = api.create(&PostParams::default(), &widget).await;
    }
}

fn widget_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("samples.example.org", "v1alpha1", "Widget"),
        "widgets",
    )
}
