//! `consume --exec 'CMD ARGS'`: any program as the handler, over a line protocol on its stdin and
//! stdout (the README's "Any program as the handler" has the protocol).
//!
//! A pool of children, each run as `sh -c CMD` in a process group of its own (a replacement kills
//! the whole group). The deliveries of one lane of one shard always go
//! to the same child, one (or one batch) at a time, so the order per key holds; one child serves
//! several shard lanes at once, telling their requests apart by `id`. Each child is owned by one
//! task:
//!
//! ```text
//!   starting ──spawned──► up ──exit / garbage line / a request older than the timeout──► down
//!      ▲                                                                                  │
//!      └──────────────── back-off (100 ms doubling to 10 s; reset after 30 s up) ◄────────┘
//! ```
//!
//! Requests in flight when a child goes down are not answered: their deliveries stay unsettled
//! (the handler call goes on waiting) and are sent again, in their order, to the child that
//! replaces it. The oldest of them (the one a sequential child was working on) counts the loss
//! against itself; once a request was in flight at three losses it is answered `retry` (the retry
//! path: a counted copy, a dead letter once spent), so a record that kills its handler cannot stop
//! the shard. stderr of every child is passed through to the log, line by line.

use std::collections::{BTreeMap, VecDeque};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use base64::Engine;
use serde::Deserialize;
use serde_json::{Value, json};
use shardwise::{Batching, Delivery, Handler, Outcome};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tracing::{info, warn};

/// Losses of a child while a request was the oldest in flight, after which it is answered `retry`.
const MAX_LOSSES: u32 = 3;
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(10);
/// A child up this long (and answering) resets the back-off.
const STABLE: Duration = Duration::from_secs(30);

/// How the children run.
#[derive(Debug, Clone)]
pub(crate) struct ExecSettings {
    /// The command line, run by `sh -c` in a process group of its own.
    pub(crate) command: String,
    /// How many children.
    pub(crate) children: usize,
    /// A request unanswered for this long means the child hangs: it is killed and replaced.
    pub(crate) timeout: Option<Duration>,
    /// With `Some`, deliveries go to the child in batches (one line per batch).
    pub(crate) batching: Option<Batching>,
    /// This worker's id, given to the children as `SHARDWISE_WORKER`.
    pub(crate) worker: String,
}

/// What the pool reports, for `/healthz` and metrics.
#[derive(Debug, Default)]
pub(crate) struct ExecStats {
    /// Children replaced since the start.
    pub(crate) restarts: AtomicU64,
    /// Children up now.
    pub(crate) up: AtomicUsize,
    /// Children waiting out a back-off now (restarting).
    pub(crate) restarting: AtomicUsize,
}

/// The handler that hands deliveries to the children.
#[derive(Debug, Clone)]
pub(crate) struct Exec {
    children: Arc<Vec<mpsc::UnboundedSender<Request>>>,
    next_id: Arc<AtomicU64>,
    batching: Option<Batching>,
    pub(crate) stats: Arc<ExecStats>,
}

/// One line to send, and where each of its deliveries' outcomes goes.
struct Request {
    /// The ids the line carries (one, or a batch's), in order.
    ids: Vec<u64>,
    /// The request's own id (the delivery's, or the batch's).
    id: u64,
    line: String,
    reply: oneshot::Sender<Vec<Outcome>>,
}

/// A request sent to the current child.
struct InFlight {
    request: Request,
    sent: Instant,
    losses: u32,
}

impl Exec {
    /// Starts the children (each in its own task).
    pub(crate) fn start(settings: ExecSettings) -> Self {
        let stats = Arc::new(ExecStats::default());
        let children = (0..settings.children.max(1))
            .map(|index| {
                let (tx, rx) = mpsc::unbounded_channel();
                tokio::spawn(run_child(index, settings.clone(), rx, stats.clone()));
                tx
            })
            .collect();
        Self {
            children: Arc::new(children),
            next_id: Arc::new(AtomicU64::new(1)),
            batching: settings.batching,
            stats,
        }
    }

    /// The child of a delivery's lane of its shard.
    fn child_of(&self, d: &Delivery) -> &mpsc::UnboundedSender<Request> {
        let mut h = DefaultHasher::new();
        (d.shard(), d.lane()).hash(&mut h);
        &self.children[(h.finish() % self.children.len() as u64) as usize]
    }

