//! `consume --exec 'CMD ARGS'`: any program as the handler, over a line protocol on its stdin and
//! stdout (the README's "Any program as the handler" has the protocol).
//!
//! A pool of children, each run as `sh -c CMD` in a process group of its own (a replacement and a
//! stop signal the whole group). The deliveries of one lane of one shard always go to the same
//! child, one (or one batch) at a time, so the order per key holds; one child serves several
//! shard lanes at once, telling their requests apart by `id`. Each child is owned by one task:
//!
//! ```text
//!   starting ──spawned──► up ──exited / closed a pipe / garbage / hung──► down: SIGKILL its group
//!      ▲                  │                                                │
//!      │                  └─stop─► stopping: stdin closed, SIGTERM to its  │
//!      │                           group, SIGKILL to what is left of it    │
//!      │                           after the grace (5 s); the task ends    │
//!      └──────── back-off (100 ms doubling to 10 s; reset after 30 s up) ◄─┘
//!                (a stop meanwhile ends the task: no child runs)
//! ```
//!
//! The task never waits on a pipe: a writer task per child owns the child's stdin and writes the
//! lines it is handed (at most 8 wait for it), telling the task as each one is written whole. A
//! request goes
//!
//! ```text
//!   queued ──handed to the writer──► being written ──written whole──► taken ──answer──► done
//! ```
//!
//! (taken: the child read it, but for what the 64 KiB pipe holds). Only the oldest request in
//! flight is timed, from the later of when it became the oldest and when the child took it: past
//! the handler timeout the child is hung, whether it did not read that request or did not answer
//! it. The requests behind it may wait legitimately (a sequential child serving many lanes takes
//! them one at a time), so they are not timed; a child that answers out of order is found hung at
//! worst once each older request was answered or timed out.
//!
//! Requests in flight when a child goes down are not answered: their deliveries stay unsettled
//! (the handler call goes on waiting) and are sent again, in their order, to the child that
//! replaces it. The oldest of them (the one a sequential child was working on, or the one it did
//! not read) counts the loss against itself; once a request was in flight at three losses it is
//! answered `retry` (the retry path: a counted copy, a dead letter once spent), so a record that
//! kills its handler cannot stop the shard. A request whose handler call was given up before it
//! was handed to the writer is dropped unwritten.
//!
//! When the consumer starts shutting down ([`Exec::notice_shutdown`]) each child is told, before
//! any request not yet handed to its writer: a line `{"shutdown": {"deadline_ms": N}}`, N the
//! milliseconds left of the shutdown deadline. Its requests in flight are still answered as
//! usual; a child that then ends with none in flight is not replaced (unless a request comes
//! after all). A stop ([`Exec::stop`], or every handle to the pool dropped) ends each child as
//! above; what it left unanswered stays unsettled. stderr of every child goes to the log line by
//! line at `warn`, the CLI's default level, so a traceback is seen without flags.
//!
//! Lines come in two formats ([`Format`]): the protocol's own (a delivery, or a batch, answered
//! with outcomes), and Lambda's Kinesis event answered with what the function returned
//! ([`lambda`]). Answers may carry fields shardwise does not know: they are ignored.

mod lambda;
pub(crate) mod runner;

use std::collections::{BTreeMap, VecDeque};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use base64::Engine;
use nix::errno::Errno;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use serde::Deserialize;
use serde_json::{Map, Value, json};
use shardwise::window::{WindowAnswer, WindowCall, WindowHandler};
use shardwise::{Batching, Delivery, Handler, Outcome};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStderr, ChildStdin, ChildStdout, Command};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{debug, info, warn};

pub(crate) use lambda::EventSource;

/// Losses of a child while a request was the oldest in flight, after which it is answered `retry`.
const MAX_LOSSES: u32 = 3;
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(10);
/// A child up this long (and answering) resets the back-off.
const STABLE: Duration = Duration::from_secs(30);
/// At a stop, how long a child has after SIGTERM before SIGKILL.
pub(crate) const STOP_GRACE: Duration = Duration::from_secs(5);
/// Lines waiting for a child's writer. The rest wait in the child's task, where one whose handler
/// call was given up is dropped unwritten.
const WRITER_QUEUE: usize = 8;
/// How long the exit status and the last answers of a child that ended (or closed a pipe) are
/// waited for.
const EXIT_WAIT: Duration = Duration::from_secs(1);
/// How often a stopping child's process group is looked at.
const STOP_POLL: Duration = Duration::from_millis(50);

/// How long a kill waits for the killed group's last processes to end.
const KILL_WAIT: Duration = Duration::from_secs(2);

/// The writer's report id of the shutdown notice (requests are numbered from 1).
const NOTICE: u64 = 0;

/// What the lines to and from the children say.
#[derive(Debug, Clone)]
pub(crate) enum Format {
    /// The protocol's own: a delivery (or a batch) per line, answered with outcomes.
    Shardwise,
    /// Lambda's Kinesis event, one batch per line, answered with what the function returned.
    Lambda(Arc<EventSource>),
}

/// How the children run.
#[derive(Debug, Clone)]
pub(crate) struct ExecSettings {
    /// The command line, run by `sh -c` in a process group of its own.
    pub(crate) command: String,
    /// How many children.
    pub(crate) children: usize,
    /// The oldest request in flight unanswered (or unread) this long means the child hangs: it
    /// is killed and replaced.
    pub(crate) timeout: Option<Duration>,
    /// With `Some`, deliveries go to the child in batches (one line per batch).
    pub(crate) batching: Option<Batching>,
    /// This worker's id, given to the children as `SHARDWISE_WORKER`.
    pub(crate) worker: String,
    /// At a stop, how long a child has after SIGTERM before SIGKILL ([`STOP_GRACE`] in the CLI).
    pub(crate) grace: Duration,
    /// What the lines say.
    pub(crate) format: Format,
    /// More environment for the children (the Lambda runner's settings).
    pub(crate) env: Vec<(String, String)>,
    /// The children's working directory (default: this process's).
    pub(crate) dir: Option<PathBuf>,
}

/// Where the pool is in its life, as every child's task sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PoolState {
    Running,
    /// The consumer is shutting down, by `deadline`: each child is told once.
    Draining {
        deadline: Instant,
    },
    /// The children stop.
    Stopped,
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
    format: Format,
    pub(crate) stats: Arc<ExecStats>,
    /// Running, then draining, then stopped.
    state: Arc<watch::Sender<PoolState>>,
    /// The children's tasks, until [`Exec::stop`] waits for them.
    tasks: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

/// One line to send, and where each of its deliveries' outcomes goes.
struct Request {
    /// What the answer is read against.
    expect: Expect,
    /// The request's own id (the delivery's, or the batch's).
    id: u64,
    /// Shared with the writer, which may be writing it while the task keeps it for a resend.
    line: Arc<str>,
    reply: oneshot::Sender<Vec<Outcome>>,
}

