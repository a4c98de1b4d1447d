//! The `stackd` command line: wiring only; the work happens in the library.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use stackd::api::stacks::PermissionScope;
use stackd::bounds::{
    DEFAULT_INSTALLER_OUTPUT_BYTES, DEFAULT_INSTALLER_OUTPUT_KEYS, DEFAULT_RENDER_BYTES, DEFAULT_RENDER_SECRET_BYTES,
    DEFAULT_RENDER_SHARE_BURST, DEFAULT_RENDER_SHARE_PER_SECOND, DocumentLimits,
};
use stackd::context::crd_groups::{CrdGroups, PLATFORM_TYPE_GROUPS};
use stackd::context::namespace_template::NamespaceTemplate;
use stackd::context::pod_policy::{AllowedToleration, NodeLabel, PodPolicy};
use stackd::context::registries::AllowedRegistries;
use stackd::context::stack_limits::{DEFAULT_MAX_PACKAGE_CRDS, DEFAULT_NAMESPACE_MAX_INSTALLS, StackLimits};
use stackd::host::namespace::ServiceAccountRef;
use stackd::host::quota::{
    ContainerDefaults, DEFAULT_CONTAINER_DEFAULTS, DEFAULT_QUOTA, NamespaceShare, ResourceList, TenantQuota,
};
use stackd::runtime::memory_budget::{
    ByteSize, DEFAULT_MAX_OBJECT_BYTES, DEFAULT_NAMESPACE_MAX_OBJECTS, DEFAULT_TENANT_BUDGET, default_namespace_share,
};
use stackd::runtime::parse_error::kubeconfig_error_message;
use tokio_util::sync::CancellationToken;

/// stackd serves stacks (packaged controllers) and on-prem cluster pools to many tenant Kubernetes
/// API servers from one host cluster.
#[derive(Parser, Debug)]
#[command(name = "stackd", version, about, long_about = None, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the daemon: one host client, one client per tenant kubeconfig.
    Run(Box<RunArgs>),
    /// Start embedded host and tenant API servers on loopback, with the daemon and samples.
    Dev(DevArgs),
    /// Turn a stack package's `.registry` directory into the YAML stream the daemon applies (the
    /// install Job's main container).
    Unpack(UnpackArgs),
    /// Copy a directory tree within the bounds on a package, never following a link (an install
    /// pod's package container runs it, from the binary `copy-self` copied).
    #[command(hide = true)]
    Copy { src: PathBuf, dest: PathBuf },
    /// Copy this binary to DEST, for the containers of images without it (an install pod's first
    /// init container).
    #[command(hide = true)]
    CopySelf { dest: PathBuf },
    /// Author stack packages: write a new one, check it as the daemon would, build its image, push it.
    #[command(subcommand)]
    Package(PackageCommand),
    /// Print the CustomResourceDefinitions generated from the Rust types (the tenants'; `--host`: the
    /// host's).
    Crds(CrdsArgs),
    /// Manage tenants on the host cluster.
    #[command(subcommand)]
    Tenant(TenantCommand),
    /// Measure scale, speed and fault tolerance against embedded API servers.
    Bench(BenchArgs),
    /// Show the Tenant objects on the host (ready, why not, which replica serves each) and, with
    /// `run --shards`, which replica serves which tenants.
    Status(StatusArgs),
    /// Print the version.
    Version,
}

#[derive(Args, Debug)]
struct HostArgs {
    /// Kubeconfig of the host cluster. Without it: in-cluster config, then $KUBECONFIG.
    #[arg(long, value_name = "FILE")]
    host_kubeconfig: Option<PathBuf>,
    /// Name of each tenant's namespace on the host; `{tenant}` is replaced by the tenant name.
    #[arg(long, default_value = "tenant-{tenant}-controllers", value_name = "TEMPLATE")]
    tenant_namespace_template: String,
}

