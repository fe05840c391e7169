//! Small helpers to drive traffic between pods and describe them to ztunnel.

use std::{fmt::Write as _, net::SocketAddr, path::PathBuf, time::Duration};

use crate::{
    Cluster, Pod, probe_bin,
    process::{Finished, PodProcess},
};

/// Starts an echo (or digest) server in `pod` on `addr` and waits for it.
pub fn server(pod: &Pod, addr: SocketAddr, mode: &str) -> PodProcess {
    server_with(pod, addr, mode, false)
}

/// Like [`server`]; `quiet` servers print no line per connection (for load
/// tests, where nobody reads them).
pub fn server_with(pod: &Pod, addr: SocketAddr, mode: &str, quiet: bool) -> PodProcess {
    let mut cmd = pod.command(&probe_bin());
    cmd.args(["server", "--listen", &addr.to_string(), "--mode", mode]);
    if quiet {
        cmd.arg("--quiet");
    }
    let mut p = PodProcess::spawn(&format!("server-{}-{addr}", pod.name), cmd);
    let ready = p.read_line(Duration::from_secs(10));
    assert!(ready.starts_with("READY"), "{ready}");
    p
}

/// Options of one client run.
#[derive(Debug, Clone)]
pub struct ClientRun {
    /// Bytes to send (echoed back in echo mode).
    pub bytes: u64,
    /// Size of each write.
    pub chunk: usize,
    /// `echo` or `digest`.
    pub mode: &'static str,
    /// Seconds to wait for the connection.
    pub connect_timeout: u64,
    /// Upper bound of the whole run.
    pub limit: Duration,
    /// `threads` (blocking reader + writer threads) or `poll` (event loop).
    pub io: &'static str,
    /// Go through this SOCKS5 proxy, optionally asking for a name.
    pub socks: Option<(SocketAddr, Option<String>)>,
    /// `SO_MARK` on the client's socket (a pod forging ztunnel's mark).
    pub mark: Option<u32>,
}

impl Default for ClientRun {
    fn default() -> Self {
        Self {
            bytes: 100_000,
            chunk: 16 * 1024,
            mode: "echo",
            connect_timeout: 5,
            limit: Duration::from_mins(1),
            io: "threads",
            socks: None,
            mark: None,
        }
    }
}

/// Runs the client in `pod` against `dst` and returns what it reported.
pub fn client(pod: &Pod, dst: SocketAddr, run: &ClientRun) -> Finished {
    let mut cmd = pod.command(&probe_bin());
    cmd.args([
        "client",
        "--connect",
        &dst.to_string(),
        "--bytes",
        &run.bytes.to_string(),
        "--chunk",
        &run.chunk.to_string(),
        "--mode",
        run.mode,
        "--connect-timeout",
        &run.connect_timeout.to_string(),
        "--timeout",
        &run.limit.as_secs().to_string(),
        "--io",
        run.io,
    ]);
    if let Some(mark) = run.mark {
        cmd.arg("--mark").arg(format!("{mark:#x}"));
    }
    if let Some((proxy, name)) = &run.socks {
        cmd.arg("--via-socks").arg(proxy.to_string());
        if let Some(name) = name {
            cmd.arg("--target-name").arg(name);
        }
    }
    PodProcess::spawn(&format!("client-{}-{dst}", pod.name), cmd)
        .wait(run.limit + Duration::from_secs(10))
}

/// Asserts that a client run succeeded with intact data.
pub fn assert_ok(done: &Finished) {
    assert!(
        done.status.success() && done.stdout.contains("RESULT ok"),
        "client failed: {done:?}"
    );
}

/// The `peer=` a server printed for its last accepted connection.
pub fn last_peer(server: &mut PodProcess) -> String {
    let line = server.read_line(Duration::from_secs(10));
    line.split_whitespace()
        .find_map(|w| w.strip_prefix("peer="))
        .unwrap_or_else(|| panic!("no peer in {line:?}"))
        .to_owned()
}

