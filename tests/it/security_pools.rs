//! The tenant is untrusted (DESIGN.md §8, "References"; issue 16): a pool counts, hands out, repairs
//! and deletes only the ClusterDeployments it created, proved by the namespace it created for each
//! (labelled with the pool, annotated with its uid), never by `spec.clusterPoolRef` or copied
//! labels; and it deletes only namespaces it created. Each attack runs through the daemon binary
//! against embedded host and tenant servers, as a tenant user could perform it.

use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use stackd::api::inventory::BareMetalAsset;
use stackd::api::pools::{ClusterDeployment, ClusterHost, ClusterPool, HostRole};

use crate::harness::until;
use crate::pools::{
    INSTALLER, NS, WITHIN, claimed_namespace, claims, create_claim, create_pool, daemon, events, lease, named_cdc,
    pool, pool_json, pool_namespaces, pools, ready, setup,
};

const POOL_NAMESPACE_LABEL: &str = "pools.stackd.dev/clusterpool-namespace";
const POOL_NAME_LABEL: &str = "pools.stackd.dev/clusterpool-name";
const POOL_UID_ANNOTATION: &str = "pools.stackd.dev/clusterpool-uid";

/// A namespace a tenant user may write in (an admin made it), with what a cluster needs to install.
async fn user_namespace(tenant: &Client, name: &str) {
    create_namespace(tenant, json!({"metadata": {"name": name}})).await;
    let secrets: Api<Secret> = Api::namespaced(tenant.clone(), name);
    for secret in [
        json!({"metadata": {"name": "creds"}, "stringData": {"username": "u", "password": "p"}}),
        json!({"metadata": {"name": "pull"}, "stringData": {".dockerconfigjson": "{}"}}),
        json!({"metadata": {"name": "install-config"}, "stringData": {"install-config.yaml": "apiVersion: v1\n"}}),
    ] {
        let secret: Secret = serde_json::from_value(secret).expect("secret");
        secrets.create(&PostParams::default(), &secret).await.expect("secret");
    }
}

async fn create_namespace(tenant: &Client, namespace: Value) -> Namespace {
    let namespace: Namespace = serde_json::from_value(namespace).expect("namespace");
    Api::<Namespace>::all(tenant.clone())
        .create(&PostParams::default(), &namespace)
        .await
        .expect("create namespace")
}

/// A ClusterDeployment made by hand in `namespace`, naming pool `pool` of namespace `team` and
/// carrying the labels a pool puts on its clusters: it installs from the Secrets of
/// [`user_namespace`].
fn hand_made_cluster(namespace: &str, name: &str, pool: &str) -> ClusterDeployment {
    serde_json::from_value(json!({
        "apiVersion": "pools.stackd.dev/v1alpha1", "kind": "ClusterDeployment",
        "metadata": {"name": name, "namespace": namespace,
            "labels": {POOL_NAMESPACE_LABEL: NS, POOL_NAME_LABEL: pool}},
        "spec": {
            "clusterName": name,
            "baseDomain": "example.com",
            "platform": {"vsphere": {"credentialsSecretRef": {"name": "creds"},
                "vCenter": "vc.example.com", "datacenter": "dc1", "defaultDatastore": "ds1"}},
            "pullSecretRef": {"name": "pull"},
            "provisioning": {"installConfigSecretRef": {"name": "install-config"}, "installerImage": INSTALLER},
            "clusterPoolRef": {"namespace": NS, "poolName": pool},
        },
    }))
    .expect("cluster deployment")
}

async fn create_cluster(tenant: &Client, cd: &ClusterDeployment) -> ClusterDeployment {
    Api::<ClusterDeployment>::namespaced(tenant.clone(), &cd.namespace().unwrap())
        .create(&PostParams::default(), cd)
        .await
        .expect("create cluster deployment")
}

async fn cluster(tenant: &Client, namespace: &str, name: &str) -> Option<ClusterDeployment> {
    Api::<ClusterDeployment>::namespaced(tenant.clone(), namespace)
        .get_opt(name)
        .await
        .expect("get cluster deployment")
}

