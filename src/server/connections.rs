//! Inbound connections: the accept loop that serves HTTP/1.1 with bounds on
//! how long a request head may take to arrive, on how long a response may
//! wait for its client to read, and on how many connections are open at
//! once, in all and from one address, and that drains them at a stop.
//!
//! `axum::serve` gives hyper no timer, so hyper's header-read timeout never
//! applies there, and it accepts without limit: a client that sends its head
//! a byte at a time, or opens connections and sends nothing, holds a task and
//! a file descriptor for as long as it likes, before any key is checked.

use super::FrontDoor;
use super::write_stall::WriteStallLimit;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use std::collections::HashMap;
use std::future::Future;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// Bounds on inbound connections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Longest a request head may take to arrive, from the first wait for
    /// it, and then its body. On a kept-alive connection the wait for the
    /// next request counts, so an idle connection closes after it too. A
    /// response being written (an SSE stream) is not bounded by it.
    pub read_timeout: Duration,
    /// Longest one write of a response may wait for the client to take a
    /// byte; then the connection is closed. A response as a whole, such as a
    /// long SSE stream, is not bounded by it.
    pub write_timeout: Duration,
    /// Most connections open at once. Past it Baton accepts no more until
    /// one closes, and new ones wait in the listen backlog.
    pub max_connections: usize,
    /// Most connections open at once from one client address (`usize::MAX`:
    /// no bound). A connection past it is closed as soon as it is accepted,
    /// so that one client cannot take every slot of `max_connections`.
    pub max_per_address: usize,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            read_timeout: DEFAULT_READ_TIMEOUT,
            write_timeout: DEFAULT_WRITE_TIMEOUT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_per_address: usize::MAX,
        }
    }
}

/// hyper's own default for a head, and nginx's order for its
/// `client_header_timeout` (60 s) and keep-alive (75 s): long enough for a
/// slow client, short enough that idle connections do not pile up.
pub const DEFAULT_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// nginx's `send_timeout`: a client that takes nothing of a response for a
/// minute is gone or stuck.
pub const DEFAULT_WRITE_TIMEOUT: Duration = Duration::from_secs(60);

/// The largest request head (a longer one is answered 431), and what a
/// connection buffers from its client before hyper stops reading for more
/// (its last read may bring as much again). hyper's default buffer, about
/// 400 KB, would let each slow head hold that much for a read timeout: 4 GB
/// at the default connection cap. Bodies stream through it in pieces.
pub const MAX_HEAD_BYTES: usize = 64 * 1024;

/// Enough for thousands of SSE subscribers at once; lowered at start-up when
/// the open-file limit cannot hold it (see [`ConnectionLimits::fit_open_files`]).
pub const DEFAULT_MAX_CONNECTIONS: usize = 10_000;

impl ConnectionLimits {
    /// Raises the soft open-file limit to the hard one (as Go's runtime
    /// does), and lowers `max_connections` to three quarters of what that
    /// allows, leaving the rest to the ledger, the agent connections and the
    /// push webhooks. Without it, accepting past the limit fails with
    /// `EMFILE` and everything else that opens a file fails with it.
    pub fn fit_open_files(self) -> Self {
        let limit = match rlimit::increase_nofile_limit(u64::MAX) {
            Ok(limit) => limit,
            Err(err) => {
                tracing::warn!(%err, "could not read or raise the open-file limit");
                return self;
            }
        };
        let room = usize::try_from(limit / 4 * 3).unwrap_or(usize::MAX).max(1);
        if room >= self.max_connections {
            return self;
        }
        tracing::warn!(
            configured = self.max_connections,
            open_file_limit = limit,
            max_connections = room,
            "the open-file limit cannot hold max-connections; lowered"
        );
        Self {
            max_connections: room,
            ..self
        }
    }
}

