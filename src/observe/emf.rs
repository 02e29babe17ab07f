//! CloudWatch Embedded Metric Format: a [`metrics`] recorder whose values are written as one JSON
//! document per label set every interval, which CloudWatch Logs turns into metrics without an API
//! call (the CloudWatch agent, Lambda's log shipping and Fluent Bit pass the lines on).
//!
//! The document, per the EMF specification
//! (<https://docs.aws.amazon.com/AmazonCloudWatch/latest/monitoring/CloudWatch_Embedded_Metric_Format_Specification.html>):
//! a root `_aws` member with `Timestamp` (ms since the epoch) and one `CloudWatchMetrics`
//! directive naming the namespace, one dimension set (the settings' dimensions, then the metric's
//! labels) and the metrics with their units; each dimension and metric value is a root member.
//! Limits from the specification: at most 100 metrics per directive (documents are split past
//! it), at most 30 dimensions per set (labels past it are dropped, with a warning), at most 100
//! values per metric. A histogram keeps, per interval, its exact count, sum, least and greatest
//! value and a uniform sample of at most [`RESERVOIR`] values (bounded memory at any rate); with
//! more than 100 values in an interval it is written as 100 order statistics of the sample,
//! evenly spaced from the exact least to the exact greatest (the percentiles), and its count and
//! sum are written beside it as `NAME_count` (Count) and `NAME_sum` (its unit), since a
//! CloudWatch metric's SampleCount then counts the 100 values, not the samples.

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use metrics::{
    Counter, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder, SharedString, Unit,
};
use metrics_util::MetricKindMask;
use metrics_util::registry::{GenerationalStorage, Recency, Registry, Storage};
use serde_json::{Map, Value, json};

/// The EMF limits (see the module docs).
const MAX_METRICS: usize = 100;
const MAX_DIMENSIONS: usize = 30;
const MAX_VALUES: usize = 100;

/// The most values of one histogram a flush interval keeps (8 KB): the sample its order
/// statistics are taken from once more than [`MAX_VALUES`] were recorded.
pub(crate) const RESERVOIR: usize = 1_024;

/// The names KCL publishes, for the metrics that mean the same: alarms and dashboards written
/// for KCL apply unchanged. Every other metric keeps its shardwise name.
pub(crate) const KCL_NAMES: &[(&str, &str)] = &[
    ("shardwise_millis_behind_latest", "MillisBehindLatest"),
    ("shardwise_records_total", "RecordsProcessed"),
    ("shardwise_leases_held", "CurrentLeases"),
    ("shardwise_leases_taken_total", "TakenLeases"),
    ("shardwise_leases_lost_total", "LostLeases"),
];

/// Where and how the Embedded Metric Format documents are written (see [`Metrics`](super::Metrics)).
pub struct Emf {
    pub(crate) namespace: String,
    pub(crate) interval: Duration,
    pub(crate) dimensions: Vec<(String, String)>,
    pub(crate) writer: Box<dyn Write + Send>,
}

impl Emf {
    /// Documents in this CloudWatch namespace, written to stderr every 60 s.
    pub fn new(namespace: impl Into<String>) -> Self {
        Self {
            namespace: namespace.into(),
            interval: Duration::from_secs(60),
            dimensions: Vec::new(),
            writer: Box::new(std::io::stderr()),
        }
    }

    /// A dimension of every metric, before its own labels: `application` for the application's
    /// name is what the CLI sets.
    pub fn dimension(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.dimensions.push((name.into(), value.into()));
        self
    }

    /// How often documents are written (default 60 s, CloudWatch's standard resolution).
    pub fn interval(mut self, interval: Duration) -> Self {
        self.interval = interval;
        self
    }

    /// Where documents go, one per line (default stderr).
    pub fn writer(mut self, writer: impl Write + Send + 'static) -> Self {
        self.writer = Box::new(writer);
        self
    }
}

impl std::fmt::Debug for Emf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Emf")
            .field("namespace", &self.namespace)
            .field("interval", &self.interval)
            .field("dimensions", &self.dimensions)
            .finish_non_exhaustive()
    }
}

