//! Prometheus metrics: HTTP requests by route and status, request duration and
//! time to first token histograms, and the engines' own figures (queue depth,
//! busy slots, KV cells, tokens, prefix-cache hits) read at scrape time, and
//! model loads and unloads.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, RwLock};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::state::{Target, TargetState};

type Labels = Vec<(String, String)>;

/// The HTTP-side metrics and the registry they render from.
pub struct ServerMetrics {
    registry: Mutex<Option<Registry>>,
    requests: Family<Labels, Counter>,
    duration: Family<Labels, Histogram>,
    ttft: Family<Labels, Histogram>,
    child_starts: Family<Labels, Counter>,
    model_loads: Family<Labels, Counter>,
    model_unloads: Family<Labels, Counter>,
}

impl std::fmt::Debug for ServerMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerMetrics").finish_non_exhaustive()
    }
}

impl Default for ServerMetrics {
    fn default() -> Self {
        let requests = Family::<Labels, Counter>::default();
        let duration = Family::<Labels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.005, 2.0, 14))
        });
        let ttft = Family::<Labels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.01, 2.0, 12))
        });
        let mut registry = Registry::default();
        registry.register(
            "sipp_http_requests",
            "HTTP requests by route and status",
            requests.clone(),
        );
        registry.register(
            "sipp_http_request_duration_seconds",
            "Time to the response headers (streams: to the first byte), by route",
            duration.clone(),
        );
        registry.register(
            "sipp_time_to_first_token_seconds",
            "Time from submission to the first generated token",
            ttft.clone(),
        );
        let child_starts = Family::<Labels, Counter>::default();
        registry.register(
            "sipp_child_starts",
            "Starts of a supervised target's child process (RPC-backed targets), by model; more than one means restarts",
            child_starts.clone(),
        );
        let model_loads = Family::<Labels, Counter>::default();
        registry.register(
            "sipp_model_loads",
            "Loads of in-process models, by model and result (ok, error)",
            model_loads.clone(),
        );
        let model_unloads = Family::<Labels, Counter>::default();
        registry.register(
            "sipp_model_unloads",
            "Unloads of in-process models, by model and reason (lru: room for another under server.models_max; idle: server.idle_unload_secs; admin: POST /models/unload)",
            model_unloads.clone(),
        );
        Self {
            registry: Mutex::new(Some(registry)),
            requests,
            duration,
            ttft,
            child_starts,
            model_loads,
            model_unloads,
        }
    }
}

impl ServerMetrics {
    /// Counts a start of `model`'s child process.
    pub fn record_child_start(&self, model: &str) {
        self.child_starts
            .get_or_create(&vec![("model".to_string(), model.to_string())])
            .inc();
    }

    /// Counts a load of `model` that succeeded or failed.
    pub fn record_model_load(&self, model: &str, ok: bool) {
        self.model_loads
            .get_or_create(&vec![
                ("model".to_string(), model.to_string()),
                (
                    "result".to_string(),
                    if ok { "ok" } else { "error" }.to_string(),
                ),
            ])
            .inc();
    }

    /// Counts an unload of `model` for `reason` (lru, idle or admin).
    pub fn record_model_unload(&self, model: &str, reason: &str) {
        self.model_unloads
            .get_or_create(&vec![
                ("model".to_string(), model.to_string()),
                ("reason".to_string(), reason.to_string()),
            ])
            .inc();
    }

    /// Adds the engine collector (once, when the state exists).
    pub fn attach_engines(&self, targets: Arc<RwLock<BTreeMap<String, TargetState>>>) {
        if let Ok(mut r) = self.registry.lock() {
            if let Some(reg) = r.as_mut() {
                reg.register_collector(Box::new(EngineCollector { targets }));
            }
        }
    }

