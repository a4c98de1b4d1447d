//! The copy tool of package pods (DESIGN.md §3.2). A package image may hold nothing but its
//! `.registry` (FROM scratch, as `stackd package build` writes it) and stackd's image nothing but its
//! static binary, so neither has a `cp`. A first init container of stackd's image copies the binary
//! into an emptyDir ([`copy_self`]); the container of the package image then runs that copy
//! (`stackd copy`, [`copy_tree`]) to copy the package's files out. The tree is the tenant's: the copy
//! is bounded like every other piece of work on tenant input, and never follows a link.

use std::fs::{self, File};
use std::io::{self, Read};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Component, Path, PathBuf};

use k8s_openapi::api::core::v1::{Container, EmptyDirVolumeSource, Volume, VolumeMount};

/// The emptyDir holding stackd's binary for the containers of other images.
pub const TOOLS_VOLUME: &str = "stackd-tools";
pub const TOOLS_DIR: &str = "/stackd-tools";
/// Where [`copy_self`] puts the binary in the pod.
pub const TOOLS_BINARY: &str = "/stackd-tools/stackd";
/// The init container that copies stackd's binary into [`TOOLS_VOLUME`].
pub const TOOLS_CONTAINER: &str = "stackd-tools";

/// What a package may hold, shared with `stackd package build` (which builds nothing larger): a
/// package is YAML, and the daemon reads at most 8 MiB of its unpacked output; this leaves room for
/// icons and README files.
pub const MAX_PACKAGE_BYTES: u64 = 64 * 1024 * 1024;
/// Files, directories and links a package may have.
pub const MAX_PACKAGE_ENTRIES: usize = 10_000;
/// How deep a package's directories may nest (real ones nest three or four levels).
pub const MAX_PACKAGE_DEPTH: usize = 32;

/// The bounds of one copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub entries: usize,
    pub bytes: u64,
    pub depth: usize,
}

impl Limits {
    /// The bounds on a package.
    pub const PACKAGE: Limits = Limits {
        entries: MAX_PACKAGE_ENTRIES,
        bytes: MAX_PACKAGE_BYTES,
        depth: MAX_PACKAGE_DEPTH,
    };
}

/// Why a tree was not (wholly) copied.
#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    #[error("{0} is not a directory: name the directory to copy")]
    NotDirectory(PathBuf),
    #[error("{path}: the tree holds more than {limit} files, directories and links, the bound on a package")]
    TooManyEntries { limit: usize, path: PathBuf },
    #[error("{path}: the tree's files hold more than {limit} bytes, the bound on a package")]
    TooManyBytes { limit: u64, path: PathBuf },
    #[error("{path} is nested more than {limit} directories deep, the bound on a package")]
    TooDeep { limit: usize, path: PathBuf },
    #[error(
        "{link} is a link to {target:?}, which {why}: a link is copied only when it names a file of the tree it is in, by a relative path"
    )]
    Link {
        link: PathBuf,
        target: PathBuf,
        why: &'static str,
    },
    #[error("{0} is neither a file, a directory nor a link: a package holds files and directories")]
    Special(PathBuf),
    #[error("{0} already exists and is not a directory, where the copy needs one (or the reverse)")]
    Conflict(PathBuf),
    #[error("cannot copy {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
}

fn io_error(path: &Path) -> impl FnOnce(io::Error) -> CopyError + '_ {
    move |source| CopyError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// What a copy copied.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Copied {
    pub entries: usize,
    pub bytes: u64,
}

