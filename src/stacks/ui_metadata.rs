//! What a package says about its kinds for user interfaces, kept on its CRDs as annotations, as
//! Crossplane's stack manager did (v0.8–v0.10, the `stacks.crossplane.io/` keys UIs of that era
//! read):
//!
//! - `*resource.yaml` (`id` = the kind, any case; title, plural title, category, readme, overviews)
//!   for the CRDs of that kind in its directory or below, the nearest file winning;
//! - `group.yaml` (title, category, readme, overviews) for every CRD in its directory or below;
//! - `*icon.*` (`icon.svg` and the like, or `<kind>.icon.png`) as a `data:` URI, the nearest one;
//! - `*ui-schema.yaml` (`ui-schema.yaml` or `<kind>.ui-schema.yaml`), every one that applies,
//!   joined as a YAML stream;
//! - the app's title on every CRD.
//!
//! Each file is bounded before it is read, and the annotations of one CRD together; past a bound
//! the package is refused with the file and the bound named (an API server refuses more than
//! 256 KiB of annotations on one object).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use base64::Engine;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use serde::Deserialize;

/// The annotations' prefix.
pub const PREFIX: &str = "stacks.crossplane.io/";
pub use crate::bounds::{MAX_UI_METADATA_CRD_BYTES as MAX_CRD_BYTES, MAX_UI_METADATA_FILE_BYTES as MAX_FILE_BYTES};

/// Why a package's UI metadata was refused.
#[derive(Debug, thiserror::Error)]
pub enum MetadataError {
    #[error("{path} is {bytes} bytes, more than the {MAX_FILE_BYTES} a package's UI metadata file may have: shrink it")]
    FileTooLarge { path: PathBuf, bytes: u64 },
    #[error("cannot read {path}: {message}")]
    Read { path: PathBuf, message: String },
    #[error("{path} is not valid YAML for {what}: {message}")]
    Parse {
        path: PathBuf,
        what: &'static str,
        message: String,
    },
    #[error(
        "the UI metadata of CRD {crd} adds up to {bytes} bytes, more than the {MAX_CRD_BYTES} one CRD may carry: shrink its icon, ui-schema or readme"
    )]
    CrdTooLarge { crd: String, bytes: usize },
}

/// A `*resource.yaml`: what one kind is called and says about itself.
#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct ResourceFile {
    #[serde(default)]
    id: String,
    title: Option<String>,
    title_plural: Option<String>,
    category: Option<String>,
    readme: Option<String>,
    overview: Option<String>,
    overview_short: Option<String>,
}

/// A `group.yaml`: the same for every kind below it.
#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct GroupFile {
    title: Option<String>,
    category: Option<String>,
    readme: Option<String>,
    overview: Option<String>,
    overview_short: Option<String>,
}

/// The package's metadata files, read.
pub struct UiMetadata {
    resources: Vec<(PathBuf, ResourceFile)>,
    groups: Vec<(PathBuf, GroupFile)>,
    /// Icons as `data:` URIs, by path.
    icons: Vec<(PathBuf, String)>,
    ui_schemas: Vec<(PathBuf, String)>,
    title: Option<String>,
}

/// Reads every metadata file among `files` (paths relative to the package root, `root` joined to
/// read them); each problem is returned beside what could be read.
pub fn read(root: &Path, files: &[PathBuf], title: Option<&str>) -> (UiMetadata, Vec<MetadataError>) {
    let mut metadata = UiMetadata {
        resources: Vec::new(),
        groups: Vec::new(),
        icons: Vec::new(),
        ui_schemas: Vec::new(),
        title: title.map(str::to_string),
    };
    let mut problems = Vec::new();
    for file in files {
        let Some(name) = file.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        let full = root.join(file);
        let result = if name == "group.yaml" {
            read_yaml(&full, "a group.yaml").map(|group| metadata.groups.push((file.clone(), group)))
        } else if name.ends_with("resource.yaml") {
            read_yaml(&full, "a resource.yaml").map(|resource| metadata.resources.push((file.clone(), resource)))
        } else if name.ends_with("ui-schema.yaml") {
            read_bounded(&full)
                .and_then(|bytes| text(&full, bytes))
                .map(|schema| metadata.ui_schemas.push((file.clone(), schema)))
        } else if let Some(media_type) = icon_media_type(name) {
            read_bounded(&full).map(|bytes| {
                let data = base64::engine::general_purpose::STANDARD.encode(bytes);
                metadata
                    .icons
                    .push((file.clone(), format!("data:{media_type};base64,{data}")));
            })
        } else {
            Ok(())
        };
        if let Err(problem) = result {
            problems.push(problem);
        }
    }
    (metadata, problems)
}

/// The media type of an icon file (`*icon.<ext>`), if `name` is one.
fn icon_media_type(name: &str) -> Option<&'static str> {
    let (stem, extension) = name.rsplit_once('.')?;
    if !stem.ends_with("icon") {
        return None;
    }
    match extension.to_ascii_lowercase().as_str() {
        "svg" => Some("image/svg+xml"),
        "png" => Some("image/png"),
        "jpg" | "jpeg" => Some("image/jpeg"),
        "gif" => Some("image/gif"),
        _ => None,
    }
}

