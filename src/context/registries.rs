//! Where tenant-chosen images may come from (`--allowed-registries`, DESIGN.md §8): stack packages,
//! the images of stack controllers and pool installers. Without the flag, any registry. With it, an
//! image runs only when its registry host, or its registry host and a path prefix, is listed: a
//! node pulls whatever a pod names, with the node's own credentials too, so a tenant could otherwise
//! run an image from any registry the nodes reach.

use std::fmt;
use std::str::FromStr;

/// The registries images may come from; empty means any.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AllowedRegistries(Vec<Prefix>);

/// One entry: a registry host (with its port, if any), lowercase, and a repository path prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Prefix {
    host: String,
    path: Option<String>,
}

impl fmt::Display for Prefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.path {
            Some(path) => write!(f, "{}/{path}", self.host),
            None => f.write_str(&self.host),
        }
    }
}

impl AllowedRegistries {
    /// True when the flag is not set.
    pub fn any(&self) -> bool {
        self.0.is_empty()
    }

    /// True when `image` may be pulled: its registry (Docker's rule: `docker.io` for an image
    /// without one) and repository path start with an allowed entry, at a path boundary.
    pub fn allows(&self, image: &str) -> bool {
        if self.any() {
            return true;
        }
        let (host, path) = registry_and_path(image);
        self.0.iter().any(|allowed| {
            allowed.host == host
                && match &allowed.path {
                    None => true,
                    Some(prefix) => path == *prefix || path.starts_with(&format!("{prefix}/")),
                }
        })
    }

    /// Why `image` (`what`, e.g. "the package image") is refused; `None` when it is allowed.
    pub fn refusal(&self, what: &str, image: &str) -> Option<String> {
        (!self.allows(image)).then(|| {
            format!(
                "{what} {image:?} is not from a registry this host allows (--allowed-registries {self}); use an image from one of those registries, or ask the host's operators to allow this one"
            )
        })
    }
}

impl fmt::Display for AllowedRegistries {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let entries: Vec<String> = self.0.iter().map(ToString::to_string).collect();
        f.write_str(&entries.join(","))
    }
}

/// The registry host (lowercase) and the repository path of an image reference, tag and digest
/// dropped. Docker's rule: the first path component names a registry when it has a `.` or `:`, or is
/// `localhost`; otherwise the image is Docker Hub's, and a single-component name is under `library/`.
pub fn registry_and_path(image: &str) -> (String, String) {
    let image = image.trim();
    let without_digest = image.split_once('@').map_or(image, |(name, _)| name);
    let (host, rest) = match without_digest.split_once('/') {
        Some((first, rest)) if first.contains('.') || first.contains(':') || first == "localhost" => {
            (first.to_ascii_lowercase(), rest)
        }
        _ => ("docker.io".to_string(), without_digest),
    };
    // A tag follows the last `:` after the last `/` (a port's `:` is in the host).
    let path = match rest.rsplit_once(':') {
        Some((name, tag)) if !tag.contains('/') => name,
        _ => rest,
    };
    let path = if host == "docker.io" && !path.contains('/') {
        format!("library/{path}")
    } else {
        path.to_string()
    };
    (host, path)
}

impl FromStr for AllowedRegistries {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut entries = Vec::new();
        for entry in s.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let bad = || {
                format!(
                    "{entry:?} is not a registry host or host/path prefix: e.g. quay.io,registry.example.com:5000/stacks (no scheme, tag or digest)"
                )
            };
            if entry.contains("://") || entry.contains('@') {
                return Err(bad());
            }
            let (host, path) = match entry.split_once('/') {
                Some((host, path)) => (host, Some(path.trim_end_matches('/'))),
                None => (entry, None),
            };
            let host_ok = !host.is_empty()
                && host
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b':'));
            let path_ok = path.is_none_or(|p| {
                !p.is_empty()
                    && p.split('/').all(|part| {
                        !part.is_empty()
                            && part.bytes().all(|b| {
                                b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'-' | b'_')
                            })
                    })
            });
            if !host_ok || !path_ok {
                return Err(bad());
            }
            entries.push(Prefix {
                host: host.to_ascii_lowercase(),
                path: path.map(str::to_string),
            });
        }
        Ok(AllowedRegistries(entries))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn images_are_read_with_dockers_rule() {
        assert_eq!(
            registry_and_path("quay.io/acme/widgets:v1"),
            ("quay.io".into(), "acme/widgets".into())
        );
        assert_eq!(
            registry_and_path("localhost:5000/w@sha256:abc"),
            ("localhost:5000".into(), "w".into())
        );
        assert_eq!(
            registry_and_path("acme/widgets:v1"),
            ("docker.io".into(), "acme/widgets".into())
        );
        assert_eq!(
            registry_and_path("busybox"),
            ("docker.io".into(), "library/busybox".into())
        );
        assert_eq!(
            registry_and_path("Registry.Example.com:5000/a/b"),
            ("registry.example.com:5000".into(), "a/b".into())
        );
    }

    #[test]
    fn an_image_passes_only_under_a_listed_host_or_prefix() {
        let any = AllowedRegistries::default();
        assert!(any.allows("evil.example.org/x:1"));
        let allowed: AllowedRegistries = "quay.io/acme, registry.example.com:5000,docker.io/library"
            .parse()
            .unwrap();
        assert!(allowed.allows("quay.io/acme/widgets:v1"));
        assert!(allowed.allows("quay.io/acme"));
        assert!(
            !allowed.allows("quay.io/acme-evil/widgets:v1"),
            "a path prefix ends at a /"
        );
        assert!(!allowed.allows("quay.io/other/widgets"));
        assert!(allowed.allows("registry.example.com:5000/anything/at/all:1"));
        assert!(
            !allowed.allows("registry.example.com/x"),
            "the port is part of the host"
        );
        assert!(allowed.allows("busybox:1.36"));
        assert!(!allowed.allows("acme/widgets"));
        assert!(!allowed.allows("quay.io.evil.example.org/acme/x"));
        let message = allowed.refusal("the package image", "evil.example.org/x:1").unwrap();
        assert!(
            message.contains("evil.example.org/x:1") && message.contains("quay.io/acme"),
            "{message}"
        );
    }

    #[test]
    fn entries_that_are_no_registry_are_refused() {
        for bad in [
            "https://quay.io",
            "quay.io/acme:v1",
            "quay.io/x@sha256:0",
            "quay.io//x",
            "qu ay.io",
        ] {
            assert!(bad.parse::<AllowedRegistries>().is_err(), "{bad}");
        }
        assert!("".parse::<AllowedRegistries>().unwrap().any());
    }
}
