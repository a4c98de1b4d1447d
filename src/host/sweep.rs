//! Orphan sweep decisions: which host objects of a tenant have lost their tenant parent.
//!
//! Deleting is only ever decided from a [`TenantSnapshot`], which can only be built from lists that
//! succeeded, so an unreachable tenant never causes a deletion.

use std::collections::{BTreeMap, BTreeSet};

use super::labels::{
    OUTPUT_UID_ANNOTATION, PARENT_KIND_LABEL, TENANT_KIND_ANNOTATION, TENANT_NAME_ANNOTATION,
    TENANT_NAMESPACE_ANNOTATION, TENANT_UID_ANNOTATION,
};
use super::ownership::belongs_to_tenant;

/// The tenant objects that exist, per kind, from successful lists. A kind that was not listed is
/// absent: its host objects are never judged.
#[derive(Clone, Debug, Default)]
pub struct TenantSnapshot {
    uids: BTreeMap<String, BTreeSet<String>>,
}

impl TenantSnapshot {
    /// Records a successful list of `kind`, by the uids it returned.
    pub fn listed(&mut self, kind: &str, uids: impl IntoIterator<Item = String>) {
        self.uids.entry(kind.to_string()).or_default().extend(uids);
    }

    /// Builds a snapshot from list results; any failed list leaves its kind out.
    pub fn from_lists<E>(lists: impl IntoIterator<Item = (String, Result<Vec<String>, E>)>) -> Self {
        let mut snapshot = TenantSnapshot::default();
        for (kind, result) in lists {
            if let Ok(uids) = result {
                snapshot.listed(&kind, uids);
            }
        }
        snapshot
    }

    fn judges(&self, kind: &str) -> bool {
        self.uids.contains_key(kind)
    }

    fn has(&self, kind: &str, uid: &str) -> bool {
        self.uids.get(kind).is_some_and(|uids| uids.contains(uid))
    }
}

/// A host object as the sweep sees it.
#[derive(Clone, Debug)]
pub struct HostObject {
    /// Kind of the host object itself, e.g. `Job`.
    pub kind: String,
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
}

/// Why a host object is kept.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Keep {
    ParentExists,
    NotThisTenants,
    NoParentLabel,
    KindNotListed,
    IdentityIncomplete,
    Namespace,
}

/// Decides whether one host object is an orphan (`Ok(())`) or must be kept.
pub fn judge(object: &HostObject, tenant: &str, snapshot: &TenantSnapshot) -> Result<(), Keep> {
    if object.kind == "Namespace" {
        return Err(Keep::Namespace);
    }
    if !belongs_to_tenant(&object.labels, tenant) {
        return Err(Keep::NotThisTenants);
    }
    if !object.labels.contains_key(PARENT_KIND_LABEL) {
        return Err(Keep::NoParentLabel);
    }
    let annotation = |key: &str| {
        object
            .annotations
            .get(key)
            .map(String::as_str)
            .filter(|v| !v.is_empty())
    };
    let (Some(kind), Some(_name), Some(uid)) = (
        annotation(TENANT_KIND_ANNOTATION),
        annotation(TENANT_NAME_ANNOTATION),
        annotation(TENANT_UID_ANNOTATION),
    ) else {
        return Err(Keep::IdentityIncomplete);
    };
    if !snapshot.judges(kind) {
        return Err(Keep::KindNotListed);
    }
    if snapshot.has(kind, uid) {
        Err(Keep::ParentExists)
    } else {
        Ok(())
    }
}

/// The suffixes of a cluster's input Secret (which records the output's uid; only stackd writes
/// it) and output Secret (the installer's token writes it) in their host names.
const RECORDER_SUFFIX: &str = "-install-config";
const RECORDED_SUFFIX: &str = "-output";

