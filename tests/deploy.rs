//! The deployment files, checked without a Docker engine: every outbox-relay
//! service in docker-compose.yml must pass the binary's own argument parser
//! and configuration checks (`--check-config`) with the environment compose
//! gives it, the image's entrypoints must be what the Dockerfile builds, and
//! nothing may publish a port beyond loopback.

use std::collections::BTreeMap;
use std::process::Command;

use yaml_serde::Value;

const BIN: &str = env!("CARGO_BIN_EXE_outbox-relay");
const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn read(path: &str) -> String {
    std::fs::read_to_string(format!("{ROOT}/{path}")).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn compose() -> Value {
    let mut v: Value =
        yaml_serde::from_str(&read("docker-compose.yml")).expect("docker-compose.yml is YAML");
    v.apply_merge().expect("merge keys resolve");
    // Merged anchors may themselves hold merge keys (environment: &outbox-env).
    v.apply_merge().expect("merge keys resolve");
    v
}

fn strings(v: &Value) -> Vec<String> {
    match v {
        Value::Sequence(s) => s
            .iter()
            .map(|x| x.as_str().expect("string").to_owned())
            .collect(),
        Value::String(s) => s.split_whitespace().map(str::to_owned).collect(),
        Value::Null => Vec::new(),
        other => panic!("expected a list of strings, got {other:?}"),
    }
}

/// The Dockerfile's ENTRYPOINT, and what its runtime stage copies in.
fn dockerfile() -> (Vec<String>, BTreeMap<String, String>) {
    let text = read("Dockerfile");
    let entry = text
        .lines()
        .find_map(|l| l.strip_prefix("ENTRYPOINT "))
        .expect("ENTRYPOINT");
    let entry: Vec<String> = serde_json::from_str(entry).expect("ENTRYPOINT in exec (JSON) form");
    let copies = text
        .lines()
        .filter_map(|l| l.strip_prefix("COPY --from=build "))
        .map(|l| {
            let mut parts = l.split_whitespace();
            let from = parts.next().expect("source").to_owned();
            let to = parts.next().expect("destination").to_owned();
            (to, from)
        })
        .collect();
    (entry, copies)
}

#[test]
fn every_outbox_service_passes_the_binarys_configuration_check() {
    let compose = compose();
    let services = compose["services"].as_mapping().expect("services");
    let (default_entry, _) = dockerfile();
    let mut checked = Vec::new();
    for (name, svc) in services {
        let name = name.as_str().expect("service name");
        if svc["image"].as_str() != Some("outbox-relay:local") {
            continue;
        }
        let entry = match &svc["entrypoint"] {
            Value::Null => default_entry.clone(),
            e => strings(e),
        };
        if entry != default_entry {
            continue; // the sample handler, checked below
        }
        let command = strings(&svc["command"]);
        let env: BTreeMap<String, String> = svc["environment"]
            .as_mapping()
            .map(|m| {
                m.iter()
                    .map(|(k, v)| {
                        let v = match v {
                            Value::String(s) => s.clone(),
                            other => yaml_serde::to_string(other).unwrap().trim().to_owned(),
                        };
                        (k.as_str().unwrap().to_owned(), v)
                    })
                    .collect()
            })
            .unwrap_or_default();
        let out = Command::new(BIN)
            .args(&command)
            .arg("--check-config")
            .env_clear()
            .envs(&env)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "service {name}: `outbox-relay {}` is refused:\n{}",
            command.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            "configuration ok",
            "service {name}"
        );
        checked.push(command[0].clone());
    }
    checked.sort();
    assert_eq!(
        checked,
        ["consume", "migrate", "prune", "relay"],
        "the services compose must run"
    );

    // The relay and the consumer's DLQ use the 3-node cluster's replicas.
    let relay = strings(&services[&Value::from("relay")]["command"]).join(" ");
    assert!(relay.contains("--stream-replicas 3"), "{relay}");
    let nats_nodes = services
        .keys()
        .filter(|k| k.as_str().is_some_and(|k| k.starts_with("nats-")))
        .count();
    assert_eq!(nats_nodes, 3);
}