fn read_bounded(path: &Path) -> Result<Vec<u8>, MetadataError> {
    let read_error = |e: std::io::Error| MetadataError::Read {
        path: path.to_path_buf(),
        message: e.to_string(),
    };
    let bytes = std::fs::metadata(path).map_err(read_error)?.len();
    if bytes > MAX_FILE_BYTES {
        return Err(MetadataError::FileTooLarge {
            path: path.to_path_buf(),
            bytes,
        });
    }
    std::fs::read(path).map_err(read_error)
}

fn text(path: &Path, bytes: Vec<u8>) -> Result<String, MetadataError> {
    String::from_utf8(bytes).map_err(|_| MetadataError::Read {
        path: path.to_path_buf(),
        message: "it is not UTF-8 text".into(),
    })
}

fn read_yaml<T: for<'de> Deserialize<'de>>(path: &Path, what: &'static str) -> Result<T, MetadataError> {
    let source = text(path, read_bounded(path)?)?;
    serde_saphyr::from_str(&source).map_err(|e| MetadataError::Parse {
        path: path.to_path_buf(),
        what,
        message: e.to_string(),
    })
}

/// True when a file in `file_dir` speaks of CRDs in `crd_dir`: the same directory or one above.
fn covers(file_dir: &Path, crd_dir: &Path) -> bool {
    crd_dir.starts_with(file_dir)
}

/// True when a file named `name` is for `kind`: the package-wide `general` name, or `<kind>.…`.
fn names_kind(name: &str, general: &[&str], kind: &str) -> bool {
    general.contains(&name) || name.starts_with(&format!("{}.", kind.to_ascii_lowercase()))
}

