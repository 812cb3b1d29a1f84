//! What `/proc` tells about a process (CPU time, resident memory, its
//! threads' CPU and run-queue waits) and about the machine the figures were
//! taken on (its idle CPU). Linux only, like the budgets.

use anyhow::Context as _;
use serde::Serialize;

/// CPU time a process has used (user + system), in clock ticks.
pub fn cpu_ticks(pid: u32) -> anyhow::Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("reading /proc/{pid}/stat"))?;
    parse_cpu_ticks(&stat).with_context(|| format!("unexpected /proc/{pid}/stat: {stat}"))
}

/// Bytes written to the block device holding `path`, once every dirty
/// page is on it (`sync`): what a process there wrote in all, as long as
/// nothing else writes meanwhile. Not `/proc/PID/io`: its `write_bytes`
/// counts each dirtied page cache folio whole, up to 2 MiB for a write of a
/// few KB on this kind of VM.
pub fn device_written_bytes(path: &std::path::Path) -> anyhow::Result<u64> {
    use std::os::unix::fs::MetadataExt as _;
    let synced = std::process::Command::new("sync")
        .status()
        .context("running sync")?;
    anyhow::ensure!(synced.success(), "sync failed: {synced}");
    let dev = std::fs::metadata(path)
        .with_context(|| format!("reading {}", path.display()))?
        .dev();
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    let stat_path = format!("/sys/dev/block/{major}:{minor}/stat");
    let stat =
        std::fs::read_to_string(&stat_path).with_context(|| format!("reading {stat_path}"))?;
    // The seventh field: sectors written, of 512 bytes whatever the device's.
    stat.split_whitespace()
        .nth(6)
        .and_then(|sectors| sectors.parse::<u64>().ok())
        .map(|sectors| sectors * 512)
        .with_context(|| format!("unexpected {stat_path}: {stat}"))
}

/// utime + stime from a `/proc/PID/stat` line.
fn parse_cpu_ticks(stat: &str) -> Option<u64> {
    let (user, system) = parse_user_system(stat)?;
    Some(user + system)
}

/// utime and stime from a `/proc/PID/stat` line. The command name may hold
/// spaces and parentheses, so fields are counted after its last `)`.
fn parse_user_system(stat: &str) -> Option<(u64, u64)> {
    let after_name = &stat[stat_name_end(stat)? + 1..];
    // After the name come field 3 (state) onwards; utime and stime are fields 14 and 15.
    let mut fields = after_name.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some((utime, stime))
}

/// Where a `/proc/PID/stat` line's command name ends: at its last `)`.
fn stat_name_end(stat: &str) -> Option<usize> {
    stat.rfind(')')
}

/// The command name of a `/proc/PID/stat` line, between its first `(` and
/// its last `)`.
fn parse_stat_name(stat: &str) -> Option<&str> {
    stat.get(stat.find('(')? + 1..stat_name_end(stat)?)
}

/// What one thread has used so far.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ThreadTimes {
    /// User CPU, in clock ticks (`/proc/PID/task/TID/stat`).
    pub user_ticks: u64,
    /// System CPU, in clock ticks.
    pub system_ticks: u64,
    /// Time on a CPU, in ns (`schedstat`).
    pub on_cpu_ns: u64,
    /// Time runnable but waiting for a CPU, in ns (`schedstat`): a thread
    /// that waits is short of a core, not of work.
    pub waiting_ns: u64,
}

impl ThreadTimes {
    fn since(&self, before: &Self) -> Self {
        Self {
            user_ticks: self.user_ticks.saturating_sub(before.user_ticks),
            system_ticks: self.system_ticks.saturating_sub(before.system_ticks),
            on_cpu_ns: self.on_cpu_ns.saturating_sub(before.on_cpu_ns),
            waiting_ns: self.waiting_ns.saturating_sub(before.waiting_ns),
        }
    }

    fn add(&mut self, other: &Self) {
        self.user_ticks += other.user_ticks;
        self.system_ticks += other.system_ticks;
        self.on_cpu_ns += other.on_cpu_ns;
        self.waiting_ns += other.waiting_ns;
    }
}

/// One thread of a process, read at one moment.
#[derive(Clone, Debug, PartialEq)]
pub struct ThreadReading {
    /// Thread id.
    pub tid: u32,
    /// Thread name (`comm`, as `stat` holds it).
    pub name: String,
    /// What it has used so far.
    pub times: ThreadTimes,
}

