//! What the Kubernetes API server says about a pod: whether it belongs in
//! the mesh, its service account and its uid.
//!
//! The plugin reads the API server's address, CA and bearer token from a
//! kubeconfig (the shape `kubectl` reads; only what is needed here:
//! `server`, `certificate-authority[-data]`, `token` or `tokenFile`), GETs
//! the pod and, when the pod's own labels do not decide, its namespace.
//! Only the fields used are decoded.
//!
//! Selection follows Istio's ambient mode: the pod label
//! `istio.io/dataplane-mode=none` opts a pod out, `=ambient` opts it in;
//! otherwise the namespace's label `istio.io/dataplane-mode=ambient` does.
//! A pod with an injected sidecar (`sidecar.istio.io/status`) has a proxy
//! of its own and is left alone.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use base64::Engine as _;
use rustls::{ClientConfig, RootCertStore, pki_types::CertificateDer};
use serde::Deserialize;

use super::http::{self, HttpError, Server};

/// The label that puts a pod or namespace in the mesh, or a pod out of it.
pub const DATAPLANE_MODE_LABEL: &str = "istio.io/dataplane-mode";
/// Its value that enrols.
pub const DATAPLANE_MODE_AMBIENT: &str = "ambient";
/// Its value that opts a pod out.
pub const DATAPLANE_MODE_NONE: &str = "none";
/// Present on pods with an injected sidecar.
pub const SIDECAR_STATUS_ANNOTATION: &str = "sidecar.istio.io/status";

/// Labels or annotations.
pub type StringMap = BTreeMap<String, String>;

/// Problems with the kubeconfig or the API server's answers.
#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    /// The kubeconfig (or a file it names) cannot be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The kubeconfig lacks something or has it in a form we cannot use.
    #[error("kubeconfig {path}: {problem}")]
    Kubeconfig {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        problem: String,
    },
    /// The API server did not answer.
    #[error("Kubernetes API server {server} unreachable: {source}")]
    Unreachable {
        /// Its URL.
        server: String,
        /// Why.
        source: HttpError,
    },
    /// It answered with an error status.
    #[error("Kubernetes API server {server}: GET {path} answered {status}: {body}")]
    Status {
        /// Its URL.
        server: String,
        /// The request path.
        path: String,
        /// HTTP status.
        status: u16,
        /// The start of the body (Kubernetes puts the reason there).
        body: String,
    },
    /// The answer was not the object expected.
    #[error("Kubernetes API server {server}: GET {path}: unexpected body: {error}")]
    Decode {
        /// Its URL.
        server: String,
        /// The request path.
        path: String,
        /// serde's message.
        error: String,
    },
}

#[derive(Deserialize)]
struct Kubeconfig {
    #[serde(default)]
    clusters: Vec<Named<ClusterEntry>>,
    #[serde(default)]
    users: Vec<Named<UserEntry>>,
    #[serde(default)]
    contexts: Vec<Named<ContextEntry>>,
    #[serde(rename = "current-context", default)]
    current_context: String,
}

#[derive(Deserialize)]
struct Named<T> {
    name: String,
    #[serde(alias = "cluster", alias = "user", alias = "context")]
    value: T,
}

#[derive(Deserialize)]
#[serde(rename_all = "kebab-case")]
struct ClusterEntry {
    server: String,
    #[serde(default)]
    certificate_authority_data: Option<String>,
    #[serde(default)]
    certificate_authority: Option<PathBuf>,
    #[serde(default)]
    insecure_skip_tls_verify: bool,
}

#[derive(Deserialize, Default)]
struct UserEntry {
    #[serde(default)]
    token: Option<String>,
    #[serde(rename = "tokenFile", default)]
    token_file: Option<PathBuf>,
}

#[derive(Deserialize)]
struct ContextEntry {
    cluster: String,
    #[serde(default)]
    user: String,
}

/// A client of one API server.
#[derive(Debug, Clone)]
pub struct ApiClient {
    server: Server,
    token: Option<String>,
    timeout: Duration,
}

