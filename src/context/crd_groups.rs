//! Lists of API group patterns the host's operators set: which groups packages may create CRDs in
//! (`--stack-crd-groups`), an allow-list on top of the groups no package ever gets (stackd's and
//! Kubernetes') — on a shared tenant, a package could otherwise take a well-known group
//! (`cert-manager.io`) before its real operator is installed — and which of the platform's groups
//! stacks may depend on without a stack having installed them (`--platform-dependency-groups`).

use std::fmt;
use std::str::FromStr;

/// Patterns, each `*` (any group), `*.example.org` (example.org's subdomains) or a group itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CrdGroups(Vec<String>);

impl Default for CrdGroups {
    fn default() -> Self {
        CrdGroups(vec!["*".into()])
    }
}

/// `--platform-dependency-groups` when not given: the claim groups Crossplane's types chart puts
/// into every tenant (v0.x), which every Crossplane provider package names in `dependsOn`, and the
/// OAM core group of its application add-on. `core.crossplane.io` has no CRD in v0.8, yet packages
/// depend on it.
pub const PLATFORM_TYPE_GROUPS: &str = "cache.crossplane.io,compute.crossplane.io,core.crossplane.io,\
     database.crossplane.io,kubernetes.crossplane.io,network.crossplane.io,storage.crossplane.io,\
     workload.crossplane.io,core.oam.dev";

impl CrdGroups {
    /// [`PLATFORM_TYPE_GROUPS`].
    pub fn platform_types() -> CrdGroups {
        PLATFORM_TYPE_GROUPS.parse().unwrap_or_else(|_| CrdGroups(Vec::new()))
    }

    pub fn allows(&self, group: &str) -> bool {
        self.0.iter().any(|pattern| match pattern.strip_prefix("*.") {
            Some(domain) => group.ends_with(&format!(".{domain}")),
            None => pattern == "*" || pattern == group,
        })
    }
}

impl FromStr for CrdGroups {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut patterns = Vec::new();
        for pattern in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let name = pattern.strip_prefix("*.").unwrap_or(pattern);
            let valid = pattern == "*"
                || (!name.is_empty()
                    && name
                        .split('.')
                        .all(|part| !part.is_empty() && part.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')));
            if !valid {
                return Err(format!(
                    "{pattern:?} is not an API group, *.DOMAIN or *: e.g. *.example.org,widgets.acme.io"
                ));
            }
            patterns.push(pattern.to_ascii_lowercase());
        }
        Ok(CrdGroups(patterns))
    }
}

impl fmt::Display for CrdGroups {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_allow_a_group_a_domains_subdomains_or_any() {
        let groups: CrdGroups = "*.example.org, widgets.acme.io".parse().unwrap();
        assert!(groups.allows("samples.example.org"));
        assert!(
            !groups.allows("example.org"),
            "the domain itself is not one of its subdomains"
        );
        assert!(!groups.allows("evil-example.org"));
        assert!(groups.allows("widgets.acme.io"));
        assert!(!groups.allows("cert-manager.io"));
        assert!(CrdGroups::default().allows("cert-manager.io"));
    }

    #[test]
    fn an_empty_list_allows_no_group() {
        let none: CrdGroups = "".parse().unwrap();
        assert!(!none.allows("database.crossplane.io"));
    }

    #[test]
    fn the_platform_types_are_the_crossplane_claim_groups() {
        let platform = CrdGroups::platform_types();
        for group in [
            "database.crossplane.io",
            "compute.crossplane.io",
            "core.crossplane.io",
            "core.oam.dev",
        ] {
            assert!(platform.allows(group), "{group}");
        }
        assert!(
            !platform.allows("aws.crossplane.io"),
            "a provider's own group is installed by its stack"
        );
        assert_eq!(platform.to_string().parse::<CrdGroups>().unwrap(), platform);
    }

    #[test]
    fn malformed_patterns_are_refused() {
        for bad in ["*.", "example..org", "ex ample.org", "**.org", "a/b"] {
            assert!(bad.parse::<CrdGroups>().is_err(), "{bad:?}");
        }
    }
}
