//! Booting a kernel in QEMU with the host's root shared read-only and a
//! results folder shared read-write; the serial console is streamed with
//! a prefix, and the whole boot is bounded by a deadline.

use std::{
    io::{BufRead as _, BufReader},
    path::Path,
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};

use super::{initramfs::DONE_MARKER, kernels::Kernel};

/// How the guest's CPUs are run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Accel {
    /// Hardware virtualisation.
    Kvm,
    /// Software emulation (slow, works anywhere).
    Tcg,
}

impl Accel {
    fn args(self) -> [&'static str; 4] {
        match self {
            Self::Kvm => ["-accel", "kvm", "-cpu", "host"],
            Self::Tcg => ["-accel", "tcg,thread=multi", "-cpu", "max"],
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Self::Kvm => "kvm",
            Self::Tcg => "tcg",
        }
    }
}

/// How a boot ended.
pub struct Boot {
    /// The job's exit status, when the init reported one.
    pub job_status: Option<i32>,
    /// Seconds from start to power-off (or to the deadline).
    pub seconds: f64,
    /// The console's last lines, for the failure message.
    pub tail: Vec<String>,
}

/// Picks KVM only when a trial boot with it reaches our init: `/dev/kvm`
/// can exist and still belong to a nested, paravirtual hypervisor that
/// cannot run a stock kernel (on our build machines QEMU aborts on an MSR
/// write). Anything else is TCG.
pub fn choose_accel(kernel: &Kernel, initrd: &Path, scratch: &Path) -> Accel {
    if std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_err()
    {
        return Accel::Tcg;
    }
    let _ = std::fs::remove_dir_all(scratch);
    if std::fs::create_dir_all(scratch).is_err()
        || std::fs::write(scratch.join("job.sh"), "exit 0\n").is_err()
    {
        return Accel::Tcg;
    }
    let trial = boot(
        kernel,
        initrd,
        scratch,
        Accel::Kvm,
        Duration::from_secs(60),
        None,
    );
    match trial {
        Ok(b) if b.job_status == Some(0) => Accel::Kvm,
        Ok(b) => {
            eprintln!(
                "xtask: vm: /dev/kvm is there but a trial boot did not reach init ({}); using TCG",
                b.tail.last().map_or("no output", String::as_str)
            );
            Accel::Tcg
        }
        Err(e) => {
            eprintln!("xtask: vm: KVM trial failed ({e:#}); using TCG");
            Accel::Tcg
        }
    }
}

/// Boots `kernel` with `initrd`, sharing `/` read-only and `results`
/// read-write, and waits until the guest powers off or `deadline` passes
/// (then QEMU is killed). Console lines are printed with `prefix` when one
/// is given.
pub fn boot(
    kernel: &Kernel,
    initrd: &Path,
    results: &Path,
    accel: Accel,
    deadline: Duration,
    prefix: Option<&str>,
) -> Result<Boot> {
    let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    let mut cmd = Command::new("qemu-system-x86_64");
    cmd.args(accel.args())
        .args(["-m", "3072", "-smp", &cpus.to_string()])
        .arg("-kernel")
        .arg(kernel.image())
        .arg("-initrd")
        .arg(initrd)
        .args([
            "-append",
            "console=ttyS0 quiet loglevel=3 panic=-1 mitigations=off",
            "-display",
            "none",
            "-serial",
            "stdio",
            "-monitor",
            "none",
            "-no-reboot",
            "-nic",
            "none",
            "-virtfs",
            "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap",
            "-virtfs",
        ])
        .arg(format!(
            "local,path={},mount_tag=results,security_model=none",
            results.display()
        ))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let start = Instant::now();
    let mut child = cmd
        .spawn()
        .context("run qemu-system-x86_64 (package qemu-system-x86)")?;
    let (tx, rx) = mpsc::channel::<String>();
    for stream in [
        child
            .stdout
            .take()
            .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
        child
            .stderr
            .take()
            .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
    ]
    .into_iter()
    .flatten()
    {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stream).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
    }
    drop(tx);

    let mut tail: Vec<String> = Vec::new();
    let mut job_status = None;
    loop {
        let left = deadline.saturating_sub(start.elapsed());
        if left.is_zero() {
            kill(&mut child);
            tail.push(format!(
                "(no power-off within {} s: killed)",
                deadline.as_secs()
            ));
            break;
        }
        match rx.recv_timeout(left.min(Duration::from_secs(1))) {
            Ok(line) => {
                let line = line.trim_end_matches('\r').to_owned();
                if let Some(p) = prefix {
                    eprintln!("{p} {line}");
                }
                if let Some(rc) = line
                    .find(DONE_MARKER)
                    .and_then(|i| line[i + DONE_MARKER.len()..].trim().parse().ok())
                {
                    job_status = Some(rc);
                }
                tail.push(line);
                if tail.len() > 40 {
                    tail.remove(0);
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            // Both streams closed: QEMU has exited.
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    // Bounded: the guest powered off or QEMU was killed above.
    let _ = child.wait();
    Ok(Boot {
        job_status,
        seconds: start.elapsed().as_secs_f64(),
        tail,
    })
}

fn kill(child: &mut Child) {
    let _ = child.kill();
}
