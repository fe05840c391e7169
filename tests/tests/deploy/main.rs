//! The Kubernetes deployment (`deploy/`): the Helm chart, rendered here
//! without helm (`render`), must equal the committed manifests; every
//! committed manifest must parse strictly into the Kubernetes API types
//! (`strict`); and the DaemonSet must keep what running ztunnel on a node
//! needs (capabilities, probe, ports, annotations, upgrade strategy, mounts,
//! the istiod settings). No root needed.
//!
//! After a chart change, regenerate the manifests with
//! `ZTUNNEL_BLESS=1 cargo test -p ztunnel-tests --test deploy` and review the diff.

mod render;
mod strict;

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Command,
};

use k8s_openapi::{
    api::{
        apps::v1::DaemonSet,
        core::v1::{Container, PodSpec},
    },
    apimachinery::pkg::util::intstr::IntOrString,
};
use render::Release;
use strict::Object;

/// The ports ztunnel serves on its pod (README.md, "Operating it").
const METRICS_PORT: i32 = 15020;
const READINESS_PORT: i32 = 15021;

/// Each committed manifest and the release it is the chart's rendering of.
const MANIFESTS: &[(&str, Release<'static>, &str)] = &[
    (
        "ztunnel.yaml",
        Release {
            name: "ztunnel",
            namespace: "ztunnel-system",
            overrides: "{}",
        },
        "the chart with its default values (capture: ebpf)",
    ),
    (
        "ztunnel-istio.yaml",
        Release {
            name: "ztunnel",
            namespace: "istio-system",
            overrides: "capture: istio-cni",
        },
        "the chart for an Istio ambient node (capture: istio-cni)",
    ),
];

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .join("deploy")
}

fn chart_dir() -> PathBuf {
    deploy_dir().join("chart")
}

fn header(release: &Release<'_>, what: &str) -> String {
    format!(
        "# Generated from deploy/chart by tests/tests/deploy: {what},\n\
         # release `{}` in namespace `{}` (what `helm template {} deploy/chart --namespace {}{}`\n\
         # renders). Edit the chart, then `ZTUNNEL_BLESS=1 cargo test -p ztunnel-tests --test deploy`.\n",
        release.name,
        release.namespace,
        release.name,
        release.namespace,
        if release.overrides == "{}" {
            String::new()
        } else {
            format!(" --set {}", release.overrides.replace(": ", "="))
        },
    )
}

fn render_or_panic(release: &Release<'_>) -> String {
    render::render(&chart_dir(), release).unwrap_or_else(|e| panic!("rendering the chart: {e}"))
}

fn parse_or_panic(text: &str, what: &str) -> Vec<Object> {
    strict::parse_all(text).unwrap_or_else(|e| panic!("{what} does not parse strictly:\n{e}"))
}