#[derive(Args, Debug)]
struct RunArgs {
    #[command(flatten)]
    host: HostArgs,
    /// Directory of tenant kubeconfigs, one `<tenant>.yaml|.yml|.kubeconfig` file per tenant;
    /// watched for changes.
    #[arg(long, default_value = "kubeconfigs/tenants", value_name = "DIR")]
    tenants_dir: PathBuf,
    /// Namespaces whose Secrets Tenant objects on the host may name (comma-separated): the daemon
    /// reads Secrets there and nowhere else; a Tenant naming a Secret elsewhere is refused.
    #[arg(
        long,
        default_value = "stackd-system",
        value_name = "NAMESPACE,...",
        value_delimiter = ',',
        value_parser = namespace_name
    )]
    tenant_secret_namespaces: Vec<String>,
    /// Image of the install Job's `unpack` container; defaults to the daemon's own image.
    #[arg(long, value_name = "IMAGE")]
    stackd_image: Option<String>,
    /// Let host pods reach a tenant over plain http (only for local development).
    #[arg(long)]
    allow_insecure_tenant_endpoint: bool,
    /// Let stacks request any permissions: API groups beyond their own, core resources, non-resource
    /// URLs and verbs such as `*`, `escalate`, `bind` and `impersonate`.
    #[arg(long)]
    insecure_allow_all_apigroups: bool,
    /// Pass a stack's controller Deployment spec through without the pod-safety checks.
    #[arg(long)]
    insecure_pass_full_deployment: bool,
    /// A node label stack pods may select (`nodeSelector`); repeat for more. Without it, none.
    #[arg(long, value_name = "KEY=VALUE")]
    stack_node_selector: Vec<NodeLabel>,
    /// A taint stack pods may tolerate: `Equal` with a value, `Exists` without, every effect when
    /// none is named; repeat for more. Without it, none.
    #[arg(long, value_name = "KEY[=VALUE][:EFFECT]")]
    stack_toleration: Vec<AllowedToleration>,
    /// The ResourceQuota of every tenant's host namespace (`spec.hard`).
    #[arg(long, default_value = DEFAULT_QUOTA, value_name = "NAME=QUANTITY,...")]
    tenant_quota: ResourceList,
    /// Default requests and limits of containers in every tenant's host namespace (a LimitRange), so
    /// pods that set none fit the quota.
    #[arg(long, default_value = DEFAULT_CONTAINER_DEFAULTS, value_name = "requests.NAME=QUANTITY,limits.NAME=QUANTITY,...")]
    tenant_container_defaults: ContainerDefaults,
    /// The CPU the host workloads stackd runs for one tenant namespace (stack controllers, install
    /// and pool installer Jobs) may request together (default: half of --tenant-quota's
    /// requests.cpu). A workload that would take its namespace past it is not created: its object
    /// gets the reason NamespaceQuotaShareExceeded, and the tenant's other namespaces keep their
    /// part of the quota.
    #[arg(long, value_name = "QUANTITY", value_parser = stackd::host::quota::share_quantity)]
    namespace_max_cpu: Option<String>,
    /// The memory the host workloads of one tenant namespace may request together (default: half
    /// of --tenant-quota's requests.memory), as --namespace-max-cpu.
    #[arg(long, value_name = "QUANTITY", value_parser = stackd::host::quota::share_quantity)]
    namespace_max_memory: Option<String>,
    /// API groups packages may create CRDs in: comma-separated groups and `*.DOMAIN` patterns, or
    /// `*` for any group but stackd's and Kubernetes' own. On a shared tenant, name your packages'
    /// domains, so that no package takes a well-known group before its operator is installed.
    #[arg(long, default_value = "*", value_name = "GROUP,*.DOMAIN,...")]
    stack_crd_groups: CrdGroups,
    /// API groups a stack's `dependsOn` may name although no stack installed their CRDs: the
    /// platform's own types, such as the claim kinds of Crossplane's types chart, which every
    /// Crossplane provider package depends on. Comma-separated groups and `*.DOMAIN` patterns. Only
    /// the groups a stack names get into its RBAC; tenant users cannot change this list.
    #[arg(long, default_value = PLATFORM_TYPE_GROUPS, value_name = "GROUP,*.DOMAIN,...")]
    platform_dependency_groups: CrdGroups,
    /// Let packages ship CRDs with conversion webhooks (`spec.conversion.strategy: Webhook`), which
    /// rewrite every object of the CRD the tenant API server serves.
    #[arg(long)]
    insecure_allow_conversion_webhooks: bool,
    /// The most CRDs one stack package may hold; a package with more is refused before it is
    /// parsed. The default admits the largest real packages (the monolithic Crossplane provider-aws
    /// held 872).
    #[arg(long, default_value_t = DEFAULT_MAX_PACKAGE_CRDS, value_name = "N", value_parser = at_least_one)]
    max_package_crds: usize,
    /// The most StackInstalls and ClusterStackInstalls one tenant namespace may have (0: no bound);
    /// the newest past it are refused and create nothing on the host, so one namespace cannot fill
    /// the quota the tenant's namespaces share.
    #[arg(long, default_value_t = DEFAULT_NAMESPACE_MAX_INSTALLS, value_name = "N")]
    namespace_max_installs: usize,
    /// Registries stack packages, stack controller images and pool installer images may come from:
    /// comma-separated registry hosts (`quay.io`, `registry.example.com:5000`) or host/path prefixes
    /// (`quay.io/acme`). Without it, any registry.
    #[arg(long, default_value = "", value_name = "HOST[/PATH],...")]
    allowed_registries: AllowedRegistries,
    /// Address of /metrics, and of /healthz and /readyz unless --health-addr is given (loopback
    /// unless told otherwise; the `/readyz?verbose` tenant detail is answered to loopback clients
    /// only, on any address).
    #[arg(long, default_value = "127.0.0.1:8080", value_name = "ADDR")]
    metrics_addr: SocketAddr,
    /// Serve /healthz and /readyz on this address instead, leaving --metrics-addr with /metrics
    /// alone (so a Service in front of it exposes nothing else).
    #[arg(long, value_name = "ADDR")]
    health_addr: Option<SocketAddr>,
    /// Run controllers only while holding a coordination.k8s.io Lease on the host.
    #[arg(long)]
    leader_elect: bool,
    /// Namespace of the leader-election Lease.
    #[arg(long, default_value = "stackd-system", value_name = "NAMESPACE")]
    leader_elect_namespace: String,
    /// Seconds the leader lease stays valid without renewal; a standby takes over after that.
    #[arg(long, default_value_t = 15, value_name = "SECONDS")]
    leader_elect_lease_duration: u64,
    /// Share the tenants among the replicas that run with it: each serves an equal share (to
    /// within one tenant), given by the shard map every replica reads and the live one with the
    /// least identity writes; no tenant is ever served by two.
    #[arg(long, conflicts_with = "leader_elect")]
    shards: bool,
    /// Namespace of the replicas' member Leases (`stackd-member-<identity>`) and the shard map
    /// (the ConfigMap `stackd-shard-map`).
    #[arg(long, default_value = "stackd-system", value_name = "NAMESPACE")]
    shard_namespace: String,
    /// Seconds a member Lease stays valid without renewal: a killed replica's tenants are served
    /// elsewhere about this long after it died.
    #[arg(long, default_value_t = 15, value_name = "SECONDS", value_parser = clap::value_parser!(u64).range(3..=3600))]
    shard_lease_duration: u64,
    /// The daemon's ServiceAccount on the host, bound to the stackd-tenant-namespace ClusterRole in
    /// every tenant namespace.
    #[arg(
        long,
        env = "STACKD_SERVICE_ACCOUNT",
        default_value = "stackd-system/stackd",
        value_name = "NAMESPACE/NAME"
    )]
    service_account: ServiceAccountRef,
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// Reconciles running at once per tenant.
    #[arg(long, default_value_t = 4, value_name = "N")]
    max_concurrent_reconciles: u16,
    /// Age after which a lease on a ClusterDeploymentCustomization or BareMetalAsset whose
    /// ClusterDeployment never appeared is released.
    #[arg(long, default_value = "5m", value_parser = humantime::parse_duration, value_name = "DURATION")]
    lease_min_age: Duration,
    /// How long one request to a cluster stackd provisioned (asset delivery) may take. Such a
    /// cluster's address comes from a tenant-writable kubeconfig: a server that stalls must not
    /// hold the tenant's reconciles.
    #[arg(long, default_value = "15s", value_parser = humantime::parse_duration, value_name = "DURATION")]
    managed_cluster_timeout: Duration,
    /// `activeDeadlineSeconds` of the installer Jobs (install and destroy): a Job still running
    /// after this long fails with reason DeadlineExceeded, and counts as a failed install attempt.
    /// openshift-install itself gives up within about two hours (up to 20 minutes for the API,
    /// 30 to 60 for bootstrap, 40 for the cluster to initialize, plus creating the infrastructure).
    #[arg(long, default_value = "3h", value_parser = humantime::parse_duration, value_name = "DURATION")]
    installer_deadline: Duration,
    /// How long an install Job's pod may fail to pull its package image (`ErrImagePull`,
    /// `ImagePullBackOff`) before the install fails with reason PackagePullFailed and its Job is
    /// made again with backoff: a registry that was briefly away is waited out, a wrong image is not.
    #[arg(long, default_value = "3m", value_parser = humantime::parse_duration, value_name = "DURATION")]
    pull_failure_grace: Duration,
    /// ClusterPools served per tenant namespace, the oldest first; the newer ones get
    /// `CapacityAvailable=False` (reason TooManyPools) and create nothing. 0 means no limit. A
    /// team's pools are a handful (one per platform or version); the limit keeps one namespace from
    /// taking the tenant's controllers, quota and API calls from the others.
    #[arg(long, default_value_t = 50, value_name = "N")]
    namespace_max_pools: usize,
    /// Clusters the pools of one tenant namespace may have at once, claimed or not: each has a
    /// namespace, objects and host work of its own. A pool past it makes no more
    /// (`CapacityAvailable=False`, reason NamespaceMaxClusters). 0 means no limit.
    #[arg(long, default_value_t = 100, value_name = "N")]
    namespace_max_clusters: usize,
    /// Lookups of the credentials Secrets a tenant namespace's BareMetalAssets wait on (missing,
    /// unusable or delivered), per recheck interval (`--backoff-base` × 10, at most 30 s): once per
    /// Secret however many assets name it, the least lately looked at first. Bounds the requests a
    /// namespace's assets cost its tenant's API server, whatever their number.
    #[arg(long, default_value_t = 10, value_name = "N", value_parser = clap::value_parser!(u16).range(1..))]
    namespace_secret_lookups: u16,
    /// Interval of the orphan sweep over host objects, and of the check that puts back each tenant's
    /// host ResourceQuota and LimitRange (which are not watched): each tenant's fall at its own
    /// point of the interval, so tenants started together do not sweep together.
    #[arg(long, default_value = "10m", value_parser = humantime::parse_duration, value_name = "DURATION")]
    sweep_interval: Duration,
    /// First retry delay after a failed reconcile; doubles per failure.
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration, value_name = "DURATION")]
    backoff_base: Duration,
    /// Quiet time after a change in the tenants directory before it is read.
    #[arg(long, default_value = "500ms", value_parser = humantime::parse_duration, value_name = "DURATION")]
    debounce: Duration,
    /// Full rescan of the tenants directory, a backstop for missed file events.
    #[arg(long, default_value = "1m", value_parser = humantime::parse_duration, value_name = "DURATION")]
    rescan_interval: Duration,
    /// How long a stopping tenant (kubeconfig changed or removed, SIGTERM) may take to finish its
    /// in-flight reconciles before they are aborted.
    #[arg(long, default_value = "20s", value_parser = humantime::parse_duration, value_name = "DURATION")]
    tenant_stop_grace: Duration,
    /// Tenant and host objects larger than this as JSON are not read: each gets a Warning Event
    /// `ObjectTooLarge`, and stackd holds off the work in its namespace that reads its kind until it
    /// is smaller (an API server stores up to ~1.5 MiB; decoded, arrays of small numbers cost 20
    /// times their JSON).
    #[arg(long, default_value = DEFAULT_MAX_OBJECT_BYTES, value_name = "SIZE")]
    max_cached_object_bytes: ByteSize,
    /// The estimated memory one tenant's cached objects may take. An object of a tenant namespace
    /// that would take the tenant past it is left out like one over --namespace-memory-budget; a
    /// tenant taken over it by what no namespace owns (cluster-scoped objects) is suspended (its
    /// controllers and watches stop, shown on /readyz?verbose and `stackd_tenant_suspended`) and
    /// retried with backoff. Size it so that tenants × budget fits the daemon's memory limit.
    #[arg(long, default_value = DEFAULT_TENANT_BUDGET, value_name = "SIZE")]
    tenant_memory_budget: ByteSize,
    /// The most data of one tenant Secret stackd reads to render a document (an install-config
    /// template, a pull secret, platform or BMC credentials); a larger one gets its pool a
    /// `DocumentTooLarge` condition and Event naming the Secret, and nothing is built from it.
    #[arg(long, default_value = DEFAULT_RENDER_SECRET_BYTES, value_name = "SIZE")]
    max_render_secret_bytes: ByteSize,
    /// The most Secret data one render reads and inlines in total (every host's BMC credentials of a
    /// cluster, say), added up before anything is built; past it, as for one Secret.
    #[arg(long, default_value = DEFAULT_RENDER_BYTES, value_name = "SIZE")]
    max_render_bytes: ByteSize,
    /// The render work one tenant namespace may cause a second on average: the pool's Secret bytes
    /// read and the install config measured after each ClusterDeploymentCustomization patch (its bytes and
    /// 32 per value).
    /// Past its share a namespace's pools wait (`CapacityAvailable=False`, NamespacePatchShareUsed);
    /// other namespaces are not held.
    #[arg(long, default_value = DEFAULT_RENDER_SHARE_PER_SECOND, value_name = "SIZE")]
    namespace_render_bytes_per_second: ByteSize,
    /// The render work one tenant namespace may cause at once, before its share is paced.
    #[arg(long, default_value = DEFAULT_RENDER_SHARE_BURST, value_name = "SIZE")]
    namespace_render_burst_bytes: ByteSize,
    /// The most data stackd reads from an installer's output Secret, measured before it is read; a
    /// larger one fails its own ClusterDeployment only (`InstallerOutputRefused`).
    #[arg(long, default_value = DEFAULT_INSTALLER_OUTPUT_BYTES, value_name = "SIZE")]
    max_installer_output_bytes: ByteSize,
    /// The most keys an installer's output Secret may hold (it writes `kubeconfig` and
    /// `metadata.json`).
    #[arg(long, default_value_t = DEFAULT_INSTALLER_OUTPUT_KEYS, value_name = "N", value_parser = at_least_one)]
    max_installer_output_keys: usize,
    /// The estimated memory the cached objects of one tenant namespace may take (default: a quarter
    /// of --tenant-memory-budget). An object that would take its namespace past it is not read: it
    /// gets a Warning Event `NamespaceOverBudget`, and stackd holds off that namespace's work that
    /// reads its kind until the namespace's objects shrink; the tenant's other namespaces are served.
    #[arg(long, value_name = "SIZE")]
    namespace_memory_budget: Option<ByteSize>,
    /// The objects of the kinds stackd reads that it caches per tenant namespace (each kind
    /// counted together); one more is left out and held off like one over
    /// --namespace-memory-budget (`NamespaceOverBudget`, naming this flag).
    #[arg(long, default_value_t = DEFAULT_NAMESPACE_MAX_OBJECTS, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    namespace_max_objects: u64,
    /// The host namespace whose pods (e.g. Prometheus) may reach the pods of tenant host namespaces.
    /// Without it, each tenant host namespace admits traffic from its own pods only (a
    /// NetworkPolicy `stackd-tenant-isolation`).
    #[arg(long, value_name = "NAMESPACE", value_parser = namespace_name)]
    monitoring_namespace: Option<String>,
}

