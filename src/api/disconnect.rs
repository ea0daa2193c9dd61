//! Noticing a client that hung up while its request is still being computed.
//!
//! actix-web drops a handler's future, or a streaming body, only once a write to the socket
//! fails (actix/actix-web#1313). A non-streaming request writes nothing until it is done, and a
//! streaming one writes nothing during its prefill (or only a keep-alive comment every few
//! seconds), so a client that gave up would keep its sequence running — and its session busy —
//! to the end. Instead each connection's socket is noted when it opens ([`on_connect`]), and a
//! request waiting on the engine peeks at it every [`POLL`] ([`Peer::hung_up`]): a peer that
//! closed its end reads as end-of-file. Dropping the request's engine stream then cancels the
//! sequence at the scheduler's next step, as the engine promises.
//!
//! A client that half-closes (shuts down its sending side) and still waits for the answer is
//! taken for gone, as uvicorn (vLLM) and llama.cpp's server take it; HTTP clients do not do this.

use actix_web::dev::Extensions;
use actix_web::HttpRequest;
use std::any::Any;
use std::time::Duration;

/// How often a waiting request looks at its socket.
pub const POLL: Duration = Duration::from_millis(50);

/// A request's connection, as far as hanging up goes.
#[derive(Debug, Clone, Copy)]
pub struct Peer {
    #[cfg(unix)]
    fd: Option<std::os::fd::RawFd>,
}

/// The socket of a connection, noted in its extensions when it opens.
#[cfg(unix)]
#[derive(Debug, Clone, Copy)]
struct Socket(std::os::fd::RawFd);

/// `HttpServer::on_connect` hook: notes the connection's socket.
pub fn on_connect(connection: &dyn Any, data: &mut Extensions) {
    #[cfg(unix)]
    if let Some(socket) = connection.downcast_ref::<actix_web::rt::net::TcpStream>() {
        use std::os::fd::AsRawFd;
        data.insert(Socket(socket.as_raw_fd()));
    }
    #[cfg(not(unix))]
    let _ = (connection, data);
}

impl Peer {
    /// The peer of `req`'s connection (one that cannot be watched where the socket is unknown).
    pub fn of(req: &HttpRequest) -> Peer {
        Peer {
            #[cfg(unix)]
            fd: req.conn_data::<Socket>().map(|s| s.0),
        }
    }

    /// Resolves once the client has closed the connection; never where that cannot be seen.
    ///
    /// Only to be awaited while the connection serves the request: actix-web keeps the socket
    /// open until the handler's future (or its streaming body, which this is part of) is
    /// dropped, so the descriptor cannot have been closed and reused meanwhile.
    pub async fn hung_up(self) {
        #[cfg(unix)]
        if let Some(fd) = self.fd {
            let mut tick = tokio::time::interval(POLL);
            loop {
                tick.tick().await;
                if closed_by_peer(fd) {
                    return;
                }
            }
        }
        std::future::pending::<()>().await
    }
}

/// Whether reading `fd` would give end-of-file or a connection error (peeked: nothing is
/// consumed, and bytes of a pipelined request leave it open).
#[cfg(unix)]
fn closed_by_peer(fd: std::os::fd::RawFd) -> bool {
    let mut byte = 0u8;
    // SAFETY: one byte into a live local; `fd` is a socket the connection still owns (see
    // `Peer::hung_up`); MSG_DONTWAIT keeps the call from blocking.
    let n = unsafe {
        libc::recv(
            fd,
            (&mut byte as *mut u8).cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    if n >= 0 {
        return n == 0;
    }
    let err = std::io::Error::last_os_error().raw_os_error();
    !matches!(err, Some(libc::EAGAIN | libc::EINTR)) && err != Some(libc::EWOULDBLOCK)
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsRawFd;

    #[test]
    fn a_closed_peer_reads_as_hung_up_and_an_open_one_does_not() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        let fd = server.as_raw_fd();
        assert!(!closed_by_peer(fd), "an idle open connection");
        // Unread bytes (a pipelined request) leave it open, and stay unread.
        client.write_all(b"GET / HTTP/1.1\r\n").unwrap();
        assert!(eventually(|| has_bytes(fd)));
        assert!(!closed_by_peer(fd), "unread bytes");
        let mut read = [0u8; 64];
        let n = std::io::Read::read(&mut &server, &mut read).unwrap();
        assert_eq!(&read[..n], b"GET / HTTP/1.1\r\n");
        drop(client);
        assert!(eventually(|| closed_by_peer(fd)), "after the client closed");
    }

    /// Whether `f` holds within a bounded number of tries (loopback delivers at once; the bound
    /// only keeps a broken case from spinning forever).
    fn eventually(mut f: impl FnMut() -> bool) -> bool {
        (0..100_000).any(|_| {
            std::thread::yield_now();
            f()
        })
    }

    fn has_bytes(fd: std::os::fd::RawFd) -> bool {
        let mut byte = 0u8;
        // SAFETY: as in `closed_by_peer`.
        let n = unsafe {
            libc::recv(
                fd,
                (&mut byte as *mut u8).cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        n > 0
    }
}
