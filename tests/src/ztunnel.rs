//! Running a real `ztunnel` process for a node of a test cluster.
//!
//! The process runs in the node's network namespace and in a cgroup below
//! the cluster's capture cgroup, so the capture programs do run for
//! ztunnel's own sockets: only their entry in `ZTUNNEL_SOCKETS` keeps them
//! from being captured, which is exactly what the tests want to exercise. Its log goes
//! to a file; on a failing test the log is printed before it is removed.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Stdio,
    time::{Duration, Instant},
};

use nix::sys::signal::Signal;

use crate::{
    Cluster,
    cgroup::TestCgroup,
    process::{PodProcess, command_in},
};

/// Path of a binary built next to the test helpers.
pub fn sibling_bin(name: &str) -> PathBuf {
    let probe = crate::probe_bin();
    let bin = probe.with_file_name(name);
    assert!(
        bin.is_file(),
        "{} missing: run the tests through `cargo xtask test` (it builds the ztunnel binary)",
        bin.display()
    );
    bin
}

/// The `ztunnel` binary the tests run: the one built next to the test
/// helpers (the debug build `cargo xtask test` makes), or the one named by
/// `ZTUNNEL_TESTS_ZTUNNEL` (e.g. `target/release/ztunnel`, to measure what
/// users run).
pub fn ztunnel_bin() -> PathBuf {
    match std::env::var_os("ZTUNNEL_TESTS_ZTUNNEL") {
        Some(path) => {
            let path = PathBuf::from(path);
            assert!(
                path.is_file(),
                "ZTUNNEL_TESTS_ZTUNNEL={}: no such file",
                path.display()
            );
            path
        }
        None => sibling_bin("ztunnel"),
    }
}

/// The log filter tests run ztunnel with: ztunnel's own debug lines help
/// when a test fails.
pub const TEST_LOG: &str = "info,ztunnel=debug";

/// The log filter that passes no `--log` at all (and no `ZTUNNEL_LOG`):
/// ztunnel logs as shipped, `info` with the access log on. What the
/// benchmark runs, since a filter no user runs skews its figures.
pub const SHIPPED_LOG: &str = "";

/// One running ztunnel.
#[derive(Debug)]
pub struct Ztunnel {
    process: Option<PodProcess>,
    log: PathBuf,
    /// Its pin folder.
    pub bpffs: PathBuf,
    /// Its enrolment socket.
    pub socket: PathBuf,
    /// Where it reads ztunnel-cni's pod records (`--cni-state-dir`).
    pub pod_records: PathBuf,
    _cgroup: TestCgroup,
}

