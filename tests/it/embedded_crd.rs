//! CustomResourceDefinitions on the embedded API server: discovery, schema validation, pruning,
//! defaults, subresources.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams, PostParams,
};
use kube::discovery::Discovery;
use serde_json::{Value, json};

use crate::harness::{self, TestServer, api_error, eventually};

fn widget_crd() -> CustomResourceDefinition {
    serde_json::from_value(json!({
        "metadata": {"name": "widgets.test.stackd.dev"},
        "spec": {
            "group": "test.stackd.dev",
            "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget", "shortNames": ["wd"]},
            "versions": [{
                "name": "v1alpha1", "served": true, "storage": true,
                "subresources": {"status": {}, "scale": {"specReplicasPath": ".spec.size", "statusReplicasPath": ".status.size"}},
                "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                    "spec": {"type": "object", "required": ["size"], "properties": {
                        "size": {"type": "integer", "minimum": 0},
                        "role": {"type": "string", "enum": ["master", "worker"]},
                        "mac": {"type": "string", "pattern": "^([0-9a-f]{2}:){5}[0-9a-f]{2}$"},
                        "mode": {"type": "string", "default": "fast"},
                        "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}
                    }},
                    "status": {"type": "object", "properties": {"size": {"type": "integer"}}}
                }}}
            }]
        }
    }))
    .unwrap()
}

fn widgets(t: &TestServer, namespace: &str) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("test.stackd.dev", "v1alpha1", "Widget");
    let resource = ApiResource::from_gvk_with_plural(&gvk, "widgets");
    Api::namespaced_with(t.client.clone(), namespace, &resource)
}

fn widget(name: &str, spec: Value) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": "test.stackd.dev/v1alpha1", "kind": "Widget",
        "metadata": {"name": name}, "spec": spec
    }))
    .unwrap()
}

async fn install_crd(t: &TestServer) -> CustomResourceDefinition {
    let crds: Api<CustomResourceDefinition> = Api::all(t.client.clone());
    crds.create(&PostParams::default(), &widget_crd()).await.unwrap()
}

#[tokio::test]
async fn crd_is_established_and_listable_right_after_creation() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let crd = install_crd(&t).await;
    let status = crd.status.unwrap();
    let conditions: Vec<(String, String)> = status
        .conditions
        .unwrap()
        .into_iter()
        .map(|c| (c.type_, c.status))
        .collect();
    assert!(conditions.contains(&("Established".into(), "True".into())));
    assert!(conditions.contains(&("NamesAccepted".into(), "True".into())));
    assert_eq!(status.accepted_names.unwrap().kind, "Widget");

    let discovery = Discovery::new(t.client.clone()).run().await.unwrap();
    let (resource, capabilities) = discovery
        .groups()
        .flat_map(|g| g.recommended_resources())
        .find(|(r, _)| r.kind == "Widget")
        .expect("Widget discovered");
    assert_eq!(resource.plural, "widgets");
    assert!(capabilities.subresources.iter().any(|(s, _)| s.plural == "status"));
    let listed = Api::<DynamicObject>::namespaced_with(t.client.clone(), "ns", &resource)
        .list(&ListParams::default())
        .await
        .unwrap();
    assert!(listed.items.is_empty());
}

#[tokio::test]
async fn custom_resources_violating_enum_pattern_or_minimum_are_invalid() {
    let t = harness::start().await;
    t.namespace("ns").await;
    install_crd(&t).await;
    let api = widgets(&t, "ns");
    for (spec, field, reason) in [
        (
            json!({"size": 1, "role": "boss"}),
            "spec.role",
            "FieldValueNotSupported",
        ),
        (json!({"size": 1, "mac": "not-a-mac"}), "spec.mac", "FieldValueInvalid"),
        (json!({"size": -1}), "spec.size", "FieldValueInvalid"),
        (json!({"size": "one"}), "spec.size", "FieldValueTypeInvalid"),
        (json!({}), "spec.size", "FieldValueRequired"),
    ] {
        let err = api_error(
            api.create(&PostParams::default(), &widget("w", spec.clone()))
                .await
                .unwrap_err(),
        );
        assert_eq!((err.code, err.reason.as_str()), (422, "Invalid"), "{spec}");
        let cause = &err.details.unwrap().causes[0];
        assert_eq!((cause.field.as_str(), cause.reason.as_str()), (field, reason), "{spec}");
    }
}

#[tokio::test]
async fn unknown_fields_are_pruned_and_defaults_applied() {
    let t = harness::start().await;
    t.namespace("ns").await;
    install_crd(&t).await;
    let api = widgets(&t, "ns");
    let spec = json!({"size": 1, "bogus": true, "free": {"anything": [1, 2]}});
    let created = api.create(&PostParams::default(), &widget("w", spec)).await.unwrap();
    assert_eq!(
        created.data["spec"],
        json!({"size": 1, "mode": "fast", "free": {"anything": [1, 2]}})
    );
    assert_eq!(created.metadata.generation, Some(1));
}

#[tokio::test]
async fn custom_resource_status_and_scale_subresources() {
    let t = harness::start().await;
    t.namespace("ns").await;
    install_crd(&t).await;
    let api = widgets(&t, "ns");
    api.create(&PostParams::default(), &widget("w", json!({"size": 1})))
        .await
        .unwrap();
    let after = api
        .patch_status(
            "w",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"size": 9}, "status": {"size": 1}})),
        )
        .await
        .unwrap();
    assert_eq!(
        (after.data["spec"]["size"].clone(), after.data["status"]["size"].clone()),
        (json!(1), json!(1))
    );
    let after = api
        .patch(
            "w",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"size": 5}})),
        )
        .await
        .unwrap();
    assert_eq!(after.data["status"]["size"], json!(1));
    let scale = api.get_scale("w").await.unwrap();
    assert_eq!(scale.spec.unwrap().replicas, Some(1));
    api.patch_scale(
        "w",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"replicas": 3}})),
    )
    .await
    .unwrap();
    let after = api.get("w").await.unwrap();
    assert_eq!(after.data["spec"]["size"], json!(3));
    assert_eq!(after.metadata.generation, Some(2));
}