    /// Sends a request to the child of `first`'s lane and waits for its outcomes. Never returns
    /// while the pool is shutting down: the deliveries stay unsettled and are read again.
    async fn send(&self, first: &Delivery, id: u64, ids: Vec<u64>, line: String) -> Vec<Outcome> {
        let (reply, answer) = oneshot::channel();
        let request = Request {
            ids,
            id,
            line,
            reply,
        };
        if self.child_of(first).send(request).is_err() {
            return std::future::pending().await;
        }
        match answer.await {
            Ok(outcomes) => outcomes,
            Err(_) => std::future::pending().await,
        }
    }
}

impl Handler for Exec {
    async fn handle(&self, delivery: Delivery) -> Outcome {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let line = delivery_json(&delivery, id).to_string();
        self.send(&delivery, id, vec![id], line)
            .await
            .into_iter()
            .next()
            .unwrap_or(Outcome::Retry)
    }

    fn batching(&self) -> Option<Batching> {
        self.batching
    }

    async fn handle_batch(&self, batch: Vec<Delivery>) -> Vec<Outcome> {
        let batch_id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let ids: Vec<u64> = batch
            .iter()
            .map(|_| self.next_id.fetch_add(1, Ordering::Relaxed))
            .collect();
        let deliveries: Vec<Value> = batch
            .iter()
            .zip(&ids)
            .map(|(d, id)| delivery_json(d, *id))
            .collect();
        let line = json!({ "id": batch_id, "batch": deliveries }).to_string();
        self.send(&batch[0], batch_id, ids, line).await
    }
}

/// One delivery as the child reads it.
fn delivery_json(d: &Delivery, id: u64) -> Value {
    let mut v = match d.page_position() {
        None => json!({
            "id": id,
            "stream": d.stream(),
            "shard": d.shard(),
            "sequence": d.sequence_number().to_string(),
            "subsequence": d.sub_sequence(),
            "partition_key": d.partition_key(),
            "attempt": d.attempt(),
        }),
        Some(position) => json!({
            "id": id,
            "source": d.stream(),
            "partition": d.shard(),
            "position": position.to_string(),
            "event": d.event_id().as_str(),
            "partition_key": d.partition_key(),
            "attempt": d.attempt(),
        }),
    };
    let object = v.as_object_mut().expect("an object");
    if let Some(ms) = d
        .arrived_at()
        .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
    {
        object.insert("arrived_ms".into(), json!(ms.as_millis() as u64));
    }
    match std::str::from_utf8(d.payload()) {
        Ok(text) => object.insert("data".into(), json!(text)),
        Err(_) => object.insert(
            "data_b64".into(),
            json!(base64::engine::general_purpose::STANDARD.encode(d.payload())),
        ),
    };
    v
}

/// An answer line.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Answer {
    id: u64,
    #[serde(default)]
    outcome: Option<Value>,
    #[serde(default)]
    outcomes: Option<Vec<ItemAnswer>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ItemAnswer {
    id: u64,
    outcome: Value,
}

/// An outcome as the protocol spells it: `"ack"`, `"drop"`, `"retry"`, `{"retry_after_ms": N}`,
/// `{"hold": "reason"}`, `{"quarantine": "reason"}`.
pub(crate) fn parse_outcome(v: &Value) -> Result<Outcome, String> {
    match v {
        Value::String(s) => match s.as_str() {
            "ack" => Ok(Outcome::Ack),
            "drop" => Ok(Outcome::Drop),
            "retry" => Ok(Outcome::Retry),
            other => Err(format!("unknown outcome `{other}`")),
        },
        Value::Object(o) if o.len() == 1 => {
            let (name, arg) = o.iter().next().expect("one entry");
            match (name.as_str(), arg) {
                ("retry_after_ms", Value::Number(n)) => n
                    .as_u64()
                    .map(|ms| Outcome::RetryAfter(Duration::from_millis(ms)))
                    .ok_or_else(|| format!("retry_after_ms must be a whole number, not {n}")),
                ("hold", Value::String(reason)) => Ok(Outcome::Hold(reason.clone())),
                ("quarantine", Value::String(reason)) => Ok(Outcome::Quarantine(reason.clone())),
                _ => Err(format!("unknown outcome {v}")),
            }
        }
        other => Err(format!("unknown outcome {other}")),
    }
}

