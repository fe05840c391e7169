//! Generates the protobuf messages and embeds the kernel object built by
//! `cargo xtask build-ebpf`.
//!
//! Protobuf: every `.proto` in `proto/` (Istio's wire contracts, with
//! Istio's package names and field numbers) is compiled with protox (pure
//! Rust, no `protoc` needed) and turned into Rust by prost-build, one file
//! per package in `OUT_DIR`.
//!
//! eBPF:
//! There is exactly one builder (xtask). This script only checks that the
//! object it finds was built from the current eBPF sources, using the same
//! code xtask uses to stamp it, and refuses to build otherwise: a stale or
//! missing object is never embedded silently: a debug build without one
//! (`cargo check` on a fresh clone) embeds an empty placeholder with a
//! warning, and the loader refuses it at start.

#[path = "../xtask/src/ebpf_artifact.rs"]
mod ebpf_artifact;

use std::path::PathBuf;

fn main() {
    compile_protos();
    embed_ebpf();
    link_order();
}

/// Lays the `ztunnel` binary's text out in the order `cargo xtask layout`
/// recorded: what start-up and an idle proxy run first, then the data
/// path, then the rest. The kernel maps text in 64 KiB blocks, so packing
/// what runs keeps the resident part of the binary small. Only with lld
/// (`--symbol-ordering-file`), the default linker of
/// x86_64-unknown-linux-gnu; names the build does not have are ignored.
fn link_order() {
    let order = PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"),
    )
    .join("layout/ztunnel.order");
    println!("cargo:rerun-if-changed={}", order.display());
    let lld_default = std::env::var("TARGET").as_deref() == Ok("x86_64-unknown-linux-gnu");
    let lld_off = std::env::var("CARGO_ENCODED_RUSTFLAGS")
        .is_ok_and(|f| f.contains("linker-features=-lld") || f.contains("fuse-ld=bfd"));
    if !lld_default || lld_off {
        return;
    }
    if order.is_file() {
        println!(
            "cargo:rustc-link-arg-bin=ztunnel=-Wl,--symbol-ordering-file={}",
            order.display()
        );
        println!("cargo:rustc-link-arg-bin=ztunnel=-Wl,--no-warn-symbol-ordering");
    }
    // Relative relocations packed (DT_RELR, glibc >= 2.36): the dynamic
    // loader reads ~10 KiB instead of ~290 KiB of `.rela.dyn` at every
    // start, and those pages stay resident.
    println!("cargo:rustc-link-arg-bin=ztunnel=-Wl,-z,pack-relative-relocs");
}

fn compile_protos() {
    let dir = PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"),
    )
    .join("proto");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("ztunnel-userspace/proto is part of the crate")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "proto"))
        .collect();
    files.sort();
    println!("cargo:rerun-if-changed={}", dir.display());
    for file in &files {
        println!("cargo:rerun-if-changed={}", file.display());
    }
    let descriptors = match protox::compile(&files, [&dir]) {
        Ok(descriptors) => descriptors,
        Err(e) => {
            eprintln!(
                "error: a .proto file in {} does not compile: {e:?}",
                dir.display()
            );
            std::process::exit(1);
        }
    };
    // Services get a client (ztunnel's) and a server (the tests' control
    // plane); messages are plain prost.
    if let Err(e) = tonic_prost_build::configure().compile_fds(descriptors) {
        eprintln!("error: generating Rust from the .proto files failed: {e}");
        std::process::exit(1);
    }
}

fn embed_ebpf() {
    let manifest = PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"),
    );
    let workspace = manifest
        .parent()
        .expect("crate lives in the workspace")
        .to_path_buf();
    let artifact = ebpf_artifact::Artifact::locate(&workspace);

    println!("cargo:rerun-if-changed={}", artifact.object.display());
    println!("cargo:rerun-if-changed={}", artifact.stamp.display());
    for input in ebpf_artifact::input_files(&workspace) {
        println!("cargo:rerun-if-changed={}", input.display());
    }
    println!("cargo:rerun-if-env-changed=CARGO_TARGET_DIR");

    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let embedded = out.join(ebpf_artifact::OBJECT_NAME);
    // A fresh clone has no object yet. `cargo check`, rust-analyzer and a
    // debug `cargo build` still work: they embed an empty object, which the
    // loader refuses at start with a sentence saying how to rebuild. A
    // release build, which is what gets shipped, must carry the real thing;
    // a stale object (sources changed since it was built) is refused in
    // every profile, because it would load the wrong programs.
    let release = std::env::var("PROFILE").is_ok_and(|p| p == "release");
    if !artifact.object.exists() && !release {
        println!(
            "cargo:warning=no eBPF object at {} yet: this build embeds none and `ztunnel run \
             --capture ebpf` will refuse to start. Run `cargo xtask build-ebpf` for a usable binary.",
            artifact.object.display()
        );
        std::fs::write(&embedded, b"").expect("write the empty placeholder into OUT_DIR");
        return;
    }
    if let Err(problem) = artifact.check_current(&workspace) {
        eprintln!(
            "error: ztunnel-userspace embeds the eBPF object, but {problem}.\n\
             Run `cargo xtask build-ebpf` (or `cargo xtask test`) first."
        );
        std::process::exit(1);
    }
    std::fs::copy(&artifact.object, &embedded).expect("copy the eBPF object into OUT_DIR");
}