/// Every thread of a process now. A thread that ends while it is read is
/// left out; a kernel without scheduler statistics reads zero waits.
pub fn threads(pid: u32) -> anyhow::Result<Vec<ThreadReading>> {
    let dir = format!("/proc/{pid}/task");
    let mut found = Vec::new();
    for entry in std::fs::read_dir(&dir).with_context(|| format!("reading {dir}"))? {
        let path = entry?.path();
        let Some(tid) = path
            .file_name()
            .and_then(|name| name.to_str()?.parse().ok())
        else {
            continue;
        };
        let read = |file: &str| std::fs::read_to_string(path.join(file)).ok();
        // The name comes from `stat` too: one read fewer per thread.
        let Some(stat) = read("stat") else {
            continue;
        };
        let (Some(name), Some((user_ticks, system_ticks))) =
            (parse_stat_name(&stat), parse_user_system(&stat))
        else {
            continue;
        };
        let (on_cpu_ns, waiting_ns) = read("schedstat")
            .as_deref()
            .and_then(parse_schedstat)
            .unwrap_or_default();
        found.push(ThreadReading {
            tid,
            name: name.to_string(),
            times: ThreadTimes {
                user_ticks,
                system_ticks,
                on_cpu_ns,
                waiting_ns,
            },
        });
    }
    Ok(found)
}

/// The calling thread's time on a CPU so far (`/proc/thread-self/schedstat`).
#[cfg(target_os = "linux")]
pub fn own_thread_on_cpu() -> anyhow::Result<std::time::Duration> {
    let line = std::fs::read_to_string("/proc/thread-self/schedstat")
        .context("reading /proc/thread-self/schedstat")?;
    let (on_cpu_ns, _) =
        parse_schedstat(&line).context("unexpected /proc/thread-self/schedstat")?;
    Ok(std::time::Duration::from_nanos(on_cpu_ns))
}

/// Time on a CPU and time waiting to run, from a `schedstat` line.
fn parse_schedstat(line: &str) -> Option<(u64, u64)> {
    let mut fields = line.split_whitespace();
    Some((fields.next()?.parse().ok()?, fields.next()?.parse().ok()?))
}

/// A thread's group: its name without a trailing number (`sled-io-3` and
/// `sled-io-5` are one group).
fn thread_group(name: &str) -> &str {
    name.trim_end_matches(|c: char| c.is_ascii_digit())
        .trim_end_matches('-')
}

/// What one group of threads used between two readings.
#[derive(Clone, Debug, PartialEq)]
pub struct ThreadGroup {
    /// The threads' name, without a trailing number.
    pub name: String,
    /// How many of its threads were in the later reading.
    pub threads: usize,
    /// What they used, summed.
    pub used: ThreadTimes,
}

/// What each thread group used between two readings of [`threads`], most
/// CPU first. A thread born in between counts from zero; one that ended in
/// between is not in the later reading, so its last part is not counted.
pub fn thread_groups_between(
    before: &[ThreadReading],
    after: &[ThreadReading],
) -> Vec<ThreadGroup> {
    let mut groups: Vec<ThreadGroup> = Vec::new();
    for thread in after {
        let used = match before.iter().find(|b| b.tid == thread.tid) {
            Some(then) => thread.times.since(&then.times),
            None => thread.times.clone(),
        };
        let name = thread_group(&thread.name);
        match groups.iter_mut().find(|g| g.name == name) {
            Some(group) => {
                group.threads += 1;
                group.used.add(&used);
            }
            None => groups.push(ThreadGroup {
                name: name.to_string(),
                threads: 1,
                used,
            }),
        }
    }
    groups.sort_by_key(|g| std::cmp::Reverse(g.used.user_ticks + g.used.system_ticks));
    groups
}

/// The machine's CPU time so far, in clock ticks (`/proc/stat`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MachineTicks {
    /// Idle and waiting for I/O.
    pub idle: u64,
    /// Taken by the host for other guests (`steal`): on a VM, time the
    /// machine's cores did not have, which moves every figure.
    pub steal: u64,
    /// All of it.
    pub total: u64,
}

impl MachineTicks {
    /// The share of the machine's time since `earlier` that it was idle.
    pub fn idle_since(&self, earlier: &MachineTicks) -> f64 {
        self.share_since(earlier, |ticks| ticks.idle)
    }

    /// The share of the machine's time since `earlier` that the host took.
    pub fn stolen_since(&self, earlier: &MachineTicks) -> f64 {
        self.share_since(earlier, |ticks| ticks.steal)
    }

    fn share_since(&self, earlier: &MachineTicks, part: fn(&MachineTicks) -> u64) -> f64 {
        part(self).saturating_sub(part(earlier)) as f64
            / self.total.saturating_sub(earlier.total).max(1) as f64
    }
}