async fn namespace(tenant: &Client, name: &str) -> Option<Namespace> {
    Api::<Namespace>::all(tenant.clone())
        .get_opt(name)
        .await
        .expect("get namespace")
}

/// The clusters `pool` created: each named after a namespace the pool created.
async fn own_clusters(tenant: &Client, pool: &str) -> Vec<ClusterDeployment> {
    let mut out = Vec::new();
    for ns in pool_namespaces(tenant, pool).await {
        if let Some(cd) = cluster(tenant, &ns.name_any(), &ns.name_any()).await {
            out.push(cd);
        }
    }
    out
}

fn installed(cd: &ClusterDeployment) -> bool {
    cd.status.as_ref().is_some_and(|s| s.installed)
}

fn unclaimed_and_ready(pool: &ClusterPool) -> (i32, i32) {
    pool.status.as_ref().map_or((0, 0), |s| (s.size, s.ready))
}

/// True when a `NotPoolMember` warning on `name` in `namespace` names `pool` and says `detail`.
async fn refused_with(tenant: &Client, namespace: &str, name: &str, pool: &str, detail: &str) -> bool {
    events(tenant, namespace, name)
        .await
        .iter()
        .any(|(reason, note)| reason == "NotPoolMember" && note.contains(pool) && note.contains(detail))
}

/// A user in namespace `evil` points a ClusterDeployment of their own (named after their namespace,
/// with the pool's labels) at team's pool. The pool creates its own cluster anyway, never counts,
/// hands out, scales away or deletes theirs, says why on it, and leaves their namespace alone when
/// the pool itself is deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_from_another_namespace_naming_a_pool_is_never_counted_claimed_or_deleted() {
    let (fleet, tenant) = setup().await;
    user_namespace(&tenant, "evil").await;
    // Older than every pool cluster: the first a claim would get if the pool trusted it.
    let foreign = create_cluster(&tenant, &hand_made_cluster("evil", "evil", "p")).await;
    create_pool(&tenant, pool_json("p", 1, None)).await;
    let daemon = daemon(&fleet, &[]);

    until("the hand-made cluster installed", WITHIN, &daemon, || async {
        cluster(&tenant, "evil", "evil").await.is_some_and(|cd| installed(&cd))
    })
    .await;
    until("the pool's own cluster ready", WITHIN, &daemon, || async {
        let own = own_clusters(&tenant, "p").await;
        own.len() == 1 && own.iter().all(installed) && ready(&tenant, "p").await == 1
    })
    .await;
    until(
        "a NotPoolMember warning on the hand-made cluster",
        WITHIN,
        &daemon,
        || async {
            refused_with(
                &tenant,
                "evil",
                "evil",
                "ClusterPool team/p",
                "namespace evil was not created by that pool",
            )
            .await
        },
    )
    .await;
    assert_eq!(unclaimed_and_ready(&pool(&tenant, "p").await), (1, 1));
    // Installed: the ClusterDeployment controller has nothing left to write on it.
    let settled = cluster(&tenant, "evil", "evil").await.unwrap();
    let version = settled.resource_version();
    assert_eq!(settled.uid(), foreign.uid());

    // A claim gets the pool's own cluster, and the pool refills with its own.
    create_claim(&tenant, "c", "p", None).await;
    until("the claim assigned", WITHIN, &daemon, || async {
        claimed_namespace(&tenant, "c").await.is_some()
    })
    .await;
    let claimed = claimed_namespace(&tenant, "c").await.unwrap();
    assert_ne!(claimed, "evil");
    assert!(
        own_clusters(&tenant, "p")
            .await
            .iter()
            .any(|cd| cd.name_any() == claimed)
    );
    until("the pool refilled with its own cluster", WITHIN, &daemon, || async {
        let own = own_clusters(&tenant, "p").await;
        own.len() == 2 && own.iter().all(installed) && ready(&tenant, "p").await == 1
    })
    .await;
    assert_eq!(unclaimed_and_ready(&pool(&tenant, "p").await), (1, 1));

    // Scaled to zero, the pool deletes its unclaimed cluster, not the hand-made one.
    pools(&tenant)
        .patch(
            "p",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"size": 0}})),
        )
        .await
        .expect("scale");
    until("the pool's unclaimed cluster deleted", WITHIN, &daemon, || async {
        unclaimed_and_ready(&pool(&tenant, "p").await) == (0, 0) && own_clusters(&tenant, "p").await.len() == 1
    })
    .await;
    let after_scale = cluster(&tenant, "evil", "evil").await.expect("still there");
    assert_eq!(after_scale.resource_version(), version, "untouched by the pool");

    // Deleting the claim and the pool deletes the pool's clusters; the hand-made one and its
    // namespace stay, and do not hold up the pool's deletion.
    claims(&tenant)
        .delete("c", &DeleteParams::default())
        .await
        .expect("delete claim");
    pools(&tenant)
        .delete("p", &DeleteParams::default())
        .await
        .expect("delete pool");
    until("the pool and its clusters gone", WITHIN, &daemon, || async {
        pools(&tenant).get_opt("p").await.unwrap().is_none() && own_clusters(&tenant, "p").await.is_empty()
    })
    .await;
    let survivor = cluster(&tenant, "evil", "evil").await.expect("still there");
    assert_eq!(survivor.resource_version(), version);
    assert!(survivor.metadata.deletion_timestamp.is_none());
    assert!(survivor.spec.cluster_pool_ref.unwrap().claim_name.is_none());
    let evil = namespace(&tenant, "evil").await.expect("namespace evil");
    assert!(evil.metadata.deletion_timestamp.is_none());
}

