//! What the CNI 1.0 specification says a plugin receives and answers:
//! the `CNI_*` environment, the network configuration on stdin, the
//! result and error documents on stdout. Pure functions only, so that the
//! parsing rules are unit-tested without a runtime.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::PathBuf,
    time::Duration,
};

use serde_json::{Map, Value, json};

/// The version this plugin speaks, and answers `VERSION` with.
pub const CNI_VERSION: &str = "1.0.0";

/// The configuration versions accepted. A chained plugin needs a
/// `prevResult`, which exists from 0.3.0 on; the result is passed through
/// untouched, so its format does not matter to us.
pub const SUPPORTED_VERSIONS: &[&str] = &["0.3.0", "0.3.1", "0.4.0", "1.0.0"];

/// Default path of ztunnel's enrolment socket (`ztunnelSocket`).
pub const DEFAULT_ZTUNNEL_SOCKET: &str = crate::enrol::zds::DEFAULT_SOCKET;

/// Default bound of each wait on ztunnel (`ztunnelTimeoutMs`): connecting,
/// sending, and its answer. An enrolment attaches programs, opens
/// listeners and issues a certificate, well under a second on a loaded
/// node; 10 s leaves room for a busy CA and still fails a pod's sandbox
/// long before the kubelet's own deadline (4 min), so it is retried.
pub const DEFAULT_ZTUNNEL_TIMEOUT: Duration = Duration::from_secs(10);

/// Default bound of each request to the Kubernetes API server
/// (`kubernetes.timeoutMs`), connect and TLS included. Two GETs at most per
/// pod; an API server that takes longer than this is in trouble, and the
/// pod is better retried than held.
pub const DEFAULT_API_TIMEOUT: Duration = Duration::from_secs(5);

/// Default admin endpoint of ztunnel (`ztunnelAdmin`), ztunnel's own
/// default `--admin-addr`: `CHECK` asks its `/config_dump` whether the pod
/// is enrolled.
pub const DEFAULT_ZTUNNEL_ADMIN: SocketAddr =
    SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 15000);

/// Default kubeconfig (`kubernetes.kubeconfig`): where an installer
/// writes the plugin's own credentials, next to the conflist.
pub const DEFAULT_KUBECONFIG: &str = "/etc/cni/net.d/ztunnel-cni.kubeconfig";

/// Namespaces never enrolled unless `excludeNamespaces` says otherwise:
/// the cluster's own system pods (DNS, the CNI and ztunnel themselves)
/// must start while the mesh does not.
pub const DEFAULT_EXCLUDED_NAMESPACES: &[&str] = &["kube-system"];

/// Largest timeout accepted in the config: a bound of more than a few
/// minutes is no bound for a pod's start.
const MAX_TIMEOUT: Duration = Duration::from_mins(5);

/// Error codes of the specification (1-99 are reserved to it).
pub mod code {
    /// The configuration's `cniVersion` is not supported.
    pub const INCOMPATIBLE_VERSION: u32 = 1;
    /// A `CNI_*` variable is missing or wrong.
    pub const INVALID_ENV: u32 = 4;
    /// Reading or opening something failed.
    pub const IO_FAILURE: u32 = 5;
    /// Stdin is not a JSON object.
    pub const DECODE_FAILED: u32 = 6;
    /// A configuration field is missing or wrong.
    pub const INVALID_CONFIG: u32 = 7;
    /// A transient condition (ztunnel or the API server not answering):
    /// the runtime should try again later.
    pub const TRY_AGAIN_LATER: u32 = 11;
    /// Ours: ztunnel answered and refused the request.
    pub const ZTUNNEL_REFUSED: u32 = 100;
    /// Ours: the API server answered, but not with what we need (an
    /// error status, a pod without a service account).
    pub const KUBERNETES: u32 = 101;
    /// Ours (`CHECK`): ztunnel runs but does not have the pod enrolled.
    pub const NOT_ENROLLED: u32 = 102;
}

/// A failure as the specification's error document describes it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{msg}{}", if details.is_empty() { String::new() } else { format!(": {details}") })]
pub struct CniError {
    /// One of [`code`].
    pub code: u32,
    /// A short message.
    pub msg: String,
    /// Longer details (may be empty).
    pub details: String,
}

impl CniError {
    /// A new error.
    pub fn new(code: u32, msg: impl Into<String>, details: impl Into<String>) -> Self {
        Self {
            code,
            msg: msg.into(),
            details: details.into(),
        }
    }

