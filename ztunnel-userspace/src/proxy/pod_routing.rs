//! What ztunnel sets inside each enrolled pod's namespace so that the
//! application sees the real client IP on inbound connections, with no
//! iptables:
//!
//! - `net.ipv4.tcp_fwmark_accept = 1`: an accepted socket inherits the mark
//!   of the SYN that created it. ztunnel's transparent socket towards the
//!   application carries [`INBOUND_MARK`], so the application's socket does
//!   too.
//! - `ip rule add fwmark INBOUND_REPLY_BIT/INBOUND_REPLY_BIT lookup 1337`
//!   and `ip route add local default dev lo table 1337` (and the IPv6
//!   twins): the application's replies to the (foreign) client IP are
//!   delivered locally, to ztunnel's transparent socket, instead of leaving
//!   through `eth0`.
//! - `net.ipv4.fwmark_reflect = 1` (and `net.ipv6.fwmark_reflect`): a reply
//!   the kernel makes itself, with no socket behind it (the RST that
//!   refuses a SYN to a closed port), carries the mark of the packet it
//!   answers. Without it the refusal of ztunnel's transparent SYN has mark
//!   0, misses the rule above, leaves through `eth0` towards the foreign
//!   client IP and is lost: ztunnel's connect would wait for its SYN
//!   retries (~130 s) instead of seeing "connection refused" at once.
//!   Unmarked traffic in the pod is unaffected (its replies stay unmarked).
//!
//! The rule and route are removed again when the pod is removed. The commands run on a
//! thread inside the pod's namespace (`ip` from iproute2 is required).

use std::process::Command;

use ztunnel_common::{INBOUND_REPLY_BIT, REPLY_ROUTE_TABLE};

use crate::netns::{NetnsError, PodNetns};

/// Errors of the per-pod routing setup.
#[derive(Debug, thiserror::Error)]
pub enum RoutingError {
    /// Entering the namespace failed.
    #[error(transparent)]
    Netns(#[from] NetnsError),
    /// A command or sysctl failed.
    #[error("in {pod}: {what}: {message}")]
    Step {
        /// The pod namespace.
        pod: String,
        /// The step.
        what: String,
        /// Output or OS error.
        message: String,
    },
}

fn rule_args(family: &str, verb: &str) -> Vec<String> {
    vec![
        family.into(),
        "rule".into(),
        verb.into(),
        "fwmark".into(),
        format!("{INBOUND_REPLY_BIT:#x}/{INBOUND_REPLY_BIT:#x}"),
        "lookup".into(),
        REPLY_ROUTE_TABLE.to_string(),
        "pref".into(),
        REPLY_ROUTE_TABLE.to_string(),
    ]
}

fn route_args(family: &str, verb: &str) -> Vec<String> {
    let default = if family == "-6" { "::/0" } else { "0.0.0.0/0" };
    vec![
        family.into(),
        "route".into(),
        verb.into(),
        "local".into(),
        default.into(),
        "dev".into(),
        "lo".into(),
        "table".into(),
        REPLY_ROUTE_TABLE.to_string(),
    ]
}

fn ip(args: &[String]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_owned())
    }
}

/// Whether the reply rule is in place for `family`.
fn has_rule(family: &str) -> Result<bool, String> {
    let out = Command::new("ip")
        .args([family, "rule", "show"])
        .output()
        .map_err(|e| format!("cannot run ip: {e}"))?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).trim().to_owned());
    }
    let wanted =
        format!("fwmark {INBOUND_REPLY_BIT:#x}/{INBOUND_REPLY_BIT:#x} lookup {REPLY_ROUTE_TABLE}");
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .any(|l| l.starts_with(&format!("{REPLY_ROUTE_TABLE}:")) && l.contains(&wanted)))
}

/// Installs the reply routing in `netns` (idempotent).
pub fn install(netns: &PodNetns) -> Result<(), RoutingError> {
    let pod = netns.name().to_owned();
    netns.run(move || {
        let step = |what: &str, message: String| RoutingError::Step {
            pod: pod.clone(),
            what: what.to_owned(),
            message,
        };
        std::fs::write("/proc/sys/net/ipv4/tcp_fwmark_accept", "1")
            .map_err(|e| step("sysctl net.ipv4.tcp_fwmark_accept=1", e.to_string()))?;
        std::fs::write("/proc/sys/net/ipv4/fwmark_reflect", "1")
            .map_err(|e| step("sysctl net.ipv4.fwmark_reflect=1", e.to_string()))?;
        let v6 = std::path::Path::new("/proc/sys/net/ipv6").exists()
            && std::fs::read_to_string("/proc/sys/net/ipv6/conf/all/disable_ipv6")
                .is_ok_and(|v| v.trim() == "0");
        if v6 {
            std::fs::write("/proc/sys/net/ipv6/fwmark_reflect", "1")
                .map_err(|e| step("sysctl net.ipv6.fwmark_reflect=1", e.to_string()))?;
        }
        let families: &[&str] = if v6 { &["-4", "-6"] } else { &["-4"] };
        for family in families {
            // Added only when missing: `ip rule add` stacks duplicates, and
            // a delete-then-add would leave a moment without the rule, in
            // which the replies of connections a running ztunnel carries
            // (an upgrade) leave the pod.
            if !has_rule(family).map_err(|m| step("ip rule show", m))? {
                ip(&rule_args(family, "add")).map_err(|m| step("ip rule add", m))?;
            }
            ip(&route_args(family, "replace")).map_err(|m| step("ip route replace", m))?;
        }
        Ok(())
    })?
}

/// Removes what [`install`] added (missing pieces are fine). The sysctls
/// are left as they are: other software in the pod may rely on it, and it is inert
/// without the rule.
pub fn remove(netns: &PodNetns) -> Result<(), RoutingError> {
    netns.run(|| {
        for family in ["-4", "-6"] {
            let _ = ip(&rule_args(family, "del"));
            let _ = ip(&route_args(family, "del"));
        }
    })?;
    Ok(())
}
