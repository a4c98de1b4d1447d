//! Defaults kube-apiserver applies to built-in kinds on create and update.

use serde_json::{Map, Value, json};

use super::discovery::ResourceInfo;

/// The object at `path` below `root`, created (replacing non-objects) on the way.
fn object_at<'a>(root: &'a mut Value, path: &[&str]) -> Option<&'a mut Map<String, Value>> {
    let mut current = root;
    for key in path {
        let map = current.as_object_mut()?;
        let child = map.entry(key.to_string()).or_insert_with(|| json!({}));
        if !child.is_object() {
            *child = json!({});
        }
        current = child;
    }
    current.as_object_mut()
}

fn default_at(root: &mut Value, path: &[&str], key: &str, value: Value) {
    if let Some(map) = object_at(root, path) {
        let slot = map.entry(key.to_string()).or_insert(Value::Null);
        if slot.is_null() {
            *slot = value;
        }
    }
}

/// Defaults applied on create and update that clients of the real server observe (a controller
/// comparing desired with actual state must cope with them here as there).
pub fn apply_builtin_defaults(info: &ResourceInfo, object: &mut Value, uid: &str) {
    match (info.group.as_str(), info.plural.as_str()) {
        ("", "secrets") => {
            default_at(object, &[], "type", json!("Opaque"));
            merge_string_data(object);
        }
        ("", "namespaces") => default_namespace(object),
        ("", "pods") => {
            default_at(object, &["status"], "phase", json!("Pending"));
            default_pod_spec(object, &["spec"]);
        }
        ("", "serviceaccounts") | ("", "configmaps") => {}
        ("apps", "deployments") => {
            default_replicated(object);
            default_at(object, &["spec"], "progressDeadlineSeconds", json!(600));
            let rolling =
                json!({"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "25%", "maxSurge": "25%"}});
            default_at(object, &["spec"], "strategy", rolling);
        }
        ("apps", "replicasets") => default_replicated(object),
        ("batch", "jobs") => default_job(object, uid),
        ("networking.k8s.io", "networkpolicies") => super::kinds::network_policy::apply_defaults(object),
        _ => {}
    }
}

fn default_namespace(namespace: &mut Value) {
    let name = namespace["metadata"]["name"].clone();
    default_at(namespace, &["spec"], "finalizers", json!(["kubernetes"]));
    default_at(namespace, &["status"], "phase", json!("Active"));
    // Set by the server on every namespace since 1.21, whatever the client sent.
    if let Some(labels) = object_at(namespace, &["metadata", "labels"]) {
        labels.insert("kubernetes.io/metadata.name".into(), name);
    }
}

fn default_replicated(object: &mut Value) {
    default_at(object, &["spec"], "replicas", json!(1));
    default_at(object, &["spec"], "revisionHistoryLimit", json!(10));
    default_at(object, &["spec"], "minReadySeconds", json!(0));
    default_pod_spec(object, &["spec", "template", "spec"]);
}

/// The PodSpec defaults every pod-bearing kind gets.
fn default_pod_spec(object: &mut Value, path: &[&str]) {
    let Some(spec) = object_at(object, path) else {
        return;
    };
    let defaults = [
        ("restartPolicy", json!("Always")),
        ("terminationGracePeriodSeconds", json!(30)),
        ("dnsPolicy", json!("ClusterFirst")),
        ("securityContext", json!({})),
        ("schedulerName", json!("default-scheduler")),
    ];
    for (key, value) in defaults {
        spec.entry(key).or_insert(value);
    }
    for list in ["containers", "initContainers"] {
        let containers = spec.get_mut(list).and_then(Value::as_array_mut);
        for container in containers.into_iter().flatten() {
            default_container(container);
        }
    }
}

fn default_container(container: &mut Value) {
    let image = container["image"].as_str().unwrap_or_default();
    // The registry's port is not a tag: look for ':' after the last '/'.
    let tag = image
        .rsplit('/')
        .next()
        .and_then(|last| last.split_once(':'))
        .map(|(_, t)| t);
    let pull = if image.contains('@') || tag.is_some_and(|t| t != "latest") {
        "IfNotPresent"
    } else {
        "Always"
    };
    default_at(container, &[], "imagePullPolicy", json!(pull));
    default_at(container, &[], "terminationMessagePath", json!("/dev/termination-log"));
    default_at(container, &[], "terminationMessagePolicy", json!("File"));
    default_at(container, &[], "resources", json!({}));
    for port in container
        .get_mut("ports")
        .and_then(Value::as_array_mut)
        .into_iter()
        .flatten()
    {
        default_at(port, &[], "protocol", json!("TCP"));
    }
}

/// `stringData` is write-only: the server folds it into `data`, base64-encoded.
fn merge_string_data(secret: &mut Value) {
    use base64::Engine;
    let Some(string_data) = secret.as_object_mut().and_then(|m| m.remove("stringData")) else {
        return;
    };
    let Some(entries) = string_data.as_object() else {
        return;
    };
    for (key, value) in entries {
        let text = value.as_str().unwrap_or_default();
        let encoded = base64::engine::general_purpose::STANDARD.encode(text);
        default_at(secret, &[], "data", json!({}));
        if let Some(data) = secret["data"].as_object_mut() {
            data.insert(key.clone(), json!(encoded));
        }
    }
}

/// Job defaults: the `controller-uid`/`job-name` labels and the selector pinned to this Job's uid.
fn default_job(job: &mut Value, uid: &str) {
    let name = job["metadata"]["name"].as_str().unwrap_or_default().to_string();
    default_at(job, &["spec"], "backoffLimit", json!(6));
    default_at(job, &["spec"], "completions", json!(1));
    default_at(job, &["spec"], "parallelism", json!(1));
    if job["spec"]["selector"].is_null() {
        default_at(
            job,
            &["spec"],
            "selector",
            json!({"matchLabels": {"controller-uid": uid}}),
        );
    }
    default_at(job, &["spec"], "completionMode", json!("NonIndexed"));
    default_at(job, &["spec"], "suspend", json!(false));
    let labels = ["spec", "template", "metadata", "labels"];
    default_at(job, &labels, "controller-uid", json!(uid));
    default_at(job, &labels, "job-name", json!(name));
    default_pod_spec(job, &["spec", "template", "spec"]);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::embedded::discovery::Resources;
    use crate::embedded::store::Store;

    fn info(group: &str, plural: &str) -> ResourceInfo {
        Resources::current(&Store::new()).find(group, "v1", plural).unwrap()
    }

    #[test]
    fn job_defaults_label_the_pod_template_with_the_uid() {
        let job_info = info("batch", "jobs");
        let mut job = json!({"metadata": {"name": "j"}, "spec": {"template": {"spec": {}}}});
        apply_builtin_defaults(&job_info, &mut job, "u-1");
        assert_eq!(job["spec"]["template"]["metadata"]["labels"]["controller-uid"], "u-1");
        assert_eq!(job["spec"]["template"]["metadata"]["labels"]["job-name"], "j");
        assert_eq!(job["spec"]["selector"]["matchLabels"]["controller-uid"], "u-1");
        assert_eq!(job["spec"]["backoffLimit"], 6);
    }

    #[test]
    fn secret_string_data_is_folded_into_base64_data() {
        let secret = info("", "secrets");
        let mut obj = json!({"metadata": {"name": "s"}, "data": {"a": "YQ=="}, "stringData": {"b": "b"}});
        apply_builtin_defaults(&secret, &mut obj, "u");
        assert_eq!(
            obj,
            json!({"metadata": {"name": "s"}, "type": "Opaque", "data": {"a": "YQ==", "b": "Yg=="}})
        );
    }

    #[test]
    fn pod_templates_get_container_defaults() {
        let deploy = info("apps", "deployments");
        let mut obj = json!({"metadata": {"name": "d"}, "spec": {"template": {"spec": {"containers": [
            {"name": "a", "image": "reg:5000/x"}, {"name": "b", "image": "x:1.0", "ports": [{"containerPort": 80}]}]}}}});
        apply_builtin_defaults(&deploy, &mut obj, "u");
        let containers = &obj["spec"]["template"]["spec"]["containers"];
        assert_eq!(containers[0]["imagePullPolicy"], "Always");
        assert_eq!(containers[1]["imagePullPolicy"], "IfNotPresent");
        assert_eq!(containers[1]["ports"][0]["protocol"], "TCP");
        assert_eq!(obj["spec"]["template"]["spec"]["restartPolicy"], "Always");
        assert_eq!(obj["spec"]["strategy"]["type"], "RollingUpdate");
    }

    #[test]
    fn namespaces_are_labelled_with_their_name() {
        let mut ns = json!({"metadata": {"name": "team-a"}});
        apply_builtin_defaults(&info("", "namespaces"), &mut ns, "u");
        assert_eq!(ns["metadata"]["labels"]["kubernetes.io/metadata.name"], "team-a");
    }
}