/// A namespace name: a DNS-1123 label.
fn namespace_name(text: &str) -> Result<String, String> {
    let text = text.trim();
    if stackd::context::namespace_template::is_dns_label(text) {
        Ok(text.to_string())
    } else {
        Err(format!("{text:?} is not a namespace name (a DNS-1123 label)"))
    }
}

/// A size as the bounds count it, saturated on a 32-bit target.
fn bytes(size: ByteSize) -> usize {
    usize::try_from(size.0).unwrap_or(usize::MAX)
}

/// A count that must be at least 1.
fn at_least_one(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(err) => Err(err.to_string()),
    }
}

#[derive(Args, Debug)]
struct DevArgs {
    /// Number of tenant API servers.
    #[arg(long, default_value_t = 2, value_name = "N")]
    tenants: u16,
    /// Serve the API servers only; run no daemon.
    #[arg(long)]
    no_daemon: bool,
    /// Where to write `host.yaml` and `tenants/<name>.yaml`.
    #[arg(long, default_value = "kubeconfigs", value_name = "DIR")]
    kubeconfig_dir: PathBuf,
    /// Where the daemon's log goes (the terminal shows progress lines only); by default
    /// `stackd.log` in the kubeconfig directory.
    #[arg(long, value_name = "FILE", conflicts_with = "verbose")]
    log_file: Option<PathBuf>,
    /// Show the daemon's log in the terminal, between the progress lines, instead of in a file.
    #[arg(long)]
    verbose: bool,
}

