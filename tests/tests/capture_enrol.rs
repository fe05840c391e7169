//! Enrolment over the unix socket (ZDS messages, netns fd as SCM_RIGHTS),
//! driven by the real `ztunnel enrol` command.

use std::{net::SocketAddr, os::fd::AsRawFd as _, process::Command, time::Duration};

use nix::sys::socket::{
    AddressFamily, MsgFlags, SockFlag, SockType, UnixAddr, connect, recv, send, socket,
};

use ztunnel_common::Counter;
use ztunnel_tests::{
    Cluster,
    flows::{self, ClientRun},
    kernel::tcx_ingress_programs,
    require_root,
    ztunnel::{Ztunnel, sibling_bin},
};

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
    let z = Ztunnel::start(&cluster, node, &[]);
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
    ];
    let out = enrol(&z, &add);
    assert!(out.status.success(), "{out:?}");
    let before = z.counters();
    flows::assert_ok(&flows::client(app, dst, &ClientRun::default()));
    assert_eq!(
        z.counters().get(Counter::ConnectRedirected),
        before.get(Counter::ConnectRedirected) + 1
    );

    // Enrolling again is a no-op.
    assert!(enrol(&z, &add).status.success());
    assert_eq!(z.count_log_lines(&["pod enrolled", "app-uid"]), 1);

    // Bad requests get an answer naming the problem; the daemon carries on.
    let missing = enrol(&z, &["add", "--uid", "x", "--netns", "/nonexistent/netns"]);
    assert!(!missing.status.success());
    assert!(
        String::from_utf8_lossy(&missing.stderr).contains("/nonexistent/netns"),
        "{missing:?}"
    );

    // A snapshot that does not mention the pod removes it.
    let out = enrol(&z, &["snapshot"]);
    assert!(out.status.success(), "{out:?}");
    z.wait_for_log("pod removed pod=app-uid", Duration::from_secs(5));
    assert!(tcx_ingress_programs(&app.netns_path()).is_empty());
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
    let fd = socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::empty(),
        None,
    )
    .expect("socket");
    connect(fd.as_raw_fd(), &UnixAddr::new(&z.socket).expect("addr")).expect("connect");
    for garbage in [
        &[0xffu8, 0xff, 0xff][..],
        &[0x0a, 0x03, 0x0a, 0x01, 0x41][..],
    ] {
        send(fd.as_raw_fd(), garbage, MsgFlags::empty()).expect("send");
        let mut buf = [0u8; 4096];
        let n = recv(fd.as_raw_fd(), &mut buf, MsgFlags::empty()).expect("recv");
        let reply = String::from_utf8_lossy(&buf[..n]).into_owned();
        // The second message is a well-formed `add` without an fd.
        assert!(
            reply.contains("malformed enrolment message")
                || reply.contains("no network namespace fd"),
            "{reply:?}"
        );
    }
    z.wait_for_log("enrolment request refused", Duration::from_secs(2));
}