#[tokio::test]
async fn deleting_a_crd_removes_its_resources_from_discovery_and_its_objects() {
    let t = harness::start().await;
    t.namespace("ns").await;
    install_crd(&t).await;
    widgets(&t, "ns")
        .create(&PostParams::default(), &widget("w", json!({"size": 1})))
        .await
        .unwrap();
    let crds: Api<CustomResourceDefinition> = Api::all(t.client.clone());
    crds.delete("widgets.test.stackd.dev", &DeleteParams::default())
        .await
        .unwrap();
    eventually("CRD gone", || async {
        crds.get_opt("widgets.test.stackd.dev").await.unwrap().is_none()
    })
    .await;
    let discovery = Discovery::new(t.client.clone()).run().await.unwrap();
    assert!(!discovery.has_group("test.stackd.dev"));
    assert_eq!(
        t.server
            .store()
            .list(
                &stackd::embedded::store::GroupResource::new("test.stackd.dev", "widgets"),
                None
            )
            .0
            .len(),
        0
    );
    // Recreating the CRD starts from an empty collection.
    install_crd(&t).await;
    assert!(
        widgets(&t, "ns")
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .is_empty()
    );
}

#[tokio::test]
async fn a_deleted_crd_waits_for_its_custom_resources_finalizers() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let crd = install_crd(&t).await;
    assert!(
        crd.metadata
            .finalizers
            .unwrap()
            .contains(&"customresourcecleanup.apiextensions.k8s.io".to_string())
    );
    let api = widgets(&t, "ns");
    let mut held = widget("held", json!({"size": 1}));
    held.metadata.finalizers = Some(vec!["x.dev/hold".into()]);
    api.create(&PostParams::default(), &held).await.unwrap();
    let crds: Api<CustomResourceDefinition> = Api::all(t.client.clone());
    crds.delete("widgets.test.stackd.dev", &DeleteParams::default())
        .await
        .unwrap();
    eventually("custom resource marked for deletion", || async {
        api.get("held").await.unwrap().metadata.deletion_timestamp.is_some()
    })
    .await;
    assert!(
        crds.get_opt("widgets.test.stackd.dev").await.unwrap().is_some(),
        "the CRD waits"
    );
    let err = api_error(
        api.create(&PostParams::default(), &widget("new", json!({"size": 1})))
            .await
            .unwrap_err(),
    );
    assert_eq!((err.code, err.reason.as_str()), (405, "MethodNotAllowed"));
    api.patch(
        "held",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": null}})),
    )
    .await
    .unwrap();
    eventually("CRD gone", || async {
        crds.get_opt("widgets.test.stackd.dev").await.unwrap().is_none()
    })
    .await;
}

#[tokio::test]
async fn cluster_scoped_custom_resources_live_outside_namespaces() {
    let t = harness::start().await;
    let mut crd = widget_crd();
    crd.metadata.name = Some("gizmos.test.stackd.dev".into());
    crd.spec.scope = "Cluster".into();
    crd.spec.names.plural = "gizmos".into();
    crd.spec.names.singular = Some("gizmo".into());
    crd.spec.names.kind = "Gizmo".into();
    crd.spec.names.short_names = None;
    let crds: Api<CustomResourceDefinition> = Api::all(t.client.clone());
    crds.create(&PostParams::default(), &crd).await.unwrap();
    let gvk = GroupVersionKind::gvk("test.stackd.dev", "v1alpha1", "Gizmo");
    let gizmos: Api<DynamicObject> =
        Api::all_with(t.client.clone(), &ApiResource::from_gvk_with_plural(&gvk, "gizmos"));
    let gizmo: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "test.stackd.dev/v1alpha1", "kind": "Gizmo",
        "metadata": {"name": "g", "namespace": "ignored"}, "spec": {"size": 1}
    }))
    .unwrap();
    let created = gizmos.create(&PostParams::default(), &gizmo).await.unwrap();
    assert_eq!(created.metadata.namespace, None);
    assert_eq!(gizmos.list(&ListParams::default()).await.unwrap().items.len(), 1);
}

#[tokio::test]
async fn a_default_added_to_a_crd_later_shows_on_existing_objects() {
    let t = harness::start().await;
    t.namespace("ns").await;
    install_crd(&t).await;
    let api = widgets(&t, "ns");
    api.create(&PostParams::default(), &widget("w", json!({"size": 1})))
        .await
        .unwrap();
    let crds: Api<CustomResourceDefinition> = Api::all(t.client.clone());
    let mut crd = crds.get("widgets.test.stackd.dev").await.unwrap();
    let mut schema = serde_json::to_value(&crd.spec.versions[0].schema).unwrap();
    schema["openAPIV3Schema"]["properties"]["spec"]["properties"]["color"] =
        json!({"type": "string", "default": "blue"});
    crd.spec.versions[0].schema = Some(serde_json::from_value(schema).unwrap());
    crds.replace("widgets.test.stackd.dev", &PostParams::default(), &crd)
        .await
        .unwrap();
    assert_eq!(api.get("w").await.unwrap().data["spec"]["color"], json!("blue"));
}
