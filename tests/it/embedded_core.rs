//! CRUD semantics of the embedded API server, against kube-apiserver's recorded answers.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions};
use serde_json::json;
use stackd::embedded::ServerOptions;

use crate::harness::{self, api_error, configmap, eventually, resource_version};

#[tokio::test]
async fn stale_update_is_a_conflict() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let api = t.configmaps("ns");
    let first = api
        .create(&PostParams::default(), &configmap("c", json!({})))
        .await
        .unwrap();
    let mut changed = first.clone();
    changed.data = Some([("k".to_string(), "v2".to_string())].into());
    api.replace("c", &PostParams::default(), &changed).await.unwrap();
    let err = api_error(api.replace("c", &PostParams::default(), &changed).await.unwrap_err());
    assert_eq!((err.code, err.reason.as_str()), (409, "Conflict"));
    let mut absent = changed.clone();
    absent.metadata.name = Some("absent".into());
    absent.metadata.resource_version = None;
    let err = api_error(
        api.replace("absent", &PostParams::default(), &absent)
            .await
            .unwrap_err(),
    );
    assert_eq!(err.code, 404, "PUT does not create");
    let err = api_error(api.replace("c", &PostParams::default(), &changed).await.unwrap_err());
    assert_eq!(
        err.message,
        "Operation cannot be fulfilled on configmaps \"c\": the object has been modified; please apply your changes to the latest version and try again"
    );
}

#[tokio::test]
async fn errors_are_status_objects_with_kube_apiserver_messages() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let api = t.configmaps("ns");
    let err = api_error(api.get("missing").await.unwrap_err());
    assert_eq!(
        (err.code, err.reason.as_str(), err.message.as_str()),
        (404, "NotFound", "configmaps \"missing\" not found")
    );
    api.create(&PostParams::default(), &configmap("c", json!({})))
        .await
        .unwrap();
    let err = api_error(
        api.create(&PostParams::default(), &configmap("c", json!({})))
            .await
            .unwrap_err(),
    );
    assert_eq!(
        (err.code, err.reason.as_str(), err.message.as_str()),
        (409, "AlreadyExists", "configmaps \"c\" already exists")
    );
    let namespaces: Api<Namespace> = Api::all(t.client.clone());
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": "ns"}})).unwrap();
    let err = api_error(namespaces.create(&PostParams::default(), &ns).await.unwrap_err());
    assert_eq!((err.code, err.reason.as_str()), (409, "AlreadyExists"));
}

#[tokio::test]
async fn names_are_validated_per_kind() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let api = t.configmaps("ns");
    let err = api_error(
        api.create(&PostParams::default(), &configmap("Bad_Name", json!({})))
            .await
            .unwrap_err(),
    );
    assert_eq!((err.code, err.reason.as_str()), (422, "Invalid"));
    assert_eq!(err.details.unwrap().causes[0].field, "metadata.name");
    let err = api_error(
        api.create(&PostParams::default(), &configmap(&"a".repeat(254), json!({})))
            .await
            .unwrap_err(),
    );
    assert_eq!(err.code, 422);
    api.create(&PostParams::default(), &configmap(&"a".repeat(253), json!({})))
        .await
        .unwrap();
    let nameless: ConfigMap = serde_json::from_value(json!({"metadata": {}})).unwrap();
    let err = api_error(api.create(&PostParams::default(), &nameless).await.unwrap_err());
    assert_eq!(err.details.unwrap().causes[0].reason, "FieldValueRequired");
}