    /// Counts a finished HTTP exchange.
    pub fn record_request(&self, route: &str, status: u16, seconds: f64) {
        let labels = vec![
            ("route".to_string(), route.to_string()),
            ("status".to_string(), status.to_string()),
        ];
        self.requests.get_or_create(&labels).inc();
        self.duration
            .get_or_create(&vec![("route".to_string(), route.to_string())])
            .observe(seconds);
    }

    /// Records the time to first token of a finished request (none when it
    /// produced no token).
    pub fn record_ttft(&self, model: &str, stats: &sipp::engine::RequestStats) {
        if stats.generated_tokens > 0 {
            self.ttft
                .get_or_create(&vec![("model".to_string(), model.to_string())])
                .observe(stats.ttft_ms / 1000.0);
        }
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if let Ok(r) = self.registry.lock() {
            if let Some(reg) = r.as_ref() {
                let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, reg);
            }
        }
        out
    }
}

/// Reads every ready engine's metrics at scrape time.
#[derive(Debug)]
struct EngineCollector {
    targets: Arc<RwLock<BTreeMap<String, TargetState>>>,
}

fn family<M: EncodeMetric>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    rows: &[(Labels, M)],
    metric_type: prometheus_client::metrics::MetricType,
) -> Result<(), std::fmt::Error> {
    let mut m = encoder.encode_descriptor(name, help, None, metric_type)?;
    for (labels, v) in rows {
        let fam = m.encode_family(labels)?;
        v.encode(fam)?;
    }
    Ok(())
}

/// A series: its name, its help, and how to read it from an engine snapshot.
type Series = (
    &'static str,
    &'static str,
    fn(&sipp::engine::MetricsSnapshot) -> u64,
);

/// What one scrape reads of a ready local engine (one snapshot for every
/// series, so they agree with each other).
struct EngineRead {
    id: String,
    m: sipp::engine::MetricsSnapshot,
    alive: bool,
    n_ctx: u32,
    placement: sipp::runtime::placement::Placement,
    /// Each LoRA adapter's name and the requests that ran with it.
    lora: Vec<(String, u64)>,
}