/// One workload entry for a local-mode config file.
#[derive(Debug, Clone)]
pub struct WorkloadEntry {
    /// The pod.
    pub pod: String,
    /// Node name.
    pub node: String,
    /// Enrol it (give ztunnel its netns).
    pub enrolled: bool,
    /// Capture outbound.
    pub outbound: bool,
    /// Capture inbound.
    pub inbound: bool,
    /// `HBONE` (in the mesh) or `TCP` (outside it).
    pub protocol: &'static str,
    /// Kubernetes namespace.
    pub namespace: &'static str,
    /// Extra YAML lines for the workload (e.g. `    labels: {app: web}`).
    pub extra: &'static str,
}

impl WorkloadEntry {
    /// An enrolled pod with full capture.
    pub fn enrolled(pod: &str, node: &str) -> Self {
        Self {
            pod: pod.into(),
            node: node.into(),
            enrolled: true,
            outbound: true,
            inbound: true,
            protocol: "HBONE",
            namespace: "test",
            extra: "",
        }
    }

    /// A pod outside the mesh (not enrolled, reached with plain TCP).
    pub fn outside(pod: &str, node: &str) -> Self {
        Self {
            enrolled: false,
            protocol: "TCP",
            ..Self::enrolled(pod, node)
        }
    }
}

/// Writes a local-mode config describing `entries` and returns its path.
pub fn write_config(cluster: &Cluster, file: &str, entries: &[WorkloadEntry]) -> PathBuf {
    write_config_with(cluster, file, entries, "")
}

/// Like [`write_config`], with `extra` YAML appended (services, policies).
pub fn write_config_with(
    cluster: &Cluster,
    file: &str,
    entries: &[WorkloadEntry],
    extra: &str,
) -> PathBuf {
    let mut yaml = String::from("trustDomain: cluster.local\nworkloads:\n");
    for e in entries {
        let pod = cluster.pod(&e.pod);
        let _ = writeln!(
            yaml,
            "  - uid: {}\n    name: {}\n    namespace: {}\n    serviceAccount: {}\n    node: {}\n    ips: [{}, \"{}\"]",
            e.pod, e.pod, e.namespace, e.pod, e.node, pod.ip, pod.ip6
        );
        if e.enrolled {
            let _ = writeln!(yaml, "    netns: {}", pod.netns_path().display());
        }
        if !e.extra.is_empty() {
            let _ = writeln!(yaml, "{}", e.extra);
        }
        let _ = writeln!(
            yaml,
            "    capture: {{outbound: {}, inbound: {}}}\n    protocol: {}",
            e.outbound, e.inbound, e.protocol
        );
    }
    yaml.push_str(extra);
    let path = cluster.dir().join(file);
    std::fs::write(&path, yaml).expect("write config");
    path
}

/// The number after `key=` in a helper's result line (`RESULT ...`,
/// `CONN ...`); panics naming the key and line when it is missing.
pub fn field(line: &str, key: &str) -> u64 {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{key}=")))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {key}= in {line:?}"))
}

/// A pod some other enroller (the CNI plugin, `ztunnel enrol`, a node
/// agent) enrols, as the mesh state must list it for it to get traffic.
#[derive(Debug, Clone, Copy)]
pub struct ListedPod<'a> {
    /// The test pod (its addresses).
    pub pod: &'a str,
    /// The uid it is enrolled with.
    pub uid: &'a str,
    /// Kubernetes namespace.
    pub namespace: &'a str,
    /// Service account.
    pub service_account: &'a str,
    /// Its node's name.
    pub node: &'a str,
}

/// Writes a local-mode config that lists `pods` as meshed workloads that
/// the config itself does not enrol (no `netns`), and returns its path.
pub fn write_listed_pods(cluster: &Cluster, file: &str, pods: &[ListedPod<'_>]) -> PathBuf {
    let mut yaml = String::from("trustDomain: cluster.local\nworkloads:\n");
    for p in pods {
        let pod = cluster.pod(p.pod);
        let _ = writeln!(
            yaml,
            "  - {{uid: {}, name: {}, namespace: {}, serviceAccount: {}, node: {}, ips: [{}, \"{}\"]}}",
            p.uid, p.pod, p.namespace, p.service_account, p.node, pod.ip, pod.ip6
        );
    }
    let path = cluster.dir().join(file);
    std::fs::write(&path, yaml).expect("write config");
    path
}
