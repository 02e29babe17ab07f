//! `consume --metrics-addr ADDR` and `--metrics-emf`: the library's `observe` (feature
//! `observability`) with the CLI's settings. `/metrics` (Prometheus text), `/healthz` and
//! `/readyz` on one address; CloudWatch Embedded Metric Format documents on stderr every
//! `--metrics-emf-interval`, the application (`--app`, or the log group) as their first
//! dimension. With `--exec`, the health report has a section on the handler programs.
//!
//! Per-shard gauges (`shardwise_in_flight`, `shardwise_millis_behind_latest`,
//! `shardwise_record_age_seconds`) are refreshed every checkpoint interval while this worker holds
//! the shard; a gauge not touched for `--metrics-idle-timeout` (30 s) is no longer reported, so a
//! shard that left the worker stops being reported. Prometheus judges idleness between scrapes:
//! a series goes from the first scrape at least the idle timeout after the scrape that last saw
//! it change; EMF at each interval.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context;
use serde_json::json;
use shardwise::observe::{Emf, Endpoints, Metrics};

use crate::exec::ExecStats;

/// What `consume` records metrics into.
#[derive(Debug, Clone)]
pub(crate) struct Outputs {
    pub(crate) prometheus: bool,
    /// The EMF namespace, interval and application dimension, with `--metrics-emf`.
    pub(crate) emf: Option<(String, Duration, String)>,
    pub(crate) gauge_idle: Duration,
}

/// Installs the process's recorder (call before the consumer starts, so that every metric from
/// the start is recorded); `None` when no output was asked for.
pub(crate) fn install(outputs: Outputs) -> anyhow::Result<Option<Metrics>> {
    if !outputs.prometheus && outputs.emf.is_none() {
        return Ok(None);
    }
    let mut builder = Metrics::builder().gauge_idle_timeout(outputs.gauge_idle);
    if outputs.prometheus {
        builder = builder.prometheus();
    }
    if let Some((namespace, interval, application)) = outputs.emf {
        builder = builder.emf(
            Emf::new(namespace)
                .interval(interval)
                .dimension("application", application),
        );
    }
    Ok(Some(
        builder
            .install()
            .context("installing the metrics recorder")?,
    ))
}

/// The endpoints, reporting the handler programs too with `--exec`.
pub(crate) fn endpoints(metrics: &Metrics, exec: Option<Arc<ExecStats>>) -> Endpoints {
    let endpoints = Endpoints::new(metrics);
    match exec {
        Some(stats) => endpoints.section("exec", move || {
            json!({
                "children_up": stats.up.load(Ordering::Relaxed),
                "children_restarting": stats.restarting.load(Ordering::Relaxed),
                "restarts": stats.restarts.load(Ordering::Relaxed),
            })
        }),
        None => endpoints,
    }
}
