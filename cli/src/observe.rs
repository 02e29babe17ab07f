//! `consume --metrics-addr ADDR`: Prometheus text on `/metrics` (metrics-exporter-prometheus
//! renders it), and `/healthz` and `/readyz` from [`Running::health`](shardwise::Running::health),
//! on one address.
//!
//! Per-shard gauges (`shardwise_in_flight`, `shardwise_millis_behind_latest`,
//! `shardwise_record_age_seconds`) are refreshed every checkpoint interval while this worker holds
//! the shard; a gauge not touched for `--metrics-idle-timeout` (30 s) is removed from the output,
//! so a shard that left the worker stops being reported (the exporter's idle timeout: the metrics
//! facade has no removal). The exporter judges idleness between scrapes: a series goes from the
//! first scrape at least the idle timeout after the scrape that last saw it change.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context;
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use metrics_util::MetricKindMask;
use serde_json::json;
use shardwise::Running;
use shardwise::consumer::{Health, HealthLimits};
use tokio::sync::Mutex;

use crate::exec::ExecStats;

/// Seconds, for the handler-duration histogram.
const DURATION_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// What the endpoints read: the running consumer once it started (taken at shutdown), and the
/// handler children, with `--exec`.
#[derive(Clone)]
pub(crate) struct Observed {
    pub(crate) running: Arc<Mutex<Option<Running>>>,
    pub(crate) exec: Option<Arc<ExecStats>>,
    pub(crate) limits: HealthLimits,
    prometheus: PrometheusHandle,
}

/// Installs the Prometheus recorder (process-wide). Call before the consumer starts, so that
/// every metric from the start is recorded.
pub(crate) fn install(gauge_idle: Duration) -> anyhow::Result<PrometheusHandle> {
    let handle = PrometheusBuilder::new()
        .idle_timeout(MetricKindMask::GAUGE, Some(gauge_idle))
        .set_buckets_for_metric(
            Matcher::Full("shardwise_handler_duration_seconds".into()),
            DURATION_BUCKETS,
        )
        .context("histogram buckets")?
        .install_recorder()
        .context("installing the Prometheus metrics recorder")?;
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        loop {
            tick.tick().await;
            upkeep.run_upkeep();
        }
    });
    Ok(handle)
}

impl Observed {
    pub(crate) fn new(prometheus: PrometheusHandle, exec: Option<Arc<ExecStats>>) -> Self {
        Self {
            running: Arc::default(),
            exec,
            limits: HealthLimits::default(),
            prometheus,
        }
    }

    async fn health(&self) -> Option<Health> {
        self.running.lock().await.as_ref().map(Running::health)
    }
}

/// Serves the endpoints on `addr` until the process ends. Binding fails at once.
pub(crate) async fn serve(addr: SocketAddr, observed: Observed) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on --metrics-addr {addr}"))?;
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(observed);
    tracing::info!(%addr, "serving /metrics, /healthz and /readyz");
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "the metrics server stopped");
        }
    });
    Ok(())
}

async fn metrics(State(observed): State<Observed>) -> impl IntoResponse {
    (
        [("content-type", "text/plain; version=0.0.4")],
        observed.prometheus.render(),
    )
}

/// The health as JSON, with what is wrong; `ok` when nothing is.
fn report(observed: &Observed, health: &Health, problems: &[String]) -> serde_json::Value {
    let exec = observed.exec.as_ref().map(|s| {
        json!({
            "children_up": s.up.load(Ordering::Relaxed),
            "children_restarting": s.restarting.load(Ordering::Relaxed),
            "restarts": s.restarts.load(Ordering::Relaxed),
        })
    });
    let shards: Vec<_> = health
        .shards
        .iter()
        .map(|s| {
            json!({
                "shard": s.shard,
                "since_read_s": s.since_read.map(|d| d.as_secs_f64()),
                "since_checkpoint_s": s.since_checkpoint.map(|d| d.as_secs_f64()),
                "unwritten_for_s": s.unwritten_for.map(|d| d.as_secs_f64()),
                "retrying": s.retrying,
                "oldest_retry": s.oldest_retry.as_ref().map(|r| json!({
                    "event": r.event,
                    "key": r.key,
                    "attempts": r.attempts,
                    "failing_for_s": r.failing_for.as_secs_f64(),
                })),
            })
        })
        .collect();
    json!({
        "ok": problems.is_empty(),
        "problems": problems,
        "leases_held": health.leases_held,
        "since_renewal_s": health.since_renewal.map(|d| d.as_secs_f64()),
        "stuck_writes": health.stuck_writes,
        "stopping": health.stopping,
        "shards": shards,
        "exec": exec,
    })
}

/// 200 while renewals and checkpoints keep up; 503 naming what stalled. Also 200 before the
/// consumer has started (it is alive, only not ready).
async fn healthz(State(observed): State<Observed>) -> impl IntoResponse {
    let Some(health) = observed.health().await else {
        return (
            StatusCode::OK,
            json!({"ok": true, "starting": true}).to_string(),
        );
    };
    let problems = health.problems(observed.limits);
    let status = if problems.is_empty() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, report(&observed, &health, &problems).to_string())
}

/// 200 once the consumer runs, while healthy and not stopping; 503 otherwise.
async fn readyz(State(observed): State<Observed>) -> impl IntoResponse {
    let Some(health) = observed.health().await else {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            json!({"ok": false, "starting": true}).to_string(),
        );
    };
    let mut problems = health.problems(observed.limits);
    if health.stopping {
        problems.push("stopping".into());
    }
    let status = if problems.is_empty() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, report(&observed, &health, &problems).to_string())
}
