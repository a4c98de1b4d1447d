//! Which answer a failed API request got: every status-code check goes through these, so the
//! codes are named once.

/// True for 409 Conflict: someone else wrote first (a stale resourceVersion, or a name taken);
/// retry with a fresh copy.
pub fn is_conflict(err: &kube::Error) -> bool {
    has_code(err, 409)
}

/// True for 409 with reason `AlreadyExists`: a create found the name taken (a conflict of
/// versions is not this).
pub fn is_already_exists(err: &kube::Error) -> bool {
    matches!(err, kube::Error::Api(status) if status.code == 409 && status.reason == "AlreadyExists")
}

/// True for 404 Not Found.
pub fn is_not_found(err: &kube::Error) -> bool {
    has_code(err, 404)
}

/// True for 404 or 409: the object is gone, or changed since the copy a request was made from.
pub fn is_gone_or_conflict(err: &kube::Error) -> bool {
    is_not_found(err) || is_conflict(err)
}

/// True for 403 Forbidden: the credentials lack a permission.
pub fn is_forbidden(err: &kube::Error) -> bool {
    has_code(err, 403)
}

/// True for 422 Unprocessable Entity: the request is invalid (a failed validation, or a JSON
/// patch whose test failed).
pub fn is_unprocessable(err: &kube::Error) -> bool {
    has_code(err, 422)
}

/// The message of the server's answer (empty for a failure that got none).
pub fn answer_message(err: &kube::Error) -> &str {
    match err {
        kube::Error::Api(status) => &status.message,
        _ => "",
    }
}

fn has_code(err: &kube::Error, code: u16) -> bool {
    matches!(err, kube::Error::Api(status) if status.code == code)
}