#[tokio::test]
async fn label_value_and_job_name_over_63_characters_are_invalid() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let api = t.configmaps("ns");
    api.create(&PostParams::default(), &configmap("ok", json!({"k": "v".repeat(63)})))
        .await
        .unwrap();
    let err = api_error(
        api.create(&PostParams::default(), &configmap("long", json!({"k": "v".repeat(64)})))
            .await
            .unwrap_err(),
    );
    assert_eq!((err.code, err.reason.as_str()), (422, "Invalid"));
    assert_eq!(err.details.unwrap().causes[0].field, "metadata.labels");

    let jobs: Api<Job> = Api::namespaced(t.client.clone(), "ns");
    let job = |name: &str| -> Job {
        serde_json::from_value(json!({"metadata": {"name": name}, "spec": {"template": {"spec": {
            "restartPolicy": "Never", "containers": [{"name": "c", "image": "busybox"}]}}}}))
        .unwrap()
    };
    let created = jobs
        .create(&PostParams::default(), &job(&"j".repeat(63)))
        .await
        .unwrap();
    let uid = created.metadata.uid.clone().unwrap();
    let labels = created
        .spec
        .as_ref()
        .unwrap()
        .template
        .metadata
        .as_ref()
        .unwrap()
        .labels
        .clone()
        .unwrap();
    assert_eq!(labels["controller-uid"], uid);
    assert_eq!(labels["job-name"], "j".repeat(63));
    let selector = created.spec.unwrap().selector.unwrap().match_labels.unwrap();
    assert_eq!(selector["controller-uid"], uid);
    let err = api_error(
        jobs.create(&PostParams::default(), &job(&"j".repeat(64)))
            .await
            .unwrap_err(),
    );
    assert_eq!((err.code, err.reason.as_str()), (422, "Invalid"));
}

#[tokio::test]
async fn create_in_a_missing_namespace_is_not_found() {
    let t = harness::start().await;
    let err = api_error(
        t.configmaps("nowhere")
            .create(&PostParams::default(), &configmap("c", json!({})))
            .await
            .unwrap_err(),
    );
    assert_eq!(
        (err.code, err.reason.as_str(), err.message.as_str()),
        (404, "NotFound", "namespaces \"nowhere\" not found")
    );
}

#[tokio::test]
async fn noop_update_and_noop_merge_patch_keep_the_resource_version() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let api = t.configmaps("ns");
    let created = api
        .create(&PostParams::default(), &configmap("c", json!({"a": "b"})))
        .await
        .unwrap();
    let replaced = api.replace("c", &PostParams::default(), &created).await.unwrap();
    assert_eq!(resource_version(&replaced), resource_version(&created));
    let patched = api
        .patch("c", &PatchParams::default(), &Patch::Merge(json!({"data": {"k": "v"}})))
        .await
        .unwrap();
    assert_eq!(resource_version(&patched), resource_version(&created));
    let changed = api
        .patch("c", &PatchParams::default(), &Patch::Merge(json!({"data": {"m": "n"}})))
        .await
        .unwrap();
    assert_ne!(resource_version(&changed), resource_version(&created));
    let keys: Vec<&String> = changed.data.as_ref().unwrap().keys().collect();
    assert_eq!(keys, vec!["k", "m"]);
}

#[tokio::test]
async fn json_patch_tests_missing_paths_as_null_and_refuses_failed_tests() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let api = t.configmaps("ns");
    api.create(&PostParams::default(), &configmap("c", json!({})))
        .await
        .unwrap();
    let add_finalizer: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/metadata/finalizers", "value": null},
        {"op": "add", "path": "/metadata/finalizers", "value": ["x.dev/f"]}
    ]))
    .unwrap();
    let patched = api
        .patch("c", &PatchParams::default(), &Patch::<()>::Json(add_finalizer))
        .await
        .unwrap();
    assert_eq!(patched.metadata.finalizers, Some(vec!["x.dev/f".to_string()]));
    let failing: json_patch::Patch =
        serde_json::from_value(json!([{"op": "test", "path": "/data/k", "value": "nope"}])).unwrap();
    let err = api_error(
        api.patch("c", &PatchParams::default(), &Patch::<()>::Json(failing))
            .await
            .unwrap_err(),
    );
    assert_eq!((err.code, err.reason.as_str()), (422, "Invalid"));
    let err = api_error(
        api.patch("missing", &PatchParams::default(), &Patch::Merge(json!({})))
            .await
            .unwrap_err(),
    );
    assert_eq!(err.code, 404);
}

