//! `ztunnel-cni`: a CNI 1.0 plugin, chained after the pod network's own
//! plugin, that enrols new pods with the node's ztunnel.
//!
//! One invocation, as a container runtime makes it:
//! - [`spec`] reads `CNI_COMMAND` and the other `CNI_*` variables, and the
//!   network configuration on stdin (ours: `ztunnelSocket`,
//!   `ztunnelTimeoutMs`, `ztunnelAdmin`, `kubernetes.{kubeconfig,timeoutMs}`,
//!   `excludeNamespaces`).
//! - [`kube`] asks the Kubernetes API server (through [`http`]) whether the
//!   pod is in the mesh (Istio's `istio.io/dataplane-mode` labels) and for
//!   its service account and uid.
//! - [`ztunnel`] sends the `add` (with the pod's network namespace as an
//!   fd), `del` or `keep` over ztunnel's enrolment socket.
//! - [`invoke`] prints the previous plugin's result (`ADD`), nothing
//!   (`DEL`, `CHECK`) or the specification's error document.
//!
//! Fail closed: an `ADD` for a pod that must be enrolled fails while the
//! API server cannot say so or ztunnel cannot enrol it, so that no such
//! pod starts outside the mesh; the kubelet retries the sandbox. Every
//! wait is bounded (`ztunnelTimeoutMs`, `kubernetes.timeoutMs`).

pub mod http;
pub mod kube;
pub mod spec;
pub mod ztunnel;

use serde_json::Value;

use crate::enrol::pod_record::{self, PodRecord};

use self::{
    kube::{ApiClient, KubeError, Selection},
    spec::{CniError, Command, Env, NetConf, code},
    ztunnel::{Presence, Removal, Workload},
};

/// What the binary prints on stdout, and whether it exits 0.
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    /// The document for stdout, if any (`DEL` and `CHECK` print nothing
    /// on success).
    pub stdout: Option<Value>,
    /// Exit 0.
    pub success: bool,
}

/// Runs one invocation: `get` reads the environment, `stdin` is the
/// network configuration. Log lines go to `tracing` (stderr in the
/// binary): stdout is the runtime's.
pub fn invoke(get: impl Fn(&str) -> Option<String>, stdin: &[u8]) -> Reply {
    let version = requested_version(stdin);
    let outcome = Env::parse(get).and_then(|env| run(&env, stdin));
    match outcome {
        Ok(stdout) => Reply {
            stdout,
            success: true,
        },
        Err(error) => {
            tracing::error!(code = error.code, "{error}");
            Reply {
                stdout: Some(error.to_json(&version)),
                success: false,
            }
        }
    }
}

/// The version to answer in: the configuration's, when it is one we
/// speak, else ours.
fn requested_version(stdin: &[u8]) -> String {
    serde_json::from_slice::<Value>(stdin)
        .ok()
        .and_then(|v| v.get("cniVersion")?.as_str().map(str::to_owned))
        .filter(|v| spec::SUPPORTED_VERSIONS.contains(&v.as_str()))
        .unwrap_or_else(|| spec::CNI_VERSION.to_owned())
}

fn run(env: &Env, stdin: &[u8]) -> Result<Option<Value>, CniError> {
    if env.command == Command::Version {
        return Ok(Some(spec::version_json()));
    }
    let conf = NetConf::parse(stdin)?;
    if env.command == Command::Check && conf.cni_version.starts_with("0.3.") {
        return Err(CniError::new(
            code::INCOMPATIBLE_VERSION,
            format!(
                "CHECK needs cniVersion 0.4.0 or later, not {}",
                conf.cni_version
            ),
            "",
        ));
    }
    match env.command {
        Command::Add => add(env, &conf).map(Some),
        Command::Del => del(env, &conf).map(|()| None),
        Command::Check => check(env, &conf).map(|()| None),
        Command::Version => unreachable!("answered above"),
    }
}

/// The single-threaded runtime the plugin's HTTP requests run on.
fn runtime() -> Result<tokio::runtime::Runtime, CniError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| {
            CniError::new(
                code::IO_FAILURE,
                "cannot start a tokio runtime",
                e.to_string(),
            )
        })
}

