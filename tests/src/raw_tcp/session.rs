//! One hand-made TCP client session: SYN; wait for the SYN-ACK; ACK; one
//! data segment; wait for the target's reaction (data, FIN or RST), acking
//! what arrives; RST. Every segment sent, not only the SYN, has the plan's
//! [`Shape`], so a defence that only copes with plain packets after the
//! handshake cannot be what stops it.
//!
//! [`run`] sets the stage (namespace check, the two raw sockets, the kernel
//! RST filter) and plays the session; every wait is bounded by the plan's
//! timeout and ends early when the caller's `interrupted` flag is set.

use std::{
    io,
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use super::{
    ACK, AddrPair, FIN, Outcome, PSH, RST, RawReceiver, RawSender, SYN, Segment, Shape, ip_packets,
    parse_tcp,
    rst_filter::{ATTACKER_MARK, KernelRstFilter, check_namespace},
    target,
};

/// Once data has arrived, this much silence ends the wait: an echo server
/// answers and then waits for us, without ever sending FIN.
const QUIET_AFTER_DATA: Duration = Duration::from_millis(300);
/// Packets examined per wait at most, matching or not: the raw socket sees
/// every TCP packet of the namespace, and a flood must not keep us forever.
const MAX_PACKETS_PER_WAIT: usize = 4096;
/// Data kept from the target at most; the rest is acked but not stored.
const MAX_DATA: usize = 64 * 1024;
/// Receive window we advertise: the largest without window scaling.
const WINDOW: u16 = 65535;
/// Largest packet we can receive (an IPv4 packet with a 64 KiB payload).
const RECV_BUF: usize = 65536 + 60;

/// A validated session plan.
pub struct SessionPlan {
    /// Our address and the target's.
    pub addrs: AddrPair,
    /// Our source port.
    pub sport: u16,
    /// The target's port.
    pub dport: u16,
    /// How every segment is wrapped.
    pub shape: Shape,
    /// Data sent after the handshake.
    pub payload: Vec<u8>,
    /// Bound of each wait (SYN-ACK, then the reaction).
    pub timeout: Duration,
    /// How the packets leave: a raw IP socket, or a packet socket.
    pub via: Via,
}

/// The kind of socket that sends a session's packets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Via {
    /// `AF_INET`/`AF_INET6` `SOCK_RAW` with the IP header included.
    Ip,
    /// `AF_PACKET` `SOCK_DGRAM` on `eth0`, to the target's link address.
    Packet,
}

/// The interface packet sockets send on (every test pod has one).
const PACKET_IFACE: &str = "eth0";

/// Random bytes from the kernel (getrandom(2)): initial sequence numbers,
/// IP ids and ports must not repeat between runs.
pub fn random_u32() -> io::Result<u32> {
    let mut bytes = [0u8; 4];
    // SAFETY: a writable buffer of the length passed.
    let n = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if n == 4 {
        Ok(u32::from_ne_bytes(bytes))
    } else {
        Err(io::Error::last_os_error())
    }
}

/// `a` comes before `b` in sequence space (RFC 1982 arithmetic).
fn seq_before(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) < 0
}

/// A received segment of our connection, copied out of the buffer.
struct Received {
    seq: u32,
    ack: u32,
    flags: u8,
    payload: Vec<u8>,
}

/// The two raw sockets of one session and its fixed addressing.
struct Wire<'a> {
    sender: RawSender,
    receiver: RawReceiver,
    addrs: AddrPair,
    shape: Shape,
    sport: u16,
    dport: u16,
    ip_id: u16,
    buf: Vec<u8>,
    /// Set from outside (the binary's signal handler); the waits check it.
    interrupted: &'a AtomicBool,
}

