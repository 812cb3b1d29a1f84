//! A minimal HTTP/1.1 client on hyper: one keep-alive connection per caller,
//! JSON-RPC bodies in, whole bodies or SSE events out. The load generator and
//! every setup call use it, so no other client's overhead is measured.

use anyhow::{Context as _, bail};
use bytes::{Bytes, BytesMut};
use http_body_util::{BodyExt as _, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use std::net::SocketAddr;
use std::time::Duration;

/// Longest any single setup call may take.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// The A2A JSON-RPC headers every request carries.
const A2A_VERSION: &str = "1.0";

/// One keep-alive HTTP/1.1 connection.
pub struct Connection {
    sender: SendRequest<Full<Bytes>>,
    authority: String,
}

impl Connection {
    /// Connects to `addr`; the connection lives until this value is dropped.
    pub async fn open(addr: SocketAddr) -> anyhow::Result<Self> {
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .with_context(|| format!("connecting to {addr}"))?;
        stream.set_nodelay(true)?;
        let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .context("HTTP/1 handshake")?;
        tokio::spawn(async move {
            // Ends when the sender is dropped or the peer closes.
            let _ = connection.await;
        });
        Ok(Self {
            sender,
            authority: addr.to_string(),
        })
    }

    /// POSTs a JSON body to `path` and returns the response head and body stream.
    pub async fn post(
        &mut self,
        path: &str,
        body: Bytes,
    ) -> anyhow::Result<hyper::Response<Incoming>> {
        self.sender.ready().await.context("connection closed")?;
        let request = hyper::Request::post(path)
            .header(hyper::header::HOST, &self.authority)
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .header("A2A-Version", A2A_VERSION)
            .body(Full::new(body))?;
        Ok(self.sender.send_request(request).await?)
    }

    /// GETs `path` and returns the status and whole body.
    pub async fn get(&mut self, path: &str) -> anyhow::Result<(hyper::StatusCode, Bytes)> {
        self.sender.ready().await.context("connection closed")?;
        let request = hyper::Request::get(path)
            .header(hyper::header::HOST, &self.authority)
            .body(Full::new(Bytes::new()))?;
        let response = self.sender.send_request(request).await?;
        let status = response.status();
        Ok((status, response.into_body().collect().await?.to_bytes()))
    }

    /// POSTs a JSON body and returns the status and whole body.
    pub async fn post_whole(
        &mut self,
        path: &str,
        body: Bytes,
    ) -> anyhow::Result<(hyper::StatusCode, Bytes)> {
        let response = self.post(path, body).await?;
        let status = response.status();
        Ok((status, response.into_body().collect().await?.to_bytes()))
    }
}

/// One JSON-RPC call on a fresh connection, bounded by [`CALL_TIMEOUT`]:
/// the `result` member, or an error naming what came back instead.
pub async fn rpc(
    addr: SocketAddr,
    path: &str,
    body: serde_json::Value,
) -> anyhow::Result<serde_json::Value> {
    let call = async {
        let mut connection = Connection::open(addr).await?;
        let (status, bytes) = connection
            .post_whole(path, Bytes::from(serde_json::to_vec(&body)?))
            .await?;
        let mut reply: serde_json::Value = serde_json::from_slice(&bytes).with_context(|| {
            format!(
                "HTTP {status}: not JSON: {}",
                String::from_utf8_lossy(&bytes)
            )
        })?;
        match reply.get_mut("result") {
            Some(result) => Ok(result.take()),
            None => bail!("HTTP {status}: no result: {reply}"),
        }
    };
    tokio::time::timeout(CALL_TIMEOUT, call)
        .await
        .with_context(|| format!("{path}: no answer within {CALL_TIMEOUT:?}"))?
}

/// Reads a `text/event-stream` body one event at a time.
pub struct SseReader {
    body: Incoming,
    buffer: BytesMut,
}

impl SseReader {
    /// Reads events from `body`.
    pub fn new(body: Incoming) -> Self {
        Self {
            body,
            buffer: BytesMut::new(),
        }
    }

    /// The next event's bytes (without the blank line that ends it), or
    /// `None` when the stream ends.
    pub async fn next_event(&mut self) -> anyhow::Result<Option<Bytes>> {
        loop {
            if let Some(end) = find(&self.buffer, b"\n\n") {
                let event = self.buffer.split_to(end + 2).freeze();
                return Ok(Some(event.slice(..end)));
            }
            match self.body.frame().await {
                Some(frame) => {
                    if let Ok(data) = frame?.into_data() {
                        self.buffer.extend_from_slice(&data);
                    }
                }
                None => return Ok(None),
            }
        }
    }
}

/// Where `needle` first occurs in `haystack`.
pub fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// How many SSE `data:` lines `body` holds: one per event here.
pub fn count_events(body: &[u8]) -> u64 {
    let mut count = u64::from(body.starts_with(b"data:"));
    let mut rest = body;
    while let Some(at) = find(rest, b"\ndata:") {
        count += 1;
        rest = &rest[at + 6..];
    }
    count
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_data_lines() {
        assert_eq!(count_events(b""), 0);
        assert_eq!(count_events(b"data: {}\n\ndata: {}\n\n"), 2);
        assert_eq!(count_events(b": keep-alive\n\ndata: {}\n\n"), 1);
    }
}
