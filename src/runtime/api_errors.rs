//! Which answer a failed API request got.

/// True for 409 Conflict: someone else wrote first; retry with a fresh copy.
pub fn is_conflict(err: &kube::Error) -> bool {
    matches!(err, kube::Error::Api(status) if status.code == 409)
}

/// True for 404 Not Found.
pub fn is_not_found(err: &kube::Error) -> bool {
    matches!(err, kube::Error::Api(status) if status.code == 404)
}