/// The committed manifests are the chart's renderings, byte for byte, so
/// they cannot drift apart; `ZTUNNEL_BLESS=1` rewrites them instead.
#[test]
fn deploy_manifests_are_the_rendered_chart() {
    let bless = std::env::var("ZTUNNEL_BLESS").as_deref() == Ok("1");
    for (file, release, what) in MANIFESTS {
        let path = deploy_dir().join(file);
        let want = format!("{}{}", header(release, what), render_or_panic(release));
        if bless {
            // Through a rename, so that the tests reading the manifests
            // meanwhile (they run in parallel) never see half a file.
            let tmp = path.with_extension("yaml.tmp");
            std::fs::write(&tmp, &want).unwrap_or_else(|e| panic!("{}: {e}", tmp.display()));
            std::fs::rename(&tmp, &path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            eprintln!("wrote {}", path.display());
            continue;
        }
        let have = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{file}: {e}"));
        if have != want {
            let (line, (h, w)) = have
                .lines()
                .zip(want.lines())
                .enumerate()
                .find(|(_, (h, w))| h != w)
                .unwrap_or((have.lines().count().min(want.lines().count()), ("", "")));
            panic!(
                "deploy/{file} is not the chart's rendering (first difference at line {}: \
                 committed {h:?}, rendered {w:?}); run \
                 `ZTUNNEL_BLESS=1 cargo test -p ztunnel-tests --test deploy` and commit the result",
                line + 1
            );
        }
    }
}

/// Every YAML file directly under deploy/ parses strictly, and every
/// manifest the chart renders is one of them.
#[test]
fn deploy_manifests_parse_strictly() {
    let mut files: Vec<_> = std::fs::read_dir(deploy_dir())
        .expect("deploy/")
        .map(|e| e.expect("deploy/ entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    let names: Vec<_> = files
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    let expected: Vec<_> = MANIFESTS.iter().map(|(f, _, _)| (*f).to_owned()).collect();
    let mut sorted = expected.clone();
    sorted.sort();
    assert_eq!(names, sorted, "the manifests under deploy/");
    for file in files {
        let text = std::fs::read_to_string(&file).expect("manifest");
        let objects = parse_or_panic(&text, &file.display().to_string());
        let kinds: Vec<_> = objects.iter().map(kind).collect();
        assert_eq!(kinds, ["ServiceAccount", "DaemonSet"], "{}", file.display());
    }
}

fn kind(object: &Object) -> &'static str {
    match object {
        Object::ServiceAccount(_) => "ServiceAccount",
        Object::ConfigMap(_) => "ConfigMap",
        Object::DaemonSet(_) => "DaemonSet",
    }
}

fn committed(file: &str) -> Vec<Object> {
    let path = deploy_dir().join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{file}: {e}"));
    parse_or_panic(&text, file)
}

fn daemonset(objects: &[Object]) -> &DaemonSet {
    objects
        .iter()
        .find_map(|o| match o {
            Object::DaemonSet(ds) => Some(&**ds),
            _ => None,
        })
        .expect("a DaemonSet")
}

fn pod_spec(ds: &DaemonSet) -> &PodSpec {
    ds.spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .expect("pod spec")
}

fn container(ds: &DaemonSet) -> &Container {
    let spec = pod_spec(ds);
    assert_eq!(spec.containers.len(), 1, "one container");
    &spec.containers[0]
}

fn args(ds: &DaemonSet) -> &[String] {
    container(ds).args.as_deref().unwrap_or_default()
}

/// The value after `flag` in the container's args.
fn flag<'a>(ds: &'a DaemonSet, flag: &str) -> Option<&'a str> {
    let args = args(ds);
    let at = args.iter().position(|a| a == flag)?;
    args.get(at + 1).map(String::as_str)
}

fn env(ds: &DaemonSet) -> BTreeMap<&str, String> {
    container(ds)
        .env
        .as_deref()
        .unwrap_or_default()
        .iter()
        .map(|e| {
            let value = match (&e.value, &e.value_from) {
                (Some(v), _) => v.clone(),
                (None, Some(from)) => format!(
                    "fieldRef:{}",
                    from.field_ref
                        .as_ref()
                        .map_or("?", |f| f.field_path.as_str())
                ),
                (None, None) => String::new(),
            };
            (e.name.as_str(), value)
        })
        .collect()
}

/// Mount path → the host path behind it, for every hostPath volume.
fn host_mounts(ds: &DaemonSet) -> BTreeMap<String, String> {
    let volumes = pod_spec(ds).volumes.as_deref().unwrap_or_default();
    container(ds)
        .volume_mounts
        .as_deref()
        .unwrap_or_default()
        .iter()
        .filter_map(|m| {
            let volume = volumes.iter().find(|v| v.name == m.name)?;
            let host = volume.host_path.as_ref()?;
            Some((m.mount_path.clone(), host.path.clone()))
        })
        .collect()
}

/// Mount path → volume name, for every mount.
fn mounts(ds: &DaemonSet) -> BTreeMap<String, String> {
    container(ds)
        .volume_mounts
        .as_deref()
        .unwrap_or_default()
        .iter()
        .map(|m| (m.mount_path.clone(), m.name.clone()))
        .collect()
}