/// Someone who may edit a pool cluster points its reference at another pool. The other pool neither
/// adopts it (no count, no claim, no deletion as excess) nor hides it: it says why on the cluster.
/// Its own pool stops counting it and builds a replacement, but keeps its namespace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn editing_a_clusters_pool_reference_does_not_move_it_to_another_pool() {
    let (fleet, tenant) = setup().await;
    create_pool(&tenant, pool_json("p", 1, None)).await;
    create_pool(&tenant, pool_json("q", 0, None)).await;
    let daemon = daemon(&fleet, &[]);
    until("p's cluster ready", WITHIN, &daemon, || async {
        ready(&tenant, "p").await == 1
    })
    .await;
    let edited = own_clusters(&tenant, "p").await.remove(0).name_any();
    // Old enough that p would reap its namespace if it thought it empty.
    until(
        "the cluster's namespace older than the minimum lease age",
        WITHIN,
        &daemon,
        || async {
            let ns = namespace(&tenant, &edited).await.unwrap();
            let created = ns.metadata.creation_timestamp.unwrap().0;
            jiff::Timestamp::now().duration_since(created) >= jiff::SignedDuration::from_secs(3)
        },
    )
    .await;

    let written = Api::<ClusterDeployment>::namespaced(tenant.clone(), &edited)
        .patch(
            &edited,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"clusterPoolRef": {"poolName": "q"}}})),
        )
        .await
        .expect("edit the reference");
    let version = written.resource_version();

    until(
        "a NotPoolMember warning from q on the edited cluster",
        WITHIN,
        &daemon,
        || async {
            refused_with(
                &tenant,
                &edited,
                &edited,
                "ClusterPool team/q",
                "was not created by that pool",
            )
            .await
        },
    )
    .await;
    until(
        "p replaced it with a ready cluster of its own",
        WITHIN,
        &daemon,
        || async {
            let own = own_clusters(&tenant, "p").await;
            let others: Vec<_> = own.iter().filter(|cd| cd.name_any() != edited).collect();
            others.len() == 1 && installed(others[0]) && ready(&tenant, "p").await == 1
        },
    )
    .await;
    assert_eq!(
        unclaimed_and_ready(&pool(&tenant, "q").await),
        (0, 0),
        "q counts nothing"
    );

    // A claim on q gets a cluster q builds, not the edited one.
    create_claim(&tenant, "cq", "q", None).await;
    until("q's claim assigned", WITHIN, &daemon, || async {
        claimed_namespace(&tenant, "cq").await.is_some()
    })
    .await;
    let claimed = claimed_namespace(&tenant, "cq").await.unwrap();
    assert_ne!(claimed, edited);
    assert!(
        own_clusters(&tenant, "q")
            .await
            .iter()
            .any(|cd| cd.name_any() == claimed)
    );

    let after = cluster(&tenant, &edited, &edited).await.expect("not deleted");
    assert_eq!(after.resource_version(), version, "untouched by either pool");
    assert!(after.metadata.deletion_timestamp.is_none());
    let ns = namespace(&tenant, &edited).await.expect("its namespace");
    assert!(
        ns.metadata.deletion_timestamp.is_none(),
        "never reaped while it holds a cluster"
    );
}

