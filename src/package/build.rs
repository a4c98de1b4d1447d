//! `stackd package build`: the package image as an OCI image archive (an OCI image layout in a
//! tar, as `scripts/image` writes stackd's own), FROM scratch with one layer holding `/.registry`,
//! written in-process: no container engine, no network.
//!
//! Reproducible: the same `.registry` gives the same bytes, so the same digest. Entries are sorted
//! and carry fixed times, owners and modes; the gzip header carries no time; the config no creation
//! date or host. Only regular files and directories go in: a symlink could point out of the package.

use std::io::Write;
use std::path::{Path, PathBuf};

use flate2::{Compression, GzBuilder};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

/// What the layer may hold: what the install pod's `stackd copy` copies out of it.
pub use crate::stacks::copy::{MAX_PACKAGE_BYTES, MAX_PACKAGE_ENTRIES};

pub const MANIFEST_MEDIA_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";
pub const CONFIG_MEDIA_TYPE: &str = "application/vnd.oci.image.config.v1+json";
pub const LAYER_MEDIA_TYPE: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
const INDEX_MEDIA_TYPE: &str = "application/vnd.oci.image.index.v1+json";
/// The index annotation naming the image, as buildah's and skopeo's oci-archive write it.
pub const REF_NAME_ANNOTATION: &str = "org.opencontainers.image.ref.name";

/// Why no image was built.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error(
        "{0} is a symbolic link or special file: a package image holds regular files and directories only; copy the file in"
    )]
    NotRegular(PathBuf),
    #[error(
        "the package holds more than {MAX_PACKAGE_BYTES} bytes or {MAX_PACKAGE_ENTRIES} files: keep only what the package needs"
    )]
    TooLarge,
    #[error("cannot write {path}: {source}")]
    Write { path: PathBuf, source: std::io::Error },
    #[error("{0}")]
    Archive(String),
}

/// A built image: its blobs, as an OCI image layout holds them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Image {
    /// The image name the index annotates (`-t`).
    pub name: String,
    pub manifest: Vec<u8>,
    pub config: Vec<u8>,
    /// The gzipped layer.
    pub layer: Vec<u8>,
}

/// `sha256:<hex>` of `bytes`.
pub fn digest(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

impl Image {
    /// The image's digest: its manifest's, what a registry and `name@sha256:…` name it by.
    pub fn digest(&self) -> String {
        digest(&self.manifest)
    }
}

/// Builds the image of the package whose `.registry` directory is `registry_dir`.
pub fn build(registry_dir: &Path, name: &str) -> Result<Image, BuildError> {
    let tar = layer_tar(registry_dir)?;
    let diff_id = digest(&tar);
    let mut gz = GzBuilder::new().mtime(0).write(Vec::new(), Compression::default());
    let layer = gz
        .write_all(&tar)
        .and_then(|()| gz.finish())
        .map_err(|e| BuildError::Archive(e.to_string()))?;
    let config = json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created_by": "stackd package build", "comment": "/.registry"}],
    });
    let config = to_bytes(&config)?;
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA_TYPE,
        "config": {"mediaType": CONFIG_MEDIA_TYPE, "digest": digest(&config), "size": config.len()},
        "layers": [{"mediaType": LAYER_MEDIA_TYPE, "digest": digest(&layer), "size": layer.len()}],
    });
    Ok(Image {
        name: name.to_string(),
        manifest: to_bytes(&manifest)?,
        config,
        layer,
    })
}

fn to_bytes(value: &Value) -> Result<Vec<u8>, BuildError> {
    serde_json::to_vec(value).map_err(|e| BuildError::Archive(e.to_string()))
}

/// The files and directories under `dir` (relative, sorted), bounded.
fn entries(dir: &Path) -> Result<Vec<(PathBuf, bool)>, BuildError> {
    let mut found = Vec::new();
    let mut pending = vec![PathBuf::new()];
    let mut bytes = 0u64;
    while let Some(relative) = pending.pop() {
        let at = dir.join(&relative);
        let read = std::fs::read_dir(&at).map_err(|source| BuildError::Read {
            path: at.clone(),
            source,
        })?;
        for entry in read {
            let entry = entry.map_err(|source| BuildError::Read {
                path: at.clone(),
                source,
            })?;
            let path = relative.join(entry.file_name());
            let kind = entry.file_type().map_err(|source| BuildError::Read {
                path: dir.join(&path),
                source,
            })?;
            if kind.is_dir() {
                pending.push(path.clone());
                found.push((path, true));
            } else if kind.is_file() {
                let metadata = entry.metadata().map_err(|source| BuildError::Read {
                    path: dir.join(&path),
                    source,
                })?;
                bytes = bytes.saturating_add(metadata.len());
                found.push((path, false));
            } else {
                return Err(BuildError::NotRegular(dir.join(path)));
            }
            if found.len() > MAX_PACKAGE_ENTRIES || bytes > MAX_PACKAGE_BYTES {
                return Err(BuildError::TooLarge);
            }
        }
    }
    found.sort();
    Ok(found)
}