#[tokio::test]
async fn finalizer_holds_a_delete_until_removed_then_the_object_is_gone() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let api = t.configmaps("ns");
    let mut cm = configmap("c", json!({}));
    cm.metadata.finalizers = Some(vec!["x.dev/hold".into()]);
    api.create(&PostParams::default(), &cm).await.unwrap();
    let deleted = api.delete("c", &DeleteParams::default()).await.unwrap().left().unwrap();
    assert!(deleted.metadata.deletion_timestamp.is_some());
    let still = api.get("c").await.unwrap();
    assert!(still.metadata.deletion_timestamp.is_some());
    let refused = api
        .patch(
            "c",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": ["x.dev/hold", "x.dev/new"]}})),
        )
        .await
        .unwrap_err();
    assert_eq!(api_error(refused).code, 422);
    api.patch(
        "c",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": null}})),
    )
    .await
    .unwrap();
    assert_eq!(api_error(api.get("c").await.unwrap_err()).code, 404);
}

#[tokio::test]
async fn delete_preconditions_that_do_not_match_are_a_conflict() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let api = t.configmaps("ns");
    api.create(&PostParams::default(), &configmap("c", json!({})))
        .await
        .unwrap();
    let params = DeleteParams {
        preconditions: Some(Preconditions {
            uid: Some("other".into()),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    assert_eq!(api_error(api.delete("c", &params).await.unwrap_err()).code, 409);
    api.delete("c", &DeleteParams::default()).await.unwrap();
}

#[tokio::test]
async fn generate_name_appends_five_random_characters() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let cm: ConfigMap = serde_json::from_value(json!({"metadata": {"generateName": "gen-"}})).unwrap();
    let created = t.configmaps("ns").create(&PostParams::default(), &cm).await.unwrap();
    let name = created.metadata.name.unwrap();
    assert!(name.starts_with("gen-") && name.len() == 9, "{name}");
    assert_eq!(created.metadata.uid.unwrap().len(), 36);
}

#[tokio::test]
async fn list_pages_with_limit_and_continue() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let api = t.configmaps("ns");
    for i in 0..5 {
        api.create(&PostParams::default(), &configmap(&format!("c{i}"), json!({})))
            .await
            .unwrap();
    }
    let mut names = Vec::new();
    let mut params = ListParams::default().limit(2);
    let mut pages = 0;
    loop {
        let page = api.list(&params).await.unwrap();
        pages += 1;
        names.extend(page.items.iter().map(|c| c.metadata.name.clone().unwrap()));
        match page.metadata.continue_ {
            Some(token) if !token.is_empty() => params = params.continue_token(&token),
            _ => break,
        }
    }
    assert_eq!(pages, 3);
    assert_eq!(names, vec!["c0", "c1", "c2", "c3", "c4"]);
}

#[tokio::test]
async fn label_and_field_selectors_select_like_kube_apiserver() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let api = t.configmaps("ns");
    for (name, labels) in [
        ("c1", json!({"app": "x", "tier": "a"})),
        ("c2", json!({"app": "y"})),
        ("c3", json!({"app": "z", "tier": "b"})),
    ] {
        api.create(&PostParams::default(), &configmap(name, labels))
            .await
            .unwrap();
    }
    let names = |list: kube::core::ObjectList<ConfigMap>| -> Vec<String> {
        list.items.into_iter().map(|c| c.metadata.name.unwrap()).collect()
    };
    assert_eq!(
        names(
            api.list(&ListParams::default().labels("app in (x,y),!tier"))
                .await
                .unwrap()
        ),
        vec!["c2"]
    );
    assert_eq!(
        names(api.list(&ListParams::default().labels("app!=x")).await.unwrap()),
        vec!["c2", "c3"]
    );
    assert_eq!(
        names(
            api.list(&ListParams::default().fields("metadata.name=c2"))
                .await
                .unwrap()
        ),
        vec!["c2"]
    );
    let err = api_error(api.list(&ListParams::default().fields("data.k=v")).await.unwrap_err());
    assert_eq!((err.code, err.reason.as_str()), (400, "BadRequest"));
}

