//! Handoff metrics in the Prometheus text format (version 0.0.4), served at
//! `GET /metrics`: how many handoffs start and how they end, why they are
//! refused, how fast targets acknowledge, how long tasks stay in each state,
//! how deep chains get, how large handoff messages are and how often the
//! failure ladder steps in; and, read at scrape time, the registry's size,
//! push delivery, and how many writes the ledger's group commit gathers per
//! log sync.
//!
//! Built on `prometheus-client`, the Prometheus project's own Rust client,
//! with its 0.0.4 text encoder. Label cardinality is bounded: agent ids come
//! from the registry, kinds and states are enums, and reason codes outside
//! the known set are counted as `OTHER`.

use crate::handoff::reasons;
use crate::protocol::TaskState;
use crate::protocol::wire::ProtoEnum as _;
use crate::store::HopKind;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets, linear_buckets};
use prometheus_client::registry::Registry;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The `Content-Type` of `GET /metrics`.
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// The `source` label of a handoff a client started (no agent handed off).
pub const CLIENT_SOURCE: &str = "client";

/// The `source` label of a handoff whose payload names, as `from`, no agent
/// registered here: `from` is the caller's word, and each distinct label is
/// a series kept until restart.
pub const UNREGISTERED_SOURCE: &str = "unregistered";

/// The label of a reason code outside the known set.
pub const OTHER_REASON: &str = "OTHER";

/// Every reason code of DESIGN.md §3.4: the bounded set of `reason` labels.
const REASON_CODES: &[&str] = &[
    reasons::SCHEMA_INVALID,
    reasons::HOP_LIMIT_EXCEEDED,
    reasons::HANDOFF_CYCLE,
    reasons::TARGET_NOT_FOUND,
    reasons::NOT_ALLOWED,
    reasons::RETRY,
    reasons::REROUTED,
    reasons::ESCALATED,
    reasons::TARGET_UNAVAILABLE,
    reasons::OUTPUT_SCHEMA_INVALID,
    reasons::DEADLINE_EXCEEDED,
];

/// The reasons of a failure-ladder step.
const LADDER_REASONS: &[&str] = &[
    reasons::RETRY,
    reasons::REROUTED,
    reasons::ESCALATED,
    reasons::TARGET_UNAVAILABLE,
];

/// Bucket bounds of the acknowledgement latency, in seconds: up to twice the
/// default `ackTimeout` (5 s), since a retried handoff acknowledges later.
const ACK_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// Bucket bounds of a state's duration, in seconds: up to beyond the default
/// task timeout (300 s).
const TRANSITION_BUCKETS: &[f64] = &[
    0.005, 0.025, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];

/// Bucket bounds of one request/response with an agent, in seconds.
const ROUND_TRIP_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// `source`, `target`, `kind` of a started handoff.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HandoffLabels {
    source: String,
    target: String,
    kind: &'static str,
}

/// `source`, `target`, `outcome` of a finished handoff.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    source: String,
    target: String,
    outcome: &'static str,
}

/// `reason` of a refusal.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

/// `target` of a per-agent histogram.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TargetLabels {
    target: String,
}

/// `from`, `to` of a task state transition.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TransitionLabels {
    from: &'static str,
    to: &'static str,
}

/// `target`, `reason` of a failure-ladder step.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LadderLabels {
    target: String,
    reason: &'static str,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// A family that is listed (HELP and TYPE) even before its first sample:
/// the registry skips empty families, and a scrape should show every metric
/// Baton has, so dashboards and alerts can be written against a quiet gateway.
#[derive(Debug)]
struct Described<M>(M);

impl<M: EncodeMetric> EncodeMetric for Described<M> {
    fn encode(&self, encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        self.0.encode(encoder)
    }

    fn metric_type(&self) -> MetricType {
        self.0.metric_type()
    }
}

/// Figures of the gateway read at scrape time rather than counted here.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GatewayFigures {
    /// Agents in the directory (built-in and registered).
    pub registered_agents: u64,
    /// Push notifications delivered.
    pub push_delivered: u64,
    /// Push notifications given up.
    pub push_failed: u64,
    /// Push notifications dropped on a full queue.
    pub push_dropped: u64,
    /// Ledger writes made durable since start.
    pub ledger_durable_writes: u64,
    /// Synchronous log appends that made them durable, one per group.
    pub ledger_log_syncs: u64,
    /// Log appends that failed and were tried again.
    pub ledger_log_failed_appends: u64,
    /// Applications to sled and checkpoints that failed and were tried again.
    pub ledger_sled_failed_attempts: u64,
    /// Connections closed unserved past their client's bound.
    pub connections_refused: u64,
}

