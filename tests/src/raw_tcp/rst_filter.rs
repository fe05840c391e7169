//! Keeps the attacker's own kernel out of the session.
//!
//! The kernel has no socket for a hand-made connection, so it would answer
//! the target's SYN-ACK with an RST and spoil the session. While a session
//! runs, [`KernelRstFilter`] therefore installs
//! `OUTPUT -p tcp -m mark ! --mark <ours> --tcp-flags RST RST --sport <sport> -j DROP`
//! with `iptables`/`ip6tables`, and removes it on drop. The mark exception
//! ([`ATTACKER_MARK`], set with `SO_MARK` on the send socket) lets our own
//! packets through: the final RST, and the first fragment of a `frag4`
//! segment, which holds too little of TCP for the tcp match (legacy iptables
//! drops such a fragment outright rather than skip it).
//!
//! The rule goes into the network namespace the process runs in and nowhere
//! else, so [`check_namespace`] refuses the host's (`init_net`, or PID 1's):
//! the tests always start `zt-raw` in a throwaway attacker namespace, where a
//! rule left behind by SIGKILL dies with the namespace.

use std::process::Command;

use anyhow::{Context as _, Result, bail};

/// `SO_MARK` of our raw packets, which the RST filter lets through. Its low
/// 12 bits are zero so it can never look like ztunnel's own mark.
pub(super) const ATTACKER_MARK: u32 = 0x00ac_0000;

/// The inode number of the initial network namespace (`init_net`), fixed by
/// the kernel (`PROC_NET_INIT_INO`, 0xEFFFFFF9) since Linux 3.8.
const INIT_NET_INODE: u64 = 0xEFFF_FFF9;

/// Refuses the host's namespace: the RST filter must only ever land in a
/// throwaway one. The host's is recognised as `init_net` (by its fixed
/// inode, which needs no privilege to read) or as PID 1's namespace (inside
/// a container; skipped where /proc/1 is not readable, as in sandboxes
/// without CAP_SYS_PTRACE).
pub(super) fn check_namespace() -> Result<()> {
    use std::os::unix::fs::MetadataExt as _;
    let ours = std::fs::metadata("/proc/self/ns/net").context("stat /proc/self/ns/net")?;
    let init = std::fs::metadata("/proc/1/ns/net").ok();
    let same_as_init = init.is_some_and(|i| (i.dev(), i.ino()) == (ours.dev(), ours.ino()));
    if ours.ino() == INIT_NET_INODE || same_as_init {
        bail!(
            "refusing to run in the host's network namespace (net:[{}]): zt-raw installs a \
             firewall rule and belongs in a throwaway namespace",
            ours.ino()
        );
    }
    Ok(())
}

/// While alive, keeps this namespace's kernel from sending RSTs from our
/// source port (see the top of this module); the rule goes on drop.
pub(super) struct KernelRstFilter {
    tool: &'static str,
    spec: Vec<String>,
}

impl KernelRstFilter {
    pub(super) fn install(v6: bool, sport: u16) -> Result<Self> {
        let tool = if v6 { "ip6tables" } else { "iptables" };
        let spec: Vec<String> = [
            "-p",
            "tcp",
            // Matches run in order: our marked packets leave the rule here,
            // before the tcp match could look at a truncated first fragment.
            "-m",
            "mark",
            "!",
            "--mark",
            &format!("{ATTACKER_MARK:#x}"),
            "-m",
            "tcp",
            "--tcp-flags",
            "RST",
            "RST",
            "--sport",
            &sport.to_string(),
            "-j",
            "DROP",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        // First in the chain, so nothing accepted earlier slips through.
        iptables(tool, &["-I", "OUTPUT", "1"], &spec)
            .with_context(|| format!("installing the kernel RST filter with {tool}"))?;
        Ok(Self { tool, spec })
    }
}

impl Drop for KernelRstFilter {
    fn drop(&mut self) {
        // Log, never panic, in Drop.
        if let Err(e) = iptables(self.tool, &["-D", "OUTPUT"], &self.spec) {
            eprintln!("zt-raw: removing the kernel RST filter: {e:#}");
        }
    }
}

/// Runs `tool -w 5 <head> <spec>` (waiting at most 5 s for the xtables lock).
fn iptables(tool: &str, head: &[&str], spec: &[String]) -> Result<()> {
    let out = Command::new(tool)
        .args(["-w", "5"])
        .args(head)
        .args(spec)
        .output()
        .with_context(|| format!("cannot run {tool} (install the iptables package)"))?;
    if !out.status.success() {
        bail!(
            "`{tool} {} {}` failed: {}",
            head.join(" "),
            spec.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}