/// An unanswered request, and where it is with the current child.
struct InFlight {
    request: Request,
    /// Handed to the current child's writer.
    handed: bool,
    /// When the current child took it: its line was written whole.
    taken: Option<Instant>,
    /// Children that went down with this request the oldest in flight.
    losses: u32,
}

/// What an answer is read against: the line's deliveries, in order.
enum Expect {
    /// The protocol's own answer: an outcome per delivery id (one, or a batch's).
    Outcomes(Vec<u64>),
    /// A Lambda function's answer: item failures named by sequence number.
    Lambda(Vec<String>),
    /// A Lambda function's answer to a tumbling window's call: item failures, and the `state`
    /// it must carry, put in the slot (left empty when the call failed).
    LambdaWindow(Vec<String>, Arc<Mutex<Option<Vec<u8>>>>),
}

impl Expect {
    /// How many deliveries the line carries.
    fn len(&self) -> usize {
        match self {
            Expect::Outcomes(ids) => ids.len(),
            Expect::Lambda(sequences) | Expect::LambdaWindow(sequences, _) => sequences.len(),
        }
    }
}

impl InFlight {
    fn new(request: Request) -> Self {
        Self {
            request,
            handed: false,
            taken: None,
            losses: 0,
        }
    }
}

impl Exec {
    /// Starts the children (each in its own task).
    pub(crate) fn start(settings: ExecSettings) -> Self {
        let stats = Arc::new(ExecStats::default());
        let (state, stopping) = watch::channel(PoolState::Running);
        let mut children = Vec::new();
        let mut tasks = Vec::new();
        for index in 0..settings.children.max(1) {
            let (tx, rx) = mpsc::unbounded_channel();
            tasks.push(tokio::spawn(run_child(
                index,
                settings.clone(),
                rx,
                stopping.clone(),
                stats.clone(),
            )));
            children.push(tx);
        }
        Self {
            children: Arc::new(children),
            next_id: Arc::new(AtomicU64::new(1)),
            batching: settings.batching,
            format: settings.format,
            stats,
            state: Arc::new(state),
            tasks: Arc::new(Mutex::new(tasks)),
        }
    }

    /// Stops the children and returns once they are gone: each gets its stdin closed and SIGTERM
    /// to its process group, and SIGKILL to what is left of the group after the grace. Requests
    /// still unanswered stay unsettled (their handler calls go on waiting); call it once the
    /// consumer has shut down.
    ///
    /// Cancellation safe: the children go on stopping in their own tasks.
    pub(crate) async fn stop(&self) {
        self.state.send_replace(PoolState::Stopped);
        let tasks = std::mem::take(&mut *self.tasks.lock().unwrap_or_else(PoisonError::into_inner));
        for task in tasks {
            let _ = task.await;
        }
    }

    /// Tells every child (and any started later) that the consumer is shutting down and has
    /// `deadline` left: the line `{"shutdown": {"deadline_ms": N}}`, before the requests not yet
    /// handed to it. Only the first call counts, and none after [`Exec::stop`].
    pub(crate) fn notice_shutdown(&self, deadline: Duration) {
        let deadline = Instant::now() + deadline;
        self.state.send_if_modified(|state| {
            let running = *state == PoolState::Running;
            if running {
                *state = PoolState::Draining { deadline };
            }
            running
        });
    }

    /// The child of `lane` of `shard`.
    fn child_for(&self, shard: &str, lane: usize) -> &mpsc::UnboundedSender<Request> {
        let mut h = DefaultHasher::new();
        (shard, lane).hash(&mut h);
        &self.children[(h.finish() % self.children.len() as u64) as usize]
    }

    /// Sends a request to the child of `first`'s lane and waits for its outcomes. Never returns
    /// while the pool is shutting down: the deliveries stay unsettled and are read again.
    async fn send(&self, first: &Delivery, id: u64, expect: Expect, line: String) -> Vec<Outcome> {
        self.send_to(first.shard(), first.lane(), id, expect, line)
            .await
    }