/// One histogram's values since the last flush, in bounded memory: the count, sum, least and
/// greatest exactly, and a uniform sample of at most [`RESERVOIR`] of the values (Vitter's
/// algorithm R: the n-th value replaces a random one of the sample with probability
/// `RESERVOIR / n`).
#[derive(Debug, Default)]
pub(crate) struct Reservoir(Mutex<Interval>);

/// What a [`Reservoir`] holds for one interval.
#[derive(Debug, Default, Clone, PartialEq)]
pub(crate) struct Interval {
    pub(crate) count: u64,
    pub(crate) sum: f64,
    pub(crate) min: f64,
    pub(crate) max: f64,
    pub(crate) sample: Vec<f64>,
}

impl Interval {
    fn record(&mut self, value: f64) {
        if self.count == 0 {
            (self.min, self.max) = (value, value);
        } else {
            self.min = self.min.min(value);
            self.max = self.max.max(value);
        }
        self.count += 1;
        self.sum += value;
        if self.sample.len() < RESERVOIR {
            self.sample.push(value);
        } else {
            let at = rand::random_range(0..self.count);
            if let Some(slot) = self.sample.get_mut(at as usize) {
                *slot = value;
            }
        }
    }
}

impl Reservoir {
    /// What was recorded since the last take; the reservoir starts empty again.
    pub(crate) fn take(&self) -> Interval {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

impl HistogramFn for Reservoir {
    fn record(&self, value: f64) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .record(value);
    }
}

/// The recorder's storage: atomic counters and gauges, histograms as [`Reservoir`]s.
#[derive(Debug)]
pub(crate) struct EmfStorage;

impl<K> Storage<K> for EmfStorage {
    type Counter = Arc<AtomicU64>;
    type Gauge = Arc<AtomicU64>;
    type Histogram = Arc<Reservoir>;

    fn counter(&self, _: &K) -> Self::Counter {
        Arc::default()
    }

    fn gauge(&self, _: &K) -> Self::Gauge {
        Arc::default()
    }

    fn histogram(&self, _: &K) -> Self::Histogram {
        Arc::default()
    }
}

/// The recorder's state, shared by the recorder (in the process-wide fan-out) and the flush task.
pub(crate) struct EmfState {
    registry: Registry<Key, GenerationalStorage<EmfStorage>>,
    recency: Recency<Key>,
    namespace: String,
    dimensions: Vec<(String, String)>,
    writer: Mutex<Box<dyn Write + Send>>,
}

/// The recorder half (given to the process-wide fan-out).
pub(crate) struct EmfRecorder(pub(crate) Arc<EmfState>);

impl EmfState {
    pub(crate) fn new(emf: Emf, gauge_idle: Duration) -> Self {
        Self {
            registry: Registry::new(GenerationalStorage::new(EmfStorage)),
            recency: Recency::new(
                quanta::Clock::new(),
                MetricKindMask::GAUGE,
                Some(gauge_idle),
            ),
            namespace: emf.namespace,
            dimensions: emf.dimensions,
            writer: Mutex::new(emf.writer),
        }
    }

    /// Writes this interval's documents: counters' increments since the last flush (none when
    /// nothing changed), gauges' values (a gauge not set for the idle timeout is dropped: a
    /// shard that left this worker stops being reported), histograms' values recorded since.
    pub(crate) fn flush(&self) -> std::io::Result<()> {
        let mut samples = Vec::new();
        for (key, counter) in self.registry.get_counter_handles() {
            let delta = counter.get_inner().swap(0, Ordering::AcqRel);
            if delta > 0 {
                samples.push((key, Value::from(delta)));
            }
        }
        for (key, gauge) in self.registry.get_gauge_handles() {
            if !self
                .recency
                .should_store_gauge(&key, gauge.get_generation(), &self.registry)
            {
                continue;
            }
            let value = f64::from_bits(gauge.get_inner().load(Ordering::Acquire));
            samples.push((key, json_number(value)));
        }
        for (key, histogram) in self.registry.get_histogram_handles() {
            samples.extend(histogram_samples(key, histogram.get_inner().take()));
        }
        let documents = documents(
            &self.namespace,
            &self.dimensions,
            samples,
            epoch_millis(SystemTime::now()),
        );
        if documents.is_empty() {
            return Ok(());
        }
        let mut writer = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        for document in documents {
            // One write per line: on a pipe shared with the log (stderr) a write of up to 4 KB
            // is never interleaved with another writer's.
            let mut line = document.to_string();
            line.push('\n');
            writer.write_all(line.as_bytes())?;
        }
        writer.flush()
    }
}

impl Recorder for EmfRecorder {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        self.0
            .registry
            .get_or_create_counter(key, |c| c.clone().into())
    }

    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        self.0
            .registry
            .get_or_create_gauge(key, |g| g.clone().into())
    }

    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        self.0
            .registry
            .get_or_create_histogram(key, |h| h.clone().into())
    }
}