#[derive(Args, Debug)]
struct UnpackArgs {
    /// The package's `.registry` directory.
    #[arg(long, value_name = "DIR")]
    content_dir: PathBuf,
    /// The permission scope the install allows; a package declaring another scope is refused.
    #[arg(long, value_name = "SCOPE")]
    permission_scope: PermissionScope,
    /// The package image: the version when app.yaml has none, and the image of controller containers
    /// that name none.
    #[arg(long, env = "STACK_IMAGE", value_name = "IMAGE")]
    package_image: Option<String>,
    /// The controller of templating stacks (behavior.yaml) whose behavior names none.
    #[arg(long, default_value = stackd::stacks::unpack::DEFAULT_TEMPLATING_CONTROLLER_IMAGE, value_name = "IMAGE")]
    templating_controller_image: String,
    /// stackd's image (the install Job's own), whose binary a templating stack's pod copies its
    /// behaviors with; `stackd:<version>` when not given.
    #[arg(long, value_name = "IMAGE")]
    stackd_image: Option<String>,
}

#[derive(Subcommand, Debug)]
enum PackageCommand {
    /// Write a new package into DIR (created, or empty): app.yaml, one CRD, the controller
    /// (install.yaml, or behavior.yaml with --templating) and a README.
    Init {
        /// The package directory; its name names the package.
        dir: PathBuf,
        /// The install kind that installs it: Namespaced (StackInstall) or Cluster (ClusterStackInstall).
        #[arg(long, default_value = "Namespaced", value_name = "SCOPE")]
        scope: PermissionScope,
        /// A templating stack: behavior.yaml and a kustomization, no controller of its own.
        #[arg(long)]
        templating: bool,
    },
    /// Judge the package in DIR as the daemon would judge an install of it, every problem at once;
    /// exit 1 when there is any.
    Check {
        #[command(flatten)]
        check: PackageCheckArgs,
        /// How to print the verdict.
        #[arg(long, value_enum, default_value = "text", value_name = "FORMAT")]
        output: CheckOutput,
    },
    /// Check the package in DIR, then write its image (FROM scratch, /.registry) as an OCI archive;
    /// the same package gives the same digest.
    Build {
        #[command(flatten)]
        check: PackageCheckArgs,
        /// The image name the archive carries.
        #[arg(short = 't', long = "tag", value_name = "IMAGE")]
        tag: String,
        /// The archive to write (default: <DIR's name>.oci.tar).
        #[arg(short = 'o', long = "output", value_name = "FILE")]
        archive: Option<PathBuf>,
    },
    /// Push an archive `build` wrote to an OCI registry as IMAGE (the same digest), with the
    /// credentials of a docker config file.
    Push {
        /// The archive.
        file: PathBuf,
        /// Where to push it: registry/repository:tag.
        image: String,
        /// The docker config file holding the registry's credentials (default:
        /// $DOCKER_CONFIG/config.json, else ~/.docker/config.json; none: anonymous).
        #[arg(long, value_name = "PATH")]
        registry_config: Option<PathBuf>,
        /// Speak plain HTTP to the registry (only one on loopback).
        #[arg(long)]
        plain_http: bool,
    },
}

