//! Which Stacks the controller runs (DESIGN.md §8): only those an install created. Anyone allowed to
//! create a Stack could otherwise ask for any permissions and a controller of their choosing; an install
//! runs its package through stackd's checks first. The proof is the install itself: a StackInstall or
//! ClusterStackInstall at the Stack's namespace and name whose uid the Stack's controller owner
//! reference names, plus stackd's label on the Stack. Its kind fixes the scope the Stack may have.

use kube::ResourceExt;
use kube::runtime::reflector::{ObjectRef, Store};

use crate::api::stacks::{ClusterStackInstall, PermissionScope, Stack, StackInstall};
use crate::host::labels::{MANAGED_BY, MANAGED_BY_LABEL};

/// Why a Stack is not run; the message says what to do.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error(
        "Stack {namespace}/{name} was not created by a StackInstall or ClusterStackInstall ({why}); stackd runs only Stacks its installs create: install the package with a StackInstall instead"
    )]
    NotInstalled {
        namespace: String,
        name: String,
        why: &'static str,
    },
    #[error(
        "Stack {namespace}/{name} asks for permissionScope {found}, but it was installed by a {kind}, whose stacks are {allowed}; a {kind} never yields cluster-wide bindings"
    )]
    ScopeMismatch {
        namespace: String,
        name: String,
        found: PermissionScope,
        allowed: PermissionScope,
        kind: &'static str,
    },
}

impl Refusal {
    pub fn reason(&self) -> &'static str {
        match self {
            Refusal::NotInstalled { .. } => "NotInstalled",
            Refusal::ScopeMismatch { .. } => "PermissionScopeMismatch",
        }
    }
}

/// The caches of both install kinds.
#[derive(Clone)]
pub struct Installs {
    pub stack_installs: Store<StackInstall>,
    pub cluster_stack_installs: Store<ClusterStackInstall>,
}

impl Installs {
    /// The scope of the install that created `stack`, or why it counts as made by hand.
    pub fn scope_of(&self, stack: &Stack) -> Result<PermissionScope, Refusal> {
        let scope = self.owner_scope(stack)?;
        if stack.labels().get(MANAGED_BY_LABEL).map(String::as_str) != Some(MANAGED_BY) {
            return Err(Refusal::NotInstalled {
                namespace: stack.namespace().unwrap_or_default(),
                name: stack.name_any(),
                why: "it lacks stackd's label",
            });
        }
        Ok(scope)
    }

    /// True when an install of the Stack's namespace and name controls it (whatever its labels say):
    /// such a Stack's grants are the install's to keep while it puts the Stack right.
    pub fn has_install(&self, stack: &Stack) -> bool {
        self.owner_scope(stack).is_ok()
    }

    /// The scope of the install the Stack's controller owner reference names, if that install exists.
    fn owner_scope(&self, stack: &Stack) -> Result<PermissionScope, Refusal> {
        let namespace = stack.namespace().unwrap_or_default();
        let name = stack.name_any();
        let refuse = |why| Refusal::NotInstalled {
            namespace: namespace.clone(),
            name: name.clone(),
            why,
        };
        let Some(owner) = stack.owner_references().iter().find(|o| o.controller == Some(true)) else {
            return Err(refuse("it has no controller owner reference"));
        };
        if owner.api_version != format!("{}/{}", crate::api::STACKS_GROUP, crate::api::VERSION) || owner.name != name {
            return Err(refuse("its controller is not an install of the same name"));
        }
        let (uid, scope) = match owner.kind.as_str() {
            "StackInstall" => (
                self.stack_installs
                    .get(&ObjectRef::new(&name).within(&namespace))
                    .and_then(|install| install.uid()),
                PermissionScope::Namespaced,
            ),
            "ClusterStackInstall" => (
                self.cluster_stack_installs
                    .get(&ObjectRef::new(&name).within(&namespace))
                    .and_then(|install| install.uid()),
                PermissionScope::Cluster,
            ),
            _ => return Err(refuse("its controller is not an install")),
        };
        if uid.as_deref() != Some(owner.uid.as_str()) {
            return Err(refuse("the install its owner reference names does not exist"));
        }
        Ok(scope)
    }
}

/// Checks that the Stack's scope is the one its install allows.
pub fn check_scope(stack: &Stack, allowed: PermissionScope) -> Result<(), Refusal> {
    let found = stack.spec.permission_scope;
    if found == allowed {
        return Ok(());
    }
    Err(Refusal::ScopeMismatch {
        namespace: stack.namespace().unwrap_or_default(),
        name: stack.name_any(),
        found,
        allowed,
        kind: match allowed {
            PermissionScope::Namespaced => "StackInstall",
            PermissionScope::Cluster => "ClusterStackInstall",
        },
    })
}
