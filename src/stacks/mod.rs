//! Stacks (DESIGN.md §3): the package format and, later, the install and stack controllers.

pub mod stream;
pub mod unpack;