impl ApiClient {
    /// Reads `kubeconfig` (its current context, or its only one).
    pub fn from_kubeconfig(kubeconfig: &Path, timeout: Duration) -> Result<Self, KubeError> {
        let text = read(kubeconfig)?;
        let bad = |problem: String| KubeError::Kubeconfig {
            path: kubeconfig.to_path_buf(),
            problem,
        };
        let config: Kubeconfig =
            serde_yaml::from_str(&text).map_err(|e| bad(format!("not a kubeconfig: {e}")))?;
        let context = if config.current_context.is_empty() {
            match config.contexts.as_slice() {
                [only] => only,
                _ => return Err(bad("no current-context, and not exactly one context".into())),
            }
        } else {
            config
                .contexts
                .iter()
                .find(|c| c.name == config.current_context)
                .ok_or_else(|| {
                    bad(format!(
                        "current-context {:?} is not in contexts",
                        config.current_context
                    ))
                })?
        };
        let cluster = config
            .clusters
            .iter()
            .find(|c| c.name == context.value.cluster)
            .ok_or_else(|| {
                bad(format!(
                    "cluster {:?} is not in clusters",
                    context.value.cluster
                ))
            })?;
        let cluster = &cluster.value;
        if cluster.insecure_skip_tls_verify {
            return Err(bad(
                "insecure-skip-tls-verify is not supported: the pod's identity comes from \
                 this server's answers, so it must be authenticated"
                    .into(),
            ));
        }
        let ca_pem = match (
            &cluster.certificate_authority_data,
            &cluster.certificate_authority,
        ) {
            (Some(data), _) => base64::engine::general_purpose::STANDARD
                .decode(data.trim())
                .map_err(|e| bad(format!("certificate-authority-data is not base64: {e}")))?,
            (None, Some(path)) => read(path)?.into_bytes(),
            (None, None) => {
                return Err(bad(
                    "the cluster has neither certificate-authority-data nor certificate-authority"
                        .into(),
                ));
            }
        };
        let user = config
            .users
            .iter()
            .find(|u| u.name == context.value.user)
            .map(|u| &u.value);
        let token = match user {
            Some(UserEntry {
                token: Some(token), ..
            }) => Some(token.trim().to_owned()),
            Some(UserEntry {
                token_file: Some(path),
                ..
            }) => Some(read(path)?.trim().to_owned()),
            _ => None,
        };
        let server =
            parse_server(&cluster.server, tls_config(&ca_pem).map_err(bad)?).map_err(bad)?;
        Ok(Self {
            server,
            token,
            timeout,
        })
    }

    /// The server's URL, for messages.
    pub fn url(&self) -> String {
        self.server.url()
    }

    async fn get<T: for<'de> Deserialize<'de>>(&self, path: &str) -> Result<T, KubeError> {
        let mut headers = vec![("accept", "application/json".to_owned())];
        if let Some(token) = &self.token {
            headers.push(("authorization", format!("Bearer {token}")));
        }
        let (status, body) = http::get(&self.server, path, &headers, self.timeout)
            .await
            .map_err(|source| KubeError::Unreachable {
                server: self.url(),
                source,
            })?;
        if status != 200 {
            let body = String::from_utf8_lossy(&body);
            return Err(KubeError::Status {
                server: self.url(),
                path: path.to_owned(),
                status,
                body: body.chars().take(300).collect(),
            });
        }
        serde_json::from_slice(&body).map_err(|e| KubeError::Decode {
            server: self.url(),
            path: path.to_owned(),
            error: e.to_string(),
        })
    }

    /// GETs the pod.
    pub async fn pod(&self, namespace: &str, name: &str) -> Result<Pod, KubeError> {
        self.get(&format!(
            "/api/v1/namespaces/{}/pods/{}",
            segment(namespace),
            segment(name)
        ))
        .await
    }

    /// GETs the namespace.
    pub async fn namespace(&self, name: &str) -> Result<Namespace, KubeError> {
        self.get(&format!("/api/v1/namespaces/{}", segment(name)))
            .await
    }
}