/// The name a metric is published under: KCL's where one means the same.
pub(crate) fn published_name(name: &str) -> &str {
    KCL_NAMES
        .iter()
        .find(|(ours, _)| *ours == name)
        .map_or(name, |(_, kcl)| kcl)
}

/// The CloudWatch unit of a metric, from its name: `_seconds` seconds, `millis` milliseconds,
/// everything else (totals, counts of leases, events, deliveries) a count. A histogram's
/// `_count` is a count, its `_sum` in the histogram's unit.
pub(crate) fn unit(name: &str) -> &'static str {
    if name.ends_with("_count") {
        return "Count";
    }
    let name = name.strip_suffix("_sum").unwrap_or(name);
    if name.ends_with("_seconds") {
        "Seconds"
    } else if name.contains("millis") {
        "Milliseconds"
    } else {
        "Count"
    }
}

/// A metric's labels, in their order: its dimensions.
type Labels = Vec<(String, String)>;

/// The documents for these samples: one per label set (split past 100 metrics), in a stable
/// order. Pure, for the tests.
pub(crate) fn documents(
    namespace: &str,
    dimensions: &[(String, String)],
    samples: Vec<(Key, Value)>,
    timestamp_ms: u64,
) -> Vec<Value> {
    let mut by_labels: BTreeMap<Labels, BTreeMap<String, (Value, &str)>> = BTreeMap::new();
    for (key, value) in samples {
        let labels: Labels = key
            .labels()
            .map(|l| (l.key().to_string(), l.value().to_string()))
            .collect();
        let name = key.name();
        by_labels
            .entry(labels)
            .or_default()
            .insert(published_name(name).to_string(), (value, unit(name)));
    }
    let mut out = Vec::new();
    for (labels, metrics) in by_labels {
        let mut members = Map::new();
        let mut names = Vec::new();
        for (name, value) in dimensions.iter().chain(&labels) {
            if members.contains_key(name) {
                continue;
            }
            if names.len() == MAX_DIMENSIONS {
                tracing::warn!(dimension = %name, "an EMF dimension set holds at most 30 dimensions: this label is dropped");
                continue;
            }
            names.push(name.clone());
            members.insert(name.clone(), Value::from(value.clone()));
        }
        let metrics: Vec<_> = metrics.into_iter().collect();
        for chunk in metrics.chunks(MAX_METRICS) {
            let mut document = members.clone();
            let mut directives = Vec::new();
            for (name, (value, unit)) in chunk {
                directives.push(json!({"Name": name, "Unit": unit}));
                document.insert(name.clone(), value.clone());
            }
            document.insert(
                "_aws".into(),
                json!({
                    "Timestamp": timestamp_ms,
                    "CloudWatchMetrics": [{
                        "Namespace": namespace,
                        "Dimensions": [names],
                        "Metrics": directives,
                    }],
                }),
            );
            out.push(Value::Object(document));
        }
    }
    out
}

