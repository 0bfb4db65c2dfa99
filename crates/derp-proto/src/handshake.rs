//! Handshake state machines for both sides, driven without IO.
//!
//! The server sends ServerKey, reads ClientInfo, then (after its own admission checks) sends
//! ServerInfo. The client reads ServerKey (unless it fast-starts with a known key), sends
//! ClientInfo, then reads ServerInfo. Callers move the frames; these types only build and
//! check them. Nonces come from the caller, so both sides are deterministic under test.

use bytes::{BufMut, Bytes};

use crate::crypto::{BoxError, BoxKey};
use crate::frame::{ClientToRelay, RelayToClient};
use crate::info::{ClientInfo, InfoError, ServerInfo};
use crate::keys::{KeyPair, PublicKey, SecretKey};

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
    /// The client key is a low-order point: its X25519 shared secret with the server key is
    /// all zeros, so the ClientInfo box proves nothing about who sent it.
    #[error("client key is a low-order point (non-contributory)")]
    LowOrderKey,
}

/// The server side of one connection's handshake.
#[derive(Debug, Clone)]
pub struct ServerHandshake {
    keys: KeyPair,
    /// The authenticated client and the box key shared with it, which also seals ServerInfo
    /// (one Diffie-Hellman per handshake).
    client: Option<(PublicKey, BoxKey)>,
}

impl ServerHandshake {
    /// Starts a handshake expecting the client's ClientInfo. Derives the public key from
    /// `secret`; a server should keep a [`KeyPair`] and use [`ServerHandshake::with_keys`].
    pub fn new(secret: SecretKey) -> Self {
        Self::with_keys(KeyPair::new(secret))
    }

    /// Starts a handshake with the server's keys already derived.
    pub fn with_keys(keys: KeyPair) -> Self {
        Self { keys, client: None }
    }

    /// The server's public key.
    pub fn public_key(&self) -> PublicKey {
        self.keys.public()
    }

    /// Writes the 45-byte ServerKey frame (header, magic, server key).
    pub fn server_key_frame(&self, out: &mut impl BufMut) {
        RelayToClient::ServerKey(self.keys.public()).encode(out);
    }

    /// Opens the ClientInfo box sealed by `key` (the key the client claims) and decodes its
    /// JSON. On success the connection is authenticated as `key`.
    ///
    /// A low-order `key` is refused before the box is opened: with it the shared secret is
    /// zero, so a box that opens would prove nothing (anyone can seal one), and the key would
    /// let a client without any private key register and receive packets. The check reads
    /// the Diffie-Hellman result the box needs anyway, so it costs nothing extra.
    pub fn handle_client_info(
        &mut self,
        key: PublicKey,
        sealed: &[u8],
    ) -> Result<ClientInfo, HandshakeError> {
        if self.client.is_some() {
            return Err(HandshakeError::OutOfOrder);
        }
        let box_key = BoxKey::with_key_pair(&self.keys, &key);
        if !box_key.is_contributory() {
            return Err(HandshakeError::LowOrderKey);
        }
        let json = box_key.open(sealed)?;
        let info = ClientInfo::from_json(&json)?;
        self.client = Some((key, box_key));
        Ok(info)
    }

    /// Writes the ServerInfo frame: exactly `{"version":2}` sealed to the authenticated client
    /// with `nonce`.
    pub fn server_info_frame(
        &self,
        nonce: [u8; 24],
        out: &mut impl BufMut,
    ) -> Result<(), HandshakeError> {
        let (_, box_key) = self.client.as_ref().ok_or(HandshakeError::OutOfOrder)?;
        let sealed = box_key.seal(&nonce, ServerInfo::DEFAULT_SERVER_JSON);
        RelayToClient::ServerInfo {
            sealed: Bytes::from(sealed),
        }
        .encode(out);
        Ok(())
    }