/// What an answer line means for the request it names: one outcome per delivery, in the
/// request's order (a batch's deliveries left out are retried).
fn outcomes_of(answer: &Answer, ids: &[u64]) -> Result<Vec<Outcome>, String> {
    match (&answer.outcome, &answer.outcomes) {
        (Some(outcome), None) if ids.len() == 1 => Ok(vec![parse_outcome(outcome)?]),
        (None, Some(items)) => {
            let mut by_id = BTreeMap::new();
            for item in items {
                if !ids.contains(&item.id) {
                    return Err(format!("no delivery {} in batch {}", item.id, answer.id));
                }
                by_id.insert(item.id, parse_outcome(&item.outcome)?);
            }
            Ok(ids
                .iter()
                .map(|id| by_id.remove(id).unwrap_or(Outcome::Retry))
                .collect())
        }
        _ => Err(format!(
            "answer {} needs `outcome` for a delivery or `outcomes` for a batch",
            answer.id
        )),
    }
}

/// Why a child was replaced.
#[derive(Debug)]
enum Down {
    Exited(String),
    Garbage(String),
    Hung(u64),
    Unwritable(std::io::Error),
}

impl std::fmt::Display for Down {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Down::Exited(status) => write!(f, "exited ({status})"),
            Down::Garbage(why) => write!(f, "wrote a line that is not an answer: {why}"),
            Down::Hung(id) => write!(f, "left request {id} unanswered past the handler timeout"),
            Down::Unwritable(e) => write!(f, "stdin closed: {e}"),
        }
    }
}

