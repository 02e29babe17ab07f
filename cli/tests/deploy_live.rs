//! deploy/ against what it describes: the CloudFormation template deployed on moto's
//! CloudFormation and a `shardwise consume` worker run on the tables the stack made (the worker
//! checks their keys itself and refuses a table it cannot use); the template's policy against the
//! README's; the Kubernetes example's probes, grace period, budget and worker id.
//!
//! YAML is read and stacks are made by `scripts/lib/deploy_kit.py`, run with the Python of the
//! emulators' venv (boto3 and PyYAML come with moto there): `scripts/emulators install`.
//!
//! `envs=$(scripts/emulators start) && eval "$envs" && SHARDWISE_LIVE=require cargo test -p shardwise-cli --test deploy_live`

#[allow(dead_code)]
mod process;
#[path = "../../tests/support/mod.rs"]
mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use aws_sdk_dynamodb::types::TimeToLiveStatus;
use serde_json::Value;

use process::{FAST, Log, Worker, assert_nothing_skipped, put, seq_order, wait_rows};

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

fn root() -> &'static Path {
    Path::new(ROOT)
}

/// The emulators' Python, or `None` (after saying why) when it is not installed and
/// `SHARDWISE_LIVE=require` is not set; with it, a missing venv fails the test.
fn venv_python(test: &str) -> Option<PathBuf> {
    let python = root().join(".emulators/venv/bin/python");
    if python.exists() {
        return Some(python);
    }
    let why = format!(
        "`{test}` needs {} (boto3, PyYAML): run `scripts/emulators install`",
        python.display()
    );
    if std::env::var("SHARDWISE_LIVE").is_ok_and(|v| v == "require") {
        panic!("{why} (SHARDWISE_LIVE=require)");
    }
    eprintln!("skipping: {why}");
    None
}

