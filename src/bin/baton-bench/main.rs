//! `baton-bench`: the benchmark harness of issue 5. It starts everything on
//! 127.0.0.1 by itself (a fast single-threaded upstream agent, Baton as a
//! separate process over a fresh ledger) and measures unary and streaming
//! throughput and latency, Baton's CPU time per request, SSE fan-out, ledger
//! transitions, GetTask/ListTasks at scale, memory and the handoff transfer,
//! each against the issue's budget.
//!
//! `cargo run --release --bin baton-bench -- [--quick] [--json FILE]`

// The same allocator as the `baton` binary: the in-process ledger figures
// measure Baton's code as it runs there.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod baton_process;
mod client;
mod disk;
mod handoff;
mod ledger;
mod load;
mod procfs;
mod reference;
mod report;
mod streaming;
mod upstream;
#[cfg(target_os = "linux")]
mod wakeup;

use baton_process::{BatonOptions, BatonProcess, LogCounters, locate_baton};
use clap::Parser;
use load::{LoadResult, LoadSpec, format_duration, json_rpc, message_params};
use report::{Budget, Figure, Report};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use upstream::{AgentKind, FakeUpstream};

/// Benchmarks Baton against the budgets of issue 5, on loopback only.
#[derive(Debug, Parser)]
#[command(name = "baton-bench")]
struct Args {
    /// Short windows and 100 k instead of 1 M stored tasks (under 3 minutes).
    #[arg(long)]
    quick: bool,
    /// Also write the results as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// The baton binary (default: `baton` beside this executable).
    #[arg(long, value_name = "PATH")]
    baton: Option<PathBuf>,
    /// Run only these sections (default: all).
    #[arg(long, value_enum, value_delimiter = ',')]
    only: Vec<Section>,
    /// Serve as the reference proxy in front of URL (the harness starts
    /// this itself).
    #[arg(long, value_name = "URL", hide = true)]
    reference_proxy: Option<String>,
}

/// The parts of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Section {
    /// Durable ledger transitions, in process.
    Ledger,
    /// Unary, streaming, fan-out, memory in flight and handoff through one Baton.
    Gateway,
    /// GetTask, ListTasks and memory at rest over stored tasks.
    Store,
}

/// Sizes and windows of one run.
struct Settings {
    warmup: Duration,
    window: Duration,
    max_requests: u64,
    concurrencies: [usize; 3],
    cpu_concurrency: usize,
    streaming_concurrency: usize,
    writers: [usize; 3],
    small_store: u64,
    large_store: u64,
    populate_writers: usize,
    subscribers: usize,
    in_flight_tasks: usize,
    handoff_samples: usize,
    long_stream_chunks: usize,
}

impl Settings {
    fn new(quick: bool) -> Self {
        Self {
            warmup: Duration::from_millis(if quick { 500 } else { 2000 }),
            window: Duration::from_secs(if quick { 3 } else { 10 }),
            max_requests: 5_000_000,
            concurrencies: [1, 16, 64],
            cpu_concurrency: 16,
            streaming_concurrency: 16,
            writers: [1, 16, 64],
            small_store: 10_000,
            large_store: if quick { 100_000 } else { 1_000_000 },
            populate_writers: 64,
            subscribers: 1000,
            in_flight_tasks: 1000,
            handoff_samples: if quick { 20 } else { 100 },
            long_stream_chunks: 2000,
        }
    }

    fn load(
        &self,
        addr: std::net::SocketAddr,
        concurrency: usize,
        request: Arc<load::RequestFn>,
    ) -> LoadSpec {
        LoadSpec {
            addr,
            concurrency,
            warmup: self.warmup,
            duration: self.window,
            max_requests: self.max_requests,
            request,
            expect: b"\"result\"",
        }
    }
}

/// Everything a section needs.
struct Bench {
    started: Instant,
    settings: Settings,
    baton_binary: PathBuf,
    scratch: tempfile::TempDir,
    cards_dir: PathBuf,
    upstream: FakeUpstream,
    /// Highest 1-minute load average seen so far.
    peak_load: std::cell::Cell<f64>,
}

impl Bench {
    /// Announces a section on stderr with the time since the start.
    fn section(&self, what: &str) {
        eprintln!("[{:5.1} s] {what}", self.started.elapsed().as_secs_f64());
    }

    fn note_load(&self) {
        self.peak_load
            .set(self.peak_load.get().max(procfs::load_average_1m()));
    }