/// What running on a node needs, the same in both manifests.
fn assert_node_facts(file: &str, capture: &str) {
    let objects = committed(file);
    let ds = daemonset(&objects);
    let spec = pod_spec(ds);
    let c = container(ds);

    // The binary's subcommand and the capture mode.
    assert_eq!(args(ds).first().map(String::as_str), Some("run"), "{file}");
    assert_eq!(flag(ds, "--capture"), Some(capture), "{file}: --capture");

    // Capabilities instead of a blanket grant: all of them added, the rest dropped.
    let sc = c.security_context.as_ref().expect("securityContext");
    let caps = sc.capabilities.as_ref().expect("capabilities");
    let added = caps.add.as_deref().unwrap_or_default();
    for cap in ["BPF", "PERFMON", "NET_ADMIN", "SYS_ADMIN", "NET_RAW"] {
        assert!(added.iter().any(|a| a == cap), "{file}: capability {cap}");
    }
    assert_eq!(
        caps.drop.as_deref(),
        Some(&["ALL".to_owned()][..]),
        "{file}"
    );
    assert_eq!(sc.read_only_root_filesystem, Some(true), "{file}");

    // Readiness on :15021/healthz/ready; metrics on 15020, annotated for Prometheus.
    let probe = c.readiness_probe.as_ref().expect("readinessProbe");
    let get = probe.http_get.as_ref().expect("readiness httpGet");
    assert_eq!(get.path.as_deref(), Some("/healthz/ready"), "{file}");
    assert_eq!(get.port, IntOrString::Int(READINESS_PORT), "{file}");
    let ports = c.ports.as_deref().unwrap_or_default();
    assert!(
        ports.iter().any(|p| p.container_port == METRICS_PORT),
        "{file}: containerPort {METRICS_PORT}"
    );
    let template = &ds.spec.as_ref().expect("spec").template;
    let annotations = template
        .metadata
        .as_ref()
        .and_then(|m| m.annotations.as_ref())
        .expect("pod annotations");
    for (key, value) in [
        ("prometheus.io/scrape", "true"),
        ("prometheus.io/port", "15020"),
        ("prometheus.io/path", "/metrics"),
    ] {
        assert_eq!(
            annotations.get(key).map(String::as_str),
            Some(value),
            "{file}: {key}"
        );
    }

    // Upgrades: the new pod first (two ztunnels per node is supported).
    let strategy = ds
        .spec
        .as_ref()
        .and_then(|s| s.update_strategy.as_ref())
        .expect("updateStrategy");
    assert_eq!(strategy.type_.as_deref(), Some("RollingUpdate"), "{file}");
    let rolling = strategy.rolling_update.as_ref().expect("rollingUpdate");
    assert_eq!(rolling.max_surge, Some(IntOrString::Int(1)), "{file}");
    assert_eq!(rolling.max_unavailable, Some(IntOrString::Int(0)), "{file}");

    // Scheduling: on every node, before anything else, in its own network namespace.
    assert_eq!(
        spec.priority_class_name.as_deref(),
        Some("system-node-critical"),
        "{file}"
    );
    assert!(
        spec.tolerations
            .as_deref()
            .unwrap_or_default()
            .iter()
            .any(|t| t.operator.as_deref() == Some("Exists")
                && t.key.is_none()
                && t.effect.is_none()),
        "{file}: a toleration of every taint"
    );
    assert_ne!(spec.host_network, Some(true), "{file}: hostNetwork");
    assert_ne!(spec.host_pid, Some(true), "{file}: hostPID");
    let requests = c
        .resources
        .as_ref()
        .and_then(|r| r.requests.as_ref())
        .expect("resource requests");
    assert!(
        requests.contains_key("cpu") && requests.contains_key("memory"),
        "{file}: cpu and memory requests"
    );

    // The kubelet waits out the drain.
    let drain: i64 = flag(ds, "--drain-timeout")
        .expect("--drain-timeout")
        .parse()
        .expect("--drain-timeout is seconds");
    let grace = spec
        .termination_grace_period_seconds
        .expect("terminationGracePeriodSeconds");
    assert!(
        grace > drain,
        "{file}: grace {grace} s must exceed the drain {drain} s"
    );

    // The node paths: enrolment socket folder, bpffs, the cgroup v2 root
    // (mounted where --cgroup points).
    let host = host_mounts(ds);
    assert_eq!(
        host.get("/var/run/ztunnel").map(String::as_str),
        Some("/var/run/ztunnel"),
        "{file}: {host:?}"
    );
    assert_eq!(
        host.get("/sys/fs/bpf").map(String::as_str),
        Some("/sys/fs/bpf"),
        "{file}: {host:?}"
    );
    let cgroup = flag(ds, "--cgroup").expect("--cgroup");
    assert_eq!(
        host.get(cgroup).map(String::as_str),
        Some("/sys/fs/cgroup"),
        "{file}: --cgroup {cgroup} is the node's cgroup root: {host:?}"
    );

    // The downward-API env Istio's chart sets; NODE_NAME is --node-name.
    let env = env(ds);
    for (name, field) in [
        ("NODE_NAME", "spec.nodeName"),
        ("POD_NAME", "metadata.name"),
        ("POD_NAMESPACE", "metadata.namespace"),
        ("INSTANCE_IP", "status.podIP"),
        ("SERVICE_ACCOUNT", "spec.serviceAccountName"),
    ] {
        assert_eq!(
            env.get(name).map(String::as_str),
            Some(format!("fieldRef:{field}").as_str()),
            "{file}: {name}"
        );
    }

    // The pod runs as the chart's ServiceAccount, which has no API token.
    let sa = objects
        .iter()
        .find_map(|o| match o {
            Object::ServiceAccount(sa) => Some(&**sa),
            _ => None,
        })
        .expect("ServiceAccount");
    assert_eq!(spec.service_account_name, sa.metadata.name, "{file}");
    assert_eq!(sa.metadata.namespace, ds.metadata.namespace, "{file}");
    assert_eq!(sa.automount_service_account_token, Some(false), "{file}");
}