#[derive(Args, Debug)]
struct PackageCheckArgs {
    /// The package directory (holding .registry) or its .registry directory.
    dir: PathBuf,
    /// The install kind's scope; the one app.yaml declares when not given.
    #[arg(long, value_name = "SCOPE")]
    scope: Option<PermissionScope>,
    /// The package image the install will name (checked against --registries, run by containers
    /// that name no image).
    #[arg(long, value_name = "IMAGE")]
    image: Option<String>,
    /// The host's --allowed-registries. Without it, any registry.
    #[arg(long, default_value = "", value_name = "HOST[/PATH],...", requires = "image")]
    registries: AllowedRegistries,
    /// The host's --platform-dependency-groups: the platform types dependsOn may name.
    #[arg(long, default_value = PLATFORM_TYPE_GROUPS, value_name = "GROUP,*.DOMAIN,...")]
    types: CrdGroups,
    /// The host's --stack-crd-groups.
    #[arg(long, default_value = "*", value_name = "GROUP,*.DOMAIN,...")]
    stack_crd_groups: CrdGroups,
    /// An API group whose CRDs another stack installed on the tenant (dependsOn may name it); repeat.
    #[arg(long, value_name = "GROUP")]
    installed_group: Vec<String>,
    /// The host's --max-package-crds.
    #[arg(long, default_value_t = DEFAULT_MAX_PACKAGE_CRDS, value_name = "N")]
    max_package_crds: usize,
    /// The host's --stack-node-selector; repeat.
    #[arg(long, value_name = "KEY=VALUE")]
    stack_node_selector: Vec<NodeLabel>,
    /// The host's --stack-toleration; repeat.
    #[arg(long, value_name = "KEY[=VALUE][:EFFECT]")]
    stack_toleration: Vec<AllowedToleration>,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum CheckOutput {
    Text,
    Json,
}

impl PackageCheckArgs {
    fn options(&self) -> stackd::package::check::CheckOptions {
        let mut options = stackd::package::check::CheckOptions::new(&self.dir);
        options.scope = self.scope;
        options.image = self.image.clone();
        options.registries = self.registries.clone();
        options.types = self.types.clone();
        options.crd_groups = self.stack_crd_groups.clone();
        options.installed_groups = self.installed_group.clone();
        options.max_crds = self.max_package_crds;
        options.pod_policy = PodPolicy {
            node_selector: self
                .stack_node_selector
                .iter()
                .map(|label| (label.key.clone(), label.value.clone()))
                .collect(),
            tolerations: self.stack_toleration.clone(),
        };
        options
    }
}

#[derive(Args, Debug)]
struct StatusArgs {
    /// Kubeconfig of the host cluster. Without it: in-cluster config, then $KUBECONFIG.
    #[arg(long, value_name = "FILE")]
    host_kubeconfig: Option<PathBuf>,
    /// Namespace of the member Leases and the shard map (`run --shard-namespace`).
    #[arg(long, default_value = "stackd-system", value_name = "NAMESPACE")]
    namespace: String,
    /// The tenants directory (`run --tenants-dir`), to list the tenants no replica serves besides
    /// the Tenant objects'.
    #[arg(long, value_name = "DIR")]
    tenants_dir: Option<PathBuf>,
}

#[derive(Args, Debug)]
struct CrdsArgs {
    /// Write one file per CRD into this directory instead of printing one stream: the tenants'
    /// CRDs, and the host's (Tenant) in its `host/` subdirectory.
    #[arg(long, value_name = "DIR", conflicts_with = "host")]
    out: Option<PathBuf>,
    /// Print the CRDs of the host cluster (Tenant) instead of the tenants' (for
    /// `stackd crds --host | kubectl apply -f -` on the host, when not using the controllers chart).
    #[arg(long)]
    host: bool,
}

#[derive(Subcommand, Debug)]
enum TenantCommand {
    /// Decommission a tenant: delete its host objects and its host namespace.
    Purge {
        /// The tenant's name (its kubeconfig file stem).
        name: String,
        #[command(flatten)]
        host: HostArgs,
    },
}

#[derive(Args, Debug)]
struct BenchArgs {
    /// CI-sized run (under a minute).
    #[arg(long)]
    quick: bool,
    /// Print the figures as JSON.
    #[arg(long)]
    json: bool,
    /// Compare against the JSON of an earlier run.
    #[arg(long, value_name = "FILE")]
    compare: Option<PathBuf>,
    /// Also run the chaos scenario.
    #[arg(long)]
    chaos: bool,
    /// Random seed of the chaos scenario.
    #[arg(long, value_name = "N")]
    seed: Option<u64>,
    /// Also write the JSON report to this file (for a later --compare).
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
    /// Keep daemon logs in this directory (by default they go with the run): every daemon's of a
    /// chaos run, the stack-install daemon's of a benchmark.
    #[arg(long, value_name = "DIR")]
    keep_logs: Option<PathBuf>,
    /// Run one scenario alone and print its figures.
    #[arg(long, value_enum, value_name = "SCENARIO", conflicts_with_all = ["chaos", "compare"])]
    only: Option<BenchScenario>,
    /// How the stacks scenario's tenant API servers are spoken to: https with HTTP/2 (as a real
    /// kube-apiserver), https with HTTP/1.1 only, or plain http (a baseline no real tenant serves).
    #[arg(long, value_enum, value_name = "TRANSPORT", default_value = "http2")]
    tenant_transport: stackd::bench::fleet::TenantTransport,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum BenchScenario {
    /// Three replicas sharing the tenants (`--shards`), then a fourth joining.
    Shards,
    /// Stack installs in several tenants at once: requests per install and where the time goes.
    Stacks,
    /// Tenant API server restarts: how soon the tenant is up, and an install right after.
    Recovery,
    /// 1,000 idle tenants on one replica (20 with --quick): start-up, memory, a steady state.
    Crowd,
    /// One tenant running issue 28's attacks while another installs stacks and fills a pool:
    /// daemon restarts, peak memory, and the other tenant's install p50 against an idle run.
    BlastRadius,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Crds(args) => print_crds(args),
        Command::Version => {
            println!("stackd {}", env!("CARGO_PKG_VERSION"));
            ExitCode::SUCCESS
        }
        Command::Run(args) => block_on(run(*args)),
        Command::Dev(args) => block_on(dev(args)),
        Command::Unpack(args) => unpack(args),
        Command::Copy { src, dest } => copy(&src, &dest),
        Command::CopySelf { dest } => copy_self(&dest),
        Command::Package(command) => package(command),
        Command::Tenant(TenantCommand::Purge { name, host }) => block_on(purge(name, host)),
        Command::Bench(args) => block_on(bench(args)),
        Command::Status(args) => block_on(status(args)),
    }
}

fn block_on(future: impl std::future::Future<Output = ExitCode>) -> ExitCode {
    match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime.block_on(future),
        Err(err) => {
            eprintln!("stackd: cannot start the async runtime: {err}");
            ExitCode::FAILURE
        }
    }
}

/// Lines of kube's client that are never written, whatever filter is set. It logs the whole text of
/// an answer it could not decode (a warning) or that was an error (debug): a tenant Secret, or
/// whatever a server a tenant named answered. And its request layer logs every failed request as an
/// error ("failed with error client error (Connect)"): 18 a second from one tenant while its server
/// restarts. stackd logs each error itself, without the text, and an outage once.
const QUIET_KUBE_CLIENT: [&str; 2] = ["kube_client::client=error", "kube_client::client::builder=off"];

fn init_logging(format: LogFormat) {
    init_logging_to(format, std::io::stderr, true);
}