/// What a histogram's interval is written as: nothing when nothing was recorded; every value
/// when at most 100 were; else 100 order statistics of the sample, evenly spaced from the exact
/// least to the exact greatest, with `NAME_count` and `NAME_sum` beside them.
pub(crate) fn histogram_samples(key: Key, interval: Interval) -> Vec<(Key, Value)> {
    if interval.count == 0 {
        return Vec::new();
    }
    if interval.count as usize <= MAX_VALUES {
        let values = interval.sample.into_iter().map(json_number).collect();
        return vec![(key, Value::Array(values))];
    }
    let mut sample = interval.sample;
    sample.sort_by(f64::total_cmp);
    let last = sample.len() - 1;
    let mut values: Vec<f64> = (0..MAX_VALUES)
        .map(|i| sample[i * last / (MAX_VALUES - 1)])
        .collect();
    // The sample may have lost the extremes; they were kept exactly.
    values[0] = interval.min;
    values[MAX_VALUES - 1] = interval.max;
    let companion = |suffix: &str| {
        Key::from_parts(
            format!("{}{suffix}", key.name()),
            key.labels().cloned().collect::<Vec<_>>(),
        )
    };
    vec![
        (companion("_count"), Value::from(interval.count)),
        (companion("_sum"), json_number(interval.sum)),
        (
            key,
            Value::Array(values.into_iter().map(json_number).collect()),
        ),
    ]
}

/// A JSON number; NaN and infinities (which JSON cannot hold) as 0.
fn json_number(value: f64) -> Value {
    serde_json::Number::from_f64(value).map_or(Value::from(0), Value::Number)
}