    /// The error document for stdout.
    pub fn to_json(&self, cni_version: &str) -> Value {
        json!({
            "cniVersion": cni_version,
            "code": self.code,
            "msg": self.msg,
            "details": self.details,
        })
    }
}

/// `CNI_COMMAND`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    /// Enrol the pod.
    Add,
    /// Remove the pod.
    Del,
    /// Check that the pod is still enrolled.
    Check,
    /// Print the supported versions.
    Version,
}

impl Command {
    fn parse(value: &str) -> Option<Self> {
        match value {
            "ADD" => Some(Self::Add),
            "DEL" => Some(Self::Del),
            "CHECK" => Some(Self::Check),
            "VERSION" => Some(Self::Version),
            _ => None,
        }
    }
}

/// The Kubernetes keys of `CNI_ARGS` (`K8S_POD_NAMESPACE=..;K8S_POD_NAME=..`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodArgs {
    /// `K8S_POD_NAMESPACE`.
    pub namespace: Option<String>,
    /// `K8S_POD_NAME`.
    pub name: Option<String>,
    /// `K8S_POD_UID` (containerd and CRI-O pass it).
    pub uid: Option<String>,
    /// `K8S_POD_INFRA_CONTAINER_ID`.
    pub infra_container_id: Option<String>,
}

impl PodArgs {
    /// Parses `CNI_ARGS`. Unknown keys (`IgnoreUnknown=1`, other plugins'
    /// arguments) are left alone; a pair without `=` is an error naming it.
    pub fn parse(cni_args: &str) -> Result<Self, CniError> {
        let mut args = Self::default();
        for pair in cni_args.split(';').filter(|p| !p.trim().is_empty()) {
            let (key, value) = pair.split_once('=').ok_or_else(|| {
                CniError::new(
                    code::INVALID_ENV,
                    "CNI_ARGS is malformed",
                    format!("{pair:?} is not KEY=VALUE"),
                )
            })?;
            let value = (!value.is_empty()).then(|| value.to_owned());
            match key.trim() {
                "K8S_POD_NAMESPACE" => args.namespace = value,
                "K8S_POD_NAME" => args.name = value,
                "K8S_POD_UID" => args.uid = value,
                "K8S_POD_INFRA_CONTAINER_ID" => args.infra_container_id = value,
                _ => {}
            }
        }
        Ok(args)
    }
}

/// The `CNI_*` environment of one invocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Env {
    /// `CNI_COMMAND`.
    pub command: Command,
    /// `CNI_CONTAINERID`.
    pub container_id: String,
    /// `CNI_NETNS` (may be absent for `DEL`).
    pub netns: Option<PathBuf>,
    /// `CNI_IFNAME`.
    pub ifname: String,
    /// `CNI_ARGS`.
    pub pod: PodArgs,
}

impl Env {
    /// Reads the variables from `get` (the process environment in the
    /// binary, a map in tests). `VERSION` needs none but `CNI_COMMAND`;
    /// `ADD` and `CHECK` need the container id, netns and interface name,
    /// `DEL` the container id and interface name. Every missing variable
    /// is named at once.
    pub fn parse(get: impl Fn(&str) -> Option<String>) -> Result<Self, CniError> {
        let command = get("CNI_COMMAND").unwrap_or_default();
        let command = Command::parse(&command).ok_or_else(|| {
            CniError::new(
                code::INVALID_ENV,
                "CNI_COMMAND must be ADD, DEL, CHECK or VERSION",
                format!("got {command:?}"),
            )
        })?;
        let non_empty = |key: &str| get(key).filter(|v| !v.is_empty());
        let (container_id, netns, ifname) = (
            non_empty("CNI_CONTAINERID"),
            non_empty("CNI_NETNS"),
            non_empty("CNI_IFNAME"),
        );
        let mut missing = Vec::new();
        if command != Command::Version {
            if container_id.is_none() {
                missing.push("CNI_CONTAINERID");
            }
            if ifname.is_none() {
                missing.push("CNI_IFNAME");
            }
            if netns.is_none() && command != Command::Del {
                missing.push("CNI_NETNS");
            }
        }
        if !missing.is_empty() {
            return Err(CniError::new(
                code::INVALID_ENV,
                format!("{} must be set", missing.join(", ")),
                String::new(),
            ));
        }
        Ok(Self {
            command,
            container_id: container_id.unwrap_or_default(),
            netns: netns.map(PathBuf::from),
            ifname: ifname.unwrap_or_default(),
            pod: PodArgs::parse(&get("CNI_ARGS").unwrap_or_default())?,
        })
    }
}

