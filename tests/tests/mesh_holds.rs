//! The mesh holds while its config and policies change (issue 10, "No way
//! around the mesh"):
//! - a config file truncated to zero bytes (what an editor or `cat >` leaves
//!   while saving) is rejected: pods stay enrolled and their traffic keeps
//!   going through HBONE, never in clear on the fabric;
//! - a policy edit closes the open connections it no longer allows, and
//!   only those.

use std::{
    net::SocketAddr,
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use ztunnel_tests::{
    Cluster,
    cgroup::TestCgroup,
    flows::{self, ClientRun, WorkloadEntry},
    probe_bin,
    process::PodProcess,
    require_root,
    sniff::Sniffer,
    ztunnel::Ztunnel,
};

/// A payload that must never cross the fabric in clear.
const MARKER: &str = "ZT-MARKER-9e41-the-mesh-holds-while-the-config-is-empty";
/// How long the config stays truncated (a slow editor's save).
const EMPTY_WINDOW: Duration = Duration::from_secs(2);
/// Bound on a ztunnel noticing a config change: a 1 s poll plus a 200 ms
/// settle re-read, with room for a loaded 2-core machine.
const RELOAD_LIMIT: Duration = Duration::from_secs(10);
/// Bound from writing a denying policy to the client seeing its open
/// connection closed (the figure): the reload takes about 1.2 s.
const CLOSE_LIMIT: Duration = Duration::from_secs(5);
/// Bound on one marker connection (connect + echo) through the mesh.
const MARKER_CONNECTION_LIMIT: Duration = Duration::from_secs(40);
/// Bound on a long-lived client reporting its first exchange.
const BEAT_START_LIMIT: Duration = Duration::from_secs(15);

/// node-a: `a1` (meshed client); node-b: `b1` (meshed server), `b2`
/// (meshed, same-node client) and `plain` (outside the mesh: the sniffer's
/// control, and a plaintext client).
fn two_nodes() -> (Cluster, usize, usize) {
    let mut cluster = Cluster::new();
    let a = cluster.add_node("node-a");
    let b = cluster.add_node("node-b");
    cluster.add_pod(a, "a1");
    cluster.add_pod(b, "b1");
    cluster.add_pod(b, "b2");
    cluster.add_pod(b, "plain");
    (cluster, a, b)
}

fn entries() -> Vec<WorkloadEntry> {
    vec![
        WorkloadEntry::enrolled("a1", "node-a"),
        WorkloadEntry::enrolled("b1", "node-b"),
        WorkloadEntry::enrolled("b2", "node-b"),
        WorkloadEntry::outside("plain", "node-b"),
    ]
}

/// GET on one of ztunnel's node-local ports, from the node's namespace.
fn node_get(cluster: &Cluster, node: usize, cg: &TestCgroup, addr: &str, path: &str) -> String {
    let (status, body) =
        Ztunnel::http_get(&cluster.node(node).netns().path(), &cg.procs(), addr, path);
    assert_eq!(status, 200, "GET {addr}{path}: {body}");
    body
}

/// The value of the first line of metric `name` carrying every one of
/// `labels`.
fn metric(text: &str, name: &str, labels: &[&str]) -> Option<u64> {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        .find(|l| labels.iter().all(|want| l.contains(want)))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// The uids of the pods ztunnel says are enrolled (admin `/config_dump`).
fn enrolled_pods(cluster: &Cluster, node: usize, cg: &TestCgroup) -> Vec<String> {
    let dump = node_get(cluster, node, cg, "127.0.0.1:15000", "/config_dump");
    let json: serde_json::Value = serde_json::from_str(&dump).expect("config_dump is JSON");
    json["enrolledPods"]
        .as_array()
        .unwrap_or_else(|| panic!("no enrolledPods in {dump}"))
        .iter()
        .filter_map(|p| p["uid"].as_str().map(ToOwned::to_owned))
        .collect()
}

/// One connection from `pod` to `dst` carrying the marker; whether it
/// echoed.
fn marker_connection(pod: &ztunnel_tests::Pod, dst: SocketAddr) -> bool {
    let mut cmd = pod.command(&probe_bin());
    cmd.args([
        "burst",
        "--connect",
        &dst.to_string(),
        "--count",
        "1",
        "--payload",
        MARKER,
    ]);
    let done = PodProcess::spawn("marker", cmd).wait(MARKER_CONNECTION_LIMIT);
    done.stdout.contains("BURST ok=1 failed=0")
}

/// How many lines of `z`'s log say that it took or refused a config change.
fn reloads_seen(z: &Ztunnel) -> usize {
    z.count_log_lines(&["config change rejected"])
        + z.count_log_lines(&["config changed: applying"])
}

/// Waits until `z` handled one more config change (either way) than
/// `before`; what it decided is checked by the caller.
fn wait_for_reload(z: &Ztunnel, before: usize) {
    let deadline = Instant::now() + RELOAD_LIMIT;
    while reloads_seen(z) <= before {
        assert!(
            Instant::now() < deadline,
            "the config change was not handled within {RELOAD_LIMIT:?}; log:\n{}",
            z.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Sets its flag when dropped.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

#[test]
fn a_truncated_config_is_rejected_and_traffic_stays_in_the_mesh() {
    if !require_root("a_truncated_config_is_rejected_and_traffic_stays_in_the_mesh") {
        return;
    }
    let (cluster, a, b) = two_nodes();
    let config = flows::write_config(&cluster, "mesh.yaml", &entries());
    let good = std::fs::read_to_string(&config).expect("read config");
    let config_arg = config.to_str().expect("utf-8");
    let (a1, b1, plain) = (cluster.pod("a1"), cluster.pod("b1"), cluster.pod("plain"));
    let dst = SocketAddr::from((b1.ip, 8080));
    let plain_dst = SocketAddr::from((plain.ip, 8080));
    // Quiet: many connections, and nobody reads a line per connection.
    let _server = flows::server_with(b1, dst, "echo", true);
    let _plain_server = flows::server_with(plain, plain_dst, "echo", true);
    let za = Ztunnel::start(&cluster, a, &["--config", config_arg]);
    let zb = Ztunnel::start(&cluster, b, &["--config", config_arg]);
    za.wait_for_log("pod enrolled pod=a1", RELOAD_LIMIT);
    zb.wait_for_log("pod enrolled pod=b1", RELOAD_LIMIT);
    let cg = TestCgroup::create(&format!("{}/admin-client", cluster.prefix()));

    // Control: the sniffer does see the marker when it travels in clear
    // (to the pod outside the mesh), so its silence below means something.
    let control = Sniffer::start(&cluster.fabric().path(), MARKER.as_bytes());
    assert!(
        marker_connection(a1, plain_dst),
        "passthrough control failed"
    );
    assert!(control.finish().0, "the sniffer missed a plaintext marker");

    let sniffer = Sniffer::start(&cluster.fabric().path(), MARKER.as_bytes());
    let stop = AtomicBool::new(false);
    let (truncated_at, restored_at, results) = std::thread::scope(|scope| {
        // A captured pod keeps connecting to a meshed pod on the other node
        // for the whole test.
        // Set on every way out, a panic included, so the scope's join ends.
        let _stop_traffic = StopOnDrop(&stop);
        let traffic = scope.spawn(|| {
            let mut results = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let started = Instant::now();
                let ok = marker_connection(a1, dst);
                results.push((started, Instant::now(), ok));
            }
            results
        });
        let before = (reloads_seen(&za), reloads_seen(&zb));
        // Truncate to zero bytes, as `: > mesh.yaml` does.
        std::fs::File::create(&config).expect("truncate config");
        let truncated_at = Instant::now();
        wait_for_reload(&za, before.0);
        wait_for_reload(&zb, before.1);
        // Hold the empty file for the window; meanwhile both nodes keep
        // their pods.
        loop {
            let pods_a = enrolled_pods(&cluster, a, &cg);
            let pods_b = enrolled_pods(&cluster, b, &cg);
            assert!(
                pods_a.contains(&"a1".to_owned()),
                "a1 un-enrolled while the config was empty: {pods_a:?}"
            );
            assert!(
                pods_b.contains(&"b1".to_owned()),
                "b1 un-enrolled while the config was empty: {pods_b:?}"
            );
            if truncated_at.elapsed() >= EMPTY_WINDOW {
                break;
            }
        }
        let before = (reloads_seen(&za), reloads_seen(&zb));
        std::fs::write(&config, &good).expect("restore config");
        let restored_at = Instant::now();
        wait_for_reload(&za, before.0);
        wait_for_reload(&zb, before.1);
        stop.store(true, Ordering::Relaxed);
        let results = traffic.join().expect("traffic thread");
        (truncated_at, restored_at, results)
    });
    let (seen, frames) = sniffer.finish();
    assert!(frames > 0, "the sniffer saw no frames at all");
    assert!(
        !seen,
        "the marker crossed the fabric in clear while the config was empty"
    );

    // Connections were really made during the window, and every one that
    // went through went through HBONE (failing would be acceptable, clear
    // text never).
    let in_window = results
        .iter()
        .filter(|(start, end, _)| *start >= truncated_at && *end <= restored_at)
        .count();
    assert!(
        in_window >= 2,
        "only {in_window} connections were made while the config was empty: {results:?}"
    );
    let ok = results.iter().filter(|(_, _, ok)| *ok).count();
    eprintln!(
        "{} marker connections, {ok} echoed, {in_window} while the config was empty",
        results.len()
    );
    let hbone = za.count_log_lines(&[&format!("orig_dst={dst}"), "path=\"hbone\""]);
    let passthrough = za.count_log_lines(&[&format!("orig_dst={dst}"), "path=\"passthrough\""]);
    assert_eq!(passthrough, 0, "connections to b1 bypassed the mesh");
    assert_eq!(
        hbone,
        ok,
        "every successful connection must have used HBONE; log:\n{}",
        za.log()
    );
    assert!(
        ok >= in_window,
        "connections failed in the window: {results:?}"
    );

    // Nothing was removed, the rejection names the file and the problem,
    // and /metrics counts it.
    for (z, node) in [(&za, a), (&zb, b)] {
        assert_eq!(
            z.count_log_lines(&["pod removed"]),
            0,
            "a pod was removed; log:\n{}",
            z.log()
        );
        assert!(
            z.count_log_lines(&["config change rejected", config_arg, "is empty"]) >= 1,
            "the rejection does not name the file and the problem; log:\n{}",
            z.log()
        );
        let text = node_get(&cluster, node, &cg, "127.0.0.1:15020", "/metrics");
        assert!(
            metric(
                &text,
                "ztunnel_config_reloads_total",
                &["result=\"rejected\"", "reason=\"empty\""]
            )
            .is_some_and(|n| n >= 1),
            "rejected reload not counted:\n{text}"
        );
    }
}

/// A long-lived client connection (`zt-probe beat`) and what it reported.
struct Beat {
    process: PodProcess,
}

impl Beat {
    /// Connects from `pod` to `dst` and waits for the first exchange.
    fn start(pod: &ztunnel_tests::Pod, dst: SocketAddr) -> Self {
        let mut cmd = pod.command(&probe_bin());
        cmd.args(["beat", "--connect", &dst.to_string(), "--seconds", "120"]);
        let mut process = PodProcess::spawn(&format!("beat-{dst}"), cmd);
        let first = process.read_line(BEAT_START_LIMIT);
        assert!(first.starts_with("CONNECTED"), "{dst}: {first}");
        let ok = process.read_line(BEAT_START_LIMIT);
        assert!(ok.starts_with("OK 0 "), "{dst}: no data flowed: {ok}");
        Self { process }
    }

    /// The first line that is not `OK ...` before `deadline`, if any.
    fn next_event(&mut self, deadline: Instant) -> Option<String> {
        loop {
            let line = self.next_line(deadline)?;
            if !line.starts_with("OK ") {
                return Some(line);
            }
        }
    }

    /// Whether it keeps exchanging: an `OK` line for an exchange made at or
    /// after `since` arrives within `limit`.
    fn flowing_since(&mut self, since: SystemTime, limit: Duration) -> bool {
        let since_ms = since
            .duration_since(UNIX_EPOCH)
            .expect("clock after 1970")
            .as_millis();
        let deadline = Instant::now() + limit;
        while let Some(line) = self.next_line(deadline) {
            let Some(stamp) = line.strip_prefix("OK ") else {
                return false;
            };
            let at: u128 = stamp
                .split_once(" t=")
                .and_then(|(_, t)| t.parse().ok())
                .unwrap_or_else(|| panic!("bad beat line {line:?}"));
            if at >= since_ms {
                return true;
            }
        }
        false
    }

    fn next_line(&mut self, deadline: Instant) -> Option<String> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return None;
        }
        self.process.try_read_line(left)
    }
}

#[test]
fn a_policy_edit_closes_the_open_connections_it_denies() {
    if !require_root("a_policy_edit_closes_the_open_connections_it_denies") {
        return;
    }
    let (cluster, a, b) = two_nodes();
    let config = flows::write_config(&cluster, "mesh.yaml", &entries());
    let config_arg = config.to_str().expect("utf-8");
    let (a1, b1, b2, plain) = (
        cluster.pod("a1"),
        cluster.pod("b1"),
        cluster.pod("b2"),
        cluster.pod("plain"),
    );
    let (denied_dst, other_dst) = (
        SocketAddr::from((b1.ip, 8080)),
        SocketAddr::from((b1.ip, 9090)),
    );
    let _s1 = flows::server(b1, denied_dst, "echo");
    let _s2 = flows::server(b1, other_dst, "echo");
    let za = Ztunnel::start(&cluster, a, &["--config", config_arg]);
    let zb = Ztunnel::start(&cluster, b, &["--config", config_arg]);
    za.wait_for_log("pod enrolled pod=a1", RELOAD_LIMIT);
    zb.wait_for_log("pod enrolled pod=b1", RELOAD_LIMIT);
    zb.wait_for_log("pod enrolled pod=b2", RELOAD_LIMIT);

    // Long-lived connections into b1, data flowing, one on each path where
    // node b enforces b1's policy: HBONE from a1 (node a), the same-node
    // fast path from b2, plaintext from `plain` (outside the mesh). And one
    // more from a1 to another port, which the policy will not match.
    let mut doomed = [
        ("hbone", Beat::start(a1, denied_dst)),
        ("local", Beat::start(b2, denied_dst)),
        ("plaintext", Beat::start(plain, denied_dst)),
    ];
    let mut spared = Beat::start(a1, other_dst);
    for d in [denied_dst, other_dst] {
        za.wait_for_log(
            &format!("orig_dst={d} target={d} dst_workload=b1"),
            Duration::from_secs(5),
        );
    }
    zb.wait_for_log(
        &format!("orig_dst={denied_dst} target={denied_dst} dst_workload=b1"),
        Duration::from_secs(5),
    );
    zb.wait_for_log(
        &format!("orig_dst={denied_dst} path=\"plaintext\""),
        Duration::from_secs(5),
    );

    // A DENY on port 8080 for a1, b2 and plain's address.
    let deny = format!(
        "policies:\n  - {{name: cut-8080, namespace: test, action: DENY, rules: [{{from: [{{principals: [\"spiffe://cluster.local/ns/test/sa/a1\", \"spiffe://cluster.local/ns/test/sa/b2\"]}}, {{ipBlocks: [\"{}/32\"]}}], to: [{{ports: [8080]}}]}}]}}\n",
        plain.ip
    );
    flows::write_config_with(&cluster, "mesh.yaml", &entries(), &deny);
    let written = Instant::now();
    for (path, beat) in &mut doomed {
        let event = beat.next_event(written + CLOSE_LIMIT).unwrap_or_else(|| {
            panic!(
                "the open {path} connection to {denied_dst} was not closed within {CLOSE_LIMIT:?} of the DENY; log:\n{}",
                zb.log()
            )
        });
        assert!(
            event.starts_with("CLOSED"),
            "{path}: expected the connection to be closed, got {event:?}"
        );
        eprintln!(
            "{path}: closed {:?} after the policy was written: {event}",
            written.elapsed()
        );
    }
    let closed_at = SystemTime::now();
    // One log line per connection, naming it and the policy.
    for path in ["hbone", "local", "plaintext"] {
        assert_eq!(
            zb.count_log_lines(&[
                "open connection closed: the new policy denies it",
                "policy=test/cut-8080",
                &format!("dst={denied_dst}"),
                &format!("path=\"{path}\""),
            ]),
            1,
            "{path}: one log line naming the connection and the policy; log:\n{}",
            zb.log()
        );
    }

    // The connection the policy does not match keeps flowing.
    assert!(
        spared.flowing_since(closed_at, Duration::from_secs(3)),
        "the connection to {other_dst} (not denied) was cut too"
    );

    // A new connection to the denied port is refused.
    let done = flows::client(
        a1,
        denied_dst,
        &ClientRun {
            bytes: 1000,
            connect_timeout: 3,
            limit: Duration::from_secs(10),
            ..ClientRun::default()
        },
    );
    assert!(
        !(done.status.success() && done.stdout.contains("RESULT ok")),
        "a new connection was allowed despite the DENY: {done:?}"
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    while zb.count_log_lines(&["access", "result=\"denied\"", "test/cut-8080"]) == 0 {
        assert!(
            Instant::now() < deadline,
            "no access log line for the refusal; log:\n{}",
            zb.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    // Counted: the three open connections closed, plus the refusal.
    let cg = TestCgroup::create(&format!("{}/admin-client", cluster.prefix()));
    let text = node_get(&cluster, b, &cg, "127.0.0.1:15020", "/metrics");
    assert_eq!(
        metric(
            &text,
            "ztunnel_connections_closed_by_policy_total",
            &["policy=\"test/cut-8080\""]
        ),
        Some(3),
        "{text}"
    );
    assert!(
        metric(
            &text,
            "ztunnel_policy_denials_total",
            &["policy=\"test/cut-8080\""]
        )
        .is_some_and(|n| n >= 1),
        "{text}"
    );
    assert!(
        spared.process.is_running(),
        "the spared connection's client exited"
    );
}
