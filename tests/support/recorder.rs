//! A metrics recorder for tests (used by the library's tests only; the live helpers are in
//! `mod.rs`).

#![allow(dead_code, unreachable_pub)]

/// A metrics recorder that keeps the last value of every counter and gauge (not histograms), for tests to read
/// (metrics-util's debugging recorder resets them when read). Install it for the test's thread
/// with `metrics::set_default_local_recorder` on a current-thread runtime.
#[derive(Debug)]
pub struct Metrics {
    registry: metrics_util::registry::Registry<metrics::Key, metrics_util::registry::AtomicStorage>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            registry: metrics_util::registry::Registry::atomic(),
        }
    }
}

impl Metrics {
    fn matching(key: &metrics::Key, name: &str, label_value: &str) -> bool {
        key.name() == name && key.labels().any(|l| l.value() == label_value)
    }

    /// The counter `name` with a label whose value is `label_value`.
    pub fn counter(&self, name: &str, label_value: &str) -> Option<u64> {
        self.registry
            .get_counter_handles()
            .into_iter()
            .find(|(key, _)| Self::matching(key, name, label_value))
            .map(|(_, c)| c.load(std::sync::atomic::Ordering::SeqCst))
    }

    /// The gauge `name` with a label whose value is `label_value`.
    pub fn gauge(&self, name: &str, label_value: &str) -> Option<f64> {
        self.registry
            .get_gauge_handles()
            .into_iter()
            .find(|(key, _)| Self::matching(key, name, label_value))
            .map(|(_, g)| f64::from_bits(g.load(std::sync::atomic::Ordering::SeqCst)))
    }
}

impl metrics::Recorder for Metrics {
    fn describe_counter(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_gauge(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_histogram(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }

    fn register_counter(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        self.registry
            .get_or_create_counter(key, |c| metrics::Counter::from_arc(c.clone()))
    }

    fn register_gauge(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        self.registry
            .get_or_create_gauge(key, |g| metrics::Gauge::from_arc(g.clone()))
    }

    /// Histograms are not kept: no test reads one, and a bucket keeps every sample until it is
    /// drained (8 bytes each: 2.9 MB an hour in `logs_day`'s day).
    fn register_histogram(
        &self,
        _: &metrics::Key,
        _: &metrics::Metadata<'_>,
    ) -> metrics::Histogram {
        metrics::Histogram::noop()
    }
}

/// A tracing subscriber that keeps every warning and error as a line of text (`LEVEL field=value
/// ...`, the message first), for tests to read what the consumer said. Install it for the test's
/// thread with `tracing::subscriber::set_default` on a current-thread runtime.
#[derive(Debug, Default, Clone)]
pub struct Logs {
    lines: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    spans: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl Logs {
    /// Every line so far, joined by newlines.
    pub fn text(&self) -> String {
        self.lines.lock().unwrap().join("\n")
    }
}

struct Fields(String);

impl tracing::field::Visit for Fields {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        use std::fmt::Write;
        if field.name() == "message" {
            let _ = write!(self.0, " {value:?}");
        } else {
            let _ = write!(self.0, " {}={value:?}", field.name());
        }
    }

    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        use std::fmt::Write;
        let _ = write!(self.0, " {}={value}", field.name());
    }
}

impl tracing::Subscriber for Logs {
    fn enabled(&self, metadata: &tracing::Metadata<'_>) -> bool {
        *metadata.level() <= tracing::Level::WARN
    }

    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        let n = self
            .spans
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        tracing::span::Id::from_u64(n + 1)
    }

    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}

    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}

    fn event(&self, event: &tracing::Event<'_>) {
        let mut fields = Fields(event.metadata().level().to_string());
        event.record(&mut fields);
        self.lines.lock().unwrap().push(fields.0);
    }

    fn enter(&self, _: &tracing::span::Id) {}

    fn exit(&self, _: &tracing::span::Id) {}
}