/// Encodes the latest [`GatewayFigures`] on each scrape.
#[derive(Debug, Default)]
struct FiguresCollector {
    // std Mutex: a copy in and out, never held across .await.
    latest: Mutex<GatewayFigures>,
}

impl Collector for FiguresCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let figures = *self.latest.lock().expect("figures lock");
        let agents = ConstGauge::new(i64::try_from(figures.registered_agents).unwrap_or(i64::MAX));
        agents.encode(encoder.encode_descriptor(
            "baton_registered_agents",
            "Agents the gateway routes to, built-in and registered.",
            None,
            agents.metric_type(),
        )?)?;
        for (name, help, value) in [
            (
                "baton_push_delivered",
                "Push notifications delivered (2xx).",
                figures.push_delivered,
            ),
            (
                "baton_push_failed",
                "Push notifications given up after the last attempt or a final 4xx.",
                figures.push_failed,
            ),
            (
                "baton_push_dropped",
                "Push notifications dropped because a delivery queue was full.",
                figures.push_dropped,
            ),
            (
                "baton_ledger_durable_writes",
                "Ledger writes made durable in the write-ahead log since start.",
                figures.ledger_durable_writes,
            ),
            (
                "baton_ledger_log_syncs",
                "Synchronous appends to the write-ahead log since start, each making a group \
                 of writes durable: writes per sync is the group commit's size.",
                figures.ledger_log_syncs,
            ),
            (
                "baton_ledger_log_failed_appends",
                "Appends to the write-ahead log that failed and were tried again; while they \
                 fail, writes wait, new sends are refused and /readyz answers 503.",
                figures.ledger_log_failed_appends,
            ),
            (
                "baton_ledger_sled_failed_attempts",
                "Applications of ledger writes to sled, and checkpoints of sled, that failed and \
                 were tried again; while they fail, the log keeps the writes, new sends are \
                 refused and /readyz answers 503.",
                figures.ledger_sled_failed_attempts,
            ),
            (
                "baton_connections_refused",
                "Inbound connections closed unserved because their client held \
                 --max-connections-per-address already.",
                figures.connections_refused,
            ),
        ] {
            let counter = ConstCounter::new(value);
            counter.encode(encoder.encode_descriptor(
                name,
                help,
                None,
                counter.metric_type(),
            )?)?;
        }
        Ok(())
    }
}

/// The handoff metrics of one gateway. Cheap to record from any task: each
/// method is a hash lookup and an atomic add.
pub struct HandoffMetrics {
    registry: Registry,
    figures: Arc<FiguresCollector>,
    /// One scrape renders at a time, so each shows the figures it stored.
    rendering: Mutex<()>,
    handoffs: Family<HandoffLabels, Counter>,
    outcomes: Family<OutcomeLabels, Counter>,
    rejections: Family<ReasonLabels, Counter>,
    ack_seconds: HistogramFamily<TargetLabels>,
    transition_seconds: HistogramFamily<TransitionLabels>,
    round_trip_seconds: HistogramFamily<TargetLabels>,
    hop_depth: Histogram,
    message_bytes: HistogramFamily<TargetLabels>,
    ladder_steps: Family<LadderLabels, Counter>,
}

impl std::fmt::Debug for HandoffMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandoffMetrics").finish_non_exhaustive()
    }
}