/// Serves `service` on every connection `listener` accepts, within
/// `limits` (counting in `refused` those closed past their client's bound),
/// until `shutdown` resolves; then stops accepting, lets each open
/// connection finish the request it is serving, and returns when all have
/// closed.
pub(super) async fn serve(
    listener: TcpListener,
    service: FrontDoor,
    limits: ConnectionLimits,
    refused: Arc<AtomicU64>,
    shutdown: impl Future<Output = ()>,
) {
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.read_timeout)
        .max_header_size(MAX_HEAD_BYTES)
        .max_buf_size(MAX_HEAD_BYTES);
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let per_address = (limits.max_per_address < usize::MAX)
        .then(|| AddressCounts::new(limits.max_per_address, refused));
    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    let mut at_cap = false;
    loop {
        let slot = match slots.clone().try_acquire_owned() {
            Ok(slot) => {
                at_cap = false;
                slot
            }
            Err(_) => {
                if !at_cap {
                    at_cap = true;
                    tracing::warn!(
                        max_connections = limits.max_connections,
                        "connection cap reached; new connections wait until one closes"
                    );
                }
                tokio::select! {
                    slot = slots.clone().acquire_owned() => slot.expect("the semaphore is never closed"),
                    () = &mut shutdown => break,
                }
            }
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(err) => {
                    if pause_after(&err) {
                        tokio::select! {
                            () = tokio::time::sleep(ACCEPT_PAUSE) => {}
                            () = &mut shutdown => break,
                        }
                    }
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // Past its address's bound a connection is closed unserved: served,
        // it would hold a slot until it sent a head or its read timed out.
        let address_slot = match per_address.as_ref().map(|counts| counts.admit(peer.ip())) {
            Some(None) => continue,
            admitted => admitted.flatten(),
        };
        let stream = WriteStallLimit::new(stream, limits.write_timeout);
        let connection = http.serve_connection(TokioIo::new(stream), service.clone());
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(err) = connection.await {
                tracing::debug!(%err, "connection closed with an error");
            }
            drop((slot, address_slot));
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

/// Open connections by client address, for
/// [`ConnectionLimits::max_per_address`].
struct AddressCounts {
    // std Mutex: one map operation per accept and per close, never held
    // across an .await.
    open: Mutex<HashMap<IpAddr, AddressOpen>>,
    max: usize,
    /// Connections refused so far (the metric's).
    refused: Arc<AtomicU64>,
}

/// One address's open connections.
#[derive(Default)]
struct AddressOpen {
    count: usize,
    /// A refusal was logged since the address last had nothing open, so
    /// that a client kept at its bound is logged once.
    warned: bool,
}

impl AddressCounts {
    fn new(max: usize, refused: Arc<AtomicU64>) -> Arc<Self> {
        assert!(max > 0, "a bound of 0 would refuse every connection");
        Arc::new(Self {
            open: Mutex::default(),
            max,
            refused,
        })
    }

    /// Counts a connection from `address`, unless its client holds `max`
    /// already (then it counts the refusal).
    fn admit(self: &Arc<Self>, address: IpAddr) -> Option<AddressSlot> {
        let client = client_of(address);
        let first_refusal = {
            let mut open = self.open.lock().expect("address counts lock");
            let entry = open.entry(client).or_default();
            if entry.count < self.max {
                entry.count += 1;
                return Some(AddressSlot {
                    counts: self.clone(),
                    client,
                });
            }
            !std::mem::replace(&mut entry.warned, true)
        };
        self.refused.fetch_add(1, Ordering::Relaxed);
        if first_refusal {
            tracing::warn!(
                client = %client,
                max_per_address = self.max,
                "a client holds the most connections one may; closing its new ones \
                 (logged once until it has none open)"
            );
        }
        None
    }
}

/// The client an address counts for: an IPv4 address (also when mapped
/// into IPv6 by a dual-stack socket), or an IPv6 /64, the least a host is
/// given (RFC 6177), so that one host cannot step around its bound by
/// changing its interface id. (A host given a shorter prefix counts once
/// per /64 it uses.)
fn client_of(address: IpAddr) -> IpAddr {
    match address.to_canonical() {
        IpAddr::V6(v6) => IpAddr::V6((u128::from(v6) & !u128::from(u64::MAX)).into()),
        v4 => v4,
    }
}

/// A connection counted against its client until dropped.
struct AddressSlot {
    counts: Arc<AddressCounts>,
    client: IpAddr,
}

impl Drop for AddressSlot {
    fn drop(&mut self) {
        let mut open = self.counts.open.lock().expect("address counts lock");
        if let Some(entry) = open.get_mut(&self.client) {
            entry.count -= 1;
            if entry.count == 0 {
                open.remove(&self.client);
            }
        }
    }
}

/// How long accepting pauses after a failure that is not the peer's.
const ACCEPT_PAUSE: Duration = Duration::from_secs(1);

/// Whether a failed accept pauses the loop: a connection the peer dropped
/// before it was taken is nothing; anything else (most often `EMFILE`) is
/// logged, and the loop pauses so as not to spin while it lasts (as hyper
/// 0.14's server and axum do).
fn pause_after(err: &std::io::Error) -> bool {
    use std::io::ErrorKind;
    if matches!(
        err.kind(),
        ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset | ErrorKind::ConnectionRefused
    ) {
        return false;
    }
    tracing::error!(%err, "accepting a connection failed; pausing for {ACCEPT_PAUSE:?}");
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_fits_within_the_open_file_limit() {
        let asked = ConnectionLimits {
            max_connections: usize::MAX,
            ..ConnectionLimits::default()
        };
        let fitted = asked.fit_open_files();
        let (soft, _) = rlimit::getrlimit(rlimit::Resource::NOFILE).unwrap();
        let room = usize::try_from(soft / 4 * 3).unwrap_or(usize::MAX);
        assert_eq!(fitted.max_connections, room.max(1));
        assert_eq!(fitted.read_timeout, asked.read_timeout);
        // A cap the limit holds is kept.
        let modest = ConnectionLimits {
            max_connections: 16,
            ..ConnectionLimits::default()
        };
        assert_eq!(modest.fit_open_files(), modest);
    }

    #[test]
    fn an_address_is_admitted_up_to_its_bound_and_again_once_one_closes() {
        let counts = AddressCounts::new(2, Arc::default());
        let v4: IpAddr = "192.0.2.7".parse().unwrap();
        // The same client on a dual-stack socket.
        let mapped: IpAddr = "::ffff:192.0.2.7".parse().unwrap();
        let first = counts.admit(v4).expect("first");
        let second = counts.admit(mapped).expect("second");
        assert!(counts.admit(v4).is_none());
        assert!(counts.admit("192.0.2.8".parse().unwrap()).is_some());
        drop(first);
        let third = counts.admit(mapped).expect("admitted once one closed");
        drop((second, third));
        // An address with nothing open is forgotten.
        assert!(counts.open.lock().unwrap().is_empty());
    }

    #[test]
    fn an_ipv6_client_counts_by_its_64() {
        let counts = AddressCounts::new(1, Arc::default());
        let one = counts.admit("2001:db8:1:2::1".parse().unwrap());
        assert!(one.is_some());
        assert!(
            counts
                .admit("2001:db8:1:2:ffff::9".parse().unwrap())
                .is_none()
        );
        assert!(counts.admit("2001:db8:1:3::1".parse().unwrap()).is_some());
    }
}