    async fn start_baton(&self, data_dir: &Path) -> anyhow::Result<BatonProcess> {
        let work_dir = tempfile::tempdir_in(self.scratch.path())?.keep();
        BatonProcess::start(&BatonOptions {
            binary: &self.baton_binary,
            work_dir: &work_dir,
            data_dir,
            cards_dir: &self.cards_dir,
            default_agent: "fast",
        })
        .await
    }
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = Args::parse();
    if let Some(upstream_url) = args.reference_proxy {
        if let Err(err) = reference::serve(upstream_url).await {
            eprintln!("baton-bench reference proxy: {err:#}");
            return std::process::ExitCode::FAILURE;
        }
        return std::process::ExitCode::SUCCESS;
    }
    match run(&args).await {
        Ok(report) => {
            println!("{}", report.table());
            if let Some(path) = &args.json {
                if let Err(err) = report.write_json(path) {
                    eprintln!("baton-bench: writing {}: {err:#}", path.display());
                    return std::process::ExitCode::FAILURE;
                }
                println!("JSON written to {}", path.display());
            }
            std::process::ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("baton-bench: {err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(args: &Args) -> anyhow::Result<Report> {
    let started = Instant::now();
    let machine_at_start = procfs::machine_ticks().ok();
    let machine = procfs::Machine::detect();
    let mode = if args.quick { "quick" } else { "full" };
    eprintln!(
        "baton-bench ({mode}) on {} cores, {}, Linux {}, load average {}{}",
        machine.nproc,
        machine.cpu_model,
        machine.kernel,
        machine.load_average,
        machine.idle_clause(", ")
    );
    // 1 000 subscribers plus the held upstream streams need a few thousand descriptors.
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(limit) if limit < 8192 => eprintln!("warning: only {limit} file descriptors allowed"),
        Ok(_) => {}
        Err(err) => eprintln!("warning: could not raise the file descriptor limit: {err}"),
    }
    let baton_binary = locate_baton(args.baton.as_deref())?;
    let scratch = tempfile::Builder::new().prefix("baton-bench-").tempdir()?;
    let upstream = FakeUpstream::start()?;
    let cards_dir = scratch.path().join("agent-cards");
    write_cards(&cards_dir, upstream.base_url())?;
    let bench = Bench {
        started,
        settings: Settings::new(args.quick),
        baton_binary,
        scratch,
        cards_dir,
        upstream,
        peak_load: std::cell::Cell::new(procfs::load_average_1m()),
    };
    let runs = |section| args.only.is_empty() || args.only.contains(&section);
    let mut figures = Vec::new();
    if runs(Section::Ledger) {
        figures.extend(ledger_figures(&bench).await);
    }
    if runs(Section::Gateway) {
        figures.extend(gateway_figures(&bench).await);
    }
    if runs(Section::Store) {
        figures.extend(store_figures(&bench).await);
    }
    bench.note_load();
    bench.section("done");
    let stolen_share = machine_at_start
        .zip(procfs::machine_ticks().ok())
        .map(|(then, now)| now.stolen_since(&then));
    Ok(Report {
        mode,
        machine,
        peak_load_average: bench.peak_load.get(),
        stolen_share,
        duration_secs: started.elapsed().as_secs_f64(),
        figures,
    })
}

/// The upstream's agents as Baton registers them at start-up.
fn write_cards(dir: &Path, base: &str) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    let cards = [
        ("fast", AgentKind::Fast, false),
        ("fast-stream", AgentKind::Fast, true),
        ("transfer-source", AgentKind::TransferSource, false),
        ("typed-target", AgentKind::TypedTarget, false),
    ];
    for (id, kind, streaming) in cards {
        let card = upstream::agent_card(base, kind, id, streaming);
        std::fs::write(
            dir.join(format!("{id}.json")),
            serde_json::to_vec_pretty(&card)?,
        )?;
    }
    Ok(())
}

fn progress(what: &str, result: &str) {
    eprintln!("  {what}: {result}");
}

/// Durable ledger transitions per second, in process.
async fn ledger_figures(bench: &Bench) -> Vec<Figure> {
    bench.section("ledger transitions (in process)");
    let mut figures = Vec::new();
    for writers in bench.settings.writers {
        let plural = if writers == 1 { "" } else { "s" };
        let name = format!("durable ledger transitions/s, {writers} writer{plural}");
        let budget = (writers == 64).then_some(Budget::Min(50_000.0));
        let dir = bench.scratch.path().join(format!("ledger-{writers}"));
        let measured = ledger::transition_rate(
            &dir,
            writers,
            bench.settings.window,
            bench.settings.max_requests,
        )
        .await;
        let figure = match measured {
            Ok(rate) => {
                progress(&name, &format!("{:.0}", rate.per_second()));
                let figure = Figure::exact(&name, rate.per_second(), 0, "/s");
                match budget {
                    Some(budget) => figure.budget(budget),
                    None => figure,
                }
            }
            Err(err) => Figure::failed(&name, "/s", budget, &err),
        };
        let _ = std::fs::remove_dir_all(&dir);
        figures.push(figure);
        bench.note_load();
    }
    figures
}

/// Unary and streaming load, CPU per request, memory in flight, fan-out
/// and handoff, on one Baton with an empty ledger.
async fn gateway_figures(bench: &Bench) -> Vec<Figure> {
    bench.section("gateway: a thread wake-up's cost, on one core and across two");
    // Measured first, with nothing else of the bench's running.
    let wake = tokio::task::spawn_blocking(wake_figures)
        .await
        .unwrap_or_else(|err| {
            vec![Figure::harness_error(
                "thread wake-up round trip",
                &err.into(),
            )]
        });
    bench.section("gateway: unary, streaming, fan-out, memory, handoff");
    let data_dir = bench.scratch.path().join("gateway-ledger");
    let baton = match bench.start_baton(&data_dir).await {
        Ok(baton) => baton,
        Err(err) => {
            return vec![Figure::harness_error(
                "gateway figures: starting Baton",
                &err,
            )];
        }
    };
    let mut figures = unary_figures(bench, &baton).await;
    figures.extend(wake);
    figures.extend(streaming_figures(bench, &baton).await);
    bench.section("gateway: memory in flight");
    let held = bench.settings.in_flight_tasks;
    let name = format!("Baton RSS per 1 000 in-flight tasks ({held} held WORKING)");
    let memory = streaming::in_flight_memory(baton.addr, &bench.upstream, held, || {
        Ok(baton.memory()?.current_kib)
    })
    .await;
    figures.push(match memory {
        Ok(memory) => {
            let per_thousand_mb = memory.per_thousand_kib() * 1024.0 / 1e6;
            progress(&name, &format!("{per_thousand_mb:.2} MB"));
            Figure::number(&name, round2(per_thousand_mb), "MB").note(format!(
                "VmRSS {:.1} MB before, {:.1} MB with the tasks in flight; allocator reuse makes this approximate",
                memory.before_kib as f64 * 1024.0 / 1e6,
                memory.during_kib as f64 * 1024.0 / 1e6
            ))
        }
        Err(err) => Figure::failed(&name, "MB", None, &err),
    });
    bench.note_load();
    bench.section("gateway: SSE fan-out");
    figures.extend(fan_out_figures(bench, &baton).await);
    bench.section("gateway: handoff");
    figures.push(handoff_figure(bench, &baton).await);
    // Last: the memory the long stream leaves behind, reused, would make
    // the in-flight figure's growth look smaller.
    bench.section("gateway: a long stream");
    figures.push(long_stream_figure(bench, &baton).await);
    baton.stop();
    figures
}

/// Slices a window is cut into where two loads whose figures are compared
/// alternate (unary c=1 direct and through Baton; the small store and the
/// large), each first in every other slice. A VM's speed drifts within
/// minutes: measured one after the other, the ratio of the two stores'
/// ListTasks p99s ranged 0.28–2.81 over five full runs on one VM (README history,
/// round 23), that of their p50s 0.94–1.50.
const ALTERNATED_SLICES: u32 = 4;

/// Which of two alternated loads runs first in slice `round`, and which
/// second.
fn alternation_order(round: u32) -> [usize; 2] {
    if round % 2 == 0 { [0, 1] } else { [1, 0] }
}

/// Runs the two load points in [`ALTERNATED_SLICES`] alternating slices of
/// their windows, and merges each point's slices.
async fn alternated(specs: [&LoadSpec; 2]) -> [LoadResult; 2] {
    let mut results = [LoadResult::empty(), LoadResult::empty()];
    for round in 0..ALTERNATED_SLICES {
        for point in alternation_order(round) {
            let slice = specs[point].slice(round, ALTERNATED_SLICES);
            results[point].absorb(&load::run(&slice, || {}).await);
        }
    }
    results
}

/// A blocking SendMessage; a good answer is a completed task.
fn unary_spec(
    settings: &Settings,
    addr: std::net::SocketAddr,
    concurrency: usize,
    path: &'static str,
) -> LoadSpec {
    let mut spec = settings.load(addr, concurrency, unary_request(path));
    spec.expect = b"TASK_STATE_COMPLETED";
    spec
}

fn unary_request(path: &'static str) -> Arc<load::RequestFn> {
    Arc::new(move |n| {
        (
            path,
            json_rpc(n, "SendMessage", &message_params("bench-", "")),
        )
    })
}

async fn unary_figures(bench: &Bench, baton: &BatonProcess) -> Vec<Figure> {
    let settings = &bench.settings;
    let ticks_per_second = procfs::clock_ticks_per_second() as f64;
    let mut figures = Vec::new();
    let mut pairs: Vec<(usize, LoadResult, LoadResult)> = Vec::new();
    let mut cpu_per_request: Option<anyhow::Result<f64>> = None;
    let mut reference = Vec::new();
    let mut breakdown = Vec::new();
    for concurrency in settings.concurrencies {
        let direct_spec = unary_spec(
            settings,
            bench.upstream.addr,
            concurrency,
            AgentKind::Fast.path(),
        );
        let through_spec = unary_spec(settings, baton.addr, concurrency, "/a2a");
        if concurrency == 1 {
            // The added p99 subtracts one window's tail from another's:
            // measured one after the other, a VM's drift between them
            // would be in the difference.
            let [direct, through] = alternated([&direct_spec, &through_spec]).await;
            progress("unary c=1 direct", &direct.summary());
            progress("unary c=1 through Baton", &through.summary());
            pairs.push((concurrency, direct, through));
            bench.note_load();
            continue;
        }
        let direct = load::run(&direct_spec, || {}).await;
        progress(&format!("unary c={concurrency} direct"), &direct.summary());
        let mut ticks = Vec::new();
        let mut readings = Vec::new();
        let at_cpu_concurrency = concurrency == settings.cpu_concurrency;
        // By thread: requests overlap here, so a thread can bound the
        // throughput (at c=1 the round trip does).
        let through = load::run(&through_spec, || {
            ticks.push(baton.cpu_ticks());
            readings.push(WindowReading::take(baton));
        })
        .await;
        progress(
            &format!("unary c={concurrency} through Baton"),
            &through.summary(),
        );
        breakdown.extend(window_figures(
            &readings,
            &through,
            direct.throughput(),
            concurrency,
            ticks_per_second,
        ));
        if at_cpu_concurrency {
            let baton_cpu = cpu_micros(&ticks, &through, ticks_per_second);
            reference =
                reference_figures(bench, concurrency, &direct, &baton_cpu, ticks_per_second).await;
            cpu_per_request = Some(baton_cpu);
        }
        pairs.push((concurrency, direct, through));
        bench.note_load();
    }
    for (concurrency, direct, through) in &pairs {
        for (side, result) in [("direct", direct), ("through Baton", through)] {
            figures.push(Figure::info(
                format!("unary SendMessage c={concurrency}, {side}"),
                result.throughput().round(),
                "req/s",
                result.summary(),
            ));
        }
    }
    for (concurrency, direct, through) in &pairs {
        let name = format!("unary throughput through Baton / direct, c={concurrency}");
        let ratio = through.throughput() / direct.throughput().max(1e-9);
        let figure = Figure::exact(name, ratio, 3, "");
        figures.push(if *concurrency == 1 {
            figure
        } else {
            figure.budget(Budget::Min(UNARY_RATIO_BUDGET))
        });
    }
    let cpu_name = format!(
        "Baton CPU time per request, c={} (/proc)",
        settings.cpu_concurrency
    );
    figures.push(match cpu_per_request {
        Some(Ok(micros)) => Figure::exact(cpu_name, micros, 1, "µs")
            .budget(Budget::Max(50.0))
            .note(format!(
                "utime+stime at {ticks_per_second} ticks/s over the measured window"
            )),
        Some(Err(err)) => Figure::failed(cpu_name, "µs", Some(Budget::Max(50.0)), &err),
        None => Figure::failed(
            cpu_name,
            "µs",
            Some(Budget::Max(50.0)),
            &anyhow::anyhow!("not run"),
        ),
    });
    if let Some((_, direct, through)) = pairs.iter().find(|(c, _, _)| *c == 1) {
        let added = through.quantile(0.99).as_secs_f64() - direct.quantile(0.99).as_secs_f64();
        figures.push(
            Figure::exact("added p99 latency through Baton, c=1", added * 1e3, 3, "ms")
            .budget(Budget::Max(1.0))
            .note(format!(
                "direct and through Baton alternated in {ALTERNATED_SLICES} slices of the window"
            )),
        );
    }
    figures.extend(breakdown);
    figures.extend(reference);
    figures
}

/// Baton's threads, the bench's own (the load's client and the upstream
/// agent), the machine's idle CPU and Baton's log counters at one edge of a
/// window.
struct WindowReading {
    at: std::time::Instant,
    threads: anyhow::Result<Vec<procfs::ThreadReading>>,
    bench_threads: anyhow::Result<Vec<procfs::ThreadReading>>,
    machine: anyhow::Result<procfs::MachineTicks>,
    log: anyhow::Result<LogCounters>,
}

impl WindowReading {
    fn take(baton: &BatonProcess) -> Self {
        Self {
            at: std::time::Instant::now(),
            threads: procfs::threads(baton.pid),
            bench_threads: procfs::threads(std::process::id()),
            machine: procfs::machine_ticks(),
            log: baton.log_counters(),
        }
    }
}

/// The least unary throughput through Baton, as a share of direct (issue 5).
const UNARY_RATIO_BUDGET: f64 = 0.22;

/// Where Baton's CPU went, thread group by thread group, and what the
/// machine had left, over a measured window: what bounds the throughput.
fn window_figures(
    readings: &[WindowReading],
    result: &LoadResult,
    direct_throughput: f64,
    concurrency: usize,
    ticks_per_second: f64,
) -> Vec<Figure> {
    let idle_name = format!("machine idle during c={concurrency} through Baton (/proc/stat)");
    let stolen_name =
        format!("machine time stolen by the host during c={concurrency} (/proc/stat)");
    let ([before, after], true) = (readings, result.completed > 0) else {
        let by_thread = by_thread_name("Baton", concurrency);
        let why = "no readings of the window, or no request completed in it (so no rows \
                   by thread, nor the bounds they imply)";
        return vec![
            Figure::unavailable(by_thread, "µs", why),
            Figure::unavailable(idle_name, "%", why),
        ];
    };
    let mut figures = Vec::new();
    let rows = ThreadRows {
        concurrency,
        requests: result.completed as f64,
        ticks_per_second,
        window_ns: after.at.duration_since(before.at).as_nanos().max(1) as f64,
    };
    let baton = rows.push(
        &mut figures,
        "Baton",
        &before.threads,
        &after.threads,
        "each of Baton's thread groups (a pool's threads summed; groups under \
         0.1 µs left out): user and system CPU per request, and the time its threads \
         ran and were runnable but waited for a core (schedstat), as % of one core",
    );
    let bench = rows.push(
        &mut figures,
        "bench",
        &before.bench_threads,
        &after.bench_threads,
        "the same for the bench's own threads (its load client and upstream agent), \
         which share the machine with Baton",
    );
    if let (Some(baton), Some(bench)) = (baton, bench) {
        let cores = procfs::cores();
        // Baton runs with its default workers: the bench clears its BATON_*.
        let workers = baton::config::default_workers();
        figures.extend(bound_figures(
            concurrency,
            direct_throughput,
            (cores, workers),
            &baton,
            &bench,
        ));
    }
    match (&before.machine, &after.machine) {
        (Ok(then), Ok(now)) => {
            figures.push(
                Figure::number(idle_name, (now.idle_since(then) * 100.0).round(), "%")
                    .note("idle and I/O wait of all cores over the window: the CPU the load left"),
            );
            figures.push(
                Figure::number(stolen_name, (now.stolen_since(then) * 100.0).round(), "%").note(
                    "steal of all cores over the window: on a VM, time its host gave to other \
                     guests, which the machine's threads did not get",
                ),
            );
        }
        (Err(err), _) | (_, Err(err)) => figures.push(Figure::failed(idle_name, "%", None, err)),
    }
    figures.push(group_commit_figure(concurrency, &before.log, &after.log));
    figures
}

/// Writes per log sync over a window: how much the ledger's group commit
/// gathered, which sets the log flusher's CPU per request.
fn group_commit_figure(
    concurrency: usize,
    before: &anyhow::Result<LogCounters>,
    after: &anyhow::Result<LogCounters>,
) -> Figure {
    let name = format!("ledger writes per log sync, c={concurrency} (/metrics)");
    match (before, after) {
        (Ok(then), Ok(now)) if now.syncs > then.syncs => {
            let writes = now.durable_writes.saturating_sub(then.durable_writes);
            let syncs = now.syncs - then.syncs;
            let per_sync = round2(writes as f64 / syncs as f64);
            Figure::info(
                name,
                per_sync,
                "",
                format!("{per_sync} ({writes} durable writes in {syncs} syncs)"),
            )
            .note(
                "Baton's baton_ledger_durable_writes_total and baton_ledger_log_syncs_total \
                 over the window: the size of a group commit",
            )
        }
        (Ok(_), Ok(_)) => Figure::unavailable(name, "", "no log sync in the window"),
        (Err(err), _) | (_, Err(err)) => Figure::failed(name, "", None, err),
    }
}

/// The row that stands for all of `process`'s rows by thread when they
/// cannot be read.
fn by_thread_name(process: &str, concurrency: usize) -> String {
    format!("{process} CPU time per request by thread, c={concurrency} (/proc)")
}

/// What one process's threads used per request over a window.
#[derive(Debug, PartialEq)]
struct ProcessUse {
    /// All its threads, µs of CPU per request.
    cpu_micros_per_request: f64,
    /// Its tokio runtime's threads (workers, and any blocking thread that
    /// ran in the window), µs of CPU per request.
    runtime_micros_per_request: Option<f64>,
}

/// The two bounds on unary throughput that the by-thread rows imply: what
/// Baton's `workers` runtime workers could serve if never idle nor waiting,
/// and the CPU per request the machine's `cores` leave Baton at the budget's
/// throughput once the bench's own threads (its load client and upstream)
/// are served.
fn bound_figures(
    concurrency: usize,
    direct_throughput: f64,
    (cores, workers): (usize, usize),
    baton: &ProcessUse,
    bench: &ProcessUse,
) -> Vec<Figure> {
    let mut figures = Vec::new();
    if let Some(micros) = baton.runtime_micros_per_request {
        let ceiling = workers as f64 * 1e6 / micros.max(1e-9);
        let ratio = ceiling / direct_throughput.max(1e-9);
        let on = match workers {
            1 => "1 worker".to_string(),
            n => format!("{n} workers"),
        };
        figures.push(
            Figure::info(
                format!(
                    "Baton's ceiling with its runtime workers always on a CPU, c={concurrency}"
                ),
                ceiling.round(),
                "req/s",
                format!(
                    "{ceiling:.0} req/s, {ratio:.2} of direct ({micros:.1} µs per request on \
                     {on})"
                ),
            )
            .note(
                "what the workers' CPU per request allows if they never idle nor wait for a core",
            ),
        );
    }
    let target = UNARY_RATIO_BUDGET * direct_throughput;
    let per_request = cores as f64 * 1e6 / target.max(1e-9);
    let left = per_request - bench.cpu_micros_per_request;
    figures.push(
        Figure::info(
            format!(
                "CPU per request the machine leaves Baton at {UNARY_RATIO_BUDGET} of direct, \
                 c={concurrency}"
            ),
            round2(left),
            "µs",
            format!(
                "{left:.1} µs with every core busy ({per_request:.1} µs per request in all, \
                 {:.1} to the bench's threads); Baton used {:.1}",
                bench.cpu_micros_per_request, baton.cpu_micros_per_request
            ),
        )
        .note("cores over the budget's throughput, less the bench's own CPU per request"),
    );
    figures
}

/// The name tokio gives its runtime's threads, workers and blocking ones
/// alike, unless told otherwise (Baton does not name them).
const RUNTIME_THREAD: &str = "tokio-rt-worker";

/// One window's rows by thread: [`ThreadRows::push`] adds a process's.
struct ThreadRows {
    concurrency: usize,
    /// Requests completed in the window.
    requests: f64,
    ticks_per_second: f64,
    window_ns: f64,
}

impl ThreadRows {
    /// `ticks` of CPU as µs per request.
    fn micros(&self, ticks: u64) -> f64 {
        micros_per_request(ticks, self.ticks_per_second, self.requests)
    }

