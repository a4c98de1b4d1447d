//! CRD types only.
