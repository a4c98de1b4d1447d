use std::os::unix::fs::{PermissionsExt, symlink};

use super::*;

/// A package-like tree: two files, a nested directory, a link to a file beside it.
fn tree() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    let root = dir.path().join("src");
    fs::create_dir_all(root.join("resources/deep")).expect("dirs");
    fs::write(root.join("app.yaml"), "title: t\n").expect("app");
    fs::write(root.join("resources/deep/w.crd.yaml"), "kind: CRD\n").expect("crd");
    symlink("../app.yaml", root.join("resources/app-link.yaml")).expect("link");
    dir
}

fn limits(entries: usize, bytes: u64, depth: usize) -> Limits {
    Limits { entries, bytes, depth }
}

#[test]
fn a_normal_tree_is_copied_with_its_links_and_again_over_itself() {
    let dir = tree();
    let (src, dest) = (dir.path().join("src"), dir.path().join("dest"));
    let copied = copy_tree(&src, &dest, &Limits::PACKAGE).expect("copied");
    assert_eq!(copied, Copied { entries: 5, bytes: 19 });
    assert_eq!(
        fs::read_to_string(dest.join("resources/deep/w.crd.yaml")).unwrap(),
        "kind: CRD\n"
    );
    assert_eq!(
        fs::read_link(dest.join("resources/app-link.yaml")).unwrap(),
        Path::new("../app.yaml")
    );
    assert_eq!(
        fs::read_to_string(dest.join("resources/app-link.yaml")).unwrap(),
        "title: t\n"
    );
    // A restarted pod copies into what the first run left.
    fs::write(src.join("app.yaml"), "title: u\n").unwrap();
    copy_tree(&src, &dest, &Limits::PACKAGE).expect("copied again");
    assert_eq!(fs::read_to_string(dest.join("app.yaml")).unwrap(), "title: u\n");
}

#[test]
fn a_tree_past_each_bound_is_refused_naming_the_bound_and_the_path() {
    let dir = tree();
    let src = dir.path().join("src");
    let err = copy_tree(&src, &dir.path().join("a"), &limits(4, 1 << 20, 8)).unwrap_err();
    assert!(matches!(err, CopyError::TooManyEntries { limit: 4, .. }), "{err}");
    assert!(err.to_string().contains("more than 4 files"), "{err}");

    let err = copy_tree(&src, &dir.path().join("b"), &limits(100, 12, 8)).unwrap_err();
    let CopyError::TooManyBytes { limit: 12, path } = &err else {
        panic!("{err}")
    };
    assert!(path.ends_with("w.crd.yaml"), "{err}");
    assert!(err.to_string().contains("more than 12 bytes"), "{err}");

    let err = copy_tree(&src, &dir.path().join("c"), &limits(100, 1 << 20, 1)).unwrap_err();
    let CopyError::TooDeep { limit: 1, path } = &err else {
        panic!("{err}")
    };
    assert!(path.ends_with("resources/deep"), "{err}");
    assert!(err.to_string().contains("nested more than 1 directories"), "{err}");
}

#[test]
fn links_out_of_the_tree_or_to_directories_are_refused() {
    for (target, why) in [
        ("../../outside", "points outside the tree"),
        ("/etc/passwd", "is an absolute path"),
        ("deep", "is not a regular file"),
        ("missing.yaml", "does not exist in the tree"),
    ] {
        let dir = tree();
        let src = dir.path().join("src");
        fs::write(dir.path().join("outside"), "secret").unwrap();
        symlink(target, src.join("resources/bad")).unwrap();
        let err = copy_tree(&src, &dir.path().join("dest"), &Limits::PACKAGE).unwrap_err();
        assert!(
            matches!(err, CopyError::Link { why: w, .. } if w == why),
            "{target}: {err}"
        );
        assert!(err.to_string().contains("resources/bad"), "{err}");
    }
    // Through another link: `up` is `..` from inside, `up/../outside` would leave the tree.
    let dir = tree();
    let src = dir.path().join("src");
    symlink("../app.yaml", src.join("resources/deep/up")).unwrap();
    symlink("deep/up/../../outside", src.join("resources/bad")).unwrap();
    let err = copy_tree(&src, &dir.path().join("dest"), &Limits::PACKAGE).unwrap_err();
    assert!(
        matches!(
            err,
            CopyError::Link {
                why: "passes through another link",
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn the_source_must_be_a_directory_and_no_link_is_followed_to_reach_it() {
    let dir = tree();
    let link = dir.path().join("link");
    symlink(dir.path().join("src"), &link).unwrap();
    let err = copy_tree(&link, &dir.path().join("dest"), &Limits::PACKAGE).unwrap_err();
    assert!(matches!(err, CopyError::NotDirectory(_)), "{err}");
    assert!(!dir.path().join("dest").exists(), "nothing was copied");
}

#[test]
fn copy_self_writes_an_executable_copy_of_the_running_binary() {
    let dir = tempfile::tempdir().expect("temp dir");
    let dest = dir.path().join("stackd");
    let bytes = copy_self(&dest).expect("copied");
    let metadata = fs::metadata(&dest).unwrap();
    assert_eq!(metadata.len(), bytes);
    assert_eq!(metadata.permissions().mode() & 0o777, 0o755);
    assert_eq!(bytes, fs::metadata(std::env::current_exe().unwrap()).unwrap().len());
}