/// Percent-encodes a path segment. Kubernetes names cannot hold anything
/// that needs it; `CNI_ARGS` comes from the runtime, and a `/` or `?` in it
/// must not turn into another request.
fn segment(value: &str) -> String {
    value
        .bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_') {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

fn read(path: &Path) -> Result<String, KubeError> {
    std::fs::read_to_string(path).map_err(|source| KubeError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// A TLS client config that trusts only the kubeconfig's CA.
fn tls_config(ca_pem: &[u8]) -> Result<Arc<ClientConfig>, String> {
    let certs: Vec<CertificateDer<'static>> = rustls_pemfile::certs(&mut &ca_pem[..])
        .collect::<Result<_, _>>()
        .map_err(|e| format!("the CA is not PEM: {e}"))?;
    if certs.is_empty() {
        return Err("the CA holds no PEM certificate".into());
    }
    let mut roots = RootCertStore::empty();
    for cert in certs {
        roots
            .add(cert)
            .map_err(|e| format!("the CA certificate is unusable: {e}"))?;
    }
    let config =
        ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots)
            .with_no_client_auth();
    Ok(Arc::new(config))
}

/// `https://host[:port][/prefix]`; the port defaults to 443.
fn parse_server(url: &str, tls: Arc<ClientConfig>) -> Result<Server, String> {
    let rest = url
        .strip_prefix("https://")
        .ok_or_else(|| format!("server {url:?} must be an https:// URL"))?;
    let (authority, prefix) = rest.split_once('/').map_or((rest, ""), |(a, p)| (a, p));
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let (host, after) = v6
            .split_once(']')
            .ok_or_else(|| format!("server {url:?}: unclosed '['"))?;
        (host, after.strip_prefix(':'))
    } else {
        match authority.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (authority, None),
        }
    };
    let port = match port {
        Some(p) => p
            .parse()
            .map_err(|_| format!("server {url:?}: port {p:?} is not a number"))?,
        None => 443,
    };
    if host.is_empty() {
        return Err(format!("server {url:?} has no host"));
    }
    let prefix = prefix.trim_end_matches('/');
    Ok(Server {
        host: host.to_owned(),
        port,
        path_prefix: if prefix.is_empty() {
            String::new()
        } else {
            format!("/{prefix}")
        },
        tls: Some(tls),
    })
}

/// The fields of an object's `metadata` the plugin reads.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Metadata {
    /// The object's uid.
    #[serde(default)]
    pub uid: String,
    /// Labels.
    #[serde(default)]
    pub labels: StringMap,
    /// Annotations.
    #[serde(default)]
    pub annotations: StringMap,
}

/// The fields of a pod's `spec` the plugin reads.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct PodSpec {
    /// The pod's service account: its identity in the mesh.
    #[serde(rename = "serviceAccountName", default)]
    pub service_account_name: String,
}

/// A pod, as far as the plugin needs it.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Pod {
    /// Metadata.
    #[serde(default)]
    pub metadata: Metadata,
    /// Spec.
    #[serde(default)]
    pub spec: PodSpec,
}

/// A namespace, as far as the plugin needs it.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Namespace {
    /// Metadata.
    #[serde(default)]
    pub metadata: Metadata,
}

