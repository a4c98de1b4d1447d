//! Which ClusterDeployments belong to a ClusterPool (DESIGN.md §8, "References").
//!
//! `spec.clusterPoolRef` proves nothing: anyone who may edit ClusterDeployments in some namespace can
//! point one at any pool and copy a pool cluster's labels and annotations. What a tenant user with
//! `edit` in a namespace can neither do nor undo is create a namespace or change its metadata, and
//! the pool creates one namespace per cluster, named after the cluster, labelled with the pool and
//! annotated with the pool's uid. So a ClusterDeployment belongs to a pool only when its reference
//! names the pool and it is named after a namespace that this pool (this uid, not an earlier pool of
//! the same name) created. Everything else is never counted, handed out, repaired or deleted, and
//! a namespace is reaped only when this pool created it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use k8s_openapi::api::core::v1::Namespace;
use kube::api::ListParams;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Client, ResourceExt};
use tracing::warn;

use super::pass::Refusals;
use super::{POOL_NAME_LABEL, POOL_NAMESPACE_LABEL};
use crate::api::pools::{ClusterDeployment, ClusterPool};
use crate::context::events::publish;
use crate::context::tenant::TenantContext;

/// Annotation on a pool cluster's namespace, set when the pool creates it: the pool's uid. The same
/// annotation on the ClusterDeployment is for people reading it; only the namespace's is trusted.
pub(crate) use crate::api::pools::POOL_UID_ANNOTATION;
/// Event reason on a ClusterDeployment whose reference names a pool that did not create it.
pub(crate) const NOT_POOL_MEMBER: &str = "NotPoolMember";
/// Event reason on such a ClusterDeployment when its deprovision leaves the pool's leases and hosts
/// alone (a reason of its own: Events with one reason on one object are merged into a series).
pub(crate) const RELEASE_REFUSED: &str = "ReleaseRefused";

/// A pool as its clusters' namespaces record it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PoolIdentity {
    pub(crate) namespace: String,
    pub(crate) name: String,
    pub(crate) uid: String,
}

impl PoolIdentity {
    pub(crate) fn of(pool: &ClusterPool) -> PoolIdentity {
        PoolIdentity {
            namespace: pool.namespace().unwrap_or_default(),
            name: pool.name_any(),
            uid: pool.metadata.uid.clone().unwrap_or_default(),
        }
    }

    fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// The labels and annotations a pool creates its clusters' namespaces with.
pub(crate) fn namespace_markers(pool: &PoolIdentity) -> (BTreeMap<String, String>, BTreeMap<String, String>) {
    let labels = BTreeMap::from([
        (POOL_NAMESPACE_LABEL.to_string(), pool.namespace.clone()),
        (POOL_NAME_LABEL.to_string(), pool.name.clone()),
    ]);
    let annotations = BTreeMap::from([(POOL_UID_ANNOTATION.to_string(), pool.uid.clone())]);
    (labels, annotations)
}

/// True when `pool` created `namespace`: its labels name the pool and it carries the pool's uid.
pub(crate) fn created_by(namespace: &Namespace, pool: &PoolIdentity) -> bool {
    labelled_for(namespace, &pool.namespace, &pool.name)
        && !pool.uid.is_empty()
        && namespace.annotations().get(POOL_UID_ANNOTATION) == Some(&pool.uid)
}

fn labelled_for(namespace: &Namespace, pool_namespace: &str, pool_name: &str) -> bool {
    let labels = namespace.labels();
    labels.get(POOL_NAMESPACE_LABEL).map(String::as_str) == Some(pool_namespace)
        && labels.get(POOL_NAME_LABEL).map(String::as_str) == Some(pool_name)
}

/// True when `cd`'s reference names `pool` (a claim only, until [`check`] agrees).
pub(crate) fn names_pool(cd: &ClusterDeployment, pool: &PoolIdentity) -> bool {
    cd.spec
        .cluster_pool_ref
        .as_ref()
        .is_some_and(|r| r.namespace == pool.namespace && r.pool_name == pool.name)
}

/// Why a ClusterDeployment whose reference names a pool does not belong to it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum NotMember {
    /// A pool names each cluster after the namespace it creates for it; this one is named otherwise.
    NamedUnlikeItsNamespace { namespace: String },
    /// Its namespace was not created by the pool.
    ForeignNamespace { namespace: String },
}