#[tokio::test]
async fn deletecollection_deletes_only_the_selected_objects() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let api = t.configmaps("ns");
    api.create(&PostParams::default(), &configmap("a1", json!({"app": "a"})))
        .await
        .unwrap();
    api.create(&PostParams::default(), &configmap("a2", json!({"app": "b"})))
        .await
        .unwrap();
    api.create(&PostParams::default(), &configmap("other", json!({})))
        .await
        .unwrap();
    api.delete_collection(&DeleteParams::default(), &ListParams::default().labels("app"))
        .await
        .unwrap();
    let left: Vec<String> = api
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|c| c.metadata.name.unwrap())
        .collect();
    assert_eq!(left, vec!["other"]);
}

#[tokio::test]
async fn status_subresource_ignores_spec_changes_and_main_resource_ignores_status() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let api: Api<Deployment> = Api::namespaced(t.client.clone(), "ns");
    let deploy: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "d"},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "d"}},
                 "template": {"metadata": {"labels": {"app": "d"}}, "spec": {"containers": [{"name": "c", "image": "i"}]}}},
        "status": {"replicas": 9}
    }))
    .unwrap();
    let created = api.create(&PostParams::default(), &deploy).await.unwrap();
    assert_eq!(
        created.status.and_then(|s| s.replicas),
        None,
        "status is not settable on create"
    );
    assert_eq!(created.metadata.generation, Some(1));
    let status_write = json!({"spec": {"replicas": 5}, "status": {"replicas": 1, "availableReplicas": 1}});
    let after = api
        .patch_status("d", &PatchParams::default(), &Patch::Merge(status_write))
        .await
        .unwrap();
    assert_eq!(after.spec.as_ref().unwrap().replicas, Some(1));
    assert_eq!(after.status.as_ref().unwrap().available_replicas, Some(1));
    assert_eq!(
        after.metadata.generation,
        Some(1),
        "status writes do not bump generation"
    );
    let main_write = json!({"spec": {"replicas": 3}, "status": {"availableReplicas": 7}});
    let after = api
        .patch("d", &PatchParams::default(), &Patch::Merge(main_write))
        .await
        .unwrap();
    assert_eq!(after.spec.as_ref().unwrap().replicas, Some(3));
    assert_eq!(after.status.as_ref().unwrap().available_replicas, Some(1));
    assert_eq!(after.metadata.generation, Some(2));
}

#[tokio::test]
async fn scale_subresource_reads_and_writes_deployment_replicas() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let api: Api<Deployment> = Api::namespaced(t.client.clone(), "ns");
    let deploy: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "d"},
        "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "d"}},
                 "template": {"metadata": {"labels": {"app": "d"}}, "spec": {"containers": [{"name": "c", "image": "i"}]}}}
    }))
    .unwrap();
    api.create(&PostParams::default(), &deploy).await.unwrap();
    let scale = api.get_scale("d").await.unwrap();
    assert_eq!(scale.spec.unwrap().replicas, Some(2));
    assert_eq!(scale.status.unwrap().selector.as_deref(), Some("app=d"));
    let scaled = api
        .patch_scale(
            "d",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": 4}})),
        )
        .await
        .unwrap();
    assert_eq!(scaled.spec.unwrap().replicas, Some(4));
    assert_eq!(api.get("d").await.unwrap().spec.unwrap().replicas, Some(4));
}

#[tokio::test]
async fn pod_log_honours_container_and_limit_bytes() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let pods: Api<Pod> = Api::namespaced(t.client.clone(), "ns");
    let pod: Pod = serde_json::from_value(json!({"metadata": {"name": "p"}, "spec": {"containers": [
        {"name": "init", "image": "i"}, {"name": "unpack", "image": "i"}]}}))
    .unwrap();
    pods.create(&PostParams::default(), &pod).await.unwrap();
    t.server.set_pod_log("ns", "p", "unpack", "hello world");
    let params = kube::api::LogParams {
        container: Some("unpack".into()),
        limit_bytes: Some(5),
        ..Default::default()
    };
    assert_eq!(pods.logs("p", &params).await.unwrap(), "hello");
    let err = api_error(pods.logs("p", &kube::api::LogParams::default()).await.unwrap_err());
    assert_eq!(err.code, 400, "two containers need a container name");
}