/// Logging into `writer` (colours only where `ansi`).
fn init_logging_to<W>(format: LogFormat, writer: W, ansi: bool)
where
    W: for<'writer> tracing_subscriber::fmt::MakeWriter<'writer> + Send + Sync + 'static,
{
    let mut filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,kube_runtime=warn,kube_client=warn"));
    for directive in QUIET_KUBE_CLIENT {
        #[allow(
            clippy::expect_used,
            reason = "constant directives, parsed at every daemon start and so by every integration test"
        )]
        let directive = directive.parse().expect("static directive");
        filter = filter.add_directive(directive);
    }
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(writer);
    // Colours where the default puts them (a terminal, unless NO_COLOR), never into a file.
    let builder = if ansi { builder } else { builder.with_ansi(false) };
    match format {
        LogFormat::Json => builder.json().flatten_event(true).init(),
        LogFormat::Text => builder.init(),
    }
}

/// The host client: `--host-kubeconfig`, else in-cluster config, else `$KUBECONFIG` (or ~/.kube/config).
async fn host_client(path: Option<&PathBuf>) -> Result<kube::Client, String> {
    stackd::runtime::transport::host_client(host_config(path).await?).map_err(|e| e.to_string())
}

async fn host_config(path: Option<&PathBuf>) -> Result<kube::Config, String> {
    let config = match path {
        Some(path) => {
            let kubeconfig = kube::config::Kubeconfig::read_from(path)
                .map_err(|e| format!("{}: {}", path.display(), kubeconfig_error_message(&e)))?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
                .await
                .map_err(|e| format!("{}: {e}", path.display()))?
        }
        None => match kube::Config::incluster() {
            Ok(config) => config,
            Err(_) => kube::Config::from_kubeconfig(&Default::default())
                .await
                .map_err(|e| format!("no --host-kubeconfig, no in-cluster config, and no usable $KUBECONFIG: {e}"))?,
        },
    };
    Ok(config)
}

/// Cancels the token on the first SIGTERM or Ctrl-C; a second one exits at once.
fn shutdown_on_signals() -> CancellationToken {
    let token = CancellationToken::new();
    let cancel = token.clone();
    tokio::spawn(async move {
        wait_for_signal().await;
        tracing::info!("shutting down: finishing in-flight reconciles (signal again to force)");
        cancel.cancel();
        wait_for_signal().await;
        tracing::warn!("second signal: exiting now");
        std::process::exit(130);
    });
    token
}