/// The identity of objects whose annotations a tenant's token may change (an installer's output
/// Secret: stripped of its tenant namespace, the sweep could not ask for its parent and kept it),
/// from the input Secret stackd wrote that records their uid ([`OUTPUT_UID_ANNOTATION`]): `objects`
/// are `(uid, object)`. The recorder must be this tenant's, with a complete identity, and its own
/// cluster's input Secret (their names say so: an installer cannot make its output Secret the
/// recorder of another's); its identity then replaces whatever the object says. The rest stay as
/// they are.
pub fn borrow_identities(objects: &mut [(Option<String>, HostObject)], tenant: &str) {
    let complete = |object: &HostObject| {
        [TENANT_KIND_ANNOTATION, TENANT_NAME_ANNOTATION, TENANT_UID_ANNOTATION]
            .iter()
            .all(|key| object.annotations.get(*key).is_some_and(|v| !v.is_empty()))
    };
    let recorded: BTreeMap<String, (String, BTreeMap<String, String>)> = objects
        .iter()
        .filter(|(_, o)| belongs_to_tenant(&o.labels, tenant) && complete(o))
        .filter_map(|(_, o)| {
            let uid = o.annotations.get(OUTPUT_UID_ANNOTATION)?.clone();
            let recorded_name = format!("{}{RECORDED_SUFFIX}", o.name.strip_suffix(RECORDER_SUFFIX)?);
            let identity = [
                TENANT_KIND_ANNOTATION,
                TENANT_NAMESPACE_ANNOTATION,
                TENANT_NAME_ANNOTATION,
                TENANT_UID_ANNOTATION,
            ]
            .iter()
            .filter_map(|key| Some((key.to_string(), o.annotations.get(*key)?.clone())))
            .collect();
            Some((uid, (recorded_name, identity)))
        })
        .collect();
    for (uid, object) in objects.iter_mut() {
        if let Some((name, identity)) = uid.as_ref().and_then(|uid| recorded.get(uid))
            && *name == object.name
        {
            object.annotations.extend(identity.clone());
        }
    }
}