/// Whether a pod is enrolled, and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Selection {
    /// Enrol it.
    Enrol(&'static str),
    /// Leave it alone.
    Skip(&'static str),
}

/// Decides from the pod alone, when its own labels or annotations decide;
/// `None` means the namespace decides ([`select_by_namespace`]).
pub fn select_by_pod(pod: &Pod) -> Option<Selection> {
    if pod
        .metadata
        .annotations
        .contains_key(SIDECAR_STATUS_ANNOTATION)
    {
        return Some(Selection::Skip("the pod has an injected sidecar"));
    }
    match pod
        .metadata
        .labels
        .get(DATAPLANE_MODE_LABEL)
        .map(String::as_str)
    {
        Some(DATAPLANE_MODE_NONE) => Some(Selection::Skip(
            "the pod is labelled istio.io/dataplane-mode=none",
        )),
        Some(DATAPLANE_MODE_AMBIENT) => Some(Selection::Enrol(
            "the pod is labelled istio.io/dataplane-mode=ambient",
        )),
        _ => None,
    }
}

/// Decides from the namespace's labels.
pub fn select_by_namespace(namespace: &Namespace) -> Selection {
    match namespace
        .metadata
        .labels
        .get(DATAPLANE_MODE_LABEL)
        .map(String::as_str)
    {
        Some(DATAPLANE_MODE_AMBIENT) => {
            Selection::Enrol("the namespace is labelled istio.io/dataplane-mode=ambient")
        }
        _ => Selection::Skip("neither the pod nor its namespace is labelled for ambient"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(labels: &[(&str, &str)], annotations: &[(&str, &str)]) -> Pod {
        let map = |kv: &[(&str, &str)]| {
            kv.iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect()
        };
        Pod {
            metadata: Metadata {
                uid: "u".into(),
                labels: map(labels),
                annotations: map(annotations),
            },
            spec: PodSpec::default(),
        }
    }

    #[test]
    fn the_pod_label_decides_first_then_the_namespace() {
        assert!(matches!(
            select_by_pod(&pod(&[(DATAPLANE_MODE_LABEL, "ambient")], &[])),
            Some(Selection::Enrol(_))
        ));
        assert!(matches!(
            select_by_pod(&pod(&[(DATAPLANE_MODE_LABEL, "none")], &[])),
            Some(Selection::Skip(_))
        ));
        assert!(matches!(
            select_by_pod(&pod(
                &[(DATAPLANE_MODE_LABEL, "ambient")],
                &[(SIDECAR_STATUS_ANNOTATION, "{}")]
            )),
            Some(Selection::Skip(_))
        ));
        assert_eq!(select_by_pod(&pod(&[("app", "web")], &[])), None);
        let mut ns = Namespace::default();
        assert!(matches!(select_by_namespace(&ns), Selection::Skip(_)));
        ns.metadata
            .labels
            .insert(DATAPLANE_MODE_LABEL.into(), "ambient".into());
        assert!(matches!(select_by_namespace(&ns), Selection::Enrol(_)));
    }

    #[test]
    fn only_the_needed_fields_of_a_pod_are_decoded() {
        let pod: Pod = serde_json::from_str(
            r#"{"kind":"Pod","apiVersion":"v1","metadata":{"name":"web","namespace":"demo",
                "uid":"0b9f","labels":{"app":"web"},"managedFields":[{"x":1}]},
                "spec":{"serviceAccountName":"web-sa","containers":[{"name":"c"}]},
                "status":{"phase":"Pending"}}"#,
        )
        .expect("decode");
        assert_eq!(pod.metadata.uid, "0b9f");
        assert_eq!(pod.spec.service_account_name, "web-sa");
        assert_eq!(pod.metadata.labels["app"], "web");
    }

    #[test]
    fn server_urls_and_path_segments() {
        let tls = tls_config(rcgen_ca().as_bytes()).expect("tls");
        let s = parse_server("https://10.0.0.1:6443", Arc::clone(&tls)).expect("v4");
        assert_eq!(
            (s.host.as_str(), s.port, s.path_prefix.as_str()),
            ("10.0.0.1", 6443, "")
        );
        let s = parse_server("https://[fd00::1]/k8s/", Arc::clone(&tls)).expect("v6");
        assert_eq!(
            (s.host.as_str(), s.port, s.path_prefix.as_str()),
            ("fd00::1", 443, "/k8s")
        );
        assert_eq!(s.url(), "https://[fd00::1]:443/k8s");
        assert!(parse_server("http://10.0.0.1", Arc::clone(&tls)).is_err());
        assert!(parse_server("https://h:x", tls).is_err());
        assert_eq!(segment("web-0.a_b"), "web-0.a_b");
        assert_eq!(segment("../x?y"), "..%2Fx%3Fy");
    }

    fn rcgen_ca() -> String {
        let key = rcgen::KeyPair::generate().expect("key");
        rcgen::CertificateParams::new(vec!["ca".into()])
            .expect("params")
            .self_signed(&key)
            .expect("sign")
            .pem()
    }

    #[test]
    fn kubeconfig_current_context_token_and_ca() {
        let dir = std::env::temp_dir().join(format!("ztunnel-cni-kube-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let ca = base64::engine::general_purpose::STANDARD.encode(rcgen_ca());
        let token_file = dir.join("token");
        std::fs::write(&token_file, "file-token\n").expect("token");
        let path = dir.join("kubeconfig");
        std::fs::write(
            &path,
            format!(
                "apiVersion: v1\nkind: Config\ncurrent-context: b\n\
                 clusters:\n- name: c\n  cluster:\n    server: https://10.0.0.9:6443\n    certificate-authority-data: {ca}\n\
                 users:\n- name: u\n  user:\n    tokenFile: {}\n\
                 contexts:\n- name: a\n  context: {{cluster: nope, user: u}}\n- name: b\n  context: {{cluster: c, user: u}}\n",
                token_file.display()
            ),
        )
        .expect("write");
        let client = ApiClient::from_kubeconfig(&path, Duration::from_secs(1)).expect("parse");
        assert_eq!(client.url(), "https://10.0.0.9:6443");
        assert_eq!(client.token.as_deref(), Some("file-token"));

        std::fs::write(
            &path,
            "clusters:\n- name: c\n  cluster:\n    server: https://x\n    insecure-skip-tls-verify: true\n\
             contexts:\n- name: a\n  context: {cluster: c}\n",
        )
        .expect("write");
        let err = ApiClient::from_kubeconfig(&path, Duration::from_secs(1)).expect_err("insecure");
        assert!(
            err.to_string().contains("insecure-skip-tls-verify"),
            "{err}"
        );
        let err = ApiClient::from_kubeconfig(&dir.join("missing"), Duration::from_secs(1))
            .expect_err("missing");
        assert!(err.to_string().contains("missing"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