async fn wait_for_signal() {
    let mut terminate = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(signal) => signal,
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = terminate.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

async fn run(args: RunArgs) -> ExitCode {
    init_logging(args.log_format);
    let template = match NamespaceTemplate::new(&args.host.tenant_namespace_template) {
        Ok(template) => template,
        Err(err) => return fail("stackd run", err),
    };
    let host_config = match host_config(args.host.host_kubeconfig.as_ref()).await {
        Ok(config) => config,
        Err(err) => return fail("stackd run", err),
    };
    let identity = format!(
        "{}-{}",
        std::env::var("POD_NAME").unwrap_or_else(|_| "stackd".to_string()),
        rand::random::<u32>()
    );
    let settings = stackd::context::shared::DaemonSettings {
        tenants_dir: Some(args.tenants_dir),
        tenant_secret_namespaces: args.tenant_secret_namespaces.into_iter().collect(),
        identity: identity.clone(),
        namespace_template: template,
        stackd_image: args.stackd_image.unwrap_or_else(stackd::stacks::default_stackd_image),
        allow_insecure_tenant_endpoint: args.allow_insecure_tenant_endpoint,
        insecure_allow_all_apigroups: args.insecure_allow_all_apigroups,
        insecure_pass_full_deployment: args.insecure_pass_full_deployment,
        stack_pod_policy: PodPolicy {
            node_selector: args
                .stack_node_selector
                .into_iter()
                .map(|label| (label.key, label.value))
                .collect(),
            tolerations: args.stack_toleration,
        },
        tenant_quota: TenantQuota {
            hard: args.tenant_quota,
            container_defaults: args.tenant_container_defaults,
            namespace_share: NamespaceShare {
                cpu: args.namespace_max_cpu,
                memory: args.namespace_max_memory,
            },
        },
        stack_crd_groups: args.stack_crd_groups,
        platform_dependency_groups: args.platform_dependency_groups,
        insecure_allow_conversion_webhooks: args.insecure_allow_conversion_webhooks,
        stack_limits: StackLimits {
            max_package_crds: args.max_package_crds,
            namespace_max_installs: args.namespace_max_installs,
        },
        allowed_registries: args.allowed_registries,
        metrics_addr: args.metrics_addr,
        health_addr: args.health_addr,
        shards: args.shards.then(|| stackd::runtime::shards::ShardSettings {
            namespace: args.shard_namespace.clone(),
            identity: identity.clone(),
            duration_seconds: args.shard_lease_duration,
            host: host_config.clone(),
        }),
        leader_election: args
            .leader_elect
            .then(|| stackd::runtime::leader::LeaderElectionSettings {
                namespace: args.leader_elect_namespace.clone(),
                lease_name: "stackd-leader".to_string(),
                identity,
                duration_seconds: args.leader_elect_lease_duration,
                host: host_config.clone(),
            }),
        rbac_subject: args.service_account,
        max_concurrent_reconciles: usize::from(args.max_concurrent_reconciles),
        lease_min_age: args.lease_min_age,
        managed_cluster_timeout: args.managed_cluster_timeout,
        installer_deadline: args.installer_deadline,
        pull_failure_grace: args.pull_failure_grace,
        namespace_max_pools: args.namespace_max_pools,
        namespace_max_clusters: args.namespace_max_clusters,
        namespace_secret_lookups: usize::from(args.namespace_secret_lookups),
        sweep_interval: args.sweep_interval,
        backoff: stackd::runtime::backoff::Backoff::new(args.backoff_base, Duration::from_secs(300)),
        debounce: args.debounce,
        rescan_interval: args.rescan_interval,
        tenant_stop_grace: args.tenant_stop_grace,
        max_cached_object_bytes: args.max_cached_object_bytes,
        tenant_memory_budget: args.tenant_memory_budget,
        document_limits: DocumentLimits {
            render_secret_bytes: bytes(args.max_render_secret_bytes),
            render_bytes: bytes(args.max_render_bytes),
            installer_output_bytes: bytes(args.max_installer_output_bytes),
            installer_output_keys: args.max_installer_output_keys,
            render_share_per_second: args.namespace_render_bytes_per_second.0,
            render_share_burst: args.namespace_render_burst_bytes.0,
        },
        namespace_memory_budget: args
            .namespace_memory_budget
            .unwrap_or_else(|| default_namespace_share(args.tenant_memory_budget)),
        namespace_max_objects: args.namespace_max_objects,
        monitoring_namespace: args.monitoring_namespace,
    };
    match stackd::daemon::run(host_config, settings, shutdown_on_signals()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => fail("stackd run", err),
    }
}

async fn bench(args: BenchArgs) -> ExitCode {
    if args.chaos {
        return chaos(&args).await;
    }
    let baseline = match args.compare.as_ref().map(stackd::bench::load).transpose() {
        Ok(baseline) => baseline,
        Err(err) => return fail("stackd bench", err),
    };
    let options = stackd::bench::BenchOptions {
        quick: args.quick,
        keep_logs: args.keep_logs.clone(),
        tenant_transport: args.tenant_transport,
    };
    match args.only {
        Some(BenchScenario::Shards) => return bench_shards(&args, &options).await,
        Some(BenchScenario::Stacks) => return bench_stacks(&args, &options).await,
        Some(BenchScenario::Recovery) => return bench_recovery(&args, &options).await,
        Some(BenchScenario::Crowd) => return bench_crowd(&args, &options).await,
        Some(BenchScenario::BlastRadius) => return bench_blast_radius(&args, &options).await,
        None => {}
    }
    let report = match stackd::bench::run(&options).await {
        Ok(report) => report,
        Err(err) => return fail("stackd bench", err),
    };
    report_bench(&args, &report, || stackd::bench::table(&report, baseline.as_ref()))
}

/// Writes a bench report as `--out` and `--json` say, else prints what `text` makes of it.
fn report_bench<T: serde::Serialize>(args: &BenchArgs, report: &T, text: impl FnOnce() -> String) -> ExitCode {
    let json = serde_json::to_string_pretty(report).unwrap_or_default();
    if let Some(path) = &args.out
        && let Err(err) = std::fs::write(path, &json)
    {
        return fail("stackd bench", format!("cannot write {}: {err}", path.display()));
    }
    if args.json {
        println!("{json}");
    } else {
        print!("{}", text());
    }
    ExitCode::SUCCESS
}

/// `stackd bench --only shards`.
async fn bench_shards(args: &BenchArgs, options: &stackd::bench::BenchOptions) -> ExitCode {
    let load = options.shard_load();
    let figures = match stackd::bench::shards::measure(&load, options.keep_logs.as_deref()).await {
        Ok(figures) => figures,
        Err(err) => return fail("stackd bench", err),
    };
    report_bench(args, &figures, || {
        format!("{}\n", stackd::bench::shard_line(&figures).trim_start())
    })
}

/// `stackd bench --only stacks`.
async fn bench_stacks(args: &BenchArgs, options: &stackd::bench::BenchOptions) -> ExitCode {
    match stackd::bench::run_stacks(options).await {
        Ok(figures) => report_bench(args, &figures, || stackd::bench::stacks_lines(&figures)),
        Err(err) => fail("stackd bench", err),
    }
}

/// `stackd bench --only recovery`.
async fn bench_recovery(args: &BenchArgs, options: &stackd::bench::BenchOptions) -> ExitCode {
    match stackd::bench::run_recovery(options).await {
        Ok(figures) => report_bench(args, &figures, || stackd::bench::recovery_lines(&figures)),
        Err(err) => fail("stackd bench", err),
    }
}

/// `stackd bench --only crowd`.
async fn bench_crowd(args: &BenchArgs, options: &stackd::bench::BenchOptions) -> ExitCode {
    match stackd::bench::run_crowd(options).await {
        Ok(figures) => report_bench(args, &figures, || stackd::bench::crowd_lines(&figures)),
        Err(err) => fail("stackd bench", err),
    }
}

/// `stackd bench --only blast-radius`.
async fn bench_blast_radius(args: &BenchArgs, options: &stackd::bench::BenchOptions) -> ExitCode {
    match stackd::bench::run_blast_radius(options).await {
        Ok(figures) => report_bench(args, &figures, || stackd::bench::blast_radius::lines(&figures)),
        Err(err) => fail("stackd bench", err),
    }
}

/// `stackd bench --chaos`: exits non-zero when an invariant fails.
async fn chaos(args: &BenchArgs) -> ExitCode {
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs())
    });
    eprintln!("chaos: seed {seed} (repeat with --seed {seed})");
    let mut options = stackd::bench::chaos::ChaosOptions::new(seed, args.quick);
    options.keep_logs = args.keep_logs.clone();
    let report = match stackd::bench::chaos::run(&options).await {
        Ok(report) => report,
        Err(err) => return fail("stackd bench --chaos", err),
    };
    let json = serde_json::to_string_pretty(&report).unwrap_or_default();
    if let Some(path) = &args.out
        && let Err(err) = std::fs::write(path, &json)
    {
        return fail(
            "stackd bench --chaos",
            format!("cannot write {}: {err}", path.display()),
        );
    }
    if args.json {
        println!("{json}");
    } else {
        print!("{}", stackd::bench::chaos::table(&report));
    }
    if report.passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

async fn dev(args: DevArgs) -> ExitCode {
    let log_file = if args.verbose {
        init_logging(LogFormat::Text);
        None
    } else {
        let path = args
            .log_file
            .clone()
            .unwrap_or_else(|| args.kubeconfig_dir.join("stackd.log"));
        match open_log_file(&path) {
            Ok(file) => init_logging_to(LogFormat::Text, std::sync::Arc::new(file), false),
            Err(err) => {
                return fail(
                    "stackd dev",
                    format!("cannot write the log file {}: {err}", path.display()),
                );
            }
        }
        Some(path)
    };
    let options = stackd::dev::DevOptions {
        tenants: args.tenants,
        no_daemon: args.no_daemon,
        kubeconfig_dir: args.kubeconfig_dir,
        log_file,
    };
    match stackd::dev::run(options, shutdown_on_signals()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => fail("stackd dev", err),
    }
}

