//! The command-line tools some tests run: kubectl and helm, as `scripts/test` installs them.

use std::path::{Path, PathBuf};

/// `name` from PATH (scripts/test puts .tools/bin there), else from the repository's .tools/bin.
pub(crate) fn tool(name: &str) -> PathBuf {
    let on_path = std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).map(|p| p.join(name)).collect::<Vec<_>>())
        .unwrap_or_default();
    let bundled = Path::new(env!("CARGO_MANIFEST_DIR")).join(".tools/bin").join(name);
    on_path
        .into_iter()
        .chain([bundled])
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("{name} not found on PATH or in .tools/bin: run the tests with scripts/test"))
}

pub(crate) fn kubectl() -> PathBuf {
    tool("kubectl")
}