#[tokio::test]
async fn terminating_namespace_refuses_creates_and_goes_once_empty() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let api = t.configmaps("ns");
    let mut held = configmap("held", json!({}));
    held.metadata.finalizers = Some(vec!["x.dev/hold".into()]);
    api.create(&PostParams::default(), &held).await.unwrap();
    api.create(&PostParams::default(), &configmap("plain", json!({})))
        .await
        .unwrap();
    let namespaces: Api<Namespace> = Api::all(t.client.clone());
    namespaces.delete("ns", &DeleteParams::default()).await.unwrap();
    let ns = namespaces.get("ns").await.unwrap();
    assert_eq!(ns.status.unwrap().phase.as_deref(), Some("Terminating"));
    let err = api_error(
        api.create(&PostParams::default(), &configmap("new", json!({})))
            .await
            .unwrap_err(),
    );
    assert_eq!((err.code, err.reason.as_str()), (403, "Forbidden"));
    eventually("plain configmap deleted", || async {
        api.get_opt("plain").await.unwrap().is_none()
    })
    .await;
    assert!(
        namespaces.get_opt("ns").await.unwrap().is_some(),
        "a finalizer in the namespace holds it"
    );
    api.patch(
        "held",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": null}})),
    )
    .await
    .unwrap();
    eventually("namespace removed", || async {
        namespaces.get_opt("ns").await.unwrap().is_none()
    })
    .await;
}

#[tokio::test]
async fn tls_and_token_kubeconfig_works_and_a_wrong_token_is_unauthorized() {
    let options = ServerOptions {
        name: "tenant-a".into(),
        tls: true,
        token: Some("s3cret".into()),
        ..Default::default()
    };
    let t = harness::start_with(options).await;
    assert!(t.server.url().starts_with("https://127.0.0.1:"));
    let yaml = t.server.kubeconfig_yaml();
    assert!(
        yaml.contains("tenant-a") && yaml.contains("s3cret") && yaml.contains("certificate-authority-data"),
        "{yaml}"
    );
    let namespaces: Api<Namespace> = Api::all(t.client.clone());
    namespaces.list(&ListParams::default()).await.unwrap();

    let mut wrong = t.server.kubeconfig();
    wrong.auth_infos[0].auth_info.as_mut().unwrap().token = Some("nope".to_string().into());
    let config = kube::Config::from_custom_kubeconfig(wrong, &Default::default())
        .await
        .unwrap();
    let client = kube::Client::try_from(config).unwrap();
    let err = api_error(
        Api::<Namespace>::all(client.clone())
            .list(&ListParams::default())
            .await
            .unwrap_err(),
    );
    assert_eq!((err.code, err.reason.as_str()), (401, "Unauthorized"));
    let err = client.apiserver_version().await.unwrap_err();
    assert_eq!(api_error(err).code, 401, "discovery needs the token too");
    t.server.shutdown().await;
}

#[tokio::test]
async fn all_namespaces_list_spans_namespaces() {
    let t = harness::start().await;
    t.namespace("a").await;
    t.namespace("b").await;
    t.configmaps("a")
        .create(&PostParams::default(), &configmap("x", json!({})))
        .await
        .unwrap();
    t.configmaps("b")
        .create(&PostParams::default(), &configmap("y", json!({})))
        .await
        .unwrap();
    let all: Api<ConfigMap> = Api::all(t.client.clone());
    let listed: Vec<(String, String)> = all
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|c| (c.metadata.namespace.unwrap(), c.metadata.name.unwrap()))
        .collect();
    assert_eq!(listed, vec![("a".into(), "x".into()), ("b".into(), "y".into())]);
}

