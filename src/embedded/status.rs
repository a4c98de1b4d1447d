//! Kubernetes `Status` errors with the reasons and message formats kube-apiserver uses.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

/// One `details.causes` entry of an `Invalid` Status.
#[derive(Debug, Clone, PartialEq)]
pub struct Cause {
    pub reason: &'static str,
    pub field: String,
    pub message: String,
}

impl Cause {
    pub fn invalid(field: &str, value: &Value, detail: &str) -> Cause {
        Cause {
            reason: "FieldValueInvalid",
            field: field.to_string(),
            message: format!("Invalid value: {}: {detail}", go_value(value)),
        }
    }

    pub fn required(field: &str, detail: &str) -> Cause {
        let message = if detail.is_empty() {
            "Required value".to_string()
        } else {
            format!("Required value: {detail}")
        };
        Cause {
            reason: "FieldValueRequired",
            field: field.to_string(),
            message,
        }
    }

    pub fn too_long(field: &str, max: usize) -> Cause {
        Cause {
            reason: "FieldValueTooLong",
            field: field.to_string(),
            message: format!("Too long: must have at most {max} bytes"),
        }
    }

    pub fn other(reason: &'static str, field: &str, message: String) -> Cause {
        Cause {
            reason,
            field: field.to_string(),
            message,
        }
    }

    /// The `field: message` form used inside the Status message.
    fn summary(&self) -> String {
        format!("{}: {}", self.field, self.message)
    }
}

/// Renders a value the way Go's `%q`/`%v` shows it in field errors.
pub fn go_value(value: &Value) -> String {
    match value {
        Value::String(s) => format!("{s:?}"),
        other => other.to_string(),
    }
}

/// A failed request: rendered as a `Status` object with the HTTP code.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub code: u16,
    pub reason: &'static str,
    pub message: String,
    pub details: Value,
}

impl ApiError {
    pub fn new(code: u16, reason: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            code,
            reason,
            message: message.into(),
            details: Value::Null,
        }
    }

    fn with_details(mut self, name: &str, group: &str, kind: &str) -> ApiError {
        let mut details = json!({ "kind": kind });
        if !name.is_empty() {
            details["name"] = json!(name);
        }
        if !group.is_empty() {
            details["group"] = json!(group);
        }
        self.details = details;
        self
    }

    /// `configmaps "x" not found`; `qualified` is `resource[.group]`.
    pub fn not_found(group: &str, resource: &str, name: &str) -> ApiError {
        let qualified = qualified(group, resource);
        ApiError::new(404, "NotFound", format!("{qualified} \"{name}\" not found")).with_details(name, group, resource)
    }

    pub fn already_exists(group: &str, resource: &str, name: &str) -> ApiError {
        let qualified = qualified(group, resource);
        ApiError::new(409, "AlreadyExists", format!("{qualified} \"{name}\" already exists"))
            .with_details(name, group, resource)
    }

    pub fn conflict(group: &str, resource: &str, name: &str, why: &str) -> ApiError {
        let qualified = qualified(group, resource);
        ApiError::new(
            409,
            "Conflict",
            format!("Operation cannot be fulfilled on {qualified} \"{name}\": {why}"),
        )
        .with_details(name, group, resource)
    }

    pub fn stale(group: &str, resource: &str, name: &str) -> ApiError {
        ApiError::conflict(
            group,
            resource,
            name,
            "the object has been modified; please apply your changes to the latest version and try again",
        )
    }

    pub fn forbidden(group: &str, resource: &str, name: &str, why: &str) -> ApiError {
        let qualified = qualified(group, resource);
        ApiError::new(403, "Forbidden", format!("{qualified} \"{name}\" is forbidden: {why}"))
            .with_details(name, group, resource)
    }

    /// 422 with field causes; `kind` is the object's Kind, as the real server reports it.
    pub fn invalid(group: &str, kind: &str, name: &str, causes: Vec<Cause>) -> ApiError {
        let listed: Vec<String> = causes.iter().map(Cause::summary).collect();
        let summary = match listed.as_slice() {
            [one] => one.clone(),
            many => format!("[{}]", many.join(", ")),
        };
        let mut err = ApiError::new(422, "Invalid", format!("{kind} \"{name}\" is invalid: {summary}"))
            .with_details(name, group, kind);
        err.details["causes"] = causes
            .iter()
            .map(|c| json!({ "reason": c.reason, "message": c.message, "field": c.field }))
            .collect();
        err
    }

    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(400, "BadRequest", message)
    }

    pub fn path_not_found() -> ApiError {
        ApiError::new(404, "NotFound", "the server could not find the requested resource")
    }

    pub fn method_not_allowed() -> ApiError {
        ApiError::new(
            405,
            "MethodNotAllowed",
            "the server does not allow this method on the requested resource",
        )
    }

    pub fn unsupported_media_type(message: impl Into<String>) -> ApiError {
        ApiError::new(415, "UnsupportedMediaType", message)
    }

    pub fn unauthorized() -> ApiError {
        ApiError::new(401, "Unauthorized", "Unauthorized")
    }

    pub fn expired(message: impl Into<String>) -> ApiError {
        ApiError::new(410, "Expired", message)
    }

    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(500, "InternalError", message)
    }

    pub fn to_status(&self) -> Value {
        let mut status = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        });
        if !self.details.is_null() {
            status["details"] = self.details.clone();
        }
        status
    }
}

pub fn qualified(group: &str, resource: &str) -> String {
    if group.is_empty() {
        resource.to_string()
    } else {
        format!("{resource}.{group}")
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let code = StatusCode::from_u16(self.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        json_response(code, &self.to_status())
    }
}

pub fn json_response(code: StatusCode, body: &impl serde::Serialize) -> Response {
    // Serialising a `Value` or a served object cannot fail: every map key is a string.
    let text = serde_json::to_string(body).unwrap_or_default();
    (code, [(axum::http::header::CONTENT_TYPE, "application/json")], text).into_response()
}
