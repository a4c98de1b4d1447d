//! Package authoring without a cluster or a container engine (issue 49): `stackd package init`
//! writes a new package, `check` gives every verdict the daemon would give an install of it (with
//! the daemon's own functions), `build` writes its image as an OCI archive, `push` sends it to a
//! registry.

pub mod build;
pub mod check;
pub mod init;
pub mod push;