/// A tar entry with fixed owner, time and mode.
fn header(kind: tar::EntryType, size: u64) -> tar::Header {
    let mut header = tar::Header::new_gnu();
    header.set_entry_type(kind);
    header.set_size(size);
    header.set_mode(if kind == tar::EntryType::Directory {
        0o755
    } else {
        0o644
    });
    header.set_uid(0);
    header.set_gid(0);
    header.set_mtime(0);
    header
}

/// The layer: `.registry/` and everything in it.
fn layer_tar(registry_dir: &Path) -> Result<Vec<u8>, BuildError> {
    let mut tar = tar::Builder::new(Vec::new());
    let failed = |e: std::io::Error| BuildError::Archive(e.to_string());
    let root = Path::new(".registry");
    tar.append_data(&mut header(tar::EntryType::Directory, 0), root, std::io::empty())
        .map_err(failed)?;
    for (relative, is_dir) in entries(registry_dir)? {
        let name = root.join(&relative);
        if is_dir {
            tar.append_data(&mut header(tar::EntryType::Directory, 0), &name, std::io::empty())
                .map_err(failed)?;
        } else {
            let path = registry_dir.join(&relative);
            let data = std::fs::read(&path).map_err(|source| BuildError::Read { path, source })?;
            tar.append_data(
                &mut header(tar::EntryType::Regular, data.len() as u64),
                &name,
                data.as_slice(),
            )
            .map_err(failed)?;
        }
    }
    tar.into_inner().map_err(failed)
}