impl Default for HandoffMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl HandoffMetrics {
    /// Every metric registered, all at zero.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let handoffs = Family::<HandoffLabels, Counter>::default();
        // Counter names are registered without `_total`: the encoder adds it.
        registry.register(
            "baton_handoffs",
            "Handoffs started, by source agent (client when a client started it), target agent and kind (direct, transfer, return, reroute); a plain or routed call is no handoff and is not counted",
            Described(handoffs.clone()),
        );
        let outcomes = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "baton_handoff_outcomes",
            "Handoffs finished, by source, target and outcome (success or failure); success rate: sum by (source, target) (rate(baton_handoff_outcomes_total{outcome=\"success\"}[5m])) / sum by (source, target) (rate(baton_handoff_outcomes_total[5m]))",
            Described(outcomes.clone()),
        );
        let rejections = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "baton_handoff_rejections",
            "Handoffs refused before delivery, by reason code (OTHER for a code outside DESIGN.md 3.4)",
            Described(rejections.clone()),
        );
        let ack_seconds: HistogramFamily<TargetLabels> =
            Family::new_with_constructor(|| Histogram::new(ACK_BUCKETS.iter().copied()));
        registry.register(
            "baton_handoff_ack_seconds",
            "Time from the start of delivery to the target's acknowledgement, by target agent",
            Described(ack_seconds.clone()),
        );
        let transition_seconds: HistogramFamily<TransitionLabels> =
            Family::new_with_constructor(|| Histogram::new(TRANSITION_BUCKETS.iter().copied()));
        registry.register(
            "baton_task_transition_seconds",
            "Time a gateway task spent in state `from` before moving to state `to`",
            Described(transition_seconds.clone()),
        );
        let round_trip_seconds: HistogramFamily<TargetLabels> =
            Family::new_with_constructor(|| Histogram::new(ROUND_TRIP_BUCKETS.iter().copied()));
        registry.register(
            "baton_agent_round_trip_seconds",
            "Duration of one request/response exchange with a handoff's target agent, by target agent",
            Described(round_trip_seconds.clone()),
        );
        let hop_depth = Histogram::new(linear_buckets(1.0, 1.0, 10));
        registry.register(
            "baton_handoff_hop_depth",
            "Hop count of each delivered handoff (hops in the control metadata)",
            hop_depth.clone(),
        );
        let message_bytes: HistogramFamily<TargetLabels> = Family::new_with_constructor(|| {
            // 256 B to 16 MiB by powers of 4.
            Histogram::new(exponential_buckets(256.0, 4.0, 9))
        });
        registry.register(
            "baton_handoff_message_bytes",
            "Size in bytes of the JSON message built for a target under its context policy",
            Described(message_bytes.clone()),
        );
        let ladder_steps = Family::<LadderLabels, Counter>::default();
        registry.register(
            "baton_handoff_ladder_steps",
            "Failure-ladder steps after no acknowledgement, by target and reason (RETRY, REROUTED, ESCALATED, TARGET_UNAVAILABLE)",
            Described(ladder_steps.clone()),
        );
        let figures = Arc::new(FiguresCollector::default());
        registry.register_collector(Box::new(figures.clone()));
        Self {
            registry,
            figures,
            rendering: Mutex::new(()),
            handoffs,
            outcomes,
            rejections,
            ack_seconds,
            transition_seconds,
            round_trip_seconds,
            hop_depth,
            message_bytes,
            ladder_steps,
        }
    }

    /// A handoff began: `baton_handoffs_total{source,target,kind}`. An empty
    /// `source` means a client started it.
    pub fn handoff_started(&self, source: &str, target: &str, kind: HopKind) {
        self.handoffs
            .get_or_create(&HandoffLabels {
                source: source_label(source),
                target: target.to_string(),
                kind: kind_label(kind),
            })
            .inc();
    }

    /// A handoff ended: `baton_handoff_outcomes_total{source,target,outcome}`.
    pub fn handoff_finished(&self, source: &str, target: &str, succeeded: bool) {
        self.outcomes
            .get_or_create(&OutcomeLabels {
                source: source_label(source),
                target: target.to_string(),
                outcome: if succeeded { "success" } else { "failure" },
            })
            .inc();
    }

    /// A handoff was refused: `baton_handoff_rejections_total{reason}`.
    pub fn rejected(&self, reason: &str) {
        self.rejections
            .get_or_create(&ReasonLabels {
                reason: bounded_reason(reason, REASON_CODES),
            })
            .inc();
    }

    /// A target acknowledged `latency` after delivery began:
    /// `baton_handoff_ack_seconds{target}`.
    pub fn acknowledged(&self, target: &str, latency: Duration) {
        self.ack_seconds
            .get_or_create(&target_labels(target))
            .observe(latency.as_secs_f64());
    }

    /// A task left state `from` for `to` after `elapsed` in `from`:
    /// `baton_task_transition_seconds{from,to}`.
    pub fn transition(&self, from: TaskState, to: TaskState, elapsed: Duration) {
        self.transition_seconds
            .get_or_create(&TransitionLabels {
                from: from.proto_name(),
                to: to.proto_name(),
            })
            .observe(elapsed.as_secs_f64());
    }

    /// One request/response with an agent took `elapsed`:
    /// `baton_agent_round_trip_seconds{target}`.
    pub fn round_trip(&self, target: &str, elapsed: Duration) {
        self.round_trip_seconds
            .get_or_create(&target_labels(target))
            .observe(elapsed.as_secs_f64());
    }

    /// A handoff was delivered at hop count `hops`: `baton_handoff_hop_depth`.
    pub fn hop_depth(&self, hops: u32) {
        self.hop_depth.observe(f64::from(hops));
    }

    /// The message built for `target` is `bytes` long:
    /// `baton_handoff_message_bytes{target}`.
    pub fn message_bytes(&self, target: &str, bytes: u64) {
        self.message_bytes
            .get_or_create(&target_labels(target))
            // f64 is exact to 2^53 bytes, far beyond any body limit.
            .observe(bytes as f64);
    }

    /// The failure ladder took a step for `target`:
    /// `baton_handoff_ladder_steps_total{target,reason}`.
    pub fn ladder_step(&self, target: &str, reason: &str) {
        self.ladder_steps
            .get_or_create(&LadderLabels {
                target: target.to_string(),
                reason: bounded_reason(reason, LADDER_REASONS),
            })
            .inc();
    }

    /// Every metric in the Prometheus text format, with `figures` as the
    /// gateway's current figures.
    pub fn render(&self, figures: GatewayFigures) -> String {
        let mut text = String::new();
        // Held across the store and the encoding: two scrapes interleaved
        // could show each other's figures, an older counter reading as a
        // reset.
        let _one_at_a_time = self.rendering.lock().expect("render lock");
        *self.figures.latest.lock().expect("figures lock") = figures;
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::prometheus_text::encode(&mut text, &self.registry);
        text
    }
}

