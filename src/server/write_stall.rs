//! A bound on how long a response may stall: a connection whose client takes
//! nothing Baton writes to it for the write timeout is closed. As nginx's
//! `send_timeout`, it times the wait of one write, not the whole response, so
//! a slow reader that keeps reading is served to the end; one that stops
//! reading (or a peer gone without a FIN) no longer holds its connection,
//! its slot under `--max-connections` and its buffered response.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// `inner`, whose writes fail with `TimedOut` once one has waited `limit`
/// for the peer to take a byte.
#[derive(Debug)]
pub struct WriteStallLimit<S> {
    inner: S,
    limit: Duration,
    /// When the write waiting now gives up; made at a connection's first
    /// stall and reset at each later one.
    gives_up: Option<Pin<Box<Sleep>>>,
    /// A write is waiting: `gives_up` runs.
    armed: bool,
}

impl<S> WriteStallLimit<S> {
    /// `inner` with its writes bounded by `limit`.
    pub fn new(inner: S, limit: Duration) -> Self {
        Self {
            inner,
            limit,
            gives_up: None,
            armed: false,
        }
    }

    /// `written`, the outcome of a write to `inner`, within the limit.
    fn within_limit<T>(
        &mut self,
        cx: &mut Context<'_>,
        written: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if written.is_ready() {
            self.armed = false;
            return written;
        }
        let limit = self.limit;
        let gives_up = match &mut self.gives_up {
            Some(gives_up) if self.armed => gives_up,
            Some(gives_up) => {
                gives_up.as_mut().reset(Instant::now() + limit);
                gives_up
            }
            None => self.gives_up.insert(Box::pin(tokio::time::sleep(limit))),
        };
        self.armed = true;
        match gives_up.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the client took nothing written to it for {limit:?}"),
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for WriteStallLimit<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for WriteStallLimit<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let written = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.within_limit(cx, written)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let written = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.within_limit(cx, written)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let flushed = Pin::new(&mut self.inner).poll_flush(cx);
        self.within_limit(cx, flushed)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let shut = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.within_limit(cx, shut)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const LIMIT: Duration = Duration::from_secs(10);

    #[tokio::test(start_paused = true)]
    async fn a_write_the_peer_takes_nothing_of_fails_after_the_limit() {
        let (near, _far) = tokio::io::duplex(16);
        let mut bounded = WriteStallLimit::new(near, LIMIT);
        let started = tokio::time::Instant::now();
        let written = tokio::time::timeout(LIMIT * 2, bounded.write_all(&[7; 64]));
        let err = written.await.expect("gave up in time").unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert_eq!(started.elapsed(), LIMIT);
    }

    #[tokio::test(start_paused = true)]
    async fn a_peer_that_keeps_reading_slowly_is_written_to_the_end() {
        let (near, mut far) = tokio::io::duplex(16);
        let mut bounded = WriteStallLimit::new(near, LIMIT);
        let reader = tokio::spawn(async move {
            let mut taken = Vec::new();
            let mut chunk = [0u8; 16];
            loop {
                // Each read comes most of a limit after the last.
                tokio::time::sleep(LIMIT * 9 / 10).await;
                match far.read(&mut chunk).await.unwrap() {
                    0 => return taken,
                    n => taken.extend_from_slice(&chunk[..n]),
                }
            }
        });
        let started = tokio::time::Instant::now();
        bounded.write_all(&[7; 64]).await.unwrap();
        bounded.shutdown().await.unwrap();
        drop(bounded);
        assert_eq!(reader.await.unwrap(), [7; 64]);
        assert!(started.elapsed() > LIMIT * 3, "{:?}", started.elapsed());
    }
}