/// The OCI image layout of `image`, as one tar (an oci-archive).
pub fn archive(image: &Image) -> Result<Vec<u8>, BuildError> {
    let index = json!({
        "schemaVersion": 2,
        "mediaType": INDEX_MEDIA_TYPE,
        "manifests": [{
            "mediaType": MANIFEST_MEDIA_TYPE,
            "digest": image.digest(),
            "size": image.manifest.len(),
            "annotations": {REF_NAME_ANNOTATION: image.name},
        }],
    });
    let mut files: Vec<(String, Vec<u8>)> = vec![
        ("oci-layout".into(), br#"{"imageLayoutVersion":"1.0.0"}"#.to_vec()),
        ("index.json".into(), to_bytes(&index)?),
    ];
    for blob in [&image.manifest, &image.config, &image.layer] {
        let name = format!("blobs/sha256/{}", digest(blob).trim_start_matches("sha256:"));
        files.push((name, blob.clone()));
    }
    files.sort();
    files.dedup_by(|a, b| a.0 == b.0);
    let mut tar = tar::Builder::new(Vec::new());
    let failed = |e: std::io::Error| BuildError::Archive(e.to_string());
    for dir in ["blobs", "blobs/sha256"] {
        tar.append_data(&mut header(tar::EntryType::Directory, 0), dir, std::io::empty())
            .map_err(failed)?;
    }
    for (name, data) in files {
        tar.append_data(
            &mut header(tar::EntryType::Regular, data.len() as u64),
            name,
            data.as_slice(),
        )
        .map_err(failed)?;
    }
    tar.into_inner().map_err(failed)
}

/// Reads back an archive [`archive`] wrote (or any oci-archive of one single-layer image).
pub fn read_archive(bytes: &[u8]) -> Result<Image, BuildError> {
    let bad = |what: &str| BuildError::Archive(format!("not an OCI image archive of one image: {what}"));
    let mut files = std::collections::BTreeMap::new();
    let mut tar = tar::Archive::new(bytes);
    let mut total = 0u64;
    for entry in tar.entries().map_err(|e| BuildError::Archive(e.to_string()))? {
        let mut entry = entry.map_err(|e| BuildError::Archive(e.to_string()))?;
        if entry.header().entry_type() != tar::EntryType::Regular {
            continue;
        }
        total = total.saturating_add(entry.size());
        if total > MAX_PACKAGE_BYTES * 2 {
            return Err(BuildError::TooLarge);
        }
        let name = entry
            .path()
            .map_err(|e| BuildError::Archive(e.to_string()))?
            .to_string_lossy()
            .trim_start_matches("./")
            .to_string();
        let mut data = Vec::new();
        std::io::Read::read_to_end(&mut entry, &mut data).map_err(|e| BuildError::Archive(e.to_string()))?;
        files.insert(name, data);
    }
    let blob = |digest: &str| -> Result<Vec<u8>, BuildError> {
        let hex = digest
            .strip_prefix("sha256:")
            .ok_or_else(|| bad("a digest is not sha256"))?;
        let data = files
            .get(&format!("blobs/sha256/{hex}"))
            .ok_or_else(|| bad("a blob is missing"))?;
        if self::digest(data) != digest {
            return Err(bad("a blob does not match its digest"));
        }
        Ok(data.clone())
    };
    let index: Value = serde_json::from_slice(files.get("index.json").ok_or_else(|| bad("no index.json"))?)
        .map_err(|_| bad("index.json"))?;
    let [entry] = index["manifests"].as_array().map(Vec::as_slice).unwrap_or_default() else {
        return Err(bad("index.json lists no single manifest"));
    };
    let manifest = blob(entry["digest"].as_str().unwrap_or_default())?;
    let parsed: Value = serde_json::from_slice(&manifest).map_err(|_| bad("the manifest"))?;
    let config = blob(parsed["config"]["digest"].as_str().unwrap_or_default())?;
    let [layer] = parsed["layers"].as_array().map(Vec::as_slice).unwrap_or_default() else {
        return Err(bad("the image has not exactly one layer"));
    };
    let layer = blob(layer["digest"].as_str().unwrap_or_default())?;
    Ok(Image {
        name: entry["annotations"][REF_NAME_ANNOTATION]
            .as_str()
            .unwrap_or_default()
            .to_string(),
        manifest,
        config,
        layer,
    })
}

/// Writes `bytes` to `path` whole or not at all (a temp file renamed into place).
pub fn write_file(path: &Path, bytes: &[u8]) -> Result<(), BuildError> {
    let failed = |source| BuildError::Write {
        path: path.to_path_buf(),
        source,
    };
    let parent = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let mut file = tempfile::NamedTempFile::new_in(parent).map_err(failed)?;
    file.write_all(bytes).map_err(failed)?;
    file.persist(path).map_err(|e| failed(e.error))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/packages/sample-stack/.registry")
    }

    fn copy(from: &Path, to: &Path) {
        std::fs::create_dir_all(to).expect("mkdir");
        for entry in std::fs::read_dir(from).expect("read").flatten() {
            let target = to.join(entry.file_name());
            if entry.path().is_dir() {
                copy(&entry.path(), &target);
            } else {
                std::fs::copy(entry.path(), target).expect("copy");
            }
        }
    }

    #[test]
    fn the_same_package_gives_the_same_digest_whatever_its_files_times() {
        let dir = tempfile::tempdir().expect("temp dir");
        let root = dir.path().join(".registry");
        copy(&sample(), &root);
        let first = archive(&build(&root, "example.org/sample:v1").expect("build")).expect("archive");
        let again = archive(&build(&sample(), "example.org/sample:v1").expect("build")).expect("archive");
        assert_eq!(first, again, "a copy made now builds the same bytes as the original");
        let touched = std::fs::File::options()
            .append(true)
            .open(root.join("app.yaml"))
            .expect("open");
        touched
            .set_modified(std::time::SystemTime::now() + std::time::Duration::from_secs(3600))
            .expect("touch");
        let image = build(&root, "example.org/sample:v1").expect("build");
        assert_eq!(archive(&image).expect("archive"), first);
        std::fs::write(root.join("app.yaml"), "title: changed\n").expect("edit");
        let changed = build(&root, "example.org/sample:v1").expect("build");
        assert_ne!(changed.digest(), image.digest(), "a change of content is a new image");
    }

    #[test]
    fn an_archive_reads_back_as_the_image_it_holds() {
        let image = build(&sample(), "example.org/sample:v1").expect("build");
        let read = read_archive(&archive(&image).expect("archive")).expect("read");
        assert_eq!(read, image);
        let manifest: Value = serde_json::from_slice(&read.manifest).expect("json");
        assert_eq!(manifest["layers"].as_array().map(Vec::len), Some(1));
        let mut layer = tar::Archive::new(flate2::read::GzDecoder::new(read.layer.as_slice()));
        let names: Vec<String> = layer
            .entries()
            .expect("entries")
            .map(|e| e.expect("entry").path().expect("path").display().to_string())
            .collect();
        assert_eq!(
            names,
            [
                ".registry",
                ".registry/app.yaml",
                ".registry/install.yaml",
                ".registry/resources",
                ".registry/resources/widget.crd.yaml"
            ]
        );
    }

    #[cfg(unix)]
    #[test]
    fn a_symlink_is_refused() {
        let dir = tempfile::tempdir().expect("temp dir");
        copy(&sample(), dir.path());
        std::os::unix::fs::symlink("/etc/passwd", dir.path().join("passwd")).expect("symlink");
        let err = build(dir.path(), "x").expect_err("refused");
        assert!(matches!(err, BuildError::NotRegular(_)), "{err}");
    }
}
