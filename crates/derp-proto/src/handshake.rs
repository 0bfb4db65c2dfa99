//! Handshake state machines for both sides, driven without IO.
//!
//! The server sends ServerKey, reads ClientInfo, then (after its own admission checks) sends
//! ServerInfo. The client reads ServerKey (unless it fast-starts with a known key), sends
//! ClientInfo, then reads ServerInfo. Callers move the frames; these types only build and
//! check them. Nonces come from the caller, so both sides are deterministic under test.

use bytes::{BufMut, Bytes};

use crate::crypto::BoxError;
use crate::frame::{ClientToRelay, RelayToClient};
use crate::info::{ClientInfo, InfoError, ServerInfo};
use crate::keys::{PublicKey, SecretKey};

/// Why a handshake step failed. On the server, any of these means: close without replying.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HandshakeError {
    /// The box did not open (wrong key, tampering, or too short).
    #[error("handshake box: {0}")]
    Box(#[from] BoxError),
    /// The JSON inside the box was refused.
    #[error("handshake JSON: {0}")]
    Info(#[from] InfoError),
    /// A step was taken in the wrong state.
    #[error("handshake step out of order")]
    OutOfOrder,
}

/// The server side of one connection's handshake.
#[derive(Debug, Clone)]
pub struct ServerHandshake {
    secret: SecretKey,
    public: PublicKey,
    client: Option<PublicKey>,
}

impl ServerHandshake {
    /// Starts a handshake expecting the client's ClientInfo.
    pub fn new(secret: SecretKey) -> Self {
        let public = secret.public_key();
        Self {
            secret,
            public,
            client: None,
        }
    }

    /// The server's public key.
    pub fn public_key(&self) -> PublicKey {
        self.public
    }

    /// Writes the 45-byte ServerKey frame (header, magic, server key).
    pub fn server_key_frame(&self, out: &mut impl BufMut) {
        RelayToClient::ServerKey(self.public).encode(out);
    }

    /// Opens the ClientInfo box sealed by `key` (the key the client claims) and decodes its
    /// JSON. On success the connection is authenticated as `key`.
    pub fn handle_client_info(
        &mut self,
        key: PublicKey,
        sealed: &[u8],
    ) -> Result<ClientInfo, HandshakeError> {
        if self.client.is_some() {
            return Err(HandshakeError::OutOfOrder);
        }
        let json = self.secret.open_from(&key, sealed)?;
        let info = ClientInfo::from_json(&json)?;
        self.client = Some(key);
        Ok(info)
    }

    /// Writes the ServerInfo frame: exactly `{"version":2}` sealed to the authenticated client
    /// with `nonce`.
    pub fn server_info_frame(
        &self,
        nonce: [u8; 24],
        out: &mut impl BufMut,
    ) -> Result<(), HandshakeError> {
        let client = self.client.ok_or(HandshakeError::OutOfOrder)?;
        let json = ServerInfo::default_server().to_json();
        let sealed = self.secret.seal_to(&client, &nonce, &json);
        RelayToClient::ServerInfo {
            sealed: Bytes::from(sealed),
        }
        .encode(out);
        Ok(())
    }

    /// The authenticated client's key, once ClientInfo has been accepted.
    pub fn client_key(&self) -> Option<PublicKey> {
        self.client
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ClientState {
    ExpectServerKey,
    SendClientInfo,
    ExpectServerInfo,
    Done,
}

/// The client side of a handshake.
#[derive(Debug, Clone)]
pub struct ClientHandshake {
    secret: SecretKey,
    info: ClientInfo,
    server_key: Option<PublicKey>,
    state: ClientState,
}

impl ClientHandshake {
    /// Starts a handshake that waits for the server's ServerKey frame.
    pub fn new(secret: SecretKey, info: ClientInfo) -> Self {
        Self {
            secret,
            info,
            server_key: None,
            state: ClientState::ExpectServerKey,
        }
    }

    /// Starts a handshake with the server key already known (from the TLS meta certificate),
    /// so ClientInfo can be sent at once. The ServerKey frame the server still sends is then
    /// ignored by [`ClientHandshake::handle_server_key`].
    pub fn fast_start(secret: SecretKey, info: ClientInfo, server_key: PublicKey) -> Self {
        Self {
            secret,
            info,
            server_key: Some(server_key),
            state: ClientState::SendClientInfo,
        }
    }

    /// Records the key from the ServerKey frame. Ignored if the key is already known.
    pub fn handle_server_key(&mut self, key: PublicKey) -> Result<(), HandshakeError> {
        if self.server_key.is_none() {
            self.server_key = Some(key);
            self.state = ClientState::SendClientInfo;
        }
        Ok(())
    }

    /// Writes the ClientInfo frame sealed to the server with `nonce`. Requires the server key.
    pub fn client_info_frame(
        &mut self,
        nonce: [u8; 24],
        out: &mut impl BufMut,
    ) -> Result<(), HandshakeError> {
        let (ClientState::SendClientInfo, Some(server_key)) = (self.state, self.server_key) else {
            return Err(HandshakeError::OutOfOrder);
        };
        let sealed = self
            .secret
            .seal_to(&server_key, &nonce, &self.info.to_json());
        ClientToRelay::ClientInfo {
            key: self.secret.public_key(),
            sealed: Bytes::from(sealed),
        }
        .encode(out);
        self.state = ClientState::ExpectServerInfo;
        Ok(())
    }

    /// Opens and decodes the ServerInfo box; completes the handshake.
    pub fn handle_server_info(&mut self, sealed: &[u8]) -> Result<ServerInfo, HandshakeError> {
        let (ClientState::ExpectServerInfo, Some(server_key)) = (self.state, self.server_key)
        else {
            return Err(HandshakeError::OutOfOrder);
        };
        let json = self.secret.open_from(&server_key, sealed)?;
        let info = ServerInfo::from_json(&json)?;
        self.state = ClientState::Done;
        Ok(info)
    }

    /// The server's key, once known.
    pub fn server_key(&self) -> Option<PublicKey> {
        self.server_key
    }

    /// Whether ServerInfo has been accepted.
    pub fn is_done(&self) -> bool {
        self.state == ClientState::Done
    }
}