    /// `ns` as % of one core over the window.
    fn share(&self, ns: u64) -> f64 {
        100.0 * ns as f64 / self.window_ns
    }

    /// A row per thread group of `process` between two readings; the first
    /// carries `note`, which explains them all. Returns what the process
    /// used, unless a reading failed.
    fn push(
        &self,
        figures: &mut Vec<Figure>,
        process: &str,
        before: &anyhow::Result<Vec<procfs::ThreadReading>>,
        after: &anyhow::Result<Vec<procfs::ThreadReading>>,
        note: &'static str,
    ) -> Option<ProcessUse> {
        let concurrency = self.concurrency;
        let (then, now) = match (before, after) {
            (Ok(then), Ok(now)) => (then, now),
            (Err(err), _) | (_, Err(err)) => {
                figures.push(Figure::failed(
                    by_thread_name(process, concurrency),
                    "µs",
                    None,
                    err,
                ));
                return None;
            }
        };
        let mut used_by_all = ProcessUse {
            cpu_micros_per_request: 0.0,
            runtime_micros_per_request: None,
        };
        let mut note = Some(note);
        for group in procfs::thread_groups_between(then, now) {
            let used = &group.used;
            let cpu = self.micros(used.user_ticks + used.system_ticks);
            used_by_all.cpu_micros_per_request += cpu;
            if group.name == RUNTIME_THREAD {
                used_by_all.runtime_micros_per_request = Some(cpu);
            }
            if cpu < 0.1 {
                continue;
            }
            let threads = match group.threads {
                1 => String::new(),
                n => format!(", {n} threads"),
            };
            let figure = Figure::info(
                format!(
                    "{process} CPU time per request, c={concurrency}, thread {}{threads} (/proc)",
                    group.name
                ),
                round2(cpu),
                "µs",
                format!(
                    "{cpu:.1} µs ({:.1} user + {:.1} system); on a CPU {:.0} %, waiting {:.0} %",
                    self.micros(used.user_ticks),
                    self.micros(used.system_ticks),
                    self.share(used.on_cpu_ns),
                    self.share(used.waiting_ns),
                ),
            );
            figures.push(match note.take() {
                Some(note) => figure.note(note),
                None => figure,
            });
        }
        Some(used_by_all)
    }
}

/// `ticks` of CPU time spread over `requests`, in µs each.
fn micros_per_request(ticks: u64, ticks_per_second: f64, requests: f64) -> f64 {
    ticks as f64 * 1e6 / (ticks_per_second * requests)
}

/// CPU time per completed request between two readings of clock ticks.
fn cpu_micros(
    ticks: &[anyhow::Result<u64>],
    result: &LoadResult,
    ticks_per_second: f64,
) -> anyhow::Result<f64> {
    match ticks {
        [Ok(before), Ok(after)] if result.completed > 0 => Ok(micros_per_request(
            after - before,
            ticks_per_second,
            result.completed as f64,
        )),
        _ => Err(anyhow::anyhow!(
            "no CPU reading or no completed request: {ticks:?}"
        )),
    }
}

/// A hand-off between two threads on one core and across two: what a hop of
/// a relayed request costs this machine before any code runs, when the woken
/// thread's core was idle (see `wakeup`).
#[cfg(target_os = "linux")]
fn wake_figures() -> Vec<Figure> {
    let name = |cores: &str| format!("thread wake-up round trip, {cores} (CPU of both threads)");
    let note = format!(
        "a one-byte ping-pong between two pinned threads over a socket pair, {} round trips \
         back to back: both threads' CPU per round trip (schedstat) and the median round trip. \
         A hop of a relayed request that wakes a thread on an idle core pays about this, \
         which sets the figures at c=1 and the tails, not the CPU per request under load",
        wakeup::ROUND_TRIPS
    );
    let Some(cores) = wakeup::two_cores() else {
        let core = rustix::thread::sched_getcpu();
        return vec![
            wake_figure(name("one core"), [core, core], &note),
            Figure::unavailable(
                name("two cores"),
                "µs",
                "this process may run on one core only, or its affinity could not be read",
            ),
        ];
    };
    vec![
        wake_figure(name("one core"), [cores[0], cores[0]], &note),
        wake_figure(name("two cores"), cores, &note),
    ]
}

/// Elsewhere the threads cannot be pinned (nor their CPU read) the same way.
#[cfg(not(target_os = "linux"))]
fn wake_figures() -> Vec<Figure> {
    vec![Figure::unavailable(
        "thread wake-up round trip",
        "µs",
        "measured on Linux only",
    )]
}

#[cfg(target_os = "linux")]
fn wake_figure(name: String, cores: [usize; 2], note: &str) -> Figure {
    match wakeup::measure(cores, wakeup::ROUND_TRIPS) {
        Ok(cost) => {
            let cpu_us = cost.cpu_per_round_trip.as_secs_f64() * 1e6;
            let shown = format!(
                "{cpu_us:.1} µs of CPU, median {} ({} round trips)",
                format_duration(cost.median),
                cost.round_trips
            );
            progress(&name, &shown);
            Figure::info(name, round1(cpu_us), "µs", shown).note(note)
        }
        Err(err) => Figure::failed(name, "µs", None, &err),
    }
}

/// The same unary load through the reference proxy (a stateless axum +
/// reqwest hop): what this machine charges for any proxy, beside Baton.
async fn reference_figures(
    bench: &Bench,
    concurrency: usize,
    direct: &LoadResult,
    baton_cpu: &anyhow::Result<f64>,
    ticks_per_second: f64,
) -> Vec<Figure> {
    let name = format!("reference proxy CPU time per request, c={concurrency} (/proc)");
    let upstream_url = format!("{}{}", bench.upstream.base_url(), AgentKind::Fast.path());
    let proxy = match reference::ReferenceProxy::start(&upstream_url).await {
        Ok(proxy) => proxy,
        Err(err) => return vec![Figure::failed(name, "µs", None, &err)],
    };
    let spec = unary_spec(&bench.settings, proxy.addr, concurrency, "/a2a");
    let mut ticks = Vec::new();
    let through = load::run(&spec, || ticks.push(proxy.cpu_ticks())).await;
    drop(proxy);
    progress(
        &format!("unary c={concurrency} through the reference proxy"),
        &through.summary(),
    );
    let ratio = through.throughput() / direct.throughput().max(1e-9);
    let mut figures = vec![
        Figure::info(
            format!("unary SendMessage c={concurrency}, through the reference proxy"),
            through.throughput().round(),
            "req/s",
            through.summary(),
        ),
        Figure::number(
            format!("reference proxy throughput / direct, c={concurrency}"),
            round2(ratio),
            "",
        )
        .note(format!(
            "a stateless axum + reqwest proxy parsing and re-serializing each body, on {} \
             runtime worker(s), tokio's default, as issue 5 ran it",
            reference::workers()
        )),
    ];
    match cpu_micros(&ticks, &through, ticks_per_second) {
        Ok(proxy_cpu) => {
            figures.push(
                Figure::number(name, proxy_cpu.round(), "µs").note(
                    "issue 5 measured 47 µs for this proxy on its machine: the machine factor",
                ),
            );
            if let Ok(baton_cpu) = baton_cpu {
                figures.push(Figure::number(
                    format!("Baton CPU time per request / the reference proxy's, c={concurrency}"),
                    round2(baton_cpu / proxy_cpu.max(1e-9)),
                    "",
                ));
            }
        }
        Err(err) => figures.push(Figure::failed(name, "µs", None, &err)),
    }
    figures
}

async fn streaming_figures(bench: &Bench, baton: &BatonProcess) -> Vec<Figure> {
    let settings = &bench.settings;
    let concurrency = settings.streaming_concurrency;
    let streaming = |path: &'static str| -> Arc<load::RequestFn> {
        Arc::new(move |n| {
            (
                path,
                json_rpc(n, "SendStreamingMessage", &message_params("bench-", "")),
            )
        })
    };
    let mut figures = Vec::new();
    let targets = [
        ("direct", bench.upstream.addr, AgentKind::Fast.path()),
        ("through Baton", baton.addr, streaming::STREAMING_AGENT_PATH),
    ];
    for (side, addr, path) in targets {
        let mut spec = settings.load(addr, concurrency, streaming(path));
        spec.expect = b"TASK_STATE_COMPLETED";
        let result = load::run(&spec, || {}).await;
        let name = format!("SendStreamingMessage events/s, c={concurrency}, {side}");
        let shown = format!(
            "{:.0} events/s ({:.0} streams/s, {:.1} events each, stream p99 {}){}",
            result.events_per_second(),
            result.throughput(),
            result.events as f64 / result.completed.max(1) as f64,
            format_duration(result.quantile(0.99)),
            if result.errors > 0 {
                format!(", {} errors", result.errors)
            } else {
                String::new()
            }
        );
        progress(&name, &shown);
        figures.push(Figure::info(
            name,
            result.events_per_second().round(),
            "events/s",
            shown,
        ));
    }
    bench.note_load();
    figures
}

