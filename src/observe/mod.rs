//! Metrics and health for a running consumer, in a few lines (feature `observability`).
//!
//! The library records its metrics through the [`metrics`] facade: **without a recorder
//! installed they are dropped.** [`Metrics`] installs one for the whole process, with Prometheus
//! text for scraping, CloudWatch Embedded Metric Format lines ([`Emf`]), or both; [`Endpoints`]
//! serves `/metrics`, `/healthz` and `/readyz` over HTTP for any [`Running`](crate::Running) consumer. The
//! `shardwise consume` command is built on the same two (`--metrics-addr`, `--metrics-emf`).
//!
//! ```no_run
//! # async fn f<H: shardwise::Handler>(consumer: shardwise::Consumer<H>) -> Result<(), Box<dyn std::error::Error>> {
//! use shardwise::observe::{Endpoints, Metrics};
//!
//! let metrics = Metrics::builder().prometheus().install()?; // before the consumer runs
//! let endpoints = Endpoints::new(&metrics);
//! endpoints.serve("0.0.0.0:9100".parse()?).await?; // 0.0.0.0: a kubelet's probes reach it
//! let running = consumer.run().await?;
//! endpoints.watch(&running);
//! # Ok(()) }
//! ```
//!
//! Only the recorder, no server: `Metrics::builder().prometheus().install()?` and render
//! [`Metrics::render_prometheus`] yourself, or install any other [`metrics`] recorder (one line,
//! e.g. `metrics_exporter_prometheus::PrometheusBuilder::new().install()`); the library does not
//! care which.
//!
//! `/healthz` answers 200 while renewals, the lease table and checkpoints keep up (and before
//! the consumer starts: alive, not ready), 503 naming what stalled
//! ([`Health::problems`](crate::consumer::Health::problems)); `/readyz` answers 200 once the
//! consumer runs, while healthy and not stopping. Both bodies are the health as JSON.

mod emf;
mod endpoints;

pub use emf::Emf;
pub use endpoints::Endpoints;

use std::sync::Arc;
use std::time::Duration;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use metrics_util::MetricKindMask;
use metrics_util::layers::FanoutBuilder;

/// Seconds, for the handler-duration histogram's Prometheus buckets.
const DURATION_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// The process's metrics recorder, once installed ([`Metrics::builder`]). Cloning shares it.
#[derive(Clone)]
pub struct Metrics {
    prometheus: Option<PrometheusHandle>,
    emf: Option<Arc<emf::EmfState>>,
}

/// What [`Metrics`] records into, chosen before [`install`](Self::install).
#[derive(Debug, Default)]
#[must_use = "nothing is recorded until install()"]
pub struct MetricsBuilder {
    prometheus: bool,
    emf: Option<Emf>,
    gauge_idle: Option<Duration>,
}

/// Installing the recorder failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum InstallError {
    /// Neither Prometheus nor EMF was chosen.
    NothingChosen,
    /// A recorder is installed in this process already (one per process).
    AlreadyInstalled,
    /// [`MetricsBuilder::install`] was called outside a Tokio runtime (it starts the upkeep and
    /// flush tasks).
    NoRuntime,
}

impl std::fmt::Display for InstallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::NothingChosen => "no metrics output chosen: call prometheus() or emf(...)",
            Self::AlreadyInstalled => "a metrics recorder is installed in this process already",
            Self::NoRuntime => "installing the metrics recorder needs a Tokio runtime",
        })
    }
}

impl std::error::Error for InstallError {}

impl Metrics {
    /// Choose the outputs, then [`install`](MetricsBuilder::install).
    pub fn builder() -> MetricsBuilder {
        MetricsBuilder::default()
    }

    /// The Prometheus text exposition of every metric now (`None` without
    /// [`prometheus`](MetricsBuilder::prometheus)).
    pub fn render_prometheus(&self) -> Option<String> {
        self.prometheus.as_ref().map(PrometheusHandle::render)
    }