/// A user copies a pool cluster (name, labels, annotations with the pool's uid, spec with its
/// clusterPoolRef and customization, plus a host of the real cluster's) into their own namespace.
/// The pool does not count it or act on it, and deleting the copy releases neither the real
/// cluster's customization nor its host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_of_a_pool_cluster_with_forged_markers_is_ignored_and_its_deletion_releases_nothing() {
    let (fleet, tenant) = setup().await;
    named_cdc(&tenant, "a").await;
    named_cdc(&tenant, "b").await;
    create_pool(&tenant, pool_json("p", 1, Some(&["a", "b"]))).await;
    let daemon = daemon(&fleet, &[]);
    until("p's cluster ready", WITHIN, &daemon, || async {
        ready(&tenant, "p").await == 1
    })
    .await;
    let real = own_clusters(&tenant, "p").await.remove(0);
    let real_name = real.name_any();
    let entry = real
        .spec
        .cluster_pool_ref
        .as_ref()
        .and_then(|r| r.cluster_deployment_customization.clone())
        .expect("built from a customization")
        .name;
    assert_eq!(
        lease(&crate::pools::cdc(&tenant, &entry).await).as_deref(),
        Some(real_name.as_str())
    );
    assert!(real.annotations().contains_key(POOL_UID_ANNOTATION));

    // A bare-metal host of team's assigned to the real cluster (the copy lists it among its hosts).
    let asset: BareMetalAsset = serde_json::from_value(json!({
        "apiVersion": "inventory.stackd.dev/v1alpha1", "kind": "BareMetalAsset",
        "metadata": {"name": "host-1", "namespace": NS},
        "spec": {"bmc": {"address": "ipmi://10.0.0.1/host-1", "credentialsName": "bmc-host-1"},
            "bootMACAddress": "00:1B:44:11:3A:B7", "role": "master", "clusterName": real_name},
    }))
    .expect("asset");
    let assets: Api<BareMetalAsset> = Api::namespaced(tenant.clone(), NS);
    assets
        .create(&PostParams::default(), &asset)
        .await
        .expect("create asset");

    user_namespace(&tenant, "evil").await;
    let mut copy = real.clone();
    copy.metadata = kube::api::ObjectMeta {
        name: real.metadata.name.clone(),
        namespace: Some("evil".into()),
        labels: real.metadata.labels.clone(),
        annotations: real.metadata.annotations.clone(),
        ..Default::default()
    };
    copy.status = None;
    copy.spec.hosts = vec![ClusterHost {
        name: "host-1".into(),
        role: HostRole::Master,
        failure_domain: None,
    }];
    create_cluster(&tenant, &copy).await;
    until("a NotPoolMember warning on the copy", WITHIN, &daemon, || async {
        refused_with(
            &tenant,
            "evil",
            &real_name,
            "ClusterPool team/p",
            "this one is in namespace evil",
        )
        .await
    })
    .await;
    // The copy's inputs are not in namespace evil: it stops there, and is written no more.
    until("the copy stopped on its missing inputs", WITHIN, &daemon, || async {
        cluster(&tenant, "evil", &real_name).await.is_some_and(|cd| {
            cd.status.as_ref().is_some_and(|s| {
                s.conditions
                    .iter()
                    .any(|c| c.type_ == "Provisioned" && c.reason == "MissingInputs")
            })
        })
    })
    .await;
    let version = cluster(&tenant, "evil", &real_name).await.unwrap().resource_version();

    // Grown by one, the pool counts exactly its own two clusters.
    pools(&tenant)
        .patch(
            "p",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"size": 2}})),
        )
        .await
        .expect("scale");
    until("p has two ready clusters of its own", WITHIN, &daemon, || async {
        own_clusters(&tenant, "p")
            .await
            .iter()
            .filter(|cd| installed(cd))
            .count()
            == 2
            && ready(&tenant, "p").await == 2
    })
    .await;
    assert_eq!(unclaimed_and_ready(&pool(&tenant, "p").await), (2, 2));
    let copy_now = cluster(&tenant, "evil", &real_name).await.expect("not deleted");
    assert_eq!(copy_now.resource_version(), version, "untouched by the pool");

    // The user deletes the copy: the real cluster keeps its customization.
    Api::<ClusterDeployment>::namespaced(tenant.clone(), "evil")
        .delete(&real_name, &DeleteParams::default())
        .await
        .expect("delete the copy");
    until("the copy gone", WITHIN, &daemon, || async {
        cluster(&tenant, "evil", &real_name).await.is_none()
    })
    .await;
    let refusal =
        format!("Released no ClusterDeploymentCustomization {entry} or bare-metal hosts of ClusterPool team/p");
    let released_nothing = events(&tenant, "evil", &real_name)
        .await
        .into_iter()
        .any(|(reason, note)| reason == "ReleaseRefused" && note.contains(&refusal));
    assert!(released_nothing, "{:?}", events(&tenant, "evil", &real_name).await);
    assert_eq!(
        lease(&crate::pools::cdc(&tenant, &entry).await).as_deref(),
        Some(real_name.as_str()),
        "still leased by the real cluster"
    );
    let host = assets.get("host-1").await.expect("asset");
    assert_eq!(
        host.spec.cluster_name.as_deref(),
        Some(real_name.as_str()),
        "still assigned"
    );
    let real_now = cluster(&tenant, &real_name, &real_name)
        .await
        .expect("the real cluster");
    assert!(real_now.metadata.deletion_timestamp.is_none());
}