#[test]
fn image_entrypoints_are_built_by_the_dockerfile() {
    let (entry, copies) = dockerfile();
    assert_eq!(entry, ["/usr/local/bin/outbox-relay"]);
    assert_eq!(
        copies
            .get("/usr/local/bin/outbox-relay")
            .map(String::as_str),
        Some("/src/target/release/outbox-relay")
    );
    let text = read("Dockerfile");
    assert!(
        text.contains("--bin outbox-relay"),
        "the build stage builds the binary"
    );
    assert!(text.contains("USER 10001"), "runs as non-root");
    // The binary the Dockerfile builds is this crate's `outbox-relay` bin.
    assert!(BIN.ends_with("/outbox-relay"));

    // Other entrypoints used by compose are copied in too.
    let compose = compose();
    for (name, svc) in compose["services"].as_mapping().unwrap() {
        let name = name.as_str().unwrap_or_default();
        if let Value::Sequence(_) = &svc["entrypoint"] {
            let e = strings(&svc["entrypoint"]);
            let from = copies.get(&e[0]).unwrap_or_else(|| {
                panic!("service {name}: entrypoint {} is not in the image", e[0])
            });
            if let Some(example) = from.strip_prefix("/src/target/release/examples/") {
                assert!(
                    std::path::Path::new(&format!("{ROOT}/examples/{example}.rs")).exists(),
                    "{example} is not an example of this crate"
                );
                assert!(
                    text.contains(&format!("--example {example}")),
                    "{example} is not built"
                );
            }
        }
    }
}

#[test]
fn ports_are_published_on_loopback_only_and_mounted_files_exist() {
    let compose = compose();
    for (name, svc) in compose["services"].as_mapping().unwrap() {
        let name = name.as_str().unwrap_or_default();
        for port in strings(&svc["ports"]) {
            assert!(
                port.starts_with("127.0.0.1:"),
                "service {name} publishes {port} beyond loopback"
            );
        }
        for volume in strings(&svc["volumes"]) {
            if let Some(path) = volume.strip_prefix("./") {
                let file = path.split(':').next().unwrap();
                assert!(
                    std::path::Path::new(&format!("{ROOT}/{file}")).exists(),
                    "service {name} mounts missing {file}"
                );
            }
        }
    }
}

/// docs/configuration.md lists every flag of every command with its
/// environment variable, as the binary's own `--help` prints them.
#[test]
fn configuration_reference_covers_every_flag() {
    let doc = read("docs/configuration.md");
    for cmd in [
        &["relay"][..],
        &["consume"],
        &["migrate"],
        &["slot", "status"],
        &["slot", "drop"],
        &["prune"],
        &["dlq", "list"],
        &["dlq", "replay"],
        &["consumer", "reset"],
        &["dlq", "delete"],
        &["admin", "log", "verify"],
        &["admin", "token", "create"],
        &["admin", "token", "list"],
        &["admin", "token", "revoke"],
        &["console"],
    ] {
        let title = format!("### `outbox-relay {}`", cmd.join(" "));
        let section = doc
            .split(&title)
            .nth(1)
            .unwrap_or_else(|| panic!("docs/configuration.md has no section {title}"));
        let section = section.split("\n### ").next().unwrap_or_default();
        let help = Command::new(BIN).args(cmd).arg("--help").output().unwrap();
        let help = String::from_utf8_lossy(&help.stdout);
        let mut flags = 0;
        for line in help.lines().map(str::trim) {
            let Some(flag) = line
                .strip_prefix("--")
                .map(|f| f.split([' ', '<']).next().unwrap_or_default())
            else {
                continue;
            };
            if flag == "help" {
                continue;
            }
            flags += 1;
            assert!(
                section.contains(&format!("| `--{flag}` |")),
                "{title}: --{flag} is not documented"
            );
        }
        for env in help
            .split("[env: ")
            .skip(1)
            .filter_map(|s| s.split([']', '=']).next())
        {
            assert!(
                section.contains(&format!("`{env}`")),
                "{title}: {env} is not documented"
            );
        }
        assert!(flags > 2, "{title}: parsed no flags from --help");
    }
}

