//! An HTTP/1.1 peer's two reads that tests of every HTTP listener need: one response head,
//! and everything until the server closes. Each panics when the server takes longer than
//! `within`, so a hang fails the test with the step's name instead of stalling it.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Reads up to and including the blank line that ends a head, a byte at a time so nothing
/// after it is taken (a 204 or an upgrade's head has no body to tell its end).
pub async fn read_head(client: &mut TcpStream, within: Duration) -> Vec<u8> {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        tokio::time::timeout(within, client.read_exact(&mut byte))
            .await
            .expect("a head byte in time")
            .expect("read");
        head.push(byte[0]);
    }
    head
}

/// Sends `request`, then returns everything the server sends until it closes the connection.
/// Sending a head the server stops reading may fail, and the close may come as a reset: both
/// are the close looked for.
pub async fn answer_to(client: &mut TcpStream, request: &[u8], within: Duration) -> Vec<u8> {
    let _ = client.write_all(request).await;
    let mut out = Vec::new();
    let read = async {
        while let Ok(n) = client.read_buf(&mut out).await {
            if n == 0 {
                break;
            }
        }
    };
    tokio::time::timeout(within, read)
        .await
        .expect("closed in time");
    out
}
