//! `/metrics`, `/healthz` and `/readyz` over HTTP (axum).

use std::net::SocketAddr;
use std::sync::{Arc, RwLock};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use serde_json::{Value, json};

use super::Metrics;
use crate::Running;
use crate::consumer::{Health, HealthLimits, HealthProbe};

/// A section of the health report beside the consumer's own: its name and what it says now.
type Section = (String, Box<dyn Fn() -> Value + Send + Sync>);

/// The HTTP endpoints of one process: `/metrics` (Prometheus text, when [`Metrics`] records for
/// Prometheus), `/healthz` and `/readyz` for the consumer it [watches](Self::watch). Cloning
/// shares it.
#[derive(Clone)]
pub struct Endpoints(Arc<Shared>);

struct Shared {
    metrics: Metrics,
    limits: HealthLimits,
    sections: Vec<Section>,
    /// The consumer, once it runs.
    watched: RwLock<Option<HealthProbe>>,
}

impl Endpoints {
    /// Endpoints for the metrics `metrics` records, with the default [`HealthLimits`], watching
    /// no consumer yet (`/healthz` 200, `/readyz` 503, both saying `starting`).
    pub fn new(metrics: &Metrics) -> Self {
        Self(Arc::new(Shared {
            metrics: metrics.clone(),
            limits: HealthLimits::default(),
            sections: Vec::new(),
            watched: RwLock::new(None),
        }))
    }

    /// When the health endpoints call the consumer unhealthy. Before [`serve`](Self::serve).
    pub fn limits(mut self, limits: HealthLimits) -> Self {
        self.shared_mut().limits = limits;
        self
    }

    /// A section of the health report under `name`, beside the consumer's (the CLI reports its
    /// handler programs so). Before [`serve`](Self::serve).
    pub fn section(
        mut self,
        name: impl Into<String>,
        report: impl Fn() -> Value + Send + Sync + 'static,
    ) -> Self {
        self.shared_mut()
            .sections
            .push((name.into(), Box::new(report)));
        self
    }

    fn shared_mut(&mut self) -> &mut Shared {
        Arc::get_mut(&mut self.0).expect("configured before it is served or cloned")
    }

    /// Reports the health of `running` from now on, also after it is shut down (then `stopping`).
    pub fn watch(&self, running: &Running) {
        *self.0.watched.write().unwrap_or_else(|e| e.into_inner()) = Some(running.health_probe());
    }

    /// Serves the endpoints on `addr` (port 0: any free port) until the process ends, on the
    /// current Tokio runtime; the address it listens on. Binding fails at once.
    pub async fn serve(&self, addr: SocketAddr) -> std::io::Result<SocketAddr> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let local = listener.local_addr()?;
        let app = Router::new()
            .route("/metrics", get(metrics))
            .route("/healthz", get(healthz))
            .route("/readyz", get(readyz))
            .with_state(self.clone());
        tracing::info!(addr = %local, "serving /metrics, /healthz and /readyz");
        tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                tracing::error!(error = %e, "the metrics and health server stopped");
            }
        });
        Ok(local)
    }

    fn health(&self) -> Option<Health> {
        self.0
            .watched
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(HealthProbe::health)
    }

    /// The health as JSON, with what is wrong; `ok` when nothing is.
    fn report(&self, health: &Health, problems: &[String]) -> Value {
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
        let mut report = json!({
            "ok": problems.is_empty(),
            "problems": problems,
            "leases_held": health.leases_held,
            "since_renewal_s": health.since_renewal.map(|d| d.as_secs_f64()),
            "since_beat_s": health.since_beat.as_secs_f64(),
            "stuck_writes": health.stuck_writes,
            "stopping": health.stopping,
            "shards": shards,
        });
        for (name, section) in &self.0.sections {
            report[name.as_str()] = section();
        }
        report
    }
}

impl std::fmt::Debug for Endpoints {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoints")
            .field("limits", &self.0.limits)
            .finish_non_exhaustive()
    }
}

async fn metrics(State(endpoints): State<Endpoints>) -> impl IntoResponse {
    match endpoints.0.metrics.render_prometheus() {
        Some(text) => (
            StatusCode::OK,
            [("content-type", "text/plain; version=0.0.4")],
            text,
        ),
        None => (
            StatusCode::NOT_FOUND,
            [("content-type", "text/plain")],
            "metrics are not recorded for Prometheus here\n".to_string(),
        ),
    }
}

/// 200 while renewals, the lease table and checkpoints keep up; 503 naming what stalled. Also
/// 200 before the consumer has started (it is alive, only not ready).
async fn healthz(State(endpoints): State<Endpoints>) -> impl IntoResponse {
    let Some(health) = endpoints.health() else {
        return (
            StatusCode::OK,
            json!({"ok": true, "starting": true}).to_string(),
        );
    };
    let problems = health.problems(endpoints.0.limits);
    answer(&endpoints, &health, problems)
}

/// 200 once the consumer runs, while healthy and not stopping; 503 otherwise.
async fn readyz(State(endpoints): State<Endpoints>) -> impl IntoResponse {
    let Some(health) = endpoints.health() else {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            json!({"ok": false, "starting": true}).to_string(),
        );
    };
    let mut problems = health.problems(endpoints.0.limits);
    if health.stopping {
        problems.push("stopping".into());
    }
    answer(&endpoints, &health, problems)
}

fn answer(endpoints: &Endpoints, health: &Health, problems: Vec<String>) -> (StatusCode, String) {
    let status = if problems.is_empty() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, endpoints.report(health, &problems).to_string())
}