/// docker-compose.yml runs the NATS and Postgres versions the tests run on
/// (scripts/stack.sh pins nats-server; the machine's Postgres is 15).
#[test]
fn compose_pins_the_versions_the_tests_run_on() {
    let stack = read("scripts/stack.sh");
    let nats = stack
        .lines()
        .find_map(|l| l.strip_prefix("NATS_VERSION=\"${NATS_SERVER_VERSION:-"))
        .and_then(|v| v.split('}').next())
        .expect("NATS_VERSION in stack.sh");
    let minor: Vec<&str> = nats.split('.').take(2).collect();
    let compose = read("docker-compose.yml");
    let tag = format!("image: nats:{}-alpine", minor.join("."));
    assert!(
        compose.contains(&tag),
        "compose should use {tag} (stack.sh: {nats})"
    );
    assert!(
        compose.contains("image: postgres:15"),
        "compose should use postgres:15"
    );
}

/// deploy/kubernetes: the consumer Deployment passes the binary's own
/// configuration check, and the KEDA ScaledObject scales that Deployment on
/// metrics the consumer exports (SPEC §11: the lag metric drives an
/// autoscaler).
#[test]
fn the_keda_scaled_object_scales_the_consumer_deployment_on_metrics_it_exports() {
    let deployment: Value =
        yaml_serde::from_str(&read("deploy/kubernetes/consumer.yaml")).expect("YAML");
    let scaled: Value =
        yaml_serde::from_str(&read("deploy/kubernetes/keda-scaledobject.yaml")).expect("YAML");
    assert_eq!(deployment["kind"].as_str(), Some("Deployment"));
    assert_eq!(scaled["kind"].as_str(), Some("ScaledObject"));
    assert_eq!(
        scaled["spec"]["scaleTargetRef"]["name"], deployment["metadata"]["name"],
        "the ScaledObject scales the consumer Deployment"
    );
    let (min, max) = (
        scaled["spec"]["minReplicaCount"]
            .as_u64()
            .expect("minReplicaCount"),
        scaled["spec"]["maxReplicaCount"]
            .as_u64()
            .expect("maxReplicaCount"),
    );
    assert!(1 <= min && min <= max, "replicas {min}..{max}");

    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    let args = strings(&container["args"]);
    assert_eq!(args[0], "consume");
    let out = Command::new(BIN)
        .args(&args)
        .arg("--check-config")
        .env_clear()
        .env("DATABASE_URL", "postgres://orders@postgres/orders")
        .env("NATS_URL", "nats://nats:4222")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "`outbox-relay {}` is refused:\n{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    let metrics_port = args
        .iter()
        .skip_while(|a| *a != "--metrics-addr")
        .nth(1)
        .and_then(|a| a.rsplit_once(':'))
        .map(|(_, p)| p.to_owned())
        .expect("--metrics-addr");
    assert_eq!(
        container["ports"][0]["containerPort"]
            .as_u64()
            .map(|p| p.to_string()),
        Some(metrics_port.clone()),
        "the metrics port is the container's"
    );
    assert_eq!(
        deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"].as_str(),
        Some(metrics_port.as_str())
    );
    assert_eq!(
        container["readinessProbe"]["httpGet"]["path"].as_str(),
        Some("/readyz")
    );
    // SIGTERM lets running calls finish (--shutdown-timeout, 30 s default)
    // before Kubernetes kills the pod.
    assert!(
        deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            .as_u64()
            .is_some_and(|s| s > 30)
    );

    let trigger = &scaled["spec"]["triggers"][0];
    assert_eq!(trigger["type"].as_str(), Some("prometheus"));
    let query = trigger["metadata"]["query"].as_str().expect("query");
    let names: Vec<&str> = query
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("outbox_"))
        .collect();
    assert!(!names.is_empty(), "{query}");
    for name in names {
        assert!(
            outbox_relay::metrics::ALL.contains(&name),
            "{name} is not a metric the processes export"
        );
    }
    assert!(
        query.contains("outbox_consumer_pending_messages"),
        "scales on the durable's backlog"
    );
    let label = deployment["spec"]["template"]["metadata"]["labels"]["app"]
        .as_str()
        .expect("app label");
    assert!(query.contains(&format!("app=\"{label}\"")), "{query}");
    assert!(trigger["metadata"]["threshold"]
        .as_str()
        .and_then(|t| t.parse::<f64>().ok())
        .is_some_and(|t| t > 0.0));
}