/// One task streamed through Baton in many chunks, each its own write:
/// what Baton spends on it, in CPU and in bytes written to disk.
async fn long_stream_figure(bench: &Bench, baton: &BatonProcess) -> Figure {
    let chunks = bench.settings.long_stream_chunks;
    let name = format!("one task streamed in {chunks} chunks of 1 KiB through Baton");
    let measured = async {
        let data_dir = bench.scratch.path();
        let written = procfs::device_written_bytes(data_dir)?;
        let cpu = baton.cpu_ticks()?;
        let started = Instant::now();
        let events = streaming::long_stream(baton.addr, chunks).await?;
        let elapsed = started.elapsed();
        let cpu = baton.cpu_ticks()? - cpu;
        let written = procfs::device_written_bytes(data_dir)? - written;
        anyhow::Ok((events, elapsed, cpu, written))
    };
    match measured.await {
        Ok((events, elapsed, cpu, written)) => {
            let cpu_ms = cpu as f64 * 1e3 / procfs::clock_ticks_per_second() as f64;
            let shown = format!(
                "{cpu_ms:.0} ms of CPU ({:.0} µs per chunk), {:.1} MB written ({:.1} KB per chunk), {events} events in {}",
                cpu_ms * 1e3 / chunks as f64,
                written as f64 / 1e6,
                written as f64 / 1e3 / chunks as f64,
                format_duration(elapsed),
            );
            progress(&name, &shown);
            Figure::info(name, cpu_ms.round(), "ms", shown).note(
                "chunks 1 ms apart at the upstream; bytes written to the ledger's block device, all dirty pages synced before and after",
            )
        }
        Err(err) => Figure::failed(&name, "ms", None, &err),
    }
}