/// A new log file at `path` (its directory made first), replacing an earlier run's.
fn open_log_file(path: &std::path::Path) -> std::io::Result<std::fs::File> {
    if let Some(dir) = path.parent().filter(|dir| !dir.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::File::create(path)
}

async fn purge(tenant: String, host_args: HostArgs) -> ExitCode {
    let namespace =
        match NamespaceTemplate::new(&host_args.tenant_namespace_template).and_then(|t| t.namespace_for(&tenant)) {
            Ok(namespace) => namespace,
            Err(err) => return fail("stackd tenant purge", err),
        };
    let host = match host_client(host_args.host_kubeconfig.as_ref()).await {
        Ok(client) => client,
        Err(err) => return fail("stackd tenant purge", err),
    };
    match stackd::host::purge::purge(&host, &tenant, &namespace).await {
        Ok(report) => {
            for object in &report.deleted {
                println!("deleted {object}");
            }
            if report.namespace_deleted {
                println!("deleted namespace {namespace}");
            } else if report.deleted.is_empty() {
                println!("nothing to purge for tenant {tenant} in {namespace}");
            }
            ExitCode::SUCCESS
        }
        Err(err) => fail("stackd tenant purge", err),
    }
}

async fn status(args: StatusArgs) -> ExitCode {
    let tenants = match &args.tenants_dir {
        None => Vec::new(),
        Some(dir) => match stackd::tenancy::directory::tenant_names(dir) {
            Ok(names) => names,
            Err(err) => return fail("stackd status", format!("cannot read {}: {err}", dir.display())),
        },
    };
    let mut tenants = tenants;
    let host = match host_client(args.host_kubeconfig.as_ref()).await {
        Ok(client) => client,
        Err(err) => return fail("stackd status", err),
    };
    let objects = match stackd::tenancy::objects::table::read(host.clone()).await {
        Ok(objects) => objects,
        Err(err) => return fail("stackd status", format!("cannot list the Tenant objects: {err}")),
    };
    if let Some(objects) = &objects {
        print!("{}", stackd::tenancy::objects::table::render(objects));
        tenants.extend(objects.iter().filter_map(|tenant| tenant.metadata.name.clone()));
        tenants.sort();
        tenants.dedup();
    }
    match stackd::runtime::shards::status::read(host, &args.namespace, &tenants).await {
        // Not sharded: the Tenants' table is the whole answer.
        Ok(None) if objects.is_some() => ExitCode::SUCCESS,
        Ok(None) => fail(
            "stackd status",
            format!(
                "the host serves no Tenant objects and there is no shard map in {} (run --shards); pass --namespace",
                args.namespace
            ),
        ),
        Ok(Some(table)) => {
            if objects.is_some() {
                println!();
            }
            print!("{}", stackd::runtime::shards::status::render(&table));
            ExitCode::SUCCESS
        }
        Err(err) => fail("stackd status", err),
    }
}

fn fail(command: &str, err: impl std::fmt::Display) -> ExitCode {
    eprintln!("{command}: {err}");
    ExitCode::FAILURE
}

fn print_crds(args: CrdsArgs) -> ExitCode {
    use stackd::api::crds;
    let result = match (args.out, args.host) {
        (Some(dir), _) => crds::write_files(&crds::all(), &dir)
            .and_then(|()| crds::write_files(&crds::host(), &dir.join(crds::HOST_DIR))),
        (None, host) => {
            let printed = if host { crds::host() } else { crds::all() };
            crds::to_yaml_stream(&printed).map(|yaml| print!("{yaml}"))
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("stackd crds: {err}");
            ExitCode::FAILURE
        }
    }
}

fn unpack(args: UnpackArgs) -> ExitCode {
    let options = stackd::stacks::unpack::UnpackOptions {
        content_dir: args.content_dir,
        permission_scope: args.permission_scope,
        package_image: args.package_image,
        templating_controller_image: args.templating_controller_image,
        stackd_image: args.stackd_image.unwrap_or_else(stackd::stacks::default_stackd_image),
    };
    // Only the stream goes to stdout: the daemon reads it back from the pod log.
    match stackd::stacks::unpack::run(&options, &mut std::io::stdout().lock()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("stackd unpack: {err}");
            ExitCode::FAILURE
        }
    }
}

fn copy(src: &Path, dest: &Path) -> ExitCode {
    use stackd::stacks::copy::{Limits, copy_tree};
    match copy_tree(src, dest, &Limits::PACKAGE) {
        Ok(_) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("stackd copy: {err}");
            ExitCode::FAILURE
        }
    }
}

fn copy_self(dest: &Path) -> ExitCode {
    match stackd::stacks::copy::copy_self(dest) {
        Ok(_) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("stackd copy-self: {err}");
            ExitCode::FAILURE
        }
    }
}

fn package(command: PackageCommand) -> ExitCode {
    use stackd::package::{build, check, init};
    match command {
        PackageCommand::Init { dir, scope, templating } => {
            match init::init(&init::InitOptions { dir, scope, templating }) {
                Ok(written) => {
                    for path in written {
                        println!("wrote {}", path.display());
                    }
                    ExitCode::SUCCESS
                }
                Err(err) => fail("stackd package init", err),
            }
        }
        PackageCommand::Check { check: args, output } => {
            let report = check::check(&args.options());
            match output {
                CheckOutput::Text => print!("{}", report.to_text()),
                CheckOutput::Json => match serde_json::to_string_pretty(&report) {
                    Ok(json) => println!("{json}"),
                    Err(err) => return fail("stackd package check", err),
                },
            }
            if report.passed() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        PackageCommand::Build {
            check: args,
            tag,
            archive,
        } => {
            let report = check::check(&args.options());
            if !report.passed() {
                eprint!("{}", report.to_text());
                return fail("stackd package build", "the package fails its check: nothing was built");
            }
            // The package directory's name, also when DIR is its .registry.
            let package_dir = report.registry_dir.parent().unwrap_or(&report.registry_dir);
            let name = package_dir.file_name().and_then(|n| n.to_str()).unwrap_or("package");
            let output = archive.unwrap_or_else(|| PathBuf::from(format!("{name}.oci.tar")));
            let built = build::build(&report.registry_dir, &tag)
                .and_then(|image| Ok((build::archive(&image)?, image.digest())))
                .and_then(|(archive, digest)| build::write_file(&output, &archive).map(|()| digest));
            match built {
                Ok(digest) => {
                    println!("{} {tag}@{digest}", output.display());
                    ExitCode::SUCCESS
                }
                Err(err) => fail("stackd package build", err),
            }
        }
        PackageCommand::Push {
            file,
            image,
            registry_config,
            plain_http,
        } => {
            let options = stackd::package::push::PushOptions {
                archive: file,
                image: image.clone(),
                registry_config,
                plain_http,
            };
            block_on(async move {
                match stackd::package::push::push(&options).await {
                    Ok(digest) => {
                        println!("{image}@{digest}");
                        ExitCode::SUCCESS
                    }
                    Err(err) => fail("stackd package push", err),
                }
            })
        }
    }
}