#[tokio::test]
async fn discovery_lists_built_in_resources_with_subresources() {
    let t = harness::start().await;
    let core = t.client.list_core_api_resources("v1").await.unwrap();
    let names: Vec<&str> = core.resources.iter().map(|r| r.name.as_str()).collect();
    for expected in [
        "namespaces",
        "configmaps",
        "secrets",
        "serviceaccounts",
        "services",
        "pods",
        "pods/log",
        "events",
    ] {
        assert!(names.contains(&expected), "{expected} in {names:?}");
    }
    let apps = t.client.list_api_group_resources("apps/v1").await.unwrap();
    let scale = apps.resources.iter().find(|r| r.name == "deployments/scale").unwrap();
    assert_eq!(
        (scale.kind.as_str(), scale.group.as_deref()),
        ("Scale", Some("autoscaling"))
    );
    let jobs = t.client.list_api_group_resources("batch/v1").await.unwrap();
    assert!(jobs.resources.iter().any(|r| r.name == "jobs/status"));
    let groups: Vec<String> = t
        .client
        .list_api_groups()
        .await
        .unwrap()
        .groups
        .into_iter()
        .map(|g| g.name)
        .collect();
    for group in [
        "apps",
        "batch",
        "rbac.authorization.k8s.io",
        "apiextensions.k8s.io",
        "coordination.k8s.io",
        "events.k8s.io",
    ] {
        assert!(groups.contains(&group.to_string()), "{group}");
    }
    assert_eq!(t.client.apiserver_version().await.unwrap().minor, "24");
}

#[tokio::test]
async fn update_with_another_uid_is_a_conflict() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let api = t.configmaps("ns");
    let mut stale = api
        .create(&PostParams::default(), &configmap("c", json!({})))
        .await
        .unwrap();
    api.delete("c", &DeleteParams::default()).await.unwrap();
    api.create(&PostParams::default(), &configmap("c", json!({})))
        .await
        .unwrap();
    stale.metadata.resource_version = None;
    let err = api_error(api.replace("c", &PostParams::default(), &stale).await.unwrap_err());
    assert_eq!((err.code, err.reason.as_str()), (409, "Conflict"));
    assert!(
        err.message.contains("Precondition failed: UID in precondition"),
        "{}",
        err.message
    );
}

#[tokio::test]
async fn job_pod_template_is_immutable() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let jobs: Api<Job> = Api::namespaced(t.client.clone(), "ns");
    let job: Job = serde_json::from_value(json!({"metadata": {"name": "j"}, "spec": {"template": {"spec": {
        "restartPolicy": "Never", "containers": [{"name": "c", "image": "one"}]}}}}))
    .unwrap();
    jobs.create(&PostParams::default(), &job).await.unwrap();
    let new_image = json!({"spec": {"template": {"spec": {"containers": [{"name": "c", "image": "two"}]}}}});
    let err = api_error(
        jobs.patch("j", &PatchParams::default(), &Patch::Merge(new_image))
            .await
            .unwrap_err(),
    );
    assert_eq!((err.code, err.reason.as_str()), (422, "Invalid"));
    assert_eq!(err.details.unwrap().causes[0].field, "spec.template");
}

#[tokio::test]
async fn events_written_through_events_api_are_read_through_core_with_field_selectors() {
    use k8s_openapi::api::core::v1::Event as CoreEvent;
    use k8s_openapi::api::events::v1::Event;
    let t = harness::start().await;
    t.namespace("ns").await;
    let events: Api<Event> = Api::namespaced(t.client.clone(), "ns");
    let event: Event = serde_json::from_value(json!({
        "metadata": {"name": "e1"},
        "eventTime": "2026-01-01T00:00:00.000000Z",
        "regarding": {"kind": "ConfigMap", "name": "c", "namespace": "ns"},
        "note": "something happened", "reason": "Happened", "type": "Normal", "action": "Reconcile",
        "reportingController": "stackd", "reportingInstance": "stackd-1"
    }))
    .unwrap();
    events.create(&PostParams::default(), &event).await.unwrap();
    let core: Api<CoreEvent> = Api::namespaced(t.client.clone(), "ns");
    let listed = core
        .list(&ListParams::default().fields("involvedObject.name=c,reason=Happened"))
        .await
        .unwrap();
    assert_eq!(listed.items.len(), 1);
    assert_eq!(listed.items[0].message.as_deref(), Some("something happened"));
    assert_eq!(listed.items[0].involved_object.kind.as_deref(), Some("ConfigMap"));
    let none = core
        .list(&ListParams::default().fields("involvedObject.name=other"))
        .await
        .unwrap();
    assert!(none.items.is_empty());
    let back = events
        .list(&ListParams::default().fields("regarding.name=c"))
        .await
        .unwrap();
    assert_eq!(back.items[0].note.as_deref(), Some("something happened"));
}