    /// Writes the EMF documents of what was recorded since the last interval now (the flush task
    /// does so every interval; call it after [`Running::shutdown`](crate::Running::shutdown) so that the last interval is
    /// not lost). Nothing without [`emf`](MetricsBuilder::emf).
    pub fn flush_emf(&self) -> std::io::Result<()> {
        self.emf.as_ref().map_or(Ok(()), |emf| emf.flush())
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics")
            .field("prometheus", &self.prometheus.is_some())
            .field("emf", &self.emf.is_some())
            .finish()
    }
}

impl MetricsBuilder {
    /// Record for Prometheus: [`Endpoints`] serves it on `/metrics`, or
    /// [`Metrics::render_prometheus`] renders it. `shardwise_handler_duration_seconds` is a
    /// histogram with buckets from 1 ms to 30 s.
    pub fn prometheus(mut self) -> Self {
        self.prometheus = true;
        self
    }

    /// Write CloudWatch Embedded Metric Format documents every interval (see [`Emf`]): names KCL
    /// users know where one exists (`MillisBehindLatest`, `RecordsProcessed`, `CurrentLeases`,
    /// `TakenLeases`, `LostLeases`), the others as on `/metrics`; the labels (`stream`, `shard`,
    /// `outcome`, `worker`, ...) as dimensions after [`Emf::dimension`]'s.
    pub fn emf(mut self, emf: Emf) -> Self {
        self.emf = Some(emf);
        self
    }

    /// A gauge not set for this long is no longer reported (default 30 s): a shard's gauges are
    /// set every checkpoint interval while this worker holds it, so a shard that left stops
    /// being reported. Counters and histograms stay.
    pub fn gauge_idle_timeout(mut self, idle: Duration) -> Self {
        self.gauge_idle = Some(idle);
        self
    }

    /// Installs the recorder for the whole process (once per process) and starts its upkeep
    /// (Prometheus) and flush (EMF) tasks on the current Tokio runtime.
    pub fn install(self) -> Result<Metrics, InstallError> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| InstallError::NoRuntime)?;
        let idle = self.gauge_idle.unwrap_or(Duration::from_secs(30));
        let mut fanout = FanoutBuilder::default();
        let prometheus = if self.prometheus {
            let recorder = PrometheusBuilder::new()
                .idle_timeout(MetricKindMask::GAUGE, Some(idle))
                .set_buckets_for_metric(
                    Matcher::Full("shardwise_handler_duration_seconds".into()),
                    DURATION_BUCKETS,
                )
                .expect("the buckets are not empty")
                .build_recorder();
            let handle = recorder.handle();
            fanout = fanout.add_recorder(recorder);
            Some(handle)
        } else {
            None
        };
        let (emf, interval) = match self.emf {
            Some(settings) => {
                let interval = settings.interval;
                let state = Arc::new(emf::EmfState::new(settings, idle));
                fanout = fanout.add_recorder(emf::EmfRecorder(state.clone()));
                (Some(state), interval)
            }
            None => (None, Duration::ZERO),
        };
        if prometheus.is_none() && emf.is_none() {
            return Err(InstallError::NothingChosen);
        }
        metrics::set_global_recorder(fanout.build()).map_err(|_| InstallError::AlreadyInstalled)?;
        if let Some(handle) = prometheus.clone() {
            runtime.spawn(async move {
                let mut tick = tokio::time::interval(Duration::from_secs(5));
                loop {
                    tick.tick().await;
                    handle.run_upkeep();
                }
            });
        }
        if let Some(state) = emf.clone() {
            runtime.spawn(async move {
                let mut tick = tokio::time::interval(interval);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                tick.tick().await;
                loop {
                    tick.tick().await;
                    if let Err(e) = state.flush() {
                        tracing::warn!(error = %e, "writing the EMF metrics failed");
                    }
                }
            });
        }
        Ok(Metrics { prometheus, emf })
    }
}
