//! Driving the `ztunnel-cni` plugin as a container runtime does, and a
//! fake Kubernetes API server for it to ask.
//!
//! The plugin runs in a node's network namespace (a node's "host"
//! namespace), with a clean environment holding only the `CNI_*`
//! variables, and the network configuration on stdin. The API server is a
//! thread of the test process serving HTTPS (a certificate from `rcgen`
//! for its address) from inside a namespace the test created, so every
//! address involved is the test's own.

use std::{
    collections::BTreeMap,
    io::{Read as _, Write as _},
    net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream},
    os::fd::AsFd as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use base64::Engine as _;
use serde_json::Value;

use crate::{Pod, netns::TestNetns, ztunnel::sibling_bin};

/// What one plugin run produced.
#[derive(Debug)]
pub struct CniRun {
    /// Exit code.
    pub code: i32,
    /// Stdout as JSON (`Null` when empty).
    pub stdout: Value,
    /// Stderr (the plugin's log).
    pub stderr: String,
    /// How long it ran.
    pub took: Duration,
}

impl CniRun {
    /// Panics unless the run exited 0.
    pub fn assert_ok(&self) -> &Self {
        assert_eq!(self.code, 0, "ztunnel-cni failed: {self:#?}");
        self
    }

    /// Panics unless the run failed with the error document of `code`;
    /// returns its `msg`.
    pub fn assert_error(&self, code: u64) -> String {
        assert_ne!(self.code, 0, "ztunnel-cni succeeded: {self:#?}");
        assert_eq!(self.stdout["code"], code, "{self:#?}");
        for key in ["cniVersion", "msg", "details"] {
            assert!(
                self.stdout.get(key).is_some(),
                "error without {key}: {self:#?}"
            );
        }
        self.stdout["msg"].as_str().unwrap_or_default().to_owned()
    }
}

/// Longest a plugin run may take in these tests: its own bounds are a few
/// seconds at most.
const RUN_LIMIT: Duration = Duration::from_secs(30);

