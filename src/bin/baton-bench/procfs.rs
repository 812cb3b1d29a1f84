//! What `/proc` tells about a process (CPU time, resident memory) and about
//! the machine the figures were taken on. Linux only, like the budgets.

use anyhow::Context as _;
use serde::Serialize;

/// CPU time a process has used (user + system), in clock ticks.
pub fn cpu_ticks(pid: u32) -> anyhow::Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("reading /proc/{pid}/stat"))?;
    parse_cpu_ticks(&stat).with_context(|| format!("unexpected /proc/{pid}/stat: {stat}"))
}

/// utime + stime from a `/proc/PID/stat` line. The command name may hold
/// spaces and parentheses, so fields are counted after its last `)`.
fn parse_cpu_ticks(stat: &str) -> Option<u64> {
    let after_name = &stat[stat.rfind(')')? + 1..];
    // After the name come field 3 (state) onwards; utime and stime are fields 14 and 15.
    let mut fields = after_name.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
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
}

impl Machine {
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
            nproc: std::thread::available_parallelism().map_or(1, |n| n.get()),
            cpu_model,
            kernel: read("/proc/sys/kernel/osrelease").trim().to_string(),
            load_average,
        }
    }
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
    fn cpu_ticks_skip_a_name_with_spaces() {
        let stat = "42 (my (odd) name) S 1 42 42 0 -1 4194560 100 0 0 0 250 37 0 0 20 0 4 0 1 1 1";
        assert_eq!(parse_cpu_ticks(stat), Some(287));
    }
}