async fn fan_out_figures(bench: &Bench, baton: &BatonProcess) -> Vec<Figure> {
    let subscribers = bench.settings.subscribers;
    let name = format!("SSE fan-out to {subscribers} subscribers, delivery p99");
    let budget = Budget::Max(50.0);
    let figure = match streaming::fan_out(baton.addr, &bench.upstream, subscribers).await {
        Ok(fan_out) => {
            let p = |q: f64| Duration::from_nanos(fan_out.latency.value_at_quantile(q));
            let p99 = p(0.99);
            progress(
                &name,
                &format!(
                    "p50 {}, p99 {}, max {}",
                    format_duration(p(0.5)),
                    format_duration(p99),
                    format_duration(p(1.0))
                ),
            );
            let mut figure = Figure::exact(&name, p99.as_secs_f64() * 1e3, 3, "ms").budget(budget);
            let mut note = format!(
                "from the release at the upstream: upstream → Baton → durable write → fan-out; p50 {}, max {}",
                format_duration(p(0.5)),
                format_duration(p(1.0))
            );
            if fan_out.delivered < subscribers {
                figure.verdict = report::Verdict::Fail;
                note.push_str(&format!(
                    "; only {} of {} subscribers ({} live) got the event",
                    fan_out.delivered, subscribers, fan_out.subscribers
                ));
            }
            figure.note(note)
        }
        Err(err) => Figure::failed(&name, "ms", Some(budget), &err),
    };
    bench.note_load();
    vec![figure]
}