/// Runs `ztunnel-cni` inside `netns` with exactly `env` and `stdin`.
pub fn run_plugin(netns: &Path, env: &[(&str, String)], stdin: &str) -> CniRun {
    let ns = std::fs::File::open(netns).unwrap_or_else(|e| panic!("open {}: {e}", netns.display()));
    let mut cmd = Command::new(sibling_bin("ztunnel-cni"));
    cmd.env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: only setns on an fd opened before fork.
    unsafe {
        use std::os::{fd::AsRawFd as _, unix::process::CommandExt as _};
        cmd.pre_exec(move || {
            if libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let start = Instant::now();
    let mut child = cmd.spawn().expect("spawn ztunnel-cni");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(stdin.as_bytes())
        .expect("write stdin");
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        if start.elapsed() > RUN_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            panic!("ztunnel-cni still running after {RUN_LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let took = start.elapsed();
    let (mut out, mut err) = (String::new(), String::new());
    let _ = child
        .stdout
        .take()
        .expect("stdout")
        .read_to_string(&mut out);
    let _ = child
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut err);
    let stdout = if out.trim().is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {out}"))
    };
    CniRun {
        code: status.code().unwrap_or(-1),
        stdout,
        stderr: err,
        took,
    }
}

/// The `CNI_*` environment of a runtime's call for `pod`. `uid: None`
/// leaves `K8S_POD_UID` out of `CNI_ARGS` (older runtimes).
pub fn pod_env(
    command: &str,
    pod: &Pod,
    namespace: &str,
    uid: Option<&str>,
) -> Vec<(&'static str, String)> {
    let mut args = format!(
        "IgnoreUnknown=1;K8S_POD_NAMESPACE={namespace};K8S_POD_NAME={};K8S_POD_INFRA_CONTAINER_ID=sandbox-{}",
        pod.name, pod.name
    );
    if let Some(uid) = uid {
        args.push_str(";K8S_POD_UID=");
        args.push_str(uid);
    }
    vec![
        ("CNI_COMMAND", command.to_owned()),
        ("CNI_CONTAINERID", format!("sandbox-{}", pod.name)),
        ("CNI_NETNS", pod.netns_path().display().to_string()),
        ("CNI_IFNAME", "eth0".to_owned()),
        ("CNI_ARGS", args),
        ("CNI_PATH", "/opt/cni/bin".to_owned()),
    ]
}

/// The result a bridge plugin gives for `pod`: what the runtime passes to
/// the next plugin of the chain as `prevResult`.
pub fn bridge_result(pod: &Pod) -> Value {
    serde_json::json!({
        "cniVersion": "1.0.0",
        "interfaces": [
            {"name": "cni0", "mac": "0a:58:0a:f4:00:01"},
            {"name": "veth1234", "mac": "2e:11:22:33:44:55"},
            {"name": "eth0", "mac": "0a:58:0a:f4:01:0a", "sandbox": pod.netns_path().display().to_string()}
        ],
        "ips": [
            {"interface": 2, "address": format!("{}/16", pod.ip), "gateway": "10.244.0.1"},
            {"interface": 2, "address": format!("{}/64", pod.ip6)}
        ],
        "routes": [{"dst": "0.0.0.0/0"}],
        "dns": {"nameservers": ["10.96.0.10"], "search": ["svc.cluster.local"]}
    })
}

/// The network configuration the runtime writes on stdin: ours from the
/// conflist, plus `prevResult`, plus `extra` keys.
pub fn net_conf(prev_result: &Value, extra: &Value) -> String {
    let mut conf = serde_json::json!({
        "cniVersion": "1.0.0",
        "name": "k8s-pod-network",
        "type": "ztunnel-cni",
        "prevResult": prev_result,
    });
    if let (Some(conf), Some(extra)) = (conf.as_object_mut(), extra.as_object()) {
        conf.extend(extra.clone());
    }
    conf.to_string()
}

/// A fake API server: GETs of known paths answer their JSON, others 404,
/// a request without the right bearer token 401. Stops on drop.
pub struct FakeApiServer {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Its CA (it signs its own certificate), PEM.
    pub ca_pem: String,
    /// The bearer token it wants.
    pub token: String,
    objects: Arc<Mutex<BTreeMap<String, String>>>,
    requests: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl FakeApiServer {
    /// Starts serving on `ip:port` inside `netns` (which must hold `ip`).
    pub fn start(netns: &TestNetns, ip: Ipv4Addr, port: u16) -> Self {
        let ca_key = rcgen::KeyPair::generate().expect("CA key");
        let mut ca_params = rcgen::CertificateParams::new(Vec::new()).expect("CA params");
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "fake kubernetes CA");
        let ca = ca_params.self_signed(&ca_key).expect("CA cert");
        let key = rcgen::KeyPair::generate().expect("server key");
        let mut params = rcgen::CertificateParams::new(Vec::new()).expect("params");
        params
            .subject_alt_names
            .push(rcgen::SanType::IpAddress(ip.into()));
        let issuer = rcgen::Issuer::from_params(&ca_params, &ca_key);
        let cert = params.signed_by(&key, &issuer).expect("server cert");
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_no_client_auth()
        .with_single_cert(
            vec![cert.der().clone(), ca.der().clone()],
            rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
        )
        .expect("server config");
        let config = Arc::new(config);

        let addr = SocketAddr::from((ip, port));
        // The listening socket is made inside the namespace and stays there;
        // the thread enters it first, then binds.
        let ns = std::fs::File::open(netns.path()).expect("open netns");
        let (bound_tx, bound_rx) = std::sync::mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let objects = Arc::new(Mutex::new(BTreeMap::new()));
        let requests = Arc::new(Mutex::new(Vec::new()));
        let token = format!("token-{}", std::process::id());
        let thread = {
            let (stop, objects, requests, token) = (
                Arc::clone(&stop),
                Arc::clone(&objects),
                Arc::clone(&requests),
                token.clone(),
            );
            std::thread::spawn(move || {
                nix::sched::setns(ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
                    .expect("enter the API server's namespace");
                let listener = TcpListener::bind(addr).expect("bind fake API server");
                listener.set_nonblocking(true).expect("nonblocking");
                bound_tx.send(()).expect("report bound");
                while !stop.load(Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((stream, _)) => {
                            serve(stream, &config, &objects, &requests, &token);
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(10)),
                    }
                }
            })
        };
        bound_rx
            .recv_timeout(Duration::from_secs(5))
            .expect("fake API server listening");
        Self {
            addr,
            ca_pem: ca.pem(),
            token,
            objects,
            requests,
            stop,
            thread: Some(thread),
        }
    }

    /// Serves `object` (JSON) at `path`.
    pub fn set(&self, path: &str, object: &Value) {
        self.objects
            .lock()
            .expect("objects")
            .insert(path.to_owned(), object.to_string());
    }

    /// Serves a namespace with `labels`.
    pub fn namespace(&self, name: &str, labels: &Value) {
        self.set(
            &format!("/api/v1/namespaces/{name}"),
            &serde_json::json!({"kind": "Namespace", "apiVersion": "v1",
                "metadata": {"name": name, "uid": format!("ns-{name}"), "labels": labels}}),
        );
    }

    /// Serves a pod with `labels`, `uid` and `service_account`.
    pub fn pod(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
        service_account: &str,
        labels: &Value,
    ) {
        self.set(
            &format!("/api/v1/namespaces/{namespace}/pods/{name}"),
            &serde_json::json!({"kind": "Pod", "apiVersion": "v1",
                "metadata": {"name": name, "namespace": namespace, "uid": uid, "labels": labels,
                    "managedFields": [{"manager": "kubelet"}]},
                "spec": {"serviceAccountName": service_account, "containers": [{"name": "app"}]},
                "status": {"phase": "Pending"}}),
        );
    }

    /// The request lines served so far (`GET /path`).
    pub fn requests(&self) -> Vec<String> {
        self.requests.lock().expect("requests").clone()
    }

    /// Writes a kubeconfig for this server (CA inline, as installers
    /// write it) into `dir`; `token` overrides the right one.
    pub fn kubeconfig(&self, dir: &Path, server: SocketAddr, token: Option<&str>) -> PathBuf {
        let path = dir.join(format!(
            "kubeconfig-{}-{}-{}",
            server.ip(),
            server.port(),
            token.unwrap_or("ok")
        ));
        let ca = base64::engine::general_purpose::STANDARD.encode(&self.ca_pem);
        std::fs::write(
            &path,
            format!(
                "apiVersion: v1\nkind: Config\ncurrent-context: ztunnel-cni\n\
                 clusters:\n- name: local\n  cluster:\n    server: https://{server}\n    certificate-authority-data: {ca}\n\
                 users:\n- name: ztunnel-cni\n  user:\n    token: {}\n\
                 contexts:\n- name: ztunnel-cni\n  context:\n    cluster: local\n    user: ztunnel-cni\n",
                token.unwrap_or(&self.token)
            ),
        )
        .expect("write kubeconfig");
        path
    }
}

/// One connection: TLS, one request, one answer, close. Every read is
/// bounded, so a stuck client cannot hold the server thread.
fn serve(
    stream: TcpStream,
    config: &Arc<rustls::ServerConfig>,
    objects: &Mutex<BTreeMap<String, String>>,
    requests: &Mutex<Vec<String>>,
    token: &str,
) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = stream.set_write_timeout(Some(Duration::from_secs(5)));
    let Ok(conn) = rustls::ServerConnection::new(Arc::clone(config)) else {
        return;
    };
    let mut tls = rustls::StreamOwned::new(conn, stream);
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") && head.len() < 64 * 1024 {
        match tls.read(&mut byte) {
            Ok(1) => head.push(byte[0]),
            _ => return,
        }
    }
    let head = String::from_utf8_lossy(&head).into_owned();
    let line = head.lines().next().unwrap_or_default().to_owned();
    let path = line
        .split_whitespace()
        .nth(1)
        .unwrap_or_default()
        .to_owned();
    requests
        .lock()
        .expect("requests")
        .push(format!("GET {path}"));
    let authorized = head
        .lines()
        .any(|l| l.eq_ignore_ascii_case(&format!("authorization: Bearer {token}")));
    let (status, body) = if !authorized {
        (
            "401 Unauthorized",
            r#"{"kind":"Status","message":"Unauthorized","code":401}"#.to_owned(),
        )
    } else if let Some(object) = objects.lock().expect("objects").get(&path) {
        ("200 OK", object.clone())
    } else {
        (
            "404 Not Found",
            format!(r#"{{"kind":"Status","message":"{path} not found","code":404}}"#),
        )
    };
    let _ = write!(
        tls,
        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = tls.flush();
    tls.conn.send_close_notify();
    let _ = tls.flush();
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take()
            && t.join().is_err()
        {
            eprintln!("cleanup: the fake API server's thread panicked");
        }
    }
}