    /// The authenticated client's key, once ClientInfo has been accepted.
    pub fn client_key(&self) -> Option<PublicKey> {
        self.client.as_ref().map(|(key, _)| *key)
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

#[cfg(test)]
mod tests {
    use bytes::BytesMut;

    use super::*;
    use crate::codec::{ClientDecoder, ServerDecoder};
    use crate::keys::MeshKey;

    fn keys() -> (SecretKey, SecretKey) {
        let mut rng = rand::thread_rng();
        (SecretKey::generate(&mut rng), SecretKey::generate(&mut rng))
    }

    fn info() -> ClientInfo {
        ClientInfo {
            mesh_key: Some(MeshKey::from_bytes([0x42; 32])),
            version: 2,
            can_ack_pings: true,
            is_prober: false,
            app_name: "test".to_owned(),
        }
    }

    /// Runs a full handshake through the frame decoders, as the two IO loops would.
    #[test]
    fn full_handshake_through_the_decoders() {
        let (server_secret, client_secret) = keys();
        let mut server = ServerHandshake::new(server_secret.clone());
        let mut client = ClientHandshake::new(client_secret.clone(), info());
        let mut to_client = BytesMut::new();
        let mut to_server = BytesMut::new();
        let mut client_decoder = ClientDecoder::new();
        let mut server_decoder = ServerDecoder::new();

        server.server_key_frame(&mut to_client);
        assert_eq!(to_client.len(), 45);
        let Some(RelayToClient::ServerKey(key)) = client_decoder.decode(&mut to_client).unwrap()
        else {
            panic!("expected ServerKey")
        };
        assert_eq!(key, server_secret.public_key());
        assert_eq!(server.public_key(), key);
        assert_eq!(client.server_key(), None);
        client.handle_server_key(key).unwrap();
        assert_eq!(client.server_key(), Some(key));

        client.client_info_frame([1; 24], &mut to_server).unwrap();
        let Some(ClientToRelay::ClientInfo { key, sealed }) =
            server_decoder.decode(&mut to_server).unwrap()
        else {
            panic!("expected ClientInfo")
        };
        assert_eq!(key, client_secret.public_key());
        assert_eq!(server.client_key(), None);
        assert_eq!(server.handle_client_info(key, &sealed), Ok(info()));
        assert_eq!(server.client_key(), Some(client_secret.public_key()));

        server.server_info_frame([2; 24], &mut to_client).unwrap();
        let Some(RelayToClient::ServerInfo { sealed }) =
            client_decoder.decode(&mut to_client).unwrap()
        else {
            panic!("expected ServerInfo")
        };
        assert!(!client.is_done());
        assert_eq!(
            client.handle_server_info(&sealed),
            Ok(ServerInfo::default_server())
        );
        assert!(client.is_done());
        assert!(to_client.is_empty() && to_server.is_empty());
    }

    #[test]
    fn a_kept_key_pair_makes_the_same_handshake() {
        let (server_secret, client_secret) = keys();
        let mut derived = ServerHandshake::new(server_secret.clone());
        let mut kept = ServerHandshake::with_keys(KeyPair::new(server_secret.clone()));
        assert_eq!(kept.public_key(), server_secret.public_key());
        let (mut a, mut b) = (Vec::new(), Vec::new());
        derived.server_key_frame(&mut a);
        kept.server_key_frame(&mut b);
        assert_eq!(a, b);
        let sealed = client_secret.seal_to(&server_secret.public_key(), &[6; 24], b"{}");
        let client_key = client_secret.public_key();
        assert_eq!(
            derived.handle_client_info(client_key, &sealed),
            kept.handle_client_info(client_key, &sealed)
        );
        let (mut a, mut b) = (Vec::new(), Vec::new());
        derived.server_info_frame([8; 24], &mut a).unwrap();
        kept.server_info_frame([8; 24], &mut b).unwrap();
        assert_eq!(a, b);
        assert_eq!(
            client_secret
                .open_from(&server_secret.public_key(), &b[5..])
                .unwrap(),
            br#"{"version":2}"#
        );
    }

    #[test]
    fn fast_start_ignores_the_later_server_key() {
        let (server_secret, client_secret) = keys();
        let server_key = server_secret.public_key();
        let mut client = ClientHandshake::fast_start(client_secret, info(), server_key);
        assert_eq!(client.server_key(), Some(server_key));
        let mut out = Vec::new();
        client.client_info_frame([0; 24], &mut out).unwrap();
        // The ServerKey the server still sends changes nothing, even a different one.
        client
            .handle_server_key(PublicKey::from_bytes([9; 32]))
            .unwrap();
        assert_eq!(client.server_key(), Some(server_key));

        let mut server = ServerHandshake::new(server_secret);
        let sealed = &out[5 + 32..];
        let key = PublicKey::from_slice(&out[5..37]).unwrap();
        assert_eq!(server.handle_client_info(key, sealed), Ok(info()));
    }

    #[test]
    fn client_steps_out_of_order_are_refused() {
        let (server_secret, client_secret) = keys();
        let mut client = ClientHandshake::new(client_secret, ClientInfo::default());
        let mut out = Vec::new();
        assert_eq!(
            client.client_info_frame([0; 24], &mut out),
            Err(HandshakeError::OutOfOrder)
        );
        assert!(out.is_empty());
        assert_eq!(
            client.handle_server_info(&[0; 64]),
            Err(HandshakeError::OutOfOrder)
        );
        client
            .handle_server_key(server_secret.public_key())
            .unwrap();
        assert_eq!(
            client.handle_server_info(&[0; 64]),
            Err(HandshakeError::OutOfOrder)
        );
        client.client_info_frame([0; 24], &mut out).unwrap();
        // ClientInfo is sent once.
        assert_eq!(
            client.client_info_frame([0; 24], &mut out),
            Err(HandshakeError::OutOfOrder)
        );
    }

    #[test]
    fn client_refuses_bad_server_info() {
        let (server_secret, client_secret) = keys();
        let server_key = server_secret.public_key();
        let client_key = client_secret.public_key();
        let mut client = ClientHandshake::fast_start(client_secret, info(), server_key);
        client.client_info_frame([0; 24], &mut Vec::new()).unwrap();

        assert_eq!(
            client.handle_server_info(&[0; 10]),
            Err(HandshakeError::Box(BoxError::TooShort))
        );
        let forged = SecretKey::from_bytes([7; 32]).seal_to(&client_key, &[0; 24], b"{}");
        assert_eq!(
            client.handle_server_info(&forged),
            Err(HandshakeError::Box(BoxError::Open))
        );
        let not_json = server_secret.seal_to(&client_key, &[0; 24], b"nope");
        assert_eq!(
            client.handle_server_info(&not_json),
            Err(HandshakeError::Info(InfoError::Syntax))
        );
        assert!(!client.is_done());
        let limited = server_secret.seal_to(
            &client_key,
            &[0; 24],
            br#"{"version":2,"TokenBucketBytesPerSecond":100,"TokenBucketBytesBurst":200}"#,
        );
        let got = client.handle_server_info(&limited).unwrap();
        assert_eq!(got.token_bucket_bytes_per_second, 100);
        assert_eq!(got.token_bucket_bytes_burst, 200);
        assert!(client.is_done());
    }

    #[test]
    fn server_refuses_bad_client_info() {
        let (server_secret, client_secret) = keys();
        let server_key = server_secret.public_key();
        let client_key = client_secret.public_key();
        let mut server = ServerHandshake::new(server_secret);
        assert_eq!(
            server.server_info_frame([0; 24], &mut Vec::new()),
            Err(HandshakeError::OutOfOrder)
        );

        let sealed = client_secret.seal_to(&server_key, &[0; 24], b"{}");
        // The claimed key must be the one that sealed the box.
        assert_eq!(
            server.handle_client_info(PublicKey::from_bytes([1; 32]), &sealed),
            Err(HandshakeError::Box(BoxError::Open))
        );
        assert_eq!(
            server.handle_client_info(client_key, &sealed[..39]),
            Err(HandshakeError::Box(BoxError::TooShort))
        );
        let bad_json = client_secret.seal_to(&server_key, &[0; 24], br#"{"meshKey":null}"#);
        assert_eq!(
            server.handle_client_info(client_key, &bad_json),
            Err(HandshakeError::Info(InfoError::InvalidMeshKey))
        );
        assert_eq!(server.client_key(), None);

        assert_eq!(
            server.handle_client_info(client_key, &sealed),
            Ok(ClientInfo::default())
        );
        // A second ClientInfo cannot re-authenticate the connection.
        assert_eq!(
            server.handle_client_info(client_key, &sealed),
            Err(HandshakeError::OutOfOrder)
        );
        let mut out = Vec::new();
        server.server_info_frame([5; 24], &mut out).unwrap();
        assert_eq!(out[0], 0x03);
        assert_eq!(
            client_secret.open_from(&server_key, &out[5..]).unwrap(),
            br#"{"version":2}"#
        );
    }

    #[test]
    fn low_order_client_keys_are_refused() {
        let mut rng = rand::thread_rng();
        let points = derp_testkit::low_order_points();
        assert_eq!(points.len(), 14);
        for point in points {
            let key = PublicKey::from_bytes(point);
            // Whatever secret either side holds, the shared secret is zero, so this box
            // "from" the key is one anyone can make: no private key stands behind it.
            let forger = SecretKey::generate(&mut rng);
            assert_eq!(forger.shared_secret(&key), [0; 32], "{point:02x?}");
            let server_secret = SecretKey::generate(&mut rng);
            assert_eq!(server_secret.shared_secret(&key), [0; 32], "{point:02x?}");
            let sealed = forger.seal_to(&key, &[4; 24], br#"{"version":2,"meshKey":""}"#);
            assert!(
                server_secret.open_from(&key, &sealed).is_ok(),
                "the forged box opens under any key: {point:02x?}"
            );

            let mut server = ServerHandshake::new(server_secret);
            assert_eq!(
                server.handle_client_info(key, &sealed),
                Err(HandshakeError::LowOrderKey),
                "{point:02x?}"
            );
            assert_eq!(server.client_key(), None);
            assert_eq!(
                server.server_info_frame([0; 24], &mut Vec::new()),
                Err(HandshakeError::OutOfOrder)
            );
        }
        // Ordinary keys whose encodings sit next to the refused ones still work.
        let (server_secret, client_secret) = keys();
        let mut server = ServerHandshake::new(server_secret.clone());
        let sealed = client_secret.seal_to(&server_secret.public_key(), &[0; 24], b"{}");
        assert!(
            server
                .handle_client_info(client_secret.public_key(), &sealed)
                .is_ok()
        );
    }
}
