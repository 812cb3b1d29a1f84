//! Inbound connection bounds over real TCP: a request head or body that
//! trickles in past the read timeout is cut off, a broken chunked body is
//! refused, an idle kept-alive connection is closed, a stream being written
//! outlives the timeout, a response its client stops reading is cut off at
//! the write timeout, connections past the cap wait in the backlog until
//! one closes, and those past an address's bound are closed.

mod common;

use baton::server::connections::ConnectionLimits;
use common::agents::{BindsInLargeReport, GatedAgent};
use common::*;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A read timeout short enough for a test to wait out.
const READ_TIMEOUT: Duration = Duration::from_secs(1);

async fn baton_with(limits: ConnectionLimits) -> TestBaton {
    baton().connections(limits).start().await
}

fn short_reads() -> ConnectionLimits {
    ConnectionLimits {
        read_timeout: READ_TIMEOUT,
        ..ConnectionLimits::default()
    }
}

async fn connect(baton: &TestBaton) -> TcpStream {
    let address = baton.base.trim_start_matches("http://");
    TcpStream::connect(address).await.expect("connect")
}

/// Reads until the peer closes the connection; what it sent before.
async fn read_until_closed(stream: &mut TcpStream) -> String {
    let mut received = Vec::new();
    let read = stream.read_to_end(&mut received);
    match tokio::time::timeout(WAIT, read).await {
        Ok(Ok(_)) => {}
        // A reset is a close too.
        Ok(Err(err)) if err.kind() == std::io::ErrorKind::ConnectionReset => {}
        Ok(Err(err)) => panic!("reading failed: {err}"),
        Err(_) => panic!("the connection stayed open for {WAIT:?}"),
    }
    String::from_utf8_lossy(&received).into_owned()
}

/// Reads one response to a `GET /healthz` (a short JSON body).
async fn read_health(stream: &mut TcpStream) -> String {
    let mut received = Vec::new();
    let mut chunk = [0u8; 1024];
    let read = async {
        while !String::from_utf8_lossy(&received).contains(r#"{"status":"ok"}"#) {
            let n = stream.read(&mut chunk).await.expect("read");
            assert!(n > 0, "closed before the response ended");
            received.extend_from_slice(&chunk[..n]);
        }
    };
    tokio::time::timeout(WAIT, read)
        .await
        .expect("the response arrives in time");
    String::from_utf8_lossy(&received).into_owned()
}

const HEALTH_REQUEST: &[u8] = b"GET /healthz HTTP/1.1\r\nhost: localhost\r\n\r\n";

