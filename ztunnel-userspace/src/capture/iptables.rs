//! The iptables capture backend (`--capture iptables`): the way Istio's
//! in-pod mode captures, kept as a fallback and as the baseline the
//! benchmark compares eBPF capture against. Same proxy, different capture.
//!
//! Inside each enrolled pod's namespace (nat table, IPv4 and IPv6):
//! - `ZTUNNEL_OUTPUT` (from `OUTPUT`): ztunnel's own sockets
//!   (`mark & 0xfff == 0x539`), loopback and excluded destinations return;
//!   every other TCP connect is `REDIRECT`ed to 15001.
//! - `ZTUNNEL_PREROUTING` (from `PREROUTING`, `-i eth0`): 15008, excluded
//!   ports and excluded sources return; every other TCP SYN is
//!   `REDIRECT`ed to 15006.
//!
//! The original destination is read with `getsockopt(SO_ORIGINAL_DST)`.
//! Rules are installed with the `iptables`/`ip6tables` commands, and
//! removed (chains flushed and deleted) when the pod is removed.

use std::{net::SocketAddr, os::fd::AsRawFd, process::Command};

use ztunnel_common::{
    INBOUND_HBONE_PORT, INBOUND_PLAINTEXT_PORT, OUTBOUND_PORT, ZTUNNEL_MARK, ZTUNNEL_MARK_MASK,
};

use super::maps::Exclusions;
use crate::netns::{NetnsError, PodNetns};