fn epoch_millis(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(name: &'static str, labels: &[(&'static str, &'static str)]) -> Key {
        let labels: Vec<metrics::Label> = labels
            .iter()
            .map(|(k, v)| metrics::Label::new(*k, *v))
            .collect();
        Key::from_parts(name, labels)
    }

    #[test]
    fn a_document_per_label_set_with_kcl_names_units_and_the_settings_dimensions_first() {
        let samples = vec![
            (
                key(
                    "shardwise_millis_behind_latest",
                    &[("stream", "orders"), ("shard", "shardId-1")],
                ),
                Value::from(1500.0),
            ),
            (
                key(
                    "shardwise_record_age_seconds",
                    &[("stream", "orders"), ("shard", "shardId-1")],
                ),
                Value::from(1.5),
            ),
            (
                key(
                    "shardwise_records_total",
                    &[("stream", "orders"), ("outcome", "ack")],
                ),
                Value::from(42),
            ),
        ];
        let dimensions = vec![("application".to_string(), "billing".to_string())];
        let documents = documents("shardwise", &dimensions, samples, 1_700_000_000_000);
        assert_eq!(documents.len(), 2, "{documents:#?}");
        let records = &documents[0];
        assert_eq!(
            records,
            &json!({
                "application": "billing",
                "stream": "orders",
                "outcome": "ack",
                "RecordsProcessed": 42,
                "_aws": {
                    "Timestamp": 1_700_000_000_000u64,
                    "CloudWatchMetrics": [{
                        "Namespace": "shardwise",
                        "Dimensions": [["application", "stream", "outcome"]],
                        "Metrics": [{"Name": "RecordsProcessed", "Unit": "Count"}],
                    }],
                },
            })
        );
        let shard = &documents[1];
        assert_eq!(shard["MillisBehindLatest"], 1500.0);
        assert_eq!(shard["shardwise_record_age_seconds"], 1.5);
        assert_eq!(
            shard["_aws"]["CloudWatchMetrics"][0]["Dimensions"],
            json!([["application", "stream", "shard"]])
        );
        assert_eq!(
            shard["_aws"]["CloudWatchMetrics"][0]["Metrics"],
            json!([
                {"Name": "MillisBehindLatest", "Unit": "Milliseconds"},
                {"Name": "shardwise_record_age_seconds", "Unit": "Seconds"},
            ])
        );
    }

    /// What `values` recorded into a reservoir are written as, by name.
    fn written(values: impl IntoIterator<Item = f64>) -> BTreeMap<String, Value> {
        let reservoir = Reservoir::default();
        for value in values {
            reservoir.record(value);
        }
        histogram_samples(
            key("shardwise_handler_duration_seconds", &[("stream", "s")]),
            reservoir.take(),
        )
        .into_iter()
        .map(|(k, v)| (k.name().to_string(), v))
        .collect()
    }

    #[test]
    fn up_to_100_values_are_written_as_they_are() {
        let few = written([3.0, 1.0]);
        assert_eq!(
            few,
            BTreeMap::from([(
                "shardwise_handler_duration_seconds".to_string(),
                json!([3.0, 1.0])
            )])
        );
        assert!(written([]).is_empty(), "nothing recorded, nothing written");
    }

    #[test]
    fn more_than_100_values_become_order_statistics_with_their_count_and_sum() {
        // 100,001 values 0..=100,000 in descending order: far past the reservoir.
        let many = written((0..=100_000).rev().map(f64::from));
        assert_eq!(many["shardwise_handler_duration_seconds_count"], 100_001);
        assert_eq!(
            many["shardwise_handler_duration_seconds_sum"],
            5_000_050_000.0
        );
        let values = many["shardwise_handler_duration_seconds"]
            .as_array()
            .unwrap();
        assert_eq!(values.len(), 100);
        assert_eq!(values[0], 0.0, "the least, exactly");
        assert_eq!(values[99], 100_000.0, "the greatest, exactly");
        let values: Vec<f64> = values.iter().map(|v| v.as_f64().unwrap()).collect();
        assert!(values.windows(2).all(|w| w[0] <= w[1]), "in order");
        // A uniform sample of 1,024: the median within 5 % of the range (about 10 standard
        // deviations of its order statistic).
        let median = values[50];
        assert!(
            (median - 50_000.0).abs() < 5_000.0,
            "median {median} of a uniform 0..=100,000"
        );
        assert_eq!(unit("shardwise_handler_duration_seconds_count"), "Count");
        assert_eq!(unit("shardwise_handler_duration_seconds_sum"), "Seconds");
        assert_eq!(unit("shardwise_millis_behind_latest_sum"), "Milliseconds");
    }

    #[test]
    fn a_reservoir_keeps_at_most_its_bound_and_starts_again_after_a_take() {
        let reservoir = Reservoir::default();
        for i in 0..10_000 {
            reservoir.record(f64::from(i));
        }
        let interval = reservoir.take();
        assert_eq!(interval.count, 10_000);
        assert_eq!(interval.sample.len(), RESERVOIR);
        assert_eq!((interval.min, interval.max), (0.0, 9_999.0));
        assert_eq!(reservoir.take(), Interval::default());
    }

    #[test]
    fn more_than_100_metrics_of_one_label_set_are_split_across_documents() {
        let names: Vec<&'static str> = (0..150)
            .map(|i| &*Box::leak(format!("shardwise_m{i:03}_total").into_boxed_str()))
            .collect();
        let samples = names
            .iter()
            .map(|n| (key(n, &[("stream", "s")]), Value::from(1)))
            .collect();
        let documents = documents("ns", &[], samples, 0);
        let counts: Vec<usize> = documents
            .iter()
            .map(|d| {
                d["_aws"]["CloudWatchMetrics"][0]["Metrics"]
                    .as_array()
                    .unwrap()
                    .len()
            })
            .collect();
        assert_eq!(counts, vec![100, 50]);
    }

    #[test]
    fn counters_report_increments_per_interval_and_idle_gauges_leave() {
        let state = Arc::new(EmfState::new(
            Emf::new("ns").writer(std::io::sink()),
            Duration::from_millis(50),
        ));
        let recorder = EmfRecorder(state.clone());
        let meta = Metadata::new("t", metrics::Level::INFO, None);
        let counter = recorder.register_counter(&key("shardwise_records_total", &[]), &meta);
        let gauge = recorder.register_gauge(&key("shardwise_leases_held", &[]), &meta);
        counter.increment(3);
        gauge.set(4.0);
        let written = |state: &EmfState| {
            let mut samples = Vec::new();
            for (key, c) in state.registry.get_counter_handles() {
                samples.push((
                    key.name().to_string(),
                    c.get_inner().load(Ordering::Relaxed),
                ));
            }
            samples
        };
        assert_eq!(
            written(&state),
            vec![("shardwise_records_total".to_string(), 3)]
        );
        state.flush().unwrap();
        assert_eq!(
            written(&state),
            vec![("shardwise_records_total".to_string(), 0)],
            "sent"
        );
        // The gauge was seen at that flush; unchanged past the idle timeout it is dropped.
        std::thread::sleep(Duration::from_millis(80));
        state.flush().unwrap();
        assert!(state.registry.get_gauge_handles().is_empty());
    }
}