/// The host objects to delete: this tenant's, with a parent label, whose parent is gone.
pub fn orphans<'a>(objects: &'a [HostObject], tenant: &str, snapshot: &TenantSnapshot) -> Vec<&'a HostObject> {
    objects
        .iter()
        .filter(|object| judge(object, tenant, snapshot).is_ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::Parent;

    fn object_of(parent: &Parent, tenant: &str) -> HostObject {
        HostObject {
            kind: "Job".into(),
            name: "x".into(),
            labels: parent.labels(tenant),
            annotations: parent.annotations(),
        }
    }

    #[test]
    fn object_of_a_vanished_parent_is_an_orphan() {
        let gone = Parent::new("StackInstall", Some("ns"), "gone", "uid-gone");
        let mut snapshot = TenantSnapshot::default();
        snapshot.listed("StackInstall", ["uid-other".to_string()]);
        let objects = [object_of(&gone, "t")];
        assert_eq!(orphans(&objects, "t", &snapshot).len(), 1);
    }

    #[test]
    fn object_of_a_live_parent_is_kept() {
        let live = Parent::new("StackInstall", Some("ns"), "live", "uid-live");
        let mut snapshot = TenantSnapshot::default();
        snapshot.listed("StackInstall", ["uid-live".to_string()]);
        assert_eq!(judge(&object_of(&live, "t"), "t", &snapshot), Err(Keep::ParentExists));
    }

    #[test]
    fn no_deletion_without_a_successful_list() {
        let gone = Parent::new("StackInstall", Some("ns"), "gone", "uid-gone");
        let lists: Vec<(String, Result<Vec<String>, &str>)> = vec![("StackInstall".into(), Err("connection refused"))];
        let snapshot = TenantSnapshot::from_lists(lists);
        assert_eq!(judge(&object_of(&gone, "t"), "t", &snapshot), Err(Keep::KindNotListed));
        assert!(orphans(&[object_of(&gone, "t")], "t", &TenantSnapshot::default()).is_empty());
    }

    #[test]
    fn an_empty_successful_list_orphans_everything_of_that_kind() {
        let gone = Parent::new("Stack", Some("ns"), "s", "u");
        let lists: Vec<(String, Result<Vec<String>, ()>)> = vec![("Stack".into(), Ok(vec![]))];
        assert!(judge(&object_of(&gone, "t"), "t", &TenantSnapshot::from_lists(lists)).is_ok());
    }

    #[test]
    fn recreated_parent_orphans_the_old_incarnation() {
        let old = Parent::new("Stack", Some("ns"), "s", "uid-old");
        let mut snapshot = TenantSnapshot::default();
        snapshot.listed("Stack", ["uid-new".to_string()]);
        assert!(judge(&object_of(&old, "t"), "t", &snapshot).is_ok());
    }

    #[test]
    fn namespaces_other_tenants_and_unlabelled_objects_are_never_swept() {
        let gone = Parent::new("Stack", Some("ns"), "s", "u");
        let mut snapshot = TenantSnapshot::default();
        snapshot.listed("Stack", Vec::<String>::new());
        let mut namespace = object_of(&gone, "t");
        namespace.kind = "Namespace".into();
        assert_eq!(judge(&namespace, "t", &snapshot), Err(Keep::Namespace));
        assert_eq!(
            judge(&object_of(&gone, "other"), "t", &snapshot),
            Err(Keep::NotThisTenants)
        );
        let mut unparented = object_of(&gone, "t");
        unparented.labels.remove(PARENT_KIND_LABEL);
        assert_eq!(judge(&unparented, "t", &snapshot), Err(Keep::NoParentLabel));
        let mut anonymous = object_of(&gone, "t");
        anonymous.annotations.remove(TENANT_UID_ANNOTATION);
        assert_eq!(judge(&anonymous, "t", &snapshot), Err(Keep::IdentityIncomplete));
    }

    #[test]
    fn an_output_stripped_of_its_annotations_is_judged_by_the_identity_its_input_records() {
        let gone = Parent::new("ClusterDeployment", Some("ns"), "c", "uid-cd");
        let mut snapshot = TenantSnapshot::default();
        snapshot.listed("ClusterDeployment", Vec::<String>::new());
        let named = |name: &str| HostObject {
            kind: "Secret".into(),
            name: name.into(),
            ..object_of(&gone, "t")
        };
        let mut input = named("ns.c-install-config");
        input
            .annotations
            .insert(OUTPUT_UID_ANNOTATION.into(), "uid-output".into());
        let mut output = named("ns.c-output");
        output.annotations.clear();
        let mut unproven = named("ns.d-output");
        unproven.annotations.clear();
        let mut forged = named("ns.e-output");
        forged
            .annotations
            .insert(TENANT_NAMESPACE_ANNOTATION.into(), String::new());
        let mut input_e = named("ns.e-install-config");
        input_e.annotations.insert(OUTPUT_UID_ANNOTATION.into(), "uid-e".into());
        let mut objects = vec![
            (Some("uid-input".to_string()), input),
            (Some("uid-output".to_string()), output),
            (Some("uid-other".to_string()), unproven),
            (Some("uid-e".to_string()), forged),
            (None, input_e),
        ];
        borrow_identities(&mut objects, "t");
        let judged: Vec<Result<(), Keep>> = objects.iter().map(|(_, o)| judge(o, "t", &snapshot)).collect();
        assert_eq!(judged, [Ok(()), Ok(()), Err(Keep::IdentityIncomplete), Ok(()), Ok(())]);
        assert_eq!(
            objects[3].1.annotations[TENANT_NAMESPACE_ANNOTATION], "ns",
            "the recorder's namespace"
        );
        // Another tenant's record, or an output Secret posing as a record of another cluster's
        // output, proves nothing.
        let mut foreign = named("ns.x-install-config");
        foreign.labels = gone.labels("other");
        foreign.annotations.insert(OUTPUT_UID_ANNOTATION.into(), "uid-x".into());
        let mut posing = named("ns.y-output");
        posing.annotations.insert(OUTPUT_UID_ANNOTATION.into(), "uid-z".into());
        let mut stripped_x = named("ns.x-output");
        stripped_x.annotations.clear();
        let mut stripped_z = named("ns.z-output");
        stripped_z.annotations.clear();
        let mut objects = vec![
            (None, foreign),
            (None, posing),
            (Some("uid-x".to_string()), stripped_x),
            (Some("uid-z".to_string()), stripped_z),
        ];
        borrow_identities(&mut objects, "t");
        assert_eq!(judge(&objects[2].1, "t", &snapshot), Err(Keep::IdentityIncomplete));
        assert_eq!(judge(&objects[3].1, "t", &snapshot), Err(Keep::IdentityIncomplete));
    }
}