impl NotMember {
    /// What the Event on the ClusterDeployment says.
    pub(crate) fn message(&self, pool: &PoolIdentity) -> String {
        let why = match self {
            NotMember::NamedUnlikeItsNamespace { namespace } => format!(
                "a pool creates each cluster in a namespace of the cluster's name, and this one is in namespace {namespace}"
            ),
            NotMember::ForeignNamespace { namespace } => {
                format!("its namespace {namespace} was not created by that pool")
            }
        };
        format!(
            "ClusterPool {} did not create this ClusterDeployment: {why}. The pool does not count, hand out, repair or delete it; remove spec.clusterPoolRef, or get a cluster of the pool with a ClusterClaim in namespace {}",
            pool.key(),
            pool.namespace
        )
    }
}

/// Decides whether `cd`, whose reference names `pool`, belongs to it; `namespace` is `cd`'s
/// namespace (`None` when it is not labelled for any pool, or gone).
pub(crate) fn check(
    cd: &ClusterDeployment,
    namespace: Option<&Namespace>,
    pool: &PoolIdentity,
) -> Result<(), NotMember> {
    let ns = cd.namespace().unwrap_or_default();
    if ns != cd.name_any() {
        return Err(NotMember::NamedUnlikeItsNamespace { namespace: ns });
    }
    match namespace {
        Some(namespace) if namespace.name_any() == ns && created_by(namespace, pool) => Ok(()),
        _ => Err(NotMember::ForeignNamespace { namespace: ns }),
    }
}

/// A pool's clusters as the caches show them, after the membership check.
pub(super) struct Clusters {
    /// Clusters of this pool: counted, handed out, repaired and deleted by it.
    pub(super) members: Vec<Arc<ClusterDeployment>>,
    /// Names of every ClusterDeployment in a namespace this pool created, members or not (a member
    /// whose reference someone edited away): their leases, hosts and namespaces are kept.
    pub(super) live: BTreeSet<String>,
}

/// Sorts the cached ClusterDeployments naming `pool` into members and others, reporting each
/// newly refused one with a warning Event on it.
pub(super) async fn clusters(
    tenant: &TenantContext,
    cds: &Store<ClusterDeployment>,
    namespaces: &Store<Namespace>,
    refusals: &Refusals,
    pool: &PoolIdentity,
) -> Result<Clusters, kube::Error> {
    let all = cds.state();
    let cached_namespace = |cd: &ClusterDeployment| {
        let ns = cd.namespace().unwrap_or_default();
        namespaces.get(&ObjectRef::new(&ns))
    };
    let mut live: BTreeSet<String> = all
        .iter()
        .filter(|cd| cd.namespace().as_deref() == Some(cd.name_any().as_str()))
        .filter(|cd| cached_namespace(cd).is_some_and(|ns| created_by(&ns, pool)))
        .map(|cd| cd.name_any())
        .collect();
    let known: BTreeSet<String> = {
        let all = refusals.lock().unwrap_or_else(|p| p.into_inner());
        all.get(&pool.key()).cloned().unwrap_or_default()
    };
    let mut members = Vec::new();
    let mut refused: BTreeSet<String> = BTreeSet::new();
    for cd in all.into_iter().filter(|cd| names_pool(cd, pool)) {
        let uid = cd.metadata.uid.clone().unwrap_or_default();
        let verdict = match (cached_namespace(&cd), known.contains(&uid)) {
            (Some(namespace), _) => check(&cd, Some(&namespace), pool),
            // Refused and reported before; not looked up again.
            (None, true) => {
                refused.insert(uid);
                continue;
            }
            // Not in the cache: not labelled for a pool, or the namespace watch is behind the
            // ClusterDeployment watch; the server decides.
            (None, false) => check(&cd, uncached_namespace(&tenant.client, &cd).await?.as_ref(), pool),
        };
        match verdict {
            Ok(()) => {
                live.insert(cd.name_any());
                members.push(cd);
            }
            Err(why) => {
                if !known.contains(&uid) {
                    report(tenant, &cd, &why, pool).await;
                }
                refused.insert(uid);
            }
        }
    }
    let mut all = refusals.lock().unwrap_or_else(|p| p.into_inner());
    all.insert(pool.key(), refused);
    Ok(Clusters { members, live })
}