/// Copies the tree under `src` into `dest` (created when missing; what is there already stays,
/// and a file of the same name is replaced, so a restarted pod copies again), within `limits`.
/// Links are copied as links, and only when they name a regular file of the tree.
pub fn copy_tree(src: &Path, dest: &Path, limits: &Limits) -> Result<Copied, CopyError> {
    let is_dir = fs::symlink_metadata(src).map_err(io_error(src))?.is_dir();
    if !is_dir {
        return Err(CopyError::NotDirectory(src.to_path_buf()));
    }
    make_dir(dest)?;
    let mut copied = Copied::default();
    let mut pending = vec![(PathBuf::new(), 0usize)];
    while let Some((relative, depth)) = pending.pop() {
        let dir = src.join(&relative);
        let mut entries = fs::read_dir(&dir)
            .map_err(io_error(&dir))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(io_error(&dir))?;
        entries.sort_by_key(|entry| entry.file_name());
        for entry in entries {
            let (from, name) = (entry.path(), relative.join(entry.file_name()));
            let to = dest.join(&name);
            copied.entries += 1;
            if copied.entries > limits.entries {
                return Err(CopyError::TooManyEntries {
                    limit: limits.entries,
                    path: from,
                });
            }
            let kind = entry.file_type().map_err(io_error(&from))?;
            if kind.is_dir() {
                if depth + 1 > limits.depth {
                    return Err(CopyError::TooDeep {
                        limit: limits.depth,
                        path: from,
                    });
                }
                make_dir(&to)?;
                pending.push((name, depth + 1));
            } else if kind.is_file() {
                let room = limits.bytes.saturating_sub(copied.bytes);
                copied.bytes += copy_file(&from, &to, room).map_err(|e| match e {
                    FileError::TooLarge => CopyError::TooManyBytes {
                        limit: limits.bytes,
                        path: from.clone(),
                    },
                    FileError::Copy(e) => e,
                })?;
            } else if kind.is_symlink() {
                let target = fs::read_link(&from).map_err(io_error(&from))?;
                check_link(src, &name, &target).map_err(|why| CopyError::Link {
                    link: from.clone(),
                    target: target.clone(),
                    why,
                })?;
                clear(&to)?;
                std::os::unix::fs::symlink(&target, &to).map_err(io_error(&to))?;
            } else {
                return Err(CopyError::Special(from));
            }
        }
    }
    Ok(copied)
}

/// Creates `dir` unless it is a directory already.
fn make_dir(dir: &Path) -> Result<(), CopyError> {
    match fs::symlink_metadata(dir) {
        Ok(metadata) if metadata.is_dir() => Ok(()),
        Ok(_) => Err(CopyError::Conflict(dir.to_path_buf())),
        Err(_) => fs::DirBuilder::new().mode(0o755).create(dir).map_err(io_error(dir)),
    }
}

/// Removes a file or link at `path`, so that creating one there never writes through a link.
fn clear(path: &Path) -> Result<(), CopyError> {
    match fs::symlink_metadata(path) {
        Ok(metadata) if metadata.is_dir() => Err(CopyError::Conflict(path.to_path_buf())),
        Ok(_) => fs::remove_file(path).map_err(io_error(path)),
        Err(_) => Ok(()),
    }
}

enum FileError {
    TooLarge,
    Copy(CopyError),
}

impl From<CopyError> for FileError {
    fn from(e: CopyError) -> Self {
        FileError::Copy(e)
    }
}

/// Copies one regular file of at most `room` bytes; its size is checked while it is read, so a
/// file that grows cannot pass the bound either.
fn copy_file(from: &Path, to: &Path, room: u64) -> Result<u64, FileError> {
    let listed = fs::symlink_metadata(from).map_err(io_error(from))?;
    if listed.len() > room {
        return Err(FileError::TooLarge);
    }
    let source = File::open(from).map_err(io_error(from))?;
    // Opening follows a link: one put in the file's place since it was listed is not copied.
    let opened = source.metadata().map_err(io_error(from))?;
    if !opened.is_file() || (opened.dev(), opened.ino()) != (listed.dev(), listed.ino()) {
        return Err(CopyError::Special(from.to_path_buf()).into());
    }
    let mode = if listed.mode() & 0o111 != 0 { 0o755 } else { 0o644 };
    clear(to)?;
    let mut target = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(to)
        .map_err(io_error(to))?;
    let written = io::copy(&mut source.take(room.saturating_add(1)), &mut target).map_err(io_error(to))?;
    if written > room {
        return Err(FileError::TooLarge);
    }
    Ok(written)
}

