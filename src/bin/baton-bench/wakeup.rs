//! What a hand-off between two threads costs on this machine: a ping-pong of
//! one byte over a socket pair, with both threads on one core and on two.
//!
//! Every hop of a relayed request (the load's, the reference proxy's and
//! Baton's own, to its log flusher and back) wakes a thread on the other
//! side. On a VM whose guest halts an idle core at once, waking a thread on
//! the other, idle core costs tens of microseconds of CPU (the halt and the
//! interrupt between virtual CPUs exit to the host), where one on the same
//! core costs a few; these rows show what the machine charges for that,
//! which sets the figures at concurrency 1 and the tails. Linux only, like
//! the budgets.

use crate::procfs::own_thread_on_cpu;
use anyhow::Context as _;
use std::io::{ErrorKind, Read as _, Write as _};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

/// Round trips per measurement.
pub const ROUND_TRIPS: usize = 4000;

/// Longest a measurement runs, whatever is left of its round trips.
const TIME_LIMIT: Duration = Duration::from_secs(10);

/// What the round trips took.
#[derive(Debug)]
pub struct WakeCost {
    /// Round trips made (fewer than asked if the time limit came first).
    pub round_trips: usize,
    /// Median time from the ping's send to the echo's arrival.
    pub median: Duration,
    /// CPU time of both threads per round trip, from their `schedstat`.
    pub cpu_per_round_trip: Duration,
}

/// The first two cores this process may run on; none if it may run on one
/// only, or its affinity cannot be read.
pub fn two_cores() -> Option<[usize; 2]> {
    let allowed = rustix::thread::sched_getaffinity(None).ok()?;
    let mut cores = (0..rustix::thread::CpuSet::MAX_CPU).filter(|&cpu| allowed.is_set(cpu));
    Some([cores.next()?, cores.next()?])
}

/// Ping-pongs one byte `round_trips` times between two threads pinned to
/// `cores` (the same core twice for a hand-off on one core).
pub fn measure(cores: [usize; 2], round_trips: usize) -> anyhow::Result<WakeCost> {
    let (mut ping_end, mut echo_end) = UnixStream::pair().context("making a socket pair")?;
    let echo = std::thread::Builder::new()
        .name("bench-wake-echo".into())
        .spawn(move || -> anyhow::Result<Duration> {
            pin_to(cores[1])?;
            let start = own_thread_on_cpu()?;
            let mut byte = [0u8; 1];
            // Ends when the ping's side closes: after its last round trip,
            // at its time limit, or when it failed.
            loop {
                match echo_end.read_exact(&mut byte) {
                    Ok(()) => echo_end.write_all(&byte)?,
                    Err(err) if err.kind() == ErrorKind::UnexpectedEof => break,
                    Err(err) => return Err(err.into()),
                }
            }
            Ok(own_thread_on_cpu()?.saturating_sub(start))
        })?;
    let ping = std::thread::Builder::new()
        .name("bench-wake-ping".into())
        .spawn(move || -> anyhow::Result<(Vec<Duration>, Duration)> {
            pin_to(cores[0])?;
            let start = own_thread_on_cpu()?;
            let began = Instant::now();
            let mut times = Vec::with_capacity(round_trips);
            let mut byte = [1u8; 1];
            while times.len() < round_trips && began.elapsed() < TIME_LIMIT {
                let sent = Instant::now();
                ping_end.write_all(&byte)?;
                ping_end.read_exact(&mut byte)?;
                times.push(sent.elapsed());
            }
            Ok((times, own_thread_on_cpu()?.saturating_sub(start)))
        })?;
    let pinged = ping
        .join()
        .map_err(|_| anyhow::anyhow!("the ping thread panicked"))?;
    let echoed = echo
        .join()
        .map_err(|_| anyhow::anyhow!("the echo thread panicked"))?;
    let (mut times, ping_cpu) = pinged?;
    let echo_cpu = echoed?;
    anyhow::ensure!(!times.is_empty(), "no round trip within {TIME_LIMIT:?}");
    times.sort_unstable();
    Ok(WakeCost {
        round_trips: times.len(),
        median: times[times.len() / 2],
        cpu_per_round_trip: (ping_cpu + echo_cpu) / times.len() as u32,
    })
}

/// Keeps the calling thread on `core`.
fn pin_to(core: usize) -> anyhow::Result<()> {
    let mut only = rustix::thread::CpuSet::new();
    only.set(core);
    rustix::thread::sched_setaffinity(None, &only)
        .with_context(|| format!("pinning a thread to core {core}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_on_one_core_are_counted_and_timed() {
        let core = rustix::thread::sched_getcpu();
        let cost = measure([core, core], 50).unwrap();
        assert_eq!(cost.round_trips, 50);
        assert!(cost.median > Duration::ZERO);
        assert!(cost.cpu_per_round_trip > Duration::ZERO);
    }
}
