//! Debian packages that some steps need, installed with apt-get when
//! missing (saying so). Installing is best effort: when the registry is
//! unreachable the caller is told and decides what that means.

use std::{path::Path, process::Command};

/// Whether `command` is on PATH (or in the sbin folders).
pub fn have(command: &str) -> bool {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin".into(), "/sbin".into()])
        .any(|dir| Path::new(&dir).join(command).is_file())
}

/// Installs the packages of every `(command, package)` whose command is
/// missing; `why` says what for. Returns whether every command is there
/// afterwards.
pub fn ensure(wanted: &[(&str, &str)], why: &str) -> bool {
    let missing: Vec<&str> = wanted
        .iter()
        .filter(|(command, _)| !have(command))
        .map(|(_, package)| *package)
        .collect();
    if missing.is_empty() {
        return true;
    }
    eprintln!("xtask: installing {} (apt-get) {why}", missing.join(", "));
    let install = || {
        Command::new("apt-get")
            .args(["install", "-y", "-q"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
            .is_ok_and(|s| s.success())
    };
    if !install() {
        // A fresh machine may have no package lists yet.
        let _ = Command::new("apt-get").args(["update", "-q"]).status();
        let _ = install();
    }
    wanted.iter().all(|(command, _)| have(command))
}