fn source_label(source: &str) -> String {
    if source.is_empty() {
        CLIENT_SOURCE.to_string()
    } else {
        source.to_string()
    }
}

fn target_labels(target: &str) -> TargetLabels {
    TargetLabels {
        target: target.to_string(),
    }
}

/// `reason` when it is in `known`, else [`OTHER_REASON`]: free text never
/// becomes a label value.
fn bounded_reason(reason: &str, known: &[&'static str]) -> &'static str {
    known
        .iter()
        .find(|code| **code == reason)
        .copied()
        .unwrap_or(OTHER_REASON)
}

/// The `kind` label: the kind's name in the ledger (`call`, `direct`, ...).
fn kind_label(kind: HopKind) -> &'static str {
    match kind {
        HopKind::Call => "call",
        HopKind::Routed => "routed",
        HopKind::Direct => "direct",
        HopKind::Transfer => "transfer",
        HopKind::Return => "return",
        HopKind::Reroute => "reroute",
    }
}

/// The value of `series` in a Prometheus text: `series` is a metric's name
/// followed by its labels exactly as rendered (`name{a="1"}`), or the bare
/// name of an unlabelled metric. For readers of `GET /metrics` (the bench,
/// the tests).
pub fn sample_value<'a>(text: &'a str, series: &str) -> Option<&'a str> {
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .map(str::trim)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sample of `name` with exactly `labels`, if any.
    fn sample<'a>(text: &'a str, name: &str, labels: &str) -> Option<&'a str> {
        sample_value(text, &format!("{name}{{{labels}}}"))
    }

    #[test]
    fn a_sample_is_found_by_its_whole_series_only() {
        let text = "# TYPE a_total counter\n\
            a_total_more 9\n\
            a_total 3\n\
            b_total{x=\"1\"} 4\n";
        assert_eq!(sample_value(text, "a_total"), Some("3"));
        assert_eq!(sample_value(text, r#"b_total{x="1"}"#), Some("4"));
        assert_eq!(
            sample_value(text, "b_total"),
            None,
            "labels are part of the series"
        );
        assert_eq!(sample_value(text, "c_total"), None);
    }

    #[test]
    fn every_metric_has_help_and_type_before_any_data() {
        let text = HandoffMetrics::new().render(GatewayFigures::default());
        for (name, kind) in [
            ("baton_handoffs_total", "counter"),
            ("baton_handoff_outcomes_total", "counter"),
            ("baton_handoff_rejections_total", "counter"),
            ("baton_handoff_ack_seconds", "histogram"),
            ("baton_task_transition_seconds", "histogram"),
            ("baton_agent_round_trip_seconds", "histogram"),
            ("baton_handoff_hop_depth", "histogram"),
            ("baton_handoff_message_bytes", "histogram"),
            ("baton_handoff_ladder_steps_total", "counter"),
            ("baton_registered_agents", "gauge"),
            ("baton_push_delivered_total", "counter"),
            ("baton_push_failed_total", "counter"),
            ("baton_push_dropped_total", "counter"),
        ] {
            assert!(
                text.contains(&format!("\n# TYPE {name} {kind}\n")),
                "no TYPE line for {name}:\n{text}"
            );
            assert!(
                text.contains(&format!("# HELP {name} ")),
                "no HELP line for {name}"
            );
        }
        assert!(!text.contains("# EOF"), "0.0.4 text has no EOF marker");
        assert!(text.contains("success rate: "), "{text}");
    }

    #[test]
    fn counters_carry_their_labels() {
        let metrics = HandoffMetrics::new();
        metrics.handoff_started("", "echo", HopKind::Call);
        metrics.handoff_started("triage", "billing", HopKind::Transfer);
        metrics.handoff_started("triage", "billing", HopKind::Transfer);
        metrics.handoff_finished("triage", "billing", true);
        metrics.handoff_finished("", "echo", false);
        metrics.rejected(reasons::HOP_LIMIT_EXCEEDED);
        metrics.rejected("something a caller wrote");
        metrics.ladder_step("billing", reasons::RETRY);
        metrics.ladder_step("billing", reasons::SCHEMA_INVALID);
        let text = metrics.render(GatewayFigures {
            registered_agents: 3,
            push_delivered: 7,
            ledger_durable_writes: 12,
            ledger_log_syncs: 5,
            ledger_log_failed_appends: 2,
            ledger_sled_failed_attempts: 3,
            ..GatewayFigures::default()
        });
        let cases = [
            (
                "baton_handoffs_total",
                r#"source="client",target="echo",kind="call""#,
                "1",
            ),
            (
                "baton_handoffs_total",
                r#"source="triage",target="billing",kind="transfer""#,
                "2",
            ),
            (
                "baton_handoff_outcomes_total",
                r#"source="triage",target="billing",outcome="success""#,
                "1",
            ),
            (
                "baton_handoff_outcomes_total",
                r#"source="client",target="echo",outcome="failure""#,
                "1",
            ),
            (
                "baton_handoff_rejections_total",
                r#"reason="HOP_LIMIT_EXCEEDED""#,
                "1",
            ),
            ("baton_handoff_rejections_total", r#"reason="OTHER""#, "1"),
            (
                "baton_handoff_ladder_steps_total",
                r#"target="billing",reason="RETRY""#,
                "1",
            ),
            (
                "baton_handoff_ladder_steps_total",
                r#"target="billing",reason="OTHER""#,
                "1",
            ),
        ];
        for (name, labels, value) in cases {
            assert_eq!(
                sample(&text, name, labels),
                Some(value),
                "{name}{{{labels}}}\n{text}"
            );
        }
        assert!(text.contains("\nbaton_registered_agents 3\n"), "{text}");
        for line in [
            "baton_push_delivered_total 7",
            "baton_ledger_durable_writes_total 12",
            "baton_ledger_log_syncs_total 5",
            "baton_ledger_log_failed_appends_total 2",
            "baton_ledger_sled_failed_attempts_total 3",
        ] {
            assert!(text.contains(&format!("\n{line}\n")), "{line}\n{text}");
        }
    }

    #[test]
    fn histograms_have_their_buckets() {
        let metrics = HandoffMetrics::new();
        metrics.acknowledged("billing", Duration::from_millis(30));
        metrics.transition(
            TaskState::Submitted,
            TaskState::Working,
            Duration::from_millis(200),
        );
        metrics.round_trip("billing", Duration::from_millis(40));
        metrics.hop_depth(2);
        metrics.hop_depth(11);
        metrics.message_bytes("billing", 1000);
        let text = metrics.render(GatewayFigures::default());
        let cases = [
            (
                "baton_handoff_ack_seconds_bucket",
                r#"target="billing",le="0.025""#,
                "0",
            ),
            (
                "baton_handoff_ack_seconds_bucket",
                r#"target="billing",le="0.05""#,
                "1",
            ),
            (
                "baton_handoff_ack_seconds_count",
                r#"target="billing""#,
                "1",
            ),
            (
                "baton_task_transition_seconds_bucket",
                r#"from="TASK_STATE_SUBMITTED",to="TASK_STATE_WORKING",le="0.5""#,
                "1",
            ),
            (
                "baton_agent_round_trip_seconds_count",
                r#"target="billing""#,
                "1",
            ),
            ("baton_handoff_hop_depth_bucket", r#"le="1""#, "0"),
            ("baton_handoff_hop_depth_bucket", r#"le="2""#, "1"),
            ("baton_handoff_hop_depth_bucket", r#"le="10""#, "1"),
            ("baton_handoff_hop_depth_bucket", r#"le="+Inf""#, "2"),
            (
                "baton_handoff_message_bytes_bucket",
                r#"target="billing",le="1024""#,
                "1",
            ),
            (
                "baton_handoff_message_bytes_bucket",
                r#"target="billing",le="256""#,
                "0",
            ),
        ];
        for (name, labels, value) in cases {
            assert_eq!(
                sample(&text, name, labels),
                Some(value),
                "{name}{{{labels}}}\n{text}"
            );
        }
        assert!(
            text.contains("\nbaton_handoff_hop_depth_count 2\n"),
            "{text}"
        );
    }
}
