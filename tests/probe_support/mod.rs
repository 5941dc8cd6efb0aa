//! Test servers for the probe tests: real listeners on 127.0.0.1:0 with a minimal hand-written
//! HTTP/1.1 responder (read the request head up to `\r\n\r\n`, write one fixed response, close),
//! optionally behind rustls, plus a throw-away PKI made with rcgen.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::task::{JoinHandle, JoinSet};
use tokio_rustls::TlsAcceptor;

/// What the server answers to one request.
#[derive(Debug, Clone)]
pub enum Reply {
    /// This status with a tiny body (none for 204/304).
    Status(u16),
    /// This 3xx status with a `Location` header.
    Redirect(u16, String),
    /// Read the request, then never answer (the connection stays open).
    Stall,
}

/// Decides the reply from the request path and the server's own port.
pub type Handler = Arc<dyn Fn(&str, u16) -> Reply + Send + Sync>;

pub struct TestServer {
    pub addr: SocketAddr,
    requests: Arc<Mutex<Vec<String>>>,
    task: JoinHandle<()>,
}

impl TestServer {
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    pub fn http_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub fn https_url(&self, path: &str) -> String {
        format!("https://{}{path}", self.addr)
    }

    /// The request heads received so far (request line and headers).
    pub fn requests(&self) -> Vec<String> {
        self.requests.lock().unwrap().clone()
    }

    pub fn paths(&self) -> Vec<String> {
        self.requests().iter().filter_map(|head| head.split(' ').nth(1).map(str::to_string)).collect()
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        // Dropping the accept task drops its JoinSet, which aborts every connection task.
        self.task.abort();
    }
}

/// Plain HTTP server. The listener is bound before this returns, so it can be probed at once.
pub async fn serve_http(handler: impl Fn(&str, u16) -> Reply + Send + Sync + 'static) -> TestServer {
    serve(Arc::new(handler), None).await
}

/// HTTPS server with the given rustls config.
pub async fn serve_https(
    config: Arc<ServerConfig>,
    handler: impl Fn(&str, u16) -> Reply + Send + Sync + 'static,
) -> TestServer {
    serve(Arc::new(handler), Some(TlsAcceptor::from(config))).await
}

async fn serve(handler: Handler, tls: Option<TlsAcceptor>) -> TestServer {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let requests = Arc::new(Mutex::new(Vec::new()));
    let log = requests.clone();
    let task = tokio::spawn(async move {
        let mut connections = JoinSet::new();
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let handler = handler.clone();
            let log = log.clone();
            let tls = tls.clone();
            connections.spawn(async move {
                match tls {
                    None => handle(stream, &handler, &log, addr.port()).await,
                    Some(acceptor) => {
                        // A failed handshake (e.g. no client certificate) just drops the stream.
                        if let Ok(stream) = acceptor.accept(stream).await {
                            handle(stream, &handler, &log, addr.port()).await;
                        }
                    }
                }
            });
            // Reap finished connection tasks so the set does not grow.
            while connections.try_join_next().is_some() {}
        }
    });
    TestServer { addr, requests, task }
}

async fn handle<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    handler: &Handler,
    log: &Mutex<Vec<String>>,
    port: u16,
) {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
        if head.len() > 64 * 1024 {
            return;
        }
    }
    let head = String::from_utf8_lossy(&head).into_owned();
    let path = head.split(' ').nth(1).unwrap_or("/").to_string();
    log.lock().unwrap().push(head);
    let response = match handler(&path, port) {
        Reply::Stall => {
            // Keep the connection open without answering until the server is dropped.
            std::future::pending::<()>().await;
            return;
        }
        Reply::Status(code @ (204 | 304)) => {
            format!("HTTP/1.1 {code} X\r\nConnection: close\r\n\r\n")
        }
        Reply::Status(code) => {
            format!("HTTP/1.1 {code} X\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        }
        Reply::Redirect(code, location) => {
            format!("HTTP/1.1 {code} X\r\nLocation: {location}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        }
    };
    let _ = stream.write_all(response.as_bytes()).await;
    let _ = stream.shutdown().await;
}

/// A temporary directory removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new() -> Self {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "nodeplan-probe-test-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    pub fn write(&self, name: &str, contents: &str) -> String {
        let path = self.0.join(name);
        std::fs::write(&path, contents).unwrap();
        path.to_string_lossy().into_owned()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A test CA, a server certificate for 127.0.0.1/localhost and a client certificate, all
/// signed by the CA; the CA and the client pair are also written as PEM files.
pub struct Pki {
    pub dir: TempDir,
    pub ca_pem_path: String,
    pub client_cert_path: String,
    pub client_key_path: String,
    ca_der: CertificateDer<'static>,
    server_cert_der: CertificateDer<'static>,
    server_key_der: Vec<u8>,
}

impl Pki {
    pub fn new() -> Self {
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.distinguished_name.push(DnType::CommonName, "nodeplan probe test CA");
        ca_params.key_usages =
            vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();

        let server_key = KeyPair::generate().unwrap();
        let mut server_params = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()]).unwrap();
        server_params.distinguished_name.push(DnType::CommonName, "127.0.0.1");
        server_params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let server_cert = server_params.signed_by(&server_key, &ca).unwrap();

        let client_key = KeyPair::generate().unwrap();
        let mut client_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        client_params.distinguished_name.push(DnType::CommonName, "system:probe");
        client_params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let client_cert = client_params.signed_by(&client_key, &ca).unwrap();

        let dir = TempDir::new();
        Pki {
            ca_pem_path: dir.write("ca.pem", &ca.pem()),
            client_cert_path: dir.write("client.crt", &client_cert.pem()),
            client_key_path: dir.write("client.key", &client_key.serialize_pem()),
            dir,
            ca_der: ca.der().clone(),
            server_cert_der: server_cert.der().clone(),
            server_key_der: server_key.serialize_der(),
        }
    }

    /// rustls server config; with `require_client_cert`, clients must present a certificate
    /// signed by the test CA.
    pub fn server_config(&self, require_client_cert: bool) -> Arc<ServerConfig> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder =
            ServerConfig::builder_with_provider(provider.clone()).with_safe_default_protocol_versions().unwrap();
        let builder = if require_client_cert {
            let mut roots = RootCertStore::empty();
            roots.add(self.ca_der.clone()).unwrap();
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider).build().unwrap();
            builder.with_client_cert_verifier(verifier)
        } else {
            builder.with_no_client_auth()
        };
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.server_key_der.clone()));
        Arc::new(builder.with_single_cert(vec![self.server_cert_der.clone()], key).unwrap())
    }
}