/// One gauge family per series, a row per engine labelled `label = id`.
fn gauge_families(
    encoder: &mut DescriptorEncoder,
    engines: &[EngineRead],
    label: &str,
    series: &[Series],
) -> Result<(), std::fmt::Error> {
    for (name, help, f) in series {
        let rows: Vec<(Labels, ConstGauge<i64>)> = engines
            .iter()
            .map(|e| {
                let l = vec![(label.to_string(), e.id.clone())];
                (l, ConstGauge::new(f(&e.m) as i64))
            })
            .collect();
        family(
            encoder,
            name,
            help,
            &rows,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
    }
    Ok(())
}

/// The gauges the Gateway API Inference Extension's endpoint picker reads
/// (its model server protocol), under vLLM's names and `model_name` label so
/// an unmodified picker configuration works: requests waiting for a slot,
/// requests running in a slot, and the fraction of KV cells in use (0..1).
fn inference_extension_gauges(
    encoder: &mut DescriptorEncoder,
    engines: &[EngineRead],
) -> Result<(), std::fmt::Error> {
    gauge_families(
        encoder,
        engines,
        "model_name",
        &[
            (
                "vllm:num_requests_waiting",
                "Requests waiting for a slot (sipp_queue_depth)",
                |m| m.queue_depth,
            ),
            (
                "vllm:num_requests_running",
                "Requests holding a slot (sipp_busy_slots)",
                |m| m.busy_slots,
            ),
        ],
    )?;
    let usage: Vec<(Labels, ConstGauge<f64>)> = engines
        .iter()
        .map(|e| {
            let used = e.m.kv_cells_used as f64 / f64::from(e.n_ctx.max(1));
            let l = vec![("model_name".to_string(), e.id.clone())];
            (l, ConstGauge::new(used.min(1.0)))
        })
        .collect();
    family(
        encoder,
        "vllm:kv_cache_usage_perc",
        "Fraction of KV cache cells in use, 0..1 (sipp_kv_cells_used over the context)",
        &usage,
        prometheus_client::metrics::MetricType::Gauge,
    )
}

/// Where each model runs (`sipp_offloaded_layers{model, backend}`), and
/// every ggml device's memory (`sipp_device_memory_{total,free}_bytes`).
fn placement_gauges(
    encoder: &mut DescriptorEncoder,
    engines: &[EngineRead],
) -> Result<(), std::fmt::Error> {
    use prometheus_client::metrics::MetricType::Gauge as G;
    let layers: Vec<(Labels, ConstGauge<i64>)> = engines
        .iter()
        .map(|e| {
            let l = vec![
                ("model".to_string(), e.id.clone()),
                ("backend".to_string(), e.placement.backend.clone()),
            ];
            (l, ConstGauge::new(i64::from(e.placement.offloaded_layers)))
        })
        .collect();
    family(
        encoder,
        "sipp_offloaded_layers",
        "Layers of the model on GPU devices (CPU: 0)",
        &layers,
        G,
    )?;
    let devices = sipp::runtime::placement::devices();
    let memory =
        |read: fn(&sipp::runtime::placement::Device) -> u64| -> Vec<(Labels, ConstGauge<i64>)> {
            devices
                .iter()
                .map(|d| {
                    let l = vec![
                        ("device".to_string(), d.name.clone()),
                        ("backend".to_string(), d.backend.clone()),
                    ];
                    (l, ConstGauge::new(read(d) as i64))
                })
                .collect()
        };
    family(
        encoder,
        "sipp_device_memory_total_bytes",
        "Memory of each ggml device",
        &memory(|d| d.memory_total),
        G,
    )?;
    family(
        encoder,
        "sipp_device_memory_free_bytes",
        "Free memory of each ggml device at the scrape",
        &memory(|d| d.memory_free),
        G,
    )
}

impl Collector for EngineCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        use prometheus_client::metrics::MetricType::{Counter as C, Gauge as G};
        let snapshots: Vec<EngineRead> = self
            .targets
            .read()
            .map(|t| {
                t.iter()
                    .filter_map(|(id, s)| match s {
                        TargetState::Ready(Target::Local(e)) => Some(EngineRead {
                            id: id.clone(),
                            lora: e
                                .lora_adapters()
                                .into_iter()
                                .map(|a| a.info.name)
                                .zip(e.lora_request_counts())
                                .collect(),
                            m: e.metrics(),
                            alive: e.is_alive(),
                            n_ctx: e.info().n_ctx,
                            placement: e.info().model.placement.clone(),
                        }),
                        _ => None,
                    })
                    .collect()
            })
            .unwrap_or_default();
        inference_extension_gauges(&mut encoder, &snapshots)?;
        let model = |id: &str| vec![("model".to_string(), id.to_string())];
        let gauges: [Series; 5] = [
            ("sipp_queue_depth", "Requests waiting for a slot", |m| {
                m.queue_depth
            }),
            ("sipp_busy_slots", "Slots holding a request", |m| {
                m.busy_slots
            }),
            ("sipp_kv_cells_used", "KV cache cells in use", |m| {
                m.kv_cells_used
            }),
            ("sipp_leased_sequences", "KV sequence leases held", |m| {
                m.leased_sequences
            }),
            (
                "sipp_snapshot_bytes",
                "Bytes of KV prefix snapshots in memory",
                |m| m.snapshot_bytes,
            ),
        ];
        gauge_families(&mut encoder, &snapshots, "model", &gauges)?;
        let up: Vec<(Labels, ConstGauge<i64>)> = snapshots
            .iter()
            .map(|e| (model(&e.id), ConstGauge::new(i64::from(e.alive))))
            .collect();
        family(
            &mut encoder,
            "sipp_engine_up",
            "1 while the engine thread runs",
            &up,
            G,
        )?;
        placement_gauges(&mut encoder, &snapshots)?;
        let counters: [Series; 14] = [
            ("sipp_prompt_tokens", "Prompt tokens admitted", |m| {
                m.prompt_tokens
            }),
            ("sipp_generated_tokens", "Tokens generated", |m| {
                m.generated_tokens
            }),
            (
                "sipp_prefix_cache_hit_tokens",
                "Prompt tokens reused from the KV cache",
                |m| m.prefix_reused_tokens,
            ),
            (
                "sipp_prefix_cache_hits",
                "Admissions that reused a cached prefix",
                |m| m.prefix_hits,
            ),
            ("sipp_snapshot_saves", "KV prefix snapshots saved", |m| {
                m.snapshot_saves
            }),
            (
                "sipp_snapshot_restores",
                "KV prefix snapshots restored",
                |m| m.snapshot_restores,
            ),
            (
                "sipp_kv_idle_parks",
                "Idle KV prefixes parked in the snapshot store while others computed",
                |m| m.idle_parks,
            ),
            ("sipp_engine_steps", "Engine steps that ran a batch", |m| {
                m.steps
            }),
            ("sipp_preemptions", "Slots preempted for KV space", |m| {
                m.preemptions
            }),
            (
                "sipp_draft_tokens",
                "Tokens drafted by speculative decoding and verified",
                |m| m.draft_tokens,
            ),
            (
                "sipp_draft_accepted_tokens",
                "Drafted tokens accepted (each saved a decode step)",
                |m| m.draft_accepted_tokens,
            ),
            (
                "sipp_images",
                "Images computed (encoded, or taken from the projector's cache, and decoded)",
                |m| m.images,
            ),
            (
                "sipp_image_milliseconds",
                "Engine time spent computing images, in milliseconds",
                |m| m.image_ns / 1_000_000,
            ),
            (
                "sipp_idle_invariant_violations",
                "Leaks found when the engine went idle",
                |m| m.invariant_violations,
            ),
        ];
        for (name, help, f) in counters {
            let rows: Vec<(Labels, ConstCounter<u64>)> = snapshots
                .iter()
                .map(|e| (model(&e.id), ConstCounter::new(f(&e.m))))
                .collect();
            family(&mut encoder, name, help, &rows, C)?;
        }
        let mut outcomes: Vec<(Labels, ConstCounter<u64>)> = Vec::new();
        for EngineRead { id, m, .. } in &snapshots {
            for (outcome, v) in [
                ("completed", m.requests_completed),
                ("failed", m.requests_failed),
                ("cancelled", m.requests_cancelled),
            ] {
                let mut l = model(id);
                l.push(("outcome".into(), outcome.into()));
                outcomes.push((l, ConstCounter::new(v)));
            }
        }
        let lora: Vec<(Labels, ConstCounter<u64>)> = snapshots
            .iter()
            .flat_map(|e| {
                e.lora.iter().map(|(name, n)| {
                    let mut l = model(&e.id);
                    l.push(("adapter".into(), name.clone()));
                    (l, ConstCounter::new(*n))
                })
            })
            .collect();
        family(
            &mut encoder,
            "sipp_lora_requests",
            "Requests that ran with each LoRA adapter",
            &lora,
            C,
        )?;
        family(
            &mut encoder,
            "sipp_requests_finished",
            "Requests finished by the engine, by outcome",
            &outcomes,
            C,
        )?;
        let secs: [Series; 2] = [
            (
                "sipp_engine_step_seconds",
                "Time the engine spent in steps that ran a batch",
                |m| m.step_ns,
            ),
            (
                "sipp_engine_batch_seconds",
                "Of that, time inside llama.cpp batches",
                |m| m.batch_ns,
            ),
        ];
        for (name, help, f) in secs {
            let rows: Vec<(Labels, ConstCounter<f64>)> = snapshots
                .iter()
                .map(|e| (model(&e.id), ConstCounter::new(f(&e.m) as f64 / 1e9)))
                .collect();
            family(&mut encoder, name, help, &rows, C)?;
        }
        Ok(())
    }
}