#[test]
fn deploy_ebpf_manifest_runs_ztunnel_on_every_node() {
    assert_node_facts("ztunnel.yaml", "ebpf");
    let objects = committed("ztunnel.yaml");
    let ds = daemonset(&objects);
    // No istiod in this cluster: none of its settings.
    let env = env(ds);
    for name in ["CA_ADDRESS", "XDS_ADDRESS", "ISTIO_META_CLUSTER_ID"] {
        assert!(!env.contains_key(name), "ztunnel.yaml: {name}");
    }
    assert!(!mounts(ds).contains_key("/var/run/secrets/tokens"));
}

#[test]
fn deploy_istio_manifest_has_istiods_settings() {
    assert_node_facts("ztunnel-istio.yaml", "istio-cni");
    let objects = committed("ztunnel-istio.yaml");
    let ds = daemonset(&objects);
    // istiod trusts the account istio-system/ztunnel to ask for pods' certificates.
    assert_eq!(ds.metadata.namespace.as_deref(), Some("istio-system"));
    assert_eq!(
        pod_spec(ds).service_account_name.as_deref(),
        Some("ztunnel")
    );
    let env = env(ds);
    for (name, value) in [
        ("CA_ADDRESS", "istiod.istio-system.svc:15012"),
        ("XDS_ADDRESS", "istiod.istio-system.svc:15012"),
        ("CLUSTER_ID", "Kubernetes"),
        ("ISTIO_META_CLUSTER_ID", "Kubernetes"),
    ] {
        assert_eq!(env.get(name).map(String::as_str), Some(value), "{name}");
    }

    // The token istiod authenticates ztunnel by, and istiod's root certificate.
    let mounts = mounts(ds);
    let volumes = pod_spec(ds).volumes.as_deref().unwrap_or_default();
    let volume = |path: &str| {
        let name = mounts
            .get(path)
            .unwrap_or_else(|| panic!("a mount at {path}"));
        volumes
            .iter()
            .find(|v| &v.name == name)
            .unwrap_or_else(|| panic!("volume {name}"))
    };
    let token = volume("/var/run/secrets/tokens")
        .projected
        .as_ref()
        .and_then(|p| p.sources.as_deref())
        .and_then(|s| s.first())
        .and_then(|s| s.service_account_token.as_ref())
        .expect("a projected service account token");
    assert_eq!(token.audience.as_deref(), Some("istio-ca"));
    assert_eq!(token.path, "istio-token");
    let root = volume("/var/run/secrets/istio")
        .config_map
        .as_ref()
        .expect("the root certificate's ConfigMap");
    assert_eq!(root.name, "istio-ca-root-cert");
}

/// Local mode (a mesh config) and a CA Secret: rendered here only, parsed
/// strictly, and wired to the flags that read them.
#[test]
fn deploy_chart_local_mode_and_ca_secret() {
    let text = render_or_panic(&Release {
        name: "ztunnel",
        namespace: "mesh",
        overrides: "localConfig:\n  trustDomain: cluster.local\n  workloads: []\ncaSecret: mesh-ca\n",
    });
    let objects = parse_or_panic(&text, "the local-mode rendering");
    let kinds: Vec<_> = objects.iter().map(kind).collect();
    assert_eq!(kinds, ["ServiceAccount", "ConfigMap", "DaemonSet"]);
    let Object::ConfigMap(config) = &objects[1] else {
        unreachable!()
    };
    let mesh = &config.data.as_ref().expect("data")["mesh.yaml"];
    let mesh: serde_yaml::Value = serde_yaml::from_str(mesh).expect("mesh.yaml is YAML");
    assert_eq!(mesh["trustDomain"].as_str(), Some("cluster.local"));

    let ds = daemonset(&objects);
    let mounts = mounts(ds);
    let config_path = flag(ds, "--config").expect("--config");
    let config_dir = Path::new(config_path).parent().unwrap().to_str().unwrap();
    assert_eq!(
        mounts.get(config_dir).map(String::as_str),
        Some("mesh-config")
    );
    assert_eq!(
        host_mounts(ds).get("/var/run/netns").map(String::as_str),
        Some("/var/run/netns")
    );
    let cert = flag(ds, "--ca-cert").expect("--ca-cert");
    let key = flag(ds, "--ca-key").expect("--ca-key");
    let ca_dir = Path::new(cert).parent().unwrap();
    assert_eq!(Path::new(key).parent(), Some(ca_dir));
    assert_eq!(
        mounts.get(ca_dir.to_str().unwrap()).map(String::as_str),
        Some("ca")
    );
}