/// How the plugin reaches the Kubernetes API server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubernetesConf {
    /// The kubeconfig with the server, its CA and a bearer token.
    pub kubeconfig: PathBuf,
    /// Bound of each request.
    pub timeout: Duration,
}

/// The network configuration on stdin: the specification's keys and ours.
#[derive(Debug, Clone, PartialEq)]
pub struct NetConf {
    /// `cniVersion`.
    pub cni_version: String,
    /// `name` (the network's).
    pub name: String,
    /// `prevResult`: the result of the plugins before us in the chain.
    pub prev_result: Option<Map<String, Value>>,
    /// `ztunnelSocket`.
    pub ztunnel_socket: PathBuf,
    /// `ztunnelTimeoutMs`.
    pub ztunnel_timeout: Duration,
    /// `ztunnelAdmin`.
    pub ztunnel_admin: SocketAddr,
    /// `kubernetes`.
    pub kubernetes: KubernetesConf,
    /// `excludeNamespaces`: pods there are never enrolled and cost no API
    /// request.
    pub exclude_namespaces: Vec<String>,
    /// `stateDir`: where the enrolled pods' records live, for a restarted
    /// ztunnel (`crate::enrol::pod_record`).
    pub state_dir: PathBuf,
}

/// Collects every problem of a configuration, each naming its field.
#[derive(Default)]
struct Problems(Vec<String>);

impl Problems {
    fn string(&mut self, obj: &Map<String, Value>, field: &str, path: &str) -> Option<String> {
        match obj.get(field) {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) if s.is_empty() => {
                self.0.push(format!("{path} must not be empty"));
                None
            }
            Some(Value::String(s)) => Some(s.clone()),
            Some(other) => {
                self.0
                    .push(format!("{path} must be a string, not {}", kind(other)));
                None
            }
        }
    }

    fn required(&mut self, obj: &Map<String, Value>, field: &str) -> String {
        let value = self.string(obj, field, field);
        if matches!(obj.get(field), None | Some(Value::Null)) {
            self.0.push(format!("{field} is missing"));
        }
        value.unwrap_or_default()
    }

    fn timeout(
        &mut self,
        obj: &Map<String, Value>,
        field: &str,
        path: &str,
        default: Duration,
    ) -> Duration {
        match obj.get(field) {
            None | Some(Value::Null) => default,
            Some(Value::Number(n)) => match n.as_u64() {
                Some(ms) if ms > 0 && Duration::from_millis(ms) <= MAX_TIMEOUT => {
                    Duration::from_millis(ms)
                }
                _ => {
                    self.0.push(format!(
                        "{path} must be a whole number of milliseconds from 1 to {}, not {n}",
                        MAX_TIMEOUT.as_millis()
                    ));
                    default
                }
            },
            Some(other) => {
                self.0.push(format!(
                    "{path} must be a number (milliseconds), not {}",
                    kind(other)
                ));
                default
            }
        }
    }

    fn object<'a>(
        &mut self,
        obj: &'a Map<String, Value>,
        field: &str,
    ) -> Option<&'a Map<String, Value>> {
        match obj.get(field) {
            None | Some(Value::Null) => None,
            Some(Value::Object(o)) => Some(o),
            Some(other) => {
                self.0
                    .push(format!("{field} must be an object, not {}", kind(other)));
                None
            }
        }
    }
}

fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