/// The transfer figure: measured when the gateway transfers, else "not available".
async fn handoff_figure(bench: &Bench, baton: &BatonProcess) -> Figure {
    let name = "handoff: two-hop transfer with typed artifact, added latency vs two direct calls";
    match handoff::measure_transfer(
        baton.addr,
        bench.upstream.addr,
        bench.settings.handoff_samples,
    )
    .await
    {
        Ok(handoff::TransferOutcome::Measured {
            samples,
            through,
            direct_pair,
        }) => {
            let added = through.as_secs_f64() - direct_pair.as_secs_f64();
            progress(
                name,
                &format!(
                    "{} added",
                    format_duration(Duration::from_secs_f64(added.max(0.0)))
                ),
            );
            Figure::number(name, round3(added * 1e3), "ms").note(format!(
                "median of {samples}: through Baton {}, direct pair {}",
                format_duration(through),
                format_duration(direct_pair)
            ))
        }
        Ok(handoff::TransferOutcome::NotAvailable(why)) => {
            progress(name, "not available");
            Figure::unavailable(name, "ms", why)
        }
        Err(err) => Figure::failed(name, "ms", None, &err),
    }
}

/// GetTask and ListTasks at a small and a large store, and Baton's memory
/// at rest holding the large one. The ledger directory is removed at the
/// end, whatever happened: it can take gigabytes.
async fn store_figures(bench: &Bench) -> Vec<Figure> {
    let data_dir = bench.scratch.path().join("store-ledger");
    let mut figures = Vec::new();
    let outcome = store_run(bench, &data_dir, &mut figures).await;
    let _ = std::fs::remove_dir_all(&data_dir);
    if let Err(err) = outcome {
        // Every figure the run makes, so that none goes missing from the report.
        for expected in StoreFigures::new(&bench.settings).all() {
            if !figures.iter().any(|f: &Figure| f.figure == expected.name) {
                figures.push(Figure::failed(
                    expected.name,
                    expected.unit,
                    expected.budget,
                    &err,
                ));
            }
        }
    }
    figures
}

/// `10 k`, `1 M`.
fn task_count(n: u64) -> String {
    if n >= 1_000_000 {
        format!("{} M", n / 1_000_000)
    } else {
        format!("{} k", n / 1000)
    }
}

/// A figure of the store section, named once for both the run and its
/// failure.
struct StoreFigure {
    name: String,
    unit: &'static str,
    budget: Option<Budget>,
}

impl StoreFigure {
    fn new(name: String, unit: &'static str, budget: Option<Budget>) -> Self {
        Self { name, unit, budget }
    }

    /// The figure as measured, shown to `decimals` places, judged (unrounded)
    /// against its budget if it has one.
    fn measured(self, value: f64, decimals: usize) -> Figure {
        let figure = Figure::exact(self.name, value, decimals, self.unit);
        match self.budget {
            Some(budget) => figure.budget(budget),
            None => figure,
        }
    }
}

/// The store section's figures, in report order.
struct StoreFigures {
    get_small: StoreFigure,
    list_small: StoreFigure,
    on_disk: StoreFigure,
    get_large: StoreFigure,
    front_door_large: StoreFigure,
    list_large: StoreFigure,
    list_ratio: StoreFigure,
    peak_rss: StoreFigure,
}

impl StoreFigures {
    fn new(settings: &Settings) -> Self {
        let small = task_count(settings.small_store);
        let large = task_count(settings.large_store);
        Self {
            get_small: StoreFigure::new(format!("GetTask p99 at {small} tasks"), "ms", None),
            list_small: StoreFigure::new(
                format!("ListTasks first page p99 at {small} tasks"),
                "ms",
                None,
            ),
            on_disk: StoreFigure::new(format!("ledger size on disk at {large} tasks"), "GB", None),
            get_large: StoreFigure::new(
                format!("GetTask p99 at {large} tasks"),
                "ms",
                Some(Budget::Max(1.0)),
            ),
            front_door_large: StoreFigure::new(
                format!("an unknown method's p99 beside GetTask at {large} tasks"),
                "ms",
                None,
            ),
            list_large: StoreFigure::new(
                format!("ListTasks first page p99 at {large} tasks"),
                "ms",
                None,
            ),
            list_ratio: StoreFigure::new(
                format!("ListTasks first page p99 at {large} / at {small}"),
                "",
                Some(Budget::Max(1.5)),
            ),
            peak_rss: StoreFigure::new(
                format!("Baton peak RSS (VmHWM) at rest with {large} tasks"),
                "MB",
                Some(Budget::Max(150.0)),
            ),
        }
    }

    fn all(self) -> [StoreFigure; 8] {
        [
            self.get_small,
            self.list_small,
            self.on_disk,
            self.get_large,
            self.front_door_large,
            self.list_large,
            self.list_ratio,
            self.peak_rss,
        ]
    }
}