#[tokio::test]
async fn built_in_specs_are_validated_like_kube_apiserver() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let jobs: Api<Job> = Api::namespaced(t.client.clone(), "ns");
    let job: Job = serde_json::from_value(json!({"metadata": {"name": "j"}, "spec": {"template": {"spec": {
        "containers": [{"name": "c", "image": "i"}]}}}}))
    .unwrap();
    let err = api_error(jobs.create(&PostParams::default(), &job).await.unwrap_err());
    assert_eq!(err.details.unwrap().causes[0].field, "spec.template.spec.restartPolicy");

    let deployments: Api<Deployment> = Api::namespaced(t.client.clone(), "ns");
    let deploy: Deployment = serde_json::from_value(json!({"metadata": {"name": "d"}, "spec": {
        "selector": {"matchLabels": {"app": "d"}},
        "template": {"metadata": {"labels": {"app": "other"}}, "spec": {"containers": [{"name": "c", "image": "i"}]}}}}))
    .unwrap();
    let err = api_error(deployments.create(&PostParams::default(), &deploy).await.unwrap_err());
    assert_eq!(err.details.unwrap().causes[0].field, "spec.template.metadata.labels");

    // What kube-apiserver 1.24 answered for a stack controller whose image was never filled in.
    let no_image: Deployment = serde_json::from_value(json!({"metadata": {"name": "d"}, "spec": {
        "selector": {"matchLabels": {"app": "d"}},
        "template": {"metadata": {"labels": {"app": "d"}}, "spec": {"containers": [{"name": "c", "image": ""}]}}}}))
    .unwrap();
    let err = api_error(deployments.create(&PostParams::default(), &no_image).await.unwrap_err());
    assert_eq!(err.code, 422);
    assert!(
        err.message
            .contains("spec.template.spec.containers[0].image: Required value"),
        "{}",
        err.message
    );
    let never: Deployment = serde_json::from_value(json!({"metadata": {"name": "d"}, "spec": {
        "selector": {"matchLabels": {"app": "d"}},
        "template": {"metadata": {"labels": {"app": "d"}}, "spec": {"restartPolicy": "Never",
            "containers": [{"name": "c", "image": "i"}, {"name": "c", "image": "i"}]}}}}))
    .unwrap();
    let err = api_error(deployments.create(&PostParams::default(), &never).await.unwrap_err());
    let fields: Vec<String> = err.details.unwrap().causes.into_iter().map(|c| c.field).collect();
    assert!(
        fields.contains(&"spec.template.spec.containers[1].name".to_string()),
        "{fields:?}"
    );
    assert!(
        fields.contains(&"spec.template.spec.restartPolicy".to_string()),
        "{fields:?}"
    );

    let bindings: Api<k8s_openapi::api::rbac::v1::ClusterRoleBinding> = Api::all(t.client.clone());
    let binding = serde_json::from_value(json!({"metadata": {"name": "stackd:ns:x"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "stackd:ns:x:system"},
        "subjects": [{"kind": "ServiceAccount", "name": "x", "namespace": "ns"}]}))
    .unwrap();
    bindings.create(&PostParams::default(), &binding).await.unwrap();
    let fetched = bindings.get("stackd:ns:x").await.unwrap();
    assert_eq!(
        fetched.metadata.name.as_deref(),
        Some("stackd:ns:x"),
        "names with ':' work in paths"
    );
    bindings.delete("stackd:ns:x", &DeleteParams::default()).await.unwrap();
}

