//! Enrolment over the unix socket (ZDS messages, netns fd as SCM_RIGHTS),
//! driven by the real `ztunnel enrol` command.

use std::{
    net::SocketAddr,
    os::{
        fd::{AsRawFd as _, OwnedFd},
        unix::fs::PermissionsExt as _,
    },
    process::Command,
    time::Duration,
};

use nix::sys::socket::{
    AddressFamily, MsgFlags, SockFlag, SockType, UnixAddr, connect, recv, send, socket,
};

use ztunnel::enrol::zds::{self, AddWorkload, WorkloadRequest, workload_request::Payload};
use ztunnel_common::Counter;
use ztunnel_tests::{
    Cluster,
    flows::{self, ClientRun},
    kernel::{attach_type, cgroup_program_count, ingress_programs},
    require_root,
    ztunnel::{Ztunnel, sibling_bin},
};

/// The overflow uid: not root, not anyone in particular.
const NOBODY: u32 = 65534;

/// Sends an empty `snapshot_sent` from a thread running as `uid`. Linux
/// keeps credentials per thread and the raw `setresuid` system call (unlike
/// libc's wrapper) changes only the calling thread's, so the test process
/// itself stays root; `SO_PEERCRED` records the connecting thread's.
fn snapshot_as(socket: &std::path::Path, uid: u32) -> Result<(), zds::ZdsError> {
    let socket = socket.to_path_buf();
    std::thread::spawn(move || {
        // SAFETY: a plain system call on this thread's own credentials.
        let rc = unsafe { libc::syscall(libc::SYS_setresuid, uid, uid, uid) };
        assert_eq!(rc, 0, "setresuid: {}", std::io::Error::last_os_error());
        let request = WorkloadRequest {
            payload: Some(Payload::SnapshotSent(zds::SnapshotSent {})),
        };
        zds::request(&socket, vec![(request, None)])
    })
    .join()
    .expect("client thread")
}

fn enrol(z: &Ztunnel, args: &[&str]) -> std::process::Output {
    Command::new(sibling_bin("ztunnel"))
        .arg("enrol")
        .arg("--socket")
        .arg(&z.socket)
        .args(args)
        .output()
        .expect("run ztunnel enrol")
}

#[test]
fn pods_are_enrolled_and_removed_over_the_socket() {
    if !require_root("pods_are_enrolled_and_removed_over_the_socket") {
        return;
    }
    let mut cluster = Cluster::new();
    let node = cluster.add_node("node-a");
    cluster.add_pod(node, "app");
    cluster.add_pod(node, "other");
    let (app, other) = (cluster.pod("app"), cluster.pod("other"));
    let dst = SocketAddr::from((other.ip, 8080));
    let _server = flows::server(other, dst, "echo");
    // The mesh state lists the pod (a pod whose workload is unknown gets
    // no traffic); the config does not enrol it, the socket does.
    let config = flows::write_listed_pods(
        &cluster,
        "mesh.yaml",
        &[flows::ListedPod {
            pod: "app",
            uid: "app-uid",
            namespace: "test",
            service_account: "app",
            node: "node-a",
        }],
    );
    let z = Ztunnel::start(
        &cluster,
        node,
        &["--config", config.to_str().expect("utf-8")],
    );
    let netns = app.netns_path();
    let netns = netns.to_str().expect("utf-8");

    let add = [
        "add",
        "--uid",
        "app-uid",
        "--netns",
        netns,
        "--name",
        "app",
        "--namespace",
        "test",
        "--service-account",
        "app",
    ];
    let out = enrol(&z, &add);
    assert!(out.status.success(), "{out:?}");
    let before = z.counters();
    flows::assert_ok(&flows::client(app, dst, &ClientRun::default()));
    let after = z.counters();
    assert_eq!(
        after.get(Counter::ConnectRedirected),
        before.get(Counter::ConnectRedirected) + 1,
        "before {before:?}\nafter {after:?}"
    );

    // Enrolling again is a no-op: still one program per hook.
    assert!(enrol(&z, &add).status.success());
    assert_eq!(z.count_log_lines(&["pod enrolled", "app-uid"]), 1);
    assert_eq!(
        cgroup_program_count(&app.netns_path(), attach_type::SK_LOOKUP),
        1
    );

    // Bad requests get an answer naming the problem; the daemon carries on.
    let missing = enrol(
        &z,
        &[
            "add",
            "--uid",
            "x",
            "--netns",
            "/nonexistent/netns",
            "--namespace",
            "test",
            "--service-account",
            "x",
        ],
    );
    assert!(!missing.status.success());
    assert!(
        String::from_utf8_lossy(&missing.stderr).contains("/nonexistent/netns"),
        "{missing:?}"
    );

    // Only root may speak on the socket: the file is 0600, and even with
    // the file opened to all, a client that is not root is refused before
    // anything it sends is read (here: a snapshot that would un-enrol the
    // pod).
    let mode = std::fs::metadata(&z.socket)
        .expect("stat socket")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "enrolment socket mode {mode:o}");
    std::fs::set_permissions(&z.socket, std::fs::Permissions::from_mode(0o666)).expect("chmod");
    match snapshot_as(&z.socket, NOBODY) {
        Err(zds::ZdsError::Refused(error)) => assert!(
            error.contains(&format!("uid {NOBODY}")),
            "the refusal must name the uid: {error}"
        ),
        other => panic!("a snapshot from uid {NOBODY} was not refused: {other:?}"),
    }
    assert_eq!(z.count_log_lines(&["pod removed"]), 0, "{}", z.log());
    assert_eq!(
        z.count_log_lines(&["enrolment client refused", "uid=65534"]),
        1
    );
    flows::assert_ok(&flows::client(app, dst, &ClientRun::default()));

    // A snapshot that does not mention the pod removes it.
    let out = enrol(&z, &["snapshot"]);
    assert!(out.status.success(), "{out:?}");
    z.wait_for_log("pod removed pod=app-uid", Duration::from_secs(5));
    assert!(ingress_programs(&app.netns_path()).is_empty());
    assert_eq!(
        cgroup_program_count(&app.netns_path(), attach_type::SK_LOOKUP),
        0,
        "sk_lookup left on a removed pod's namespace"
    );
    let before = z.counters();
    flows::assert_ok(&flows::client(app, dst, &ClientRun::default()));
    assert_eq!(
        z.counters().get(Counter::ConnectRedirected),
        before.get(Counter::ConnectRedirected)
    );

    // Deleting an unknown pod is fine (idempotent).
    assert!(enrol(&z, &["del", "--uid", "nope"]).status.success());
}

