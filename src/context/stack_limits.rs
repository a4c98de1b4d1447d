//! How much one namespace's stack installs may cost the tenant and the daemon
//! (`--max-package-crds`, `--namespace-max-installs`; DESIGN.md §8 "Blast radius").

/// The most CRDs a package may hold by default. The largest Crossplane providers shipped as one
/// package: Upbound's monolithic provider-aws v0.30 held 872 CRDs, provider-azure 692, provider-gcp
/// 325; every other provider about 30 or fewer. A tenant API server spends about 3 MB per CRD, so a
/// bound still admits the biggest real package while a package of tens of thousands (an 8 MiB
/// stream of tiny CRDs) is refused before it is parsed.
pub const DEFAULT_MAX_PACKAGE_CRDS: usize = 1000;

/// The most StackInstalls and ClusterStackInstalls one namespace may have by default. Each running
/// install costs the tenant's host namespace a controller pod, its token copy and up to two pull-secret
/// copies per pull secret (and, while it installs, a Job): with the default quota (`pods=50`,
/// `count/jobs.batch=50`, `secrets=200`) ten installs take a fifth of the pods and Jobs and under half
/// of the Secrets even at the pull-secret bound, so one namespace cannot exhaust what the tenant's
/// other namespaces share.
pub const DEFAULT_NAMESPACE_MAX_INSTALLS: usize = 10;

/// The bounds on stack installs the daemon was given.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StackLimits {
    /// `--max-package-crds`: a package with more CRDs is refused.
    pub max_package_crds: usize,
    /// `--namespace-max-installs`: the newest installs of a namespace past this many are refused
    /// (0: no bound).
    pub namespace_max_installs: usize,
}

impl Default for StackLimits {
    fn default() -> Self {
        StackLimits {
            max_package_crds: DEFAULT_MAX_PACKAGE_CRDS,
            namespace_max_installs: DEFAULT_NAMESPACE_MAX_INSTALLS,
        }
    }
}