#[tokio::test]
async fn a_request_head_that_trickles_in_is_cut_off_at_the_read_timeout() {
    let baton = baton_with(short_reads()).await;
    let mut stream = connect(&baton).await;
    stream
        .write_all(b"POST /a2a HTTP/1.1\r\nhost: localhost\r\n")
        .await
        .unwrap();
    let (mut reader, mut writer) = stream.into_split();
    // One header byte every 100 ms, for up to twenty times the timeout: the
    // head never ends, and each byte is progress a plain idle check would
    // take as life.
    let trickle = tokio::spawn(async move {
        for _ in 0..200 {
            if writer.write_all(b"x").await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    // Closed by Baton, well before the trickle ends.
    let mut received = Vec::new();
    let within = READ_TIMEOUT * 5;
    let read = tokio::time::timeout(within, reader.read_to_end(&mut received)).await;
    assert!(
        read.is_ok(),
        "the connection stayed open for {within:?} of a trickling head"
    );
    trickle.abort();
    let reply = String::from_utf8_lossy(&received);
    assert!(
        reply.is_empty() || reply.starts_with("HTTP/1.1 408"),
        "{reply}"
    );
    // Others are served meanwhile and after.
    let mut other = connect(&baton).await;
    other.write_all(HEALTH_REQUEST).await.unwrap();
    assert!(read_health(&mut other).await.starts_with("HTTP/1.1 200"));
    baton.stop().await;
}

#[tokio::test]
async fn an_idle_kept_alive_connection_is_closed_after_the_read_timeout() {
    let baton = baton_with(short_reads()).await;
    let mut stream = connect(&baton).await;
    stream.write_all(HEALTH_REQUEST).await.unwrap();
    let first = read_health(&mut stream).await;
    assert!(first.starts_with("HTTP/1.1 200"), "{first}");
    assert!(!first.to_ascii_lowercase().contains("connection: close"));
    // Kept alive, then nothing more is sent: closed, without a reply.
    assert_eq!(read_until_closed(&mut stream).await, "");
    baton.stop().await;
}

#[tokio::test]
async fn a_request_body_that_trickles_in_gets_408_at_the_read_timeout() {
    let baton = baton_with(short_reads()).await;
    let mut stream = connect(&baton).await;
    stream
        .write_all(
            b"POST /a2a HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n\
              content-length: 200\r\n\r\n{\"jsonrpc\":",
        )
        .await
        .unwrap();
    let reply = read_until_closed(&mut stream).await;
    assert!(reply.starts_with("HTTP/1.1 408"), "{reply}");
    let body = &reply[reply.find("\r\n\r\n").expect("a head") + 4..];
    let body: serde_json::Value = serde_json::from_str(body).expect("a JSON-RPC error");
    assert_eq!(body["error"]["code"], -32600, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("did not arrive within 1 s"), "{message}");
    baton.stop().await;
}

#[tokio::test]
async fn a_request_body_with_a_broken_chunk_gets_400() {
    let baton = baton_with(short_reads()).await;
    let mut stream = connect(&baton).await;
    stream
        .write_all(
            b"POST /a2a HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n\
              transfer-encoding: chunked\r\n\r\nzz\r\n{}\r\n",
        )
        .await
        .unwrap();
    let reply = read_until_closed(&mut stream).await;
    assert!(reply.starts_with("HTTP/1.1 400"), "{reply}");
    let body = &reply[reply.find("\r\n\r\n").expect("a head") + 4..];
    let body: serde_json::Value = serde_json::from_str(body).expect("a JSON-RPC error");
    assert_eq!(body["error"]["code"], -32600, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("could not be read"), "{message}");
    baton.stop().await;
}

#[tokio::test]
async fn a_stream_being_written_outlives_the_read_timeout() {
    let agent = GatedAgent::new();
    let baton = baton()
        .agent("gated", agent.clone())
        .connections(short_reads())
        .start()
        .await;
    let response = baton
        .open_stream(
            "/agents/gated/a2a",
            "SendStreamingMessage",
            serde_json::json!({"message": user_message(&message_id("slow"), "wait")}),
        )
        .await;
    // Three read timeouts with the stream open and the client silent.
    tokio::time::sleep(READ_TIMEOUT * 3).await;
    agent.release(1);
    let stream = read_sse(response, usize::MAX).await;
    assert!(stream.closed);
    let last = stream.events.last().expect("events");
    let state = &last["result"]["statusUpdate"]["status"]["state"];
    assert_eq!(state, "TASK_STATE_COMPLETED", "{last}");
    baton.stop().await;
}

/// The id of the completed task of agent `large`.
async fn large_task(baton: &TestBaton) -> String {
    let params = serde_json::json!({"message": user_message(&message_id("m"), "talk")});
    let reply = baton
        .call_at("/agents/large/a2a", "SendMessage", params)
        .await;
    let task = &reply.result()["task"];
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED");
    task["id"].as_str().unwrap().to_string()
}

/// Sends a GetTask of `task_id` on `stream`.
async fn ask_for(stream: &mut TcpStream, task_id: &str) {
    let body = serde_json::json!({
        "jsonrpc": "2.0", "id": 1, "method": "GetTask", "params": {"id": task_id},
    })
    .to_string();
    let request = format!(
        "POST /a2a HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n\
         a2a-version: 1.0\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.expect("write");
}

/// Reads a response `chunk` bytes at a time, `pause` before each, until
/// the peer closes or the response ends: the bytes read, and the
/// response's length.
async fn read_response(stream: &mut TcpStream, chunk: usize, pause: Duration) -> (usize, usize) {
    let mut received = Vec::new();
    let mut buffer = vec![0u8; 64 * 1024];
    let mut length = usize::MAX;
    let read = async {
        'reading: while received.len() < length {
            tokio::time::sleep(pause).await;
            let goal = received.len().saturating_add(chunk);
            while received.len() < goal.min(length) {
                let n = match stream.read(&mut buffer).await {
                    Ok(0) => break 'reading,
                    Ok(n) => n,
                    Err(err) if err.kind() == std::io::ErrorKind::ConnectionReset => break 'reading,
                    Err(err) => panic!("reading failed: {err}"),
                };
                received.extend_from_slice(&buffer[..n]);
                if length == usize::MAX {
                    length = response_length(&received).unwrap_or(usize::MAX);
                }
            }
        }
    };
    tokio::time::timeout(WAIT * 2, read)
        .await
        .expect("the response ends or is cut off in time");
    (received.len(), length)
}

/// The length of the response whose head `received` begins with.
fn response_length(received: &[u8]) -> Option<usize> {
    let text = String::from_utf8_lossy(received);
    let head_end = text.find("\r\n\r\n")? + 4;
    let body: usize = text[..head_end]
        .lines()
        .find_map(|line| {
            line.to_ascii_lowercase()
                .strip_prefix("content-length: ")
                .map(str::to_string)
        })?
        .trim()
        .parse()
        .ok()?;
    Some(head_end + body)
}

/// A write timeout a test can wait out a few times.
const WRITE_TIMEOUT: Duration = Duration::from_secs(2);

/// Far more than a connection's kernel buffers hold while its client does
/// not read: 12 MiB, or more where the send buffers may grow larger.
fn more_than_buffers() -> usize {
    let largest_send_buffer = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_wmem")
        .ok()
        .and_then(|text| text.split_whitespace().nth(2)?.parse::<usize>().ok())
        .unwrap_or(0);
    (12 << 20).max(largest_send_buffer * 2)
}

/// A connection whose receive buffer stays small (no autotuning), so the
/// kernel holds little of what its client does not read.
async fn connect_small(baton: &TestBaton) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(64 * 1024).expect("SO_RCVBUF");
    connect_socket(baton, socket).await
}

/// `socket`, connected to `baton`.
async fn connect_socket(baton: &TestBaton, socket: tokio::net::TcpSocket) -> TcpStream {
    let address = baton.base.trim_start_matches("http://").parse().unwrap();
    socket.connect(address).await.expect("connect")
}

#[tokio::test]
async fn a_response_the_client_stops_reading_is_cut_off_at_the_write_timeout() {
    let bytes = more_than_buffers();
    let baton = baton()
        .agent("large", BindsInLargeReport::new("large", bytes).at_once())
        .tune(|settings| settings.max_task_bytes = usize::MAX)
        .connections(ConnectionLimits {
            write_timeout: WRITE_TIMEOUT,
            ..ConnectionLimits::default()
        })
        .start()
        .await;
    let task_id = large_task(&baton).await;
    // A client that stops reading: the kernel buffers fill, the response
    // waits, and after the write timeout the connection is closed. Three
    // timeouts leave the server time to shape the reply first.
    let mut stopped = connect_small(&baton).await;
    ask_for(&mut stopped, &task_id).await;
    tokio::time::sleep(WRITE_TIMEOUT * 3).await;
    let (read, length) = read_response(&mut stopped, usize::MAX, Duration::ZERO).await;
    assert!(length > bytes, "{length}");
    assert!(read < length, "all {length} bytes came");
    // One that reads slowly but steadily, taking the response in over more
    // than a write timeout, gets all of it.
    let mut slow = connect_small(&baton).await;
    ask_for(&mut slow, &task_id).await;
    let started = std::time::Instant::now();
    let pace = Duration::from_millis(300);
    let (read, length) = read_response(&mut slow, bytes / 12, pace).await;
    assert_eq!(read, length);
    assert!(started.elapsed() > WRITE_TIMEOUT, "{:?}", started.elapsed());
    baton.stop().await;
}

#[tokio::test]
async fn connections_past_the_cap_wait_until_one_closes() {
    let baton = baton_with(ConnectionLimits {
        max_connections: 2,
        ..ConnectionLimits::default()
    })
    .await;
    let (first, mut second) = two_served(&baton).await;
    // The third is taken by the kernel's backlog, not by Baton.
    let mut third = connect(&baton).await;
    third.write_all(HEALTH_REQUEST).await.unwrap();
    let mut byte = [0u8; 1];
    let early = tokio::time::timeout(Duration::from_millis(500), third.read(&mut byte)).await;
    assert!(
        early.is_err(),
        "a third connection was served at a cap of 2"
    );
    drop(first);
    assert!(read_health(&mut third).await.starts_with("HTTP/1.1 200"));
    // The second is still served.
    second.write_all(HEALTH_REQUEST).await.unwrap();
    assert!(read_health(&mut second).await.starts_with("HTTP/1.1 200"));
    baton.stop().await;
}

#[tokio::test]
async fn connections_past_an_address_s_bound_are_closed_and_others_served() {
    // One slot beyond the address's two: the other address is served only
    // if the refused connection gave its slot back.
    let baton = baton_with(ConnectionLimits {
        max_connections: 3,
        max_per_address: 2,
        ..ConnectionLimits::default()
    })
    .await;
    let (first, mut second) = two_served(&baton).await;
    // A third from the same address is closed unserved.
    let mut third = connect(&baton).await;
    let _ = third.write_all(HEALTH_REQUEST).await;
    assert_eq!(read_until_closed(&mut third).await, "");
    // Another address (on Linux all of 127/8 is loopback) is served
    // meanwhile, and then closes.
    let mut other = connect_from(&baton, [127, 0, 0, 2]).await;
    other.write_all(HEALTH_REQUEST).await.unwrap();
    assert!(read_health(&mut other).await.starts_with("HTTP/1.1 200"));
    drop(other);
    // Once one of the first two closes, the address is served again.
    drop(first);
    let served_again = async {
        loop {
            let mut next = connect(&baton).await;
            let _ = next.write_all(HEALTH_REQUEST).await;
            let mut byte = [0u8; 1];
            if matches!(next.read(&mut byte).await, Ok(1)) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(WAIT, served_again)
        .await
        .expect("a connection is served once one of its address's closed");
    // The second was never cut off.
    second.write_all(HEALTH_REQUEST).await.unwrap();
    assert!(read_health(&mut second).await.starts_with("HTTP/1.1 200"));
    let metrics = baton.metrics().await;
    let refused = baton::metrics::sample_value(&metrics, "baton_connections_refused_total")
        .map(|value| value.parse::<u64>().unwrap());
    assert!(refused.is_some_and(|refused| refused >= 1), "{refused:?}");
    baton.stop().await;
}

/// Two connections to `baton`, each served a health check and kept open.
async fn two_served(baton: &TestBaton) -> (TcpStream, TcpStream) {
    let mut first = connect(baton).await;
    let mut second = connect(baton).await;
    for stream in [&mut first, &mut second] {
        stream.write_all(HEALTH_REQUEST).await.unwrap();
        assert!(read_health(stream).await.starts_with("HTTP/1.1 200"));
    }
    (first, second)
}

/// A connection to `baton` from the loopback address `ip`.
async fn connect_from(baton: &TestBaton, ip: [u8; 4]) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    let from = (std::net::Ipv4Addr::from(ip), 0).into();
    socket.bind(from).expect("bind");
    connect_socket(baton, socket).await
}

#[tokio::test]
async fn a_head_over_64_kib_is_431_and_a_larger_body_streams_through() {
    let baton = baton().start().await;
    let mut stream = connect(&baton).await;
    let filler = "x".repeat(100 * 1024);
    let head = format!("GET /healthz HTTP/1.1\r\nhost: localhost\r\nx-filler: {filler}\r\n\r\n");
    // Baton may answer, and close, before the whole head is written.
    let _ = stream.write_all(head.as_bytes()).await;
    let reply = read_until_closed(&mut stream).await;
    assert!(reply.starts_with("HTTP/1.1 431"), "{reply}");
    // A body three times the buffer is read whole.
    let text = "y".repeat(3 * 64 * 1024);
    let result = baton
        .send_text(&message_id("big"), &text, serde_json::json!({}))
        .await;
    let task = &result["task"];
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{result}");
    assert_eq!(task["artifacts"][0]["parts"][0]["text"], text.as_str());
    baton.stop().await;
}