/// Running the sweep against the API servers.
pub mod run {
    use std::collections::BTreeMap;

    use jiff::{SignedDuration, Timestamp};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
    use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, ListParams, Preconditions, PropagationPolicy};
    use kube::{Client, ResourceExt};
    use tracing::{info, warn};

    use super::{HostObject, TenantSnapshot, borrow_identities, orphans};
    use crate::host::labels::{
        PARENT_KIND_LABEL, TENANT_KIND_ANNOTATION, TENANT_NAME_ANNOTATION, TENANT_NAMESPACE_ANNOTATION,
        TENANT_UID_ANNOTATION, tenant_selector,
    };
    use crate::runtime::api_errors::is_gone_or_conflict;
    use crate::runtime::cause::diagnose;

    /// What one sweep deleted, as `Kind/name`.
    #[derive(Debug, Default, PartialEq, Eq)]
    pub struct SweepReport {
        pub deleted: Vec<String>,
        /// Parent kinds that could not be listed on the tenant: nothing of theirs was judged.
        pub unlisted_kinds: Vec<String>,
    }

    /// Lists each parent kind on the tenant (a failed list leaves its kind out of the snapshot, so
    /// none of its host objects can be deleted; an unreachable tenant ends the sweep), then
    /// deletes this tenant's host objects in `host_namespace` whose parent is gone. Never deletes
    /// the namespace itself.
    ///
    /// A parent created between the tenant lists and the host lists (a pool creating a
    /// ClusterDeployment mid-sweep) must not lose its new host objects: objects younger than the
    /// tenant lists are left to the next sweep, and each orphan's parent is asked for again by name
    /// right before the delete.
    pub async fn sweep_once(
        host: &Client,
        tenant: &Client,
        tenant_name: &str,
        host_namespace: &str,
        parent_kinds: &[ApiResource],
        host_kinds: &[ApiResource],
    ) -> Result<SweepReport, kube::Error> {
        let mut report = SweepReport::default();
        let listed_at = Timestamp::now();
        let mut lists = Vec::new();
        for kind in parent_kinds {
            let api: Api<DynamicObject> = Api::all_with(tenant.clone(), kind);
            let result = match api.list_metadata(&ListParams::default()).await {
                // The tenant is unreachable: nothing is judged this time, and the caller tells
                // the outage at the level its probe decides (once, not once per kind).
                Err(err) if diagnose(&err).kind.is_outage() => return Err(err),
                result => result,
            };
            if let Err(err) = &result {
                warn!(tenant = %tenant_name, kind = %kind.kind, error = %err, "sweep: cannot list tenant parents; skipping their host objects");
                report.unlisted_kinds.push(kind.kind.clone());
            }
            let uids = result.map(|list| {
                list.items
                    .into_iter()
                    .filter_map(|o| o.metadata.uid)
                    .collect::<Vec<_>>()
            });
            lists.push((kind.kind.clone(), uids));
        }
        let snapshot = TenantSnapshot::from_lists(lists);
        let selector = format!("{},{PARENT_KIND_LABEL}", tenant_selector(tenant_name));
        for kind in host_kinds {
            let api: Api<DynamicObject> = Api::namespaced_with(host.clone(), host_namespace, kind);
            let listed = api.list_metadata(&ListParams::default().labels(&selector)).await?;
            let objects: BTreeMap<String, ObjectMeta> = listed
                .items
                .into_iter()
                .filter(|o| older_than_the_lists(o.metadata.creation_timestamp.as_ref(), listed_at))
                .map(|o| (o.name_any(), o.metadata))
                .collect();
            let mut candidates: Vec<(Option<String>, HostObject)> = objects
                .iter()
                .map(|(name, meta)| {
                    let object = HostObject {
                        kind: kind.kind.clone(),
                        name: name.clone(),
                        labels: meta.labels.clone().unwrap_or_default(),
                        annotations: meta.annotations.clone().unwrap_or_default(),
                    };
                    (meta.uid.clone(), object)
                })
                .collect();
            // An installer's output Secret stripped of its annotations is judged by the identity
            // its input Secret records for it.
            borrow_identities(&mut candidates, tenant_name);
            let candidates: Vec<HostObject> = candidates.into_iter().map(|(_, object)| object).collect();
            for orphan in orphans(&candidates, tenant_name, &snapshot) {
                if !parent_still_gone(tenant, parent_kinds, orphan).await {
                    continue;
                }
                let params = DeleteParams {
                    propagation_policy: Some(PropagationPolicy::Background),
                    preconditions: Some(Preconditions {
                        uid: objects.get(&orphan.name).and_then(|meta| meta.uid.clone()),
                        resource_version: None,
                    }),
                    ..Default::default()
                };
                match api.delete(&orphan.name, &params).await {
                    Ok(_) => {
                        let parent = |key: &str| orphan.annotations.get(key).map(String::as_str).unwrap_or("");
                        info!(
                            tenant = %tenant_name,
                            kind = %orphan.kind,
                            name = %orphan.name,
                            parent_kind = %parent(TENANT_KIND_ANNOTATION),
                            parent_namespace = %parent(TENANT_NAMESPACE_ANNOTATION),
                            parent_name = %parent(TENANT_NAME_ANNOTATION),
                            parent_uid = %parent(TENANT_UID_ANNOTATION),
                            "sweep: deleted a host object whose tenant parent is gone"
                        );
                        report.deleted.push(format!("{}/{}", orphan.kind, orphan.name));
                    }
                    // Gone or replaced meanwhile: nothing to do.
                    Err(err) if is_gone_or_conflict(&err) => {}
                    Err(err) => return Err(err),
                }
            }
        }
        Ok(report)
    }

    /// Whether a host object was created before the tenant lists began. Creation timestamps have
    /// whole seconds and the host's clock: anything within a second of the lists counts as younger.
    fn older_than_the_lists(created: Option<&Time>, listed_at: Timestamp) -> bool {
        created.is_some_and(|created| {
            created
                .0
                .checked_add(SignedDuration::from_secs(1))
                .is_ok_and(|plus_one| plus_one < listed_at)
        })
    }

    /// Asks the tenant for the orphan's parent by name: true only when the answer is that it is
    /// gone (not found, or found with another uid). Any error keeps the object.
    async fn parent_still_gone(tenant: &Client, parent_kinds: &[ApiResource], orphan: &HostObject) -> bool {
        let annotation = |key: &str| orphan.annotations.get(key).map(String::as_str).unwrap_or("");
        let Some(kind) = parent_kinds
            .iter()
            .find(|k| k.kind == annotation(TENANT_KIND_ANNOTATION))
        else {
            return false;
        };
        let namespace = annotation(TENANT_NAMESPACE_ANNOTATION);
        let api: Api<DynamicObject> = if namespace.is_empty() {
            Api::all_with(tenant.clone(), kind)
        } else {
            Api::namespaced_with(tenant.clone(), namespace, kind)
        };
        match api.get_metadata_opt(annotation(TENANT_NAME_ANNOTATION)).await {
            Ok(None) => true,
            Ok(Some(parent)) => parent.metadata.uid.as_deref() != Some(annotation(TENANT_UID_ANNOTATION)),
            Err(_) => false,
        }
    }
}