/// Reads [`MachineTicks`] now.
pub fn machine_ticks() -> anyhow::Result<MachineTicks> {
    let stat = std::fs::read_to_string("/proc/stat").context("reading /proc/stat")?;
    parse_machine_ticks(&stat).context("unexpected /proc/stat")
}

/// [`MachineTicks`] from `/proc/stat`'s first line.
fn parse_machine_ticks(stat: &str) -> Option<MachineTicks> {
    let line = stat.lines().next()?.strip_prefix("cpu ")?;
    let ticks: Vec<u64> = line
        .split_whitespace()
        .map(|t| t.parse().ok())
        .collect::<Option<_>>()?;
    // user nice system idle iowait irq softirq steal; the guest fields
    // after them are already counted in user and nice.
    Some(MachineTicks {
        idle: ticks.get(3)? + ticks.get(4)?,
        steal: *ticks.get(7)?,
        total: ticks.iter().take(8).sum(),
    })
}

/// The cores this process may run on (1 when unknown).
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
}

/// Clock ticks per second (`getconf CLK_TCK`; 100 on Linux if that fails).
pub fn clock_ticks_per_second() -> u64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .and_then(|text| text.trim().parse().ok())
        .filter(|ticks| *ticks > 0)
        .unwrap_or(100)
}

/// Resident memory of a process, in KiB.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Memory {
    /// Peak resident set (`VmHWM`).
    pub peak_kib: u64,
    /// Current resident set (`VmRSS`).
    pub current_kib: u64,
}

/// Reads `VmHWM` and `VmRSS` from `/proc/PID/status`.
pub fn memory(pid: u32) -> anyhow::Result<Memory> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("reading /proc/{pid}/status"))?;
    let field = |name: &str| -> Option<u64> {
        status
            .lines()
            .find_map(|line| line.strip_prefix(name))
            .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
    };
    Ok(Memory {
        peak_kib: field("VmHWM:").context("no VmHWM")?,
        current_kib: field("VmRSS:").context("no VmRSS")?,
    })
}

/// The machine the figures come from.
#[derive(Clone, Debug, Serialize)]
pub struct Machine {
    /// Cores this process may use (`nproc`).
    pub nproc: usize,
    /// `model name` of the first processor in `/proc/cpuinfo`.
    pub cpu_model: String,
    /// Kernel release.
    pub kernel: String,
    /// 1, 5 and 15 minute load averages when the run started: other work on the machine.
    pub load_average: String,
    /// How an idle core waits (the cpuidle driver, and a VM guest's halt
    /// polling), when the kernel says: on a VM whose guest halts at once,
    /// every wake of an idle core exits to the host, which sets the wake-up
    /// rows and the tails at concurrency 1.
    pub idle: Option<String>,
}

impl Machine {
    /// "idle cores: …" after `separator`, for a header line; empty when
    /// unknown. One formatting for the start-up line and the report's
    /// header, so that the two cannot drift apart.
    pub fn idle_clause(&self, separator: &str) -> String {
        self.idle.as_ref().map_or(String::new(), |idle| {
            format!("{separator}idle cores: {idle}")
        })
    }

    /// Reads it from `/proc`.
    pub fn detect() -> Self {
        let read = |path: &str| std::fs::read_to_string(path).unwrap_or_default();
        let cpu_model = read("/proc/cpuinfo")
            .lines()
            .find(|line| line.starts_with("model name"))
            .and_then(|line| line.split_once(':'))
            .map(|(_, model)| model.trim().to_string())
            .unwrap_or_else(|| "unknown".into());
        let load_average = read("/proc/loadavg")
            .split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ");
        Self {
            nproc: cores(),
            cpu_model,
            kernel: read("/proc/sys/kernel/osrelease").trim().to_string(),
            load_average,
            idle: describe_idle(
                &read("/sys/devices/system/cpu/cpuidle/current_driver"),
                &read("/sys/module/haltpoll/parameters/guest_halt_poll_ns"),
            ),
        }
    }
}

/// The idle row of [`Machine`] from the cpuidle driver's name and the
/// haltpoll module's polling time in nanoseconds (empty when unread). The
/// polling time counts only while `haltpoll` is the driver: the module's
/// setting is there whenever it is built in, whichever driver runs.
fn describe_idle(driver: &str, halt_poll_ns: &str) -> Option<String> {
    let driver = driver.trim();
    if driver.is_empty() {
        return None;
    }
    let polling = if driver == "haltpoll" {
        halt_poll_ns.trim().parse::<u64>().ok()
    } else {
        None
    };
    Some(match polling {
        Some(0) => format!("cpuidle {driver}, no polling before a halt"),
        Some(ns) if ns < 1000 => format!("cpuidle {driver}, polling up to {ns} ns before a halt"),
        Some(ns) => format!(
            "cpuidle {driver}, polling up to {} µs before a halt",
            ns / 1000
        ),
        None => format!("cpuidle {driver}"),
    })
}