/// Values the chart cannot honour stop the rendering with a reason.
#[test]
fn deploy_chart_refuses_what_it_cannot_do() {
    let refused = |overrides: &str| {
        render::render(
            &chart_dir(),
            &Release {
                name: "ztunnel",
                namespace: "ztunnel-system",
                overrides,
            },
        )
        .expect_err(overrides)
    };
    assert!(
        refused("cni:\n  enabled: true").contains("ztunnel-cni installer is not part"),
        "cni.enabled"
    );
    assert!(refused("capture: iptables").contains("capture must be"));
    assert!(
        refused("capture: istio-cni\ncaSecret: mesh-ca").contains("istiod's CA"),
        "a CA key on the nodes of an Istio mesh"
    );
    assert!(
        refused("capture: istio-cni\nlocalConfig:\n  workloads: []")
            .contains("the mesh comes from istiod"),
        "a local config beside istiod's xDS"
    );
    // A misspelt value name, which helm would silently ignore.
    assert!(refused("captur: istio-cni").contains("captur is not a value"));
}

/// The strict check catches what k8s-openapi alone lets through: a
/// misspelt field, in a hand-written document and in the chart's output.
#[test]
fn deploy_strict_parsing_rejects_a_misspelt_field() {
    let doc = "apiVersion: apps/v1
kind: DaemonSet
metadata: {name: x}
spec:
  selector: {matchLabels: {app: x}}
  template:
    metadata: {labels: {app: x}}
    spec:
      containers:
        - name: x
          image: x
          readinesProbe: {httpGet: {path: /healthz/ready, port: 15021}}
";
    // k8s-openapi alone takes it, and loses the probe.
    let lax: DaemonSet = serde_yaml::from_str(doc).expect("k8s-openapi ignores unknown fields");
    assert!(container(&lax).readiness_probe.is_none());
    let err = strict::parse_all(doc).expect_err("a misspelt field");
    assert!(
        err.contains(".spec.template.spec.containers[0].readinesProbe: unknown field"),
        "{err}"
    );
    // Spelt right, it passes.
    strict::parse_all(&doc.replace("readinesProbe", "readinessProbe")).expect("spelt right");

    // The same typo slipped into the chart's output.
    let rendered = render_or_panic(&MANIFESTS[0].1);
    strict::parse_all(&rendered).expect("the rendering parses");
    let typo = rendered.replacen("priorityClassName:", "priorityClasName:", 1);
    let err = strict::parse_all(&typo).expect_err("a misspelt field in the chart");
    assert!(
        err.contains(".spec.template.spec.priorityClasName: unknown field"),
        "{err}"
    );
    // A value of the wrong type is refused by the type itself.
    let err =
        strict::parse_all(&rendered.replacen("containerPort: 15020", "containerPort: metrics", 1))
            .expect_err("a port name where the number belongs");
    assert!(err.contains("DaemonSet ztunnel"), "{err}");
}

/// Every flag the manifests pass exists in the binary (`ztunnel run
/// --help`), and so does the env var it reads the node name from. The
/// values are not checked: `--capture istio-cni` is new.
#[test]
fn deploy_manifests_use_flags_of_the_binary() {
    let bin = ztunnel_tests::ztunnel::ztunnel_bin();
    let out = Command::new(&bin)
        .args(["run", "--help"])
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", bin.display()));
    assert!(out.status.success(), "ztunnel run --help");
    let help = String::from_utf8_lossy(&out.stdout);
    for (file, _, _) in MANIFESTS {
        let objects = committed(file);
        let ds = daemonset(&objects);
        for arg in args(ds).iter().filter(|a| a.starts_with("--")) {
            assert!(
                help.contains(&format!("{arg} ")) || help.contains(&format!("{arg}\n")),
                "{file}: {arg} is not a flag of `ztunnel run`"
            );
        }
        assert!(help.contains("[env: NODE_NAME"), "ztunnel reads NODE_NAME");
    }
}