#[test]
fn malformed_enrolment_messages_are_refused_with_a_reason() {
    if !require_root("malformed_enrolment_messages_are_refused_with_a_reason") {
        return;
    }
    let mut cluster = Cluster::new();
    let node = cluster.add_node("node-a");
    let z = Ztunnel::start(&cluster, node, &[]);
    // Each breaks the protocol: answered with the reason, then the
    // connection is closed (a node agent starts over with a snapshot).
    for (garbage, reason) in [
        (&[0xffu8, 0xff, 0xff][..], "malformed ZDS message"),
        // A well-formed `add` without an fd.
        (&[0x0a, 0x03, 0x0a, 0x01, 0x41][..], "add must carry 1 fd"),
    ] {
        let fd = socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::empty(),
            None,
        )
        .expect("socket");
        connect(fd.as_raw_fd(), &UnixAddr::new(&z.socket).expect("addr")).expect("connect");
        send(fd.as_raw_fd(), garbage, MsgFlags::empty()).expect("send");
        let mut buf = [0u8; 4096];
        let n = recv(fd.as_raw_fd(), &mut buf, MsgFlags::empty()).expect("recv");
        let reply = String::from_utf8_lossy(&buf[..n]).into_owned();
        assert!(reply.contains(reason), "{reply:?}");
        let n = recv(fd.as_raw_fd(), &mut buf, MsgFlags::empty()).expect("recv");
        assert_eq!(n, 0, "the connection stays open after a protocol error");
    }
    z.wait_for_log("enrolment protocol error", Duration::from_secs(2));
}

#[test]
fn an_add_without_workload_info_is_refused_and_nothing_is_enrolled() {
    if !require_root("an_add_without_workload_info_is_refused_and_nothing_is_enrolled") {
        return;
    }
    let mut cluster = Cluster::new();
    let node = cluster.add_node("node-a");
    cluster.add_pod(node, "app");
    cluster.add_pod(node, "other");
    let (app, other) = (cluster.pod("app"), cluster.pod("other"));
    let dst = SocketAddr::from((other.ip, 8080));
    let _server = flows::server(other, dst, "echo");
    let z = Ztunnel::start(&cluster, node, &[]);

    // A CNI-style client sending an `add` with the netns fd but no workload
    // info: it must be refused, not enrolled under a guessed identity.
    let netns: OwnedFd = std::fs::File::open(app.netns_path())
        .expect("open pod netns")
        .into();
    let request = WorkloadRequest {
        payload: Some(Payload::Add(AddWorkload {
            uid: "uid-without-info".into(),
            workload_info: None,
        })),
    };
    match zds::request(&z.socket, vec![(request, Some(netns))]) {
        Err(zds::ZdsError::Refused(error)) => assert!(
            error.contains("uid-without-info") && error.contains("workload_info"),
            "the refusal must name the pod and the missing field: {error}"
        ),
        Err(other) => panic!("expected a refusal from ztunnel, got {other}"),
        Ok(()) => panic!("an add without workload info was accepted"),
    }

    // Through the CLI, an empty service account is refused the same way.
    let netns_path = app.netns_path();
    let out = enrol(
        &z,
        &[
            "add",
            "--uid",
            "uid-empty-sa",
            "--netns",
            netns_path.to_str().expect("utf-8"),
            "--namespace",
            "test",
            "--service-account",
            "",
        ],
    );
    assert!(!out.status.success(), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("uid-empty-sa") && stderr.contains("workload_info.service_account"),
        "{out:?}"
    );

    // Nothing was enrolled: no log line, no capture.
    assert_eq!(z.count_log_lines(&["pod enrolled"]), 0, "{}", z.log());
    let before = z.counters();
    flows::assert_ok(&flows::client(app, dst, &ClientRun::default()));
    assert_eq!(
        z.counters().get(Counter::ConnectRedirected),
        before.get(Counter::ConnectRedirected),
        "the refused pod's connection was captured"
    );
    z.wait_for_log("workload_info is missing", Duration::from_secs(2));
}
