//! The server's side of the handshake: ClientInfo frame → box open → JSON.
//!
//! The server key is the fixed `server` key from testdata/keys.json. `data[0] % 3` picks a mode:
//!
//! 0. raw: the rest is what a client sends first. Whatever the decoder makes of it goes to
//!    [`ServerHandshake::handle_client_info`], whose verdict must match refusing a key whose
//!    X25519 result with the server key is all zeros (a low-order key), else opening the box
//!    and parsing the JSON by hand; success authenticates exactly the claimed key, once.
//! 1. sealed JSON: the rest is ClientInfo JSON, sealed by the `client_a` key to the server.
//!    The server must accept it exactly when [`ClientInfo::from_json`] does, with the same
//!    value; an accepted value then goes round the real client state machine (ServerKey →
//!    ClientInfo → ServerInfo) and comes back equal, and the client accepts the ServerInfo.
//! 2. tampered: the rest is XORed over a valid ClientInfo frame (longer input is appended).
//!    The handshake may only succeed if the key and the sealed box are the original ones.

use std::sync::OnceLock;

use bytes::BytesMut;
use derp_proto::frame::{KEY_LEN, MAX_CLIENT_INFO_LEN};
use derp_proto::{
    ClientDecoder, ClientHandshake, ClientInfo, ClientToRelay, DecodeError, HandshakeError,
    PublicKey, RelayToClient, SecretKey, ServerDecoder, ServerHandshake, ServerInfo,
};

/// `server.private_hex` in testdata/keys.json.
const SERVER_PRIVATE_HEX: &str = "1050eb254dc4ff1e762df3c9944e7960f36440775958a35cea4eb88b130ee34c";
/// `client_a.private_hex` in testdata/keys.json.
const CLIENT_PRIVATE_HEX: &str = "d0453a3a3cf498d231e8b82c22ec897f54718031ec49cbbdfeb4266d59db7c7f";

struct Fixture {
    server: ServerHandshake,
    server_secret: SecretKey,
    client_secret: SecretKey,
    client_public: PublicKey,
    /// A valid ClientInfo frame from the client, and its key and box.
    valid_frame: Vec<u8>,
    valid_sealed: Vec<u8>,
}

fn secret(hex_text: &str) -> SecretKey {
    let mut bytes = [0u8; 32];
    hex::decode_to_slice(hex_text, &mut bytes).expect("fixed key hex");
    SecretKey::from_bytes(bytes)
}

fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let server_secret = secret(SERVER_PRIVATE_HEX);
        let client_secret = secret(CLIENT_PRIVATE_HEX);
        let client_public = client_secret.public_key();
        let server = ServerHandshake::new(server_secret.clone());
        let valid_sealed = client_secret.seal_to(
            &server.public_key(),
            &[7; 24],
            br#"{"version":2,"CanAckPings":true}"#,
        );
        let mut valid_frame = Vec::new();
        ClientToRelay::ClientInfo {
            key: client_public,
            sealed: valid_sealed.clone().into(),
        }
        .encode(&mut valid_frame);
        Fixture {
            server,
            server_secret,
            client_secret,
            client_public,
            valid_frame,
            valid_sealed,
        }
    })
}

/// Decodes the first frame a fresh server connection reads from `bytes`.
fn first_client_frame(bytes: &[u8]) -> Result<Option<ClientToRelay>, DecodeError> {
    let mut buf = BytesMut::from(bytes);
    let msg = ServerDecoder::new().decode(&mut buf)?;
    if let Some(msg) = &msg {
        assert!(
            matches!(msg, ClientToRelay::ClientInfo { .. }),
            "a new connection decoded {msg:?} first"
        );
    }
    Ok(msg)
}

/// Runs the server step on a decoded ClientInfo and checks it against a by-hand open+parse.
fn server_step(key: PublicKey, sealed: &[u8]) -> Result<ClientInfo, HandshakeError> {
    let fx = fixture();
    let mut server = fx.server.clone();
    let result = server.handle_client_info(key, sealed);
    let by_hand = if fx.server_secret.shared_secret(&key) == [0; 32] {
        Err(HandshakeError::LowOrderKey)
    } else {
        fx.server_secret
            .open_from(&key, sealed)
            .map_err(HandshakeError::from)
            .and_then(|json| ClientInfo::from_json(&json).map_err(HandshakeError::from))
    };
    assert_eq!(
        result, by_hand,
        "handshake verdict differs from the low-order check + open + parse"
    );
    match &result {
        Ok(_) => {
            assert_eq!(server.client_key(), Some(key));
            assert_eq!(
                server.handle_client_info(key, sealed),
                Err(HandshakeError::OutOfOrder),
                "a second ClientInfo was accepted"
            );
            let mut out = Vec::new();
            server
                .server_info_frame([1; 24], &mut out)
                .expect("ServerInfo after ClientInfo");
        }
        Err(_) => {
            assert_eq!(
                server.client_key(),
                None,
                "failed handshake authenticated a key"
            );
            assert_eq!(
                server.server_info_frame([1; 24], &mut Vec::new()),
                Err(HandshakeError::OutOfOrder)
            );
        }
    }
    result
}

