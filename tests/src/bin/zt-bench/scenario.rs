//! The scenarios: what stands between the client and the server, how to
//! start it and stop it, and which address the load generators dial.
//!
//! - `direct`: nothing; the load generators dial the server.
//! - `bare-relay`: a `zt-relay` in the client's pod and one in the
//!   server's (no TLS, no mesh); the load generators dial the client pod's
//!   relay, which forwards to the server pod's, which forwards to the
//!   server: the mesh's shape with the least a userspace proxy can do.
//! - `mesh-*`: a ztunnel on each node, started as shipped (release build,
//!   no `--log`, so `info` with the access log on); capture makes the
//!   load generators' connections to the server go through them.
//! - `mesh-ebpf@baseline` (A/B mode): `mesh-ebpf` with another ztunnel
//!   binary (`--baseline-ztunnel`).

use std::{
    net::{Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    time::Duration,
};

use nix::sys::signal::Signal;
use ztunnel_tests::{
    Cluster, Pod,
    process::PodProcess,
    ztunnel::{SHIPPED_LOG, Ztunnel, sibling_bin, ztunnel_bin},
};

use crate::tools::{IPERF3_PORT, NGINX_PORT, SOCKPERF_PORT};

/// Port of the built-in echo server (`zt-probe server --mode echo`).
pub const ECHO_PORT: u16 = 8080;
/// Port of the built-in digest server (bulk sink).
pub const DIGEST_PORT: u16 = 9000;
/// Every server port a load generator dials, so every one gets a relay.
const SERVER_PORTS: [u16; 5] = [
    ECHO_PORT,
    DIGEST_PORT,
    IPERF3_PORT,
    SOCKPERF_PORT,
    NGINX_PORT,
];
/// The client pod's relay of server port P listens on P + this. Both
/// offsets keep the relays' ports below the ephemeral range (32768 on),
/// so no outgoing connection of an earlier measurement holds one.
const CLIENT_RELAY_OFFSET: u16 = 10000;
/// The server pod's relay of server port P listens on P + this (on the
/// server pod's address, like ztunnel's inbound listener).
const SERVER_RELAY_OFFSET: u16 = 20000;
/// How long a relay has to bind its ports (milliseconds, normally).
const RELAY_READY: Duration = Duration::from_secs(10);
/// How long a relay has to exit after SIGTERM before it is killed.
const RELAY_STOP: Duration = Duration::from_secs(2);

/// One scenario of the benchmark.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scenario {
    Direct,
    BareRelay,
    MeshEbpf,
    MeshEbpfSockmap,
    MeshIptables,
    /// `mesh-ebpf` run with the baseline binary of an A/B run.
    MeshEbpfBaseline,
}

/// The scenarios of a normal run, in their first run's order.
pub const NORMAL: [Scenario; 5] = [
    Scenario::Direct,
    Scenario::BareRelay,
    Scenario::MeshEbpf,
    Scenario::MeshEbpfSockmap,
    Scenario::MeshIptables,
];

/// The scenarios of an A/B run (`--baseline-ztunnel`).
pub const AB: [Scenario; 4] = [
    Scenario::Direct,
    Scenario::BareRelay,
    Scenario::MeshEbpf,
    Scenario::MeshEbpfBaseline,
];

impl Scenario {
    /// Its name in the report and the JSON.
    pub fn name(self) -> &'static str {
        match self {
            Self::Direct => "direct",
            Self::BareRelay => "bare-relay",
            Self::MeshEbpf => "mesh-ebpf",
            Self::MeshEbpfSockmap => "mesh-ebpf-sockmap",
            Self::MeshIptables => "mesh-iptables",
            Self::MeshEbpfBaseline => "mesh-ebpf@baseline",
        }
    }

    /// The ztunnel arguments that make this scenario, or `None` when it
    /// runs no ztunnel.
    fn ztunnel_args(self) -> Option<&'static [&'static str]> {
        match self {
            Self::Direct | Self::BareRelay => None,
            // As shipped: the defaults (sockmap off).
            Self::MeshEbpf | Self::MeshEbpfBaseline => Some(&[]),
            Self::MeshEbpfSockmap => Some(&["--sockmap", "on"]),
            Self::MeshIptables => Some(&["--capture", "iptables"]),
        }
    }
}

/// The ztunnel binaries of a run: the working tree's and, in A/B mode, the
/// baseline's.
pub struct Binaries {
    pub current: PathBuf,
    pub baseline: Option<PathBuf>,
    /// Extra arguments of the baseline's ztunnels alone: with the current
    /// binary as the baseline, an A/B of a setting.
    pub baseline_args: Vec<String>,
}

impl Binaries {
    pub fn new(baseline: Option<PathBuf>, baseline_args: Vec<String>) -> Self {
        Self {
            current: ztunnel_bin(),
            baseline,
            baseline_args,
        }
    }
}

/// The two ztunnels of a mesh scenario; stopped (and checked for a clean
/// exit) by [`Mesh::stop`], killed if dropped on a panic.
pub struct Mesh {
    pub a: Ztunnel,
    pub b: Ztunnel,
}

