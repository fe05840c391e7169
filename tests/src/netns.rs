//! A network namespace created by a test (`ip netns add`), deleted on drop.

use std::{path::PathBuf, process::Command};

use crate::{run, run_quiet};

/// Owns one named network namespace.
#[derive(Debug)]
pub struct TestNetns {
    name: String,
}

impl TestNetns {
    /// Creates the namespace and brings its loopback up.
    pub fn create(name: &str) -> Self {
        run(Command::new("ip").args(["netns", "add", name]));
        let ns = Self {
            name: name.to_owned(),
        };
        ns.ip(&["link", "set", "lo", "up"]);
        ns
    }

    /// The namespace's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `/var/run/netns/<name>`.
    pub fn path(&self) -> PathBuf {
        PathBuf::from("/var/run/netns").join(&self.name)
    }

    /// `ip -n <ns> <args>`, panicking on failure.
    pub fn ip(&self, args: &[&str]) -> String {
        run(Command::new("ip").arg("-n").arg(&self.name).args(args))
    }

    /// Any command inside the namespace (`ip netns exec`).
    pub fn exec(&self, program: &str, args: &[&str]) -> String {
        run(Command::new("ip")
            .args(["netns", "exec", &self.name, program])
            .args(args))
    }

    /// Like [`Self::exec`] but returns the full output without asserting.
    pub fn exec_output(&self, program: &str, args: &[&str]) -> std::process::Output {
        Command::new("ip")
            .args(["netns", "exec", &self.name, program])
            .args(args)
            .output()
            .expect("run ip netns exec")
    }

    /// Writes a sysctl inside the namespace.
    pub fn sysctl(&self, key: &str, value: &str) {
        self.exec("sysctl", &["-q", "-w", &format!("{key}={value}")]);
    }
}

impl Drop for TestNetns {
    fn drop(&mut self) {
        run_quiet(Command::new("ip").args(["netns", "del", &self.name]));
    }
}

/// Whether a namespace with this name exists.
pub fn exists(name: &str) -> bool {
    PathBuf::from("/var/run/netns").join(name).exists()
}