impl NetConf {
    /// Parses stdin. Not JSON, or not an object: code 6. An unsupported
    /// `cniVersion`: code 1. Any other bad field: code 7, with every bad
    /// field named in one message. Keys we do not know are left alone (the
    /// runtime adds its own, e.g. `runtimeConfig`).
    pub fn parse(stdin: &[u8]) -> Result<Self, CniError> {
        let value: Value = serde_json::from_slice(stdin).map_err(|e| {
            CniError::new(
                code::DECODE_FAILED,
                "the network configuration on stdin is not valid JSON",
                e.to_string(),
            )
        })?;
        let Value::Object(obj) = value else {
            return Err(CniError::new(
                code::DECODE_FAILED,
                "the network configuration on stdin must be a JSON object",
                format!("got {}", kind(&value)),
            ));
        };
        let mut p = Problems::default();
        let cni_version = p.required(&obj, "cniVersion");
        let name = p.required(&obj, "name");
        p.required(&obj, "type");
        let prev_result = match obj.get("prevResult") {
            None | Some(Value::Null) => None,
            Some(Value::Object(o)) => Some(o.clone()),
            Some(other) => {
                p.0.push(format!("prevResult must be an object, not {}", kind(other)));
                None
            }
        };
        let ztunnel_socket = p
            .string(&obj, "ztunnelSocket", "ztunnelSocket")
            .map_or_else(|| PathBuf::from(DEFAULT_ZTUNNEL_SOCKET), PathBuf::from);
        let ztunnel_timeout = p.timeout(
            &obj,
            "ztunnelTimeoutMs",
            "ztunnelTimeoutMs",
            DEFAULT_ZTUNNEL_TIMEOUT,
        );
        let ztunnel_admin = match p.string(&obj, "ztunnelAdmin", "ztunnelAdmin") {
            None => DEFAULT_ZTUNNEL_ADMIN,
            Some(addr) => addr.parse().unwrap_or_else(|_| {
                p.0.push(format!(
                    "ztunnelAdmin must be an address:port like 127.0.0.1:15000, not {addr:?}"
                ));
                DEFAULT_ZTUNNEL_ADMIN
            }),
        };
        let state_dir = p.string(&obj, "stateDir", "stateDir").map_or_else(
            || PathBuf::from(crate::enrol::pod_record::DEFAULT_DIR),
            PathBuf::from,
        );
        let kubernetes = match p.object(&obj, "kubernetes") {
            Some(k) => KubernetesConf {
                kubeconfig: p
                    .string(k, "kubeconfig", "kubernetes.kubeconfig")
                    .map_or_else(|| PathBuf::from(DEFAULT_KUBECONFIG), PathBuf::from),
                timeout: p.timeout(k, "timeoutMs", "kubernetes.timeoutMs", DEFAULT_API_TIMEOUT),
            },
            None => KubernetesConf {
                kubeconfig: PathBuf::from(DEFAULT_KUBECONFIG),
                timeout: DEFAULT_API_TIMEOUT,
            },
        };
        let exclude_namespaces = match obj.get("excludeNamespaces") {
            None | Some(Value::Null) => DEFAULT_EXCLUDED_NAMESPACES
                .iter()
                .map(|&s| s.to_owned())
                .collect(),
            Some(Value::Array(items)) => items
                .iter()
                .enumerate()
                .filter_map(|(i, item)| match item {
                    Value::String(s) if !s.is_empty() => Some(s.clone()),
                    other => {
                        p.0.push(format!(
                            "excludeNamespaces[{i}] must be a namespace name, not {}",
                            if other.is_string() {
                                "an empty string"
                            } else {
                                kind(other)
                            }
                        ));
                        None
                    }
                })
                .collect(),
            Some(other) => {
                p.0.push(format!(
                    "excludeNamespaces must be an array of namespace names, not {}",
                    kind(other)
                ));
                Vec::new()
            }
        };
        if !p.0.is_empty() {
            return Err(CniError::new(
                code::INVALID_CONFIG,
                format!("invalid network configuration: {}", p.0.join("; ")),
                String::new(),
            ));
        }
        if !SUPPORTED_VERSIONS.contains(&cni_version.as_str()) {
            return Err(CniError::new(
                code::INCOMPATIBLE_VERSION,
                format!(
                    "cniVersion {cni_version:?} is not supported (supported: {})",
                    SUPPORTED_VERSIONS.join(", ")
                ),
                String::new(),
            ));
        }
        Ok(Self {
            cni_version,
            name,
            prev_result,
            ztunnel_socket,
            ztunnel_timeout,
            ztunnel_admin,
            kubernetes,
            exclude_namespaces,
            state_dir,
        })
    }

    /// The previous plugin's result, required by `ADD` and `CHECK`: this
    /// plugin creates no interface, so it only makes sense chained after
    /// one that does.
    pub fn require_prev_result(&self) -> Result<&Map<String, Value>, CniError> {
        self.prev_result.as_ref().ok_or_else(|| {
            CniError::new(
                code::INVALID_CONFIG,
                "prevResult is missing: ztunnel-cni is a chained plugin and must come after the \
                 plugin that creates the pod's interface in the conflist",
                String::new(),
            )
        })
    }