/// Runs `deploy_kit.py ARGS`; returns whether it succeeded, its stdout and its stderr.
fn kit(python: &Path, args: &[&str]) -> (bool, String, String) {
    // moto answers every service on the DynamoDB endpoint.
    let moto = std::env::var("AWS_ENDPOINT_URL_DYNAMODB").unwrap_or_default();
    let mut command = Command::new(python);
    command
        .arg(root().join("scripts/lib/deploy_kit.py"))
        .args(args);
    for var in ["AWS_ENDPOINT_URL_CLOUDFORMATION", "AWS_ENDPOINT_URL_IAM"] {
        if std::env::var_os(var).is_none() && !moto.is_empty() {
            command.env(var, &moto);
        }
    }
    let out = command.output().expect("run deploy_kit.py");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Every YAML document of a file under deploy/, as JSON (CloudFormation tags in long form).
fn yaml(python: &Path, file: &str) -> Vec<Value> {
    let path = root().join("deploy").join(file);
    let (ok, stdout, stderr) = kit(python, &["json", path.to_str().unwrap()]);
    assert!(ok, "cannot read {}: {stderr}", path.display());
    serde_json::from_str(&stdout).expect("deploy_kit.py json prints a JSON list")
}

fn template(python: &Path) -> Value {
    yaml(python, "cloudformation.yaml").remove(0)
}

// ---------------------------------------------------------------------------------------------
// The stack on moto, and a worker on its tables

/// Every optional feature of the template turned on. moto 5.2.5 keeps `!Ref AWS::NoValue` inside
/// a list as `null`, so a policy whose optional statements are left out is refused as a
/// MalformedPolicyDocument; with every one given, every statement is there and moto's IAM checks
/// each one's syntax. (The defaults are checked by cfn-lint in scripts/test.)
fn every_feature(stream: &str, counts: &str) -> Vec<String> {
    let account = "arn:aws:dynamodb:us-east-1:123456789012";
    vec![
        format!("StreamName={stream}"),
        format!("DeadLetterStreamName={stream}-dlq"),
        "EnhancedFanOut=true".into(),
        "LogGroupName=/shardwise/deploy-live".into(),
        "KmsKeyArn=arn:aws:kms:us-east-1:123456789012:key/00000000-0000-0000-0000-000000000000"
            .into(),
        "OnFailureQueueArn=arn:aws:sqs:us-east-1:123456789012:spent".into(),
        "OnFailureTopicArn=arn:aws:sns:us-east-1:123456789012:spent".into(),
        "OnFailureBucket=spent-records".into(),
        "OnFailurePrefix=billing/".into(),
        format!("EffectTableArns={account}:table/{counts}"),
        "TrustedService=ecs-tasks.amazonaws.com".into(),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_runs_on_the_tables_the_stack_made() {
    let live = live_or_skip!();
    let Some(python) = venv_python("a_worker_runs_on_the_tables_the_stack_made") else {
        return;
    };
    let t0 = Instant::now();
    let ttl =
        &template(&python)["Resources"]["ReceiptTable"]["Properties"]["TimeToLiveSpecification"];
    assert_eq!(
        ttl["AttributeName"], "expiresAt",
        "the ledger's TTL attribute"
    );
    assert_eq!(ttl["Enabled"], true);

    let app = support::unique_name("deploy");
    let stream = support::unique_name("deploy-stream");
    let stack = support::unique_name("deploy-stack");
    // Named, not the application's default, so a worker that made its own table would show.
    let lease_table = format!("{app}-leases");
    let mut params = vec![
        format!("ApplicationName={app}"),
        format!("LeaseTableName={lease_table}"),
    ];
    // `--count-into` below: an effect per record, committed with its receipt.
    let counts = format!("{app}-counts");
    params.extend(every_feature(&stream, &counts));
    let template_path = root().join("deploy/cloudformation.yaml");
    let mut args = vec!["deploy", &stack, template_path.to_str().unwrap()];
    args.extend(params.iter().map(String::as_str));
    let (ok, stdout, stderr) = kit(&python, &args);
    assert!(ok, "the stack was not made: {stdout} {stderr}");
    let deployed: Value = serde_json::from_str(&stdout).expect("a JSON answer");
    let outputs = &deployed["outputs"];
    assert_eq!(outputs["LeaseTableName"], lease_table.as_str());
    let receipts = format!("{app}-receipts");
    assert_eq!(
        outputs["ReceiptTableName"],
        receipts.as_str(),
        "the CLI's default ledger name"
    );
    for output in [
        "LeaseTableArn",
        "ReceiptTableArn",
        "ConsumerPolicyArn",
        "ConsumerRoleArn",
    ] {
        assert!(
            outputs[output]
                .as_str()
                .is_some_and(|v| v.starts_with("arn:aws:")),
            "output {output}: {outputs}"
        );
    }
    let deploy_s = t0.elapsed().as_secs_f64();

    let (n, keys) = (200u64, 8u64);
    live.create_stream(&stream, 2).await;
    put(&stream, n, keys, 0).await;
    let log = Log::default();
    let mut args: Vec<&str> = FAST.to_vec();
    args.extend([
        "--lanes",
        "2",
        "--lease-table",
        &lease_table,
        "--receipts",
        &receipts,
        "--count-into",
        &counts,
    ]);
    let mut worker = Worker::spawn(&stream, &app, "w1", &args, &log);
    let deadline = Instant::now() + Duration::from_secs(120);
    while log.distinct_ids() < n as usize {
        if let Ok(Some(status)) = worker.child.try_wait() {
            panic!(
                "the worker exited ({status}) on the stack's tables: {}",
                worker.stderr_tail()
            );
        }
        assert!(
            Instant::now() < deadline,
            "{} of {n} records handled in 120 s: {}",
            log.distinct_ids(),
            worker.stderr_tail()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let lines = log.snapshot();
    let mut last: BTreeMap<String, String> = BTreeMap::new();
    for h in &lines {
        let top = last.entry(h.shard.clone()).or_default();
        if seq_order(&h.sequence) > seq_order(top) {
            *top = h.sequence.clone();
        }
    }
    let rows = wait_rows(
        &live,
        &lease_table,
        &stream,
        "each shard checkpointed at its last handled record, in the stack's table",
        Duration::from_secs(30),
        |rows| {
            rows.len() == last.len()
                && rows
                    .iter()
                    .all(|r| last.get(&r.shard) == Some(&r.checkpoint))
        },
    )
    .await;
    worker.stop_gracefully(Duration::from_secs(30)).await;
    log.assert_no_garbage();
    assert_nothing_skipped(&log.snapshot(), n);
    assert_eq!(rows.len(), 2, "one lease row per shard: {rows:#?}");

    let own = live.dynamodb.describe_table().table_name(&app).send().await;
    assert!(
        own.is_err_and(|e| e
            .as_service_error()
            .is_some_and(|e| e.is_resource_not_found_exception())),
        "the worker made a lease table of its own, `{app}`"
    );
    let mut events = BTreeSet::new();
    let mut start = None;
    loop {
        let page = live
            .dynamodb
            .scan()
            .table_name(&receipts)
            .set_exclusive_start_key(start.take())
            .send()
            .await
            .expect("scan the ledger");
        for item in page.items() {
            if process::attr_s(item, "application").as_deref() == Some(app.as_str()) {
                events.insert(process::attr_s(item, "eventId").unwrap_or_default());
            }
        }
        match page.last_evaluated_key {
            Some(key) if !key.is_empty() => start = Some(key),
            _ => break,
        }
    }
    assert_eq!(
        events.len(),
        n as usize,
        "one receipt per record in the stack's ledger"
    );
    // moto's CloudFormation ignores TimeToLiveSpecification (and PointInTimeRecoverySpecification):
    // there the worker turns TTL on, as it does on a ledger without it; on AWS the stack has.
    let ttl = live
        .dynamodb
        .describe_time_to_live()
        .table_name(&receipts)
        .send()
        .await
        .expect("DescribeTimeToLive")
        .time_to_live_description
        .expect("a TTL description");
    assert_eq!(ttl.attribute_name(), Some("expiresAt"));
    assert_eq!(ttl.time_to_live_status(), Some(&TimeToLiveStatus::Enabled));
    eprintln!(
        "deploy_live: stack made in {deploy_s:.1} s; {n} records handled on its tables, {:.1} s in all",
        t0.elapsed().as_secs_f64()
    );

    let (ok, _, stderr) = kit(&python, &["delete", &stack]);
    assert!(ok, "the stack was not deleted: {stderr}");
    // The tables outlive their stack (DeletionPolicy: Retain).
    live.delete_table(&lease_table).await;
    live.delete_table(&receipts).await;
    live.delete_table(&counts).await;
    live.delete_stream(&stream).await;
}

// ---------------------------------------------------------------------------------------------
// The template's policy against the README's

/// Actions of the README's library policy that the template leaves out, by statement: the stack
/// creates and tags the tables, turns on TTL and point-in-time recovery.
const DONE_BY_THE_STACK: &[(&str, &[&str])] = &[
    (
        "LeaseTable",
        &[
            "dynamodb:CreateTable",
            "dynamodb:TagResource",
            "dynamodb:DescribeContinuousBackups",
            "dynamodb:UpdateContinuousBackups",
        ],
    ),
    (
        "ReceiptLedger",
        &[
            "dynamodb:CreateTable",
            "dynamodb:TagResource",
            "dynamodb:UpdateTimeToLive",
        ],
    ),
];

fn actions(statement: &Value) -> BTreeSet<String> {
    match &statement["Action"] {
        Value::String(a) => BTreeSet::from([a.clone()]),
        Value::Array(list) => list
            .iter()
            .map(|a| a.as_str().expect("an action").to_owned())
            .collect(),
        other => panic!("Action is {other}"),
    }
}

/// The README's library policy: actions by Sid.
fn readme_policy() -> BTreeMap<String, BTreeSet<String>> {
    let readme = std::fs::read_to_string(root().join("README.md")).expect("the README");
    let json = readme
        .split_once("<!-- iam-policy: library -->")
        .and_then(|(_, rest)| rest.split_once("```json"))
        .and_then(|(_, rest)| rest.split_once("```"))
        .map(|(json, _)| json)
        .expect("the README's library policy");
    let policy: Value = serde_json::from_str(json).expect("the README's policy is JSON");
    policy["Statement"]
        .as_array()
        .expect("statements")
        .iter()
        .map(|s| (s["Sid"].as_str().expect("a Sid").to_owned(), actions(s)))
        .collect()
}

#[test]
fn the_template_grants_the_readmes_policy_less_what_the_stack_does() {
    let Some(python) =
        venv_python("the_template_grants_the_readmes_policy_less_what_the_stack_does")
    else {
        return;
    };
    let template = template(&python);
    let statements =
        template["Resources"]["ConsumerPolicy"]["Properties"]["PolicyDocument"]["Statement"]
            .as_array()
            .expect("the policy's statements");
    let readme = readme_policy();
    let mut granted: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for statement in statements {
        // An optional statement: `!If [CONDITION, STATEMENT, !Ref AWS::NoValue]`.
        let statement = match statement.get("Fn::If") {
            Some(branches) => {
                assert_eq!(branches[2]["Ref"], "AWS::NoValue", "{statement}");
                &branches[1]
            }
            None => statement,
        };
        let sid = statement["Sid"]
            .as_str()
            .expect("every statement has a Sid");
        let actions = actions(statement);
        if sid == "DecryptTheStream" {
            assert_eq!(
                actions,
                BTreeSet::from(["kms:Decrypt".to_owned(), "kms:GenerateDataKey".to_owned()])
            );
            continue;
        }
        // The README's statement for the stream and the dead-letter stream is two here, the
        // second one only with a dead-letter stream (of a stream or a log group).
        let readme_sid = if sid == "WriteDeadLetters" {
            "WriteRetryCopiesAndDeadLetters"
        } else {
            sid
        };
        let listed = readme
            .get(readme_sid)
            .unwrap_or_else(|| panic!("the README's policy has no statement {readme_sid}"));
        let extra: Vec<_> = actions.difference(listed).collect();
        assert!(
            extra.is_empty(),
            "{sid} grants what the README does not list: {extra:?}"
        );
        granted
            .entry(readme_sid.to_owned())
            .or_default()
            .extend(actions);
    }
    for (sid, listed) in &readme {
        let left_out: BTreeSet<String> = listed
            .difference(granted.get(sid).unwrap_or(&BTreeSet::new()))
            .cloned()
            .collect();
        let expected: BTreeSet<String> = DONE_BY_THE_STACK
            .iter()
            .find(|(s, _)| s == sid)
            .map(|(_, a)| a.iter().map(|a| a.to_string()).collect())
            .unwrap_or_default();
        assert_eq!(
            left_out, expected,
            "the README's {sid}: actions the template leaves out"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The Kubernetes example

fn env_of(container: &Value) -> BTreeMap<String, Value> {
    container["env"]
        .as_array()
        .expect("the container's env")
        .iter()
        .map(|e| (e["name"].as_str().expect("a name").to_owned(), e.clone()))
        .collect()
}

#[test]
fn the_kubernetes_example_probes_the_pod_and_outlasts_the_shutdown_deadline() {
    let Some(python) =
        venv_python("the_kubernetes_example_probes_the_pod_and_outlasts_the_shutdown_deadline")
    else {
        return;
    };
    let docs = yaml(&python, "kubernetes.yaml");
    let of_kind =
        |kind: &str| -> Vec<&Value> { docs.iter().filter(|d| d["kind"] == kind).collect() };
    let [deployment] = of_kind("Deployment")[..] else {
        panic!("one Deployment");
    };
    let pod = &deployment["spec"]["template"];
    let [container] = &pod["spec"]["containers"].as_array().expect("containers")[..] else {
        panic!("one container");
    };
    let env = env_of(container);
    let value = |name: &str| -> &str {
        env.get(name)
            .and_then(|e| e["value"].as_str())
            .unwrap_or_else(|| panic!("{name} has no value"))
    };

    // The probes reach the port the worker serves them on, bound to every address.
    let addr = value("SHARDWISE_METRICS_ADDR");
    let (host, port) = addr.rsplit_once(':').expect("HOST:PORT");
    assert_eq!(
        host, "0.0.0.0",
        "the kubelet probes the pod's IP, not loopback"
    );
    let port: u64 = port.parse().expect("a port");
    let probe_port = |probe: &str| -> u64 {
        let named = &container[probe]["httpGet"]["port"];
        named.as_u64().unwrap_or_else(|| {
            container["ports"]
                .as_array()
                .expect("ports")
                .iter()
                .find(|p| p["name"] == *named)
                .and_then(|p| p["containerPort"].as_u64())
                .unwrap_or_else(|| panic!("{probe}: no port named {named}"))
        })
    };
    assert_eq!(container["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(probe_port("livenessProbe"), port);
    assert_eq!(probe_port("readinessProbe"), port);

    // SIGKILL comes only after the worker's own deadline, with room for its final writes.
    let deadline = humantime::parse_duration(value("SHARDWISE_SHUTDOWN_DEADLINE"))
        .expect("SHARDWISE_SHUTDOWN_DEADLINE is a duration");
    let grace = pod["spec"]["terminationGracePeriodSeconds"]
        .as_u64()
        .expect("terminationGracePeriodSeconds");
    assert!(
        Duration::from_secs(grace) > deadline + Duration::from_secs(5),
        "a grace period of {grace} s leaves no room after a {deadline:?} shutdown deadline"
    );

    // Each pod is its own worker, by name.
    assert_eq!(
        env["SHARDWISE_WORKER_ID"]["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.name"
    );

    // A budget over these pods.
    let labels = &pod["metadata"]["labels"];
    let budgets = of_kind("PodDisruptionBudget");
    assert!(
        budgets.iter().any(|b| {
            let selector = b["spec"]["selector"]["matchLabels"].as_object();
            selector.is_some_and(|s| !s.is_empty() && s.iter().all(|(k, v)| labels[k] == *v))
        }),
        "no PodDisruptionBudget selects the Deployment's pods"
    );

    // Credentials: the service account the pods run as, with the role to assume.
    let account = pod["spec"]["serviceAccountName"]
        .as_str()
        .expect("a service account");
    let accounts = of_kind("ServiceAccount");
    let sa = accounts
        .iter()
        .find(|s| s["metadata"]["name"] == account)
        .unwrap_or_else(|| panic!("no ServiceAccount {account}"));
    assert!(sa["metadata"]["annotations"]["eks.amazonaws.com/role-arn"].is_string());

    // Every SHARDWISE_ variable is one `consume` (or every command) reads, once the help names
    // them.
    let help: String = [vec!["--help"], vec!["consume", "--help"]]
        .iter()
        .map(|args| {
            let out = Command::new(process::BIN)
                .args(args)
                .output()
                .expect("shardwise --help");
            String::from_utf8_lossy(&out.stdout).into_owned()
        })
        .collect();
    if help.contains("[env: SHARDWISE_") {
        for name in env.keys().filter(|n| n.starts_with("SHARDWISE_")) {
            assert!(
                help.contains(&format!("[env: {name}=")),
                "`shardwise consume --help` names no {name}"
            );
        }
    } else {
        eprintln!("`consume --help` names no SHARDWISE_ variable yet: their names are not checked");
    }
}