/// Fuzz target.
pub fn server_handshake(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    match mode % 3 {
        0 => raw(rest),
        1 => sealed_json(rest),
        _ => tampered(rest),
    }
}

fn raw(stream: &[u8]) {
    if let Ok(Some(ClientToRelay::ClientInfo { key, sealed })) = first_client_frame(stream) {
        let _ = server_step(key, &sealed);
    }
}

fn sealed_json(plaintext: &[u8]) {
    let fx = fixture();
    let server_key = fx.server.public_key();
    let sealed = fx.client_secret.seal_to(&server_key, &[9; 24], plaintext);
    let mut frame = Vec::new();
    ClientToRelay::ClientInfo {
        key: fx.client_public,
        sealed: sealed.clone().into(),
    }
    .encode(&mut frame);
    let decoded = first_client_frame(&frame);
    if KEY_LEN + sealed.len() > MAX_CLIENT_INFO_LEN {
        assert!(
            matches!(decoded, Err(DecodeError::FrameTooLarge { .. })),
            "{decoded:?}"
        );
        return;
    }
    let Ok(Some(ClientToRelay::ClientInfo { key, sealed: got })) = decoded else {
        panic!("a well-formed ClientInfo frame decoded as {decoded:?}");
    };
    assert_eq!((key, &got[..]), (fx.client_public, &sealed[..]));

    let result = server_step(key, &got);
    assert_eq!(result, ClientInfo::from_json(plaintext).map_err(Into::into));
    let Ok(info) = result else {
        return;
    };

    // The accepted value, sent again by the real client state machine, arrives unchanged.
    let mut client = ClientHandshake::new(fx.client_secret.clone(), info.clone());
    let mut server_key_frame = Vec::new();
    fx.server.server_key_frame(&mut server_key_frame);
    let Ok(Some(RelayToClient::ServerKey(announced))) =
        ClientDecoder::new().decode(&mut BytesMut::from(&server_key_frame[..]))
    else {
        panic!("ServerKey frame does not decode");
    };
    client.handle_server_key(announced).expect("ServerKey step");
    let mut client_info_frame = Vec::new();
    client
        .client_info_frame([3; 24], &mut client_info_frame)
        .expect("ClientInfo step");
    let Ok(Some(ClientToRelay::ClientInfo { key, sealed })) =
        first_client_frame(&client_info_frame)
    else {
        panic!("the client's ClientInfo frame does not decode");
    };
    let mut server = fx.server.clone();
    let again = server.handle_client_info(key, &sealed);
    assert_eq!(
        again.as_ref(),
        Ok(&info),
        "ClientInfo changed on the way round"
    );

    let mut server_info_frame = Vec::new();
    server
        .server_info_frame([5; 24], &mut server_info_frame)
        .expect("ServerInfo step");
    let Ok(Some(RelayToClient::ServerInfo { sealed })) =
        ClientDecoder::new().decode(&mut BytesMut::from(&server_info_frame[..]))
    else {
        panic!("ServerInfo frame does not decode");
    };
    assert_eq!(
        client.handle_server_info(&sealed),
        Ok(ServerInfo::default_server())
    );
    assert!(client.is_done());
}

fn tampered(mask: &[u8]) {
    let fx = fixture();
    let mut frame = fx.valid_frame.clone();
    for (i, m) in mask.iter().enumerate() {
        match frame.get_mut(i) {
            Some(b) => *b ^= m,
            None => frame.push(*m),
        }
    }
    let Ok(Some(ClientToRelay::ClientInfo { key, sealed })) = first_client_frame(&frame) else {
        return;
    };
    if server_step(key, &sealed).is_ok() {
        assert_eq!(
            key, fx.client_public,
            "accepted a ClientInfo under another key"
        );
        assert_eq!(sealed[..], fx.valid_sealed[..], "accepted an altered box");
    }
}