impl Wire<'_> {
    /// Sends one segment in the session's shape; each segment gets its own
    /// IPv4 id (never 0: the kernel would replace a 0 in every fragment with
    /// a different id of its own, and reassembly would fail).
    fn send(&mut self, seq: u32, ack: u32, flags: u8, payload: &[u8]) -> Result<()> {
        let segment = Segment {
            sport: self.sport,
            dport: self.dport,
            seq,
            ack,
            flags,
            window: WINDOW,
            payload,
        }
        .encode(self.addrs);
        self.ip_id = self.ip_id.wrapping_add(1).max(1);
        for packet in ip_packets(self.addrs, self.shape, self.ip_id, &segment) {
            self.sender
                .send(&packet, self.addrs.dst())
                .with_context(|| format!("raw send to {}", self.addrs.dst()))?;
        }
        Ok(())
    }

    /// The next segment of our connection before `deadline`, skipping other
    /// traffic; `None` on timeout or after [`MAX_PACKETS_PER_WAIT`] packets.
    fn recv(&mut self, deadline: Instant) -> Result<Option<Received>> {
        for _ in 0..MAX_PACKETS_PER_WAIT {
            if self.interrupted.load(Ordering::SeqCst) {
                bail!("interrupted by a signal");
            }
            let (from, tcp) = match self.receiver.recv(&mut self.buf, deadline) {
                Ok(Some(got)) => got,
                Ok(None) => return Ok(None),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e).context("raw receive"),
            };
            if from != self.addrs.dst() {
                continue;
            }
            let Some(view) = parse_tcp(tcp) else {
                continue;
            };
            if view.sport == self.dport && view.dport == self.sport {
                return Ok(Some(Received {
                    seq: view.seq,
                    ack: view.ack,
                    flags: view.flags,
                    payload: view.payload.to_vec(),
                }));
            }
        }
        Ok(None)
    }
}

/// Runs the session and says what happened.
fn session(wire: &mut Wire<'_>, payload: &[u8], timeout: Duration) -> Result<Outcome> {
    let mut out = Outcome {
        sport: wire.sport,
        ..Outcome::default()
    };
    let isn = random_u32().context("getrandom for the initial sequence number")?;
    wire.send(isn, 0, SYN, &[])?;

    // The SYN-ACK (or an RST acking our SYN: the port is closed).
    let deadline = Instant::now() + timeout;
    let peer_isn = loop {
        let Some(seg) = wire.recv(deadline)? else {
            return Ok(out); // silence: dropped somewhere
        };
        let acks_syn = seg.flags & ACK != 0 && seg.ack == isn.wrapping_add(1);
        if seg.flags & RST != 0 && (acks_syn || seg.flags & ACK == 0) {
            out.rst = true;
            return Ok(out);
        }
        if seg.flags & (SYN | ACK) == SYN | ACK && acks_syn {
            break seg.seq;
        }
    };
    out.syn_ack = true;

    let mut snd_nxt = isn.wrapping_add(1);
    let mut rcv_nxt = peer_isn.wrapping_add(1);
    // What the target has acked of ours: the sequence number its RST
    // check expects (an RST elsewhere in the window only earns a challenge
    // ACK, RFC 5961).
    let mut peer_acked = snd_nxt;
    wire.send(snd_nxt, rcv_nxt, ACK, &[])?;
    wire.send(snd_nxt, rcv_nxt, PSH | ACK, payload)?;
    snd_nxt = snd_nxt.wrapping_add(payload.len() as u32);

    let mut data = Vec::new();
    let deadline = Instant::now() + timeout;
    let mut last_data: Option<Instant> = None;
    for _ in 0..MAX_PACKETS_PER_WAIT {
        let until = last_data.map_or(deadline, |t| deadline.min(t + QUIET_AFTER_DATA));
        let Some(seg) = wire.recv(until)? else {
            break;
        };
        if seg.flags & ACK != 0 && seq_before(peer_acked, seg.ack) && !seq_before(snd_nxt, seg.ack)
        {
            peer_acked = seg.ack;
        }
        if seg.flags & RST != 0 {
            out.rst = true;
            break;
        }
        if seg.flags & SYN != 0 {
            // A retransmitted SYN-ACK: our ACK was lost; say it again.
            wire.send(snd_nxt, rcv_nxt, ACK, &[])?;
            continue;
        }
        // Take what is new in this segment: all of it when it starts at
        // rcv_nxt, the tail when it overlaps what we have, nothing when it
        // starts beyond (a gap: the dup ACK below asks for the rest).
        let end = seg.seq.wrapping_add(seg.payload.len() as u32);
        if !seq_before(rcv_nxt, seg.seq) && seq_before(rcv_nxt, end) {
            // In range by the check above; `get` all the same, never a panic.
            let skip = rcv_nxt.wrapping_sub(seg.seq) as usize;
            let new = seg.payload.get(skip..).unwrap_or_default();
            let room = MAX_DATA.saturating_sub(data.len());
            data.extend_from_slice(&new[..new.len().min(room)]);
            rcv_nxt = end;
            last_data = Some(Instant::now());
        }
        if seg.flags & FIN != 0 && end == rcv_nxt {
            rcv_nxt = rcv_nxt.wrapping_add(1);
            out.fin = true;
        }
        if !seg.payload.is_empty() || seg.flags & FIN != 0 {
            // Ack (or re-ack) so the target does not retransmit for minutes.
            wire.send(snd_nxt, rcv_nxt, ACK, &[])?;
        }
        if out.fin {
            break; // nothing follows a FIN
        }
    }
    out.data = String::from_utf8_lossy(&data).into_owned();

    if !out.rst {
        wire.send(peer_acked, rcv_nxt, RST | ACK, &[])?;
    }
    Ok(out)
}