/// Namespaces labelled like the pool's but not created by it (no uid, or an earlier pool's uid)
/// are never reaped, while an empty one the pool created is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_reaps_only_the_empty_namespaces_it_created() {
    let (fleet, tenant) = setup().await;
    let created = create_pool(&tenant, pool_json("p", 0, None)).await;
    let labels = json!({POOL_NAMESPACE_LABEL: NS, POOL_NAME_LABEL: "p"});
    create_namespace(&tenant, json!({"metadata": {"name": "p-lookalike", "labels": labels}})).await;
    create_namespace(
        &tenant,
        json!({"metadata": {"name": "p-earlier", "labels": labels,
            "annotations": {POOL_UID_ANNOTATION: "uid-of-an-earlier-pool-p"}}}),
    )
    .await;
    // As the pool made it for a cluster whose creation then failed.
    create_namespace(
        &tenant,
        json!({"metadata": {"name": "p-empty", "labels": labels,
            "annotations": {POOL_UID_ANNOTATION: created.uid().unwrap()}}}),
    )
    .await;
    let daemon = daemon(&fleet, &[]);
    // p-empty is the youngest: the pass that reaps it found the other two old enough as well.
    until("the pool's empty namespace reaped", WITHIN, &daemon, || async {
        namespace(&tenant, "p-empty")
            .await
            .is_none_or(|ns| ns.metadata.deletion_timestamp.is_some())
    })
    .await;
    for name in ["p-lookalike", "p-earlier"] {
        let ns = namespace(&tenant, name).await.expect("not deleted");
        assert!(ns.metadata.deletion_timestamp.is_none(), "{name} is being deleted");
    }
}