/// Each started ztunnel gets its own log file, so waiting for a line never
/// matches what an earlier instance wrote.
fn next_instance() -> u32 {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Paths a ztunnel of a node uses, derived from the cluster.
pub struct ZtunnelPaths {
    /// Pin folder (inside the cluster's private bpffs).
    pub bpffs: PathBuf,
    /// Enrolment socket.
    pub socket: PathBuf,
    /// ztunnel-cni's pod records of this node (never the machine's
    /// `/var/run/ztunnel/pods`).
    pub pod_records: PathBuf,
    /// Log file.
    pub log: PathBuf,
    /// This instance's number (two ztunnels of one node, e.g. an upgrade,
    /// get their own cgroups and logs).
    pub instance: u32,
}

impl ZtunnelPaths {
    /// The paths for `node` of `cluster`.
    pub fn for_node(cluster: &Cluster, node: usize) -> Self {
        let name = &cluster.node(node).name;
        let instance = next_instance();
        Self {
            bpffs: cluster.bpffs().path().join(format!("ztunnel-{name}")),
            socket: cluster.dir().join(format!("{name}.sock")),
            pod_records: cluster.dir().join(format!("pods-{name}")),
            log: cluster.dir().join(format!("ztunnel-{name}-{instance}.log")),
            instance,
        }
    }
}

impl Ztunnel {
    /// Starts `ztunnel run` for `node` with the cluster's capture cgroup and
    /// the given extra arguments, and waits until it is ready.
    pub fn start(cluster: &Cluster, node: usize, extra: &[&str]) -> Self {
        Self::start_full(cluster, node, TEST_LOG, extra, &[])
    }

    /// [`Self::start`] with the log filter `filter` (`info` is what users
    /// run); [`SHIPPED_LOG`] (empty) passes no `--log`, leaving ztunnel at
    /// its default.
    pub fn start_with_log(cluster: &Cluster, node: usize, filter: &str, extra: &[&str]) -> Self {
        Self::start_full(cluster, node, filter, extra, &[])
    }

    /// [`Self::start_with_log`] with the ztunnel binary at `binary` instead
    /// of [`ztunnel_bin`]: two builds side by side in one run (the
    /// benchmark's A/B mode), without changing the process environment.
    pub fn start_binary(
        cluster: &Cluster,
        node: usize,
        binary: &Path,
        filter: &str,
        extra: &[&str],
    ) -> Self {
        let z = Self::spawn(cluster, node, binary, filter, extra, &[]);
        z.wait_for_log("ztunnel ready", Duration::from_secs(20));
        z
    }

    /// [`Self::start`] with extra environment variables (e.g. a `PATH`
    /// without iproute2, to make a step of every enrolment fail).
    pub fn start_with_env(
        cluster: &Cluster,
        node: usize,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Self {
        Self::start_full(cluster, node, TEST_LOG, extra, env)
    }

    /// Starts ztunnel with the log filter, extra arguments and environment.
    pub fn start_full(
        cluster: &Cluster,
        node: usize,
        filter: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Self {
        let z = Self::spawn(cluster, node, &ztunnel_bin(), filter, extra, env);
        z.wait_for_log("ztunnel ready", Duration::from_secs(20));
        z
    }

    /// Starts ztunnel without waiting until it is ready (for tests of what
    /// it does before).
    pub fn start_unready(cluster: &Cluster, node: usize, extra: &[&str]) -> Self {
        Self::spawn(cluster, node, &ztunnel_bin(), TEST_LOG, extra, &[])
    }

    fn spawn(
        cluster: &Cluster,
        node: usize,
        binary: &Path,
        filter: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Self {
        let paths = ZtunnelPaths::for_node(cluster, node);
        let node_ref = cluster.node(node);
        let cgroup = TestCgroup::create(&format!(
            "{}/ztunnel-{}-{}",
            cluster.prefix(),
            node_ref.name,
            paths.instance
        ));
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&paths.log)
            .expect("open ztunnel log");
        let mut cmd = command_in(&node_ref.netns().path(), &cgroup.procs(), binary);
        if filter == SHIPPED_LOG {
            cmd.env_remove("ZTUNNEL_LOG");
        } else {
            cmd.args(["--log", filter]);
        }
        cmd.args([
            "run",
            "--node-name",
            &node_ref.name,
            "--reconcile-grace",
            "1",
        ])
        .arg("--cgroup")
        .arg(cluster.cgroup())
        .arg("--bpffs")
        .arg(&paths.bpffs)
        .arg("--enrol-socket")
        .arg(&paths.socket)
        .arg("--cni-state-dir")
        .arg(&paths.pod_records)
        // Every node of the cluster shares one development CA, kept in the
        // cluster's scratch folder (never the machine's default location).
        .arg("--ca-dir")
        .arg(cluster.dir().join("dev-ca"))
        .args(extra)
        .envs(env.iter().copied())
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::from(log));
        let process = PodProcess::spawn_with_io(&format!("ztunnel-{}", node_ref.name), cmd);
        Self {
            process: Some(process),
            log: paths.log,
            bpffs: paths.bpffs,
            socket: paths.socket,
            pod_records: paths.pod_records,
            _cgroup: cgroup,
        }
    }

    /// `/metrics` of the ztunnel of `node`, fetched from inside the node by
    /// a process in `cg`.
    pub fn metrics_of(cluster: &Cluster, node: usize, cg: &TestCgroup) -> String {
        let (status, body) = Self::http_get(
            &cluster.node(node).netns().path(),
            &cg.procs(),
            "127.0.0.1:15020",
            "/metrics",
        );
        assert_eq!(status, 200, "GET /metrics: {body}");
        body
    }

    /// Resident memory of the ztunnel process, in KiB (`VmRSS`).
    pub fn rss_kib(&self) -> u64 {
        self.status_kib("VmRSS")
    }

    /// The resident part that is ztunnel's own (heap, stacks; `RssAnon`),
    /// in KiB: `VmRSS` less the pages of the binary and libraries.
    pub fn anon_kib(&self) -> u64 {
        self.status_kib("RssAnon")
    }

    /// A `kB` field of `/proc/PID/status` (0 when unreadable).
    fn status_kib(&self, field: &str) -> u64 {
        let pid = self.process.as_ref().map_or(0, PodProcess::pid);
        let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    }

    /// GET `path` from the ztunnel of `node` at `addr` (its admin,
    /// metrics or readiness port), from a process in a fresh cgroup of the
    /// cluster; panics unless the answer is 200.
    pub fn node_get(cluster: &Cluster, node: usize, addr: &str, path: &str) -> String {
        let cg = TestCgroup::create(&format!("{}/admin-{node}", cluster.prefix()));
        let (status, body) =
            Self::http_get(&cluster.node(node).netns().path(), &cg.procs(), addr, path);
        assert_eq!(status, 200, "GET {path} on node {node}: {body}");
        body
    }

    /// `/config_dump` of the ztunnel of `node`, parsed.
    pub fn config_dump_of(cluster: &Cluster, node: usize) -> serde_json::Value {
        let body = Self::node_get(cluster, node, "127.0.0.1:15000", "/config_dump");
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("config_dump: {e}: {body}"))
    }

    /// HTTP GET from inside `netns` (e.g. the node's, for ztunnel's admin
    /// ports); returns (status, body).
    pub fn http_get(netns: &Path, cgroup_procs: &Path, addr: &str, path: &str) -> (u16, String) {
        let mut cmd = command_in(netns, cgroup_procs, &crate::probe_bin());
        cmd.args(["get", "--addr", addr, "--path", path]);
        let done = PodProcess::spawn("http-get", cmd).wait(Duration::from_secs(20));
        let (head, body) = done.stdout.split_once('\n').unwrap_or((&done.stdout, ""));
        let status = head
            .strip_prefix("STATUS ")
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        (status, body.to_owned())
    }

    /// The whole log so far.
    pub fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until the log contains `needle`; panics with the log otherwise.
    pub fn wait_for_log(&self, needle: &str, limit: Duration) {
        let limit = crate::patience(limit);
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if self.log().contains(needle) {
                return;
            }
            if let Some(p) = &self.process
                && !p.is_running()
            {
                // It may have written the line and exited between our read
                // and this check (e.g. "drained" right before exit): read
                // once more before calling it a failure.
                let log = self.log();
                assert!(
                    log.contains(needle),
                    "ztunnel exited while waiting for {needle:?}; log:\n{log}"
                );
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!(
            "no {needle:?} in ztunnel's log within {limit:?}; log:\n{}",
            self.log()
        );
    }

    /// Counts lines of the log containing every one of `needles`.
    pub fn count_log_lines(&self, needles: &[&str]) -> usize {
        self.log()
            .lines()
            .filter(|l| needles.iter().all(|n| l.contains(n)))
            .count()
    }

    /// The process id (0 once stopped).
    pub fn pid(&self) -> u32 {
        self.process.as_ref().map_or(0, PodProcess::pid)
    }

    /// Sends a signal without waiting.
    pub fn signal(&self, signal: Signal) {
        if let Some(p) = &self.process {
            p.signal(signal);
        }
    }

    /// SIGKILL: no cleanup at all.
    pub fn kill(&mut self) {
        if let Some(p) = self.process.take() {
            p.signal(Signal::SIGKILL);
            let done = p.wait(Duration::from_secs(10));
            assert!(!done.status.success());
        }
    }

    /// SIGTERM (harmless if already sent) and wait for a clean exit
    /// (status 0).
    pub fn stop(&mut self) {
        if let Some(p) = self.process.take() {
            p.signal(Signal::SIGTERM);
            let done = p.wait(Duration::from_secs(30));
            assert!(
                done.status.success(),
                "ztunnel exited with {}; log:\n{}",
                done.status,
                self.log()
            );
        }
    }

    /// The capture counters from ztunnel's pinned map.
    pub fn counters(&self) -> ztunnel::capture::counters::CounterSnapshot {
        ztunnel::capture::counters::read_pinned(&self.bpffs.join("maps"))
            .expect("read pinned counters")
    }

    /// Every pin below ztunnel's pin folder.
    pub fn pins(&self) -> Vec<PathBuf> {
        pins_below(&self.bpffs)
    }
}

/// Every file below `dir`.
pub fn pins_below(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        if let Ok(entries) = fs::read_dir(&d) {
            for e in entries.flatten() {
                let p = e.path();
                if p.is_dir() {
                    stack.push(p);
                } else {
                    out.push(p);
                }
            }
        }
    }
    out.sort();
    out
}

impl Drop for Ztunnel {
    fn drop(&mut self) {
        if let Some(p) = self.process.take() {
            p.signal(Signal::SIGKILL);
        }
        if std::thread::panicking() {
            eprintln!(
                "---- ztunnel log ({}) ----\n{}",
                self.log.display(),
                self.log()
            );
        }
    }
}
