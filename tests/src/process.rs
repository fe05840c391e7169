//! Processes running inside a pod: its network namespace and its cgroup.

use std::{
    fs::File,
    io::{Read as _, Write as _},
    os::{fd::AsRawFd, unix::process::CommandExt as _},
    path::Path,
    process::{Child, Command, ExitStatus, Stdio},
    time::{Duration, Instant},
};

/// Builds a command that, in the child right before `exec`, joins the cgroup
/// (so the capture programs see it) and then the network namespace.
///
/// `ip netns exec` is not used on purpose: it remounts `/sys`, which hides
/// the cgroup2 mount from the child on hybrid hosts.
pub fn command_in(netns: &Path, cgroup_procs: &Path, program: &Path) -> Command {
    let ns = File::open(netns).unwrap_or_else(|e| panic!("open {}: {e}", netns.display()));
    let procs = std::fs::OpenOptions::new()
        .write(true)
        .open(cgroup_procs)
        .unwrap_or_else(|e| panic!("open {}: {e}", cgroup_procs.display()));
    let mut cmd = Command::new(program);
    // SAFETY: the closure only makes async-signal-safe syscalls (write,
    // setns) on fds opened before fork; it allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            let pid = b"0\n"; // "0" means "the writing process" in cgroup.procs
            if libc::write(procs.as_raw_fd(), pid.as_ptr().cast(), pid.len()) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd
}

/// A child process that is killed (and reaped) when dropped.
#[derive(Debug)]
pub struct PodProcess {
    name: String,
    child: Option<Child>,
}

/// What a finished process produced.
#[derive(Debug)]
pub struct Finished {
    /// Exit status.
    pub status: ExitStatus,
    /// Everything it wrote to stdout.
    pub stdout: String,
    /// Everything it wrote to stderr.
    pub stderr: String,
}

impl PodProcess {
    /// Spawns `cmd` with piped stdout/stderr.
    pub fn spawn(name: &str, mut cmd: Command) -> Self {
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let child = cmd.spawn().unwrap_or_else(|e| panic!("spawn {name}: {e}"));
        Self {
            name: name.to_owned(),
            child: Some(child),
        }
    }

    /// Spawns `cmd` with the stdio it already has configured.
    pub fn spawn_with_io(name: &str, mut cmd: Command) -> Self {
        cmd.stdin(Stdio::null());
        let child = cmd.spawn().unwrap_or_else(|e| panic!("spawn {name}: {e}"));
        Self {
            name: name.to_owned(),
            child: Some(child),
        }
    }

    /// Whether the process has not exited yet.
    pub fn is_running(&self) -> bool {
        self.child.as_ref().is_some_and(|c| {
            // SAFETY: kill(pid, 0) only checks for existence.
            let alive = unsafe { libc::kill(c.id() as i32, 0) } == 0;
            let status =
                std::fs::read_to_string(format!("/proc/{}/stat", c.id())).unwrap_or_default();
            alive && !status.contains(") Z ")
        })
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// Waits at most `limit`; `None` (after killing it) if it is still
    /// running then. For load generators that may hang on a peer.
    pub fn try_wait(mut self, limit: Duration) -> Option<Finished> {
        let mut child = self.child.take().expect("child present");
        let deadline = Instant::now() + limit;
        let status = loop {
            if let Ok(Some(status)) = child.try_wait() {
                break status;
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let (stdout, stderr) = drain(&mut child);
        Some(Finished {
            status,
            stdout,
            stderr,
        })
    }

    /// Waits at most `limit`; panics (after killing it) if it is still running.
    pub fn wait(mut self, limit: Duration) -> Finished {
        let mut child = self.child.take().expect("child present");
        let deadline = Instant::now() + limit;
        let status = loop {
            if let Some(status) = child.try_wait().expect("try_wait") {
                break status;
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                let (out, err) = drain(&mut child);
                panic!(
                    "{} still running after {limit:?}; stdout: {out}\nstderr: {err}",
                    self.name
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let (stdout, stderr) = drain(&mut child);
        Finished {
            status,
            stdout,
            stderr,
        }
    }

    /// Sends a signal (e.g. SIGTERM, SIGKILL).
    pub fn signal(&self, signal: nix::sys::signal::Signal) {
        if let Some(child) = &self.child {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), signal);
        }
    }

    /// Like [`Self::read_line`], but `None` instead of a panic on timeout.
    pub fn try_read_line(&mut self, limit: Duration) -> Option<String> {
        let stdout = self.child.as_mut().and_then(|c| c.stdout.as_mut())?;
        let fd = stdout.as_raw_fd();
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, bounded wait.
        if unsafe { libc::poll(&raw mut pfd, 1, limit.as_millis() as i32) } <= 0 {
            return None;
        }
        Some(self.read_line(limit))
    }

    /// Reads one line from stdout, waiting at most `limit` (servers print a
    /// "ready" line once listening).
    pub fn read_line(&mut self, limit: Duration) -> String {
        let stdout = self
            .child
            .as_mut()
            .and_then(|c| c.stdout.as_mut())
            .expect("piped stdout");
        let fd = stdout.as_raw_fd();
        let deadline = Instant::now() + limit;
        let mut line = Vec::new();
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            assert!(
                !remaining.is_zero(),
                "{}: no line on stdout within {limit:?}",
                self.name
            );
            let mut pfd = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd, bounded wait.
            let ready =
                unsafe { libc::poll(&raw mut pfd, 1, remaining.as_millis().min(1000) as i32) };
            if ready <= 0 {
                continue;
            }
            let mut byte = [0u8; 1];
            match stdout.read(&mut byte) {
                Ok(0) => panic!(
                    "{}: stdout closed before a full line: {:?}",
                    self.name,
                    String::from_utf8_lossy(&line)
                ),
                Ok(_) if byte[0] == b'\n' => return String::from_utf8_lossy(&line).into_owned(),
                Ok(_) => line.push(byte[0]),
                Err(e) => panic!("{}: reading stdout: {e}", self.name),
            }
        }
    }
}

fn drain(child: &mut Child) -> (String, String) {
    let mut out = String::new();
    let mut err = String::new();
    if let Some(s) = child.stdout.as_mut() {
        let _ = s.read_to_string(&mut out);
    }
    if let Some(s) = child.stderr.as_mut() {
        let _ = s.read_to_string(&mut err);
    }
    (out, err)
}

impl Drop for PodProcess {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Writes `data` to a file, for tests that need config files.
pub fn write_file(path: &Path, data: &str) {
    let mut f = File::create(path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
    f.write_all(data.as_bytes()).expect("write file");
}