async fn store_run(
    bench: &Bench,
    data_dir: &Path,
    figures: &mut Vec<Figure>,
) -> anyhow::Result<()> {
    let (small, large) = (bench.settings.small_store, bench.settings.large_store);
    let (small_name, large_name) = (task_count(small), task_count(large));
    let scale_note =
        (large < 1_000_000).then(|| format!("--quick: {large_name} stored tasks instead of 1 M"));
    let with_scale_note = |figure: Figure| match &scale_note {
        Some(note) => {
            let joined = figure
                .note
                .as_ref()
                .map_or_else(|| note.clone(), |n| format!("{note}; {n}"));
            figure.note(joined)
        }
        None => figure,
    };
    let ms = |d: Duration| d.as_secs_f64() * 1e3;

    bench.section(&format!("store: {small_name} tasks"));
    let small_dir = data_dir.join("small");
    let small_sample = populate(bench, &small_dir, small).await?;
    let bytes_per_task = disk::allocated_bytes(&small_dir) / small.max(1);

    bench.section(&format!("store: {large_name} tasks"));
    // sled takes several kB per task; refuse rather than fill a shared disk.
    let needed = bytes_per_task * large * 3 / 2 + (1 << 30);
    if let Some(available) = disk::available_bytes(data_dir) {
        anyhow::ensure!(
            available >= needed,
            "storing {large_name} tasks needs about {} free where TMPDIR points ({bytes_per_task} B per task seen at {small_name}), {} available",
            disk::format_bytes(needed),
            disk::format_bytes(available)
        );
    }
    let large_dir = data_dir.join("large");
    let large_sample = populate(bench, &large_dir, large).await?;
    let on_disk = disk::allocated_bytes(&large_dir);

    bench.section(&format!(
        "store: queries at {small_name} and at {large_name} tasks, alternated"
    ));
    let ([small_queries, large_queries], front_door_p99) = query_figures(
        bench,
        [
            StoreUnderTest {
                label: "small",
                data_dir: &small_dir,
                sample: &small_sample,
                times_front_door: false,
            },
            StoreUnderTest {
                label: "large",
                data_dir: &large_dir,
                sample: &large_sample,
                times_front_door: true,
            },
        ],
    )
    .await?;
    let alternated = format!(
        "the {small_name} and {large_name} stores served at once, their queries alternated in {ALTERNATED_SLICES} slices"
    );
    let named = StoreFigures::new(&bench.settings);
    figures.push(named.get_small.measured(ms(small_queries.get_p99), 3));
    figures.push(named.list_small.measured(ms(small_queries.list_p99), 3));
    figures.push(with_scale_note(
        named.on_disk.measured(on_disk as f64 / 1e9, 2),
    ));
    figures.push(with_scale_note(
        named
            .get_large
            .measured(ms(large_queries.get_p99), 3)
            .note(alternated.clone()),
    ));
    figures.push(with_scale_note(
        named.front_door_large.measured(ms(front_door_p99), 3).note(
            "the same Baton, in the same slices: a JSON-RPC call answered -32601 at the \
                 front door, with no ledger read; the floor of GetTask's p99 on this machine"
                .to_string(),
        ),
    ));
    figures.push(with_scale_note(
        named.list_large.measured(ms(large_queries.list_p99), 3),
    ));
    let list_ratio =
        large_queries.list_p99.as_secs_f64() / small_queries.list_p99.as_secs_f64().max(1e-9);
    figures.push(with_scale_note(
        named.list_ratio.measured(list_ratio, 2).note(alternated),
    ));
    let mb = |kib: u64| kib as f64 * 1024.0 / 1e6;
    figures.push(with_scale_note(
        named
            .peak_rss
            .measured(mb(large_queries.rest.peak_kib), 2)
            .note(format!(
                "VmRSS at rest {:.1} MB; after the queries VmRSS {:.1} MB, VmHWM {:.1} MB (MB = 10^6 bytes)",
                mb(large_queries.rest.current_kib),
                mb(large_queries.after.current_kib),
                mb(large_queries.after.peak_kib)
            )),
    ));
    Ok(())
}

async fn populate(bench: &Bench, dir: &Path, count: u64) -> anyhow::Result<Vec<String>> {
    let started = Instant::now();
    let sample = ledger::populate(dir, count, bench.settings.populate_writers).await?;
    eprintln!(
        "  stored {count} tasks in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    bench.note_load();
    Ok(sample)
}

struct QueryFigures {
    get_p99: Duration,
    list_p99: Duration,
    rest: procfs::Memory,
    after: procfs::Memory,
}

/// One populated ledger to query.
struct StoreUnderTest<'a> {
    /// `small` or `large`, for progress lines and errors.
    label: &'static str,
    data_dir: &'a Path,
    /// Ids of stored tasks, for GetTask.
    sample: &'a [String],
    /// Whether an unknown method's calls are timed in its slices too.
    times_front_door: bool,
}