    /// The result of `ADD`: the previous plugin's result unchanged, in the
    /// configuration's version (that is the version the runtime asked for).
    pub fn add_result(&self) -> Result<Value, CniError> {
        let mut result = self.require_prev_result()?.clone();
        result.insert("cniVersion".into(), Value::String(self.cni_version.clone()));
        Ok(Value::Object(result))
    }
}

/// The answer to `VERSION`.
pub fn version_json() -> Value {
    json!({
        "cniVersion": CNI_VERSION,
        "supportedVersions": SUPPORTED_VERSIONS,
    })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn env(vars: &[(&str, &str)]) -> Result<Env, CniError> {
        let vars: BTreeMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        Env::parse(|k| vars.get(k).cloned())
    }

    #[test]
    fn cni_args_give_the_pod_and_ignore_other_keys() {
        let args = PodArgs::parse(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE=demo;K8S_POD_NAME=web-0;\
             K8S_POD_INFRA_CONTAINER_ID=abc;K8S_POD_UID=1234-5678;",
        )
        .expect("parse");
        assert_eq!(
            args,
            PodArgs {
                namespace: Some("demo".into()),
                name: Some("web-0".into()),
                uid: Some("1234-5678".into()),
                infra_container_id: Some("abc".into()),
            }
        );
        assert_eq!(PodArgs::parse("").expect("empty"), PodArgs::default());
        assert_eq!(
            PodArgs::parse("K8S_POD_UID=").expect("empty value").uid,
            None
        );
        let err = PodArgs::parse("K8S_POD_NAME=a;oops").expect_err("no =");
        assert_eq!(err.code, code::INVALID_ENV);
        assert!(err.details.contains("oops"), "{err}");
    }

    #[test]
    fn the_environment_names_every_missing_variable() {
        let add = env(&[
            ("CNI_COMMAND", "ADD"),
            ("CNI_CONTAINERID", "c1"),
            ("CNI_NETNS", "/var/run/netns/p"),
            ("CNI_IFNAME", "eth0"),
            ("CNI_ARGS", "K8S_POD_NAMESPACE=demo;K8S_POD_NAME=web"),
        ])
        .expect("complete");
        assert_eq!(add.command, Command::Add);
        assert_eq!(add.netns, Some(PathBuf::from("/var/run/netns/p")));
        assert_eq!(add.pod.name.as_deref(), Some("web"));

        let err = env(&[("CNI_COMMAND", "ADD"), ("CNI_IFNAME", "eth0")]).expect_err("missing");
        assert_eq!(err.code, code::INVALID_ENV);
        assert!(
            err.msg.contains("CNI_CONTAINERID") && err.msg.contains("CNI_NETNS"),
            "{err}"
        );
        // DEL may come after the namespace is gone.
        let del = env(&[
            ("CNI_COMMAND", "DEL"),
            ("CNI_CONTAINERID", "c1"),
            ("CNI_IFNAME", "eth0"),
        ])
        .expect("del without netns");
        assert_eq!(del.netns, None);
        assert_eq!(
            env(&[("CNI_COMMAND", "VERSION")]).expect("version").command,
            Command::Version
        );
        let err = env(&[("CNI_COMMAND", "GC")]).expect_err("unknown command");
        assert!(err.details.contains("GC"), "{err}");
    }

    const PREV: &str = r#"{"cniVersion":"1.0.0","interfaces":[{"name":"eth0","mac":"aa:bb:cc:dd:ee:ff","sandbox":"/var/run/netns/p"}],"ips":[{"address":"10.244.1.10/16","gateway":"10.244.0.1","interface":0}],"dns":{}}"#;

    fn conf(extra: &str) -> String {
        format!(
            r#"{{"cniVersion":"1.0.0","name":"k8s-pod-network","type":"ztunnel-cni","prevResult":{PREV}{extra}}}"#
        )
    }

    #[test]
    fn a_minimal_config_takes_the_named_defaults() {
        let conf = NetConf::parse(conf("").as_bytes()).expect("parse");
        assert_eq!(conf.ztunnel_socket, PathBuf::from(DEFAULT_ZTUNNEL_SOCKET));
        assert_eq!(conf.ztunnel_timeout, DEFAULT_ZTUNNEL_TIMEOUT);
        assert_eq!(conf.ztunnel_admin, DEFAULT_ZTUNNEL_ADMIN);
        assert_eq!(
            conf.kubernetes.kubeconfig,
            PathBuf::from(DEFAULT_KUBECONFIG)
        );
        assert_eq!(conf.kubernetes.timeout, DEFAULT_API_TIMEOUT);
        assert_eq!(conf.exclude_namespaces, vec!["kube-system".to_owned()]);
    }

    #[test]
    fn our_keys_are_read() {
        let conf = NetConf::parse(
            conf(
                r#","ztunnelSocket":"/run/z.sock","ztunnelTimeoutMs":2500,
                "kubernetes":{"kubeconfig":"/k","timeoutMs":700},"excludeNamespaces":[],
                "runtimeConfig":{"whatever":1}"#,
            )
            .as_bytes(),
        )
        .expect("parse");
        assert_eq!(conf.ztunnel_socket, PathBuf::from("/run/z.sock"));
        assert_eq!(conf.ztunnel_timeout, Duration::from_millis(2500));
        assert_eq!(conf.kubernetes.kubeconfig, PathBuf::from("/k"));
        assert_eq!(conf.kubernetes.timeout, Duration::from_millis(700));
        assert!(conf.exclude_namespaces.is_empty());
    }

    #[test]
    fn every_bad_field_is_named_at_once() {
        let err = NetConf::parse(
            br#"{"cniVersion":"1.0.0","type":"ztunnel-cni","ztunnelSocket":7,
                "ztunnelTimeoutMs":0,"ztunnelAdmin":"localhost","name":null,"kubernetes":{"timeoutMs":"5s"},
                "excludeNamespaces":["a",""],"prevResult":[]}"#,
        )
        .expect_err("bad");
        assert_eq!(err.code, code::INVALID_CONFIG);
        for field in [
            "name is missing",
            "ztunnelSocket must be a string, not a number",
            "ztunnelTimeoutMs must be a whole number",
            "ztunnelAdmin must be an address:port",
            "kubernetes.timeoutMs must be a number",
            "excludeNamespaces[1]",
            "prevResult must be an object",
        ] {
            assert!(err.msg.contains(field), "{field:?} not in {err}");
        }
    }

    #[test]
    fn bad_json_and_versions_have_their_codes() {
        let err = NetConf::parse(b"{not json").expect_err("syntax");
        assert_eq!(err.code, code::DECODE_FAILED);
        let err = NetConf::parse(b"[1]").expect_err("array");
        assert_eq!(err.code, code::DECODE_FAILED);
        let err = NetConf::parse(br#"{"cniVersion":"0.2.0","name":"n","type":"ztunnel-cni"}"#)
            .expect_err("old");
        assert_eq!(err.code, code::INCOMPATIBLE_VERSION);
        assert!(
            err.msg.contains("0.2.0") && err.msg.contains("1.0.0"),
            "{err}"
        );
    }

    #[test]
    fn add_passes_the_previous_result_through_in_the_configs_version() {
        let conf = NetConf::parse(conf("").as_bytes()).expect("parse");
        let prev: Value = serde_json::from_str(PREV).expect("prev");
        assert_eq!(conf.add_result().expect("result"), prev);

        let old = conf.clone();
        let old = NetConf {
            cni_version: "0.4.0".into(),
            ..old
        };
        let result = old.add_result().expect("result");
        assert_eq!(result["cniVersion"], "0.4.0");
        assert_eq!(result["ips"], prev["ips"]);

        let unchained = NetConf {
            prev_result: None,
            ..conf
        };
        let err = unchained.add_result().expect_err("no prevResult");
        assert_eq!(err.code, code::INVALID_CONFIG);
        assert!(err.msg.contains("prevResult"), "{err}");
    }

    #[test]
    fn version_and_error_documents_have_the_specs_shape() {
        let v = version_json();
        assert_eq!(v["cniVersion"], "1.0.0");
        assert!(
            v["supportedVersions"]
                .as_array()
                .expect("array")
                .contains(&json!("1.0.0"))
        );
        let e = CniError::new(code::TRY_AGAIN_LATER, "ztunnel is not running", "socket /x")
            .to_json("0.4.0");
        assert_eq!(
            e,
            json!({"cniVersion":"0.4.0","code":11,"msg":"ztunnel is not running","details":"socket /x"})
        );
    }
}