/// Reads `cd`'s namespace from the server, when it is named after it (no other can qualify).
async fn uncached_namespace(client: &Client, cd: &ClusterDeployment) -> Result<Option<Namespace>, kube::Error> {
    let ns = cd.namespace().unwrap_or_default();
    if ns != cd.name_any() {
        return Ok(None);
    }
    // The daemon may list namespaces, not get them.
    let found = Api::<Namespace>::all(client.clone())
        .list(&ListParams::default().fields(&format!("metadata.name={ns}")))
        .await?;
    Ok(found.items.into_iter().find(|n| n.name_any() == ns))
}

async fn report(tenant: &TenantContext, cd: &ClusterDeployment, why: &NotMember, pool: &PoolIdentity) {
    let namespace = cd.namespace().unwrap_or_default();
    warn!(namespace = %namespace, cluster = %cd.name_any(), reason = ?why, "ignoring a ClusterDeployment the pool did not create");
    publish(tenant, cd, true, NOT_POOL_MEMBER, why.message(pool)).await;
}

/// For the ClusterDeployment controller, which has no pool at hand: true when `cd`'s reference
/// names a pool and `cd` is named after a namespace created for a pool of that name (the uid
/// annotation only the daemon sets is there). Deprovisioning releases the pool's leases and hosts
/// only for such a cluster.
pub(crate) async fn created_by_named_pool(client: &Client, cd: &ClusterDeployment) -> Result<bool, kube::Error> {
    let Some(pool_ref) = &cd.spec.cluster_pool_ref else {
        return Ok(false);
    };
    let Some(namespace) = uncached_namespace(client, cd).await? else {
        return Ok(false);
    };
    let has_uid = namespace
        .annotations()
        .get(POOL_UID_ANNOTATION)
        .is_some_and(|uid| !uid.is_empty());
    Ok(has_uid && labelled_for(&namespace, &pool_ref.namespace, &pool_ref.pool_name))
}