/// Whether a pod is enrolled.
#[derive(Debug)]
enum Decision {
    /// Not in the mesh, and why (for the log).
    PassThrough(String),
    /// In the mesh: the workload, and why.
    Enrol(Workload, &'static str),
}

/// Decides for the pod `CNI_ARGS` names. A pod that is not a Kubernetes
/// pod, or in an excluded namespace, costs no request; for any other, the
/// API server must answer, or the pod cannot be decided and the call fails
/// (naming the server).
fn decide(env: &Env, conf: &NetConf) -> Result<Decision, CniError> {
    let (Some(namespace), Some(name)) = (&env.pod.namespace, &env.pod.name) else {
        return Ok(Decision::PassThrough(
            "CNI_ARGS names no Kubernetes pod (K8S_POD_NAMESPACE, K8S_POD_NAME)".into(),
        ));
    };
    if conf.exclude_namespaces.contains(namespace) {
        return Ok(Decision::PassThrough(format!(
            "namespace {namespace} is in excludeNamespaces"
        )));
    }
    let pod_ref = format!("{namespace}/{name}");
    let fail = |e: KubeError| kube_error(&e, &pod_ref);
    let api = ApiClient::from_kubeconfig(&conf.kubernetes.kubeconfig, conf.kubernetes.timeout)
        .map_err(fail)?;
    let (pod, selection) = runtime()?
        .block_on(async {
            let pod = api.pod(namespace, name).await?;
            let selection = match kube::select_by_pod(&pod) {
                Some(s) => s,
                None => kube::select_by_namespace(&api.namespace(namespace).await?),
            };
            Ok((pod, selection))
        })
        .map_err(fail)?;
    let why = match selection {
        Selection::Skip(why) => return Ok(Decision::PassThrough(why.into())),
        Selection::Enrol(why) => why,
    };
    let uid = env
        .pod
        .uid
        .clone()
        .or_else(|| Some(pod.metadata.uid.clone()).filter(|u| !u.is_empty()))
        .ok_or_else(|| {
            CniError::new(
                code::KUBERNETES,
                format!("pod {pod_ref} has no uid: neither K8S_POD_UID in CNI_ARGS nor metadata.uid from {}", api.url()),
                "",
            )
        })?;
    if pod.spec.service_account_name.is_empty() {
        // Kubernetes always sets it; guessing `default` would give the pod
        // another workload's identity and policies.
        return Err(CniError::new(
            code::KUBERNETES,
            format!(
                "pod {pod_ref} has no spec.serviceAccountName at {}: its mesh identity is unknown",
                api.url()
            ),
            "",
        ));
    }
    Ok(Decision::Enrol(
        Workload {
            uid,
            name: name.clone(),
            namespace: namespace.clone(),
            service_account: pod.spec.service_account_name,
        },
        why,
    ))
}

fn kube_error(error: &KubeError, pod: &str) -> CniError {
    let code = match error {
        KubeError::Read { .. } => code::IO_FAILURE,
        KubeError::Kubeconfig { .. } => code::INVALID_CONFIG,
        KubeError::Unreachable { .. } => code::TRY_AGAIN_LATER,
        KubeError::Status { .. } | KubeError::Decode { .. } => code::KUBERNETES,
    };
    CniError::new(
        code,
        format!("cannot decide whether pod {pod} belongs in the mesh: {error}"),
        "",
    )
}

fn add(env: &Env, conf: &NetConf) -> Result<Value, CniError> {
    let result = conf.add_result()?;
    match decide(env, conf)? {
        Decision::PassThrough(why) => {
            tracing::info!(container = %env.container_id, pod = ?env.pod.name, "ADD: not enrolled: {why}");
        }
        Decision::Enrol(pod, why) => {
            let netns = env
                .netns
                .as_deref()
                .ok_or_else(|| CniError::new(code::INVALID_ENV, "CNI_NETNS must be set", ""))?;
            // Recorded before ztunnel is asked, so that no enrolled pod
            // lacks a record (a restarted ztunnel enrols the recorded ones
            // again); dropped again if the enrolment fails.
            let record = PodRecord {
                uid: pod.uid.clone(),
                name: pod.name.clone(),
                namespace: pod.namespace.clone(),
                service_account: pod.service_account.clone(),
                netns: netns.to_path_buf(),
            };
            pod_record::write(&conf.state_dir, &record).map_err(|e| {
                CniError::new(
                    code::IO_FAILURE,
                    format!("cannot record pod {pod}: {e}"),
                    "",
                )
            })?;
            if let Err(e) = ztunnel::enrol(conf, netns, &pod) {
                let _ = pod_record::remove(&conf.state_dir, &pod.uid);
                return Err(e);
            }
            tracing::info!(container = %env.container_id, "ADD: pod {pod} enrolled ({why})");
        }
    }
    Ok(result)
}

fn del(env: &Env, conf: &NetConf) -> Result<(), CniError> {
    // The uid comes from the runtime; without it, from the API server if
    // the pod is still there. Not found either way: nothing can be named
    // to ztunnel, which drops the pod at its next restart.
    let uid = match &env.pod.uid {
        Some(uid) => uid.clone(),
        None => match uid_from_api(env, conf) {
            Ok(Some(uid)) => uid,
            Ok(None) => {
                tracing::info!(container = %env.container_id, "DEL: not a Kubernetes pod: nothing to remove");
                return Ok(());
            }
            Err(e) => {
                tracing::warn!(container = %env.container_id, "DEL: no K8S_POD_UID and the pod's uid is unknown ({e}): nothing removed");
                return Ok(());
            }
        },
    };
    // The record goes first and whatever ztunnel says: a pod deleted while
    // ztunnel is down must not be enrolled again when it starts.
    if let Err(e) = pod_record::remove(&conf.state_dir, &uid) {
        tracing::warn!(container = %env.container_id, %uid, "DEL: {e}");
    }
    // Sent whatever the pod's labels say now: they may have changed since
    // ADD, and removing a pod ztunnel never had is a no-op.
    match ztunnel::remove(conf, &uid)? {
        Removal::Removed => {
            tracing::info!(container = %env.container_id, %uid, "DEL: pod removed from ztunnel");
        }
        Removal::NotRunning => tracing::info!(
            container = %env.container_id, %uid,
            socket = %conf.ztunnel_socket.display(),
            "DEL: ztunnel is not running: nothing to remove (a restarted ztunnel drops pods nobody re-enrols)"
        ),
    }
    Ok(())
}

fn uid_from_api(env: &Env, conf: &NetConf) -> Result<Option<String>, KubeError> {
    let (Some(namespace), Some(name)) = (&env.pod.namespace, &env.pod.name) else {
        return Ok(None);
    };
    let api = ApiClient::from_kubeconfig(&conf.kubernetes.kubeconfig, conf.kubernetes.timeout)?;
    let Ok(runtime) = runtime() else {
        return Ok(None);
    };
    let pod = runtime.block_on(api.pod(namespace, name))?;
    Ok(Some(pod.metadata.uid).filter(|u| !u.is_empty()))
}

fn check(env: &Env, conf: &NetConf) -> Result<(), CniError> {
    conf.require_prev_result()?;
    match decide(env, conf)? {
        Decision::PassThrough(why) => {
            tracing::info!(container = %env.container_id, "CHECK: not enrolled, nothing to check: {why}");
        }
        Decision::Enrol(pod, _) => match ztunnel::check(conf, &pod)? {
            Presence::Enrolled => {
                tracing::info!(container = %env.container_id, "CHECK: pod {pod} is enrolled");
            }
            Presence::SocketAnswered(why) => tracing::info!(
                container = %env.container_id,
                "CHECK: ztunnel answers on its socket; whether pod {pod} is enrolled is unconfirmed ({why})"
            ),
        },
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_answer_in_the_configurations_version() {
        let reply = invoke(
            |k| (k == "CNI_COMMAND").then(|| "ADD".to_owned()),
            br#"{"cniVersion":"0.4.0"}"#,
        );
        assert!(!reply.success);
        let out = reply.stdout.expect("error document");
        assert_eq!(out["cniVersion"], "0.4.0");
        assert_eq!(out["code"], code::INVALID_ENV);
    }

    #[test]
    fn version_needs_no_configuration() {
        let reply = invoke(|k| (k == "CNI_COMMAND").then(|| "VERSION".to_owned()), b"");
        assert!(reply.success);
        assert_eq!(reply.stdout, Some(spec::version_json()));
    }

    #[test]
    fn a_pod_outside_kubernetes_or_in_an_excluded_namespace_is_passed_through() {
        let prev = r#"{"cniVersion":"1.0.0","ips":[{"address":"10.1.1.1/24"}]}"#;
        let conf = format!(
            r#"{{"cniVersion":"1.0.0","name":"n","type":"ztunnel-cni","prevResult":{prev},
                "kubernetes":{{"kubeconfig":"/nonexistent/kubeconfig"}}}}"#
        );
        for args in ["", "K8S_POD_NAMESPACE=kube-system;K8S_POD_NAME=coredns-1"] {
            let reply = invoke(
                |k| match k {
                    "CNI_COMMAND" => Some("ADD".into()),
                    "CNI_CONTAINERID" => Some("c".into()),
                    "CNI_NETNS" => Some("/nonexistent/netns".into()),
                    "CNI_IFNAME" => Some("eth0".into()),
                    "CNI_ARGS" => Some(args.into()),
                    _ => None,
                },
                conf.as_bytes(),
            );
            assert!(reply.success, "{args}: {reply:?}");
            assert_eq!(
                reply.stdout,
                Some(serde_json::from_str(prev).expect("prev")),
                "{args}"
            );
        }
        // Any other pod needs the API server: a missing kubeconfig fails
        // the ADD and names the file.
        let reply = invoke(
            |k| match k {
                "CNI_COMMAND" => Some("ADD".into()),
                "CNI_CONTAINERID" => Some("c".into()),
                "CNI_NETNS" => Some("/nonexistent/netns".into()),
                "CNI_IFNAME" => Some("eth0".into()),
                "CNI_ARGS" => Some("K8S_POD_NAMESPACE=demo;K8S_POD_NAME=web".into()),
                _ => None,
            },
            conf.as_bytes(),
        );
        assert!(!reply.success);
        let out = reply.stdout.expect("error");
        assert_eq!(out["code"], code::IO_FAILURE);
        assert!(
            out["msg"]
                .as_str()
                .is_some_and(|m| m.contains("/nonexistent/kubeconfig") && m.contains("demo/web")),
            "{out}"
        );
    }
}