/// Owns child `index`: starts it, sends it requests, reads its answers, and replaces it when it
/// goes down, sending what it left unanswered to the next one.
async fn run_child(
    index: usize,
    settings: ExecSettings,
    mut requests: mpsc::UnboundedReceiver<Request>,
    stats: Arc<ExecStats>,
) {
    let mut backoff = FIRST_BACKOFF;
    // Unanswered requests, oldest first: carried over from child to child.
    let mut flight: VecDeque<InFlight> = VecDeque::new();
    loop {
        let mut child = match spawn(index, &settings) {
            Ok(child) => child,
            Err(e) => {
                warn!(child = index, command = %settings.command, error = %e, ?backoff, "cannot start the handler program; trying again");
                stats.restarting.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(backoff).await;
                stats.restarting.fetch_sub(1, Ordering::Relaxed);
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            }
        };
        let pid = child.id().unwrap_or(0);
        let started = Instant::now();
        stats.up.fetch_add(1, Ordering::Relaxed);
        info!(child = index, pid, command = %settings.command, resent = flight.len(), "handler program started");
        let down = serve(&mut child, index, &settings, &mut requests, &mut flight).await;
        stats.up.fetch_sub(1, Ordering::Relaxed);
        kill_group(&mut child, pid).await;
        let Some(down) = down else {
            return; // no more requests: the worker is stopping
        };
        stats.restarts.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("shardwise_exec_restarts_total").increment(1);
        if started.elapsed() >= STABLE {
            backoff = FIRST_BACKOFF;
        }
        // The oldest request in flight was being worked on: it counts the loss.
        if let Some(oldest) = flight.front_mut() {
            oldest.losses += 1;
        }
        while flight
            .front()
            .is_some_and(|f| f.losses >= MAX_LOSSES || f.request.reply.is_closed())
        {
            let spent = flight.pop_front().expect("front");
            if spent.losses >= MAX_LOSSES {
                warn!(
                    child = index,
                    request = spent.request.id,
                    losses = spent.losses,
                    "the handler program went down {MAX_LOSSES} times with this request in flight: answered retry"
                );
                let _ = spent
                    .request
                    .reply
                    .send(vec![Outcome::Retry; spent.request.ids.len()]);
            }
        }
        flight.retain(|f| !f.request.reply.is_closed());
        warn!(child = index, pid, reason = %down, unanswered = flight.len(), ?backoff, "handler program replaced; its unanswered deliveries go to the next one");
        stats.restarting.fetch_add(1, Ordering::Relaxed);
        tokio::time::sleep(backoff).await;
        stats.restarting.fetch_sub(1, Ordering::Relaxed);
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// Kills the child's whole process group (the shell and what it started; the group's id is the
/// shell's pid, `pid`, even once the shell was reaped) and reaps the shell.
async fn kill_group(child: &mut Child, pid: u32) {
    if let Ok(group) = i32::try_from(pid)
        && group > 0
    {
        let _ = nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(group),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    let _ = child.start_kill();
    let _ = child.wait().await;
}

fn spawn(index: usize, settings: &ExecSettings) -> std::io::Result<Child> {
    // Its own process group: a replacement kills the shell and everything it started.
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(&settings.command)
        .process_group(0)
        .env("SHARDWISE_CHILD", index.to_string())
        .env("SHARDWISE_WORKER", &settings.worker)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    if let Some(stderr) = child.stderr.take() {
        let pid = child.id().unwrap_or(0);
        tokio::spawn(async move {
            let mut lines = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                info!(target: "shardwise::exec", child = index, pid, "{line}");
            }
        });
    }
    Ok(child)
}

async fn write_line(stdin: &mut ChildStdin, line: &str) -> std::io::Result<()> {
    stdin.write_all(line.as_bytes()).await?;
    stdin.write_all(b"\n").await?;
    stdin.flush().await
}

/// Runs one child until it goes down (`Some(why)`) or no more requests can come (`None`).
async fn serve(
    child: &mut Child,
    index: usize,
    settings: &ExecSettings,
    requests: &mut mpsc::UnboundedReceiver<Request>,
    flight: &mut VecDeque<InFlight>,
) -> Option<Down> {
    let mut stdin = child.stdin.take().expect("piped");
    let mut answers = BufReader::new(child.stdout.take().expect("piped")).lines();
    // What the previous child left unanswered goes first, in its order.
    for f in flight.iter_mut() {
        f.sent = Instant::now();
        if let Err(e) = write_line(&mut stdin, &f.request.line).await {
            return Some(Down::Unwritable(e));
        }
    }
    let mut check = tokio::time::interval(Duration::from_millis(100));
    loop {
        tokio::select! {
            request = requests.recv() => {
                let request = request?;
                let written = write_line(&mut stdin, &request.line).await;
                flight.push_back(InFlight { request, sent: Instant::now(), losses: 0 });
                if let Err(e) = written {
                    return Some(Down::Unwritable(e));
                }
            }
            line = answers.next_line() => match line {
                Ok(Some(line)) => {
                    if let Err(down) = answered(&line, flight) {
                        return Some(down);
                    }
                }
                Ok(None) | Err(_) => {
                    let status = child.wait().await.map_or_else(|e| e.to_string(), |s| s.to_string());
                    return Some(Down::Exited(status));
                }
            },
            status = child.wait() => {
                // Answers it wrote before it exited still count.
                let drain = async {
                    while let Ok(Some(line)) = answers.next_line().await {
                        answered(&line, flight)?;
                    }
                    Ok(())
                };
                let drained = tokio::time::timeout(Duration::from_secs(1), drain).await;
                if let Ok(Err(down)) = drained {
                    return Some(down);
                }
                return Some(Down::Exited(status.map_or_else(|e| e.to_string(), |s| s.to_string())));
            }
            _ = check.tick(), if settings.timeout.is_some() => {
                let limit = settings.timeout.expect("checked");
                if let Some(hung) = flight.iter().find(|f| f.sent.elapsed() > limit && !f.request.reply.is_closed()) {
                    warn!(child = index, request = hung.request.id, ?limit, "a request went unanswered past the handler timeout");
                    return Some(Down::Hung(hung.request.id));
                }
            }
        }
    }
}

/// Takes one line from the child: the answer to a request in flight, or garbage.
fn answered(line: &str, flight: &mut VecDeque<InFlight>) -> Result<(), Down> {
    if line.trim().is_empty() {
        return Ok(());
    }
    let answer: Answer = serde_json::from_str(line)
        .map_err(|e| Down::Garbage(format!("{e}: {}", truncated(line))))?;
    let Some(at) = flight.iter().position(|f| f.request.id == answer.id) else {
        return Err(Down::Garbage(format!(
            "no request {} is waiting for an answer: {}",
            answer.id,
            truncated(line)
        )));
    };
    let outcomes = outcomes_of(&answer, &flight[at].request.ids)
        .map_err(|why| Down::Garbage(format!("{why}: {}", truncated(line))))?;
    let done = flight.remove(at).expect("found");
    let _ = done.request.reply.send(outcomes);
    Ok(())
}

fn truncated(line: &str) -> String {
    const MAX: usize = 200;
    match line.char_indices().nth(MAX) {
        Some((at, _)) => format!("{}…", &line[..at]),
        None => line.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_parse_as_the_protocol_spells_them() {
        let cases = [
            (json!("ack"), Outcome::Ack),
            (json!("drop"), Outcome::Drop),
            (json!("retry"), Outcome::Retry),
            (
                json!({"retry_after_ms": 250}),
                Outcome::RetryAfter(Duration::from_millis(250)),
            ),
            (
                json!({"hold": "check it"}),
                Outcome::Hold("check it".into()),
            ),
            (
                json!({"quarantine": "bad"}),
                Outcome::Quarantine("bad".into()),
            ),
        ];
        for (v, outcome) in cases {
            assert_eq!(parse_outcome(&v).unwrap(), outcome, "{v}");
        }
        for bad in [
            json!("ok"),
            json!({"retry_after_ms": -1}),
            json!(3),
            json!({"a": 1, "b": 2}),
        ] {
            assert!(parse_outcome(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_batch_answer_names_its_deliveries_and_leaves_out_the_ones_to_retry() {
        let answer: Answer =
            serde_json::from_str(r#"{"id": 9, "outcomes": [{"id": 11, "outcome": "drop"}, {"id": 10, "outcome": "ack"}]}"#)
                .unwrap();
        assert_eq!(
            outcomes_of(&answer, &[10, 11, 12]).unwrap(),
            [Outcome::Ack, Outcome::Drop, Outcome::Retry]
        );
        let stranger: Answer =
            serde_json::from_str(r#"{"id": 9, "outcomes": [{"id": 99, "outcome": "ack"}]}"#)
                .unwrap();
        assert!(outcomes_of(&stranger, &[10]).is_err());
        let single: Answer = serde_json::from_str(r#"{"id": 4, "outcome": "ack"}"#).unwrap();
        assert_eq!(outcomes_of(&single, &[4]).unwrap(), [Outcome::Ack]);
        assert!(serde_json::from_str::<Answer>(r#"{"id": 4, "outcome": "ack", "x": 1}"#).is_err());
    }

    fn settings(command: &str, timeout: Option<Duration>) -> ExecSettings {
        ExecSettings {
            command: command.into(),
            children: 1,
            timeout,
            batching: None,
            worker: "w".into(),
        }
    }

    fn delivery(key: &str, data: &str) -> Delivery {
        Delivery::builder(
            "s",
            "shardId-000000000000",
            shardwise::Position::new(shardwise::SequenceNumber::parse("1").unwrap(), 0),
        )
        .partition_key(key)
        .payload(data.to_string())
        .build()
    }

    /// A program that answers each line with its id and the outcome the data names.
    const ECHO: &str = r#"python3 -u -c 'import json,sys
for line in sys.stdin:
    d = json.loads(line)
    print(json.dumps({"id": d["id"], "outcome": d["data"]}))'"#;

    #[tokio::test]
    async fn a_child_answers_each_delivery_by_id() {
        let exec = Exec::start(settings(ECHO, None));
        assert_eq!(exec.handle(delivery("k", "ack")).await, Outcome::Ack);
        assert_eq!(exec.handle(delivery("k", "drop")).await, Outcome::Drop);
        assert_eq!(exec.stats.restarts.load(Ordering::Relaxed), 0);
    }

    #[tokio::test]
    async fn a_child_that_dies_is_replaced_and_gets_the_unanswered_delivery_again() {
        // The first child dies on its first line; the next ones answer.
        let dir = std::env::temp_dir().join(format!("shardwise-exec-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let marker = dir.join("died");
        let command = format!(
            r#"if [ ! -e {m} ]; then read -r line; touch {m}; exit 3; fi; {ECHO}"#,
            m = marker.display()
        );
        let exec = Exec::start(settings(&command, None));
        assert_eq!(exec.handle(delivery("k", "ack")).await, Outcome::Ack);
        assert_eq!(exec.stats.restarts.load(Ordering::Relaxed), 1);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn garbage_or_a_hang_replaces_the_child_and_a_record_that_always_kills_it_is_retried() {
        // Garbage every time: after three losses the delivery is answered retry.
        let exec = Exec::start(settings("while read -r l; do echo not-json; done", None));
        assert_eq!(exec.handle(delivery("k", "ack")).await, Outcome::Retry);
        assert_eq!(exec.stats.restarts.load(Ordering::Relaxed), 3);
        // A child that never answers, past the timeout.
        let exec = Exec::start(settings("sleep 3600", Some(Duration::from_millis(200))));
        assert_eq!(exec.handle(delivery("k", "ack")).await, Outcome::Retry);
        assert_eq!(exec.stats.restarts.load(Ordering::Relaxed), 3);
    }
}
