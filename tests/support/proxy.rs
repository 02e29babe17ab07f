//! A TCP proxy in front of an emulator, for tests that cut, freeze or block the way to it.

use std::sync::{Arc, Mutex};

/// The proxy's open connections: each one's task, and whether it is frozen.
type Connections = Arc<Mutex<Vec<(tokio::task::AbortHandle, Arc<std::sync::atomic::AtomicBool>)>>>;

/// A TCP proxy in front of an emulator whose connections the test can cut (closed at once) or
/// freeze (kept open, nothing forwarded either way until the client closes its end), and which
/// can refuse new connections (closed as soon as accepted) while blocked.
pub struct Proxy {
    pub url: String,
    connections: Connections,
    accepted: Arc<std::sync::atomic::AtomicUsize>,
    blocked: Arc<std::sync::atomic::AtomicBool>,
    stalled: Arc<std::sync::atomic::AtomicBool>,
}

impl Proxy {
    pub async fn start(upstream: &str) -> Proxy {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        let upstream = upstream
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .to_string();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let connections: Connections = Arc::default();
        let accepted = Arc::new(AtomicUsize::new(0));
        let blocked = Arc::new(AtomicBool::new(false));
        let stalled = Arc::new(AtomicBool::new(false));
        let (conns, count, refuse) = (connections.clone(), accepted.clone(), blocked.clone());
        let stall = stalled.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                if refuse.load(Ordering::SeqCst) {
                    continue; // dropped: closed at once
                }
                if stall.load(Ordering::SeqCst) {
                    // A peer that stopped answering: the connection is held open, what the
                    // client sends is read and dropped, and the emulator never sees it (a
                    // connection left idle there held one of moto's workers and slowed the
                    // tests that came after).
                    let task = tokio::spawn(async move {
                        use tokio::io::AsyncReadExt;
                        let mut client = client;
                        let mut buf = vec![0u8; 64 * 1024];
                        while matches!(client.read(&mut buf).await, Ok(n) if n > 0) {}
                    });
                    let frozen = Arc::new(AtomicBool::new(true));
                    conns.lock().unwrap().push((task.abort_handle(), frozen));
                    continue;
                }
                let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
                    continue;
                };
                let frozen = Arc::new(AtomicBool::new(false));
                let f = frozen.clone();
                let task = tokio::spawn(async move {
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    tokio::select! {
                        _ = pipe(cr, sw, f.clone()) => {}
                        _ = pipe(sr, cw, f) => {}
                    }
                });
                conns.lock().unwrap().push((task.abort_handle(), frozen));
            }
        });
        Proxy {
            url,
            connections,
            accepted,
            blocked,
            stalled,
        }
    }

    /// A DynamoDB client whose requests go through this proxy (the SDK's defaults otherwise).
    pub async fn dynamodb(&self) -> aws_sdk_dynamodb::Client {
        let config = aws_config::defaults(aws_config::BehaviorVersion::latest())
            .load()
            .await;
        aws_sdk_dynamodb::Client::from_conf(
            aws_sdk_dynamodb::config::Builder::from(&config)
                .endpoint_url(&self.url)
                .build(),
        )
    }

    /// A Kinesis client whose requests go through this proxy.
    pub async fn client(&self) -> aws_sdk_kinesis::Client {
        let config = aws_config::defaults(aws_config::BehaviorVersion::latest())
            .load()
            .await;
        aws_sdk_kinesis::Client::from_conf(
            aws_sdk_kinesis::config::Builder::from(&config)
                .endpoint_url(&self.url)
                .build(),
        )
    }

    /// Closes every connection open now.
    pub fn cut(&self) {
        for (task, _) in self.connections.lock().unwrap().drain(..) {
            task.abort();
        }
    }

    /// Stops forwarding on every connection open now.
    pub fn freeze(&self) {
        for (_, frozen) in self.connections.lock().unwrap().iter() {
            frozen.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }

    /// A peer that stopped answering: every connection open now is frozen, and every new one is
    /// accepted and held without reaching the emulator; nothing is forwarded either way.
    pub fn stall(&self) {
        self.stalled
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.freeze();
    }

    /// Closes every connection open now and every new one until [`unblock`](Self::unblock): the
    /// emulator is unreachable.
    pub fn block(&self) {
        self.blocked
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.cut();
    }

    /// Forwards new connections again.
    pub fn unblock(&self) {
        self.blocked
            .store(false, std::sync::atomic::Ordering::SeqCst);
    }

    pub fn accepted(&self) -> usize {
        self.accepted.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// Copies `from` to `to` until either closes; frozen, it reads and drops.
pub async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    frozen: Arc<std::sync::atomic::AtomicBool>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if frozen.load(std::sync::atomic::Ordering::SeqCst) {
            continue;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