impl Mesh {
    /// Starts the ztunnels of `scenario` on both nodes and waits until
    /// each has its pods; `None` for a scenario without ztunnel.
    pub fn start(
        cluster: &Cluster,
        [na, nb]: [usize; 2],
        scenario: Scenario,
        binaries: &Binaries,
        config: &str,
        more: &[String],
    ) -> Option<Self> {
        let own = scenario.ztunnel_args()?;
        let (binary, own_more): (&Path, &[String]) = if scenario == Scenario::MeshEbpfBaseline {
            (
                binaries
                    .baseline
                    .as_deref()
                    .expect("the baseline scenario runs only with --baseline-ztunnel"),
                &binaries.baseline_args,
            )
        } else {
            (&binaries.current, &[])
        };
        let mut args = vec!["--config", config, "--cleanup", "--drain-timeout", "1"];
        args.extend(own);
        args.extend(more.iter().chain(own_more).map(String::as_str));
        let a = Ztunnel::start_binary(cluster, na, binary, SHIPPED_LOG, &args);
        let b = Ztunnel::start_binary(cluster, nb, binary, SHIPPED_LOG, &args);
        a.wait_for_log("pod enrolled pod=srv-a", Duration::from_secs(15));
        a.wait_for_log("pod enrolled pod=client", Duration::from_secs(15));
        b.wait_for_log("pod enrolled pod=srv-b", Duration::from_secs(15));
        Some(Self { a, b })
    }

    /// The processes whose CPU counts as the proxy's.
    pub fn pids(&self) -> Vec<u32> {
        vec![self.a.pid(), self.b.pid()]
    }

    pub fn stop(mut self) {
        self.a.stop();
        self.b.stop();
    }
}

/// Where the load generators dial a server port: the server itself, or
/// the client pod's relay in front of it.
#[derive(Clone, Copy, Debug)]
pub struct Dial {
    ip: Ipv4Addr,
    offset: u16,
}

impl Dial {
    /// The server's own address.
    pub fn direct(server: &Pod) -> Self {
        Self {
            ip: server.ip,
            offset: 0,
        }
    }

    /// The relay in the client's pod ([`Relays`]).
    pub fn via_relay(client: &Pod) -> Self {
        Self {
            ip: client.ip,
            offset: CLIENT_RELAY_OFFSET,
        }
    }

    /// The address to dial for the server's `port`.
    pub fn addr(self, port: u16) -> SocketAddr {
        SocketAddr::from((self.ip, port + self.offset))
    }
}

/// One `zt-relay` process, stopped with SIGTERM (then killed) on drop.
struct Relay(Option<PodProcess>);

impl Relay {
    fn start(pod: &Pod, pairs: impl Iterator<Item = (SocketAddr, SocketAddr)>) -> Self {
        let mut cmd = pod.command(&sibling_bin("zt-relay"));
        for (listen, to) in pairs {
            cmd.arg("--listen")
                .arg(listen.to_string())
                .arg("--to")
                .arg(to.to_string());
        }
        let mut process = PodProcess::spawn(&format!("zt-relay-{}", pod.name), cmd);
        let ready = process.read_line(RELAY_READY);
        assert_eq!(ready, "READY", "zt-relay in {} did not start", pod.name);
        Self(Some(process))
    }

    fn pid(&self) -> u32 {
        self.0.as_ref().map_or(0, PodProcess::pid)
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        if let Some(process) = self.0.take() {
            process.signal(Signal::SIGTERM);
            // try_wait kills it if it has not exited by then.
            if process.try_wait(RELAY_STOP).is_none() {
                eprintln!("zt-bench: a relay ignored SIGTERM and was killed");
            }
        }
    }
}

/// The two relays of `bare-relay` for one client/server pair:
/// client -> client_ip:(P+10000) -> server_ip:(P+20000) -> server_ip:P.
pub struct Relays {
    client: Relay,
    server: Relay,
}

impl Relays {
    pub fn start(client: &Pod, server: &Pod) -> Self {
        let at = |ip: Ipv4Addr, port: u16| SocketAddr::from((ip, port));
        // The server's first, so the client's never forwards into nothing.
        let server_relay = Relay::start(
            server,
            SERVER_PORTS
                .iter()
                .map(|&p| (at(server.ip, p + SERVER_RELAY_OFFSET), at(server.ip, p))),
        );
        let client_relay = Relay::start(
            client,
            SERVER_PORTS.iter().map(|&p| {
                (
                    at(client.ip, p + CLIENT_RELAY_OFFSET),
                    at(server.ip, p + SERVER_RELAY_OFFSET),
                )
            }),
        );
        Self {
            client: client_relay,
            server: server_relay,
        }
    }

    /// The processes whose CPU counts as the proxy's.
    pub fn pids(&self) -> Vec<u32> {
        vec![self.client.pid(), self.server.pid()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relay_ports_stay_in_range_and_apart() {
        for p in SERVER_PORTS {
            let client = p.checked_add(CLIENT_RELAY_OFFSET).expect("client port");
            let server = p.checked_add(SERVER_RELAY_OFFSET).expect("server port");
            assert!(!SERVER_PORTS.contains(&client) && !SERVER_PORTS.contains(&server));
            assert!(client < 32768 && server < 32768, "{client} {server}");
        }
    }
}