/// Why the link at `link` (relative to `root`) to `target` is not copied, if it is not: its target
/// must be relative, stay inside the tree without passing through another link, and be a regular
/// file (a link to a directory could make a loop for whoever walks the copy).
fn check_link(root: &Path, link: &Path, target: &Path) -> Result<(), &'static str> {
    if target.is_absolute() {
        return Err("is an absolute path");
    }
    let mut at: Vec<&std::ffi::OsStr> = link.parent().map(|p| p.iter().collect()).unwrap_or_default();
    let parts: Vec<Component> = target.components().collect();
    for (i, part) in parts.iter().enumerate() {
        match part {
            Component::CurDir => {}
            Component::ParentDir => {
                at.pop().ok_or("points outside the tree")?;
            }
            Component::Normal(name) => {
                at.push(name);
                let is_last = i + 1 == parts.len();
                let through_link = fs::symlink_metadata(root.join(at.iter().collect::<PathBuf>()))
                    .is_ok_and(|m| m.file_type().is_symlink());
                if !is_last && through_link {
                    return Err("passes through another link");
                }
            }
            Component::RootDir | Component::Prefix(_) => return Err("is an absolute path"),
        }
    }
    match fs::symlink_metadata(root.join(at.iter().collect::<PathBuf>())) {
        Ok(metadata) if metadata.is_file() => Ok(()),
        Ok(_) => Err("is not a regular file"),
        Err(_) => Err("does not exist in the tree"),
    }
}

/// Copies the running binary to `dest` (mode 0755), for containers of images without it. The
/// binary is `/proc/self/exe`, or the absolute path it was started by where `/proc` is not mounted.
pub fn copy_self(dest: &Path) -> Result<u64, CopyError> {
    let own = Path::new("/proc/self/exe");
    let started_as = std::env::args_os().next().map(PathBuf::from);
    let mut source = match File::open(own) {
        Ok(file) => (file, own.to_path_buf()),
        Err(e) => match started_as.filter(|p| p.is_absolute()) {
            Some(path) => (File::open(&path).map_err(io_error(&path))?, path),
            None => return Err(io_error(own)(e)),
        },
    };
    // Written aside and renamed: a restarted pod never runs a half-written binary.
    let partial = dest.with_extension("partial");
    clear(&partial)?;
    let mut target = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o755)
        .open(&partial)
        .map_err(io_error(&partial))?;
    let written = io::copy(&mut source.0, &mut target).map_err(|e| io_error(&source.1)(e))?;
    drop(target);
    fs::rename(&partial, dest).map_err(io_error(dest))?;
    Ok(written)
}

/// The command that copies `from` (in the container's image) to `to` with the copied binary.
pub fn copy_command(from: &str, to: &str) -> Vec<String> {
    vec![TOOLS_BINARY.into(), "copy".into(), from.into(), to.into()]
}

/// The emptyDir the binary is copied into.
pub fn tools_volume() -> Volume {
    Volume {
        name: TOOLS_VOLUME.into(),
        empty_dir: Some(EmptyDirVolumeSource::default()),
        ..Volume::default()
    }
}

/// The mount of [`tools_volume`]: read-only for the containers that run the binary.
pub fn tools_mount(read_only: bool) -> VolumeMount {
    VolumeMount {
        name: TOOLS_VOLUME.into(),
        mount_path: TOOLS_DIR.into(),
        read_only: read_only.then_some(true),
        ..VolumeMount::default()
    }
}

/// The first init container of a pod whose other containers run [`copy_command`]: stackd's image
/// copies its own binary into [`tools_volume`].
pub fn copy_self_container(stackd_image: &str) -> Container {
    Container {
        name: TOOLS_CONTAINER.into(),
        image: Some(stackd_image.to_string()),
        args: Some(vec!["copy-self".into(), TOOLS_BINARY.into()]),
        volume_mounts: Some(vec![tools_mount(false)]),
        ..Container::default()
    }
}

#[cfg(test)]
mod tests;