/// What the ClusterDeployment controller says when it leaves a pool's leases and hosts alone.
pub(crate) fn release_refused_message(cd: &ClusterDeployment) -> String {
    let (pool, cdc) = cd.spec.cluster_pool_ref.as_ref().map_or_else(Default::default, |r| {
        (
            format!("{}/{}", r.namespace, r.pool_name),
            r.cluster_deployment_customization
                .as_ref()
                .map(|c| format!("ClusterDeploymentCustomization {} or ", c.name))
                .unwrap_or_default(),
        )
    });
    format!(
        "Released no {cdc}bare-metal hosts of ClusterPool {pool}: that pool did not create this ClusterDeployment, so its spec.clusterPoolRef is not trusted"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::pools::{ClusterDeploymentSpec, ClusterPoolReference};
    use kube::api::ObjectMeta;

    fn pool() -> PoolIdentity {
        PoolIdentity {
            namespace: "team-a".into(),
            name: "p".into(),
            uid: "uid-1".into(),
        }
    }

    fn namespace(name: &str, labels: &[(&str, &str)], uid: Option<&str>) -> Namespace {
        Namespace {
            metadata: ObjectMeta {
                name: Some(name.into()),
                labels: Some(labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()),
                annotations: uid.map(|u| BTreeMap::from([(POOL_UID_ANNOTATION.to_string(), u.to_string())])),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn made_by(pool: &PoolIdentity, name: &str) -> Namespace {
        let (labels, annotations) = namespace_markers(pool);
        Namespace {
            metadata: ObjectMeta {
                name: Some(name.into()),
                labels: Some(labels),
                annotations: Some(annotations),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn cd(namespace: &str, name: &str, pool_namespace: &str, pool_name: &str) -> ClusterDeployment {
        let mut cd = ClusterDeployment::new(
            name,
            ClusterDeploymentSpec {
                cluster_pool_ref: Some(ClusterPoolReference {
                    namespace: pool_namespace.into(),
                    pool_name: pool_name.into(),
                    ..Default::default()
                }),
                ..Default::default()
            },
        );
        cd.metadata.namespace = Some(namespace.into());
        cd
    }

    #[test]
    fn a_cluster_named_after_a_namespace_its_pool_created_is_a_member() {
        let pool = pool();
        let cd = cd("p-x7k2p", "p-x7k2p", "team-a", "p");
        assert!(names_pool(&cd, &pool));
        assert_eq!(check(&cd, Some(&made_by(&pool, "p-x7k2p")), &pool), Ok(()));
    }

    #[test]
    fn a_reference_from_another_namespace_is_not_membership() {
        let pool = pool();
        let foreign = cd("evil", "p-x7k2p", "team-a", "p");
        assert!(names_pool(&foreign, &pool));
        assert_eq!(
            check(&foreign, Some(&made_by(&pool, "p-x7k2p")), &pool),
            Err(NotMember::NamedUnlikeItsNamespace {
                namespace: "evil".into()
            })
        );
        let named_like_its_namespace = cd("evil", "evil", "team-a", "p");
        let plain = namespace("evil", &[], None);
        assert_eq!(
            check(&named_like_its_namespace, Some(&plain), &pool),
            Err(NotMember::ForeignNamespace {
                namespace: "evil".into()
            })
        );
        assert_eq!(
            check(&named_like_its_namespace, None, &pool),
            Err(NotMember::ForeignNamespace {
                namespace: "evil".into()
            })
        );
    }

    #[test]
    fn only_the_namespace_markers_of_this_pool_and_uid_count() {
        let pool = pool();
        let labels = [(POOL_NAMESPACE_LABEL, "team-a"), (POOL_NAME_LABEL, "p")];
        assert!(created_by(&made_by(&pool, "n"), &pool));
        assert!(!created_by(&namespace("n", &labels, None), &pool), "no uid");
        assert!(
            !created_by(&namespace("n", &labels, Some("uid-0")), &pool),
            "an earlier pool of the same name"
        );
        let other = PoolIdentity {
            name: "q".into(),
            ..pool.clone()
        };
        assert!(!created_by(&made_by(&other, "n"), &pool), "another pool's");
        let no_uid = PoolIdentity {
            uid: String::new(),
            ..pool.clone()
        };
        assert!(
            !created_by(&namespace("n", &labels, Some("")), &no_uid),
            "an empty uid proves nothing"
        );
    }

    #[test]
    fn an_edited_reference_does_not_move_a_cluster_to_another_pool() {
        let p = pool();
        let q = PoolIdentity {
            name: "q".into(),
            uid: "uid-2".into(),
            ..p.clone()
        };
        let edited = cd("p-x7k2p", "p-x7k2p", "team-a", "q");
        assert!(!names_pool(&edited, &p));
        assert!(names_pool(&edited, &q));
        assert_eq!(
            check(&edited, Some(&made_by(&p, "p-x7k2p")), &q),
            Err(NotMember::ForeignNamespace {
                namespace: "p-x7k2p".into()
            })
        );
    }

    #[test]
    fn the_refusal_names_the_pool_and_what_to_do() {
        let message = NotMember::ForeignNamespace {
            namespace: "evil".into(),
        }
        .message(&pool());
        assert!(message.contains("ClusterPool team-a/p did not create"), "{message}");
        assert!(message.contains("namespace evil"), "{message}");
        assert!(message.contains("ClusterClaim in namespace team-a"), "{message}");
    }
}