#[tokio::test]
async fn dry_run_writes_are_checked_but_change_nothing() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let api = t.configmaps("ns");
    let dry = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let answered = api.create(&dry, &configmap("c", json!({}))).await.unwrap();
    assert!(answered.metadata.uid.is_some());
    assert!(
        api.get_opt("c").await.unwrap().is_none(),
        "a dry-run create stores nothing"
    );
    let err = api_error(api.create(&dry, &configmap("Bad_Name", json!({}))).await.unwrap_err());
    assert_eq!(err.code, 422, "a dry run still validates");

    let created = api
        .create(&PostParams::default(), &configmap("c", json!({})))
        .await
        .unwrap();
    let patch = Patch::Merge(json!({"data": {"k": "changed"}}));
    let answered = api.patch("c", &PatchParams::default().dry_run(), &patch).await.unwrap();
    assert_eq!(answered.data.unwrap()["k"], "changed");
    let stored = api.get("c").await.unwrap();
    assert_eq!(resource_version(&stored), resource_version(&created));
    let params = DeleteParams {
        dry_run: true,
        ..DeleteParams::default()
    };
    api.delete("c", &params).await.unwrap();
    assert!(
        api.get_opt("c").await.unwrap().is_some(),
        "a dry-run delete keeps the object"
    );
}

#[tokio::test]
async fn a_fresh_server_has_the_system_namespaces() {
    let t = harness::start().await;
    let namespaces: Api<Namespace> = Api::all(t.client.clone());
    let names: Vec<String> = namespaces
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|n| n.metadata.name.unwrap())
        .collect();
    assert_eq!(names, vec!["default", "kube-node-lease", "kube-public", "kube-system"]);
}

#[tokio::test]
async fn malformed_bodies_and_patches_are_refused_without_harming_the_server() {
    let t = harness::start().await;
    t.namespace("ns").await;
    t.configmaps("ns")
        .create(&PostParams::default(), &configmap("c", json!({})))
        .await
        .unwrap();
    let send = |method: &str, path: &str, content_type: &str, body: &str| {
        http::Request::builder()
            .method(method)
            .uri(path)
            .header("content-type", content_type)
            .body(body.as_bytes().to_vec())
            .unwrap()
    };
    let cm = "/api/v1/namespaces/ns/configmaps";
    let crds = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions";
    let requests = [
        send("POST", cm, "application/json", "5"),
        send("POST", cm, "application/json", r#"{"metadata": "x"}"#),
        send("POST", cm, "application/json", "{not json"),
        send("PUT", &format!("{cm}/c"), "application/json", r#"{"metadata": []}"#),
        send("PATCH", &format!("{cm}/c"), "application/merge-patch+json", "5"),
        send(
            "PATCH",
            &format!("{cm}/c"),
            "application/merge-patch+json",
            r#"{"metadata": 1}"#,
        ),
        send(
            "PATCH",
            &format!("{cm}/c"),
            "application/json-patch+json",
            r#"[{"op":"replace","path":"","value":5}]"#,
        ),
        send(
            "PATCH",
            &format!("{cm}/c"),
            "application/json-patch+json",
            r#"{"op":"add"}"#,
        ),
        send(
            "POST",
            crds,
            "application/json",
            r#"{"metadata": {"name": "a.b"}, "spec": {"names": "x", "versions": 3}}"#,
        ),
        send(
            "GET",
            &format!("{cm}?labelSelector=a%20in%20(&limit=x"),
            "application/json",
            "",
        ),
        send(
            "GET",
            &format!("{cm}?watch=1&resourceVersion=abc"),
            "application/json",
            "",
        ),
    ];
    for request in requests {
        let description = format!("{} {}", request.method(), request.uri());
        let err = api_error(t.client.request_text(request).await.unwrap_err());
        assert!(
            (400..500).contains(&err.code),
            "{description}: {} {}",
            err.code,
            err.message
        );
    }
    assert!(t.configmaps("ns").get("c").await.is_ok(), "the server still answers");
}
