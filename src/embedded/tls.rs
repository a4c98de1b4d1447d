//! Optional TLS: a throw-away CA per server and a serving certificate for 127.0.0.1/localhost.

use std::io;
use std::sync::Arc;

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

pub(super) struct ServingCert {
    pub ca_pem: String,
    pub config: Arc<rustls::ServerConfig>,
}

/// A CA and a certificate for the server `name`; `http2` offers HTTP/2 by ALPN before HTTP/1.1.
pub(super) fn generate(name: &str, http2: bool) -> Result<ServingCert, String> {
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let ca_key = KeyPair::generate().map_err(|e| err(&e))?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).map_err(|e| err(&e))?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, format!("{name}-ca"));
    let ca_cert = ca_params.self_signed(&ca_key).map_err(|e| err(&e))?;
    let issuer = Issuer::new(ca_params, ca_key);

    let key = KeyPair::generate().map_err(|e| err(&e))?;
    let mut params =
        CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()]).map_err(|e| err(&e))?;
    params.distinguished_name.push(DnType::CommonName, name);
    let cert = params.signed_by(&key, &issuer).map_err(|e| err(&e))?;

    let chain = vec![CertificateDer::from(cert.der().to_vec())];
    let private = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| err(&e))?
        .with_no_client_auth()
        .with_single_cert(chain, private)
        .map_err(|e| err(&e))?;
    config.alpn_protocols = if http2 {
        vec![b"h2".to_vec(), b"http/1.1".to_vec()]
    } else {
        vec![b"http/1.1".to_vec()]
    };
    Ok(ServingCert {
        ca_pem: ca_cert.pem(),
        config: Arc::new(config),
    })
}

/// A listener that hands axum connections whose TLS handshake completed. Handshakes run
/// concurrently, each on its own task, so one slow or stalled client never holds up the others.
pub(super) struct TlsListener {
    address: std::net::SocketAddr,
    ready: tokio::sync::mpsc::Receiver<(TlsStream<TcpStream>, std::net::SocketAddr)>,
    closed: tokio_util::sync::CancellationToken,
}

/// How long a client may take to complete its handshake.
const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

impl TlsListener {
    /// Accepts on `listener` until `stop` fires (which also closes the socket, then [`Self::closed`]).
    pub(super) fn new(
        listener: TcpListener,
        acceptor: TlsAcceptor,
        stop: tokio_util::sync::CancellationToken,
    ) -> io::Result<TlsListener> {
        let address = listener.local_addr()?;
        let (sender, ready) = tokio::sync::mpsc::channel(64);
        let closed = tokio_util::sync::CancellationToken::new();
        let closing = closed.clone();
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    _ = stop.cancelled() => {
                        drop(listener);
                        closing.cancel();
                        return;
                    }
                    accepted = listener.accept() => accepted,
                };
                let Ok((stream, addr)) = accepted else {
                    // Transient accept errors (e.g. out of descriptors): back off briefly and retry.
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                    continue;
                };
                // As Go's servers (kube-apiserver's) do on every connection: see `runtime::transport`.
                let _ = stream.set_nodelay(true);
                let (acceptor, sender) = (acceptor.clone(), sender.clone());
                tokio::spawn(async move {
                    // A failed or stalled handshake is that client's problem.
                    if let Ok(Ok(tls)) = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                        let _ = sender.send((tls, addr)).await;
                    }
                });
            }
        });
        Ok(TlsListener { address, ready, closed })
    }

    /// Cancelled once the socket is closed: from then on new connections are refused. A stopping
    /// server tells its open connections (HTTP/2 GOAWAY) only after that, as Go's servers do, so a
    /// client that asks again at once is refused rather than let in and cut off.
    pub(super) fn closed(&self) -> tokio_util::sync::CancellationToken {
        self.closed.clone()
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(connection) => connection,
            // The accept loop stopped: serving is shutting down, so wait for that to finish.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        Ok(self.address)
    }
}