/// Starts Baton on each populated ledger and reads its memory at rest, then
/// times GetTask (random stored tasks) and ListTasks (first page) at c=1,
/// alternating between the stores slice by slice. Each store's first slice
/// has the whole warm-up (a fresh process); later ones a share of it, to
/// warm what the other store's slice left cold.
///
/// In the large store's slices, after its queries, it times a call of an
/// unknown method too: the front door's answer with no ledger read, the
/// floor under GetTask's p99. Returns the stores' figures and that p99.
async fn query_figures(
    bench: &Bench,
    stores: [StoreUnderTest<'_>; 2],
) -> anyhow::Result<([QueryFigures; 2], Duration)> {
    for store in &stores {
        anyhow::ensure!(
            !store.sample.is_empty(),
            "no stored task to query in the {} store",
            store.label
        );
    }
    let batons = [
        bench.start_baton(stores[0].data_dir).await?,
        bench.start_baton(stores[1].data_dir).await?,
    ];
    tokio::time::sleep(Duration::from_secs(1)).await;
    let rest = [batons[0].memory()?, batons[1].memory()?];
    let list: Arc<load::RequestFn> = Arc::new(|n| ("/a2a", json_rpc(n, "ListTasks", "{}")));
    let unknown: Arc<load::RequestFn> =
        Arc::new(|n| ("/a2a", json_rpc(n, "BenchNoSuchMethod", "{}")));
    let samples = stores
        .each_ref()
        .map(|store| Arc::new(store.sample.to_vec()));
    let mut gets = [LoadResult::empty(), LoadResult::empty()];
    let mut lists = [LoadResult::empty(), LoadResult::empty()];
    let mut front_door = LoadResult::empty();
    for round in 0..ALTERNATED_SLICES {
        let slice = |addr, request| {
            bench
                .settings
                .load(addr, 1, request)
                .slice(round, ALTERNATED_SLICES)
        };
        for store in alternation_order(round) {
            let addr = batons[store].addr;
            // Each slice reads other tasks than the last: a repeat would find
            // them in the caches.
            let first_request = u64::from(round) << 32;
            let get = load::run(
                &slice(addr, get_task(samples[store].clone(), first_request)),
                || {},
            )
            .await;
            gets[store].absorb(&get);
            let listed = load::run(&slice(addr, list.clone()), || {}).await;
            lists[store].absorb(&listed);
            if stores[store].times_front_door {
                let mut spec = slice(addr, unknown.clone());
                spec.expect = b"-32601";
                front_door.absorb(&load::run(&spec, || {}).await);
            }
        }
        bench.note_load();
    }
    let after = [batons[0].memory()?, batons[1].memory()?];
    for baton in batons {
        baton.stop();
    }
    progress("unknown method c=1", &front_door.summary());
    anyhow::ensure!(
        front_door.completed > 0,
        "an unknown method: no -32601 answer ({} errors)",
        front_door.errors
    );
    for (store, under_test) in stores.iter().enumerate() {
        let label = under_test.label;
        let (get, list) = (&gets[store], &lists[store]);
        progress(&format!("GetTask c=1, {label} store"), &get.summary());
        progress(&format!("ListTasks c=1, {label} store"), &list.summary());
        for (what, result) in [("GetTask", get), ("ListTasks", list)] {
            anyhow::ensure!(
                result.completed > 0,
                "{what} at the {label} store: no good answer ({} errors)",
                result.errors
            );
        }
    }
    let per_store = std::array::from_fn(|store| QueryFigures {
        get_p99: gets[store].quantile(0.99),
        list_p99: lists[store].quantile(0.99),
        rest: rest[store],
        after: after[store],
    });
    Ok((per_store, front_door.quantile(0.99)))
}

/// GetTask of tasks in `ids`, spread over them; `first_request` moves
/// where the sequence of tasks read starts.
fn get_task(ids: Arc<Vec<String>>, first_request: u64) -> Arc<load::RequestFn> {
    Arc::new(move |n| {
        // A multiplicative hash spreads consecutive requests over the sample.
        let spread = (first_request + n).wrapping_mul(2_654_435_761);
        let id = &ids[(spread % ids.len() as u64) as usize];
        (
            "/a2a",
            json_rpc(n, "GetTask", &format!(r#"{{"id":"{id}"}}"#)),
        )
    })
}

fn round1(value: f64) -> f64 {
    (value * 10.0).round() / 10.0
}

fn round2(value: f64) -> f64 {
    (value * 100.0).round() / 100.0
}

fn round3(value: f64) -> f64 {
    (value * 1000.0).round() / 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use procfs::{ThreadReading, ThreadTimes};

    fn thread(tid: u32, name: &str, user_ticks: u64, on_cpu_ns: u64) -> ThreadReading {
        ThreadReading {
            tid,
            name: name.into(),
            times: ThreadTimes {
                user_ticks,
                system_ticks: 0,
                on_cpu_ns,
                waiting_ns: 0,
            },
        }
    }

    #[test]
    fn a_slice_keeps_the_whole_warm_up_only_first_and_a_share_of_the_window() {
        let settings = Settings::new(false);
        let addr = "127.0.0.1:1".parse().unwrap();
        let spec = settings.load(addr, 1, unary_request("/a2a"));
        let first = spec.slice(0, 4);
        let later = spec.slice(3, 4);
        assert_eq!(first.warmup, settings.warmup);
        assert_eq!(later.warmup, settings.warmup / 4);
        for slice in [&first, &later] {
            assert_eq!(slice.duration, settings.window / 4);
            assert_eq!(slice.max_requests, settings.max_requests / 4);
            assert_eq!((slice.addr, slice.concurrency), (addr, 1));
        }
    }

    #[test]
    fn rows_by_thread_give_cpu_per_request_and_shares_of_the_window() {
        // 100 ticks/s over 1 000 requests in a 1 s window: a tick is 10 µs
        // per request, and 0.5 s on a CPU is 50 %.
        let rows = ThreadRows {
            concurrency: 64,
            requests: 1_000.0,
            ticks_per_second: 100.0,
            window_ns: 1e9,
        };
        let before = Ok(vec![
            thread(1, RUNTIME_THREAD, 10, 0),
            thread(2, "idle", 5, 0),
        ]);
        let after = Ok(vec![
            thread(1, RUNTIME_THREAD, 13, 500_000_000),
            thread(2, "idle", 5, 0),
            thread(3, "flusher", 1, 0),
        ]);
        let mut figures = Vec::new();
        let used = rows.push(&mut figures, "Baton", &before, &after, "the note");
        assert_eq!(
            used,
            Some(ProcessUse {
                cpu_micros_per_request: 40.0,
                runtime_micros_per_request: Some(30.0),
            })
        );
        // The idle thread used nothing in the window: no row for it.
        assert_eq!(figures.len(), 2);
        let row = &figures[0];
        assert_eq!(
            row.figure,
            format!("Baton CPU time per request, c=64, thread {RUNTIME_THREAD} (/proc)")
        );
        assert_eq!(row.value, Some(30.0));
        assert!(row.measured.contains("on a CPU 50 %"), "{}", row.measured);
        assert_eq!(row.note.as_deref(), Some("the note"));
        assert_eq!(figures[1].note, None);

        let failed = Err(anyhow::anyhow!("gone"));
        let mut figures = Vec::new();
        let used = rows.push(&mut figures, "bench", &before, &failed, "the note");
        assert_eq!(used, None);
        assert_eq!(figures.len(), 1);
        assert_eq!(figures[0].figure, by_thread_name("bench", 64));
        assert_eq!(figures[0].value, None);
    }

    #[test]
    fn group_commit_is_writes_over_syncs_in_the_window() {
        let counters = |durable_writes, syncs| {
            Ok(LogCounters {
                durable_writes,
                syncs,
            })
        };
        let figure = group_commit_figure(16, &counters(100, 40), &counters(190, 70));
        assert_eq!(figure.figure, "ledger writes per log sync, c=16 (/metrics)");
        assert_eq!(figure.value, Some(3.0));
        assert_eq!(figure.measured, "3 (90 durable writes in 30 syncs)");
        let idle = group_commit_figure(16, &counters(100, 40), &counters(100, 40));
        assert_eq!(idle.value, None);
        let unread = group_commit_figure(16, &Err(anyhow::anyhow!("refused")), &counters(1, 1));
        assert_eq!(unread.value, None);
    }

    #[test]
    fn the_bounds_follow_from_cpu_per_request_and_the_direct_rate() {
        // Round 19's c=64 window: 135 230 req/s direct on 2 cores.
        let baton = ProcessUse {
            cpu_micros_per_request: 49.8,
            runtime_micros_per_request: Some(36.8),
        };
        let bench = ProcessUse {
            cpu_micros_per_request: 19.7,
            runtime_micros_per_request: Some(8.9),
        };
        let figures = bound_figures(64, 135_230.0, (2, 1), &baton, &bench);
        assert_eq!(figures.len(), 2);
        // 1 s / 36.8 µs.
        assert_eq!(figures[0].value, Some(27_174.0));
        assert!(
            figures[0].measured.contains("0.20 of direct"),
            "{}",
            figures[0].measured
        );
        // 2 s / (0.22 × 135 230) − 19.7 µs.
        assert_eq!(figures[1].value, Some(47.53));
        assert!(
            figures[1].measured.ends_with("Baton used 49.8"),
            "{}",
            figures[1].measured
        );
        // Two workers serve twice as many at the same CPU per request.
        let two = bound_figures(64, 135_230.0, (2, 2), &baton, &bench);
        assert_eq!(two[0].value, Some(54_348.0));

        let no_runtime = ProcessUse {
            runtime_micros_per_request: None,
            ..baton
        };
        assert_eq!(
            bound_figures(64, 135_230.0, (2, 1), &no_runtime, &bench).len(),
            1
        );
    }
}