    /// [`send`](Self::send) to the child of `lane` of `shard`.
    async fn send_to(
        &self,
        shard: &str,
        lane: usize,
        id: u64,
        expect: Expect,
        line: String,
    ) -> Vec<Outcome> {
        let (reply, answer) = oneshot::channel();
        let request = Request {
            expect,
            id,
            line: line.into(),
            reply,
        };
        if self.child_for(shard, lane).send(request).is_err() {
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
        if let Format::Lambda(_) = self.format {
            // Lambda's event is a batch, of one here.
            let outcomes = self.handle_batch(vec![delivery]).await;
            return outcomes.into_iter().next().unwrap_or(Outcome::Retry);
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let line = delivery_json(&delivery, id).to_string();
        self.send(&delivery, id, Expect::Outcomes(vec![id]), line)
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
        if let Format::Lambda(source) = &self.format {
            let (line, sequences) = lambda::request_line(batch_id, &batch, source);
            return self
                .send(&batch[0], batch_id, Expect::Lambda(sequences), line)
                .await;
        }
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
        self.send(&batch[0], batch_id, Expect::Outcomes(ids), line)
            .await
    }
}

/// The handler program run on tumbling windows (`--tumbling-window`, Lambda's format): each
/// call is one request of Lambda's `KinesisTimeWindowEvent`, to the child of the shard's lane.
#[derive(Debug, Clone)]
pub(crate) struct ExecWindows(pub(crate) Exec);

impl WindowHandler for ExecWindows {
    async fn handle_window(&self, call: WindowCall) -> WindowAnswer {
        let Format::Lambda(source) = &self.0.format else {
            // `consume` runs windows only with Lambda's format.
            return WindowAnswer::failed();
        };
        let id = self.0.next_id.fetch_add(1, Ordering::Relaxed);
        let (line, sequences) = lambda::window_request_line(id, &call, source);
        let slot = Arc::new(Mutex::new(None));
        let lane = call.records.first().map_or(0, Delivery::lane);
        let outcomes = self
            .0
            .send_to(
                &call.shard_id,
                lane,
                id,
                Expect::LambdaWindow(sequences, slot.clone()),
                line,
            )
            .await;
        let state = slot.lock().unwrap_or_else(PoisonError::into_inner).take();
        match state {
            Some(state) => WindowAnswer::new(state, outcomes),
            None => WindowAnswer::failed(),
        }
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
    object.extend(identity(d));
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

/// What identifies a delivery's record for good, the same for its retries and their copies:
/// `idempotency_key` (its [`EventId`](shardwise::receipts::EventId): for a retry copy, the
/// record's that was first read) and, for a Kinesis record, `origin`: that record's `stream`,
/// `shard`, `sequence` and `subsequence`.
fn identity(d: &Delivery) -> Map<String, Value> {
    let key = d.event_id();
    let mut fields = Map::new();
    // `kinesis/STREAM/SHARD/SEQUENCE.SUB`: neither a stream's nor a shard's name holds a `/`.
    let origin = key.as_str().strip_prefix("kinesis/").and_then(|rest| {
        let (rest, position) = rest.rsplit_once('/')?;
        let (stream, shard) = rest.rsplit_once('/')?;
        let (sequence, sub) = position.rsplit_once('.')?;
        let sub: u64 = sub.parse().ok()?;
        Some(json!({ "stream": stream, "shard": shard, "sequence": sequence, "subsequence": sub }))
    });
    fields.insert("idempotency_key".into(), json!(key.as_str()));
    if let Some(origin) = origin {
        fields.insert("origin".into(), origin);
    }
    fields
}

/// An answer line: the protocol's own (`outcome`, `outcomes`) or a Lambda function's
/// (`response`, `error`). Fields it does not know are ignored, so that a program may say more
/// (and a later shardwise may read more) without being taken for garbage.
#[derive(Debug, Deserialize)]
struct Answer {
    id: u64,
    #[serde(default)]
    outcome: Option<Value>,
    #[serde(default)]
    outcomes: Option<Vec<ItemAnswer>>,
    /// What the function returned (`null` or absent: nothing).
    #[serde(default)]
    response: Option<Value>,
    /// The function raised (`null` or absent: it did not).
    #[serde(default)]
    error: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct ItemAnswer {
    id: u64,
    outcome: Value,
}

/// The outcomes spelt as objects, by their one key.
const OUTCOME_KEYS: [&str; 3] = ["retry_after_ms", "hold", "quarantine"];

/// An outcome as the protocol spells it: `"ack"`, `"drop"`, `"retry"`, `{"retry_after_ms": N}`,
/// `{"hold": "reason"}`, `{"quarantine": "reason"}` (an object's other keys are ignored).
pub(crate) fn parse_outcome(v: &Value) -> Result<Outcome, String> {
    match v {
        Value::String(s) => match s.as_str() {
            "ack" => Ok(Outcome::Ack),
            "drop" => Ok(Outcome::Drop),
            "retry" => Ok(Outcome::Retry),
            other => Err(format!("unknown outcome `{other}`")),
        },
        Value::Object(o) => {
            let mut known = o.iter().filter(|(k, _)| OUTCOME_KEYS.contains(&k.as_str()));
            let (Some((name, arg)), None) = (known.next(), known.next()) else {
                return Err(format!("unknown outcome {v}"));
            };
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
/// request's order (a batch's deliveries left out are retried; a Lambda function's answer as
/// [`lambda::read_answer`] reads it).
fn outcomes_of(answer: &Answer, expect: &Expect) -> Result<Vec<Outcome>, String> {
    let ids = match expect {
        Expect::Outcomes(ids) => ids,
        Expect::LambdaWindow(sequences, slot) => {
            let (read, state) = lambda::read_window_answer(
                answer.error.as_ref(),
                answer.response.as_ref(),
                sequences,
            );
            if let Some(why) = &read.batch_failed {
                warn!(
                    request = answer.id,
                    records = sequences.len(),
                    "{why}: the window's call is made again"
                );
            }
            *slot.lock().unwrap_or_else(PoisonError::into_inner) = state;
            return Ok(read.outcomes);
        }
        Expect::Lambda(sequences) => {
            let read =
                lambda::read_answer(answer.error.as_ref(), answer.response.as_ref(), sequences);
            match &read.batch_failed {
                Some(why) => {
                    warn!(
                        request = answer.id,
                        records = sequences.len(),
                        "{why}: the whole batch is retried"
                    );
                }
                None => {
                    let failed = read.outcomes.iter().filter(|o| **o != Outcome::Ack).count();
                    if failed > 0 {
                        debug!(
                            request = answer.id,
                            failed,
                            records = sequences.len(),
                            "batch item failures: retried from the first one named"
                        );
                    }
                }
            }
            // A batch that failed as a whole answers no outcome: the lane retries every record,
            // or, with --bisect-batch-on-error, handles the batch again in halves.
            if read.batch_failed.is_some() {
                return Ok(Vec::new());
            }
            return Ok(read.outcomes);
        }
    };
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
    ClosedStdout,
    Garbage(String),
    /// The oldest request in flight went past the timeout; `taken`: the child had read it.
    Hung {
        request: u64,
        taken: bool,
    },
    Unwritable(std::io::Error),
}

impl std::fmt::Display for Down {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Down::Exited(status) => write!(f, "exited ({status})"),
            Down::ClosedStdout => write!(f, "closed its stdout"),
            Down::Garbage(why) => write!(f, "wrote a line that is not an answer: {why}"),
            Down::Hung {
                request,
                taken: true,
            } => write!(
                f,
                "left request {request} unanswered past the handler timeout"
            ),
            Down::Hung {
                request,
                taken: false,
            } => write!(
                f,
                "did not read request {request} within the handler timeout"
            ),
            Down::Unwritable(e) => write!(f, "stdin closed: {e}"),
        }
    }
}

/// Owns child `index`: starts it, sends it requests, reads its answers, and replaces it when it
/// goes down, sending what it left unanswered to the next one; stops it at the pool's stop.
async fn run_child(
    index: usize,
    settings: ExecSettings,
    mut requests: mpsc::UnboundedReceiver<Request>,
    mut stop: watch::Receiver<PoolState>,
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
                if !wait_out(backoff, &mut stop, &stats).await {
                    return;
                }
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            }
        };
        let pid = child.id().unwrap_or(0);
        let started = Instant::now();
        stats.up.fetch_add(1, Ordering::Relaxed);
        info!(child = index, pid, command = %settings.command, resent = flight.len(), "handler program started");
        let served = serve(&mut child, &settings, &mut requests, &mut stop, &mut flight).await;
        stats.up.fetch_sub(1, Ordering::Relaxed);
        let down = match served {
            Served::Stopped => {
                stop_group(&mut child, index, pid, settings.grace).await;
                return;
            }
            Served::Finished => {
                kill_group(&mut child, pid).await;
                info!(
                    child = index,
                    pid, "handler program ended after the shutdown notice"
                );
                // Not replaced, unless a request comes after all.
                tokio::select! {
                    () = stopped(&mut stop) => return,
                    request = requests.recv() => match request {
                        Some(request) => flight.push_back(InFlight::new(request)),
                        None => return,
                    },
                }
                continue;
            }
            Served::Down(down) => down,
        };
        kill_group(&mut child, pid).await;
        stats.restarts.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("shardwise_exec_restarts_total").increment(1);
        if started.elapsed() >= STABLE {
            backoff = FIRST_BACKOFF;
        }
        // The oldest request in flight was being worked on (or not read): it counts the loss.
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
                    .send(vec![Outcome::Retry; spent.request.expect.len()]);
            }
        }
        flight.retain(|f| !f.request.reply.is_closed());
        warn!(child = index, pid, reason = %down, unanswered = flight.len(), ?backoff, "handler program replaced; its unanswered deliveries go to the next one");
        if !wait_out(backoff, &mut stop, &stats).await {
            return;
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// Waits out a back-off, counted as restarting; `false` when the pool stops meanwhile.
async fn wait_out(
    backoff: Duration,
    stop: &mut watch::Receiver<PoolState>,
    stats: &ExecStats,
) -> bool {
    stats.restarting.fetch_add(1, Ordering::Relaxed);
    let waited = tokio::select! {
        () = tokio::time::sleep(backoff) => true,
        () = stopped(stop) => false,
    };
    stats.restarting.fetch_sub(1, Ordering::Relaxed);
    waited
}

/// Returns once the pool stops: [`Exec::stop`] was called, or every handle to the pool is gone.
/// Cancellation safe.
async fn stopped(stop: &mut watch::Receiver<PoolState>) {
    let _ = stop.wait_for(|state| *state == PoolState::Stopped).await;
}

/// Returns once the consumer is shutting down: the time left until its deadline (none once the
/// pool stopped or is gone). Cancellation safe.
async fn draining(state: &mut watch::Receiver<PoolState>) -> Option<Duration> {
    let state = *state
        .wait_for(|state| *state != PoolState::Running)
        .await
        .ok()?;
    match state {
        PoolState::Draining { deadline } => {
            Some(deadline.saturating_duration_since(Instant::now()))
        }
        PoolState::Running | PoolState::Stopped => None,
    }
}

/// The shutdown notice as a child reads it.
fn notice_line(left: Duration) -> Arc<str> {
    json!({ "shutdown": { "deadline_ms": left.as_millis() as u64 } })
        .to_string()
        .into()
}

/// The process group of a child whose shell has pid `pid` (the group's id is that pid, even once
/// the shell was reaped, as long as a process of the group is left).
fn group_of(pid: u32) -> Option<Pid> {
    i32::try_from(pid)
        .ok()
        .filter(|group| *group > 0)
        .map(Pid::from_raw)
}

/// Kills the child's whole process group (the shell and what it started), reaps the shell, and
/// waits (at most [`KILL_WAIT`]) for the rest of the group to be gone: SIGKILL takes effect when
/// a process next runs, and a program the shell started is not its child to wait for.
async fn kill_group(child: &mut Child, pid: u32) {
    let group = group_of(pid);
    if let Some(group) = group {
        let _ = killpg(group, Signal::SIGKILL);
    }
    let _ = child.start_kill();
    let _ = child.wait().await;
    let Some(group) = group else { return };
    let deadline = Instant::now() + KILL_WAIT;
    while group_lives(group) && Instant::now() < deadline {
        tokio::time::sleep(STOP_POLL / 5).await;
    }
}

/// Whether a process of the group is still running. A zombie (ended, waiting to be reaped by
/// whichever process inherited it, which PID 1 of a container may do only every few seconds)
/// does not count.
#[cfg(target_os = "linux")]
fn group_lives(group: Pid) -> bool {
    let Ok(processes) = procfs::process::all_processes() else {
        return killpg(group, None) != Err(Errno::ESRCH);
    };
    processes
        .filter_map(|p| p.ok()?.stat().ok())
        .any(|stat| stat.pgrp == group.as_raw() && !matches!(stat.state, 'Z' | 'X' | 'x'))
}

/// Whether a process of the group is still running (zombies included).
#[cfg(not(target_os = "linux"))]
fn group_lives(group: Pid) -> bool {
    killpg(group, None) != Err(Errno::ESRCH)
}

/// Ends a child at the pool's stop (its stdin is closed already): SIGTERM to its process group,
/// then SIGKILL to what is left of the group after `grace`.
async fn stop_group(child: &mut Child, index: usize, pid: u32, grace: Duration) {
    let Some(group) = group_of(pid) else {
        return kill_group(child, pid).await;
    };
    let _ = killpg(group, Signal::SIGTERM);
    let deadline = Instant::now() + grace;
    loop {
        // Reaps the shell once it ended: the group is gone when no process of it is left.
        let _ = child.try_wait();
        if !group_lives(group) {
            info!(child = index, pid, "handler program stopped");
            return;
        }
        if Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(STOP_POLL).await;
    }
    warn!(
        child = index,
        pid,
        ?grace,
        "handler program still running past the grace after SIGTERM: killed"
    );
    kill_group(child, pid).await;
}

fn spawn(index: usize, settings: &ExecSettings) -> std::io::Result<Child> {
    // Its own process group: a replacement kills the shell and everything it started.
    let mut command = Command::new("sh");
    command
        .arg("-c")
        .arg(&settings.command)
        .process_group(0)
        .envs(settings.env.iter().map(|(name, value)| (name, value)))
        .env("SHARDWISE_CHILD", index.to_string())
        .env("SHARDWISE_WORKER", &settings.worker)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    if let Some(dir) = &settings.dir {
        command.current_dir(dir);
    }
    let mut child = command.spawn()?;
    if let Some(stderr) = child.stderr.take() {
        tokio::spawn(log_stderr(index, child.id().unwrap_or(0), stderr));
    }
    Ok(child)
}

/// Passes a child's stderr to the log line by line, at `warn`: the CLI's default level, so a
/// traceback is seen without flags. Reads to the end (bytes that are not UTF-8 included), so the
/// child never blocks on a full stderr pipe.
async fn log_stderr(index: usize, pid: u32, stderr: ChildStderr) {
    let mut stderr = BufReader::new(stderr);
    let mut line = Vec::new();
    loop {
        line.clear();
        match stderr.read_until(b'\n', &mut line).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {
                let text = String::from_utf8_lossy(&line);
                warn!(target: "shardwise::exec", child = index, pid, "{}", text.trim_end());
            }
        }
    }
}

/// What a child's writer tells the child's task.
enum Written {
    /// The line of this request was written whole: the child took it.
    Taken(u64),
    /// The child's stdin cannot be written to (it closed it, or ended). The writer ends.
    Failed(std::io::Error),
}

/// A child's writer: the only task that waits on the child's stdin. Writes the lines it is
/// handed, in order, and reports each one written whole.
async fn write_lines(
    mut stdin: ChildStdin,
    mut lines: mpsc::Receiver<(u64, Arc<str>)>,
    report: mpsc::UnboundedSender<Written>,
) {
    while let Some((id, line)) = lines.recv().await {
        let (written, failed) = match write_line(&mut stdin, &line).await {
            Ok(()) => (Written::Taken(id), false),
            Err(e) => (Written::Failed(e), true),
        };
        if report.send(written).is_err() || failed {
            return;
        }
    }
}

async fn write_line(stdin: &mut ChildStdin, line: &str) -> std::io::Result<()> {
    stdin.write_all(line.as_bytes()).await?;
    stdin.write_all(b"\n").await?;
    stdin.flush().await
}

/// Aborts a child's writer when dropped, which closes the child's stdin.
struct WriterTask(JoinHandle<()>);

impl Drop for WriterTask {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The hang clock: since when the oldest request in flight waits on the child.
#[derive(Debug)]
struct HangClock {
    /// The id of the oldest request in flight, as last followed.
    oldest: Option<u64>,
    /// When it became the oldest.
    since: Instant,
}

impl HangClock {
    fn new(now: Instant) -> Self {
        Self {
            oldest: None,
            since: now,
        }
    }

    /// Follows the oldest request in flight: one that just became the oldest starts its clock
    /// `now`.
    fn follow(&mut self, oldest: Option<u64>, now: Instant) {
        if oldest != self.oldest {
            self.oldest = oldest;
            self.since = now;
        }
    }

    /// When the child is hung unless the oldest request moves before: `limit` after the later of
    /// when it became the oldest and when the child took it (`taken`). `None` with nothing in
    /// flight.
    fn deadline(&self, taken: Option<Instant>, limit: Duration) -> Option<Instant> {
        self.oldest?;
        Some(taken.map_or(self.since, |taken| taken.max(self.since)) + limit)
    }
}

/// Hands the writer the next requests in order, as many as its queue takes; drops those not
/// handed yet whose handler call was given up.
fn hand_over(flight: &mut VecDeque<InFlight>, writer: &mpsc::Sender<(u64, Arc<str>)>) {
    flight.retain(|f| f.handed || !f.request.reply.is_closed());
    for f in flight.iter_mut().filter(|f| !f.handed) {
        // Full: the writer reports the line it is writing, and more are handed then. Closed: its
        // failure is on the way.
        if writer
            .try_send((f.request.id, f.request.line.clone()))
            .is_err()
        {
            break;
        }
        f.handed = true;
    }
}

/// How a child's service ended.
enum Served {
    /// The pool stops.
    Stopped,
    /// The child went down: it is replaced.
    Down(Down),
    /// The child ended after the shutdown notice with nothing in flight: it is done.
    Finished,
}

/// Where the shutdown notice is with the current child.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Notice {
    /// The consumer is not shutting down yet.
    NotYet,
    /// To hand to the writer (before the requests not handed yet).
    Due(Arc<str>),
    /// Handed to the writer (or there is none to give).
    Handed,
}

/// Runs one child until it goes down, ends after the shutdown notice, or the pool stops. Never
/// waits on the child's stdin: its writer does.
async fn serve(
    child: &mut Child,
    settings: &ExecSettings,
    requests: &mut mpsc::UnboundedReceiver<Request>,
    stop: &mut watch::Receiver<PoolState>,
    flight: &mut VecDeque<InFlight>,
) -> Served {
    let (writer, lines) = mpsc::channel(WRITER_QUEUE);
    let (report, mut written) = mpsc::unbounded_channel();
    let stdin = child.stdin.take().expect("piped");
    let _writer = WriterTask(tokio::spawn(write_lines(stdin, lines, report)));
    let mut answers = BufReader::new(child.stdout.take().expect("piped")).lines();
    // What the previous child left unanswered goes first, in its order.
    for f in flight.iter_mut() {
        f.handed = false;
        f.taken = None;
    }
    let mut clock = HangClock::new(Instant::now());
    // A child started while the consumer drains is told before anything else.
    let mut notice = match *stop.borrow() {
        PoolState::Running => Notice::NotYet,
        PoolState::Draining { deadline } => Notice::Due(notice_line(
            deadline.saturating_duration_since(Instant::now()),
        )),
        PoolState::Stopped => Notice::Handed,
    };
    let mut drain = stop.clone();
    loop {
        if let Notice::Due(line) = &notice
            && writer.try_send((NOTICE, line.clone())).is_ok()
        {
            notice = Notice::Handed;
        }
        hand_over(flight, &writer);
        clock.follow(flight.front().map(|f| f.request.id), Instant::now());
        let hang_at = settings
            .timeout
            .and_then(|limit| clock.deadline(flight.front().and_then(|f| f.taken), limit));
        let hang = tokio::time::sleep_until(hang_at.unwrap_or_else(Instant::now));
        let ended = tokio::select! {
            () = stopped(stop) => break,
            left = draining(&mut drain), if notice == Notice::NotYet => {
                notice = left.map_or(Notice::Handed, |left| Notice::Due(notice_line(left)));
                continue;
            }
            request = requests.recv() => match request {
                Some(request) => {
                    flight.push_back(InFlight::new(request));
                    continue;
                }
                None => break,
            },
            Some(report) = written.recv() => match report {
                Written::Taken(id) => {
                    // Not there when answered before it was written whole.
                    if let Some(f) = flight.iter_mut().find(|f| f.request.id == id) {
                        f.taken = Some(Instant::now());
                    }
                    continue;
                }
                Written::Failed(e) => ending(child, &mut answers, flight, Down::Unwritable(e)).await,
            },
            line = answers.next_line() => match line {
                Ok(Some(line)) => match answered(&line, flight) {
                    Ok(()) => continue,
                    Err(down) => return Served::Down(down),
                },
                Ok(None) | Err(_) => ending(child, &mut answers, flight, Down::ClosedStdout).await,
            },
            status = child.wait() => {
                let status = status.map_or_else(|e| e.to_string(), |s| s.to_string());
                ending(child, &mut answers, flight, Down::Exited(status)).await
            }
            () = hang, if hang_at.is_some() => {
                let oldest = flight.front().expect("timed");
                let (request, taken) = (oldest.request.id, oldest.taken.is_some());
                return Served::Down(Down::Hung { request, taken });
            }
        };
        // It ended (or closed a pipe). Told of the shutdown and with nothing left to answer, it
        // is done; else it is replaced.
        let done =
            notice == Notice::Handed && flight.is_empty() && !matches!(ended, Down::Garbage(_));
        return if done {
            Served::Finished
        } else {
            Served::Down(ended)
        };
    }
    // Stopping. What it still answers is read and let go, so that it does not die writing to a
    // closed pipe while it ends.
    tokio::spawn(async move { while let Ok(Some(_)) = answers.next_line().await {} });
    Served::Stopped
}

/// A child ended, or closed its stdin or stdout: takes the answers it wrote before it ended
/// (they still count) and how it ended, waiting at most [`EXIT_WAIT`]. Still running then, it
/// went down for `why`.
async fn ending(
    child: &mut Child,
    answers: &mut Lines<BufReader<ChildStdout>>,
    flight: &mut VecDeque<InFlight>,
    why: Down,
) -> Down {
    let drain = async {
        while let Ok(Some(line)) = answers.next_line().await {
            answered(&line, flight)?;
        }
        Ok(child.wait().await)
    };
    match tokio::time::timeout(EXIT_WAIT, drain).await {
        Ok(Err(garbage)) => garbage,
        Ok(Ok(status)) => Down::Exited(status.map_or_else(|e| e.to_string(), |s| s.to_string())),
        Err(_) => why,
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
    let outcomes = outcomes_of(&answer, &flight[at].request.expect)
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
    use std::path::{Path, PathBuf};

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
            json!({"hold": "a", "quarantine": "b"}),
        ] {
            assert!(parse_outcome(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn answers_may_carry_fields_shardwise_does_not_know() {
        // Each was garbage (the child killed) while answers were read strictly.
        let single: Answer = serde_json::from_str(
            r#"{"id": 4, "outcome": "ack", "took_ms": 12, "trace": {"span": "a1"}}"#,
        )
        .unwrap();
        assert_eq!(
            outcomes_of(&single, &Expect::Outcomes(vec![4])).unwrap(),
            [Outcome::Ack]
        );
        let batch: Answer = serde_json::from_str(
            r#"{"id": 9, "outcomes": [{"id": 10, "outcome": "drop", "why": "not JSON"}], "worker": "py-3"}"#,
        )
        .unwrap();
        assert_eq!(
            outcomes_of(&batch, &Expect::Outcomes(vec![10, 11])).unwrap(),
            [Outcome::Drop, Outcome::Retry]
        );
        // An outcome object's other keys too.
        assert_eq!(
            parse_outcome(&json!({"retry_after_ms": 250, "reason": "throttled"})).unwrap(),
            Outcome::RetryAfter(Duration::from_millis(250))
        );
    }

    #[test]
    fn a_batch_answer_names_its_deliveries_and_leaves_out_the_ones_to_retry() {
        let answer: Answer =
            serde_json::from_str(r#"{"id": 9, "outcomes": [{"id": 11, "outcome": "drop"}, {"id": 10, "outcome": "ack"}]}"#)
                .unwrap();
        assert_eq!(
            outcomes_of(&answer, &Expect::Outcomes(vec![10, 11, 12])).unwrap(),
            [Outcome::Ack, Outcome::Drop, Outcome::Retry]
        );
        let stranger: Answer =
            serde_json::from_str(r#"{"id": 9, "outcomes": [{"id": 99, "outcome": "ack"}]}"#)
                .unwrap();
        assert!(outcomes_of(&stranger, &Expect::Outcomes(vec![10])).is_err());
        let single: Answer = serde_json::from_str(r#"{"id": 4, "outcome": "ack"}"#).unwrap();
        assert_eq!(
            outcomes_of(&single, &Expect::Outcomes(vec![4])).unwrap(),
            [Outcome::Ack]
        );
        // A Lambda function's answer where the protocol's is expected says nothing.
        let lambda: Answer = serde_json::from_str(r#"{"id": 4, "response": null}"#).unwrap();
        assert!(outcomes_of(&lambda, &Expect::Outcomes(vec![4])).is_err());
    }

    #[test]
    fn the_hang_clock_times_the_oldest_request_from_when_it_was_taken_or_became_the_oldest() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let limit = Duration::from_millis(1000);
        // One clock through a child's life: (now, the oldest request in flight, when the child
        // took it, the deadline expected), in ms.
        let steps = [
            // Nothing in flight: nothing is timed.
            (0, None, None, None),
            // Request 1 comes and is not read yet: timed from its coming.
            (100, Some(1), None, Some(1100)),
            // The child takes it: timed from the take.
            (300, Some(1), Some(300), Some(1300)),
            // 1 answered; 2, taken at 300 ms, waited behind it legitimately: timed from becoming
            // the oldest.
            (900, Some(2), Some(300), Some(1900)),
            // Following the same oldest later does not restart its clock.
            (1500, Some(2), Some(300), Some(1900)),
            // 2 answered; 3 could not be written whole before the child read it, at 2.5 s:
            // timed from the take.
            (2000, Some(3), Some(2500), Some(3500)),
            // 3 answered, nothing left.
            (2600, None, None, None),
        ];
        let mut clock = HangClock::new(t0);
        for (now, oldest, taken, deadline) in steps {
            clock.follow(oldest, at(now));
            let expected = deadline.map(at);
            assert_eq!(
                clock.deadline(taken.map(at), limit),
                expected,
                "at {now} ms"
            );
        }
    }

    fn settings(command: &str, timeout: Option<Duration>) -> ExecSettings {
        ExecSettings {
            command: command.into(),
            children: 1,
            timeout,
            batching: None,
            worker: "w".into(),
            grace: STOP_GRACE,
            format: Format::Shardwise,
            env: Vec::new(),
            dir: None,
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

    /// A fresh directory for one test's files.
    fn scratch(test: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("shardwise-exec-{}-{test}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A program that answers each line with its id and the outcome the data names.
    const ECHO: &str = r#"python3 -u -c 'import json,sys
for line in sys.stdin:
    d = json.loads(line)
    print(json.dumps({"id": d["id"], "outcome": d["data"]}))'"#;

    /// A sequential program: takes `delay_s` over each line, notes `id size-of-data` in `log`,
    /// then answers ack.
    fn acking(log: &Path, delay_s: f64) -> String {
        format!(
            r#"python3 -u -c 'import json,sys,time
log = open(sys.argv[1], "a", buffering=1)
for line in sys.stdin:
    d = json.loads(line)
    time.sleep({delay_s})
    log.write("%d %d\n" % (d["id"], len(d["data"])))
    print(json.dumps({{"id": d["id"], "outcome": "ack"}}))' {log}"#,
            log = log.display()
        )
    }

    /// The ids the program of [`acking`] noted, in its order, and the data sizes it saw.
    fn noted(log: &Path) -> Vec<(u64, usize)> {
        std::fs::read_to_string(log)
            .unwrap_or_default()
            .lines()
            .map(|l| {
                let (id, size) = l.split_once(' ').expect("id size");
                (id.parse().unwrap(), size.parse().unwrap())
            })
            .collect()
    }

    /// Whether process `pid` runs (a zombie does not).
    fn running(pid: &str) -> bool {
        let out = std::process::Command::new("ps")
            .args(["-o", "stat=", "-p", pid])
            .output()
            .expect("ps runs");
        let stat = String::from_utf8_lossy(&out.stdout);
        !stat.trim().is_empty() && !stat.trim().starts_with('Z')
    }

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
        let dir = scratch("dies");
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

    #[tokio::test]
    async fn a_child_that_does_not_read_a_big_record_is_replaced_within_the_timeout() {
        // The first child never reads its stdin, and a 200 KiB line does not fit in the pipe
        // (64 KiB): its write never ends. The child that replaces it reads and answers.
        let dir = scratch("unread");
        let (marker, log) = (dir.join("started"), dir.join("log"));
        let command = format!(
            "if [ ! -e {m} ]; then touch {m}; exec sleep 3600; fi; {}",
            acking(&log, 0.0),
            m = marker.display()
        );
        let timeout = Duration::from_secs(2);
        let exec = Exec::start(settings(&command, Some(timeout)));
        let record = "x".repeat(200 * 1024);
        let started = Instant::now();
        let handled = exec.handle(delivery("k", &record));
        tokio::pin!(handled);
        let mut replaced_after = None;
        let outcome = tokio::time::timeout(Duration::from_secs(60), async {
            loop {
                tokio::select! {
                    outcome = &mut handled => break outcome,
                    () = tokio::time::sleep(Duration::from_millis(10)) => {
                        let restarts = exec.stats.restarts.load(Ordering::Relaxed);
                        if replaced_after.is_none() && restarts > 0 {
                            replaced_after = Some(started.elapsed());
                        }
                    }
                }
            }
        })
        .await
        .expect("answered: the child's task is not stuck writing to a child that does not read");
        let answered_after = started.elapsed();
        assert_eq!(outcome, Outcome::Ack);
        assert_eq!(exec.stats.restarts.load(Ordering::Relaxed), 1);
        // Nothing lost: the replacement got the whole record, once.
        assert_eq!(
            noted(&log).iter().map(|n| n.1).collect::<Vec<_>>(),
            [record.len()]
        );
        // Replaced once the timeout passed, and soon after (generous: a loaded machine).
        let replaced_after = replaced_after.unwrap_or(answered_after);
        assert!(
            replaced_after >= timeout,
            "replaced after {replaced_after:?}, before the timeout"
        );
        assert!(
            replaced_after < timeout + Duration::from_secs(5),
            "replaced only after {replaced_after:?}"
        );
        eprintln!(
            "timeout {timeout:?}: replaced after {replaced_after:?}, answered after {answered_after:?}"
        );
        exec.stop().await;
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn sixty_four_lanes_queued_on_one_sequential_child_are_all_answered_and_none_killed() {
        // 64 lanes share one child that takes 50 ms over each request. The last one waits
        // 3.2 s, past the 1.5 s timeout, but only behind the others: the child never keeps one
        // request longer than 50 ms. Small records all fit in the pipe at once (taken together,
        // queued in the child); 100 KiB ones do not (they wait for the writer).
        for size in [512, 100 * 1024] {
            let dir = scratch(&format!("lanes-{size}"));
            let log = dir.join("log");
            let exec = Exec::start(settings(
                &acking(&log, 0.05),
                Some(Duration::from_millis(1500)),
            ));
            let record = "y".repeat(size);
            let handled = (0..64).map(|lane| {
                let exec = exec.clone();
                let d = Delivery::builder(
                    "s",
                    "shardId-000000000000",
                    shardwise::Position::new(shardwise::SequenceNumber::parse("1").unwrap(), 0),
                )
                .lane(lane)
                .partition_key(format!("k{lane}"))
                .payload(record.clone())
                .build();
                async move { exec.handle(d).await }
            });
            let started = Instant::now();
            let outcomes =
                tokio::time::timeout(Duration::from_secs(120), futures::future::join_all(handled))
                    .await
                    .expect("all answered");
            eprintln!(
                "64 requests of {size} bytes through one child in {:?}",
                started.elapsed()
            );
            assert_eq!(outcomes, vec![Outcome::Ack; 64], "{size} bytes");
            let restarts = exec.stats.restarts.load(Ordering::Relaxed);
            assert_eq!(restarts, 0, "a child was killed ({size} bytes)");
            // Each request reached the child once, whole.
            let noted = noted(&log);
            let mut ids: Vec<u64> = noted.iter().map(|n| n.0).collect();
            ids.sort_unstable();
            ids.dedup();
            assert_eq!((noted.len(), ids.len()), (64, 64), "{size} bytes");
            assert!(noted.iter().all(|n| n.1 == size), "{size} bytes");
            exec.stop().await;
            let _ = std::fs::remove_dir_all(&dir);
        }
    }

    /// Log output kept in memory.
    #[derive(Clone, Default)]
    struct Logged(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Logged {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[tokio::test]
    async fn a_childs_stderr_reaches_the_log_at_the_clis_default_level() {
        let logged = Logged::default();
        let sink = logged.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(
                crate::common::DEFAULT_LOG_FILTER,
            ))
            .with_writer(move || sink.clone())
            .with_ansi(false)
            .finish();
        // This test's runtime runs every task on this thread.
        let _logging = tracing::subscriber::set_default(subscriber);
        let command = format!(r#"echo "Traceback (most recent call last): boom" >&2; {ECHO}"#);
        let exec = Exec::start(settings(&command, None));
        assert_eq!(exec.handle(delivery("k", "ack")).await, Outcome::Ack);
        let seen = async {
            loop {
                let text = String::from_utf8_lossy(&logged.0.lock().unwrap()).into_owned();
                if text.contains("Traceback (most recent call last): boom") {
                    return text;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        let text = tokio::time::timeout(Duration::from_secs(10), seen)
            .await
            .unwrap_or_else(|_| panic!("no traceback in the log: {:?}", logged.0.lock().unwrap()));
        assert!(text.contains("child=0"), "{text}");
        exec.stop().await;
    }

    #[tokio::test]
    async fn a_stop_sends_sigterm_and_lets_the_child_end() {
        // Stays up after its stdin closes: only SIGTERM ends it, and it notes it did.
        let dir = scratch("term");
        let marker = dir.join("terminated");
        let command = format!(
            r#"python3 -u -c 'import json,signal,sys,time
def term(*_):
    open(sys.argv[1], "w").write("SIGTERM")
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
for line in sys.stdin:
    print(json.dumps({{"id": json.loads(line)["id"], "outcome": "ack"}}))
while True:
    time.sleep(1)' {}"#,
            marker.display()
        );
        let grace = Duration::from_secs(30);
        let exec = Exec::start(ExecSettings {
            grace,
            ..settings(&command, None)
        });
        assert_eq!(exec.handle(delivery("k", "ack")).await, Outcome::Ack);
        let started = Instant::now();
        exec.stop().await;
        let stopped_after = started.elapsed();
        assert_eq!(
            std::fs::read_to_string(&marker).ok().as_deref(),
            Some("SIGTERM")
        );
        assert!(
            stopped_after < grace,
            "waited out the grace: {stopped_after:?}"
        );
        eprintln!("a child ending on SIGTERM stopped in {stopped_after:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn a_child_that_ignores_sigterm_is_killed_after_the_grace() {
        let dir = scratch("ignore-term");
        let pid = dir.join("pid");
        let command = format!(
            r#"python3 -u -c 'import json,os,signal,sys,time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(sys.argv[1], "w").write(str(os.getpid()))
for line in sys.stdin:
    print(json.dumps({{"id": json.loads(line)["id"], "outcome": "ack"}}))
while True:
    time.sleep(1)' {}"#,
            pid.display()
        );
        let grace = Duration::from_secs(1);
        let exec = Exec::start(ExecSettings {
            grace,
            ..settings(&command, None)
        });
        assert_eq!(exec.handle(delivery("k", "ack")).await, Outcome::Ack);
        let pid = std::fs::read_to_string(&pid).unwrap();
        assert!(running(&pid));
        let started = Instant::now();
        exec.stop().await;
        let stopped_after = started.elapsed();
        assert!(
            stopped_after >= grace,
            "stopped after {stopped_after:?}, before the grace"
        );
        assert!(!running(&pid), "still running after the stop");
        eprintln!(
            "a child ignoring SIGTERM was killed {stopped_after:?} after the stop (grace {grace:?})"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A program that notes in `log` the shutdown notice (`notice MS`) and SIGTERM, acks every
    /// delivery, and with `end_on_notice` exits once told.
    fn noting(log: &Path, end_on_notice: bool) -> String {
        format!(
            r#"python3 -u -c 'import json,signal,sys
log = open(sys.argv[1], "a", buffering=1)
def term(*_):
    log.write("SIGTERM\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
for line in sys.stdin:
    d = json.loads(line)
    if "shutdown" in d:
        log.write("notice %d\n" % d["shutdown"]["deadline_ms"])
        if {end}:
            sys.exit(0)
        continue
    print(json.dumps({{"id": d["id"], "outcome": "ack"}}))
signal.pause()' {log}"#,
            end = if end_on_notice { "True" } else { "False" },
            log = log.display()
        )
    }

    /// Waits (at most 10 s) until `log` holds `lines` lines, and returns them.
    async fn noted_lines(log: &Path, lines: usize) -> Vec<String> {
        let started = Instant::now();
        loop {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            let noted: Vec<String> = text.lines().map(String::from).collect();
            if noted.len() >= lines || started.elapsed() > Duration::from_secs(10) {
                return noted;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    #[tokio::test]
    async fn the_shutdown_notice_reaches_each_child_before_sigterm() {
        let dir = scratch("notice");
        let log = dir.join("log");
        let exec = Exec::start(ExecSettings {
            children: 2,
            ..settings(&noting(&log, false), None)
        });
        assert_eq!(exec.handle(delivery("k", "ack")).await, Outcome::Ack);
        exec.notice_shutdown(Duration::from_secs(3));
        // A second notice changes nothing.
        exec.notice_shutdown(Duration::from_secs(60));
        let notices = noted_lines(&log, 2).await;
        assert_eq!(notices.len(), 2, "{notices:?}");
        for notice in &notices {
            let ms: u64 = notice
                .strip_prefix("notice ")
                .and_then(|ms| ms.parse().ok())
                .unwrap_or_else(|| panic!("{notice}"));
            assert!((2000..=3000).contains(&ms), "{notice}");
        }
        // Still served while the consumer drains.
        assert_eq!(exec.handle(delivery("k", "ack")).await, Outcome::Ack);
        exec.stop().await;
        let noted = noted_lines(&log, 4).await;
        assert_eq!(
            noted.iter().map(|l| &l[..6]).collect::<Vec<_>>(),
            ["notice", "notice", "SIGTER", "SIGTER"],
            "{noted:?}"
        );
        assert_eq!(exec.stats.restarts.load(Ordering::Relaxed), 0);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn a_child_that_ends_after_the_notice_is_not_replaced_unless_a_request_comes() {
        let dir = scratch("notice-end");
        let log = dir.join("log");
        let exec = Exec::start(settings(&noting(&log, true), None));
        assert_eq!(exec.handle(delivery("k", "ack")).await, Outcome::Ack);
        exec.notice_shutdown(Duration::from_secs(3));
        let ended = async {
            while exec.stats.up.load(Ordering::Relaxed) > 0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), ended)
            .await
            .expect("the child ended after the notice");
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(
            exec.stats.up.load(Ordering::Relaxed),
            0,
            "not started again"
        );
        assert_eq!(exec.stats.restarts.load(Ordering::Relaxed), 0);
        // A request after all: a new child, told first, ends again with it unanswered; it is
        // then replaced (a loss) and, at the third, the request is answered retry.
        let late = tokio::time::timeout(Duration::from_secs(30), exec.handle(delivery("k", "ack")))
            .await
            .expect("answered");
        assert_eq!(late, Outcome::Retry);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn the_lambda_format_reads_batch_item_failures_and_a_raise_as_lambda_does() {
        // Fails the record whose data is "fail"; raises (answers an error) for "raise".
        let program = r#"python3 -u -c 'import base64,json,sys
for line in sys.stdin:
    r = json.loads(line)
    if "event" not in r:
        continue
    records = r["event"]["Records"]
    data = [base64.b64decode(x["kinesis"]["data"]).decode() for x in records]
    if "raise" in data:
        print(json.dumps({"id": r["id"], "error": {"errorType": "ValueError", "errorMessage": "no"}}))
        continue
    failed = [{"itemIdentifier": x["kinesis"]["sequenceNumber"]} for x, d in zip(records, data) if d == "fail"]
    print(json.dumps({"id": r["id"], "response": {"batchItemFailures": failed}, "took_ms": 1}))'"#;
        let source = EventSource::new("arn:aws:kinesis:us-east-1:000000000000:stream/s", "f");
        let exec = Exec::start(ExecSettings {
            format: Format::Lambda(Arc::new(source)),
            batching: Some(Batching::new(10, Duration::from_millis(10))),
            ..settings(program, None)
        });
        let batch = |data: [&str; 4]| {
            data.iter()
                .enumerate()
                .map(|(i, d)| {
                    let sequence =
                        shardwise::SequenceNumber::parse(&(100 + i).to_string()).unwrap();
                    Delivery::builder(
                        "s",
                        "shardId-000000000000",
                        shardwise::Position::new(sequence, 0),
                    )
                    .partition_key("k")
                    .payload(d.to_string())
                    .build()
                })
                .collect::<Vec<_>>()
        };
        use Outcome::{Ack as A, Retry as R};
        let cases: [([&str; 4], Vec<Outcome>); 4] = [
            (["a", "b", "c", "d"], vec![A, A, A, A]),
            (["a", "fail", "c", "d"], vec![A, R, R, R]),
            (["a", "b", "c", "fail"], vec![A, A, A, R]),
            // Raised: the batch failed as a whole, no outcome (the lane retries each record,
            // or with --bisect-batch-on-error handles the batch again in halves).
            (["a", "raise", "c", "d"], vec![]),
        ];
        for (data, outcomes) in cases {
            assert_eq!(exec.handle_batch(batch(data)).await, outcomes, "{data:?}");
        }
        // One delivery alone is a batch of one.
        assert_eq!(
            exec.handle(batch(["fail", "a", "a", "a"]).remove(0)).await,
            R
        );
        assert_eq!(exec.stats.restarts.load(Ordering::Relaxed), 0);
        exec.stop().await;
    }
}