/// Plays the session of `plan` and says what happened: everything after the
/// command line was checked and signals are caught. Refuses the host's
/// network namespace; holds the kernel RST filter while the session runs.
/// Returns an error when `interrupted` is set during a wait.
pub fn run(plan: &SessionPlan, interrupted: &AtomicBool) -> Result<Outcome> {
    check_namespace()?;
    let v6 = plan.addrs.is_v6();
    let family = if v6 { "AF_INET6" } else { "AF_INET" };
    // The receiver first: a SYN-ACK may come back before the SYN's send
    // call even returns.
    let receiver = RawReceiver::open(v6)
        .with_context(|| format!("{family} SOCK_RAW IPPROTO_TCP receive socket"))?;
    let sender = match plan.via {
        Via::Ip => RawSender::open(v6, ATTACKER_MARK).with_context(|| {
            format!("{family} SOCK_RAW IPPROTO_RAW send socket (header included)")
        })?,
        Via::Packet => {
            let mac = super::sockets::neighbour_mac(plan.addrs.dst(), PACKET_IFACE, plan.timeout)
                .context("the target's link address")?;
            let index = super::sockets::ifindex(PACKET_IFACE).context(PACKET_IFACE)?;
            RawSender::open_packet(v6, index, mac).context("AF_PACKET SOCK_DGRAM send socket")?
        }
    };
    let _filter = KernelRstFilter::install(v6, plan.sport)?;
    let mut wire = Wire {
        sender,
        receiver,
        addrs: plan.addrs,
        shape: plan.shape,
        sport: plan.sport,
        dport: plan.dport,
        ip_id: random_u32().context("getrandom for the IP id")? as u16,
        buf: vec![0; RECV_BUF],
        interrupted,
    };
    session(&mut wire, &plan.payload, plan.timeout).with_context(|| {
        format!(
            "session {} -> {}",
            plan.sport,
            target(plan.addrs, plan.dport)
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequence_comparison_wraps() {
        assert!(seq_before(1, 2));
        assert!(seq_before(u32::MAX, 0));
        assert!(!seq_before(0, u32::MAX));
        assert!(!seq_before(5, 5));
    }
}
