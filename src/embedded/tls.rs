//! Optional TLS: a throw-away CA per server and a serving certificate for 127.0.0.1/localhost.

use std::io;
use std::sync::Arc;

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

pub struct ServingCert {
    pub ca_pem: String,
    pub config: Arc<rustls::ServerConfig>,
}

pub fn generate(name: &str) -> Result<ServingCert, String> {
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
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| err(&e))?
        .with_no_client_auth()
        .with_single_cert(chain, private)
        .map_err(|e| err(&e))?;
    Ok(ServingCert {
        ca_pem: ca_cert.pem(),
        config: Arc::new(config),
    })
}

/// A listener that completes the TLS handshake before handing the connection to axum.
pub struct TlsListener {
    pub listener: TcpListener,
    pub acceptor: TlsAcceptor,
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let Ok((stream, addr)) = self.listener.accept().await else {
                // Transient accept errors (e.g. out of descriptors): back off briefly and retry.
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                continue;
            };
            // A failed handshake is that client's problem; keep serving others.
            if let Ok(tls) = self.acceptor.accept(stream).await {
                return (tls, addr);
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.listener.local_addr()
    }
}