impl UiMetadata {
    /// Puts the annotations that apply to `crd`, read from `crd_file` (relative to the package root).
    pub fn annotate(&self, crd: &mut CustomResourceDefinition, crd_file: &Path) -> Result<(), MetadataError> {
        let crd_dir = crd_file.parent().unwrap_or(Path::new(""));
        let kind = crd.spec.names.kind.clone();
        let dir_of = |path: &Path| path.parent().map(Path::to_path_buf).unwrap_or_default();
        let name_of = |path: &Path| path.file_name().and_then(|n| n.to_str()).unwrap_or("").to_string();
        let mut found = BTreeMap::new();
        let mut put = |key: &str, value: Option<&String>| {
            if let Some(value) = value {
                found.insert(format!("{PREFIX}{key}"), value.clone());
            }
        };
        put("stack-title", self.title.as_ref());
        // The nearest file wins: the deepest directory, then the last path.
        let nearest = |paths: &mut Vec<&PathBuf>| {
            paths.sort();
            paths.pop().cloned()
        };
        let mut groups: Vec<&PathBuf> = self
            .groups
            .iter()
            .map(|(path, _)| path)
            .filter(|path| covers(&dir_of(path), crd_dir))
            .collect();
        if let Some(path) = nearest(&mut groups)
            && let Some((_, group)) = self.groups.iter().find(|(p, _)| *p == path)
        {
            put("group-title", group.title.as_ref());
            put("group-category", group.category.as_ref());
            put("group-readme", group.readme.as_ref());
            put("group-overview", group.overview.as_ref());
            put("group-overview-short", group.overview_short.as_ref());
        }
        let mut resources: Vec<&PathBuf> = self
            .resources
            .iter()
            .filter(|(path, resource)| resource.id.eq_ignore_ascii_case(&kind) && covers(&dir_of(path), crd_dir))
            .map(|(path, _)| path)
            .collect();
        if let Some(path) = nearest(&mut resources)
            && let Some((_, resource)) = self.resources.iter().find(|(p, _)| *p == path)
        {
            put("resource-title", resource.title.as_ref());
            put("resource-title-plural", resource.title_plural.as_ref());
            put("resource-category", resource.category.as_ref());
            put("resource-readme", resource.readme.as_ref());
            put("resource-overview", resource.overview.as_ref());
            put("resource-overview-short", resource.overview_short.as_ref());
        }
        const ICONS: [&str; 5] = ["icon.svg", "icon.png", "icon.jpg", "icon.jpeg", "icon.gif"];
        let mut icons: Vec<&PathBuf> = self
            .icons
            .iter()
            .map(|(path, _)| path)
            .filter(|path| covers(&dir_of(path), crd_dir) && names_kind(&name_of(path), &ICONS, &kind))
            .collect();
        if let Some(path) = nearest(&mut icons) {
            put(
                "icon-data-uri",
                self.icons.iter().find(|(p, _)| *p == path).map(|(_, uri)| uri),
            );
        }
        let mut schemas: Vec<&(PathBuf, String)> = self
            .ui_schemas
            .iter()
            .filter(|(path, _)| {
                covers(&dir_of(path), crd_dir) && names_kind(&name_of(path), &["ui-schema.yaml"], &kind)
            })
            .collect();
        schemas.sort_by(|a, b| b.0.cmp(&a.0));
        if !schemas.is_empty() {
            let joined = schemas
                .iter()
                .map(|(_, schema)| schema.trim_matches('\n'))
                .collect::<Vec<_>>()
                .join("\n---\n");
            put("ui-schema", Some(&joined));
        }
        let bytes: usize = found.iter().map(|(key, value)| key.len() + value.len()).sum();
        if bytes > MAX_CRD_BYTES {
            return Err(MetadataError::CrdTooLarge {
                crd: crd.metadata.name.clone().unwrap_or_default(),
                bytes,
            });
        }
        if !found.is_empty() {
            crd.metadata.annotations.get_or_insert_default().extend(found);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn crd(kind: &str) -> CustomResourceDefinition {
        serde_json::from_value(json!({
            "metadata": {"name": format!("{}s.example.org", kind.to_lowercase())},
            "spec": {"group": "example.org", "names": {"kind": kind, "plural": format!("{}s", kind.to_lowercase())},
                     "scope": "Namespaced", "versions": []},
        }))
        .expect("crd")
    }

    fn package(files: &[(&str, &[u8])]) -> (tempfile::TempDir, Vec<PathBuf>) {
        let dir = tempfile::tempdir().expect("temp dir");
        for (path, bytes) in files {
            let full = dir.path().join(path);
            std::fs::create_dir_all(full.parent().expect("parent")).expect("mkdir");
            std::fs::write(full, bytes).expect("write");
        }
        let paths = files.iter().map(|(p, _)| PathBuf::from(p)).collect();
        (dir, paths)
    }

    #[test]
    fn resource_group_icon_and_ui_schema_files_annotate_the_crds_below_them() {
        let (dir, files) = package(&[
            ("icon.svg", b"<svg/>"),
            ("resources/group.yaml", b"title: Databases\ncategory: Database\n"),
            ("resources/sql/instance.resource.yaml", b"id: instance\ntitle: SQL Instance\ntitlePlural: SQL Instances\ncategory: Database\nreadme: |\n  # Hi\n"),
            ("resources/sql/instance.ui-schema.yaml", b"\nversion: 0.5\nconfigSections: []\n"),
            ("resources/sql/ui-schema.yaml", b"configSections: []\n"),
            ("resources/sql/instance.icon.png", b"\x89PNG"),
            ("resources/other/bucket.resource.yaml", b"id: bucket\ntitle: Bucket\n"),
        ]);
        let (metadata, problems) = read(dir.path(), &files, Some("Sample"));
        assert!(problems.is_empty());
        let mut instance = crd("Instance");
        metadata
            .annotate(&mut instance, Path::new("resources/sql/instance.crd.yaml"))
            .expect("annotated");
        let annotations = instance.metadata.annotations.expect("annotations");
        let get = |key: &str| annotations.get(&format!("{PREFIX}{key}")).cloned();
        assert_eq!(get("stack-title").as_deref(), Some("Sample"));
        assert_eq!(get("group-title").as_deref(), Some("Databases"));
        assert_eq!(get("resource-title").as_deref(), Some("SQL Instance"));
        assert_eq!(get("resource-title-plural").as_deref(), Some("SQL Instances"));
        assert_eq!(get("resource-readme").as_deref(), Some("# Hi\n"));
        assert_eq!(
            get("icon-data-uri").as_deref(),
            Some("data:image/png;base64,iVBORw=="),
            "the nearest icon"
        );
        assert_eq!(
            get("ui-schema").as_deref(),
            Some("configSections: []\n---\nversion: 0.5\nconfigSections: []"),
            "every ui-schema that applies, the last path first"
        );
        // A kind elsewhere gets the package-wide icon and no other kind's resource file.
        let mut widget = crd("Widget");
        metadata
            .annotate(&mut widget, Path::new("resources/widget.crd.yaml"))
            .expect("annotated");
        let annotations = widget.metadata.annotations.expect("annotations");
        assert_eq!(
            annotations[&format!("{PREFIX}icon-data-uri")],
            "data:image/svg+xml;base64,PHN2Zy8+"
        );
        assert!(!annotations.contains_key(&format!("{PREFIX}resource-title")));
    }

    #[test]
    fn files_and_crds_past_their_bounds_are_refused_by_name() {
        let big = vec![b'x'; MAX_FILE_BYTES as usize + 1];
        let (dir, files) = package(&[("icon.svg", &big)]);
        let (_, problems) = read(dir.path(), &files, None);
        assert!(
            matches!(&problems[..], [MetadataError::FileTooLarge { .. }]),
            "{problems:?}"
        );
        let near = vec![b'x'; MAX_FILE_BYTES as usize];
        let (dir, files) = package(&[
            ("icon.svg", &near),
            ("ui-schema.yaml", &near),
            ("a.resource.yaml", b"id: a\n"),
        ]);
        let (metadata, problems) = read(dir.path(), &files, None);
        assert!(problems.is_empty());
        let err = metadata
            .annotate(&mut crd("A"), Path::new("a.crd.yaml"))
            .expect_err("too large");
        assert!(err.to_string().contains("shrink its icon"), "{err}");
    }
}