/// Errors of the iptables backend.
#[derive(Debug, thiserror::Error)]
pub enum IptablesError {
    /// Entering the namespace failed.
    #[error(transparent)]
    Netns(#[from] NetnsError),
    /// A command failed.
    #[error("in {pod}: `{command}` failed: {message}")]
    Command {
        /// The pod.
        pod: String,
        /// The command line.
        command: String,
        /// Its stderr.
        message: String,
    },
}

fn run(tool: &str, args: &[String]) -> Result<(), String> {
    let out = Command::new(tool)
        .args(["-w", "5"])
        .args(args)
        .output()
        .map_err(|e| format!("cannot run {tool} (install the iptables package): {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_owned())
    }
}

/// One nat-table command line, from words separated by spaces.
fn nat(line: &str) -> Vec<String> {
    std::iter::once("-t")
        .chain(std::iter::once("nat"))
        .chain(line.split_whitespace())
        .map(str::to_owned)
        .collect()
}

fn rules(v6: bool, ex: &Exclusions) -> Vec<Vec<String>> {
    let loopback = if v6 { "::1/128" } else { "127.0.0.0/8" };
    let mut out = vec![
        nat("-N ZTUNNEL_OUTPUT"),
        nat("-N ZTUNNEL_PREROUTING"),
        nat(&format!(
            "-A ZTUNNEL_OUTPUT -m mark --mark {ZTUNNEL_MARK:#x}/{ZTUNNEL_MARK_MASK:#x} -j RETURN"
        )),
        nat(&format!("-A ZTUNNEL_OUTPUT -d {loopback} -j RETURN")),
    ];
    let family = |c: &&super::maps::Cidr| c.addr.is_ipv6() == v6;
    out.extend(
        ex.outbound_ports
            .iter()
            .map(|p| nat(&format!("-A ZTUNNEL_OUTPUT -p tcp --dport {p} -j RETURN"))),
    );
    out.extend(
        ex.outbound_cidrs
            .iter()
            .filter(family)
            .map(|c| nat(&format!("-A ZTUNNEL_OUTPUT -d {c} -j RETURN"))),
    );
    out.push(nat(&format!(
        "-A ZTUNNEL_OUTPUT -p tcp -j REDIRECT --to-ports {OUTBOUND_PORT}"
    )));
    out.push(nat(&format!(
        "-A ZTUNNEL_PREROUTING -p tcp --dport {INBOUND_HBONE_PORT} -j RETURN"
    )));
    out.extend(ex.inbound_ports.iter().map(|p| {
        nat(&format!(
            "-A ZTUNNEL_PREROUTING -p tcp --dport {p} -j RETURN"
        ))
    }));
    out.extend(
        ex.inbound_cidrs
            .iter()
            .filter(family)
            .map(|c| nat(&format!("-A ZTUNNEL_PREROUTING -s {c} -j RETURN"))),
    );
    out.push(nat(&format!(
        "-A ZTUNNEL_PREROUTING -p tcp -j REDIRECT --to-ports {INBOUND_PLAINTEXT_PORT}"
    )));
    out.push(nat("-A OUTPUT -p tcp -j ZTUNNEL_OUTPUT"));
    out.push(nat("-A PREROUTING -i eth0 -p tcp -j ZTUNNEL_PREROUTING"));
    out
}

fn teardown_rules() -> Vec<Vec<String>> {
    [
        "-D OUTPUT -p tcp -j ZTUNNEL_OUTPUT",
        "-D PREROUTING -i eth0 -p tcp -j ZTUNNEL_PREROUTING",
        "-F ZTUNNEL_OUTPUT",
        "-X ZTUNNEL_OUTPUT",
        "-F ZTUNNEL_PREROUTING",
        "-X ZTUNNEL_PREROUTING",
    ]
    .into_iter()
    .map(nat)
    .collect()
}

/// Installs the capture rules in `netns` (removing ours first, so it is
/// idempotent).
pub fn install(netns: &PodNetns, exclusions: &Exclusions) -> Result<(), IptablesError> {
    let pod = netns.name().to_owned();
    let ex = exclusions.clone();
    netns.run(move || {
        for (tool, v6) in [("iptables", false), ("ip6tables", true)] {
            for args in teardown_rules() {
                let _ = run(tool, &args);
            }
            for args in rules(v6, &ex) {
                run(tool, &args).map_err(|message| IptablesError::Command {
                    pod: pod.clone(),
                    command: format!("{tool} {}", args.join(" ")),
                    message,
                })?;
            }
        }
        Ok(())
    })?
}

/// Removes the rules (missing pieces are fine).
pub fn remove(netns: &PodNetns) -> Result<(), IptablesError> {
    netns.run(|| {
        for tool in ["iptables", "ip6tables"] {
            for args in teardown_rules() {
                let _ = run(tool, &args);
            }
        }
    })?;
    Ok(())
}

/// `getsockopt(SO_ORIGINAL_DST)`: the destination before `REDIRECT`.
pub fn original_dst(stream: &impl AsRawFd, v6: bool) -> std::io::Result<SocketAddr> {
    const SO_ORIGINAL_DST: libc::c_int = 80;
    const IP6T_SO_ORIGINAL_DST: libc::c_int = 80;
    // SAFETY: zeroed sockaddr_storage is a valid out-buffer.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    let (level, name) = if v6 {
        (libc::SOL_IPV6, IP6T_SO_ORIGINAL_DST)
    } else {
        (libc::SOL_IP, SO_ORIGINAL_DST)
    };
    // SAFETY: valid fd and out-buffer of the declared size.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            level,
            name,
            (&raw mut storage).cast(),
            &raw mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    match i32::from(storage.ss_family) {
        libc::AF_INET => {
            // SAFETY: the kernel filled a sockaddr_in (family says so).
            let sin: libc::sockaddr_in = unsafe { *(&raw const storage).cast() };
            let ip = std::net::Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
            Ok(SocketAddr::new(ip.into(), u16::from_be(sin.sin_port)))
        }
        libc::AF_INET6 => {
            // SAFETY: the kernel filled a sockaddr_in6 (family says so).
            let sin6: libc::sockaddr_in6 = unsafe { *(&raw const storage).cast() };
            let ip = std::net::Ipv6Addr::from(sin6.sin6_addr.s6_addr);
            Ok(SocketAddr::new(ip.into(), u16::from_be(sin6.sin6_port)))
        }
        _ => Err(std::io::Error::other(
            "SO_ORIGINAL_DST returned no IP address",
        )),
    }
}