/// The 1-minute load average now.
pub fn load_average_1m() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|text| text.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_idle_row_names_the_driver_and_its_halt_polling() {
        let cases = [
            (
                "haltpoll\n",
                "0\n",
                "cpuidle haltpoll, no polling before a halt",
            ),
            (
                "haltpoll\n",
                "200000\n",
                "cpuidle haltpoll, polling up to 200 µs before a halt",
            ),
            (
                "haltpoll\n",
                "500\n",
                "cpuidle haltpoll, polling up to 500 ns before a halt",
            ),
            // The haltpoll module's setting says nothing about another driver.
            ("intel_idle\n", "200000\n", "cpuidle intel_idle"),
            ("intel_idle\n", "", "cpuidle intel_idle"),
        ];
        for (driver, halt_poll_ns, row) in cases {
            assert_eq!(
                describe_idle(driver, halt_poll_ns).as_deref(),
                Some(row),
                "{driver:?} {halt_poll_ns:?}"
            );
        }
        assert_eq!(describe_idle("", "0"), None);
    }

    #[test]
    fn cpu_ticks_skip_a_name_with_spaces() {
        let stat = "42 (my (odd) name) S 1 42 42 0 -1 4194560 100 0 0 0 250 37 0 0 20 0 4 0 1 1 1";
        assert_eq!(parse_cpu_ticks(stat), Some(287));
    }

    #[test]
    fn user_and_system_ticks_are_fields_14_and_15() {
        let stat = "42 (my (odd) name) S 1 42 42 0 -1 4194560 100 0 0 0 250 37 0 0 20 0 4 0 1 1 1";
        assert_eq!(parse_user_system(stat), Some((250, 37)));
        assert_eq!(parse_stat_name(stat), Some("my (odd) name"));
    }

    #[test]
    fn thread_groups_sum_a_pools_threads_and_count_a_new_thread_from_zero() {
        let times = |user, system, on_cpu, waiting| ThreadTimes {
            user_ticks: user,
            system_ticks: system,
            on_cpu_ns: on_cpu,
            waiting_ns: waiting,
        };
        let reading = |tid, name: &str, times| ThreadReading {
            tid,
            name: name.into(),
            times,
        };
        let before = vec![
            reading(1, "tokio-rt-worker", times(10, 5, 100, 10)),
            reading(2, "sled-io-0", times(1, 1, 10, 1)),
            reading(3, "sled-io-1", times(2, 2, 20, 2)),
            reading(4, "ended", times(9, 9, 90, 9)),
        ];
        let after = vec![
            reading(1, "tokio-rt-worker", times(40, 15, 400, 60)),
            reading(2, "sled-io-0", times(2, 3, 30, 2)),
            reading(3, "sled-io-1", times(3, 4, 40, 4)),
            reading(5, "sled-io-2", times(1, 0, 5, 0)),
        ];
        let group = |name: &str, threads, used| ThreadGroup {
            name: name.into(),
            threads,
            used,
        };
        assert_eq!(
            thread_groups_between(&before, &after),
            vec![
                group("tokio-rt-worker", 1, times(30, 10, 300, 50)),
                group("sled-io", 3, times(3, 4, 45, 3)),
            ]
        );
    }

    #[test]
    fn schedstat_and_machine_ticks_are_read() {
        assert_eq!(parse_schedstat("123 45 6\n"), Some((123, 45)));
        // guest and guest_nice (the last two) are already in user and nice.
        let stat = "cpu  100 1 20 300 7 0 5 2 40 3\ncpu0 50 0 10 150 3 0 2 1 20 1\n";
        assert_eq!(
            parse_machine_ticks(stat),
            Some(MachineTicks {
                idle: 307,
                steal: 2,
                total: 435
            })
        );
    }

    #[test]
    fn the_stolen_share_is_of_the_time_between_two_readings() {
        let earlier = MachineTicks {
            idle: 100,
            steal: 10,
            total: 1000,
        };
        let later = MachineTicks {
            idle: 150,
            steal: 60,
            total: 1400,
        };
        assert_eq!(later.stolen_since(&earlier), 0.125);
        // No time between them: nothing stolen, not a division by zero.
        assert_eq!(earlier.stolen_since(&earlier), 0.0);
    }
}
